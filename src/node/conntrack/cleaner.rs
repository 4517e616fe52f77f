//! Conntrack cleanup off the sync's critical path.
//!
//! Upstream deletes stale entries at the end of `syncProxyRules`, after the restore, so every
//! later change waits for it; on a node with a large UDP table that wait was seconds (the
//! tool walked the table once per stale filter). Here a successful sync only describes what
//! it made stale, as a [`CleanupJob`] built from its results (the service and endpoint maps
//! and update results, which an nftables proxier has too, nothing of iptables), and hands it
//! to its family's [`ConntrackCleaner`], a thread that runs cleanups one after the other
//! while later syncs go on:
//!
//! * 1.29–1.31 ([`CleanupWork::Requests`]): upstream's per-change deletions; jobs that arrive
//!   while one runs are queued together (in order, without repeats) and run as one.
//! * 1.32+ ([`CleanupWork::Reconcile`]): the state after the sync ([`ServingFrontends`]); the
//!   reconciler is state-based, so of the jobs waiting only the newest state counts. Every
//!   successful sync hands its state; only one whose endpoint changes call for it (upstream's
//!   `ConntrackCleanupRequired`) starts a reconciliation, the others keep a waiting one
//!   current.
//!
//! Upstream's guarantee holds: a job exists only once the sync's rules are in the kernel, so
//! a flow to a removed endpoint is deleted after the rules that stop new ones. The
//! reconciler adds one check of its own: entries are judged against the state of the rules
//! that were in the kernel while they were listed. A proxier counts the rule writes it starts
//! ([`RuleWrites`]) and each job carries the count of its sync; when a later write began
//! before the listing ended, a new endpoint's first flows could already be in the listing and
//! would look stale to the older state, so the cleaner judges them by the newer state once
//! that sync hands it (or, if that write failed, by the next successful one) instead.
//!
//! Stopping never waits for a cleanup: [`ConntrackCleaner::stop`] returns at once and the
//! thread ends at its next step (a listing or a batch takes well under a second at 250k
//! entries; the 1.29 requests are bounded by the tool's timeout).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use super::reconciler::{ReconcileSummary, delete_stale, list_udp};
use super::{CleanupSummary, ClearRequest, Conntrack, ServingFrontends, run_requests, stale_requests};
use crate::compat::Release;
use crate::model::IpFamily;
use crate::tracker::{EndpointsMap, EndpointsUpdateResult, ServicePortMap, ServiceUpdateResult};

/// Counts the rule writes (restores) a proxier has begun, shared with its cleaner.
#[derive(Debug, Default)]
pub struct RuleWrites(AtomicU64);

impl RuleWrites {
    pub fn new() -> Arc<RuleWrites> {
        Arc::default()
    }

    /// A write of the rules begins now; its number (what its job carries).
    pub fn begin(&self) -> u64 {
        self.0.fetch_add(1, Ordering::SeqCst) + 1
    }

    /// The number of the last write begun.
    pub fn current(&self) -> u64 {
        self.0.load(Ordering::SeqCst)
    }
}

/// What a successful sync leaves for the conntrack cleanup.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CleanupWork {
    /// 1.29–1.31: upstream's per-change deletions, in its order.
    Requests(Vec<ClearRequest>),
    /// 1.32+: the UDP frontends and their serving backends after the sync. `required`: the
    /// sync's endpoint changes call for a reconciliation; otherwise the state only replaces
    /// the one a waiting reconciliation holds.
    Reconcile { frontends: ServingFrontends, required: bool },
}

/// One sync's cleanup: its family, the rule write it follows and the work.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CleanupJob {
    pub family: IpFamily,
    /// The [`RuleWrites`] number of the sync's restore.
    pub rules: u64,
    pub work: CleanupWork,
}

