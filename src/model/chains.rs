//! Chain names: the fixed top-level chains and the hashed per-service and per-endpoint ones.
//!
//! The hashed names must be bit-identical to upstream's so a node can switch between
//! upstream kube-proxy and this one without stranding chains: the first 16 characters of the
//! standard base32 encoding of SHA-256 over the service port name, the protocol and (for
//! endpoint chains) the endpoint.

use std::collections::HashSet;

use sha2::{Digest, Sha256};

pub(crate) const KUBE_SERVICES: &str = "KUBE-SERVICES";
pub(crate) const KUBE_EXTERNAL_SERVICES: &str = "KUBE-EXTERNAL-SERVICES";
pub(crate) const KUBE_NODEPORTS: &str = "KUBE-NODEPORTS";
pub(crate) const KUBE_POSTROUTING: &str = "KUBE-POSTROUTING";
pub(crate) const KUBE_MARK_MASQ: &str = "KUBE-MARK-MASQ";
pub(crate) const KUBE_FORWARD: &str = "KUBE-FORWARD";
pub(crate) const KUBE_PROXY_FIREWALL: &str = "KUBE-PROXY-FIREWALL";
pub(crate) const KUBE_PROXY_CANARY: &str = "KUBE-PROXY-CANARY";
/// kubelet's copy of the anti-martian rule lives here; we only write it when localhost
/// NodePorts are on.
pub(crate) const KUBE_FIREWALL: &str = "KUBE-FIREWALL";
/// Chains kubelet creates; ensured on full syncs so our rules can refer to them.
#[cfg(test)]
pub(crate) const KUBE_KUBELET_CANARY: &str = "KUBE-KUBELET-CANARY";

pub(crate) const SERVICE_CHAIN_PREFIX: &str = "KUBE-SVC-";
pub(crate) const SERVICE_LOCAL_CHAIN_PREFIX: &str = "KUBE-SVL-";
pub(crate) const SERVICE_FIREWALL_CHAIN_PREFIX: &str = "KUBE-FW-";
pub(crate) const SERVICE_EXTERNAL_CHAIN_PREFIX: &str = "KUBE-EXT-";
pub(crate) const ENDPOINT_CHAIN_PREFIX: &str = "KUBE-SEP-";

/// Whether a nat chain is one of the per-service chains this proxier owns (and may delete
/// when no longer referenced).
pub(crate) fn is_service_chain_name(chain: &str) -> bool {
    [
        SERVICE_CHAIN_PREFIX,
        SERVICE_LOCAL_CHAIN_PREFIX,
        ENDPOINT_CHAIN_PREFIX,
        SERVICE_FIREWALL_CHAIN_PREFIX,
        SERVICE_EXTERNAL_CHAIN_PREFIX,
    ]
    .iter()
    .any(|p| chain.starts_with(p))
}

/// A compact identity for one of our hashed chains: the chain kind and the 80 bits its 16
/// base32 characters encode. Sets of these avoid touching (and hashing) name strings, which
/// matters when comparing 100k+ chains against `iptables-save` on every sync.
pub(crate) type ChainKey = u128;

const KEY_PREFIXES: [(&str, u128); 5] = [
    (SERVICE_CHAIN_PREFIX, 1),
    (SERVICE_LOCAL_CHAIN_PREFIX, 2),
    (SERVICE_FIREWALL_CHAIN_PREFIX, 3),
    (SERVICE_EXTERNAL_CHAIN_PREFIX, 4),
    (ENDPOINT_CHAIN_PREFIX, 5),
];

/// The [`ChainKey`] of a per-service chain name, or `None` when the name is not one we
/// generate (wrong prefix, or not 16 base32 characters after it).
pub(crate) fn chain_key(name: &str) -> Option<ChainKey> {
    let (kind, rest) = KEY_PREFIXES.iter().find_map(|(p, k)| name.strip_prefix(p).map(|rest| (*k, rest)))?;
    if rest.len() != 16 {
        return None;
    }
    let mut bits: u128 = 0;
    for b in rest.bytes() {
        let v = match b {
            b'A'..=b'Z' => b - b'A',
            b'2'..=b'7' => b - b'2' + 26,
            _ => return None,
        };
        bits = (bits << 5) | u128::from(v);
    }
    Some((kind << 80) | bits)
}

/// Longest hashed chain name: `KUBE-SEP-` (and the other 9-byte prefixes) plus 16 characters.
const MAX_HASHED_NAME: usize = 25;

/// A hashed chain name spelled out from its [`ChainKey`], on the stack: lets endpoints keep
/// only the key.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) struct ChainName {
    buf: [u8; MAX_HASHED_NAME],
    len: u8,
}

impl ChainName {
    pub fn as_str(&self) -> &str {
        // Only ASCII is ever written (a prefix and base32 characters).
        std::str::from_utf8(&self.buf[..usize::from(self.len)]).unwrap_or_default()
    }
}

impl std::ops::Deref for ChainName {
    type Target = str;
    fn deref(&self) -> &str {
        self.as_str()
    }
}

