//! Watches the `--config` file so the daemon can exit when it changes: upstream kube-proxy
//! exits with "content of the proxy server's configuration file was updated" and lets its
//! DaemonSet restart it with the new configuration, rather than reconfiguring in place.
//!
//! No inotify: the watcher polls, reading the file and comparing a SHA-256 of its content with
//! the content the configuration was loaded from. Polling by content (not mtime) means a
//! ConfigMap volume update (kubelet swaps a symlink) is seen when the content changes and
//! ignored when a rewrite leaves it identical. A missing file is reported as [`ConfigChange::Removed`]
//! and any other read failure as [`ConfigChange::Unreadable`]; the caller decides whether to
//! exit on those too. Config files are a few KB, so each poll is a small blocking read.
//!
//! Create the watcher *before* loading the configuration (or hand it the exact bytes that were
//! loaded with [`ConfigWatcher::with_contents`]), so a change in between is not missed.

use std::fmt;
use std::io;
use std::path::PathBuf;
use std::time::Duration;

use sha2::{Digest, Sha256};
use tokio_util::sync::CancellationToken;

/// How often the daemon polls the config file.
pub(crate) const DEFAULT_POLL_INTERVAL: Duration = Duration::from_secs(2);

/// What happened to the watched file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum ConfigChange {
    /// The content differs from the baseline.
    Modified,
    /// The file no longer exists.
    Removed,
    /// The file exists but cannot be read (the I/O error's text).
    Unreadable(String),
}

impl fmt::Display for ConfigChange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConfigChange::Modified => f.write_str("content of the proxy server's configuration file was updated"),
            ConfigChange::Removed => f.write_str("the proxy server's configuration file was removed"),
            ConfigChange::Unreadable(e) => write!(f, "the proxy server's configuration file cannot be read: {e}"),
        }
    }
}

/// The content digest of one version of the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Fingerprint([u8; 32]);

impl Fingerprint {
    fn of(contents: &[u8]) -> Fingerprint {
        Fingerprint(Sha256::digest(contents).into())
    }
}

/// Polls one file for changes against a fixed baseline.
#[derive(Debug, Clone)]
pub(crate) struct ConfigWatcher {
    path: PathBuf,
    baseline: Fingerprint,
    interval: Duration,
}

impl ConfigWatcher {
    /// Watches `path`, taking its current content as the baseline.
    pub fn new(path: impl Into<PathBuf>, interval: Duration) -> io::Result<ConfigWatcher> {
        let path = path.into();
        let contents = std::fs::read(&path)?;
        Ok(ConfigWatcher::with_contents(path, &contents, interval))
    }

    /// Watches `path` against `contents` (the bytes the configuration was loaded from).
    pub(crate) fn with_contents(path: impl Into<PathBuf>, contents: &[u8], interval: Duration) -> ConfigWatcher {
        // A zero interval would spin; poll at least every millisecond.
        let interval = interval.max(Duration::from_millis(1));
        ConfigWatcher { path: path.into(), baseline: Fingerprint::of(contents), interval }
    }

    /// One poll: what, if anything, differs from the baseline now.
    pub fn check(&self) -> Option<ConfigChange> {
        match std::fs::read(&self.path) {
            Ok(contents) if Fingerprint::of(&contents) == self.baseline => None,
            Ok(_) => Some(ConfigChange::Modified),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Some(ConfigChange::Removed),
            Err(e) => Some(ConfigChange::Unreadable(e.to_string())),
        }
    }

