//! An in-memory [`Iptables`] that models the kernel's tables, for tests (the `testing` feature;
//! the `render` command uses the lighter [`super::chain_tracker::ChainTracker`]).
//!
//! This module owns [`FakeIptables`]. Unlike upstream's `iptablestest.FakeIPTables` (which
//! replaces whole chains with whatever a restore declared), it applies restore payloads line by
//! line with `iptables-restore` semantics, so tests see the same successes and failures a node
//! would:
//!
//! * Each family instance has the `filter`, `nat` and `mangle` tables with their built-in
//!   chains (policy `ACCEPT`): filter `INPUT FORWARD OUTPUT`; nat `PREROUTING INPUT OUTPUT
//!   POSTROUTING`; mangle all five.
//! * `*table` starts a section. Without `--noflush` ([`FlushFlag::Flush`]) the table is
//!   flushed first: every user chain deleted, every built-in chain emptied (policies kept).
//!   `restore` (`-T table`) skips the sections of other tables.
//! * `:NAME POLICY [p:b]` creates a user chain, or with `--noflush` flushes it if it exists (a
//!   second declaration in one flushing payload is an error, as `iptables-restore` reports
//!   "chain already exists"). On a built-in chain it only sets the policy (unless `-`) and
//!   never flushes. Policies other than `-` on user chains are errors.
//! * `-A`, `-I [n]`, `-D (n | rule)`, `-R n`, `-N`, `-X [chain]`, `-F [chain]`, `-Z [chain]`,
//!   `-P chain policy` work as in `iptables`. A `-j`/`-g` target must be a standard or
//!   extension target (`ACCEPT`, `DNAT`, `MARK`, ...) or an existing user chain of the table.
//!   `-X` fails if the chain does not exist, is built-in, still has rules, or is the target of
//!   any rule in the table. Chain names are limited to 28 characters.
//! * `COMMIT` ends a section; a missing `COMMIT` fails on the line after the last one.
//! * A restore is atomic: it is applied to a copy that replaces the live tables only if every
//!   line succeeded. (That is `iptables-nft`'s behaviour; legacy `iptables-restore` commits
//!   table by table, so an earlier table could stick there.) Failures are
//!   [`IptablesError::RestoreLine`] with the 1-based number of the failing line.
//! * With [`RestoreCounters::Counters`] rule lines may carry a `[packets:bytes]` prefix;
//!   counters themselves are not modelled (everything saves as `[0:0]`).
//!
//! Rule arguments are split the way `iptables-restore` splits them (double quotes group, `\"`
//! escapes inside quotes) and rules are compared by those argument lists, so
//! `ensure_rule(.., &["-m", "comment", "--comment", "a b", ..])` finds a rule restored as
//! `-m comment --comment "a b" ..`. A rule's text is kept as written in the restore line (after
//! `-A CHAIN `), or rendered from the arguments with minimal quoting for `ensure_rule`.
//! `iptables-save` output is therefore *not* normalised the way the kernel round trip
//! normalises it (no `/32` suffixes, no re-ordered matches, no quoting of every comment).
//!
//! The single-command methods follow upstream's runner: `ensure_chain`/`ensure_rule` report
//! whether the chain/rule already existed, `delete_rule` on a missing chain or rule succeeds,
//! `flush_chain`/`delete_chain` on a missing chain fail, `chain_exists` answers `Ok(false)`
//! for a missing chain.
//!
//! For tests it records every call ([`FakeIptables::calls`]) and restore payload
//! ([`FakeIptables::restores`]), can be scripted to fail ([`FakeIptables::fail_next_restore`],
//! [`FakeIptables::fail_restores_containing`], [`FakeIptables::fail_next_save`]), and exposes
//! the tables ([`FakeIptables::rules`], [`FakeIptables::chains`], [`FakeIptables::save_all`]).
//! State lives behind a `std::sync::Mutex`; no lock is held across calls into other code.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Mutex, MutexGuard, PoisonError};

use super::{FlushFlag, Iptables, IptablesError, RestoreCounters, RestoreInput, Result, RulePosition, Table};
use crate::model::IpFamily;

const ALL_TABLES: [Table; 3] = [Table::Filter, Table::Nat, Table::Mangle];

/// `XT_EXTENSION_MAXNAMELEN - 1`.
const MAX_CHAIN_NAME_LEN: usize = 28;

/// Standard verdicts and the extension targets a rule may jump to without a chain of that
/// name existing. Not exhaustive, but covers everything kube-proxy and common CNIs write.
const TARGETS: &[&str] = &[
    "ACCEPT",
    "DROP",
    "RETURN",
    "QUEUE",
    "REJECT",
    "DNAT",
    "SNAT",
    "MASQUERADE",
    "REDIRECT",
    "NETMAP",
    "MARK",
    "CONNMARK",
    "LOG",
    "NFLOG",
    "ULOG",
    "NOTRACK",
    "CT",
    "TRACE",
    "TCPMSS",
    "TPROXY",
    "CLASSIFY",
    "DSCP",
    "TOS",
    "TTL",
    "HL",
    "ECN",
    "SET",
    "AUDIT",
    "CHECKSUM",
    "NFQUEUE",
    "SECMARK",
    "CONNSECMARK",
    "IDLETIMER",
    "LED",
    "RATEEST",
    "TEE",
    "HMARK",
    "SYNPROXY",
    "CLUSTERIP",
    "DNPT",
    "SNPT",
    "TCPOPTSTRIP",
];

fn builtin_chains(table: Table) -> &'static [&'static str] {
    match table {
        Table::Filter => &["INPUT", "FORWARD", "OUTPUT"],
        Table::Nat => &["PREROUTING", "INPUT", "OUTPUT", "POSTROUTING"],
        Table::Mangle => &["PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING"],
    }
}

/// An in-memory iptables for one IP family. See the module docs.
#[derive(Debug)]
pub struct FakeIptables {
    family: IpFamily,
    inner: Mutex<Inner>,
}

#[derive(Debug)]
struct Inner {
    tables: Tables,
    calls: Vec<String>,
    restores: Vec<Vec<u8>>,
    next_restore_failures: VecDeque<IptablesError>,
    next_save_failures: VecDeque<IptablesError>,
    fail_restores_containing: Vec<String>,
    has_random_fully: bool,
    present: bool,
    /// Like the runner on iptables-nft: `--noflush` inputs go in pieces of this cost.
    split_budget: Option<u64>,
}

type Tables = BTreeMap<Table, TableState>;

#[derive(Debug, Clone)]
struct TableState {
    table: Table,
    /// Built-in and user chains by name.
    chains: BTreeMap<String, ChainState>,
    /// How many rules of this table jump or go to each chain.
    references: HashMap<String, usize>,
}

#[derive(Debug, Clone)]
struct ChainState {
    builtin: bool,
    policy: String,
    rules: Vec<RuleState>,
}

#[derive(Debug, Clone)]
struct RuleState {
    /// Arguments after `-A CHAIN`, unquoted.
    args: Vec<String>,
    /// The rule's text after `-A CHAIN `.
    text: String,
    /// The `-j` / `-g` target, if any.
    target: Option<String>,
}

/// A failed operation inside the model: what `iptables` would print and its exit status.
#[derive(Debug)]
struct OpError {
    status: i32,
    message: String,
}

impl OpError {
    /// Exit status 1: the operation failed (missing chain, chain in use, ...).
    fn resource(message: impl Into<String>) -> Self {
        OpError { status: 1, message: message.into() }
    }

    /// Exit status 2: bad parameters.
    fn param(message: impl Into<String>) -> Self {
        OpError { status: 2, message: message.into() }
    }
}

type OpResult<T> = std::result::Result<T, OpError>;

