//! The sync planner: what the kernel holds and what the table should hold in, the smallest
//! [`Transaction`] that gets from one to the other out.
//!
//! Three ways to know what the kernel holds:
//!
//! * **Partial sync** ([`plan_partial`]): from this proxier's memory ([`Committed`]) of what
//!   its last successful syncs wrote. For each service port that changed, the old fragment is
//!   rendered again from the inputs it was made from (kept as `Arc`s, so memory holds no rule
//!   text) and compared with the new one: new chains are added, chains whose rules changed
//!   are flushed and written again, chains no longer used are flushed and left to
//!   [`StaleChains`] (deleted by a later sync once unused for more than a second, as
//!   upstream: kernels before 6.2 cannot delete a chain in the transaction that removed the
//!   map element pointing at it). Elements go through a claim index ([`ElementIndex`]):
//!   several service ports may put the same key in a set (a ClusterIP shared by the ports of
//!   a Service, an external IP shared by Services, the hairpin entry of an endpoint behind
//!   several Services), so an element exists while anyone claims it, and when claims differ
//!   the smallest value (then comment) is written, whatever the order of events.
//! * **Full sync from a listing** ([`plan_full`]): the kernel's table as listed (at start-up,
//!   after a failed transaction, hourly from 1.34, when the node's topology changed). Every
//!   object is compared with what the table should hold and only what differs is written;
//!   our per-service chains that nothing uses are flushed (stale) and unused affinity sets
//!   deleted; foreign objects are left alone, as upstream leaves them. This is how a table
//!   written by upstream's kube-proxy is adopted, and how changes made from outside are
//!   repaired. Rules are compared by text: a listing that does not give rules back in
//!   knftables' spelling makes every chain look changed, and the full sync then rewrites
//!   every chain, as upstream's full sync always does.
//! * **Blind full sync** ([`plan_blind`]): when the table cannot be listed, every object is
//!   written as upstream's full sync writes it (chains and sets added and flushed, every rule
//!   and element written); what else the kernel holds stays unknown until a later full sync.
//!
//! Operations are grouped so that every transaction applies in order: add the table,
//! re-create base chains whose hook or priority changed, add chains and sets, flush chains,
//! delete sets (then add again those re-created), add rules (those of chains holding an
//! anonymous set or map first), delete elements, add elements. The order within a
//! transaction is chosen for the kernel's costs (see [`Phases`]).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::model::{EndpointRef, NamespacedName, ServicePortName, ServicePortRef};
use crate::nftables::canonical_rule;
use crate::nftables::table::{ElementState, SetState, set_references};
use crate::nftables::{Chain, Element, Family, NftError, Operation, Rule, Set, SetKind, TableState, Transaction};
use crate::tracker::{EndpointsMap, ServicePortMap};

use super::names::{is_affinity_set, is_service_chain};
use super::render::{
    self, AffinitySet, BaseTable, ChainSpec, ElementSpec, Fragment, NODEPORT_IPS, NftRenderConfig, RuleSpec, Store,
};

/// Per-service chains flushed and waiting to be deleted, with when they went out of use.
pub type StaleChains = HashMap<String, Instant>;

/// How long a chain stays unused before it is deleted.
pub(crate) const STALE_CHAIN_DELAY: Duration = Duration::from_secs(1);

/// What a partial sync needs to remember about one service port: the inputs of its last
/// fragment (to render it again and see what to take away) and its metric flags.
#[derive(Debug, Clone)]
pub(crate) struct Memo {
    owner: u32,
    svc: ServicePortRef,
    endpoints: Vec<EndpointRef>,
    no_local_endpoints_internal: bool,
    no_local_endpoints_external: bool,
}

impl Memo {
    fn new(owner: u32, svc: &ServicePortRef, endpoints: &[EndpointRef], fragment: &Fragment) -> Memo {
        Memo {
            owner,
            svc: svc.clone(),
            endpoints: endpoints.to_vec(),
            no_local_endpoints_internal: fragment.no_local_endpoints_internal,
            no_local_endpoints_external: fragment.no_local_endpoints_external,
        }
    }

    /// Whether the inputs are the very ones the memo was made from.
    fn same_inputs(&self, svc: &ServicePortRef, endpoints: &[EndpointRef]) -> bool {
        Arc::ptr_eq(&self.svc, svc)
            && self.endpoints.len() == endpoints.len()
            && self.endpoints.iter().zip(endpoints).all(|(a, b)| Arc::ptr_eq(a, b))
    }
}

/// The value and comment of an element as the kernel holds it.
type Held = (Option<Box<str>>, Option<Box<str>>);

#[derive(Debug, Clone, PartialEq, Eq)]
struct Claim {
    owner: u32,
    value: Option<Box<str>>,
    comment: Option<Box<str>>,
}

/// Who claims each element key of each store, and with what value.
#[derive(Debug, Clone, Default)]
pub(crate) struct ElementIndex {
    stores: [HashMap<Box<str>, Vec<Claim>>; Store::ALL.len()],
}

impl ElementIndex {
    fn add(&mut self, owner: u32, e: &ElementSpec) {
        let claim =
            Claim { owner, value: e.value.as_deref().map(Box::from), comment: e.comment.as_deref().map(Box::from) };
        let store = &mut self.stores[e.store.index()];
        match store.get_mut(e.key.as_str()) {
            Some(claims) => claims.push(claim),
            None => {
                store.insert(Box::from(e.key.as_str()), vec![claim]);
            }
        }
    }

