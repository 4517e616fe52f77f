//! The sync loop of one proxier: a [`BoundedFrequencyRunner`] decides when the proxier's
//! sync runs, and in iptables mode a [`CanaryMonitor`] forces a full resync when someone
//! flushed our tables (upstream's `SyncLoop` plus `ipt.Monitor(..., forceSyncProxyRules,
//! ...)`). Either mode's proxier runs in it through [`LoopProxier`].
//!
//! Syncs run on the blocking pool (they exec iptables); the proxier sits behind a std
//! `Mutex` that only its sync takes (and tests), never held across an `.await`. Event
//! handlers never touch it: they record into the proxier's `ChangeRecorder` (its own short
//! lock) and call [`RunnerHandle::run`] to ask for a sync; the canary monitor asks for a
//! resync the same way. So nothing on the async runtime's threads waits for a sync.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;
use tracing::Instrument as _;

use crate::compat::Release;
use crate::daemon::runner::{BoundedFrequencyRunner, Pacing, RunnerError, RunnerHandle};
use crate::iptables::Iptables;
use crate::iptables::monitor::{CANARY_TABLES, CanaryMonitor, Sentinel};
use crate::iptables::{CHAIN_FORWARD, CHAIN_PREROUTING, Table};
use crate::model::IpFamily;
use crate::model::chains::{KUBE_FORWARD, KUBE_PROXY_CANARY, KUBE_SERVICES};
use crate::proxier::nftables::{NftSyncOutcome, NftSyncReport, NftablesProxier};
use crate::proxier::{JUMP_CHAINS, Proxier, SyncOutcome, SyncReport};
use crate::tracker::ChangeRecorder;

/// What a sync loop needs of a proxier, whichever mode it writes.
pub trait LoopProxier: Send + 'static {
    /// What one sync reports (metrics, health, conntrack cleanup).
    type Report: Send + Sync + 'static;
    fn family(&self) -> IpFamily;
    fn release(&self) -> Release;
    /// Where event handlers record changes.
    fn recorder(&self) -> Arc<ChangeRecorder>;
    /// Makes the next sync full, reading the kernel first.
    fn force_full_sync(&self);
    /// Applies pending changes and writes the rules; `None` while Services or EndpointSlices
    /// have not been listed yet (nothing was touched).
    fn sync_once(&mut self, now: Instant) -> Option<Box<Self::Report>>;
    /// When to retry after this sync (set when it failed).
    fn retry_after(report: &Self::Report) -> Option<Duration>;
}

impl LoopProxier for Proxier {
    type Report = SyncReport;

    fn family(&self) -> IpFamily {
        Proxier::family(self)
    }

    fn release(&self) -> Release {
        self.config().render.features.release
    }

    fn recorder(&self) -> Arc<ChangeRecorder> {
        Proxier::recorder(self)
    }

    fn force_full_sync(&self) {
        Proxier::force_full_sync(self)
    }

    fn sync_once(&mut self, now: Instant) -> Option<Box<SyncReport>> {
        match self.sync(now) {
            SyncOutcome::Synced(report) => Some(report),
            SyncOutcome::NotInitialized => None,
        }
    }

    fn retry_after(report: &SyncReport) -> Option<Duration> {
        report.retry_after
    }
}

/// Syncs allowed back to back before `min_sync_period` applies (upstream's `burstSyncs`, up
/// to 1.33; later releases pace syncs after completion, [`Pacing`]).
pub(crate) const BURST_SYNCS: u32 = 2;
/// The runner's maximum interval: the canary monitor, not the runner, triggers periodic
/// resyncs, so this only needs to be long (upstream uses an hour too).
pub(crate) const MAX_INTERVAL: Duration = Duration::from_secs(3600);

/// How the release paces syncs: a burst of two up to 1.33, one `minSyncPeriod` after the
/// end of the last sync from 1.34.
fn sync_pacing(release: Release) -> Pacing {
    if release.paces_syncs_after_completion() { Pacing::AfterCompletion } else { Pacing::Burst(BURST_SYNCS) }
}

impl LoopProxier for NftablesProxier {
    type Report = NftSyncReport;

    fn family(&self) -> IpFamily {
        NftablesProxier::family(self)
    }

    fn release(&self) -> Release {
        self.config().render.features.release
    }

    fn recorder(&self) -> Arc<ChangeRecorder> {
        NftablesProxier::recorder(self)
    }

    fn force_full_sync(&self) {
        NftablesProxier::force_full_sync(self)
    }

