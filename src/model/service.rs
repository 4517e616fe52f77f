//! `ServicePortInfo`: what the proxier needs to know about one port of one Service for one
//! IP family, extracted once from the v1 Service and kept compact (no API objects retained).

use std::sync::Arc;

use super::ip::Cidr;
use super::names::{Protocol, ServicePortName};
use crate::proxier::chains::ServiceChainNames;

/// One entry of `loadBalancerSourceRanges` (spec field or annotation), as written in rules.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SourceRange {
    /// The text written after `-s` in the firewall chain.
    pub text: String,
    /// Parsed network, used to decide whether the node itself is allowed.
    pub cidr: Option<Cidr>,
}

/// One port of a Service, for the IP family being rendered.
///
/// Addresses are kept in Go's canonical text form because that is how they are written into
/// rules; they are validated when the port is built.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServicePortInfo {
    pub name: ServicePortName,
    /// `ns/name:port` (upstream `svcPortNameString`), used in comments and hashes.
    pub name_string: String,
    pub cluster_ip: String,
    pub port: i32,
    pub protocol: Protocol,
    /// 0 when the port has no node port.
    pub node_port: i32,
    /// External IPs of this family.
    pub external_ips: Vec<String>,
    /// Load-balancer ingress IPs of this family.
    pub load_balancer_ips: Vec<String>,
    pub load_balancer_source_ranges: Vec<SourceRange>,
    /// `Some(seconds)` when session affinity is ClientIP.
    pub sticky_seconds: Option<i32>,
    pub external_policy_local: bool,
    pub internal_policy_local: bool,
    /// 0 when none.
    pub health_check_node_port: i32,
    /// Whether topology hints may be used (`service.kubernetes.io/topology-mode` or the
    /// deprecated `topology-aware-hints` annotation says Auto).
    pub hints_enabled: bool,
    pub chains: ServiceChainNames,
}

impl ServicePortInfo {
    /// Whether NodePort, external IP or load-balancer traffic can reach this port.
    pub fn externally_accessible(&self) -> bool {
        self.node_port != 0 || !self.load_balancer_ips.is_empty() || !self.external_ips.is_empty()
    }

    /// Whether any traffic to this port uses the "Cluster" endpoint set.
    pub fn uses_cluster_endpoints(&self) -> bool {
        // External traffic needs the Cluster set even with Local policy: pod and host traffic
        // to external destinations is short-circuited to it.
        !self.internal_policy_local || self.externally_accessible()
    }

    /// Whether any traffic to this port uses the "Local" endpoint set.
    pub fn uses_local_endpoints(&self) -> bool {
        self.internal_policy_local || (self.externally_accessible() && self.external_policy_local)
    }
}

/// Shared, immutable service port entries: the maps hand out clones of the `Arc`.
pub type ServicePortRef = Arc<ServicePortInfo>;
