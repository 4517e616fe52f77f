//! What a trace found, and its two renderings: the `--json` object (a contract: field names,
//! verdict names and number types are relied on) and a short human-readable path.

use std::fmt::Write as _;

use serde::Serialize;

/// The packet's fate: `DNAT` when its destination was rewritten, else `ACCEPT`, `DROP` or
/// `REJECT`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum Verdict {
    Dnat,
    Accept,
    Drop,
    Reject,
}

impl Verdict {
    pub fn as_str(self) -> &'static str {
        match self {
            Verdict::Dnat => "DNAT",
            Verdict::Accept => "ACCEPT",
            Verdict::Drop => "DROP",
            Verdict::Reject => "REJECT",
        }
    }
}

/// Where the packet may end up (`ip:port`, IPv6 in brackets), how likely, and whether its
/// source is masqueraded on the way.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Destination {
    pub address: String,
    pub probability: f64,
    pub masquerade: bool,
}

/// One rule that matched, in traversal order (depth first).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Step {
    pub table: String,
    pub chain: String,
    /// Line in the rules text; `null` for an assumed jump rule or a chain policy.
    pub line: Option<usize>,
    /// The full `-A CHAIN ...` rule.
    pub rule: String,
    /// What the rule jumps to (a chain, `DNAT`, `MARK`...), empty for none.
    pub target: String,
    /// Probability that a new connection takes this rule.
    pub probability: f64,
    /// Jump depth below the built-in chain (0).
    pub depth: usize,
    /// A `recent --rcheck` (session affinity) rule: taken only by a client seen recently,
    /// never by a first connection, so it adds nothing to the probabilities.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub affinity: bool,
}

/// The result of tracing one packet.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Trace {
    pub verdict: Verdict,
    /// Sorted by address text; empty when the packet is dropped or rejected.
    pub destinations: Vec<Destination>,
    pub path: Vec<Step>,
}

impl Trace {
    pub(crate) fn to_json(&self) -> String {
        serde_json::to_string(self).expect("a trace always serialises")
    }

    /// The short human-readable form.
    pub fn to_human(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "verdict: {}", self.verdict.as_str());
        for d in &self.destinations {
            let _ = writeln!(
                s,
                "  -> {:<24} {:>7.3}%{}",
                d.address,
                d.probability * 100.0,
                if d.masquerade { "  masquerade" } else { "" }
            );
        }
        let _ = writeln!(s, "path:");
        for step in &self.path {
            let indent = "  ".repeat(step.depth + 1);
            let origin = match step.line {
                Some(l) => format!("line {l}"),
                None if step.rule.ends_with("(policy)") => "policy".to_string(),
                None => "assumed".to_string(),
            };
            let branch = if step.affinity {
                " [affinity: only a client seen recently]".to_string()
            } else if step.probability < 1.0 {
                format!(" [p={}]", step.probability)
            } else {
                String::new()
            };
            let _ = writeln!(s, "{indent}{} {} ({origin}){branch}: {}", step.table, step.chain, step.rule);
        }
        s
    }
}
