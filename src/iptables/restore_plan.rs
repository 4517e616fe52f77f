//! Applying one large `iptables-restore --noflush` input as a sequence of smaller ones that
//! iptables-nft applies in seconds rather than minutes, with the same end state.
//!
//! Why: with `--noflush`, iptables-nft (1.8.9 through 1.8.13) inserts every chain name a
//! command mentions into a sorted linked list, walked with `strcmp` from its head
//! (`nft_cache_level_set` → `cache_chain_list_insert` in nft-cache.c). One restore therefore
//! costs about (commands × distinct chain names) / 2 comparisons: 31 G at 10k services,
//! twelve minutes. Cut into pieces whose product stays under a budget, the same work costs a
//! few seconds, plus a small per-transaction cost (process start, kernel validation).
//!
//! The input comes in [`Layout::DependencyOrder`](super::Layout): every chain after the
//! chains it jumps to, each declaration followed by its rules, the flushes of chains to
//! delete and then their deletions last. The [`Cutter`] reads that stream as it is written
//! (the proxier's rendered rules write themselves into it: no copy of the whole input
//! exists) and applies a piece each time the next chain would take it over the budget (a
//! small table shares its run with the start of the next; within a piece each table is laid
//! out as upstream lays it out: declarations, rules, deletions). The pieces keep every packet
//! on a complete path while they are applied one after the other:
//! * a chain is never split: its flush (`:CHAIN`) and all its rules are in one transaction;
//! * chains go bottom-up: a rewritten parent only ever refers to children already in their
//!   new state (a child rewritten earlier still does what its old parent expects: endpoint
//!   and service chains are named by what they do);
//! * stale chains are flushed and deleted last, after everything that referred to them has
//!   been rewritten; all are flushed before any is deleted (they may refer to each other).
//!
//! Plain text gets that layout from [`write_dependency_ordered`], which parses it and orders
//! its chains by their height in the jump graph; the proxier's renderer knows its chains'
//! kinds and writes the layout directly.

use std::collections::{HashMap, HashSet};
use std::io;

use super::save;
use super::{IptablesError, Layout, RestoreInput};

/// Above this many (commands × distinct chain names) a piece is cut. Measured on iptables
/// 1.8.9 (docs/performance.md): around 8M the user-space list walk of a piece (~20 ms) is
/// comparable to its fixed cost.
pub const DEFAULT_BUDGET: u64 = 8_000_000;

/// One `iptables-restore` run of a cut restore: sections of whole chains, each between its
/// table's header and a `COMMIT` (a small table and the start of the next share a run).
#[derive(Debug)]
pub struct Piece<'a> {
    pub text: &'a [u8],
    /// Where runs of this piece's lines come from: (first line here, its number in the whole
    /// input), in order; the lines after each start follow on in the input.
    origins: &'a [(usize, usize)],
}

impl Piece<'_> {
    /// The number in the whole input of line `line` (1-based) of this piece. A `COMMIT` that
    /// does not end its table in the input is numbered as the line the next piece starts
    /// with.
    pub fn input_line(&self, line: usize) -> usize {
        let at = self.origins.partition_point(|&(first, _)| first <= line);
        match at.checked_sub(1).map(|i| self.origins[i]) {
            Some((first, input)) => input + (line - first),
            None => self.origins.first().map_or(line, |&(_, input)| input),
        }
    }

    /// The lines around `line` of this piece, numbered as in the whole input.
    pub fn context(&self, line: usize) -> String {
        save::format_line_context_numbered(self.text, line, 3, |n| self.input_line(n))
    }
}

/// Reads a restore input in [`Layout::DependencyOrder`] as it is written and hands `apply`
/// each piece as soon as it is complete (see the module docs). An error from `apply` stops
/// the stream: the writer sees an I/O error and [`Cutter::finish`] returns `apply`'s error.
pub struct Cutter<F> {
    budget: u64,
    apply: F,
    /// The end of the input that is not a whole line yet.
    partial: Vec<u8>,
    /// Lines read so far.
    lines: usize,
    /// The open table's `*name` line and its number.
    header: Option<(Vec<u8>, usize)>,
    /// The chain being read (or a deletion): a unit that is never cut.
    unit: Unit,
    piece: PieceText,
    failed: Option<IptablesError>,
    pieces: usize,
}

