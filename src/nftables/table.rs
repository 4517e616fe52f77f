//! A model of one family's `kube-proxy` table as the kernel holds it: chains with their
//! rules, sets and maps with their elements, counters. [`TableState::apply`] applies a
//! [`Transaction`] with the kernel's semantics, atomically (on error nothing changes), and
//! refuses what the kernel refuses, so a transaction the model accepts is one `nft -f` takes:
//!
//! * objects must exist to be flushed, deleted, or added to (rules, elements);
//! * a rule may only `jump`/`goto` existing chains and name (`@set`) existing sets and maps;
//!   a map element's verdict may only name an existing chain;
//! * a chain or set still referenced (by a rule of another chain or a map element) cannot be
//!   deleted (`EBUSY`); a chain still holding rules is deleted with them (as kernel 6.18
//!   does for nft's `delete chain`);
//! * adding an element whose key exists with another value fails (`EEXIST`: upstream deletes
//!   then adds); with the same value it is a no-op, as is adding an existing object, except
//!   that an existing set or map added again takes the new default timeout (and must have
//!   the same type and flags: `EEXIST`).
//!
//! [`TableState::dump`] writes the table as knftables' fake `Dump()` does (the form
//! upstream's tests compare, and an order `nft -f` accepts on a node without the table):
//! the table, chains, sets, maps and counters, then each chain's rules, then elements.
//! Objects come by name (bytewise); elements by their line. [`sort_dump`] is upstream's
//! test normalisation (`sortNFTablesTransaction`), for comparing with its fixtures.

use std::collections::{BTreeMap, BTreeSet};

use super::Family;
use super::transaction::{Chain, Element, Operation, Rule, Set, SetKind, Transaction, write_operation};

/// Set flags compared regardless of the order written.
fn sorted(flags: &[String]) -> BTreeSet<&str> {
    flags.iter().map(String::as_str).collect()
}

/// Why the kernel (as modelled) refused a transaction: the failing operation, by its index
/// and text, and the error the kernel gives.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("operation {index} `{operation}`: {reason}")]
pub struct ApplyError {
    pub index: usize,
    pub operation: String,
    pub reason: ApplyErrorReason,
}

/// The kernel's refusal, as `nft` reports it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ApplyErrorReason {
    #[error("No such file or directory: {0} does not exist")]
    NotFound(String),
    #[error("Device or resource busy: {0}")]
    Busy(String),
    #[error("File exists: {0}")]
    Exists(String),
}

/// A chain as held: its declaration and its rules in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChainState {
    pub chain: Chain,
    /// `(text, comment)` in order.
    pub rules: Vec<(String, Option<String>)>,
}

/// An element as held: its value and comment, keyed by its joined key in [`SetState`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ElementState {
    pub key: Vec<String>,
    pub value: Vec<String>,
    pub comment: Option<String>,
}

/// A set or map as held.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SetState {
    pub set: Set,
    /// By the key's ` . `-joined text.
    pub elements: BTreeMap<String, ElementState>,
}

/// One family's `kube-proxy` table, or its absence.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TableState {
    pub exists: bool,
    pub chains: BTreeMap<String, ChainState>,
    pub sets: BTreeMap<String, SetState>,
    pub counters: BTreeSet<String>,
}

/// The chain names a rule text or verdict jumps to (`jump X`, `goto X`).
pub fn chain_references(text: &str) -> impl Iterator<Item = &str> {
    let mut words = text.split_whitespace().peekable();
    std::iter::from_fn(move || {
        while let Some(word) = words.next() {
            if (word == "jump" || word == "goto")
                && let Some(target) = words.peek()
            {
                let target = target.trim_end_matches([',', '}']);
                if !target.is_empty() {
                    return Some(target);
                }
            }
        }
        None
    })
}

/// The set and map names a rule text refers to (`@name`).
pub fn set_references(text: &str) -> impl Iterator<Item = &str> {
    text.split_whitespace().filter_map(|word| {
        let name = word.strip_prefix('@')?;
        let name = name.trim_end_matches([',', '}', ')']);
        (!name.is_empty()).then_some(name)
    })
}