impl CleanupJob {
    /// What the sync of `family` numbered `rules` leaves, from its maps after the sync and
    /// its update results; `None` when a 1.29–1.31 sync made nothing stale.
    pub fn after_sync(
        release: Release,
        family: IpFamily,
        rules: u64,
        services: &ServicePortMap,
        endpoints: &EndpointsMap,
        service_update: &ServiceUpdateResult,
        endpoints_update: &EndpointsUpdateResult,
    ) -> Option<CleanupJob> {
        let work = if release.has_conntrack_reconciler() {
            CleanupWork::Reconcile {
                frontends: ServingFrontends::for_release(release, family, services, endpoints),
                required: endpoints_update.conntrack_cleanup_required,
            }
        } else {
            let requests = stale_requests(family, services, service_update, endpoints_update);
            if requests.is_empty() {
                return None;
            }
            CleanupWork::Requests(requests)
        };
        Some(CleanupJob { family, rules, work })
    }

    /// Whether running it does anything (a state that is not required does not).
    pub fn starts_work(&self) -> bool {
        match &self.work {
            CleanupWork::Requests(requests) => !requests.is_empty(),
            CleanupWork::Reconcile { required, .. } => *required,
        }
    }

    /// Runs the job here and now, with no other sync around (tests and tools; the daemon
    /// hands jobs to a [`ConntrackCleaner`]).
    pub fn run(&self, ct: &dyn Conntrack) -> Option<CleanupRun> {
        let started = Instant::now();
        let outcome = match &self.work {
            CleanupWork::Requests(requests) => CleanupOutcome::Requests(run_requests(ct, self.family, requests)),
            CleanupWork::Reconcile { required: false, .. } => return None,
            CleanupWork::Reconcile { frontends, required: true } => match list_udp(ct, self.family) {
                Some(entries) => CleanupOutcome::Reconciled(delete_stale(ct, frontends, &entries)),
                None => CleanupOutcome::Reconciled(ReconcileSummary::default()),
            },
        };
        Some(CleanupRun { family: self.family, elapsed: started.elapsed(), outcome })
    }
}

/// One run of a cleanup.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CleanupRun {
    pub family: IpFamily,
    /// From the start of the run (its last listing, for a reconciliation) to its end.
    pub elapsed: Duration,
    pub outcome: CleanupOutcome,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CleanupOutcome {
    Requests(CleanupSummary),
    Reconciled(ReconcileSummary),
}

/// A reconciler run for its metrics (1.33+): observed only when it could list the table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConntrackReconcile {
    pub elapsed: Duration,
    pub deleted: u64,
}

impl CleanupRun {
    /// The reconciler's figures, when this was a reconciliation that listed the table.
    pub fn reconcile(&self) -> Option<ConntrackReconcile> {
        match &self.outcome {
            CleanupOutcome::Reconciled(summary) if summary.listed => {
                Some(ConntrackReconcile { elapsed: self.elapsed, deleted: summary.deleted })
            }
            _ => None,
        }
    }
}

/// A reconciliation waiting to run, with the newest state handed so far.
#[derive(Debug)]
struct PendingReconcile {
    rules: u64,
    frontends: ServingFrontends,
    /// Its state was found older than the rules in the kernel: it waits for a newer one.
    deferred: bool,
}

#[derive(Debug, Default)]
struct State {
    requests: Vec<ClearRequest>,
    reconcile: Option<PendingReconcile>,
    /// The newest reconciler state handed (required or not).
    latest: Option<(u64, ServingFrontends)>,
    running: bool,
    stopping: bool,
    /// Runs finished so far.
    runs: u64,
}

#[derive(Debug, Default)]
struct Shared {
    state: Mutex<State>,
    changed: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// What the cleaner tells about each run (the daemon records the reconciler's metrics).
pub type OnCleanupRun = Arc<dyn Fn(&CleanupRun) + Send + Sync>;

/// One family's conntrack cleanup, on a thread of its own. See the module docs.
#[derive(Debug)]
pub struct ConntrackCleaner {
    family: IpFamily,
    shared: Arc<Shared>,
}

impl ConntrackCleaner {
    /// Starts the cleaner of `family`'s proxier, whose rule writes `rules` counts.
    pub fn start(
        family: IpFamily,
        ct: Arc<dyn Conntrack>,
        rules: Arc<RuleWrites>,
        on_run: OnCleanupRun,
    ) -> std::io::Result<ConntrackCleaner> {
        let shared = Arc::new(Shared::default());
        let worker = Worker { family, ct, rules, on_run, shared: shared.clone() };
        std::thread::Builder::new().name(format!("conntrack-cleanup-{}", family.api_name())).spawn(move || {
            let _span = tracing::info_span!("conntrack cleanup", family = %family).entered();
            worker.run();
        })?;
        Ok(ConntrackCleaner { family, shared })
    }

