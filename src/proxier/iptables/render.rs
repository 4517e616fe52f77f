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
//! successful sync ([`RenderState`]). They also copy the top-level entries of unchanged
//! services from that sync ([`ServiceMemo`]) instead of computing them again, so a partial
//! sync's work is the changed services plus a copy, not every service's endpoints
//! categorized and every entry formatted (at 10k services that was most of its render time).
//!
//! The code follows the chain groups it writes: per service port, a `ServicePlan` (which
//! chains the port uses, where each kind of traffic goes) read by one writer per group (its
//! entries in the top-level chains, then KUBE-EXT-, KUBE-FW-, KUBE-SVC-/KUBE-SVL-,
//! KUBE-SEP-); at the end, the fixed top-level chains, the `*filter` and `*nat` writers and
//! the stale chains' deletions.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt::{self, Write as _};
use std::io;
use std::net::IpAddr;

use crate::compat::Features;
use crate::iptables::{Layout, RestoreInput, input_text};
use crate::model::chains::{self, ChainKey, ChainName, KeySet, NatChains, chain_name};
use crate::model::{
    EndpointInfo, EndpointRef, IpFamily, NamespacedName, ServicePortInfo, ServicePortName, ServicePortRef,
};
use crate::node::nfacct::{self, NfacctCounters};
use crate::proxier::local_detect::LocalDetector;
use crate::proxier::nodeport_addresses::NodePortAddresses;
use crate::tracker::topology::{Categorized, categorize_endpoints};
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
    /// What each service port contributed to the last successful sync ([`ServiceMemo`]).
    services: HashMap<ServicePortName, ServiceMemo>,
    /// The inputs besides a service's own that its entries depend on, as when they were
    /// memoized: entries are reused only while these are the same.
    context: Option<EntryContext>,
    /// Large-cluster mode of the last sync: when it flips, every service is rewritten so
    /// comments are consistent (upstream leaves unchanged services as they were).
    large_cluster_mode: Option<bool>,
}

impl RenderState {
    /// Records what a successful restore of `rendered` put in place.
    pub fn commit(&mut self, written: RenderOutcome) {
        if written.full {
            self.written.clear();
            self.services.clear();
        }
        for c in written.top_level {
            self.written.insert(c.key, c.rules);
        }
        for name in &written.services_gone {
            self.services.remove(name);
        }
        self.services.extend(written.services);
        self.context = Some(written.context);
        self.large_cluster_mode = Some(written.large_cluster_mode);
    }

    /// Whether the last successful sync was in large-cluster mode (`None` before one).
    pub(crate) fn large_cluster_mode(&self) -> Option<bool> {
        self.large_cluster_mode
    }

    /// Forgets everything: the next render writes every chain.
    pub fn reset(&mut self) {
        *self = RenderState::default();
    }
}

/// What a service port contributed to a successful sync: the count of nat rules in its own
/// chains (so a partial sync that leaves them as they were can still report totals) and,
/// once a partial sync has computed them, its entries in the top-level chains (so the next
/// partial sync copies them instead of categorizing its endpoints and formatting the rules
/// again: that made every partial sync O(services) in work, not just in copying).
///
/// Entries are memoized by partial syncs in large-cluster mode only, the syncs that can reuse
/// them: a full sync writes every chain anyway and is where memory peaks, so it keeps the
/// counts alone, and the first partial sync after it fills the entries in; below the
/// threshold every sync looks for stale chains, so none would be reused.
#[derive(Debug, Clone)]
struct ServiceMemo {
    rules: usize,
    entries: Option<Box<ServiceEntries>>,
}

/// A service port's share of the top-level chains.
///
/// Not the chains it uses: only a sync that looks for stale chains needs all of those, and
/// such a sync (once per sync period in large clusters) computes every service instead, which
/// keeps the memos a third smaller (4.1 instead of 6.3 MB of heap at 10k services).
#[derive(Debug, Clone)]
struct ServiceEntries {
    /// Its rules in each chain of [`EntryChains`], one after another; `ends[i]` is where
    /// those of chain `i` end.
    text: Box<str>,
    ends: [u32; ENTRY_CHAINS],
    no_local_endpoints_internal: bool,
    no_local_endpoints_external: bool,
}

/// What entries depend on besides the service port and its endpoints (the configuration is
/// fixed for the life of a proxier).
#[derive(Debug, Clone, PartialEq, Eq)]
struct EntryContext {
    node_labels: BTreeMap<String, String>,
    nfacct: NfacctCounters,
}

/// Counts reported with each render (metrics and logs).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RenderStats {
    pub services: usize,
    pub endpoints: usize,
    /// Service ports whose entries this render computed; a partial sync copies the others'
    /// from the last sync ([`ServiceMemo`]).
    pub services_computed: usize,
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

/// The result of one render. Its restore input is not assembled: the renderer's parts are
/// kept and write the input on demand ([`RestoreInput`]), straight into `iptables-restore`
/// (at 10k services the input is 34 MB; the parts are a third of that).
pub struct Rendered<'a> {
    pub full: bool,
    pub stats: RenderStats,
    services: Vec<(ServicePortName, ServiceMemo)>,
    services_gone: Vec<ServicePortName>,
    context: EntryContext,
    active_nat_chains: KeySet,
    document: Document<'a>,
}

/// What a render leaves once its restore input is no longer needed: what
/// [`RenderState::commit`] records after a successful restore.
pub struct RenderOutcome {
    full: bool,
    large_cluster_mode: bool,
    top_level: Vec<TopLevelChain>,
    /// Memos made by this render (all services' on a full sync), and the services gone.
    services: Vec<(ServicePortName, ServiceMemo)>,
    services_gone: Vec<ServicePortName>,
    context: EntryContext,
    /// The per-service nat chains this state uses: every one when the render was full or
    /// looked for stale chains (`existing_nat_chains`); otherwise those of the services it
    /// computed again, the others being in use (and in the kernel) since an earlier sync.
    pub active_nat_chains: KeySet,
}