    fn remove(&mut self, owner: u32, e: &ElementSpec) {
        let store = &mut self.stores[e.store.index()];
        let Some(claims) = store.get_mut(e.key.as_str()) else { return };
        let (value, comment) = (e.value.as_deref(), e.comment.as_deref());
        if let Some(i) = claims
            .iter()
            .position(|c| c.owner == owner && c.value.as_deref() == value && c.comment.as_deref() == comment)
        {
            claims.swap_remove(i);
        }
        if claims.is_empty() {
            store.remove(e.key.as_str());
        }
    }

    /// What the kernel should hold for `key`: the smallest claim, by value then comment.
    fn winner(&self, store: Store, key: &str) -> Option<Held> {
        Self::winner_of(self.stores[store.index()].get(key)?)
    }

    fn winner_of(claims: &[Claim]) -> Option<Held> {
        claims
            .iter()
            .min_by(|a, b| (&a.value, &a.comment).cmp(&(&b.value, &b.comment)))
            .map(|c| (c.value.clone(), c.comment.clone()))
    }

    /// `store`'s keys and what each should hold, sorted by key.
    fn desired(&self, store: Store) -> Vec<(&str, Held)> {
        let mut out: Vec<(&str, Held)> = self.stores[store.index()]
            .iter()
            .filter_map(|(key, claims)| Some((key.as_ref(), Self::winner_of(claims)?)))
            .collect();
        out.sort_unstable_by(|a, b| a.0.cmp(b.0));
        out
    }
}

/// Totals over every service port, kept up to date as memos change.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Totals {
    pub endpoints: usize,
    pub no_local_endpoints_internal: usize,
    pub no_local_endpoints_external: usize,
}

impl Totals {
    fn add(&mut self, memo: &Memo) {
        self.endpoints += memo.endpoints.len();
        self.no_local_endpoints_internal += usize::from(memo.no_local_endpoints_internal);
        self.no_local_endpoints_external += usize::from(memo.no_local_endpoints_external);
    }

    fn remove(&mut self, memo: &Memo) {
        self.endpoints -= memo.endpoints.len();
        self.no_local_endpoints_internal -= usize::from(memo.no_local_endpoints_internal);
        self.no_local_endpoints_external -= usize::from(memo.no_local_endpoints_external);
    }
}

/// What the kernel holds for the service ports, as this proxier wrote it: valid after a
/// successful sync, dropped when a transaction fails.
#[derive(Debug, Clone, Default)]
pub(crate) struct Committed {
    memos: HashMap<ServicePortName, Memo>,
    index: ElementIndex,
    next_owner: u32,
    pub totals: Totals,
}

impl Committed {
    fn new_owner(&mut self) -> u32 {
        let owner = self.next_owner;
        self.next_owner = self.next_owner.wrapping_add(1);
        owner
    }

    fn insert_memo(&mut self, name: ServicePortName, memo: Memo) {
        self.totals.add(&memo);
        if let Some(old) = self.memos.insert(name, memo) {
            self.totals.remove(&old);
        }
    }

    fn remove_memo(&mut self, name: &ServicePortName) {
        if let Some(old) = self.memos.remove(name) {
            self.totals.remove(&old);
        }
    }

    /// Adds a service port's fragment, as a full sync does.
    fn record(&mut self, name: &ServicePortName, svc: &ServicePortRef, endpoints: &[EndpointRef], fragment: &Fragment) {
        let owner = self.new_owner();
        for e in &fragment.elements {
            self.index.add(owner, e);
        }
        self.insert_memo(name.clone(), Memo::new(owner, svc, endpoints, fragment));
    }
}

/// What a plan does, for logs and reports.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PlanStats {
    /// Service ports whose fragments were rendered.
    pub services_computed: usize,
    pub chains_added: usize,
    /// Existing chains flushed and written again.
    pub chains_rewritten: usize,
    /// Per-service chains flushed (or found empty) because nothing uses them any more.
    pub chains_stale: usize,
    pub sets_added: usize,
    pub sets_deleted: usize,
    pub rules_added: usize,
    pub elements_added: usize,
    pub elements_deleted: usize,
    /// Operations of a large full sync sent ahead of the plan's transaction, and in how many
    /// transactions ([`CHUNK_OPERATIONS`]).
    pub operations_sent_before: usize,
    pub transactions_before: usize,
}

/// Full syncs larger than this many operations are sent in several transactions, each
/// ending where the table is consistent (see [`Phases`]): the proxier never holds the whole
/// first sync of a large cluster in memory, `nft` never parses it in one piece, and the
/// kernel's per-transaction costs that grow with the transaction (binding each anonymous set
/// walks the whole pending batch) stay bounded. Chosen by measurement (docs/performance.md,
/// `nft_scale --kernel --chunk`): smaller pieces pay the table's re-validation and `nft`'s
/// cache fetch once more each.
pub const CHUNK_OPERATIONS: usize = 5_000;

/// Receives the transactions of a full sync sent in pieces, in order.
pub(crate) type ChunkSink<'a> = &'a mut dyn FnMut(Transaction) -> Result<(), NftError>;

/// Where a full sync sends its pieces, and how large they get.
pub(crate) struct Chunks<'a> {
    pub sink: ChunkSink<'a>,
    pub operations: usize,
}

