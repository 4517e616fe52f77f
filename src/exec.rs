//! Running external programs: the only place in the crate that spawns processes.
//!
//! This module owns the [`Exec`] trait (run one [`Command`] to completion and collect its
//! [`Output`]), [`RealExec`] (std::process with an optional timeout after which the child is
//! killed) and, under the `testing` feature, `FakeExec` (scripted results and a call log, for
//! tests).
//!
//! Everything here is synchronous: callers are the proxier's sync and the iptables runner,
//! which run on a plain thread (or inside `spawn_blocking`).

use std::borrow::Cow;
#[cfg(any(test, feature = "testing"))]
use std::collections::VecDeque;
use std::fmt;
use std::io::{self, Read, Write};
use std::process::{Child, ExitStatus, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
#[cfg(any(test, feature = "testing"))]
use std::sync::{Mutex, PoisonError};
use std::thread;
use std::time::{Duration, Instant};

/// One program invocation. `'a` is the lifetime of borrowed stdin data: a restore input of
/// tens of megabytes is written to the child straight from the caller's buffer, not copied.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Command<'a> {
    pub program: String,
    pub args: Vec<String>,
    /// Bytes written to the child's stdin; `None` connects stdin to `/dev/null`.
    pub stdin: Option<Cow<'a, [u8]>>,
    /// Kill the child if it has not exited after this long.
    pub timeout: Option<Duration>,
}

impl<'a> Command<'a> {
    pub fn new(program: impl Into<String>) -> Self {
        Command { program: program.into(), args: Vec::new(), stdin: None, timeout: None }
    }

    pub fn arg(mut self, arg: impl Into<String>) -> Self {
        self.args.push(arg.into());
        self
    }

    pub fn args<I, S>(mut self, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.args.extend(args.into_iter().map(Into::into));
        self
    }

    /// Feeds `data` to the child: owned (`Vec<u8>`, `String`) or borrowed (`&[u8]`, `&str`).
    pub fn stdin<'b>(self, data: impl Into<Stdin<'b>>) -> Command<'b> {
        let Command { program, args, stdin: _, timeout } = self;
        Command { program, args, stdin: Some(data.into().0), timeout }
    }

    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    /// Program and arguments as one vector (`argv`).
    pub fn argv(&self) -> Vec<String> {
        std::iter::once(self.program.clone()).chain(self.args.iter().cloned()).collect()
    }
}

/// Stdin data for [`Command::stdin`]: anything that is, or borrows, bytes.
#[derive(Debug)]
pub struct Stdin<'a>(Cow<'a, [u8]>);

impl<'a> From<&'a [u8]> for Stdin<'a> {
    fn from(data: &'a [u8]) -> Self {
        Stdin(Cow::Borrowed(data))
    }
}

impl<'a> From<&'a str> for Stdin<'a> {
    fn from(data: &'a str) -> Self {
        Stdin(Cow::Borrowed(data.as_bytes()))
    }
}

impl From<Vec<u8>> for Stdin<'_> {
    fn from(data: Vec<u8>) -> Self {
        Stdin(Cow::Owned(data))
    }
}

impl From<String> for Stdin<'_> {
    fn from(data: String) -> Self {
        Stdin(Cow::Owned(data.into_bytes()))
    }
}

impl fmt::Display for Command<'_> {
    /// The command line, space-separated, with arguments containing whitespace quoted.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.program)?;
        for arg in &self.args {
            if arg.is_empty() || arg.contains(char::is_whitespace) {
                write!(f, " {arg:?}")?;
            } else {
                write!(f, " {arg}")?;
            }
        }
        Ok(())
    }
}

/// What a finished child produced.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Output {
    /// The exit code; `None` when the child was killed by a signal.
    pub status: Option<i32>,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
}

impl Output {
    /// A successful run that printed `stdout`.
    pub fn ok(stdout: impl Into<Vec<u8>>) -> Self {
        Output { status: Some(0), stdout: stdout.into(), stderr: Vec::new() }
    }

    /// A run that exited with `code` and printed `stderr`.
    pub fn exit(code: i32, stderr: impl Into<Vec<u8>>) -> Self {
        Output { status: Some(code), stdout: Vec::new(), stderr: stderr.into() }
    }

    pub fn success(&self) -> bool {
        self.status == Some(0)
    }

