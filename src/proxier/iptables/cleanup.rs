//! `--cleanup`: removes everything the iptables proxier installed and nothing else
//! (upstream's `CleanupLeftovers`).
//!
//! This module owns [`cleanup_leftovers`]. In order:
//!
//! 1. the jump rules from the built-in chains into ours ([`JUMP_CHAINS`]) are deleted (a
//!    missing rule or chain is not an error);
//! 2. in nat, `KUBE-SERVICES`, `KUBE-NODEPORTS`, `KUBE-POSTROUTING`, `KUBE-MARK-MASQ` and
//!    every per-service chain (`KUBE-SVC-`, `KUBE-SVL-`, `KUBE-EXT-`, `KUBE-FW-`, `KUBE-SEP-`)
//!    that exists is flushed and deleted in one `iptables-restore --noflush`;
//! 3. in filter, `KUBE-SERVICES`, `KUBE-EXTERNAL-SERVICES`, `KUBE-FORWARD`, `KUBE-NODEPORTS`
//!    and `KUBE-PROXY-FIREWALL` the same way;
//! 4. our canary chain `KUBE-PROXY-CANARY` in nat and filter with the above, and in mangle on
//!    its own, where a failure is only logged (newer upstream releases remove it the same way;
//!    1.29 left it behind).
//!
//! kubelet's chains (`KUBE-FIREWALL`, `KUBE-KUBELET-CANARY`, `KUBE-IPTABLES-HINT`) and every chain
//! and rule of other owners are left alone. Where upstream leaves `KUBE-MARK-MASQ` and
//! `KUBE-PROXY-FIREWALL` behind we remove them too (in 1.29 nothing but kube-proxy creates
//! them), and a chain of ours that a foreign rule still jumps to is flushed but kept, so
//! that one such reference cannot make the whole restore fail. Running it twice is safe: the
//! second run finds nothing to do and succeeds.

use std::collections::{BTreeSet, HashSet};

use crate::iptables::runner::is_not_found;
use crate::iptables::{FlushFlag, Iptables, IptablesError, RestoreCounters, Table, save};
use crate::model::chains;
use crate::proxier::JUMP_CHAINS;

#[derive(Debug, thiserror::Error)]
pub enum CleanupError {
    #[error("failed to delete jump rule {table}/{src} -> {dst}: {source}")]
    DeleteJump { table: Table, src: &'static str, dst: &'static str, source: IptablesError },
    #[error("failed to run iptables-save -t {table}: {source}")]
    Save { table: Table, source: IptablesError },
    #[error("failed to flush and delete our {table} chains: {source}")]
    Restore { table: Table, source: IptablesError },
}

/// What [`cleanup_leftovers`] did.
#[derive(Debug, Default)]
pub struct CleanupReport {
    /// Chains flushed and deleted, as `table/chain`.
    pub deleted: Vec<String>,
    /// Chains flushed but kept because a foreign rule still jumps to them.
    pub kept_referenced: Vec<String>,
    /// Everything that failed; cleanup carries on past each failure.
    pub errors: Vec<CleanupError>,
}

impl CleanupReport {
    pub fn success(&self) -> bool {
        self.errors.is_empty()
    }
}

const NAT_CHAINS: &[&str] = &[
    chains::KUBE_SERVICES,
    chains::KUBE_NODEPORTS,
    chains::KUBE_POSTROUTING,
    chains::KUBE_MARK_MASQ,
    chains::KUBE_PROXY_CANARY,
];
const FILTER_CHAINS: &[&str] = &[
    chains::KUBE_SERVICES,
    chains::KUBE_EXTERNAL_SERVICES,
    chains::KUBE_FORWARD,
    chains::KUBE_NODEPORTS,
    chains::KUBE_PROXY_FIREWALL,
    chains::KUBE_PROXY_CANARY,
];

/// Removes our rules and chains from one family's iptables. See the module docs.
pub fn cleanup_leftovers(ipt: &dyn Iptables) -> CleanupReport {
    let mut report = CleanupReport::default();
    for jump in JUMP_CHAINS {
        if let Err(source) = ipt.delete_rule(jump.table, jump.src, &jump.args())
            && !is_not_found(&source)
        {
            let err = CleanupError::DeleteJump { table: jump.table, src: jump.src, dst: jump.dst, source };
            tracing::error!(error = %err, "error removing iptables proxy rule");
            report.errors.push(err);
        }
    }
    for (table, fixed) in [(Table::Nat, NAT_CHAINS), (Table::Filter, FILTER_CHAINS)] {
        clean_table(ipt, table, fixed, table == Table::Nat, &mut report);
    }
    // Only the canary lives in mangle; a node without a usable mangle table is no failure.
    let mut mangle = CleanupReport::default();
    clean_table(ipt, Table::Mangle, &[chains::KUBE_PROXY_CANARY], false, &mut mangle);
    report.deleted.extend(mangle.deleted);
    report.kept_referenced.extend(mangle.kept_referenced);
    for error in mangle.errors {
        tracing::warn!(%error, "could not remove the canary chain from mangle; ignored");
    }
    if report.success() {
        tracing::info!(deleted = report.deleted.len(), kept = report.kept_referenced.len(), "iptables cleanup done");
    }
    report
}

