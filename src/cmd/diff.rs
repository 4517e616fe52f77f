//! The `diff` command: the node's live rules (our chains and the jump rules into them) against
//! what the cluster state renders to, differing rules grouped by service.
//!
//! The cluster state comes from manifests, or, without any, from the API server as the daemon
//! reads it (`--kubeconfig`, the config file's `clientConnection.kubeconfig`, `--master`, else
//! in-cluster): one list of Services and EndpointSlices with the watches' selector and
//! decoding, and this node's Node.
//!
//! Rules are compared by meaning, not spelling ([`crate::trace::rule::Rule::key`]): what
//! `iptables-save` prints for a rule we wrote (`/32` masks, `-p` before `-m`, `--set-xmark`,
//! 11-digit probabilities) equals our restore text. Compared: every chain the rendering has
//! in nat and filter, every service chain (`KUBE-SVC-`, `KUBE-SVL-`, `KUBE-EXT-`, `KUBE-FW-`,
//! `KUBE-SEP-`) the node has (stale ones show as extra), and the jump rules from the built-in
//! chains. Rule order within a chain matters (it decides probabilities and precedence).
//!
//! It reads iptables rules only, for now: asked about nftables mode (`--proxy-mode nftables`,
//! or a config with `mode: nftables`) it says so and points at `render --proxy-mode nftables`.

use std::collections::{BTreeMap, HashMap};
use std::io::Write;

use super::render::{self, RenderCmdError};
use super::trace::LiveNode;
use crate::cmd::cli::{DiffArgs, RenderArgs};
use crate::config::Settings;
use crate::manifest::Snapshot;
use crate::model::IpFamily;
use crate::trace::ruleset::{Chain, LoadedRule, builtin_chains};
use crate::trace::{LoadError, RuleSet};

