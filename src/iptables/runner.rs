//! The real [`Iptables`]: runs the `iptables`/`ip6tables` binaries (and their `-save` and
//! `-restore` companions) through [`Exec`].
//!
//! This module owns [`IptablesRunner`], the version probing that decides which flags the
//! binaries accept ([`IptablesVersion`], [`wait_flags`], [`restore_wait_flags`]), the parsing
//! of `iptables-restore` failures into a line number ([`parse_restore_error`]) and the
//! detection of which backend (nft or legacy) the host already uses ([`detect_backend`]).
//!
//! Behaviour follows upstream's `pkg/util/iptables` runner:
//!
//! * The version comes from `iptables --version`; if that fails the runner assumes 1.4.11
//!   (the oldest release with `-C`).
//! * Single commands get `-w 5 -W 100000` (>= 1.6.1), `-w 5` (>= 1.4.22), `-w` (>= 1.4.20) or
//!   nothing. `iptables-restore` gets `-w 5 -W 100000` from 1.6.2 on; older, it gets `-w` if
//!   `iptables-restore --version` (with empty stdin) reports a version, and otherwise the
//!   runner takes the xtables lock itself (see [`super::lock`]).
//! * `-N` exiting 1 means the chain existed; `-S` exiting 1 means it does not; `-C` exiting 1
//!   means the rule is absent. Without `-C` (before 1.4.11) rule presence is decided from
//!   `iptables-save` output.
//! * Calls are serialised by a mutex, as the [`Iptables`] contract asks.
//!
//! Restore inputs ([`RestoreInput`]) are written into `iptables-restore`'s stdin while it
//! runs, never held whole; on iptables-nft a `--noflush` restore goes in dependency order
//! through [`super::restore_plan`], one transaction per piece.
//!
//! A restore failure is reported as [`IptablesError::RestoreLine`] when the output names a
//! line, with the lines around it. iptables 1.8 words this several ways, all recognised:
//!
//! ```text
//! iptables-restore v1.8.9 (legacy): unknown option "--bogus"      (then)
//! Error occurred at line: 3
//! iptables-restore: line 2 failed                                  (legacy, on COMMIT)
//! iptables-nft-restore: line 2 failed: No chain/target/match by that name.
//! line 2: CHAIN_DEL failed (Device or resource busy): chain FOO    (nft, on COMMIT)
//! iptables-restore: COMMIT expected at line 4
//! ```
//!
//! (nft reports a jump to a missing chain at the table's `COMMIT` line, legacy at the rule.)
//!
//! The runner can drive iptables inside a named network namespace (`ip netns exec NAME ...`),
//! which is how the real-iptables tests use it.

use std::sync::{Arc, LazyLock, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use regex::Regex;

use super::lock::{Locker, XtablesLocker};
use super::restore_plan::apply_in_pieces;
use super::{
    FlushFlag, Iptables, IptablesError, Layout, RestoreCounters, RestoreInput, Result, RulePosition, Table, save,
};
use crate::exec::{Command, Exec, Output};
use crate::model::IpFamily;

/// A dotted iptables version (`major.minor.patch`; missing parts are 0).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct IptablesVersion {
    pub major: u32,
    pub minor: u32,
    pub patch: u32,
}

impl IptablesVersion {
    pub const fn new(major: u32, minor: u32, patch: u32) -> Self {
        IptablesVersion { major, minor, patch }
    }

    /// Finds `vX.Y[.Z...]` in `text` (the output of `--version`).
    pub fn find_in(text: &str) -> Option<IptablesVersion> {
        static VERSION: LazyLock<Regex> =
            LazyLock::new(|| Regex::new(r"v([0-9]+(\.[0-9]+)+)").expect("constant regex is valid"));
        let captures = VERSION.captures(text)?;
        Self::parse(captures.get(1)?.as_str())
    }

    /// Parses `X.Y` or `X.Y.Z` (further components are ignored).
    pub fn parse(s: &str) -> Option<IptablesVersion> {
        let mut parts = s.split('.').map(|p| p.parse::<u32>().ok());
        let major = parts.next()??;
        let minor = parts.next()??;
        let patch = match parts.next() {
            Some(p) => p?,
            None => 0,
        };
        if parts.any(|p| p.is_none()) {
            return None;
        }
        Some(IptablesVersion { major, minor, patch })
    }
}

impl std::fmt::Display for IptablesVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}

/// Oldest release with `-C`/`--check`.
pub(crate) const MIN_CHECK_VERSION: IptablesVersion = IptablesVersion::new(1, 4, 11);
/// Oldest release whose MASQUERADE takes `--random-fully`.
pub(crate) const RANDOM_FULLY_MIN_VERSION: IptablesVersion = IptablesVersion::new(1, 6, 2);
/// Oldest release with `-w`.
pub(crate) const WAIT_MIN_VERSION: IptablesVersion = IptablesVersion::new(1, 4, 20);
/// Oldest release with `-w SECONDS`.
pub(crate) const WAIT_SECONDS_MIN_VERSION: IptablesVersion = IptablesVersion::new(1, 4, 22);
/// Oldest release with `-W USECONDS`.
pub(crate) const WAIT_INTERVAL_MIN_VERSION: IptablesVersion = IptablesVersion::new(1, 6, 1);
/// Oldest release whose `iptables-restore` takes `-w SECONDS -W USECONDS`.
pub(crate) const WAIT_RESTORE_MIN_VERSION: IptablesVersion = IptablesVersion::new(1, 6, 2);

const WAIT_FULL: &[&str] = &["-w", "5", "-W", "100000"];

/// The lock-wait flags for single `iptables` commands of `version`.
pub(crate) fn wait_flags(version: IptablesVersion) -> &'static [&'static str] {
    if version >= WAIT_INTERVAL_MIN_VERSION {
        WAIT_FULL
    } else if version >= WAIT_SECONDS_MIN_VERSION {
        &["-w", "5"]
    } else if version >= WAIT_MIN_VERSION {
        &["-w"]
    } else {
        &[]
    }
}

/// The lock-wait flags for `iptables-restore`, given the `iptables` version and whether
/// `iptables-restore --version` reported a version (older backports that do have `--version`
/// also accept `-w`). Empty means the caller must take the xtables lock itself.
pub(crate) fn restore_wait_flags(version: IptablesVersion, restore_reports_version: bool) -> &'static [&'static str] {
    if version >= WAIT_RESTORE_MIN_VERSION {
        WAIT_FULL
    } else if restore_reports_version {
        &["-w"]
    } else {
        &[]
    }
}

