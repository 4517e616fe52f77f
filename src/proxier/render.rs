//! The renderer: service and endpoint maps in, `iptables-restore` input out. Pure: no I/O,
//! no clock, no logging per rule.
//!
//! The rule text, and which rules exist, follow upstream kube-proxy's `syncProxyRules` (1.29)
//! exactly. The document is laid out in the canonical order upstream's own tests normalise to
//! (tables by name; `KUBE-NODEPORTS`, `KUBE-SERVICES`, then the other chains by name; all chain
//! lines, then each chain's rules, then `-X` lines), with services taken in order of their
//! `ns/name:port` string. That makes the output deterministic and diffable, and identical to
//! upstream's fixtures, while being exactly equivalent for iptables-restore.
//!
//! Partial syncs (`RenderInput::changed` set) rewrite only the chains of changed services and,
//! going beyond upstream, only those top-level chains whose content changed since the last
//! successful sync ([`RenderState`]).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt::Write as _;
use std::net::IpAddr;

use crate::compat::Features;
use crate::model::chains::{self, ChainKey, ChainName, KeySet, NatChains, chain_name};
use crate::model::{
    EndpointInfo, EndpointRef, IpFamily, NamespacedName, ServicePortInfo, ServicePortName, ServicePortRef,
};
use crate::node::nfacct::{self, NfacctCounters};
use crate::proxier::local_detect::LocalDetector;
use crate::proxier::nodeport_addresses::NodePortAddresses;
use crate::tracker::topology::categorize_endpoints;
use crate::tracker::{EndpointsMap, ServicePortMap};

/// Above this many endpoints (over all services) rules lose their per-endpoint comments and
/// stale chains are cleaned up at most once per sync period, as upstream does.
pub const LARGE_CLUSTER_ENDPOINTS_THRESHOLD: usize = 1000;

/// Settings that shape the rules; fixed for the life of a proxier.
#[derive(Debug, Clone)]
pub struct RenderConfig {
    pub family: IpFamily,
    /// SNAT all traffic sent to cluster IPs.
    pub masquerade_all: bool,
    /// `0x00004000`-style mark (Go's `%#08x` of `1 << masqueradeBit`).
    pub masquerade_mark: String,
    /// Effective setting: already false when nodePortAddresses excludes 127.0.0.0/8.
    pub localhost_nodeports: bool,
    pub local_detector: LocalDetector,
    /// The node's IP of this family; decides whether LB source ranges admit the node.
    pub node_ip: Option<IpAddr>,
    pub node_port_addresses: NodePortAddresses,
    /// MASQUERADE supports `--random-fully` (iptables 1.6.2 and later).
    pub random_fully: bool,
    /// `nf_conntrack_tcp_be_liberal` is set: no INVALID-drop rule.
    pub conntrack_tcp_liberal: bool,
    /// The upstream release emulated and its feature gates.
    pub features: Features,
}

/// One sync's view of the world.
#[derive(Debug, Clone, Copy)]
pub struct RenderInput<'a> {
    pub services: &'a ServicePortMap,
    pub endpoints: &'a EndpointsMap,
    /// Labels of this node (for the topology zone).
    pub node_labels: &'a BTreeMap<String, String>,
    /// The host's interface addresses, used when nodePortAddresses does not match all.
    pub interface_addrs: &'a [IpAddr],
    /// `None` for a full sync; for a partial sync, the services whose chains must be rewritten.
    pub changed: Option<&'a HashSet<NamespacedName>>,
    /// The per-service nat chains the kernel holds, when stale chains are to be cleaned up.
    pub existing_nat_chains: Option<&'a NatChains>,
    /// The accounting objects the rules may name (none before 1.31).
    pub nfacct: NfacctCounters,
}

/// Top-level chain contents as last written successfully, so a partial sync can leave the
/// unchanged ones out of its restore input.
#[derive(Debug, Default, Clone)]
pub struct RenderState {
    written: HashMap<&'static str, String>,
    /// nat rules in each service port's own chains as last written, so a partial sync can
    /// count (for metrics) the rules of services it does not rewrite without rendering them.
    service_rules: HashMap<ServicePortName, usize>,
    /// Large-cluster mode of the last sync: when it flips, every service is rewritten so
    /// comments are consistent (upstream leaves unchanged services as they were).
    large_cluster_mode: Option<bool>,
}

impl RenderState {
    /// Records what a successful restore of `rendered` put in place.
    pub fn commit(&mut self, rendered: &mut Rendered) {
        if rendered.full {
            self.written.clear();
        }
        for (key, body) in rendered.top_level.drain(..) {
            self.written.insert(key, body);
        }
        self.service_rules = std::mem::take(&mut rendered.service_rules);
        self.large_cluster_mode = Some(rendered.stats.large_cluster_mode);
    }

