//! Change tracking: turns Service and EndpointSlice events into the service and endpoint
//! maps the proxier renders from (upstream `pkg/proxy`'s change trackers).
//!
//! Event handlers record through a proxier's [`ChangeRecorder`] (the trackers behind their
//! own short lock: [`ServiceChangeTracker::record`],
//! [`EndpointChangeTracker::endpoint_slice_update`], node labels). A sync drains it
//! ([`ChangeRecorder::drain`]) and applies the changes with [`ServicePortMap::apply`] and
//! [`EndpointsMap::apply`] without holding that lock, learning what changed, then
//! [`topology::categorize_endpoints`] per service port chooses endpoints. Nothing here does I/O or
//! waits for a sync.

pub mod endpoint_slice_cache;
pub mod endpoints;
pub mod endpoints_map;
pub mod recorder;
pub mod service;
pub mod topology;

/// Fixture builders for tests here and in `tests/` (the `testing` feature).
#[cfg(any(test, feature = "testing"))]
pub mod testing;

pub use endpoint_slice_cache::InvalidEndpointSlice;
pub(crate) use endpoint_slice_cache::LABEL_SERVICE_NAME;
pub use endpoints::EndpointChangeTracker;
pub(crate) use endpoints::EndpointChanges;
pub(crate) use endpoints_map::LocalReadyEndpoints;
pub use endpoints_map::{EndpointsMap, EndpointsUpdateResult, ServiceEndpoint};
pub(crate) use recorder::ChangeObserver;
pub use recorder::ChangeRecorder;
pub(crate) use service::{HealthCheckNodePorts, ServiceChanges};
pub use service::{ServiceChangeTracker, ServicePortMap, ServiceUpdateResult};
