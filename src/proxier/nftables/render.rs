//! The nftables renderer: pure functions from the proxier's maps to the desired `kube-proxy`
//! table, in two parts.
//!
//! * [`base_table`]: the table's fixed objects (base chains and their jumps, the dispatch
//!   chains and their rules, the sets and maps, the node-port addresses): written by full
//!   syncs only, as upstream's `setupNFTables`.
//! * [`fragment`]: everything one service port contributes: its chains with their rules, its
//!   ClientIP affinity sets, and its elements in the shared sets and maps. A fragment depends
//!   only on the service port, its endpoints, the node's labels and the proxier's fixed
//!   settings, so a partial sync renders only the service ports that changed (and renders
//!   the old fragment again, from the inputs it was made from, to see what to take away).
//!
//! The rule text is upstream's for the emulated release (pkg/proxy/nftables/proxier.go), as
//! `knftables.Concat` spells it; docs/upstream-versions.md ("nftables mode") lists what
//! changes between 1.31 and 1.37.

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;

use crate::compat::Features;
use crate::model::ip::format_ip;
use crate::model::{EndpointRef, IpFamily, ServicePortInfo};
use crate::nftables::{BaseChain, Chain, ChainType, Family, Hook, Set, SetKind};
use crate::proxier::local_detect::LocalDetector;
use crate::proxier::nodeport_addresses::NodePortAddresses;
use crate::tracker::topology::categorize_endpoints;

use super::names::{self, EndpointNames, ServicePortChains};

// The fixed chains.
pub(crate) const FILTER_PREROUTING: &str = "filter-prerouting";
pub(crate) const FILTER_INPUT: &str = "filter-input";
pub(crate) const FILTER_FORWARD: &str = "filter-forward";
pub(crate) const FILTER_OUTPUT: &str = "filter-output";
pub(crate) const FILTER_OUTPUT_POST_DNAT: &str = "filter-output-post-dnat";
pub(crate) const FILTER_PREROUTING_PRE_DNAT: &str = "filter-prerouting-pre-dnat";
pub(crate) const FILTER_OUTPUT_PRE_DNAT: &str = "filter-output-pre-dnat";
pub(crate) const NAT_PREROUTING: &str = "nat-prerouting";
pub(crate) const NAT_OUTPUT: &str = "nat-output";
pub(crate) const NAT_POSTROUTING: &str = "nat-postrouting";
pub(crate) const SERVICES: &str = "services";
pub(crate) const MASQUERADING: &str = "masquerading";
pub(crate) const MARK_FOR_MASQUERADE: &str = "mark-for-masquerade";
pub(crate) const CLUSTER_IPS_CHECK: &str = "cluster-ips-check";
pub(crate) const SERVICE_ENDPOINTS_CHECK: &str = "service-endpoints-check";
pub(crate) const NODEPORT_ENDPOINTS_CHECK: &str = "nodeport-endpoints-check";
pub(crate) const FIREWALL_CHECK: &str = "firewall-check";
pub(crate) const REJECT_CHAIN: &str = "reject-chain";
/// The set of node addresses that accept NodePorts (absent when every address does).
pub(crate) const NODEPORT_IPS: &str = "nodeport-ips";

/// The shared sets and maps that service ports put elements in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Store {
    ClusterIps,
    ServiceIps,
    FirewallIps,
    NoEndpointServices,
    NoEndpointNodePorts,
    ServiceNodePorts,
    /// 1.36+.
    HairpinConnections,
}

