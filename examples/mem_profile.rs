//! Heap profile of the daemon's proxier at a synthetic cluster size, without a kernel or an
//! API server: Services and EndpointSlices arrive as JSON (deserialised one at a time and
//! dropped, as the watches do), go through the watch event handlers into a proxier whose
//! iptables runner talks to a fake "kernel" exec, and two syncs run (the first full, the
//! second partial with the stale-chain cleanup reading the whole nat table back).
//!
//! A counting global allocator reports live heap bytes (requested sizes: malloc's per-chunk
//! overhead is not included) after each phase and the peaks in between; `/proc/self/status`
//! gives VmRSS and VmHWM for comparison.
//!
//!     cargo run --release --example mem_profile -- 10000 [--no-pages] [--nft]
//!
//! Figures are recorded in docs/performance.md.

// An example reports on stdout.
#![allow(clippy::print_stdout)]

use std::alloc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cap::Cap;
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::runtime::watcher::Event;
use kube_proxy_rs::k8s::objects::{ServiceView, SliceView, convert_event};
use kube_proxy_rs::k8s::{ServiceEvents, SliceEvents};
use kube_proxy_rs::proxier::SyncOutcome;
use kube_proxy_rs::synthetic::{self, ClusterShape};

#[path = "support/profiled_proxier.rs"]
mod profiled_proxier;

use profiled_proxier::KernelExec;

#[global_allocator]
static ALLOCATOR: Cap<alloc::System> = Cap::new(alloc::System, usize::MAX);

/// `--nft`: an iptables-nft node, where a large restore is split into transactions.
fn nft_mode() -> bool {
    std::env::args().any(|a| a == "--nft")
}

fn mb(bytes: usize) -> String {
    format!("{:.1}", bytes as f64 / 1e6)
}

/// (VmRSS, VmHWM) in bytes.
fn rss() -> (usize, usize) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().trim_end_matches(" kB").trim().parse::<usize>().ok())
            .unwrap_or(0)
            * 1024
    };
    (field("VmRSS:"), field("VmHWM:"))
}

fn reset_hwm() {
    // "5" resets the peak RSS to the current RSS (proc(5), clear_refs).
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

struct Report {
    last: usize,
}

impl Report {
    fn phase(&mut self, name: &str) {
        let now = ALLOCATOR.allocated();
        let (rss, hwm) = rss();
        println!(
            "| {name} | {} | {:+.1} | {} | {} | {} |",
            mb(now),
            (now as f64 - self.last as f64) / 1e6,
            mb(ALLOCATOR.max_allocated()),
            mb(rss),
            mb(hwm)
        );
        self.last = now;
        reset_hwm();
    }
}

fn main() {
    let services: usize = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(10_000);

    // The watch side: JSON documents as the API server sends them.
    let (svc_json, slice_json) = {
        let cluster = synthetic::cluster(ClusterShape::new(services, 10));
        let svc: Vec<String> = cluster.services.iter().map(|s| serde_json::to_string(s).expect("json")).collect();
        let slices: Vec<String> = cluster.slices.iter().map(|s| serde_json::to_string(s).expect("json")).collect();
        (svc, slices)
    };
    let json_bytes: usize = svc_json.iter().chain(&slice_json).map(String::len).sum();
    println!(
        "{services} services, {} endpoints; JSON input {} MB (counted in every figure)",
        services * 10,
        mb(json_bytes)
    );
    println!();
    println!("| phase | live heap (MB) | change | peak so far | VmRSS | VmHWM since previous |");
    println!("|---|---:|---:|---:|---:|---:|");
    let mut report = Report { last: 0 };
    reset_hwm();
    report.phase("start (JSON input held)");

    let kernel = Arc::new(KernelExec::new(Some(|| ALLOCATOR.allocated()), nft_mode()));
    let (proxier, set, _sync_runner) = profiled_proxier::proxier(kernel.clone());
    report.phase("proxier created");

    let mut svc_events = ServiceEvents::default();
    svc_events.handle(Event::Init, &set);
    for doc in &svc_json {
        let svc: ServiceView = serde_json::from_str(doc).expect("service");
        svc_events.handle(convert_event::<_, Service>(Event::InitApply(svc)), &set);
    }
    svc_events.handle(Event::InitDone, &set);
    report.phase("services listed (pending)");

    let mut slice_events = SliceEvents::default();
    slice_events.handle(Event::Init, &set);
    for doc in &slice_json {
        let slice: SliceView = serde_json::from_str(doc).expect("slice");
        slice_events.handle(convert_event::<_, EndpointSlice>(Event::InitApply(slice)), &set);
    }
    slice_events.handle(Event::InitDone, &set);
    report.phase("slices listed (pending)");

    let start = Instant::now();
    let sync = |now: Instant| match proxier.lock().expect("lock").sync(now) {
        SyncOutcome::Synced(report) => {
            assert!(report.result.is_ok(), "sync failed: {:?}", report.result);
            (report.full, kernel.restored_bytes.swap(0, std::sync::atomic::Ordering::Relaxed))
        }
        SyncOutcome::NotInitialized => panic!("not initialised"),
    };
    let (full, bytes) = sync(start);
    let at_restore = kernel.at_restore.lock().expect("lock").last().copied().unwrap_or(0);
    println!("| (largest live heap while the restore input was written) | {} | | | | |", mb(at_restore));
    report.phase(&format!("first sync done (full: {full}, {} MB input)", mb(bytes)));

    // A rollout of one service, a sync period later: partial sync with the stale-chain
    // cleanup (the whole nat table is read back).
    let slice = synthetic::slice(7, 10, 1);
    slice_events.handle(Event::Apply(slice), &set);
    let nat_saved = kernel.nat.lock().expect("lock").len();
    let (full, bytes) = sync(start + Duration::from_secs(31));
    let at_restore = kernel.at_restore.lock().expect("lock").last().copied().unwrap_or(0);
    println!("| (largest live heap while the restore input was written) | {} | | | | |", mb(at_restore));
    report.phase(&format!("partial sync done (full: {full}, {bytes} B input)"));
    if std::env::args().any(|a| a == "--no-pages") {
        // For heap profilers: the page decoding below would be the process's peak.
        return;
    }
    // What one list page of every object costs while it is held (API servers answer a list
    // from their cache in one page): as k8s-openapi objects and as the watches decode it.
    let page = |docs: &[String]| format!("[{}]", docs.join(","));
    let (svc_page, slice_page) = (page(&svc_json), page(&slice_json));
    let before = ALLOCATOR.allocated();
    let cost = |decoded: usize| mb(decoded - before);
    let full: Vec<Service> = serde_json::from_str(&svc_page).expect("services");
    let full_services = cost(ALLOCATOR.allocated());
    drop(full);
    let view: Vec<ServiceView> = serde_json::from_str(&svc_page).expect("services");
    let view_services = cost(ALLOCATOR.allocated());
    drop(view);
    let full: Vec<EndpointSlice> = serde_json::from_str(&slice_page).expect("slices");
    let full_slices = cost(ALLOCATOR.allocated());
    drop(full);
    let view: Vec<SliceView> = serde_json::from_str(&slice_page).expect("slices");
    let view_slices = cost(ALLOCATOR.allocated());
    drop(view);
    drop((svc_page, slice_page));
    println!(
        "| (one list page decoded: Services {full_services} MB as objects, {view_services} MB slim; \
         EndpointSlices {full_slices} MB as objects, {view_slices} MB slim) | | | | | |"
    );

    println!();
    println!(
        "The fake kernel's copy of the nat chain lines ({} MB, what the partial sync's cleanup read back) is counted above.",
        mb(nat_saved)
    );
}
