//! Follows one packet (the first of a new connection) through loaded rules as the kernel does:
//!
//! * source local (one of the node's addresses, or loopback): locally generated, so nat
//!   `OUTPUT`, filter `OUTPUT`, nat `POSTROUTING`;
//! * otherwise it arrives: nat `PREROUTING`, then filter `INPUT` when the (possibly rewritten)
//!   destination is local, else filter `FORWARD` and nat `POSTROUTING`.
//!
//! Every matching rule's target is followed (jumps, gotos, returns, marks); a `statistic`
//! rule splits the packet into a taken and a not-taken branch weighted by its probability, so
//! every destination comes out with its probability. A `recent --rcheck` rule (session
//! affinity) does not match a first packet; it is recorded as an affinity branch. The packet
//! mark and the conntrack states a first packet has (`NEW`, plus `DNAT`/`SNAT` once
//! translated) are modelled; interface matches need the interface given. A rule the tracer
//! cannot evaluate stops the trace with an error naming it.

use std::net::{IpAddr, SocketAddr};

use super::report::{Destination, Step, Trace, Verdict};
use super::rule::{Match, Proto, Rule, Target};
use super::ruleset::{LoadedRule, RuleSet};

/// Deeper than any sane rule set nests; stops jump loops.
const MAX_DEPTH: usize = 64;

/// The packet to trace.
#[derive(Debug, Clone)]
pub struct Packet {
    pub src: IpAddr,
    pub dst: IpAddr,
    pub dport: u16,
    pub proto: Proto,
    /// The interface it arrives on, for `-i` matches (arriving packets only).
    pub in_interface: Option<String>,
    /// The interface it leaves by, for `-o` matches.
    pub out_interface: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TraceError {
    #[error("{}: cannot evaluate {rule:?}: {reason}", where_(*line))]
    Unsupported { line: Option<usize>, rule: String, reason: String },
    #[error("{}: {rule:?} jumps to chain {chain} which table {table} does not have", where_(*line))]
    MissingChain { line: Option<usize>, rule: String, table: String, chain: String },
    #[error("jumps nest deeper than {MAX_DEPTH} chains (a loop?) at table {table} chain {chain}")]
    TooDeep { table: String, chain: String },
    #[error("source {src} and destination {dst} are not of the same IP family")]
    MixedFamilies { src: IpAddr, dst: IpAddr },
}

fn where_(line: Option<usize>) -> String {
    line.map_or_else(|| "assumed jump rule".to_string(), |l| format!("line {l}"))
}

/// The packet's state along one branch.
#[derive(Debug, Clone)]
struct State {
    dst: IpAddr,
    dport: u16,
    mark: u32,
    dnat: bool,
    snat: bool,
    weight: f64,
}

/// How a chain traversal ended for one branch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Exit {
    /// Fell off the end or hit `RETURN`.
    Return,
    Accept,
    Drop,
    Reject,
    /// `DNAT`, `MASQUERADE` or `SNAT`: the nat table is done with the packet.
    Nat,
}

enum Eval {
    No,
    /// All matches hold; the probability the `statistic` matches give it.
    Yes(f64),
    /// Matches only for a client with a `recent` entry.
    Affinity,
}

struct Tracer<'a> {
    rules: &'a RuleSet<'a>,
    pkt: &'a Packet,
    local: &'a [IpAddr],
    locally_generated: bool,
    path: Vec<Step>,
}