impl Rendered<'_> {
    /// Drops the restore input, keeping what the render state needs.
    pub fn into_outcome(mut self) -> RenderOutcome {
        RenderOutcome {
            full: self.full,
            large_cluster_mode: self.stats.large_cluster_mode,
            top_level: self.document.take_top_level(),
            services: self.services,
            services_gone: self.services_gone,
            context: self.context,
            active_nat_chains: self.active_nat_chains,
        }
    }

    /// The restore input in upstream's layout (what `iptables-restore` gets in one piece).
    pub fn payload(&self) -> String {
        // Writing into a buffer cannot fail, and the renderer writes UTF-8.
        let text = input_text(self, Layout::Canonical).unwrap_or_default();
        String::from_utf8(text).unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned())
    }
}

impl RestoreInput for Rendered<'_> {
    fn write_to(&self, layout: Layout, out: &mut dyn io::Write) -> io::Result<()> {
        match layout {
            Layout::Canonical => self.document.write_canonical(out),
            Layout::DependencyOrder => self.document.write_dependency_ordered(out),
        }
    }
}

impl fmt::Debug for Rendered<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Rendered").field("full", &self.full).field("stats", &self.stats).finish_non_exhaustive()
    }
}

/// Total endpoints of the services in the map: decides large-cluster mode.
pub fn total_endpoints(services: &ServicePortMap, endpoints: &EndpointsMap) -> usize {
    services.keys().map(|name| endpoints.get(name).map_or(0, Vec::len)).sum()
}

/// Renders the filter and nat tables.
pub fn render<'a>(cfg: &RenderConfig, input: &RenderInput<'a>, state: &RenderState) -> Rendered<'a> {
    let mut r = Renderer::new(cfg, input, state);
    r.run();
    r.finish()
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

fn sort_key(name: &str) -> u128 {
    let mut bytes = [0u8; 16];
    let n = name.len().min(16);
    bytes[..n].copy_from_slice(&name.as_bytes()[..n]);
    u128::from_be_bytes(bytes)
}

/// Which chains a service port uses and where each kind of its traffic goes, decided once
/// from its endpoints and traffic policies (the locals at the top of upstream's per-service
/// loop), so each chain group's writer reads them by name.
struct ServicePlan<'s> {
    /// `ns/name:port`, as rule comments spell it.
    name: &'s str,
    /// Lower-case protocol, as `-m` and `-p` take it.
    proto: &'static str,
    port: i32,
    /// KUBE-SVC-: endpoints for the Cluster traffic policy.
    cluster_chain: &'s str,
    /// KUBE-SVL-: endpoints for the Local traffic policy.
    local_chain: &'s str,
    /// KUBE-EXT-: entry point of external traffic.
    external_chain: &'s str,
    /// KUBE-FW-: load-balancer source-range filter.
    fw_chain: &'s str,
    uses_cluster_chain: bool,
    uses_local_chain: bool,
    uses_external_chain: bool,
    uses_fw_chain: bool,
    /// The Cluster or Local chain, by internalTrafficPolicy.
    internal_chain: &'s str,
    /// The internal traffic chain has endpoints.
    has_internal: bool,
    /// The Cluster or Local chain, by externalTrafficPolicy.
    external_policy_chain: &'s str,
    /// The external policy chain has endpoints.
    has_external: bool,
    /// The service has a usable endpoint anywhere in the cluster.
    has_endpoints: bool,
    /// Where traffic without a usable endpoint goes: REJECT when the service has none at
    /// all, DROP when it has none on this node under a Local policy.
    unusable_target: &'static str,
    /// The quoted comment of the rules that send traffic to `unusable_target`.
    unusable_comment: String,
}

impl<'s> ServicePlan<'s> {
    fn new(svc: &'s ServicePortInfo, cat: &Categorized<'_>) -> Self {
        let name = svc.name_string.as_str();
        let chains = &svc.chains;
        let cluster_chain = chains.cluster_policy.as_str();
        let local_chain = chains.local_policy.as_str();
        let external_chain = chains.external.as_str();
        let fw_chain = chains.firewall.as_str();
        let has_endpoints = cat.has_any_endpoints;
        let (internal_chain, has_internal) = if svc.internal_policy_local {
            (local_chain, has_endpoints && !cat.local.is_empty())
        } else {
            (cluster_chain, has_endpoints)
        };
        let (external_policy_chain, has_external) = if svc.external_policy_local {
            (local_chain, has_endpoints && !cat.local.is_empty())
        } else {
            (cluster_chain, has_endpoints)
        };
        let (unusable_target, unusable_comment) = if has_endpoints {
            ("DROP", format!("\"{name} has no local endpoints\""))
        } else {
            ("REJECT", format!("\"{name} has no endpoints\""))
        };
        ServicePlan {
            name,
            proto: svc.protocol.lower(),
            port: svc.port,
            cluster_chain,
            local_chain,
            external_chain,
            fw_chain,
            uses_cluster_chain: !cat.cluster.is_empty() && svc.uses_cluster_endpoints(),
            uses_local_chain: !cat.local.is_empty() && svc.uses_local_endpoints(),
            uses_external_chain: has_endpoints && svc.externally_accessible(),
            uses_fw_chain: has_endpoints && !svc.load_balancer_ips.is_empty() && svc.filters_load_balancer_sources(),
            internal_chain,
            has_internal,
            external_policy_chain,
            has_external,
            has_endpoints,
            unusable_target,
            unusable_comment,
        }
    }
}