/// The operations of a plan, in the order they apply.
///
/// A plan is groups, then a tail. The first group holds the fixed objects (full syncs), then
/// one group per service port written: the chains and sets it adds, the chains it flushes
/// early (those naming an affinity set that is re-created), the sets it re-creates, then each
/// chain it writes, flushed and filled in one go. The tail comes last: element deletions and
/// additions (this is where traffic moves to new chains), the flushes of stale chains (only
/// old elements pointed at them), then set deletions (nothing refers to them any more).
///
/// Every group leaves the table consistent and the traffic as before, so a full sync can be
/// cut into transactions between groups ([`CHUNK_OPERATIONS`]); partial syncs are one.
///
/// Within a transaction of a full sync the closed groups go out by class, each class in
/// group order (a partial sync, a handful of groups, keeps them one after the other):
/// every group's prelude and adds (declarations of empty objects, and base chains
/// re-created: nothing can jump to those), then early flushes and set re-creations (the
/// flushes still precede the deletions that need them), then the write blocks (flush and
/// rules) of chains whose rules hold an anonymous set or map, then the other write blocks,
/// then the tail. Any order of the groups' classes applies, since each class only needs what
/// the classes before it in its own group made. This one is the cheapest for the kernel:
/// binding an anonymous set walks the whole pending batch (`__nft_set_trans_bind`), so those
/// rules go while the batch is short, and named-set lookups walk the table's list of sets,
/// in which the declarations then come first.
struct Phases<'s> {
    /// Groups closed and not sent yet, by class.
    pending: Pending,
    /// Whether transactions are ordered by class (full syncs), or group after group.
    by_class: bool,
    // The group being built.
    prelude: Vec<Operation>,
    adds: Vec<Operation>,
    early_flushes: Vec<Operation>,
    set_recreate_deletes: Vec<Operation>,
    set_readds: Vec<Operation>,
    /// Write blocks of chains whose rules hold an anonymous set or map.
    anonymous_writes: Vec<Operation>,
    writes: Vec<Operation>,
    // The tail.
    element_deletes: Vec<Operation>,
    element_adds: Vec<Operation>,
    stale_flushes: Vec<Operation>,
    set_deletes: Vec<Operation>,
    stats: PlanStats,
    sink: Option<Chunks<'s>>,
    /// Operations already sent through `sink`, in how many transactions.
    sent: usize,
    chunks: usize,
    failed: Option<NftError>,
}

/// Closed groups' operations by class, in the order a transaction sends the classes.
#[derive(Default)]
struct Pending {
    declarations: Vec<Operation>,
    recreations: Vec<Operation>,
    anonymous_writes: Vec<Operation>,
    writes: Vec<Operation>,
}

impl Pending {
    fn len(&self) -> usize {
        self.declarations.len() + self.recreations.len() + self.anonymous_writes.len() + self.writes.len()
    }

    fn take(&mut self) -> Vec<Operation> {
        let mut ops = Vec::with_capacity(self.len());
        for part in [&mut self.declarations, &mut self.recreations, &mut self.anonymous_writes, &mut self.writes] {
            ops.append(part);
        }
        ops
    }
}

/// Whether rule text holds an anonymous set or map (`vmap { … }`, `saddr != { … }`): a
/// brace not opened by `update @set { … }` / `add @set { … }`, whose braces hold the key.
fn holds_anonymous_set(text: &str) -> bool {
    let mut rest = text;
    while let Some(at) = rest.find('{') {
        let before = rest[..at].trim_end();
        let word = before.rsplit(' ').next().unwrap_or_default();
        if !word.starts_with('@') {
            return true;
        }
        rest = &rest[at + 1..];
    }
    false
}