fn clean_table(ipt: &dyn Iptables, table: Table, fixed: &[&str], service_chains: bool, report: &mut CleanupReport) {
    let mut saved = Vec::new();
    if let Err(source) = ipt.save_into(table, &mut saved) {
        let err = CleanupError::Save { table, source };
        tracing::error!(error = %err, "cleanup could not read the table");
        report.errors.push(err);
        return;
    }
    let existing = save::chains_from_table(&saved);
    let ours: BTreeSet<String> = existing
        .iter()
        .filter(|c| fixed.contains(&c.as_str()) || (service_chains && chains::is_service_chain_name(c)))
        .cloned()
        .collect();
    if ours.is_empty() {
        return;
    }
    let referenced = referenced_from_outside(&String::from_utf8_lossy(&saved), &ours);

    let mut data = format!("*{table}\n");
    for chain in &ours {
        data.push_str(&save::chain_line(chain));
        data.push('\n');
    }
    for chain in &ours {
        if !referenced.contains(chain) {
            data.push_str(&format!("-X {chain}\n"));
        }
    }
    data.push_str("COMMIT\n");

    match ipt.restore(table, data.as_bytes(), FlushFlag::NoFlush, RestoreCounters::Counters) {
        Ok(()) => {
            for chain in ours {
                let name = format!("{table}/{chain}");
                if referenced.contains(&chain) {
                    tracing::warn!(chain = %name, "kept (flushed) a chain another owner's rule still jumps to");
                    report.kept_referenced.push(name);
                } else {
                    report.deleted.push(name);
                }
            }
        }
        Err(source) => {
            let context = source.restore_context().unwrap_or_default().to_string();
            let err = CleanupError::Restore { table, source };
            tracing::error!(error = %err, %context, "failed to execute iptables-restore");
            report.errors.push(err);
        }
    }
}

