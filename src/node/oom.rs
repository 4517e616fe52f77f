//! The process's OOM-killer score adjustment (`oomScoreAdj`, default -999) so the kernel kills
//! workloads before the node's proxy. Upstream writes `/proc/<pid>/oom_score_adj` at start-up
//! and only logs when it cannot, e.g. in an unprivileged container; so do we, as a warning.

use std::io;
use std::path::PathBuf;
#[cfg(any(test, feature = "testing"))]
use std::sync::Mutex;

/// Valid range of `oom_score_adj`.
pub(crate) const OOM_SCORE_ADJ_RANGE: std::ops::RangeInclusive<i32> = -1000..=1000;

#[derive(Debug, thiserror::Error)]
pub(crate) enum OomError {
    #[error("oom_score_adj {0} is outside [-1000, 1000]")]
    OutOfRange(i32),
    #[error("failed to write oom_score_adj {value} to {path}: {source}")]
    Write { path: PathBuf, value: i32, source: io::Error },
}

/// Sets this process's `oom_score_adj`.
pub(crate) trait OomScoreAdjuster: Send + Sync {
    fn apply(&self, value: i32) -> Result<(), OomError>;
}

/// Writes `/proc/self/oom_score_adj` (or another path, for tests).
#[derive(Debug, Clone)]
pub(crate) struct ProcOomScoreAdjuster {
    path: PathBuf,
}

impl Default for ProcOomScoreAdjuster {
    fn default() -> Self {
        ProcOomScoreAdjuster { path: PathBuf::from("/proc/self/oom_score_adj") }
    }
}

impl ProcOomScoreAdjuster {
    #[cfg(test)]
    pub fn at(path: impl Into<PathBuf>) -> Self {
        ProcOomScoreAdjuster { path: path.into() }
    }
}

impl OomScoreAdjuster for ProcOomScoreAdjuster {
    fn apply(&self, value: i32) -> Result<(), OomError> {
        if !OOM_SCORE_ADJ_RANGE.contains(&value) {
            return Err(OomError::OutOfRange(value));
        }
        std::fs::write(&self.path, value.to_string()).map_err(|source| OomError::Write {
            path: self.path.clone(),
            value,
            source,
        })
    }
}

/// Records applied values; fails with `PermissionDenied` when built with [`FakeOomScoreAdjuster::denied`].
#[cfg(any(test, feature = "testing"))]
#[derive(Debug, Default)]
pub struct FakeOomScoreAdjuster {
    pub applied: Mutex<Vec<i32>>,
    deny: bool,
}

#[cfg(any(test, feature = "testing"))]
impl FakeOomScoreAdjuster {
    pub fn denied() -> Self {
        FakeOomScoreAdjuster { applied: Mutex::default(), deny: true }
    }
}

#[cfg(any(test, feature = "testing"))]
impl OomScoreAdjuster for FakeOomScoreAdjuster {
    fn apply(&self, value: i32) -> Result<(), OomError> {
        if self.deny {
            return Err(OomError::Write {
                path: "/proc/self/oom_score_adj".into(),
                value,
                source: io::Error::from(io::ErrorKind::PermissionDenied),
            });
        }
        self.applied.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(value);
        Ok(())
    }
}

/// Applies `value` the way upstream does at start-up: a failure is never fatal. It is a
/// warning (upstream logs it at verbosity 2) because the unprivileged DaemonSet meets it on
/// every start: lowering the score needs `CAP_SYS_RESOURCE`, which is not worth granting for it
/// (the kubelet already gives a system-node-critical pod -997).
pub(crate) fn apply_oom_score_adj(adjuster: &dyn OomScoreAdjuster, value: i32) {
    match adjuster.apply(value) {
        Ok(()) => tracing::debug!(oom_score_adj = value, "applied oom_score_adj"),
        Err(OomError::Write { source, .. }) if source.kind() == io::ErrorKind::PermissionDenied => tracing::warn!(
            oom_score_adj = value,
            error = %source,
            "cannot set oom_score_adj (lowering it needs CAP_SYS_RESOURCE); keeping the one the kubelet set"
        ),
        Err(e) => tracing::warn!(error = %e, "failed to apply oom_score_adj"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_the_value_as_decimal_text() {
        let dir = std::env::temp_dir().join(format!("kpr-oom-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("oom_score_adj");
        std::fs::write(&path, "0").unwrap();
        ProcOomScoreAdjuster::at(&path).apply(-999).unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "-999");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn out_of_range_is_refused_without_writing() {
        let path = std::env::temp_dir().join(format!("kpr-oom-missing-{}/x", std::process::id()));
        assert!(matches!(ProcOomScoreAdjuster::at(&path).apply(1001), Err(OomError::OutOfRange(1001))));
        assert!(matches!(ProcOomScoreAdjuster::at(&path).apply(-1001), Err(OomError::OutOfRange(-1001))));
    }

    #[test]
    fn a_write_failure_names_the_path_and_is_not_fatal() {
        let path = std::env::temp_dir().join(format!("kpr-oom-missing-{}/oom_score_adj", std::process::id()));
        let err = ProcOomScoreAdjuster::at(&path).apply(-999).unwrap_err();
        assert!(err.to_string().contains("oom_score_adj -999") && err.to_string().contains("kpr-oom-missing"), "{err}");
        apply_oom_score_adj(&FakeOomScoreAdjuster::denied(), -999);
        let fake = FakeOomScoreAdjuster::default();
        apply_oom_score_adj(&fake, -999);
        assert_eq!(*fake.applied.lock().unwrap(), vec![-999]);
    }
}
