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
//! records and the chain names; [`iptables`] is the only place that knows how rules reach the
//! kernel, and [`exec`] the only place that starts processes.
//!
//! The modules by role, each layer using only the ones above it (`tests/architecture.rs`
//! fails the build when a `use crate::` edge points the other way, or when the submodules of
//! one folder import each other in a cycle):
//!
//! | layer | modules | role |
//! |---|---|---|
//! | 0 | [`exec`], [`compat`], [`time`] | leaves: starting processes, the emulated upstream release, deadline arithmetic |
//! | 1 | [`model`] | names, addresses, service ports, endpoints, chain names; pure data |
//! | 2 | [`tracker`], [`iptables`], [`nftables`], [`config`] | change tracking; rules to the kernel (iptables mode, nftables mode); the configuration and its file |
//! | 3 | [`node`] | the node's other side effects: sysctls, conntrack, nfacct, OOM score, open-file limit, capabilities |
//! | 4 | [`proxier`] | render and sync (upstream `syncProxyRules`), `--cleanup` |
//! | 5 | [`metrics`], [`trace`], [`manifest`], [`synthetic`] | the metric registry; the packet tracer; YAML manifests; synthetic clusters |
//! | 6 | [`serve`] | the HTTP servers on the node network (health, metrics, health-check node ports) |
//! | 7 | [`k8s`] | the API server side: client, watches, lists, events |
//! | 8 | [`daemon`] | assembly, sync loops and their pacing, task supervision, the composition root |
//! | 9 | [`cmd`] | what a user invokes: flags, `render`, `trace`, `diff` |
//!
//! Locking: each family's change recorder (in [`tracker`]) sits behind its own short lock
//! that watch handlers take to record a change and a sync takes to drain them; the proxier
//! itself is owned by its family's sync loop (behind a lock only the loop, the post-sync hook
//! and start-up take), so nothing on the async runtime ever waits for a sync.

pub mod cmd;
pub mod compat;
pub mod config;
pub mod daemon;
pub mod exec;
pub mod iptables;
pub mod k8s;
pub mod manifest;
pub mod metrics;
pub mod model;
pub mod nftables;
pub mod node;
pub mod proxier;
pub mod serve;
pub mod synthetic;
pub mod time;
pub mod trace;
pub mod tracker;
