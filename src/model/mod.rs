//! The domain model: names, addresses, service ports, endpoints and the chain names derived
//! from them. Pure data, no I/O.

pub mod chains;
pub mod endpoint;
pub mod ip;
pub mod names;
pub mod node;
pub mod service;

pub(crate) use endpoint::{EndpointInfo, EndpointRef, NodeHints};
pub use ip::Cidr;
pub use names::{IpFamily, NamespacedName, Protocol, ServicePortName};
pub use service::InvalidService;
pub(crate) use service::{ServicePortInfo, ServicePortRef, service_ports, skipped_addresses};
