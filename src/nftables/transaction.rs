//! Transactions on the `kube-proxy` table: typed operations, written as the text `nft -f`
//! reads. The text is exactly what upstream's knftables writes for the same operation (its
//! `writeOperation`), so a transaction logged by us reads like one logged by upstream, and
//! the `Dump()` form upstream's tests compare is these same `add …` lines.
//!
//! Line forms (family `F` is `ip` or `ip6`, the table is always `kube-proxy`):
//!
//! ```text
//! add table F kube-proxy { comment "rules for kube-proxy" ; }
//! add chain F kube-proxy NAME [{ [type T hook H priority N ;] [comment "C" ;] }]
//! flush chain F kube-proxy NAME            delete chain F kube-proxy NAME
//! add rule F kube-proxy CHAIN RULE [comment "C"]
//! add set|map F kube-proxy NAME { type T ; [flags a,b ;] [timeout Ns ;] [comment "C" ;] }
//! flush set|map F kube-proxy NAME          delete set|map F kube-proxy NAME
//! add element F kube-proxy NAME { K1 . K2 [comment "C"] [: V] }
//! delete element F kube-proxy NAME { K1 . K2 }
//! add counter F kube-proxy NAME            delete counter F kube-proxy NAME
//! delete table F kube-proxy
//! ```
//!
//! Object comments (table, chain, set, map) are left out when the kernel does not support
//! them (knftables' `noObjectComments`); rule and element comments are always written.

use std::fmt::{self, Write as _};

use super::{Family, TABLE, go_quote};

/// A base chain's type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ChainType {
    Filter,
    Nat,
}

impl ChainType {
    pub fn as_str(self) -> &'static str {
        match self {
            ChainType::Filter => "filter",
            ChainType::Nat => "nat",
        }
    }
}

/// A base chain's hook.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Hook {
    Prerouting,
    Input,
    Forward,
    Output,
    Postrouting,
}

impl Hook {
    pub fn as_str(self) -> &'static str {
        match self {
            Hook::Prerouting => "prerouting",
            Hook::Input => "input",
            Hook::Forward => "forward",
            Hook::Output => "output",
            Hook::Postrouting => "postrouting",
        }
    }
}

/// What makes a chain a base chain: its type, hook and priority (written as a number, as
/// knftables writes `dstnat-10` and the like).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BaseChain {
    pub chain_type: ChainType,
    pub hook: Hook,
    pub priority: i32,
}

/// A chain: a base chain when `base` is set, else a regular one.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Chain {
    pub name: String,
    pub base: Option<BaseChain>,
    pub comment: Option<String>,
}

impl Chain {
    /// A regular chain without a comment.
    pub fn regular(name: impl Into<String>) -> Chain {
        Chain { name: name.into(), base: None, comment: None }
    }
}

/// A rule appended to a chain. `text` is the rule's statements as nft reads them (upstream's
/// `knftables.Concat` output); `comment` is written after it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Rule {
    pub chain: String,
    pub text: String,
    pub comment: Option<String>,
}

/// A set or a map (a map's `type` includes `: verdict` or the value type).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum SetKind {
    Set,
    Map,
}

impl SetKind {
    pub fn as_str(self) -> &'static str {
        match self {
            SetKind::Set => "set",
            SetKind::Map => "map",
        }
    }
}

/// A set or map declaration.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Set {
    pub kind: SetKind,
    pub name: String,
    /// `ipv4_addr`, `ipv4_addr . inet_proto . inet_service : verdict`, ...
    pub set_type: String,
    /// `dynamic`, `timeout`, in the order written.
    pub flags: Vec<String>,
    /// Written as whole seconds (`timeout 10800s ;`).
    pub timeout_secs: Option<u64>,
    pub comment: Option<String>,
}

/// A set or map element. `key` parts are joined with ` . `; `value` (maps only) likewise;
/// a verdict value is one part such as `goto service-…` or `drop`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Element {
    pub kind: SetKind,
    pub set: String,
    pub key: Vec<String>,
    pub value: Vec<String>,
    pub comment: Option<String>,
}

