//! Does churn leak? The live heap of the watch handlers, change trackers, proxier and
//! iptables runner (fake kernel, as `mem_profile`) over many rounds of churn, each round
//! creating a batch of Services with EndpointSlices under fresh names, syncing, scaling every
//! slice down, syncing, deleting everything and syncing again. Every object a round creates
//! is gone at its end, so the live heap after each round should be the same: a figure that
//! grows with the number of rounds is state kept for objects that no longer exist.
//!
//! A counting global allocator gives exact live bytes (RSS, which the soak samples, also
//! moves with the allocator's fragmentation).
//!
//!     cargo run --release --example churn_profile -- [ROUNDS] [SERVICES_PER_ROUND]
//!
//! Figures are recorded in docs/performance.md ("Soak").

// An example reports on stdout.
#![allow(clippy::print_stdout)]

use std::alloc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cap::Cap;
use kube::runtime::watcher::Event;
use kube_proxy_rs::daemon::runner::BoundedFrequencyRunner;
use kube_proxy_rs::exec::{Command, Exec, ExecError, Output};
use kube_proxy_rs::iptables::runner::{Backend, IptablesRunner, RunnerOptions};
use kube_proxy_rs::k8s::{ProxierSet, ServiceEvents, SliceEvents};
use kube_proxy_rs::model::{Cidr, IpFamily};
use kube_proxy_rs::proxier::local_detect::LocalDetector;
use kube_proxy_rs::proxier::nodeport_addresses::NodePortAddresses;
use kube_proxy_rs::proxier::{Proxier, ProxierConfig, RenderConfig, StaticInterfaces, SyncOutcome};
use kube_proxy_rs::synthetic;

#[global_allocator]
static ALLOCATOR: Cap<alloc::System> = Cap::new(alloc::System, usize::MAX);

/// A kernel that accepts every restore and whose nat table lists the chains of the last one.
#[derive(Default)]
struct KernelExec {
    nat: Mutex<Vec<u8>>,
}

impl Exec for KernelExec {
    fn run(&self, cmd: &Command<'_>) -> Result<Output, ExecError> {
        if cmd.args.iter().any(|a| a == "--version") {
            return Ok(Output::ok("iptables v1.8.9 (legacy)\n"));
        }
        if cmd.program.ends_with("-save") {
            return Ok(Output::ok(self.nat.lock().expect("lock").clone()));
        }
        if cmd.program.ends_with("-restore") {
            let text = String::from_utf8_lossy(cmd.stdin.as_deref().unwrap_or_default());
            if let Some(start) = text.find("*nat\n") {
                let declared: String =
                    text[start..].lines().filter(|l| l.starts_with(':')).flat_map(|l| [l, "\n"]).collect();
                *self.nat.lock().expect("lock") = format!("*nat\n{declared}COMMIT\n").into_bytes();
            }
        }
        Ok(Output::ok(""))
    }
}

fn main() {
    let mut args = std::env::args().skip(1);
    let rounds: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(1000);
    let per_round: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(40);
    let family = IpFamily::V4;

    let kernel = Arc::new(KernelExec::default());
    let runner = IptablesRunner::new(
        kernel,
        family,
        RunnerOptions {
            backend: Backend::Legacy,
            netns: None,
            command_timeout: Duration::from_secs(60),
            ..RunnerOptions::default()
        },
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
    let recorder: Arc<dyn kube_proxy_rs::k8s::ChangeSink> = proxier.lock().expect("proxier").recorder();
    let set = ProxierSet::new(vec![(recorder, Arc::new(move || handle.run()))]);

    let mut services = ServiceEvents::default();
    let mut slices = SliceEvents::default();
    for e in [Event::Init, Event::InitDone] {
        services.handle(e, &set);
    }
    for e in [Event::Init, Event::InitDone] {
        slices.handle(e, &set);
    }

    // Every sync is a cleanup sync (small cluster), a sync period apart, so the large-cluster
    // cadence plays no part; each sync must succeed.
    let start = Instant::now();
    let mut syncs = 0u64;
    let mut sync = || {
        syncs += 1;
        match proxier.lock().expect("lock").sync(start + Duration::from_secs(31 * syncs)) {
            SyncOutcome::Synced(report) => assert!(report.result.is_ok(), "sync failed: {:?}", report.result),
            SyncOutcome::NotInitialized => panic!("not initialised"),
        }
    };
    sync();

    let checkpoints = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10_000];
    println!("{rounds} rounds of {per_round} services × 10 endpoints created, scaled to 5, deleted");
    println!();
    println!("| after round | live heap (bytes) | change since round 1 |");
    println!("|---:|---:|---:|");
    let mut baseline = None;
    for round in 1..=rounds {
        let ids: Vec<usize> = (0..per_round).map(|k| (round * per_round + k) % 60_000).collect();
        for &i in &ids {
            services.handle(Event::Apply(synthetic::service(i)), &set);
            slices.handle(Event::Apply(synthetic::slice(i, 10, 0)), &set);
        }
        sync();
        for &i in &ids {
            slices.handle(Event::Apply(synthetic::slice(i, 5, 1)), &set);
        }
        sync();
        for &i in &ids {
            slices.handle(Event::Delete(synthetic::slice(i, 5, 1)), &set);
            services.handle(Event::Delete(synthetic::service(i)), &set);
        }
        sync();
        if checkpoints.contains(&round) || round == rounds {
            let live = ALLOCATOR.allocated();
            let base = *baseline.get_or_insert(live);
            println!("| {round} | {live} | {:+} |", live as i64 - base as i64);
        }
    }
}
