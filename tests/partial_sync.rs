//! Partial syncs: after any series of partial syncs the kernel state must equal what one full
//! sync of the same cluster state produces, and a partial sync writes only what changed.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube_proxy_rs::compat::Release;
use kube_proxy_rs::iptables::Table;
use kube_proxy_rs::model::IpFamily;
use kube_proxy_rs::proxier::render::RenderStats;
use kube_proxy_rs::tracker::testing::{Ep, ep, node, slice, svc};

use crate::support::harness::{TEST_NODE_NAME, TestProxier};
use crate::support::rng::Rng;

/// The randomised cluster: services by index, each with up to two slices.
#[derive(Clone, Default)]
struct Cluster {
    services: BTreeMap<usize, Service>,
    slices: BTreeMap<(usize, usize), EndpointSlice>,
    zone: String,
}

pub(crate) fn random_service(rng: &mut Rng, i: usize, family: IpFamily) -> Service {
    let ns = format!("ns{}", i % 3);
    let name = format!("svc{i}");
    let ip = match family {
        IpFamily::V4 => format!("172.30.{}.{}", i / 200, i % 200 + 1),
        IpFamily::V6 => format!("fd00:30::{:x}", i + 1),
    };
    let mut b = svc(&ns, &name).cluster_ip(&ip);
    let kind = rng.below(4);
    let np = 30000 + i as i32 * 2;
    match kind {
        0 => b = b.type_("ClusterIP").tcp("p80", 80),
        1 => b = b.type_("NodePort").node_port("p80", 80, np),
        _ => {
            // Addresses are sometimes spelled the lenient way Kubernetes accepts: written
            // canonically from 1.30 on, skipped (IPv4) or kept as written (IPv6) by 1.29, so
            // an update may change only the spelling.
            let lb = match (family, rng.chance(30)) {
                (IpFamily::V4, false) => format!("203.0.113.{}", i + 1),
                (IpFamily::V4, true) => format!("203.0.113.{:03}", i + 1),
                (IpFamily::V6, false) => format!("fd00:99::{:x}", i + 1),
                (IpFamily::V6, true) => format!("FD00:99:0:0::{:04x}", i + 1),
            };
            b = b.type_("LoadBalancer").node_port("p80", 80, np);
            // ipMode Proxy drops the IP from 1.30 on (ignored by 1.29).
            b = if rng.chance(30) { b.lb_ingress_modes(&[(&lb, "Proxy")]) } else { b.lb_ingress(&[&lb]) };
            if rng.chance(50) {
                let range = match (family, rng.chance(30)) {
                    (IpFamily::V4, false) => "198.18.0.0/15",
                    // Host bits set: 198.18.0.0/15 from 1.30 on.
                    (IpFamily::V4, true) => "198.19.7.1/15",
                    (IpFamily::V6, false) => "fd00:77::/64",
                    (IpFamily::V6, true) => "fd00:77::1/64",
                };
                b = b.source_ranges(&[range]);
            }
        }
    }
    if rng.chance(30) {
        b = b.port("dns", "UDP", 53, 0);
    }
    if rng.chance(25) {
        let ext = match (family, rng.chance(30)) {
            (IpFamily::V4, false) => format!("198.19.0.{}", i + 1),
            (IpFamily::V4, true) => format!("::ffff:198.19.0.{}", i + 1),
            (IpFamily::V6, false) => format!("fd00:88::{:x}", i + 1),
            (IpFamily::V6, true) => format!("fd00:88:0::{:x}", i + 1),
        };
        b = b.external_ips(&[&ext]);
    }
    if rng.chance(40) {
        b = b.local_traffic();
        if kind >= 2 {
            b = b.health_check_node_port(32000 + i as i32);
        }
    }
    if rng.chance(20) {
        b = b.internal_local();
    }
    if rng.chance(25) {
        b = b.affinity(Some(60 + rng.below(1000) as i32));
    }
    if rng.chance(20) {
        b = b.annotation("service.kubernetes.io/topology-mode", "Auto");
    }
    b.build()
}

pub(crate) fn random_slice(rng: &mut Rng, i: usize, part: usize, family: IpFamily) -> EndpointSlice {
    let ns = format!("ns{}", i % 3);
    let name = format!("svc{i}");
    let mut s = slice(&ns, &name, &format!("{name}-{part}")).tcp("p80", 8080).udp("dns", 5353);
    if family == IpFamily::V6 {
        s = s.ipv6();
    }
    for _ in 0..rng.below(4) {
        // A small address pool, so endpoints collide across slices and move between them.
        let host = rng.below(6) + 1;
        // Sometimes spelled with leading zeros: skipped by 1.29 and 1.30, the same endpoint
        // as the canonical spelling from 1.31 (so it collides with it).
        let ip = match (family, rng.chance(20)) {
            (IpFamily::V4, false) => format!("10.{}.0.{host}", i + 1),
            (IpFamily::V4, true) => format!("10.{:03}.0.{host:02}", i + 1),
            (IpFamily::V6, _) => format!("fd00:10::{:x}:{host}", i + 1),
        };
        let mut e: Ep = ep(&ip);
        e = match rng.below(3) {
            0 => e.node(TEST_NODE_NAME),
            1 => e.node("other-node"),
            _ => e,
        };
        match rng.below(10) {
            0 => e = e.terminating(),
            1 => e = e.not_ready(),
            _ => {}
        }
        if rng.chance(50) {
            e = e.zone(["zone-a", "zone-b"][rng.below(2)]).hints(&[["zone-a", "zone-b"][rng.below(2)]]);
        }
        // Node hints count from 1.34 on (PreferSameNode).
        if rng.chance(40) {
            e = e.node_hints(&[[TEST_NODE_NAME, "other-node"][rng.below(2)]]);
        }
        s = s.endpoint(e);
    }
    s.build()
}