impl FakeIptables {
    /// A fake with empty built-in chains, `present()` true and `has_random_fully()` false.
    pub fn new(family: IpFamily) -> Self {
        let tables = ALL_TABLES.iter().map(|&t| (t, TableState::new(t))).collect();
        FakeIptables {
            family,
            inner: Mutex::new(Inner {
                tables,
                calls: Vec::new(),
                restores: Vec::new(),
                next_restore_failures: VecDeque::new(),
                next_save_failures: VecDeque::new(),
                fail_restores_containing: Vec::new(),
                has_random_fully: false,
                present: true,
                split_budget: None,
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic in another test thread must not make every later call panic too.
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn iptables_command(&self) -> &'static str {
        match self.family {
            IpFamily::V4 => "iptables",
            IpFamily::V6 => "ip6tables",
        }
    }

    fn restore_command(&self) -> &'static str {
        match self.family {
            IpFamily::V4 => "iptables-restore",
            IpFamily::V6 => "ip6tables-restore",
        }
    }

    fn save_command(&self) -> &'static str {
        match self.family {
            IpFamily::V4 => "iptables-save",
            IpFamily::V6 => "ip6tables-save",
        }
    }

    /// The error a failed single `iptables` command returns; `args` as upstream's
    /// `makeFullArgs` lays them out (`-X CHAIN -t table ...`).
    fn command_error(&self, op: &str, table: Table, chain: &str, args: &[&str], err: OpError) -> IptablesError {
        let mut full = format!("{op} {chain} -t {table}");
        if !args.is_empty() {
            full.push(' ');
            full.push_str(&render_args(args.iter().copied()));
        }
        IptablesError::Failed {
            command: self.iptables_command().to_string(),
            args: full,
            status: err.status,
            output: format!("{}: {}", self.iptables_command(), err.message),
        }
    }

    /// Sets what [`Iptables::has_random_fully`] answers.
    pub fn set_has_random_fully(&self, value: bool) {
        self.lock().has_random_fully = value;
    }

    /// Applies `--noflush` inputs the way the runner does on iptables-nft: in dependency
    /// order, cut into transactions of at most `budget` (see [`super::restore_plan`]); with a
    /// budget of 1, each chain is its own transaction, so a chain written before a chain it
    /// jumps to fails as it would in the kernel.
    pub fn set_split_budget(&self, budget: Option<u64>) {
        self.lock().split_budget = budget;
    }

    /// Sets what [`Iptables::present`] answers (other operations are unaffected).
    pub fn set_present(&self, value: bool) {
        self.lock().present = value;
    }

    /// Makes the next restore call (`restore` or `restore_all`) fail with `err` without
    /// changing anything. Several queued errors are used one per call, in order.
    pub fn fail_next_restore(&self, err: IptablesError) {
        self.lock().next_restore_failures.push_back(err);
    }

    /// Makes every restore whose payload contains `text` fail, without changing anything,
    /// with an [`IptablesError::RestoreLine`] naming the line where `text` first occurs.
    pub fn fail_restores_containing(&self, text: impl Into<String>) {
        self.lock().fail_restores_containing.push(text.into());
    }

    /// Makes the next `save_into` or `list_chains` call fail with `err` (queued like
    /// `fail_next_restore`).
    pub fn fail_next_save(&self, err: IptablesError) {
        self.lock().next_save_failures.push_back(err);
    }

    /// Drops every scripted failure.
    pub fn clear_failures(&self) {
        let mut inner = self.lock();
        inner.next_restore_failures.clear();
        inner.next_save_failures.clear();
        inner.fail_restores_containing.clear();
    }

    /// One line per trait call made so far, oldest first, failed ones included:
    ///
    /// * `ensure_chain nat KUBE-SERVICES`, `flush_chain ...`, `delete_chain ...`,
    ///   `chain_exists ...` — table and chain;
    /// * `ensure_rule -I nat PREROUTING -m comment --comment "kubernetes service portals" -j
    ///   KUBE-SERVICES`, `delete_rule nat PREROUTING ...` — arguments rendered with quotes
    ///   where needed;
    /// * `save_into nat`, `list_chains nat`;
    /// * `restore nat --noflush --counters`, `restore_all --noflush` — the flags passed.
    pub fn calls(&self) -> Vec<String> {
        self.lock().calls.clone()
    }

    /// Every restore payload received so far (by `restore` and `restore_all`, failed ones
    /// included), oldest first.
    pub fn restores(&self) -> Vec<Vec<u8>> {
        self.lock().restores.clone()
    }

    /// Forgets the recorded calls and payloads.
    pub fn clear_log(&self) {
        let mut inner = self.lock();
        inner.calls.clear();
        inner.restores.clear();
    }

    /// Applies `data` like `restore_all(data, NoFlush, NoCounters)` without recording the call
    /// or consulting scripted failures: for setting up a starting state.
    pub fn seed(&self, data: &[u8]) -> Result<()> {
        let mut inner = self.lock();
        let tables = self.apply_restore(&inner.tables, None, data, FlushFlag::NoFlush, RestoreCounters::NoCounters)?;
        inner.tables = tables;
        Ok(())
    }

    /// The rules of `chain` (text after `-A CHAIN `, in order), or `None` if it does not exist.
    pub fn rules(&self, table: Table, chain: &str) -> Option<Vec<String>> {
        let inner = self.lock();
        let chain = inner.tables.get(&table)?.chains.get(chain)?;
        Some(chain.rules.iter().map(|r| r.text.clone()).collect())
    }

    /// The chains of `table` in `iptables-save` order: built-ins first (in hook order), then
    /// user chains alphabetically.
    pub fn chains(&self, table: Table) -> Vec<String> {
        let inner = self.lock();
        inner.tables.get(&table).map(|t| t.ordered_names()).unwrap_or_default()
    }

    /// The policy of `chain` (`-` for user chains), or `None` if it does not exist.
    pub fn policy(&self, table: Table, chain: &str) -> Option<String> {
        let inner = self.lock();
        Some(inner.tables.get(&table)?.chains.get(chain)?.policy.clone())
    }

    /// `iptables-save` of every table (filter, nat, mangle), unlogged.
    pub fn save_all(&self) -> String {
        let inner = self.lock();
        let mut out = String::new();
        for table in inner.tables.values() {
            table.render(&mut out);
        }
        out
    }

    /// Runs a restore payload against a copy of `tables` and returns the copy if every line
    /// applied.
    fn apply_restore(
        &self,
        tables: &Tables,
        only: Option<Table>,
        data: &[u8],
        flush: FlushFlag,
        counters: RestoreCounters,
    ) -> Result<Tables> {
        let mut work = tables.clone();
        let line_error = |line: usize, message: String| IptablesError::RestoreLine {
            command: self.restore_command().to_string(),
            line,
            output: message,
            context: super::save::format_line_context(data, line, 3),
        };

        let lines = split_lines(data);
        let mut current: Option<Table> = None;
        let mut skipping = false;

        for (index, raw) in lines.iter().enumerate() {
            let line_no = index + 1;
            let line = std::str::from_utf8(raw)
                .map_err(|_| line_error(line_no, "line is not valid UTF-8".to_string()))?
                .trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            if skipping {
                if line == "COMMIT" {
                    skipping = false;
                }
                continue;
            }

            if let Some(name) = line.strip_prefix('*') {
                if let Some(open) = current {
                    return Err(line_error(line_no, format!("table {open} was not committed before {line:?}")));
                }
                let name = name.split_whitespace().next().unwrap_or("");
                if let Some(only) = only
                    && name != only.as_str()
                {
                    skipping = true;
                    continue;
                }
                let Some(table) = Table::parse(name) else {
                    return Err(line_error(
                        line_no,
                        format!("can't initialize iptables table `{name}': Table does not exist"),
                    ));
                };
                if flush == FlushFlag::Flush
                    && let Some(state) = work.get_mut(&table)
                {
                    state.flush_table();
                }
                current = Some(table);
                continue;
            }

            let Some(table) = current else {
                return Err(line_error(line_no, format!("{line:?} is outside a table (missing *table line?)")));
            };
            if line == "COMMIT" {
                current = None;
                continue;
            }
            let Some(state) = work.get_mut(&table) else {
                return Err(line_error(line_no, format!("table {table} is not modelled")));
            };
            let result = match line.strip_prefix(':') {
                Some(declaration) => state.declare(declaration, flush),
                None => state.command(line, counters),
            };
            result.map_err(|e| line_error(line_no, e.message))?;
        }

        if let Some(open) = current {
            return Err(line_error(lines.len() + 1, format!("COMMIT expected (table {open} was not committed)")));
        }
        Ok(work)
    }

    fn restore_internal(
        &self,
        only: Option<Table>,
        data: &[u8],
        flush: FlushFlag,
        counters: RestoreCounters,
    ) -> Result<()> {
        let mut inner = self.lock();
        let mut call = match only {
            Some(table) => format!("restore {table}"),
            None => "restore_all".to_string(),
        };
        if flush == FlushFlag::NoFlush {
            call.push_str(" --noflush");
        }
        if counters == RestoreCounters::Counters {
            call.push_str(" --counters");
        }
        inner.calls.push(call);
        inner.restores.push(data.to_vec());

        if let Some(err) = inner.next_restore_failures.pop_front() {
            return Err(err);
        }
        for text in &inner.fail_restores_containing {
            if let Some(line) = line_containing(data, text.as_bytes()) {
                return Err(IptablesError::RestoreLine {
                    command: self.restore_command().to_string(),
                    line,
                    output: format!("scripted failure: input contains {text:?}"),
                    context: super::save::format_line_context(data, line, 3),
                });
            }
        }

        let tables = self.apply_restore(&inner.tables, only, data, flush, counters)?;
        inner.tables = tables;
        Ok(())
    }
}

impl Iptables for FakeIptables {
    fn family(&self) -> IpFamily {
        self.family
    }