impl<'s> Phases<'s> {
    fn new(sink: Option<Chunks<'s>>) -> Phases<'s> {
        Phases {
            pending: Pending::default(),
            by_class: sink.is_some(),
            prelude: Vec::new(),
            adds: Vec::new(),
            early_flushes: Vec::new(),
            set_recreate_deletes: Vec::new(),
            set_readds: Vec::new(),
            anonymous_writes: Vec::new(),
            writes: Vec::new(),
            element_deletes: Vec::new(),
            element_adds: Vec::new(),
            stale_flushes: Vec::new(),
            set_deletes: Vec::new(),
            stats: PlanStats::default(),
            sink,
            sent: 0,
            chunks: 0,
            failed: None,
        }
    }

    /// Closes the group being built; sends what is pending when it is large enough.
    fn end_group(&mut self) {
        let pending = &mut self.pending;
        if !self.by_class {
            for part in [
                &mut self.prelude,
                &mut self.adds,
                &mut self.early_flushes,
                &mut self.set_recreate_deletes,
                &mut self.set_readds,
                &mut self.writes,
            ] {
                pending.writes.append(part);
            }
        }
        pending.declarations.append(&mut self.prelude);
        pending.declarations.append(&mut self.adds);
        pending.recreations.append(&mut self.early_flushes);
        pending.recreations.append(&mut self.set_recreate_deletes);
        pending.recreations.append(&mut self.set_readds);
        pending.anonymous_writes.append(&mut self.anonymous_writes);
        pending.writes.append(&mut self.writes);
        if let Some(chunks) = self.sink.as_mut()
            && self.pending.len() >= chunks.operations
            && self.failed.is_none()
        {
            let ops = self.pending.take();
            let n = ops.len();
            match (chunks.sink)(Transaction { ops }) {
                Ok(()) => {
                    self.sent += n;
                    self.chunks += 1;
                }
                Err(e) => self.failed = Some(e),
            }
        }
    }

    fn into_plan(mut self) -> Result<Plan, NftError> {
        self.end_group();
        if let Some(e) = self.failed {
            return Err(e);
        }
        let mut ops = self.pending.take();
        for part in [self.element_deletes, self.element_adds, self.stale_flushes, self.set_deletes] {
            ops.extend(part);
        }
        self.stats.operations_sent_before = self.sent;
        self.stats.transactions_before = self.chunks;
        Ok(Plan { tx: Transaction { ops }, stats: self.stats })
    }

    fn add_chain(&mut self, chain: Chain) {
        self.stats.chains_added += 1;
        self.adds.push(Operation::AddChain(chain));
    }

    fn add_set(&mut self, set: Set) {
        self.stats.sets_added += 1;
        self.adds.push(Operation::AddSet(set));
    }

    /// Deletes a set and adds it again; the chains naming it must be written with
    /// `flush_early` in the same group.
    fn recreate_set(&mut self, held_kind: SetKind, set: Set) {
        self.stats.sets_deleted += 1;
        self.stats.sets_added += 1;
        self.set_recreate_deletes.push(Operation::DeleteSet { kind: held_kind, name: set.name.clone() });
        self.set_readds.push(Operation::AddSet(set));
    }

    /// Deletes a set nothing refers to once the plan applied (in the tail).
    fn delete_set(&mut self, kind: SetKind, name: String) {
        self.stats.sets_deleted += 1;
        self.set_deletes.push(Operation::DeleteSet { kind, name });
    }

    /// Re-creates a chain whose declaration differs (another hook or priority, or a base
    /// chain where a regular one should be): flushed, deleted and added first in its group.
    fn recreate_chain(&mut self, chain: Chain, held_rules: usize, rules: Vec<RuleSpec>) {
        self.stats.chains_rewritten += 1;
        let name = chain.name.clone();
        if held_rules > 0 {
            self.prelude.push(Operation::FlushChain(name.clone()));
        }
        self.prelude.push(Operation::DeleteChain(name.clone()));
        self.prelude.push(Operation::AddChain(chain));
        self.write_block(&name, None, rules);
    }

    fn new_chain(&mut self, chain: Chain, rules: Vec<RuleSpec>) {
        let name = chain.name.clone();
        self.add_chain(chain);
        self.write_block(&name, None, rules);
    }

    /// Flushes an existing chain holding `held_rules` rules and writes `rules` into it, in one
    /// go unless `flush_early` (it names a set the group re-creates).
    fn rewrite_chain(&mut self, name: &str, held_rules: usize, rules: Vec<RuleSpec>, flush_early: bool) {
        self.stats.chains_rewritten += 1;
        let mut flush = (held_rules > 0).then(|| Operation::FlushChain(name.to_string()));
        if flush_early && let Some(flush) = flush.take() {
            self.early_flushes.push(flush);
        }
        self.write_block(name, flush, rules);
    }

    /// A per-service chain nothing uses any more: flushed in the tail (or early, when it
    /// names a set its group re-creates), deleted by a later sync.
    fn stale_chain(&mut self, name: &str, held_rules: usize, flush_early: bool) {
        self.stats.chains_stale += 1;
        if held_rules > 0 {
            let flush = Operation::FlushChain(name.to_string());
            if flush_early { self.early_flushes.push(flush) } else { self.stale_flushes.push(flush) }
        }
    }

    /// A chain's write block: its flush (if any), then its rules; with the anonymous-set
    /// writes when a rule holds one.
    fn write_block(&mut self, chain: &str, flush: Option<Operation>, rules: Vec<RuleSpec>) {
        self.stats.rules_added += rules.len();
        let writes = if self.by_class && rules.iter().any(|r| holds_anonymous_set(&r.text)) {
            &mut self.anonymous_writes
        } else {
            &mut self.writes
        };
        writes.extend(flush);
        for r in rules {
            writes.push(Operation::AddRule(Rule {
                chain: chain.to_string(),
                text: r.text,
                comment: r.comment.map(str::to_string),
            }));
        }
    }

    fn add_element(&mut self, kind: SetKind, set: &str, key: &str, held: Held) {
        self.stats.elements_added += 1;
        let (value, comment) = held;
        self.element_adds.push(Operation::AddElement(Element {
            kind,
            set: set.to_string(),
            key: split_parts(key),
            value: value.map(|v| split_parts(&v)).unwrap_or_default(),
            comment: comment.map(String::from),
        }));
    }

    fn delete_element(&mut self, kind: SetKind, set: &str, key: &str) {
        self.stats.elements_deleted += 1;
        self.element_deletes.push(Operation::DeleteElement { kind, set: set.to_string(), key: split_parts(key) });
    }

    /// Takes the elements of set `set` from `held` to `desired` (both by key).
    fn diff_elements(
        &mut self,
        kind: SetKind,
        set: &str,
        mut held: BTreeMap<String, ElementState>,
        desired: Vec<(&str, Held)>,
    ) {
        for (key, want) in desired {
            match held.remove(key) {
                Some(h) if held_matches(&h, &want) => {}
                Some(_) => {
                    self.delete_element(kind, set, key);
                    self.add_element(kind, set, key, want);
                }
                None => self.add_element(kind, set, key, want),
            }
        }
        for key in held.keys() {
            self.delete_element(kind, set, key);
        }
    }
}

fn split_parts(joined: &str) -> Vec<String> {
    joined.split(" . ").map(str::to_string).collect()
}

/// Whether rules as the kernel holds them (text and comment) are `rules`.
/// Whether a listed chain holds `rules`. A listing shows rules in nft's canonical words
/// (`mark and 0x4000 == 0` lists as `meta mark & 0x00004000 == 0x00000000`), so both sides
/// are compared in them.
fn same_rules(held: &[(String, Option<String>)], rules: &[RuleSpec]) -> bool {
    held.len() == rules.len()
        && held.iter().zip(rules).all(|((text, comment), r)| {
            comment.as_deref() == r.comment && (*text == r.text || canonical_rule(text) == canonical_rule(&r.text))
        })
}

fn held_matches(held: &ElementState, want: &Held) -> bool {
    let value_matches = match &want.0 {
        Some(v) => {
            held.value.len() == v.split(" . ").count() && held.value.iter().zip(v.split(" . ")).all(|(a, b)| a == b)
        }
        None => held.value.is_empty(),
    };
    value_matches && held.comment.as_deref() == want.1.as_deref()
}

/// A transaction and what it does.
#[derive(Debug, Clone, Default)]
pub(crate) struct Plan {
    pub tx: Transaction,
    pub stats: PlanStats,
}

/// The inputs of a sync besides the configuration.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SyncInput<'a> {
    pub services: &'a ServicePortMap,
    pub endpoints: &'a EndpointsMap,
    pub node_labels: &'a BTreeMap<String, String>,
}