/// Applies one random change to `cluster` and to the incremental proxier.
fn mutate(rng: &mut Rng, cluster: &mut Cluster, fp: &mut TestProxier, family: IpFamily, max_services: usize) {
    match rng.below(10) {
        // Add or replace a service.
        0..=2 => {
            let i = rng.below(max_services);
            let new = random_service(rng, i, family);
            match cluster.services.insert(i, new.clone()) {
                Some(old) => fp.update_service(&old, &new),
                None => fp.add_services(&[new]),
            }
        }
        // Delete a service.
        3 => {
            let pick = rng.below(cluster.services.len().max(1));
            if let Some(i) = cluster.services.keys().nth(pick).copied()
                && let Some(old) = cluster.services.remove(&i)
            {
                fp.delete_service(&old);
            }
        }
        // Add or replace a slice.
        4..=7 => {
            let i = rng.below(max_services);
            let part = rng.below(2);
            let new = random_slice(rng, i, part, family);
            cluster.slices.insert((i, part), new.clone());
            fp.add_slices(&[new]);
        }
        // Delete a slice.
        8 => {
            let pick = rng.below(cluster.slices.len().max(1));
            if let Some(k) = cluster.slices.keys().nth(pick).copied()
                && let Some(old) = cluster.slices.remove(&k)
            {
                fp.delete_slice(&old);
            }
        }
        // The node moves zone (forces a full sync).
        _ => {
            cluster.zone = ["zone-a", "zone-b"][rng.below(2)].to_string();
            fp.set_node(&node(TEST_NODE_NAME, &[("topology.kubernetes.io/zone", &cluster.zone)], &[], &[]));
        }
    }
}

/// A fresh proxier that knows the whole cluster and does one full sync; with that sync's
/// figures.
fn full_sync_of(
    cluster: &Cluster,
    family: IpFamily,
    release: Release,
    extra: &[EndpointSlice],
    extra_svcs: &[Service],
) -> (TestProxier, RenderStats) {
    let mut fp = TestProxier::with_release(family, release);
    if !cluster.zone.is_empty() {
        fp.set_node(&node(TEST_NODE_NAME, &[("topology.kubernetes.io/zone", &cluster.zone)], &[], &[]));
    }
    fp.add_services(&cluster.services.values().cloned().collect::<Vec<_>>());
    fp.add_services(extra_svcs);
    fp.add_slices(&cluster.slices.values().cloned().collect::<Vec<_>>());
    fp.add_slices(extra);
    let report = fp.sync();
    assert!(report.full);
    (fp, report.stats)
}

/// `save` without the per-service chains nothing jumps to: what a sync that does not look for
/// stale chains leaves for a later one to delete, as upstream does.
fn without_unreferenced_service_chains(save: &str) -> String {
    let is_service_chain =
        |c: &str| ["KUBE-SEP-", "KUBE-SVC-", "KUBE-SVL-", "KUBE-EXT-", "KUBE-FW-"].iter().any(|p| c.starts_with(p));
    let chain_of = |line: &str| -> Option<String> {
        let rest = line.strip_prefix(':').or_else(|| line.strip_prefix("-A "))?;
        rest.split_whitespace().next().map(str::to_owned)
    };
    let mut lines: Vec<&str> = save.lines().collect();
    loop {
        let targets: std::collections::HashSet<String> = lines
            .iter()
            .filter(|l| l.starts_with("-A "))
            .filter_map(|l| l.split(" -j ").nth(1)?.split_whitespace().next().map(str::to_owned))
            .collect();
        let before = lines.len();
        lines.retain(|l| chain_of(l).is_none_or(|c| !is_service_chain(&c) || targets.contains(&c)));
        if lines.len() == before {
            return lines.join("\n");
        }
    }
}

fn run_invariant(seed: u64, family: IpFamily, release: Release, steps: usize, large: bool) {
    run_invariant_split(seed, family, release, steps, large, None);
}

/// [`run_invariant`] with the proxier's restores applied as the runner applies them on
/// iptables-nft (in dependency order, cut into transactions of at most `split_budget`).
fn run_invariant_split(
    seed: u64,
    family: IpFamily,
    release: Release,
    steps: usize,
    large: bool,
    split_budget: Option<u64>,
) {
    let mut rng = Rng::with_state(seed);
    let mut cluster = Cluster::default();
    let mut fp = TestProxier::with_release(family, release);
    fp.ipt.set_split_budget(split_budget);
    // Large-cluster mode: one big service pushes the total over the threshold.
    let (big_svcs, big_slices) = if large {
        let ip = if family == IpFamily::V4 { "172.31.0.1" } else { "fd00:31::1" };
        let svc = svc("big", "big").cluster_ip(ip).tcp("p80", 80).build();
        let mut s = slice("big", "big", "big-1").tcp("p80", 80);
        if family == IpFamily::V6 {
            s = s.ipv6();
        }
        for n in 0..1001u32 {
            let addr = match family {
                IpFamily::V4 => format!("10.250.{}.{}", n / 250, n % 250 + 1),
                IpFamily::V6 => format!("fd00:250::{:x}", n + 1),
            };
            s = s.endpoint(ep(&addr));
        }
        (vec![svc], vec![s.build()])
    } else {
        (Vec::new(), Vec::new())
    };
    fp.add_services(&big_svcs);
    fp.add_slices(&big_slices);
    fp.sync();
    for step in 0..steps {
        for _ in 0..=rng.below(3) {
            mutate(&mut rng, &mut cluster, &mut fp, family, 8);
        }
        // In large-cluster mode, stale chains are looked for at most once per sync period:
        // syncs a second apart skip that (and reuse the entries of unchanged services),
        // leaving stale chains for a later sync; one a period later looks for them.
        let soon = large && rng.below(2) == 0;
        let report = fp.sync_after(Duration::from_secs(if soon { 1 } else { 31 }));
        assert_eq!(report.stats.large_cluster_mode, large, "seed {seed} step {step}");
        let (reference, full_stats) = full_sync_of(&cluster, family, release, &big_slices, &big_svcs);
        // What exists after the sync is counted the same way whether the entries of a
        // service were computed or reused from an earlier sync.
        let totals = |s: &RenderStats| {
            (
                s.services,
                s.endpoints,
                s.nat_rules_total,
                s.filter_rules_total,
                s.no_local_endpoints_internal,
                s.no_local_endpoints_external,
            )
        };
        assert_eq!(
            totals(&report.stats),
            totals(&full_stats),
            "seed {seed} step {step}: (services, endpoints, nat rules, filter rules, no local internal, no local external)"
        );
        let (mut got, mut want) = (fp.ipt.save_all(), reference.ipt.save_all());
        if soon {
            (got, want) = (without_unreferenced_service_chains(&got), without_unreferenced_service_chains(&want));
        }
        if got != want {
            let diff = similar::TextDiff::from_lines(&want, &got);
            panic!(
                "seed {seed} step {step} ({family}, {release}, large={large}, split {split_budget:?}): state after partial syncs differs from a full sync \
                 (- full, + partial):\n{}\nlast payload:\n{}",
                diff.unified_diff(),
                report.payload.as_deref().unwrap_or_default()
            );
        }
    }
}

