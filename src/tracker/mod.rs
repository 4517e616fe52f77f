//! Change tracking: turns Service and EndpointSlice events into the service and endpoint
//! maps the proxier renders from (upstream `pkg/proxy`'s change trackers).
//!
//! Event handlers call [`ServiceChangeTracker::update`] and
//! [`EndpointChangeTracker::endpoint_slice_update`], which only record. A sync then calls
//! [`ServicePortMap::update`] and [`EndpointsMap::update`] to apply everything recorded and
//! learn what changed, and [`categorize_endpoints`] per service port to choose endpoints.
//! Nothing here does I/O or blocks; callers hold whatever lock they need around it.

pub mod endpoint_slice_cache;
pub mod endpoints;
pub mod service;
pub mod topology;

#[cfg(test)]
pub(crate) mod testing;

pub use endpoint_slice_cache::{EndpointSliceCache, InvalidEndpointSlice, LABEL_SERVICE_NAME};
pub use endpoints::{EndpointChangeTracker, EndpointsMap, EndpointsUpdateResult, LocalReadyEndpoints, ServiceEndpoint};
pub use service::{HealthCheckNodePorts, ServiceChangeTracker, ServicePortMap, ServiceUpdateResult};
pub use topology::{Categorized, LABEL_TOPOLOGY_ZONE, categorize_endpoints};