    fn sync_once(&mut self, now: Instant) -> Option<Box<NftSyncReport>> {
        match self.sync(now) {
            NftSyncOutcome::Synced(report) => Some(report),
            NftSyncOutcome::NotInitialized => None,
        }
    }

    fn retry_after(report: &NftSyncReport) -> Option<Duration> {
        report.retry_after
    }
}

/// A proxier shared by its sync loop and whoever syncs it by hand (tests).
pub type Shared<P> = Arc<Mutex<P>>;
/// An iptables proxier and its sync loop.
pub type SharedProxier = Shared<Proxier>;

/// Locks the proxier; a poisoned lock (a panic mid-sync) still yields the proxier, and the
/// next sync is forced full so the kernel is rewritten from a known state.
pub fn lock<P: LoopProxier>(proxier: &Mutex<P>) -> MutexGuard<'_, P> {
    proxier.lock().unwrap_or_else(|poisoned: PoisonError<MutexGuard<'_, P>>| {
        let guard = poisoned.into_inner();
        guard.force_full_sync();
        guard
    })
}

/// The jumps the canary monitor watches beyond the canaries, one per table we write: a flush
/// of just that table (`iptables -t nat -F`) removes it while the canaries stay.
pub(crate) fn sentinel_jumps() -> Vec<Sentinel> {
    [(Table::Nat, CHAIN_PREROUTING, KUBE_SERVICES), (Table::Filter, CHAIN_FORWARD, KUBE_FORWARD)]
        .iter()
        .filter_map(|&(table, src, dst)| JUMP_CHAINS.iter().find(|j| j.table == table && j.src == src && j.dst == dst))
        .map(|j| Sentinel {
            table: j.table,
            chain: j.src.to_string(),
            args: j.args().iter().map(|a| a.to_string()).collect(),
        })
        .collect()
}

/// One proxier's runner and, in iptables mode, its canary monitor.
pub struct SyncLoop<P: LoopProxier> {
    proxier: Shared<P>,
    runner: BoundedFrequencyRunner,
    monitor: Option<CanaryMonitor>,
}

impl SyncLoop<Proxier> {
    /// `min_sync_period` bounds how often syncs run; `sync_period` is how often the canary
    /// is checked (and the retry delay after a failed sync, which the proxier reports).
    pub fn new(
        proxier: SharedProxier,
        iptables: Arc<dyn Iptables>,
        min_sync_period: Duration,
        sync_period: Duration,
    ) -> Result<SyncLoop<Proxier>, RunnerError> {
        let pacing = sync_pacing(lock(&proxier).config().render.features.release);
        let runner = BoundedFrequencyRunner::new("sync-runner", min_sync_period, MAX_INTERVAL, pacing)?;
        let monitor = CanaryMonitor::new(iptables, KUBE_PROXY_CANARY, &CANARY_TABLES, sync_period)
            .with_sentinels(sentinel_jumps());
        Ok(SyncLoop { proxier, runner, monitor: Some(monitor) })
    }
}

impl<P: LoopProxier> SyncLoop<P> {
    /// A loop with no canary: syncs run at most every `min_sync_period` and at least every
    /// `max_interval` (nftables mode: upstream's runner runs a sync every `syncPeriod` from
    /// 1.34, every hour before).
    pub fn without_canary(
        proxier: Shared<P>,
        min_sync_period: Duration,
        max_interval: Duration,
    ) -> Result<SyncLoop<P>, RunnerError> {
        let pacing = sync_pacing(lock(&proxier).release());
        let runner = BoundedFrequencyRunner::new("sync-runner", min_sync_period, max_interval, pacing)?;
        Ok(SyncLoop { proxier, runner, monitor: None })
    }

    /// What event handlers call to ask for a sync.
    pub fn handle(&self) -> RunnerHandle {
        self.runner.handle()
    }

    pub fn proxier(&self) -> Shared<P> {
        self.proxier.clone()
    }

    /// Runs until `shutdown`; `on_report` sees every sync's report (metrics, health). On the
    /// way out the canaries are removed and the service rules are left in place.
    ///
    /// A sync that panics ends the loop with [`SyncPanicked`]: the proxier's state is not
    /// trusted after it (upstream's process would have crashed), and the daemon exits so the
    /// pod restarts with a clean one.
    pub async fn run(
        self,
        shutdown: CancellationToken,
        on_report: impl Fn(&P::Report) + Send + Sync + 'static,
    ) -> Result<(), SyncPanicked> {
        self.run_observed(shutdown, || (), move |report, ()| on_report(report)).await
    }

