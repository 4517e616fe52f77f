//! The real [`Nftables`]: the `nft` command through [`Exec`], as upstream's knftables drives
//! it.
//!
//! * [`Nftables::run`] writes the transaction's text into `nft -f -` (one atomic kernel
//!   transaction), [`Nftables::check`] into `nft --check -f -`.
//! * [`Nftables::list_table`] reads `nft -s -y -T list table F kube-proxy` and parses it
//!   ([`super::listing`]); rule text comes back in nft's canonical words
//!   ([`super::canonical`]). Not found is `None`.
//! * [`NftRunner::new`] checks, as knftables' `New` does, that `nft` runs, that
//!   `nft --version` is 1.0.1 or later, and whether the kernel keeps comments on tables
//!   (`nft --check` of `add table F kube-proxy { comment "test" ; }`; when only the plain
//!   form passes, object comments are left out: [`Nftables::object_comments`] is false).
//!
//! The daemon writes through [`super::netlink::NetlinkNftables`], which hands this runner
//! every transaction it does not encode itself (the table, base chains, named maps, the fixed
//! chains' rules), and every listing and check; with `KUBE_PROXY_RS_NFT_WRITER=nft`, all of
//! them. docs/architecture.md says why (nft's per-process cache fetch is most of a small
//! transaction's cost at scale).
//!
//! When nft refuses a transaction, the error names the failing line(s) nft reported
//! (`/dev/stdin:LINE:COL-COL: Error: …`) with the lines around the first one, taken from
//! the transaction text written again (it was streamed into nft, never held whole).

use std::io::Write;
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use regex::Regex;

use super::listing::parse_table_listing;
use super::{Family, NftError, Nftables, TABLE, TableState, Transaction, transaction::write_operation};
use crate::exec::{Command, Exec, ExecError, Output};

/// How to build an [`NftRunner`].
#[derive(Debug, Clone)]
pub struct NftOptions {
    /// The `nft` binary (a name looked up in `PATH`, or a path).
    pub program: String,
    /// Run every command inside this network namespace (`ip netns exec NAME nft …`).
    pub netns: Option<String>,
    /// Kill any single `nft` that runs longer than this.
    pub command_timeout: Duration,
}

impl Default for NftOptions {
    fn default() -> Self {
        NftOptions { program: "nft".into(), netns: None, command_timeout: Duration::from_secs(300) }
    }
}

/// nft's version, from `nftables vX.Y.Z (…)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct NftVersion {
    pub major: u32,
    pub minor: u32,
    pub patch: u32,
}

impl NftVersion {
    /// The oldest nft knftables accepts (it refuses `v0.*` and `v1.0.0`).
    pub const MINIMUM: NftVersion = NftVersion { major: 1, minor: 0, patch: 1 };

    /// Reads `nftables v1.0.6 (Lester Gooch #5)`.
    pub fn parse(output: &str) -> Option<NftVersion> {
        static VERSION: LazyLock<Regex> =
            LazyLock::new(|| Regex::new(r"nftables v([0-9]+)\.([0-9]+)(?:\.([0-9]+))?").expect("constant regex"));
        let c = VERSION.captures(output)?;
        let part = |i: usize| c.get(i).map_or(Some(0), |m| m.as_str().parse().ok());
        Some(NftVersion { major: part(1)?, minor: part(2)?, patch: part(3)? })
    }
}

impl std::fmt::Display for NftVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}

/// The real `nft`, for one family. See the module documentation.
pub struct NftRunner {
    family: Family,
    exec: Arc<dyn Exec>,
    options: NftOptions,
    version: NftVersion,
    object_comments: bool,
}

impl std::fmt::Debug for NftRunner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NftRunner")
            .field("family", &self.family)
            .field("options", &self.options)
            .field("version", &self.version)
            .field("object_comments", &self.object_comments)
            .finish_non_exhaustive()
    }
}

