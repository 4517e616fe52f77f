//! The process's soft open-file limit, raised to its hard limit at start-up.
//!
//! Upstream's Go runtime does this for kube-proxy on Linux; without it the default soft limit
//! (often 1024) lets a few hundred idle connections to the health port exhaust the file
//! descriptors the daemon needs for iptables-restore, conntrack and its watches.

use std::io;
#[cfg(any(test, feature = "testing"))]
use std::sync::{Mutex, PoisonError};

/// Reads and sets `RLIMIT_NOFILE`.
pub trait OpenFileLimit {
    /// (soft, hard).
    fn get(&self) -> io::Result<(u64, u64)>;
    fn set(&self, soft: u64, hard: u64) -> io::Result<()>;
}

/// This process's limit (`getrlimit`/`setrlimit`).
#[derive(Debug, Default, Clone, Copy)]
pub struct ProcessOpenFileLimit;

impl OpenFileLimit for ProcessOpenFileLimit {
    fn get(&self) -> io::Result<(u64, u64)> {
        nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE).map_err(io::Error::from)
    }

    fn set(&self, soft: u64, hard: u64) -> io::Result<()> {
        nix::sys::resource::setrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE, soft, hard).map_err(io::Error::from)
    }
}

/// Raises the soft limit to the hard one; returns (before, after) when it changed. Failures
/// are logged, never fatal.
pub fn raise_open_file_limit(limit: &dyn OpenFileLimit) -> Option<(u64, u64)> {
    let (soft, hard) = match limit.get() {
        Ok(v) => v,
        Err(error) => {
            tracing::warn!(%error, "failed to read the open-file limit");
            return None;
        }
    };
    if soft >= hard {
        return None;
    }
    match limit.set(hard, hard) {
        Ok(()) => {
            tracing::info!(from = soft, open_files = hard, "raised the open-file limit");
            Some((soft, hard))
        }
        Err(error) => {
            tracing::warn!(%error, soft, hard, "failed to raise the open-file limit");
            None
        }
    }
}

/// An in-memory limit; `deny` makes setting fail.
#[cfg(any(test, feature = "testing"))]
#[derive(Debug, Default)]
pub struct FakeOpenFileLimit {
    pub limits: Mutex<(u64, u64)>,
    pub deny: bool,
}

#[cfg(any(test, feature = "testing"))]
impl OpenFileLimit for FakeOpenFileLimit {
    fn get(&self) -> io::Result<(u64, u64)> {
        Ok(*self.limits.lock().unwrap_or_else(PoisonError::into_inner))
    }

    fn set(&self, soft: u64, hard: u64) -> io::Result<()> {
        if self.deny {
            return Err(io::Error::from(io::ErrorKind::PermissionDenied));
        }
        *self.limits.lock().unwrap_or_else(PoisonError::into_inner) = (soft, hard);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn raises_soft_to_hard_once() {
        let fake = FakeOpenFileLimit { limits: Mutex::new((1024, 524_288)), deny: false };
        assert_eq!(raise_open_file_limit(&fake), Some((1024, 524_288)));
        assert_eq!(fake.get().unwrap(), (524_288, 524_288));
        assert_eq!(raise_open_file_limit(&fake), None, "already at the hard limit");
    }

    #[test]
    fn a_failure_is_not_fatal() {
        let fake = FakeOpenFileLimit { limits: Mutex::new((1024, 4096)), deny: true };
        assert_eq!(raise_open_file_limit(&fake), None);
        assert_eq!(fake.get().unwrap(), (1024, 4096));
    }

    #[test]
    fn the_process_limit_reads() {
        let (soft, hard) = ProcessOpenFileLimit.get().unwrap();
        assert!(soft <= hard && soft > 0);
    }
}