#[test]
fn partial_syncs_equal_full_sync_ipv4() {
    for seed in 1..=40u64 {
        run_invariant(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15), IpFamily::V4, Release::V1_29, 25, false);
    }
}

/// The same with the newest release's behaviour: ipMode Proxy ingresses, hints without the
/// annotation and node hints change which chains exist as services and slices change.
#[test]
fn partial_syncs_equal_full_sync_newest_release() {
    for seed in 1..=30u64 {
        run_invariant(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) + 11, IpFamily::V4, Release::NEWEST, 25, false);
    }
    for seed in 1..=8u64 {
        run_invariant(seed.wrapping_mul(0x2545_F491_4F6C_DD1D) + 13, IpFamily::V6, Release::V1_33, 25, false);
    }
}

#[test]
fn partial_syncs_equal_full_sync_ipv6() {
    for seed in 1..=15u64 {
        run_invariant(seed.wrapping_mul(0x2545_F491_4F6C_DD1D) + 7, IpFamily::V6, Release::V1_29, 25, false);
    }
}

#[test]
fn partial_syncs_equal_full_sync_large_cluster_mode() {
    for seed in 1..=16u64 {
        run_invariant(seed.wrapping_mul(0x1234_5678_9ABC_DEF1) + 3, IpFamily::V4, Release::V1_29, 12, true);
    }
    for seed in 1..=6u64 {
        run_invariant(seed.wrapping_mul(0x1234_5678_9ABC_DEF1) + 23, IpFamily::V6, Release::NEWEST, 12, true);
    }
}

/// Restores applied chain by chain in dependency order (budget 1: each chain its own
/// transaction, as on a large iptables-nft node) reach the state one canonical restore
/// reaches, and never jump to a chain not yet written or delete one still jumped to (the
/// fake kernel rejects both, as nf_tables does).
#[test]
fn partial_syncs_applied_chain_by_chain_equal_full_sync() {
    for seed in 1..=20u64 {
        let seed = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) + 17;
        run_invariant_split(seed, IpFamily::V4, Release::V1_29, 20, false, Some(1));
        run_invariant_split(seed, IpFamily::V4, Release::NEWEST, 20, false, Some(1));
    }
    for seed in 1..=6u64 {
        run_invariant_split(
            seed.wrapping_mul(0x2545_F491_4F6C_DD1D) + 19,
            IpFamily::V6,
            Release::V1_33,
            20,
            false,
            Some(1),
        );
    }
    for seed in 1..=3u64 {
        run_invariant_split(
            seed.wrapping_mul(0x1234_5678_9ABC_DEF1) + 5,
            IpFamily::V4,
            Release::V1_29,
            8,
            true,
            Some(5_000),
        );
    }
}