    /// Takes one sync's job; returns at once. Requests join those waiting; a state replaces
    /// the waiting one.
    pub fn submit(&self, job: CleanupJob) {
        if job.family != self.family {
            tracing::error!(family = %self.family, job = %job.family, "a cleanup job of another family; ignored");
            return;
        }
        let mut state = self.shared.lock();
        match job.work {
            CleanupWork::Requests(requests) => {
                for request in requests {
                    if !state.requests.contains(&request) {
                        state.requests.push(request);
                    }
                }
            }
            CleanupWork::Reconcile { frontends, required } => {
                if state.latest.as_ref().is_none_or(|(rules, _)| *rules <= job.rules) {
                    state.latest = Some((job.rules, frontends.clone()));
                }
                match &mut state.reconcile {
                    Some(pending) if pending.rules <= job.rules => {
                        *pending = PendingReconcile { rules: job.rules, frontends, deferred: false };
                    }
                    Some(_) => {}
                    None if required => {
                        state.reconcile = Some(PendingReconcile { rules: job.rules, frontends, deferred: false });
                    }
                    None => {}
                }
            }
        }
        drop(state);
        self.shared.changed.notify_all();
    }

    /// Nothing is running or waiting to run (a deferred reconciliation is waiting).
    pub fn is_idle(&self) -> bool {
        let state = self.shared.lock();
        !state.running && state.requests.is_empty() && state.reconcile.is_none()
    }

    /// Whether a run is under way.
    pub fn is_running(&self) -> bool {
        self.shared.lock().running
    }

    /// How many runs have finished.
    pub fn runs(&self) -> u64 {
        self.shared.lock().runs
    }

    /// Stops the thread after its current step; never waits for it.
    pub fn stop(&self) {
        self.shared.lock().stopping = true;
        self.shared.changed.notify_all();
    }
}

impl Drop for ConntrackCleaner {
    fn drop(&mut self) {
        self.stop();
    }
}

struct Worker {
    family: IpFamily,
    ct: Arc<dyn Conntrack>,
    rules: Arc<RuleWrites>,
    on_run: OnCleanupRun,
    shared: Arc<Shared>,
}

/// What the worker took from the queue.
enum Taken {
    Requests(Vec<ClearRequest>),
    Reconcile(u64, ServingFrontends),
}

impl Worker {
    fn run(self) {
        while let Some(taken) = self.next() {
            let started = Instant::now();
            let outcome = match taken {
                Taken::Requests(requests) => {
                    Some((CleanupOutcome::Requests(self.run_requests(&requests)), started.elapsed()))
                }
                Taken::Reconcile(rules, frontends) => {
                    self.reconcile(rules, frontends).map(|(summary, took)| (CleanupOutcome::Reconciled(summary), took))
                }
            };
            let mut state = self.shared.lock();
            state.running = false;
            state.runs += 1;
            drop(state);
            self.shared.changed.notify_all();
            if let Some((outcome, elapsed)) = outcome {
                (self.on_run)(&CleanupRun { family: self.family, elapsed, outcome });
            }
        }
        tracing::debug!("conntrack cleanup stopped");
    }

    /// Waits for work; `None` once stopping.
    fn next(&self) -> Option<Taken> {
        let mut state = self.shared.lock();
        loop {
            if state.stopping {
                return None;
            }
            if !state.requests.is_empty() {
                state.running = true;
                return Some(Taken::Requests(std::mem::take(&mut state.requests)));
            }
            if state.reconcile.as_ref().is_some_and(|r| !r.deferred) {
                let pending = state.reconcile.take()?;
                state.running = true;
                return Some(Taken::Reconcile(pending.rules, pending.frontends));
            }
            state = self.shared.changed.wait(state).unwrap_or_else(PoisonError::into_inner);
        }
    }

