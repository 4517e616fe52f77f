//! The proxier the heap-profiling examples (`mem_profile`, `churn_profile`) measure: the
//! daemon's watch handlers, change trackers, proxier and iptables runner, over a fake
//! kernel exec instead of iptables.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use kube_proxy_rs::daemon::runner::BoundedFrequencyRunner;
use kube_proxy_rs::exec::{Command, Exec, ExecError, Output};
use kube_proxy_rs::iptables::runner::{Backend, IptablesRunner, RunnerOptions};
use kube_proxy_rs::k8s::{ChangeSink, ProxierSet};
use kube_proxy_rs::model::{Cidr, IpFamily};
use kube_proxy_rs::proxier::local_detect::LocalDetector;
use kube_proxy_rs::proxier::nodeport_addresses::NodePortAddresses;
use kube_proxy_rs::proxier::{Proxier, ProxierConfig, RenderConfig, StaticInterfaces};
use kube_proxy_rs::synthetic;

/// Answers the iptables runner like a kernel that accepted every restore: `*-save -t nat`
/// prints the chain declarations of the last restore's nat table, everything else
/// succeeds. With `live_heap`, records it when a restore arrives (the payload and whatever
/// the runner made of it are live then).
pub struct KernelExec {
    pub nat: Mutex<Vec<u8>>,
    pub at_restore: Mutex<Vec<usize>>,
    live_heap: Option<fn() -> usize>,
    nft: bool,
}

impl KernelExec {
    /// `nft`: an iptables-nft node (a large restore is split into transactions there).
    pub fn new(live_heap: Option<fn() -> usize>, nft: bool) -> Self {
        KernelExec { nat: Mutex::default(), at_restore: Mutex::default(), live_heap, nft }
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
        if cmd.program.ends_with("-restore") {
            if let Some(live_heap) = self.live_heap {
                self.at_restore.lock().expect("lock").push(live_heap());
            }
            let input = cmd.stdin.as_deref().unwrap_or_default();
            let text = String::from_utf8_lossy(input);
            if let Some(start) = text.find("*nat\n") {
                let mut nat = self.nat.lock().expect("lock");
                // Keep only chain declarations: enough for the stale-chain check, and it keeps
                // the fake kernel's own copy out of the figures as far as possible.
                *nat = text[start..]
                    .lines()
                    .filter(|l| l.starts_with(':'))
                    .flat_map(|l| [l, "\n"])
                    .collect::<String>()
                    .into_bytes();
            }
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
    let sync_runner =
        BoundedFrequencyRunner::new("sync", Duration::ZERO, Duration::from_secs(3600), 2).expect("runner");
    let handle = sync_runner.handle();
    let recorder: Arc<dyn ChangeSink> = proxier.lock().expect("proxier").recorder();
    let set = ProxierSet::new(vec![(recorder, Arc::new(move || handle.run()))]);
    (proxier, set, sync_runner)
}