    /// Forgets everything: the next render writes every chain.
    pub fn reset(&mut self) {
        *self = RenderState::default();
    }
}

/// Counts reported with each render (metrics and logs).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RenderStats {
    pub services: usize,
    pub endpoints: usize,
    pub large_cluster_mode: bool,
    /// Rule lines in the restore input, per table (`-X` lines count as nat rules, as
    /// upstream's line buffer counts them).
    pub filter_rules: usize,
    pub nat_rules: usize,
    pub filter_chains: usize,
    pub nat_chains: usize,
    /// nat rules that exist after this sync, including those of chains not rewritten
    /// (upstream's `sync_proxy_rules_iptables_total{table="nat"}`).
    pub nat_rules_total: usize,
    /// filter rules that exist after this sync.
    pub filter_rules_total: usize,
    pub deleted_chains: usize,
    /// Services whose internal (resp. external) traffic policy is Local with no local endpoint.
    pub no_local_endpoints_internal: usize,
    pub no_local_endpoints_external: usize,
}

/// The result of one render.
#[derive(Debug, Clone)]
pub struct Rendered {
    /// The `iptables-restore` input (for `--noflush`).
    pub payload: String,
    pub full: bool,
    pub stats: RenderStats,
    /// Top-level chains written in this payload, keyed `table/chain`, with their rules.
    top_level: Vec<(&'static str, String)>,
    service_rules: HashMap<ServicePortName, usize>,
    /// Every per-service nat chain this state uses, written now or before.
    pub active_nat_chains: KeySet,
}

/// Total endpoints of the services in the map: decides large-cluster mode.
pub fn total_endpoints(services: &ServicePortMap, endpoints: &EndpointsMap) -> usize {
    services.keys().map(|name| endpoints.get(name).map_or(0, Vec::len)).sum()
}

/// Renders the filter and nat tables.
pub fn render(cfg: &RenderConfig, input: &RenderInput<'_>, state: &RenderState) -> Rendered {
    let mut r = Renderer::new(cfg, input, state);
    r.run();
    r.finish(state)
}

/// One per-service nat chain written by this render: its name (as a key) and where its
/// rules come from.
struct ChainSpan<'a> {
    /// The name's first 16 bytes, big-endian: sorting by this (then by name) is sorting by
    /// name, with integer compares for all but near-ties.
    sort: u128,
    /// Spelled out once: it is written twice (chain line and rules) and breaks sort ties.
    name: ChainName,
    body: SpanBody<'a>,
}

enum SpanBody<'a> {
    /// Rules already rendered into the shared arena.
    Arena { start: usize, end: usize, rules: usize },
    /// A KUBE-SEP- chain, rendered straight into the payload when it is assembled: these
    /// are most of the payload, and rendering them twice (arena, then payload) would hold
    /// two copies of it at once.
    Endpoint { svc: &'a ServicePortInfo, ep: &'a EndpointInfo },
}

impl<'a> ChainSpan<'a> {
    /// The rules from `start` to the end of `arena`, for chain `name` (one of `svc.chains`).
    fn arena(name: &str, key: ChainKey, arena: &str, start: usize) -> Self {
        debug_assert_eq!(chain_name(key), name);
        let end = arena.len();
        let rules = count_lines(&arena[start..end]);
        ChainSpan { sort: sort_key(name), name: chain_name(key), body: SpanBody::Arena { start, end, rules } }
    }

    fn endpoint(svc: &'a ServicePortInfo, ep: &'a EndpointInfo) -> Self {
        let name = ep.chain_name();
        ChainSpan { sort: sort_key(&name), name, body: SpanBody::Endpoint { svc, ep } }
    }

    fn rules(&self) -> usize {
        match self.body {
            SpanBody::Arena { rules, .. } => rules,
            SpanBody::Endpoint { .. } => ENDPOINT_CHAIN_RULES,
        }
    }
}

/// Rules in every KUBE-SEP- chain: the hairpin masquerade and the DNAT.
const ENDPOINT_CHAIN_RULES: usize = 2;

/// Writes the rules of `ep`'s KUBE-SEP- chain.
fn push_endpoint_chain(out: &mut String, svc: &ServicePortInfo, ep: &EndpointInfo, chain: &str, large: bool) {
    let name = svc.name_string.as_str();
    let dnat_match = match svc.protocol {
        crate::model::Protocol::Tcp => " -m tcp -p tcp -j DNAT --to-destination ",
        crate::model::Protocol::Udp => " -m udp -p udp -j DNAT --to-destination ",
        crate::model::Protocol::Sctp => " -m sctp -p sctp -j DNAT --to-destination ",
    };
    out.push_str("-A ");
    out.push_str(chain);
    if !large {
        out.push_str(" -m comment --comment ");
        out.push_str(name);
    }
    out.push_str(" -s ");
    out.push_str(ep.ip());
    out.push_str(" -j KUBE-MARK-MASQ\n-A ");
    out.push_str(chain);
    if !large {
        out.push_str(" -m comment --comment ");
        out.push_str(name);
    }
    if svc.sticky_seconds.is_some() {
        out.push_str(" -m recent --name ");
        out.push_str(chain);
        out.push_str(" --set");
    }
    out.push_str(dnat_match);
    out.push_str(&ep.endpoint);
    out.push('\n');
}