impl std::fmt::Display for ChainName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::fmt::Debug for ChainName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}", self.as_str())
    }
}

impl PartialEq<&str> for ChainName {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

/// The chain name a [`ChainKey`] was decoded from (the inverse of [`chain_key`]); empty
/// for a key no name decodes to.
pub(crate) fn chain_name(key: ChainKey) -> ChainName {
    const ALPHABET: &[u8; 32] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZ234567";
    let mut name = ChainName { buf: [0; MAX_HASHED_NAME], len: 0 };
    let kind = key >> 80;
    let Some((prefix, _)) = KEY_PREFIXES.iter().find(|(_, k)| *k == kind) else {
        return name;
    };
    let p = prefix.len();
    name.buf[..p].copy_from_slice(prefix.as_bytes());
    for i in 0..16 {
        let v = (key >> (5 * (15 - i))) & 31;
        name.buf[p + i] = ALPHABET[v as usize];
    }
    name.len = (p + 16) as u8;
    name
}

/// The four chain names of a service port, computed once when the port is built.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServiceChainNames {
    /// KUBE-SVC-: endpoints for "Cluster" traffic policy.
    pub cluster_policy: String,
    /// KUBE-SVL-: endpoints for "Local" traffic policy.
    pub local_policy: String,
    /// KUBE-FW-: loadBalancerSourceRanges filter.
    pub firewall: String,
    /// KUBE-EXT-: entry point for NodePort, external IP and load-balancer traffic.
    pub external: String,
    /// The four chains' [`ChainKey`]s.
    pub keys: ServiceChainKeys,
}

/// The [`ChainKey`]s of a service port's four chains, by role.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServiceChainKeys {
    pub cluster_policy: ChainKey,
    pub local_policy: ChainKey,
    pub firewall: ChainKey,
    pub external: ChainKey,
}

impl ServiceChainKeys {
    /// All four, in the order of [`ServiceChainNames`]' fields.
    pub fn all(&self) -> [ChainKey; 4] {
        [self.cluster_policy, self.local_policy, self.firewall, self.external]
    }
}

impl ServiceChainNames {
    /// `service_port_name` is the display form (`ns/name:port`), `protocol` lower case.
    pub fn new(service_port_name: &str, protocol: &str) -> Self {
        let hash = port_proto_hash(service_port_name, protocol);
        let cluster_policy = format!("{SERVICE_CHAIN_PREFIX}{hash}");
        let local_policy = format!("{SERVICE_LOCAL_CHAIN_PREFIX}{hash}");
        let firewall = format!("{SERVICE_FIREWALL_CHAIN_PREFIX}{hash}");
        let external = format!("{SERVICE_EXTERNAL_CHAIN_PREFIX}{hash}");
        let key = |n: &str| chain_key(n).unwrap_or_default();
        let keys = ServiceChainKeys {
            cluster_policy: key(&cluster_policy),
            local_policy: key(&local_policy),
            firewall: key(&firewall),
            external: key(&external),
        };
        ServiceChainNames { cluster_policy, local_policy, firewall, external, keys }
    }
}

/// KUBE-SEP- chain of one endpoint (`ip:port`) of a service port.
pub fn endpoint_chain_name(service_port_name: &str, protocol: &str, endpoint: &str) -> String {
    let mut h = Sha256::new();
    h.update(service_port_name.as_bytes());
    h.update(protocol.as_bytes());
    h.update(endpoint.as_bytes());
    let mut name = String::with_capacity(ENDPOINT_CHAIN_PREFIX.len() + 16);
    name.push_str(ENDPOINT_CHAIN_PREFIX);
    push_base32_prefix16(&h.finalize(), &mut name);
    name
}

fn port_proto_hash(service_port_name: &str, protocol: &str) -> String {
    let mut h = Sha256::new();
    h.update(service_port_name.as_bytes());
    h.update(protocol.as_bytes());
    let mut out = String::with_capacity(16);
    push_base32_prefix16(&h.finalize(), &mut out);
    out
}

/// Appends the first 16 characters of the RFC 4648 base32 encoding of `digest`: exactly the
/// first 10 bytes, so no padding is involved.
fn push_base32_prefix16(digest: &[u8], out: &mut String) {
    const ALPHABET: &[u8; 32] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZ234567";
    for chunk in digest[..10].chunks(5) {
        let v = chunk.iter().fold(0u64, |acc, b| (acc << 8) | u64::from(*b));
        for i in (0..8).rev() {
            out.push(ALPHABET[((v >> (i * 5)) & 31) as usize] as char);
        }
    }
}

/// Hashes a [`ChainKey`] by folding it: its low 80 bits are already uniformly random
/// (they come from SHA-256).
#[derive(Default)]
pub struct KeyHasher(u64);

