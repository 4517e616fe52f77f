//! The bounded-frequency runner that paces proxier syncs (upstream's
//! `async.BoundedFrequencyRunner`).
//!
//! This module owns two pieces:
//!
//! * [`Schedule`]: the pure decision logic. Given `now`, it says whether a requested run may
//!   happen (up to 1.33 a token bucket allowing `burst` runs, refilled at one run per
//!   `min_interval`; from 1.34 `min_interval` after the last run ended, [`Pacing`])
//!   and when the timer should next fire (at most `max_interval` after the last run, earlier
//!   for a refused request or a retry). No clocks, no tasks: unit tests drive it with
//!   hand-made instants.
//! * [`BoundedFrequencyRunner`]: a thin tokio loop around a [`Schedule`]. [`RunnerHandle::run`]
//!   requests a run (requests made while one is pending coalesce into one),
//!   [`RunnerHandle::retry_after`] asks for a run no later than a delay from now (ignored if
//!   a run is due sooner anyway), and the loop calls the user's function whenever the
//!   schedule allows, until a [`CancellationToken`] fires.
//!
//! Timing follows upstream: the loop does not run at start (callers request the first run);
//! a refused request re-arms the timer for the moment the limiter would allow it; every run
//! re-arms it for `max_interval`; a retry only ever moves the timer earlier.

use std::future::Future;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use crate::time::instant_after;

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RunnerError {
    #[error("{name}: max interval ({max:?}) must be >= min interval ({min:?})")]
    IntervalOrder { name: String, min: Duration, max: Duration },
    #[error("{name}: burst must be at least 1")]
    ZeroBurst { name: String },
}

/// A token bucket holding up to `burst` tokens, refilled at one token per `period`, kept as
/// exact nanosecond credit (one token = `period` of credit) so that "one period after the
/// bucket emptied" always admits a run, with no float rounding.
#[derive(Debug, Clone)]
struct TokenBucket {
    period: Duration,
    capacity: Duration,
    credit: Duration,
    updated: Instant,
}

impl TokenBucket {
    fn new(period: Duration, burst: u32, now: Instant) -> Self {
        let capacity = period.saturating_mul(burst);
        TokenBucket { period, capacity, credit: capacity, updated: now }
    }

    fn refill(&mut self, now: Instant) {
        let elapsed = now.saturating_duration_since(self.updated);
        self.credit = self.credit.saturating_add(elapsed).min(self.capacity);
        self.updated = self.updated.max(now);
    }

    fn try_accept(&mut self, now: Instant) -> bool {
        self.refill(now);
        if self.credit >= self.period {
            self.credit -= self.period;
            true
        } else {
            false
        }
    }

    /// How long until a token is available (zero if one is).
    fn wait(&mut self, now: Instant) -> Duration {
        self.refill(now);
        self.period.saturating_sub(self.credit)
    }
}

/// How `min_interval` spaces runs: upstream changed it in 1.34.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pacing {
    /// Up to 1.33 (`async.BoundedFrequencyRunner`): up to this many runs back to back, then
    /// one per `min_interval`, counted from run start to run start (a token bucket).
    Burst(u32),
    /// From 1.34 (`pkg/proxy/runner`, PR #131615): `min_interval` from the end of one run to
    /// the start of the next, with no burst.
    AfterCompletion,
}

/// What holds a requested run back, from the [`Pacing`] and `min_interval`.
#[derive(Debug, Clone)]
enum Spacing {
    /// Nothing: a burst pacing with a zero `min_interval`.
    Free,
    Bucket(TokenBucket),
    AfterCompletion,
}

/// The pure scheduling state of a bounded-frequency runner. See the module docs.
#[derive(Debug, Clone)]
pub(crate) struct Schedule {
    min_interval: Duration,
    max_interval: Duration,
    spacing: Spacing,
    /// When the last run finished.
    last_run: Option<Instant>,
    deadline: Instant,
}