impl Store {
    pub const ALL: [Store; 7] = [
        Store::ClusterIps,
        Store::ServiceIps,
        Store::FirewallIps,
        Store::NoEndpointServices,
        Store::NoEndpointNodePorts,
        Store::ServiceNodePorts,
        Store::HairpinConnections,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Store::ClusterIps => "cluster-ips",
            Store::ServiceIps => "service-ips",
            Store::FirewallIps => "firewall-ips",
            Store::NoEndpointServices => "no-endpoint-services",
            Store::NoEndpointNodePorts => "no-endpoint-nodeports",
            Store::ServiceNodePorts => "service-nodeports",
            Store::HairpinConnections => "hairpin-connections",
        }
    }

    pub fn kind(self) -> SetKind {
        match self {
            Store::ClusterIps | Store::HairpinConnections => SetKind::Set,
            _ => SetKind::Map,
        }
    }

    pub(crate) fn index(self) -> usize {
        self as usize
    }

    /// Whether `release` has this store.
    fn exists_in(self, features: &Features) -> bool {
        self != Store::HairpinConnections || !features.release.nft_has_mark_for_masquerade_chain()
    }

    /// Its declaration, as upstream writes it.
    fn declaration(self, family: Family) -> Set {
        let addr = family.addr_type();
        let (set_type, comment) = match self {
            Store::ClusterIps => (addr.to_string(), "Active ClusterIPs"),
            Store::ServiceIps => (
                format!("{addr} . inet_proto . inet_service : verdict"),
                "ClusterIP, ExternalIP and LoadBalancer IP traffic",
            ),
            Store::FirewallIps => (
                format!("{addr} . inet_proto . inet_service : verdict"),
                "destinations that are subject to LoadBalancerSourceRanges",
            ),
            Store::NoEndpointServices => (
                format!("{addr} . inet_proto . inet_service : verdict"),
                "vmap to drop or reject packets to services with no endpoints",
            ),
            Store::NoEndpointNodePorts => (
                "inet_proto . inet_service : verdict".to_string(),
                "vmap to drop or reject packets to service nodeports with no endpoints",
            ),
            Store::ServiceNodePorts => ("inet_proto . inet_service : verdict".to_string(), "NodePort traffic"),
            Store::HairpinConnections => {
                (format!("{addr} . {addr} . inet_proto . inet_service"), "service hairpin connections")
            }
        };
        Set {
            kind: self.kind(),
            name: self.name().to_string(),
            set_type,
            flags: Vec::new(),
            timeout_secs: None,
            comment: Some(comment.to_string()),
        }
    }
}

/// Settings that shape the table; fixed for the life of a proxier.
#[derive(Debug, Clone)]
pub struct NftRenderConfig {
    pub family: IpFamily,
    /// Masquerade all traffic sent to cluster IPs.
    pub masquerade_all: bool,
    /// `0x00004000`-style mark (Go's `%#08x` of `1 << masqueradeBit`; upstream's tests use
    /// `0x4000`).
    pub masquerade_mark: String,
    pub local_detector: LocalDetector,
    /// The node's IP of this family: a load-balancer source range that holds it admits the
    /// load-balancer IPs themselves.
    pub node_ip: Option<IpAddr>,
    pub node_port_addresses: NodePortAddresses,
    /// The upstream release emulated and its feature gates.
    pub features: Features,
}

impl NftRenderConfig {
    pub fn family(&self) -> Family {
        Family::from(self.family)
    }

    /// `ip` or `ip6`.
    fn ip(&self) -> &'static str {
        self.family().addr_selector()
    }

    /// The statement that marks a packet for masquerading: a jump to `mark-for-masquerade`
    /// up to 1.35, the mark itself from 1.36.
    fn masquerade(&self) -> String {
        if self.features.release.nft_has_mark_for_masquerade_chain() {
            format!("jump {MARK_FOR_MASQUERADE}")
        } else {
            format!("mark set mark or {}", self.masquerade_mark)
        }
    }

    /// `ip daddr != 127.0.0.0/8` or `ip6 daddr != ::1`.
    fn not_localhost(&self) -> &'static str {
        match self.family {
            IpFamily::V4 => "ip daddr != 127.0.0.0/8",
            IpFamily::V6 => "ip6 daddr != ::1",
        }
    }
}

/// A rule: its text (what follows the chain name) and comment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuleSpec {
    pub text: String,
    pub comment: Option<&'static str>,
}

impl RuleSpec {
    fn new(text: impl Into<String>) -> RuleSpec {
        RuleSpec { text: text.into(), comment: None }
    }

    fn commented(text: impl Into<String>, comment: &'static str) -> RuleSpec {
        RuleSpec { text: text.into(), comment: Some(comment) }
    }
}

/// A per-service chain and its rules.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChainSpec {
    pub name: String,
    pub rules: Vec<RuleSpec>,
}

/// A ClientIP affinity set of one endpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AffinitySet {
    pub name: String,
    pub timeout_secs: u64,
}

