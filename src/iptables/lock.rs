//! The xtables lock, taken by hand around `iptables-restore` when that binary is too old to
//! wait for the lock itself (no `-w` support).
//!
//! This module owns the [`Locker`] trait (so the runner's fallback is testable with a fake)
//! and [`XtablesLocker`], which takes both locks iptables has used over the years, each
//! polled at a fixed interval up to a bound:
//!
//! * the 1.6.x style lock: an exclusive `flock` on `/run/xtables.lock` (created if missing,
//!   mode 0600);
//! * the 1.4.x style lock: binding the abstract unix socket `@xtables`.
//!
//! Both are released when the returned guard is dropped. The abstract socket lives in the
//! network namespace of *this* process, so when the runner drives iptables in another
//! namespace only the file lock is meaningful; the fallback only matters for iptables
//! releases older than 1.6.2 anyway.

use std::fs::{File, OpenOptions, TryLockError};
use std::io;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::net::{SocketAddr, UnixListener};
use std::path::PathBuf;
use std::thread;
use std::time::{Duration, Instant};

/// Where the 1.6.x lock file lives.
pub(crate) const LOCKFILE_PATH_16X: &str = "/run/xtables.lock";
/// The abstract socket name (without the leading NUL) of the 1.4.x lock.
pub(crate) const LOCK_SOCKET_14X: &str = "xtables";
/// How often a busy lock is retried.
pub(crate) const LOCK_POLL_INTERVAL: Duration = Duration::from_millis(200);
/// How long each lock is retried before giving up.
pub(crate) const LOCK_TIMEOUT: Duration = Duration::from_secs(2);

#[derive(Debug, thiserror::Error)]
pub(crate) enum LockError {
    #[error("failed to open iptables lock {path}: {source}")]
    Open { path: String, source: io::Error },
    #[error("failed to acquire new iptables lock {path} within {timeout:?}: {last}")]
    FileLock { path: String, timeout: Duration, last: String },
    #[error("failed to acquire old iptables lock @{name} within {timeout:?}: {last}")]
    SocketLock { name: String, timeout: Duration, last: String },
}

/// Holds the lock until dropped.
pub(crate) type LockGuard = Box<dyn Send>;

/// Takes the iptables lock(s).
pub(crate) trait Locker: Send + Sync {
    fn acquire(&self) -> Result<LockGuard, LockError>;
}

/// The real xtables locks (see the module docs). Paths and timing are fields so tests can use
/// private ones.
#[derive(Debug, Clone)]
pub(crate) struct XtablesLocker {
    pub lockfile: PathBuf,
    /// Abstract socket name, without the leading NUL.
    pub socket_name: String,
    pub poll_interval: Duration,
    pub timeout: Duration,
}

impl Default for XtablesLocker {
    fn default() -> Self {
        XtablesLocker {
            lockfile: PathBuf::from(LOCKFILE_PATH_16X),
            socket_name: LOCK_SOCKET_14X.to_string(),
            poll_interval: LOCK_POLL_INTERVAL,
            timeout: LOCK_TIMEOUT,
        }
    }
}

/// Both locks, released on drop (closing the file drops the flock; closing the listener
/// frees the abstract name).
struct XtablesGuard {
    _file: File,
    _socket: UnixListener,
}

impl Locker for XtablesLocker {
    fn acquire(&self) -> Result<LockGuard, LockError> {
        let path = self.lockfile.display().to_string();
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .open(&self.lockfile)
            .map_err(|source| LockError::Open { path: path.clone(), source })?;

        poll(self.poll_interval, self.timeout, || match file.try_lock() {
            Ok(()) => Ok(()),
            Err(TryLockError::WouldBlock) => Err("lock is held by another process".to_string()),
            Err(TryLockError::Error(e)) => Err(e.to_string()),
        })
        .map_err(|last| LockError::FileLock { path: path.clone(), timeout: self.timeout, last })?;

        let socket = poll(self.poll_interval, self.timeout, || {
            SocketAddr::from_abstract_name(self.socket_name.as_bytes())
                .and_then(|addr| UnixListener::bind_addr(&addr))
                .map_err(|e| e.to_string())
        })
        .map_err(|last| LockError::SocketLock {
            name: self.socket_name.clone(),
            timeout: self.timeout,
            last,
        })?;

        tracing::debug!(lockfile = %path, socket = %self.socket_name, "acquired xtables locks");
        Ok(Box::new(XtablesGuard { _file: file, _socket: socket }))
    }
}

/// Tries `attempt` immediately and then every `interval` until it succeeds or `timeout` has
/// passed; returns the last failure reason on timeout.
fn poll<T>(interval: Duration, timeout: Duration, mut attempt: impl FnMut() -> Result<T, String>) -> Result<T, String> {
    let deadline = Instant::now() + timeout;
    loop {
        match attempt() {
            Ok(value) => return Ok(value),
            Err(reason) => {
                let now = Instant::now();
                if now >= deadline {
                    return Err(reason);
                }
                thread::sleep(interval.min(deadline - now));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn private_locker(tag: &str) -> (XtablesLocker, PathBuf) {
        let dir = std::env::temp_dir().join(format!("kube-proxy-rs-lock-{}-{tag}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let locker = XtablesLocker {
            lockfile: dir.join("xtables.lock"),
            socket_name: format!("kube-proxy-rs-test-{}-{tag}", std::process::id()),
            poll_interval: Duration::from_millis(20),
            timeout: Duration::from_millis(100),
        };
        (locker, dir)
    }

    #[test]
    fn acquires_and_releases_both_locks() {
        let (locker, dir) = private_locker("release");
        let guard = locker.acquire().expect("free locks");
        // While held, a second acquisition times out on the file lock.
        let err = locker.acquire().err().expect("busy");
        assert!(matches!(err, LockError::FileLock { .. }), "{err}");
        drop(guard);
        let again = locker.acquire().expect("released");
        drop(again);
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn busy_socket_times_out() {
        let (locker, dir) = private_locker("socket");
        let addr = SocketAddr::from_abstract_name(locker.socket_name.as_bytes()).expect("addr");
        let _held = UnixListener::bind_addr(&addr).expect("bind");
        let started = Instant::now();
        let err = locker.acquire().err().expect("socket busy");
        assert!(matches!(err, LockError::SocketLock { .. }), "{err}");
        assert!(started.elapsed() >= Duration::from_millis(100));
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn unopenable_lockfile() {
        let locker = XtablesLocker {
            lockfile: PathBuf::from("/nonexistent-dir-kube-proxy-rs/xtables.lock"),
            ..XtablesLocker::default()
        };
        assert!(matches!(locker.acquire(), Err(LockError::Open { .. })));
    }

    #[test]
    fn poll_retries_until_success() {
        let mut tries = 0;
        let result = poll(Duration::from_millis(1), Duration::from_secs(1), || {
            tries += 1;
            if tries < 3 { Err("busy".to_string()) } else { Ok(tries) }
        });
        assert_eq!(result, Ok(3));
    }
}