    /// stdout followed by stderr, lossily decoded (what a combined-output reader sees, modulo
    /// interleaving).
    pub fn combined(&self) -> String {
        let mut text = String::from_utf8_lossy(&self.stdout).into_owned();
        text.push_str(&String::from_utf8_lossy(&self.stderr));
        text
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    #[error("{program}: executable not found")]
    NotFound { program: String },
    #[error("failed to start {program}: {source}")]
    Spawn { program: String, source: io::Error },
    #[error("i/o error talking to {program}: {source}")]
    Io { program: String, source: io::Error },
    #[error("{program} did not finish within {timeout:?} and was killed")]
    TimedOut { program: String, timeout: Duration },
    /// Only from `FakeExec`: a call nobody scripted, or that did not match the script.
    #[error("unexpected command {command}: {reason}")]
    Unexpected { command: String, reason: String },
}

/// Writes a child's stdin while it runs (see [`Exec::run_feeding`]).
pub type Feed<'f> = &'f (dyn Fn(&mut dyn Write) -> io::Result<()> + Sync);

/// Runs commands to completion.
pub trait Exec: Send + Sync {
    fn run(&self, cmd: &Command<'_>) -> Result<Output, ExecError>;

    /// Runs `cmd` with stdin written by `feed` while the child runs (`cmd.stdin` is not
    /// used), so a large input never exists in memory as a whole. When `feed` fails (other
    /// than by the child closing its stdin), the child is killed before it sees the end of
    /// its input, and the error is returned. The default collects the input first.
    fn run_feeding(&self, cmd: &Command<'_>, feed: Feed<'_>) -> Result<Output, ExecError> {
        let mut data = Vec::new();
        feed(&mut data).map_err(|source| ExecError::Io { program: cmd.program.clone(), source })?;
        self.run(&cmd.clone().stdin(data))
    }
}

impl<T: Exec + ?Sized> Exec for Arc<T> {
    fn run(&self, cmd: &Command<'_>) -> Result<Output, ExecError> {
        (**self).run(cmd)
    }

    fn run_feeding(&self, cmd: &Command<'_>, feed: Feed<'_>) -> Result<Output, ExecError> {
        (**self).run_feeding(cmd, feed)
    }
}

/// Runs commands with `std::process`.
#[derive(Debug, Clone, Copy, Default)]
pub struct RealExec;

impl Exec for RealExec {
    fn run(&self, cmd: &Command<'_>) -> Result<Output, ExecError> {
        match cmd.stdin.as_deref() {
            Some(data) => spawn_and_wait(cmd, Some(&|out: &mut dyn Write| out.write_all(data))),
            None => spawn_and_wait(cmd, None),
        }
    }

    fn run_feeding(&self, cmd: &Command<'_>, feed: Feed<'_>) -> Result<Output, ExecError> {
        spawn_and_wait(cmd, Some(feed))
    }
}

fn spawn_and_wait(cmd: &Command<'_>, feed: Option<Feed<'_>>) -> Result<Output, ExecError> {
    let started = Instant::now();
    let mut child = std::process::Command::new(&cmd.program)
        .args(&cmd.args)
        .stdin(if feed.is_some() { Stdio::piped() } else { Stdio::null() })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|source| match source.kind() {
            io::ErrorKind::NotFound => ExecError::NotFound { program: cmd.program.clone() },
            _ => ExecError::Spawn { program: cmd.program.clone(), source },
        })?;

    let io_err = |source: io::Error| ExecError::Io { program: cmd.program.clone(), source };
    let stdin = child.stdin.take();
    let stdout = child.stdout.take();
    let stderr = child.stderr.take();
    // Set by the stdin writer when its input failed: the child must not see an end of input
    // (it would apply what it got), so the waiter kills it.
    let feed_failed = AtomicBool::new(false);