/// The line number `iptables-restore` blamed in its output (see the module docs for the
/// formats), or `None` if it named none.
pub fn parse_restore_error(output: &str) -> Option<usize> {
    static PATTERNS: LazyLock<[Regex; 4]> = LazyLock::new(|| {
        [r"Error occurred at line: ([0-9]+)", r"line ([0-9]+) failed", r"(?m)^line ([0-9]+): ", r"at line:? ([0-9]+)"]
            .map(|p| Regex::new(p).expect("constant regex is valid"))
    });
    PATTERNS.iter().find_map(|re| re.captures(output)?.get(1)?.as_str().parse().ok().filter(|&n: &usize| n > 0))
}

/// Which flavour of the iptables binaries to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Backend {
    /// `iptables`, `iptables-save`, `iptables-restore`: whatever the host's alternatives say.
    #[default]
    Default,
    /// `iptables-nft`, `iptables-nft-save`, `iptables-nft-restore`.
    Nft,
    /// `iptables-legacy`, `iptables-legacy-save`, `iptables-legacy-restore`.
    Legacy,
}

impl Backend {
    pub fn as_str(self) -> &'static str {
        match self {
            Backend::Default => "default",
            Backend::Nft => "nft",
            Backend::Legacy => "legacy",
        }
    }

    fn infix(self) -> &'static str {
        match self {
            Backend::Default => "",
            Backend::Nft => "-nft",
            Backend::Legacy => "-legacy",
        }
    }
}

impl std::fmt::Display for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The three binary names of one family and backend.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Binaries {
    pub iptables: String,
    pub save: String,
    pub restore: String,
}

impl Binaries {
    pub fn new(family: IpFamily, backend: Backend) -> Self {
        let base = match family {
            IpFamily::V4 => "iptables",
            IpFamily::V6 => "ip6tables",
        };
        let stem = format!("{base}{}", backend.infix());
        Binaries { save: format!("{stem}-save"), restore: format!("{stem}-restore"), iptables: stem }
    }
}

/// How to build an [`IptablesRunner`].
#[derive(Debug, Clone)]
pub struct RunnerOptions {
    pub backend: Backend,
    /// Run every command inside this network namespace (`ip netns exec NAME ...`).
    pub netns: Option<String>,
    /// Kill any single command that runs longer than this.
    pub command_timeout: Duration,
    /// On iptables-nft, a `--noflush` restore is applied in pieces that each cost at most
    /// this (see [`super::restore_plan`]); `None` never splits.
    pub split_budget: Option<u64>,
}

impl Default for RunnerOptions {
    fn default() -> Self {
        RunnerOptions {
            backend: Backend::Default,
            netns: None,
            command_timeout: Duration::from_secs(300),
            split_budget: Some(super::restore_plan::DEFAULT_BUDGET),
        }
    }
}

/// How commands reach the binaries: the exec, the namespace prefix and the timeout.
#[derive(Clone)]
struct Invoker {
    exec: Arc<dyn Exec>,
    netns: Option<String>,
    timeout: Duration,
}

impl Invoker {
    fn command(&self, program: &str, args: &[&str]) -> Command<'static> {
        let cmd = match &self.netns {
            Some(ns) => Command::new("ip").args(["netns", "exec", ns.as_str(), program]),
            None => Command::new(program),
        };
        cmd.args(args.iter().copied()).timeout(self.timeout)
    }

    fn run(&self, cmd: &Command<'_>) -> Result<Output> {
        tracing::trace!(command = %cmd, "running");
        self.exec.run(cmd).map_err(|e| IptablesError::Exec { command: cmd.to_string(), reason: e.to_string() })
    }

    /// Runs `cmd` with `input` (canonical layout) written into its stdin as it runs.
    fn run_feeding(&self, cmd: &Command<'_>, input: &dyn RestoreInput) -> Result<Output> {
        tracing::trace!(command = %cmd, "running");
        self.exec
            .run_feeding(cmd, &|out: &mut dyn std::io::Write| input.write_to(Layout::Canonical, out))
            .map_err(|e| IptablesError::Exec { command: cmd.to_string(), reason: e.to_string() })
    }
}

/// Messages iptables 1.8 prints when a chain, target or match does not exist (exit 1 or 2
/// depending on the backend and the operation).
const NOT_FOUND_MESSAGES: &[&str] = &[
    "No chain/target/match by that name",
    "No such file or directory",
    "does a matching rule exist",
    "does not exist",
];

/// Whether `err` is iptables saying a chain, rule, target or match does not exist (upstream's
/// `IsNotFoundError`), as opposed to failing for another reason.
pub(crate) fn is_not_found(err: &IptablesError) -> bool {
    match err {
        IptablesError::Failed { output, .. } => NOT_FOUND_MESSAGES.iter().any(|m| output.contains(m)),
        _ => false,
    }
}

/// `Ok(true)` for exit 0, `Ok(false)` for exit 1 (iptables' "no such thing" / "already
/// exists"), an error otherwise.
fn zero_or_one(cmd: &Command<'_>, out: &Output) -> Result<bool> {
    match out.status {
        Some(0) => Ok(true),
        Some(1) => Ok(false),
        _ => Err(failed(cmd, out)),
    }
}

fn failed(cmd: &Command<'_>, out: &Output) -> IptablesError {
    let output = out.combined().trim().to_string();
    match out.status {
        Some(status) => IptablesError::Failed { command: cmd.program.clone(), args: args_text(cmd), status, output },
        None => IptablesError::Exec { command: cmd.to_string(), reason: format!("killed by a signal: {output}") },
    }
}

fn args_text(cmd: &Command<'_>) -> String {
    let mut text = cmd.to_string();
    text.drain(..cmd.program.len().min(text.len()));
    text.trim_start().to_string()
}

/// The real iptables, one family, one backend. See the module docs.
pub struct IptablesRunner {
    family: IpFamily,
    bins: Binaries,
    invoker: Invoker,
    locker: Arc<dyn Locker>,
    version: Option<IptablesVersion>,
    /// `--version` said `(nf_tables)`: chain names can be read with `nft` (see [`super::nft`])
    /// and large restores are split (see [`super::restore_plan`]).
    nf_tables: bool,
    split_budget: Option<u64>,
    has_check: bool,
    has_random_fully: bool,
    wait_flag: &'static [&'static str],
    restore_wait_flag: &'static [&'static str],
    mu: Mutex<()>,
}

impl std::fmt::Debug for IptablesRunner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IptablesRunner")
            .field("family", &self.family)
            .field("bins", &self.bins)
            .field("netns", &self.invoker.netns)
            .field("version", &self.version)
            .field("wait_flag", &self.wait_flag)
            .field("restore_wait_flag", &self.restore_wait_flag)
            .finish_non_exhaustive()
    }
}

