//! Private network namespaces for tests that touch real iptables (root only; CI is root).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use kube_proxy_rs::exec::{Command, Exec, Output, RealExec};
use kube_proxy_rs::iptables::runner::{Backend, IptablesRunner, RunnerOptions};
use kube_proxy_rs::model::IpFamily;

pub fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            let line = status.lines().find(|l| l.starts_with("Uid:"))?;
            line.split_whitespace().nth(2).map(|euid| euid == "0")
        })
        .unwrap_or(false)
}

/// Whether a test that cannot run must fail rather than skip: set by `.ci/run` (`CI`), where
/// the job runs as root and a skipped real-kernel test would hide a broken runner.
pub fn skipping_is_an_error() -> bool {
    std::env::var_os("CI").is_some_and(|v| !v.is_empty())
}

/// Returns early (passing) when not root, saying why; under CI (see
/// [`skipping_is_an_error`]) fails instead.
#[macro_export]
macro_rules! require_root {
    () => {
        if !$crate::support::netns::is_root() {
            assert!(
                !$crate::support::netns::skipping_is_an_error(),
                "this test needs root (network namespaces, real iptables) and CI is set: CI must run as root"
            );
            eprintln!("skipping: creating network namespaces for real-iptables tests needs root");
            return;
        }
    };
}

/// A network namespace deleted on drop, even when the test panics.
pub struct Netns {
    pub name: String,
}

impl Netns {
    pub fn create(tag: &str) -> Netns {
        static COUNTER: AtomicUsize = AtomicUsize::new(0);
        let name = format!("kprs-{}-{tag}-{}", std::process::id(), COUNTER.fetch_add(1, Ordering::SeqCst));
        let out = RealExec.run(&Command::new("ip").args(["netns", "add", name.as_str()])).expect("run ip");
        assert!(out.success(), "ip netns add {name}: {}", out.combined());
        Netns { name }
    }

    /// Runs `argv` inside the namespace.
    pub fn run(&self, argv: &[&str]) -> Output {
        let cmd = Command::new("ip")
            .args(["netns", "exec", self.name.as_str()])
            .args(argv.iter().copied())
            .timeout(Duration::from_secs(60));
        RealExec.run(&cmd).expect("run ip netns exec")
    }

    /// Runs `argv` inside the namespace with `stdin`.
    pub fn run_with_stdin(&self, argv: &[&str], stdin: &str) -> Output {
        let cmd = Command::new("ip")
            .args(["netns", "exec", self.name.as_str()])
            .args(argv.iter().copied())
            .stdin(stdin.as_bytes().to_vec())
            .timeout(Duration::from_secs(60));
        RealExec.run(&cmd).expect("run ip netns exec")
    }

    /// Runs `argv` inside the namespace, which must succeed; returns stdout.
    pub fn ok(&self, argv: &[&str]) -> String {
        let out = self.run(argv);
        assert!(out.success(), "{argv:?} failed: {}", out.combined());
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    pub fn runner(&self, backend: Backend, family: IpFamily) -> IptablesRunner {
        self.runner_with(RunnerOptions { backend, ..RunnerOptions::default() }, family)
    }

    /// A runner with `options`, inside this namespace (its own command timeout unless
    /// `options` sets a shorter one).
    #[allow(dead_code)]
    pub fn runner_with(&self, options: RunnerOptions, family: IpFamily) -> IptablesRunner {
        let options = RunnerOptions {
            netns: Some(self.name.clone()),
            command_timeout: options.command_timeout.min(Duration::from_secs(60)),
            ..options
        };
        IptablesRunner::new(Arc::new(RealExec), family, options)
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        match RealExec.run(&Command::new("ip").args(["netns", "del", self.name.as_str()])) {
            Ok(out) if out.success() => {}
            Ok(out) => eprintln!("warning: ip netns del {}: {}", self.name, out.combined()),
            Err(e) => eprintln!("warning: ip netns del {}: {e}", self.name),
        }
    }
}