/// Upstream's `TestSyncProxyRulesRepeated`, first steps: adding a service rewrites only its
/// chains; deleting one deletes only its chains; and (going beyond upstream) top-level chains
/// whose content did not change are left out.
#[test]
fn partial_sync_writes_only_changed_chains() {
    let mut fp = TestProxier::new(IpFamily::V4);
    let svc1 = svc("ns1", "svc1").type_("ClusterIP").bare_cluster_ip("172.30.0.41").tcp("p80", 80).build();
    let svc2 = svc("ns2", "svc2").type_("ClusterIP").bare_cluster_ip("172.30.0.42").tcp("p8080", 8080).build();
    fp.add_services(&[svc1, svc2.clone()]);
    fp.add_slices(&[
        slice("ns1", "svc1", "svc1-1")
            .tcp("p80", 80)
            .endpoint(kube_proxy_rs::tracker::testing::bare_ep("10.0.1.1"))
            .build(),
        slice("ns2", "svc2", "svc2-1")
            .tcp("p8080", 8080)
            .endpoint(kube_proxy_rs::tracker::testing::bare_ep("10.0.2.1"))
            .build(),
    ]);
    assert!(fp.sync().full);

    // Add svc3 with an endpoint: KUBE-SERVICES changes (new rule); its SVC and SEP chains are
    // written; nothing in filter changed, so filter is empty.
    let svc3 = svc("ns3", "svc3").type_("ClusterIP").bare_cluster_ip("172.30.0.43").tcp("p80", 80).build();
    fp.add_services(&[svc3]);
    fp.add_slices(&[slice("ns3", "svc3", "svc3-1")
        .tcp("p80", 80)
        .endpoint(kube_proxy_rs::tracker::testing::bare_ep("10.0.3.1"))
        .build()]);
    let report = fp.sync();
    assert!(!report.full);
    crate::support::assert_rules_eq(
        r#"
        *filter
        COMMIT
        *nat
        :KUBE-SERVICES - [0:0]
        :KUBE-SEP-BSWRHOQ77KEXZLNL - [0:0]
        :KUBE-SVC-X27LE4BHSL4DOUIK - [0:0]
        -A KUBE-SERVICES -m comment --comment "ns1/svc1:p80 cluster IP" -m tcp -p tcp -d 172.30.0.41 --dport 80 -j KUBE-SVC-XPGD46QRK7WJZT7O
        -A KUBE-SERVICES -m comment --comment "ns2/svc2:p8080 cluster IP" -m tcp -p tcp -d 172.30.0.42 --dport 8080 -j KUBE-SVC-2VJB64SDSIJUP5T6
        -A KUBE-SERVICES -m comment --comment "ns3/svc3:p80 cluster IP" -m tcp -p tcp -d 172.30.0.43 --dport 80 -j KUBE-SVC-X27LE4BHSL4DOUIK
        -A KUBE-SERVICES -m comment --comment "kubernetes service nodeports; NOTE: this must be the last rule in this chain" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS
        -A KUBE-SEP-BSWRHOQ77KEXZLNL -m comment --comment ns3/svc3:p80 -s 10.0.3.1 -j KUBE-MARK-MASQ
        -A KUBE-SEP-BSWRHOQ77KEXZLNL -m comment --comment ns3/svc3:p80 -m tcp -p tcp -j DNAT --to-destination 10.0.3.1:80
        -A KUBE-SVC-X27LE4BHSL4DOUIK -m comment --comment "ns3/svc3:p80 cluster IP" -m tcp -p tcp -d 172.30.0.43 --dport 80 ! -s 10.0.0.0/8 -j KUBE-MARK-MASQ
        -A KUBE-SVC-X27LE4BHSL4DOUIK -m comment --comment "ns3/svc3:p80 -> 10.0.3.1:80" -j KUBE-SEP-BSWRHOQ77KEXZLNL
        COMMIT
        "#,
        report.payload.as_deref().expect("recorded"),
    );

    // Delete svc2: its KUBE-SERVICES rule goes and its chains are flushed and deleted.
    fp.delete_service(&svc2);
    let report = fp.sync();
    crate::support::assert_rules_eq(
        r#"
        *filter
        COMMIT
        *nat
        :KUBE-SERVICES - [0:0]
        :KUBE-SEP-UHEGFW77JX3KXTOV - [0:0]
        :KUBE-SVC-2VJB64SDSIJUP5T6 - [0:0]
        -A KUBE-SERVICES -m comment --comment "ns1/svc1:p80 cluster IP" -m tcp -p tcp -d 172.30.0.41 --dport 80 -j KUBE-SVC-XPGD46QRK7WJZT7O
        -A KUBE-SERVICES -m comment --comment "ns3/svc3:p80 cluster IP" -m tcp -p tcp -d 172.30.0.43 --dport 80 -j KUBE-SVC-X27LE4BHSL4DOUIK
        -A KUBE-SERVICES -m comment --comment "kubernetes service nodeports; NOTE: this must be the last rule in this chain" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS
        -X KUBE-SEP-UHEGFW77JX3KXTOV
        -X KUBE-SVC-2VJB64SDSIJUP5T6
        COMMIT
        "#,
        report.payload.as_deref().expect("recorded"),
    );
    assert_eq!(report.stats.deleted_chains, 2);
    assert!(fp.ipt.rules(Table::Nat, "KUBE-SVC-2VJB64SDSIJUP5T6").is_none());

    // A sync with no changes writes nothing but the table headers.
    let report = fp.sync();
    crate::support::assert_rules_eq("*filter\nCOMMIT\n*nat\nCOMMIT\n", report.payload.as_deref().expect("recorded"));
}

/// Upstream's absurd-but-possible case: a partial restore that fails (here, someone added a
/// jump into a chain we delete) makes the next sync full, which succeeds.
#[test]
fn failed_partial_sync_forces_a_full_resync() {
    let mut fp = TestProxier::new(IpFamily::V4);
    let svc3 = svc("ns3", "svc3").type_("ClusterIP").bare_cluster_ip("172.30.0.43").tcp("p80", 80).build();
    let svc4 = svc("ns4", "svc4").type_("ClusterIP").bare_cluster_ip("172.30.0.44").tcp("p80", 80).build();
    fp.add_services(&[svc3, svc4.clone()]);
    fp.add_slices(&[
        slice("ns3", "svc3", "svc3-1")
            .tcp("p80", 80)
            .endpoint(kube_proxy_rs::tracker::testing::bare_ep("10.0.3.1"))
            .build(),
        slice("ns4", "svc4", "svc4-1")
            .tcp("p80", 80)
            .endpoint(kube_proxy_rs::tracker::testing::bare_ep("10.0.4.1"))
            .build(),
    ]);
    fp.sync();
    let svc4_sep = fp
        .ipt
        .chains(Table::Nat)
        .into_iter()
        .find(|c| {
            c.starts_with("KUBE-SEP-")
                && fp.ipt.rules(Table::Nat, c).is_some_and(|r| r.iter().any(|l| l.contains("10.0.4.1")))
        })
        .expect("svc4 endpoint chain");
    use kube_proxy_rs::iptables::{Iptables, RulePosition};
    fp.ipt
        .ensure_rule(RulePosition::Append, Table::Nat, "KUBE-SVC-X27LE4BHSL4DOUIK", &["-j", &svc4_sep])
        .expect("ensure rule");

    fp.delete_service(&svc4);
    let now = std::time::Instant::now() + std::time::Duration::from_secs(3600);
    match fp.proxier.sync(now) {
        kube_proxy_rs::proxier::SyncOutcome::Synced(report) => {
            assert!(!report.full);
            assert!(report.result.is_err(), "partial restore should fail");
            assert_eq!(report.retry_after, Some(std::time::Duration::from_secs(30)));
        }
        other => panic!("unexpected {other:?}"),
    }
    let report = fp.sync();
    assert!(report.full, "the sync after a failure must be full");
    assert!(fp.ipt.rules(Table::Nat, &svc4_sep).is_none(), "stale chain deleted by the full resync");
}