    /// Polls every interval (on tokio's clock, so paused time works in tests) until the file
    /// changes, returning what happened, or until `cancel` fires (`None`).
    pub async fn changed(&self, cancel: &CancellationToken) -> Option<ConfigChange> {
        let mut ticks = tokio::time::interval(self.interval);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                biased;
                () = cancel.cancelled() => return None,
                _ = ticks.tick() => {
                    if let Some(change) = self.check() {
                        tracing::info!(path = %self.path.display(), %change, "config file changed");
                        return Some(change);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const INTERVAL: Duration = Duration::from_secs(2);

    /// A scratch directory removed on drop.
    struct Scratch(PathBuf);

    impl Scratch {
        fn new(name: &str) -> Scratch {
            let dir = std::env::temp_dir().join(format!("kpr-config-watch-{name}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).expect("scratch dir");
            Scratch(dir)
        }

        fn file(&self, name: &str, text: &str) -> PathBuf {
            let p = self.0.join(name);
            std::fs::write(&p, text).expect("write");
            p
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn check_compares_content_not_timestamps() {
        let dir = Scratch::new("check");
        let path = dir.file("config.conf", "mode: iptables\n");
        let w = ConfigWatcher::new(&path, INTERVAL).unwrap();
        assert_eq!(w.check(), None);
        // Rewritten with the same bytes: not a change.
        std::fs::write(&path, "mode: iptables\n").unwrap();
        assert_eq!(w.check(), None);
        // Replaced by rename with the same bytes (a ConfigMap update that changed nothing).
        let tmp = dir.file("new.conf", "mode: iptables\n");
        std::fs::rename(&tmp, &path).unwrap();
        assert_eq!(w.check(), None);
        std::fs::write(&path, "mode: iptables\nclusterCIDR: 10.0.0.0/8\n").unwrap();
        assert_eq!(w.check(), Some(ConfigChange::Modified));
        // Back to the original content: no longer a change (the baseline is fixed).
        std::fs::write(&path, "mode: iptables\n").unwrap();
        assert_eq!(w.check(), None);
        std::fs::remove_file(&path).unwrap();
        assert_eq!(w.check(), Some(ConfigChange::Removed));
        std::fs::create_dir(&path).unwrap();
        assert!(matches!(w.check(), Some(ConfigChange::Unreadable(_))));
    }

    #[test]
    fn with_contents_catches_a_change_before_the_first_poll() {
        let dir = Scratch::new("baseline");
        let path = dir.file("config.conf", "new\n");
        let w = ConfigWatcher::with_contents(&path, b"old\n", INTERVAL);
        assert_eq!(w.check(), Some(ConfigChange::Modified));
        assert!(ConfigWatcher::new(dir.0.join("missing"), INTERVAL).is_err());
    }

    #[test]
    fn messages() {
        assert_eq!(ConfigChange::Modified.to_string(), "content of the proxy server's configuration file was updated");
        assert_eq!(ConfigChange::Removed.to_string(), "the proxy server's configuration file was removed");
    }

    #[tokio::test(start_paused = true)]
    async fn changed_waits_for_a_modification_on_paused_time() {
        let dir = Scratch::new("paused");
        let path = dir.file("config.conf", "a: 1\n");
        let w = ConfigWatcher::new(&path, INTERVAL).unwrap();
        let cancel = CancellationToken::new();
        let task = tokio::spawn({
            let (w, cancel) = (w.clone(), cancel.clone());
            async move {
                let started = tokio::time::Instant::now();
                (w.changed(&cancel).await, started.elapsed())
            }
        });
        // Several polls pass without a change.
        tokio::time::sleep(INTERVAL * 5 + Duration::from_millis(500)).await;
        assert!(!task.is_finished());
        std::fs::write(&path, "a: 2\n").unwrap();
        let (change, elapsed) = task.await.unwrap();
        assert_eq!(change, Some(ConfigChange::Modified));
        // Seen at the first poll after the write (the polls are at 0, 2, 4... seconds).
        assert_eq!(elapsed, INTERVAL * 6);
    }

    #[tokio::test(start_paused = true)]
    async fn changed_reports_removal_and_stops_on_cancel() {
        let dir = Scratch::new("removed");
        let path = dir.file("config.conf", "a: 1\n");
        let w = ConfigWatcher::new(&path, INTERVAL).unwrap();
        let cancel = CancellationToken::new();
        let task = tokio::spawn({
            let (w, cancel) = (w.clone(), cancel.clone());
            async move { w.changed(&cancel).await }
        });
        tokio::time::sleep(INTERVAL * 3).await;
        std::fs::remove_file(&path).unwrap();
        assert_eq!(task.await.unwrap(), Some(ConfigChange::Removed));

        std::fs::write(&path, "a: 1\n").unwrap();
        let task = tokio::spawn({
            let (w, cancel) = (w.clone(), cancel.clone());
            async move { w.changed(&cancel).await }
        });
        tokio::time::sleep(INTERVAL * 10).await;
        cancel.cancel();
        assert_eq!(task.await.unwrap(), None);
    }

    #[tokio::test]
    async fn changed_on_real_time() {
        let dir = Scratch::new("real");
        let path = dir.file("config.conf", "a: 1\n");
        let w = ConfigWatcher::new(&path, Duration::from_millis(20)).unwrap();
        let cancel = CancellationToken::new();
        let writer = {
            let path = path.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(100)).await;
                std::fs::write(&path, "a: 2\n").unwrap();
            })
        };
        let change = tokio::time::timeout(Duration::from_secs(10), w.changed(&cancel)).await;
        writer.await.unwrap();
        assert_eq!(change.ok().flatten(), Some(ConfigChange::Modified));
    }
}
