//! Deleting stale conntrack entries after a sync (upstream 1.29 `pkg/proxy/conntrack`).
//!
//! UDP (and SCTP) have no connection teardown the kernel could see, so a conntrack entry keeps
//! steering a client's packets to whatever the first packet was DNATed to — or keeps them
//! black-holed if the first packet met a REJECT because the service had no endpoints — for as
//! long as the client keeps sending. After every successful sync the proxier hands the sync's
//! [`ServiceUpdateResult`] and [`EndpointsUpdateResult`] to [`clean_stale_entries`], which
//! deletes exactly the entries upstream 1.29 deletes:
//!
//! * a UDP service port that went from no ready endpoint to some: every entry whose original
//!   destination is its cluster IP, one of its external IPs or load-balancer IPs, and every
//!   entry whose original destination port is its node port;
//! * a UDP endpoint that went away: the entries to the service's cluster IP, external IPs and
//!   load-balancer IPs that were DNATed to that endpoint, and those to the node port that were
//!   DNATed to it;
//! * a UDP service port that was deleted: every entry to its cluster IP.
//!
//! Deleting goes through the [`Conntrack`] trait: [`ExecConntrack`] runs the `conntrack` tool
//! through [`crate::exec`] with upstream's exact argument lists (optionally inside a network
//! namespace, for tests), `FakeConntrack` (under the `testing` feature) records what it was
//! asked. A [`ClearRequest`] is one deletion; [`ClearRequest::args`] is the argv upstream would
//! run for it.
//!
//! Failures are logged and counted, never propagated: a stale entry costs one client its
//! traffic until the entry times out, a failed sync would cost everyone.
//!
//! Releases 1.32 and later replace all of this with the reconciler in [`reconciler`], which
//! lists the table ([`Conntrack::list_entries`]) and deletes, in one batch, the entries that
//! point a service at a backend that no longer serves it ([`Conntrack::delete_entries`]).
//! The daemon talks netlink for both ([`netlink::NetlinkConntrack`], as upstream does from
//! 1.32) and keeps the tool for the 1.29–1.31 requests, as those releases ran it.
//!
//! A sync never runs any of this itself: it leaves a [`cleaner::CleanupJob`] (what the sync
//! made stale, in terms of its service and endpoint maps, not of its rules), and a per-family
//! [`cleaner::ConntrackCleaner`] runs it beside later syncs ([`cleaner`]).

pub mod cleaner;
pub mod netlink;
pub mod reconciler;

use std::collections::{BTreeSet, HashSet};
use std::fmt;
use std::sync::Arc;
#[cfg(any(test, feature = "testing"))]
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use crate::exec::{Command, Exec, ExecError};
use crate::model::ip::{format_ip, parse_ip_sloppy};
use crate::model::{IpFamily, Protocol};
use crate::tracker::{EndpointsUpdateResult, ServicePortMap, ServiceUpdateResult};

pub use reconciler::{
    ConntrackEntry, EndpointMatch, FlowFilter, ReconcileSummary, ServingFrontends, reconcile, stale_flow_filters,
};

/// The conntrack tool (looked up in `PATH`, as upstream's `LookPath("conntrack")`).
pub(crate) const CONNTRACK_PROGRAM: &str = "conntrack";

/// What `conntrack -D` prints (and exits 1 with) when nothing matched: not an error.
pub(crate) const NO_CONNECTION_TO_DELETE: &str = "0 flow entries have been deleted";

/// Kill a `conntrack` run that takes longer than this (deleting from a very large table can
/// take a while; upstream waits forever).
pub(crate) const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// Why one deletion failed. Every variant carries the request (boxed, to keep `Result` small).
#[derive(Debug, thiserror::Error)]
pub enum ConntrackError {
    #[error("failed to delete {request}: {address:?} is not an IP address")]
    InvalidAddress { request: Box<ClearRequest>, address: String },
    #[error("failed to delete {request}: port 0 is not a valid port")]
    InvalidPort { request: Box<ClearRequest> },
    #[error("failed to delete {request}: failed to run `{command}`: {source}")]
    Exec { request: Box<ClearRequest>, command: String, source: ExecError },
    #[error("failed to delete {request}: `{command}` exited with {status}: {output}")]
    Failed { request: Box<ClearRequest>, command: String, status: String, output: String },
    /// Only from `FakeConntrack`: a failure a test asked for.
    #[error("failed to delete {request}: {reason}")]
    Injected { request: Box<ClearRequest>, reason: String },
    #[error("failed to list {family} {protocol} conntrack entries: failed to run `{command}`: {source}")]
    ListExec { family: IpFamily, protocol: Protocol, command: String, source: ExecError },
    #[error("failed to list {family} {protocol} conntrack entries: `{command}` exited with {status}: {output}")]
    ListFailed { family: IpFamily, protocol: Protocol, command: String, status: String, output: String },
    /// Only from `FakeConntrack`.
    #[error("failed to list {family} {protocol} conntrack entries: injected failure")]
    ListInjected { family: IpFamily, protocol: Protocol },
    #[error("failed to delete {filter}: failed to run `{command}`: {source}")]
    FlowsExec { filter: Box<FlowFilter>, command: String, source: ExecError },
    #[error("failed to delete {filter}: `{command}` exited with {status}: {output}")]
    FlowsFailed { filter: Box<FlowFilter>, command: String, status: String, output: String },
    /// Only from `FakeConntrack`.
    #[error("failed to delete {filter}: injected failure")]
    FlowsInjected { filter: Box<FlowFilter> },
    #[error("failed to {action} {family} conntrack entries over netlink: {source}")]
    Netlink { action: &'static str, family: IpFamily, source: std::io::Error },
    #[error("failed to {action} {family} conntrack entries over netlink: {reason}")]
    NetlinkMessage { action: &'static str, family: IpFamily, reason: String },
}

pub type Result<T, E = ConntrackError> = std::result::Result<T, E>;

/// One deletion: which entries of one protocol to remove (upstream's `ClearEntriesFor*`).
///
/// Addresses are kept as the caller wrote them (upstream passes external and load-balancer
/// IPs verbatim); the IP family of `Ip`, `Nat` and `PortNat` follows from the address, as
/// upstream's `IsIPv6String` decides it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ClearRequest {
    /// Every entry whose original destination is `ip` (`ClearEntriesForIP`).
    Ip { ip: String, protocol: Protocol },
    /// Every entry whose original destination port is `port` (`ClearEntriesForPort`).
    Port { port: u16, family: IpFamily, protocol: Protocol },
    /// Entries to `origin` that were DNATed to `dest` (`ClearEntriesForNAT`).
    Nat { origin: String, dest: String, protocol: Protocol },
    /// Entries to port `port` (any address) that were DNATed to `dest`
    /// (`ClearEntriesForPortNAT`).
    PortNat { dest: String, port: u16, protocol: Protocol },
}

impl ClearRequest {
    pub fn protocol(&self) -> Protocol {
        match self {
            ClearRequest::Ip { protocol, .. }
            | ClearRequest::Port { protocol, .. }
            | ClearRequest::Nat { protocol, .. }
            | ClearRequest::PortNat { protocol, .. } => *protocol,
        }
    }

