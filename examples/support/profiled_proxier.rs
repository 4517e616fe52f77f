//! The proxier the heap-profiling examples (`mem_profile`, `churn_profile`) measure: the
//! daemon's watch handlers, change trackers, proxier and iptables runner, over a fake
//! kernel exec instead of iptables.

use std::io::Write;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kube_proxy_rs::daemon::runner::{BoundedFrequencyRunner, Pacing};
use kube_proxy_rs::exec::{Command, Exec, ExecError, Feed, Output};
use kube_proxy_rs::iptables::runner::{Backend, IptablesRunner, RunnerOptions};
use kube_proxy_rs::k8s::{ChangeSink, ProxierSet};
use kube_proxy_rs::model::{Cidr, IpFamily};
use kube_proxy_rs::proxier::local_detect::LocalDetector;
use kube_proxy_rs::proxier::nodeport_addresses::NodePortAddresses;
use kube_proxy_rs::proxier::{Proxier, ProxierConfig, RenderConfig, StaticInterfaces};
use kube_proxy_rs::synthetic;

/// Answers the iptables runner like a kernel that accepted every restore: `*-save -t nat`
/// prints the chain declarations of the last restore's nat table, everything else
/// succeeds. Restore inputs are read as they are written and not kept (the runner streams
/// them; keeping them here would put a copy of the input in the figures). With
/// `live_heap`, records the largest live heap seen while each restore's input arrived.
pub struct KernelExec {
    pub nat: Mutex<Vec<u8>>,
    pub at_restore: Mutex<Vec<usize>>,
    /// Bytes of restore input received since this was last reset.
    pub restored_bytes: AtomicUsize,
    live_heap: Option<fn() -> usize>,
    nft: bool,
}

impl KernelExec {
    /// `nft`: an iptables-nft node (a large restore is split into transactions there).
    pub fn new(live_heap: Option<fn() -> usize>, nft: bool) -> Self {
        KernelExec {
            nat: Mutex::default(),
            at_restore: Mutex::default(),
            restored_bytes: AtomicUsize::new(0),
            live_heap,
            nft,
        }
    }
}

/// A restore's stdin as the fake kernel reads it: line by line, keeping the nat table's
/// chain declarations only.
struct RestoreReader<'k> {
    kernel: &'k KernelExec,
    partial: Vec<u8>,
    in_nat: bool,
    nat: Option<Vec<u8>>,
    peak_heap: usize,
}

impl RestoreReader<'_> {
    fn line(&mut self, line: &[u8]) {
        if line.starts_with(b"*") {
            self.in_nat = line == b"*nat";
            if self.in_nat {
                self.nat = Some(Vec::new());
            }
        } else if self.in_nat && line.starts_with(b":") {
            let nat = self.nat.get_or_insert_with(Vec::new);
            nat.extend_from_slice(line);
            nat.push(b'\n');
        }
    }
}

impl Write for RestoreReader<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if let Some(live_heap) = self.kernel.live_heap {
            self.peak_heap = self.peak_heap.max(live_heap());
        }
        self.kernel.restored_bytes.fetch_add(buf.len(), Ordering::Relaxed);
        let mut rest = buf;
        while let Some(end) = rest.iter().position(|&b| b == b'\n') {
            let mut line = std::mem::take(&mut self.partial);
            line.extend_from_slice(&rest[..end]);
            self.line(&line);
            line.clear();
            self.partial = line;
            rest = &rest[end + 1..];
        }
        self.partial.extend_from_slice(rest);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Exec for KernelExec {
    fn run(&self, cmd: &Command<'_>) -> Result<Output, ExecError> {
        if cmd.args.iter().any(|a| a == "--version") {
            let mode = if self.nft { "nf_tables" } else { "legacy" };
            return Ok(Output::ok(format!("iptables v1.8.9 ({mode})\n")));
        }
        if cmd.program.ends_with("-save") {
            let nat = self.nat.lock().expect("lock");
            return Ok(Output::ok(nat.clone()));
        }
        if !cmd.program.ends_with("-restore") {
            return Ok(Output::ok(""));
        }
        let input = cmd.stdin.as_deref().unwrap_or_default();
        self.run_feeding(cmd, &|out: &mut dyn Write| out.write_all(input))
    }

    fn run_feeding(&self, cmd: &Command<'_>, feed: Feed<'_>) -> Result<Output, ExecError> {
        if !cmd.program.ends_with("-restore") {
            return self.run(cmd);
        }
        let mut reader = RestoreReader { kernel: self, partial: Vec::new(), in_nat: false, nat: None, peak_heap: 0 };
        feed(&mut reader).map_err(|source| ExecError::Io { program: cmd.program.clone(), source })?;
        if let Some(live_heap) = self.live_heap {
            self.at_restore.lock().expect("lock").push(reader.peak_heap.max(live_heap()));
        }
        if let Some(nat) = reader.nat {
            *self.nat.lock().expect("lock") = nat;
        }
        Ok(Output::ok(""))
    }
}

/// An IPv4 proxier on `kernel`, the handlers' view of it, and the runner its changes
/// trigger (kept alive by the caller; syncs are run by hand).
pub fn proxier(kernel: Arc<KernelExec>) -> (Arc<Mutex<Proxier>>, ProxierSet, BoundedFrequencyRunner) {
    let family = IpFamily::V4;
    let backend = if kernel.nft { Backend::Nft } else { Backend::Legacy };
    let runner = IptablesRunner::new(
        kernel,
        family,
        RunnerOptions { backend, netns: None, command_timeout: Duration::from_secs(60), ..RunnerOptions::default() },
    );
    let cfg = ProxierConfig {
        render: RenderConfig {
            family,
            masquerade_all: false,
            masquerade_mark: kube_proxy_rs::config::masquerade_mark(14),
            localhost_nodeports: true,
            local_detector: LocalDetector::Cidr(Cidr::parse_sloppy("10.0.0.0/8").expect("cidr")),
            node_ip: Some("192.168.0.2".parse().expect("ip")),
            node_port_addresses: NodePortAddresses::new(family, &[]),
            random_fully: true,
            conntrack_tcp_liberal: false,
            features: kube_proxy_rs::compat::Features::default(),
        },
        hostname: synthetic::NODE_NAME.to_string(),
        sync_period: Duration::from_secs(30),
    };
    let proxier = Arc::new(Mutex::new(Proxier::new(cfg, Arc::new(runner), Arc::new(StaticInterfaces(Vec::new())))));
    let sync_runner = BoundedFrequencyRunner::new("sync", Duration::ZERO, Duration::from_secs(3600), Pacing::Burst(2))
        .expect("runner");
    let handle = sync_runner.handle();
    let recorder: Arc<dyn ChangeSink> = proxier.lock().expect("proxier").recorder();
    let set = ProxierSet::new(vec![(recorder, Arc::new(move || handle.run()))]);
    (proxier, set, sync_runner)
}
