//! The netlink writer: transactions sent to the kernel's nf_tables as one netlink batch,
//! without `nft`, when every operation in them is one [`encode`] knows; otherwise (and
//! always for listing and checking) the `nft` runner, as before.
//!
//! Why: what a small transaction costs through `nft -f` is nft itself, not the kernel. nft
//! 1.0.6 reads the names of every chain and set of the table before it applies an element
//! or a rule (`nft_cache_evaluate`: `NFT_CACHE_CHAIN | NFT_CACHE_SET`), which at 10k
//! services is ~0.1 s and at 50k several seconds, for every partial sync; the kernel's part
//! of the same batch is a few milliseconds (docs/performance.md, "The writer's share of a
//! partial sync"). The partial syncs of a running node are endpoint and service changes:
//! elements, per-service chains and their rules, affinity sets — the forms [`encode`]
//! covers. A full sync's first write still goes through nft in the chunks that hold a form
//! not covered (the table, base chains, named maps); its cost is the kernel's set walks
//! either way.
//!
//! Why hand-written messages and not a crate: the rust-netlink crates we use for conntrack
//! have no nf_tables messages, and what matters here is that every message equals what
//! nft sends for the same text (user data of anonymous maps, register layout, byte orders),
//! which no crate promises; tests/nft_netlink.rs holds the encoder to nft on the real
//! kernel, form by form, family by family.
//!
//! Atomicity is the kernel's: a batch is one transaction, all of it or nothing. The kernel
//! answers every failed message, and the last one in any case; the first error names the
//! operation that caused it, in the text `nft -f` would have been given.

pub mod encode;
pub mod message;
pub mod socket;

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use self::socket::{Netlink, NetlinkError};
use super::transaction::write_operation;
use super::{Family, NftError, Nftables, TableState, Transaction};

#[cfg(any(test, feature = "testing"))]
pub use socket::FakeNetlink;
pub use socket::KernelNetlink;

/// The environment variable that turns the netlink writer off (`nft` for every
/// transaction): `KUBE_PROXY_RS_NFT_WRITER=nft`.
pub const WRITER_ENV: &str = "KUBE_PROXY_RS_NFT_WRITER";

/// Whether the environment asks for `nft` only.
pub fn cli_only_from_env() -> bool {
    std::env::var(WRITER_ENV).is_ok_and(|v| v == "nft")
}

/// How a transaction went to the kernel (for tests and benchmarks).
#[derive(Debug, Default)]
pub struct WriterStats {
    pub netlink: std::sync::atomic::AtomicU64,
    pub cli: std::sync::atomic::AtomicU64,
}

/// The writer: netlink for what [`encode`] covers, `cli` for the rest.
pub struct NetlinkNftables {
    cli: Arc<dyn Nftables>,
    netlink: Arc<dyn Netlink>,
    /// How anonymous maps are named (none: `__map%d`, as nft does).
    names: Option<encode::AnonymousNames>,
    seq: AtomicU32,
    warned_not_sent: std::sync::atomic::AtomicBool,
    pub stats: WriterStats,
}

impl std::fmt::Debug for NetlinkNftables {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NetlinkNftables").field("family", &self.cli.family()).finish_non_exhaustive()
    }
}

impl NetlinkNftables {
    /// The daemon's writer: anonymous maps get names of its own ([`encode::AnonymousNames`]:
    /// the kernel then skips numbering them, about a third of a large first sync's kernel
    /// time, docs/performance.md).
    pub fn new(cli: Arc<dyn Nftables>, netlink: Arc<dyn Netlink>) -> NetlinkNftables {
        NetlinkNftables::named(cli, netlink, Some(encode::AnonymousNames::random()))
    }

    /// A writer that names anonymous maps `__map%d`, as nft does, so the kernel numbers them
    /// (the benchmarks' comparison: `nft_scale --kernel-names`).
    pub fn with_kernel_names(cli: Arc<dyn Nftables>, netlink: Arc<dyn Netlink>) -> NetlinkNftables {
        NetlinkNftables::named(cli, netlink, None)
    }

    /// A writer naming anonymous maps from `names` (none: `__map%d`).
    pub fn named(cli: Arc<dyn Nftables>, netlink: Arc<dyn Netlink>, names: Option<encode::AnonymousNames>) -> Self {
        // Sequence numbers tell a batch's answers apart (each batch opens its own socket).
        NetlinkNftables {
            cli,
            netlink,
            names,
            seq: AtomicU32::new(0),
            warned_not_sent: std::sync::atomic::AtomicBool::new(false),
            stats: WriterStats::default(),
        }
    }

