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
use std::io;
use std::sync::atomic::{AtomicUsize, Ordering};

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
    RestoreLine {
        command: String,
        line: usize,
        output: String,
        /// The failing line and its neighbours, numbered (see [`save::format_line_context`]);
        /// empty when the input could not be shown again.
        context: String,
    },
    /// The restore input could not be produced.
    #[error("failed to write the restore input for {command}: {reason}")]
    Input { command: String, reason: String },
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

    /// The lines around the one iptables-restore rejected, when it said which.
    pub fn restore_context(&self) -> Option<&str> {
        match self {
            IptablesError::RestoreLine { context, .. } => Some(context),
            _ => None,
        }
    }
}

/// How a [`RestoreInput`] lays out each table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// Upstream's order, for one transaction: all chain declarations, then all rules, then
    /// the deletions.
    Canonical,
    /// Every chain after the chains it jumps to, each declaration followed by its rules;
    /// then the flushes of the chains to delete, then their deletions. Applied in order,
    /// any cut between two chains leaves every packet a complete path (see
    /// [`restore_plan`]).
    DependencyOrder,
}

/// A restore input written on demand, as often as needed, instead of being held as one
/// buffer (34 MB at 10k services): the proxier's rendered rules write themselves straight
/// into `iptables-restore`.
pub trait RestoreInput: Sync {
    /// Writes the input in `layout`. An input that cannot take
    /// [`Layout::DependencyOrder`] fails with [`io::ErrorKind::Unsupported`] before writing
    /// anything.
    fn write_to(&self, layout: Layout, out: &mut dyn io::Write) -> io::Result<()>;
}

/// Plain text: written as it is, or reordered by [`restore_plan::write_dependency_ordered`]
/// when it has the proxier's shape.
impl RestoreInput for &[u8] {
    fn write_to(&self, layout: Layout, out: &mut dyn io::Write) -> io::Result<()> {
        match layout {
            Layout::Canonical => out.write_all(self),
            Layout::DependencyOrder => restore_plan::write_dependency_ordered(self, out),
        }
    }
}

/// A [`RestoreInput`] that counts what it writes: the size of its last write, for logs.
pub struct CountedInput<'i> {
    input: &'i dyn RestoreInput,
    bytes: AtomicUsize,
}

impl<'i> CountedInput<'i> {
    pub fn new(input: &'i dyn RestoreInput) -> Self {
        CountedInput { input, bytes: AtomicUsize::new(0) }
    }

    /// Bytes the last write produced (0 before any).
    pub fn bytes(&self) -> usize {
        self.bytes.load(Ordering::Relaxed)
    }
}

impl RestoreInput for CountedInput<'_> {
    fn write_to(&self, layout: Layout, out: &mut dyn io::Write) -> io::Result<()> {
        struct Counting<'o> {
            out: &'o mut dyn io::Write,
            bytes: usize,
        }
        impl io::Write for Counting<'_> {
            fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
                let n = self.out.write(buf)?;
                self.bytes += n;
                Ok(n)
            }
            fn flush(&mut self) -> io::Result<()> {
                self.out.flush()
            }
        }
        let mut counting = Counting { out, bytes: 0 };
        let written = self.input.write_to(layout, &mut counting);
        self.bytes.store(counting.bytes, Ordering::Relaxed);
        written
    }
}

/// [`Iptables::restore_input`] as one [`Iptables::restore_all`] of the input's text.
pub fn restore_input_whole<I: Iptables + ?Sized>(
    iptables: &I,
    input: &dyn RestoreInput,
    flush: FlushFlag,
    counters: RestoreCounters,
    on_step: &mut dyn FnMut(),
) -> Result<()> {
    let text = input_text(input, Layout::Canonical)
        .map_err(|e| IptablesError::Input { command: "iptables-restore".into(), reason: e.to_string() })?;
    iptables.restore_all(&text, flush, counters)?;
    on_step();
    Ok(())
}

/// The whole of `input` in `layout`, as bytes.
pub fn input_text(input: &dyn RestoreInput, layout: Layout) -> io::Result<Vec<u8>> {
    let mut text = Vec::new();
    input.write_to(layout, &mut text)?;
    Ok(text)
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
    /// [`Iptables::restore_all`] of an input written on demand, calling `on_step` after each
    /// transaction when it is applied as several (see [`restore_plan`]), so a long restore
    /// can show it is moving. The default writes the input into a buffer first.
    fn restore_input(
        &self,
        input: &dyn RestoreInput,
        flush: FlushFlag,
        counters: RestoreCounters,
        on_step: &mut dyn FnMut(),
    ) -> Result<()> {
        restore_input_whole(self, input, flush, counters, on_step)
    }
    /// Whether MASQUERADE accepts `--random-fully`.
    fn has_random_fully(&self) -> bool;
    /// Whether the kernel supports this family's tables at all.
    fn present(&self) -> bool;
}
