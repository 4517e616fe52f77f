//! A structured model of `iptables-restore` input / `iptables-save` output, and the canonical
//! form tests compare rule sets in.
//!
//! This module owns [`Dump`]: parsing (upstream `iptablestest.ParseIPTablesDump`), printing
//! (upstream `IPTablesDump.String()`), and the order-insensitive normalisation upstream's
//! proxier tests apply before comparing (`sortIPTablesRules` in
//! `pkg/proxy/iptables/proxier_test.go`), so expected outputs written for upstream kube-proxy
//! can be compared byte for byte with ours.
//!
//! # What upstream does (read from `pkg/util/iptables/testing/parse.go` and `proxier_test.go`)
//!
//! Parsing: the text is trimmed of leading/trailing newlines and split into lines, each line is
//! trimmed of whitespace, and blank lines and lines starting with `#` are skipped. Then a
//! three-state machine:
//!
//! 1. expect `*table`; anything else is an error.
//! 2. chain declarations `:NAME - [packets:bytes]` (upstream's regex accepts only `-` as the
//!    policy); the first line that is not one moves on to state 3 and is re-read there.
//! 3. `-A CHAIN rest` (the chain must have been declared in this table, and not deleted; the
//!    rule must parse, see below), `-X CHAIN` (the chain must be declared and have no rules
//!    yet; it is marked deleted), `COMMIT` (back to state 1); anything else is an error,
//!    including a chain declaration after the first rule.
//!
//! Ending anywhere but state 1 is an error (no `COMMIT`). A rule is split into words (a
//! double-quoted string is one word, quotes removed); it must have at least one word after
//! `-A CHAIN`. `-m MODULE` pairs are skipped; a known parameter (`--comment`, `-j`, `-s`, ...)
//! takes the next word as its value, and parsing fails if a value-taking known parameter is the
//! last word or a non-negatable one is preceded by `!`. Unknown words are skipped one at a time.
//!
//! Printing (`String()`), per table in order: `*table`; every chain's declaration line as
//! `:NAME - [packets:bytes]`, deleted chains included; every chain's rules, chain by chain, as
//! the original trimmed line; one `-X NAME` line per deleted chain; `COMMIT`. Each line ends
//! in `\n`.
//!
//! Normalisation (`sortIPTablesRules`): tables sorted by name; in each table chains ordered
//! `KUBE-NODEPORTS`, then `KUBE-SERVICES`, then other `KUBE-*` alphabetically, then the rest
//! alphabetically; then a *stable* sort of the rules of filter `KUBE-NODEPORTS`, nat
//! `KUBE-NODEPORTS` and filter `KUBE-SERVICES` by "service name" — the `--comment` value up to
//! its first space or colon (`orderByCommentServiceName`; two rules compare as unordered if
//! either has no comment) — and of nat `KUBE-SERVICES` the same way except that a rule whose
//! comment contains `must be the last rule` sorts after everything. Other chains keep their
//! rule order. Because that comparator is not a strict weak order when comment-less rules are
//! mixed in, the result depends on the sorting algorithm; we run a port of Go's
//! `sort.SliceStable` (insertion sort on blocks of 20, then SymMerge) so even those inputs
//! come out exactly as upstream's do.
//!
//! # Where we differ (documented extensions)
//!
//! * A chain declaration may carry any policy word (`:PREROUTING ACCEPT [0:0]`), which is kept
//!   and printed back, so `iptables-save` output parses too. With `-` this is exactly upstream.
//! * Empty table and chain names are rejected (upstream's regexes accept them).
//! * Rules and `-X` lines look chains up in the table being parsed; upstream looks in the
//!   first table of that name, which only differs when a dump repeats a table.
//! * Errors carry the 1-based line number of the offending line in the original text.
//! * Chain counters that overflow `u64` saturate, as Go's `ParseUint` (error ignored) does.
//!
//! # Representation
//!
//! [`DumpChain::rules`] holds each rule's text *after* `-A CHAIN ` exactly as written (so
//! `-A {chain} {rule}` reproduces the input line byte for byte); [`DumpChain::rule_lines`]
//! gives the full lines.

use std::cmp::Ordering;
use std::collections::HashMap;
use std::fmt;
use std::sync::LazyLock;

use regex::Regex;

const KUBE_NODEPORTS: &str = "KUBE-NODEPORTS";
const KUBE_SERVICES: &str = "KUBE-SERVICES";
const MUST_BE_LAST: &str = "must be the last rule";

/// A parsed rule dump: the tables in input order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Dump {
    pub tables: Vec<DumpTable>,
}

/// One `*table` ... `COMMIT` section.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DumpTable {
    pub name: String,
    /// Chains in declaration order.
    pub chains: Vec<DumpChain>,
}

/// One declared chain with the rules the dump adds to it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DumpChain {
    pub name: String,
    /// The policy word of the declaration line: `-` for user chains, `ACCEPT`/`DROP` for
    /// built-in chains in `iptables-save` output.
    pub policy: String,
    pub packets: u64,
    pub bytes: u64,
    /// Rule text after `-A CHAIN `, verbatim, in order.
    pub rules: Vec<String>,
    /// Set by a `-X CHAIN` line (only ever in restore *input*).
    pub deleted: bool,
}

/// Why a dump did not parse. Every variant tied to a line carries its 1-based number.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DumpError {
    #[error("line {line}: could not parse iptables data (table {index} starts with {text:?}, not a table name)")]
    ExpectedTable { line: usize, index: usize, text: String },
    #[error("line {line}: empty table name in {text:?}")]
    EmptyTableName { line: usize, text: String },
    #[error("line {line}: empty chain name in declaration {text:?}")]
    EmptyChainName { line: usize, text: String },
    #[error("line {line}: error parsing rule {text:?}: table {table} declares no chain {chain:?}")]
    UndeclaredChain { line: usize, table: String, chain: String, text: String },
    #[error("line {line}: cannot add rules to deleted chain {chain:?}")]
    RuleInDeletedChain { line: usize, chain: String },
    #[error("line {line}: cannot delete chain {chain:?} after adding rules")]
    DeleteAfterRules { line: usize, chain: String },
    #[error("line {line}: bad iptables rule {text:?}: {reason}")]
    BadRule { line: usize, text: String, reason: String },
    #[error("line {line}: error parsing rule {text:?}")]
    Unparseable { line: usize, text: String },
    #[error("line {line}: could not parse iptables data (table {table} has no COMMIT line)")]
    MissingCommit { line: usize, table: String },
    #[error("iptables data is not UTF-8 (invalid byte at offset {offset})")]
    NotUtf8 { offset: usize },
}