    /// The arguments of the `conntrack` run upstream 1.29 makes for this request (without the
    /// program name), or why the request cannot be run.
    pub fn args(&self) -> Result<Vec<String>> {
        let proto = self.protocol().lower().to_owned();
        let (mut args, family) = match self {
            ClearRequest::Ip { ip, .. } => {
                let family = self.family_of(ip)?;
                (vec!["-D".into(), "--orig-dst".into(), ip.clone(), "-p".into(), proto], family)
            }
            ClearRequest::Port { port, family, .. } => {
                let port = self.valid_port(*port)?;
                (vec!["-D".into(), "-p".into(), proto, "--dport".into(), port], *family)
            }
            ClearRequest::Nat { origin, dest, .. } => {
                let family = self.family_of(origin)?;
                self.family_of(dest)?;
                let args = vec![
                    "-D".into(),
                    "--orig-dst".into(),
                    origin.clone(),
                    "--dst-nat".into(),
                    dest.clone(),
                    "-p".into(),
                    proto,
                ];
                (args, family)
            }
            ClearRequest::PortNat { dest, port, .. } => {
                let family = self.family_of(dest)?;
                let port = self.valid_port(*port)?;
                (
                    vec!["-D".into(), "-p".into(), proto, "--dport".into(), port, "--dst-nat".into(), dest.clone()],
                    family,
                )
            }
        };
        if family == IpFamily::V6 {
            args.extend(["-f".into(), "ipv6".into()]);
        }
        Ok(args)
    }

    fn family_of(&self, address: &str) -> Result<IpFamily> {
        parse_ip_sloppy(address).map(|ip| IpFamily::of(&ip)).ok_or_else(|| ConntrackError::InvalidAddress {
            request: Box::new(self.clone()),
            address: address.to_owned(),
        })
    }

    fn valid_port(&self, port: u16) -> Result<String> {
        if port == 0 {
            return Err(ConntrackError::InvalidPort { request: Box::new(self.clone()) });
        }
        Ok(port.to_string())
    }
}

impl fmt::Display for ClearRequest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ClearRequest::Ip { ip, protocol } => write!(f, "{protocol} conntrack entries to {ip}"),
            ClearRequest::Port { port, family, protocol } => {
                write!(f, "{protocol} conntrack entries to port {port} ({family})")
            }
            ClearRequest::Nat { origin, dest, protocol } => {
                write!(f, "{protocol} conntrack entries to {origin} DNATed to {dest}")
            }
            ClearRequest::PortNat { dest, port, protocol } => {
                write!(f, "{protocol} conntrack entries to port {port} DNATed to {dest}")
            }
        }
    }
}

/// Lists and deletes conntrack entries. Implementations treat "nothing matched" as success.
pub trait Conntrack: Send + Sync {
    /// Deletes the entries `request` selects (1.29's per-change cleanup).
    fn clear(&self, request: &ClearRequest) -> Result<()>;

    /// The `family` entries of `protocol` in the table (the reconciler of 1.32+).
    fn list_entries(&self, family: IpFamily, protocol: Protocol) -> Result<Vec<ConntrackEntry>>;

    /// Deletes the entries `filter` matches; how many there were (one `conntrack -D`: a walk
    /// of the whole table, whatever it matches; the reconciler's way up to this issue, kept
    /// for the benchmark's comparison).
    fn delete_flows(&self, filter: &FlowFilter) -> Result<u64>;

    /// Deletes exactly `entries` (of `family`), each by its original tuple, zone and (when
    /// listed with it) id, as one batch. An entry already gone is counted, not an error;
    /// `Err` only when the batch could not run at all.
    fn delete_entries(&self, family: IpFamily, entries: &[ConntrackEntry]) -> Result<EntryDeletions>;

    /// Entries whose original destination is `ip` (upstream `ClearEntriesForIP`).
    fn clear_entries_for_ip(&self, ip: &str, protocol: Protocol) -> Result<()> {
        self.clear(&ClearRequest::Ip { ip: ip.to_owned(), protocol })
    }

    /// Entries whose original destination port is `port` (upstream `ClearEntriesForPort`).
    fn clear_entries_for_port(&self, port: u16, family: IpFamily, protocol: Protocol) -> Result<()> {
        self.clear(&ClearRequest::Port { port, family, protocol })
    }

    /// Entries to `origin` DNATed to `dest` (upstream `ClearEntriesForNAT`).
    fn clear_entries_for_nat(&self, origin: &str, dest: &str, protocol: Protocol) -> Result<()> {
        self.clear(&ClearRequest::Nat { origin: origin.to_owned(), dest: dest.to_owned(), protocol })
    }

    /// Entries to port `port` DNATed to `dest` (upstream `ClearEntriesForPortNAT`).
    fn clear_entries_for_port_nat(&self, dest: &str, port: u16, protocol: Protocol) -> Result<()> {
        self.clear(&ClearRequest::PortNat { dest: dest.to_owned(), port, protocol })
    }
}

impl<T: Conntrack + ?Sized> Conntrack for Arc<T> {
    fn clear(&self, request: &ClearRequest) -> Result<()> {
        (**self).clear(request)
    }

    fn list_entries(&self, family: IpFamily, protocol: Protocol) -> Result<Vec<ConntrackEntry>> {
        (**self).list_entries(family, protocol)
    }

    fn delete_flows(&self, filter: &FlowFilter) -> Result<u64> {
        (**self).delete_flows(filter)
    }

    fn delete_entries(&self, family: IpFamily, entries: &[ConntrackEntry]) -> Result<EntryDeletions> {
        (**self).delete_entries(family, entries)
    }
}

/// What one [`Conntrack::delete_entries`] batch did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EntryDeletions {
    /// Entries deleted.
    pub deleted: u64,
    /// Entries that were no longer there (expired, deleted by someone else, or replaced by
    /// a new entry with another id).
    pub gone: u64,
    /// Entries whose deletion failed for another reason.
    pub failed: u64,
    /// The first of those failures, for the log.
    pub first_failure: Option<String>,
}

impl EntryDeletions {
    fn fail(&mut self, why: impl FnOnce() -> String) {
        self.failed += 1;
        if self.first_failure.is_none() {
            self.first_failure = Some(why());
        }
    }
}

/// What conntrack-tools prints when a listing found nothing (not an error).
pub(crate) const NO_CONNECTION_TO_LIST: &str = "0 flow entries have been shown";

/// How a finished `conntrack` run ended, for error messages.
fn exit_status(output: &crate::exec::Output) -> String {
    match output.status {
        Some(code) => format!("exit status {code}"),
        None => "a signal".to_owned(),
    }
}

/// Runs the `conntrack` tool through an [`Exec`], one process per request.
pub struct ExecConntrack {
    exec: Arc<dyn Exec>,
    /// Run inside this network namespace (`ip netns exec NAME conntrack ...`); the
    /// real-kernel tests use it, production does not.
    netns: Option<String>,
    timeout: Duration,
}

