//! Rules as the kernel would hold them after loading a text: `iptables-save` output, or
//! `iptables-restore` input applied in order (several syncs of `render --then` included:
//! a chain declaration flushes the chain, `-X` deletes it, as `iptables-restore --noflush`).
//!
//! Loading checks every rule, so a malformed line anywhere fails the load naming its line,
//! but keeps only the rule's text, borrowed from the loaded text: the parsed [`Rule`] is made
//! when someone first asks for it ([`LoadedRule::rule`]). A 10k-Service dump has 443k rules
//! and a trace reaches a few thousand; parsing and keeping all of them made loading take 2 s
//! and 238 MB (docs/performance.md, issue 12). Rules the tracer does not model are reported
//! only if a packet reaches them (see [`super::rule`]).

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::OnceLock;

use super::rule::{Rule, RuleError, parse_rule};
use crate::proxier::JUMP_CHAINS;

/// Why a rules text did not load. Always names the 1-based line.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("line {line}: {reason}: {text}")]
pub struct LoadError {
    pub line: usize,
    pub text: String,
    pub reason: String,
}

/// One rule of a chain, text borrowed from the loaded text (`'t`).
#[derive(Debug, Clone)]
pub struct LoadedRule<'t> {
    /// 1-based line in the loaded text; `None` for an assumed jump rule.
    pub line: Option<usize>,
    /// The full `-A CHAIN ...` rule (an `-I` line is rewritten so).
    text: Cow<'t, str>,
    /// Where the words after `-A CHAIN` start in `text`.
    body_at: usize,
    /// The parse, made on first use; boxed so that an unparsed rule costs one word.
    parsed: OnceLock<Box<Result<Rule, String>>>,
}

impl<'t> LoadedRule<'t> {
    fn new(line: Option<usize>, text: Cow<'t, str>, body_at: usize) -> Self {
        LoadedRule { line, text, body_at, parsed: OnceLock::new() }
    }

    /// The full `-A CHAIN ...` rule as written.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// The words after `-A CHAIN`.
    pub fn body(&self) -> &str {
        &self.text[self.body_at..]
    }

    /// The parsed rule, or why the tracer cannot evaluate it. Parsed on the first call.
    pub fn rule(&self) -> Result<&Rule, &str> {
        match &**self.parsed.get_or_init(|| Box::new(parse_rule(self.body()).map_err(|e| e.to_string()))) {
            Ok(rule) => Ok(rule),
            Err(reason) => Err(reason),
        }
    }

    /// Whether [`LoadedRule::rule`] has been called.
    #[cfg(test)]
    pub(crate) fn is_parsed(&self) -> bool {
        self.parsed.get().is_some()
    }
}

#[derive(Debug, Clone, Default)]
pub struct Chain<'t> {
    /// `ACCEPT`/`DROP` for built-in chains, `None` for user chains.
    pub policy: Option<String>,
    pub rules: Vec<LoadedRule<'t>>,
}

/// The built-in chains of a table (they exist without being declared).
pub(crate) fn builtin_chains(table: &str) -> &'static [&'static str] {
    match table {
        "nat" => &["PREROUTING", "INPUT", "OUTPUT", "POSTROUTING"],
        "filter" => &["INPUT", "FORWARD", "OUTPUT"],
        "mangle" => &["PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING"],
        "raw" => &["PREROUTING", "OUTPUT"],
        _ => &[],
    }
}

/// The chains of one table, kept in an arena so that a rule can name its chain by index.
#[derive(Debug, Clone, Default)]
struct Table<'t> {
    ids: HashMap<&'t str, usize>,
    chains: Vec<Chain<'t>>,
}

impl<'t> Table<'t> {
    fn id(&self, name: &str) -> Option<usize> {
        self.ids.get(name).copied()
    }