impl DumpError {
    /// The 1-based line the error is about, if it is about one. For
    /// [`DumpError::MissingCommit`] this is the line of the unterminated `*table`.
    pub fn line(&self) -> Option<usize> {
        match self {
            DumpError::ExpectedTable { line, .. }
            | DumpError::EmptyTableName { line, .. }
            | DumpError::EmptyChainName { line, .. }
            | DumpError::UndeclaredChain { line, .. }
            | DumpError::RuleInDeletedChain { line, .. }
            | DumpError::DeleteAfterRules { line, .. }
            | DumpError::BadRule { line, .. }
            | DumpError::Unparseable { line, .. }
            | DumpError::MissingCommit { line, .. } => Some(*line),
            DumpError::NotUtf8 { .. } => None,
        }
    }
}

static DECLARE_CHAIN: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"^:([^ ]*) ([^ ]+) \[([0-9]*):([0-9]*)\]$").expect("constant regex is valid"));
static ADD_RULE: LazyLock<Regex> = LazyLock::new(|| Regex::new(r"^-A ([^ ]*) (.*)$").expect("constant regex is valid"));
static DELETE_CHAIN: LazyLock<Regex> = LazyLock::new(|| Regex::new(r"^-X (.*)$").expect("constant regex is valid"));
/// Upstream's `wordRegex`, with Go's ASCII-only `\s` / `\S` spelled out.
static WORD: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r#"(?:^|[\t\n\x0C\r ])("[^"]*"|[^"][^\t\n\x0C\r ]*)"#).expect("constant regex is valid")
});

#[derive(Clone, Copy, PartialEq, Eq)]
enum State {
    TableDeclaration,
    ChainDeclarations,
    Rules,
}

impl Dump {
    /// Parses `iptables-restore` input or `iptables-save` output (see the module docs for
    /// exactly what is accepted).
    pub fn parse(text: &str) -> Result<Dump, DumpError> {
        let mut dump = Dump::default();
        let mut state = State::TableDeclaration;
        let mut table_line = 0;
        // Index of each chain of the current table (first declaration wins, as a linear
        // search would find it), so big dumps parse in linear time.
        let mut chain_index: HashMap<String, usize> = HashMap::new();

        for (index, raw) in text.split('\n').enumerate() {
            let line_no = index + 1;
            let line = raw.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }

            if state == State::ChainDeclarations {
                match DECLARE_CHAIN.captures(line) {
                    Some(caps) => {
                        let name = &caps[1];
                        if name.is_empty() {
                            return Err(DumpError::EmptyChainName { line: line_no, text: line.to_string() });
                        }
                        let chain = DumpChain {
                            name: name.to_string(),
                            policy: caps[2].to_string(),
                            packets: parse_counter(&caps[3]),
                            bytes: parse_counter(&caps[4]),
                            rules: Vec::new(),
                            deleted: false,
                        };
                        if let Some(table) = dump.tables.last_mut() {
                            chain_index.entry(chain.name.clone()).or_insert(table.chains.len());
                            table.chains.push(chain);
                        }
                        continue;
                    }
                    None => state = State::Rules,
                }
            }

            match state {
                State::TableDeclaration => {
                    let Some(name) = line.strip_prefix('*') else {
                        return Err(DumpError::ExpectedTable {
                            line: line_no,
                            index: dump.tables.len() + 1,
                            text: line.to_string(),
                        });
                    };
                    if name.is_empty() {
                        return Err(DumpError::EmptyTableName { line: line_no, text: line.to_string() });
                    }
                    dump.tables.push(DumpTable { name: name.to_string(), chains: Vec::new() });
                    table_line = line_no;
                    chain_index.clear();
                    state = State::ChainDeclarations;
                }
                State::ChainDeclarations => {}
                State::Rules => {
                    let Some(table) = dump.tables.last_mut() else {
                        return Err(DumpError::Unparseable { line: line_no, text: line.to_string() });
                    };
                    if let Some(caps) = ADD_RULE.captures(line) {
                        let chain_name = &caps[1];
                        let rule = caps.get(2).map_or("", |m| m.as_str());
                        let table_name = table.name.clone();
                        let Some(chain) = chain_index.get(chain_name).and_then(|&i| table.chains.get_mut(i)) else {
                            return Err(DumpError::UndeclaredChain {
                                line: line_no,
                                table: table_name,
                                chain: chain_name.to_string(),
                                text: line.to_string(),
                            });
                        };
                        if chain.deleted {
                            return Err(DumpError::RuleInDeletedChain { line: line_no, chain: chain_name.to_string() });
                        }
                        if let Err(reason) = parse_rule(line) {
                            return Err(DumpError::BadRule { line: line_no, text: line.to_string(), reason });
                        }
                        chain.rules.push(rule.to_string());
                    } else if let Some(caps) = DELETE_CHAIN.captures(line) {
                        let chain_name = &caps[1];
                        let table_name = table.name.clone();
                        let Some(chain) = chain_index.get(chain_name).and_then(|&i| table.chains.get_mut(i)) else {
                            return Err(DumpError::UndeclaredChain {
                                line: line_no,
                                table: table_name,
                                chain: chain_name.to_string(),
                                text: line.to_string(),
                            });
                        };
                        if !chain.rules.is_empty() {
                            return Err(DumpError::DeleteAfterRules { line: line_no, chain: chain_name.to_string() });
                        }
                        chain.deleted = true;
                    } else if line == "COMMIT" {
                        state = State::TableDeclaration;
                    } else {
                        return Err(DumpError::Unparseable { line: line_no, text: line.to_string() });
                    }
                }
            }
        }