impl fmt::Debug for ExecConntrack {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ExecConntrack")
            .field("netns", &self.netns)
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

impl ExecConntrack {
    pub fn new(exec: Arc<dyn Exec>) -> Self {
        ExecConntrack { exec, netns: None, timeout: DEFAULT_TIMEOUT }
    }

    /// Runs every command inside the named network namespace.
    pub fn in_netns(mut self, name: impl Into<String>) -> Self {
        self.netns = Some(name.into());
        self
    }

    /// Kills a run that takes longer than `timeout`.
    #[cfg(test)]
    pub(crate) fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The command that carries out `args`.
    fn command(&self, args: Vec<String>) -> Command<'static> {
        let cmd = match &self.netns {
            Some(ns) => Command::new("ip").args(["netns", "exec", ns.as_str(), CONNTRACK_PROGRAM]),
            None => Command::new(CONNTRACK_PROGRAM),
        };
        cmd.args(args).timeout(self.timeout)
    }
}

impl Conntrack for ExecConntrack {
    fn clear(&self, request: &ClearRequest) -> Result<()> {
        let cmd = self.command(request.args()?);
        tracing::debug!(command = %cmd, "clearing conntrack entries");
        let output = self.exec.run(&cmd).map_err(|source| ConntrackError::Exec {
            request: Box::new(request.clone()),
            command: cmd.to_string(),
            source,
        })?;
        let text = output.combined();
        let text = text.trim();
        if output.success() {
            tracing::debug!(command = %cmd, output = text, "conntrack entries deleted");
            return Ok(());
        }
        // conntrack exits 1 when nothing matched; upstream looks for the message.
        if text.contains(NO_CONNECTION_TO_DELETE) {
            tracing::debug!(command = %cmd, "no conntrack entries to delete");
            return Ok(());
        }
        Err(ConntrackError::Failed {
            request: Box::new(request.clone()),
            command: cmd.to_string(),
            status: exit_status(&output),
            output: text.to_owned(),
        })
    }

    fn list_entries(&self, family: IpFamily, protocol: Protocol) -> Result<Vec<ConntrackEntry>> {
        let mut args = vec!["-L".to_owned(), "-p".to_owned(), protocol.lower().to_owned()];
        if family == IpFamily::V6 {
            args.extend(["-f".to_owned(), "ipv6".to_owned()]);
        }
        let cmd = self.command(args);
        tracing::debug!(command = %cmd, "listing conntrack entries");
        let output = self.exec.run(&cmd).map_err(|source| ConntrackError::ListExec {
            family,
            protocol,
            command: cmd.to_string(),
            source,
        })?;
        // The entries are on stdout, the "N flow entries have been shown" summary on stderr.
        // Without `-f` the tool lists both families (1.4.7): keep the one asked for.
        let stdout = String::from_utf8_lossy(&output.stdout);
        if output.success() || output.combined().contains(NO_CONNECTION_TO_LIST) {
            let mut entries = reconciler::parse_entries(&stdout);
            entries.retain(|e| e.family() == family);
            return Ok(entries);
        }
        Err(ConntrackError::ListFailed {
            family,
            protocol,
            command: cmd.to_string(),
            status: exit_status(&output),
            output: output.combined().trim().to_owned(),
        })
    }

    fn delete_flows(&self, filter: &FlowFilter) -> Result<u64> {
        let cmd = self.command(filter.args());
        tracing::debug!(command = %cmd, "deleting stale conntrack entries");
        let output = self.exec.run(&cmd).map_err(|source| ConntrackError::FlowsExec {
            filter: Box::new(filter.clone()),
            command: cmd.to_string(),
            source,
        })?;
        let text = output.combined();
        // conntrack exits 1 when nothing matched ("0 flow entries have been deleted").
        if output.success() || text.contains(NO_CONNECTION_TO_DELETE) {
            // The summary is always printed; without it, one run deleted at least one entry.
            let deleted = reconciler::deleted_count(&text).unwrap_or(u64::from(output.success()));
            tracing::debug!(command = %cmd, deleted, "stale conntrack entries deleted");
            return Ok(deleted);
        }
        Err(ConntrackError::FlowsFailed {
            filter: Box::new(filter.clone()),
            command: cmd.to_string(),
            status: exit_status(&output),
            output: text.trim().to_owned(),
        })
    }

    /// One `conntrack -D` per entry ([`ConntrackEntry::delete_args`]): the tool cannot delete
    /// several entries in one run (`-R` with `-D` lines walks the table once per line), so
    /// this costs a walk of the table per entry. Only the tests and the benchmark use it.
    fn delete_entries(&self, _family: IpFamily, entries: &[ConntrackEntry]) -> Result<EntryDeletions> {
        let mut outcome = EntryDeletions::default();
        for entry in entries {
            let cmd = self.command(entry.delete_args());
            match self.exec.run(&cmd) {
                Ok(output) => {
                    let text = output.combined();
                    match reconciler::deleted_count(&text) {
                        Some(0) => outcome.gone += 1,
                        Some(n) if output.success() => outcome.deleted += n,
                        None if output.success() => outcome.deleted += 1,
                        _ => outcome.fail(|| format!("`{cmd}` exited with {}: {}", exit_status(&output), text.trim())),
                    }
                }
                Err(err) => outcome.fail(|| format!("failed to run `{cmd}`: {err}")),
            }
        }
        Ok(outcome)
    }
}

/// A [`Conntrack`] that records every request (valid or not) and holds a table of entries
/// for the reconciler: [`FakeConntrack::set_entries`] fills it, `list_entries` reads it,
/// `delete_flows` removes what the filter matches. `clear` (1.29) only records.
///
/// Requests are validated like [`ExecConntrack`] validates them, and the ones registered with
/// [`FakeConntrack::fail_on`] / [`FakeConntrack::fail_flows`] fail, so tests can check that
/// one failure does not stop the rest.
#[cfg(any(test, feature = "testing"))]
#[derive(Debug, Default)]
pub struct FakeConntrack {
    inner: Mutex<FakeState>,
    released: std::sync::Condvar,
}

#[cfg(any(test, feature = "testing"))]
#[derive(Debug, Default)]
struct FakeState {
    calls: Vec<ClearRequest>,
    failing: HashSet<ClearRequest>,
    entries: Vec<ConntrackEntry>,
    listings: Vec<(IpFamily, Protocol)>,
    list_fails: bool,
    flow_deletions: Vec<FlowFilter>,
    failing_flows: HashSet<FlowFilter>,
    entry_deletions: Vec<Vec<ConntrackEntry>>,
    failing_entries: HashSet<ConntrackEntry>,
    expiring: Vec<ConntrackEntry>,
    /// While set, listings and requests wait (a cleanup that takes its time).
    held: bool,
    /// Calls waiting on `held` right now.
    waiting: usize,
}

#[cfg(any(test, feature = "testing"))]
impl FakeConntrack {
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> MutexGuard<'_, FakeState> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Makes every later `request` fail.
    pub fn fail_on(&self, request: ClearRequest) -> &Self {
        self.lock().failing.insert(request);
        self
    }

    /// Every request so far, oldest first.
    pub fn calls(&self) -> Vec<ClearRequest> {
        self.lock().calls.clone()
    }