    // Feed stdin and drain both pipes on their own threads so that a child blocked on a
    // full pipe can never deadlock against us.
    let (status, stdout, stderr) = thread::scope(|scope| {
        let feed_failed = &feed_failed;
        let writer = stdin.zip(feed).map(|(pipe, feed)| {
            scope.spawn(move || {
                let mut pipe = io::BufWriter::with_capacity(64 * 1024, pipe);
                match feed(&mut pipe).and_then(|()| pipe.flush()) {
                    // The child may exit without reading everything (e.g. on a parse error).
                    Err(e) if e.kind() == io::ErrorKind::BrokenPipe => (Ok(()), None),
                    Err(e) => {
                        feed_failed.store(true, Ordering::SeqCst);
                        // The pipe goes back to the waiter, open (no end of input), and is
                        // closed only after the child is killed.
                        (Err(e), Some(pipe.into_parts().0))
                    }
                    Ok(()) => (Ok(()), None),
                }
            })
        });
        let out_reader = stdout.map(|pipe| scope.spawn(move || read_all(pipe)));
        let err_reader = stderr.map(|pipe| scope.spawn(move || read_all(pipe)));

        let status = wait(&mut child, cmd, writer.is_some().then_some(feed_failed));
        // The stdin pipe closes first: a process the child left behind may hold its output
        // pipes until its input ends.
        let fed = writer.map(|w| {
            let (fed, pipe) = w.join().unwrap_or_else(|_| (Err(io::Error::other("stdin writer panicked")), None));
            drop(pipe);
            fed
        });
        let joined = |h: Option<thread::ScopedJoinHandle<'_, io::Result<Vec<u8>>>>| {
            h.map(|h| h.join().unwrap_or_else(|_| Err(io::Error::other("pipe reader panicked"))))
                .unwrap_or_else(|| Ok(Vec::new()))
        };
        let stdout = joined(out_reader);
        let stderr = joined(err_reader);
        fed.transpose().map_err(io_err)?;
        Ok::<_, ExecError>((status?, stdout.map_err(io_err)?, stderr.map_err(io_err)?))
    })?;

    tracing::trace!(command = %cmd, status = ?status.code(), elapsed = ?started.elapsed(), "command finished");
    Ok(Output { status: status.code(), stdout, stderr })
}

fn read_all(mut pipe: impl Read) -> io::Result<Vec<u8>> {
    let mut buf = Vec::new();
    pipe.read_to_end(&mut buf)?;
    Ok(buf)
}

/// The longest [`wait`] sleeps between two looks at a child.
const MAX_POLL_PAUSE: Duration = Duration::from_millis(4);

/// Waits for `child`, killing it when `cmd.timeout` expires or `feed_failed` is set.
fn wait(child: &mut Child, cmd: &Command<'_>, feed_failed: Option<&AtomicBool>) -> Result<ExitStatus, ExecError> {
    let io_err = |source: io::Error| ExecError::Io { program: cmd.program.clone(), source };
    if cmd.timeout.is_none() && feed_failed.is_none() {
        return child.wait().map_err(io_err);
    }
    let deadline = cmd.timeout.map(|timeout| (Instant::now() + timeout, timeout));
    // Poll with a short, growing interval: iptables commands usually finish in a few
    // milliseconds, and this keeps the latency we add small without a helper thread. The
    // cap is what a longer command (a restore into a large nf_tables table: ~0.3 s) waits
    // after it ends, half of it on average; a wakeup every few ms costs nothing.
    let mut pause = Duration::from_millis(1);
    loop {
        if let Some(status) = child.try_wait().map_err(io_err)? {
            return Ok(status);
        }
        if feed_failed.is_some_and(|failed| failed.load(Ordering::SeqCst)) {
            let _ = child.kill();
            return child.wait().map_err(io_err);
        }
        let now = Instant::now();
        if let Some((deadline, timeout)) = deadline
            && now >= deadline
        {
            // Kill and reap; a failure to kill means it exited in between, which is fine.
            let _ = child.kill();
            let _ = child.wait();
            return Err(ExecError::TimedOut { program: cmd.program.clone(), timeout });
        }
        let left = deadline.map_or(MAX_POLL_PAUSE, |(deadline, _)| deadline - now);
        thread::sleep(pause.min(left));
        pause = (pause * 2).min(MAX_POLL_PAUSE);
    }
}

/// One scripted response of a [`FakeExec`].
#[cfg(any(test, feature = "testing"))]
#[derive(Debug)]
pub struct Expectation {
    /// The command line (argv joined by single spaces) the call must have; `None` accepts any
    /// call.
    argv: Option<String>,
    result: Result<Output, ExecError>,
}

/// One call a [`FakeExec`] received.
#[cfg(any(test, feature = "testing"))]
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Call {
    pub argv: Vec<String>,
    pub stdin: Option<Vec<u8>>,
    pub timeout: Option<Duration>,
}

#[cfg(any(test, feature = "testing"))]
impl Call {
    /// The argv joined with spaces (for compact assertions).
    pub fn line(&self) -> String {
        self.argv.join(" ")
    }

    pub fn stdin_text(&self) -> String {
        String::from_utf8_lossy(self.stdin.as_deref().unwrap_or_default()).into_owned()
    }
}

