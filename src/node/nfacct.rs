//! Netfilter accounting objects (nfacct) that upstream kube-proxy uses from 1.31 on to count
//! packets its rules drop or accept (docs/upstream-versions.md rows 5–7).
//!
//! On every full sync the proxier makes sure both objects exist; only an object that could
//! be created is referenced by a rule (`-m nfacct --nfacct-name NAME`), because a rule naming
//! a missing object makes the kernel reject the whole restore. Where nfacct is unavailable
//! the rules are the 1.29 ones, as upstream writes them when `nfacct.Ensure` fails.
//!
//! [`ExecNfacct`] drives the `nfacct` tool through [`crate::exec`] (upstream talks netlink
//! directly; the tool sends the same `NFNL_SUBSYS_ACCT` messages, and `unsafe` code is not
//! allowed here for a raw netlink socket); [`FakeNfacct`] keeps objects in memory. The fake is
//! not only a test double: the `render` command uses it to render a node with nfacct support
//! without a kernel, so it stays in the release binary (only its test helpers need the
//! `testing` feature).

use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use crate::exec::{Command, Exec, ExecError};

/// Packets dropped by the `KUBE-FORWARD` rule for conntrack state INVALID.
pub const CT_STATE_INVALID_DROPPED: &str = "ct_state_invalid_dropped_pkts";
/// Packets accepted on a NodePort through a loopback address (IPv4).
pub const LOCALHOST_NODEPORTS_ACCEPTED: &str = "localhost_nps_accepted_pkts";

/// The nfacct tool (looked up in `PATH`).
pub(crate) const NFACCT_PROGRAM: &str = "nfacct";

const TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum NfacctError {
    #[error("failed to run `{command}`: {source}")]
    Exec { command: String, source: ExecError },
    #[error("`{command}` failed: {output}")]
    Failed { command: String, output: String },
    #[error("`{command}` printed no packet count: {output:?}")]
    Unparsable { command: String, output: String },
    /// Only from [`FakeNfacct`].
    #[error("nfacct object {name}: {reason}")]
    Injected { name: String, reason: String },
}

/// Creating and reading accounting objects.
pub trait Nfacct: Send + Sync + fmt::Debug {
    /// Creates the object `name` unless it exists.
    fn ensure(&self, name: &str) -> Result<(), NfacctError>;
    /// The packet count of the object `name`.
    fn packets(&self, name: &str) -> Result<u64, NfacctError>;
}

/// Which accounting objects the last full sync could make sure of: the rules name only these.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NfacctCounters {
    /// [`CT_STATE_INVALID_DROPPED`] exists.
    pub ct_state_invalid_dropped: bool,
    /// [`LOCALHOST_NODEPORTS_ACCEPTED`] exists.
    pub localhost_nodeports_accepted: bool,
}

impl NfacctCounters {
    /// Both objects, as upstream's unit tests (and so `render`) assume.
    #[cfg(test)]
    pub(crate) const BOTH: NfacctCounters =
        NfacctCounters { ct_state_invalid_dropped: true, localhost_nodeports_accepted: true };

    /// Makes sure of both objects through `nfacct`; an object that cannot be created is
    /// logged and left out, as upstream does.
    pub fn ensure(nfacct: &dyn Nfacct) -> NfacctCounters {
        let ensure = |name: &str| match nfacct.ensure(name) {
            Ok(()) => true,
            Err(error) => {
                tracing::error!(%error, counter = name, "failed to create nfacct counter; its metric will not be updated");
                false
            }
        };
        NfacctCounters {
            ct_state_invalid_dropped: ensure(CT_STATE_INVALID_DROPPED),
            localhost_nodeports_accepted: ensure(LOCALHOST_NODEPORTS_ACCEPTED),
        }
    }
}

/// Runs the `nfacct` tool, optionally inside a network namespace (tests).
pub(crate) struct ExecNfacct {
    exec: Arc<dyn Exec>,
    netns: Option<String>,
}

impl fmt::Debug for ExecNfacct {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ExecNfacct").field("netns", &self.netns).finish_non_exhaustive()
    }
}

impl ExecNfacct {
    pub fn new(exec: Arc<dyn Exec>) -> Self {
        ExecNfacct { exec, netns: None }
    }

    /// Runs every command inside the named network namespace.
    #[cfg(test)]
    pub fn in_netns(mut self, name: impl Into<String>) -> Self {
        self.netns = Some(name.into());
        self
    }

    fn run(&self, args: &[&str]) -> Result<(String, String), NfacctError> {
        let cmd = match &self.netns {
            Some(ns) => Command::new("ip").args(["netns", "exec", ns.as_str(), NFACCT_PROGRAM]),
            None => Command::new(NFACCT_PROGRAM),
        }
        .args(args.iter().copied())
        .timeout(TIMEOUT);
        let command = cmd.to_string();
        let output = self.exec.run(&cmd).map_err(|source| NfacctError::Exec { command: command.clone(), source })?;
        let text = output.combined().trim().to_string();
        if output.success() { Ok((command, text)) } else { Err(NfacctError::Failed { command, output: text }) }
    }
}

impl Nfacct for ExecNfacct {
    /// As upstream's `Ensure`: an object that can be read exists (made by the other IP
    /// family's proxier, an earlier run or upstream kube-proxy); otherwise it is added.
    fn ensure(&self, name: &str) -> Result<(), NfacctError> {
        if self.run(&["get", name]).is_ok() {
            return Ok(());
        }
        match self.run(&["add", name]) {
            Ok(_) => Ok(()),
            // Added by someone else in between (the tool reports EBUSY for an existing name).
            Err(NfacctError::Failed { .. }) if self.run(&["get", name]).is_ok() => Ok(()),
            Err(e) => Err(e),
        }
    }