    fn ensure_chain(&self, table: Table, chain: &str) -> Result<bool> {
        let mut inner = self.lock();
        inner.calls.push(format!("ensure_chain {table} {chain}"));
        let state = inner.table_mut(table);
        if state.chains.contains_key(chain) {
            return Ok(true);
        }
        state.create_chain(chain).map_err(|e| self.command_error("-N", table, chain, &[], e))?;
        Ok(false)
    }

    fn flush_chain(&self, table: Table, chain: &str) -> Result<()> {
        let mut inner = self.lock();
        inner.calls.push(format!("flush_chain {table} {chain}"));
        inner.table_mut(table).flush_chain(chain).map_err(|e| self.command_error("-F", table, chain, &[], e))
    }

    fn delete_chain(&self, table: Table, chain: &str) -> Result<()> {
        let mut inner = self.lock();
        inner.calls.push(format!("delete_chain {table} {chain}"));
        inner.table_mut(table).delete_chain(chain).map_err(|e| self.command_error("-X", table, chain, &[], e))
    }

    fn chain_exists(&self, table: Table, chain: &str) -> Result<bool> {
        let mut inner = self.lock();
        inner.calls.push(format!("chain_exists {table} {chain}"));
        Ok(inner.table_mut(table).chains.contains_key(chain))
    }

    fn rule_exists(&self, table: Table, chain: &str, args: &[&str]) -> Result<bool> {
        let mut inner = self.lock();
        inner.calls.push(format!("rule_exists {table} {chain} {}", render_args(args.iter().copied())));
        let owned: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        Ok(inner.table_mut(table).find_rule(chain, &owned).is_some())
    }

    fn ensure_rule(&self, position: RulePosition, table: Table, chain: &str, args: &[&str]) -> Result<bool> {
        let mut inner = self.lock();
        let text = render_args(args.iter().copied());
        inner.calls.push(format!("ensure_rule {} {table} {chain} {text}", position.flag()));
        let state = inner.table_mut(table);
        let owned: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        if state.find_rule(chain, &owned).is_some() {
            return Ok(true);
        }
        let index = match position {
            RulePosition::Prepend => 0,
            RulePosition::Append => state.chains.get(chain).map_or(0, |c| c.rules.len()),
        };
        state
            .insert_rule(chain, index, owned, text)
            .map_err(|e| self.command_error(position.flag(), table, chain, args, e))?;
        Ok(false)
    }

    fn delete_rule(&self, table: Table, chain: &str, args: &[&str]) -> Result<()> {
        let mut inner = self.lock();
        inner.calls.push(format!("delete_rule {table} {chain} {}", render_args(args.iter().copied())));
        let state = inner.table_mut(table);
        let owned: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        if let Some(index) = state.find_rule(chain, &owned) {
            state.remove_rule(chain, index);
        }
        Ok(())
    }

    fn list_chains(&self, table: Table) -> Result<Vec<String>> {
        let mut inner = self.lock();
        inner.calls.push(format!("list_chains {table}"));
        if let Some(err) = inner.next_save_failures.pop_front() {
            return Err(err);
        }
        Ok(inner.tables.get(&table).map(|state| state.ordered_names()).unwrap_or_default())
    }

    fn save_into(&self, table: Table, out: &mut Vec<u8>) -> Result<()> {
        let mut inner = self.lock();
        inner.calls.push(format!("save_into {table}"));
        if let Some(err) = inner.next_save_failures.pop_front() {
            return Err(err);
        }
        let Some(state) = inner.tables.get(&table) else {
            return Err(IptablesError::Failed {
                command: self.save_command().to_string(),
                args: format!("-t {table}"),
                status: 1,
                output: format!("{}: table `{table}' is not modelled", self.save_command()),
            });
        };
        let mut text = String::new();
        state.render(&mut text);
        out.extend_from_slice(text.as_bytes());
        Ok(())
    }

    fn restore(&self, table: Table, data: &[u8], flush: FlushFlag, counters: RestoreCounters) -> Result<()> {
        self.restore_internal(Some(table), data, flush, counters)
    }

    fn restore_all(&self, data: &[u8], flush: FlushFlag, counters: RestoreCounters) -> Result<()> {
        self.restore_internal(None, data, flush, counters)
    }

    fn restore_input(
        &self,
        input: &dyn RestoreInput,
        flush: FlushFlag,
        counters: RestoreCounters,
        on_step: &mut dyn FnMut(),
    ) -> Result<()> {
        let budget = self.lock().split_budget.filter(|_| flush == FlushFlag::NoFlush);
        if let Some(budget) = budget {
            let restore_piece = &mut |piece: &[u8]| self.restore_internal(None, piece, flush, counters);
            if super::restore_plan::apply_in_pieces(input, budget, restore_piece, on_step)? {
                return Ok(());
            }
        }
        super::restore_input_whole(self, input, flush, counters, on_step)
    }

    fn has_random_fully(&self) -> bool {
        self.lock().has_random_fully
    }

    fn present(&self) -> bool {
        self.lock().present
    }
}

impl Inner {
    fn table_mut(&mut self, table: Table) -> &mut TableState {
        self.tables.entry(table).or_insert_with(|| TableState::new(table))
    }
}

impl TableState {
    fn new(table: Table) -> Self {
        let chains = builtin_chains(table)
            .iter()
            .map(|name| {
                let chain = ChainState { builtin: true, policy: "ACCEPT".to_string(), rules: Vec::new() };
                (name.to_string(), chain)
            })
            .collect();
        TableState { table, chains, references: HashMap::new() }
    }

    fn ordered_names(&self) -> Vec<String> {
        let mut names: Vec<String> = builtin_chains(self.table)
            .iter()
            .filter(|n| self.chains.contains_key(**n))
            .map(|n| n.to_string())
            .collect();
        names.extend(self.chains.iter().filter(|(_, c)| !c.builtin).map(|(n, _)| n.clone()));
        names
    }

    /// `iptables-save -t table` text.
    fn render(&self, out: &mut String) {
        let names = self.ordered_names();
        out.push_str(&format!("*{}\n", self.table));
        for name in &names {
            if let Some(chain) = self.chains.get(name) {
                out.push_str(&format!(":{name} {} [0:0]\n", chain.policy));
            }
        }
        for name in &names {
            if let Some(chain) = self.chains.get(name) {
                for rule in &chain.rules {
                    out.push_str(&format!("-A {name} {}\n", rule.text));
                }
            }
        }
        out.push_str("COMMIT\n");
    }