/// An upper bound of what [`push_endpoint_chain`] writes.
fn endpoint_chain_len(svc: &ServicePortInfo, ep: &EndpointInfo, large: bool) -> usize {
    let comments = if large { 0 } else { 2 * (22 + svc.name_string.len()) };
    let sticky = if svc.sticky_seconds.is_some() { 50 } else { 0 };
    130 + comments + sticky + 2 * ep.endpoint.len()
}

fn sort_key(name: &str) -> u128 {
    let mut bytes = [0u8; 16];
    let n = name.len().min(16);
    bytes[..n].copy_from_slice(&name.as_bytes()[..n]);
    u128::from_be_bytes(bytes)
}

struct Renderer<'a> {
    cfg: &'a RenderConfig,
    input: &'a RenderInput<'a>,
    large: bool,
    // Top-level chain bodies.
    filter_services: String,
    filter_external: String,
    filter_nodeports: String,
    filter_firewall: String,
    nat_services: String,
    nat_nodeports: String,
    // Per-service nat chains: rule text in one arena, spans per chain.
    arena: String,
    spans: Vec<ChainSpan<'a>>,
    /// Upper bound of the bytes the KUBE-SEP- chains will take in the payload.
    endpoint_chain_bytes: usize,
    /// The per-service chains this state needs (whether rewritten or not): they must not be
    /// deleted as stale, and they are what the kernel holds after the restore.
    active: KeySet,
    stale: Vec<String>,
    probabilities: Vec<String>,
    stats: RenderStats,
    skipped_nat_rules: usize,
    state: &'a RenderState,
    /// Write every service's chains (full sync, or large-cluster mode flipped).
    rewrite_all: bool,
    service_rules: HashMap<ServicePortName, usize>,
}

impl<'a> Renderer<'a> {
    fn new(cfg: &'a RenderConfig, input: &'a RenderInput<'a>, state: &'a RenderState) -> Self {
        let total = total_endpoints(input.services, input.endpoints);
        let large = total > LARGE_CLUSTER_ENDPOINTS_THRESHOLD;
        let rewrite_all = input.changed.is_none() || state.large_cluster_mode != Some(large);
        Renderer {
            cfg,
            input,
            large,
            filter_services: String::new(),
            filter_external: String::new(),
            filter_nodeports: String::new(),
            filter_firewall: String::new(),
            nat_services: String::with_capacity(input.services.len() * 160),
            nat_nodeports: String::new(),
            arena: String::with_capacity(total * 100 + input.services.len() * 300),
            spans: Vec::with_capacity(total + input.services.len() * 2),
            endpoint_chain_bytes: 0,
            active: KeySet::with_capacity_and_hasher(total + input.services.len() * 4, Default::default()),
            stale: Vec::new(),
            probabilities: Vec::new(),
            stats: RenderStats {
                services: input.services.len(),
                endpoints: total,
                large_cluster_mode: large,
                ..RenderStats::default()
            },
            skipped_nat_rules: 0,
            state,
            rewrite_all,
            service_rules: HashMap::with_capacity(input.services.len()),
        }
    }

    fn run(&mut self) {
        let mut services: Vec<&'a ServicePortRef> = self.input.services.values().collect();
        // Upstream's normal form orders KUBE-SERVICES and KUBE-NODEPORTS rules by the
        // service's `ns/name` string (the comment up to the first ' ' or ':'), keeping a
        // service's ports in the order written; so: by `ns/name`, then by port name.
        services.sort_unstable_by(|a, b| {
            service_part(&a.name_string)
                .cmp(service_part(&b.name_string))
                .then_with(|| a.name.port.cmp(&b.name.port))
                .then_with(|| a.protocol.cmp(&b.protocol))
        });
        for svc in services {
            self.service(svc);
        }
        self.stale_chains();
        self.nodeports_tail();
    }

    /// Makes sure `probabilities[1..=n]` hold `1/i` as upstream prints it (`%0.10f`).
    fn probability(&mut self, n: usize) {
        for i in self.probabilities.len()..=n {
            self.probabilities.push(if i == 0 { String::new() } else { format!("{:.10}", 1.0 / i as f64) });
        }
    }

