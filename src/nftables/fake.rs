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
            return Err(NftError::Rejected { family: self.family, message: "injected failure".into() });
        }
        inner.table.apply(tx).map_err(|e| NftError::Rejected { family: self.family, message: e.to_string() })
    }

    fn check(&self, tx: &Transaction) -> Result<(), NftError> {
        let mut inner = self.lock();
        inner.calls.push(FakeCall::Check(tx.clone()));
        let mut scratch = inner.table.clone();
        scratch.apply(tx).map_err(|e| NftError::Rejected { family: self.family, message: e.to_string() })
    }

    fn list_table(&self) -> Result<Option<TableState>, NftError> {
        let mut inner = self.lock();
        inner.calls.push(FakeCall::ListTable);
        if inner.fail_lists > 0 {
            inner.fail_lists -= 1;
            return Err(NftError::List { family: self.family, message: "injected failure".into() });
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
        assert_eq!(nft.list_count(), 2);
    }
}