    fn send(&self, tx: &Transaction, encoded: encode::Encoded) -> Result<(), NftError> {
        let family = self.cli.family();
        let count = encoded.messages.len() as u32;
        // Kept far below u32::MAX so that a batch's numbers never wrap.
        let first = 0x1000 + self.seq.fetch_add(count + 2, Ordering::Relaxed) % (1 << 30);
        let batch = message::batch(encode::af(family), &encoded.messages, first);
        let acks = match self.netlink.transact(&batch, first, count) {
            Ok(acks) => acks,
            Err(NetlinkError::NotSent(e)) => {
                // Nothing reached the kernel: nft writes it (and every later one it cannot
                // send either; said once at warning level).
                if self.warned_not_sent.swap(true, Ordering::Relaxed) {
                    tracing::debug!(%family, error = %e, operations = tx.len(), "netlink batch not sent; writing it with nft");
                } else {
                    tracing::warn!(%family, error = %e, operations = tx.len(), "netlink batch not sent; writing it with nft (said once)");
                }
                self.stats.cli.fetch_add(1, Ordering::Relaxed);
                return self.cli.run(tx);
            }
            Err(e) => return Err(NftError::Rejected { family, message: format!("nf_tables netlink batch: {e}") }),
        };
        let failed = acks.iter().filter(|a| a.errno != 0).min_by_key(|a| a.seq);
        if let Some(ack) = failed {
            let errno = std::io::Error::from_raw_os_error(-ack.errno);
            let message = match ack.seq.checked_sub(first + 1).map(|i| i as usize) {
                Some(i) if i < encoded.origins.len() => {
                    let index = encoded.origins[i];
                    let mut line = String::new();
                    write_operation(&mut line, family, &tx.ops[index], self.cli.object_comments());
                    format!(
                        "nf_tables refused operation {} of {}: {errno}: {}",
                        index + 1,
                        tx.ops.len(),
                        line.trim_end()
                    )
                }
                _ => format!("nf_tables refused the batch: {errno}"),
            };
            return Err(NftError::Rejected { family, message });
        }
        if !acks.iter().any(|a| a.seq == first + count) {
            return Err(NftError::Rejected { family, message: "nf_tables did not acknowledge the batch".into() });
        }
        Ok(())
    }
}

impl Nftables for NetlinkNftables {
    fn family(&self) -> Family {
        self.cli.family()
    }

    fn run(&self, tx: &Transaction) -> Result<(), NftError> {
        if tx.ops.is_empty() {
            return Ok(());
        }
        match encode::transaction_named(self.cli.family(), &tx.ops, self.names.as_ref()) {
            Ok(encoded) => {
                self.stats.netlink.fetch_add(1, Ordering::Relaxed);
                self.send(tx, encoded)
            }
            Err(why) => {
                tracing::trace!(family = %self.cli.family(), reason = %why, "transaction goes to nft");
                self.stats.cli.fetch_add(1, Ordering::Relaxed);
                self.cli.run(tx)
            }
        }
    }

    fn check(&self, tx: &Transaction) -> Result<(), NftError> {
        self.cli.check(tx)
    }

    fn list_table(&self) -> Result<Option<TableState>, NftError> {
        self.cli.list_table()
    }

    fn object_comments(&self) -> bool {
        self.cli.object_comments()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nftables::fake::FakeNftables;
    use crate::nftables::{Chain, Operation, Rule};

    fn writer() -> (Arc<FakeNftables>, Arc<FakeNetlink>, NetlinkNftables) {
        let cli = Arc::new(FakeNftables::new(Family::Ip));
        let nl = Arc::new(FakeNetlink::default());
        let w = NetlinkNftables::new(cli.clone(), nl.clone());
        (cli, nl, w)
    }

    fn chain_and_rule() -> Transaction {
        Transaction {
            ops: vec![
                Operation::AddChain(Chain::regular("endpoint-X")),
                Operation::AddRule(Rule {
                    chain: "endpoint-X".into(),
                    text: "meta l4proto tcp dnat to 10.0.0.1:80".into(),
                    comment: None,
                }),
            ],
        }
    }

    #[test]
    fn encodable_transactions_go_over_netlink_and_others_to_nft() {
        let (_cli, nl, w) = writer();
        w.run(&chain_and_rule()).unwrap();
        assert_eq!(nl.batches.lock().unwrap().len(), 1);
        assert_eq!(w.stats.netlink.load(Ordering::Relaxed), 1);

        let mut tx = Transaction { ops: vec![Operation::AddTable] };
        tx.ops.extend(chain_and_rule().ops);
        w.run(&tx).unwrap();
        assert_eq!(nl.batches.lock().unwrap().len(), 1, "the table operation sends it all to nft");
        assert_eq!(w.stats.cli.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn a_batch_that_cannot_be_sent_goes_to_nft() {
        let (cli, nl, w) = writer();
        nl.unsendable.store(true, Ordering::Relaxed);
        let tx = Transaction { ops: vec![Operation::AddTable] };
        w.run(&tx).unwrap();
        w.run(&chain_and_rule()).unwrap();
        assert!(nl.batches.lock().unwrap().is_empty());
        assert_eq!(w.stats.cli.load(Ordering::Relaxed), 2);
        let table = cli.list_table().unwrap().expect("nft wrote it");
        assert_eq!(table.chains["endpoint-X"].rules.len(), 1);
    }

    #[test]
    fn a_refused_message_names_its_operation() {
        let (_cli, nl, w) = writer();
        *nl.fail_at.lock().unwrap() = Some((1, -2));
        let err = w.run(&chain_and_rule()).unwrap_err().to_string();
        assert!(err.contains("operation 2 of 2"), "{err}");
        assert!(err.contains("add rule ip kube-proxy endpoint-X meta l4proto tcp dnat to 10.0.0.1:80"), "{err}");
        assert!(err.contains("No such file or directory"), "{err}");
        let err = NftError::Rejected { family: Family::Ip, message: err };
        assert!(err.is_not_found(), "reads as nft's not-found");
    }
}