struct Renderer<'r, 'a> {
    cfg: &'r RenderConfig,
    input: &'r RenderInput<'a>,
    large: bool,
    /// Top-level chain bodies built from the services' entries.
    entries: EntryChains,
    // Per-service nat chains: rule text in one arena, spans per chain.
    arena: String,
    spans: Vec<ChainSpan<'a>>,
    /// The per-service chains this state needs (whether rewritten or not): they must not be
    /// deleted as stale, and they are what the kernel holds after the restore. Those of the
    /// services computed: every service unless entries are reused ([`RenderOutcome`]).
    active: KeySet,
    stale: Vec<String>,
    probabilities: Vec<String>,
    stats: RenderStats,
    skipped_nat_rules: usize,
    state: &'r RenderState,
    /// Write every service's chains (full sync, or large-cluster mode flipped).
    rewrite_all: bool,
    /// What entries depend on besides each service, now, and whether the state's memos were
    /// made with the same.
    context: EntryContext,
    context_unchanged: bool,
    /// Copy the memoized entries of unchanged services: not on a sync that looks for stale
    /// chains (it needs every chain in use, [`ServiceEntries`]).
    reuse_entries: bool,
    /// Memoize entries: on partial syncs in large-cluster mode, the only ones that reuse
    /// them (below the threshold every sync looks for stale chains).
    keep_entries: bool,
    /// New memos, and how many services of the input the state had a memo for.
    memos: Vec<(ServicePortName, ServiceMemo)>,
    memos_seen: usize,
}

/// The top-level chains that hold the services' entries. A service port's entries in each
/// are contiguous (services are written one after another), which is what lets a memo keep
/// them as one text.
#[derive(Default)]
struct EntryChains {
    filter_services: String,
    filter_external: String,
    filter_nodeports: String,
    filter_firewall: String,
    nat_services: String,
    nat_nodeports: String,
}

/// How many chains [`EntryChains`] has.
const ENTRY_CHAINS: usize = 6;

impl EntryChains {
    fn parts_mut(&mut self) -> [&mut String; ENTRY_CHAINS] {
        [
            &mut self.filter_services,
            &mut self.filter_external,
            &mut self.filter_nodeports,
            &mut self.filter_firewall,
            &mut self.nat_services,
            &mut self.nat_nodeports,
        ]
    }

    fn lens(&mut self) -> [usize; ENTRY_CHAINS] {
        self.parts_mut().map(|p| p.len())
    }

    /// The text added to each chain since `lens`, as a memo keeps it; `None` in the
    /// absurd case of a service's entries over 4 GiB (it is then computed every time).
    fn added_since(&mut self, lens: [usize; ENTRY_CHAINS]) -> Option<(Box<str>, [u32; ENTRY_CHAINS])> {
        let mut text = String::new();
        let mut ends = [0; ENTRY_CHAINS];
        for ((part, start), end) in self.parts_mut().into_iter().zip(lens).zip(&mut ends) {
            text.push_str(part.get(start..).unwrap_or_default());
            *end = u32::try_from(text.len()).ok()?;
        }
        Some((text.into_boxed_str(), ends))
    }

    /// Appends memoized entries to each chain.
    fn push(&mut self, entries: &ServiceEntries) {
        let mut start = 0;
        for (part, end) in self.parts_mut().into_iter().zip(entries.ends) {
            let end = end as usize;
            part.push_str(entries.text.get(start..end).unwrap_or_default());
            start = end;
        }
    }
}

impl<'r, 'a> Renderer<'r, 'a> {
    fn new(cfg: &'r RenderConfig, input: &'r RenderInput<'a>, state: &'r RenderState) -> Self {
        let total = total_endpoints(input.services, input.endpoints);
        let large = total > LARGE_CLUSTER_ENDPOINTS_THRESHOLD;
        let rewrite_all = input.changed.is_none() || state.large_cluster_mode != Some(large);
        let context = EntryContext { node_labels: input.node_labels.clone(), nfacct: input.nfacct };
        let context_unchanged = state.context.as_ref() == Some(&context);
        let reuse_entries = !rewrite_all && input.existing_nat_chains.is_none() && context_unchanged;
        let keep_entries = input.changed.is_some() && large;
        let mut entries = EntryChains::default();
        entries.nat_services.reserve(input.services.len() * 160);
        Renderer {
            cfg,
            input,
            large,
            entries,
            arena: String::with_capacity(total * 100 + input.services.len() * 300),
            spans: Vec::with_capacity(total + input.services.len() * 2),
            active: KeySet::with_capacity_and_hasher(
                if reuse_entries { 0 } else { total + input.services.len() * 4 },
                Default::default(),
            ),
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
            context,
            context_unchanged,
            reuse_entries,
            keep_entries,
            memos: Vec::with_capacity(if input.changed.is_some() { 16 } else { input.services.len() }),
            memos_seen: 0,
        }
    }