impl std::hash::Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(*b);
        }
    }
    fn write_u128(&mut self, v: u128) {
        self.0 = (v as u64) ^ ((v >> 64) as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

/// A set of [`ChainKey`]s.
pub(crate) type KeySet = HashSet<ChainKey, std::hash::BuildHasherDefault<KeyHasher>>;

/// The per-service nat chains (`KUBE-SVC-`, `KUBE-SVL-`, `KUBE-SEP-`, `KUBE-FW-`, `KUBE-EXT-`)
/// present in the kernel: the only chains stale-chain cleanup ever deletes. Names we generate
/// are kept as [`ChainKey`]s (16 bytes each, so 130k chains cost a few MB); any other name with
/// one of our prefixes (written by hand, or by a kube-proxy with another hash) is kept as
/// written, and is always stale.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NatChains {
    keys: KeySet,
    other: HashSet<String>,
}

impl NatChains {
    /// The service chains among `names` (a table's chain names; others are ignored).
    pub fn from_names<I, S>(names: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let mut chains = NatChains::default();
        for name in names {
            chains.insert_name(name.as_ref());
        }
        chains
    }

    /// Exactly the chains in `keys` (what a sync that deleted every stale chain leaves).
    pub fn from_keys(keys: KeySet) -> Self {
        NatChains { keys, other: HashSet::new() }
    }

    fn insert_name(&mut self, name: &str) {
        if !is_service_chain_name(name) {
            return;
        }
        match chain_key(name) {
            Some(key) => {
                self.keys.insert(key);
            }
            None => {
                self.other.insert(name.to_owned());
            }
        }
    }

    /// Adds chains created since (a sync that deleted nothing stale).
    pub fn extend(&mut self, keys: &KeySet) {
        self.keys.extend(keys.iter().copied());
    }

    pub fn len(&self) -> usize {
        self.keys.len() + self.other.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The chains not in `active`, by name, sorted: what cleanup deletes.
    pub fn stale(&self, active: &KeySet) -> Vec<String> {
        let mut stale: Vec<String> = self
            .keys
            .iter()
            .filter(|k| !active.contains(k))
            .map(|&k| chain_name(k).as_str().to_owned())
            .chain(self.other.iter().cloned())
            .collect();
        stale.sort_unstable();
        stale
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Expected names are the ones upstream kube-proxy's own tests use for these services.
    #[test]
    fn service_chain_names_match_upstream() {
        let names = ServiceChainNames::new("ns1/svc1:p80", "tcp");
        assert_eq!(names.cluster_policy, "KUBE-SVC-XPGD46QRK7WJZT7O");
        assert_eq!(names.external, "KUBE-EXT-XPGD46QRK7WJZT7O");
        assert_eq!(names.local_policy, "KUBE-SVL-XPGD46QRK7WJZT7O");
        assert_eq!(names.firewall, "KUBE-FW-XPGD46QRK7WJZT7O");
    }

    #[test]
    fn endpoint_chain_name_matches_upstream() {
        assert_eq!(endpoint_chain_name("ns1/svc1:p80", "tcp", "10.180.0.1:80"), "KUBE-SEP-SXIVWICOYRO3J4NJ");
    }

    #[test]
    fn chain_keys_identify_our_chains() {
        let names = ServiceChainNames::new("ns1/svc1:p80", "tcp");
        let keys: std::collections::HashSet<ChainKey> = names.keys.all().into_iter().collect();
        assert_eq!(keys.len(), 4, "each chain kind has its own key");
        assert_eq!(chain_key(&names.firewall), Some(names.keys.firewall));
        let sep = endpoint_chain_name("ns1/svc1:p80", "tcp", "10.180.0.1:80");
        assert!(chain_key(&sep).is_some());
        assert_ne!(chain_key(&sep), chain_key("KUBE-SEP-SXIVWICOYRO3J4NK"));
        assert_eq!(chain_key("KUBE-SEP-short"), None);
        assert_eq!(chain_key("KUBE-SEP-sxivwicoyro3j4nj"), None);
        assert_eq!(chain_key("KUBE-SERVICES"), None);
        assert_eq!(chain_key("KUBE-MARK-MASQ"), None);
    }

    #[test]
    fn chain_names_are_spelled_out_from_keys() {
        let names = ServiceChainNames::new("ns1/svc1:p80", "tcp");
        for (name, key) in [&names.cluster_policy, &names.local_policy, &names.firewall, &names.external]
            .into_iter()
            .zip(names.keys.all())
        {
            assert_eq!(chain_name(key), name.as_str());
        }
        let sep = endpoint_chain_name("ns1/svc1:p80", "tcp", "10.180.0.1:80");
        let key = chain_key(&sep).expect("our chain");
        assert_eq!(chain_name(key).as_str(), "KUBE-SEP-SXIVWICOYRO3J4NJ");
        assert_eq!(chain_name(key).to_string(), sep);
        assert_eq!(chain_name(0).as_str(), "", "no kind, no name");
    }

    #[test]
    fn service_chain_prefixes_are_recognised() {
        assert!(is_service_chain_name("KUBE-SEP-SXIVWICOYRO3J4NJ"));
        assert!(is_service_chain_name("KUBE-FW-XPGD46QRK7WJZT7O"));
        assert!(!is_service_chain_name("KUBE-SERVICES"));
        assert!(!is_service_chain_name("KUBE-MARK-MASQ"));
    }
}
