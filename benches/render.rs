//! Render benchmarks: full render of synthetic clusters (1k, 10k, 30k services with 10
//! endpoints each), a partial sync after one endpoint change at 10k, and the whole `render`
//! process (YAML parsing included) at 10k services.
//!
//! Run with `cargo bench --bench render` (add `-- --quick` for fewer rounds). Prints medians;
//! results are recorded in docs/performance.md.

// A benchmark reports on stdout.
#![allow(clippy::print_stdout)]

use std::collections::{BTreeMap, HashSet};
use std::process::Command;
use std::time::{Duration, Instant};

use kube_proxy_rs::iptables::save::chains_from_table;
use kube_proxy_rs::iptables::{CountedInput, Layout, RestoreInput};
use kube_proxy_rs::model::chains::NatChains;
use kube_proxy_rs::model::{IpFamily, NamespacedName};
use kube_proxy_rs::proxier::local_detect::LocalDetector;
use kube_proxy_rs::proxier::nodeport_addresses::NodePortAddresses;
use kube_proxy_rs::proxier::render::{self, RenderConfig, RenderInput, RenderState};
use kube_proxy_rs::synthetic::{self, ClusterShape};
use kube_proxy_rs::tracker::{EndpointChangeTracker, EndpointsMap, ServiceChangeTracker, ServicePortMap};

fn render_config() -> RenderConfig {
    RenderConfig {
        family: IpFamily::V4,
        masquerade_all: false,
        masquerade_mark: kube_proxy_rs::config::masquerade_mark(14),
        localhost_nodeports: true,
        local_detector: LocalDetector::Cidr(kube_proxy_rs::model::Cidr::parse_sloppy("10.0.0.0/8").expect("cidr")),
        node_ip: Some("192.168.0.2".parse().expect("ip")),
        node_port_addresses: NodePortAddresses::new(IpFamily::V4, &[]),
        random_fully: true,
        conntrack_tcp_liberal: false,
        features: kube_proxy_rs::compat::Features::default(),
    }
}

struct Maps {
    services: ServicePortMap,
    endpoints: EndpointsMap,
    svc_tracker: ServiceChangeTracker,
    ep_tracker: EndpointChangeTracker,
}

