//! `nodePortAddresses`: which of the node's addresses accept NodePort traffic.

use std::net::IpAddr;

use crate::model::{Cidr, IpFamily};

/// The `nodePortAddresses` CIDRs of one family (upstream's `NodePortAddresses`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodePortAddresses {
    cidrs: Vec<Cidr>,
    match_all: bool,
    contains_ipv4_loopback: bool,
}

impl NodePortAddresses {
    /// Keeps the CIDRs of `family`; with none left, every address matches (`0.0.0.0/0` or
    /// `::/0`). Unparseable entries are ignored (configuration validation rejects them).
    pub fn new(family: IpFamily, cidrs: &[String]) -> Self {
        let mut parsed: Vec<Cidr> =
            cidrs.iter().filter_map(|s| Cidr::parse_sloppy(s.trim())).filter(|c| c.family() == family).collect();
        if parsed.is_empty() {
            let zero = match family {
                IpFamily::V4 => Cidr::parse_sloppy("0.0.0.0/0"),
                IpFamily::V6 => Cidr::parse_sloppy("::/0"),
            };
            parsed.extend(zero);
        }
        let loopback: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(127, 0, 0, 0));
        let contains_ipv4_loopback =
            parsed.iter().any(|c| c.family() == IpFamily::V4 && (c.network().is_loopback() || c.contains(&loopback)));
        let match_all = parsed.iter().any(Cidr::is_zero);
        if match_all {
            parsed.retain(Cidr::is_zero);
            parsed.truncate(1);
        }
        NodePortAddresses { cidrs: parsed, match_all, contains_ipv4_loopback }
    }

    /// Resolves the keywords validation admits to CIDRs: `primary` (1.31: the only entry;
    /// 1.37: combinable) to the node's IPs, `/32` and `/128`, leaving out loopback fallbacks;
    /// `localhost` (1.37) to `127.0.0.0/8` and `::1/128`; `all` (1.37) to `0.0.0.0/0` and
    /// `::/0`. CIDRs are kept as written.
    pub(crate) fn resolve_keywords(addresses: &[String], node_ips: &[IpAddr]) -> Vec<String> {
        let mut out = Vec::with_capacity(addresses.len());
        for address in addresses {
            match address.as_str() {
                crate::config::NODE_PORT_ADDRESSES_PRIMARY => out.extend(
                    node_ips.iter().filter(|ip| !ip.is_loopback() && !ip.is_unspecified()).map(|ip| match ip {
                        IpAddr::V4(v4) => format!("{v4}/32"),
                        IpAddr::V6(v6) => format!("{v6}/128"),
                    }),
                ),
                crate::config::NODE_PORT_ADDRESSES_LOCALHOST => {
                    out.extend(["127.0.0.0/8".to_string(), "::1/128".to_string()])
                }
                crate::config::NODE_PORT_ADDRESSES_ALL => out.extend(["0.0.0.0/0".to_string(), "::/0".to_string()]),
                _ => out.push(address.clone()),
            }
        }
        out
    }

    /// Every local address of the family accepts NodePorts.
    pub(crate) fn match_all(&self) -> bool {
        self.match_all
    }

    pub(crate) fn contains_ipv4_loopback(&self) -> bool {
        self.contains_ipv4_loopback
    }

    pub fn cidrs(&self) -> &[Cidr] {
        &self.cidrs
    }

    /// The host addresses inside the CIDRs, deduplicated, in CIDR order then interface order.
    pub(crate) fn node_ips(&self, interface_addrs: &[IpAddr]) -> Vec<IpAddr> {
        let mut out: Vec<IpAddr> = Vec::new();
        for cidr in &self.cidrs {
            for ip in interface_addrs {
                let ip = crate::model::ip::normalize(*ip);
                if cidr.contains(&ip) && !out.contains(&ip) {
                    out.push(ip);
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(v: &[&str]) -> Vec<String> {
        v.iter().map(|x| x.to_string()).collect()
    }

    #[test]
    fn empty_matches_all() {
        let n = NodePortAddresses::new(IpFamily::V4, &[]);
        assert!(n.match_all());
        assert!(n.contains_ipv4_loopback());
        let n = NodePortAddresses::new(IpFamily::V6, &s(&["10.0.0.0/8"]));
        assert!(n.match_all());
        assert!(!n.contains_ipv4_loopback());
    }

    #[test]
    fn filters_family_and_finds_ips() {
        let n = NodePortAddresses::new(IpFamily::V4, &s(&["192.168.0.0/16", "fd00::/8", "127.0.0.1/32"]));
        assert!(!n.match_all());
        assert!(n.contains_ipv4_loopback());
        let addrs: Vec<IpAddr> =
            ["10.0.0.1", "192.168.1.2", "127.0.0.1", "fd00::1"].iter().map(|a| a.parse().unwrap()).collect();
        assert_eq!(n.node_ips(&addrs), vec![addrs[1], addrs[2]]);
    }

    #[test]
    fn primary_resolves_to_node_ips() {
        let ips: Vec<IpAddr> = vec!["192.168.0.2".parse().unwrap(), "::1".parse().unwrap()];
        assert_eq!(NodePortAddresses::resolve_keywords(&s(&["primary"]), &ips), s(&["192.168.0.2/32"]));
        assert_eq!(NodePortAddresses::resolve_keywords(&s(&["10.0.0.0/8"]), &ips), s(&["10.0.0.0/8"]));
        let n = NodePortAddresses::new(IpFamily::V4, &NodePortAddresses::resolve_keywords(&s(&["primary"]), &ips));
        assert!(!n.match_all());
        assert!(!n.contains_ipv4_loopback());
    }

    #[test]
    fn keywords_of_1_37_resolve_and_combine() {
        let ips: Vec<IpAddr> = vec!["192.168.0.2".parse().unwrap(), "fd00::2".parse().unwrap()];
        let resolved = NodePortAddresses::resolve_keywords(&s(&["localhost", "primary", "10.1.0.0/16"]), &ips);
        assert_eq!(resolved, s(&["127.0.0.0/8", "::1/128", "192.168.0.2/32", "fd00::2/128", "10.1.0.0/16"]));
        let n = NodePortAddresses::new(IpFamily::V4, &resolved);
        assert!(!n.match_all() && n.contains_ipv4_loopback());
        let all = NodePortAddresses::resolve_keywords(&s(&["all"]), &ips);
        assert!(NodePortAddresses::new(IpFamily::V4, &all).match_all());
        assert!(NodePortAddresses::new(IpFamily::V6, &all).match_all());
    }

    #[test]
    fn zero_cidr_wins() {
        let n = NodePortAddresses::new(IpFamily::V4, &s(&["192.168.0.0/16", "0.0.0.0/0"]));
        assert!(n.match_all());
        assert_eq!(n.cidrs().len(), 1);
    }
}