        if state != State::TableDeclaration {
            let table = dump.tables.last().map(|t| t.name.clone()).unwrap_or_default();
            return Err(DumpError::MissingCommit { line: table_line, table });
        }
        Ok(dump)
    }

    /// [`Dump::parse`] for raw bytes (e.g. a payload recorded by the fake).
    pub fn parse_bytes(data: &[u8]) -> Result<Dump, DumpError> {
        let text = std::str::from_utf8(data).map_err(|e| DumpError::NotUtf8 { offset: e.valid_up_to() })?;
        Dump::parse(text)
    }

    /// The first table called `name`.
    pub fn table(&self, name: &str) -> Option<&DumpTable> {
        self.tables.iter().find(|t| t.name == name)
    }

    /// The chain `chain` of the first table called `table`.
    pub fn chain(&self, table: &str, chain: &str) -> Option<&DumpChain> {
        self.table(table)?.chain(chain)
    }

    /// Reorders tables, chains and the service-keyed chains' rules the way upstream's
    /// `sortIPTablesRules` does (see the module docs).
    pub fn sort_canonical(&mut self) {
        self.tables.sort_by(|a, b| a.name.cmp(&b.name));
        for table in &mut self.tables {
            table.chains.sort_by(|a, b| compare_chain_names(&a.name, &b.name));
        }
        let sorts: [(&str, &str, bool); 4] = [
            ("filter", KUBE_NODEPORTS, false),
            ("nat", KUBE_NODEPORTS, false),
            ("filter", KUBE_SERVICES, false),
            ("nat", KUBE_SERVICES, true),
        ];
        for (table, chain, keep_last) in sorts {
            if let Some(chain) = self.chain_mut(table, chain) {
                sort_rules_by_service(chain, keep_last);
            }
        }
    }

    /// Upstream's normalised text: a sorted copy of this dump, printed. Two rule sets that
    /// differ only in the order services were processed give identical strings.
    pub fn canonical_string(&self) -> String {
        let mut sorted = self.clone();
        sorted.sort_canonical();
        sorted.to_string()
    }

    fn chain_mut(&mut self, table: &str, chain: &str) -> Option<&mut DumpChain> {
        self.tables.iter_mut().find(|t| t.name == table)?.chains.iter_mut().find(|c| c.name == chain)
    }
}

/// Parses `text` and returns its canonical form (upstream `sortIPTablesRules`).
pub fn canonicalize(text: &str) -> Result<String, DumpError> {
    Ok(Dump::parse(text)?.canonical_string())
}

impl DumpTable {
    pub fn chain(&self, name: &str) -> Option<&DumpChain> {
        self.chains.iter().find(|c| c.name == name)
    }
}

impl DumpChain {
    /// The rules as full `-A CHAIN ...` lines.
    pub fn rule_lines(&self) -> Vec<String> {
        self.rules.iter().map(|r| format!("-A {} {}", self.name, r)).collect()
    }

    /// The declaration line, `:NAME POLICY [packets:bytes]`.
    pub fn declaration(&self) -> String {
        format!(":{} {} [{}:{}]", self.name, self.policy, self.packets, self.bytes)
    }
}

/// Upstream `IPTablesDump.String()` (no reordering).
impl fmt::Display for Dump {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for table in &self.tables {
            writeln!(f, "*{}", table.name)?;
            for chain in &table.chains {
                writeln!(f, "{}", chain.declaration())?;
            }
            for chain in &table.chains {
                for rule in &chain.rules {
                    writeln!(f, "-A {} {}", chain.name, rule)?;
                }
            }
            for chain in table.chains.iter().filter(|c| c.deleted) {
                writeln!(f, "-X {}", chain.name)?;
            }
            writeln!(f, "COMMIT")?;
        }
        Ok(())
    }
}

/// The `--comment` value of a rule, given its text after `-A CHAIN ` (as stored in
/// [`DumpChain::rules`]), using upstream's rule parser. `None` if the rule has no comment or
/// does not parse.
pub fn rule_comment(chain: &str, rule: &str) -> Option<String> {
    parse_rule(&format!("-A {chain} {rule}")).ok().flatten()
}

fn parse_counter(digits: &str) -> u64 {
    if digits.is_empty() {
        return 0;
    }
    digits.parse().unwrap_or(u64::MAX)
}

fn chain_rank(name: &str) -> u8 {
    match name {
        KUBE_NODEPORTS => 0,
        KUBE_SERVICES => 1,
        _ if name.starts_with("KUBE-") => 2,
        _ => 3,
    }
}

fn compare_chain_names(a: &str, b: &str) -> Ordering {
    chain_rank(a).cmp(&chain_rank(b)).then_with(|| a.cmp(b))
}

/// How upstream's parameter table treats a word of a rule.
enum Param {
    /// Takes the next word as its value.
    Value { negatable: bool },
    /// Stands alone.
    Flag { negatable: bool },
}

/// The parameters upstream's `iptablestest.Rule` recognises.
fn known_param(word: &str) -> Option<Param> {
    let value = |negatable| Some(Param::Value { negatable });
    let flag = |negatable| Some(Param::Flag { negatable });
    match word {
        "-A" | "--comment" | "-j" | "--probability" | "--to-destination" | "--name" | "--seconds" | "--mode" => {
            value(false)
        }
        "-p" | "-s" | "--src-type" | "--sport" | "-d" | "--dst-type" | "--dport" | "--match-set" | "--mark"
        | "--ctstate" => value(true),
        "--random-fully" | "--reap" => flag(false),
        "--rcheck" | "--set" => flag(true),
        _ => None,
    }
}

