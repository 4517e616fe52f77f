//! `EndpointInfo`: one endpoint (address and port) of one service port, with the conditions
//! and topology the proxier uses to choose endpoints.
//!
//! Built by the tracker's EndpointSlice cache; this module only knows how to name an
//! endpoint (its `ip:port` string and KUBE-SEP chain), never how to read API objects.

use std::collections::BTreeSet;
use std::sync::Arc;

use super::ip::join_host_port;
use super::names::ServicePortName;
use crate::model::chains::{ChainKey, ChainName, chain_key, chain_name, endpoint_chain_name};

/// One endpoint of a service port.
///
/// There is one of these per endpoint and service port, shared (behind [`EndpointRef`])
/// by the EndpointSlice cache and the endpoints map, so it holds no text that can be derived:
/// the IP is part of `endpoint` and the chain name is spelled out from `chain_key`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndpointInfo {
    /// `ip:port` (`[ip]:port` for IPv6) with the address as written in the EndpointSlice:
    /// the DNAT target and the hash input of the chain name.
    pub endpoint: String,
    pub port: i32,
    /// The endpoint's nodeName equals this node's name.
    pub is_local: bool,
    pub ready: bool,
    pub serving: bool,
    pub terminating: bool,
    /// Zones from `hints.forZones`; empty when the endpoint has no hints.
    pub zone_hints: BTreeSet<String>,
    /// What `hints.forNodes` says about this node.
    pub node_hints: NodeHints,
    /// [`ChainKey`] of this endpoint's KUBE-SEP- chain (see [`EndpointInfo::chain_name`]).
    pub chain_key: ChainKey,
}

/// An endpoint's `hints.forNodes` as the proxier needs it: only whether this node is named
/// matters (the node's name is fixed for the life of the process), so a byte instead of a
/// set of names per endpoint.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum NodeHints {
    /// No node hints.
    #[default]
    None,
    /// Hinted for this node (among others, maybe).
    ThisNode,
    /// Hinted only for other nodes.
    OtherNodes,
}

impl EndpointInfo {
    /// An endpoint of `service_port` at `ip` and `port`, with `endpoint` and the chain
    /// derived from them (`ip` is taken as the text to write). Conditions start as a plain
    /// ready remote endpoint (ready, serving, not terminating, not local, no hints); set the
    /// public fields to change that, but not `endpoint`/`port` (the chain would be stale).
    pub fn new(service_port: &ServicePortName, ip: &str, port: i32) -> EndpointInfo {
        let endpoint = join_host_port(ip, port);
        let name = endpoint_chain_name(&service_port.to_string(), service_port.protocol.lower(), &endpoint);
        EndpointInfo {
            endpoint,
            port,
            is_local: false,
            ready: true,
            serving: true,
            terminating: false,
            zone_hints: BTreeSet::new(),
            node_hints: NodeHints::None,
            chain_key: chain_key(&name).unwrap_or_default(),
        }
    }

    /// The IP alone, as written in the EndpointSlice (upstream 1.29's `IP()`), written after
    /// `-s` in the hairpin rule: always spelled like the address in `endpoint`.
    pub fn ip(&self) -> &str {
        // `endpoint` always ends in `:port`; searching bytes is much cheaper than chars here,
        // and this runs for every endpoint chain of every full sync.
        let colon = self.endpoint.as_bytes().iter().rposition(|&b| b == b':').unwrap_or(self.endpoint.len());
        let host = &self.endpoint[..colon];
        host.strip_prefix('[').and_then(|h| h.strip_suffix(']')).unwrap_or(host)
    }

    /// KUBE-SEP- chain for this endpoint of this service port.
    pub(crate) fn chain_name(&self) -> ChainName {
        chain_name(self.chain_key)
    }

    /// Upstream's "serving and terminating" fallback condition: still able to take traffic
    /// while shutting down.
    pub(crate) fn is_serving_terminating(&self) -> bool {
        self.serving && self.terminating
    }
}

pub(crate) type EndpointRef = Arc<EndpointInfo>;