/// A service with two endpoints and one with `big_endpoints`, each with its slice.
fn small_and_big(big_endpoints: u32) -> (Service, EndpointSlice, Service, EndpointSlice) {
    let small = svc("ns1", "small").cluster_ip("172.30.0.1").tcp("p80", 80).build();
    let small_eps = slice("ns1", "small", "small-1").tcp("p80", 80).ips(&["10.1.0.1", "10.1.0.2"]).build();
    let big = svc("ns2", "big").cluster_ip("172.30.0.2").tcp("p80", 80).build();
    let mut big_eps = slice("ns2", "big", "big-1").tcp("p80", 80);
    for n in 0..big_endpoints {
        big_eps = big_eps.endpoint(ep(&format!("10.2.{}.{}", n / 250, n % 250 + 1)));
    }
    (small, small_eps, big, big_eps.build())
}

/// Crossing the large-cluster threshold changes every endpoint rule's comments; the partial
/// sync that crosses it rewrites every service so the result still equals a full sync.
#[test]
fn crossing_the_large_cluster_threshold_rewrites_everything() {
    let (small, small_eps, big, big_eps) = small_and_big(1000);

    let mut fp = TestProxier::new(IpFamily::V4);
    fp.add_services(&[small.clone(), big.clone()]);
    fp.add_slices(std::slice::from_ref(&small_eps));
    assert!(!fp.sync().stats.large_cluster_mode);

    fp.add_slices(std::slice::from_ref(&big_eps));
    let report = fp.sync();
    assert!(!report.full);
    assert!(report.stats.large_cluster_mode);
    let mut reference = TestProxier::new(IpFamily::V4);
    reference.add_services(&[small.clone(), big.clone()]);
    reference.add_slices(&[small_eps.clone(), big_eps.clone()]);
    reference.sync();
    assert_eq!(fp.ipt.save_all(), reference.ipt.save_all());
    assert!(!fp.ipt.save_all().contains("ns1/small:p80 -> 10.1.0.1:80"), "comments dropped in large mode");

    fp.delete_slice(&big_eps);
    let report = fp.sync();
    assert!(!report.stats.large_cluster_mode);
    let mut reference = TestProxier::new(IpFamily::V4);
    reference.add_services(&[small, big]);
    reference.add_slices(&[small_eps]);
    reference.sync();
    assert_eq!(fp.ipt.save_all(), reference.ipt.save_all());
}

/// The rule totals reported for metrics count what is in the kernel, whether or not a
/// partial sync rewrote it.
#[test]
fn rule_totals_count_chains_not_rewritten() {
    let count = |fp: &TestProxier, table: Table| -> usize {
        fp.ipt
            .chains(table)
            .iter()
            .filter(|c| c.starts_with("KUBE-") && *c != "KUBE-PROXY-CANARY")
            .map(|c| fp.ipt.rules(table, c).map_or(0, |r| r.len()))
            .sum()
    };
    let mut fp = TestProxier::new(IpFamily::V4);
    let a = svc("ns1", "a").cluster_ip("172.30.0.1").tcp("p80", 80).build();
    let b = svc("ns1", "b").cluster_ip("172.30.0.2").tcp("p80", 80).build();
    fp.add_services(&[a, b]);
    fp.add_slices(&[slice("ns1", "a", "a-1").tcp("p80", 80).ips(&["10.1.0.1", "10.1.0.2"]).build()]);
    let full = fp.sync();
    assert_eq!(full.stats.nat_rules_total, count(&fp, Table::Nat));
    assert_eq!(full.stats.filter_rules_total, count(&fp, Table::Filter));

    fp.add_slices(&[slice("ns1", "a", "a-1").tcp("p80", 80).ips(&["10.1.0.1", "10.1.0.3", "10.1.0.4"]).build()]);
    let partial = fp.sync();
    assert!(!partial.full);
    assert!(partial.stats.nat_rules < partial.stats.nat_rules_total);
    assert_eq!(partial.stats.nat_rules_total, count(&fp, Table::Nat));
    assert_eq!(partial.stats.filter_rules_total, count(&fp, Table::Filter));
}