impl SyncInput<'_> {
    fn endpoints_of(&self, name: &ServicePortName) -> &[EndpointRef] {
        self.endpoints.get(name).map_or(&[], Vec::as_slice)
    }

    /// Every service port, sorted by name (so a transaction comes out the same every time).
    fn sorted_ports(&self) -> Vec<(&ServicePortName, &ServicePortRef)> {
        let mut ports: Vec<_> = self.services.iter().collect();
        ports.sort_unstable_by(|a, b| a.0.cmp(b.0));
        ports
    }
}

/// The Services a partial sync rewrites. Usually a handful: looked up by comparing names
/// (every service port is checked against it, and hashing each name cost more than the rest
/// of a partial sync at 10k services); many go through a hash set.
#[derive(Debug, Clone)]
pub(crate) enum ChangedServices {
    Few(Vec<NamespacedName>),
    Many(HashSet<NamespacedName>),
}

impl ChangedServices {
    const FEW: usize = 16;

    pub(crate) fn new(names: impl IntoIterator<Item = NamespacedName>) -> ChangedServices {
        let set: HashSet<NamespacedName> = names.into_iter().collect();
        if set.len() <= Self::FEW {
            ChangedServices::Few(set.into_iter().collect())
        } else {
            ChangedServices::Many(set)
        }
    }

    pub(crate) fn contains(&self, name: &NamespacedName) -> bool {
        match self {
            ChangedServices::Few(names) => names.iter().any(|n| n == name),
            ChangedServices::Many(set) => set.contains(name),
        }
    }
}

/// Plans a partial sync of the service ports of the `changed` Services against `committed`,
/// which it brings up to date as if the transaction succeeded (drop it if it fails). New
/// stale chains are added to `stale` with the time `now`.
pub(crate) fn plan_partial(
    cfg: &NftRenderConfig,
    committed: &mut Committed,
    stale: &mut StaleChains,
    input: &SyncInput<'_>,
    changed: &ChangedServices,
    now: Instant,
) -> Plan {
    let family = cfg.family();
    let mut phases = Phases::new(None);
    let mut ports: Vec<ServicePortName> =
        input.services.keys().filter(|name| changed.contains(&name.service)).cloned().collect();
    ports.extend(
        committed
            .memos
            .keys()
            .filter(|name| changed.contains(&name.service) && !input.services.contains_key(*name))
            .cloned(),
    );
    ports.sort_unstable();

    // What each element key touched held before this sync.
    let mut touched: HashMap<(Store, Box<str>), Option<Held>> = HashMap::new();
    let touch = |touched: &mut HashMap<(Store, Box<str>), Option<Held>>, index: &ElementIndex, e: &ElementSpec| {
        touched.entry((e.store, Box::from(e.key.as_str()))).or_insert_with(|| index.winner(e.store, &e.key));
    };

    for name in ports {
        let svc = input.services.get(&name);
        let endpoints = input.endpoints_of(&name);
        let memo = committed.memos.get(&name);
        if let (Some(memo), Some(svc)) = (memo, svc)
            && memo.same_inputs(svc, endpoints)
        {
            continue;
        }
        let old = memo.map(|m| render::fragment(cfg, &m.svc, &m.endpoints, input.node_labels));
        let new = svc.map(|s| render::fragment(cfg, s, endpoints, input.node_labels));
        phases.stats.services_computed += usize::from(new.is_some());
        let owner = match memo {
            Some(m) => m.owner,
            None => committed.new_owner(),
        };
        for e in old.iter().flat_map(|f| &f.elements) {
            touch(&mut touched, &committed.index, e);
            committed.index.remove(owner, e);
        }
        for e in new.iter().flat_map(|f| &f.elements) {
            touch(&mut touched, &committed.index, e);
            committed.index.add(owner, e);
        }
        match (svc, &new) {
            (Some(svc), Some(fragment)) => {
                committed.insert_memo(name, Memo::new(owner, svc, endpoints, fragment));
            }
            _ => committed.remove_memo(&name),
        }
        diff_fragments(&mut phases, family, old.unwrap_or_default(), new.unwrap_or_default(), stale, now);
        phases.end_group();
    }

    let mut touched: Vec<_> = touched.into_iter().collect();
    touched.sort_unstable_by(|a, b| a.0.cmp(&b.0));
    for ((store, key), before) in touched {
        let after = committed.index.winner(store, &key);
        if before == after {
            continue;
        }
        if before.is_some() {
            phases.delete_element(store.kind(), store.name(), &key);
        }
        if let Some(after) = after {
            phases.add_element(store.kind(), store.name(), &key, after);
        }
    }
    // Nothing is sent ahead without a sink, so this cannot fail.
    phases.into_plan().unwrap_or_default()
}