    fn service(&mut self, svc: &'a ServicePortInfo) {
        let input = self.input;
        let endpoints: &'a [EndpointRef] = input.endpoints.get(&svc.name).map_or(&[], Vec::as_slice);
        let cat = categorize_endpoints(endpoints, svc, &self.cfg.features, input.node_labels);
        let name = svc.name_string.as_str();
        let proto = svc.protocol.lower();
        let port = svc.port;

        let cluster_chain = svc.chains.cluster_policy.as_str();
        let local_chain = svc.chains.local_policy.as_str();
        let uses_cluster_chain = !cat.cluster.is_empty() && svc.uses_cluster_endpoints();
        let uses_local_chain = !cat.local.is_empty() && svc.uses_local_endpoints();

        let mut internal_chain = cluster_chain;
        let mut has_internal = cat.has_any_endpoints;
        if svc.internal_policy_local {
            internal_chain = local_chain;
            if cat.local.is_empty() {
                has_internal = false;
            }
        }
        let mut external_policy_chain = cluster_chain;
        let mut has_external = cat.has_any_endpoints;
        if svc.external_policy_local {
            external_policy_chain = local_chain;
            if cat.local.is_empty() {
                has_external = false;
            }
        }
        let external_chain = svc.chains.external.as_str();
        let uses_external_chain = cat.has_any_endpoints && svc.externally_accessible();
        let fw_chain = svc.chains.firewall.as_str();
        let uses_fw_chain =
            cat.has_any_endpoints && !svc.load_balancer_ips.is_empty() && svc.filters_load_balancer_sources();
        let lb_chain = if uses_fw_chain { fw_chain } else { external_chain };

        let (internal_target, internal_comment, external_target, external_comment);
        if !cat.has_any_endpoints {
            internal_target = "REJECT";
            internal_comment = format!("\"{name} has no endpoints\"");
            external_target = "REJECT";
            external_comment = internal_comment.clone();
        } else {
            internal_target = "DROP";
            external_target = "DROP";
            internal_comment = format!("\"{name} has no local endpoints\"");
            external_comment = internal_comment.clone();
            if !has_internal {
                self.stats.no_local_endpoints_internal += 1;
            }
            if !has_external {
                self.stats.no_local_endpoints_external += 1;
            }
        }

        // Cluster IP.
        if has_internal {
            let _ = writeln!(
                self.nat_services,
                "-A KUBE-SERVICES -m comment --comment \"{name} cluster IP\" -m {proto} -p {proto} -d {} --dport {port} -j {internal_chain}",
                svc.cluster_ip
            );
        } else {
            let _ = writeln!(
                self.filter_services,
                "-A KUBE-SERVICES -m comment --comment {internal_comment} -m {proto} -p {proto} -d {} --dport {port} -j {internal_target}",
                svc.cluster_ip
            );
        }

        // External IPs.
        for ip in &svc.external_ips {
            if cat.has_any_endpoints {
                let _ = writeln!(
                    self.nat_services,
                    "-A KUBE-SERVICES -m comment --comment \"{name} external IP\" -m {proto} -p {proto} -d {ip} --dport {port} -j {external_chain}"
                );
            }
            if !has_external {
                let _ = writeln!(
                    self.filter_external,
                    "-A KUBE-EXTERNAL-SERVICES -m comment --comment {external_comment} -m {proto} -p {proto} -d {ip} --dport {port} -j {external_target}"
                );
            }
        }

        // Load-balancer IPs.
        for ip in &svc.load_balancer_ips {
            if cat.has_any_endpoints {
                let _ = writeln!(
                    self.nat_services,
                    "-A KUBE-SERVICES -m comment --comment \"{name} loadbalancer IP\" -m {proto} -p {proto} -d {ip} --dport {port} -j {lb_chain}"
                );
            }
            if uses_fw_chain {
                let _ = writeln!(
                    self.filter_firewall,
                    "-A KUBE-PROXY-FIREWALL -m comment --comment \"{name} traffic not accepted by {fw_chain}\" -m {proto} -p {proto} -d {ip} --dport {port} -j DROP"
                );
            }
        }
        if !has_external {
            for ip in &svc.load_balancer_ips {
                let _ = writeln!(
                    self.filter_external,
                    "-A KUBE-EXTERNAL-SERVICES -m comment --comment {external_comment} -m {proto} -p {proto} -d {ip} --dport {port} -j {external_target}"
                );
            }
        }

        // Node port.
        if svc.node_port != 0 {
            let node_port = svc.node_port;
            if cat.has_any_endpoints {
                // 1.31+ counts loopback NodePort traffic first (same target: no traffic change).
                if self.cfg.localhost_nodeports
                    && self.cfg.family == IpFamily::V4
                    && self.input.nfacct.localhost_nodeports_accepted
                {
                    let _ = writeln!(
                        self.nat_nodeports,
                        "-A KUBE-NODEPORTS -m comment --comment {name} -m {proto} -p {proto} -d 127.0.0.0/8 --dport {node_port} -m nfacct --nfacct-name {} -j {external_chain}",
                        nfacct::LOCALHOST_NODEPORTS_ACCEPTED
                    );
                }
                let _ = writeln!(
                    self.nat_nodeports,
                    "-A KUBE-NODEPORTS -m comment --comment {name} -m {proto} -p {proto} --dport {node_port} -j {external_chain}"
                );
            }
            if !has_external {
                let _ = writeln!(
                    self.filter_external,
                    "-A KUBE-EXTERNAL-SERVICES -m comment --comment {external_comment} -m addrtype --dst-type LOCAL -m {proto} -p {proto} --dport {node_port} -j {external_target}"
                );
            }
        }

        // Health check node port: always accepted, local endpoints or not.
        if svc.health_check_node_port != 0 {
            let _ = writeln!(
                self.filter_nodeports,
                "-A KUBE-NODEPORTS -m comment --comment \"{name} health check node port\" -m tcp -p tcp --dport {} -j ACCEPT",
                svc.health_check_node_port
            );
        }

        // The per-service chains stay (they are active) whether or not they are rewritten.
        let [cluster_key, local_key, fw_key, external_key] = svc.chains.keys;
        for (used, key) in [
            (uses_external_chain, external_key),
            (uses_fw_chain, fw_key),
            (uses_cluster_chain, cluster_key),
            (uses_local_chain, local_key),
        ] {
            if used {
                self.active.insert(key);
            }
        }
        for ep in &cat.all_reachable {
            self.active.insert(ep.chain_key);
        }
        let skip = match input.changed {
            Some(changed) => !self.rewrite_all && !changed.contains(&svc.name.service),
            None => false,
        };
        if skip && let Some(&rules) = self.state.service_rules.get(&svc.name) {
            // Unchanged since the last sync: the kernel already has these chains.
            self.skipped_nat_rules += rules;
            self.service_rules.insert(svc.name.clone(), rules);
            return;
        }
        let arena_before = self.arena.len();
        let spans_before = self.spans.len();
        let endpoint_bytes_before = self.endpoint_chain_bytes;

        // Rules that send cluster-IP traffic to masquerade, in the internal traffic chain.
        let internal_masq = if has_internal {
            if self.cfg.masquerade_all {
                Some(format!(
                    "-A {internal_chain} -m comment --comment \"{name} cluster IP\" -m {proto} -p {proto} -d {} --dport {port} -j KUBE-MARK-MASQ\n",
                    svc.cluster_ip
                ))
            } else if self.cfg.local_detector.is_implemented() {
                Some(format!(
                    "-A {internal_chain} -m comment --comment \"{name} cluster IP\" -m {proto} -p {proto} -d {} --dport {port} {} -j KUBE-MARK-MASQ\n",
                    svc.cluster_ip,
                    self.cfg.local_detector.if_not_local().join(" ")
                ))
            } else {
                None
            }
        } else {
            None
        };

        // KUBE-EXT-
        if uses_external_chain {
            let start = self.arena.len();
            let a = &mut self.arena;
            if !svc.external_policy_local {
                let _ = writeln!(
                    a,
                    "-A {external_chain} -m comment --comment \"masquerade traffic for {name} external destinations\" -j KUBE-MARK-MASQ"
                );
            } else {
                if self.cfg.local_detector.is_implemented() {
                    let _ = writeln!(
                        a,
                        "-A {external_chain} -m comment --comment \"pod traffic for {name} external destinations\" {} -j {cluster_chain}",
                        self.cfg.local_detector.if_local().join(" ")
                    );
                }
                let _ = writeln!(
                    a,
                    "-A {external_chain} -m comment --comment \"masquerade LOCAL traffic for {name} external destinations\" -m addrtype --src-type LOCAL -j KUBE-MARK-MASQ"
                );
                let _ = writeln!(
                    a,
                    "-A {external_chain} -m comment --comment \"route LOCAL traffic for {name} external destinations\" -m addrtype --src-type LOCAL -j {cluster_chain}"
                );
            }
            if has_external {
                let _ = writeln!(a, "-A {external_chain} -j {external_policy_chain}");
            }
            self.spans.push(ChainSpan::arena(external_chain, svc.chains.keys[3], &self.arena, start));
        }

        // KUBE-FW-
        if uses_fw_chain {
            let start = self.arena.len();
            let a = &mut self.arena;
            let mut allow_from_node = false;
            for src in &svc.load_balancer_source_ranges {
                let _ = writeln!(
                    a,
                    "-A {fw_chain} -m comment --comment \"{name} loadbalancer IP\" -s {} -j {external_chain}",
                    src.text
                );
                if let (Some(cidr), Some(node_ip)) = (&src.cidr, &self.cfg.node_ip)
                    && cidr.contains(node_ip)
                {
                    allow_from_node = true;
                }
            }
            if allow_from_node {
                for ip in &svc.load_balancer_ips {
                    let _ = writeln!(
                        a,
                        "-A {fw_chain} -m comment --comment \"{name} loadbalancer IP\" -s {ip} -j {external_chain}"
                    );
                }
            }
            let _ = writeln!(
                a,
                "-A {fw_chain} -m comment --comment \"other traffic to {name} will be dropped by KUBE-PROXY-FIREWALL\""
            );
            self.spans.push(ChainSpan::arena(fw_chain, svc.chains.keys[2], &self.arena, start));
        }

        // KUBE-SVC- and KUBE-SVL-
        let [cluster_key, local_key, _, _] = svc.chains.keys;
        for (used, chain, key, eps) in [
            (uses_cluster_chain, cluster_chain, cluster_key, &cat.cluster),
            (uses_local_chain, local_chain, local_key, &cat.local),
        ] {
            if !used {
                continue;
            }
            let start = self.arena.len();
            if internal_chain == chain
                && let Some(rule) = &internal_masq
            {
                self.arena.push_str(rule);
            }
            self.service_to_endpoint_rules(svc, chain, eps);
            self.spans.push(ChainSpan::arena(chain, key, &self.arena, start));
        }

        // KUBE-SEP-
        for ep in &cat.all_reachable {
            self.endpoint_chain_bytes += endpoint_chain_len(svc, ep, self.large);
            self.spans.push(ChainSpan::endpoint(svc, ep));
        }

        let rules = self.spans[spans_before..].iter().map(ChainSpan::rules).sum::<usize>();
        self.service_rules.insert(svc.name.clone(), rules);
        if skip {
            // Unchanged, but its rule count was not known: count, then leave it out.
            self.skipped_nat_rules += rules;
            self.arena.truncate(arena_before);
            self.spans.truncate(spans_before);
            self.endpoint_chain_bytes = endpoint_bytes_before;
        }
    }

