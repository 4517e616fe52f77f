//! `EndpointInfo`: one endpoint (address and port) of one service port, with the conditions
//! and topology the proxier uses to choose endpoints.

use std::collections::BTreeSet;
use std::sync::Arc;

/// One endpoint of a service port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndpointInfo {
    /// `ip:port` (`[ip]:port` for IPv6): the DNAT target and the hash input of the chain name.
    pub endpoint: String,
    /// The IP alone, as written after `-s` in the hairpin rule.
    pub ip: String,
    pub port: i32,
    /// The endpoint's nodeName equals this node's name.
    pub is_local: bool,
    pub ready: bool,
    pub serving: bool,
    pub terminating: bool,
    /// Zones from `hints.forZones`; empty when the endpoint has no hints.
    pub zone_hints: BTreeSet<String>,
    /// KUBE-SEP- chain for this endpoint of this service port.
    pub chain_name: String,
}

pub type EndpointRef = Arc<EndpointInfo>;