/// Chain and affinity-set operations that take one service port from `old` to `new` (empty
/// when absent), the kernel holding exactly `old`.
fn diff_fragments(
    phases: &mut Phases<'_>,
    family: Family,
    old: Fragment,
    new: Fragment,
    stale: &mut StaleChains,
    now: Instant,
) {
    let old_sets: HashMap<&str, &AffinitySet> = old.affinity_sets.iter().map(|s| (s.name.as_str(), s)).collect();
    let new_sets: HashSet<&str> = new.affinity_sets.iter().map(|s| s.name.as_str()).collect();
    // The kernel keeps an existing set's timeout on `add`: a set whose timeout changed is
    // deleted and added again, the chains naming it flushed before and written after.
    let mut recreated = false;
    for set in &new.affinity_sets {
        match old_sets.get(set.name.as_str()) {
            None => phases.add_set(set.declaration(family)),
            Some(held) if held.timeout_secs != set.timeout_secs => {
                recreated = true;
                phases.recreate_set(SetKind::Set, set.declaration(family));
            }
            Some(_) => {}
        }
    }
    for set in &old.affinity_sets {
        if !new_sets.contains(set.name.as_str()) {
            phases.delete_set(SetKind::Set, set.name.clone());
        }
    }

    let mut old_chains: HashMap<String, Vec<RuleSpec>> = old.chains.into_iter().map(|c| (c.name, c.rules)).collect();
    for ChainSpec { name, rules } in new.chains {
        match old_chains.remove(&name) {
            Some(held) if !recreated && held == rules => {}
            Some(held) => phases.rewrite_chain(&name, held.len(), rules, recreated),
            None => {
                // New to this service port (maybe flushed and waiting for deletion: the add is
                // then a no-op, and the chain is in use again).
                stale.remove(&name);
                phases.new_chain(Chain::regular(&name), rules);
            }
        }
    }
    let mut gone: Vec<(String, Vec<RuleSpec>)> = old_chains.into_iter().collect();
    gone.sort_unstable_by(|a, b| a.0.cmp(&b.0));
    for (name, held) in gone {
        phases.stale_chain(&name, held.len(), recreated);
        stale.entry(name).or_insert(now);
    }
}

/// Plans a full sync against `listed`, the kernel's table (`None`: there is none), and
/// returns it with the memory it leaves once applied. `stale` becomes the per-service chains
/// the kernel will hold unused (keeping the time of those already known). With a `sink`, a
/// large plan is sent ahead in pieces ([`Phases`]); an error sending one ends the plan.
pub(crate) fn plan_full(
    cfg: &NftRenderConfig,
    base: BaseTable,
    listed: Option<TableState>,
    stale: &mut StaleChains,
    input: &SyncInput<'_>,
    now: Instant,
    sink: Option<Chunks<'_>>,
) -> Result<(Plan, Committed), NftError> {
    let family = cfg.family();
    let mut listed = listed.unwrap_or_default();
    let mut phases = Phases::new(sink);
    if !listed.exists {
        phases.prelude.push(Operation::AddTable);
    }

    // Fixed sets and maps; what the element stores hold is kept for the element diff.
    let mut held_stores: HashMap<String, SetState> = HashMap::new();
    let mut recreated_base_set = false;
    for set in base.sets {
        match listed.sets.remove(&set.name) {
            Some(held) if held.set.kind == set.kind && held.set.set_type == set.set_type => {
                held_stores.insert(set.name.clone(), held);
            }
            // Another type, or a set where a map should be: re-created, and every fixed chain
            // written again around it.
            Some(held) => {
                recreated_base_set = true;
                phases.recreate_set(held.set.kind, set);
            }
            None => phases.add_set(set),
        }
    }
    // Fixed chains.
    for spec in base.chains {
        match listed.chains.remove(&spec.chain.name) {
            // Another hook or priority (an older release's): re-created, as upstream does
            // once per process.
            Some(held) if held.chain.base != spec.chain.base => {
                phases.recreate_chain(spec.chain, held.rules.len(), spec.rules)
            }
            Some(held) if !recreated_base_set && same_rules(&held.rules, &spec.rules) => {}
            Some(held) => phases.rewrite_chain(&spec.chain.name, held.rules.len(), spec.rules, recreated_base_set),
            None => phases.new_chain(spec.chain, spec.rules),
        }
    }
    match &base.nodeport_ips {
        None => {
            if let Some(held) = listed.sets.remove(NODEPORT_IPS) {
                phases.delete_set(held.set.kind, NODEPORT_IPS.to_string());
            }
        }
        Some(ips) => {
            let held = held_stores.remove(NODEPORT_IPS).map(|s| s.elements).unwrap_or_default();
            let mut desired: Vec<(&str, Held)> = ips.iter().map(|ip| (ip.as_str(), (None, None))).collect();
            desired.sort_unstable_by(|a, b| a.0.cmp(b.0));
            phases.diff_elements(SetKind::Set, NODEPORT_IPS, held, desired);
        }
    }
    phases.end_group();

    // Service ports, one group each.
    let mut committed = Committed::default();
    for (name, svc) in input.sorted_ports() {
        if phases.failed.is_some() {
            break;
        }
        let endpoints = input.endpoints_of(name);
        let fragment = render::fragment(cfg, svc, endpoints, input.node_labels);
        phases.stats.services_computed += 1;
        committed.record(name, svc, endpoints, &fragment);

        let mut recreated = false;
        for set in &fragment.affinity_sets {
            match listed.sets.remove(&set.name) {
                Some(held)
                    if held.set.kind == SetKind::Set
                        && held.set.set_type == family.addr_type()
                        && held.set.timeout_secs == Some(set.timeout_secs) => {}
                Some(held) => {
                    recreated = true;
                    flush_users_early(&mut phases, &mut listed, &set.name);
                    phases.recreate_set(held.set.kind, set.declaration(family));
                }
                None => phases.add_set(set.declaration(family)),
            }
        }
        for ChainSpec { name, rules } in fragment.chains {
            match listed.chains.remove(&name) {
                Some(held) if held.chain.base.is_some() => {
                    phases.recreate_chain(Chain::regular(&name), held.rules.len(), rules)
                }
                Some(held) if !recreated && same_rules(&held.rules, &rules) => {}
                Some(held) => phases.rewrite_chain(&name, held.rules.len(), rules, recreated),
                None => phases.new_chain(Chain::regular(&name), rules),
            }
        }
        phases.end_group();
    }

    // What the kernel holds and nothing uses: our per-service chains go stale, our affinity
    // sets go at once; anything else is not ours to touch.
    let mut new_stale = StaleChains::new();
    let mut leftovers: Vec<_> = std::mem::take(&mut listed.chains).into_iter().collect();
    leftovers.sort_unstable_by(|a, b| a.0.cmp(&b.0));
    for (name, held) in leftovers {
        if is_service_chain(&name) {
            phases.stale_chain(&name, held.rules.len(), false);
            let since = stale.get(&name).copied().unwrap_or(now);
            new_stale.insert(name, since);
        }
    }
    let mut sets: Vec<_> = std::mem::take(&mut listed.sets).into_iter().collect();
    sets.sort_unstable_by(|a, b| a.0.cmp(&b.0));
    for (name, held) in sets {
        if is_affinity_set(&name) {
            phases.delete_set(held.set.kind, name);
        }
    }

    for store in BaseTable::stores(&cfg.features) {
        let held = held_stores.remove(store.name()).map(|s| s.elements).unwrap_or_default();
        phases.diff_elements(store.kind(), store.name(), held, committed.index.desired(store));
    }
    let plan = phases.into_plan()?;
    *stale = new_stale;
    Ok((plan, committed))
}