impl NftRunner {
    /// Checks that `nft` is usable for `family` (see the module documentation) and builds
    /// the runner. Errors are [`NftError::Unavailable`].
    pub fn new(exec: Arc<dyn Exec>, family: Family, options: NftOptions) -> Result<NftRunner, NftError> {
        let mut runner = NftRunner { family, exec, options, version: NftVersion::MINIMUM, object_comments: true };
        let unavailable = |message: String| NftError::Unavailable { family, message };

        let cmd = runner.command(&["--version"]);
        let out = runner.exec(&cmd).map_err(unavailable)?;
        let text = out.combined();
        if !out.success() {
            return Err(unavailable(format!("`{cmd}` failed: {}", text.trim())));
        }
        let version = NftVersion::parse(&text)
            .ok_or_else(|| unavailable(format!("could not read the version in `{}`", text.trim())))?;
        if version < NftVersion::MINIMUM {
            return Err(unavailable(format!("nft version must be v1.0.1 or later (got {})", text.trim())));
        }
        runner.version = version;

        let probe = |text: String| -> Result<Output, String> {
            let cmd = runner.command(&["--check", "-f", "-"]).stdin(text);
            runner.exec(&cmd)
        };
        let with_comment =
            probe(format!("add table {family} {TABLE} {{ comment \"test\" ; }}\n")).map_err(unavailable)?;
        if !with_comment.success() {
            let plain = probe(format!("add table {family} {TABLE}\n")).map_err(unavailable)?;
            if !plain.success() {
                return Err(unavailable(format!("could not run nftables command: {}", plain.combined().trim())));
            }
            tracing::info!(%family, "the kernel does not keep comments on nftables objects; leaving them out");
            runner.object_comments = false;
        }
        tracing::debug!(%family, %version, object_comments = runner.object_comments, "nft runner ready");
        Ok(runner)
    }

    pub fn version(&self) -> NftVersion {
        self.version
    }

    fn command(&self, args: &[&str]) -> Command<'static> {
        let cmd = match &self.options.netns {
            Some(ns) => Command::new("ip").args(["netns", "exec", ns.as_str(), self.options.program.as_str()]),
            None => Command::new(self.options.program.clone()),
        };
        cmd.args(args.iter().copied()).timeout(self.options.command_timeout)
    }

    fn exec(&self, cmd: &Command<'_>) -> Result<Output, String> {
        tracing::trace!(command = %cmd, "running");
        self.exec.run(cmd).map_err(|e| exec_failure(cmd, &e))
    }

    /// `nft [--check] -f -` with `tx` written into its stdin while it runs.
    fn apply(&self, tx: &Transaction, check: bool) -> Result<(), NftError> {
        let args: &[&str] = if check { &["--check", "-f", "-"] } else { &["-f", "-"] };
        let cmd = self.command(args);
        let family = self.family;
        let comments = self.object_comments;
        let feed = |out: &mut dyn Write| -> std::io::Result<()> {
            let mut line = String::with_capacity(256);
            for op in &tx.ops {
                line.clear();
                write_operation(&mut line, family, op, comments);
                out.write_all(line.as_bytes())?;
            }
            Ok(())
        };
        tracing::trace!(command = %cmd, operations = tx.len(), "running");
        let out = self
            .exec
            .run_feeding(&cmd, &feed)
            .map_err(|e| NftError::Rejected { family, message: exec_failure(&cmd, &e) })?;
        if out.success() {
            return Ok(());
        }
        let stderr = out.combined();
        let message = match failing_lines(&stderr) {
            lines if !lines.is_empty() => {
                let text = tx.text(family, comments);
                let context = line_context(&text, lines[0].0, 3);
                let errors: Vec<String> = lines.iter().map(|(n, e)| format!("line {n}: {e}")).collect();
                format!("`{cmd}` failed: {}\n{context}", errors.join("; "))
            }
            _ => format!("`{cmd}` failed: {}", stderr.trim()),
        };
        Err(NftError::Rejected { family, message })
    }
}

/// An exec failure as text; a timeout says that whether nft applied the input is unknown.
fn exec_failure(cmd: &Command<'_>, err: &ExecError) -> String {
    match err {
        ExecError::TimedOut { timeout, .. } => {
            format!("`{cmd}` did not finish within {timeout:?} and was killed (whether it applied anything is unknown)")
        }
        other => format!("`{cmd}`: {other}"),
    }
}

/// The lines nft blamed: `/dev/stdin:LINE:COL-COL: Error: MESSAGE`, in order, without
/// repeats of a line.
pub fn failing_lines(stderr: &str) -> Vec<(usize, String)> {
    static LOCATION: LazyLock<Regex> = LazyLock::new(|| {
        Regex::new(r"(?m)^[^:\n]*:([0-9]+):[0-9]+(?:-[0-9]+)?: Error: (.*)$").expect("constant regex")
    });
    let mut lines: Vec<(usize, String)> = Vec::new();
    for c in LOCATION.captures_iter(stderr) {
        let Some(line) = c.get(1).and_then(|m| m.as_str().parse::<usize>().ok()) else { continue };
        if !lines.iter().any(|(n, _)| *n == line) {
            lines.push((line, c.get(2).map_or("", |m| m.as_str()).trim().to_string()));
        }
    }
    lines
}