/// One chain as read (its declaration and its rules), or one deletion, and the chain names
/// it mentions: a unit that is never cut.
#[derive(Default)]
struct Unit {
    declaration: Option<(Vec<u8>, usize)>,
    rules: Vec<u8>,
    first_rule_line: usize,
    rule_lines: usize,
    names: HashSet<String>,
}

impl Unit {
    fn lines(&self) -> usize {
        usize::from(self.declaration.is_some()) + self.rule_lines
    }

    fn push_rule(&mut self, line: &[u8], number: usize) {
        if self.rule_lines == 0 {
            self.first_rule_line = number;
        }
        self.rules.extend_from_slice(line);
        self.rules.push(b'\n');
        self.rule_lines += 1;
    }

    fn clear(&mut self) {
        self.declaration = None;
        self.rules.clear();
        self.rule_lines = 0;
        self.names.clear();
    }
}

/// The text of the piece being filled: the table sections already complete, and the open
/// one laid out as upstream lays out a table (declarations, then rules and deletions; with
/// declarations next to their rules iptables-nft-restore is 8 % slower on a 10k first sync).
#[derive(Default)]
struct PieceText {
    text: Vec<u8>,
    lines: usize,
    origins: Vec<(usize, usize)>,
    names: HashSet<String>,
    /// The open section's header line and its number in the input.
    header: Option<(Vec<u8>, usize)>,
    declarations: Vec<u8>,
    declaration_lines: Vec<usize>,
    rules: Vec<u8>,
    rule_lines: usize,
    /// Runs of the open section's rules: (index among its rule lines, input line).
    rule_runs: Vec<(usize, usize)>,
    /// The input line after the last rule added.
    next_input_line: usize,
}

impl PieceText {
    /// Lines of the piece so far, an open section's header counted.
    fn len(&self) -> usize {
        self.lines + self.header.as_ref().map_or(0, |_| 1 + self.declaration_lines.len() + self.rule_lines)
    }

    fn open(&mut self, header: &[u8], line: usize) {
        self.header = Some((header.to_vec(), line));
        self.next_input_line = line + 1;
    }

    fn push_unit(&mut self, unit: &mut Unit) {
        if let Some((declaration, line)) = unit.declaration.take() {
            self.declarations.extend_from_slice(&declaration);
            self.declarations.push(b'\n');
            self.declaration_lines.push(line);
            self.next_input_line = line + 1;
        }
        if unit.rule_lines > 0 {
            self.rule_runs.push((self.rule_lines, unit.first_rule_line));
            self.rules.extend_from_slice(&unit.rules);
            self.rule_lines += unit.rule_lines;
            self.next_input_line = unit.first_rule_line + unit.rule_lines;
        }
        let names = std::mem::take(&mut unit.names);
        self.names.extend(names);
        unit.clear();
    }

    fn push_line(&mut self, line: &[u8], input_line: usize) {
        self.lines += 1;
        self.origins.push((self.lines, input_line));
        self.text.extend_from_slice(line);
        self.text.push(b'\n');
    }

    /// Ends the open section with a `COMMIT` numbered `commit_line` in the input.
    fn close(&mut self, commit_line: usize) {
        let Some((header, header_line)) = self.header.take() else {
            return;
        };
        self.push_line(&header, header_line);
        let first_declaration = self.lines + 1;
        let declared = self.declaration_lines.iter().enumerate().map(|(i, &line)| (first_declaration + i, line));
        self.origins.extend(declared);
        self.text.extend_from_slice(&self.declarations);
        self.lines += self.declaration_lines.len();
        let first_rule = self.lines + 1;
        self.origins.extend(self.rule_runs.iter().map(|&(index, line)| (first_rule + index, line)));
        self.text.extend_from_slice(&self.rules);
        self.lines += self.rule_lines;
        self.push_line(b"COMMIT", commit_line);
        self.declarations.clear();
        self.declaration_lines.clear();
        self.rules.clear();
        self.rule_lines = 0;
        self.rule_runs.clear();
    }

    /// What restoring this text with `unit` added would cost (headers and COMMITs counted
    /// as two lines).
    fn cost_with(&self, unit: &Unit) -> u64 {
        let names = self.names.len() + unit.names.iter().filter(|n| !self.names.contains(*n)).count();
        ((self.len() + unit.lines() + 2) as u64).saturating_mul(names as u64)
    }

    fn clear(&mut self) {
        self.text.clear();
        self.lines = 0;
        self.origins.clear();
        self.names.clear();
    }
}

