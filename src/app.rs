//! Composition root: builds the real exec, iptables runners and (later) the daemon's tasks.

use std::sync::Arc;
use std::time::Duration;

use crate::cleanup::cleanup_leftovers;
use crate::exec::{Exec, RealExec};
use crate::iptables::Iptables;
use crate::iptables::runner::{IptablesRunner, RunnerOptions, detect_backend};
use crate::model::IpFamily;

/// Longest any single iptables command may take.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(300);

/// The iptables runners for both families, on the backend the host already uses.
pub fn iptables_runners(exec: Arc<dyn Exec>) -> Vec<IptablesRunner> {
    let detection = detect_backend(exec.clone(), None, COMMAND_TIMEOUT);
    tracing::info!(
        backend = ?detection.backend,
        legacy_rules = detection.legacy_rules,
        nft_rules = detection.nft_rules,
        reason = detection.reason,
        "chose iptables backend"
    );
    [IpFamily::V4, IpFamily::V6]
        .into_iter()
        .map(|family| {
            let options = RunnerOptions { backend: detection.backend, netns: None, command_timeout: COMMAND_TIMEOUT };
            IptablesRunner::new(exec.clone(), family, options)
        })
        .collect()
}

/// `--cleanup`: removes our rules and chains from both families (upstream
/// `CleanupLeftovers`). Returns whether everything succeeded; a family whose iptables is not
/// present is skipped.
pub fn cleanup() -> bool {
    let exec: Arc<dyn Exec> = Arc::new(RealExec);
    let mut ok = true;
    for runner in iptables_runners(exec) {
        let family = runner.family();
        if !runner.present() {
            tracing::info!(%family, "iptables not present for this family; nothing to clean up");
            continue;
        }
        let report = cleanup_leftovers(&runner);
        tracing::info!(%family, deleted = report.deleted.len(), kept_referenced = report.kept_referenced.len(), errors = report.errors.len(), "cleanup finished");
        ok &= report.success();
    }
    ok
}