fn join_key(parts: &[String]) -> String {
    parts.join(" . ")
}

impl TableState {
    /// An empty, existing table.
    pub fn new_empty() -> TableState {
        TableState { exists: true, ..TableState::default() }
    }

    /// Applies `tx` atomically: on error the state is unchanged.
    pub fn apply(&mut self, tx: &Transaction) -> Result<(), ApplyError> {
        let mut next = self.clone();
        for (index, op) in tx.ops.iter().enumerate() {
            next.apply_one(op).map_err(|reason| ApplyError { index, operation: op.to_string(), reason })?;
        }
        *self = next;
        Ok(())
    }

    fn require_table(&self) -> Result<(), ApplyErrorReason> {
        if self.exists { Ok(()) } else { Err(ApplyErrorReason::NotFound("table kube-proxy".into())) }
    }

    fn chain_referenced(&self, name: &str) -> Option<String> {
        for (chain_name, chain) in &self.chains {
            if chain_name != name && chain.rules.iter().any(|(text, _)| chain_references(text).any(|t| t == name)) {
                return Some(format!("chain {name} is referenced by a rule in chain {chain_name}"));
            }
        }
        for (set_name, set) in &self.sets {
            if set.elements.values().any(|e| e.value.iter().any(|v| chain_references(v).any(|t| t == name))) {
                return Some(format!("chain {name} is referenced by an element of map {set_name}"));
            }
        }
        None
    }

    fn set_referenced(&self, name: &str) -> Option<String> {
        self.chains.iter().find_map(|(chain_name, chain)| {
            chain
                .rules
                .iter()
                .any(|(text, _)| set_references(text).any(|s| s == name))
                .then(|| format!("set {name} is referenced by a rule in chain {chain_name}"))
        })
    }

    fn check_rule_references(&self, rule: &Rule) -> Result<(), ApplyErrorReason> {
        for target in chain_references(&rule.text) {
            if !self.chains.contains_key(target) {
                return Err(ApplyErrorReason::NotFound(format!("chain {target}")));
            }
        }
        for set in set_references(&rule.text) {
            if !self.sets.contains_key(set) {
                return Err(ApplyErrorReason::NotFound(format!("set {set}")));
            }
        }
        Ok(())
    }

