//! `ChainTracker`: an [`Iptables`] that keeps only which chains exist in each table.
//!
//! The `render` command needs exactly that from "the kernel" between its syncs (stale chains
//! are found from the chain list `iptables-save` reports), and on a 100k-endpoint cluster the
//! full rule model of the test fake (`FakeIptables`) costs more than the render itself. Rule
//! operations succeed without effect; restores apply their chain lines (`:NAME` creates,
//! `-X NAME` deletes) and are otherwise trusted. Tests that need rule-level checks use the
//! fake.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;

use super::{FlushFlag, Iptables, RestoreCounters, Result, RulePosition, Table};
use crate::model::IpFamily;

/// Chain names per table, as the last restores left them.
pub(crate) struct ChainTracker {
    family: IpFamily,
    random_fully: bool,
    tables: Mutex<BTreeMap<Table, BTreeSet<String>>>,
}

impl ChainTracker {
    pub fn new(family: IpFamily, random_fully: bool) -> Self {
        ChainTracker { family, random_fully, tables: Mutex::new(BTreeMap::new()) }
    }

    /// The chains of `table`, sorted.
    #[cfg(test)]
    pub fn chains(&self, table: Table) -> Vec<String> {
        self.lock().get(&table).map(|c| c.iter().cloned().collect()).unwrap_or_default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<Table, BTreeSet<String>>> {
        // A poisoned lock only means another thread panicked mid-update of a set of names;
        // the names are still usable.
        self.tables.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn apply(&self, data: &[u8], only: Option<Table>, flush: FlushFlag) {
        let text = String::from_utf8_lossy(data);
        let mut tables = self.lock();
        let mut current: Option<Table> = None;
        for line in text.lines() {
            if let Some(name) = line.strip_prefix('*') {
                current = Table::parse(name.trim()).filter(|t| only.is_none_or(|o| o == *t));
                if let (Some(t), FlushFlag::Flush) = (current, flush) {
                    tables.entry(t).or_default().clear();
                }
                continue;
            }
            let Some(table) = current else { continue };
            if let Some(decl) = line.strip_prefix(':') {
                if let Some(name) = decl.split_whitespace().next() {
                    tables.entry(table).or_default().insert(name.to_string());
                }
            } else if let Some(name) = line.strip_prefix("-X ") {
                tables.entry(table).or_default().remove(name.trim());
            }
        }
    }
}

impl Iptables for ChainTracker {
    fn family(&self) -> IpFamily {
        self.family
    }

    fn ensure_chain(&self, table: Table, chain: &str) -> Result<bool> {
        Ok(!self.lock().entry(table).or_default().insert(chain.to_string()))
    }

    fn flush_chain(&self, _table: Table, _chain: &str) -> Result<()> {
        Ok(())
    }

    fn delete_chain(&self, table: Table, chain: &str) -> Result<()> {
        self.lock().entry(table).or_default().remove(chain);
        Ok(())
    }

    fn chain_exists(&self, table: Table, chain: &str) -> Result<bool> {
        Ok(self.lock().get(&table).is_some_and(|c| c.contains(chain)))
    }

    fn ensure_rule(&self, _position: RulePosition, _table: Table, _chain: &str, _args: &[&str]) -> Result<bool> {
        Ok(false)
    }

    fn rule_exists(&self, _table: Table, _chain: &str, _args: &[&str]) -> Result<bool> {
        Ok(false)
    }

    fn delete_rule(&self, _table: Table, _chain: &str, _args: &[&str]) -> Result<()> {
        Ok(())
    }

    fn save_into(&self, table: Table, out: &mut Vec<u8>) -> Result<()> {
        let tables = self.lock();
        out.extend_from_slice(format!("*{table}\n").as_bytes());
        for chain in tables.get(&table).into_iter().flatten() {
            out.push(b':');
            out.extend_from_slice(chain.as_bytes());
            out.extend_from_slice(b" - [0:0]\n");
        }
        out.extend_from_slice(b"COMMIT\n");
        Ok(())
    }

    fn restore(&self, table: Table, data: &[u8], flush: FlushFlag, _counters: RestoreCounters) -> Result<()> {
        self.apply(data, Some(table), flush);
        Ok(())
    }

    fn restore_all(&self, data: &[u8], flush: FlushFlag, _counters: RestoreCounters) -> Result<()> {
        self.apply(data, None, flush);
        Ok(())
    }

    fn has_random_fully(&self) -> bool {
        self.random_fully
    }

    fn present(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tracks_declared_and_deleted_chains() {
        let t = ChainTracker::new(IpFamily::V4, true);
        t.restore_all(
            b"*filter\n:KUBE-FORWARD - [0:0]\nCOMMIT\n*nat\n:KUBE-SERVICES - [0:0]\n:KUBE-SVC-A - [0:0]\n-A KUBE-SVC-A -j X\nCOMMIT\n",
            FlushFlag::NoFlush,
            RestoreCounters::Counters,
        )
        .unwrap();
        assert_eq!(t.chains(Table::Nat), ["KUBE-SERVICES", "KUBE-SVC-A"]);
        t.restore_all(
            b"*nat\n:KUBE-SVC-A - [0:0]\n-X KUBE-SVC-A\nCOMMIT\n",
            FlushFlag::NoFlush,
            RestoreCounters::Counters,
        )
        .unwrap();
        assert_eq!(t.chains(Table::Nat), ["KUBE-SERVICES"]);
        assert_eq!(t.chains(Table::Filter), ["KUBE-FORWARD"]);
        let mut buf = Vec::new();
        t.save_into(Table::Nat, &mut buf).unwrap();
        assert_eq!(super::super::save::chains_from_table(&buf).into_iter().collect::<Vec<_>>(), ["KUBE-SERVICES"]);
        assert!(t.chain_exists(Table::Filter, "KUBE-FORWARD").unwrap());
        assert!(!t.ensure_chain(Table::Filter, "KUBE-NEW").unwrap());
        assert!(t.ensure_chain(Table::Filter, "KUBE-NEW").unwrap());
    }
}