impl IptablesRunner {
    /// Probes the binaries' version and builds a runner that takes the real xtables locks
    /// when it has to.
    pub fn new(exec: Arc<dyn Exec>, family: IpFamily, options: RunnerOptions) -> Self {
        Self::with_locker(exec, family, options, Arc::new(XtablesLocker::default()))
    }

    /// Like [`IptablesRunner::new`] with a chosen [`Locker`] for the no-`-w` fallback.
    pub(crate) fn with_locker(
        exec: Arc<dyn Exec>,
        family: IpFamily,
        options: RunnerOptions,
        locker: Arc<dyn Locker>,
    ) -> Self {
        let bins = Binaries::new(family, options.backend);
        let invoker = Invoker { exec, netns: options.netns, timeout: options.command_timeout };

        let version_text = probe_version_text(&invoker, &bins.iptables);
        let version = version_text.as_deref().and_then(IptablesVersion::find_in);
        let nf_tables = version_text.as_deref().is_some_and(|t| t.contains("nf_tables"));
        let effective = version.unwrap_or_else(|| {
            tracing::info!(
                command = %bins.iptables,
                assumed = %MIN_CHECK_VERSION,
                "could not determine the iptables version; assuming at least the minimum"
            );
            MIN_CHECK_VERSION
        });
        let restore_wait_flag = if effective >= WAIT_RESTORE_MIN_VERSION {
            restore_wait_flags(effective, true)
        } else {
            let reports = probe_version(&invoker, &bins.restore).is_some();
            if !reports {
                tracing::debug!(command = %bins.restore, "no iptables-restore version; assuming it lacks --wait");
            }
            restore_wait_flags(effective, reports)
        };
        let runner = IptablesRunner {
            family,
            invoker,
            locker,
            version,
            nf_tables,
            split_budget: options.split_budget,
            has_check: effective >= MIN_CHECK_VERSION,
            has_random_fully: effective >= RANDOM_FULLY_MIN_VERSION,
            wait_flag: wait_flags(effective),
            restore_wait_flag,
            bins,
            mu: Mutex::new(()),
        };
        tracing::debug!(
            command = %runner.bins.iptables,
            version = %effective,
            wait_flag = ?runner.wait_flag,
            restore_wait_flag = ?runner.restore_wait_flag,
            netns = runner.invoker.netns.as_deref().unwrap_or(""),
            "iptables runner ready"
        );
        runner
    }

    /// The version `--version` reported, if it could be read.
    pub fn version(&self) -> Option<IptablesVersion> {
        self.version
    }

    pub fn binaries(&self) -> &Binaries {
        &self.bins
    }

    /// The flags every single command is given.
    pub fn wait_flag(&self) -> &[&str] {
        self.wait_flag
    }

    /// The flags `iptables-restore` is given (empty: the runner takes the lock itself).
    pub fn restore_wait_flag(&self) -> &[&str] {
        self.restore_wait_flag
    }

    fn lock(&self) -> MutexGuard<'_, ()> {
        self.mu.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// `iptables WAIT OP CHAIN -t TABLE ARGS...` (upstream's argument order).
    fn single(&self, op: &str, table: Table, chain: &str, args: &[&str]) -> Result<(Command<'static>, Output)> {
        let mut full: Vec<&str> = self.wait_flag.to_vec();
        full.extend([op, chain, "-t", table.as_str()]);
        full.extend_from_slice(args);
        let cmd = self.invoker.command(&self.bins.iptables, &full);
        let out = self.invoker.run(&cmd)?;
        Ok((cmd, out))
    }

    fn check_rule(&self, table: Table, chain: &str, args: &[&str]) -> Result<bool> {
        if self.has_check {
            let (cmd, out) = self.single("-C", table, chain, args)?;
            return match zero_or_one(&cmd, &out) {
                // A rule jumping to a missing chain (or using a missing match) cannot exist;
                // iptables says so with a usage error rather than exit 1.
                Err(e) if is_not_found(&e) => Ok(false),
                other => other,
            };
        }
        let mut saved = Vec::new();
        self.save_locked(table, &mut saved)?;
        Ok(save_has_rule(&String::from_utf8_lossy(&saved), chain, args))
    }

    fn save_locked(&self, table: Table, out: &mut Vec<u8>) -> Result<()> {
        let cmd = self.invoker.command(&self.bins.save, &["-t", table.as_str()]);
        let output = self.invoker.run(&cmd)?;
        if !output.success() {
            return Err(failed(&cmd, &output));
        }
        // The nat table of a large cluster is tens of megabytes: hand the buffer over
        // rather than copying it when the caller's is empty (it always is in the proxier).
        if out.is_empty() {
            *out = output.stdout;
        } else {
            out.extend_from_slice(&output.stdout);
        }
        Ok(())
    }

    fn restore_internal(
        &self,
        table: Option<Table>,
        input: &dyn RestoreInput,
        flush: FlushFlag,
        counters: RestoreCounters,
    ) -> Result<()> {
        let _serial = self.lock();
        let mut args: Vec<&str> = self.restore_wait_flag.to_vec();
        if let Some(table) = table {
            args.extend(["-T", table.as_str()]);
        }
        if flush == FlushFlag::NoFlush {
            args.push("--noflush");
        }
        if counters == RestoreCounters::Counters {
            args.push("--counters");
        }
        let _xtables = if self.restore_wait_flag.is_empty() {
            Some(self.locker.acquire().map_err(|e| IptablesError::Lock(e.to_string()))?)
        } else {
            None
        };
        let cmd = self.invoker.command(&self.bins.restore, &args);
        let out = self.invoker.run_feeding(&cmd, input)?;
        if out.success() {
            return Ok(());
        }
        let output = out.combined().trim().to_string();
        match parse_restore_error(&output) {
            Some(line) => {
                // The input was streamed, not kept: write it again to show the failing line.
                let context = super::input_text(input, Layout::Canonical)
                    .map(|text| save::format_line_context(&text, line, 3))
                    .unwrap_or_default();
                Err(IptablesError::RestoreLine { command: self.bins.restore.clone(), line, output, context })
            }
            None => Err(failed(&cmd, &out)),
        }
    }
}

/// Logs a restore that iptables-restore rejected, with the lines around the failing one.
fn log_restore_line_error(err: &IptablesError) {
    if let IptablesError::RestoreLine { command, line, output, context } = err {
        tracing::warn!(%command, line, %context, %output, "iptables-restore rejected its input");
    }
}

/// Runs `program --version` (stdin empty, as some old `iptables-restore` builds read it
/// regardless) and extracts the version.
fn probe_version(invoker: &Invoker, program: &str) -> Option<IptablesVersion> {
    probe_version_text(invoker, program).as_deref().and_then(IptablesVersion::find_in)
}

