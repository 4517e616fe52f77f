//! The one integration-test binary (fewer link steps): one module per area.

mod cleanup_cli;
mod conntrack_real;
mod daemon_assembly;
mod daemon_cli;
mod daemon_e2e;
mod docs_reference;
mod e2e_events;
mod e2e_faults;
mod e2e_scale;
mod e2e_trace;
mod e2e_traffic;
mod e2e_versions;
mod events;
mod golden;
mod image;
mod iptables_real;
mod k8s_events;
mod k8s_watch;
mod partial_sync;
mod render_cli;
mod render_restore;
mod support;
mod sync_loop_real;
mod trace_cli;
mod trace_flows;
mod upstream_rules;