    /// [`Self::run`], with `on_start` called on the sync's thread just before each sync takes
    /// its pending changes; what it returns goes to `on_report` with that sync's report (the
    /// daemon's health marks which queued updates a sync can have written).
    pub async fn run_observed<T: Send + 'static>(
        self,
        shutdown: CancellationToken,
        on_start: impl Fn() -> T + Send + Sync + 'static,
        on_report: impl Fn(&P::Report, T) + Send + Sync + 'static,
    ) -> Result<(), SyncPanicked> {
        let SyncLoop { proxier, runner, monitor } = self;
        // Cancelled on shutdown, or by this loop itself after a panicking sync.
        let stop = shutdown.child_token();
        let panicked: Arc<std::sync::Mutex<Option<String>>> = Arc::default();
        let handle = runner.handle();
        let (recorder, family) = {
            let p = lock(&proxier);
            (p.recorder(), p.family())
        };
        // Every log line of a family's syncs and canary checks carries the family (dual-stack
        // nodes run two of these loops side by side).
        let canary_span = tracing::info_span!("canary", family = %family);
        let monitor_task = monitor.map(|monitor| {
            tokio::spawn(
                monitor
                    .run(stop.clone(), move || {
                        tracing::info!("iptables were flushed from outside; forcing a full resync");
                        recorder.resync_from_kernel();
                        handle.run();
                    })
                    .instrument(canary_span),
            )
        });
        // The first sync happens as soon as the loop starts (and is full).
        runner.handle().run();
        let on_report = Arc::new(on_report);
        let on_start = Arc::new(on_start);
        runner
            .run_loop(stop.clone(), || {
                let proxier = proxier.clone();
                let on_report = on_report.clone();
                let on_start = on_start.clone();
                let stop = stop.clone();
                let panicked = panicked.clone();
                async move {
                    let outcome = tokio::task::spawn_blocking(move || {
                        let _span = tracing::info_span!("sync", family = %family).entered();
                        let started = on_start();
                        lock(&proxier).sync_once(Instant::now()).map(|report| (report, started))
                    })
                    .await;
                    match outcome {
                        Ok(Some((report, started))) => {
                            on_report(&report, started);
                            P::retry_after(&report)
                        }
                        Ok(None) => None,
                        Err(e) if e.is_panic() => {
                            let message = panic_message(e.into_panic());
                            tracing::error!(family = %family, panic = %message, "a sync panicked; stopping this family's sync loop");
                            *panicked.lock().unwrap_or_else(PoisonError::into_inner) = Some(message);
                            stop.cancel();
                            None
                        }
                        Err(e) => {
                            tracing::error!(error = %e, "sync task failed");
                            Some(Duration::from_secs(1))
                        }
                    }
                }
            })
            .await;
        if let Some(task) = monitor_task
            && let Err(e) = task.await
        {
            tracing::error!(error = %e, "canary monitor task failed");
        }
        let panicked = panicked.lock().unwrap_or_else(PoisonError::into_inner).take();
        match panicked {
            Some(message) => Err(SyncPanicked { family, message }),
            None => Ok(()),
        }
    }
}

/// A family's sync loop stopped because a sync panicked.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("a {family} sync panicked: {message}")]
pub struct SyncPanicked {
    pub family: IpFamily,
    pub message: String,
}

/// The text of a panic's payload (`panic!` with a literal or a formatted message).
pub(crate) fn panic_message(payload: Box<dyn std::any::Any + Send>) -> String {
    match payload.downcast::<String>() {
        Ok(s) => *s,
        Err(payload) => match payload.downcast::<&'static str>() {
            Ok(s) => (*s).to_string(),
            Err(_) => "(no message)".to_string(),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Both sentinels must match a jump the proxier really writes (a renamed chain would
    /// silently drop one).
    #[test]
    fn sentinels_are_the_proxiers_own_jumps() {
        let s = sentinel_jumps();
        assert_eq!(s.len(), 2, "{s:?}");
        assert_eq!((s[0].table, s[0].chain.as_str()), (Table::Nat, "PREROUTING"));
        assert_eq!(s[0].args.join(" "), "-m comment --comment kubernetes service portals -j KUBE-SERVICES");
        assert_eq!((s[1].table, s[1].chain.as_str()), (Table::Filter, "FORWARD"));
        assert_eq!(s[1].args.last().map(String::as_str), Some("KUBE-FORWARD"));
    }

    #[test]
    fn syncs_are_paced_as_the_release_paces_them() {
        for release in Release::all() {
            let want = if release.minor() >= 34 { Pacing::AfterCompletion } else { Pacing::Burst(2) };
            assert_eq!(sync_pacing(release), want, "{release}");
        }
    }
}