/// Flushes, early in the group, every listed chain whose rules name set `set` (about to be
/// deleted and added again), and forgets their rules: written again or left stale later.
fn flush_users_early(phases: &mut Phases<'_>, listed: &mut TableState, set: &str) {
    for (name, chain) in listed.chains.iter_mut() {
        if chain.rules.iter().any(|(text, _)| set_references(text).any(|s| s == set)) {
            phases.early_flushes.push(Operation::FlushChain(name.clone()));
            chain.rules.clear();
        }
    }
}

/// Plans a full sync without knowing what the kernel holds: every object written as
/// upstream's full sync writes it (chains added and flushed, sets and maps flushed and
/// filled). The per-service chains and affinity sets the kernel may hold besides stay unknown.
pub(crate) fn plan_blind(
    cfg: &NftRenderConfig,
    base: BaseTable,
    input: &SyncInput<'_>,
    sink: Option<Chunks<'_>>,
) -> Result<(Plan, Committed), NftError> {
    let family = cfg.family();
    let mut phases = Phases::new(sink);
    phases.prelude.push(Operation::AddTable);
    for set in base.sets {
        let (kind, name) = (set.kind, set.name.clone());
        phases.add_set(set);
        phases.writes.push(Operation::FlushSet { kind, name });
    }
    for spec in base.chains {
        let name = spec.chain.name.clone();
        phases.add_chain(spec.chain);
        phases.rewrite_chain(&name, 1, spec.rules, false);
    }
    match &base.nodeport_ips {
        None => {
            // Added, then deleted (after the rules naming it are rewritten): gone whether or
            // not it was there.
            phases.add_set(Set {
                kind: SetKind::Set,
                name: NODEPORT_IPS.to_string(),
                set_type: family.addr_type().to_string(),
                flags: Vec::new(),
                timeout_secs: None,
                comment: None,
            });
            phases.delete_set(SetKind::Set, NODEPORT_IPS.to_string());
        }
        Some(ips) => {
            for ip in ips {
                phases.add_element(SetKind::Set, NODEPORT_IPS, ip, (None, None));
            }
        }
    }
    phases.end_group();

    let mut committed = Committed::default();
    for (name, svc) in input.sorted_ports() {
        if phases.failed.is_some() {
            break;
        }
        let endpoints = input.endpoints_of(name);
        let fragment = render::fragment(cfg, svc, endpoints, input.node_labels);
        phases.stats.services_computed += 1;
        committed.record(name, svc, endpoints, &fragment);
        for set in &fragment.affinity_sets {
            phases.add_set(set.declaration(family));
        }
        for ChainSpec { name, rules } in fragment.chains {
            phases.add_chain(Chain::regular(&name));
            phases.rewrite_chain(&name, 1, rules, false);
        }
        phases.end_group();
    }
    for store in BaseTable::stores(&cfg.features) {
        for (key, want) in committed.index.desired(store) {
            phases.add_element(store.kind(), store.name(), key, want);
        }
    }
    Ok((phases.into_plan()?, committed))
}

