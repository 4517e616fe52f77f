//! What the proxier needs from its own Node object: labels (topology zone), pod CIDRs (for
//! NodeCIDR local detection) and addresses (node IPs), and how node IPs are chosen.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use k8s_openapi::api::core::v1::Node;

use super::ip::parse_ip_sloppy;
use super::names::IpFamily;

/// The parts of this node the proxier uses.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct NodeInfo {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub pod_cidrs: Vec<String>,
    /// Every parseable status address, in status order.
    pub addresses: Vec<IpAddr>,
    /// Upstream's `GetNodeHostIPs`: the first InternalIP (else ExternalIP), plus the first
    /// address of the other family if there is one.
    pub host_ips: Vec<IpAddr>,
}

impl NodeInfo {
    pub fn from_node(node: &Node) -> NodeInfo {
        let name = node.metadata.name.clone().unwrap_or_default();
        let labels = node.metadata.labels.clone().unwrap_or_default();
        let spec = node.spec.as_ref();
        let mut pod_cidrs = spec.and_then(|s| s.pod_cidrs.clone()).unwrap_or_default();
        if pod_cidrs.is_empty()
            && let Some(cidr) = spec.and_then(|s| s.pod_cidr.clone()).filter(|c| !c.is_empty())
        {
            pod_cidrs.push(cidr);
        }
        let status_addrs = node.status.as_ref().and_then(|s| s.addresses.as_ref());
        let mut addresses = Vec::new();
        let mut internal = Vec::new();
        let mut external = Vec::new();
        for a in status_addrs.into_iter().flatten() {
            let Some(ip) = parse_ip_sloppy(&a.address) else { continue };
            addresses.push(ip);
            match a.type_.as_str() {
                "InternalIP" => internal.push(ip),
                "ExternalIP" => external.push(ip),
                _ => {}
            }
        }
        let all: Vec<IpAddr> = internal.into_iter().chain(external).collect();
        let mut host_ips = Vec::new();
        if let Some(first) = all.first().copied() {
            host_ips.push(first);
            if let Some(other) = all.iter().find(|ip| IpFamily::of(ip) != IpFamily::of(&first)) {
                host_ips.push(*other);
            }
        }
        NodeInfo { name, labels, pod_cidrs, addresses, host_ips }
    }
}

/// The node IP of each family and the primary family (upstream `detectNodeIPs`): the Node's
/// host IPs, overridden for its family by a specified (non-unspecified) bind address; a family
/// with no address gets the loopback address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct NodeIps {
    pub primary: IpFamily,
    pub v4: IpAddr,
    pub v6: IpAddr,
}

impl NodeIps {
    pub fn detect(host_ips: &[IpAddr], bind_address: Option<IpAddr>) -> NodeIps {
        let mut ips =
            NodeIps { primary: IpFamily::V4, v4: IpAddr::V4(Ipv4Addr::LOCALHOST), v6: IpAddr::V6(Ipv6Addr::LOCALHOST) };
        if let Some(first) = host_ips.first() {
            ips.primary = IpFamily::of(first);
            ips.set(*first);
            if let Some(second) = host_ips.get(1) {
                ips.set(*second);
            }
        }
        if let Some(bind) = bind_address.filter(|b| !b.is_unspecified()) {
            ips.primary = IpFamily::of(&bind);
            ips.set(bind);
        }
        ips
    }

    fn set(&mut self, ip: IpAddr) {
        match IpFamily::of(&ip) {
            IpFamily::V4 => self.v4 = super::ip::normalize(ip),
            IpFamily::V6 => self.v6 = ip,
        }
    }

    pub fn get(&self, family: IpFamily) -> IpAddr {
        match family {
            IpFamily::V4 => self.v4,
            IpFamily::V6 => self.v6,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{NodeAddress, NodeStatus};

    fn node(addrs: &[(&str, &str)]) -> Node {
        Node {
            metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
                name: Some("n1".into()),
                ..Default::default()
            },
            status: Some(NodeStatus {
                addresses: Some(
                    addrs.iter().map(|(t, a)| NodeAddress { type_: t.to_string(), address: a.to_string() }).collect(),
                ),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn host_ips_prefer_internal_and_add_other_family() {
        let n = NodeInfo::from_node(&node(&[
            ("Hostname", "n1"),
            ("ExternalIP", "203.0.113.5"),
            ("InternalIP", "192.168.1.5"),
            ("InternalIP", "fd00::5"),
        ]));
        assert_eq!(n.host_ips, vec!["192.168.1.5".parse::<IpAddr>().unwrap(), "fd00::5".parse().unwrap()]);
    }

    #[test]
    fn bind_address_overrides_its_family() {
        let host: Vec<IpAddr> = vec!["192.168.1.5".parse().unwrap()];
        let ips = NodeIps::detect(&host, Some("10.1.1.1".parse().unwrap()));
        assert_eq!(ips.v4, "10.1.1.1".parse::<IpAddr>().unwrap());
        assert_eq!(ips.v6, "::1".parse::<IpAddr>().unwrap());
        let ips = NodeIps::detect(&host, Some("0.0.0.0".parse().unwrap()));
        assert_eq!(ips.v4, "192.168.1.5".parse::<IpAddr>().unwrap());
        let ips = NodeIps::detect(&[], None);
        assert_eq!(ips.v4, "127.0.0.1".parse::<IpAddr>().unwrap());
        assert_eq!(ips.primary, IpFamily::V4);
    }
}