    fn apply_one(&mut self, op: &Operation) -> Result<(), ApplyErrorReason> {
        match op {
            Operation::AddTable => self.exists = true,
            Operation::DeleteTable => {
                self.require_table()?;
                *self = TableState::default();
            }
            Operation::AddChain(chain) => {
                self.require_table()?;
                match self.chains.get(&chain.name) {
                    // A plain `add chain` of an existing chain, base or not, changes nothing
                    // (upstream relies on it: add then delete each base chain at start-up);
                    // a base declaration must match the existing chain's.
                    Some(existing) if chain.base.is_some() && existing.chain.base != chain.base => {
                        return Err(ApplyErrorReason::Exists(format!(
                            "chain {} exists with another type, hook or priority",
                            chain.name
                        )));
                    }
                    Some(_) => {}
                    None => {
                        self.chains.insert(chain.name.clone(), ChainState { chain: chain.clone(), rules: Vec::new() });
                    }
                }
            }
            Operation::FlushChain(name) => {
                self.require_table()?;
                let chain =
                    self.chains.get_mut(name).ok_or_else(|| ApplyErrorReason::NotFound(format!("chain {name}")))?;
                chain.rules.clear();
            }
            Operation::DeleteChain(name) => {
                self.require_table()?;
                if !self.chains.contains_key(name) {
                    return Err(ApplyErrorReason::NotFound(format!("chain {name}")));
                }
                // A chain still holding rules is deleted with them (measured on kernel 6.18
                // with nft 1.0.6: nft sends a recursive delete; kernels before the
                // recursive `NFT_MSG_DELCHAIN` refused it with EBUSY). Only references from
                // other chains or from map elements keep it.
                if let Some(why) = self.chain_referenced(name) {
                    return Err(ApplyErrorReason::Busy(why));
                }
                self.chains.remove(name);
            }
            Operation::AddRule(rule) => {
                self.require_table()?;
                self.check_rule_references(rule)?;
                let chain = self
                    .chains
                    .get_mut(&rule.chain)
                    .ok_or_else(|| ApplyErrorReason::NotFound(format!("chain {}", rule.chain)))?;
                chain.rules.push((rule.text.clone(), rule.comment.clone()));
            }
            Operation::AddSet(set) => {
                self.require_table()?;
                match self.sets.get_mut(&set.name) {
                    Some(existing) if existing.set.kind != set.kind || existing.set.set_type != set.set_type => {
                        return Err(ApplyErrorReason::Exists(format!(
                            "{} {} exists with another type",
                            existing.set.kind.as_str(),
                            set.name
                        )));
                    }
                    Some(existing) if sorted(&existing.set.flags) != sorted(&set.flags) => {
                        return Err(ApplyErrorReason::Exists(format!(
                            "{} {} exists with other flags",
                            existing.set.kind.as_str(),
                            set.name
                        )));
                    }
                    // Adding an existing set again replaces its default timeout (none when
                    // the new declaration has none) and keeps its comment: measured on
                    // kernel 6.18 with nft 1.0.6.
                    Some(existing) => existing.set.timeout_secs = set.timeout_secs,
                    None => {
                        self.sets.insert(set.name.clone(), SetState { set: set.clone(), elements: BTreeMap::new() });
                    }
                }
            }
            Operation::FlushSet { kind, name } => {
                self.require_table()?;
                let set = self.sets.get_mut(name).filter(|s| s.set.kind == *kind);
                set.ok_or_else(|| ApplyErrorReason::NotFound(format!("{} {name}", kind.as_str())))?.elements.clear();
            }
            Operation::DeleteSet { kind, name } => {
                self.require_table()?;
                if self.sets.get(name).is_none_or(|s| s.set.kind != *kind) {
                    return Err(ApplyErrorReason::NotFound(format!("{} {name}", kind.as_str())));
                }
                if let Some(why) = self.set_referenced(name) {
                    return Err(ApplyErrorReason::Busy(why));
                }
                self.sets.remove(name);
            }
            Operation::AddElement(element) => {
                self.require_table()?;
                for value in &element.value {
                    for target in chain_references(value) {
                        if !self.chains.contains_key(target) {
                            return Err(ApplyErrorReason::NotFound(format!("chain {target}")));
                        }
                    }
                }
                let set =
                    self.sets.get_mut(&element.set).filter(|s| s.set.kind == element.kind).ok_or_else(|| {
                        ApplyErrorReason::NotFound(format!("{} {}", element.kind.as_str(), element.set))
                    })?;
                let key = join_key(&element.key);
                match set.elements.get(&key) {
                    Some(existing) if existing.value != element.value => {
                        return Err(ApplyErrorReason::Exists(format!(
                            "element {{ {key} }} of {} has another value",
                            element.set
                        )));
                    }
                    Some(_) => {}
                    None => {
                        set.elements.insert(
                            key,
                            ElementState {
                                key: element.key.clone(),
                                value: element.value.clone(),
                                comment: element.comment.clone(),
                            },
                        );
                    }
                }
            }
            Operation::DeleteElement { kind, set, key } => {
                self.require_table()?;
                let state = self
                    .sets
                    .get_mut(set)
                    .filter(|s| s.set.kind == *kind)
                    .ok_or_else(|| ApplyErrorReason::NotFound(format!("{} {set}", kind.as_str())))?;
                let joined = join_key(key);
                if state.elements.remove(&joined).is_none() {
                    return Err(ApplyErrorReason::NotFound(format!("element {{ {joined} }} of {set}")));
                }
            }
            Operation::AddCounter(name) => {
                self.require_table()?;
                self.counters.insert(name.clone());
            }
            Operation::DeleteCounter(name) => {
                self.require_table()?;
                if !self.counters.remove(name) {
                    return Err(ApplyErrorReason::NotFound(format!("counter {name}")));
                }
            }
        }
        Ok(())
    }