/// Upstream `ParseRule(line, false)`, reduced to what we need: validation and the comment.
fn parse_rule(line: &str) -> Result<Option<String>, String> {
    let words: Vec<&str> =
        WORD.captures_iter(line).filter_map(|c| c.get(1)).map(|m| m.as_str().trim_matches('"')).collect();

    if words.len() < 2 || words[0] != "-A" {
        return Err("does not start with \"-A CHAIN\"".to_string());
    }
    if words.len() < 3 {
        return Err("no match rules".to_string());
    }

    let mut comment = None;
    let mut negated = false;
    let mut w = 0;
    while w < words.len() {
        let word = words[w];
        if word == "-m" && w + 1 < words.len() {
            w += 2;
            continue;
        }
        if word == "!" {
            negated = true;
            w += 1;
            continue;
        }
        match known_param(word) {
            Some(Param::Flag { negatable }) => {
                if negated && !negatable {
                    return Err(format!("cannot negate parameter {word:?}"));
                }
                w += 1;
            }
            Some(Param::Value { negatable }) => {
                if negated && !negatable {
                    return Err(format!("cannot negate parameter {word:?}"));
                }
                let Some(value) = words.get(w + 1) else {
                    return Err(format!("parameter {word:?} requires an argument"));
                };
                if word == "--comment" {
                    comment = Some((*value).to_string());
                }
                w += 2;
            }
            None => w += 1,
        }
        negated = false;
    }
    Ok(comment)
}

/// `orderByCommentServiceName`: the comment up to its first space or colon.
fn service_name(comment: &str) -> &str {
    comment.find([' ', ':']).map_or(comment, |i| &comment[..i])
}

fn sort_rules_by_service(chain: &mut DumpChain, keep_last: bool) {
    let name = chain.name.clone();
    let mut keyed: Vec<(Option<String>, String)> =
        chain.rules.drain(..).map(|rule| (rule_comment(&name, &rule), rule)).collect();

    let by_service = |a: &Option<String>, b: &Option<String>| match (a, b) {
        (Some(a), Some(b)) => service_name(a) < service_name(b),
        _ => false,
    };
    let is_last = |c: &Option<String>| c.as_deref().is_some_and(|c| c.contains(MUST_BE_LAST));

    go_stable_sort(&mut keyed, &|(a, _), (b, _)| {
        if keep_last {
            if is_last(a) {
                return false;
            }
            if is_last(b) {
                return true;
            }
        }
        by_service(a, b)
    });
    chain.rules = keyed.into_iter().map(|(_, rule)| rule).collect();
}

/// Go's `sort.SliceStable` algorithm: insertion sort on blocks of 20, then repeated SymMerge
/// of neighbouring blocks. Equivalent to any stable sort for a strict weak order; kept
/// faithful so that inconsistent comparators give the same result as upstream too.
fn go_stable_sort<T>(v: &mut [T], less: &impl Fn(&T, &T) -> bool) {
    const BLOCK: usize = 20;
    let n = v.len();
    let mut a = 0;
    let mut b = BLOCK;
    while b <= n {
        insertion_sort(v, a, b, less);
        a = b;
        b += BLOCK;
    }
    insertion_sort(v, a, n, less);

    let mut block = BLOCK;
    while block < n {
        a = 0;
        b = 2 * block;
        while b <= n {
            sym_merge(v, a, a + block, b, less);
            a = b;
            b += 2 * block;
        }
        let m = a + block;
        if m < n {
            sym_merge(v, a, m, n, less);
        }
        block *= 2;
    }
}

fn insertion_sort<T>(v: &mut [T], a: usize, b: usize, less: &impl Fn(&T, &T) -> bool) {
    for i in a + 1..b {
        let mut j = i;
        while j > a && less(&v[j], &v[j - 1]) {
            v.swap(j, j - 1);
            j -= 1;
        }
    }
}

/// Merges the sorted runs `v[a..m]` and `v[m..b]` (Kim & Kutzner's SymMerge, as in Go).
fn sym_merge<T>(v: &mut [T], a: usize, m: usize, b: usize, less: &impl Fn(&T, &T) -> bool) {
    if m - a == 1 {
        // Insert v[a] into v[m..b]: find the lowest i with v[i] >= v[a].
        let (mut i, mut j) = (m, b);
        while i < j {
            let h = (i + j) / 2;
            if less(&v[h], &v[a]) {
                i = h + 1;
            } else {
                j = h;
            }
        }
        for k in a..i - 1 {
            v.swap(k, k + 1);
        }
        return;
    }
    if b - m == 1 {
        // Insert v[m] into v[a..m]: find the lowest i with v[i] > v[m].
        let (mut i, mut j) = (a, m);
        while i < j {
            let h = (i + j) / 2;
            if !less(&v[m], &v[h]) {
                i = h + 1;
            } else {
                j = h;
            }
        }
        let mut k = m;
        while k > i {
            v.swap(k, k - 1);
            k -= 1;
        }
        return;
    }

    let mid = (a + b) / 2;
    let n = mid + m;
    let (mut start, mut r) = if m > mid { (n - b, mid) } else { (a, m) };
    let p = n - 1;
    while start < r {
        let c = (start + r) / 2;
        if !less(&v[p - c], &v[c]) {
            start = c + 1;
        } else {
            r = c;
        }
    }
    let end = n - start;
    if start < m && m < end {
        rotate(v, start, m, end);
    }
    if a < start && start < mid {
        sym_merge(v, a, start, mid, less);
    }
    if mid < end && end < b {
        sym_merge(v, mid, end, b, less);
    }
}

/// Go's block-swap rotation of `v[a..b]` around `m`.
fn rotate<T>(v: &mut [T], a: usize, m: usize, b: usize) {
    let mut i = m - a;
    let mut j = b - m;
    while i != j {
        if i > j {
            swap_range(v, m - i, m, j);
            i -= j;
        } else {
            swap_range(v, m - i, m + j - i, i);
            j -= i;
        }
    }
    swap_range(v, m - i, m, i);
}