    fn run(&mut self) {
        // Upstream's normal form orders KUBE-SERVICES and KUBE-NODEPORTS rules by the
        // service's `ns/name` string (the comment up to the first ' ' or ':'), keeping a
        // service's ports in the order written; so: by `ns/name`, then by port name.
        let mut services: Vec<(&'a str, &'a ServicePortRef)> =
            self.input.services.values().map(|s| (service_part(&s.name_string), s)).collect();
        services.sort_unstable_by(|(a_part, a), (b_part, b)| {
            a_part.cmp(b_part).then_with(|| a.name.port.cmp(&b.name.port)).then_with(|| a.protocol.cmp(&b.protocol))
        });
        for (_, svc) in services {
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

    /// Writes one service port: its entries in the top-level chains, then (unless a partial
    /// sync leaves it as it was) its own chains.
    fn service(&mut self, svc: &'a ServicePortInfo) {
        let input = self.input;
        let state = self.state;
        let unchanged = match input.changed {
            Some(changed) => !self.rewrite_all && !changed.contains(&svc.name.service),
            None => false,
        };
        let memo = if input.changed.is_some() { state.services.get(&svc.name) } else { None };
        self.memos_seen += usize::from(memo.is_some());
        // The state's memo of this service is complete and still right.
        let memo_current = unchanged && self.context_unchanged && memo.is_some_and(|m| m.entries.is_some());
        if memo_current
            && self.reuse_entries
            && let Some(memo) = memo
            && let Some(entries) = &memo.entries
        {
            // Nothing it depends on changed: the kernel has its chains, and its entries
            // are what they were.
            self.entries.push(entries);
            self.stats.no_local_endpoints_internal += usize::from(entries.no_local_endpoints_internal);
            self.stats.no_local_endpoints_external += usize::from(entries.no_local_endpoints_external);
            self.skipped_nat_rules += memo.rules;
            return;
        }

        self.stats.services_computed += 1;
        let endpoints: &'a [EndpointRef] = input.endpoints.get(&svc.name).map_or(&[], Vec::as_slice);
        let cat = categorize_endpoints(endpoints, svc, &self.cfg.features, input.node_labels);
        let plan = ServicePlan::new(svc, &cat);
        let no_local_endpoints_internal = plan.has_endpoints && !plan.has_internal;
        let no_local_endpoints_external = plan.has_endpoints && !plan.has_external;
        self.stats.no_local_endpoints_internal += usize::from(no_local_endpoints_internal);
        self.stats.no_local_endpoints_external += usize::from(no_local_endpoints_external);

        // Entries in the top-level chains, in upstream's order: each writes to several.
        let lens = self.entries.lens();
        self.cluster_ip_entries(svc, &plan);
        self.external_ip_entries(svc, &plan);
        self.load_balancer_entries(svc, &plan);
        self.node_port_entries(svc, &plan);
        self.health_check_entry(svc);
        self.mark_active(svc, &plan, &cat);
        let entries = if self.keep_entries && !memo_current { self.entries.added_since(lens) } else { None };
        let entries = entries.map(|(text, ends)| {
            Box::new(ServiceEntries { text, ends, no_local_endpoints_internal, no_local_endpoints_external })
        });

        if unchanged && let Some(memo) = memo {
            // Unchanged since the last sync: the kernel already has these chains.
            self.skipped_nat_rules += memo.rules;
            if !memo_current {
                self.memos.push((svc.name.clone(), ServiceMemo { rules: memo.rules, entries }));
            }
            return;
        }
        let arena_before = self.arena.len();
        let spans_before = self.spans.len();

        self.external_chain(svc, &plan);
        self.firewall_chain(svc, &plan);
        self.policy_chains(svc, &plan, &cat);
        self.endpoint_chains(svc, &cat);

        let rules = self.spans[spans_before..].iter().map(ChainSpan::rules).sum::<usize>();
        self.memos.push((svc.name.clone(), ServiceMemo { rules, entries }));
        if unchanged {
            // Unchanged, but its rule count was not known: count, then leave it out.
            self.skipped_nat_rules += rules;
            self.arena.truncate(arena_before);
            self.spans.truncate(spans_before);
        }
    }

    /// The cluster IP: to the internal traffic chain (nat `KUBE-SERVICES`), or rejected or
    /// dropped when that chain has no endpoint (filter `KUBE-SERVICES`).
    fn cluster_ip_entries(&mut self, svc: &ServicePortInfo, plan: &ServicePlan<'_>) {
        let ServicePlan { name, proto, port, .. } = *plan;
        if plan.has_internal {
            let internal_chain = plan.internal_chain;
            let _ = writeln!(
                self.entries.nat_services,
                "-A KUBE-SERVICES -m comment --comment \"{name} cluster IP\" -m {proto} -p {proto} -d {} --dport {port} -j {internal_chain}",
                svc.cluster_ip
            );
        } else {
            let (target, comment) = (plan.unusable_target, &plan.unusable_comment);
            let _ = writeln!(
                self.entries.filter_services,
                "-A KUBE-SERVICES -m comment --comment {comment} -m {proto} -p {proto} -d {} --dport {port} -j {target}",
                svc.cluster_ip
            );
        }
    }

    /// External IPs: to the KUBE-EXT- chain (nat `KUBE-SERVICES`) and, without usable
    /// endpoints, rejected or dropped (filter `KUBE-EXTERNAL-SERVICES`).
    fn external_ip_entries(&mut self, svc: &ServicePortInfo, plan: &ServicePlan<'_>) {
        let ServicePlan { name, proto, port, external_chain, .. } = *plan;
        let (target, comment) = (plan.unusable_target, &plan.unusable_comment);
        for ip in &svc.external_ips {
            if plan.has_endpoints {
                let _ = writeln!(
                    self.entries.nat_services,
                    "-A KUBE-SERVICES -m comment --comment \"{name} external IP\" -m {proto} -p {proto} -d {ip} --dport {port} -j {external_chain}"
                );
            }
            if !plan.has_external {
                let _ = writeln!(
                    self.entries.filter_external,
                    "-A KUBE-EXTERNAL-SERVICES -m comment --comment {comment} -m {proto} -p {proto} -d {ip} --dport {port} -j {target}"
                );
            }
        }
    }

    /// Load-balancer IPs: to the KUBE-FW- or KUBE-EXT- chain (nat `KUBE-SERVICES`), what
    /// the firewall chain did not accept dropped (filter `KUBE-PROXY-FIREWALL`) and, without
    /// usable endpoints, rejected or dropped (filter `KUBE-EXTERNAL-SERVICES`).
    fn load_balancer_entries(&mut self, svc: &ServicePortInfo, plan: &ServicePlan<'_>) {
        let ServicePlan { name, proto, port, fw_chain, .. } = *plan;
        let lb_chain = if plan.uses_fw_chain { fw_chain } else { plan.external_chain };
        for ip in &svc.load_balancer_ips {
            if plan.has_endpoints {
                let _ = writeln!(
                    self.entries.nat_services,
                    "-A KUBE-SERVICES -m comment --comment \"{name} loadbalancer IP\" -m {proto} -p {proto} -d {ip} --dport {port} -j {lb_chain}"
                );
            }
            if plan.uses_fw_chain {
                let _ = writeln!(
                    self.entries.filter_firewall,
                    "-A KUBE-PROXY-FIREWALL -m comment --comment \"{name} traffic not accepted by {fw_chain}\" -m {proto} -p {proto} -d {ip} --dport {port} -j DROP"
                );
            }
        }
        if !plan.has_external {
            let (target, comment) = (plan.unusable_target, &plan.unusable_comment);
            for ip in &svc.load_balancer_ips {
                let _ = writeln!(
                    self.entries.filter_external,
                    "-A KUBE-EXTERNAL-SERVICES -m comment --comment {comment} -m {proto} -p {proto} -d {ip} --dport {port} -j {target}"
                );
            }
        }
    }

    /// The node port: to the KUBE-EXT- chain (nat `KUBE-NODEPORTS`) and, without usable
    /// endpoints, rejected or dropped (filter `KUBE-EXTERNAL-SERVICES`).
    fn node_port_entries(&mut self, svc: &ServicePortInfo, plan: &ServicePlan<'_>) {
        if svc.node_port == 0 {
            return;
        }
        let ServicePlan { name, proto, external_chain, .. } = *plan;
        let node_port = svc.node_port;
        if plan.has_endpoints {
            // 1.31+ counts loopback NodePort traffic first (same target: no traffic change).
            if self.cfg.localhost_nodeports
                && self.cfg.family == IpFamily::V4
                && self.input.nfacct.localhost_nodeports_accepted
            {
                let _ = writeln!(
                    self.entries.nat_nodeports,
                    "-A KUBE-NODEPORTS -m comment --comment {name} -m {proto} -p {proto} -d 127.0.0.0/8 --dport {node_port} -m nfacct --nfacct-name {} -j {external_chain}",
                    nfacct::LOCALHOST_NODEPORTS_ACCEPTED
                );
            }
            let _ = writeln!(
                self.entries.nat_nodeports,
                "-A KUBE-NODEPORTS -m comment --comment {name} -m {proto} -p {proto} --dport {node_port} -j {external_chain}"
            );
        }
        if !plan.has_external {
            let (target, comment) = (plan.unusable_target, &plan.unusable_comment);
            let _ = writeln!(
                self.entries.filter_external,
                "-A KUBE-EXTERNAL-SERVICES -m comment --comment {comment} -m addrtype --dst-type LOCAL -m {proto} -p {proto} --dport {node_port} -j {target}"
            );
        }
    }

    /// The health check node port (filter `KUBE-NODEPORTS`): always accepted, local
    /// endpoints or not.
    fn health_check_entry(&mut self, svc: &ServicePortInfo) {
        if svc.health_check_node_port == 0 {
            return;
        }
        let name = svc.name_string.as_str();
        let _ = writeln!(
            self.entries.filter_nodeports,
            "-A KUBE-NODEPORTS -m comment --comment \"{name} health check node port\" -m tcp -p tcp --dport {} -j ACCEPT",
            svc.health_check_node_port
        );
    }

    /// Records the service's own chains as in use: they stay (are not deleted as stale)
    /// whether or not this sync rewrites them.
    fn mark_active(&mut self, svc: &ServicePortInfo, plan: &ServicePlan<'_>, cat: &Categorized<'_>) {
        let keys = &svc.chains.keys;
        for (used, key) in [
            (plan.uses_external_chain, keys.external),
            (plan.uses_fw_chain, keys.firewall),
            (plan.uses_cluster_chain, keys.cluster_policy),
            (plan.uses_local_chain, keys.local_policy),
        ] {
            if used {
                self.active.insert(key);
            }
        }
        for ep in &cat.all_reachable {
            self.active.insert(ep.chain_key);
        }
    }

    /// KUBE-EXT-: masquerades external traffic (or, with the Local policy, short-circuits
    /// pod and host traffic to the Cluster set), then jumps to the external policy chain.
    fn external_chain(&mut self, svc: &ServicePortInfo, plan: &ServicePlan<'_>) {
        if !plan.uses_external_chain {
            return;
        }
        let ServicePlan { name, external_chain, cluster_chain, .. } = *plan;
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
        if plan.has_external {
            let _ = writeln!(a, "-A {external_chain} -j {}", plan.external_policy_chain);
        }
        self.spans.push(ChainSpan::arena(external_chain, svc.chains.keys.external, &self.arena, start));
    }

    /// KUBE-FW-: load-balancer traffic from the allowed source ranges (and from the node's
    /// own load-balancer IPs when a range admits the node) goes on to KUBE-EXT-.
    fn firewall_chain(&mut self, svc: &ServicePortInfo, plan: &ServicePlan<'_>) {
        if !plan.uses_fw_chain {
            return;
        }
        let ServicePlan { name, fw_chain, external_chain, .. } = *plan;
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
        self.spans.push(ChainSpan::arena(fw_chain, svc.chains.keys.firewall, &self.arena, start));
    }

    /// KUBE-SVC- (Cluster policy) and KUBE-SVL- (Local policy): the internal traffic
    /// chain's masquerade rule, then load balancing over the set's endpoints.
    fn policy_chains(&mut self, svc: &ServicePortInfo, plan: &ServicePlan<'_>, cat: &Categorized<'a>) {
        let internal_masq = self.internal_masquerade_rule(svc, plan);
        let keys = &svc.chains.keys;
        for (used, chain, key, eps) in [
            (plan.uses_cluster_chain, plan.cluster_chain, keys.cluster_policy, &cat.cluster),
            (plan.uses_local_chain, plan.local_chain, keys.local_policy, &cat.local),
        ] {
            if !used {
                continue;
            }
            let start = self.arena.len();
            if plan.internal_chain == chain
                && let Some(rule) = &internal_masq
            {
                self.arena.push_str(rule);
            }
            self.service_to_endpoint_rules(svc, chain, eps);
            self.spans.push(ChainSpan::arena(chain, key, &self.arena, start));
        }
    }

    /// The rule that sends cluster-IP traffic to masquerade, in the internal traffic chain:
    /// all of it with masqueradeAll, else what does not come from a local pod.
    fn internal_masquerade_rule(&self, svc: &ServicePortInfo, plan: &ServicePlan<'_>) -> Option<String> {
        if !plan.has_internal {
            return None;
        }
        let ServicePlan { name, proto, port, internal_chain, .. } = *plan;
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
    }

    /// KUBE-SEP-: one chain per reachable endpoint, written straight into the payload at
    /// assembly ([`SpanBody::Endpoint`]).
    fn endpoint_chains(&mut self, svc: &'a ServicePortInfo, cat: &Categorized<'a>) {
        for ep in &cat.all_reachable {
            self.spans.push(ChainSpan::endpoint(svc, ep));
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
            let _ = writeln!(self.entries.nat_services, "-A KUBE-SERVICES {comment} {dest} -j KUBE-NODEPORTS");
        } else {
            for ip in npa.node_ips(self.input.interface_addrs) {
                if ip.is_loopback() && (v6 || !self.cfg.localhost_nodeports) {
                    continue;
                }
                let _ = writeln!(
                    self.entries.nat_services,
                    "-A KUBE-SERVICES {comment} -d {} -j KUBE-NODEPORTS",
                    crate::model::ip::format_ip(&ip)
                );
            }
        }
    }

    /// Puts the restore input's parts in order and counts what it holds: `*filter`, then
    /// `*nat` with every per-service chain written and the stale chains' deletions.
    fn finish(mut self) -> Rendered<'a> {
        let filter = self.filter_chains();
        let nat_fixed = self.nat_fixed_chains();

        self.stats.filter_rules_total = filter.iter().map(|c| count_lines(&c.rules)).sum();
        let filter: Vec<_> = filter.into_iter().filter(|c| !self.unchanged(c.key, &c.rules)).collect();
        self.stats.filter_chains = filter.len();
        self.stats.filter_rules = filter.iter().map(|c| count_lines(&c.rules)).sum();

        let mut nat_firsts = Vec::new();
        let mut nat_others = Vec::with_capacity(self.stale.len() + 4);
        let mut omitted_nat_rules = 0;
        for c in nat_fixed {
            if self.unchanged(c.key, &c.rules) {
                omitted_nat_rules += count_lines(&c.rules);
            } else if c.chain == chains::KUBE_NODEPORTS || c.chain == chains::KUBE_SERVICES {
                nat_firsts.push(c);
            } else {
                nat_others.push(Other::Top(c));
            }
        }
        nat_others.extend(std::mem::take(&mut self.stale).into_iter().map(Other::Stale));
        nat_others
            .sort_unstable_by(|a, b| sort_key(a.name()).cmp(&sort_key(b.name())).then_with(|| a.name().cmp(b.name())));
        // Each per-service chain has exactly one span: its rules are written together.
        self.spans.sort_unstable_by(|a, b| a.sort.cmp(&b.sort).then_with(|| a.name.as_str().cmp(b.name.as_str())));

        let deleted = nat_others.iter().filter(|o| matches!(o, Other::Stale(_))).count();
        let top_rules: usize = nat_firsts.iter().map(|c| count_lines(&c.rules)).sum::<usize>()
            + nat_others.iter().map(|o| if let Other::Top(c) = o { count_lines(&c.rules) } else { 0 }).sum::<usize>();
        let nat_rules = top_rules + self.spans.iter().map(ChainSpan::rules).sum::<usize>() + deleted;
        self.stats.nat_chains = nat_firsts.len() + self.spans.len() + nat_others.len();
        self.stats.deleted_chains = deleted;
        self.stats.nat_rules = nat_rules;
        self.stats.nat_rules_total = nat_rules + self.skipped_nat_rules + omitted_nat_rules - deleted;

        self.arena.shrink_to_fit();
        let services_gone = self.services_gone();
        Rendered {
            full: self.input.changed.is_none(),
            stats: self.stats,
            services: self.memos,
            services_gone,
            context: self.context,
            active_nat_chains: self.active,
            document: Document {
                filter,
                nat_firsts,
                nat_others,
                spans: self.spans,
                arena: self.arena,
                large: self.large,
            },
        }
    }

    /// The services the state has a memo for that are no longer in the input.
    fn services_gone(&self) -> Vec<ServicePortName> {
        if self.input.changed.is_none() || self.memos_seen == self.state.services.len() {
            return Vec::new();
        }
        self.state.services.keys().filter(|name| !self.input.services.contains_key(*name)).cloned().collect()
    }

    /// Whether a partial sync can leave out top-level chain `key`: the kernel already holds
    /// exactly `rules` there.
    fn unchanged(&self, key: &str, rules: &str) -> bool {
        self.input.changed.is_some() && self.state.written.get(key).is_some_and(|b| b == rules)
    }

    /// The filter table's chains in canonical order: those holding the services' entries
    /// (taken out of the renderer) and the fixed ones.
    fn filter_chains(&mut self) -> Vec<TopLevelChain> {
        let mut filter = vec![
            TopLevelChain::new(
                "filter/KUBE-NODEPORTS",
                chains::KUBE_NODEPORTS,
                std::mem::take(&mut self.entries.filter_nodeports),
            ),
            TopLevelChain::new(
                "filter/KUBE-SERVICES",
                chains::KUBE_SERVICES,
                std::mem::take(&mut self.entries.filter_services),
            ),
            TopLevelChain::new(
                "filter/KUBE-EXTERNAL-SERVICES",
                chains::KUBE_EXTERNAL_SERVICES,
                std::mem::take(&mut self.entries.filter_external),
            ),
        ];
        if let Some(rules) = kubelet_firewall_rules(self.cfg) {
            filter.push(TopLevelChain::new("filter/KUBE-FIREWALL", chains::KUBE_FIREWALL, rules));
        }
        filter.push(TopLevelChain::new(
            "filter/KUBE-FORWARD",
            chains::KUBE_FORWARD,
            forward_rules(self.cfg, &self.input.nfacct),
        ));
        filter.push(TopLevelChain::new(
            "filter/KUBE-PROXY-FIREWALL",
            chains::KUBE_PROXY_FIREWALL,
            std::mem::take(&mut self.entries.filter_firewall),
        ));
        filter
    }

    /// The nat table's top-level chains: those holding the services' entries (taken out of
    /// the renderer) and the fixed ones.
    fn nat_fixed_chains(&mut self) -> Vec<TopLevelChain> {
        vec![
            TopLevelChain::new(
                "nat/KUBE-NODEPORTS",
                chains::KUBE_NODEPORTS,
                std::mem::take(&mut self.entries.nat_nodeports),
            ),
            TopLevelChain::new(
                "nat/KUBE-SERVICES",
                chains::KUBE_SERVICES,
                std::mem::take(&mut self.entries.nat_services),
            ),
            TopLevelChain::new("nat/KUBE-MARK-MASQ", chains::KUBE_MARK_MASQ, mark_masq_rules(self.cfg)),
            TopLevelChain::new("nat/KUBE-POSTROUTING", chains::KUBE_POSTROUTING, postrouting_rules(self.cfg)),
        ]
    }
}

/// A top-level chain as this render would write it.
struct TopLevelChain {
    /// Its key in [`RenderState`]: `table/chain`.
    key: &'static str,
    chain: &'static str,
    rules: String,
}

impl TopLevelChain {
    fn new(key: &'static str, chain: &'static str, rules: String) -> Self {
        TopLevelChain { key, chain, rules }
    }
}

/// filter `KUBE-FORWARD`: drops INVALID packets (unless conntrack is liberal), accepts
/// marked and established service traffic.
fn forward_rules(cfg: &RenderConfig, nfacct: &NfacctCounters) -> String {
    let mark = &cfg.masquerade_mark;
    let mut forward = String::new();
    if !cfg.conntrack_tcp_liberal {
        if nfacct.ct_state_invalid_dropped {
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
    forward
}

/// filter `KUBE-FIREWALL`: kubelet's anti-martian rule, written only when localhost
/// NodePorts are on (IPv4).
fn kubelet_firewall_rules(cfg: &RenderConfig) -> Option<String> {
    (cfg.family == IpFamily::V4 && cfg.localhost_nodeports).then(|| {
        "-A KUBE-FIREWALL -m comment --comment \"block incoming localnet connections\" -d 127.0.0.0/8 ! -s 127.0.0.0/8 -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j DROP\n".to_string()
    })
}

/// nat `KUBE-POSTROUTING`: masquerades marked traffic, clearing the mark.
fn postrouting_rules(cfg: &RenderConfig) -> String {
    let mark = &cfg.masquerade_mark;
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
    postrouting
}

/// nat `KUBE-MARK-MASQ`: marks traffic for masquerading in KUBE-POSTROUTING.
fn mark_masq_rules(cfg: &RenderConfig) -> String {
    format!("-A KUBE-MARK-MASQ -j MARK --or-mark {}\n", cfg.masquerade_mark)
}

/// A restore input as the renderer's parts, in canonical order, written on demand.
struct Document<'a> {
    /// The filter chains written, in canonical order.
    filter: Vec<TopLevelChain>,
    /// nat `KUBE-NODEPORTS` and `KUBE-SERVICES` when written: they come first.
    nat_firsts: Vec<TopLevelChain>,
    /// The other top-level nat chains written and the stale chains, sorted by name.
    nat_others: Vec<Other>,
    /// The per-service chains written, sorted by name.
    spans: Vec<ChainSpan<'a>>,
    arena: String,
    large: bool,
}

/// Where a [`Document`] is written: text is built in a buffer and passed on in chunks, so
/// the writer formats into a `String` and the output sees few large writes.
struct Chunked<'w> {
    buf: String,
    out: &'w mut dyn io::Write,
}

impl<'w> Chunked<'w> {
    const CHUNK: usize = 64 * 1024;