/// The stale chains unused for more than [`STALE_CHAIN_DELAY`] at `now`, in name order.
pub(crate) fn due_stale_chains(stale: &StaleChains, now: Instant) -> Vec<String> {
    let mut due: Vec<String> = stale
        .iter()
        .filter(|(_, since)| now.checked_duration_since(**since).is_some_and(|d| d > STALE_CHAIN_DELAY))
        .map(|(name, _)| name.clone())
        .collect();
    due.sort_unstable();
    due
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Instant;

    use super::holds_anonymous_set;
    use crate::compat::Release;
    use crate::model::NamespacedName;
    use crate::nftables::fake::FakeNftables;
    use crate::nftables::{Family, Operation, TableState, Transaction};
    use crate::proxier::nftables::{NftSyncOutcome, NftablesProxier, test_proxier};
    use crate::synthetic;

    #[test]
    fn anonymous_sets_are_told_from_set_updates() {
        assert!(holds_anonymous_set("numgen random mod 2 vmap { 0 : goto endpoint-a , 1 : goto endpoint-b }"));
        assert!(holds_anonymous_set(
            "meta l4proto tcp dnat ip addr . port to numgen random mod 1 map { 0 : 10.0.0.1 . 80 }"
        ));
        assert!(holds_anonymous_set("ip saddr != { 203.0.113.0/24 } drop"));
        assert!(holds_anonymous_set("ip daddr { 172.16.0.0/12 } drop"));
        assert!(!holds_anonymous_set("update @affinity-abc-ns/svc/tcp/p80__10.0.0.1/80 { ip saddr }"));
        assert!(!holds_anonymous_set("ip daddr . meta l4proto . th dport vmap @service-ips"));
        assert!(!holds_anonymous_set("ip saddr @affinity-x goto endpoint-y"));
    }

    /// A proxier on `FakeNftables` with a synthetic cluster of `services` Services (every third
    /// with session affinity) × `per` endpoints, sending full syncs in pieces of `chunk`.
    fn proxier(release: Release, services: usize, per: usize, chunk: usize) -> (NftablesProxier, Arc<FakeNftables>) {
        let nft = Arc::new(FakeNftables::new(Family::Ip));
        let proxier = test_proxier(release, nft.clone()).with_chunk_operations(chunk);
        proxier.on_service_cidrs(&["172.16.0.0/12".into()]);
        for i in 0..services {
            let s = synthetic::shaped_service(i, 3);
            proxier.on_service_state(NamespacedName::of_object(&s.metadata), Some(&s));
            proxier.on_endpoint_slice_update(&synthetic::slice(i, per, 0), false);
        }
        proxier.on_services_synced();
        proxier.on_endpoint_slices_synced();
        (proxier, nft)
    }

    /// Where an operation of a first write goes in its transaction: declarations, write
    /// blocks of chains holding an anonymous set, other write blocks, the tail.
    fn class(op: &Operation, anonymous_chains: &[&str]) -> u8 {
        match op {
            Operation::AddTable | Operation::AddChain(_) | Operation::AddSet(_) => 0,
            Operation::FlushChain(c) if anonymous_chains.contains(&c.as_str()) => 1,
            Operation::AddRule(r) if anonymous_chains.contains(&r.chain.as_str()) => 1,
            Operation::FlushChain(_) | Operation::AddRule(_) | Operation::FlushSet { .. } => 2,
            _ => 3,
        }
    }

    fn first_sync_in_pieces(release: Release, blind: bool) {
        let (mut whole, whole_nft) = proxier(release, 40, 3, usize::MAX);
        let NftSyncOutcome::Synced(report) = whole.sync(Instant::now()) else { panic!("not initialised") };
        assert!(report.result.is_ok(), "{release}: {:?}", report.result);
        assert_eq!(whole_nft.runs().len(), 1);

        let (mut pieces, nft) = proxier(release, 40, 3, 60);
        if blind {
            nft.fail_next_lists(1);
        }
        let NftSyncOutcome::Synced(report) = pieces.sync(Instant::now()) else { panic!("not initialised") };
        assert!(report.result.is_ok(), "{release}: {:?}", report.result);
        assert_eq!(report.stats.listed, !blind);
        let runs: Vec<Transaction> = nft.runs();
        assert!(runs.len() > 5, "{release}: {} transactions", runs.len());

        // Each piece applies on its own, in order, to a kernel that refuses a rule naming a
        // chain or set not declared yet (so no piece leaves one for a later piece).
        let mut table = TableState::default();
        for (i, tx) in runs.iter().enumerate() {
            table.apply(tx).unwrap_or_else(|e| panic!("{release}: piece {i} refused: {e}\n{tx:?}"));
            let anonymous: Vec<&str> = tx
                .ops
                .iter()
                .filter_map(|op| match op {
                    Operation::AddRule(r) if holds_anonymous_set(&r.text) => Some(r.chain.as_str()),
                    _ => None,
                })
                .collect();
            let classes: Vec<u8> = tx.ops.iter().map(|op| class(op, &anonymous)).collect();
            assert!(classes.is_sorted(), "{release}: piece {i} out of order: {classes:?}");
            assert!(i + 1 == runs.len() || !classes.contains(&3), "{release}: elements before the last piece");
            assert!(i + 1 == runs.len() || tx.len() >= 60, "{release}: piece {i} of {} operations", tx.len());
        }
        assert!(runs.iter().any(|tx| tx.ops.iter().any(|op| class(op, &[]) == 0)));
        assert_eq!(table, whole_nft.table(), "{release}: the pieces make the table one transaction makes");
        assert_eq!(nft.table(), whole_nft.table(), "{release}");

        // The full sync against the table as listed finds nothing to do.
        pieces.force_full_sync();
        let NftSyncOutcome::Synced(report) = pieces.sync(Instant::now()) else { panic!("not initialised") };
        assert!(report.result.is_ok() && report.full, "{release}");
        assert_eq!(report.stats.operations, 0, "{release}: {:?}", report.transaction);
    }

    #[test]
    fn a_first_sync_in_pieces_applies_piece_by_piece() {
        for release in [Release::V1_33, Release::V1_35, Release::V1_37] {
            first_sync_in_pieces(release, false);
            first_sync_in_pieces(release, true);
        }
    }
}