impl AffinitySet {
    /// Its declaration: `{ type ipv4_addr ; flags dynamic,timeout ; timeout Ns ; }`.
    pub fn declaration(&self, family: Family) -> Set {
        Set {
            kind: SetKind::Set,
            name: self.name.clone(),
            set_type: family.addr_type().to_string(),
            flags: vec!["dynamic".into(), "timeout".into()],
            timeout_secs: Some(self.timeout_secs),
            comment: None,
        }
    }
}

/// An element a service port puts in a shared set or map. `key` (and a map's `value`) are
/// the parts joined with ` . `, as upstream compares them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ElementSpec {
    pub store: Store,
    pub key: String,
    pub value: Option<String>,
    pub comment: Option<String>,
}

/// What one service port contributes to the table.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Fragment {
    /// Its chains, each created before any rule jumps to it when added in this order.
    pub chains: Vec<ChainSpec>,
    pub affinity_sets: Vec<AffinitySet>,
    pub elements: Vec<ElementSpec>,
    /// Internal (resp. external) traffic policy Local without a local endpoint, while the
    /// service has endpoints elsewhere (upstream's no-local-endpoints metric).
    pub no_local_endpoints_internal: bool,
    pub no_local_endpoints_external: bool,
}

/// nft limits comments to 128 bytes (knftables' `CommentLengthMax`).
const COMMENT_LENGTH_MAX: usize = 128;

/// The element comment of a service port: its `ns/name:port`, cut to 128 bytes as 1.37
/// does. Earlier releases write it whole, and `nft` then refuses the whole transaction (a
/// namespace, name and port name of 63, 63 and 15 bytes make 143); every release cuts it
/// here so that one Service with long names cannot cost every other its rules.
fn element_comment(name: &str) -> String {
    let mut end = name.len().min(COMMENT_LENGTH_MAX);
    while !name.is_char_boundary(end) {
        end -= 1;
    }
    name[..end].to_string()
}

fn elem(store: Store, key: String, value: Option<String>, comment: Option<&str>) -> ElementSpec {
    ElementSpec { store, key, value, comment: comment.map(element_comment) }
}

