//! Deadline arithmetic shared by the sync pacing and the canary monitor.

use std::time::{Duration, Instant};

/// `now + d`, saturating at a far-future instant instead of overflowing on absurd durations.
pub(crate) fn instant_after(now: Instant, d: Duration) -> Instant {
    const CENTURY: Duration = Duration::from_secs(100 * 365 * 24 * 3600);
    now.checked_add(d).or_else(|| now.checked_add(CENTURY)).unwrap_or(now)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn saturates_instead_of_overflowing() {
        let now = Instant::now();
        assert_eq!(instant_after(now, Duration::from_secs(5)), now + Duration::from_secs(5));
        assert!(instant_after(now, Duration::MAX) > now + Duration::from_secs(50 * 365 * 24 * 3600));
    }
}