impl<F: FnMut(&Piece<'_>) -> Result<(), IptablesError>> Cutter<F> {
    pub fn new(budget: u64, apply: F) -> Self {
        Cutter {
            budget,
            apply,
            partial: Vec::new(),
            lines: 0,
            header: None,
            unit: Unit::default(),
            piece: PieceText::default(),
            failed: None,
            pieces: 0,
        }
    }

    /// Ends the input: `Ok(pieces applied)`, or the error that stopped it.
    pub fn finish(mut self) -> Result<usize, IptablesError> {
        if let Some(err) = self.failed.take() {
            return Err(err);
        }
        if !self.partial.is_empty() {
            let line = std::mem::take(&mut self.partial);
            self.line(&line).map_err(|e| self.input_error(e))?;
        }
        if self.header.is_some() {
            return Err(self.input_error(io::Error::new(io::ErrorKind::InvalidData, "table without COMMIT")));
        }
        self.apply_piece().map_err(|e| self.input_error(e))?;
        Ok(self.pieces)
    }

    fn input_error(&mut self, e: io::Error) -> IptablesError {
        self.failed.take().unwrap_or(IptablesError::Input { command: "iptables-restore".into(), reason: e.to_string() })
    }

    fn line(&mut self, raw: &[u8]) -> io::Result<()> {
        self.lines += 1;
        let number = self.lines;
        let line = raw.strip_suffix(b"\r").unwrap_or(raw);
        if self.header.is_none() {
            if line.starts_with(b"*") {
                self.header = Some((line.to_vec(), number));
                return Ok(());
            }
            if line.is_empty() || line.starts_with(b"#") {
                return Ok(());
            }
            return Err(io::Error::new(io::ErrorKind::InvalidData, format!("line {number}: not in a table")));
        }
        if line == b"COMMIT" {
            self.close_unit()?;
            self.piece.close(number);
            self.header = None;
            return Ok(());
        }
        let text = std::str::from_utf8(line).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
        if let Some(rest) = text.strip_prefix(':') {
            // A chain's declaration starts the next unit.
            self.close_unit()?;
            if let Some(name) = rest.split_ascii_whitespace().next() {
                self.unit.names.insert(name.to_string());
            }
            self.unit.declaration = Some((line.to_vec(), number));
            return Ok(());
        }
        if let Some(rest) = text.strip_prefix("-X ") {
            // So does a deletion.
            self.close_unit()?;
            self.unit.names.insert(rest.trim().to_string());
        } else if let Some(rest) = text.strip_prefix("-A ").or_else(|| text.strip_prefix("-I ")) {
            for name in rest.split_ascii_whitespace().next().into_iter().chain(jump_target(rest)) {
                if !self.unit.names.contains(name) {
                    self.unit.names.insert(name.to_string());
                }
            }
        }
        self.unit.push_rule(line, number);
        Ok(())
    }

    /// Adds the unit just read to the piece, applying the piece first if the unit would take
    /// it over the budget.
    fn close_unit(&mut self) -> io::Result<()> {
        if self.unit.lines() == 0 {
            return Ok(());
        }
        if self.piece.len() > 0 && self.piece.cost_with(&self.unit) > self.budget {
            self.apply_piece()?;
        }
        if self.piece.header.is_none()
            && let Some((header, header_line)) = &self.header
        {
            self.piece.open(header, *header_line);
        }
        self.piece.push_unit(&mut self.unit);
        Ok(())
    }

    /// Applies the piece so far, committing a table section it leaves open.
    fn apply_piece(&mut self) -> io::Result<()> {
        if self.piece.len() == 0 {
            return Ok(());
        }
        let next = self.piece.next_input_line;
        self.piece.close(next);
        let piece = Piece { text: &self.piece.text, origins: &self.piece.origins };
        let applied = (self.apply)(&piece);
        self.piece.clear();
        match applied {
            Ok(()) => {
                self.pieces += 1;
                Ok(())
            }
            Err(e) => {
                self.failed = Some(e);
                Err(io::Error::other("a piece of the restore failed"))
            }
        }
    }
}