    /// The command line [`ExecConntrack`] would have run for each request so far
    /// (`conntrack -D ...`), or the error for an invalid one.
    pub fn command_lines(&self) -> Vec<String> {
        self.calls()
            .iter()
            .map(|request| match request.args() {
                Ok(args) => Command::new(CONNTRACK_PROGRAM).args(args).to_string(),
                Err(err) => format!("<{err}>"),
            })
            .collect()
    }

    pub fn clear_calls(&self) {
        self.lock().calls.clear();
    }

    /// Replaces the table the reconciler lists and deletes from.
    pub fn set_entries(&self, entries: Vec<ConntrackEntry>) -> &Self {
        self.lock().entries = entries;
        self
    }

    /// The table now, in insertion order.
    pub fn entries(&self) -> Vec<ConntrackEntry> {
        self.lock().entries.clone()
    }

    /// Makes every later listing fail (or succeed again).
    pub fn fail_listing(&self, fail: bool) -> &Self {
        self.lock().list_fails = fail;
        self
    }

    /// Makes every later deletion with `filter` fail.
    pub fn fail_flows(&self, filter: FlowFilter) -> &Self {
        self.lock().failing_flows.insert(filter);
        self
    }

    /// Every listing so far, oldest first.
    pub fn listings(&self) -> Vec<(IpFamily, Protocol)> {
        self.lock().listings.clone()
    }

    /// Every `delete_flows` filter so far, oldest first.
    pub fn flow_deletions(&self) -> Vec<FlowFilter> {
        self.lock().flow_deletions.clone()
    }

    /// Every `delete_entries` batch so far, oldest first.
    pub fn entry_deletions(&self) -> Vec<Vec<ConntrackEntry>> {
        self.lock().entry_deletions.clone()
    }

    /// Makes every later deletion of `entry` (in a batch) fail.
    pub fn fail_entry(&self, entry: ConntrackEntry) -> &Self {
        self.lock().failing_entries.insert(entry);
        self
    }

    /// Removes `entry` from the table right after the next listing (it expires before the
    /// deletion reaches it).
    pub fn expire_after_listing(&self, entry: ConntrackEntry) -> &Self {
        self.lock().expiring.push(entry);
        self
    }

    /// Makes listings and 1.29 requests wait until [`FakeConntrack::release`]: a cleanup
    /// that is still running while a test looks at what else happens.
    pub fn hold(&self) -> &Self {
        self.lock().held = true;
        self
    }

    /// Lets held and later calls run.
    pub fn release(&self) {
        self.lock().held = false;
        self.released.notify_all();
    }

    /// How many calls are waiting on [`FakeConntrack::hold`] now.
    pub fn waiting(&self) -> usize {
        self.lock().waiting
    }

    /// Waits while held; returns the lock.
    fn lock_when_released(&self) -> MutexGuard<'_, FakeState> {
        let mut state = self.lock();
        if state.held {
            state.waiting += 1;
            while state.held {
                state = self.released.wait(state).unwrap_or_else(PoisonError::into_inner);
            }
            state.waiting -= 1;
        }
        state
    }

    /// IPs cleared with [`ClearRequest::Ip`] (upstream fake's `ClearedIPs`).
    pub fn cleared_ips(&self) -> BTreeSet<String> {
        self.lock()
            .calls
            .iter()
            .filter_map(|r| match r {
                ClearRequest::Ip { ip, .. } => Some(ip.clone()),
                _ => None,
            })
            .collect()
    }

    /// Ports cleared with [`ClearRequest::Port`] (`ClearedPorts`).
    pub fn cleared_ports(&self) -> BTreeSet<u16> {
        self.lock()
            .calls
            .iter()
            .filter_map(|r| match r {
                ClearRequest::Port { port, .. } => Some(*port),
                _ => None,
            })
            .collect()
    }

    /// `(origin, dest)` pairs cleared with [`ClearRequest::Nat`] (`ClearedNATs`).
    pub fn cleared_nats(&self) -> BTreeSet<(String, String)> {
        self.lock()
            .calls
            .iter()
            .filter_map(|r| match r {
                ClearRequest::Nat { origin, dest, .. } => Some((origin.clone(), dest.clone())),
                _ => None,
            })
            .collect()
    }

    /// `(port, dest)` pairs cleared with [`ClearRequest::PortNat`] (`ClearedPortNATs`).
    pub fn cleared_port_nats(&self) -> BTreeSet<(u16, String)> {
        self.lock()
            .calls
            .iter()
            .filter_map(|r| match r {
                ClearRequest::PortNat { dest, port, .. } => Some((*port, dest.clone())),
                _ => None,
            })
            .collect()
    }
}

#[cfg(any(test, feature = "testing"))]
impl Conntrack for FakeConntrack {
    fn clear(&self, request: &ClearRequest) -> Result<()> {
        let mut state = self.lock_when_released();
        state.calls.push(request.clone());
        request.args()?;
        if state.failing.contains(request) {
            return Err(ConntrackError::Injected {
                request: Box::new(request.clone()),
                reason: "injected failure".into(),
            });
        }
        Ok(())
    }

    fn list_entries(&self, family: IpFamily, protocol: Protocol) -> Result<Vec<ConntrackEntry>> {
        let mut state = self.lock_when_released();
        state.listings.push((family, protocol));
        if state.list_fails {
            return Err(ConntrackError::ListInjected { family, protocol });
        }
        let listed = state.entries.iter().filter(|e| e.protocol == protocol && e.family() == family).copied().collect();
        let expiring = std::mem::take(&mut state.expiring);
        state.entries.retain(|e| !expiring.contains(e));
        Ok(listed)
    }

    fn delete_flows(&self, filter: &FlowFilter) -> Result<u64> {
        let mut state = self.lock();
        state.flow_deletions.push(filter.clone());
        if state.failing_flows.contains(filter) {
            return Err(ConntrackError::FlowsInjected { filter: Box::new(filter.clone()) });
        }
        let before = state.entries.len();
        state.entries.retain(|e| !filter.matches(e));
        Ok((before - state.entries.len()) as u64)
    }

    fn delete_entries(&self, family: IpFamily, entries: &[ConntrackEntry]) -> Result<EntryDeletions> {
        let mut state = self.lock();
        state.entry_deletions.push(entries.to_vec());
        let mut outcome = EntryDeletions::default();
        for entry in entries {
            if state.failing_entries.contains(entry) {
                outcome.fail(|| format!("deleting {entry}: injected failure"));
                continue;
            }
            // As the kernel looks it up: by tuple and zone, and id when the deletion names one.
            let found = state.entries.iter().position(|e| {
                e.family() == family
                    && (e.protocol, e.orig_src, e.orig_dst, e.orig_sport, e.orig_dport, e.zone)
                        == (
                            entry.protocol,
                            entry.orig_src,
                            entry.orig_dst,
                            entry.orig_sport,
                            entry.orig_dport,
                            entry.zone,
                        )
                    && entry.id.is_none_or(|id| e.id == Some(id))
            });
            match found {
                Some(i) => {
                    state.entries.remove(i);
                    outcome.deleted += 1;
                }
                None => outcome.gone += 1,
            }
        }
        Ok(outcome)
    }
}