/// Traces `pkt`; `local_addresses` are the node's own (for `addrtype LOCAL`; loopback always is).
pub fn trace(rules: &RuleSet<'_>, pkt: &Packet, local_addresses: &[IpAddr]) -> Result<Trace, TraceError> {
    if pkt.src.is_ipv4() != pkt.dst.is_ipv4() {
        return Err(TraceError::MixedFamilies { src: pkt.src, dst: pkt.dst });
    }
    let mut t = Tracer { rules, pkt, local: local_addresses, locally_generated: false, path: Vec::new() };
    t.locally_generated = t.is_local(pkt.src);
    let start = State { dst: pkt.dst, dport: pkt.dport, mark: 0, dnat: false, snat: false, weight: 1.0 };

    // (state, verdict, masquerade) per finished branch.
    let mut finished: Vec<(State, Verdict, bool)> = Vec::new();
    let first_nat = if t.locally_generated { "OUTPUT" } else { "PREROUTING" };
    let translated = t.run_builtin("nat", first_nat, start)?;
    // Past the nat table every branch walks the same filter and POSTROUTING rules: the path
    // lists each of those once, with the branches' probabilities summed.
    let merge_from = t.path.len();
    for (st, exit) in translated {
        match exit {
            Exit::Drop => finished.push((st, Verdict::Drop, false)),
            Exit::Reject => finished.push((st, Verdict::Reject, false)),
            Exit::Return | Exit::Accept | Exit::Nat => {
                let delivered_locally = !t.locally_generated && t.is_local(st.dst);
                let filter = if t.locally_generated {
                    "OUTPUT"
                } else if delivered_locally {
                    "INPUT"
                } else {
                    "FORWARD"
                };
                for (st, exit) in t.run_builtin("filter", filter, st)? {
                    match exit {
                        Exit::Drop => finished.push((st, Verdict::Drop, false)),
                        Exit::Reject => finished.push((st, Verdict::Reject, false)),
                        _ if delivered_locally => {
                            let v = passed(&st);
                            finished.push((st, v, false));
                        }
                        _ => {
                            for (st, exit) in t.run_builtin("nat", "POSTROUTING", st)? {
                                match exit {
                                    Exit::Drop => finished.push((st, Verdict::Drop, false)),
                                    Exit::Reject => finished.push((st, Verdict::Reject, false)),
                                    Exit::Nat => {
                                        let v = passed(&st);
                                        finished.push((st, v, true));
                                    }
                                    Exit::Return | Exit::Accept => {
                                        let v = passed(&st);
                                        finished.push((st, v, false));
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    let mut path = t.path;
    merge_steps(&mut path, merge_from);
    Ok(summarise(finished, path))
}

/// Folds repeated steps from `from` on into their first occurrence, summing probabilities.
fn merge_steps(path: &mut Vec<Step>, from: usize) {
    let tail = path.split_off(from.min(path.len()));
    let mut merged: Vec<Step> = Vec::new();
    for step in tail {
        let same = |m: &&mut Step| {
            m.table == step.table
                && m.chain == step.chain
                && m.line == step.line
                && m.rule == step.rule
                && m.depth == step.depth
                && m.affinity == step.affinity
        };
        match merged.iter_mut().find(|m| same(m)) {
            Some(m) => m.probability = round(m.probability + step.probability),
            None => merged.push(step),
        }
    }
    path.extend(merged);
}

fn passed(st: &State) -> Verdict {
    if st.dnat { Verdict::Dnat } else { Verdict::Accept }
}

/// Probabilities are products of the rules' 10-digit decimals: round off float noise.
fn round(p: f64) -> f64 {
    (p * 1e9).round() / 1e9
}

fn summarise(finished: Vec<(State, Verdict, bool)>, path: Vec<Step>) -> Trace {
    let mut destinations: Vec<Destination> = Vec::new();
    let mut weights = [(Verdict::Accept, 0.0), (Verdict::Reject, 0.0), (Verdict::Drop, 0.0)];
    let mut any_dnat = false;
    for (st, verdict, masquerade) in &finished {
        match verdict {
            Verdict::Dnat | Verdict::Accept => {
                any_dnat |= *verdict == Verdict::Dnat;
                weights[0].1 += st.weight;
                let address = SocketAddr::new(st.dst, st.dport).to_string();
                match destinations.iter_mut().find(|d| d.address == address && d.masquerade == *masquerade) {
                    Some(d) => d.probability += st.weight,
                    None => destinations.push(Destination { address, probability: st.weight, masquerade: *masquerade }),
                }
            }
            Verdict::Reject => weights[1].1 += st.weight,
            Verdict::Drop => weights[2].1 += st.weight,
        }
    }
    for d in &mut destinations {
        d.probability = round(d.probability);
    }
    destinations.sort_by(|a, b| a.address.cmp(&b.address).then(a.masquerade.cmp(&b.masquerade)));
    let verdict = if any_dnat {
        Verdict::Dnat
    } else {
        // Kube-proxy's rules never mix outcomes for one flow; if some other rule set does,
        // report the most likely (ties: ACCEPT, REJECT, DROP).
        let mut best = weights[0];
        for w in &weights[1..] {
            if w.1 > best.1 {
                best = *w;
            }
        }
        best.0
    };
    Trace { verdict, destinations, path }
}

impl Tracer<'_> {
    fn is_local(&self, ip: IpAddr) -> bool {
        ip.is_loopback() || self.local.contains(&ip)
    }

    /// Runs a built-in chain: a branch that falls off its end gets the chain's policy.
    fn run_builtin(&mut self, table: &str, chain: &str, st: State) -> Result<Vec<(State, Exit)>, TraceError> {
        let Some(c) = self.rules.chain(table, chain) else {
            return Ok(vec![(st, Exit::Return)]);
        };
        let drop_policy = c.policy.as_deref() == Some("DROP");
        let mut out = self.run_chain(table, chain, st, 0, 0)?;
        for (st, exit) in &mut out {
            if *exit == Exit::Return && drop_policy {
                *exit = Exit::Drop;
                self.path.push(Step {
                    table: table.to_string(),
                    chain: chain.to_string(),
                    line: None,
                    rule: format!(":{chain} DROP (policy)"),
                    target: "DROP".into(),
                    probability: round(st.weight),
                    depth: 0,
                    affinity: false,
                });
            }
        }
        Ok(out)
    }

    /// Records that `r` (rule `rule` of `table`/`chain`) matched for a branch of `weight`.
    fn step(&mut self, at: (&str, &str, usize), r: &LoadedRule<'_>, rule: &Rule, weight: f64, affinity: bool) {
        let (table, chain, depth) = at;
        self.path.push(Step {
            table: table.to_string(),
            chain: chain.to_string(),
            line: r.line,
            rule: r.text().to_string(),
            target: rule.target.name(),
            probability: round(weight),
            depth,
            affinity,
        });
    }

    /// Runs `chain` from rule `start` for one branch; returns how each resulting branch ended.
    fn run_chain(
        &mut self,
        table: &str,
        chain: &str,
        mut st: State,
        start: usize,
        depth: usize,
    ) -> Result<Vec<(State, Exit)>, TraceError> {
        if depth > MAX_DEPTH {
            return Err(TraceError::TooDeep { table: table.into(), chain: chain.into() });
        }
        let rules = self.rules;
        let Some(c) = rules.chain(table, chain) else {
            return Ok(vec![(st, Exit::Return)]);
        };
        let mut out = Vec::new();
        let mut i = start;
        while i < c.rules.len() {
            let r = &c.rules[i];
            i += 1;
            let rule = r.rule().map_err(|reason| TraceError::Unsupported {
                line: r.line,
                rule: r.text().to_string(),
                reason: reason.to_string(),
            })?;
            let p = match self.eval(rule, &st).map_err(|reason| TraceError::Unsupported {
                line: r.line,
                rule: r.text().to_string(),
                reason,
            })? {
                Eval::No => continue,
                Eval::Affinity => {
                    self.step((table, chain, depth), r, rule, st.weight, true);
                    continue;
                }
                Eval::Yes(p) => p,
            };
            if p <= 0.0 {
                continue;
            }
            let mut taken = st.clone();
            taken.weight *= p;
            st.weight *= 1.0 - p;
            let rest = (p < 1.0).then_some(st.clone());
            self.step((table, chain, depth), r, rule, taken.weight, false);

            // Branches that carry on in this chain after the target.
            let mut continuing: Vec<State> = Vec::new();
            match &rule.target {
                Target::None | Target::Log => continuing.push(taken),
                Target::Mark { value, mask } => {
                    taken.mark = (taken.mark & !mask) ^ value;
                    continuing.push(taken);
                }
                Target::Accept => out.push((taken, Exit::Accept)),
                Target::Drop => out.push((taken, Exit::Drop)),
                Target::Reject => out.push((taken, Exit::Reject)),
                Target::Return => out.push((taken, Exit::Return)),
                Target::Masquerade | Target::Snat => {
                    taken.snat = true;
                    out.push((taken, Exit::Nat));
                }
                Target::Dnat { addr, port } => {
                    taken.dst = *addr;
                    taken.dport = port.unwrap_or(taken.dport);
                    taken.dnat = true;
                    out.push((taken, Exit::Nat));
                }
                Target::Jump(target) | Target::Goto(target) => {
                    if rules.chain(table, target).is_none() {
                        return Err(TraceError::MissingChain {
                            line: r.line,
                            rule: r.text().to_string(),
                            table: table.into(),
                            chain: target.clone(),
                        });
                    }
                    let goto = matches!(rule.target, Target::Goto(_));
                    for (s, exit) in self.run_chain(table, target, taken, 0, depth + 1)? {
                        if exit == Exit::Return && !goto {
                            continuing.push(s);
                        } else {
                            out.push((s, exit));
                        }
                    }
                }
            }
            if let Some(rest) = rest {
                continuing.push(rest);
            }
            // Carry on with the last branch here; any others get their own traversal.
            let Some(last) = continuing.pop() else {
                return Ok(out);
            };
            for s in continuing {
                out.extend(self.run_chain(table, chain, s, i, depth)?);
            }
            st = last;
        }
        out.push((st, Exit::Return));
        Ok(out)
    }

    fn eval(&self, rule: &Rule, st: &State) -> Result<Eval, String> {
        let pkt = self.pkt;
        let mut probability = 1.0;
        let mut affinity = false;
        for m in &rule.matches {
            let ok = match m {
                Match::Source { neg, net } => net.contains(&pkt.src) != *neg,
                Match::Destination { neg, net } => net.contains(&st.dst) != *neg,
                Match::Protocol { neg, proto } => proto.0.is_none_or(|p| p == pkt.proto) != *neg,
                Match::DestPort { neg, ranges } => {
                    ranges.iter().any(|(lo, hi)| (*lo..=*hi).contains(&st.dport)) != *neg
                }
                Match::SourcePort => return Err("the rule matches a source port, which a trace does not have".into()),
                Match::InInterface { neg, name } => {
                    let actual = if self.locally_generated {
                        None
                    } else {
                        Some(pkt.in_interface.as_deref().ok_or(
                            "the rule matches the input interface (-i): give the packet's with --in-interface",
                        )?)
                    };
                    actual.is_some_and(|a| iface_matches(name, a)) != *neg
                }
                Match::OutInterface { neg, name } => {
                    let actual = pkt
                        .out_interface
                        .as_deref()
                        .ok_or("the rule matches the output interface (-o): give the packet's with --out-interface")?;
                    iface_matches(name, actual) != *neg
                }
                Match::SrcTypeLocal { neg } => self.is_local(pkt.src) != *neg,
                Match::DstTypeLocal { neg } => self.is_local(st.dst) != *neg,
                Match::Mark { neg, value, mask } => ((st.mark & mask) == *value) != *neg,
                Match::CtState { neg, states } => {
                    let has = states.iter().any(|s| match s.as_str() {
                        "NEW" => true,
                        "DNAT" => st.dnat,
                        "SNAT" => st.snat,
                        _ => false,
                    });
                    has != *neg
                }
                Match::Probability(p) => {
                    probability *= p;
                    true
                }
                // No entry for a first packet: `! --rcheck` matches, `--rcheck` is a branch.
                Match::RecentSet { .. } | Match::Nfacct { .. } => true,
                Match::RecentCheck { neg, .. } => {
                    affinity |= !*neg;
                    true
                }
            };
            if !ok {
                return Ok(Eval::No);
            }
        }
        Ok(if affinity { Eval::Affinity } else { Eval::Yes(probability) })
    }
}

/// iptables interface names: a trailing `+` matches any name with that prefix.
fn iface_matches(pattern: &str, actual: &str) -> bool {
    match pattern.strip_suffix('+') {
        Some(prefix) => actual.starts_with(prefix),
        None => pattern == actual,
    }
}
