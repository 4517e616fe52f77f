//! Splitting one large `iptables-restore --noflush` input into a sequence of smaller ones
//! that iptables-nft applies in seconds rather than minutes, with the same end state.
//!
//! Why: with `--noflush`, iptables-nft (1.8.9 through 1.8.13) inserts every chain name a
//! command mentions into a sorted linked list, walked with `strcmp` from its head
//! (`nft_cache_level_set` → `cache_chain_list_insert` in nft-cache.c). One restore therefore
//! costs about (commands × distinct chain names) / 2 comparisons: 31 G at 10k services,
//! twelve minutes. Cut into pieces whose product stays under a budget, the same work costs a
//! few seconds, plus a small per-transaction cost (process start, kernel validation).
//!
//! The pieces keep every packet on a complete path while they are applied one after the
//! other:
//! * a chain is never split: its flush (`:CHAIN`) and all its rules are in one transaction;
//! * chains go bottom-up: a chain is written no earlier than every chain it jumps to, so a
//!   rewritten parent only ever refers to children already in their new state (a child
//!   rewritten earlier still does what its old parent expects: endpoint and service chains
//!   are named by what they do);
//! * stale chains are flushed and deleted last, parents before children, after everything
//!   that referred to them has been rewritten.
//!
//! Tables other than the split one (filter, small) are applied whole, in input order.
//! Input of any shape other than what the proxier writes (`*table`, `:CHAIN` declarations,
//! `-A` rules for declared chains, `-X`, `COMMIT`, comments) is not split.

use std::collections::{HashMap, HashSet};

/// Above this many (commands × distinct chain names) a table is split; each piece stays
/// under it. Measured on iptables 1.8.9 (docs/performance.md): around 8M the user-space
/// list walk of a piece (~20 ms) is comparable to its fixed cost.
pub const DEFAULT_BUDGET: u64 = 8_000_000;

/// One `iptables-restore` input of a split restore, as the numbers of the original lines it
/// holds (its text is built only when it is restored: at 10k services the input is 34 MB,
/// and a second copy of all of it would double the sync's peak memory).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Piece {
    /// For each line of the piece (index 0 = line 1), its line number in the original input.
    original_lines: Vec<u32>,
}

/// The pieces of a split restore of one input.
#[derive(Debug)]
pub struct Plan<'a> {
    input: &'a [u8],
    /// Byte range of each line of `input` (index 0 = line 1), without its newline.
    line_ranges: Vec<(u32, u32)>,
    pub pieces: Vec<Piece>,
}

impl Plan<'_> {
    /// The text of `piece`, one newline-terminated line per original line.
    pub fn text(&self, piece: &Piece) -> Vec<u8> {
        let range = |n: u32| (n as usize).checked_sub(1).and_then(|i| self.line_ranges.get(i)).copied();
        let size = piece.original_lines.iter().map(|&n| range(n).map_or(0, |(s, e)| (e - s) as usize) + 1).sum();
        let mut out = Vec::with_capacity(size);
        for &n in &piece.original_lines {
            if let Some((start, end)) = range(n) {
                out.extend_from_slice(&self.input[start as usize..end as usize]);
            }
            out.push(b'\n');
        }
        out
    }
}

impl Piece {
    /// The line of the original input that line `line` (1-based) of this piece came from.
    pub(crate) fn original_line(&self, line: usize) -> Option<usize> {
        line.checked_sub(1).and_then(|i| self.original_lines.get(i)).map(|&n| n as usize)
    }
}

/// The pieces to restore one after the other in place of `data`, or `None` when `data` is
/// best restored as it is (within budget, or not of a shape this module understands).
pub fn split(data: &[u8], budget: u64) -> Option<Plan<'_>> {
    let pieces = split_pieces(data, budget)?;
    let mut line_ranges = Vec::with_capacity(data.iter().filter(|&&b| b == b'\n').count() + 1);
    let mut start = 0;
    for line in data.split(|&b| b == b'\n') {
        let end = start + line.len();
        let trimmed = if line.ends_with(b"\r") { end - 1 } else { end };
        // Offsets are u32s: an input past 4 GiB is not split.
        line_ranges.push((u32::try_from(start).ok()?, u32::try_from(trimmed).ok()?));
        start = end + 1;
    }
    Some(Plan { input: data, line_ranges, pieces })
}