    fn is_builtin(&self, chain: &str) -> bool {
        self.chains.get(chain).is_some_and(|c| c.builtin)
    }

    fn chain(&self, chain: &str) -> OpResult<&ChainState> {
        self.chains.get(chain).ok_or_else(|| OpError::resource(format!("chain `{chain}' does not exist")))
    }

    fn chain_mut(&mut self, chain: &str) -> OpResult<&mut ChainState> {
        self.chains.get_mut(chain).ok_or_else(|| OpError::resource(format!("chain `{chain}' does not exist")))
    }

    fn create_chain(&mut self, chain: &str) -> OpResult<()> {
        validate_chain_name(chain)?;
        if self.chains.contains_key(chain) {
            return Err(OpError::resource(format!("chain `{chain}' already exists")));
        }
        self.chains
            .insert(chain.to_string(), ChainState { builtin: false, policy: "-".to_string(), rules: Vec::new() });
        Ok(())
    }

    fn flush_chain(&mut self, chain: &str) -> OpResult<()> {
        let rules = std::mem::take(&mut self.chain_mut(chain)?.rules);
        for rule in &rules {
            self.unreference(rule.target.as_deref());
        }
        Ok(())
    }

    fn flush_all_chains(&mut self) {
        for chain in self.chains.values_mut() {
            chain.rules.clear();
        }
        self.references.clear();
    }

    /// What `iptables-restore` does to a table it is given without `--noflush`.
    fn flush_table(&mut self) {
        self.flush_all_chains();
        self.chains.retain(|_, c| c.builtin);
    }

    fn delete_chain(&mut self, chain: &str) -> OpResult<()> {
        let state = self.chain(chain)?;
        if state.builtin {
            return Err(OpError::param(format!("cannot delete built-in chain `{chain}'")));
        }
        if !state.rules.is_empty() {
            return Err(OpError::resource(format!(
                "chain `{chain}' is not empty ({} rules): Directory not empty",
                state.rules.len()
            )));
        }
        let references = self.references.get(chain).copied().unwrap_or(0);
        if references > 0 {
            return Err(OpError::resource(format!(
                "chain `{chain}' is still referenced by {references} rule(s): Too many links"
            )));
        }
        self.chains.remove(chain);
        Ok(())
    }

    fn set_policy(&mut self, chain: &str, policy: &str) -> OpResult<()> {
        let builtin = self.is_builtin(chain);
        let state = self.chain_mut(chain)?;
        if !builtin {
            return Err(OpError::param(format!("can't set policy `{policy}' on `{chain}': Bad built-in chain name")));
        }
        if policy != "ACCEPT" && policy != "DROP" {
            return Err(OpError::param(format!("bad policy name `{policy}' for `{chain}'")));
        }
        state.policy = policy.to_string();
        Ok(())
    }

    fn find_rule(&self, chain: &str, args: &[String]) -> Option<usize> {
        self.chains.get(chain)?.rules.iter().position(|r| r.args == args)
    }

    /// Checks that a rule's target can be used in this table.
    fn check_target(&self, target: &Target) -> OpResult<()> {
        if !target.goto && TARGETS.contains(&target.name.as_str()) {
            return Ok(());
        }
        match self.chains.get(&target.name) {
            Some(chain) if chain.builtin => {
                Err(OpError::param(format!("cannot jump to built-in chain `{}'", target.name)))
            }
            Some(_) => Ok(()),
            None => Err(OpError::param(format!("Couldn't load target `{}': No such file or directory", target.name))),
        }
    }

    /// Inserts a rule at `index` (0-based; `index == len` appends).
    fn insert_rule(&mut self, chain: &str, index: usize, args: Vec<String>, text: String) -> OpResult<()> {
        let target = rule_target(&args)?;
        self.chain(chain)?;
        if let Some(target) = &target {
            self.check_target(target)?;
        }
        let state = self.chain_mut(chain)?;
        if index > state.rules.len() {
            return Err(OpError::param(format!(
                "index of insertion too big (chain `{chain}' has {} rules)",
                state.rules.len()
            )));
        }
        let target = target.map(|t| t.name);
        state.rules.insert(index, RuleState { args, text, target: target.clone() });
        if let Some(target) = target {
            *self.references.entry(target).or_insert(0) += 1;
        }
        Ok(())
    }

    fn remove_rule(&mut self, chain: &str, index: usize) {
        let removed = match self.chains.get_mut(chain) {
            Some(state) if index < state.rules.len() => state.rules.remove(index),
            _ => return,
        };
        self.unreference(removed.target.as_deref());
    }

    fn unreference(&mut self, target: Option<&str>) {
        let Some(target) = target else { return };
        if let Some(count) = self.references.get_mut(target) {
            *count = count.saturating_sub(1);
            if *count == 0 {
                self.references.remove(target);
            }
        }
    }

    /// A `:NAME POLICY [packets:bytes]` line (without the colon).
    fn declare(&mut self, declaration: &str, flush: FlushFlag) -> OpResult<()> {
        let mut words = declaration.split_whitespace();
        let name = words.next().unwrap_or("");
        let Some(policy) = words.next() else {
            return Err(OpError::param(format!("bad policy name in chain declaration `:{declaration}'")));
        };
        if let Some(counters) = words.next() {
            parse_counters(counters)?;
        }
        if let Some(extra) = words.next() {
            return Err(OpError::param(format!("unexpected `{extra}' in chain declaration")));
        }

        if self.is_builtin(name) {
            return if policy == "-" { Ok(()) } else { self.set_policy(name, policy) };
        }
        if policy != "-" {
            return Err(OpError::param(format!("can't set policy `{policy}' on `{name}': Bad built-in chain name")));
        }
        if self.chains.contains_key(name) && flush == FlushFlag::NoFlush {
            return self.flush_chain(name);
        }
        self.create_chain(name)
    }