impl<F: FnMut(&Piece<'_>) -> Result<(), IptablesError>> io::Write for Cutter<F> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if self.failed.is_some() {
            return Err(io::Error::other("a piece of the restore failed"));
        }
        let mut rest = buf;
        while let Some(end) = rest.iter().position(|&b| b == b'\n') {
            if self.partial.is_empty() {
                self.line(&rest[..end])?;
            } else {
                self.partial.extend_from_slice(&rest[..end]);
                let line = std::mem::take(&mut self.partial);
                let result = self.line(&line);
                self.partial = line;
                self.partial.clear();
                result?;
            }
            rest = &rest[end + 1..];
        }
        self.partial.extend_from_slice(rest);
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Applies `input` as a sequence of transactions that each cost at most `budget`: `apply`
/// restores one piece's text, `on_step` runs after each. A failure names the line in the
/// whole input (in [`Layout::DependencyOrder`]) and shows the lines around it. `Ok(false)`
/// when the input has no dependency order (text of another shape): nothing was applied.
pub fn apply_in_pieces(
    input: &dyn RestoreInput,
    budget: u64,
    apply: &mut dyn FnMut(&[u8]) -> Result<(), IptablesError>,
    on_step: &mut dyn FnMut(),
) -> Result<bool, IptablesError> {
    let mut cutter = Cutter::new(budget, |piece: &Piece<'_>| {
        apply(piece.text).map_err(|e| match e {
            IptablesError::RestoreLine { command, line, output, .. } => IptablesError::RestoreLine {
                command,
                line: piece.input_line(line),
                output,
                context: piece.context(line),
            },
            other => other,
        })?;
        on_step();
        Ok(())
    });
    match input.write_to(Layout::DependencyOrder, &mut cutter) {
        Ok(()) => {
            let pieces = cutter.finish()?;
            tracing::debug!(pieces, "restored in pieces");
            Ok(true)
        }
        Err(e) if e.kind() == io::ErrorKind::Unsupported => Ok(false),
        Err(e) => Err(cutter
            .finish()
            .err()
            .unwrap_or_else(|| IptablesError::Input { command: "iptables-restore".into(), reason: e.to_string() })),
    }
}

/// Writes restore text `data` in [`Layout::DependencyOrder`]; fails with
/// [`io::ErrorKind::Unsupported`], writing nothing, when it is not of the shape the proxier
/// writes (`*table`, `:CHAIN` declarations, `-A` rules for declared chains, `-X`, `COMMIT`,
/// comments) or its jumps form a cycle.
pub fn write_dependency_ordered(data: &[u8], out: &mut dyn io::Write) -> io::Result<()> {
    let unsupported = || io::Error::new(io::ErrorKind::Unsupported, "input not of the proxier's shape");
    let tables = parse(data).ok_or_else(unsupported)?;
    let mut orders = Vec::with_capacity(tables.len());
    for table in &tables {
        orders.push(table.dependency_order().ok_or_else(unsupported)?);
    }
    for (table, order) in tables.iter().zip(orders) {
        table.write_in(&order, out)?;
    }
    Ok(())
}

/// Where a line of the input is (`u32`s: an input past 4 GiB is not reordered).
#[derive(Clone, Copy)]
struct Line {
    start: u32,
    len: u32,
}

impl Line {
    fn text<'a>(&self, input: &'a str) -> &'a str {
        &input[self.start as usize..(self.start + self.len) as usize]
    }
}

struct Chain<'a> {
    name: &'a str,
    declaration: Line,
    rules: Vec<Line>,
    deleted: Option<Line>,
}

struct TableText<'a> {
    /// The whole input, which the lines point into.
    input: &'a str,
    header: Line,
    commit: Line,
    chains: Vec<Chain<'a>>,
    /// `-X` of chains not declared in this input.
    bare_deletions: Vec<Line>,
}