#[derive(Debug, thiserror::Error)]
pub enum DiffCmdError {
    #[error(transparent)]
    Render(#[from] RenderCmdError),
    #[error("{path}: {source}")]
    ReadRules { path: String, source: std::io::Error },
    #[error("{what}: {source}")]
    Rules { what: String, source: LoadError },
    #[error("failed to read the node's rules: {0}")]
    Live(String),
    #[error(transparent)]
    Client(#[from] crate::k8s::client::ClientError),
    #[error(transparent)]
    List(#[from] crate::k8s::list::ListError),
    #[error("failed to start the async runtime: {0}")]
    Runtime(#[source] std::io::Error),
    #[error("failed to write output: {0}")]
    Output(#[from] std::io::Error),
}

impl DiffCmdError {
    /// 2 for bad input; 3 when the node's rules or the cluster state cannot be read (1 means
    /// "they differ").
    pub fn exit_code(&self) -> u8 {
        match self {
            DiffCmdError::Render(e) => u8::try_from(e.exit_code()).unwrap_or(2),
            DiffCmdError::ReadRules { .. } | DiffCmdError::Rules { .. } | DiffCmdError::Client(_) => 2,
            DiffCmdError::Live(_) | DiffCmdError::Output(_) | DiffCmdError::List(_) | DiffCmdError::Runtime(_) => 3,
        }
    }
}

/// One differing rule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuleDiff {
    pub table: String,
    pub chain: String,
    pub kind: DiffKind,
    /// The rule as rendered (missing) or as on the node (extra, order).
    pub rule: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum DiffKind {
    /// Rendered, not on the node.
    Missing,
    /// On the node, not rendered.
    Extra,
    /// Same rules, different order: the chain as on the node.
    Order,
}

/// Differences grouped by service (`ns/name:port`), or [`NODE_WIDE`] for rules of no service.
pub type Report = BTreeMap<String, Vec<RuleDiff>>;

pub(crate) const NODE_WIDE: &str = "(node-wide rules)";

const SERVICE_CHAIN_PREFIXES: &[&str] = &["KUBE-SVC-", "KUBE-SVL-", "KUBE-EXT-", "KUBE-FW-", "KUBE-SEP-"];

fn key(r: &LoadedRule<'_>) -> String {
    match r.rule() {
        Ok(rule) => rule.key(),
        // Not modelled: compare the words after `-A CHAIN`.
        Err(_) => r.text().split_whitespace().skip(2).collect::<Vec<_>>().join(" "),
    }
}

/// The service a comment names: its first word containing `/` (`ns/name:port`).
fn comment_service(r: &LoadedRule<'_>) -> Option<String> {
    let comment = r.rule().ok()?.comment.as_deref()?;
    comment.split_whitespace().find(|w| w.contains('/')).map(|w| w.trim_end_matches([',', ';', '.']).to_string())
}

/// Compares `expected` (rendered, jump rules assumed) with `live` (the node's).
pub fn compare(expected: &RuleSet<'_>, live: &RuleSet<'_>) -> Report {
    let mut diffs: Vec<RuleDiff> = Vec::new();
    let mut chain_service: HashMap<(String, String), String> = HashMap::new();
    let empty = Chain::default();
    for table in ["nat", "filter"] {
        let mut names: Vec<&str> = expected.chains(table).map(|(n, _)| n).collect();
        for (name, _) in live.chains(table) {
            if SERVICE_CHAIN_PREFIXES.iter().any(|p| name.starts_with(p)) && expected.chain(table, name).is_none() {
                names.push(name);
            }
        }
        names.sort_unstable();
        names.dedup();
        for name in names {
            let e = expected.chain(table, name).unwrap_or(&empty);
            let l = live.chain(table, name).unwrap_or(&empty);
            for r in e.rules.iter().chain(&l.rules) {
                if let Some(svc) = comment_service(r) {
                    chain_service.entry((table.to_string(), name.to_string())).or_insert(svc);
                }
            }
            if builtin_chains(table).contains(&name) {
                // Only our jump rules: present on the node, anywhere in the chain.
                let live_keys: Vec<String> = l.rules.iter().map(key).collect();
                for r in &e.rules {
                    if !live_keys.contains(&key(r)) {
                        diffs.push(RuleDiff {
                            table: table.into(),
                            chain: name.into(),
                            kind: DiffKind::Missing,
                            rule: r.text().to_string(),
                        });
                    }
                }
                continue;
            }
            diffs.extend(compare_chain(table, name, e, l));
        }
    }
    let mut report = Report::new();
    for d in diffs {
        let rule = live_or_expected(&d, expected, live);
        let svc = rule
            .and_then(comment_service)
            .or_else(|| chain_service.get(&(d.table.clone(), d.chain.clone())).cloned())
            .unwrap_or_else(|| NODE_WIDE.to_string());
        report.entry(svc).or_default().push(d);
    }
    report
}

fn live_or_expected<'a>(d: &RuleDiff, expected: &'a RuleSet<'a>, live: &'a RuleSet<'a>) -> Option<&'a LoadedRule<'a>> {
    let set = if d.kind == DiffKind::Missing { expected } else { live };
    set.chain(&d.table, &d.chain)?.rules.iter().find(|r| r.text() == d.rule)
}

fn compare_chain(table: &str, name: &str, e: &Chain<'_>, l: &Chain<'_>) -> Vec<RuleDiff> {
    let ek: Vec<String> = e.rules.iter().map(key).collect();
    let lk: Vec<String> = l.rules.iter().map(key).collect();
    if ek == lk {
        return vec![];
    }
    let diff = |kind, rule: &LoadedRule<'_>| RuleDiff {
        table: table.into(),
        chain: name.into(),
        kind,
        rule: rule.text().to_string(),
    };
    let mut out = Vec::new();
    // Multiset difference, each side in its own order.
    let mut unmatched_live: Vec<Option<&String>> = lk.iter().map(Some).collect();
    for (k, r) in ek.iter().zip(&e.rules) {
        match unmatched_live.iter_mut().find(|u| u.is_some_and(|x| x == k)) {
            Some(slot) => *slot = None,
            None => out.push(diff(DiffKind::Missing, r)),
        }
    }
    for (slot, r) in unmatched_live.iter().zip(&l.rules) {
        if slot.is_some() {
            out.push(diff(DiffKind::Extra, r));
        }
    }
    if out.is_empty() {
        out.extend(l.rules.iter().map(|r| diff(DiffKind::Order, r)));
    }
    out
}

/// Prints the report; returns whether anything differs.
pub(crate) fn print_report(report: &Report, out: &mut dyn Write) -> std::io::Result<bool> {
    if report.is_empty() {
        writeln!(out, "no differences")?;
        return Ok(false);
    }
    let mut rules = 0;
    for (svc, diffs) in report {
        writeln!(out, "{svc}:")?;
        let mut last_chain = None;
        for d in diffs {
            if last_chain != Some((&d.table, &d.chain)) {
                writeln!(out, "  {} {}:", d.table, d.chain)?;
                last_chain = Some((&d.table, &d.chain));
            }
            let (mark, note) = match d.kind {
                DiffKind::Missing => ("-", "  (rendered, not on the node)"),
                DiffKind::Extra => ("+", "  (on the node, not rendered)"),
                DiffKind::Order => ("~", "  (order on the node)"),
            };
            writeln!(out, "    {mark} {}{note}", d.rule)?;
            rules += 1;
        }
    }
    writeln!(out, "{rules} rule(s) differ, in {} group(s)", report.len())?;
    Ok(true)
}

/// Runs `diff`; `Ok(true)` when the rules differ.
pub fn run(args: &DiffArgs, node: &dyn LiveNode, out: &mut dyn Write) -> Result<bool, DiffCmdError> {
    // The comparison reads iptables rules: nftables mode is refused before anything is read.
    render::require_iptables_mode(&args.render, "diff")?;
    let family = IpFamily::from(args.ip_family);
    let render_args = RenderArgs {
        options: args.render.clone(),
        ip_family: args.ip_family,
        manifests: args.manifests.clone(),
        then: vec![],
    };
    // Rendered for the node compared against: the live node's nfacct objects and sysctl
    // (flags still win); a saved rules file says nothing of them, so the flags decide.
    let facts = match &args.node_rules {
        Some(_) => render::NodeFacts::from_flags(&args.render),
        None => node.facts().with_flags(&args.render),
    };
    let mut buf = Vec::new();
    if args.manifests.is_empty() {
        let settings = render::load_settings(&args.render)?;
        let snapshot = cluster_snapshot(args, &settings)?;
        render::render_snapshots_with(&render_args, &settings, facts, &[snapshot], &mut buf)?;
    } else {
        render::run_node_with(&render_args, facts, &mut buf)?;
    }
    let rendered = String::from_utf8_lossy(&buf);
    let mut expected =
        RuleSet::parse(&rendered).map_err(|source| DiffCmdError::Rules { what: "rendered rules".into(), source })?;
    expected.assume_jump_rules_if_missing();

    let (what, live_text) = match &args.node_rules {
        Some(path) => {
            let name = path.display().to_string();
            let text = std::fs::read_to_string(path)
                .map_err(|source| DiffCmdError::ReadRules { path: name.clone(), source })?;
            (name, text)
        }
        None => ("the node's rules".to_string(), node.rules(family).map_err(DiffCmdError::Live)?),
    };
    let live = RuleSet::parse(&live_text).map_err(|source| DiffCmdError::Rules { what, source })?;
    let report = compare(&expected, &live);
    let differ = print_report(&report, out)?;
    out.flush()?;
    Ok(differ)
}

/// The cluster state from the API server, as a snapshot `render` takes.
fn cluster_snapshot(args: &DiffArgs, settings: &Settings) -> Result<Snapshot, DiffCmdError> {
    let node_name = render::node_name(&args.render, settings);
    let kubeconfig = args.kubeconfig.as_deref().or(settings.client.kubeconfig.as_deref());
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(DiffCmdError::Runtime)?;
    let state = runtime.block_on(async {
        let client = crate::k8s::client::build(kubeconfig, args.master.as_deref()).await?;
        Ok::<_, DiffCmdError>(crate::k8s::list::cluster_state(&client, &node_name).await?)
    })?;
    Ok(Snapshot {
        services: state.services,
        endpoint_slices: state.endpoint_slices,
        nodes: state.node.into_iter().collect(),
        service_cidrs: Vec::new(),
    })
}
