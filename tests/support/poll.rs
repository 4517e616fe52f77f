//! Waiting until a condition holds: the one polling loop the tests use.
//!
//! Every wait is bounded. [`eventually`] and [`eventually_fast`] fail the test naming what
//! they waited for; [`poll_until`] returns the time it took (or `None`) for callers that
//! measure it or build their own failure message.

use std::time::{Duration, Instant};

/// How often [`eventually`] checks: its checks typically run a tool (`iptables-save` in a
/// namespace, a request to the daemon), which should not hog the shared 2-core machine.
pub const SLOW_POLL: Duration = Duration::from_millis(200);

/// How often [`eventually_fast`] checks: in-memory state (fakes, the test API server) is
/// cheap to look at, and tests waiting on it should not lose time between checks.
pub const FAST_POLL: Duration = Duration::from_millis(20);

/// Checks `check` every `every` until it holds or `limit` has passed; returns how long it
/// took to hold, or `None` when it never did.
pub async fn poll_until(limit: Duration, every: Duration, mut check: impl FnMut() -> bool) -> Option<Duration> {
    // Real time, not tokio's clock: the conditions depend on other processes and threads.
    let start = Instant::now();
    loop {
        if check() {
            return Some(start.elapsed());
        }
        let elapsed = start.elapsed();
        if elapsed >= limit {
            return None;
        }
        tokio::time::sleep(every.min(limit - elapsed)).await;
    }
}

/// Waits (checking every [`SLOW_POLL`]) until `check` holds; fails the test after `limit`.
pub async fn eventually(what: &str, limit: Duration, check: impl FnMut() -> bool) -> Duration {
    eventually_every(what, limit, SLOW_POLL, check).await
}

/// Waits (checking every [`FAST_POLL`]) until `check` holds; fails the test after `limit`.
pub async fn eventually_fast(what: &str, limit: Duration, check: impl FnMut() -> bool) -> Duration {
    eventually_every(what, limit, FAST_POLL, check).await
}

/// Like [`eventually`] for a check that must await (a request to the daemon), checking every
/// `every`.
pub async fn eventually_async<F: std::future::Future<Output = bool>>(
    what: &str,
    limit: Duration,
    every: Duration,
    mut check: impl FnMut() -> F,
) -> Duration {
    let start = Instant::now();
    loop {
        if check().await {
            return start.elapsed();
        }
        let elapsed = start.elapsed();
        assert!(elapsed < limit, "timed out after {limit:?} waiting for: {what}");
        tokio::time::sleep(every.min(limit - elapsed)).await;
    }
}

async fn eventually_every(what: &str, limit: Duration, every: Duration, check: impl FnMut() -> bool) -> Duration {
    match poll_until(limit, every, check).await {
        Some(took) => took,
        None => panic!("timed out after {limit:?} waiting for: {what}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn poll_until_reports_when_the_condition_held_or_none() {
        let mut calls = 0;
        let took = poll_until(Duration::from_secs(5), Duration::from_millis(1), || {
            calls += 1;
            calls == 3
        })
        .await;
        assert!(took.is_some_and(|t| t < Duration::from_secs(5)), "{took:?}");
        assert_eq!(calls, 3, "checked until it held, then stopped");

        let never = poll_until(Duration::from_millis(30), Duration::from_millis(5), || false).await;
        assert_eq!(never, None);
    }

    #[tokio::test]
    async fn eventually_async_awaits_each_check() {
        let mut calls = 0;
        eventually_async("the third call", Duration::from_secs(5), Duration::from_millis(1), || {
            calls += 1;
            let done = calls == 3;
            async move { done }
        })
        .await;
        assert_eq!(calls, 3);
    }

    #[tokio::test]
    #[should_panic(expected = "waiting for: the never")]
    async fn eventually_async_fails_naming_what_it_waited_for() {
        eventually_async("the never", Duration::from_millis(30), Duration::from_millis(5), || async { false }).await;
    }

    #[tokio::test]
    #[should_panic(expected = "waiting for: the impossible")]
    async fn eventually_fails_naming_what_it_waited_for() {
        eventually_fast("the impossible", Duration::from_millis(30), || false).await;
    }
}