/// What one [`clean_stale_entries`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CleanupSummary {
    /// Deletions attempted (one `conntrack` run each).
    pub requests: usize,
    /// Of those, how many failed (each was logged).
    pub failures: usize,
}

/// Whether stale entries of `protocol` must be deleted (upstream `IsClearConntrackNeeded`).
pub(crate) fn is_clear_conntrack_needed(protocol: Protocol) -> bool {
    matches!(protocol, Protocol::Udp | Protocol::Sctp)
}

/// Deletes the conntrack entries made stale by one sync (upstream 1.29 `CleanStaleEntries`).
///
/// Call it after a successful sync of the `family` proxier, with that proxier's service map
/// (already updated) and the two update results of the sync. Requests go out in a fixed
/// order: first the service IPs (deleted UDP cluster IPs, then the IPs of newly active
/// services — one sorted set), then the node ports of newly active services (ascending), then
/// per deleted endpoint (in sorted order) the node port NAT, the cluster IP NAT, and the
/// external and load-balancer IP NATs in the order the Service lists them. A request that
/// was already made in this call is not repeated (upstream repeats it when several ports of
/// one Service lose the same endpoint IP; the second run deletes nothing).
///
/// Every failure is logged and counted; none stops the rest.
pub fn clean_stale_entries(
    ct: &dyn Conntrack,
    family: IpFamily,
    services: &ServicePortMap,
    svc_result: &ServiceUpdateResult,
    ep_result: &EndpointsUpdateResult,
) -> CleanupSummary {
    run_requests(ct, family, &stale_requests(family, services, svc_result, ep_result))
}

/// The deletions [`clean_stale_entries`] makes for one sync, in its order, without repeats.
/// Pure: what a sync hands to the cleanup of 1.29–1.31.
pub fn stale_requests(
    family: IpFamily,
    services: &ServicePortMap,
    svc_result: &ServiceUpdateResult,
    ep_result: &EndpointsUpdateResult,
) -> Vec<ClearRequest> {
    let mut requests = stale_service_requests(family, services, svc_result, ep_result);
    requests.extend(stale_endpoint_requests(services, ep_result));
    let mut seen = HashSet::new();
    requests.retain(|request| seen.insert(request.clone()));
    requests
}

/// Runs `requests` in order; a failure is logged and counted and does not stop the rest.
pub fn run_requests(ct: &dyn Conntrack, family: IpFamily, requests: &[ClearRequest]) -> CleanupSummary {
    let mut summary = CleanupSummary::default();
    for request in requests {
        summary.requests += 1;
        if let Err(err) = ct.clear(request) {
            summary.failures += 1;
            tracing::error!(family = %family, request = %request, error = %err, "failed to delete stale conntrack entries");
        }
    }
    if summary.requests > 0 {
        tracing::debug!(
            family = %family,
            requests = summary.requests,
            failures = summary.failures,
            "deleted stale conntrack entries"
        );
    }
    summary
}

/// Upstream `deleteStaleServiceConntrackEntries`: entries to services that were deleted or
/// just got their first endpoint (which may hold black-hole entries from the REJECT era).
fn stale_service_requests(
    family: IpFamily,
    services: &ServicePortMap,
    svc_result: &ServiceUpdateResult,
    ep_result: &EndpointsUpdateResult,
) -> Vec<ClearRequest> {
    let mut ips: BTreeSet<(Protocol, String)> =
        svc_result.deleted_udp_cluster_ips.iter().map(|ip| (Protocol::Udp, ip.clone())).collect();
    let mut node_ports: BTreeSet<(Protocol, u16)> = BTreeSet::new();

    let mut newly_active: Vec<_> = ep_result.newly_active_udp_services.iter().collect();
    newly_active.sort();
    for name in newly_active {
        let Some(info) = services.get(name) else {
            tracing::debug!(service_port = %name, "newly active service port is not in the service map");
            continue;
        };
        if !is_clear_conntrack_needed(info.protocol) {
            continue;
        }
        tracing::debug!(service_port = %name, "newly active UDP service may have stale conntrack entries");
        ips.insert((info.protocol, info.cluster_ip.clone()));
        ips.extend(info.external_ips.iter().map(|ip| (info.protocol, ip.clone())));
        ips.extend(info.load_balancer_ips.iter().map(|ip| (info.protocol, ip.clone())));
        if let Some(port) = node_port(info.node_port) {
            node_ports.insert((info.protocol, port));
        }
    }

    if !ips.is_empty() || !node_ports.is_empty() {
        tracing::debug!(family = %family, ips = ?ips, node_ports = ?node_ports, "deleting stale service conntrack entries");
    }
    let by_ip = ips.into_iter().map(|(protocol, ip)| ClearRequest::Ip { ip, protocol });
    let by_port = node_ports.into_iter().map(|(protocol, port)| ClearRequest::Port { port, family, protocol });
    by_ip.chain(by_port).collect()
}

/// Upstream `deleteStaleEndpointConntrackEntries`: entries DNATed to endpoints that went away,
/// via every address and the node port of their service.
fn stale_endpoint_requests(services: &ServicePortMap, ep_result: &EndpointsUpdateResult) -> Vec<ClearRequest> {
    let mut deleted: Vec<_> = ep_result.deleted_udp_endpoints.iter().collect();
    deleted.sort();
    let mut requests = Vec::new();
    for stale in deleted {
        let name = &stale.service_port_name;
        let Some(info) = services.get(name) else {
            tracing::debug!(service_port = %name, endpoint = %stale.endpoint, "service of deleted endpoint is gone");
            continue;
        };
        if !is_clear_conntrack_needed(info.protocol) {
            continue;
        }
        let Some(dest) = endpoint_ip(&stale.endpoint) else {
            tracing::error!(service_port = %name, endpoint = %stale.endpoint, "cannot parse the IP of a deleted endpoint");
            continue;
        };
        let protocol = info.protocol;
        if let Some(port) = node_port(info.node_port) {
            requests.push(ClearRequest::PortNat { dest: dest.clone(), port, protocol });
        }
        let origins = std::iter::once(&info.cluster_ip).chain(&info.external_ips).chain(&info.load_balancer_ips);
        requests.extend(origins.map(|origin| ClearRequest::Nat {
            origin: origin.clone(),
            dest: dest.clone(),
            protocol,
        }));
    }
    requests
}

/// The service's node port, if it has a usable one.
fn node_port(port: i32) -> Option<u16> {
    u16::try_from(port).ok().filter(|p| *p != 0)
}

