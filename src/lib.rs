//! kube-proxy-rs: a drop-in replacement for Kubernetes kube-proxy in iptables mode.
//!
//! Data flows one way:
//!
//! ```text
//! API objects ──▶ tracker (record changes) ──▶ proxier (render, pure) ──▶ iptables ──▶ kernel
//! ```
//!
//! Start reading at [`proxier::render`], which turns service and endpoint maps into the exact
//! `iptables-restore` input upstream kube-proxy writes; [`tracker`] turns Services and
//! EndpointSlices into those maps; [`model`] holds the compact per-port and per-endpoint
//! records; [`iptables`] is the only place that knows how rules reach the kernel, and [`exec`]
//! the only place that starts processes. [`runner`] paces syncs; [`cleanup`] is `--cleanup`; [`serve`] holds the HTTP servers
//! on the node network (health, metrics, health-check node ports).
//! [`cmd`] holds the commands besides the daemon (`render`, `trace`, `diff`); [`trace`] is the
//! packet tracer they and the tests share. [`cli`] parses upstream's flags, [`options`] merges them with the `--config` file
//! ([`config`]) the way upstream does, and [`config_watch`] notices when that file changes.

pub mod app;
pub mod capabilities;
pub mod cleanup;
pub mod cli;
pub mod cmd;
pub mod compat;
pub mod config;
pub mod config_watch;
pub mod conntrack;
pub mod daemon;
pub mod events;
pub mod exec;
pub mod fd_limit;
pub mod iptables;
pub mod k8s;
pub mod manifest;
pub mod metrics;
pub mod model;
pub mod nfacct;
pub mod oom;
pub mod options;
pub mod proxier;
pub mod runner;
pub mod serve;
pub mod sync_loop;
pub mod synthetic;
pub mod sysctl;
pub mod trace;
pub mod tracker;