    fn packets(&self, name: &str) -> Result<u64, NfacctError> {
        let (command, output) = self.run(&["get", name])?;
        parse_packets(&output).ok_or(NfacctError::Unparsable { command, output })
    }
}

/// The packet count in `nfacct get` output: `{ pkts = 00000000000000000012, bytes = ... } = NAME;`.
fn parse_packets(output: &str) -> Option<u64> {
    let rest = output.split("pkts = ").nth(1)?;
    rest.split(|c: char| !c.is_ascii_digit()).next()?.parse().ok()
}

/// Objects in memory; `failing` makes [`Nfacct::ensure`] fail.
#[derive(Debug, Default)]
pub struct FakeNfacct {
    objects: Mutex<BTreeMap<String, u64>>,
    failing: bool,
}

impl FakeNfacct {
    pub fn new() -> Self {
        Self::default()
    }

    /// A fake on which no object can be created (no nfacct support; `render --nfacct absent`).
    pub fn unavailable() -> Self {
        FakeNfacct { failing: true, ..Self::default() }
    }

    /// Adds `n` packets to `name` (which must exist).
    #[cfg(any(test, feature = "testing"))]
    pub fn count(&self, name: &str, n: u64) {
        if let Some(p) = self.objects.lock().unwrap_or_else(PoisonError::into_inner).get_mut(name) {
            *p += n;
        }
    }
}

impl Nfacct for FakeNfacct {
    fn ensure(&self, name: &str) -> Result<(), NfacctError> {
        if self.failing {
            return Err(NfacctError::Injected { name: name.into(), reason: "nfacct not supported".into() });
        }
        self.objects.lock().unwrap_or_else(PoisonError::into_inner).entry(name.into()).or_insert(0);
        Ok(())
    }

    fn packets(&self, name: &str) -> Result<u64, NfacctError> {
        self.objects
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(name)
            .copied()
            .ok_or_else(|| NfacctError::Injected { name: name.into(), reason: "no such object".into() })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::exec::{FakeExec, Output};

    #[test]
    fn parses_the_tool_output() {
        let line = "{ pkts = 00000000000000000012, bytes = 00000000000000000840 } = ct_state_invalid_dropped_pkts;";
        assert_eq!(parse_packets(line), Some(12));
        assert_eq!(parse_packets("garbage"), None);
    }

    #[test]
    fn ensure_accepts_an_existing_object_and_reports_other_failures() {
        // Already there: one read, nothing added.
        let fake = Arc::new(FakeExec::new());
        fake.expect("nfacct get ct_state_invalid_dropped_pkts", Output::ok("{ pkts = 0, bytes = 0 } = x;"));
        assert!(ExecNfacct::new(fake.clone()).ensure(CT_STATE_INVALID_DROPPED).is_ok());
        assert_eq!(fake.remaining(), 0);

        let fake = Arc::new(FakeExec::new());
        let missing = || Output::exit(1, "nfacct v1.0.2: error: No such file or directory");
        fake.expect("nfacct get ct_state_invalid_dropped_pkts", missing());
        // Created by the other family's proxier in between: EBUSY, then readable.
        fake.expect(
            "nfacct add ct_state_invalid_dropped_pkts",
            Output::exit(1, "nfacct v1.0.2: error: Device or resource busy"),
        );
        fake.expect(
            "nfacct get ct_state_invalid_dropped_pkts",
            Output::ok("{ pkts = 0, bytes = 0 } = ct_state_invalid_dropped_pkts;"),
        );
        fake.expect("nfacct get localhost_nps_accepted_pkts", missing());
        fake.expect(
            "nfacct add localhost_nps_accepted_pkts",
            Output::exit(1, "nfacct v1.0.2: error: Operation not permitted"),
        );
        fake.expect("nfacct get localhost_nps_accepted_pkts", missing());
        let nfacct = ExecNfacct::new(fake.clone());
        let counters = NfacctCounters::ensure(&nfacct);
        assert_eq!(counters, NfacctCounters { ct_state_invalid_dropped: true, localhost_nodeports_accepted: false });
        assert_eq!(fake.remaining(), 0);
    }

    #[test]
    fn packets_come_from_get_and_a_netns_is_entered() {
        let fake = Arc::new(FakeExec::new());
        fake.expect(
            "ip netns exec ns1 nfacct get localhost_nps_accepted_pkts",
            Output::ok(
                "{ pkts = 00000000000000000003, bytes = 00000000000000000180 } = localhost_nps_accepted_pkts;\n",
            ),
        );
        let nfacct = ExecNfacct::new(fake.clone()).in_netns("ns1");
        assert_eq!(nfacct.packets(LOCALHOST_NODEPORTS_ACCEPTED).unwrap(), 3);
    }

    #[test]
    fn the_fake_counts_and_can_be_unavailable() {
        let fake = FakeNfacct::new();
        assert_eq!(NfacctCounters::ensure(&fake), NfacctCounters::BOTH);
        fake.count(CT_STATE_INVALID_DROPPED, 5);
        assert_eq!(fake.packets(CT_STATE_INVALID_DROPPED).unwrap(), 5);
        assert_eq!(NfacctCounters::ensure(&FakeNfacct::unavailable()), NfacctCounters::default());
    }
}
