//! The one integration-test binary (fewer link steps): one module per area.

mod support;
mod upstream_rules;
mod partial_sync;