fn build(shape: ClusterShape) -> Maps {
    let cluster = synthetic::cluster(shape);
    let mut svc_tracker = ServiceChangeTracker::new(IpFamily::V4, kube_proxy_rs::compat::Features::default());
    let mut ep_tracker = EndpointChangeTracker::new(synthetic::NODE_NAME.to_string(), IpFamily::V4);
    for s in &cluster.services {
        svc_tracker.update(None, Some(s));
    }
    for s in &cluster.slices {
        ep_tracker.endpoint_slice_update(s, false);
    }
    let mut services = ServicePortMap::default();
    let mut endpoints = EndpointsMap::default();
    services.update(&mut svc_tracker);
    endpoints.update(&mut ep_tracker);
    Maps { services, endpoints, svc_tracker, ep_tracker }
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let rounds = if quick { 3 } else { 11 };
    let cfg = render_config();
    let labels = BTreeMap::new();
    println!("| services | endpoints | full render median (ms) | restore input (MB) |");
    println!("|---:|---:|---:|---:|");
    let mut ten_k = None;
    for services in [1_000usize, 10_000, 30_000] {
        let maps = build(ClusterShape::new(services, 10));
        let mut times = Vec::new();
        let mut bytes = 0;
        for _ in 0..rounds {
            let input = RenderInput {
                services: &maps.services,
                endpoints: &maps.endpoints,
                node_labels: &labels,
                interface_addrs: &[],
                changed: None,
                existing_nat_chains: None,
                nfacct: Default::default(),
            };
            let t = Instant::now();
            let r = render::render(&cfg, &input, &RenderState::default());
            bytes = written_bytes(&r);
            times.push(t.elapsed());
        }
        println!("| {services} | {} | {:.1} | {:.1} |", services * 10, ms(median(times)), bytes as f64 / 1e6);
        if services == 10_000 {
            ten_k = Some(maps);
        }
    }

    // Partial sync after one endpoint change, 10k services.
    let Some(mut maps) = ten_k else { return };
    let input = RenderInput {
        services: &maps.services,
        endpoints: &maps.endpoints,
        node_labels: &labels,
        interface_addrs: &[],
        changed: None,
        existing_nat_chains: None,
        nfacct: Default::default(),
    };
    let full = render::render(&cfg, &input, &RenderState::default());
    let full_bytes = written_bytes(&full);
    let full_payload = full.payload();
    let mut existing =
        NatChains::from_names(chains_from_table(full_payload.split("*nat").nth(1).unwrap_or("").as_bytes()));
    drop(full_payload);
    let mut state = RenderState::default();
    state.commit(full.into_outcome());

    // As the daemon runs them above the large-cluster threshold: stale chains are looked
    // for once per sync period (here every 4th sync); the first partial sync after a full
    // one fills the render's per-service memos in.
    let mut first = Duration::ZERO;
    let mut steady = Vec::new();
    let mut with_cleanup = Vec::new();
    let mut partial_bytes = 0;
    for round in 0..rounds.max(9) {
        // Replace the endpoints of service 4242 (a rollout), as a watch event would.
        let slice = synthetic::slice(4242, 10, round + 1);
        maps.ep_tracker.endpoint_slice_update(&slice, false);
        let t = Instant::now();
        let svc_result = maps.services.update(&mut maps.svc_tracker);
        let ep_result = maps.endpoints.update(&mut maps.ep_tracker);
        let mut changed: HashSet<NamespacedName> = svc_result.updated_services.clone();
        changed.extend(ep_result.updated_services.iter().cloned());
        let cleanup = round % 4 == 0;
        let input = RenderInput {
            services: &maps.services,
            endpoints: &maps.endpoints,
            node_labels: &labels,
            interface_addrs: &[],
            changed: Some(&changed),
            existing_nat_chains: cleanup.then_some(&existing),
            nfacct: Default::default(),
        };
        let r = render::render(&cfg, &input, &state);
        let elapsed = t.elapsed();
        partial_bytes = written_bytes(&r);
        if std::env::var_os("BENCH_PROFILE_PARTIAL").is_some() {
            for _ in 0..40 {
                let _ = render::render(&cfg, &input, &state);
            }
        }
        match (round, cleanup) {
            (0, _) => first = elapsed,
            (_, true) => with_cleanup.push(elapsed),
            (_, false) => steady.push(elapsed),
        }
        let mut outcome = r.into_outcome();
        // What the kernel holds now: the chains in use (stale ones were deleted), or the
        // chains it held and those written.
        let active = std::mem::take(&mut outcome.active_nat_chains);
        if cleanup {
            existing = NatChains::from_keys(active);
        } else {
            existing.extend(&active);
        }
        state.commit(outcome);
    }
    println!();
    println!(
        "partial sync after one endpoint change at 10k services (trackers and render): median {:.2} ms; \
         {:.2} ms when it looks for stale chains (once per sync period); {:.2} ms the first after a full sync; \
         {} bytes ({:.3}% of the full {} bytes)",
        ms(median(steady)),
        ms(median(with_cleanup)),
        ms(first),
        partial_bytes,
        partial_bytes as f64 * 100.0 / full_bytes as f64,
        full_bytes
    );

    // The whole `render` process on a 10k-service manifest.
    let cluster = synthetic::cluster(ClusterShape::new(10_000, 10));
    let yaml = synthetic::cluster_yaml(&cluster).expect("yaml");
    let dir = std::env::temp_dir().join(format!("kube-proxy-rs-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("tmp dir");
    let path = dir.join("cluster.yaml");
    std::fs::write(&path, &yaml).expect("write manifest");
    let bin = env!("CARGO_BIN_EXE_kube-proxy-rs");
    let mut times = Vec::new();
    for _ in 0..rounds.min(5) {
        let t = Instant::now();
        let out = Command::new(bin)
            .args(["render", "--hostname-override", synthetic::NODE_NAME])
            .arg(&path)
            .output()
            .expect("run render");
        times.push(t.elapsed());
        assert!(out.status.success(), "render failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    println!(
        "whole `render` process, 10k services / 100k endpoints ({:.1} MB of YAML): median {:.0} ms",
        yaml.len() as f64 / 1e6,
        ms(median(times))
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Writes the render's restore input as the daemon does (into iptables-restore's stdin;
/// here, nowhere) and returns its size: part of what a render costs.
fn written_bytes(rendered: &render::Rendered<'_>) -> usize {
    let counted = CountedInput::new(rendered);
    counted.write_to(Layout::Canonical, &mut std::io::sink()).expect("writing to a sink cannot fail");
    counted.bytes()
}
