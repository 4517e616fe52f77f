//! The canary monitor: notices when something outside flushed the iptables tables (a
//! firewall reload, `iptables -F`) so that the proxier can rewrite its rules with a full sync.
//!
//! This module owns [`CanaryMonitor`] (upstream's `runner.Monitor`). It keeps an empty
//! canary chain (`KUBE-PROXY-CANARY`) in each watched table and polls the first table's
//! canary every `interval`. When it is gone, the other tables are polled every
//! [`FLUSH_POLL_INTERVAL`] until their canaries are gone too (a flush of several tables is
//! not atomic) or [`FLUSH_TIMEOUT`] passes, then the reload callback runs and the canaries
//! are re-created. On shutdown the canaries are deleted.
//!
//! Beyond upstream, the monitor can also watch "sentinel" rules (the proxier's jumps from the
//! built-in chains): flushing a single table (`iptables -t nat -F`) leaves every canary in
//! place, yet takes all service traffic down until the next full sync, which upstream only
//! does on a canary flush. A sentinel that was present and is gone forces that full sync too.
//! Sentinels only count once they have been seen (the first full sync creates them), so a
//! proxier that has not synced yet is not reloaded over and over.
//!
//! The decisions live in [`CanaryMonitor::step`], a synchronous function that does one
//! round of iptables calls and says how long to wait before the next, so tests can drive it
//! directly; [`CanaryMonitor::run`] is the tokio loop around it, running each step on the
//! blocking pool.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use super::{Iptables, Table};

/// How often the other tables are checked once the first table's canary has vanished.
pub(crate) const FLUSH_POLL_INTERVAL: Duration = Duration::from_millis(100);
/// How long to wait for the other tables' canaries to vanish too.
pub(crate) const FLUSH_TIMEOUT: Duration = Duration::from_secs(5);

/// The tables kube-proxy keeps its canary in, the first one polled.
pub const CANARY_TABLES: [Table; 3] = [Table::Mangle, Table::Nat, Table::Filter];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Creating the canaries (retried every interval until all exist).
    Setup,
    /// Polling the first table's canary.
    Watching,
    /// The first canary vanished; waiting (until the deadline) for the others to vanish.
    Flushing { deadline: Instant },
}

/// A rule whose disappearance means its table was flushed from outside.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Sentinel {
    pub table: Table,
    pub chain: String,
    pub args: Vec<String>,
}

/// What one [`CanaryMonitor::step`] decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Step {
    /// The tables were flushed: call the reload function.
    pub reload: bool,
    /// When to step next.
    pub next_in: Duration,
}

/// Watches canary chains. See the module docs.
pub struct CanaryMonitor {
    iptables: Arc<dyn Iptables>,
    canary: String,
    tables: Vec<Table>,
    interval: Duration,
    flush_poll: Duration,
    flush_timeout: Duration,
    state: State,
    sentinels: Vec<Sentinel>,
    /// All sentinels were present at the last check (so a missing one now was removed).
    sentinels_seen: bool,
}

impl std::fmt::Debug for CanaryMonitor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CanaryMonitor")
            .field("canary", &self.canary)
            .field("tables", &self.tables)
            .field("interval", &self.interval)
            .field("state", &self.state)
            .finish_non_exhaustive()
    }
}

impl CanaryMonitor {
    /// Watches `canary` in `tables` (the first is polled; an empty list watches nothing),
    /// every `interval`.
    pub fn new(iptables: Arc<dyn Iptables>, canary: impl Into<String>, tables: &[Table], interval: Duration) -> Self {
        CanaryMonitor {
            iptables,
            canary: canary.into(),
            tables: tables.to_vec(),
            interval,
            flush_poll: FLUSH_POLL_INTERVAL,
            flush_timeout: FLUSH_TIMEOUT,
            state: State::Setup,
            sentinels: Vec::new(),
            sentinels_seen: false,
        }
    }

    /// Also watches `sentinels` (see the module docs), after the first table's canary.
    pub(crate) fn with_sentinels(mut self, sentinels: Vec<Sentinel>) -> Self {
        self.sentinels = sentinels;
        self
    }