/// A scripted [`Exec`]: each call consumes the next expectation in order; a call whose command
/// line does not match it (or with nothing left to consume) fails with
/// [`ExecError::Unexpected`] and leaves the script untouched. Every call is logged.
///
/// Expectations are written as one string and compared with the call's argv joined by spaces
/// (runs of whitespace count as one), so an argument containing spaces matches the words it is
/// made of; assert on [`FakeExec::calls`] where argument boundaries matter.
#[cfg(any(test, feature = "testing"))]
#[derive(Debug, Default)]
pub struct FakeExec {
    inner: Mutex<FakeInner>,
}

#[cfg(any(test, feature = "testing"))]
#[derive(Debug, Default)]
struct FakeInner {
    script: VecDeque<Expectation>,
    calls: Vec<Call>,
}

#[cfg(any(test, feature = "testing"))]
impl FakeExec {
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, FakeInner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Expects `argv` (a space-separated command line, program first) and answers `output`.
    pub fn expect(&self, argv: &str, output: Output) -> &Self {
        self.push(Some(argv), Ok(output))
    }

    /// Expects `argv` and fails with `err` (as if the program could not be run).
    pub fn expect_err(&self, argv: &str, err: ExecError) -> &Self {
        self.push(Some(argv), Err(err))
    }

    /// Answers the next call, whatever it is, with `output`.
    pub fn expect_any(&self, output: Output) -> &Self {
        self.push(None, Ok(output))
    }

    fn push(&self, argv: Option<&str>, result: Result<Output, ExecError>) -> &Self {
        let argv = argv.map(|a| a.split_whitespace().collect::<Vec<_>>().join(" "));
        self.lock().script.push_back(Expectation { argv, result });
        self
    }

    /// Every call so far, oldest first.
    pub fn calls(&self) -> Vec<Call> {
        self.lock().calls.clone()
    }

    /// The argv of every call, each joined with spaces.
    pub fn call_lines(&self) -> Vec<String> {
        self.lock().calls.iter().map(Call::line).collect()
    }

    /// How many scripted responses have not been used yet.
    pub fn remaining(&self) -> usize {
        self.lock().script.len()
    }

    pub fn clear_calls(&self) {
        self.lock().calls.clear();
    }
}

#[cfg(any(test, feature = "testing"))]
impl Exec for FakeExec {
    fn run(&self, cmd: &Command<'_>) -> Result<Output, ExecError> {
        let mut inner = self.lock();
        let call = Call { argv: cmd.argv(), stdin: cmd.stdin.as_deref().map(<[u8]>::to_vec), timeout: cmd.timeout };
        let line = call.line().split_whitespace().collect::<Vec<_>>().join(" ");
        inner.calls.push(call);
        let unexpected = |reason: String| ExecError::Unexpected { command: cmd.to_string(), reason };
        let Some(next) = inner.script.front() else {
            return Err(unexpected("no more calls were scripted".into()));
        };
        if let Some(expected) = &next.argv
            && *expected != line
        {
            return Err(unexpected(format!("expected `{expected}`")));
        }
        inner.script.pop_front().map_or_else(|| Err(unexpected("script is empty".into())), |e| e.result)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn real_exec_collects_output_and_status() {
        let out = RealExec.run(&Command::new("sh").args(["-c", "echo out; echo err >&2; exit 3"])).expect("runs");
        assert_eq!(out.status, Some(3));
        assert_eq!(out.stdout, b"out\n");
        assert_eq!(out.stderr, b"err\n");
        assert!(!out.success());
    }

    #[test]
    fn real_exec_feeds_large_stdin() {
        // Larger than a pipe buffer in both directions.
        let data: Vec<u8> = (0..1_000_000u32).map(|i| b'a' + (i % 26) as u8).collect();
        let out = RealExec.run(&Command::new("cat").stdin(data.clone())).expect("runs");
        assert!(out.success());
        assert_eq!(out.stdout, data);
    }

    #[test]
    fn real_exec_streams_a_feed_while_the_child_runs() {
        // Far larger than a pipe buffer, written in small pieces.
        let feed = |out: &mut dyn Write| {
            for i in 0..200_000u32 {
                writeln!(out, "line {i}")?;
            }
            Ok(())
        };
        let out = RealExec.run_feeding(&Command::new("wc").arg("-l"), &feed).expect("runs");
        assert!(out.success());
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "200000");
    }

