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
use std::sync::Arc;
use std::time::{Duration, Instant};

use cap::Cap;
use kube::runtime::watcher::Event;
use kube_proxy_rs::k8s::{ServiceEvents, SliceEvents};
use kube_proxy_rs::proxier::SyncOutcome;
use kube_proxy_rs::synthetic;

#[path = "support/profiled_proxier.rs"]
mod profiled_proxier;

use profiled_proxier::KernelExec;

#[global_allocator]
static ALLOCATOR: Cap<alloc::System> = Cap::new(alloc::System, usize::MAX);

fn main() {
    let mut args = std::env::args().skip(1);
    let rounds: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(1000);
    let per_round: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(40);
    let kernel = Arc::new(KernelExec::new(None, false));
    let (proxier, set, _sync_runner) = profiled_proxier::proxier(kernel);

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