/// Renders what `svc` with `endpoints` (the endpoints map's list: sorted by endpoint string)
/// contributes to the table.
pub fn fragment(
    cfg: &NftRenderConfig,
    svc: &ServicePortInfo,
    endpoints: &[EndpointRef],
    node_labels: &BTreeMap<String, String>,
) -> Fragment {
    let release = cfg.features.release;
    let ip = cfg.ip();
    let proto = svc.protocol.lower();
    let port = svc.port;
    let chains = ServicePortChains::new(&svc.name);
    let cat = categorize_endpoints(endpoints, svc, &cfg.features, node_labels);
    let has_endpoints = cat.has_any_endpoints;
    let affinity = svc.sticky_seconds;
    let mark_chains = release.nft_has_mark_for_masquerade_chain();
    let masquerade = cfg.masquerade();

    let uses_cluster = !cat.cluster.is_empty() && svc.uses_cluster_endpoints();
    let uses_local = !cat.local.is_empty() && svc.uses_local_endpoints();
    let (internal_chain, has_internal) = if svc.internal_policy_local {
        (&chains.local, has_endpoints && !cat.local.is_empty())
    } else {
        (&chains.cluster, has_endpoints)
    };
    let (external_policy_chain, has_external) = if svc.external_policy_local {
        (&chains.local, has_endpoints && !cat.local.is_empty())
    } else {
        (&chains.cluster, has_endpoints)
    };
    let uses_external = has_endpoints && svc.externally_accessible();
    let uses_firewall = !svc.load_balancer_ips.is_empty() && !svc.load_balancer_source_ranges.is_empty();
    let (internal_verdict, external_verdict) =
        if has_endpoints { ("drop", "drop") } else { ("goto reject-chain", "goto reject-chain") };

    let mut out = Fragment {
        no_local_endpoints_internal: has_endpoints && !has_internal,
        no_local_endpoints_external: has_endpoints && !has_external,
        ..Fragment::default()
    };

    // Endpoint chains: for every reachable endpoint up to 1.35; from 1.36 only with ClientIP
    // affinity, other services DNAT through a map in their service chain.
    let endpoint_chains = !release.nft_dnat_maps() || affinity.is_some();
    let reachable: Vec<(&EndpointRef, Option<EndpointNames>)> = cat
        .all_reachable
        .iter()
        .map(|ep| (*ep, endpoint_chains.then(|| EndpointNames::new(&svc.name, ep.ip(), ep.port))))
        .collect();
    // The Cluster and Local sets are subsets of the reachable one, by endpoint string.
    let by_endpoint: HashMap<&str, usize> = if endpoint_chains {
        reachable.iter().enumerate().map(|(i, (ep, _))| (ep.endpoint.as_str(), i)).collect()
    } else {
        HashMap::new()
    };
    let names_of = |ep: &EndpointRef| -> Option<&EndpointNames> {
        by_endpoint.get(ep.endpoint.as_str()).and_then(|&i| reachable[i].1.as_ref())
    };

    // Elements, in upstream's order.
    if !mark_chains {
        for (ep, _) in &reachable {
            if ep.is_local {
                let ep_ip = ep.ip();
                out.elements.push(elem(
                    Store::HairpinConnections,
                    format!("{ep_ip} . {ep_ip} . {proto} . {}", ep.port),
                    None,
                    None,
                ));
            }
        }
    }
    let name = svc.name_string.as_str();
    let cip = &svc.cluster_ip;
    out.elements.push(elem(Store::ClusterIps, cip.clone(), None, None));
    if has_internal {
        out.elements.push(elem(
            Store::ServiceIps,
            format!("{cip} . {proto} . {port}"),
            Some(format!("goto {internal_chain}")),
            None,
        ));
    } else {
        out.elements.push(elem(
            Store::NoEndpointServices,
            format!("{cip} . {proto} . {port}"),
            Some(internal_verdict.to_string()),
            Some(name),
        ));
    }
    for eip in &svc.external_ips {
        if has_endpoints {
            out.elements.push(elem(
                Store::ServiceIps,
                format!("{eip} . {proto} . {port}"),
                Some(format!("goto {}", chains.external)),
                None,
            ));
        }
        if !has_external {
            out.elements.push(elem(
                Store::NoEndpointServices,
                format!("{eip} . {proto} . {port}"),
                Some(external_verdict.to_string()),
                Some(name),
            ));
        }
    }
    for lb in &svc.load_balancer_ips {
        if has_endpoints {
            out.elements.push(elem(
                Store::ServiceIps,
                format!("{lb} . {proto} . {port}"),
                Some(format!("goto {}", chains.external)),
                None,
            ));
        }
        if uses_firewall {
            out.elements.push(elem(
                Store::FirewallIps,
                format!("{lb} . {proto} . {port}"),
                Some(format!("goto {}", chains.firewall)),
                None,
            ));
        }
    }
    if !has_external {
        for lb in &svc.load_balancer_ips {
            out.elements.push(elem(
                Store::NoEndpointServices,
                format!("{lb} . {proto} . {port}"),
                Some(external_verdict.to_string()),
                Some(name),
            ));
        }
    }
    if svc.node_port != 0 {
        let node_port = svc.node_port;
        if has_endpoints {
            out.elements.push(elem(
                Store::ServiceNodePorts,
                format!("{proto} . {node_port}"),
                Some(format!("goto {}", chains.external)),
                None,
            ));
        }
        if !has_external {
            out.elements.push(elem(
                Store::NoEndpointNodePorts,
                format!("{proto} . {node_port}"),
                Some(external_verdict.to_string()),
                Some(name),
            ));
        }
    }

    // Chains: endpoint chains first (policy chains jump to them), then the policy chains,
    // the external chain (it goes to the policy chains) and the firewall chain.
    let mut cluster_rules = Vec::new();
    let mut local_rules = Vec::new();
    if has_internal && mark_chains {
        let port_match = if release.nft_cluster_ip_masquerade_matches_port() {
            format!(" {proto} dport {port}")
        } else {
            String::new()
        };
        let rule = if cfg.masquerade_all {
            Some(format!("{ip} daddr {cip}{port_match} {masquerade}"))
        } else if cfg.local_detector.is_implemented() {
            Some(format!("{ip} daddr {cip}{port_match} {} {masquerade}", cfg.local_detector.if_not_local_nft()))
        } else {
            None
        };
        if let Some(rule) = rule {
            let target = if svc.internal_policy_local { &mut local_rules } else { &mut cluster_rules };
            target.push(RuleSpec::new(rule));
        }
    }
    for (used, rules, eps) in
        [(uses_cluster, &mut cluster_rules, &cat.cluster), (uses_local, &mut local_rules, &cat.local)]
    {
        if !used {
            continue;
        }
        if endpoint_chains {
            // Jumps to endpoint chains: affinity first, then a random pick.
            let mut vmap = Vec::with_capacity(eps.len());
            for (i, ep) in eps.iter().enumerate() {
                let Some(n) = names_of(ep) else { continue };
                if affinity.is_some() {
                    rules.push(RuleSpec::new(format!("{ip} saddr @{} goto {}", n.affinity_set, n.chain)));
                }
                vmap.push(format!("{i} : goto {}", n.chain));
            }
            rules.push(RuleSpec::new(format!("numgen random mod {} vmap {{ {} }}", eps.len(), vmap.join(" , "))));
        } else {
            let targets: Vec<String> =
                eps.iter().enumerate().map(|(i, ep)| format!("{i} : {} . {}", ep.ip(), ep.port)).collect();
            rules.push(RuleSpec::new(format!(
                "meta l4proto {proto} dnat {ip} addr . port to numgen random mod {} map {{ {} }}",
                eps.len(),
                targets.join(" , ")
            )));
        }
    }

    if endpoint_chains {
        for (ep, n) in &reachable {
            let Some(n) = n else { continue };
            let mut rules = Vec::with_capacity(3);
            if mark_chains {
                rules.push(RuleSpec::new(format!("{ip} saddr {} {masquerade}", ep.ip())));
            }
            if affinity.is_some() {
                rules.push(RuleSpec::new(format!("update @{} {{ {ip} saddr }}", n.affinity_set)));
            }
            rules.push(RuleSpec::new(format!("meta l4proto {proto} dnat to {}", names::dnat_target(ep.ip(), ep.port))));
            out.chains.push(ChainSpec { name: n.chain.clone(), rules });
        }
    }
    if uses_cluster {
        out.chains.push(ChainSpec { name: chains.cluster.clone(), rules: cluster_rules });
    }
    if uses_local {
        out.chains.push(ChainSpec { name: chains.local.clone(), rules: local_rules });
    }
    if uses_external {
        let mut rules = Vec::with_capacity(4);
        if !svc.external_policy_local {
            if mark_chains {
                rules.push(RuleSpec::new(masquerade.clone()));
            } else {
                rules.push(RuleSpec::commented(masquerade.clone(), "masquerade"));
            }
        } else {
            if cfg.local_detector.is_implemented() {
                rules.push(RuleSpec::commented(
                    format!("{} goto {}", cfg.local_detector.if_local_nft(), chains.cluster),
                    "short-circuit pod traffic",
                ));
            }
            rules.push(RuleSpec::commented(format!("fib saddr type local {masquerade}"), "masquerade local traffic"));
            rules.push(RuleSpec::commented(
                format!("fib saddr type local goto {}", chains.cluster),
                "short-circuit local traffic",
            ));
        }
        if has_external {
            rules.push(RuleSpec::new(format!("goto {external_policy_chain}")));
        }
        out.chains.push(ChainSpec { name: chains.external.clone(), rules });
    }
    if uses_firewall {
        let mut sources: Vec<String> = Vec::new();
        let mut allow_from_node = false;
        for range in &svc.load_balancer_source_ranges {
            sources.push(range.text.clone());
            if let (Some(cidr), Some(node_ip)) = (&range.cidr, &cfg.node_ip)
                && cidr.contains(node_ip)
            {
                allow_from_node = true;
            }
        }
        if allow_from_node {
            sources.extend(svc.load_balancer_ips.iter().cloned());
        }
        out.chains.push(ChainSpec {
            name: chains.firewall.clone(),
            rules: vec![RuleSpec::new(format!("{ip} saddr != {{ {} }} drop", sources.join(" , ")))],
        });
    }

    if let Some(seconds) = affinity {
        for (_, n) in &reachable {
            if let Some(n) = n {
                out.affinity_sets.push(AffinitySet {
                    name: n.affinity_set.clone(),
                    timeout_secs: u64::try_from(seconds).unwrap_or(0),
                });
            }
        }
    }
    out
}

