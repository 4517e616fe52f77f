//! The nftables proxier at scale, without a kernel: N synthetic services × M endpoints go
//! through the trackers into an `NftablesProxier` whose "kernel" keeps the table in memory
//! (the fake, `--fake`) or only counts what it is sent (default, so the heap figures are the
//! proxier's alone). Reports, per phase: time (planning and rendering; with `--fake` also the
//! fake's applying), operations and bytes of `nft -f` text sent, live heap and its peak.
//!
//!     cargo run --release --example nft_scale -- 10000 [endpoints] [--release 1.35] [--fake]
//!
//! Phases: the first (full) sync; 20 single-endpoint changes (partial syncs, one each); a
//! forced full sync against the table (with `--fake`: the table as listed, so nothing should
//! be sent; without: no table, so everything is).

// An example reports on stdout.
#![allow(clippy::print_stdout)]

use std::alloc;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use cap::Cap;
use kube_proxy_rs::compat::{Features, Release};
use kube_proxy_rs::model::{Cidr, IpFamily, NamespacedName};
use kube_proxy_rs::nftables::fake::FakeNftables;
use kube_proxy_rs::nftables::{Family, NftError, Nftables, TableState, Transaction};
use kube_proxy_rs::proxier::StaticInterfaces;
use kube_proxy_rs::proxier::local_detect::LocalDetector;
use kube_proxy_rs::proxier::nftables::{NftProxierConfig, NftRenderConfig, NftSyncOutcome, NftablesProxier};
use kube_proxy_rs::proxier::nodeport_addresses::NodePortAddresses;
use kube_proxy_rs::synthetic::{self, ClusterShape};

#[global_allocator]
static ALLOCATOR: Cap<alloc::System> = Cap::new(alloc::System, usize::MAX);

/// A kernel that takes every transaction and keeps nothing but counts.
#[derive(Default)]
struct Counting {
    ops: AtomicUsize,
    bytes: AtomicUsize,
}

impl Nftables for Counting {
    fn family(&self) -> Family {
        Family::Ip
    }

    fn run(&self, tx: &Transaction) -> Result<(), NftError> {
        self.ops.fetch_add(tx.len(), Ordering::Relaxed);
        // What the writer would send (counted here, not part of the proxier's figures).
        let text: usize = tx.ops.iter().map(|op| op.to_string().len() + 1).sum();
        self.bytes.fetch_add(text, Ordering::Relaxed);
        Ok(())
    }

    fn check(&self, _tx: &Transaction) -> Result<(), NftError> {
        Ok(())
    }

    fn list_table(&self) -> Result<Option<TableState>, NftError> {
        Ok(None)
    }
}

fn mb(bytes: usize) -> String {
    format!("{:.1}", bytes as f64 / 1e6)
}

/// VmHWM: the process's peak resident set.
fn peak_rss() -> usize {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches(" kB").trim().parse::<usize>().ok())
        .unwrap_or(0)
        * 1024
}

fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1).cloned())
}