/// The IP of an `ip:port` / `[ip]:port` endpoint string in Go's canonical form (upstream
/// `IPPart`); a bare IP is returned as written. `None` when there is no valid IP in it.
fn endpoint_ip(endpoint: &str) -> Option<String> {
    if parse_ip_sloppy(endpoint).is_some() {
        return Some(endpoint.to_owned());
    }
    let host = match endpoint.strip_prefix('[') {
        Some(rest) => rest.split_once("]:")?.0,
        None => {
            let (host, _port) = endpoint.rsplit_once(':')?;
            if host.contains(':') {
                return None;
            }
            host
        }
    };
    parse_ip_sloppy(host).map(|ip| format_ip(&ip))
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::exec::{FakeExec, Output};
    use crate::model::{NamespacedName, ServicePortName};
    use crate::tracker::testing::svc;
    use crate::tracker::{ServiceChangeTracker, ServiceEndpoint};

    const CLUSTER_IP: &str = "172.30.1.1";
    const EXTERNAL_IP: &str = "192.168.99.100";
    const LB_IP: &str = "1.2.3.4";
    const ENDPOINT_IP: &str = "10.240.0.4";
    const NODE_PORT: u16 = 5353;

    fn spn(ns: &str, name: &str, port: &str, protocol: Protocol) -> ServicePortName {
        ServicePortName::new(NamespacedName::new(ns, name), port, protocol)
    }

    fn udp_port() -> ServicePortName {
        spn("test", "cleanup-test", "dns-udp", Protocol::Udp)
    }

    /// Upstream's fixture: one Service with a TCP and a UDP port on 53, an external IP, a
    /// load-balancer IP, and a node port on the UDP port.
    fn service_map() -> ServicePortMap {
        let svc = svc("test", "cleanup-test")
            .bare_cluster_ip(CLUSTER_IP)
            .external_ips(&[EXTERNAL_IP])
            .port("dns-tcp", "TCP", 53, 0)
            .port("dns-udp", "UDP", 53, i32::from(NODE_PORT))
            .lb_ingress(&[LB_IP])
            .build();
        let mut tracker = ServiceChangeTracker::new(IpFamily::V4, crate::compat::Features::default());
        tracker.update(None, Some(&svc));
        let mut map = ServicePortMap::new();
        map.update(&mut tracker);
        assert_eq!(map.len(), 2, "fixture: {map:?}");
        map
    }

    fn deleted(name: ServicePortName, endpoint: &str) -> ServiceEndpoint {
        ServiceEndpoint { service_port_name: name, endpoint: endpoint.to_owned() }
    }

    fn run(svc: ServiceUpdateResult, eps: EndpointsUpdateResult) -> (FakeConntrack, CleanupSummary) {
        let fake = FakeConntrack::new();
        let summary = clean_stale_entries(&fake, IpFamily::V4, &service_map(), &svc, &eps);
        (fake, summary)
    }

    fn set<T: Ord + Clone>(items: &[T]) -> BTreeSet<T> {
        items.iter().cloned().collect()
    }

    // Upstream TestCleanStaleEntries: "DeletedUDPClusterIPs clears entries for given
    // clusterIPs (only)".
    #[test]
    fn deleted_cluster_ips_clear_only_those_ips() {
        let svc = ServiceUpdateResult {
            // Not the fixture's cluster IP: that of some deleted service.
            deleted_udp_cluster_ips: BTreeSet::from(["172.30.99.99".to_owned()]),
            ..Default::default()
        };
        let (fake, summary) = run(svc, EndpointsUpdateResult::default());
        assert_eq!(fake.command_lines(), ["conntrack -D --orig-dst 172.30.99.99 -p udp"]);
        assert_eq!(fake.cleared_ips(), set(&["172.30.99.99".to_owned()]));
        assert!(fake.cleared_ports().is_empty() && fake.cleared_nats().is_empty());
        assert!(fake.cleared_port_nats().is_empty());
        assert_eq!(summary, CleanupSummary { requests: 1, failures: 0 });
    }

    // "DeletedUDPEndpoints clears NAT entries for all IPs and NodePorts".
    #[test]
    fn deleted_endpoint_clears_nat_entries_for_every_address_and_the_node_port() {
        let eps = EndpointsUpdateResult {
            deleted_udp_endpoints: vec![deleted(udp_port(), "10.240.0.4:5300")],
            ..Default::default()
        };
        let (fake, summary) = run(ServiceUpdateResult::default(), eps);
        assert_eq!(
            fake.command_lines(),
            [
                "conntrack -D -p udp --dport 5353 --dst-nat 10.240.0.4",
                "conntrack -D --orig-dst 172.30.1.1 --dst-nat 10.240.0.4 -p udp",
                "conntrack -D --orig-dst 192.168.99.100 --dst-nat 10.240.0.4 -p udp",
                "conntrack -D --orig-dst 1.2.3.4 --dst-nat 10.240.0.4 -p udp",
            ]
        );
        assert!(fake.cleared_ips().is_empty() && fake.cleared_ports().is_empty());
        assert_eq!(
            fake.cleared_nats(),
            set(&[
                (CLUSTER_IP.to_owned(), ENDPOINT_IP.to_owned()),
                (EXTERNAL_IP.to_owned(), ENDPOINT_IP.to_owned()),
                (LB_IP.to_owned(), ENDPOINT_IP.to_owned()),
            ])
        );
        assert_eq!(fake.cleared_port_nats(), set(&[(NODE_PORT, ENDPOINT_IP.to_owned())]));
        assert_eq!(summary.requests, 4);
    }

    // "NewlyActiveUDPServices clears entries for all IPs and NodePorts".
    #[test]
    fn newly_active_service_clears_every_address_and_the_node_port() {
        let eps = EndpointsUpdateResult { newly_active_udp_services: vec![udp_port()], ..Default::default() };
        let (fake, _) = run(ServiceUpdateResult::default(), eps);
        // IPs sorted as strings, then node ports.
        assert_eq!(
            fake.command_lines(),
            [
                "conntrack -D --orig-dst 1.2.3.4 -p udp",
                "conntrack -D --orig-dst 172.30.1.1 -p udp",
                "conntrack -D --orig-dst 192.168.99.100 -p udp",
                "conntrack -D -p udp --dport 5353",
            ]
        );
        assert_eq!(fake.cleared_ips(), set(&[CLUSTER_IP.to_owned(), EXTERNAL_IP.to_owned(), LB_IP.to_owned()]));
        assert_eq!(fake.cleared_ports(), set(&[NODE_PORT]));
        assert!(fake.cleared_nats().is_empty() && fake.cleared_port_nats().is_empty());
    }

    // "DeletedUDPEndpoints for unknown Service has no effect".
    #[test]
    fn deleted_endpoint_of_unknown_service_does_nothing() {
        let eps = EndpointsUpdateResult {
            deleted_udp_endpoints: vec![deleted(
                spn("unknown", "cleanup-test", "dns-udp", Protocol::Udp),
                "10.240.0.4:80",
            )],
            ..Default::default()
        };
        let (fake, summary) = run(ServiceUpdateResult::default(), eps);
        assert!(fake.calls().is_empty(), "{:?}", fake.command_lines());
        assert_eq!(summary, CleanupSummary::default());
    }

    // "NewlyActiveUDPServices for unknown Service has no effect".
    #[test]
    fn newly_active_unknown_service_does_nothing() {
        let eps = EndpointsUpdateResult {
            newly_active_udp_services: vec![spn("unknown", "cleanup-test", "dns-udp", Protocol::Udp)],
            ..Default::default()
        };
        let (fake, _) = run(ServiceUpdateResult::default(), eps);
        assert!(fake.calls().is_empty(), "{:?}", fake.command_lines());
    }

    #[test]
    fn all_cases_together_come_out_in_a_fixed_order() {
        let svc = ServiceUpdateResult {
            deleted_udp_cluster_ips: BTreeSet::from(["172.30.99.99".to_owned(), "172.30.0.5".to_owned()]),
            ..Default::default()
        };
        let eps = EndpointsUpdateResult {
            // Unsorted on purpose.
            deleted_udp_endpoints: vec![deleted(udp_port(), "10.240.0.9:5300"), deleted(udp_port(), "10.240.0.4:5300")],
            newly_active_udp_services: vec![udp_port()],
            ..Default::default()
        };
        let (fake, summary) = run(svc, eps);
        assert_eq!(
            fake.command_lines(),
            [
                "conntrack -D --orig-dst 1.2.3.4 -p udp",
                "conntrack -D --orig-dst 172.30.0.5 -p udp",
                "conntrack -D --orig-dst 172.30.1.1 -p udp",
                "conntrack -D --orig-dst 172.30.99.99 -p udp",
                "conntrack -D --orig-dst 192.168.99.100 -p udp",
                "conntrack -D -p udp --dport 5353",
                "conntrack -D -p udp --dport 5353 --dst-nat 10.240.0.4",
                "conntrack -D --orig-dst 172.30.1.1 --dst-nat 10.240.0.4 -p udp",
                "conntrack -D --orig-dst 192.168.99.100 --dst-nat 10.240.0.4 -p udp",
                "conntrack -D --orig-dst 1.2.3.4 --dst-nat 10.240.0.4 -p udp",
                "conntrack -D -p udp --dport 5353 --dst-nat 10.240.0.9",
                "conntrack -D --orig-dst 172.30.1.1 --dst-nat 10.240.0.9 -p udp",
                "conntrack -D --orig-dst 192.168.99.100 --dst-nat 10.240.0.9 -p udp",
                "conntrack -D --orig-dst 1.2.3.4 --dst-nat 10.240.0.9 -p udp",
            ]
        );
        assert_eq!(summary.requests, 14);
    }

    #[test]
    fn same_endpoint_ip_on_two_ports_is_cleared_once() {
        let svc =
            svc("ns", "dns").bare_cluster_ip("172.30.0.10").port("a", "UDP", 53, 0).port("b", "UDP", 5353, 0).build();
        let mut tracker = ServiceChangeTracker::new(IpFamily::V4, crate::compat::Features::default());
        tracker.update(None, Some(&svc));
        let mut map = ServicePortMap::new();
        map.update(&mut tracker);
        let eps = EndpointsUpdateResult {
            deleted_udp_endpoints: vec![
                deleted(spn("ns", "dns", "a", Protocol::Udp), "10.1.0.1:53"),
                deleted(spn("ns", "dns", "b", Protocol::Udp), "10.1.0.1:5353"),
            ],
            ..Default::default()
        };
        let fake = FakeConntrack::new();
        clean_stale_entries(&fake, IpFamily::V4, &map, &ServiceUpdateResult::default(), &eps);
        assert_eq!(fake.command_lines(), ["conntrack -D --orig-dst 172.30.0.10 --dst-nat 10.1.0.1 -p udp"]);
    }

    #[test]
    fn ipv6_requests_carry_the_family_flag_and_bare_endpoint_ips() {
        let svc = svc("ns", "dns6")
            .bare_cluster_ip("fd00:10:96::a")
            .external_ips(&["2001:db8::99"])
            .port("dns", "UDP", 53, 30053)
            .build();
        let mut tracker = ServiceChangeTracker::new(IpFamily::V6, crate::compat::Features::default());
        tracker.update(None, Some(&svc));
        let mut map = ServicePortMap::new();
        map.update(&mut tracker);
        let name = spn("ns", "dns6", "dns", Protocol::Udp);
        let eps = EndpointsUpdateResult {
            deleted_udp_endpoints: vec![deleted(name.clone(), "[fd00:10:244::5]:53")],
            newly_active_udp_services: vec![name],
            ..Default::default()
        };
        let fake = FakeConntrack::new();
        clean_stale_entries(&fake, IpFamily::V6, &map, &ServiceUpdateResult::default(), &eps);
        assert_eq!(
            fake.command_lines(),
            [
                "conntrack -D --orig-dst 2001:db8::99 -p udp -f ipv6",
                "conntrack -D --orig-dst fd00:10:96::a -p udp -f ipv6",
                "conntrack -D -p udp --dport 30053 -f ipv6",
                "conntrack -D -p udp --dport 30053 --dst-nat fd00:10:244::5 -f ipv6",
                "conntrack -D --orig-dst fd00:10:96::a --dst-nat fd00:10:244::5 -p udp -f ipv6",
                "conntrack -D --orig-dst 2001:db8::99 --dst-nat fd00:10:244::5 -p udp -f ipv6",
            ]
        );
    }

    #[test]
    fn a_failure_is_counted_and_does_not_stop_the_rest() {
        let fake = FakeConntrack::new();
        fake.fail_on(ClearRequest::Ip { ip: CLUSTER_IP.into(), protocol: Protocol::Udp });
        let eps = EndpointsUpdateResult {
            newly_active_udp_services: vec![udp_port()],
            deleted_udp_endpoints: vec![deleted(udp_port(), "not-an-ip:53")],
            ..Default::default()
        };
        let summary = clean_stale_entries(&fake, IpFamily::V4, &service_map(), &ServiceUpdateResult::default(), &eps);
        // The unparsable endpoint is skipped (logged) without a request.
        assert_eq!(summary, CleanupSummary { requests: 4, failures: 1 });
        assert_eq!(fake.cleared_ports(), set(&[NODE_PORT]));
    }

    #[test]
    fn nothing_to_do_makes_no_calls() {
        let (fake, summary) = run(ServiceUpdateResult::default(), EndpointsUpdateResult::default());
        assert!(fake.calls().is_empty());
        assert_eq!(summary, CleanupSummary::default());
    }

    // Upstream conntrack_test.go: the argv of each ClearEntriesFor* (TestClearUDPConntrackForIP,
    // TestClearUDPConntrackForPort, TestDeleteUDPConnections, TestClearUDPConntrackForPortNAT).
    #[test]
    fn argv_per_request_matches_upstream() {
        let cases = [
            (ClearRequest::Ip { ip: "10.240.0.3".into(), protocol: Protocol::Udp }, "-D --orig-dst 10.240.0.3 -p udp"),
            (
                ClearRequest::Ip { ip: "2001:db8::10".into(), protocol: Protocol::Udp },
                "-D --orig-dst 2001:db8::10 -p udp -f ipv6",
            ),
            (
                ClearRequest::Ip { ip: "::ffff:10.240.0.3".into(), protocol: Protocol::Udp },
                "-D --orig-dst ::ffff:10.240.0.3 -p udp",
            ),
            (
                ClearRequest::Port { port: 8080, family: IpFamily::V4, protocol: Protocol::Udp },
                "-D -p udp --dport 8080",
            ),
            (
                ClearRequest::Port { port: 6666, family: IpFamily::V6, protocol: Protocol::Sctp },
                "-D -p sctp --dport 6666 -f ipv6",
            ),
            (
                ClearRequest::Nat { origin: "1.2.3.4".into(), dest: "10.20.30.40".into(), protocol: Protocol::Udp },
                "-D --orig-dst 1.2.3.4 --dst-nat 10.20.30.40 -p udp",
            ),
            (
                ClearRequest::Nat {
                    origin: "fd00::600d:f00d".into(),
                    dest: "2001:db8::5".into(),
                    protocol: Protocol::Sctp,
                },
                "-D --orig-dst fd00::600d:f00d --dst-nat 2001:db8::5 -p sctp -f ipv6",
            ),
            (
                ClearRequest::PortNat { dest: "1.2.3.4".into(), port: 30211, protocol: Protocol::Udp },
                "-D -p udp --dport 30211 --dst-nat 1.2.3.4",
            ),
            (
                ClearRequest::PortNat { dest: "2001:db8::5".into(), port: 30211, protocol: Protocol::Udp },
                "-D -p udp --dport 30211 --dst-nat 2001:db8::5 -f ipv6",
            ),
        ];
        for (request, want) in cases {
            assert_eq!(request.args().expect("valid").join(" "), want, "{request}");
        }
    }

    #[test]
    fn invalid_requests_are_rejected_without_running_anything() {
        let exec = Arc::new(FakeExec::new());
        let ct = ExecConntrack::new(exec.clone());
        let err = ct.clear_entries_for_ip("--flush", Protocol::Udp).expect_err("not an IP");
        assert!(matches!(err, ConntrackError::InvalidAddress { .. }), "{err}");
        let err = ct.clear_entries_for_nat("10.0.0.1", "", Protocol::Udp).expect_err("empty dest");
        assert!(err.to_string().contains("\"\" is not an IP address"), "{err}");
        let err = ct.clear_entries_for_port(0, IpFamily::V4, Protocol::Udp).expect_err("port 0");
        assert!(matches!(err, ConntrackError::InvalidPort { .. }), "{err}");
        let err = ct.clear_entries_for_port_nat("10.0.0.1", 0, Protocol::Udp).expect_err("port 0");
        assert!(matches!(err, ConntrackError::InvalidPort { .. }), "{err}");
        assert!(exec.calls().is_empty());
    }

    // Upstream TestExecConntrackTool and the "simulated error" cases: "0 flow entries have
    // been deleted" with exit status 1 is success; any other failure is an error.
    #[test]
    fn exec_conntrack_runs_the_tool_and_reads_its_status() {
        let exec = Arc::new(FakeExec::new());
        exec.expect("conntrack -D --orig-dst 10.240.0.3 -p udp", Output::ok("1 flow entries have been deleted\n"))
            .expect(
                "conntrack -D -p udp --dport 9090",
                Output::exit(1, "conntrack v1.4.7 (conntrack-tools): 0 flow entries have been deleted.\n"),
            )
            .expect(
                "conntrack -D --orig-dst 1.2.3.4 --dst-nat 10.20.30.40 -p udp",
                Output::exit(1, "conntrack v1.4.7 (conntrack-tools): Operation failed: invalid parameters\n"),
            )
            .expect_err(
                "conntrack -D -p udp --dport 30211 --dst-nat 1.2.3.4",
                ExecError::NotFound { program: "conntrack".into() },
            );
        let ct = ExecConntrack::new(exec.clone()).with_timeout(Duration::from_secs(7));

        ct.clear_entries_for_ip("10.240.0.3", Protocol::Udp).expect("deleted");
        ct.clear_entries_for_port(9090, IpFamily::V4, Protocol::Udp).expect("nothing to delete is fine");
        let err = ct.clear_entries_for_nat("1.2.3.4", "10.20.30.40", Protocol::Udp).expect_err("failed");
        match &err {
            ConntrackError::Failed { status, output, .. } => {
                assert_eq!(status, "exit status 1");
                assert!(output.contains("invalid parameters"), "{output}");
            }
            other => panic!("unexpected error {other}"),
        }
        assert!(err.to_string().starts_with("failed to delete UDP conntrack entries to 1.2.3.4 DNATed to 10.20.30.40"));
        let err = ct.clear_entries_for_port_nat("1.2.3.4", 30211, Protocol::Udp).expect_err("missing tool");
        assert!(matches!(err, ConntrackError::Exec { source: ExecError::NotFound { .. }, .. }), "{err}");

        assert_eq!(exec.remaining(), 0);
        assert!(exec.calls().iter().all(|c| c.timeout == Some(Duration::from_secs(7)) && c.stdin.is_none()));
    }

    #[test]
    fn exec_conntrack_in_a_namespace_prefixes_ip_netns_exec() {
        let exec = Arc::new(FakeExec::new());
        exec.expect("ip netns exec kprs-test conntrack -D --orig-dst 198.18.0.20 -p udp", Output::ok(""));
        let ct = ExecConntrack::new(exec.clone()).in_netns("kprs-test");
        ct.clear_entries_for_ip("198.18.0.20", Protocol::Udp).expect("ok");
        assert_eq!(exec.calls()[0].argv[..4], ["ip", "netns", "exec", "kprs-test"]);
    }

    #[test]
    fn a_killed_conntrack_is_an_error() {
        let exec = Arc::new(FakeExec::new());
        exec.expect_any(Output { status: None, stdout: Vec::new(), stderr: Vec::new() });
        let err = ExecConntrack::new(exec).clear_entries_for_ip("10.0.0.1", Protocol::Udp).expect_err("killed");
        assert!(err.to_string().contains("exited with a signal"), "{err}");
    }

    #[test]
    fn endpoint_ip_is_upstreams_ip_part() {
        assert_eq!(endpoint_ip("10.1.0.1:80").as_deref(), Some("10.1.0.1"));
        assert_eq!(endpoint_ip("[fd00::1]:80").as_deref(), Some("fd00::1"));
        assert_eq!(endpoint_ip("[FD00:0::1]:80").as_deref(), Some("fd00::1"));
        assert_eq!(endpoint_ip("[::ffff:10.1.0.1]:80").as_deref(), Some("10.1.0.1"));
        assert_eq!(endpoint_ip("010.001.000.001:80").as_deref(), Some("10.1.0.1"));
        assert_eq!(endpoint_ip("10.1.0.1").as_deref(), Some("10.1.0.1"));
        assert_eq!(endpoint_ip("fd00::1").as_deref(), Some("fd00::1"));
        for bad in ["", ":80", "host:80", "fd00::1:80:x", "[fd00::1]", "[nope]:80"] {
            assert_eq!(endpoint_ip(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn tcp_service_ports_are_never_cleared() {
        // The tracker only reports UDP, but a TCP name must not turn into deletions.
        let tcp = spn("test", "cleanup-test", "dns-tcp", Protocol::Tcp);
        let eps = EndpointsUpdateResult {
            deleted_udp_endpoints: vec![deleted(tcp.clone(), "10.240.0.4:53")],
            newly_active_udp_services: vec![tcp],
            ..Default::default()
        };
        let (fake, _) = run(ServiceUpdateResult::default(), eps);
        assert!(fake.calls().is_empty(), "{:?}", fake.command_lines());
    }
}