/// A fixed chain and its rules.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BaseChainSpec {
    pub chain: Chain,
    pub rules: Vec<RuleSpec>,
}

/// The table's fixed objects, as a full sync writes them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BaseTable {
    /// Base chains first (in upstream's order), then the regular ones.
    pub chains: Vec<BaseChainSpec>,
    /// The sets and maps, the element stores of this release included.
    pub sets: Vec<Set>,
    /// `nodeport-ips` is absent when every local address accepts NodePorts.
    pub nodeport_ips: Option<Vec<String>>,
}

impl BaseTable {
    /// The element stores this release has.
    pub fn stores(features: &Features) -> impl Iterator<Item = Store> + '_ {
        Store::ALL.into_iter().filter(|s| s.exists_in(features))
    }
}

/// What a full sync's fixed objects depend on besides the configuration.
#[derive(Debug, Clone, Copy)]
pub struct BaseInput<'a> {
    /// The ServiceCIDRs of this family, sorted (the `Drop traffic to unallocated
    /// ClusterIPs` rule; none: no rule).
    pub service_cidrs: &'a [String],
    /// The host's interface addresses (for nodePortAddresses that do not match all).
    pub interface_addrs: &'a [IpAddr],
}

fn base_chain(name: &str, chain_type: ChainType, hook: Hook, priority: i32) -> BaseChainSpec {
    BaseChainSpec {
        chain: Chain { name: name.to_string(), base: Some(BaseChain { chain_type, hook, priority }), comment: None },
        rules: Vec::new(),
    }
}