impl TableText<'_> {
    /// The live chains, each no earlier than every chain it jumps to (input order among
    /// equals); `None` if the jumps form a cycle.
    fn dependency_order(&self) -> Option<Vec<usize>> {
        let index: HashMap<&str, usize> = self.chains.iter().enumerate().map(|(i, c)| (c.name, i)).collect();
        let targets: Vec<Vec<usize>> = self
            .chains
            .iter()
            .map(|c| {
                let mut t: Vec<usize> = c
                    .rules
                    .iter()
                    .filter_map(|r| jump_target(r.text(self.input)))
                    .filter_map(|n| index.get(n).copied())
                    .collect();
                t.sort_unstable();
                t.dedup();
                t
            })
            .collect();
        let depth = depths(&targets)?;
        let mut live: Vec<usize> = (0..self.chains.len()).filter(|&i| self.chains[i].deleted.is_none()).collect();
        live.sort_by_key(|&i| (depth[i], i));
        Some(live)
    }

    /// Writes the table: the live chains in `order`, then the stale chains' flushes, then
    /// every deletion.
    fn write_in(&self, order: &[usize], out: &mut dyn io::Write) -> io::Result<()> {
        let mut line = |l: &Line| {
            out.write_all(l.text(self.input).as_bytes())?;
            out.write_all(b"\n")
        };
        line(&self.header)?;
        for &i in order {
            let chain = &self.chains[i];
            line(&chain.declaration)?;
            chain.rules.iter().try_for_each(&mut line)?;
        }
        let stale = self.chains.iter().filter(|c| c.deleted.is_some());
        stale.clone().try_for_each(|c| line(&c.declaration))?;
        stale.filter_map(|c| c.deleted.as_ref()).try_for_each(&mut line)?;
        self.bare_deletions.iter().try_for_each(&mut line)?;
        line(&self.commit)
    }
}

/// The chain a rule jumps or goes to (`-j NAME` / `-g NAME`), if any.
fn jump_target(rule: &str) -> Option<&str> {
    let mut words = rule.split_ascii_whitespace();
    while let Some(w) = words.next() {
        if w == "-j" || w == "-g" || w == "--jump" || w == "--goto" {
            return words.next();
        }
    }
    None
}

/// Each chain's height above the leaves of the jump graph (a chain jumping to nothing
/// declared here is 0). `None` if the graph has a cycle (iptables would reject it anyway).
fn depths(targets: &[Vec<usize>]) -> Option<Vec<usize>> {
    const UNSEEN: usize = usize::MAX;
    const IN_PROGRESS: usize = usize::MAX - 1;
    let mut depth = vec![UNSEEN; targets.len()];
    for root in 0..targets.len() {
        if depth[root] != UNSEEN {
            continue;
        }
        // Iterative DFS: (node, next target index).
        let mut stack = vec![(root, 0usize)];
        depth[root] = IN_PROGRESS;
        while let Some(&mut (node, ref mut next)) = stack.last_mut() {
            if let Some(&child) = targets[node].get(*next) {
                *next += 1;
                match depth[child] {
                    IN_PROGRESS => return None,
                    UNSEEN => {
                        depth[child] = IN_PROGRESS;
                        stack.push((child, 0));
                    }
                    _ => {}
                }
            } else {
                depth[node] = targets[node].iter().map(|&c| depth[c] + 1).max().unwrap_or(0);
                stack.pop();
            }
        }
    }
    Some(depth)
}

/// A table being parsed: from its `*table` line to its `COMMIT`.
struct OpenTable<'a> {
    header: Line,
    chains: Vec<Chain<'a>>,
    index: HashMap<&'a str, usize>,
    bare: Vec<Line>,
}

/// Parses the restore input into tables; `None` for anything but the proxier's shape.
fn parse(data: &[u8]) -> Option<Vec<TableText<'_>>> {
    let text = std::str::from_utf8(data).ok()?;
    let mut tables = Vec::new();
    let mut current: Option<OpenTable<'_>> = None;
    for raw in text.lines() {
        let line = raw.trim_end_matches('\r');
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let l = Line {
            start: u32::try_from(line.as_ptr() as usize - text.as_ptr() as usize).ok()?,
            len: u32::try_from(line.len()).ok()?,
        };
        match &mut current {
            None => {
                if !line.starts_with('*') {
                    return None;
                }
                current = Some(OpenTable { header: l, chains: Vec::new(), index: HashMap::new(), bare: Vec::new() });
            }
            Some(OpenTable { chains, index, bare, .. }) => {
                if line == "COMMIT" {
                    let OpenTable { header, chains, bare, .. } = current.take()?;
                    tables.push(TableText { input: text, header, commit: l, chains, bare_deletions: bare });
                } else if let Some(rest) = line.strip_prefix(':') {
                    let name = rest.split_ascii_whitespace().next()?;
                    if index.contains_key(name) {
                        return None;
                    }
                    index.insert(name, chains.len());
                    chains.push(Chain { name, declaration: l, rules: Vec::new(), deleted: None });
                } else if let Some(rest) = line.strip_prefix("-A ") {
                    let name = rest.split_ascii_whitespace().next()?;
                    let &c = index.get(name)?;
                    if chains[c].deleted.is_some() {
                        return None;
                    }
                    chains[c].rules.push(l);
                } else if let Some(rest) = line.strip_prefix("-X ") {
                    let name = rest.trim();
                    match index.get(name) {
                        Some(&c) if chains[c].rules.is_empty() && chains[c].deleted.is_none() => {
                            chains[c].deleted = Some(l)
                        }
                        Some(_) => return None,
                        None => bare.push(l),
                    }
                } else {
                    return None;
                }
            }
        }
    }
    if current.is_some() {
        return None;
    }
    Some(tables)
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;

    const PAYLOAD: &str = "*filter