    /// The operations that build this table from nothing, in [`TableState::dump`]'s order.
    pub fn to_transaction(&self) -> Transaction {
        let mut tx = Transaction::new();
        if !self.exists {
            return tx;
        }
        tx.push(Operation::AddTable);
        for chain in self.chains.values() {
            tx.push(Operation::AddChain(chain.chain.clone()));
        }
        for kind in [SetKind::Set, SetKind::Map] {
            for set in self.sets.values().filter(|s| s.set.kind == kind) {
                tx.push(Operation::AddSet(set.set.clone()));
            }
        }
        for name in &self.counters {
            tx.push(Operation::AddCounter(name.clone()));
        }
        for (name, chain) in &self.chains {
            for (text, comment) in &chain.rules {
                tx.push(Operation::AddRule(Rule { chain: name.clone(), text: text.clone(), comment: comment.clone() }));
            }
        }
        for kind in [SetKind::Set, SetKind::Map] {
            for set in self.sets.values().filter(|s| s.set.kind == kind) {
                for element in set.elements.values() {
                    tx.push(Operation::AddElement(Element {
                        kind,
                        set: set.set.name.clone(),
                        key: element.key.clone(),
                        value: element.value.clone(),
                        comment: element.comment.clone(),
                    }));
                }
            }
        }
        tx
    }

    /// The table as knftables' fake `Dump()` writes it (see the module documentation); empty
    /// when the table does not exist.
    pub fn dump(&self, family: Family) -> String {
        let tx = self.to_transaction();
        let mut out = String::new();
        for op in &tx.ops {
            write_operation(&mut out, family, op, true);
        }
        out
    }

    /// The table as `nft list` shows it ([`super::Nftables::list_table`]): rule text in nft's
    /// canonical words ([`super::canonical_rule`]), element keys and values likewise, set
    /// flags in nft's order. What the fake lists, and what a real listing of a table written
    /// from this model equals.
    pub fn as_listed(&self) -> TableState {
        let mut listed = self.clone();
        for chain in listed.chains.values_mut() {
            for (text, _) in &mut chain.rules {
                *text = super::canonical_rule(text);
            }
        }
        for set in listed.sets.values_mut() {
            set.set.flags = super::canonical::listed_flag_order(&set.set.flags);
            let elements = std::mem::take(&mut set.elements);
            for (_, mut element) in elements {
                let canonical = |parts: &[String]| -> Vec<String> {
                    if parts.len() == 1 && (parts[0].starts_with("goto ") || parts[0].starts_with("jump ")) {
                        return parts.to_vec();
                    }
                    parts.iter().map(|p| super::canonical::canonical_element(p)).collect()
                };
                element.key = canonical(&element.key);
                element.value = canonical(&element.value);
                set.elements.insert(join_key(&element.key), element);
            }
        }
        listed
    }

    /// Counts of what the table holds: (chains, rules, sets and maps, elements).
    pub fn counts(&self) -> (usize, usize, usize, usize) {
        let rules = self.chains.values().map(|c| c.rules.len()).sum();
        let elements = self.sets.values().map(|s| s.elements.len()).sum();
        (self.chains.len(), rules, self.sets.len(), elements)
    }
}

