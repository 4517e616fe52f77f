//! `FakeNftables`: an in-memory kernel for one family's `kube-proxy` table, applying
//! transactions with [`TableState`]'s kernel semantics, recording what it was asked, and
//! failing on request.

use std::sync::{Mutex, MutexGuard, PoisonError};

use super::{Family, NftError, Nftables, TableState, Transaction};

/// What the fake was asked, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FakeCall {
    Run(Transaction),
    Check(Transaction),
    ListTable,
}

#[derive(Debug, Default)]
struct Inner {
    table: TableState,
    calls: Vec<FakeCall>,
    /// Fail this many of the next `run`s (the table is unchanged).
    fail_runs: usize,
    /// Fail this many of the next `list_table`s.
    fail_lists: usize,
    /// Fail this many of the next `check`s.
    fail_checks: usize,
    /// The message injected failures carry.
    failure_message: Option<String>,
}

/// See the module documentation.
#[derive(Debug)]
pub struct FakeNftables {
    family: Family,
    inner: Mutex<Inner>,
}

impl FakeNftables {
    pub fn new(family: Family) -> FakeNftables {
        FakeNftables { family, inner: Mutex::new(Inner::default()) }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The table as the kernel holds it now.
    pub fn table(&self) -> TableState {
        self.lock().table.clone()
    }

    /// Replaces the table (something outside changed it).
    pub fn set_table(&self, table: TableState) {
        self.lock().table = table;
    }

    /// The table as knftables' fake `Dump()` writes it.
    pub fn dump(&self) -> String {
        self.lock().table.dump(self.family)
    }

    pub fn calls(&self) -> Vec<FakeCall> {
        self.lock().calls.clone()
    }

    pub fn clear_calls(&self) {
        self.lock().calls.clear();
    }

    /// The transactions run so far (successful or not).
    pub fn runs(&self) -> Vec<Transaction> {
        self.lock()
            .calls
            .iter()
            .filter_map(|c| match c {
                FakeCall::Run(tx) => Some(tx.clone()),
                _ => None,
            })
            .collect()
    }

    /// How many times the table was listed.
    pub fn list_count(&self) -> usize {
        self.lock().calls.iter().filter(|c| matches!(c, FakeCall::ListTable)).count()
    }

    /// Makes the next `n` runs fail without changing anything.
    pub fn fail_next_runs(&self, n: usize) {
        self.lock().fail_runs = n;
    }

    /// Makes the next `n` listings fail.
    pub fn fail_next_lists(&self, n: usize) {
        self.lock().fail_lists = n;
    }

    /// Makes the next `n` checks fail.
    pub fn fail_next_checks(&self, n: usize) {
        self.lock().fail_checks = n;
    }

    /// The message of injected failures (default "injected failure"), e.g. one that
    /// [`NftError::is_not_found`] recognises.
    pub fn set_failure_message(&self, message: impl Into<String>) {
        self.lock().failure_message = Some(message.into());
    }

    /// How many transactions were run (successful or not).
    pub fn run_count(&self) -> usize {
        self.lock().calls.iter().filter(|c| matches!(c, FakeCall::Run(_))).count()
    }

    /// The last transaction run, as the text `nft -f` would have read.
    pub fn last_run_text(&self) -> Option<String> {
        let inner = self.lock();
        inner.calls.iter().rev().find_map(|c| match c {
            FakeCall::Run(tx) => Some(tx.text(self.family, true)),
            _ => None,
        })
    }
}

impl Inner {
    fn injected(&self) -> String {
        self.failure_message.clone().unwrap_or_else(|| "injected failure".into())
    }
}

impl Nftables for FakeNftables {
    fn family(&self) -> Family {
        self.family
    }

    fn run(&self, tx: &Transaction) -> Result<(), NftError> {
        let mut inner = self.lock();
        inner.calls.push(FakeCall::Run(tx.clone()));
        if inner.fail_runs > 0 {
            inner.fail_runs -= 1;
            return Err(NftError::Rejected { family: self.family, message: inner.injected() });
        }
        inner.table.apply(tx).map_err(|e| NftError::Rejected { family: self.family, message: e.to_string() })
    }

    fn check(&self, tx: &Transaction) -> Result<(), NftError> {
        let mut inner = self.lock();
        inner.calls.push(FakeCall::Check(tx.clone()));
        if inner.fail_checks > 0 {
            inner.fail_checks -= 1;
            return Err(NftError::Rejected { family: self.family, message: inner.injected() });
        }
        let mut scratch = inner.table.clone();
        scratch.apply(tx).map_err(|e| NftError::Rejected { family: self.family, message: e.to_string() })
    }

    fn list_table(&self) -> Result<Option<TableState>, NftError> {
        let mut inner = self.lock();
        inner.calls.push(FakeCall::ListTable);
        if inner.fail_lists > 0 {
            inner.fail_lists -= 1;
            return Err(NftError::List { family: self.family, message: inner.injected() });
        }
        // As the kernel lists it: rules in nft's canonical words.
        Ok(inner.table.exists.then(|| inner.table.as_listed()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nftables::Operation;

    #[test]
    fn runs_apply_and_failures_change_nothing() {
        let nft = FakeNftables::new(Family::Ip);
        assert_eq!(nft.list_table().unwrap(), None);
        nft.run(&Transaction { ops: vec![Operation::AddTable] }).unwrap();
        assert!(nft.list_table().unwrap().is_some());
        nft.fail_next_runs(1);
        assert!(nft.run(&Transaction { ops: vec![Operation::DeleteTable] }).is_err());
        assert!(nft.table().exists);
        assert!(nft.run(&Transaction { ops: vec![Operation::FlushChain("x".into())] }).is_err());
        assert_eq!(nft.runs().len(), 3);
        assert_eq!(nft.run_count(), 3);
        assert_eq!(nft.list_count(), 2);
        assert_eq!(nft.last_run_text().as_deref(), Some("flush chain ip kube-proxy x\n"));
        nft.fail_next_checks(1);
        assert!(nft.check(&Transaction { ops: vec![Operation::AddTable] }).is_err());
        assert!(nft.check(&Transaction { ops: vec![Operation::AddTable] }).is_ok());
        nft.set_failure_message("Error: No such file or directory");
        nft.fail_next_lists(1);
        assert!(nft.list_table().unwrap_err().is_not_found());
    }

    #[test]
    fn listing_shows_rules_as_nft_does() {
        let nft = FakeNftables::new(Family::Ip);
        let mut tx = Transaction::new();
        tx.push(Operation::AddTable);
        tx.push(Operation::AddChain(crate::nftables::Chain::regular("m")));
        tx.push(Operation::AddRule(crate::nftables::Rule {
            chain: "m".into(),
            text: "mark set mark or 0x4000".into(),
            comment: None,
        }));
        nft.run(&tx).unwrap();
        let listed = nft.list_table().unwrap().unwrap();
        assert_eq!(listed.chains["m"].rules[0].0, "meta mark set meta mark | 0x00004000");
        // The fake's own view keeps what was written (for Dump() comparisons).
        assert_eq!(nft.table().chains["m"].rules[0].0, "mark set mark or 0x4000");
    }
}
