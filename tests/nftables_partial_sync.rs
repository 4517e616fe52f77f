//! nftables partial syncs: after any series of changes synced partially, the kernel's table is
//! the one a fresh proxier's full sync of the same cluster writes (but for stale chains not
//! yet deleted, which are empty and unreferenced), every transaction is one the strict fake
//! kernel accepts, and a full sync of an up-to-date table changes nothing.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube_proxy_rs::compat::Release;
use kube_proxy_rs::model::IpFamily;
use kube_proxy_rs::nftables::TableState;
use kube_proxy_rs::proxier::nftables::NftSyncOutcome;
use kube_proxy_rs::tracker::testing::node;

use crate::partial_sync::{random_service, random_slice};
use crate::support::harness::TEST_NODE_NAME;
use crate::support::line_diff;
use crate::support::nft::{FakeSettings, NftTestProxier};
use crate::support::rng::Rng;

#[derive(Clone, Default)]
struct Cluster {
    services: BTreeMap<usize, Service>,
    slices: BTreeMap<(usize, usize), EndpointSlice>,
    zone: String,
}

fn mutate(rng: &mut Rng, cluster: &mut Cluster, fp: &mut NftTestProxier, family: IpFamily, max: usize) {
    match rng.below(10) {
        0..=2 => {
            let i = rng.below(max);
            let new = random_service(rng, i, family);
            cluster.services.insert(i, new.clone());
            fp.add_services(&[new]);
        }
        3 => {
            let pick = rng.below(cluster.services.len().max(1));
            if let Some(i) = cluster.services.keys().nth(pick).copied()
                && let Some(old) = cluster.services.remove(&i)
            {
                fp.delete_service(&old);
            }
        }
        4..=7 => {
            let (i, part) = (rng.below(max), rng.below(2));
            let new = random_slice(rng, i, part, family);
            cluster.slices.insert((i, part), new.clone());
            fp.add_slices(&[new]);
        }
        8 => {
            let pick = rng.below(cluster.slices.len().max(1));
            if let Some(k) = cluster.slices.keys().nth(pick).copied()
                && let Some(old) = cluster.slices.remove(&k)
            {
                fp.delete_slice(&old);
            }
        }
        _ => {
            cluster.zone = ["zone-a", "zone-b"][rng.below(2)].to_string();
            fp.set_node(&node(TEST_NODE_NAME, &[("topology.kubernetes.io/zone", &cluster.zone)], &[], &[]));
        }
    }
}

/// `table` without the per-service chains in `stale` (they must be empty and unreferenced).
fn without_stale(mut table: TableState, stale: &[&String], what: &str) -> TableState {
    for name in stale {
        let chain =
            table.chains.remove(*name).unwrap_or_else(|| panic!("{what}: stale chain {name} is not in the kernel"));
        assert!(chain.rules.is_empty(), "{what}: stale chain {name} holds rules");
    }
    table
}

fn run(seed: u64, family: IpFamily, release: Release, steps: usize) {
    let mut rng = Rng::with_state(seed);
    let mut settings = FakeSettings::upstream(family);
    // Full syncs (the first, after failures, after zone changes) now and then in small pieces.
    if rng.chance(30) {
        settings.chunk_operations = Some(1 + rng.below(40));
    }
    let mut cluster = Cluster::default();
    let mut fp = NftTestProxier::new(&settings, release);
    fp.sync();
    for step in 0..steps {
        let what = format!("seed {seed} step {step} ({family}, {release})");
        for _ in 0..=rng.below(3) {
            mutate(&mut rng, &mut cluster, &mut fp, family, 8);
        }
        // Now and then the kernel refuses a transaction: nothing is applied, and the next
        // sync (full, from a listing) must get everything right.
        let fail = rng.chance(8);
        if fail {
            fp.nft.fail_next_runs(1);
        }
        fp.now += Duration::from_millis(if rng.chance(50) { 400 } else { 1500 });
        let report = match fp.proxier.sync(fp.now) {
            NftSyncOutcome::Synced(report) => report,
            NftSyncOutcome::NotInitialized => panic!("{what}: not initialized"),
        };
        // The failure hits the sync's first transaction: the stale-chain deletion when one is
        // due (the sync goes on), else the sync's own (unless it had nothing to send).
        fp.nft.fail_next_runs(0);
        if fail && report.result.is_err() {
            continue;
        }
        if let Err(e) = &report.result {
            panic!("{what}: sync failed: {e}\n{}", report.transaction.as_deref().unwrap_or_default());
        }

        let mut reference = NftTestProxier::new(&FakeSettings::upstream(family), release);
        if !cluster.zone.is_empty() {
            reference.set_node(&node(TEST_NODE_NAME, &[("topology.kubernetes.io/zone", &cluster.zone)], &[], &[]));
        }
        reference.add_services(&cluster.services.values().cloned().collect::<Vec<_>>());
        reference.add_slices(&cluster.slices.values().cloned().collect::<Vec<_>>());
        let full = reference.sync();
        let totals = |s: &kube_proxy_rs::proxier::nftables::NftSyncStats| {
            (s.services, s.endpoints, s.no_local_endpoints_internal, s.no_local_endpoints_external)
        };
        assert_eq!(totals(&report.stats), totals(&full.stats), "{what}: (services, endpoints, no local int, ext)");
        assert_eq!(report.service_health, full.service_health, "{what}: health-check ports and local endpoints");

        let stale: Vec<&String> = fp.proxier.stale_chains().keys().collect();
        let got = without_stale(fp.nft.table(), &stale, &what).dump(fp.family);
        let want = reference.nft.dump();
        if got != want {
            panic!(
                "{what}: table after partial syncs differs from a full sync (- full, + partial):\n{}\nlast transaction:\n{}",
                line_diff(&want, &got),
                report.transaction.as_deref().unwrap_or_default()
            );
        }
        // A full sync of this table finds nothing to write.
        if rng.chance(20) {
            fp.proxier.force_full_sync();
            let again = fp.sync();
            assert!(again.full, "{what}");
            assert_eq!(
                again.stats.operations,
                0,
                "{what}: a full sync rewrote an up-to-date table:\n{}",
                again.transaction.unwrap_or_default()
            );
        }
    }
}

#[test]
fn nftables_partial_syncs_equal_full_sync_ipv4() {
    for release in Release::nftables_all() {
        for seed in 1..=30u64 {
            run(
                seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) + u64::from(release.to_string().as_bytes()[3]),
                IpFamily::V4,
                release,
                25,
            );
        }
    }
}

#[test]
fn nftables_partial_syncs_equal_full_sync_ipv6() {
    for release in [Release::V1_33, "1.35".parse().expect("release"), Release::V1_37] {
        for seed in 1..=15u64 {
            run(seed.wrapping_mul(0x2545_F491_4F6C_DD1D) + 7, IpFamily::V6, release, 25);
        }
    }
}