    fn new(out: &'w mut dyn io::Write) -> Self {
        Chunked { buf: String::with_capacity(Self::CHUNK * 2), out }
    }

    /// Passes the buffer on once it holds a chunk.
    fn spill(&mut self) -> io::Result<()> {
        if self.buf.len() >= Self::CHUNK {
            self.out.write_all(self.buf.as_bytes())?;
            self.buf.clear();
        }
        Ok(())
    }

    fn finish(self) -> io::Result<()> {
        self.out.write_all(self.buf.as_bytes())
    }
}

impl Document<'_> {
    /// Upstream's layout: each table's chain lines, then its rules, then the deletions.
    fn write_canonical(&self, out: &mut dyn io::Write) -> io::Result<()> {
        let mut w = Chunked::new(out);
        w.buf.push_str("*filter\n");
        for c in &self.filter {
            push_chain_line(&mut w.buf, c.chain);
        }
        for c in &self.filter {
            w.buf.push_str(&c.rules);
            w.spill()?;
        }
        w.buf.push_str("COMMIT\n*nat\n");
        for c in &self.nat_firsts {
            push_chain_line(&mut w.buf, c.chain);
        }
        for item in self.merged() {
            push_chain_line(&mut w.buf, item.name());
            w.spill()?;
        }
        for c in &self.nat_firsts {
            w.buf.push_str(&c.rules);
            w.spill()?;
        }
        for item in self.merged() {
            self.push_rules(&mut w.buf, &item);
            w.spill()?;
        }
        self.push_deletions(&mut w.buf);
        w.buf.push_str("COMMIT\n");
        w.finish()
    }

