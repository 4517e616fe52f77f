//! The iptables layer: the `Iptables` interface the proxier programs rules through, the
//! restore/save text helpers, the chain tracker the `render` command uses as its kernel, and,
//! under the `testing` feature, a fake that models the kernel tables and the rule-dump model
//! tests compare rule sets with.
//!
//! Nothing outside this module knows how iptables is invoked.

pub mod chain_tracker;
#[cfg(any(test, feature = "testing"))]
pub mod dump;
#[cfg(any(test, feature = "testing"))]
pub mod fake;
pub mod lock;
pub mod monitor;
pub mod nft;
pub mod restore_plan;
pub mod runner;
pub mod save;

use std::fmt;

use crate::model::IpFamily;

/// The tables kube-proxy touches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Table {
    Filter,
    Nat,
    Mangle,
}

impl Table {
    pub fn as_str(self) -> &'static str {
        match self {
            Table::Filter => "filter",
            Table::Nat => "nat",
            Table::Mangle => "mangle",
        }
    }

    pub fn parse(s: &str) -> Option<Table> {
        match s {
            "filter" => Some(Table::Filter),
            "nat" => Some(Table::Nat),
            "mangle" => Some(Table::Mangle),
            _ => None,
        }
    }
}

impl fmt::Display for Table {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Built-in chains our jump rules hang off.
pub(crate) const CHAIN_PREROUTING: &str = "PREROUTING";
pub(crate) const CHAIN_POSTROUTING: &str = "POSTROUTING";
pub(crate) const CHAIN_OUTPUT: &str = "OUTPUT";
pub(crate) const CHAIN_INPUT: &str = "INPUT";
pub(crate) const CHAIN_FORWARD: &str = "FORWARD";

/// `-I` or `-A` for `ensure_rule`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RulePosition {
    Prepend,
    Append,
}

impl RulePosition {
    pub fn flag(self) -> &'static str {
        match self {
            RulePosition::Prepend => "-I",
            RulePosition::Append => "-A",
        }
    }
}

/// Whether `iptables-restore` flushes the tables it is given (`--noflush` when not).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FlushFlag {
    Flush,
    NoFlush,
}

/// Whether `iptables-restore` is passed `--counters`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RestoreCounters {
    Counters,
    NoCounters,
}

#[derive(Debug, thiserror::Error)]
pub enum IptablesError {
    /// The command could not be run at all (missing binary, spawn failure, timeout).
    #[error("failed to run {command}: {reason}")]
    Exec { command: String, reason: String },
    /// The command ran and failed.
    #[error("{command} {args} failed with exit status {status}: {output}")]
    Failed { command: String, args: String, status: i32, output: String },
    /// `iptables-restore` rejected a line of its input.
    #[error("{command}: input error on line {line}: {output}")]
    RestoreLine { command: String, line: usize, output: String },
    /// A lock could not be taken (old iptables without `--wait`).
    #[error("failed to acquire iptables lock: {0}")]
    Lock(String),
}

impl IptablesError {
    /// The line of the restore input that failed, when iptables-restore said so.
    pub fn restore_line(&self) -> Option<usize> {
        match self {
            IptablesError::RestoreLine { line, .. } => Some(*line),
            _ => None,
        }
    }
}

pub type Result<T, E = IptablesError> = std::result::Result<T, E>;

/// The operations the proxier needs from iptables (upstream's `utiliptables.Interface`).
/// Implementations serialise their own calls; callers may share them across threads.
pub trait Iptables: Send + Sync {
    /// The family this instance manages (iptables vs ip6tables).
    fn family(&self) -> IpFamily;
    /// Creates `chain` if missing; `Ok(true)` if it already existed.
    fn ensure_chain(&self, table: Table, chain: &str) -> Result<bool>;
    fn flush_chain(&self, table: Table, chain: &str) -> Result<()>;
    fn delete_chain(&self, table: Table, chain: &str) -> Result<()>;
    fn chain_exists(&self, table: Table, chain: &str) -> Result<bool>;
    /// Adds the rule unless an identical one exists; `Ok(true)` if it already existed.
    fn ensure_rule(&self, position: RulePosition, table: Table, chain: &str, args: &[&str]) -> Result<bool>;
    /// Whether an identical rule exists (`iptables -C`; a rule jumping to a missing chain
    /// does not); changes nothing.
    fn rule_exists(&self, table: Table, chain: &str, args: &[&str]) -> Result<bool>;
    /// Deletes the rule if present.
    fn delete_rule(&self, table: Table, chain: &str, args: &[&str]) -> Result<()>;
    /// `iptables-save -t table`.
    fn save_into(&self, table: Table, out: &mut Vec<u8>) -> Result<()>;
    /// The names of the chains in `table`, in no particular order (built-in chains nothing
    /// has used may be missing on nft).
    /// Implementations read them the cheapest way the backend allows; the default reads
    /// `iptables-save`.
    fn list_chains(&self, table: Table) -> Result<Vec<String>> {
        let mut saved = Vec::new();
        self.save_into(table, &mut saved)?;
        Ok(save::chains_from_table(&saved).into_iter().collect())
    }
    /// `iptables-restore -T table`.
    fn restore(&self, table: Table, data: &[u8], flush: FlushFlag, counters: RestoreCounters) -> Result<()>;
    /// `iptables-restore` of several tables at once.
    fn restore_all(&self, data: &[u8], flush: FlushFlag, counters: RestoreCounters) -> Result<()>;
    /// [`Iptables::restore_all`], calling `on_step` after each transaction when the input is
    /// applied as several (see [`restore_plan`]), so a long restore can show it is moving.
    fn restore_all_in_steps(
        &self,
        data: &[u8],
        flush: FlushFlag,
        counters: RestoreCounters,
        on_step: &mut dyn FnMut(),
    ) -> Result<()> {
        self.restore_all(data, flush, counters)?;
        on_step();
        Ok(())
    }
    /// Whether MASQUERADE accepts `--random-fully`.
    fn has_random_fully(&self) -> bool;
    /// Whether the kernel supports this family's tables at all.
    fn present(&self) -> bool;
}