    /// One round of checks at `now`.
    pub fn step(&mut self, now: Instant) -> Step {
        let Some(&first) = self.tables.first() else {
            return Step { reload: false, next_in: self.interval };
        };
        match self.state {
            State::Setup => {
                for &table in &self.tables {
                    if let Err(e) = self.iptables.ensure_chain(table, &self.canary) {
                        tracing::error!(%table, chain = %self.canary, error = %e, "could not set up iptables canary");
                        return Step { reload: false, next_in: self.interval };
                    }
                }
                self.state = State::Watching;
                Step { reload: false, next_in: self.interval }
            }
            State::Watching => match self.iptables.chain_exists(first, &self.canary) {
                Ok(true) if self.sentinel_removed() => {
                    // Re-create whatever canaries went with the rules (`-F` then `-X`).
                    self.state = State::Setup;
                    Step { reload: true, next_in: Duration::ZERO }
                }
                Ok(true) => Step { reload: false, next_in: self.interval },
                Err(e) => {
                    tracing::error!(table = %first, chain = %self.canary, error = %e, "could not check for iptables canary");
                    Step { reload: false, next_in: self.interval }
                }
                Ok(false) => {
                    tracing::debug!(table = %first, chain = %self.canary, "iptables canary deleted");
                    self.state = State::Flushing { deadline: crate::time::instant_after(now, self.flush_timeout) };
                    self.step(now)
                }
            },
            State::Flushing { deadline } => {
                let others_gone = self.tables[1..]
                    .iter()
                    .all(|&table| matches!(self.iptables.chain_exists(table, &self.canary), Ok(false)));
                if !others_gone && now < deadline {
                    return Step { reload: false, next_in: self.flush_poll.min(deadline - now) };
                }
                if !others_gone {
                    tracing::info!(chain = %self.canary, "inconsistent iptables state detected");
                }
                tracing::info!("reloading after iptables flush");
                self.state = State::Setup;
                self.sentinels_seen = false;
                Step { reload: true, next_in: Duration::ZERO }
            }
        }
    }

    /// Whether a sentinel seen at the last check is gone now; a missing one that was never
    /// seen (rules not written yet) does not count, and a failed check counts as present.
    fn sentinel_removed(&mut self) -> bool {
        for s in &self.sentinels {
            let args: Vec<&str> = s.args.iter().map(String::as_str).collect();
            match self.iptables.rule_exists(s.table, &s.chain, &args) {
                Ok(true) => {}
                Ok(false) => {
                    let removed = self.sentinels_seen;
                    if removed {
                        tracing::info!(table = %s.table, chain = %s.chain, rule = %s.args.join(" "),
                            "a rule of ours vanished (table flushed from outside); forcing a full resync");
                    }
                    self.sentinels_seen = false;
                    return removed;
                }
                Err(e) => {
                    tracing::error!(table = %s.table, chain = %s.chain, error = %e, "could not check for a sentinel rule");
                    return false;
                }
            }
        }
        self.sentinels_seen = true;
        false
    }

    /// Deletes the canaries (on shutdown); failures are logged.
    pub fn remove_canaries(&self) {
        for &table in &self.tables {
            if let Err(e) = self.iptables.delete_chain(table, &self.canary) {
                tracing::debug!(%table, chain = %self.canary, error = %e, "could not delete iptables canary");
            }
        }
    }