    /// [`Layout::DependencyOrder`]: every chain after those it jumps to, known from the
    /// chain's kind ([`dependency_rank`]); each chain line followed by its rules; the stale
    /// chains' flushes, then their deletions, last.
    fn write_dependency_ordered(&self, out: &mut dyn io::Write) -> io::Result<()> {
        let mut w = Chunked::new(out);
        w.buf.push_str("*filter\n");
        for c in &self.filter {
            push_chain_line(&mut w.buf, c.chain);
            w.buf.push_str(&c.rules);
            w.spill()?;
        }
        w.buf.push_str("COMMIT\n*nat\n");
        for rank in 0..=MAX_DEPENDENCY_RANK {
            for c in self.nat_firsts.iter().filter(|c| dependency_rank(c.chain) == rank) {
                push_chain_line(&mut w.buf, c.chain);
                w.buf.push_str(&c.rules);
                w.spill()?;
            }
            for item in self.merged() {
                if !matches!(item, Merged::Other(Other::Stale(_))) && dependency_rank(item.name()) == rank {
                    push_chain_line(&mut w.buf, item.name());
                    self.push_rules(&mut w.buf, &item);
                    w.spill()?;
                }
            }
        }
        for other in &self.nat_others {
            if let Other::Stale(chain) = other {
                push_chain_line(&mut w.buf, chain);
                w.spill()?;
            }
        }
        self.push_deletions(&mut w.buf);
        w.buf.push_str("COMMIT\n");
        w.finish()
    }