/// Stale chains are found without reading the ruleset in steady state: the kernel's chain
/// names are listed once (at the first sync, after a failed restore, after a forced resync),
/// then the proxier follows what it wrote. Below the large-cluster threshold every sync
/// deletes stale chains; above it, at most once per sync period (upstream's cadence).
#[test]
fn stale_chains_are_cleaned_up_without_reading_the_ruleset_each_sync() {
    let reads = |fp: &TestProxier| {
        fp.ipt.calls().iter().filter(|c| c.starts_with("list_chains nat") || c.starts_with("save_into")).count()
    };
    let saves = |fp: &TestProxier| fp.ipt.calls().iter().filter(|c| c.starts_with("save_into")).count();
    let sync_at = |fp: &mut TestProxier, now: std::time::Instant| match fp.proxier.sync(now) {
        kube_proxy_rs::proxier::SyncOutcome::Synced(r) => {
            assert!(r.result.is_ok(), "{:?}", r.result);
            r.payload.expect("recorded")
        }
        other => panic!("{other:?}"),
    };
    let start = std::time::Instant::now();
    let second = std::time::Duration::from_secs(1);

    let mut small = TestProxier::new(IpFamily::V4);
    // Left by an earlier process: one of our names and one we would never generate.
    small
        .ipt
        .seed(b"*nat\n:KUBE-SVC-AAAAAAAAAAAAAAAA - [0:0]\n:KUBE-SEP-handmade - [0:0]\n:OTHER - [0:0]\nCOMMIT\n")
        .expect("seed");
    let a = svc("ns1", "a").cluster_ip("172.30.0.1").tcp("p80", 80).build();
    small.add_services(&[a]);
    small.add_slices(&[slice("ns1", "a", "a-1").tcp("p80", 80).ips(&["10.1.0.1"]).build()]);
    let first = sync_at(&mut small, start);
    assert!(first.contains("-X KUBE-SVC-AAAAAAAAAAAAAAAA\n") && first.contains("-X KUBE-SEP-handmade\n"), "{first}");
    assert!(!first.contains("-X OTHER"), "only our chains are cleaned up");
    assert_eq!(reads(&small), 1);
    let sep: String = small.ipt.chains(Table::Nat).into_iter().find(|c| c.starts_with("KUBE-SEP-")).expect("sep");
    // The endpoint goes: its chain is deleted at the next sync, from what the proxier knows.
    small.add_slices(&[slice("ns1", "a", "a-1").tcp("p80", 80).ips(&["10.1.0.2"]).build()]);
    let second_payload = sync_at(&mut small, start + second);
    assert!(second_payload.contains(&format!("-X {sep}\n")), "{second_payload}");
    for i in 2..5u32 {
        sync_at(&mut small, start + second * i);
    }
    assert_eq!(reads(&small), 1, "no read of the kernel in steady state");
    // A forced resync (our rules were flushed from outside) reads the chain names again.
    small.proxier.force_full_sync();
    sync_at(&mut small, start + second * 6);
    assert_eq!(reads(&small), 2);
    // So does the sync after a failed restore.
    small.ipt.fail_next_restore(kube_proxy_rs::iptables::IptablesError::Lock("test".into()));
    small.add_services(&[svc("ns1", "b").cluster_ip("172.30.0.2").tcp("p80", 80).build()]);
    match small.proxier.sync(start + second * 7) {
        kube_proxy_rs::proxier::SyncOutcome::Synced(r) => assert!(r.result.is_err()),
        other => panic!("{other:?}"),
    }
    sync_at(&mut small, start + second * 8);
    assert_eq!(reads(&small), 3);
    assert_eq!(saves(&small), 0, "the fake lists chain names; iptables-save is never read");
    assert!(
        small.ipt.chains(Table::Nat).iter().filter(|c| c.starts_with("KUBE-SEP-")).count() == 1,
        "{:?}",
        small.ipt.chains(Table::Nat)
    );

    let mut large = TestProxier::new(IpFamily::V4);
    large.add_services(&[svc("ns1", "big").cluster_ip("172.30.0.2").tcp("p80", 80).build()]);
    let big_slice = |first: u32| {
        let mut s = slice("ns1", "big", "big-1").tcp("p80", 80);
        for n in first..first + 1001 {
            s = s.endpoint(ep(&format!("10.2.{}.{}", n / 250, n % 250 + 1)));
        }
        s.build()
    };
    large.add_slices(&[big_slice(0)]);
    sync_at(&mut large, start);
    assert_eq!(reads(&large), 1);
    // One endpoint replaced: its old chain stays until a sync period has passed.
    large.add_slices(&[big_slice(1)]);
    let payload = sync_at(&mut large, start + second);
    assert!(!payload.contains("-X "), "within one sync period (30s) no cleanup");
    sync_at(&mut large, start + second * 2);
    let payload = sync_at(&mut large, start + second * 40);
    assert_eq!(payload.matches("-X KUBE-SEP-").count(), 1, "after a sync period the stale chain goes");
    assert_eq!(reads(&large), 1, "still without reading the kernel");
}

/// After a successful sync the proxier clears the conntrack entries of UDP endpoints that
/// went away, and of services that got their first endpoint (upstream CleanStaleEntries).
#[test]
fn successful_syncs_clear_stale_udp_conntrack_entries() {
    use kube_proxy_rs::node::conntrack::FakeConntrack;
    let ct = std::sync::Arc::new(FakeConntrack::new());
    let mut fp = TestProxier::new(IpFamily::V4).with_conntrack(ct.clone());
    let dns = svc("kube-system", "dns").cluster_ip("172.30.0.10").udp("dns", 53).build();
    fp.add_services(&[dns]);
    fp.sync();
    assert!(ct.command_lines().is_empty(), "no endpoints yet: {:?}", ct.command_lines());

    // First endpoint: entries cached against the REJECT must go.
    fp.add_slices(&[slice("kube-system", "dns", "dns-1").udp("dns", 5353).ips(&["10.1.0.1", "10.1.0.2"]).build()]);
    fp.sync();
    assert_eq!(ct.command_lines(), ["conntrack -D --orig-dst 172.30.0.10 -p udp"]);

    // One endpoint removed: its flows through the cluster IP go.
    fp.add_slices(&[slice("kube-system", "dns", "dns-1").udp("dns", 5353).ips(&["10.1.0.2"]).build()]);
    fp.sync();
    assert_eq!(ct.command_lines()[1..], ["conntrack -D --orig-dst 172.30.0.10 --dst-nat 10.1.0.1 -p udp".to_string()]);
    // 1.29 never lists the table (the reconciler is 1.32's).
    assert!(ct.listings().is_empty() && ct.entry_deletions().is_empty(), "{:?}", ct.listings());
    assert_eq!(fp.last_reconcile(), None);
}