    /// Steps until `shutdown` is cancelled, calling `reload` whenever the tables were
    /// flushed; the canaries are removed on the way out.
    pub async fn run(self, shutdown: CancellationToken, mut reload: impl FnMut()) {
        let mut monitor = self;
        loop {
            let now = tokio::time::Instant::now().into_std();
            let stepped = tokio::task::spawn_blocking(move || {
                let step = monitor.step(now);
                (monitor, step)
            })
            .await;
            let step = match stepped {
                Ok((m, step)) => {
                    monitor = m;
                    step
                }
                Err(e) => {
                    tracing::error!(error = %e, "canary monitor step failed; stopping the monitor");
                    return;
                }
            };
            if step.reload {
                reload();
            }
            tokio::select! {
                biased;
                () = shutdown.cancelled() => break,
                () = tokio::time::sleep(step.next_in) => {}
            }
        }
        // Dropping the handle does not cancel a blocking task, so awaiting is only for order.
        let _ = tokio::task::spawn_blocking(move || monitor.remove_canaries()).await;
        tracing::debug!("canary monitor stopped");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::iptables::fake::FakeIptables;
    use crate::model::IpFamily;
    use std::sync::atomic::{AtomicUsize, Ordering};

    const CANARY: &str = "KUBE-PROXY-CANARY";
    const SEC: Duration = Duration::from_secs(1);

    fn setup() -> (Arc<FakeIptables>, CanaryMonitor) {
        let fake = Arc::new(FakeIptables::new(IpFamily::V4));
        let monitor = CanaryMonitor::new(fake.clone(), CANARY, &CANARY_TABLES, SEC * 30);
        (fake, monitor)
    }

    fn has_canary(fake: &FakeIptables, table: Table) -> bool {
        fake.chains(table).iter().any(|c| c == CANARY)
    }

    #[test]
    fn creates_canaries_then_watches() {
        let (fake, mut m) = setup();
        let t0 = Instant::now();
        assert_eq!(m.step(t0), Step { reload: false, next_in: SEC * 30 });
        for table in CANARY_TABLES {
            assert!(has_canary(&fake, table), "{table}");
        }
        fake.clear_log();
        assert_eq!(m.step(t0 + SEC * 30), Step { reload: false, next_in: SEC * 30 });
        assert_eq!(fake.calls(), ["chain_exists mangle KUBE-PROXY-CANARY"]);
    }

    #[test]
    fn full_flush_triggers_one_reload_and_recreates() {
        let (fake, mut m) = setup();
        let t0 = Instant::now();
        m.step(t0);
        for table in CANARY_TABLES {
            fake.delete_chain(table, CANARY).expect("delete");
        }
        let step = m.step(t0 + SEC * 30);
        assert_eq!(step, Step { reload: true, next_in: Duration::ZERO });
        m.step(t0 + SEC * 30);
        for table in CANARY_TABLES {
            assert!(has_canary(&fake, table), "{table} re-created");
        }
        assert!(!m.step(t0 + SEC * 60).reload);
    }

    #[test]
    fn partial_flush_waits_for_the_other_tables_then_gives_up() {
        let (fake, mut m) = setup();
        let t0 = Instant::now();
        m.step(t0);
        fake.delete_chain(Table::Mangle, CANARY).expect("delete");
        let t1 = t0 + SEC * 30;
        assert_eq!(m.step(t1), Step { reload: false, next_in: FLUSH_POLL_INTERVAL });
        // nat goes; filter still there: keep waiting.
        fake.delete_chain(Table::Nat, CANARY).expect("delete");
        assert!(!m.step(t1 + SEC).reload);
        // Close to the deadline the wait is cut to it.
        assert_eq!(m.step(t1 + SEC * 5 - Duration::from_millis(30)).next_in, Duration::from_millis(30));
        // At the deadline: reload anyway (inconsistent state).
        assert!(m.step(t1 + FLUSH_TIMEOUT).reload);
    }

    fn sentinel() -> Sentinel {
        let args = ["-m", "comment", "--comment", "kubernetes service portals", "-j", "KUBE-SERVICES"];
        Sentinel { table: Table::Nat, chain: "PREROUTING".into(), args: args.iter().map(|a| a.to_string()).collect() }
    }

    fn add_sentinel(fake: &FakeIptables) {
        let s = sentinel();
        let args: Vec<&str> = s.args.iter().map(String::as_str).collect();
        fake.ensure_chain(Table::Nat, "KUBE-SERVICES").expect("chain");
        fake.ensure_rule(crate::iptables::RulePosition::Prepend, Table::Nat, &s.chain, &args).expect("rule");
    }

    /// `iptables -t nat -F` leaves every canary but removes our jumps: the sentinel catches
    /// it within one interval, once it has been seen.
    #[test]
    fn flushed_single_table_is_caught_by_a_sentinel() {
        let (fake, m) = setup();
        let mut m = m.with_sentinels(vec![sentinel()]);
        let t0 = Instant::now();
        m.step(t0);
        // Not written yet (no full sync so far): no reload, however often we look.
        assert!(!m.step(t0 + SEC * 30).reload);
        assert!(!m.step(t0 + SEC * 60).reload);
        add_sentinel(&fake);
        assert!(!m.step(t0 + SEC * 90).reload, "seen now");
        fake.flush_chain(Table::Nat, "PREROUTING").expect("flush");
        assert_eq!(m.step(t0 + SEC * 120), Step { reload: true, next_in: Duration::ZERO });
        // Back to setup: canaries ensured, and the sentinel must be seen again before it counts.
        assert!(!m.step(t0 + SEC * 120).reload);
        assert!(!m.step(t0 + SEC * 150).reload, "still missing but not seen since the reload");
        add_sentinel(&fake);
        assert!(!m.step(t0 + SEC * 180).reload);
        assert!(has_canary(&fake, Table::Nat));
    }

    /// Flushing and deleting one table's chains (`-F` then `-X`) reloads and re-creates that
    /// table's canary.
    #[test]
    fn deleted_chains_of_one_table_reload_and_recreate_its_canary() {
        let (fake, m) = setup();
        let mut m = m.with_sentinels(vec![sentinel()]);
        let t0 = Instant::now();
        m.step(t0);
        add_sentinel(&fake);
        assert!(!m.step(t0 + SEC * 30).reload);
        fake.flush_chain(Table::Nat, "PREROUTING").expect("flush");
        fake.delete_chain(Table::Nat, "KUBE-SERVICES").expect("delete");
        fake.delete_chain(Table::Nat, CANARY).expect("delete");
        assert!(m.step(t0 + SEC * 60).reload);
        m.step(t0 + SEC * 60);
        assert!(has_canary(&fake, Table::Nat), "re-created");
    }

    #[test]
    fn setup_failure_retries_each_interval() {
        let fake = Arc::new(FakeIptables::new(IpFamily::V4));
        // A chain name too long for iptables makes ensure_chain fail.
        let long = "KUBE-PROXY-CANARY-WITH-A-NAME-TOO-LONG";
        let mut m = CanaryMonitor::new(fake.clone(), long, &CANARY_TABLES, SEC * 30);
        assert_eq!(m.step(Instant::now()), Step { reload: false, next_in: SEC * 30 });
        assert_eq!(m.state, State::Setup);
    }

    #[test]
    fn no_tables_watches_nothing() {
        let fake = Arc::new(FakeIptables::new(IpFamily::V4));
        let mut m = CanaryMonitor::new(fake.clone(), CANARY, &[], SEC);
        assert!(!m.step(Instant::now()).reload);
        assert!(fake.calls().is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn loop_reloads_within_one_interval_and_cleans_up() {
        let (fake, m) = setup();
        let reloads = Arc::new(AtomicUsize::new(0));
        let counter = reloads.clone();
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(m.run(shutdown.clone(), move || {
            counter.fetch_add(1, Ordering::SeqCst);
        }));
        tokio::time::sleep(SEC).await;
        assert!(has_canary(&fake, Table::Filter));
        for table in CANARY_TABLES {
            fake.delete_chain(table, CANARY).expect("delete");
        }
        tokio::time::sleep(SEC * 30).await;
        assert_eq!(reloads.load(Ordering::SeqCst), 1);
        assert!(has_canary(&fake, Table::Mangle), "re-created after reload");
        shutdown.cancel();
        task.await.expect("monitor stops");
        for table in CANARY_TABLES {
            assert!(!has_canary(&fake, table), "{table}: removed on shutdown");
        }
    }
}