    /// The nat chains after the fixed-first ones, per-service and others merged in name
    /// order.
    fn merged(&self) -> impl Iterator<Item = Merged<'_, '_>> {
        let mut spans = self.spans.iter().peekable();
        let mut others = self.nat_others.iter().peekable();
        std::iter::from_fn(move || match (spans.peek(), others.peek()) {
            (Some(span), Some(other)) => {
                let name = other.name();
                let span_first = span.sort.cmp(&sort_key(name)).then_with(|| span.name.as_str().cmp(name)).is_lt();
                if span_first { spans.next().map(Merged::Span) } else { others.next().map(Merged::Other) }
            }
            (Some(_), None) => spans.next().map(Merged::Span),
            (None, _) => others.next().map(Merged::Other),
        })
    }

    fn push_rules(&self, out: &mut String, item: &Merged<'_, '_>) {
        match item {
            Merged::Span(span) => match span.body {
                SpanBody::Arena { start, end, .. } => out.push_str(&self.arena[start..end]),
                SpanBody::Endpoint { svc, ep } => push_endpoint_chain(out, svc, ep, &span.name, self.large),
            },
            Merged::Other(Other::Top(c)) => out.push_str(&c.rules),
            Merged::Other(Other::Stale(_)) => {}
        }
    }

    /// A `-X` line for each stale chain.
    fn push_deletions(&self, out: &mut String) {
        for other in &self.nat_others {
            if let Other::Stale(chain) = other {
                out.push_str("-X ");
                out.push_str(chain);
                out.push('\n');
            }
        }
    }