    fn get(&self, name: &str) -> Option<&Chain<'t>> {
        self.chains.get(self.id(name)?)
    }

    /// Declares `name` as `chain`, replacing (flushing) the chain of that name if any.
    fn declare(&mut self, name: &'t str, chain: Chain<'t>) {
        match self.ids.get(name) {
            Some(&id) => self.chains[id] = chain,
            None => {
                self.ids.insert(name, self.chains.len());
                self.chains.push(chain);
            }
        }
    }

    fn get_or_create(&mut self, name: &'t str) -> &mut Chain<'t> {
        let next = self.chains.len();
        let id = *self.ids.entry(name).or_insert(next);
        if id == next {
            self.chains.push(Chain::default());
        }
        &mut self.chains[id]
    }

    fn remove(&mut self, name: &str) {
        if let Some(id) = self.ids.remove(name) {
            self.chains[id] = Chain::default();
        }
    }

    fn iter(&self) -> impl Iterator<Item = (&'t str, &Chain<'t>)> {
        self.ids.iter().map(|(name, &id)| (*name, &self.chains[id]))
    }
}

/// All tables of a loaded text; names and rules borrow from it (`'t`).
#[derive(Debug, Clone, Default)]
pub struct RuleSet<'t> {
    /// A text has a few tables: a list is faster than a map.
    tables: Vec<(&'t str, Table<'t>)>,
    /// Whether the jump rules from the built-in chains were assumed (see
    /// [`RuleSet::assume_jump_rules_if_missing`]).
    pub assumed_jumps: bool,
}

impl<'t> RuleSet<'t> {
    /// Loads `text` (see the module docs).
    pub fn parse(text: &'t str) -> Result<RuleSet<'t>, LoadError> {
        let mut set = RuleSet::default();
        // The open table (its index in `set.tables`) and the line that opened it.
        let mut current: Option<(usize, usize)> = None;
        // The chain the previous rule went to: save and render output list a chain's rules
        // together, so most rules need no name lookup (the lookups were a third of the load).
        let mut last_chain: Option<(&'t str, usize)> = None;
        for (index, raw) in text.split('\n').enumerate() {
            let line_no = index + 1;
            let mut line = raw.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let err = |reason: &str| LoadError { line: line_no, text: line.to_string(), reason: reason.to_string() };
            // `iptables-save -c` prefixes rules with their counters.
            if line.starts_with('[')
                && let Some((_, rest)) = line.split_once(']')
            {
                line = rest.trim_start();
            }
            if let Some(name) = line.strip_prefix('*') {
                if let Some((open, at)) = current {
                    let open = set.tables[open].0;
                    return Err(err(&format!("table {open} (line {at}) has no COMMIT before the next table")));
                }
                if name.is_empty() {
                    return Err(err("empty table name"));
                }
                let at = match set.tables.iter().position(|(n, _)| *n == name) {
                    Some(at) => at,
                    None => {
                        set.tables.push((name, Table::default()));
                        set.tables.len() - 1
                    }
                };
                let chains = &mut set.tables[at].1;
                for b in builtin_chains(name) {
                    if chains.id(b).is_none() {
                        chains.declare(b, Chain { policy: Some("ACCEPT".into()), rules: vec![] });
                    }
                }
                current = Some((at, line_no));
                last_chain = None;
                continue;
            }
            let Some((at, _)) = current else {
                return Err(err("expected a table (\"*nat\", \"*filter\") before this line"));
            };
            let (table, chains) = &mut set.tables[at];
            let table: &str = table;
            let is_builtin = |c: &str| builtin_chains(table).contains(&c);
            if let Some(rest) = line.strip_prefix("-A ").or_else(|| line.strip_prefix("-I ")) {
                let insert = line.starts_with("-I");
                let (chain, mut body) = rest.split_once(' ').unwrap_or((rest, ""));
                let mut position = None;
                if insert
                    && let Some((n, after)) = body.split_once(' ')
                    && let Ok(n) = n.parse::<usize>()
                {
                    position = Some(n.saturating_sub(1));
                    body = after;
                }
                let id = match last_chain {
                    Some((name, id)) if name == chain => id,
                    _ => match chains.id(chain) {
                        Some(id) => id,
                        None => return Err(err(&format!("chain {chain} is not declared in table {table}"))),
                    },
                };
                last_chain = Some((chain, id));
                // Checked now, parsed again when needed (module docs).
                if let Err(RuleError::Syntax(reason)) = parse_rule(body) {
                    return Err(err(&format!("bad rule: {reason}")));
                }
                let rules = &mut chains.chains[id].rules;
                if insert {
                    let text = format!("-A {chain} {body}");
                    let rule = LoadedRule::new(Some(line_no), Cow::Owned(text), "-A ".len() + chain.len() + 1);
                    let at = position.unwrap_or(0).min(rules.len());
                    rules.insert(at, rule);
                } else {
                    // `body` is a suffix of `line`.
                    let body_at = line.len() - body.len();
                    rules.push(LoadedRule::new(Some(line_no), Cow::Borrowed(line), body_at));
                }
                continue;
            }
            // Whatever else the line does, it may remove or add chains.
            last_chain = None;
            if line == "COMMIT" {
                current = None;
            } else if let Some(decl) = line.strip_prefix(':') {
                let mut parts = decl.split_whitespace();
                let (Some(name), Some(policy)) = (parts.next(), parts.next()) else {
                    return Err(err("bad chain declaration (expected \":NAME POLICY [packets:bytes]\")"));
                };
                let policy = match policy {
                    "-" if !is_builtin(name) => None,
                    "ACCEPT" | "DROP" if is_builtin(name) => Some(policy.to_string()),
                    _ => return Err(err(&format!("bad policy {policy:?} for chain {name}"))),
                };
                // Declaring a chain flushes it (restore input); in save output it is new.
                chains.declare(name, Chain { policy, rules: vec![] });
            } else if let Some(name) = line.strip_prefix("-X ") {
                let name = name.trim();
                if is_builtin(name) {
                    return Err(err("cannot delete a built-in chain"));
                }
                chains.remove(name);
            } else if let Some(name) = line.strip_prefix("-F ") {
                let name = name.trim();
                match chains.id(name) {
                    Some(id) => chains.chains[id].rules.clear(),
                    None => return Err(err(&format!("chain {name} is not declared in table {table}"))),
                }
            } else if let Some(name) = line.strip_prefix("-N ") {
                chains.get_or_create(name.trim());
            } else {
                return Err(err("not a table, chain declaration, rule or COMMIT"));
            }
        }
        if let Some((at, line)) = current {
            let table = set.tables[at].0;
            return Err(LoadError {
                line,
                text: format!("*{table}"),
                reason: format!("table {table} has no COMMIT line"),
            });
        }
        Ok(set)
    }

    fn table(&self, table: &str) -> Option<&Table<'t>> {
        self.tables.iter().find(|(name, _)| *name == table).map(|(_, t)| t)
    }

    pub fn chain(&self, table: &str, chain: &str) -> Option<&Chain<'t>> {
        self.table(table)?.get(chain)
    }