fn main() {
    let positional: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let services = positional.first().copied().unwrap_or(10_000);
    let per = positional.get(1).copied().unwrap_or(10);
    let release: Release = match arg("--release").as_deref() {
        Some("1.36") => Release::V1_36,
        Some("1.37") => Release::V1_37,
        Some(r) => r.parse().expect("release"),
        None => Release::V1_35,
    };
    let fake_mode = std::env::args().any(|a| a == "--fake");

    let fake = Arc::new(FakeNftables::new(Family::Ip));
    let counting = Arc::new(Counting::default());
    let nft: Arc<dyn Nftables> = if fake_mode { fake.clone() } else { counting.clone() };
    let cfg = NftProxierConfig {
        render: NftRenderConfig {
            family: IpFamily::V4,
            masquerade_all: false,
            masquerade_mark: "0x00004000".into(),
            local_detector: LocalDetector::Cidr(Cidr::parse_sloppy("10.0.0.0/8").expect("cidr")),
            node_ip: Some("192.168.0.2".parse().expect("ip")),
            node_port_addresses: NodePortAddresses::new(IpFamily::V4, &["192.168.0.2/32".into()]),
            features: Features::of(release),
        },
        hostname: synthetic::NODE_NAME.into(),
        sync_period: Duration::from_secs(30),
    };
    let mut proxier =
        NftablesProxier::new(cfg, nft, Arc::new(StaticInterfaces(vec!["192.168.0.2".parse().expect("ip")])));
    proxier.on_service_cidrs(&["172.16.0.0/12".into()]);
    // Objects are made one at a time and dropped, as the watches do.
    for i in 0..services {
        let s = synthetic::shaped_service(i, ClusterShape::DEFAULT_AFFINITY_EVERY);
        proxier.on_service_state(NamespacedName::of_object(&s.metadata), Some(&s));
        proxier.on_endpoint_slice_update(&synthetic::slice(i, per, 0), false);
    }
    proxier.on_services_synced();
    proxier.on_endpoint_slices_synced();
    let heap_before_sync = ALLOCATOR.allocated();
    println!(
        "{services} services × {per} endpoints, release {release}, kernel: {}",
        if fake_mode { "fake (applies)" } else { "counting" }
    );
    println!("live heap before the first sync (trackers, pending changes): {} MB", mb(heap_before_sync));
    println!();
    println!(
        "| phase | time (ms) | operations in transactions | nft text (MB) | live heap (MB) | peak heap (MB) | VmHWM (MB) |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|");

    let mut now = Instant::now();
    let phase = |proxier: &mut NftablesProxier, name: &str, now: Instant| {
        counting.bytes.store(0, Ordering::Relaxed);
        let started = Instant::now();
        let report = match proxier.sync(now) {
            NftSyncOutcome::Synced(r) => r,
            NftSyncOutcome::NotInitialized => panic!("not initialised"),
        };
        let elapsed = started.elapsed();
        assert!(report.result.is_ok(), "{name}: {:?}", report.result);
        let bytes = counting.bytes.swap(0, Ordering::Relaxed);
        let txs = report.stats.plan.transactions_before + usize::from(report.stats.operations > 0);
        (name.to_string(), elapsed, report.stats.operations, txs, bytes, report.full)
    };
    let print = |(name, elapsed, ops, txs, bytes, full): (String, Duration, usize, usize, usize, bool)| {
        println!(
            "| {name} (full: {full}) | {:.1} | {ops} in {txs} | {} | {} | {} | {} |",
            elapsed.as_secs_f64() * 1e3,
            if fake_mode { "-".to_string() } else { mb(bytes) },
            mb(ALLOCATOR.allocated()),
            mb(ALLOCATOR.max_allocated()),
            mb(peak_rss())
        );
    };
    print(phase(&mut proxier, "first sync", now));

    let partials: usize = arg("--partials").and_then(|p| p.parse().ok()).unwrap_or(20);
    let mut partial = Vec::new();
    for k in 0..partials {
        now += Duration::from_secs(2);
        let i = (k * 997 + 1) % services;
        proxier.on_endpoint_slice_update(&synthetic::slice(i, per, k + 1), false);
        let r = phase(&mut proxier, "one slice changed", now);
        partial.push(r.1);
        if k == 0 || k + 1 == partials {
            print(r);
        }
    }
    partial.sort();
    println!(
        "| partial syncs: median {:.2} ms, max {:.2} ms | | | | | | |",
        partial[partial.len() / 2].as_secs_f64() * 1e3,
        partial[partial.len() - 1].as_secs_f64() * 1e3
    );

    now += Duration::from_secs(2);
    proxier.force_full_sync();
    print(phase(&mut proxier, "forced full sync", now));
    if fake_mode {
        let (chains, rules, sets, elements) = fake.table().counts();
        println!();
        println!("table: {chains} chains, {rules} rules, {sets} sets and maps, {elements} elements");
    }
}