/// Lines `line - context ..= line + context` of `text`, numbered, the failing one marked.
pub fn line_context(text: &str, line: usize, context: usize) -> String {
    let first = line.saturating_sub(context).max(1);
    let last = line + context;
    let width = last.to_string().len();
    let mut out = String::new();
    for (index, content) in text.lines().enumerate() {
        let number = index + 1;
        if number < first {
            continue;
        }
        if number > last {
            break;
        }
        let marker = if number == line { '>' } else { ' ' };
        out.push_str(&format!("{marker} {number:>width$} | {content}\n"));
    }
    out
}

/// Whether nft's output says the object does not exist (knftables' `IsNotFound`).
pub fn is_not_found_output(output: &str) -> bool {
    output.contains("No such file or directory")
}

impl Nftables for NftRunner {
    fn family(&self) -> Family {
        self.family
    }

    fn run(&self, tx: &Transaction) -> Result<(), NftError> {
        if tx.is_empty() {
            return Ok(());
        }
        self.apply(tx, false)
    }

    fn check(&self, tx: &Transaction) -> Result<(), NftError> {
        if tx.is_empty() {
            return Ok(());
        }
        self.apply(tx, true)
    }

    fn list_table(&self) -> Result<Option<TableState>, NftError> {
        let family = self.family;
        let cmd = self.command(&["-s", "-y", "-T", "list", "table", family.as_str(), TABLE]);
        let out = self.exec(&cmd).map_err(|message| NftError::List { family, message })?;
        if !out.success() {
            let text = out.combined();
            if is_not_found_output(&text) {
                return Ok(None);
            }
            return Err(NftError::List { family, message: format!("`{cmd}` failed: {}", text.trim()) });
        }
        let text = String::from_utf8_lossy(&out.stdout);
        parse_table_listing(&text).map_err(|e| NftError::List { family, message: format!("reading `{cmd}`: {e}") })
    }

    fn object_comments(&self) -> bool {
        self.object_comments
    }
}