:KUBE-SERVICES - [0:0]
-A KUBE-SERVICES -j REJECT
COMMIT
*nat
:KUBE-SERVICES - [0:0]
:KUBE-MARK-MASQ - [0:0]
:KUBE-SVC-A - [0:0]
:KUBE-SEP-A1 - [0:0]
:KUBE-SEP-A2 - [0:0]
:KUBE-SVC-OLD - [0:0]
:KUBE-SEP-OLD - [0:0]
-A KUBE-SERVICES -d 10.0.0.1/32 -j KUBE-SVC-A
-A KUBE-MARK-MASQ -j MARK --or-mark 0x4000
-A KUBE-SVC-A -m statistic --mode random --probability 0.5 -j KUBE-SEP-A1
-A KUBE-SVC-A -j KUBE-SEP-A2
-A KUBE-SEP-A1 -s 10.1.0.1/32 -j KUBE-MARK-MASQ
-A KUBE-SEP-A1 -p tcp -j DNAT --to-destination 10.1.0.1:80
-A KUBE-SEP-A2 -s 10.1.0.2/32 -j KUBE-MARK-MASQ
-A KUBE-SEP-A2 -p tcp -j DNAT --to-destination 10.1.0.2:80
-X KUBE-SVC-OLD
-X KUBE-SEP-OLD
-X KUBE-SEP-GONE
COMMIT
";

    const ORDERED: &str = "*filter
