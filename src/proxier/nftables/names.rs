//! Names of the per-service objects of the `kube-proxy` table (upstream's
//! `servicePortChainNameBase`, `servicePortEndpointChainNameBase`, `hashAndTruncate`),
//! unchanged from 1.30 to 1.37.
//!
//! A service port's base is `HASH-ns/name/proto/port` and an endpoint's
//! `HASH-ns/name/proto/port__ip/port` (`:` of an IPv6 address written `.`), where HASH is the
//! first 8 characters of the RFC 4648 base32 encoding of SHA-256 over the rest. Chains are
//! `service-`, `local-`, `external-`, `firewall-` + the port's base, `endpoint-` + the
//! endpoint's; the ClientIP affinity set of an endpoint is `affinity-` + its base. Every such
//! name holds a `/`, which none of the fixed chains does: that is how stale chains are told
//! apart ([`is_service_chain`]).

use sha2::{Digest, Sha256};

use crate::model::{ServicePortName, ip::join_host_port};

/// knftables' `NameLengthMax` (256) less the longest prefix (16).
const BASE_LENGTH_MAX: usize = 240;

pub(crate) const SERVICE_PREFIX: &str = "service-";
pub(crate) const LOCAL_PREFIX: &str = "local-";
pub(crate) const EXTERNAL_PREFIX: &str = "external-";
pub(crate) const FIREWALL_PREFIX: &str = "firewall-";
pub(crate) const ENDPOINT_PREFIX: &str = "endpoint-";
pub(crate) const AFFINITY_PREFIX: &str = "affinity-";

/// `HASH-name`, cut to 240 bytes (the last three replaced by `...`) when longer.
pub fn hash_and_truncate(name: &str) -> String {
    const ALPHABET: &[u8; 32] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZ234567";
    let digest = Sha256::digest(name.as_bytes());
    // 8 base32 characters are exactly the first 40 bits: no padding is involved.
    let bits = digest[..5].iter().fold(0u64, |acc, b| (acc << 8) | u64::from(*b));
    let mut out = String::with_capacity(9 + name.len());
    for i in (0..8).rev() {
        out.push(char::from(ALPHABET[((bits >> (i * 5)) & 31) as usize]));
    }
    out.push('-');
    out.push_str(name);
    if out.len() > BASE_LENGTH_MAX {
        // Names are ASCII (namespaces, names, port names, IPs, digits), so any cut is on a
        // character boundary; `floor` keeps a non-ASCII name from panicking all the same.
        let mut cut = BASE_LENGTH_MAX - 3;
        while !out.is_char_boundary(cut) {
            cut -= 1;
        }
        out.truncate(cut);
        out.push_str("...");
    }
    out
}

/// `HASH-ns/name/proto/port` of a service port.
pub fn service_port_base(name: &ServicePortName) -> String {
    let svc = &name.service;
    hash_and_truncate(&format!("{}/{}/{}/{}", svc.namespace, svc.name, name.protocol.lower(), name.port))
}

/// `HASH-ns/name/proto/port__ip/port` of an endpoint `ip` (as written in the endpoint
/// string, without brackets) and `port` of a service port.
pub fn endpoint_base(name: &ServicePortName, ip: &str, port: i32) -> String {
    let svc = &name.service;
    let ip = ip.replace(':', ".");
    hash_and_truncate(&format!("{}/{}/{}/{}__{ip}/{port}", svc.namespace, svc.name, name.protocol.lower(), name.port))
}

/// The four chain names of a service port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServicePortChains {
    /// `service-…`: endpoints for the Cluster traffic policy.
    pub cluster: String,
    /// `local-…`: endpoints for the Local traffic policy.
    pub local: String,
    /// `external-…`: entry of NodePort, external IP and load-balancer traffic.
    pub external: String,
    /// `firewall-…`: loadBalancerSourceRanges.
    pub firewall: String,
}

impl ServicePortChains {
    pub fn new(name: &ServicePortName) -> ServicePortChains {
        let base = service_port_base(name);
        ServicePortChains {
            cluster: format!("{SERVICE_PREFIX}{base}"),
            local: format!("{LOCAL_PREFIX}{base}"),
            external: format!("{EXTERNAL_PREFIX}{base}"),
            firewall: format!("{FIREWALL_PREFIX}{base}"),
        }
    }
}

/// An endpoint's chain and affinity set names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndpointNames {
    pub chain: String,
    pub affinity_set: String,
}

impl EndpointNames {
    pub fn new(name: &ServicePortName, ip: &str, port: i32) -> EndpointNames {
        let base = endpoint_base(name, ip, port);
        EndpointNames { chain: format!("{ENDPOINT_PREFIX}{base}"), affinity_set: format!("{AFFINITY_PREFIX}{base}") }
    }
}