/// Deletes the `kube-proxy` table of both families (upstream's `CleanupLeftovers` for
/// nftables mode, used by `--cleanup` and when starting in iptables mode). A family whose
/// `nft` is unusable is skipped (as upstream from 1.33); a missing table is not an error.
/// Returns the errors of the families that failed, each already logged.
pub fn cleanup_tables(exec: Arc<dyn Exec>, options: &NftOptions) -> Vec<NftError> {
    let mut errors = Vec::new();
    for family in [Family::Ip, Family::Ip6] {
        let runner = match NftRunner::new(exec.clone(), family, options.clone()) {
            Ok(runner) => runner,
            Err(e) => {
                tracing::debug!(%family, error = %e, "nft is not usable; not cleaning up its kube-proxy table");
                continue;
            }
        };
        match runner.run(&Transaction { ops: vec![super::Operation::DeleteTable] }) {
            Ok(()) => tracing::info!(%family, "deleted the nftables kube-proxy table"),
            Err(e) if e.is_not_found() => {}
            Err(e) => {
                tracing::error!(%family, error = %e, "Error cleaning up nftables rules");
                errors.push(e);
            }
        }
    }
    errors
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::exec::FakeExec;
    use crate::nftables::{Operation, Rule};

    fn fake_ready(version: &str) -> Arc<FakeExec> {
        let exec = Arc::new(FakeExec::new());
        exec.expect("nft --version", Output::ok(version));
        exec.expect("nft --check -f -", Output::ok(""));
        exec
    }

    #[test]
    fn versions_are_read_and_checked() {
        assert_eq!(
            NftVersion::parse("nftables v1.0.6 (Lester Gooch #5)\n"),
            Some(NftVersion { major: 1, minor: 0, patch: 6 })
        );
        assert_eq!(NftVersion::parse("nftables v1.1 (x)"), Some(NftVersion { major: 1, minor: 1, patch: 0 }));
        assert_eq!(NftVersion::parse("nope"), None);

        let exec = Arc::new(FakeExec::new());
        exec.expect("nft --version", Output::ok("nftables v1.0.0 (Fearless Fosdick #3)\n"));
        let err = NftRunner::new(exec, Family::Ip, NftOptions::default()).unwrap_err();
        assert!(err.to_string().contains("must be v1.0.1 or later"), "{err}");

        let exec = Arc::new(FakeExec::new());
        exec.expect("nft --version", Output::ok("nftables v0.9.8 (E.D.S.)\n"));
        assert!(matches!(NftRunner::new(exec, Family::Ip, NftOptions::default()), Err(NftError::Unavailable { .. })));

        let exec = Arc::new(FakeExec::new());
        exec.expect_err("nft --version", ExecError::NotFound { program: "nft".into() });
        let err = NftRunner::new(exec, Family::Ip6, NftOptions::default()).unwrap_err();
        assert!(matches!(err, NftError::Unavailable { family: Family::Ip6, .. }), "{err}");
    }

    #[test]
    fn object_comments_are_probed_as_knftables_does() {
        let exec = fake_ready("nftables v1.0.6 (Lester Gooch #5)\n");
        let runner = NftRunner::new(exec.clone(), Family::Ip, NftOptions::default()).unwrap();
        assert!(runner.object_comments());
        assert_eq!(exec.calls()[1].stdin_text(), "add table ip kube-proxy { comment \"test\" ; }\n");

        let exec = Arc::new(FakeExec::new());
        exec.expect("nft --version", Output::ok("nftables v1.0.6 (Lester Gooch #5)\n"))
            .expect("nft --check -f -", Output::exit(1, "Error: syntax error\n"))
            .expect("nft --check -f -", Output::ok(""));
        let runner = NftRunner::new(exec.clone(), Family::Ip6, NftOptions::default()).unwrap();
        assert!(!runner.object_comments());
        assert_eq!(exec.calls()[2].stdin_text(), "add table ip6 kube-proxy\n");

        let exec = Arc::new(FakeExec::new());
        exec.expect("nft --version", Output::ok("nftables v1.0.6 (Lester Gooch #5)\n"))
            .expect("nft --check -f -", Output::exit(1, "Error: Operation not permitted\n"))
            .expect("nft --check -f -", Output::exit(1, "Error: Operation not permitted\n"));
        let err = NftRunner::new(exec, Family::Ip, NftOptions::default()).unwrap_err();
        assert!(err.to_string().contains("could not run nftables command"), "{err}");
    }

    #[test]
    fn a_refused_transaction_names_its_line_with_context() {
        let exec = fake_ready("nftables v1.0.6 (Lester Gooch #5)\n");
        let runner = NftRunner::new(exec.clone(), Family::Ip, NftOptions::default()).unwrap();
        let mut tx = Transaction::new();
        tx.push(Operation::AddTable);
        for i in 0..8 {
            tx.push(Operation::AddRule(Rule { chain: "services".into(), text: format!("jump c{i}"), comment: None }));
        }
        exec.expect(
            "nft -f -",
            Output::exit(
                1,
                "/dev/stdin:6:1-40: Error: Could not process rule: No such file or directory\n\
                 add rule ip kube-proxy services jump c4\n^^^^\n",
            ),
        );
        let err = runner.run(&tx).unwrap_err();
        let text = err.to_string();
        assert!(text.contains("line 6: Could not process rule: No such file or directory"), "{text}");
        assert!(text.contains("> 6 | add rule ip kube-proxy services jump c4"), "{text}");
        assert!(text.contains("  3 | add rule ip kube-proxy services jump c1"), "{text}");
        assert!(!text.contains("jump c0"), "{text}");
        assert_eq!(exec.calls()[2].stdin_text(), tx.text(Family::Ip, true));
    }

    #[test]
    fn listing_not_found_is_no_table() {
        let exec = Arc::new(FakeExec::new());
        exec.expect("ip netns exec ns1 nft --version", Output::ok("nftables v1.0.6 (Lester Gooch #5)\n"))
            .expect("ip netns exec ns1 nft --check -f -", Output::ok(""))
            .expect(
                "ip netns exec ns1 nft -s -y -T list table ip kube-proxy",
                Output::exit(1, "Error: No such file or directory\nlist table ip kube-proxy\n"),
            )
            .expect(
                "ip netns exec ns1 nft -s -y -T list table ip kube-proxy",
                Output::exit(1, "Error: Operation not permitted\n"),
            );
        let runner =
            NftRunner::new(exec.clone(), Family::Ip, NftOptions { netns: Some("ns1".into()), ..NftOptions::default() })
                .unwrap();
        assert_eq!(runner.list_table().unwrap(), None);
        assert!(matches!(runner.list_table(), Err(NftError::List { .. })));
    }

    #[test]
    fn failing_lines_are_read_from_nft_errors() {
        let stderr = "/dev/stdin:61:1-84: Error: Could not process rule: Operation not supported\nadd element …\n^^^\n\
                      /dev/stdin:63:1-91: Error: Could not process rule: Operation not supported\n\
                      /dev/stdin:61:1-84: Error: again\n";
        assert_eq!(
            failing_lines(stderr),
            vec![
                (61, "Could not process rule: Operation not supported".to_string()),
                (63, "Could not process rule: Operation not supported".to_string())
            ]
        );
        assert!(failing_lines("Error: No such file or directory\n").is_empty());
    }
}