fn split_pieces(data: &[u8], budget: u64) -> Option<Vec<Piece>> {
    let tables = parse(data)?;
    if tables.iter().all(|t| t.cost() <= budget) {
        return None;
    }
    let mut pieces = Vec::new();
    for table in &tables {
        if table.cost() <= budget {
            pieces.push(table.whole());
        } else {
            pieces.extend(table.split(budget)?);
        }
    }
    Some(pieces)
}

/// A line of the input: its number and where its text is (`u32`s: at 10k services the
/// planner holds 450k of these, and their size is most of a split restore's extra memory).
#[derive(Clone, Copy)]
struct Line {
    number: u32,
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
    lines: usize,
    names: usize,
}

impl TableText<'_> {
    fn cost(&self) -> u64 {
        (self.lines as u64).saturating_mul(self.names as u64)
    }

    /// The table as one piece, in its original line order.
    fn whole(&self) -> Piece {
        let mut all: Vec<&Line> = vec![&self.header];
        for c in &self.chains {
            all.push(&c.declaration);
            all.extend(c.rules.iter());
            all.extend(c.deleted.iter());
        }
        all.extend(self.bare_deletions.iter());
        all.push(&self.commit);
        all.sort_by_key(|l| l.number);
        let mut builder = PieceBuilder::new(&self.header);
        for l in all.into_iter().skip(1) {
            builder.push(l);
        }
        builder.finish()
    }

    fn split(&self, budget: u64) -> Option<Vec<Piece>> {
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

        let (stale, live): (Vec<usize>, Vec<usize>) =
            (0..self.chains.len()).partition(|&i| self.chains[i].deleted.is_some());
        let mut live = live;
        live.sort_by_key(|&i| (depth[i], i));
        let mut pieces = Vec::new();
        let mut current = Packing::default();
        for &i in &live {
            let chain = &self.chains[i];
            let names: Vec<&str> = std::iter::once(chain.name)
                .chain(chain.rules.iter().filter_map(|r| jump_target(r.text(self.input))))
                .collect();
            let lines = 1 + chain.rules.len();
            if !current.is_empty() && current.cost_with(lines, &names) > budget {
                pieces.push(self.emit(&std::mem::take(&mut current), Part::Rules, false));
            }
            current.add(i, lines, &names);
        }
        if !current.is_empty() {
            pieces.push(self.emit(&std::mem::take(&mut current), Part::Rules, false));
        }
        // Stale chains: nothing live refers to them any more (their parents were rewritten
        // above), but they may refer to each other through their old rules, so all are
        // flushed before any is deleted.
        for part in [Part::Flush, Part::Delete] {
            for &i in &stale {
                let names = [self.chains[i].name];
                if !current.is_empty() && current.cost_with(1, &names) > budget {
                    pieces.push(self.emit(&std::mem::take(&mut current), part, false));
                }
                current.add(i, 1, &names);
            }
            let bare = part == Part::Delete && !self.bare_deletions.is_empty();
            if !current.is_empty() || bare {
                pieces.push(self.emit(&std::mem::take(&mut current), part, bare));
            }
        }
        Some(pieces)
    }

    /// A piece with `part` of the chains of `packing` (and, with `bare`, the deletions of
    /// chains not declared in the input), laid out as the original is.
    fn emit(&self, packing: &Packing<'_>, part: Part, bare: bool) -> Piece {
        let mut builder = PieceBuilder::new(&self.header);
        if part != Part::Delete {
            for &i in &packing.chains {
                builder.push(&self.chains[i].declaration);
            }
        }
        for &i in &packing.chains {
            let chain = &self.chains[i];
            match part {
                Part::Rules => chain.rules.iter().for_each(|r| builder.push(r)),
                Part::Flush => {}
                Part::Delete => chain.deleted.iter().for_each(|l| builder.push(l)),
            }
        }
        if bare {
            self.bare_deletions.iter().for_each(|l| builder.push(l));
        }
        builder.push(&self.commit);
        builder.finish()
    }
}