/// Whether `chain` is a per-service chain (its name holds a `/`): the chains that go stale.
pub fn is_service_chain(chain: &str) -> bool {
    chain.contains('/')
}

/// Whether `set` is an endpoint's ClientIP affinity set.
pub fn is_affinity_set(set: &str) -> bool {
    set.starts_with(AFFINITY_PREFIX)
}

/// `ip:port` (`[ip]:port` for IPv6), as the DNAT target of an endpoint chain.
pub(crate) fn dnat_target(ip: &str, port: i32) -> String {
    join_host_port(ip, port)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{NamespacedName, Protocol};

    fn spn(ns: &str, name: &str, port: &str) -> ServicePortName {
        ServicePortName::new(NamespacedName::new(ns, name), port, Protocol::Tcp)
    }

    /// The hashes of upstream's test names (pkg/proxy/nftables/proxier_test.go).
    #[test]
    fn hashes_match_upstream() {
        for (name, hash) in [
            ("ns1/svc1/tcp/p80", "ULMVA6XW"),
            ("ns1/svc1/tcp/p80__10.180.0.1/80", "5OJB2KTY"),
            ("ns2/svc2/tcp/p80", "42NFTM6N"),
            ("ns2/svc2/tcp/p80__10.180.0.2/80", "SGOXE6O3"),
            ("ns3/svc3/tcp/p80", "4AT6LBPK"),
            ("ns3/svc3/tcp/p80__10.180.0.3/80", "UEIP74TE"),
            ("ns4/svc4/tcp/p80", "LAUZTJTB"),
            ("ns4/svc4/tcp/p80__10.180.0.4/80", "UNZV3OEC"),
            ("ns4/svc4/tcp/p80__10.180.0.5/80", "5RFCDDV7"),
            ("ns5/svc5/tcp/p80", "HVFWP5L3"),
            ("ns5/svc5/tcp/p80__10.180.0.3/80", "GTK6MW7G"),
            ("ns1/svc1/tcp/p80__fd00.10.180..2.1/80", "2CRNCTTE"),
            ("ns2/svc2/tcp/p8080", "MHHHYRWA"),
            ("ns1/svc1/tcp/p80__10.0.1.1/80", "5TPGNJF2"),
        ] {
            assert_eq!(hash_and_truncate(name), format!("{hash}-{name}"), "{name}");
        }
    }

    #[test]
    fn names_of_a_service_port_and_its_endpoints() {
        let chains = ServicePortChains::new(&spn("ns5", "svc5", "p80"));
        assert_eq!(chains.cluster, "service-HVFWP5L3-ns5/svc5/tcp/p80");
        assert_eq!(chains.local, "local-HVFWP5L3-ns5/svc5/tcp/p80");
        assert_eq!(chains.external, "external-HVFWP5L3-ns5/svc5/tcp/p80");
        assert_eq!(chains.firewall, "firewall-HVFWP5L3-ns5/svc5/tcp/p80");
        let ep = EndpointNames::new(&spn("ns5", "svc5", "p80"), "10.180.0.3", 80);
        assert_eq!(ep.chain, "endpoint-GTK6MW7G-ns5/svc5/tcp/p80__10.180.0.3/80");
        assert_eq!(ep.affinity_set, "affinity-GTK6MW7G-ns5/svc5/tcp/p80__10.180.0.3/80");
        let v6 = EndpointNames::new(&spn("ns1", "svc1", "p80"), "fd00:10:180::2:1", 80);
        assert_eq!(v6.chain, "endpoint-2CRNCTTE-ns1/svc1/tcp/p80__fd00.10.180..2.1/80");
        // An unnamed port leaves the last part empty.
        let unnamed = ServicePortChains::new(&spn("ns", "svc", ""));
        assert!(unnamed.cluster.ends_with("-ns/svc/tcp/"), "{}", unnamed.cluster);
        assert!(is_service_chain(&unnamed.cluster));
        assert!(!is_service_chain("services"));
        assert!(is_affinity_set(&ep.affinity_set));
        assert_eq!(dnat_target("fd00::1", 80), "[fd00::1]:80");
    }

    #[test]
    fn long_names_are_cut_to_240() {
        let long = "n".repeat(63);
        let name = ServicePortName::new(NamespacedName::new(&long, &long), long.clone(), Protocol::Sctp);
        let ep = endpoint_base(&name, "fd00:1111:2222:3333:4444:5555:6666:7777", 65535);
        assert_eq!(ep.len(), 240);
        assert!(ep.ends_with("..."), "{ep}");
        assert_eq!(&ep[8..9], "-");
        // A service port's base never needs cutting.
        assert!(!service_port_base(&name).ends_with("..."));
    }
}