/// What `program --version` printed, when it succeeded.
fn probe_version_text(invoker: &Invoker, program: &str) -> Option<String> {
    let cmd = invoker.command(program, &["--version"]).stdin(Vec::new());
    match invoker.run(&cmd) {
        Ok(out) if out.success() => {
            let text = out.combined();
            if IptablesVersion::find_in(&text).is_none() {
                tracing::debug!(command = %cmd, output = %text.trim(), "no version in --version output");
            }
            Some(text)
        }
        Ok(out) => {
            tracing::debug!(command = %cmd, status = ?out.status, output = %out.combined().trim(), "--version failed");
            None
        }
        Err(e) => {
            tracing::debug!(command = %cmd, error = %e, "--version could not run");
            None
        }
    }
}

/// Whether `iptables-save` output holds `-A chain args...`, compared roughly the way upstream
/// does without `-C`: words split on whitespace (so a multi-word comment becomes several
/// words), quotes and `0x` prefixes dropped (iptables-save's quoting and hex formatting differ
/// from what callers pass), and the words compared as multisets.
fn save_has_rule(saved: &str, chain: &str, args: &[&str]) -> bool {
    fn normalise<'a>(words: impl Iterator<Item = &'a str>) -> Vec<String> {
        let mut out: Vec<String> = words
            .flat_map(|w| {
                let w = w.trim_matches('"');
                let w = w.strip_prefix("0x").unwrap_or(w);
                w.split_whitespace().map(str::to_string).collect::<Vec<_>>()
            })
            .collect();
        out.sort();
        out
    }
    let wanted = normalise(args.iter().copied());
    saved.lines().any(|line| {
        let mut words = line.split_whitespace();
        words.next() == Some("-A") && words.next() == Some(chain) && normalise(words) == wanted
    })
}

impl Iptables for IptablesRunner {
    fn family(&self) -> IpFamily {
        self.family
    }

    fn ensure_chain(&self, table: Table, chain: &str) -> Result<bool> {
        let _serial = self.lock();
        let (cmd, out) = self.single("-N", table, chain, &[])?;
        // `-N` exits 1 when the chain exists; it created the chain on 0.
        zero_or_one(&cmd, &out).map(|created| !created)
    }

    fn flush_chain(&self, table: Table, chain: &str) -> Result<()> {
        let _serial = self.lock();
        let (cmd, out) = self.single("-F", table, chain, &[])?;
        if out.success() { Ok(()) } else { Err(failed(&cmd, &out)) }
    }

    fn delete_chain(&self, table: Table, chain: &str) -> Result<()> {
        let _serial = self.lock();
        let (cmd, out) = self.single("-X", table, chain, &[])?;
        if out.success() { Ok(()) } else { Err(failed(&cmd, &out)) }
    }

    fn chain_exists(&self, table: Table, chain: &str) -> Result<bool> {
        let _serial = self.lock();
        let (cmd, out) = self.single("-S", table, chain, &[])?;
        zero_or_one(&cmd, &out)
    }

    fn ensure_rule(&self, position: RulePosition, table: Table, chain: &str, args: &[&str]) -> Result<bool> {
        let _serial = self.lock();
        if self.check_rule(table, chain, args)? {
            return Ok(true);
        }
        let (cmd, out) = self.single(position.flag(), table, chain, args)?;
        if out.success() { Ok(false) } else { Err(failed(&cmd, &out)) }
    }

    fn rule_exists(&self, table: Table, chain: &str, args: &[&str]) -> Result<bool> {
        let _serial = self.lock();
        self.check_rule(table, chain, args)
    }

    fn delete_rule(&self, table: Table, chain: &str, args: &[&str]) -> Result<()> {
        let _serial = self.lock();
        if !self.check_rule(table, chain, args)? {
            return Ok(());
        }
        let (cmd, out) = self.single("-D", table, chain, args)?;
        if out.success() { Ok(()) } else { Err(failed(&cmd, &out)) }
    }

    fn save_into(&self, table: Table, out: &mut Vec<u8>) -> Result<()> {
        let _serial = self.lock();
        self.save_locked(table, out)
    }

    fn list_chains(&self, table: Table) -> Result<Vec<String>> {
        let _serial = self.lock();
        if self.nf_tables {
            let cmd = self.invoker.command("nft", &["list", "chains", super::nft::nft_family(self.family)]);
            match self.invoker.run(&cmd) {
                Ok(out) if out.success() => {
                    return Ok(super::nft::chains_from_nft_listing(
                        &String::from_utf8_lossy(&out.stdout),
                        self.family,
                        table,
                    ));
                }
                Ok(out) => {
                    tracing::info!(command = %cmd, output = %out.combined().trim(), "nft could not list chains; reading iptables-save instead")
                }
                Err(e) => {
                    tracing::info!(error = %e, "nft is not usable; reading chain names from iptables-save instead")
                }
            }
        }
        let mut saved = Vec::new();
        self.save_locked(table, &mut saved)?;
        Ok(save::chains_from_table(&saved).into_iter().collect())
    }

    fn restore(&self, table: Table, data: &[u8], flush: FlushFlag, counters: RestoreCounters) -> Result<()> {
        self.restore_internal(Some(table), &data, flush, counters).inspect_err(log_restore_line_error)
    }

    fn restore_all(&self, data: &[u8], flush: FlushFlag, counters: RestoreCounters) -> Result<()> {
        self.restore_input(&data, flush, counters, &mut || {})
    }

    fn restore_input(
        &self,
        input: &dyn RestoreInput,
        flush: FlushFlag,
        counters: RestoreCounters,
        on_step: &mut dyn FnMut(),
    ) -> Result<()> {
        let split_budget = self.split_budget.filter(|_| self.nf_tables && flush == FlushFlag::NoFlush);
        if let Some(budget) = split_budget {
            let restore_piece = &mut |piece: &[u8]| self.restore_internal(None, &piece, flush, counters);
            if apply_in_pieces(input, budget, restore_piece, on_step).inspect_err(log_restore_line_error)? {
                return Ok(());
            }
        }
        self.restore_internal(None, input, flush, counters).inspect_err(log_restore_line_error)?;
        on_step();
        Ok(())
    }

    fn has_random_fully(&self) -> bool {
        self.has_random_fully
    }

    fn present(&self) -> bool {
        matches!(self.chain_exists(Table::Nat, super::CHAIN_POSTROUTING), Ok(true))
    }
}

/// What [`detect_backend`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct BackendDetection {
    pub backend: Backend,
    /// Rule lines (`-A ...`) in `iptables-legacy-save` plus `ip6tables-legacy-save`.
    pub legacy_rules: usize,
    /// Rule lines in `iptables-nft-save` plus `ip6tables-nft-save` (not counted when a
    /// kubelet hint chain decided).
    pub nft_rules: usize,
    /// Why this backend was chosen.
    pub reason: &'static str,
}