/// What of its chains a piece carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Part {
    /// Declarations (flushes) and rules of live chains.
    Rules,
    /// Declarations alone: flushes of stale chains.
    Flush,
    /// Deletions of stale chains.
    Delete,
}

#[derive(Default)]
struct Packing<'a> {
    chains: Vec<usize>,
    lines: usize,
    names: HashSet<&'a str>,
}

impl<'a> Packing<'a> {
    fn is_empty(&self) -> bool {
        self.chains.is_empty()
    }

    fn cost_with(&self, lines: usize, names: &[&'a str]) -> u64 {
        let new_names = names.iter().filter(|n| !self.names.contains(*n)).collect::<HashSet<_>>().len();
        ((self.lines + lines + 2) as u64).saturating_mul((self.names.len() + new_names) as u64)
    }

    fn add(&mut self, chain: usize, lines: usize, names: &[&'a str]) {
        self.chains.push(chain);
        self.lines += lines;
        self.names.extend(names.iter().copied());
    }
}

struct PieceBuilder {
    original_lines: Vec<u32>,
}

impl PieceBuilder {
    fn new(header: &Line) -> Self {
        let mut b = PieceBuilder { original_lines: Vec::new() };
        b.push(header);
        b
    }

    fn push(&mut self, line: &Line) {
        self.original_lines.push(line.number);
    }

    fn finish(self) -> Piece {
        Piece { original_lines: self.original_lines }
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
    lines: usize,
}

/// Parses the restore input into tables; `None` for anything but the proxier's shape.
fn parse(data: &[u8]) -> Option<Vec<TableText<'_>>> {
    let text = std::str::from_utf8(data).ok()?;
    let mut tables = Vec::new();
    let mut current: Option<OpenTable<'_>> = None;
    for (i, raw) in text.lines().enumerate() {
        let line = raw.trim_end_matches('\r');
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let l = Line {
            number: u32::try_from(i + 1).ok()?,
            start: u32::try_from(line.as_ptr() as usize - text.as_ptr() as usize).ok()?,
            len: u32::try_from(line.len()).ok()?,
        };
        match &mut current {
            None => {
                if !line.starts_with('*') {
                    return None;
                }
                current = Some(OpenTable {
                    header: l,
                    chains: Vec::new(),
                    index: HashMap::new(),
                    bare: Vec::new(),
                    lines: 0,
                });
            }
            Some(OpenTable { chains, index, bare, lines, .. }) => {
                *lines += 1;
                if line == "COMMIT" {
                    let OpenTable { header, chains, bare, lines, .. } = current.take()?;
                    let mut names: HashSet<&str> = chains.iter().map(|c| c.name).collect();
                    for c in &chains {
                        names.extend(c.rules.iter().filter_map(|r| jump_target(r.text(text))));
                    }
                    let names = names.len();
                    tables.push(TableText {
                        input: text,
                        header,
                        commit: l,
                        chains,
                        bare_deletions: bare,
                        lines,
                        names,
                    });
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
    use super::*;

    /// The pieces' texts of a split of `PAYLOAD`.
    fn texts(budget: u64) -> Option<(Vec<String>, Vec<Piece>)> {
        let plan = split(PAYLOAD.as_bytes(), budget)?;
        let texts = plan.pieces.iter().map(|p| String::from_utf8(plan.text(p)).unwrap()).collect();
        Some((texts, plan.pieces))
    }

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

    #[test]
    fn within_budget_nothing_is_split() {
        assert!(split(PAYLOAD.as_bytes(), 1_000_000).is_none());
        assert!(split(PAYLOAD.as_bytes(), 1).is_some());
    }

    #[test]
    fn pieces_go_bottom_up_with_deletions_last_and_lines_map_back() {
        let (texts, pieces) = texts(1).expect("split");
        assert_eq!(texts[0], "*filter\n:KUBE-SERVICES - [0:0]\n-A KUBE-SERVICES -j REJECT\nCOMMIT\n");
        // Budget 1: one chain per piece, leaves first.
        let order: Vec<&str> = texts[1..]
            .iter()
            .map(|t| t.lines().nth(1).unwrap().trim_start_matches(':').split(' ').next().unwrap())
            .collect();
        let pos = |n: &str| order.iter().position(|o| *o == n).unwrap();
        assert!(pos("KUBE-MARK-MASQ") < pos("KUBE-SEP-A1"));
        assert!(pos("KUBE-SEP-A1") < pos("KUBE-SVC-A"));
        assert!(pos("KUBE-SEP-A2") < pos("KUBE-SVC-A"));
        assert!(pos("KUBE-SVC-A") < pos("KUBE-SERVICES"));
        // Stale chains last: all flushed, then all deleted (they may refer to each other);
        // the deletion of an undeclared chain rides with the last.
        let n = texts.len();
        assert_eq!(
            texts[n - 4..],
            [
                "*nat\n:KUBE-SVC-OLD - [0:0]\nCOMMIT\n",
                "*nat\n:KUBE-SEP-OLD - [0:0]\nCOMMIT\n",
                "*nat\n-X KUBE-SVC-OLD\nCOMMIT\n",
                "*nat\n-X KUBE-SEP-OLD\n-X KUBE-SEP-GONE\nCOMMIT\n",
            ]
        );
        // Line numbers map back to the original.
        let svc = &pieces[texts.iter().position(|t| t.contains(":KUBE-SVC-A ")).unwrap()];
        assert_eq!(svc.original_line(1), Some(5));
        assert_eq!(svc.original_line(2), Some(8));
        assert_eq!(svc.original_line(3), Some(15));
        assert_eq!(svc.original_line(svc.original_lines.len()), Some(24));
        assert_eq!(svc.original_line(0), None);
    }

    #[test]
    fn every_line_is_restored_exactly_once() {
        for budget in [1, 10, 40, 100, 1000] {
            let (texts, pieces) = texts(budget).unwrap_or_else(|| (vec![PAYLOAD.to_string()], vec![parse_whole()]));
            let mut seen: Vec<usize> = Vec::new();
            for (p, text) in pieces.iter().zip(&texts) {
                for (i, line) in text.lines().enumerate() {
                    if line.starts_with('*') || line == "COMMIT" {
                        continue;
                    }
                    let n = p.original_line(i + 1).unwrap();
                    assert_eq!(PAYLOAD.lines().nth(n - 1), Some(line), "budget {budget}");
                    seen.push(n);
                }
            }
            seen.sort_unstable();
            let expected: Vec<usize> = PAYLOAD
                .lines()
                .enumerate()
                .filter(|(_, l)| !l.starts_with('*') && *l != "COMMIT")
                .map(|(i, _)| i + 1)
                .collect();
            assert_eq!(seen, expected, "budget {budget}");
        }
    }

    fn parse_whole() -> Piece {
        Piece { original_lines: (1..=PAYLOAD.lines().count() as u32).collect() }
    }

    #[test]
    fn larger_budgets_pack_chains_together() {
        let small = split(PAYLOAD.as_bytes(), 1).unwrap().pieces.len();
        let larger = split(PAYLOAD.as_bytes(), 60).unwrap().pieces.len();
        assert!(larger < small, "{larger} < {small}");
    }

    #[test]
    fn unknown_shapes_and_cycles_are_not_split() {
        for odd in [
            "*nat\n:A - [0:0]\n-I A -j ACCEPT\nCOMMIT\n",
            "*nat\n-A UNDECLARED -j ACCEPT\nCOMMIT\n",
            "*nat\n:A - [0:0]\n-A A -j ACCEPT\n",
            "junk\n",
            "*nat\n:A - [0:0]\n:B - [0:0]\n-A A -j B\n-A B -j A\nCOMMIT\n",
        ] {
            assert!(split(odd.as_bytes(), 0).is_none(), "{odd:?}");
        }
    }

    #[test]
    fn depths_follow_the_longest_path() {
        assert_eq!(depths(&[vec![1, 2], vec![2], vec![]]), Some(vec![2, 1, 0]));
        assert_eq!(depths(&[vec![0]]), None);
    }
}