impl Schedule {
    /// A schedule whose timer first fires `max_interval` after `now`.
    pub fn new(
        name: &str,
        min_interval: Duration,
        max_interval: Duration,
        pacing: Pacing,
        now: Instant,
    ) -> Result<Self, RunnerError> {
        if max_interval < min_interval {
            return Err(RunnerError::IntervalOrder { name: name.to_string(), min: min_interval, max: max_interval });
        }
        let spacing = match pacing {
            Pacing::Burst(0) => return Err(RunnerError::ZeroBurst { name: name.to_string() }),
            Pacing::Burst(_) if min_interval.is_zero() => Spacing::Free,
            Pacing::Burst(burst) => Spacing::Bucket(TokenBucket::new(min_interval, burst, now)),
            Pacing::AfterCompletion => Spacing::AfterCompletion,
        };
        Ok(Schedule { min_interval, max_interval, spacing, last_run: None, deadline: instant_after(now, max_interval) })
    }

    /// When the timer next fires.
    pub fn deadline(&self) -> Instant {
        self.deadline
    }

    /// A run was requested (or the timer fired) at `now`. `true`: run now, then call
    /// [`Schedule::ran`]. `false`: the timer was re-armed for when a run will be allowed.
    pub(crate) fn try_run(&mut self, now: Instant) -> bool {
        let limiter = match &mut self.spacing {
            Spacing::Free => return true,
            Spacing::Bucket(limiter) => limiter,
            Spacing::AfterCompletion => {
                let Some(finished) = self.last_run else {
                    return true;
                };
                let allowed = instant_after(finished, self.min_interval);
                if now >= allowed {
                    return true;
                }
                self.deadline = self.deadline.min(allowed);
                tracing::trace!(wait = ?allowed.saturating_duration_since(now), "run deferred until min interval after the last");
                return false;
            }
        };
        if limiter.try_accept(now) {
            return true;
        }
        let since_last = self.last_run.map_or(Duration::MAX, |t| now.saturating_duration_since(t));
        let possible = self.min_interval.saturating_sub(since_last).max(limiter.wait(now));
        let scheduled = self.deadline.saturating_duration_since(now);
        let next = possible.min(scheduled);
        tracing::trace!(?since_last, ?possible, ?scheduled, "run refused by rate limit");
        self.deadline = now + next;
        false
    }

    /// The function finished at `now`: the timer is re-armed for `max_interval`.
    pub fn ran(&mut self, now: Instant) {
        self.last_run = Some(now);
        self.deadline = instant_after(now, self.max_interval);
    }

    /// A retry was requested for `at`; it moves the timer earlier, never later.
    pub fn retry(&mut self, now: Instant, at: Instant) {
        let at = at.max(now);
        if at < self.deadline {
            self.deadline = at;
        }
    }
}

/// Requests recorded by handles, taken by the loop.
#[derive(Debug, Default)]
struct Requests {
    run: bool,
    retry_at: Option<Instant>,
}

#[derive(Debug, Default)]
struct Shared {
    requests: Mutex<Requests>,
    wake: Notify,
}

impl Shared {
    fn take(&self) -> Requests {
        std::mem::take(&mut *self.requests.lock().unwrap_or_else(PoisonError::into_inner))
    }
}

/// The current time on tokio's clock (virtual when the clock is paused in tests).
fn now() -> Instant {
    tokio::time::Instant::now().into_std()
}

/// Requests runs of a [`BoundedFrequencyRunner`]; cheap to clone, never blocks, usable from
/// any thread (including from inside the running function).
#[derive(Debug, Clone)]
pub struct RunnerHandle {
    shared: Arc<Shared>,
}

impl RunnerHandle {
    /// Asks for a run as soon as the rate limit allows. Requests coalesce.
    pub fn run(&self) {
        self.shared.requests.lock().unwrap_or_else(PoisonError::into_inner).run = true;
        self.shared.wake.notify_one();
    }