/// Chains kubelet creates in the mangle table of the backend it uses.
const KUBELET_HINT_CHAINS: &[&str] = &["KUBE-IPTABLES-HINT", "KUBE-KUBELET-CANARY"];

/// Decides whether the host uses iptables-nft or iptables-legacy, as the upstream image's
/// `iptables-wrapper` does: a kubelet hint chain in the nft mangle table means nft, one in
/// the legacy tables means legacy; otherwise the backend holding more rules (both families
/// counted) wins, nft on a tie. Binaries that fail or are missing count as empty.
pub(crate) fn detect_backend(exec: Arc<dyn Exec>, netns: Option<&str>, timeout: Duration) -> BackendDetection {
    let invoker = Invoker { exec, netns: netns.map(str::to_string), timeout };
    let save = |backend: Backend, args: &[&str]| -> String {
        let mut text = String::new();
        for family in [IpFamily::V4, IpFamily::V6] {
            let cmd = invoker.command(&Binaries::new(family, backend).save, args);
            match invoker.run(&cmd) {
                Ok(out) if out.success() => text.push_str(&String::from_utf8_lossy(&out.stdout)),
                Ok(out) => tracing::debug!(command = %cmd, status = ?out.status, "save failed; counting it as empty"),
                Err(e) => tracing::debug!(command = %cmd, error = %e, "save could not run; counting it as empty"),
            }
        }
        text
    };
    let has_hint = |text: &str| {
        text.lines().any(|l| {
            l.strip_prefix(':')
                .and_then(|rest| rest.split_whitespace().next())
                .is_some_and(|name| KUBELET_HINT_CHAINS.contains(&name))
        })
    };
    let count_rules = |text: &str| text.lines().filter(|l| l.starts_with('-')).count();

    let detection = if has_hint(&save(Backend::Nft, &["-t", "mangle"])) {
        BackendDetection { backend: Backend::Nft, legacy_rules: 0, nft_rules: 0, reason: "kubelet hint chain in nft" }
    } else {
        let legacy = save(Backend::Legacy, &[]);
        let legacy_rules = count_rules(&legacy);
        if has_hint(&legacy) {
            BackendDetection {
                backend: Backend::Legacy,
                legacy_rules,
                nft_rules: 0,
                reason: "kubelet hint chain in legacy",
            }
        } else {
            let nft_rules = count_rules(&save(Backend::Nft, &[]));
            let (backend, reason) = if legacy_rules > nft_rules {
                (Backend::Legacy, "legacy holds more rules")
            } else {
                (Backend::Nft, "nft holds at least as many rules")
            };
            BackendDetection { backend, legacy_rules, nft_rules, reason }
        }
    };
    tracing::info!(
        backend = %detection.backend,
        legacy_rules = detection.legacy_rules,
        nft_rules = detection.nft_rules,
        reason = detection.reason,
        "detected iptables backend"
    );
    detection
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::exec::{ExecError, FakeExec};
    use crate::iptables::lock::{LockError, LockGuard};
    use std::sync::atomic::{AtomicUsize, Ordering};

    fn v(s: &str) -> IptablesVersion {
        IptablesVersion::parse(s).expect("version")
    }

    #[test]
    fn version_parsing() {
        assert_eq!(IptablesVersion::find_in("iptables v1.8.9 (nf_tables)\n"), Some(v("1.8.9")));
        assert_eq!(IptablesVersion::find_in("iptables v1.4.21\n"), Some(v("1.4.21")));
        assert_eq!(IptablesVersion::find_in("ip6tables-legacy v1.6\n"), Some(v("1.6.0")));
        assert_eq!(IptablesVersion::find_in("iptables-restore v1.8.9 (legacy)"), Some(v("1.8.9")));
        assert_eq!(IptablesVersion::find_in("iptables v1.8.10.1"), Some(v("1.8.10")));
        assert_eq!(IptablesVersion::find_in("iptables version unknown"), None);
        assert_eq!(IptablesVersion::find_in("iptables v1 (x)"), None);
        assert_eq!(IptablesVersion::find_in("v99999999999.1"), None);
        assert_eq!(IptablesVersion::find_in(""), None);
        assert!(v("1.4.11") < v("1.4.20"));
        assert!(v("1.10.0") > v("1.9.9"));
        assert_eq!(v("1.6.2").to_string(), "1.6.2");
    }

    #[test]
    fn wait_flags_by_version() {
        assert_eq!(wait_flags(v("1.8.9")), ["-w", "5", "-W", "100000"]);
        assert_eq!(wait_flags(v("1.6.1")), ["-w", "5", "-W", "100000"]);
        assert_eq!(wait_flags(v("1.6.0")), ["-w", "5"]);
        assert_eq!(wait_flags(v("1.4.22")), ["-w", "5"]);
        assert_eq!(wait_flags(v("1.4.21")), ["-w"]);
        assert_eq!(wait_flags(v("1.4.20")), ["-w"]);
        assert!(wait_flags(v("1.4.19")).is_empty());
        assert!(wait_flags(v("1.4.11")).is_empty());

        assert_eq!(restore_wait_flags(v("1.6.2"), false), ["-w", "5", "-W", "100000"]);
        assert_eq!(restore_wait_flags(v("1.6.1"), true), ["-w"]);
        assert!(restore_wait_flags(v("1.6.1"), false).is_empty());
    }

    #[test]
    fn restore_error_formats_of_iptables_1_8_9() {
        // Legacy, missing jump target: the rule's line.
        let legacy = "iptables-restore v1.8.9 (legacy): Couldn't load target `NOPE':No such file or directory\n\n\
                      Error occurred at line: 4\n\
                      Try `iptables-restore -h' or 'iptables-restore --help' for more information.\n";
        assert_eq!(parse_restore_error(legacy), Some(4));
        // nft, unknown option.
        let nft = "iptables-nft-restore v1.8.9 (nf_tables): unknown option \"--bogus-opt\"\n\
                   Error occurred at line: 3\nTry `iptables-nft-restore -h' or 'iptables-nft-restore --help' for more information.";
        assert_eq!(parse_restore_error(nft), Some(3));
        // Commit-time failures.
        assert_eq!(parse_restore_error("iptables-restore: line 2 failed\n"), Some(2));
        assert_eq!(
            parse_restore_error("iptables-nft-restore: line 12 failed: No chain/target/match by that name.\n"),
            Some(12)
        );
        assert_eq!(
            parse_restore_error(
                "iptables-nft-restore v1.8.9 (nf_tables): \nline 2: CHAIN_DEL failed (Device or resource busy): chain FOO\n"
            ),
            Some(2)
        );
        assert_eq!(parse_restore_error("iptables-restore: COMMIT expected at line 4\n"), Some(4));
        // Nothing to go on.
        assert_eq!(parse_restore_error("iptables-restore: unable to initialize table 'nat'"), None);
        assert_eq!(parse_restore_error("Error occurred at line: 0"), None);
        assert_eq!(parse_restore_error(""), None);
    }

    #[test]
    fn save_rule_matching_without_check() {
        let saved = "*nat\n:KUBE-SERVICES - [0:0]\n\
                     -A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n\
                     -A KUBE-MARK-MASQ -j MARK --set-xmark 0x4000/0x4000\nCOMMIT\n";
        let portals = ["-m", "comment", "--comment", "kubernetes service portals", "-j", "KUBE-SERVICES"];
        assert!(save_has_rule(saved, "PREROUTING", &portals));
        assert!(!save_has_rule(saved, "OUTPUT", &portals));
        assert!(!save_has_rule(saved, "PREROUTING", &portals[..4]));
        assert!(save_has_rule(saved, "KUBE-MARK-MASQ", &["-j", "MARK", "--set-xmark", "4000/0x4000"]));
    }

    const V189: &str = "iptables v1.8.9 (nf_tables)\n";

    /// A runner on a fake exec that reported `version` (and, if asked, restore's version).
    fn runner_with(fake: &Arc<FakeExec>, family: IpFamily, options: RunnerOptions) -> IptablesRunner {
        IptablesRunner::with_locker(fake.clone(), family, options, Arc::new(CountingLocker::default()))
    }

    fn modern(fake: &Arc<FakeExec>) -> IptablesRunner {
        fake.expect("iptables --version", Output::ok(V189));
        let r = runner_with(fake, IpFamily::V4, RunnerOptions::default());
        fake.clear_calls();
        r
    }

    #[derive(Default)]
    struct CountingLocker {
        acquired: Arc<AtomicUsize>,
        released: Arc<AtomicUsize>,
        fail: bool,
    }

    struct Release(Arc<AtomicUsize>);
    impl Drop for Release {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    impl Locker for CountingLocker {
        fn acquire(&self) -> std::result::Result<LockGuard, LockError> {
            if self.fail {
                return Err(LockError::FileLock {
                    path: "/run/xtables.lock".into(),
                    timeout: Duration::from_secs(2),
                    last: "held".into(),
                });
            }
            self.acquired.fetch_add(1, Ordering::SeqCst);
            Ok(Box::new(Release(self.released.clone())))
        }
    }

    #[test]
    fn probing_a_modern_iptables() {
        let fake = Arc::new(FakeExec::new());
        fake.expect("iptables --version", Output::ok(V189));
        let r = runner_with(&fake, IpFamily::V4, RunnerOptions::default());
        assert_eq!(r.version(), Some(v("1.8.9")));
        assert_eq!(r.wait_flag(), ["-w", "5", "-W", "100000"]);
        assert_eq!(r.restore_wait_flag(), ["-w", "5", "-W", "100000"]);
        assert!(r.has_random_fully());
        // The restore binary was not asked: the version alone decided.
        assert_eq!(fake.call_lines(), ["iptables --version"]);
        assert_eq!(fake.calls()[0].timeout, Some(Duration::from_secs(300)));
    }

    #[test]
    fn probing_old_versions() {
        // 1.4.21: `-w`, restore reports a version so it gets `-w`, no --random-fully.
        let fake = Arc::new(FakeExec::new());
        fake.expect("ip6tables --version", Output::ok("ip6tables v1.4.21\n"))
            .expect("ip6tables-restore --version", Output::ok("ip6tables-restore v1.4.21\n"));
        let r = runner_with(&fake, IpFamily::V6, RunnerOptions::default());
        assert_eq!(r.wait_flag(), ["-w"]);
        assert_eq!(r.restore_wait_flag(), ["-w"]);
        assert!(!r.has_random_fully());
        assert_eq!(fake.calls()[1].stdin.as_deref(), Some(&b""[..]), "restore --version gets empty stdin");

        // 1.6.1: full single-command flags, but restore without --version support.
        let fake = Arc::new(FakeExec::new());
        fake.expect("iptables --version", Output::ok("iptables v1.6.1\n"))
            .expect("iptables-restore --version", Output::exit(2, "unknown option"));
        let r = runner_with(&fake, IpFamily::V4, RunnerOptions::default());
        assert_eq!(r.wait_flag(), ["-w", "5", "-W", "100000"]);
        assert!(r.restore_wait_flag().is_empty());
    }

    #[test]
    fn unknown_version_assumes_minimum() {
        let fake = Arc::new(FakeExec::new());
        fake.expect_err("iptables --version", ExecError::NotFound { program: "iptables".into() })
            .expect("iptables-restore --version", Output::ok("garbage"));
        let r = runner_with(&fake, IpFamily::V4, RunnerOptions::default());
        assert_eq!(r.version(), None);
        assert!(r.wait_flag().is_empty());
        assert!(r.restore_wait_flag().is_empty());
        assert!(!r.has_random_fully());
        // 1.4.11 has -C.
        fake.expect("iptables -C OUTPUT -t nat -j ACCEPT", Output::ok(""));
        assert!(r.ensure_rule(RulePosition::Append, Table::Nat, "OUTPUT", &["-j", "ACCEPT"]).expect("ok"));
    }

    #[test]
    fn backend_and_netns_select_binaries() {
        let fake = Arc::new(FakeExec::new());
        fake.expect("ip netns exec t1 ip6tables-legacy --version", Output::ok("ip6tables v1.8.9 (legacy)\n"));
        let options = RunnerOptions { backend: Backend::Legacy, netns: Some("t1".into()), ..RunnerOptions::default() };
        let r = runner_with(&fake, IpFamily::V6, options);
        assert_eq!(r.binaries().save, "ip6tables-legacy-save");
        fake.expect("ip netns exec t1 ip6tables-legacy-save -t filter", Output::ok("*filter\nCOMMIT\n"));
        let mut buf = Vec::new();
        r.save_into(Table::Filter, &mut buf).expect("save");
        assert_eq!(buf, b"*filter\nCOMMIT\n");
        assert_eq!(Binaries::new(IpFamily::V4, Backend::Nft).restore, "iptables-nft-restore");
        assert_eq!(Binaries::new(IpFamily::V4, Backend::Default).iptables, "iptables");
    }

    #[test]
    fn chain_operations() {
        let fake = Arc::new(FakeExec::new());
        let r = modern(&fake);
        fake.expect("iptables -w 5 -W 100000 -N KUBE-TEST -t nat", Output::ok(""))
            .expect("iptables -w 5 -W 100000 -N KUBE-TEST -t nat", Output::exit(1, "iptables: Chain already exists."))
            .expect("iptables -w 5 -W 100000 -N KUBE-TEST -t nat", Output::exit(4, "resource problem"))
            .expect("iptables -w 5 -W 100000 -F KUBE-TEST -t filter", Output::ok(""))
            .expect("iptables -w 5 -W 100000 -X KUBE-TEST -t filter", Output::exit(1, "iptables: No chain"))
            .expect("iptables -w 5 -W 100000 -S KUBE-TEST -t nat", Output::ok("-N KUBE-TEST\n"))
            .expect("iptables -w 5 -W 100000 -S KUBE-TEST -t nat", Output::exit(1, "No chain/target/match"))
            .expect("iptables -w 5 -W 100000 -S POSTROUTING -t nat", Output::exit(3, "can't initialize table"));
        assert!(!r.ensure_chain(Table::Nat, "KUBE-TEST").expect("created"));
        assert!(r.ensure_chain(Table::Nat, "KUBE-TEST").expect("existed"));
        let err = r.ensure_chain(Table::Nat, "KUBE-TEST").expect_err("exit 4");
        assert!(
            matches!(&err, IptablesError::Failed { status: 4, output, .. } if output == "resource problem"),
            "{err}"
        );
        r.flush_chain(Table::Filter, "KUBE-TEST").expect("flushed");
        let err = r.delete_chain(Table::Filter, "KUBE-TEST").expect_err("missing");
        assert!(err.to_string().contains("-X KUBE-TEST -t filter"), "{err}");
        assert!(r.chain_exists(Table::Nat, "KUBE-TEST").expect("exists"));
        assert!(!r.chain_exists(Table::Nat, "KUBE-TEST").expect("missing"));
        assert!(!r.present());
        assert_eq!(fake.remaining(), 0);
    }

    #[test]
    fn rule_operations_use_check() {
        let fake = Arc::new(FakeExec::new());
        let r = modern(&fake);
        let args = ["-m", "comment", "--comment", "kubernetes service portals", "-j", "KUBE-SERVICES"];
        let rule = "PREROUTING -t nat -m comment --comment kubernetes service portals -j KUBE-SERVICES";
        fake.expect(&format!("iptables -w 5 -W 100000 -C {rule}"), Output::exit(1, "Bad rule"))
            .expect(&format!("iptables -w 5 -W 100000 -I {rule}"), Output::ok(""))
            .expect(&format!("iptables -w 5 -W 100000 -C {rule}"), Output::ok(""))
            .expect(&format!("iptables -w 5 -W 100000 -C {rule}"), Output::ok(""))
            .expect(&format!("iptables -w 5 -W 100000 -D {rule}"), Output::ok(""))
            .expect(&format!("iptables -w 5 -W 100000 -C {rule}"), Output::exit(1, "Bad rule"))
            .expect(&format!("iptables -w 5 -W 100000 -C {rule}"), Output::exit(2, "unknown option"))
            .expect(
                "iptables -w 5 -W 100000 -C INPUT -t filter -j KUBE-NOPE",
                Output::exit(2, "iptables v1.8.9 (legacy): Couldn't load target `KUBE-NOPE':No such file or directory"),
            );
        assert!(!r.ensure_rule(RulePosition::Prepend, Table::Nat, "PREROUTING", &args).expect("inserted"));
        assert!(r.ensure_rule(RulePosition::Prepend, Table::Nat, "PREROUTING", &args).expect("existed"));
        r.delete_rule(Table::Nat, "PREROUTING", &args).expect("deleted");
        r.delete_rule(Table::Nat, "PREROUTING", &args).expect("absent is fine");
        let err = r.ensure_rule(RulePosition::Append, Table::Nat, "PREROUTING", &args).expect_err("usage error");
        assert!(!is_not_found(&err), "{err}");
        // -C with a missing jump target: the rule is absent, nothing to delete.
        r.delete_rule(Table::Filter, "INPUT", &["-j", "KUBE-NOPE"]).expect("absent");
        // The comment with spaces is one argument.
        assert_eq!(fake.calls()[1].argv[12], "kubernetes service portals");
        assert_eq!(fake.remaining(), 0);
    }

    #[test]
    fn rule_check_without_dash_c_reads_save() {
        let fake = Arc::new(FakeExec::new());
        fake.expect("iptables --version", Output::ok("iptables v1.4.10\n"))
            .expect("iptables-restore --version", Output::exit(1, ""));
        let r = runner_with(&fake, IpFamily::V4, RunnerOptions::default());
        fake.expect("iptables-save -t filter", Output::ok("*filter\n-A INPUT -j KUBE-FIREWALL\nCOMMIT\n"))
            .expect("iptables-save -t filter", Output::ok("*filter\nCOMMIT\n"))
            .expect("iptables -A OUTPUT -t filter -j KUBE-FIREWALL", Output::ok(""));
        assert!(r.ensure_rule(RulePosition::Append, Table::Filter, "INPUT", &["-j", "KUBE-FIREWALL"]).expect("ok"));
        assert!(!r.ensure_rule(RulePosition::Append, Table::Filter, "OUTPUT", &["-j", "KUBE-FIREWALL"]).expect("ok"));
        assert_eq!(fake.remaining(), 0);
    }

    #[test]
    fn restore_flags_and_errors() {
        let fake = Arc::new(FakeExec::new());
        let r = modern(&fake);
        let data = b"*nat\n:KUBE-SERVICES - [0:0]\n-A KUBE-SERVICES -j NOPE\nCOMMIT\n";
        fake.expect("iptables-restore -w 5 -W 100000 -T nat --noflush --counters", Output::ok(""))
            .expect("iptables-restore -w 5 -W 100000", Output::ok(""))
            .expect(
                "iptables-restore -w 5 -W 100000 --noflush --counters",
                Output::exit(
                    2,
                    "iptables-restore v1.8.9 (legacy): Couldn't load target `NOPE':No such file or directory\n\n\
                     Error occurred at line: 3\nTry `iptables-restore -h' or 'iptables-restore --help' for more information.\n",
                ),
            )
            .expect("iptables-restore -w 5 -W 100000 --noflush", Output::exit(1, "iptables-restore: unable to initialize table 'nat'"));
        r.restore(Table::Nat, data, FlushFlag::NoFlush, RestoreCounters::Counters).expect("ok");
        r.restore_all(data, FlushFlag::Flush, RestoreCounters::NoCounters).expect("ok");
        let err = r.restore_all(data, FlushFlag::NoFlush, RestoreCounters::Counters).expect_err("line error");
        assert_eq!(err.restore_line(), Some(3));
        assert!(matches!(&err, IptablesError::RestoreLine { command, .. } if command == "iptables-restore"));
        let err = r.restore_all(data, FlushFlag::NoFlush, RestoreCounters::NoCounters).expect_err("failed");
        assert!(matches!(err, IptablesError::Failed { status: 1, .. }), "{err}");
        assert_eq!(fake.calls()[0].stdin.as_deref(), Some(&data[..]));
    }

    #[test]
    fn restore_takes_the_lock_only_without_wait_support() {
        let fake = Arc::new(FakeExec::new());
        fake.expect("iptables --version", Output::ok("iptables v1.6.1\n"))
            .expect("iptables-restore --version", Output::exit(2, ""));
        let locker = Arc::new(CountingLocker::default());
        let r = IptablesRunner::with_locker(fake.clone(), IpFamily::V4, RunnerOptions::default(), locker.clone());
        fake.expect("iptables-restore --noflush", Output::ok("")).expect("iptables-restore -T filter", Output::ok(""));
        r.restore_all(b"", FlushFlag::NoFlush, RestoreCounters::NoCounters).expect("ok");
        r.restore(Table::Filter, b"", FlushFlag::Flush, RestoreCounters::NoCounters).expect("ok");
        assert_eq!(locker.acquired.load(Ordering::SeqCst), 2);
        assert_eq!(locker.released.load(Ordering::SeqCst), 2, "guard dropped after each restore");

        // With wait support the lock is never touched.
        let fake = Arc::new(FakeExec::new());
        fake.expect("iptables --version", Output::ok(V189));
        let locker = Arc::new(CountingLocker::default());
        let r = IptablesRunner::with_locker(fake.clone(), IpFamily::V4, RunnerOptions::default(), locker.clone());
        fake.expect("iptables-restore -w 5 -W 100000 --noflush", Output::ok(""));
        r.restore_all(b"", FlushFlag::NoFlush, RestoreCounters::NoCounters).expect("ok");
        assert_eq!(locker.acquired.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn restore_fails_without_running_when_lock_busy() {
        let fake = Arc::new(FakeExec::new());
        fake.expect("iptables --version", Output::ok("iptables v1.4.21\n"))
            .expect("iptables-restore --version", Output::exit(2, ""));
        let locker = Arc::new(CountingLocker { fail: true, ..CountingLocker::default() });
        let r = IptablesRunner::with_locker(fake.clone(), IpFamily::V4, RunnerOptions::default(), locker);
        let err = r.restore_all(b"", FlushFlag::NoFlush, RestoreCounters::NoCounters).expect_err("busy");
        assert!(matches!(err, IptablesError::Lock(_)), "{err}");
        assert_eq!(fake.calls().len(), 2, "restore never ran");
    }

    #[test]
    fn exec_failures_and_signals() {
        let fake = Arc::new(FakeExec::new());
        let r = modern(&fake);
        fake.expect_err(
            "iptables-save -t nat",
            ExecError::TimedOut { program: "iptables-save".into(), timeout: Duration::from_secs(1) },
        )
        .expect("iptables-save -t nat", Output { status: None, stdout: Vec::new(), stderr: Vec::new() });
        let mut buf = Vec::new();
        assert!(matches!(r.save_into(Table::Nat, &mut buf), Err(IptablesError::Exec { .. })));
        let err = r.save_into(Table::Nat, &mut buf).expect_err("signal");
        assert!(err.to_string().contains("killed by a signal"), "{err}");
        assert!(buf.is_empty());
    }

    fn save_out(rules: usize, hint: bool) -> Output {
        let mut text = String::from("*mangle\n:PREROUTING ACCEPT [0:0]\n");
        if hint {
            text.push_str(":KUBE-IPTABLES-HINT - [0:0]\n");
        }
        for i in 0..rules {
            text.push_str(&format!("-A PREROUTING -d 203.0.113.{i}/32 -j ACCEPT\n"));
        }
        text.push_str("COMMIT\n");
        Output::ok(text)
    }

    #[test]
    fn backend_detection_by_hint() {
        let fake = Arc::new(FakeExec::new());
        fake.expect("iptables-nft-save -t mangle", save_out(0, true))
            .expect("ip6tables-nft-save -t mangle", save_out(0, false));
        let d = detect_backend(fake.clone(), None, Duration::from_secs(5));
        assert_eq!((d.backend, d.reason), (Backend::Nft, "kubelet hint chain in nft"));

        let fake = Arc::new(FakeExec::new());
        fake.expect("iptables-nft-save -t mangle", save_out(0, false))
            .expect("ip6tables-nft-save -t mangle", Output::exit(1, "no table"))
            .expect("iptables-legacy-save", save_out(1, false))
            .expect("ip6tables-legacy-save", save_out(0, true));
        let d = detect_backend(fake.clone(), None, Duration::from_secs(5));
        assert_eq!((d.backend, d.legacy_rules), (Backend::Legacy, 1));
        assert_eq!(fake.remaining(), 0);
    }

    #[test]
    fn backend_detection_by_rule_count() {
        let script = |legacy4: usize, legacy6: usize, nft4: usize, nft6: usize| {
            let fake = Arc::new(FakeExec::new());
            fake.expect("ip netns exec ns iptables-nft-save -t mangle", save_out(0, false))
                .expect("ip netns exec ns ip6tables-nft-save -t mangle", save_out(0, false))
                .expect("ip netns exec ns iptables-legacy-save", save_out(legacy4, false))
                .expect("ip netns exec ns ip6tables-legacy-save", save_out(legacy6, false))
                .expect("ip netns exec ns iptables-nft-save", save_out(nft4, false))
                .expect("ip netns exec ns ip6tables-nft-save", save_out(nft6, false));
            let d = detect_backend(fake.clone(), Some("ns"), Duration::from_secs(5));
            assert_eq!(fake.remaining(), 0);
            d
        };
        let d = script(3, 2, 1, 1);
        assert_eq!((d.backend, d.legacy_rules, d.nft_rules), (Backend::Legacy, 5, 2));
        let d = script(1, 1, 2, 0);
        assert_eq!((d.backend, d.reason), (Backend::Nft, "nft holds at least as many rules"));
        let d = script(0, 0, 0, 0);
        assert_eq!(d.backend, Backend::Nft, "a tie goes to nft");
        let d = script(0, 3, 0, 4);
        assert_eq!(d.backend, Backend::Nft);
    }

    #[test]
    fn backend_detection_with_no_binaries() {
        let fake = Arc::new(FakeExec::new());
        for _ in 0..6 {
            fake.expect_any(Output::exit(127, "not found"));
        }
        let d = detect_backend(fake.clone(), None, Duration::from_secs(5));
        assert_eq!((d.backend, d.legacy_rules, d.nft_rules), (Backend::Nft, 0, 0));
    }
}