    fn service_to_endpoint_rules(&mut self, svc: &ServicePortInfo, chain: &str, eps: &[&'a EndpointRef]) {
        let name = svc.name_string.as_str();
        if let Some(secs) = svc.sticky_seconds {
            for ep in eps {
                let ep_chain = ep.chain_name();
                let a = &mut self.arena;
                a.push_str("-A ");
                a.push_str(chain);
                if !self.large {
                    push_endpoint_comment(a, name, &ep.endpoint);
                }
                let _ = writeln!(a, " -m recent --name {ep_chain} --rcheck --seconds {secs} --reap -j {ep_chain}");
            }
        }
        let n = eps.len();
        self.probability(n);
        for (i, ep) in eps.iter().enumerate() {
            let ep_chain = ep.chain_name();
            let prob = (i + 1 < n).then(|| self.probabilities[n - i].as_str());
            let a = &mut self.arena;
            a.push_str("-A ");
            a.push_str(chain);
            if !self.large {
                push_endpoint_comment(a, name, &ep.endpoint);
            }
            if let Some(p) = prob {
                a.push_str(" -m statistic --mode random --probability ");
                a.push_str(p);
            }
            a.push_str(" -j ");
            a.push_str(&ep_chain);
            a.push('\n');
        }
    }

    fn stale_chains(&mut self) {
        let Some(existing) = self.input.existing_nat_chains else {
            return;
        };
        self.stale = existing.stale(&self.active);
    }

    fn nodeports_tail(&mut self) {
        let comment =
            "-m comment --comment \"kubernetes service nodeports; NOTE: this must be the last rule in this chain\"";
        let npa = &self.cfg.node_port_addresses;
        let v6 = self.cfg.family == IpFamily::V6;
        if npa.match_all() {
            let mut dest = String::from("-m addrtype --dst-type LOCAL");
            if v6 {
                dest.push_str(" ! -d ::1/128");
            } else if !self.cfg.localhost_nodeports {
                dest.push_str(" ! -d 127.0.0.0/8");
            }
            let _ = writeln!(self.nat_services, "-A KUBE-SERVICES {comment} {dest} -j KUBE-NODEPORTS");
        } else {
            for ip in npa.node_ips(self.input.interface_addrs) {
                if ip.is_loopback() && (v6 || !self.cfg.localhost_nodeports) {
                    continue;
                }
                let _ = writeln!(
                    self.nat_services,
                    "-A KUBE-SERVICES {comment} -d {} -j KUBE-NODEPORTS",
                    crate::model::ip::format_ip(&ip)
                );
            }
        }
    }

    fn finish(self, state: &RenderState) -> Rendered {
        let cfg = self.cfg;
        let full = self.input.changed.is_none();
        let mark = &cfg.masquerade_mark;
        let mut stats = self.stats;

        // Fixed top-level chains.
        let mut forward = String::new();
        if !cfg.conntrack_tcp_liberal {
            if self.input.nfacct.ct_state_invalid_dropped {
                let _ = writeln!(
                    forward,
                    "-A KUBE-FORWARD -m conntrack --ctstate INVALID -m nfacct --nfacct-name {} -j DROP",
                    nfacct::CT_STATE_INVALID_DROPPED
                );
            } else {
                forward.push_str("-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP\n");
            }
        }
        let _ = writeln!(
            forward,
            "-A KUBE-FORWARD -m comment --comment \"kubernetes forwarding rules\" -m mark --mark {mark}/{mark} -j ACCEPT"
        );
        forward.push_str("-A KUBE-FORWARD -m comment --comment \"kubernetes forwarding conntrack rule\" -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT\n");

        let mut postrouting = String::new();
        let _ = writeln!(postrouting, "-A KUBE-POSTROUTING -m mark ! --mark {mark}/{mark} -j RETURN");
        let _ = writeln!(postrouting, "-A KUBE-POSTROUTING -j MARK --xor-mark {mark}");
        postrouting.push_str(
            "-A KUBE-POSTROUTING -m comment --comment \"kubernetes service traffic requiring SNAT\" -j MASQUERADE",
        );
        if cfg.random_fully {
            postrouting.push_str(" --random-fully");
        }
        postrouting.push('\n');
        let mark_masq = format!("-A KUBE-MARK-MASQ -j MARK --or-mark {mark}\n");

        let kubelet_firewall = (cfg.family == IpFamily::V4 && cfg.localhost_nodeports).then(|| {
            "-A KUBE-FIREWALL -m comment --comment \"block incoming localnet connections\" -d 127.0.0.0/8 ! -s 127.0.0.0/8 -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j DROP\n".to_string()
        });

        // Filter table top-level chains, in canonical order.
        let mut filter: Vec<(&'static str, &'static str, String)> = vec![
            ("filter/KUBE-NODEPORTS", chains::KUBE_NODEPORTS, self.filter_nodeports),
            ("filter/KUBE-SERVICES", chains::KUBE_SERVICES, self.filter_services),
            ("filter/KUBE-EXTERNAL-SERVICES", chains::KUBE_EXTERNAL_SERVICES, self.filter_external),
        ];
        if let Some(fw) = kubelet_firewall {
            filter.push(("filter/KUBE-FIREWALL", chains::KUBE_FIREWALL, fw));
        }
        filter.push(("filter/KUBE-FORWARD", chains::KUBE_FORWARD, forward));
        filter.push(("filter/KUBE-PROXY-FIREWALL", chains::KUBE_PROXY_FIREWALL, self.filter_firewall));

        let nat_top: Vec<(&'static str, &'static str, String)> = vec![
            ("nat/KUBE-NODEPORTS", chains::KUBE_NODEPORTS, self.nat_nodeports),
            ("nat/KUBE-SERVICES", chains::KUBE_SERVICES, self.nat_services),
            ("nat/KUBE-MARK-MASQ", chains::KUBE_MARK_MASQ, mark_masq),
            ("nat/KUBE-POSTROUTING", chains::KUBE_POSTROUTING, postrouting),
        ];

        let unchanged = |key: &str, body: &str| !full && state.written.get(key).is_some_and(|b| b == body);

        let mut top_level = Vec::new();
        let top_len: usize = filter.iter().chain(nat_top.iter()).map(|(_, _, b)| b.len() + 64).sum();
        let mut out = String::with_capacity(
            self.arena.len()
                + self.endpoint_chain_bytes
                + self.spans.len() * 40
                + self.stale.len() * 80
                + top_len
                + 256,
        );

        // *filter
        out.push_str("*filter\n");
        stats.filter_rules_total = filter.iter().map(|(_, _, body)| count_lines(body)).sum();
        let filter: Vec<_> = filter.into_iter().filter(|(k, _, body)| !unchanged(k, body)).collect();
        for (_, chain, _) in &filter {
            push_chain_line(&mut out, chain);
        }
        for (key, _, body) in filter {
            out.push_str(&body);
            stats.filter_chains += 1;
            stats.filter_rules += count_lines(&body);
            top_level.push((key, body));
        }
        out.push_str("COMMIT\n");

        // *nat: the two fixed-first chains, then everything else by name: the per-service
        // chains (sorted in place) merged with the few other top-level and stale chains.
        out.push_str("*nat\n");
        let mut firsts: Vec<(&'static str, &'static str, String)> = Vec::new();
        let mut others: Vec<(u128, &str, Other)> = Vec::with_capacity(self.stale.len() + 4);
        let mut omitted_nat_rules = 0;
        for (key, chain, body) in nat_top {
            if unchanged(key, &body) {
                omitted_nat_rules += count_lines(&body);
                continue;
            }
            if chain == chains::KUBE_NODEPORTS || chain == chains::KUBE_SERVICES {
                firsts.push((key, chain, body));
            } else {
                others.push((sort_key(chain), chain, Other::Top(key, body)));
            }
        }
        for chain in &self.stale {
            others.push((sort_key(chain), chain.as_str(), Other::Stale));
        }
        others.sort_unstable_by(|a, b| a.0.cmp(&b.0).then_with(|| a.1.cmp(b.1)));
        let mut spans = self.spans;
        // Each per-service chain has exactly one span: its rules are written together.
        spans.sort_unstable_by(|a, b| a.sort.cmp(&b.sort).then_with(|| a.name.as_str().cmp(b.name.as_str())));

        for (_, chain, _) in &firsts {
            push_chain_line(&mut out, chain);
        }
        for item in merged(&spans, &others) {
            match item {
                Merged::Span(span) => push_chain_line(&mut out, &span.name),
                Merged::Other(chain, _) => push_chain_line(&mut out, chain),
            }
        }
        stats.nat_chains = firsts.len() + spans.len() + others.len();
        let mut nat_rules = 0;
        for (_, _, text) in &firsts {
            out.push_str(text);
            nat_rules += count_lines(text);
        }
        for item in merged(&spans, &others) {
            match item {
                Merged::Span(span) => {
                    match span.body {
                        SpanBody::Arena { start, end, .. } => out.push_str(&self.arena[start..end]),
                        SpanBody::Endpoint { svc, ep } => {
                            push_endpoint_chain(&mut out, svc, ep, &span.name, self.large)
                        }
                    }
                    nat_rules += span.rules();
                }
                Merged::Other(_, Other::Top(_, text)) => {
                    out.push_str(text);
                    nat_rules += count_lines(text);
                }
                Merged::Other(_, Other::Stale) => {}
            }
        }
        for (_, chain, body) in &others {
            if matches!(body, Other::Stale) {
                out.push_str("-X ");
                out.push_str(chain);
                out.push('\n');
                nat_rules += 1;
                stats.deleted_chains += 1;
            }
        }
        out.push_str("COMMIT\n");
        for (key, _, text) in firsts {
            top_level.push((key, text));
        }
        for (_, _, body) in others {
            if let Other::Top(key, text) = body {
                top_level.push((key, text));
            }
        }

        stats.nat_rules = nat_rules;
        stats.nat_rules_total = nat_rules + self.skipped_nat_rules + omitted_nat_rules - stats.deleted_chains;
        Rendered {
            payload: out,
            full,
            stats,
            top_level,
            service_rules: self.service_rules,
            active_nat_chains: self.active,
        }
    }
}

/// A nat chain other than the per-service ones: a top-level chain written in this sync
/// (key and rules) or a stale chain to delete.
enum Other {
    Top(&'static str, String),
    Stale,
}

enum Merged<'s, 'a> {
    Span(&'s ChainSpan<'a>),
    Other(&'s str, &'s Other),
}

/// `spans` and `others`, both sorted by name, merged in name order.
fn merged<'s, 'a>(
    spans: &'s [ChainSpan<'a>],
    others: &'s [(u128, &'s str, Other)],
) -> impl Iterator<Item = Merged<'s, 'a>> {
    let mut spans = spans.iter().peekable();
    let mut others = others.iter().peekable();
    std::iter::from_fn(move || match (spans.peek(), others.peek()) {
        (Some(span), Some((sort, name, _))) => {
            let span_first = span.sort.cmp(sort).then_with(|| span.name.as_str().cmp(name)).is_lt();
            if span_first {
                spans.next().map(Merged::Span)
            } else {
                others.next().map(|(_, name, body)| Merged::Other(name, body))
            }
        }
        (Some(_), None) => spans.next().map(Merged::Span),
        (None, _) => others.next().map(|(_, name, body)| Merged::Other(name, body)),
    })
}

/// `ns/name` of an `ns/name:port` string.
fn service_part(name_string: &str) -> &str {
    name_string.split_once(':').map_or(name_string, |(svc, _)| svc)
}

fn push_chain_line(out: &mut String, chain: &str) {
    out.push(':');
    out.push_str(chain);
    out.push_str(" - [0:0]\n");
}

/// ` -m comment --comment "ns/svc:port -> ip:port"`
fn push_endpoint_comment(out: &mut String, service: &str, endpoint: &str) {
    out.push_str(" -m comment --comment \"");
    out.push_str(service);
    out.push_str(" -> ");
    out.push_str(endpoint);
    out.push('"');
}

fn count_lines(s: &str) -> usize {
    s.as_bytes().iter().filter(|b| **b == b'\n').count()
}