    /// The chains of `table` (none if the text has no such table), in no particular order.
    pub fn chains(&self, table: &str) -> impl Iterator<Item = (&'t str, &Chain<'t>)> {
        self.table(table).into_iter().flat_map(Table::iter)
    }

    #[cfg(test)]
    fn all_chains(&self) -> impl Iterator<Item = &Chain<'t>> {
        self.tables.iter().flat_map(|(_, t)| t.iter()).map(|(_, c)| c)
    }

    /// Number of rules in all tables.
    #[cfg(test)]
    pub(crate) fn rule_count(&self) -> usize {
        self.all_chains().map(|c| c.rules.len()).sum()
    }

    /// Parses every rule now rather than on first use (for comparing with lazy loading).
    #[cfg(test)]
    pub(crate) fn parse_every_rule(&self) {
        for rule in self.all_chains().flat_map(|c| &c.rules) {
            let _ = rule.rule();
        }
    }

    /// Whether any built-in chain of nat or filter has a rule.
    pub(crate) fn has_builtin_rules(&self) -> bool {
        ["nat", "filter"]
            .iter()
            .any(|t| builtin_chains(t).iter().any(|c| self.chain(t, c).is_some_and(|c| !c.rules.is_empty())))
    }

    /// A render or restore file holds only our chains: add the jump rules kube-proxy ensures
    /// in the built-in chains (upstream `iptablesJumpChains`, each inserted at the top, so
    /// the last of the list comes first), for the chains the text declares.
    pub(crate) fn assume_jump_rules_if_missing(&mut self) {
        if self.has_builtin_rules() {
            return;
        }
        for jump in JUMP_CHAINS.iter().rev() {
            let table = jump.table.as_str();
            let Some((_, chains)) = self.tables.iter_mut().find(|(name, _)| *name == table) else { continue };
            if chains.id(jump.dst).is_none() {
                continue;
            }
            let words: Vec<String> = jump.args().iter().map(|a| quote(a)).collect();
            let text = format!("-A {} {}", jump.src, words.join(" "));
            let body_at = "-A ".len() + jump.src.len() + 1;
            chains.get_or_create(jump.src).rules.push(LoadedRule::new(None, Cow::Owned(text), body_at));
            self.assumed_jumps = true;
        }
    }
}