    /// One command line of a restore payload.
    fn command(&mut self, line: &str, counters: RestoreCounters) -> OpResult<()> {
        let mut args = tokenize(line)?;
        let mut line = line;
        if args.first().is_some_and(|a| a.starts_with('[')) {
            if counters == RestoreCounters::NoCounters {
                return Err(OpError::param(format!("bad argument `{}' (counters need --counters)", args[0])));
            }
            parse_counters(&args[0])?;
            args.remove(0);
            line = skip_words(line, 1);
        }
        if args.iter().any(|a| a == "-t" || a == "--table") {
            return Err(OpError::param("the -t option cannot be used in iptables-restore"));
        }

        let Some(op) = args.first().cloned() else {
            return Err(OpError::param("no command specified"));
        };
        let chain_arg = args.get(1).cloned();
        let need_chain = || chain_arg.clone().ok_or_else(|| OpError::param(format!("option `{op}' requires a chain")));
        let no_extra = |count: usize| match args.get(count) {
            Some(extra) => Err(OpError::param(format!("unexpected argument `{extra}' after `{op}'"))),
            None => Ok(()),
        };

        match op.as_str() {
            "-A" | "--append" => {
                let chain = need_chain()?;
                let rule = args[2..].to_vec();
                let text = rule_text(line, 2, &rule);
                let index = self.chain(&chain)?.rules.len();
                self.insert_rule(&chain, index, rule, text)
            }
            "-I" | "--insert" => {
                let chain = need_chain()?;
                let (position, skip) = match args.get(2).map(|a| a.parse::<usize>()) {
                    Some(Ok(0)) => return Err(OpError::param("invalid rule number `0'")),
                    Some(Ok(n)) => (n, 3),
                    _ => (1, 2),
                };
                let rule = args[skip.min(args.len())..].to_vec();
                let text = rule_text(line, skip, &rule);
                self.chain(&chain)?;
                self.insert_rule(&chain, position - 1, rule, text)
            }
            "-D" | "--delete" => {
                let chain = need_chain()?;
                let len = self.chain(&chain)?.rules.len();
                let index = match (args.len(), args.get(2).map(|a| a.parse::<usize>())) {
                    (3, Some(Ok(n))) => {
                        if n == 0 || n > len {
                            return Err(OpError::param(format!(
                                "index of deletion too big (chain `{chain}' has {len} rules)"
                            )));
                        }
                        n - 1
                    }
                    _ => self
                        .find_rule(&chain, &args[2..])
                        .ok_or_else(|| OpError::resource("Bad rule (does a matching rule exist in that chain?)"))?,
                };
                self.remove_rule(&chain, index);
                Ok(())
            }
            "-R" | "--replace" => {
                let chain = need_chain()?;
                let len = self.chain(&chain)?.rules.len();
                let number = match args.get(2).map(|a| a.parse::<usize>()) {
                    Some(Ok(n)) if n >= 1 && n <= len => n,
                    _ => {
                        return Err(OpError::param(format!("-R needs a rule number between 1 and {len}")));
                    }
                };
                let rule = args[3..].to_vec();
                let text = rule_text(line, 3, &rule);
                self.remove_rule(&chain, number - 1);
                self.insert_rule(&chain, number - 1, rule, text)
            }
            "-N" | "--new-chain" => {
                let chain = need_chain()?;
                no_extra(2)?;
                self.create_chain(&chain)
            }
            "-X" | "--delete-chain" => {
                no_extra(2)?;
                match chain_arg {
                    Some(chain) => self.delete_chain(&chain),
                    None => {
                        let user: Vec<String> =
                            self.chains.iter().filter(|(_, c)| !c.builtin).map(|(n, _)| n.clone()).collect();
                        user.iter().try_for_each(|chain| self.delete_chain(chain))
                    }
                }
            }
            "-F" | "--flush" => {
                no_extra(2)?;
                match chain_arg {
                    Some(chain) => self.flush_chain(&chain),
                    None => {
                        self.flush_all_chains();
                        Ok(())
                    }
                }
            }
            "-Z" | "--zero" => {
                no_extra(2)?;
                match chain_arg {
                    Some(chain) => self.chain(&chain).map(|_| ()),
                    None => Ok(()),
                }
            }
            "-P" | "--policy" => {
                let chain = need_chain()?;
                let Some(policy) = args.get(2) else {
                    return Err(OpError::param("-P requires a policy"));
                };
                no_extra(3)?;
                self.set_policy(&chain, policy)
            }
            other => Err(OpError::param(format!("unknown command `{other}'"))),
        }
    }
}

fn validate_chain_name(chain: &str) -> OpResult<()> {
    if chain.is_empty() {
        return Err(OpError::param("empty chain name"));
    }
    if chain.chars().count() > MAX_CHAIN_NAME_LEN {
        return Err(OpError::param(format!(
            "chain name `{chain}' too long (must be under {} chars)",
            MAX_CHAIN_NAME_LEN + 1
        )));
    }
    if chain.starts_with('-') || chain.starts_with('!') || chain.chars().any(|c| c.is_whitespace() || c == '"') {
        return Err(OpError::param(format!("invalid chain name `{chain}'")));
    }
    if TARGETS.contains(&chain) {
        return Err(OpError::param(format!("chain name `{chain}' may not clash with target name")));
    }
    Ok(())
}

fn parse_counters(word: &str) -> OpResult<()> {
    let valid = word
        .strip_prefix('[')
        .and_then(|w| w.strip_suffix(']'))
        .and_then(|w| w.split_once(':'))
        .is_some_and(|(p, b)| p.parse::<u64>().is_ok() && b.parse::<u64>().is_ok());
    if valid { Ok(()) } else { Err(OpError::param(format!("bad counters `{word}'"))) }
}

/// A rule's jump (`-j`) or goto (`-g`) target.
struct Target {
    name: String,
    goto: bool,
}

fn rule_target(args: &[String]) -> OpResult<Option<Target>> {
    let mut target = None;
    let mut i = 0;
    while i < args.len() {
        let goto = match args[i].as_str() {
            "--comment" => {
                i += 2;
                continue;
            }
            "-j" | "--jump" => false,
            "-g" | "--goto" => true,
            _ => {
                i += 1;
                continue;
            }
        };
        let Some(name) = args.get(i + 1) else {
            return Err(OpError::param(format!("option `{}' requires an argument", args[i])));
        };
        target = Some(Target { name: name.clone(), goto });
        i += 2;
    }
    Ok(target)
}

/// Splits a restore line into arguments the way `iptables-restore` does: whitespace
/// separates, `"` opens and closes a quoted part (a closing quote ends the argument, even an
/// empty one), and inside quotes `\` escapes the next character.
fn tokenize(line: &str) -> OpResult<Vec<String>> {
    let mut args = Vec::new();
    let mut current = String::new();
    let mut quoted = false;
    let mut escaped = false;
    for ch in line.chars() {
        if quoted {
            if escaped {
                current.push(ch);
                escaped = false;
            } else if ch == '\\' {
                escaped = true;
            } else if ch == '"' {
                quoted = false;
                args.push(std::mem::take(&mut current));
            } else {
                current.push(ch);
            }
            continue;
        }
        match ch {
            '"' => quoted = true,
            ' ' | '\t' | '\n' => {
                if !current.is_empty() {
                    args.push(std::mem::take(&mut current));
                }
            }
            _ => current.push(ch),
        }
    }
    if quoted {
        return Err(OpError::param("unterminated quoted argument"));
    }
    if !current.is_empty() {
        args.push(current);
    }
    Ok(args)
}

/// Renders arguments back into restore syntax, quoting only what needs it.
fn render_args<'a>(args: impl Iterator<Item = &'a str>) -> String {
    args.map(|arg| {
        let plain = !arg.is_empty() && !arg.chars().any(|c| c.is_whitespace() || c == '"' || c == '\\');
        if plain {
            arg.to_string()
        } else {
            let mut quoted = String::with_capacity(arg.len() + 2);
            quoted.push('"');
            for c in arg.chars() {
                if c == '"' || c == '\\' {
                    quoted.push('\\');
                }
                quoted.push(c);
            }
            quoted.push('"');
            quoted
        }
    })
    .collect::<Vec<_>>()
    .join(" ")
}

/// `line` without its first `count` whitespace-separated words.
fn skip_words(line: &str, count: usize) -> &str {
    let mut rest = line.trim_start();
    for _ in 0..count {
        let end = rest.find(char::is_whitespace).unwrap_or(rest.len());
        rest = rest[end..].trim_start();
    }
    rest
}

/// The text of a rule after its command words, as written when the command words are plain
/// (they always are in practice), otherwise rendered from the arguments.
fn rule_text(line: &str, command_words: usize, args: &[String]) -> String {
    if line.split_whitespace().take(command_words).any(|w| w.contains('"')) {
        render_args(args.iter().map(String::as_str))
    } else {
        skip_words(line, command_words).trim_end().to_string()
    }
}

/// Lines as `iptables-restore` reads them: split on `\n`, a final newline ends the last line.
fn split_lines(data: &[u8]) -> Vec<&[u8]> {
    let data = data.strip_suffix(b"\n").unwrap_or(data);
    if data.is_empty() {
        return Vec::new();
    }
    data.split(|&b| b == b'\n').collect()
}