/// Upstream's `sortNFTablesTransaction` (pkg/proxy/nftables/helpers_test.go): drops empty
/// and `#` lines, then sorts stably by object type (table, chain, rule, set, map, element),
/// then by the object's name (the fifth word), keeping rules of one chain in order and
/// ordering other lines of one name by their text.
pub fn sort_dump(text: &str) -> String {
    fn order(kind: &str) -> u8 {
        match kind {
            "table" => 10,
            "chain" => 9,
            "rule" => 8,
            "set" => 7,
            "map" => 6,
            "element" => 5,
            _ => 0,
        }
    }
    let mut lines: Vec<&str> = text.lines().filter(|l| !l.is_empty() && !l.starts_with('#')).collect();
    lines.sort_by(|a, b| {
        use std::cmp::Ordering;
        let wa: Vec<&str> = a.split(' ').collect();
        let wb: Vec<&str> = b.split(' ').collect();
        if wa.len() < 5 || wb.len() < 5 {
            return Ordering::Equal;
        }
        if wa[1] != wb[1] {
            return order(wb[1]).cmp(&order(wa[1]));
        }
        if wa[4] != wb[4] {
            return wa[4].cmp(wb[4]);
        }
        if wa[1] == "rule" {
            return Ordering::Equal;
        }
        a.cmp(b)
    });
    let mut out = lines.join("\n");
    out.push('\n');
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nftables::transaction::{BaseChain, ChainType, Hook};

    fn rule(chain: &str, text: &str) -> Operation {
        Operation::AddRule(Rule { chain: chain.into(), text: text.into(), comment: None })
    }

    fn map(name: &str) -> Operation {
        Operation::AddSet(Set {
            kind: SetKind::Map,
            name: name.into(),
            set_type: "ipv4_addr . inet_proto . inet_service : verdict".into(),
            flags: vec![],
            timeout_secs: None,
            comment: None,
        })
    }

    fn element(set: &str, key: &[&str], value: &str) -> Operation {
        Operation::AddElement(Element {
            kind: SetKind::Map,
            set: set.into(),
            key: key.iter().map(|s| s.to_string()).collect(),
            value: vec![value.into()],
            comment: None,
        })
    }

    fn tx(ops: Vec<Operation>) -> Transaction {
        Transaction { ops }
    }

    fn base() -> TableState {
        let mut t = TableState::default();
        t.apply(&tx(vec![
            Operation::AddTable,
            Operation::AddChain(Chain {
                name: "nat-prerouting".into(),
                base: Some(BaseChain { chain_type: ChainType::Nat, hook: Hook::Prerouting, priority: -100 }),
                comment: None,
            }),
            Operation::AddChain(Chain::regular("services")),
            Operation::AddChain(Chain::regular("service-A")),
            map("service-ips"),
            rule("nat-prerouting", "jump services"),
            rule("services", "ip daddr . meta l4proto . th dport vmap @service-ips"),
            element("service-ips", &["10.0.0.1", "tcp", "80"], "goto service-A"),
        ]))
        .expect("base applies");
        t
    }

    #[test]
    fn references_are_enforced_like_the_kernel() {
        let mut t = base();
        let before = t.clone();
        // A jump to a missing chain, an unknown set, a missing element's deletion.
        for op in [
            rule("services", "jump nowhere"),
            rule("services", "ip daddr @nothing drop"),
            Operation::DeleteElement { kind: SetKind::Map, set: "service-ips".into(), key: vec!["1.1.1.1".into()] },
            element("service-ips", &["10.0.0.2", "tcp", "80"], "goto missing"),
        ] {
            let err = t.apply(&tx(vec![op])).unwrap_err();
            assert!(matches!(err.reason, ApplyErrorReason::NotFound(_)), "{err}");
        }
        // Deleting a chain a map element still points at, or one a rule jumps to.
        let err = t.apply(&tx(vec![Operation::DeleteChain("service-A".into())])).unwrap_err();
        assert!(matches!(err.reason, ApplyErrorReason::Busy(_)), "{err}");
        let err = t.apply(&tx(vec![Operation::DeleteChain("services".into())])).unwrap_err();
        assert!(matches!(err.reason, ApplyErrorReason::Busy(_)), "{err}");
        // A chain with rules that nothing refers to goes, rules and all.
        let mut scratch = t.clone();
        scratch
            .apply(&tx(vec![Operation::AddChain(Chain::regular("lone")), rule("lone", "ip saddr @service-ips drop")]))
            .expect("a chain with a rule");
        scratch.apply(&tx(vec![Operation::DeleteChain("lone".into())])).expect("deleted with its rule");
        assert!(!scratch.chains.contains_key("lone"));
        // Another value for an existing key.
        let err = t.apply(&tx(vec![element("service-ips", &["10.0.0.1", "tcp", "80"], "drop")])).unwrap_err();
        assert!(matches!(err.reason, ApplyErrorReason::Exists(_)), "{err}");
        // Atomic: a failing transaction changes nothing, even after good operations.
        let err = t
            .apply(&tx(vec![Operation::AddChain(Chain::regular("service-B")), rule("service-B", "goto nowhere")]))
            .unwrap_err();
        assert_eq!(err.index, 1);
        assert_eq!(t, before);
        // Delete the element, then the chain: fine.
        t.apply(&tx(vec![
            Operation::DeleteElement {
                kind: SetKind::Map,
                set: "service-ips".into(),
                key: vec!["10.0.0.1".into(), "tcp".into(), "80".into()],
            },
            Operation::DeleteChain("service-A".into()),
        ]))
        .expect("unreferenced chain deletes");
        assert!(!t.chains.contains_key("service-A"));
    }

    #[test]
    fn a_set_added_again_takes_the_new_timeout_and_keeps_its_comment() {
        let mut t = base();
        let affinity = |flags: &[&str], timeout_secs: Option<u64>, comment: Option<&str>| {
            Operation::AddSet(Set {
                kind: SetKind::Set,
                name: "affinity".into(),
                set_type: "ipv4_addr".into(),
                flags: flags.iter().map(|f| f.to_string()).collect(),
                timeout_secs,
                comment: comment.map(Into::into),
            })
        };
        t.apply(&tx(vec![affinity(&["dynamic", "timeout"], Some(10800), Some("first"))])).unwrap();
        t.apply(&tx(vec![affinity(&["timeout", "dynamic"], Some(60), Some("second"))])).unwrap();
        assert_eq!(t.sets["affinity"].set.timeout_secs, Some(60));
        assert_eq!(t.sets["affinity"].set.comment.as_deref(), Some("first"));
        t.apply(&tx(vec![affinity(&["dynamic", "timeout"], None, None)])).unwrap();
        assert_eq!(t.sets["affinity"].set.timeout_secs, None);
        let err = t.apply(&tx(vec![affinity(&["timeout"], Some(60), None)])).unwrap_err();
        assert!(matches!(err.reason, ApplyErrorReason::Exists(_)), "{err}");
    }

    #[test]
    fn dump_is_knftables_order_and_sort_dump_is_upstreams() {
        let t = base();
        assert_eq!(
            t.dump(Family::Ip),
            "add table ip kube-proxy { comment \"rules for kube-proxy\" ; }\n\
             add chain ip kube-proxy nat-prerouting { type nat hook prerouting priority -100 ; }\n\
             add chain ip kube-proxy service-A\n\
             add chain ip kube-proxy services\n\
             add map ip kube-proxy service-ips { type ipv4_addr . inet_proto . inet_service : verdict ; }\n\
             add rule ip kube-proxy nat-prerouting jump services\n\
             add rule ip kube-proxy services ip daddr . meta l4proto . th dport vmap @service-ips\n\
             add element ip kube-proxy service-ips { 10.0.0.1 . tcp . 80 : goto service-A }\n"
        );
        // The dump rebuilds the same table from nothing.
        let mut rebuilt = TableState::default();
        rebuilt.apply(&t.to_transaction()).expect("a dump applies to an empty kernel");
        assert_eq!(rebuilt, t);
        // Upstream's normalisation: rules after chains, before sets and maps; rules keep their
        // order within a chain; comments and blank lines dropped.
        let text = "# svc\nadd element ip kube-proxy m { b }\nadd rule ip kube-proxy c z\n\nadd rule ip kube-proxy c a\n\
                    add map ip kube-proxy m { type x ; }\nadd element ip kube-proxy m { a }\nadd chain ip kube-proxy c\n";
        assert_eq!(
            sort_dump(text),
            "add chain ip kube-proxy c\nadd rule ip kube-proxy c z\nadd rule ip kube-proxy c a\n\
             add map ip kube-proxy m { type x ; }\nadd element ip kube-proxy m { a }\nadd element ip kube-proxy m { b }\n"
        );
    }

    #[test]
    fn references_are_read_from_rule_text() {
        let text = "numgen random mod 2 vmap { 0 : goto endpoint-A , 1 : goto endpoint-B }";
        assert_eq!(chain_references(text).collect::<Vec<_>>(), ["endpoint-A", "endpoint-B"]);
        assert_eq!(set_references("ip saddr @affinity-X goto endpoint-X").collect::<Vec<_>>(), ["affinity-X"]);
        assert_eq!(set_references("update @affinity-X { ip saddr }").collect::<Vec<_>>(), ["affinity-X"]);
    }
}