    /// The top-level chains written, taken out (for [`RenderState::commit`]).
    fn take_top_level(&mut self) -> Vec<TopLevelChain> {
        let mut written = std::mem::take(&mut self.filter);
        written.append(&mut self.nat_firsts);
        for other in std::mem::take(&mut self.nat_others) {
            if let Other::Top(c) = other {
                written.push(c);
            }
        }
        written
    }
}

/// The highest [`dependency_rank`].
const MAX_DEPENDENCY_RANK: u8 = 6;

/// Where a nat chain goes in [`Layout::DependencyOrder`]: after every chain it can jump to.
/// Endpoint chains jump to KUBE-MARK-MASQ; service chains to endpoint chains; external
/// chains to service chains; firewall chains to external or service chains; the node-port
/// chain to external, firewall or service chains, and KUBE-SERVICES to all of those and to
/// KUBE-NODEPORTS. (The jumps of every render are checked against this in the tests.)
fn dependency_rank(chain: &str) -> u8 {
    if chain.starts_with(chains::ENDPOINT_CHAIN_PREFIX) {
        1
    } else if chain.starts_with(chains::SERVICE_CHAIN_PREFIX) || chain.starts_with(chains::SERVICE_LOCAL_CHAIN_PREFIX) {
        2
    } else if chain.starts_with(chains::SERVICE_EXTERNAL_CHAIN_PREFIX) {
        3
    } else if chain.starts_with(chains::SERVICE_FIREWALL_CHAIN_PREFIX) {
        4
    } else if chain == chains::KUBE_NODEPORTS {
        5
    } else if chain == chains::KUBE_SERVICES {
        MAX_DEPENDENCY_RANK
    } else {
        0
    }
}

/// A nat chain other than the per-service ones: a top-level chain written in this sync or
/// a stale chain to delete.
enum Other {
    Top(TopLevelChain),
    Stale(String),
}

impl Other {
    fn name(&self) -> &str {
        match self {
            Other::Top(c) => c.chain,
            Other::Stale(chain) => chain,
        }
    }
}

enum Merged<'s, 'a> {
    Span(&'s ChainSpan<'a>),
    Other(&'s Other),
}

impl Merged<'_, '_> {
    fn name(&self) -> &str {
        match self {
            Merged::Span(span) => &span.name,
            Merged::Other(other) => other.name(),
        }
    }
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