fn quote(word: &str) -> String {
    if word.contains(' ') { format!("\"{word}\"") } else { word.to_string() }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loads_save_output_with_policies_and_counters() {
        let text = "# Generated by iptables-save\n*filter\n:INPUT ACCEPT [1:2]\n:FORWARD DROP [0:0]\n:OUTPUT ACCEPT [0:0]\n:KUBE-FORWARD - [0:0]\n[5:300] -A FORWARD -j KUBE-FORWARD\nCOMMIT\n";
        let set = RuleSet::parse(text).unwrap();
        assert_eq!(set.chain("filter", "FORWARD").unwrap().policy.as_deref(), Some("DROP"));
        let rules = &set.chain("filter", "FORWARD").unwrap().rules;
        assert_eq!(rules[0].text(), "-A FORWARD -j KUBE-FORWARD");
        assert_eq!(rules[0].body(), "-j KUBE-FORWARD");
        assert_eq!(rules[0].line, Some(7));
        assert!(set.has_builtin_rules());
    }

    #[test]
    fn restore_input_applies_in_order() {
        let text = "*nat\n:KUBE-A - [0:0]\n:KUBE-B - [0:0]\n-A KUBE-A -j KUBE-B\n-A KUBE-B -j RETURN\nCOMMIT\n\
                    *nat\n:KUBE-A - [0:0]\n-A KUBE-A -j RETURN\n-X KUBE-B\nCOMMIT\n";
        let set = RuleSet::parse(text).unwrap();
        assert_eq!(set.chain("nat", "KUBE-A").unwrap().rules.len(), 1);
        assert_eq!(set.chain("nat", "KUBE-A").unwrap().rules[0].line, Some(9));
        assert!(set.chain("nat", "KUBE-B").is_none());
    }

    #[test]
    fn rules_go_to_their_chain_however_the_lines_interleave() {
        let text = "*nat\n:A - [0:0]\n:B - [0:0]\n-A A -j RETURN\n-A B -j RETURN\n-A A -j ACCEPT\n-I A 1 -j DROP\n\
                    -A A -j MARK --or-mark 0x1\nCOMMIT\n*filter\n:A - [0:0]\n-A A -j DROP\nCOMMIT\n";
        let set = RuleSet::parse(text).unwrap();
        let rules = |table: &str, chain: &str| -> Vec<(Option<usize>, String)> {
            set.chain(table, chain).unwrap().rules.iter().map(|r| (r.line, r.text().to_string())).collect()
        };
        let at = |line: usize, text: &str| (Some(line), text.to_string());
        assert_eq!(
            rules("nat", "A"),
            vec![
                at(7, "-A A -j DROP"),
                at(4, "-A A -j RETURN"),
                at(6, "-A A -j ACCEPT"),
                at(8, "-A A -j MARK --or-mark 0x1")
            ]
        );
        assert_eq!(rules("nat", "B"), vec![at(5, "-A B -j RETURN")]);
        assert_eq!(rules("filter", "A"), vec![at(12, "-A A -j DROP")]);
        assert_eq!(set.rule_count(), 6);

        // Deleted between two of its rules: the second names a chain that is gone.
        let deleted = "*nat\n:A - [0:0]\n-A A -j RETURN\n-X A\n-A A -j RETURN\nCOMMIT\n";
        let e = RuleSet::parse(deleted).unwrap_err();
        assert_eq!((e.line, e.reason.as_str()), (5, "chain A is not declared in table nat"));
        // Declared again between two of its rules: flushed, the later rule kept.
        let redeclared = "*nat\n:A - [0:0]\n-A A -j RETURN\n:A - [0:0]\n-A A -j ACCEPT\nCOMMIT\n";
        let set = RuleSet::parse(redeclared).unwrap();
        let lines: Vec<_> = set.chain("nat", "A").unwrap().rules.iter().map(|r| r.line).collect();
        assert_eq!(lines, vec![Some(5)]);
        // Deleted and created again with -N: empty, then filled.
        let recreated = "*nat\n:A - [0:0]\n-A A -j RETURN\n-X A\n-N A\n-A A -j ACCEPT\nCOMMIT\n";
        let set = RuleSet::parse(recreated).unwrap();
        let lines: Vec<_> = set.chain("nat", "A").unwrap().rules.iter().map(|r| r.line).collect();
        assert_eq!(lines, vec![Some(6)]);
    }

    #[test]
    fn errors_name_the_line() {
        let cases = [
            ("*nat\n:KUBE-A - [0:0]\n-A KUBE-A -d 10.0.0.300 -j X\nCOMMIT\n", 3),
            ("*nat\n:KUBE-A - [0:0]\n-A KUBE-B -j X\nCOMMIT\n", 3),
            ("*nat\n:KUBE-A - [0:0]\nhello\nCOMMIT\n", 3),
            ("\n\n-A KUBE-A -j X\n", 3),
            ("*nat\n:KUBE-A - [0:0]\n", 1),
            ("*nat\n:KUBE-A - [0:0]\n-A KUBE-A -m comment --comment \"open -j X\nCOMMIT\n", 3),
        ];
        for (text, line) in cases {
            let e = RuleSet::parse(text).unwrap_err();
            assert_eq!(e.line, line, "{text:?}: {e}");
            assert!(e.to_string().starts_with(&format!("line {line}: ")), "{e}");
        }
    }

    #[test]
    fn unsupported_rules_load_and_carry_the_reason() {
        let text = "*filter\n:KUBE-A - [0:0]\n-A KUBE-A -m set --match-set x src -j DROP\nCOMMIT\n";
        let set = RuleSet::parse(text).unwrap();
        let rule = &set.chain("filter", "KUBE-A").unwrap().rules[0];
        assert!(rule.rule().unwrap_err().contains("-m set"));
    }

    #[test]
    fn jump_rules_are_assumed_only_without_builtin_rules() {
        let text = "*nat\n:KUBE-SERVICES - [0:0]\n:KUBE-POSTROUTING - [0:0]\nCOMMIT\n*filter\n:KUBE-SERVICES - [0:0]\n:KUBE-FORWARD - [0:0]\n:KUBE-PROXY-FIREWALL - [0:0]\nCOMMIT\n";
        let mut set = RuleSet::parse(text).unwrap();
        set.assume_jump_rules_if_missing();
        assert!(set.assumed_jumps);
        let pre: Vec<&str> = set.chain("nat", "PREROUTING").unwrap().rules.iter().map(|r| r.text()).collect();
        assert_eq!(pre, vec![r#"-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES"#]);
        // Inserted at the top one by one: the firewall jump ends up first in FORWARD.
        let fwd: Vec<String> = set
            .chain("filter", "FORWARD")
            .unwrap()
            .rules
            .iter()
            .map(|r| r.text().rsplit(' ').next().unwrap().to_string())
            .collect();
        assert_eq!(fwd, vec!["KUBE-PROXY-FIREWALL", "KUBE-FORWARD", "KUBE-SERVICES"]);
        assert!(set.chain("filter", "FORWARD").unwrap().rules.iter().all(|r| r.rule().is_ok()));

        let mut live = RuleSet::parse(
            "*nat\n:PREROUTING ACCEPT [0:0]\n:KUBE-SERVICES - [0:0]\n-A PREROUTING -j KUBE-SERVICES\nCOMMIT\n",
        )
        .unwrap();
        live.assume_jump_rules_if_missing();
        assert!(!live.assumed_jumps);
    }
}