fn swap_range<T>(v: &mut [T], a: usize, b: usize, n: usize) {
    for k in 0..n {
        v.swap(a + k, b + k);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Strips the common indentation of a multi-line literal and its leading newline.
    fn dedent(text: &str) -> String {
        let text = text.strip_prefix('\n').unwrap_or(text).trim_end();
        let indent =
            text.lines().filter(|l| !l.trim().is_empty()).map(|l| l.len() - l.trim_start().len()).min().unwrap_or(0);
        text.lines().map(|l| format!("{}\n", l.get(indent..).unwrap_or("").trim_end())).collect()
    }

    // Upstream's TestSortIPTablesRules "basic test using each match type", condensed.
    const UNSORTED: &str = r#"
        *filter
        :KUBE-SERVICES - [0:0]
        :KUBE-EXTERNAL-SERVICES - [0:0]
        :KUBE-FORWARD - [0:0]
        :KUBE-NODEPORTS - [0:0]
        -A KUBE-NODEPORTS -m comment --comment "ns2/svc2:p80 health check node port" -m tcp -p tcp --dport 30000 -j ACCEPT
        -A KUBE-EXTERNAL-SERVICES -m comment --comment "ns2/svc2:p80 has no local endpoints" -m tcp -p tcp -d 192.168.99.22 --dport 80 -j DROP
        -A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP
        -A KUBE-FORWARD -m comment --comment "kubernetes forwarding rules" -m mark --mark 0x4000/0x4000 -j ACCEPT
        COMMIT
        *nat
        :KUBE-SERVICES - [0:0]
        :KUBE-NODEPORTS - [0:0]
        :KUBE-POSTROUTING - [0:0]
        :KUBE-MARK-MASQ - [0:0]
        :KUBE-SVC-XPGD46QRK7WJZT7O - [0:0]
        :KUBE-SEP-SXIVWICOYRO3J4NJ - [0:0]
        :KUBE-SVC-X27LE4BHSL4DOUIK - [0:0]
        :KUBE-SVC-GNZBNJ2PO5MGZ6GT - [0:0]
        :KUBE-SEP-STALE - [0:0]
        -A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN
        -A KUBE-POSTROUTING -j MARK --xor-mark 0x4000
        -A KUBE-MARK-MASQ -j MARK --or-mark 0x4000
        -A KUBE-SERVICES -m comment --comment "ns3/svc3:p80 cluster IP" -m tcp -p tcp -d 172.30.0.43 --dport 80 -j KUBE-SVC-X27LE4BHSL4DOUIK
        -A KUBE-NODEPORTS -m comment --comment ns3/svc3:p80 -m tcp -p tcp --dport 3002 -j KUBE-SVC-X27LE4BHSL4DOUIK
        -A KUBE-SERVICES -m comment --comment "ns1/svc1:p80 cluster IP" -m tcp -p tcp -d 172.30.0.41 --dport 80 -j KUBE-SVC-XPGD46QRK7WJZT7O
        -A KUBE-SVC-XPGD46QRK7WJZT7O -m comment --comment ns1/svc1:p80 -j KUBE-SEP-SXIVWICOYRO3J4NJ
        -A KUBE-SEP-SXIVWICOYRO3J4NJ -m comment --comment ns1/svc1:p80 -s 10.180.0.1 -j KUBE-MARK-MASQ
        -A KUBE-SEP-SXIVWICOYRO3J4NJ -m comment --comment ns1/svc1:p80 -m tcp -p tcp -j DNAT --to-destination 10.180.0.1:80
        -A KUBE-SERVICES -m comment --comment "kubernetes service nodeports; NOTE: this must be the last rule in this chain" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS
        -A KUBE-NODEPORTS -m comment --comment ns2/svc2:p80 -m tcp -p tcp --dport 3001 -j KUBE-SVC-GNZBNJ2PO5MGZ6GT
        -A KUBE-SERVICES -m comment --comment "ns2/svc2:p80 cluster IP" -m tcp -p tcp -d 172.30.0.42 --dport 80 -j KUBE-SVC-GNZBNJ2PO5MGZ6GT
        -A KUBE-SERVICES -m comment --comment "ns2/svc2:p80 external IP" -m tcp -p tcp -d 192.168.99.11 --dport 80 -j KUBE-SVC-GNZBNJ2PO5MGZ6GT
        -X KUBE-SEP-STALE
        COMMIT
        "#;

    const SORTED: &str = r#"
        *filter
        :KUBE-NODEPORTS - [0:0]
        :KUBE-SERVICES - [0:0]
        :KUBE-EXTERNAL-SERVICES - [0:0]
        :KUBE-FORWARD - [0:0]
        -A KUBE-NODEPORTS -m comment --comment "ns2/svc2:p80 health check node port" -m tcp -p tcp --dport 30000 -j ACCEPT
        -A KUBE-EXTERNAL-SERVICES -m comment --comment "ns2/svc2:p80 has no local endpoints" -m tcp -p tcp -d 192.168.99.22 --dport 80 -j DROP
        -A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP
        -A KUBE-FORWARD -m comment --comment "kubernetes forwarding rules" -m mark --mark 0x4000/0x4000 -j ACCEPT
        COMMIT
        *nat
        :KUBE-NODEPORTS - [0:0]
        :KUBE-SERVICES - [0:0]
        :KUBE-MARK-MASQ - [0:0]
        :KUBE-POSTROUTING - [0:0]
        :KUBE-SEP-STALE - [0:0]
        :KUBE-SEP-SXIVWICOYRO3J4NJ - [0:0]
        :KUBE-SVC-GNZBNJ2PO5MGZ6GT - [0:0]
        :KUBE-SVC-X27LE4BHSL4DOUIK - [0:0]
        :KUBE-SVC-XPGD46QRK7WJZT7O - [0:0]
        -A KUBE-NODEPORTS -m comment --comment ns2/svc2:p80 -m tcp -p tcp --dport 3001 -j KUBE-SVC-GNZBNJ2PO5MGZ6GT
        -A KUBE-NODEPORTS -m comment --comment ns3/svc3:p80 -m tcp -p tcp --dport 3002 -j KUBE-SVC-X27LE4BHSL4DOUIK
        -A KUBE-SERVICES -m comment --comment "ns1/svc1:p80 cluster IP" -m tcp -p tcp -d 172.30.0.41 --dport 80 -j KUBE-SVC-XPGD46QRK7WJZT7O
        -A KUBE-SERVICES -m comment --comment "ns2/svc2:p80 cluster IP" -m tcp -p tcp -d 172.30.0.42 --dport 80 -j KUBE-SVC-GNZBNJ2PO5MGZ6GT
        -A KUBE-SERVICES -m comment --comment "ns2/svc2:p80 external IP" -m tcp -p tcp -d 192.168.99.11 --dport 80 -j KUBE-SVC-GNZBNJ2PO5MGZ6GT
        -A KUBE-SERVICES -m comment --comment "ns3/svc3:p80 cluster IP" -m tcp -p tcp -d 172.30.0.43 --dport 80 -j KUBE-SVC-X27LE4BHSL4DOUIK
        -A KUBE-SERVICES -m comment --comment "kubernetes service nodeports; NOTE: this must be the last rule in this chain" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS
        -A KUBE-MARK-MASQ -j MARK --or-mark 0x4000
        -A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN
        -A KUBE-POSTROUTING -j MARK --xor-mark 0x4000
        -A KUBE-SEP-SXIVWICOYRO3J4NJ -m comment --comment ns1/svc1:p80 -s 10.180.0.1 -j KUBE-MARK-MASQ
        -A KUBE-SEP-SXIVWICOYRO3J4NJ -m comment --comment ns1/svc1:p80 -m tcp -p tcp -j DNAT --to-destination 10.180.0.1:80
        -A KUBE-SVC-XPGD46QRK7WJZT7O -m comment --comment ns1/svc1:p80 -j KUBE-SEP-SXIVWICOYRO3J4NJ
        -X KUBE-SEP-STALE
        COMMIT
        "#;

    #[test]
    fn canonical_order_matches_upstream() {
        let out = canonicalize(&dedent(UNSORTED)).unwrap();
        assert_eq!(out, dedent(SORTED));
    }

    #[test]
    fn canonical_is_idempotent_and_round_trips() {
        let sorted = dedent(SORTED);
        // Already-canonical text prints back unchanged ...
        assert_eq!(Dump::parse(&sorted).unwrap().to_string(), sorted);
        // ... and canonicalising twice changes nothing.
        assert_eq!(canonicalize(&sorted).unwrap(), sorted);
        // Printing without sorting keeps input order, and re-parses to the same model.
        let dump = Dump::parse(&dedent(UNSORTED)).unwrap();
        let printed = dump.to_string();
        assert_eq!(Dump::parse(&printed).unwrap(), dump);
        assert_eq!(Dump::parse_bytes(printed.as_bytes()).unwrap(), dump);
    }

    #[test]
    fn tables_sorted_by_name() {
        let input = "*nat\n:KUBE-B - [0:0]\nCOMMIT\n*mangle\nCOMMIT\n*filter\nCOMMIT\n";
        assert_eq!(canonicalize(input).unwrap(), "*filter\nCOMMIT\n*mangle\nCOMMIT\n*nat\n:KUBE-B - [0:0]\nCOMMIT\n");
    }

    #[test]
    fn chain_order() {
        let input = dedent(
            "
            *nat
            :ZZZ - [0:0]
            :KUBE-ZZZ - [0:0]
            :KUBE-SERVICES - [0:0]
            :AAA - [0:0]
            :KUBE-AAA - [0:0]
            :KUBE-NODEPORTS - [0:0]
            :KUBE- - [0:0]
            COMMIT
            ",
        );
        let out = canonicalize(&input).unwrap();
        let names: Vec<&str> = out.lines().filter_map(|l| l.strip_prefix(':')).collect();
        assert_eq!(
            names,
            vec![
                "KUBE-NODEPORTS - [0:0]",
                "KUBE-SERVICES - [0:0]",
                "KUBE- - [0:0]",
                "KUBE-AAA - [0:0]",
                "KUBE-ZZZ - [0:0]",
                "AAA - [0:0]",
                "ZZZ - [0:0]",
            ]
        );
    }

    #[test]
    fn service_name_is_comment_up_to_space_or_colon() {
        // Upstream's "correctly match same service name in different styles of comments".
        let input = dedent(
            r#"
            *nat
            :KUBE-SERVICES - [0:0]
            -A KUBE-SERVICES -m comment --comment "ns2/svc2:p80 cluster IP" svc2 line 1
            -A KUBE-SERVICES -m comment --comment ns2/svc2 svc2 line 2
            -A KUBE-SERVICES -m comment --comment "ns2/svc2 blah" svc2 line 3
            -A KUBE-SERVICES -m comment --comment "ns1/svc1:p80 cluster IP" svc1 line 1
            -A KUBE-SERVICES -m comment --comment ns1/svc1 svc1 line 2
            -A KUBE-SERVICES -m comment --comment "ns1/svc1 blah" svc1 line 3
            -A KUBE-SERVICES -m comment --comment ns4/svc4 svc4 line 1
            -A KUBE-SERVICES -m comment --comment "ns4/svc4:p80 cluster IP" svc4 line 2
            -A KUBE-SERVICES -m comment --comment "ns4/svc4 blah" svc4 line 3
            -A KUBE-SERVICES -m comment --comment "ns3/svc3:p80 cluster IP" svc3 line 1
            -A KUBE-SERVICES -m comment --comment "ns3/svc3 blah" svc3 line 2
            -A KUBE-SERVICES -m comment --comment ns3/svc3 svc3 line 3
            COMMIT
            "#,
        );
        let out = canonicalize(&input).unwrap();
        let order: Vec<&str> = out
            .lines()
            .filter(|l| l.starts_with("-A"))
            .filter_map(|l| l.rsplit_once(" svc").map(|(_, tail)| tail))
            .collect();
        assert_eq!(
            order,
            vec![
                "1 line 1", "1 line 2", "1 line 3", "2 line 1", "2 line 2", "2 line 3", "3 line 1", "3 line 2",
                "3 line 3", "4 line 1", "4 line 2", "4 line 3",
            ]
        );
    }

    #[test]
    fn only_service_keyed_chains_are_sorted() {
        let input = dedent(
            r#"
            *nat
            :KUBE-SVC-A - [0:0]
            :KUBE-EXTERNAL-SERVICES - [0:0]
            -A KUBE-SVC-A -m comment --comment "b/b" -j KUBE-MARK-MASQ
            -A KUBE-SVC-A -m comment --comment "a/a" -j KUBE-MARK-MASQ
            COMMIT
            *mangle
            :KUBE-SERVICES - [0:0]
            -A KUBE-SERVICES -m comment --comment "b/b" -j MARK
            -A KUBE-SERVICES -m comment --comment "a/a" -j MARK
            COMMIT
            "#,
        );
        let dump = Dump::parse(&input).unwrap();
        let mut sorted = dump.clone();
        sorted.sort_canonical();
        assert_eq!(sorted.chain("nat", "KUBE-SVC-A").unwrap().rules, dump.chain("nat", "KUBE-SVC-A").unwrap().rules);
        assert_eq!(
            sorted.chain("mangle", "KUBE-SERVICES").unwrap().rules,
            dump.chain("mangle", "KUBE-SERVICES").unwrap().rules
        );
    }

    #[test]
    fn filter_services_sorted_but_must_be_last_only_in_nat() {
        let input = dedent(
            r#"
            *filter
            :KUBE-SERVICES - [0:0]
            -A KUBE-SERVICES -m comment --comment "zz/this must be the last rule" -j REJECT
            -A KUBE-SERVICES -m comment --comment "aa/svc has no endpoints" -j REJECT
            COMMIT
            *nat
            :KUBE-SERVICES - [0:0]
            -A KUBE-SERVICES -m comment --comment "aa/NOTE: this must be the last rule" -j KUBE-NODEPORTS
            -A KUBE-SERVICES -m comment --comment "zz/svc cluster IP" -j KUBE-SVC-Z
            -A KUBE-SERVICES -m comment --comment "bb/svc cluster IP" -j KUBE-SVC-B
            COMMIT
            "#,
        );
        let dump = Dump::parse(&input).unwrap();
        let mut sorted = dump.clone();
        sorted.sort_canonical();
        let filter = &sorted.chain("filter", "KUBE-SERVICES").unwrap().rules;
        assert!(filter[0].contains("aa/svc"));
        assert!(filter[1].contains("zz/this"));
        let nat = &sorted.chain("nat", "KUBE-SERVICES").unwrap().rules;
        assert!(nat[0].contains("bb/svc"));
        assert!(nat[1].contains("zz/svc"));
        assert!(nat[2].contains("must be the last rule"));
    }

    #[test]
    fn save_output_with_policies_parses() {
        let save = dedent(
            r#"
            # Generated by iptables-save v1.8.9
            *nat
            :PREROUTING ACCEPT [10:600]
            :POSTROUTING ACCEPT [0:0]
            :KUBE-SERVICES - [0:0]
            -A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
            COMMIT
            # Completed
            "#,
        );
        let dump = Dump::parse(&save).unwrap();
        let pre = dump.chain("nat", "PREROUTING").unwrap();
        assert_eq!((pre.policy.as_str(), pre.packets, pre.bytes), ("ACCEPT", 10, 600));
        assert_eq!(
            pre.rule_lines(),
            vec!["-A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES".to_string()]
        );
        assert_eq!(pre.rules, vec!["-m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES".to_string()]);
        assert_eq!(rule_comment("PREROUTING", &pre.rules[0]).as_deref(), Some("kubernetes service portals"));
        assert!(dump.chain("nat", "OUTPUT").is_none());
        assert!(dump.chain("filter", "PREROUTING").is_none());
        assert!(dump.to_string().contains(":PREROUTING ACCEPT [10:600]\n"));
    }

    #[test]
    fn counters_saturate_and_default_to_zero() {
        let dump = Dump::parse("*nat\n:A - [:99999999999999999999999]\nCOMMIT\n").unwrap();
        let chain = dump.chain("nat", "A").unwrap();
        assert_eq!((chain.packets, chain.bytes), (0, u64::MAX));
    }

    #[test]
    fn empty_input_is_an_empty_dump() {
        assert_eq!(Dump::parse("").unwrap(), Dump::default());
        assert_eq!(Dump::parse("\n\n# nothing\n").unwrap(), Dump::default());
        assert_eq!(canonicalize("").unwrap(), "");
    }

    fn err(text: &str) -> DumpError {
        match Dump::parse(text) {
            Ok(dump) => panic!("expected an error, parsed {dump:?}"),
            Err(e) => e,
        }
    }

    #[test]
    fn parse_errors_name_their_line() {
        let e = err("\n*nat\n:A - [0:0]\n-A B -j ACCEPT\nCOMMIT\n");
        assert!(matches!(&e, DumpError::UndeclaredChain { chain, .. } if chain == "B"), "{e}");
        assert_eq!(e.line(), Some(4));

        let e = err("*nat\n:A - [0:0]\n-X A\n-A A -j ACCEPT\nCOMMIT\n");
        assert!(matches!(e, DumpError::RuleInDeletedChain { line: 4, .. }), "{e}");

        let e = err("*nat\n:A - [0:0]\n-A A -j ACCEPT\n-X A\nCOMMIT\n");
        assert!(matches!(e, DumpError::DeleteAfterRules { line: 4, .. }), "{e}");

        let e = err("*nat\n:A - [0:0]\n-X B\nCOMMIT\n");
        assert!(matches!(e, DumpError::UndeclaredChain { line: 3, .. }), "{e}");

        let e = err("*nat\n:A - [0:0]\n-A A -j ACCEPT\n");
        assert!(matches!(e, DumpError::MissingCommit { line: 1, .. }), "{e}");
        assert!(e.to_string().contains("no COMMIT"));

        let e = err(":A - [0:0]\n");
        assert!(matches!(e, DumpError::ExpectedTable { line: 1, index: 1, .. }), "{e}");

        let e = err("*nat\nCOMMIT\n-A A -j ACCEPT\n");
        assert!(matches!(e, DumpError::ExpectedTable { line: 3, index: 2, .. }), "{e}");

        // Chain declarations after the first rule are not accepted.
        let e = err("*nat\n:A - [0:0]\n-A A -j ACCEPT\n:B - [0:0]\nCOMMIT\n");
        assert!(matches!(e, DumpError::Unparseable { line: 4, .. }), "{e}");

        let e = err("*nat\n:A - [0:0]\n-A A\nCOMMIT\n");
        assert!(matches!(e, DumpError::Unparseable { line: 3, .. }), "{e}");

        let e = err("*nat\n:A - [0:0]\n-I A -j ACCEPT\nCOMMIT\n");
        assert!(matches!(e, DumpError::Unparseable { line: 3, .. }), "{e}");

        let e = err("*\nCOMMIT\n");
        assert!(matches!(e, DumpError::EmptyTableName { line: 1, .. }), "{e}");

        let e = err("*nat\n: - [0:0]\nCOMMIT\n");
        assert!(matches!(e, DumpError::EmptyChainName { line: 2, .. }), "{e}");

        assert!(matches!(Dump::parse_bytes(b"*nat\n\xff\n"), Err(DumpError::NotUtf8 { offset: 5 })));
    }

    #[test]
    fn chains_are_per_table() {
        let e = err("*filter\n:KUBE-A - [0:0]\nCOMMIT\n*nat\n:KUBE-B - [0:0]\n-A KUBE-A -j ACCEPT\nCOMMIT\n");
        assert!(matches!(&e, DumpError::UndeclaredChain { line: 6, table, .. } if table == "nat"), "{e}");
    }

    #[test]
    fn large_dump_round_trips() {
        let services = 2000;
        let mut text = String::from("*nat\n:KUBE-SERVICES - [0:0]\n");
        for i in 0..services {
            text.push_str(&format!(":KUBE-SVC-{i:016} - [0:0]\n"));
        }
        for i in (0..services).rev() {
            text.push_str(&format!(
                "-A KUBE-SERVICES -m comment --comment \"ns/svc{i:05}:p cluster IP\" -j KUBE-SVC-{i:016}\n"
            ));
            text.push_str(&format!(
                "-A KUBE-SVC-{i:016} -m comment --comment ns/svc{i:05}:p -j DNAT --to-destination 10.0.0.1:80\n"
            ));
        }
        text.push_str("COMMIT\n");
        let dump = Dump::parse(&text).unwrap();
        assert_eq!(dump.tables[0].chains.len(), services + 1);
        // Printing groups rules by chain; the model survives the round trip.
        assert!(Dump::parse(&dump.to_string()).unwrap() == dump);
        let canonical = dump.canonical_string();
        let services_rules = &Dump::parse(&canonical).unwrap().tables[0].chains[0].rules;
        assert!(services_rules[0].contains("svc00000"));
        assert!(services_rules[services - 1].contains(&format!("svc{:05}", services - 1)));
    }

    #[test]
    fn rule_parser_errors() {
        let e = err("*nat\n:A - [0:0]\n-A A -j\nCOMMIT\n");
        assert!(
            matches!(&e, DumpError::BadRule { line: 3, reason, .. } if reason.contains("requires an argument")),
            "{e}"
        );

        let e = err("*nat\n:A - [0:0]\n-A A ! -j ACCEPT\nCOMMIT\n");
        assert!(matches!(&e, DumpError::BadRule { reason, .. } if reason.contains("cannot negate")), "{e}");

        // Negatable parameters and flags are fine; unknown parameters are skipped.
        Dump::parse(
            "*nat\n:A - [0:0]\n-A A ! -s 10.0.0.0/8 -m recent ! --rcheck --whatever x -j MASQUERADE --random-fully\nCOMMIT\n",
        )
        .unwrap();
    }

    #[test]
    fn rule_comment_extraction() {
        assert_eq!(rule_comment("X", "-m comment --comment \"a b\" -j Y").as_deref(), Some("a b"));
        assert_eq!(rule_comment("X", "-m comment --comment a/b:c -j Y").as_deref(), Some("a/b:c"));
        assert_eq!(rule_comment("X", "-j Y"), None);
        // The value of a known parameter is never mistaken for a parameter.
        assert_eq!(rule_comment("X", "--name --comment -j Y"), None);
        // Last one wins, as in upstream's reflection-based parser.
        assert_eq!(rule_comment("X", "--comment a --comment b").as_deref(), Some("b"));
    }

    #[test]
    fn whitespace_and_blank_lines_are_tolerated() {
        let dump = Dump::parse("\n\n  *nat  \n\t:A - [0:0]\n\n# c\n  -A A -j ACCEPT  \n COMMIT\n\n").unwrap();
        assert_eq!(dump.to_string(), "*nat\n:A - [0:0]\n-A A -j ACCEPT\nCOMMIT\n");
    }

    /// A comparison-inconsistent ordering: rules without comments are "equal" to everything.
    #[test]
    fn comment_less_rules_follow_go_stable_sort() {
        // Hand-traced with Go's insertion sort (fewer than 20 elements): c, (none), b, a
        // -> i=1: none<c? false. i=2: b<none? false. i=3: a<b? yes swap -> c,none,a,b;
        //    a<none? false. Result: c, none, a, b.
        let input = dedent(
            r#"
            *nat
            :KUBE-NODEPORTS - [0:0]
            -A KUBE-NODEPORTS -m comment --comment c/c -j KUBE-SVC-C
            -A KUBE-NODEPORTS -j KUBE-SVC-NONE
            -A KUBE-NODEPORTS -m comment --comment b/b -j KUBE-SVC-B
            -A KUBE-NODEPORTS -m comment --comment a/a -j KUBE-SVC-A
            COMMIT
            "#,
        );
        let mut dump = Dump::parse(&input).unwrap();
        dump.sort_canonical();
        let targets: Vec<&str> =
            dump.chain("nat", "KUBE-NODEPORTS").unwrap().rules.iter().filter_map(|r| r.rsplit(' ').next()).collect();
        assert_eq!(targets, vec!["KUBE-SVC-C", "KUBE-SVC-NONE", "KUBE-SVC-A", "KUBE-SVC-B"]);
    }

    /// For a proper strict weak order Go's algorithm is just a stable sort; check it against
    /// the standard library on many pseudo-random inputs of every size class (the merge
    /// phase only starts above 20 elements).
    #[test]
    fn go_stable_sort_is_a_stable_sort() {
        let mut seed: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for len in [0usize, 1, 2, 3, 19, 20, 21, 39, 40, 41, 60, 99, 257, 1000] {
            for keys in [1u64, 3, 10, 1000] {
                let items: Vec<(u64, usize)> = (0..len).map(|i| (next() % keys, i)).collect();
                let mut ours = items.clone();
                go_stable_sort(&mut ours, &|a: &(u64, usize), b: &(u64, usize)| a.0 < b.0);
                let mut std_sorted = items.clone();
                std_sorted.sort_by_key(|x| x.0);
                assert_eq!(ours, std_sorted, "len {len} keys {keys}");
            }
        }
    }
}