:KUBE-SERVICES - [0:0]
-A KUBE-SERVICES -j REJECT
COMMIT
*nat
:KUBE-MARK-MASQ - [0:0]
-A KUBE-MARK-MASQ -j MARK --or-mark 0x4000
:KUBE-SEP-A1 - [0:0]
-A KUBE-SEP-A1 -s 10.1.0.1/32 -j KUBE-MARK-MASQ
-A KUBE-SEP-A1 -p tcp -j DNAT --to-destination 10.1.0.1:80
:KUBE-SEP-A2 - [0:0]
-A KUBE-SEP-A2 -s 10.1.0.2/32 -j KUBE-MARK-MASQ
-A KUBE-SEP-A2 -p tcp -j DNAT --to-destination 10.1.0.2:80
:KUBE-SVC-A - [0:0]
-A KUBE-SVC-A -m statistic --mode random --probability 0.5 -j KUBE-SEP-A1
-A KUBE-SVC-A -j KUBE-SEP-A2
:KUBE-SERVICES - [0:0]
-A KUBE-SERVICES -d 10.0.0.1/32 -j KUBE-SVC-A
:KUBE-SVC-OLD - [0:0]
:KUBE-SEP-OLD - [0:0]
-X KUBE-SVC-OLD
-X KUBE-SEP-OLD
-X KUBE-SEP-GONE
COMMIT
";

    fn ordered(text: &str) -> io::Result<String> {
        let mut out = Vec::new();
        write_dependency_ordered(text.as_bytes(), &mut out)?;
        Ok(String::from_utf8(out).unwrap())
    }

    /// The pieces `input` is cut into (written `chunk` bytes at a time) and each piece's
    /// line numbers in the input.
    fn cut(input: &str, budget: u64, chunk: usize) -> Vec<(String, Vec<usize>)> {
        let mut pieces = Vec::new();
        let mut cutter = Cutter::new(budget, |p: &Piece<'_>| {
            let text = String::from_utf8(p.text.to_vec()).unwrap();
            let numbers = (1..=text.lines().count()).map(|n| p.input_line(n)).collect();
            pieces.push((text, numbers));
            Ok(())
        });
        for part in input.as_bytes().chunks(chunk) {
            cutter.write_all(part).unwrap();
        }
        let applied = cutter.finish().unwrap();
        assert_eq!(applied, pieces.len());
        pieces
    }

    #[test]
    fn text_is_reordered_bottom_up_with_deletions_last() {
        assert_eq!(ordered(PAYLOAD).unwrap(), ORDERED);
        // Already ordered text stays as it is.
        assert_eq!(ordered(ORDERED).unwrap(), ORDERED);
    }

    #[test]
    fn within_budget_the_input_is_one_piece() {
        // Each table laid out as upstream does: declarations, rules, deletions.
        let pieces = cut(ORDERED, 1_000_000, 4096);
        assert_eq!(pieces.len(), 1);
        let expected = "*filter
:KUBE-SERVICES - [0:0]
-A KUBE-SERVICES -j REJECT
COMMIT
*nat
:KUBE-MARK-MASQ - [0:0]
:KUBE-SEP-A1 - [0:0]
:KUBE-SEP-A2 - [0:0]
:KUBE-SVC-A - [0:0]
:KUBE-SERVICES - [0:0]
:KUBE-SVC-OLD - [0:0]
:KUBE-SEP-OLD - [0:0]
-A KUBE-MARK-MASQ -j MARK --or-mark 0x4000
-A KUBE-SEP-A1 -s 10.1.0.1/32 -j KUBE-MARK-MASQ
-A KUBE-SEP-A1 -p tcp -j DNAT --to-destination 10.1.0.1:80
-A KUBE-SEP-A2 -s 10.1.0.2/32 -j KUBE-MARK-MASQ
-A KUBE-SEP-A2 -p tcp -j DNAT --to-destination 10.1.0.2:80
-A KUBE-SVC-A -m statistic --mode random --probability 0.5 -j KUBE-SEP-A1
-A KUBE-SVC-A -j KUBE-SEP-A2
-A KUBE-SERVICES -d 10.0.0.1/32 -j KUBE-SVC-A
-X KUBE-SVC-OLD
-X KUBE-SEP-OLD
-X KUBE-SEP-GONE
COMMIT
";
        assert_eq!(pieces[0].0, expected);
        let numbers = [1, 2, 3, 4, 5, 6, 8, 11, 14, 17, 19, 20, 7, 9, 10, 12, 13, 15, 16, 18, 21, 22, 23, 24];
        assert_eq!(pieces[0].1, numbers);
        // Empty tables are left out.
        let pieces = cut("*filter\nCOMMIT\n*nat\n:A - [0:0]\nCOMMIT\n", 1_000_000, 4096);
        assert_eq!(pieces, [("*nat\n:A - [0:0]\nCOMMIT\n".to_string(), vec![3, 4, 5])]);
    }

    #[test]
    fn a_small_table_shares_a_piece_with_the_start_of_the_next() {
        // Budget 40: the filter table and KUBE-MARK-MASQ fit together (8 lines × 4 names,
        // targets counted), the next chain does not.
        let pieces = cut(ORDERED, 40, 4096);
        assert!(pieces[0].0.starts_with("*filter\n:KUBE-SERVICES - [0:0]\n-A KUBE-SERVICES -j REJECT\nCOMMIT\n*nat\n"));
        assert_eq!(pieces[0].1[..6], [1, 2, 3, 4, 5, 6]);
        assert!(pieces[0].0.ends_with("-A KUBE-MARK-MASQ -j MARK --or-mark 0x4000\nCOMMIT\n"), "{}", pieces[0].0);
        assert!(pieces[1].0.starts_with("*nat\n"), "{}", pieces[1].0);
    }

    #[test]
    fn a_budget_of_one_applies_chain_by_chain_and_lines_map_back() {
        let pieces = cut(ORDERED, 1, 7);
        let texts: Vec<&str> = pieces.iter().map(|(t, _)| t.as_str()).collect();
        assert_eq!(texts[0], "*filter\n:KUBE-SERVICES - [0:0]\n-A KUBE-SERVICES -j REJECT\nCOMMIT\n");
        assert_eq!(texts[1], "*nat\n:KUBE-MARK-MASQ - [0:0]\n-A KUBE-MARK-MASQ -j MARK --or-mark 0x4000\nCOMMIT\n");
        assert_eq!(
            texts[texts.len() - 5..],
            [
                "*nat\n:KUBE-SVC-OLD - [0:0]\nCOMMIT\n",
                "*nat\n:KUBE-SEP-OLD - [0:0]\nCOMMIT\n",
                "*nat\n-X KUBE-SVC-OLD\nCOMMIT\n",
                "*nat\n-X KUBE-SEP-OLD\nCOMMIT\n",
                "*nat\n-X KUBE-SEP-GONE\nCOMMIT\n",
            ]
        );
        let svc = pieces.iter().find(|(t, _)| t.contains(":KUBE-SVC-A ")).unwrap();
        assert_eq!(svc.1[..4], [5, 14, 15, 16]);
    }

    #[test]
    fn every_line_is_applied_once_whatever_the_budget() {
        let body: Vec<(usize, String)> = ORDERED
            .lines()
            .enumerate()
            .filter(|(_, l)| !l.starts_with('*') && *l != "COMMIT")
            .map(|(i, l)| (i + 1, l.to_string()))
            .collect();
        for budget in [1, 10, 40, 100, 1000, u64::MAX] {
            for chunk in [1, 13, 4096] {
                let mut seen = Vec::new();
                for (text, numbers) in cut(ORDERED, budget, chunk) {
                    for (line, number) in text.lines().zip(numbers) {
                        // A piece that does not end its table commits where the next begins.
                        if line != "COMMIT" {
                            assert_eq!(ORDERED.lines().nth(number - 1), Some(line), "budget {budget}");
                        }
                        if !line.starts_with('*') && line != "COMMIT" {
                            seen.push((number, line.to_string()));
                        }
                    }
                }
                seen.sort();
                assert_eq!(seen, body, "budget {budget} chunk {chunk}");
            }
        }
    }

    #[test]
    fn larger_budgets_pack_chains_together() {
        let small = cut(ORDERED, 1, 4096).len();
        let larger = cut(ORDERED, 60, 4096).len();
        assert!(larger < small, "{larger} < {small}");
    }

    #[test]
    fn a_failing_piece_stops_the_stream_with_its_error() {
        let mut applied = 0;
        let mut cutter = Cutter::new(1, |p: &Piece<'_>| {
            if p.text.windows(10).any(|w| w == b"KUBE-SVC-A") {
                return Err(IptablesError::RestoreLine {
                    command: "iptables-restore".into(),
                    line: p.input_line(3),
                    output: "bad".into(),
                    context: p.context(3),
                });
            }
            applied += 1;
            Ok(())
        });
        let err = cutter.write_all(ORDERED.as_bytes()).expect_err("stops");
        assert_eq!(err.kind(), io::ErrorKind::Other);
        let err = cutter.finish().expect_err("the piece's error");
        assert_eq!(err.restore_line(), Some(15), "{err}");
        let context = err.restore_context().unwrap();
        assert!(context.contains("> 15 | -A KUBE-SVC-A -m statistic"), "{context}");
        assert!(context.contains("  14 | :KUBE-SVC-A - [0:0]"), "{context}");
        assert_eq!(applied, 4, "filter, KUBE-MARK-MASQ and the two endpoint chains");
    }

    #[test]
    fn a_table_without_commit_is_an_error() {
        let mut cutter = Cutter::new(1_000, |_: &Piece<'_>| Ok(()));
        cutter.write_all(b"*nat\n:A - [0:0]\n").unwrap();
        assert!(matches!(cutter.finish(), Err(IptablesError::Input { .. })));
        let mut cutter = Cutter::new(1_000, |_: &Piece<'_>| Ok(()));
        assert!(cutter.write_all(b"-A X -j ACCEPT\n").is_err());
    }

    #[test]
    fn unknown_shapes_and_cycles_are_not_reordered() {
        for odd in [
            "*nat\n:A - [0:0]\n-I A -j ACCEPT\nCOMMIT\n",
            "*nat\n-A UNDECLARED -j ACCEPT\nCOMMIT\n",
            "*nat\n:A - [0:0]\n-A A -j ACCEPT\n",
            "junk\n",
            "*nat\n:A - [0:0]\n:B - [0:0]\n-A A -j B\n-A B -j A\nCOMMIT\n",
        ] {
            let mut out = Vec::new();
            let err = write_dependency_ordered(odd.as_bytes(), &mut out).expect_err(odd);
            assert_eq!(err.kind(), io::ErrorKind::Unsupported, "{odd:?}");
            assert!(out.is_empty());
        }
    }

    #[test]
    fn depths_follow_the_longest_path() {
        assert_eq!(depths(&[vec![1, 2], vec![2], vec![]]), Some(vec![2, 1, 0]));
        assert_eq!(depths(&[vec![0]]), None);
    }
}