/// From 1.32 the per-change deletions are gone: after a successful sync in which a Service
/// with a UDP port had endpoint changes (upstream `ConntrackCleanupRequired`), the proxier
/// lists the family's UDP entries and deletes those that no serving endpoint answers.
#[test]
fn from_1_32_udp_endpoint_changes_run_the_conntrack_reconciler() {
    use kube_proxy_rs::model::Protocol;
    use kube_proxy_rs::node::conntrack::{ConntrackEntry, FakeConntrack};
    let client = "10.0.5.5".parse().unwrap();
    let entry = |protocol, dst: &str, reply_src: &str| {
        ConntrackEntry::new(
            protocol,
            (client, 40000),
            (dst.parse().unwrap(), 53),
            (reply_src.parse().unwrap(), 5353),
            (client, 40000),
        )
    };
    let live = entry(Protocol::Udp, "172.30.0.10", "10.1.0.1");
    // Another client port: the table holds one entry per original tuple.
    let stale =
        ConntrackEntry { orig_sport: 40001, reply_dport: 40001, ..entry(Protocol::Udp, "172.30.0.10", "10.1.0.9") };
    let tcp = entry(Protocol::Tcp, "172.30.0.11", "10.1.0.9");

    let ct = std::sync::Arc::new(FakeConntrack::new());
    ct.set_entries(vec![live, stale, tcp]);
    let mut fp = TestProxier::with_release(IpFamily::V4, Release::V1_35).with_conntrack(ct.clone());
    let dns = svc("kube-system", "dns").cluster_ip("172.30.0.10").udp("dns", 53).build();
    let web = svc("kube-system", "web").cluster_ip("172.30.0.11").tcp("dns", 53).build();
    fp.add_services(&[dns, web]);
    fp.sync();
    assert!(ct.listings().is_empty(), "no endpoint changed: nothing to reconcile");
    assert_eq!(fp.last_reconcile(), None);

    fp.add_slices(&[slice("kube-system", "dns", "dns-1").udp("dns", 5353).ips(&["10.1.0.1", "10.1.0.2"]).build()]);
    fp.sync();
    assert_eq!(ct.listings(), [(IpFamily::V4, Protocol::Udp)]);
    // Exactly the stale entry, in one batch.
    assert_eq!(ct.entry_deletions(), [vec![stale]]);
    assert_eq!(ct.entries(), [live, tcp]);
    assert_eq!(fp.last_reconcile().map(|r| r.deleted), Some(1));
    assert!(ct.command_lines().is_empty(), "no 1.29 deletions: {:?}", ct.command_lines());

    // Endpoint changes of a TCP-only Service, or none at all, do not run it.
    fp.add_slices(&[slice("kube-system", "web", "web-1").tcp("dns", 8053).ips(&["10.1.0.3"]).build()]);
    fp.sync();
    assert_eq!(fp.last_reconcile(), None);
    fp.sync();
    assert_eq!(fp.last_reconcile(), None);
    assert_eq!(ct.listings().len(), 1);

    // Losing every endpoint is an endpoint change too: it runs, and (as upstream) leaves the
    // Service's entries alone because it has no serving endpoint.
    ct.set_entries(vec![live]);
    fp.add_slices(&[slice("kube-system", "dns", "dns-1").udp("dns", 5353).ips(&[]).build()]);
    fp.sync();
    assert_eq!(ct.listings().len(), 2);
    assert_eq!(ct.entries(), [live]);
    assert_eq!(fp.last_reconcile().map(|r| r.deleted), Some(0));
}

/// A partial render reuses a service's entries in the top-level chains from the last sync
/// only while what they depend on besides the service itself is unchanged: here the
/// accounting objects the rules may name (KUBE-NODEPORTS entries count loopback traffic when
/// one exists). Two partial renders, so the second has memoized entries to reuse.
#[test]
fn reused_entries_follow_the_inputs_they_depend_on() {
    use std::collections::HashSet;

    use kube_proxy_rs::node::nfacct::NfacctCounters;
    use kube_proxy_rs::proxier::render::{self, RenderInput, RenderState};
    use kube_proxy_rs::synthetic::{self, ClusterShape};
    use kube_proxy_rs::tracker::{EndpointChangeTracker, EndpointsMap, ServiceChangeTracker, ServicePortMap};

    let cluster = synthetic::cluster(ClusterShape::new(40, 2));
    let features = kube_proxy_rs::compat::Features::of(Release::V1_29);
    let mut svc_tracker = ServiceChangeTracker::new(IpFamily::V4, features);
    let mut ep_tracker = EndpointChangeTracker::new(synthetic::NODE_NAME.to_string(), IpFamily::V4);
    for s in &cluster.services {
        svc_tracker.update(None, Some(s));
    }
    for s in &cluster.slices {
        ep_tracker.endpoint_slice_update(s, false);
    }
    let (mut services, mut endpoints) = (ServicePortMap::default(), EndpointsMap::default());
    services.update(&mut svc_tracker);
    endpoints.update(&mut ep_tracker);

    let cfg = crate::support::harness::upstream_render_config(IpFamily::V4);
    let labels = BTreeMap::new();
    let nothing_changed = HashSet::new();
    let input = |changed, nfacct| RenderInput {
        services: &services,
        endpoints: &endpoints,
        node_labels: &labels,
        interface_addrs: &[],
        changed,
        existing_nat_chains: None,
        nfacct,
    };
    let counting = NfacctCounters { ct_state_invalid_dropped: false, localhost_nodeports_accepted: true };
    let nodeports = |payload: &str| {
        let nat = payload.split("*nat").nth(1).unwrap_or_default().to_string();
        nat.lines().filter(|l| l.starts_with("-A KUBE-NODEPORTS ")).map(str::to_owned).collect::<Vec<_>>()
    };

    let mut state = RenderState::default();
    let full = render::render(&cfg, &input(None, NfacctCounters::default()), &state);
    state.commit(full.into_outcome());
    for _ in 0..2 {
        let partial = render::render(&cfg, &input(Some(&nothing_changed), NfacctCounters::default()), &state);
        assert_eq!(partial.stats.nat_chains, 0, "nothing changed, nothing written:\n{}", partial.payload());
        state.commit(partial.into_outcome());
    }

    let partial = render::render(&cfg, &input(Some(&nothing_changed), counting), &state);
    let want = render::render(&cfg, &input(None, counting), &RenderState::default());
    let (got, want) = (nodeports(&partial.payload()), nodeports(&want.payload()));
    assert!(want.iter().any(|l| l.contains("--nfacct-name")), "the cluster has node ports: {want:?}");
    assert_eq!(got, want, "KUBE-NODEPORTS after the accounting object appeared");
}