/// The chains of `ours` that a rule in a chain not in `ours` jumps or goes to.
fn referenced_from_outside(saved: &str, ours: &BTreeSet<String>) -> HashSet<String> {
    let mut referenced = HashSet::new();
    for line in saved.lines() {
        let mut words = line.split_whitespace();
        if words.next() != Some("-A") {
            continue;
        }
        let Some(chain) = words.next() else { continue };
        if ours.contains(chain) {
            continue;
        }
        let words: Vec<&str> = words.collect();
        for pair in words.windows(2) {
            if matches!(pair[0], "-j" | "-g" | "--jump" | "--goto") && ours.contains(pair[1]) {
                referenced.insert(pair[1].to_string());
            }
        }
    }
    referenced
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::iptables::RulePosition;
    use crate::iptables::fake::FakeIptables;
    use crate::model::IpFamily;
    use crate::proxier::KUBELET_JUMP_CHAINS;

    const OURS: &str = "*nat\n\
:KUBE-SERVICES - [0:0]\n:KUBE-NODEPORTS - [0:0]\n:KUBE-POSTROUTING - [0:0]\n:KUBE-MARK-MASQ - [0:0]\n\
:KUBE-SVC-AAAAAAAAAAAAAAAA - [0:0]\n:KUBE-SEP-BBBBBBBBBBBBBBBB - [0:0]\n\
-A KUBE-SERVICES -d 198.18.0.1/32 -j KUBE-SVC-AAAAAAAAAAAAAAAA\n\
-A KUBE-SVC-AAAAAAAAAAAAAAAA -j KUBE-SEP-BBBBBBBBBBBBBBBB\n\
-A KUBE-SEP-BBBBBBBBBBBBBBBB -j KUBE-MARK-MASQ\n\
-A KUBE-MARK-MASQ -j MARK --set-xmark 0x4000/0x4000\n\
COMMIT\n\
*filter\n\
:KUBE-SERVICES - [0:0]\n:KUBE-EXTERNAL-SERVICES - [0:0]\n:KUBE-FORWARD - [0:0]\n:KUBE-NODEPORTS - [0:0]\n\
:KUBE-PROXY-FIREWALL - [0:0]\n\
-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP\n\
COMMIT\n";

    const FOREIGN: &str = "*nat\n:FOREIGN - [0:0]\n-A FOREIGN -d 203.0.113.9/32 -j RETURN\n\
-A PREROUTING -j FOREIGN\nCOMMIT\n*filter\n:KUBE-FIREWALL - [0:0]\n\
-A INPUT -s 203.0.113.8/32 -j ACCEPT\nCOMMIT\n";

    fn installed() -> FakeIptables {
        let fake = FakeIptables::new(IpFamily::V4);
        fake.seed(FOREIGN.as_bytes()).expect("foreign");
        fake.seed(OURS.as_bytes()).expect("ours");
        for table in [Table::Mangle, Table::Nat, Table::Filter] {
            fake.ensure_chain(table, chains::KUBE_PROXY_CANARY).expect("canary");
            fake.ensure_chain(table, chains::KUBE_KUBELET_CANARY).expect("kubelet's canary");
        }
        for jump in JUMP_CHAINS.iter().chain(KUBELET_JUMP_CHAINS) {
            fake.ensure_chain(jump.table, jump.dst).expect("chain");
            fake.ensure_rule(RulePosition::Prepend, jump.table, jump.src, &jump.args()).expect("jump");
        }
        fake
    }

    #[test]
    fn removes_ours_and_keeps_foreign() {
        let fake = installed();
        let report = cleanup_leftovers(&fake);
        assert!(report.success(), "{:?}", report.errors);
        assert_eq!(report.deleted.len(), 14, "{:?}", report.deleted);
        for table in [Table::Nat, Table::Filter, Table::Mangle] {
            let kube: Vec<String> = fake.chains(table).into_iter().filter(|c| c.starts_with("KUBE-")).collect();
            let mut expected = vec![chains::KUBE_KUBELET_CANARY.to_string()];
            if table == Table::Filter {
                expected.insert(0, "KUBE-FIREWALL".to_string());
            }
            assert_eq!(kube, expected, "{table}");
        }
        assert_eq!(fake.rules(Table::Nat, "PREROUTING").expect("chain"), ["-j FOREIGN"]);
        assert_eq!(fake.rules(Table::Nat, "FOREIGN").expect("chain"), ["-d 203.0.113.9/32 -j RETURN"]);
        // kubelet's jumps stay; the foreign INPUT rule stays.
        let input = fake.rules(Table::Filter, "INPUT").expect("chain");
        assert_eq!(input, ["-j KUBE-FIREWALL", "-s 203.0.113.8/32 -j ACCEPT"]);
    }

    #[test]
    fn second_run_changes_nothing() {
        let fake = installed();
        assert!(cleanup_leftovers(&fake).success());
        let after_first = fake.save_all();
        fake.clear_log();
        let report = cleanup_leftovers(&fake);
        assert!(report.success(), "{:?}", report.errors);
        assert!(report.deleted.is_empty());
        assert_eq!(fake.save_all(), after_first);
        assert!(fake.restores().is_empty(), "nothing to restore the second time");
    }

    #[test]
    fn chain_referenced_by_foreign_rule_is_flushed_not_deleted() {
        let fake = installed();
        fake.seed(b"*nat\n-A FOREIGN -j KUBE-MARK-MASQ\nCOMMIT\n").expect("foreign reference");
        let report = cleanup_leftovers(&fake);
        assert!(report.success(), "{:?}", report.errors);
        assert_eq!(report.kept_referenced, ["nat/KUBE-MARK-MASQ"]);
        assert_eq!(fake.rules(Table::Nat, "KUBE-MARK-MASQ").expect("kept"), Vec::<String>::new());
    }

    #[test]
    fn failures_are_reported_and_cleanup_continues() {
        let fake = installed();
        fake.fail_next_save(IptablesError::Exec { command: "iptables-save".into(), reason: "boom".into() });
        let report = cleanup_leftovers(&fake);
        assert_eq!(report.errors.len(), 1);
        assert!(matches!(report.errors[0], CleanupError::Save { table: Table::Nat, .. }));
        // filter was still cleaned.
        assert!(!fake.chains(Table::Filter).iter().any(|c| c == "KUBE-FORWARD"));
    }

    #[test]
    fn a_mangle_failure_is_logged_not_reported() {
        let fake = installed();
        assert!(cleanup_leftovers(&fake).success());
        fake.ensure_chain(Table::Mangle, chains::KUBE_PROXY_CANARY).expect("canary again");
        // Every table's save fails (nat, filter, then mangle).
        fake.fail_next_save(IptablesError::Exec { command: "iptables-save".into(), reason: "boom".into() });
        fake.fail_next_save(IptablesError::Exec { command: "iptables-save".into(), reason: "boom".into() });
        fake.fail_next_save(IptablesError::Exec { command: "iptables-save".into(), reason: "boom".into() });
        let report = cleanup_leftovers(&fake);
        assert_eq!(report.errors.len(), 2, "nat's and filter's saves fail, mangle's is only logged");
        assert!(report.errors.iter().all(|e| !matches!(e, CleanupError::Save { table: Table::Mangle, .. })));
    }
}