/// The 1-based line on which `needle` first starts in `data`.
fn line_containing(data: &[u8], needle: &[u8]) -> Option<usize> {
    if needle.is_empty() {
        return None;
    }
    let offset = data.windows(needle.len()).position(|w| w == needle)?;
    Some(data[..offset].iter().filter(|&&b| b == b'\n').count() + 1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::iptables::dump::Dump;

    fn fake() -> FakeIptables {
        FakeIptables::new(IpFamily::V4)
    }

    fn restore_all(f: &FakeIptables, text: &str) -> Result<()> {
        f.restore_all(text.as_bytes(), FlushFlag::NoFlush, RestoreCounters::Counters)
    }

    const BASE: &str = "*filter
:KUBE-SERVICES - [0:0]
:KUBE-FORWARD - [0:0]
-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP
COMMIT
*nat
:KUBE-SERVICES - [0:0]
:KUBE-MARK-MASQ - [0:0]
:KUBE-SVC-AAA - [0:0]
:KUBE-SEP-111 - [0:0]
-A KUBE-MARK-MASQ -j MARK --or-mark 0x4000
-A KUBE-SERVICES -m comment --comment \"ns/a:p cluster IP\" -m tcp -p tcp -d 10.0.0.1 --dport 80 -j KUBE-SVC-AAA
-A KUBE-SVC-AAA -m comment --comment ns/a:p -j KUBE-SEP-111
-A KUBE-SEP-111 -m comment --comment ns/a:p -s 10.1.0.1 -j KUBE-MARK-MASQ
-A KUBE-SEP-111 -m comment --comment ns/a:p -m tcp -p tcp -j DNAT --to-destination 10.1.0.1:80
COMMIT
";

    fn strings(items: &[&str]) -> Vec<String> {
        items.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn starts_with_builtin_chains() {
        let f = fake();
        assert_eq!(f.chains(Table::Filter), strings(&["INPUT", "FORWARD", "OUTPUT"]));
        assert_eq!(f.chains(Table::Nat), strings(&["PREROUTING", "INPUT", "OUTPUT", "POSTROUTING"]));
        assert_eq!(f.chains(Table::Mangle), strings(&["PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING"]));
        assert_eq!(f.policy(Table::Nat, "PREROUTING").as_deref(), Some("ACCEPT"));
        assert_eq!(f.rules(Table::Nat, "PREROUTING"), Some(vec![]));
        assert_eq!(f.rules(Table::Nat, "FORWARD"), None);
        assert!(f.present());
        assert!(!f.has_random_fully());
        f.set_has_random_fully(true);
        f.set_present(false);
        assert!(f.has_random_fully());
        assert!(!f.present());
        assert_eq!(f.family(), IpFamily::V4);
    }

    #[test]
    fn restore_builds_chains_and_rules() {
        let f = fake();
        restore_all(&f, BASE).unwrap();
        assert_eq!(
            f.chains(Table::Nat),
            strings(&[
                "PREROUTING",
                "INPUT",
                "OUTPUT",
                "POSTROUTING",
                "KUBE-MARK-MASQ",
                "KUBE-SEP-111",
                "KUBE-SERVICES",
                "KUBE-SVC-AAA"
            ])
        );
        assert_eq!(
            f.rules(Table::Nat, "KUBE-SEP-111").unwrap(),
            strings(&[
                "-m comment --comment ns/a:p -s 10.1.0.1 -j KUBE-MARK-MASQ",
                "-m comment --comment ns/a:p -m tcp -p tcp -j DNAT --to-destination 10.1.0.1:80",
            ])
        );
        assert_eq!(
            f.rules(Table::Nat, "KUBE-SERVICES").unwrap(),
            strings(&[
                "-m comment --comment \"ns/a:p cluster IP\" -m tcp -p tcp -d 10.0.0.1 --dport 80 -j KUBE-SVC-AAA"
            ])
        );
        assert_eq!(f.calls(), strings(&["restore_all --noflush --counters"]));
        assert_eq!(f.restores(), vec![BASE.as_bytes().to_vec()]);
    }

    #[test]
    fn save_into_looks_like_iptables_save() {
        let f = fake();
        restore_all(&f, BASE).unwrap();
        let mut out = Vec::new();
        f.save_into(Table::Filter, &mut out).unwrap();
        let text = String::from_utf8(out).unwrap();
        assert_eq!(
            text,
            "*filter
:INPUT ACCEPT [0:0]
:FORWARD ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:KUBE-FORWARD - [0:0]
:KUBE-SERVICES - [0:0]
-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP
COMMIT
"
        );
        // Parseable by the dump model and by the chain scanner.
        let mut nat = Vec::new();
        f.save_into(Table::Nat, &mut nat).unwrap();
        let dump = Dump::parse_bytes(&nat).unwrap();
        assert_eq!(dump.chain("nat", "KUBE-SVC-AAA").unwrap().rules, f.rules(Table::Nat, "KUBE-SVC-AAA").unwrap());
        let chains = crate::iptables::save::chains_from_table(&nat);
        assert!(chains.contains("KUBE-SEP-111") && chains.contains("PREROUTING"));
        // save_into appends.
        let before = nat.len();
        f.save_into(Table::Nat, &mut nat).unwrap();
        assert_eq!(nat.len(), before * 2);
        assert!(Dump::parse(&f.save_all()).is_ok());
    }

    #[test]
    fn noflush_leaves_undeclared_chains_alone() {
        let f = fake();
        restore_all(&f, BASE).unwrap();
        f.ensure_rule(RulePosition::Append, Table::Nat, "PREROUTING", &["-j", "KUBE-SERVICES"]).unwrap();
        // Redeclare KUBE-SERVICES only: it is flushed and refilled; KUBE-SVC-AAA, KUBE-SEP-111
        // and the built-in PREROUTING keep their rules.
        restore_all(
            &f,
            "*nat\n:KUBE-SERVICES - [0:0]\n:PREROUTING ACCEPT [0:0]\n-A KUBE-SERVICES -j KUBE-SVC-AAA\nCOMMIT\n",
        )
        .unwrap();
        assert_eq!(f.rules(Table::Nat, "KUBE-SERVICES").unwrap(), strings(&["-j KUBE-SVC-AAA"]));
        assert_eq!(f.rules(Table::Nat, "KUBE-SVC-AAA").unwrap().len(), 1);
        assert_eq!(f.rules(Table::Nat, "KUBE-SEP-111").unwrap().len(), 2);
        assert_eq!(f.rules(Table::Nat, "PREROUTING").unwrap(), strings(&["-j KUBE-SERVICES"]));
        // The filter table was not in the payload at all.
        assert_eq!(f.rules(Table::Filter, "KUBE-FORWARD").unwrap().len(), 1);
    }

    #[test]
    fn flush_replaces_declared_tables_only() {
        let f = fake();
        restore_all(&f, BASE).unwrap();
        f.ensure_rule(RulePosition::Append, Table::Nat, "PREROUTING", &["-j", "KUBE-SERVICES"]).unwrap();
        f.restore_all(b"*nat\n:KUBE-NEW - [0:0]\nCOMMIT\n", FlushFlag::Flush, RestoreCounters::NoCounters).unwrap();
        assert_eq!(f.chains(Table::Nat), strings(&["PREROUTING", "INPUT", "OUTPUT", "POSTROUTING", "KUBE-NEW"]));
        assert_eq!(f.rules(Table::Nat, "PREROUTING"), Some(vec![]));
        assert_eq!(f.rules(Table::Filter, "KUBE-FORWARD").unwrap().len(), 1);
        assert_eq!(f.calls().last().map(String::as_str), Some("restore_all"));
    }

    #[test]
    fn restore_with_table_only_touches_that_table() {
        let f = fake();
        f.restore(Table::Filter, BASE.as_bytes(), FlushFlag::NoFlush, RestoreCounters::NoCounters).unwrap();
        assert!(f.rules(Table::Filter, "KUBE-FORWARD").is_some());
        assert!(f.rules(Table::Nat, "KUBE-SVC-AAA").is_none());
        assert_eq!(f.calls(), strings(&["restore filter --noflush"]));
        // Sections for other tables are skipped even when they would fail.
        f.restore(Table::Filter, b"*nat\n-A NOPE -j NOPE\nCOMMIT\n", FlushFlag::NoFlush, RestoreCounters::NoCounters)
            .unwrap();
    }

    #[test]
    fn restore_is_atomic() {
        let f = fake();
        restore_all(&f, BASE).unwrap();
        let before = f.save_all();
        // The filter table and the first nat lines apply fine; line 8 jumps nowhere.
        let payload = "*filter
:KUBE-FORWARD - [0:0]
COMMIT
*nat
:KUBE-SERVICES - [0:0]
:KUBE-SVC-BBB - [0:0]
-A KUBE-SERVICES -j KUBE-SVC-BBB
-A KUBE-SVC-BBB -j KUBE-SEP-MISSING
COMMIT
";
        let err = restore_all(&f, payload).unwrap_err();
        assert_eq!(err.restore_line(), Some(8), "{err}");
        assert!(err.to_string().contains("KUBE-SEP-MISSING"), "{err}");
        assert_eq!(f.save_all(), before);
        assert_eq!(f.restores().len(), 2);
    }

    #[test]
    fn error_line_numbers() {
        let cases: &[(&str, usize)] = &[
            ("*nat\n:KUBE-A - [0:0]\n-A KUBE-B -j ACCEPT\nCOMMIT\n", 3),
            ("# comment\n\n*nat\n:KUBE-A - [0:0]\n-A KUBE-A -j KUBE-NOPE\nCOMMIT\n", 5),
            ("*nat\n:KUBE-A - [0:0]\n-A KUBE-A -j\nCOMMIT\n", 3),
            ("*nat\n:KUBE-A - [0:0]\n-A KUBE-A -m comment --comment \"open\nCOMMIT\n", 3),
            ("*nat\n:KUBE-A - [0:0]\n", 3),
            ("*nat\n:KUBE-A - [0:0]", 3),
            ("-A KUBE-A -j ACCEPT\n", 1),
            ("*raw\nCOMMIT\n", 1),
            ("*nat\n*filter\nCOMMIT\n", 2),
            ("*nat\n:KUBE-A ACCEPT [0:0]\nCOMMIT\n", 2),
            ("*nat\n:PREROUTING BOGUS [0:0]\nCOMMIT\n", 2),
            ("*nat\n:KUBE-A\nCOMMIT\n", 2),
            ("*nat\n:KUBE-AAAAAAAAAAAAAAAAAAAAAAAAAAA - [0:0]\nCOMMIT\n", 2),
            ("*nat\n:DNAT - [0:0]\nCOMMIT\n", 2),
            ("*nat\n-X KUBE-NOT-THERE\nCOMMIT\n", 2),
            ("*nat\n-X PREROUTING\nCOMMIT\n", 2),
            ("*nat\n-F KUBE-NOT-THERE\nCOMMIT\n", 2),
            ("*nat\n-N PREROUTING\nCOMMIT\n", 2),
            ("*nat\n-A PREROUTING -j POSTROUTING\nCOMMIT\n", 2),
            ("*nat\n[1:2] -A PREROUTING -j ACCEPT\nCOMMIT\n", 2),
            ("*nat\n-A PREROUTING -t nat -j ACCEPT\nCOMMIT\n", 2),
            ("*nat\n-Q PREROUTING\nCOMMIT\n", 2),
            ("*nat\n-I PREROUTING 2 -j ACCEPT\nCOMMIT\n", 2),
            ("*nat\n-D PREROUTING -j ACCEPT\nCOMMIT\n", 2),
            ("*nat\n-D PREROUTING 1\nCOMMIT\n", 2),
            ("*nat\n-P KUBE-X ACCEPT\nCOMMIT\n", 2),
            ("*nat\n-P PREROUTING RETURN\nCOMMIT\n", 2),
            ("*nat\n-A PREROUTING -g ACCEPT\nCOMMIT\n", 2),
        ];
        for (payload, line) in cases {
            let f = fake();
            let err = f.restore_all(payload.as_bytes(), FlushFlag::NoFlush, RestoreCounters::NoCounters).unwrap_err();
            assert_eq!(err.restore_line(), Some(*line), "payload {payload:?}: {err}");
            assert!(err.to_string().starts_with("iptables-restore: input error on line"), "{err}");
        }
    }

    #[test]
    fn ipv6_names_its_commands() {
        let f = FakeIptables::new(IpFamily::V6);
        let err = restore_all(&f, "*nat\n-A NOPE -j ACCEPT\nCOMMIT\n").unwrap_err();
        assert!(matches!(&err, IptablesError::RestoreLine { command, .. } if command == "ip6tables-restore"));
        let err = f.flush_chain(Table::Nat, "NOPE").unwrap_err();
        assert!(matches!(&err, IptablesError::Failed { command, .. } if command == "ip6tables"));
    }

    #[test]
    fn delete_of_referenced_chain_fails() {
        let f = fake();
        restore_all(&f, BASE).unwrap();
        // Flushed but still jumped to from KUBE-SERVICES (not redeclared, so not flushed).
        let err = restore_all(&f, "*nat\n:KUBE-SVC-AAA - [0:0]\n-X KUBE-SVC-AAA\nCOMMIT\n").unwrap_err();
        assert_eq!(err.restore_line(), Some(3));
        assert!(err.to_string().contains("referenced"), "{err}");
        assert_eq!(f.rules(Table::Nat, "KUBE-SVC-AAA").unwrap().len(), 1);

        // Not flushed first: the chain still has rules.
        let err = restore_all(&f, "*nat\n:KUBE-SERVICES - [0:0]\n-X KUBE-SVC-AAA\nCOMMIT\n").unwrap_err();
        assert!(err.to_string().contains("not empty"), "{err}");

        // What kube-proxy writes for stale chains: flush everything that refers to them,
        // declare them (flushing them), then delete them.
        restore_all(
            &f,
            "*nat\n:KUBE-SERVICES - [0:0]\n:KUBE-SVC-AAA - [0:0]\n:KUBE-SEP-111 - [0:0]\n-X KUBE-SVC-AAA\n-X KUBE-SEP-111\nCOMMIT\n",
        )
        .unwrap();
        assert!(f.rules(Table::Nat, "KUBE-SVC-AAA").is_none());
        assert!(f.rules(Table::Nat, "KUBE-SEP-111").is_none());
        // KUBE-MARK-MASQ lost its last reference with KUBE-SEP-111 and can go too.
        restore_all(&f, "*nat\n:KUBE-MARK-MASQ - [0:0]\n-X KUBE-MARK-MASQ\nCOMMIT\n").unwrap();
    }

    #[test]
    fn duplicate_declaration_in_flushing_restore_fails() {
        let f = fake();
        let payload = b"*nat\n:KUBE-A - [0:0]\n:KUBE-A - [0:0]\nCOMMIT\n";
        let err = f.restore_all(payload, FlushFlag::Flush, RestoreCounters::NoCounters).unwrap_err();
        assert_eq!(err.restore_line(), Some(3));
        f.restore_all(payload, FlushFlag::NoFlush, RestoreCounters::NoCounters).unwrap();
    }

    #[test]
    fn insert_delete_replace_and_counters() {
        let f = fake();
        restore_all(
            &f,
            "*filter
:KUBE-A - [0:0]
[5:300] -A KUBE-A -j ACCEPT
-A KUBE-A -j DROP
-I KUBE-A -j REJECT
-I KUBE-A 3 -m comment --comment \"x y\" -j RETURN
-R KUBE-A 4 -j LOG
-D KUBE-A -j REJECT
-A KUBE-A -j MARK --set-mark 1
-D KUBE-A 4
-P INPUT DROP
-Z KUBE-A
COMMIT
",
        )
        .unwrap();
        assert_eq!(
            f.rules(Table::Filter, "KUBE-A").unwrap(),
            strings(&["-j ACCEPT", "-m comment --comment \"x y\" -j RETURN", "-j LOG"])
        );
        assert_eq!(f.policy(Table::Filter, "INPUT").as_deref(), Some("DROP"));
        assert_eq!(f.policy(Table::Filter, "KUBE-A").as_deref(), Some("-"));
        restore_all(&f, "*filter\n-F\n-X\nCOMMIT\n").unwrap();
        assert_eq!(f.chains(Table::Filter), strings(&["INPUT", "FORWARD", "OUTPUT"]));
    }

    #[test]
    fn single_commands_behave_like_the_runner() {
        let f = fake();
        assert!(!f.ensure_chain(Table::Nat, "KUBE-SERVICES").unwrap());
        assert!(f.ensure_chain(Table::Nat, "KUBE-SERVICES").unwrap());
        assert!(f.ensure_chain(Table::Nat, "PREROUTING").unwrap());
        assert!(f.ensure_chain(Table::Nat, "bad name").is_err());
        assert!(f.chain_exists(Table::Nat, "KUBE-SERVICES").unwrap());
        assert!(!f.chain_exists(Table::Filter, "KUBE-SERVICES").unwrap());

        let args = ["-m", "comment", "--comment", "kubernetes service portals", "-j", "KUBE-SERVICES"];
        assert!(!f.ensure_rule(RulePosition::Prepend, Table::Nat, "PREROUTING", &args).unwrap());
        assert!(f.ensure_rule(RulePosition::Prepend, Table::Nat, "PREROUTING", &args).unwrap());
        assert!(!f.ensure_rule(RulePosition::Prepend, Table::Nat, "PREROUTING", &["-j", "ACCEPT"]).unwrap());
        assert!(!f.ensure_rule(RulePosition::Append, Table::Nat, "PREROUTING", &["-j", "RETURN"]).unwrap());
        assert_eq!(
            f.rules(Table::Nat, "PREROUTING").unwrap(),
            strings(&[
                "-j ACCEPT",
                "-m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES",
                "-j RETURN"
            ])
        );
        // Exact argument comparison: a different spelling is a different rule.
        assert!(!f.ensure_rule(RulePosition::Append, Table::Nat, "PREROUTING", &["--jump", "RETURN"]).unwrap());

        // A restored rule with a quoted comment is found by its unquoted arguments.
        restore_all(&f, "*nat\n:KUBE-X - [0:0]\n-A KUBE-X -m comment --comment \"a b\" -j ACCEPT\nCOMMIT\n").unwrap();
        assert!(
            f.ensure_rule(
                RulePosition::Append,
                Table::Nat,
                "KUBE-X",
                &["-m", "comment", "--comment", "a b", "-j", "ACCEPT"]
            )
            .unwrap()
        );

        // Missing chain or target: the rule cannot be added.
        let err = f.ensure_rule(RulePosition::Append, Table::Nat, "KUBE-NOPE", &["-j", "ACCEPT"]).unwrap_err();
        assert!(
            matches!(&err, IptablesError::Failed { status: 1, args, .. } if args == "-A KUBE-NOPE -t nat -j ACCEPT"),
            "{err}"
        );
        assert!(f.ensure_rule(RulePosition::Append, Table::Nat, "PREROUTING", &["-j", "KUBE-NOPE"]).is_err());

        // Deleting a chain that is still referenced fails; unreference it and it works.
        assert!(f.delete_chain(Table::Nat, "KUBE-SERVICES").is_err());
        f.delete_rule(Table::Nat, "PREROUTING", &args).unwrap();
        f.delete_rule(Table::Nat, "PREROUTING", &args).unwrap();
        f.delete_rule(Table::Nat, "KUBE-NOPE", &args).unwrap();
        f.delete_chain(Table::Nat, "KUBE-SERVICES").unwrap();
        assert!(f.delete_chain(Table::Nat, "KUBE-SERVICES").is_err());
        assert!(f.delete_chain(Table::Nat, "PREROUTING").is_err());

        f.flush_chain(Table::Nat, "PREROUTING").unwrap();
        assert_eq!(f.rules(Table::Nat, "PREROUTING"), Some(vec![]));
        assert!(f.flush_chain(Table::Nat, "KUBE-SERVICES").is_err());

        // A non-empty chain cannot be deleted.
        assert!(f.delete_chain(Table::Nat, "KUBE-X").is_err());
        f.flush_chain(Table::Nat, "KUBE-X").unwrap();
        f.delete_chain(Table::Nat, "KUBE-X").unwrap();

        let calls = f.calls();
        assert_eq!(calls[0], "ensure_chain nat KUBE-SERVICES");
        assert_eq!(
            calls[6],
            "ensure_rule -I nat PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES"
        );
        assert!(
            calls.contains(
                &"delete_rule nat KUBE-NOPE -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES"
                    .to_string()
            )
        );
        assert!(calls.contains(&"flush_chain nat PREROUTING".to_string()));
        assert!(calls.contains(&"delete_chain nat KUBE-X".to_string()));
        f.clear_log();
        assert!(f.calls().is_empty() && f.restores().is_empty());
    }

    #[test]
    fn scripted_failures() {
        let f = fake();
        f.fail_next_restore(IptablesError::Exec { command: "iptables-restore".into(), reason: "boom".into() });
        let err = restore_all(&f, BASE).unwrap_err();
        assert!(matches!(err, IptablesError::Exec { .. }));
        assert!(f.rules(Table::Nat, "KUBE-SVC-AAA").is_none());
        restore_all(&f, BASE).unwrap();

        f.fail_restores_containing("KUBE-SEP-111 -m comment");
        let err = restore_all(&f, BASE).unwrap_err();
        assert_eq!(err.restore_line(), Some(14));
        let err = f.restore(Table::Nat, BASE.as_bytes(), FlushFlag::Flush, RestoreCounters::NoCounters).unwrap_err();
        assert_eq!(err.restore_line(), Some(14));
        assert_eq!(f.rules(Table::Nat, "KUBE-SEP-111").unwrap().len(), 2);
        restore_all(&f, "*nat\nCOMMIT\n").unwrap();
        f.clear_failures();
        restore_all(&f, BASE).unwrap();
        assert_eq!(f.restores().len(), 6);

        f.fail_next_save(IptablesError::Lock("held".into()));
        let mut out = Vec::new();
        assert!(f.save_into(Table::Nat, &mut out).is_err());
        assert!(out.is_empty());
        f.save_into(Table::Nat, &mut out).unwrap();
        assert!(!out.is_empty());
    }

    #[test]
    fn seed_is_unlogged() {
        let f = fake();
        f.seed(BASE.as_bytes()).unwrap();
        assert!(f.calls().is_empty() && f.restores().is_empty());
        assert_eq!(f.rules(Table::Nat, "KUBE-SVC-AAA").unwrap().len(), 1);
    }

    #[test]
    fn restored_state_round_trips_through_dump() {
        let f = fake();
        restore_all(&f, BASE).unwrap();
        let canonical_input = Dump::parse(BASE).unwrap();
        let saved = Dump::parse(&f.save_all()).unwrap();
        for table in &canonical_input.tables {
            for chain in &table.chains {
                assert_eq!(saved.chain(&table.name, &chain.name).unwrap().rules, chain.rules, "{}", chain.name);
            }
        }
    }

    #[test]
    fn tokenizer_follows_iptables_restore() {
        let t = |s: &str| tokenize(s).unwrap();
        assert_eq!(t("-A X  -j\tY"), strings(&["-A", "X", "-j", "Y"]));
        assert_eq!(t("--comment \"a b\" x"), strings(&["--comment", "a b", "x"]));
        assert_eq!(t("--comment \"\" x"), strings(&["--comment", "", "x"]));
        assert_eq!(t("ab\"c d\"e"), strings(&["abc d", "e"]));
        assert_eq!(t("\"say \\\"hi\\\"\""), strings(&["say \"hi\""]));
        assert!(tokenize("\"open").is_err());
        let args = strings(&["a b", "", "c\"d", "plain", "x\\y"]);
        let rendered = render_args(args.iter().map(String::as_str));
        assert_eq!(rendered, "\"a b\" \"\" \"c\\\"d\" plain \"x\\\\y\"");
        assert_eq!(t(&rendered), args);
    }

    #[test]
    fn usable_across_threads() {
        let f = std::sync::Arc::new(fake());
        let handles: Vec<_> = (0..4)
            .map(|i| {
                let f = std::sync::Arc::clone(&f);
                std::thread::spawn(move || {
                    let chain = format!("KUBE-T{i}");
                    f.ensure_chain(Table::Filter, &chain).map(|_| ())
                })
            })
            .collect();
        for h in handles {
            assert!(h.join().is_ok_and(|r| r.is_ok()));
        }
        assert_eq!(f.chains(Table::Filter).len(), 7);
    }
}
