//! The one integration-test binary (fewer link steps): one module per area.

mod iptables_real;
mod partial_sync;
mod support;
mod upstream_rules;