    /// Asks for a run no later than `delay` from now (the earliest of pending retries wins).
    pub fn retry_after(&self, delay: Duration) {
        let at = instant_after(now(), delay);
        {
            let mut requests = self.shared.requests.lock().unwrap_or_else(PoisonError::into_inner);
            requests.retry_at = Some(requests.retry_at.map_or(at, |t| t.min(at)));
        }
        self.shared.wake.notify_one();
    }
}

/// Calls a function at most as often as its [`Pacing`] and `min_interval` allow,
/// and at least once per `max_interval`. See the module docs.
#[derive(Debug)]
pub struct BoundedFrequencyRunner {
    name: String,
    min_interval: Duration,
    max_interval: Duration,
    pacing: Pacing,
    shared: Arc<Shared>,
}

impl BoundedFrequencyRunner {
    pub fn new(
        name: impl Into<String>,
        min_interval: Duration,
        max_interval: Duration,
        pacing: Pacing,
    ) -> Result<Self, RunnerError> {
        let name = name.into();
        // Validate now rather than when the loop starts.
        Schedule::new(&name, min_interval, max_interval, pacing, Instant::now())?;
        Ok(BoundedFrequencyRunner { name, min_interval, max_interval, pacing, shared: Arc::default() })
    }

    pub fn handle(&self) -> RunnerHandle {
        RunnerHandle { shared: self.shared.clone() }
    }

    /// Runs until `shutdown` is cancelled. `f` is called whenever the schedule allows; the
    /// duration it returns, if any, requests a retry that long after it finished (as
    /// [`RunnerHandle::retry_after`] would). A call in progress is finished before shutdown.
    pub(crate) async fn run_loop<F, Fut>(self, shutdown: CancellationToken, mut f: F)
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Option<Duration>>,
    {
        let mut schedule = match Schedule::new(&self.name, self.min_interval, self.max_interval, self.pacing, now()) {
            Ok(s) => s,
            Err(e) => {
                // `new` validated the same parameters; keep the loop total anyway.
                tracing::error!(runner = %self.name, error = %e, "invalid runner parameters");
                return;
            }
        };
        tracing::debug!(runner = %self.name, min = ?self.min_interval, max = ?self.max_interval, pacing = ?self.pacing, "loop running");
        loop {
            let requests = self.shared.take();
            if requests.run {
                self.attempt(&mut schedule, &mut f).await;
            }
            if let Some(at) = requests.retry_at {
                schedule.retry(now(), at);
            }
            let deadline = tokio::time::Instant::from_std(schedule.deadline());
            tokio::select! {
                biased;
                () = shutdown.cancelled() => {
                    tracing::debug!(runner = %self.name, "loop stopping");
                    return;
                }
                () = self.shared.wake.notified() => {}
                () = tokio::time::sleep_until(deadline) => {
                    self.attempt(&mut schedule, &mut f).await;
                }
            }
        }
    }