/// A partial sync's work follows the change, not the cluster: once the first partial sync
/// after a full one has kept every service's entries, the next computes only the service
/// that changed (and still writes the same state as a full sync). In large-cluster mode, as
/// at scale: below it every sync looks for stale chains, and those compute every service.
#[test]
fn partial_syncs_compute_only_changed_services() {
    let mut fp = TestProxier::new(IpFamily::V4);
    let big = svc("big", "big").bare_cluster_ip("172.31.0.1").tcp("p80", 80).build();
    let mut big_slice = slice("big", "big", "big-1").tcp("p80", 80);
    for n in 0..1001u32 {
        big_slice = big_slice.endpoint(ep(&format!("10.250.{}.{}", n / 250, n % 250 + 1)));
    }
    let big_slice = big_slice.build();
    fp.add_services(std::slice::from_ref(&big));
    fp.add_slices(std::slice::from_ref(&big_slice));
    let services: Vec<Service> = (0..20u8)
        .map(|i| {
            svc("ns", &format!("svc{i}"))
                .type_("NodePort")
                .bare_cluster_ip(&format!("172.30.1.{i}"))
                .tcp("p80", 80)
                .build()
        })
        .collect();
    fp.add_services(&services);
    let slices: Vec<EndpointSlice> = (0..20u8)
        .map(|i| {
            slice("ns", &format!("svc{i}"), &format!("svc{i}-1"))
                .tcp("p80", 80)
                .endpoint(kube_proxy_rs::tracker::testing::bare_ep(&format!("10.0.1.{i}")))
                .build()
        })
        .collect();
    fp.add_slices(&slices);
    let full = fp.sync();
    assert!(full.full && full.stats.large_cluster_mode);
    assert_eq!(full.stats.services_computed, 21);

    let replace_endpoint = |fp: &mut TestProxier, i: u8, last: u8| {
        fp.add_slices(&[slice("ns", &format!("svc{i}"), &format!("svc{i}-1"))
            .tcp("p80", 80)
            .endpoint(kube_proxy_rs::tracker::testing::bare_ep(&format!("10.0.2.{last}")))
            .build()]);
    };
    // A second apart, as changes arrive: these syncs do not look for stale chains.
    let soon = Duration::from_secs(1);
    replace_endpoint(&mut fp, 3, 1);
    let first = fp.sync_after(soon);
    assert!(!first.full);
    assert_eq!(first.stats.services_computed, 21, "the first partial sync after a full one keeps every entry");
    replace_endpoint(&mut fp, 7, 2);
    let second = fp.sync_after(soon);
    assert_eq!(second.stats.services_computed, 1, "only svc7 changed");
    let third = fp.sync_after(soon);
    assert_eq!(third.stats.services_computed, 0, "nothing changed");
    assert_eq!(third.stats.nat_chains, 0, "{:?}", third.payload);

    let mut reference = TestProxier::new(IpFamily::V4);
    reference.add_services(&[big]);
    reference.add_slices(&[big_slice]);
    reference.add_services(&services);
    let mut want_slices = slices.clone();
    for (i, last) in [(3u8, 1u8), (7, 2)] {
        want_slices[usize::from(i)] = slice("ns", &format!("svc{i}"), &format!("svc{i}-1"))
            .tcp("p80", 80)
            .endpoint(kube_proxy_rs::tracker::testing::bare_ep(&format!("10.0.2.{last}")))
            .build();
    }
    reference.add_slices(&want_slices);
    reference.sync();
    assert_eq!(
        without_unreferenced_service_chains(&fp.ipt.save_all()),
        without_unreferenced_service_chains(&reference.ipt.save_all())
    );
    // A sync period later, the stale chains are gone too.
    fp.sync();
    assert_eq!(fp.ipt.save_all(), reference.ipt.save_all());
}

/// From 1.33 a sync is full again once the last full sync is an hour old (upstream's
/// `FullSyncPeriod`), which repairs rules changed from outside without a restart; from 1.34
/// (the newest patch releases) not in large-cluster mode, where it would rewrite every rule
/// for nothing. Partial syncs in between do not move the hour.
#[test]
fn periodic_full_sync_follows_the_release() {
    use kube_proxy_rs::iptables::{Iptables, RulePosition};
    let release = |r: &str| r.parse::<Release>().expect("release");
    let (small, small_eps, big, big_eps) = small_and_big(1001);
    let rogue = ["-s", "203.0.113.9/32", "-j", "RETURN"];
    let has_rogue = |fp: &TestProxier| {
        fp.ipt.rules(Table::Nat, "KUBE-SERVICES").unwrap_or_default().iter().any(|r| r.contains("203.0.113.9"))
    };

    for (version, large, full_after_an_hour) in [
        ("1.29", false, false),
        ("1.32", false, false),
        ("1.33", false, true),
        ("1.33", true, true),
        ("1.34", false, true),
        ("1.34", true, false),
        ("1.35", false, true),
        ("1.35", true, false),
    ] {
        let case = format!("{version}, large-cluster mode {large}");
        let mut fp = TestProxier::with_release(IpFamily::V4, release(version));
        fp.add_services(&[small.clone(), big.clone()]);
        fp.add_slices(std::slice::from_ref(&small_eps));
        if large {
            fp.add_slices(std::slice::from_ref(&big_eps));
        }
        let first = fp.sync();
        assert!(first.full, "{case}");
        assert_eq!(first.stats.large_cluster_mode, large, "{case}");
        // Someone adds a rule to one of our chains; partial syncs leave it alone.
        fp.ipt.ensure_rule(RulePosition::Append, Table::Nat, "KUBE-SERVICES", &rogue).expect("rogue rule");
        assert!(!fp.sync_after(Duration::from_secs(59 * 60)).full, "{case}: 59 minutes after the full sync");
        assert!(has_rogue(&fp), "{case}");
        let later = fp.sync_after(Duration::from_secs(2 * 60));
        assert_eq!(later.full, full_after_an_hour, "{case}: 61 minutes after the full sync");
        assert_eq!(has_rogue(&fp), !full_after_an_hour, "{case}: a full sync rewrites KUBE-SERVICES");
        // The hour starts again from the sync that was full.
        assert!(!fp.sync_after(Duration::from_secs(31)).full, "{case}: right after");
    }
}