/// One operation of a transaction.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Operation {
    /// `add table` (with the table's comment).
    AddTable,
    DeleteTable,
    AddChain(Chain),
    FlushChain(String),
    DeleteChain(String),
    AddRule(Rule),
    AddSet(Set),
    FlushSet {
        kind: SetKind,
        name: String,
    },
    DeleteSet {
        kind: SetKind,
        name: String,
    },
    AddElement(Element),
    DeleteElement {
        kind: SetKind,
        set: String,
        key: Vec<String>,
    },
    AddCounter(String),
    DeleteCounter(String),
}

/// Operations applied to one family's `kube-proxy` table in one atomic `nft -f` run.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Transaction {
    pub ops: Vec<Operation>,
}

impl Transaction {
    pub fn new() -> Transaction {
        Transaction::default()
    }

    pub fn push(&mut self, op: Operation) {
        self.ops.push(op);
    }

    pub fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }

    pub fn len(&self) -> usize {
        self.ops.len()
    }

    /// The `nft -f` input for `family`, one line per operation.
    pub fn text(&self, family: Family, object_comments: bool) -> String {
        let mut out = String::with_capacity(self.ops.len() * 96);
        for op in &self.ops {
            write_operation(&mut out, family, op, object_comments);
        }
        out
    }
}

fn join_parts(out: &mut String, parts: &[String]) {
    for (i, part) in parts.iter().enumerate() {
        if i > 0 {
            out.push_str(" . ");
        }
        out.push_str(part);
    }
}

/// Appends `op` as one line (with its newline) in knftables' syntax.
pub fn write_operation(out: &mut String, family: Family, op: &Operation, object_comments: bool) {
    // `write!` into a String cannot fail.
    let _ = write_operation_fmt(out, family, op, object_comments);
}

fn write_operation_fmt(out: &mut String, family: Family, op: &Operation, object_comments: bool) -> fmt::Result {
    match op {
        Operation::AddTable => {
            write!(out, "add table {family} {TABLE}")?;
            if object_comments {
                write!(out, " {{ comment {} ; }}", go_quote(super::TABLE_COMMENT))?;
            }
        }
        Operation::DeleteTable => write!(out, "delete table {family} {TABLE}")?,
        Operation::AddChain(chain) => {
            write!(out, "add chain {family} {TABLE} {}", chain.name)?;
            let comment = chain.comment.as_ref().filter(|_| object_comments);
            if chain.base.is_some() || comment.is_some() {
                out.push_str(" {");
                if let Some(base) = &chain.base {
                    write!(
                        out,
                        " type {} hook {} priority {} ;",
                        base.chain_type.as_str(),
                        base.hook.as_str(),
                        base.priority
                    )?;
                }
                if let Some(comment) = comment {
                    write!(out, " comment {} ;", go_quote(comment))?;
                }
                out.push_str(" }");
            }
        }
        Operation::FlushChain(name) => write!(out, "flush chain {family} {TABLE} {name}")?,
        Operation::DeleteChain(name) => write!(out, "delete chain {family} {TABLE} {name}")?,
        Operation::AddRule(rule) => {
            write!(out, "add rule {family} {TABLE} {} {}", rule.chain, rule.text)?;
            if let Some(comment) = &rule.comment {
                write!(out, " comment {}", go_quote(comment))?;
            }
        }
        Operation::AddSet(set) => {
            write!(out, "add {} {family} {TABLE} {} {{ type {} ;", set.kind.as_str(), set.name, set.set_type)?;
            if !set.flags.is_empty() {
                write!(out, " flags {} ;", set.flags.join(","))?;
            }
            if let Some(timeout) = set.timeout_secs {
                write!(out, " timeout {timeout}s ;")?;
            }
            if let Some(comment) = set.comment.as_ref().filter(|_| object_comments) {
                write!(out, " comment {} ;", go_quote(comment))?;
            }
            out.push_str(" }");
        }
        Operation::FlushSet { kind, name } => write!(out, "flush {} {family} {TABLE} {name}", kind.as_str())?,
        Operation::DeleteSet { kind, name } => write!(out, "delete {} {family} {TABLE} {name}", kind.as_str())?,
        Operation::AddElement(element) => {
            write!(out, "add element {family} {TABLE} {} {{ ", element.set)?;
            join_parts(out, &element.key);
            if let Some(comment) = &element.comment {
                write!(out, " comment {}", go_quote(comment))?;
            }
            if !element.value.is_empty() {
                out.push_str(" : ");
                join_parts(out, &element.value);
            }
            out.push_str(" }");
        }
        Operation::DeleteElement { set, key, .. } => {
            write!(out, "delete element {family} {TABLE} {set} {{ ")?;
            join_parts(out, key);
            out.push_str(" }");
        }
        Operation::AddCounter(name) => write!(out, "add counter {family} {TABLE} {name}")?,
        Operation::DeleteCounter(name) => write!(out, "delete counter {family} {TABLE} {name}")?,
    }
    out.push('\n');
    Ok(())
}