    fn stopping(&self) -> bool {
        self.shared.lock().stopping
    }

    /// Runs the requests in order, stopping early when asked to.
    fn run_requests(&self, requests: &[ClearRequest]) -> CleanupSummary {
        let mut summary = CleanupSummary::default();
        for request in requests {
            if self.stopping() {
                break;
            }
            let done = run_requests(self.ct.as_ref(), self.family, std::slice::from_ref(request));
            summary.requests += done.requests;
            summary.failures += done.failures;
        }
        summary
    }

    /// Lists, makes sure the state judging the listing is that of the rules in the kernel,
    /// deletes the stale entries; the summary and the time from the listing's start. `None`
    /// when stopped or deferred.
    fn reconcile(&self, rules: u64, frontends: ServingFrontends) -> Option<(ReconcileSummary, Duration)> {
        let listing = Instant::now();
        let Some(entries) = list_udp(self.ct.as_ref(), self.family) else {
            return Some((ReconcileSummary::default(), listing.elapsed()));
        };
        let mut judge = frontends;
        let current = self.rules.current();
        if current != rules {
            let mut state = self.shared.lock();
            match &state.latest {
                // The sync whose write began before the listing ended has handed its state.
                Some((latest, newer)) if *latest == current => {
                    tracing::debug!(judged = rules, now = current, "judging the listing by the newer sync's state");
                    judge = newer.clone();
                    // A reconciliation that sync asked for is this one.
                    if state.reconcile.as_ref().is_some_and(|p| p.rules <= current) {
                        state.reconcile = None;
                    }
                }
                // Still writing (or that write failed): wait for the state of the rules that
                // will be in the kernel, and list again then.
                _ => {
                    tracing::debug!(judged = rules, now = current, "rules changed during the listing; deferring");
                    if state.reconcile.is_none() {
                        state.reconcile = Some(PendingReconcile { rules, frontends: judge, deferred: true });
                    }
                    return None;
                }
            }
        }
        if self.stopping() {
            return None;
        }
        let summary = delete_stale(self.ct.as_ref(), &judge, &entries);
        Some((summary, listing.elapsed()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compat::Features;
    use crate::model::Protocol;
    use crate::node::conntrack::{ConntrackEntry, FakeConntrack};
    use crate::tracker::testing::{slice, svc};
    use crate::tracker::{EndpointChangeTracker, ServiceChangeTracker};

    const DNS_IP: &str = "172.30.0.10";

    /// dns (UDP 53) served by `endpoints` on 5353: the frontends a 1.35 sync hands over.
    fn frontends(endpoints: &[&str]) -> ServingFrontends {
        let mut services = ServiceChangeTracker::new(IpFamily::V4, Features::of(Release::V1_35));
        services.update(None, Some(&svc("ns", "dns").bare_cluster_ip(DNS_IP).udp("dns", 53).build()));
        let mut eps = EndpointChangeTracker::new("node", IpFamily::V4);
        eps.endpoint_slice_update(&slice("ns", "dns", "dns-1").udp("dns", 5353).ips(endpoints).build(), false);
        let (mut service_map, mut endpoints_map) = (ServicePortMap::new(), EndpointsMap::new());
        service_map.update(&mut services);
        endpoints_map.update(&mut eps);
        ServingFrontends::new(
            crate::node::conntrack::EndpointMatch::IpAndPort,
            IpFamily::V4,
            &service_map,
            &endpoints_map,
        )
    }

    /// A flow from client port `port` to dns answered by `endpoint`.
    fn flow(port: u16, endpoint: &str) -> ConntrackEntry {
        let client = "10.0.0.50".parse().unwrap();
        ConntrackEntry::new(
            Protocol::Udp,
            (client, port),
            (DNS_IP.parse().unwrap(), 53),
            (endpoint.parse().unwrap(), 5353),
            (client, port),
        )
    }

    fn reconcile_job(rules: u64, endpoints: &[&str], required: bool) -> CleanupJob {
        CleanupJob {
            family: IpFamily::V4,
            rules,
            work: CleanupWork::Reconcile { frontends: frontends(endpoints), required },
        }
    }

    fn request(ip: &str) -> ClearRequest {
        ClearRequest::Ip { ip: ip.into(), protocol: Protocol::Udp }
    }

    fn start(fake: &Arc<FakeConntrack>, rules: &Arc<RuleWrites>) -> (ConntrackCleaner, Arc<Mutex<Vec<CleanupRun>>>) {
        let runs: Arc<Mutex<Vec<CleanupRun>>> = Arc::default();
        let seen = runs.clone();
        let on_run: OnCleanupRun = Arc::new(move |run: &CleanupRun| seen.lock().unwrap().push(run.clone()));
        let cleaner = ConntrackCleaner::start(IpFamily::V4, fake.clone(), rules.clone(), on_run).expect("thread");
        (cleaner, runs)
    }

    fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !done() {
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// Requests handed while a run is under way are run together next, in order and
    /// without repeats among them.
    #[test]
    fn requests_waiting_behind_a_run_are_coalesced() {
        let fake = Arc::new(FakeConntrack::new());
        let rules = RuleWrites::new();
        let (cleaner, runs) = start(&fake, &rules);
        fake.hold();
        let job = |ips: &[&str]| CleanupJob {
            family: IpFamily::V4,
            rules: rules.begin(),
            work: CleanupWork::Requests(ips.iter().map(|ip| request(ip)).collect()),
        };
        cleaner.submit(job(&["10.0.0.1", "10.0.0.2"]));
        wait_for("the first run to block", || fake.waiting() == 1);
        cleaner.submit(job(&["10.0.0.2", "10.0.0.3"]));
        cleaner.submit(job(&["10.0.0.3", "10.0.0.4"]));
        fake.release();
        wait_for("both runs", || cleaner.is_idle() && cleaner.runs() == 2);
        let ips: Vec<_> = fake.calls().iter().map(|r| r.to_string()).collect();
        let want: Vec<_> = ["10.0.0.1", "10.0.0.2", "10.0.0.2", "10.0.0.3", "10.0.0.4"]
            .iter()
            .map(|ip| request(ip).to_string())
            .collect();
        assert_eq!(ips, want);
        let runs = runs.lock().unwrap();
        let counts: Vec<_> = runs
            .iter()
            .map(|r| match &r.outcome {
                CleanupOutcome::Requests(s) => s.requests,
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(counts, [2, 3]);
    }

    /// States handed while a reconciliation lists are not queued one by one: the listing is
    /// judged by the newest, that of the rules in the kernel, and no second run follows.
    #[test]
    fn a_reconciliation_judges_by_the_newest_state() {
        let fake = Arc::new(FakeConntrack::new());
        // Endpoint .1 went away first, then .2 was replaced by .3.
        fake.set_entries(vec![flow(1, "10.1.0.1"), flow(2, "10.1.0.2"), flow(3, "10.1.0.3")]);
        let rules = RuleWrites::new();
        let (cleaner, runs) = start(&fake, &rules);
        fake.hold();
        cleaner.submit(reconcile_job(rules.begin(), &["10.1.0.2", "10.1.0.3"], true));
        wait_for("the listing", || fake.waiting() == 1);
        cleaner.submit(reconcile_job(rules.begin(), &["10.1.0.3"], true));
        cleaner.submit(reconcile_job(rules.begin(), &["10.1.0.3"], false));
        fake.release();
        wait_for("the run", || cleaner.is_idle() && cleaner.runs() >= 1);
        assert_eq!(fake.entries(), [flow(3, "10.1.0.3")]);
        assert_eq!(fake.listings().len(), 1);
        assert_eq!(fake.entry_deletions(), [vec![flow(1, "10.1.0.1"), flow(2, "10.1.0.2")]]);
        assert_eq!(runs.lock().unwrap().len(), 1);
        assert_eq!(runs.lock().unwrap()[0].reconcile().map(|r| r.deleted), Some(2));
    }

    /// A restore that began before the listing ended and has not handed its state yet may
    /// have let a new endpoint's first flows in: nothing is deleted until that state (or,
    /// when that sync failed, a later one) comes; then the table is listed again.
    #[test]
    fn a_listing_overtaken_by_a_rule_write_waits_for_its_state() {
        let fake = Arc::new(FakeConntrack::new());
        let rules = RuleWrites::new();
        let (cleaner, runs) = start(&fake, &rules);
        fake.set_entries(vec![flow(1, "10.1.0.1")]);
        fake.hold();
        cleaner.submit(reconcile_job(rules.begin(), &["10.1.0.1"], true));
        wait_for("the listing", || fake.waiting() == 1);
        // The next sync adds .9, and the first flow to it is made before the listing ends.
        rules.begin();
        fake.set_entries(vec![flow(1, "10.1.0.1"), flow(9, "10.1.0.9")]);
        fake.release();
        wait_for("the run to give up", || !cleaner.is_running() && fake.listings().len() == 1);
        std::thread::sleep(Duration::from_millis(50));
        assert!(fake.entry_deletions().is_empty(), "{:?}", fake.entry_deletions());
        assert!(!cleaner.is_idle(), "it waits for the newer state");
        // That write failed; the next sync (not asking for a cleanup itself) hands its state.
        cleaner.submit(reconcile_job(rules.begin(), &["10.1.0.9"], false));
        wait_for("the run", || cleaner.is_idle());
        assert_eq!(fake.listings().len(), 2);
        assert_eq!(fake.entries(), [flow(9, "10.1.0.9")]);
        assert_eq!(runs.lock().unwrap().len(), 1, "the deferred attempt is not a run");
    }

    #[test]
    fn a_state_alone_starts_nothing() {
        let fake = Arc::new(FakeConntrack::new());
        let rules = RuleWrites::new();
        let (cleaner, _runs) = start(&fake, &rules);
        cleaner.submit(reconcile_job(rules.begin(), &["10.1.0.1"], false));
        std::thread::sleep(Duration::from_millis(50));
        assert!(cleaner.is_idle());
        assert!(fake.listings().is_empty());
    }

    /// Stopping returns at once while a cleanup runs; the run then ends without deleting.
    #[test]
    fn stopping_never_waits_for_a_running_cleanup() {
        let fake = Arc::new(FakeConntrack::new());
        fake.set_entries(vec![flow(1, "10.1.0.1")]);
        let rules = RuleWrites::new();
        let (cleaner, runs) = start(&fake, &rules);
        fake.hold();
        cleaner.submit(reconcile_job(rules.begin(), &["10.1.0.2"], true));
        wait_for("the listing", || fake.waiting() == 1);
        let stopping = Instant::now();
        cleaner.stop();
        assert!(stopping.elapsed() < Duration::from_millis(100));
        assert!(cleaner.is_running());
        fake.release();
        wait_for("the thread to notice", || !cleaner.is_running());
        assert!(fake.entry_deletions().is_empty());
        assert!(runs.lock().unwrap().is_empty());
    }

    #[test]
    fn jobs_follow_the_release() {
        let (services, endpoints) = (ServicePortMap::new(), EndpointsMap::new());
        let (svc_update, mut ep_update) = (ServiceUpdateResult::default(), EndpointsUpdateResult::default());
        let job = |release, ep_update: &EndpointsUpdateResult| {
            CleanupJob::after_sync(release, IpFamily::V4, 7, &services, &endpoints, &svc_update, ep_update)
        };
        // 1.29–1.31: only when there is something to delete.
        assert_eq!(job(Release::V1_31, &ep_update), None);
        // 1.32+: every sync hands its state; only some ask for a run.
        let state = job(Release::V1_32, &ep_update).expect("a state");
        assert_eq!(state.rules, 7);
        assert!(!state.starts_work());
        ep_update.conntrack_cleanup_required = true;
        assert!(job(Release::V1_35, &ep_update).expect("a state").starts_work());
    }
}