fn regular_chain(name: &str) -> BaseChainSpec {
    BaseChainSpec { chain: Chain::regular(name), rules: Vec::new() }
}

/// The fixed objects of the table (upstream's `setupNFTables`).
pub fn base_table(cfg: &NftRenderConfig, input: &BaseInput<'_>) -> BaseTable {
    let release = cfg.features.release;
    let ip = cfg.ip();
    let mark = &cfg.masquerade_mark;
    let pre_dnat = release.nft_pre_dnat_filter_chains();
    let mark_chains = release.nft_has_mark_for_masquerade_chain();
    let match_all = cfg.node_port_addresses.match_all();

    let mut chains: Vec<BaseChainSpec> = if pre_dnat {
        vec![
            base_chain(FILTER_PREROUTING_PRE_DNAT, ChainType::Filter, Hook::Prerouting, -110),
            base_chain(FILTER_OUTPUT_PRE_DNAT, ChainType::Filter, Hook::Output, -110),
            base_chain(FILTER_INPUT, ChainType::Filter, Hook::Input, 0),
            base_chain(FILTER_FORWARD, ChainType::Filter, Hook::Forward, 0),
            base_chain(FILTER_OUTPUT, ChainType::Filter, Hook::Output, 0),
        ]
    } else {
        vec![
            base_chain(FILTER_PREROUTING, ChainType::Filter, Hook::Prerouting, -110),
            base_chain(FILTER_INPUT, ChainType::Filter, Hook::Input, -110),
            base_chain(FILTER_FORWARD, ChainType::Filter, Hook::Forward, -110),
            base_chain(FILTER_OUTPUT, ChainType::Filter, Hook::Output, -110),
            base_chain(FILTER_OUTPUT_POST_DNAT, ChainType::Filter, Hook::Output, -90),
        ]
    };
    chains.extend([
        base_chain(NAT_PREROUTING, ChainType::Nat, Hook::Prerouting, -100),
        base_chain(NAT_OUTPUT, ChainType::Nat, Hook::Output, -100),
        base_chain(NAT_POSTROUTING, ChainType::Nat, Hook::Postrouting, 100),
    ]);

    // The jumps from the base chains (upstream's nftablesJumpChains), in order.
    let (firewall_from, cluster_ips_check_from) = if pre_dnat {
        ([FILTER_PREROUTING_PRE_DNAT, FILTER_OUTPUT_PRE_DNAT], FILTER_OUTPUT)
    } else {
        ([FILTER_PREROUTING, FILTER_OUTPUT], FILTER_OUTPUT_POST_DNAT)
    };
    let jumps: [(&str, &str, bool); 11] = [
        (NODEPORT_ENDPOINTS_CHECK, FILTER_INPUT, true),
        (SERVICE_ENDPOINTS_CHECK, FILTER_INPUT, true),
        (SERVICE_ENDPOINTS_CHECK, FILTER_FORWARD, true),
        (SERVICE_ENDPOINTS_CHECK, FILTER_OUTPUT, true),
        (FIREWALL_CHECK, firewall_from[0], true),
        (FIREWALL_CHECK, firewall_from[1], true),
        (SERVICES, NAT_OUTPUT, false),
        (SERVICES, NAT_PREROUTING, false),
        (MASQUERADING, NAT_POSTROUTING, false),
        (CLUSTER_IPS_CHECK, FILTER_FORWARD, true),
        (CLUSTER_IPS_CHECK, cluster_ips_check_from, true),
    ];
    let mut regular: Vec<BaseChainSpec> = Vec::new();
    let ensure = |regular: &mut Vec<BaseChainSpec>, name: &str| {
        if !regular.iter().any(|c| c.chain.name == name) {
            regular.push(regular_chain(name));
        }
    };
    for (dst, src, ct_new) in jumps {
        ensure(&mut regular, dst);
        let text = if ct_new { format!("ct state new jump {dst}") } else { format!("jump {dst}") };
        if let Some(c) = chains.iter_mut().find(|c| c.chain.name == src) {
            c.rules.push(RuleSpec::new(text));
        }
    }
    if mark_chains {
        ensure(&mut regular, MARK_FOR_MASQUERADE);
    }
    regular.push(BaseChainSpec {
        chain: Chain {
            name: REJECT_CHAIN.to_string(),
            base: None,
            comment: Some("helper for @no-endpoint-services / @no-endpoint-nodeports".to_string()),
        },
        rules: vec![RuleSpec::new("reject")],
    });
    let mut rules_of = |name: &str, rules: Vec<RuleSpec>| {
        if let Some(c) = regular.iter_mut().find(|c| c.chain.name == name) {
            c.rules.extend(rules);
        }
    };

    if mark_chains {
        rules_of(MARK_FOR_MASQUERADE, vec![RuleSpec::new(format!("mark set mark or {mark}"))]);
        rules_of(
            MASQUERADING,
            vec![
                RuleSpec::new(format!("mark and {mark} == 0 return")),
                RuleSpec::new(format!("mark set mark xor {mark}")),
                RuleSpec::new("masquerade fully-random"),
            ],
        );
    } else {
        rules_of(
            MASQUERADING,
            vec![
                RuleSpec::new(format!("mark and {mark} != 0 mark set mark xor {mark} masquerade fully-random")),
                RuleSpec::new(format!(
                    "ct status dnat {ip} saddr . {ip} daddr . meta l4proto . th dport @{} masquerade fully-random",
                    Store::HairpinConnections.name()
                )),
            ],
        );
    }

    let mut check = vec![RuleSpec::commented(
        format!("{ip} daddr @{} reject", Store::ClusterIps.name()),
        "Reject traffic to invalid ports of ClusterIPs",
    )];
    if !input.service_cidrs.is_empty() {
        check.push(RuleSpec::commented(
            format!("{ip} daddr {{ {} }} drop", input.service_cidrs.join(",")),
            "Drop traffic to unallocated ClusterIPs",
        ));
    }
    rules_of(CLUSTER_IPS_CHECK, check);

    rules_of(
        SERVICE_ENDPOINTS_CHECK,
        vec![RuleSpec::new(format!("{ip} daddr . meta l4proto . th dport vmap @{}", Store::NoEndpointServices.name()))],
    );
    let nodeport_dest = if match_all { cfg.not_localhost().to_string() } else { format!("{ip} daddr @{NODEPORT_IPS}") };
    rules_of(
        NODEPORT_ENDPOINTS_CHECK,
        vec![RuleSpec::new(format!(
            "{nodeport_dest} meta l4proto . th dport vmap @{}",
            Store::NoEndpointNodePorts.name()
        ))],
    );
    rules_of(
        FIREWALL_CHECK,
        vec![RuleSpec::new(format!("{ip} daddr . meta l4proto . th dport vmap @{}", Store::FirewallIps.name()))],
    );

    let mut services = Vec::with_capacity(3);
    if !mark_chains {
        if cfg.masquerade_all {
            services.push(RuleSpec::commented(
                format!("{ip} daddr @{} mark set mark or {mark}", Store::ClusterIps.name()),
                "masquerade all clusterIP traffic",
            ));
        } else if cfg.local_detector.is_implemented() {
            services.push(RuleSpec::commented(
                format!(
                    "{ip} daddr @{} {} mark set mark or {mark}",
                    Store::ClusterIps.name(),
                    cfg.local_detector.if_not_local_nft()
                ),
                "masquerade clusterIP traffic from outside cluster",
            ));
        }
    }
    services.push(RuleSpec::new(format!("{ip} daddr . meta l4proto . th dport vmap @{}", Store::ServiceIps.name())));
    if match_all {
        services.push(RuleSpec::new(format!(
            "fib daddr type local {} meta l4proto . th dport vmap @{}",
            cfg.not_localhost(),
            Store::ServiceNodePorts.name()
        )));
    } else {
        services.push(RuleSpec::new(format!(
            "{ip} daddr @{NODEPORT_IPS} meta l4proto . th dport vmap @{}",
            Store::ServiceNodePorts.name()
        )));
    }
    rules_of(SERVICES, services);
    chains.extend(regular);

    let mut sets: Vec<Set> = Vec::new();
    let family = cfg.family();
    for store in BaseTable::stores(&cfg.features) {
        sets.push(store.declaration(family));
    }
    let nodeport_ips = if match_all {
        None
    } else {
        sets.push(Set {
            kind: SetKind::Set,
            name: NODEPORT_IPS.to_string(),
            set_type: family.addr_type().to_string(),
            flags: Vec::new(),
            timeout_secs: None,
            comment: Some("IPs that accept NodePort traffic".to_string()),
        });
        let mut ips = Vec::new();
        for addr in cfg.node_port_addresses.node_ips(input.interface_addrs) {
            if IpFamily::of(&addr) != cfg.family {
                continue;
            }
            if addr.is_loopback() {
                tracing::error!("--nodeport-addresses includes localhost but localhost NodePorts are not supported");
                continue;
            }
            let text = format_ip(&addr);
            if !ips.contains(&text) {
                ips.push(text);
            }
        }
        Some(ips)
    };
    BaseTable { chains, sets, nodeport_ips }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compat::Release;
    use crate::model::Cidr;

    fn cfg(release: Release) -> NftRenderConfig {
        NftRenderConfig {
            family: IpFamily::V4,
            masquerade_all: false,
            masquerade_mark: "0x4000".into(),
            local_detector: LocalDetector::Cidr(Cidr::parse_sloppy("10.0.0.0/8").unwrap()),
            node_ip: Some("192.168.0.2".parse().unwrap()),
            node_port_addresses: NodePortAddresses::new(IpFamily::V4, &["192.168.0.2/32".to_string()]),
            features: Features::of(release),
        }
    }

    #[test]
    fn element_comments_are_cut_to_128_bytes() {
        let long = format!("{}/{}:{}", "n".repeat(63), "s".repeat(63), "p".repeat(15));
        assert_eq!(element_comment(&long).len(), 128);
        assert_eq!(element_comment("ns1/svc1:p80"), "ns1/svc1:p80");
    }

    #[test]
    fn base_table_names_nodeport_ips_only_without_match_all() {
        let addrs: Vec<IpAddr> =
            ["127.0.0.1", "192.168.0.2", "192.168.1.2"].iter().map(|a| a.parse().unwrap()).collect();
        let input = BaseInput { service_cidrs: &[], interface_addrs: &addrs };
        let base = base_table(&cfg(Release::V1_34), &input);
        assert_eq!(base.nodeport_ips, Some(vec!["192.168.0.2".to_string()]));
        let mut all = cfg(Release::V1_34);
        all.node_port_addresses = NodePortAddresses::new(IpFamily::V4, &[]);
        let base = base_table(&all, &input);
        assert_eq!(base.nodeport_ips, None);
        assert!(!base.sets.iter().any(|s| s.name == NODEPORT_IPS));
        let services = base.chains.iter().find(|c| c.chain.name == SERVICES).unwrap();
        assert_eq!(
            services.rules.last().unwrap().text,
            "fib daddr type local ip daddr != 127.0.0.0/8 meta l4proto . th dport vmap @service-nodeports"
        );
    }
}