impl fmt::Display for Operation {
    /// The operation's line for the `ip` family with object comments, without the newline
    /// (for logs and test messages).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut line = String::new();
        write_operation(&mut line, Family::Ip, self, true);
        f.write_str(line.trim_end())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(op: Operation) -> String {
        let mut out = String::new();
        write_operation(&mut out, Family::Ip, &op, true);
        out
    }

    #[test]
    fn lines_are_knftables_text() {
        assert_eq!(line(Operation::AddTable), "add table ip kube-proxy { comment \"rules for kube-proxy\" ; }\n");
        assert_eq!(
            line(Operation::AddChain(Chain {
                name: "filter-output-post-dnat".into(),
                base: Some(BaseChain { chain_type: ChainType::Filter, hook: Hook::Output, priority: -90 }),
                comment: None,
            })),
            "add chain ip kube-proxy filter-output-post-dnat { type filter hook output priority -90 ; }\n"
        );
        assert_eq!(
            line(Operation::AddChain(Chain {
                name: "reject-chain".into(),
                base: None,
                comment: Some("helper for @no-endpoint-services / @no-endpoint-nodeports".into()),
            })),
            "add chain ip kube-proxy reject-chain { comment \"helper for @no-endpoint-services / @no-endpoint-nodeports\" ; }\n"
        );
        assert_eq!(line(Operation::AddChain(Chain::regular("services"))), "add chain ip kube-proxy services\n");
        assert_eq!(
            line(Operation::AddRule(Rule {
                chain: "cluster-ips-check".into(),
                text: "ip daddr @cluster-ips reject".into(),
                comment: Some("Reject traffic to invalid ports of ClusterIPs".into()),
            })),
            "add rule ip kube-proxy cluster-ips-check ip daddr @cluster-ips reject comment \"Reject traffic to invalid ports of ClusterIPs\"\n"
        );
        assert_eq!(
            line(Operation::AddSet(Set {
                kind: SetKind::Set,
                name: "affinity-XXX".into(),
                set_type: "ipv4_addr".into(),
                flags: vec!["dynamic".into(), "timeout".into()],
                timeout_secs: Some(10800),
                comment: None,
            })),
            "add set ip kube-proxy affinity-XXX { type ipv4_addr ; flags dynamic,timeout ; timeout 10800s ; }\n"
        );
        assert_eq!(
            line(Operation::AddElement(Element {
                kind: SetKind::Map,
                set: "no-endpoint-services".into(),
                key: vec!["172.30.0.46".into(), "tcp".into(), "80".into()],
                value: vec!["goto reject-chain".into()],
                comment: Some("ns6/svc6:p80".into()),
            })),
            "add element ip kube-proxy no-endpoint-services { 172.30.0.46 . tcp . 80 comment \"ns6/svc6:p80\" : goto reject-chain }\n"
        );
        assert_eq!(
            line(Operation::DeleteElement {
                kind: SetKind::Map,
                set: "service-ips".into(),
                key: vec!["172.30.0.41".into(), "tcp".into(), "80".into()],
            }),
            "delete element ip kube-proxy service-ips { 172.30.0.41 . tcp . 80 }\n"
        );
    }

    #[test]
    fn object_comments_can_be_left_out() {
        let mut tx = Transaction::new();
        tx.push(Operation::AddTable);
        tx.push(Operation::AddSet(Set {
            kind: SetKind::Set,
            name: "cluster-ips".into(),
            set_type: "ipv6_addr".into(),
            flags: vec![],
            timeout_secs: None,
            comment: Some("Active ClusterIPs".into()),
        }));
        assert_eq!(
            tx.text(Family::Ip6, false),
            "add table ip6 kube-proxy\nadd set ip6 kube-proxy cluster-ips { type ipv6_addr ; }\n"
        );
    }
}