    #[test]
    fn real_exec_kills_the_child_when_its_feed_fails() {
        // The child leaves a mark once its input ends: a failed feed must not end it (the
        // child would act on half an input).
        let mark = std::env::temp_dir().join(format!("kpr-feed-{}", std::process::id()));
        let _ = std::fs::remove_file(&mark);
        let feed = |out: &mut dyn Write| {
            out.write_all(&vec![b'x'; 200_000])?;
            out.flush()?;
            Err(io::Error::other("the input could not be written"))
        };
        let script = format!("cat >/dev/null; touch {}", mark.display());
        let cmd = Command::new("sh").args(["-c", script.as_str()]).timeout(Duration::from_secs(20));
        let started = Instant::now();
        let err = RealExec.run_feeding(&cmd, &feed).expect_err("the feed's error");
        assert!(err.to_string().contains("the input could not be written"), "{err}");
        assert!(started.elapsed() < Duration::from_secs(10), "killed, not timed out");
        thread::sleep(Duration::from_millis(200));
        assert!(!mark.exists(), "the child saw the end of its input");
    }

    #[test]
    fn a_child_exiting_early_ends_the_feed_without_error() {
        let feed = |out: &mut dyn Write| {
            for _ in 0..1_000 {
                out.write_all(&[b'y'; 4096])?;
            }
            Ok(())
        };
        let out = RealExec.run_feeding(&Command::new("head").args(["-c", "10"]), &feed).expect("broken pipe is fine");
        assert!(out.success());
        assert_eq!(out.stdout, b"yyyyyyyyyy");
    }

    #[test]
    fn fake_exec_records_a_feed_as_stdin() {
        let fake = FakeExec::new();
        fake.expect("cat", Output::ok(""));
        fake.run_feeding(&Command::new("cat"), &|out: &mut dyn Write| out.write_all(b"*nat\nCOMMIT\n"))
            .expect("scripted");
        assert_eq!(fake.calls()[0].stdin_text(), "*nat\nCOMMIT\n");
    }

    #[test]
    fn real_exec_child_ignoring_stdin() {
        let data = vec![b'x'; 1_000_000];
        let out = RealExec.run(&Command::new("true").stdin(data)).expect("broken pipe is not an error");
        assert!(out.success());
    }

    #[test]
    fn real_exec_times_out_and_kills() {
        let started = Instant::now();
        let err = RealExec
            .run(&Command::new("sleep").arg("10").timeout(Duration::from_millis(100)))
            .expect_err("must time out");
        assert!(matches!(err, ExecError::TimedOut { .. }), "{err}");
        assert!(started.elapsed() < Duration::from_secs(5));
    }

    #[test]
    fn real_exec_reports_signal_as_no_status() {
        let out = RealExec.run(&Command::new("sh").args(["-c", "kill -9 $$"])).expect("runs");
        assert_eq!(out.status, None);
    }

    #[test]
    fn real_exec_missing_program() {
        let err = RealExec.run(&Command::new("/nonexistent/kube-proxy-rs-test")).expect_err("missing");
        assert!(matches!(err, ExecError::NotFound { .. }), "{err}");
    }

    #[test]
    fn fake_exec_plays_script_in_order_and_logs() {
        let fake = FakeExec::new();
        fake.expect("iptables --version", Output::ok("iptables v1.8.9 (nf_tables)\n"))
            .expect("iptables-restore --noflush", Output::exit(2, "bad"));
        let out = fake.run(&Command::new("iptables").arg("--version")).expect("scripted");
        assert!(out.success());
        let out = fake.run(&Command::new("iptables-restore").arg("--noflush").stdin("*nat\n")).expect("scripted");
        assert_eq!(out.status, Some(2));
        assert_eq!(fake.call_lines(), ["iptables --version", "iptables-restore --noflush"]);
        assert_eq!(fake.calls()[1].stdin_text(), "*nat\n");
        assert_eq!(fake.remaining(), 0);
        assert!(matches!(fake.run(&Command::new("x")), Err(ExecError::Unexpected { .. })));
    }

    #[test]
    fn fake_exec_rejects_mismatch_without_consuming() {
        let fake = FakeExec::new();
        fake.expect("a b", Output::ok(""));
        let err = fake.run(&Command::new("a").arg("c")).expect_err("mismatch");
        assert!(err.to_string().contains("expected `a b`"), "{err}");
        assert_eq!(fake.remaining(), 1);
        assert!(fake.run(&Command::new("a").arg("b")).is_ok());
    }

    #[test]
    fn command_display_quotes_spaces() {
        let cmd = Command::new("iptables").args(["-m", "comment", "--comment", "a b", ""]);
        assert_eq!(cmd.to_string(), r#"iptables -m comment --comment "a b" """#);
    }
}