    async fn attempt<F, Fut>(&self, schedule: &mut Schedule, f: &mut F)
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Option<Duration>>,
    {
        let started = now();
        if !schedule.try_run(started) {
            tracing::trace!(runner = %self.name, next_in = ?schedule.deadline().saturating_duration_since(started), "run deferred");
            return;
        }
        let retry = f().await;
        let finished = now();
        schedule.ran(finished);
        if let Some(delay) = retry {
            schedule.retry(finished, instant_after(finished, delay));
        }
        tracing::trace!(
            runner = %self.name,
            took = ?finished.saturating_duration_since(started),
            next_in = ?schedule.deadline().saturating_duration_since(finished),
            "ran"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    fn at(base: Instant, ms: u64) -> Instant {
        base + MS * ms as u32
    }

    #[test]
    fn schedule_rejects_bad_parameters() {
        let t = Instant::now();
        assert!(matches!(Schedule::new("x", MS * 10, MS, Pacing::Burst(1), t), Err(RunnerError::IntervalOrder { .. })));
        assert!(matches!(Schedule::new("x", MS, MS * 10, Pacing::Burst(0), t), Err(RunnerError::ZeroBurst { .. })));
        assert!(BoundedFrequencyRunner::new("x", MS * 2, MS, Pacing::Burst(1)).is_err());
    }

    #[test]
    fn schedule_burst_then_min_interval() {
        let t0 = Instant::now();
        let mut s = Schedule::new("t", MS * 100, MS * 1000, Pacing::Burst(2), t0).expect("valid");
        assert_eq!(s.deadline(), at(t0, 1000));
        // Two runs in a row are allowed.
        assert!(s.try_run(t0));
        s.ran(t0);
        assert!(s.try_run(at(t0, 10)));
        s.ran(at(t0, 10));
        assert_eq!(s.deadline(), at(t0, 1010));
        // The third is deferred a min interval past the last run (a token refilled at 100).
        assert!(!s.try_run(at(t0, 20)));
        assert_eq!(s.deadline(), at(t0, 110));
        assert!(s.try_run(at(t0, 110)));
        s.ran(at(t0, 110));
        // Now at most one per 100ms.
        assert!(!s.try_run(at(t0, 150)));
        assert_eq!(s.deadline(), at(t0, 210));
        assert!(s.try_run(at(t0, 210)));
    }

    #[test]
    fn schedule_after_completion_counts_from_the_end_of_a_run() {
        let t0 = Instant::now();
        let mut s = Schedule::new("t", MS * 100, MS * 1000, Pacing::AfterCompletion, t0).expect("valid");
        assert!(s.try_run(t0), "the first run is not held back");
        s.ran(at(t0, 50)); // a run of 50 ms
        // No burst: the next waits until 100 ms after the end, not after the start.
        assert!(!s.try_run(at(t0, 60)));
        assert_eq!(s.deadline(), at(t0, 150));
        assert!(!s.try_run(at(t0, 149)));
        assert!(s.try_run(at(t0, 150)));
        s.ran(at(t0, 400)); // a run longer than the min interval
        assert!(!s.try_run(at(t0, 401)), "even a long run is followed by the min interval");
        assert_eq!(s.deadline(), at(t0, 500));
        // The periodic timer is not pushed later by a deferral.
        let mut s = Schedule::new("t", MS * 100, MS * 100, Pacing::AfterCompletion, t0).expect("valid");
        s.ran(at(t0, 10));
        assert!(!s.try_run(at(t0, 20)));
        assert_eq!(s.deadline(), at(t0, 110));
        // A zero min interval never holds a run back; an absurd one does not overflow.
        let mut s = Schedule::new("t", Duration::ZERO, MS * 10, Pacing::AfterCompletion, t0).expect("valid");
        s.ran(t0);
        assert!(s.try_run(t0));
        let mut s = Schedule::new("t", Duration::MAX, Duration::MAX, Pacing::AfterCompletion, t0).expect("valid");
        s.ran(t0);
        assert!(!s.try_run(at(t0, 1000)));
    }

    #[test]
    fn schedule_deferral_never_later_than_timer() {
        let t0 = Instant::now();
        let mut s = Schedule::new("t", MS * 100, MS * 100, Pacing::Burst(1), t0).expect("valid");
        assert!(s.try_run(t0));
        s.ran(at(t0, 50)); // a slow run: timer at 150
        assert!(!s.try_run(at(t0, 60)));
        // The limiter allows at 100, the min interval since the end of the run at 150.
        assert_eq!(s.deadline(), at(t0, 150));
    }

    #[test]
    fn schedule_zero_min_interval_always_runs() {
        let t0 = Instant::now();
        let mut s = Schedule::new("t", Duration::ZERO, MS * 10, Pacing::Burst(1), t0).expect("valid");
        for i in 0..5 {
            assert!(s.try_run(at(t0, i)));
            s.ran(at(t0, i));
        }
        assert_eq!(s.deadline(), at(t0, 14));
    }

    #[test]
    fn absurd_durations_do_not_overflow() {
        let t0 = Instant::now();
        let mut s = Schedule::new("t", Duration::MAX, Duration::MAX, Pacing::Burst(1), t0).expect("valid");
        assert!(s.deadline() > t0);
        assert!(s.try_run(t0));
        s.ran(t0);
        assert!(!s.try_run(t0));
        s.retry(t0, instant_after(t0, Duration::MAX));
    }

    #[test]
    fn schedule_retry_only_moves_earlier() {
        let t0 = Instant::now();
        let mut s = Schedule::new("t", MS, MS * 1000, Pacing::Burst(1), t0).expect("valid");
        s.retry(t0, at(t0, 2000));
        assert_eq!(s.deadline(), at(t0, 1000));
        s.retry(t0, at(t0, 300));
        assert_eq!(s.deadline(), at(t0, 300));
        s.retry(at(t0, 10), t0); // in the past: fire now
        assert_eq!(s.deadline(), at(t0, 10));
    }

    /// Spawns a runner whose function records the (virtual) time of each call since start.
    fn spawn_recording(
        min: Duration,
        max: Duration,
        burst: u32,
        retry: Option<Duration>,
    ) -> (RunnerHandle, Arc<Mutex<Vec<Duration>>>, CancellationToken, tokio::task::JoinHandle<()>) {
        spawn_paced(min, max, Pacing::Burst(burst), retry)
    }

    /// [`spawn_recording`] with any pacing.
    fn spawn_paced(
        min: Duration,
        max: Duration,
        pacing: Pacing,
        retry: Option<Duration>,
    ) -> (RunnerHandle, Arc<Mutex<Vec<Duration>>>, CancellationToken, tokio::task::JoinHandle<()>) {
        let runner = BoundedFrequencyRunner::new("test", min, max, pacing).expect("valid");
        let handle = runner.handle();
        let calls = Arc::new(Mutex::new(Vec::new()));
        let shutdown = CancellationToken::new();
        let start = tokio::time::Instant::now();
        let log = calls.clone();
        let task = tokio::spawn(runner.run_loop(shutdown.clone(), move || {
            log.lock().expect("lock").push(start.elapsed());
            std::future::ready(retry)
        }));
        (handle, calls, shutdown, task)
    }

    fn secs(list: &[f64]) -> Vec<Duration> {
        list.iter().map(|s| Duration::from_secs_f64(*s)).collect()
    }

    async fn sleep_s(s: f64) {
        tokio::time::sleep(Duration::from_secs_f64(s)).await;
    }

    #[tokio::test(start_paused = true)]
    async fn requests_coalesce_and_respect_min_interval() {
        let (handle, calls, shutdown, task) =
            spawn_recording(Duration::from_secs(1), Duration::from_secs(3600), 1, None);
        sleep_s(0.5).await;
        handle.run();
        handle.run();
        handle.run();
        sleep_s(0.1).await; // t=0.6
        assert_eq!(*calls.lock().expect("lock"), secs(&[0.5]));
        handle.run();
        handle.run();
        sleep_s(2.0).await; // t=2.6
        // Both later requests collapsed into one run, one min interval after the first.
        assert_eq!(*calls.lock().expect("lock"), secs(&[0.5, 1.5]));
        shutdown.cancel();
        task.await.expect("loop ends");
    }

    #[tokio::test(start_paused = true)]
    async fn burst_runs_back_to_back_then_throttles() {
        let (handle, calls, shutdown, task) =
            spawn_recording(Duration::from_secs(1), Duration::from_secs(3600), 2, None);
        for _ in 0..4 {
            handle.run();
            sleep_s(0.1).await;
        }
        sleep_s(3.0).await;
        // 0 and 0.1 use the burst; the later requests coalesce and wait a min interval after the
        // last run (a token has refilled by then too).
        assert_eq!(*calls.lock().expect("lock"), secs(&[0.0, 0.1, 1.1]));
        shutdown.cancel();
        task.await.expect("loop ends");
    }

    #[tokio::test(start_paused = true)]
    async fn after_completion_pacing_has_no_burst() {
        let (handle, calls, shutdown, task) =
            spawn_paced(Duration::from_secs(1), Duration::from_secs(3600), Pacing::AfterCompletion, None);
        for _ in 0..4 {
            handle.run();
            sleep_s(0.1).await;
        }
        sleep_s(3.0).await;
        // Where a burst of 2 ran at 0, 0.1 and 1.1, one run and then one a min interval after.
        assert_eq!(*calls.lock().expect("lock"), secs(&[0.0, 1.0]));
        handle.run();
        sleep_s(0.1).await;
        assert_eq!(*calls.lock().expect("lock"), secs(&[0.0, 1.0, 3.4]), "an idle runner runs at once");
        shutdown.cancel();
        task.await.expect("loop ends");
    }

    #[tokio::test(start_paused = true)]
    async fn max_interval_runs_without_requests() {
        let (_handle, calls, shutdown, task) =
            spawn_recording(Duration::from_secs(1), Duration::from_secs(10), 2, None);
        sleep_s(35.0).await;
        assert_eq!(*calls.lock().expect("lock"), secs(&[10.0, 20.0, 30.0]));
        shutdown.cancel();
        task.await.expect("loop ends");
    }

    #[tokio::test(start_paused = true)]
    async fn retry_returned_by_function() {
        let (handle, calls, shutdown, task) =
            spawn_recording(Duration::from_secs(1), Duration::from_secs(100), 2, Some(Duration::from_secs(5)));
        handle.run();
        sleep_s(12.0).await;
        assert_eq!(*calls.lock().expect("lock"), secs(&[0.0, 5.0, 10.0]));
        shutdown.cancel();
        task.await.expect("loop ends");
    }

    #[tokio::test(start_paused = true)]
    async fn retry_after_from_handle() {
        let (handle, calls, shutdown, task) =
            spawn_recording(Duration::from_secs(1), Duration::from_secs(100), 1, None);
        handle.run();
        sleep_s(1.0).await;
        handle.retry_after(Duration::from_secs(7));
        handle.retry_after(Duration::from_secs(3)); // the earlier one wins
        sleep_s(10.0).await;
        // A retry later than the periodic run changes nothing.
        handle.retry_after(Duration::from_secs(500));
        sleep_s(120.0).await;
        assert_eq!(*calls.lock().expect("lock"), secs(&[0.0, 4.0, 104.0]));
        shutdown.cancel();
        task.await.expect("loop ends");
    }

    #[tokio::test(start_paused = true)]
    async fn shutdown_stops_the_loop() {
        let (handle, calls, shutdown, task) = spawn_recording(Duration::ZERO, Duration::from_secs(1), 1, None);
        shutdown.cancel();
        task.await.expect("loop ends");
        handle.run();
        sleep_s(5.0).await;
        assert!(calls.lock().expect("lock").is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn run_requested_from_inside_the_function() {
        let runner =
            BoundedFrequencyRunner::new("test", Duration::from_secs(2), Duration::from_secs(60), Pacing::Burst(1))
                .expect("ok");
        let handle = runner.handle();
        let inner = handle.clone();
        let calls = Arc::new(Mutex::new(Vec::new()));
        let log = calls.clone();
        let shutdown = CancellationToken::new();
        let start = tokio::time::Instant::now();
        let task = tokio::spawn(runner.run_loop(shutdown.clone(), move || {
            let mut log = log.lock().expect("lock");
            log.push(start.elapsed());
            if log.len() == 1 {
                inner.run();
            }
            std::future::ready(None)
        }));
        handle.run();
        sleep_s(5.0).await;
        assert_eq!(*calls.lock().expect("lock"), secs(&[0.0, 2.0]));
        shutdown.cancel();
        task.await.expect("loop ends");
    }
}
