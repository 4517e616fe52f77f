//! nftables mode, release by release: each difference between upstream's nftables proxiers of
//! 1.31 to 1.37 (docs/upstream-versions.md, "nftables mode"), and the settings upstream's
//! fixtures do not cover (IPv6, masqueradeAll, no local-traffic detector, nodePortAddresses
//! matching every address, interface detectors), checked on the table one sync leaves.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use kube_proxy_rs::compat::Release;
use kube_proxy_rs::model::IpFamily;
use kube_proxy_rs::nftables::fake::FakeNftables;
use kube_proxy_rs::nftables::{Family, NftError, Nftables, Operation, TableState, Transaction, sort_dump};
use kube_proxy_rs::proxier::StaticInterfaces;
use kube_proxy_rs::proxier::nftables::NftSyncOutcome;
use kube_proxy_rs::proxier::nftables::NftablesProxier;
use kube_proxy_rs::tracker::testing::{ep, slice, svc};

use crate::support::harness::TEST_NODE_NAME;
use crate::support::nft::{FakeSettings, NftTestProxier};

fn r(v: &str) -> Release {
    v.parse().unwrap_or_else(|_| match v {
        "1.36" => Release::V1_36,
        "1.37" => Release::V1_37,
        _ => panic!("release {v}"),
    })
}

/// A ClusterIP service with one local endpoint, and a LoadBalancer with a local endpoint
/// and session affinity, synced once.
fn table(settings: &FakeSettings, release: Release) -> String {
    let v6 = settings.family == IpFamily::V6;
    let (cip1, cip2, ep1, ep2, lb) = if v6 {
        ("fd00:30::1", "fd00:30::2", "fd00:10::1", "fd00:10::2", "fd00:99::1")
    } else {
        ("172.30.0.41", "172.30.0.42", "10.180.0.1", "10.180.0.2", "5.6.7.8")
    };
    let mut fp = NftTestProxier::new(settings, release);
    fp.add_services(&[
        svc("ns1", "svc1").cluster_ip(cip1).tcp("p80", 80).build(),
        svc("ns2", "svc2")
            .type_("LoadBalancer")
            .cluster_ip(cip2)
            .node_port("p80", 80, 3001)
            .lb_ingress(&[lb])
            .affinity(Some(600))
            .build(),
    ]);
    let mut s1 = slice("ns1", "svc1", "svc1-1").tcp("p80", 80).endpoint(ep(ep1).node(TEST_NODE_NAME));
    let mut s2 = slice("ns2", "svc2", "svc2-1").tcp("p80", 80).endpoint(ep(ep2).node(TEST_NODE_NAME));
    if v6 {
        s1 = s1.ipv6();
        s2 = s2.ipv6();
    }
    fp.add_slices(&[s1.build(), s2.build()]);
    fp.sync();
    fp.nft.dump()
}

#[track_caller]
fn has(table: &str, line: &str) {
    assert!(table.lines().any(|l| l == line), "missing {line:?} in:\n{table}");
}

#[track_caller]
fn lacks(table: &str, needle: &str) {
    assert!(!table.contains(needle), "unexpected {needle:?} in:\n{table}");
}

#[test]
fn nftables_filter_base_chains_move_before_dnat_in_1_34() {
    let v4 = FakeSettings::upstream(IpFamily::V4);
    for release in ["1.31", "1.32", "1.33"].map(r) {
        let t = table(&v4, release);
        has(&t, "add chain ip kube-proxy filter-prerouting { type filter hook prerouting priority -110 ; }");
        has(&t, "add chain ip kube-proxy filter-input { type filter hook input priority -110 ; }");
        has(&t, "add chain ip kube-proxy filter-output-post-dnat { type filter hook output priority -90 ; }");
        has(&t, "add rule ip kube-proxy filter-output-post-dnat ct state new jump cluster-ips-check");
        has(&t, "add rule ip kube-proxy filter-prerouting ct state new jump firewall-check");
        lacks(&t, "pre-dnat");
    }
    for release in ["1.34", "1.35", "1.36", "1.37"].map(r) {
        let t = table(&v4, release);
        has(&t, "add chain ip kube-proxy filter-prerouting-pre-dnat { type filter hook prerouting priority -110 ; }");
        has(&t, "add chain ip kube-proxy filter-output-pre-dnat { type filter hook output priority -110 ; }");
        has(&t, "add chain ip kube-proxy filter-input { type filter hook input priority 0 ; }");
        has(&t, "add rule ip kube-proxy filter-output ct state new jump cluster-ips-check");
        lacks(&t, "post-dnat");
        lacks(&t, "filter-prerouting {");
    }
}

#[test]
fn nftables_cluster_ip_masquerade_rule_per_release() {
    let v4 = FakeSettings::upstream(IpFamily::V4);
    let chain = "add rule ip kube-proxy service-ULMVA6XW-ns1/svc1/tcp/p80";
    for release in ["1.31", "1.32", "1.33"].map(r) {
        has(
            &table(&v4, release),
            &format!("{chain} ip daddr 172.30.0.41 tcp dport 80 ip saddr != 10.0.0.0/8 jump mark-for-masquerade"),
        );
    }
    for release in ["1.34", "1.35"].map(r) {
        has(
            &table(&v4, release),
            &format!("{chain} ip daddr 172.30.0.41 ip saddr != 10.0.0.0/8 jump mark-for-masquerade"),
        );
    }
    for release in ["1.36", "1.37"].map(r) {
        let t = table(&v4, release);
        lacks(&t, "mark-for-masquerade");
        has(
            &t,
            "add rule ip kube-proxy services ip daddr @cluster-ips ip saddr != 10.0.0.0/8 mark set mark or 0x4000 comment \"masquerade clusterIP traffic from outside cluster\"",
        );
    }
    // masqueradeAll, and no detector.
    let mut all = v4.clone();
    all.masquerade_all = true;
    has(&table(&all, r("1.33")), &format!("{chain} ip daddr 172.30.0.41 tcp dport 80 jump mark-for-masquerade"));
    has(&table(&all, r("1.35")), &format!("{chain} ip daddr 172.30.0.41 jump mark-for-masquerade"));
    has(
        &table(&all, r("1.36")),
        "add rule ip kube-proxy services ip daddr @cluster-ips mark set mark or 0x4000 comment \"masquerade all clusterIP traffic\"",
    );
    let mut none = v4.clone();
    none.detect_local = false;
    for release in Release::nftables_all() {
        let t = table(&none, release);
        lacks(&t, "ip daddr 172.30.0.41");
        lacks(&t, "masquerade clusterIP traffic");
    }
}

#[test]
fn nftables_masquerading_and_hairpin_per_release() {
    let v4 = FakeSettings::upstream(IpFamily::V4);
    for release in ["1.31", "1.35"].map(r) {
        let t = table(&v4, release);
        has(&t, "add rule ip kube-proxy mark-for-masquerade mark set mark or 0x4000");
        has(&t, "add rule ip kube-proxy masquerading mark and 0x4000 == 0 return");
        has(&t, "add rule ip kube-proxy masquerading mark set mark xor 0x4000");
        has(&t, "add rule ip kube-proxy masquerading masquerade fully-random");
        // Hairpin traffic is masqueraded by each endpoint chain.
        has(
            &t,
            "add rule ip kube-proxy endpoint-5OJB2KTY-ns1/svc1/tcp/p80__10.180.0.1/80 ip saddr 10.180.0.1 jump mark-for-masquerade",
        );
        lacks(&t, "hairpin-connections");
    }
    for release in ["1.36", "1.37"].map(r) {
        let t = table(&v4, release);
        has(
            &t,
            "add rule ip kube-proxy masquerading mark and 0x4000 != 0 mark set mark xor 0x4000 masquerade fully-random",
        );
        has(
            &t,
            "add rule ip kube-proxy masquerading ct status dnat ip saddr . ip daddr . meta l4proto . th dport @hairpin-connections masquerade fully-random",
        );
        has(
            &t,
            "add set ip kube-proxy hairpin-connections { type ipv4_addr . ipv4_addr . inet_proto . inet_service ; comment \"service hairpin connections\" ; }",
        );
        has(&t, "add element ip kube-proxy hairpin-connections { 10.180.0.1 . 10.180.0.1 . tcp . 80 }");
        has(&t, "add element ip kube-proxy hairpin-connections { 10.180.0.2 . 10.180.0.2 . tcp . 80 }");
    }
}

#[test]
fn nftables_dnat_maps_and_endpoint_chains_per_release() {
    let v4 = FakeSettings::upstream(IpFamily::V4);
    let t = table(&v4, r("1.35"));
    has(
        &t,
        "add rule ip kube-proxy service-ULMVA6XW-ns1/svc1/tcp/p80 numgen random mod 1 vmap { 0 : goto endpoint-5OJB2KTY-ns1/svc1/tcp/p80__10.180.0.1/80 }",
    );
    has(
        &t,
        "add rule ip kube-proxy endpoint-5OJB2KTY-ns1/svc1/tcp/p80__10.180.0.1/80 meta l4proto tcp dnat to 10.180.0.1:80",
    );
    for release in ["1.36", "1.37"].map(r) {
        let t = table(&v4, release);
        has(
            &t,
            "add rule ip kube-proxy service-ULMVA6XW-ns1/svc1/tcp/p80 meta l4proto tcp dnat ip addr . port to numgen random mod 1 map { 0 : 10.180.0.1 . 80 }",
        );
        lacks(&t, "endpoint-5OJB2KTY");
        // With ClientIP affinity the endpoint chains stay, without the hairpin rule.
        let svc2 = "service-42NFTM6N-ns2/svc2/tcp/p80";
        let ep2 = "endpoint-SGOXE6O3-ns2/svc2/tcp/p80__10.180.0.2/80";
        has(
            &t,
            &format!(
                "add rule ip kube-proxy {svc2} ip saddr @affinity-SGOXE6O3-ns2/svc2/tcp/p80__10.180.0.2/80 goto {ep2}"
            ),
        );
        has(&t, &format!("add rule ip kube-proxy {svc2} numgen random mod 1 vmap {{ 0 : goto {ep2} }}"));
        has(
            &t,
            &format!(
                "add rule ip kube-proxy {ep2} update @affinity-SGOXE6O3-ns2/svc2/tcp/p80__10.180.0.2/80 {{ ip saddr }}"
            ),
        );
        has(&t, &format!("add rule ip kube-proxy {ep2} meta l4proto tcp dnat to 10.180.0.2:80"));
        has(
            &t,
            "add set ip kube-proxy affinity-SGOXE6O3-ns2/svc2/tcp/p80__10.180.0.2/80 { type ipv4_addr ; flags dynamic,timeout ; timeout 600s ; }",
        );
        has(
            &t,
            "add rule ip kube-proxy external-42NFTM6N-ns2/svc2/tcp/p80 mark set mark or 0x4000 comment \"masquerade\"",
        );
    }
}

#[test]
fn nftables_ipv6_and_match_all_node_ports() {
    let mut v6 = FakeSettings::upstream(IpFamily::V6);
    for release in ["1.33", "1.35"].map(r) {
        let t = table(&v6, release);
        has(&t, "add table ip6 kube-proxy { comment \"rules for kube-proxy\" ; }");
        has(&t, "add set ip6 kube-proxy cluster-ips { type ipv6_addr ; comment \"Active ClusterIPs\" ; }");
        has(&t, "add element ip6 kube-proxy nodeport-ips { 2001:db8::1 }");
        has(
            &t,
            "add rule ip6 kube-proxy cluster-ips-check ip6 daddr { fd00:10:96::/112 } drop comment \"Drop traffic to unallocated ClusterIPs\"",
        );
        lacks(&t, "ip daddr");
    }
    let t = table(&v6, r("1.37"));
    has(
        &t,
        "add rule ip6 kube-proxy masquerading ct status dnat ip6 saddr . ip6 daddr . meta l4proto . th dport @hairpin-connections masquerade fully-random",
    );
    assert!(
        t.lines()
            .any(|l| l
                .contains("meta l4proto tcp dnat ip6 addr . port to numgen random mod 1 map { 0 : fd00:10::1 . 80 }")),
        "{t}"
    );
    has(&t, "add element ip6 kube-proxy hairpin-connections { fd00:10::1 . fd00:10::1 . tcp . 80 }");
    let t = table(&v6, r("1.35"));
    assert!(t.lines().any(|l| l.ends_with("meta l4proto tcp dnat to [fd00:10::1]:80")), "{t}");
    // nodePortAddresses matching everything: no nodeport-ips set, `fib daddr type local`.
    v6.node_port_addresses = Vec::new();
    let t = table(&v6, r("1.35"));
    lacks(&t, "nodeport-ips");
    has(
        &t,
        "add rule ip6 kube-proxy services fib daddr type local ip6 daddr != ::1 meta l4proto . th dport vmap @service-nodeports",
    );
    has(
        &t,
        "add rule ip6 kube-proxy nodeport-endpoints-check ip6 daddr != ::1 meta l4proto . th dport vmap @no-endpoint-nodeports",
    );
    let mut v4 = FakeSettings::upstream(IpFamily::V4);
    v4.node_port_addresses = Vec::new();
    let t = table(&v4, r("1.31"));
    has(
        &t,
        "add rule ip kube-proxy services fib daddr type local ip daddr != 127.0.0.0/8 meta l4proto . th dport vmap @service-nodeports",
    );
    has(
        &t,
        "add rule ip kube-proxy nodeport-endpoints-check ip daddr != 127.0.0.0/8 meta l4proto . th dport vmap @no-endpoint-nodeports",
    );
}

/// Switching nodePortAddresses between a list and everything, across a restart: the set goes
/// (after the rules naming it are rewritten) or comes back.
#[test]
fn nftables_nodeport_ips_set_follows_node_port_addresses() {
    let v4 = FakeSettings::upstream(IpFamily::V4);
    let mut all = v4.clone();
    all.node_port_addresses = Vec::new();
    for (from, to) in [(&v4, &all), (&all, &v4)] {
        let mut first = NftTestProxier::new(from, r("1.35"));
        first.add_services(&[svc("ns1", "svc1")
            .type_("NodePort")
            .cluster_ip("172.30.0.41")
            .node_port("p80", 80, 3001)
            .build()]);
        first.sync();
        let mut second = NftTestProxier::on_kernel(to, r("1.35"), first.nft.clone());
        second.add_services(&[svc("ns1", "svc1")
            .type_("NodePort")
            .cluster_ip("172.30.0.41")
            .node_port("p80", 80, 3001)
            .build()]);
        second.sync();
        let mut fresh = NftTestProxier::new(to, r("1.35"));
        fresh.add_services(&[svc("ns1", "svc1")
            .type_("NodePort")
            .cluster_ip("172.30.0.41")
            .node_port("p80", 80, 3001)
            .build()]);
        fresh.sync();
        assert_eq!(second.sorted_dump(), fresh.sorted_dump());
    }
}

#[test]
fn nftables_interface_detectors_write_iifname() {
    use kube_proxy_rs::proxier::local_detect::LocalDetector;
    let v4 = FakeSettings::upstream(IpFamily::V4);
    let mut cfg = v4.render_config(r("1.33"));
    cfg.local_detector = LocalDetector::InterfaceNamePrefix("veth".into());
    let nft =
        std::sync::Arc::new(kube_proxy_rs::nftables::fake::FakeNftables::new(kube_proxy_rs::nftables::Family::Ip));
    let mut p = kube_proxy_rs::proxier::nftables::NftablesProxier::new(
        kube_proxy_rs::proxier::nftables::NftProxierConfig {
            render: cfg,
            hostname: TEST_NODE_NAME.into(),
            sync_period: Duration::from_secs(30),
        },
        nft.clone(),
        std::sync::Arc::new(kube_proxy_rs::proxier::StaticInterfaces(v4.interface_addrs.clone())),
    );
    p.on_services_synced();
    p.on_endpoint_slices_synced();
    p.on_service_state(
        kube_proxy_rs::model::NamespacedName::new("ns1", "svc1"),
        Some(&svc("ns1", "svc1").cluster_ip("172.30.0.41").tcp("p80", 80).build()),
    );
    p.on_endpoint_slice_update(
        &slice("ns1", "svc1", "svc1-1").tcp("p80", 80).endpoint(ep("10.180.0.1")).build(),
        false,
    );
    assert!(matches!(p.sync(std::time::Instant::now()), NftSyncOutcome::Synced(r) if r.result.is_ok()));
    has(
        &nft.dump(),
        "add rule ip kube-proxy service-ULMVA6XW-ns1/svc1/tcp/p80 ip daddr 172.30.0.41 tcp dport 80 iifname != veth* jump mark-for-masquerade",
    );
}

/// ServiceCIDRs change the drop rule at the next full sync only, as upstream.
#[test]
fn nftables_service_cidrs_apply_at_full_syncs() {
    let mut settings = FakeSettings::upstream(IpFamily::V4);
    settings.service_cidrs = Vec::new();
    let mut fp = NftTestProxier::new(&settings, r("1.34"));
    fp.sync();
    lacks(&fp.nft.dump(), "Drop traffic to unallocated ClusterIPs");
    fp.proxier.on_service_cidrs(&["10.97.0.0/16".into(), "fd00::/108".into(), "10.96.0.0/16".into()]);
    fp.add_services(&[svc("ns1", "svc1").cluster_ip("10.96.0.10").tcp("p80", 80).build()]);
    assert!(!fp.sync().full);
    lacks(&fp.nft.dump(), "Drop traffic to unallocated ClusterIPs");
    fp.proxier.force_full_sync();
    assert!(fp.sync().full);
    has(
        &fp.nft.dump(),
        "add rule ip kube-proxy cluster-ips-check ip daddr { 10.96.0.0/16,10.97.0.0/16 } drop comment \"Drop traffic to unallocated ClusterIPs\"",
    );
}

/// From 1.34 a sync an hour after the last full sync is full (and lists the table); before,
/// only failures and topology changes make one.
#[test]
fn nftables_hourly_full_sync_from_1_34() {
    for (release, hourly) in [("1.31", false), ("1.33", false), ("1.34", true), ("1.37", true)] {
        let mut fp = NftTestProxier::new(&FakeSettings::upstream(IpFamily::V4), r(release));
        fp.sync();
        let lists = fp.nft.list_count();
        let report = fp.sync_after(Duration::from_secs(3601));
        assert_eq!(report.full, hourly, "{release}");
        assert_eq!(fp.nft.list_count() - lists, usize::from(hourly), "{release}: listings");
    }
}

/// A failed stale-chain deletion makes the sync full from 1.34; in every release the chains
/// are deleted later.
#[test]
fn nftables_failed_stale_chain_deletion() {
    for (release, full) in [("1.33", false), ("1.35", true)] {
        let mut fp = NftTestProxier::new(&FakeSettings::upstream(IpFamily::V4), r(release));
        let s = svc("ns1", "svc1").cluster_ip("172.30.0.41").tcp("p80", 80).build();
        fp.add_services(std::slice::from_ref(&s));
        fp.add_slices(&[slice("ns1", "svc1", "svc1-1").tcp("p80", 80).endpoint(ep("10.180.0.1")).build()]);
        fp.sync();
        fp.delete_service(&s);
        fp.sync();
        assert_eq!(fp.proxier.stale_chains().len(), 2, "{release}");
        fp.nft.fail_next_runs(1);
        let report = fp.sync_after(Duration::from_secs(2));
        assert!(report.stale_chain_cleanup_failed, "{release}");
        assert_eq!(report.full, full, "{release}");
        assert_eq!(fp.proxier.stale_chains().len(), 2, "{release}");
        fp.sync_after(Duration::from_secs(2));
        assert!(fp.proxier.stale_chains().is_empty(), "{release}");
        lacks(&fp.nft.dump(), "ns1/svc1");
    }
}

/// Steady state never lists the table; the kernel is read at start-up and after a failure.
#[test]
fn nftables_steady_state_never_lists() {
    let mut fp = NftTestProxier::new(&FakeSettings::upstream(IpFamily::V4), r("1.35"));
    fp.sync();
    assert_eq!(fp.nft.list_count(), 1);
    for i in 0..20 {
        let ip = format!("10.180.0.{}", i + 1);
        fp.add_services(&[svc("ns1", &format!("svc{i}"))
            .cluster_ip(&format!("172.30.0.{}", i + 1))
            .tcp("p80", 80)
            .build()]);
        fp.add_slices(&[slice("ns1", &format!("svc{i}"), "a").tcp("p80", 80).endpoint(ep(&ip)).build()]);
        let report = fp.sync_after(Duration::from_secs(2));
        assert!(!report.full);
        // One service and its endpoint: its chains, rules and elements, nothing else.
        assert!(report.stats.operations <= 8, "{}", report.transaction.unwrap_or_default());
    }
    assert_eq!(fp.nft.list_count(), 1);
    fp.nft.fail_next_runs(1);
    fp.add_services(&[svc("ns9", "x").cluster_ip("172.30.9.9").tcp("p80", 80).build()]);
    let failed = match fp.proxier.sync(fp.now) {
        NftSyncOutcome::Synced(r) => r,
        NftSyncOutcome::NotInitialized => unreachable!(),
    };
    assert!(failed.result.is_err());
    let report = fp.sync();
    assert!(report.full);
    assert_eq!(fp.nft.list_count(), 2);
    // The full sync after the failure wrote only what the failed one would have.
    assert!(report.stats.operations <= 4, "{}", report.transaction.unwrap_or_default());
    assert!(fp.nft.dump().contains("172.30.9.9"));
}

/// A partial sync's transaction is small and in order: chains before the rules and elements
/// that name them, element deletions before additions.
#[test]
fn nftables_partial_sync_transaction_shape() {
    let mut fp = NftTestProxier::new(&FakeSettings::upstream(IpFamily::V4), r("1.34"));
    fp.sync();
    fp.add_services(&[svc("ns1", "svc1").cluster_ip("172.30.0.41").tcp("p80", 80).build()]);
    fp.add_slices(&[slice("ns1", "svc1", "svc1-1").tcp("p80", 80).endpoint(ep("10.180.0.1")).build()]);
    let report = fp.sync();
    assert_eq!(
        report.transaction.as_deref().unwrap_or_default(),
        "add chain ip kube-proxy endpoint-5OJB2KTY-ns1/svc1/tcp/p80__10.180.0.1/80\n\
         add chain ip kube-proxy service-ULMVA6XW-ns1/svc1/tcp/p80\n\
         add rule ip kube-proxy endpoint-5OJB2KTY-ns1/svc1/tcp/p80__10.180.0.1/80 ip saddr 10.180.0.1 jump mark-for-masquerade\n\
         add rule ip kube-proxy endpoint-5OJB2KTY-ns1/svc1/tcp/p80__10.180.0.1/80 meta l4proto tcp dnat to 10.180.0.1:80\n\
         add rule ip kube-proxy service-ULMVA6XW-ns1/svc1/tcp/p80 ip daddr 172.30.0.41 ip saddr != 10.0.0.0/8 jump mark-for-masquerade\n\
         add rule ip kube-proxy service-ULMVA6XW-ns1/svc1/tcp/p80 numgen random mod 1 vmap { 0 : goto endpoint-5OJB2KTY-ns1/svc1/tcp/p80__10.180.0.1/80 }\n\
         add element ip kube-proxy cluster-ips { 172.30.0.41 }\n\
         add element ip kube-proxy service-ips { 172.30.0.41 . tcp . 80 : goto service-ULMVA6XW-ns1/svc1/tcp/p80 }\n"
    );
    // A new endpoint: the service chain is rewritten, the new endpoint chain added; the map
    // element does not change.
    fp.add_slices(&[slice("ns1", "svc1", "svc1-1")
        .tcp("p80", 80)
        .endpoint(ep("10.180.0.1"))
        .endpoint(ep("10.180.0.2"))
        .build()]);
    let report = fp.sync();
    let tx = fp.nft.runs().pop().expect("a transaction");
    assert!(matches!(tx.ops.first(), Some(Operation::AddChain(c)) if c.name.starts_with("endpoint-")), "{tx:?}");
    assert!(tx.ops.iter().any(|op| matches!(op, Operation::FlushChain(c) if c == "service-ULMVA6XW-ns1/svc1/tcp/p80")));
    assert!(!tx.ops.iter().any(|op| matches!(op, Operation::AddElement(_) | Operation::DeleteElement { .. })));
    assert_eq!(report.stats.operations, 6, "{}", report.transaction.unwrap_or_default());
}

/// Two Services claiming the same external IP and port: the element stays while either
/// claims it, whichever goes first.
#[test]
fn nftables_shared_elements_are_reference_counted() {
    for first_gone in ["svc1", "svc2"] {
        let mut fp = NftTestProxier::new(&FakeSettings::upstream(IpFamily::V4), r("1.36"));
        let make = |name: &str, cip: &str| {
            svc("ns1", name).cluster_ip(cip).tcp("p80", 80).external_ips(&["192.168.99.22"]).build()
        };
        let (a, b) = (make("svc1", "172.30.0.41"), make("svc2", "172.30.0.42"));
        fp.add_services(&[a.clone(), b.clone()]);
        fp.sync();
        let key = "add element ip kube-proxy no-endpoint-services { 192.168.99.22 . tcp . 80 comment ";
        assert_eq!(fp.nft.dump().lines().filter(|l| l.starts_with(key)).count(), 1);
        fp.delete_service(if first_gone == "svc1" { &a } else { &b });
        fp.sync();
        let other = if first_gone == "svc1" { "ns1/svc2:p80" } else { "ns1/svc1:p80" };
        has(&fp.nft.dump(), &format!("{key}\"{other}\" : goto reject-chain }}"));
        fp.delete_service(if first_gone == "svc1" { &b } else { &a });
        fp.sync();
        lacks(&fp.nft.dump(), "192.168.99.22");
    }
}

/// A large full sync goes out in pieces, each accepted on its own, and ends in the same table;
/// a piece that fails ends the sync, and the next (full) sync gets everything right.
#[test]
fn nftables_large_full_syncs_go_out_in_pieces() {
    let cluster = |fp: &mut NftTestProxier| {
        for i in 0..30 {
            let ns = format!("ns{}", i % 3);
            let name = format!("svc{i}");
            let mut s = svc(&ns, &name).cluster_ip(&format!("172.30.0.{}", i + 1)).tcp("p80", 80);
            if i % 4 == 0 {
                s = s.affinity(Some(60));
            }
            fp.add_services(&[s.build()]);
            fp.add_slices(&[slice(&ns, &name, "a")
                .tcp("p80", 80)
                .endpoint(ep(&format!("10.1.{i}.1")).node(TEST_NODE_NAME))
                .endpoint(ep(&format!("10.1.{i}.2")))
                .build()]);
        }
    };
    for release in ["1.33", "1.37"].map(r) {
        let mut whole = NftTestProxier::new(&FakeSettings::upstream(IpFamily::V4), release);
        cluster(&mut whole);
        whole.sync();
        assert_eq!(whole.nft.runs().len(), 1);

        let mut settings = FakeSettings::upstream(IpFamily::V4);
        settings.chunk_operations = Some(25);
        let mut pieces = NftTestProxier::new(&settings, release);
        cluster(&mut pieces);
        let report = pieces.sync();
        let runs = pieces.nft.runs();
        assert!(runs.len() > 4, "{release}: {} transactions", runs.len());
        assert_eq!(report.stats.plan.transactions_before + 1, runs.len());
        assert_eq!(report.stats.operations, runs.iter().map(|t| t.len()).sum::<usize>());
        assert_eq!(pieces.sorted_dump(), whole.sorted_dump(), "{release}");

        // The third piece fails: the sync fails, the next one is full and repairs.
        let kernel = Arc::new(FailNth { inner: FakeNftables::new(Family::Ip), fail_at: 3, runs: AtomicUsize::new(0) });
        let mut failing = NftTestProxier::new(&settings, release);
        failing.proxier = NftablesProxier::new(
            failing.proxier.config().clone(),
            kernel.clone(),
            Arc::new(StaticInterfaces(settings.interface_addrs.clone())),
        )
        .with_chunk_operations(25);
        failing.proxier.on_service_cidrs(&settings.service_cidrs);
        failing.proxier.on_services_synced();
        failing.proxier.on_endpoint_slices_synced();
        cluster(&mut failing);
        let NftSyncOutcome::Synced(report) = failing.proxier.sync(failing.now) else { panic!("not initialized") };
        assert!(report.result.is_err(), "{release}");
        assert_eq!(kernel.runs.load(Ordering::Relaxed), 3);
        let NftSyncOutcome::Synced(report) = failing.proxier.sync(failing.now) else { panic!("not initialized") };
        assert!(report.result.is_ok() && report.full && report.stats.listed, "{release}");
        assert_eq!(sort_dump(&kernel.inner.dump()), whole.sorted_dump(), "{release}");
    }
}

/// A fake kernel whose `fail_at`-th transaction fails.
struct FailNth {
    inner: FakeNftables,
    fail_at: usize,
    runs: AtomicUsize,
}

impl Nftables for FailNth {
    fn family(&self) -> Family {
        self.inner.family()
    }

    fn run(&self, tx: &Transaction) -> Result<(), NftError> {
        if self.runs.fetch_add(1, Ordering::Relaxed) + 1 == self.fail_at {
            return Err(NftError::Rejected { family: Family::Ip, message: "injected".into() });
        }
        self.inner.run(tx)
    }

    fn check(&self, tx: &Transaction) -> Result<(), NftError> {
        self.inner.check(tx)
    }

    fn list_table(&self) -> Result<Option<TableState>, NftError> {
        self.inner.list_table()
    }
}

/// A successful sync leaves the conntrack cleanup the iptables proxier's sync leaves for the
/// same changes (the same `CleanupJob`: per-change requests up to 1.31, the serving state for
/// the reconciler from 1.32), numbered by the rule write it follows; the sync itself does no
/// conntrack work (the proxier has no conntrack to do it with), and a failed sync leaves none.
#[test]
fn nftables_syncs_leave_the_iptables_proxiers_conntrack_cleanup() {
    use kube_proxy_rs::model::Protocol;
    use kube_proxy_rs::node::conntrack::cleaner::CleanupWork;
    use kube_proxy_rs::node::conntrack::{ClearRequest, ConntrackEntry, FakeConntrack};

    use crate::support::harness::TestProxier;

    let dns = || svc("kube-system", "dns").cluster_ip("172.30.0.10").udp("dns", 53).build();
    let web = || svc("kube-system", "web").cluster_ip("172.30.0.11").tcp("http", 80).build();
    let dns_slice = |ips: &[&str]| slice("kube-system", "dns", "dns-1").udp("dns", 5353).ips(ips).build();
    let web_slice = slice("kube-system", "web", "web-1").tcp("http", 8080).ips(&["10.1.0.3"]).build();
    for release in ["1.31", "1.32", "1.35", "1.37"].map(r) {
        let mut nft = NftTestProxier::new(&FakeSettings::upstream(IpFamily::V4), release);
        let mut ipt = TestProxier::with_release(IpFamily::V4, release);
        let writes = nft.proxier.rule_writes();
        let mut step = |what: &str,
                        change: &dyn Fn(&mut NftTestProxier, &mut TestProxier)|
         -> Option<kube_proxy_rs::node::conntrack::cleaner::CleanupJob> {
            change(&mut nft, &mut ipt);
            let report = nft.sync();
            let expected = ipt.sync().conntrack_cleanup;
            assert_eq!(report.conntrack_cleanup, expected, "{release} {what}");
            if let Some(job) = &report.conntrack_cleanup {
                assert_eq!((job.family, job.rules), (IpFamily::V4, writes.current()), "{release} {what}");
            }
            report.conntrack_cleanup
        };
        let reconciles = release >= r("1.32");

        let first = step("services, no endpoints", &|n, i| {
            n.add_services(&[dns(), web()]);
            i.add_services(&[dns(), web()]);
        });
        let first_endpoints = step("first endpoints", &|n, i| {
            n.add_slices(&[dns_slice(&["10.1.0.1", "10.1.0.2"]), web_slice.clone()]);
            i.add_slices(&[dns_slice(&["10.1.0.1", "10.1.0.2"]), web_slice.clone()]);
        });
        let removed = step("one UDP endpoint removed", &|n, i| {
            n.add_slices(&[dns_slice(&["10.1.0.2"])]);
            i.add_slices(&[dns_slice(&["10.1.0.2"])]);
        });
        let nothing = step("nothing changed", &|_, _| {});
        if reconciles {
            let required = |job: &Option<_>| match job {
                Some(kube_proxy_rs::node::conntrack::cleaner::CleanupJob {
                    work: CleanupWork::Reconcile { required, .. },
                    ..
                }) => *required,
                other => panic!("{release}: a reconciler state every sync, got {other:?}"),
            };
            assert_eq!(
                [&first, &first_endpoints, &removed, &nothing].map(required),
                [false, true, true, false],
                "{release}"
            );
            // Run the job of the removal: only the entry through the removed endpoint goes.
            let client = "10.0.5.5".parse().expect("ip");
            let entry = |sport, reply_src: &str| {
                ConntrackEntry::new(
                    Protocol::Udp,
                    (client, sport),
                    ("172.30.0.10".parse().expect("ip"), 53),
                    (reply_src.parse().expect("ip"), 5353),
                    (client, sport),
                )
            };
            let (live, stale) = (entry(40000, "10.1.0.2"), entry(40001, "10.1.0.1"));
            let ct = FakeConntrack::new();
            ct.set_entries(vec![live, stale]);
            let run = removed.as_ref().and_then(|job| job.run(&ct)).expect("a required reconciliation runs");
            assert_eq!(run.reconcile().map(|r| r.deleted), Some(1), "{release}");
            assert_eq!(ct.entries(), [live], "{release}");
        } else {
            assert_eq!(first, None, "{release}: nothing stale");
            assert_eq!(nothing, None, "{release}: nothing stale");
            let requests = |job: &Option<_>| match job {
                Some(kube_proxy_rs::node::conntrack::cleaner::CleanupJob {
                    work: CleanupWork::Requests(requests),
                    ..
                }) => requests.clone(),
                other => panic!("{release}: requests, got {other:?}"),
            };
            assert_eq!(
                requests(&first_endpoints),
                [ClearRequest::Ip { ip: "172.30.0.10".into(), protocol: Protocol::Udp }],
                "{release}"
            );
            let ct = FakeConntrack::new();
            removed.as_ref().and_then(|job| job.run(&ct)).expect("requests run");
            assert_eq!(ct.command_lines(), ["conntrack -D --orig-dst 172.30.0.10 --dst-nat 10.1.0.1 -p udp"]);
        }

        // A failed sync leaves no cleanup (its rules are not in the kernel); the next one,
        // full, leaves one numbered by its own write (what the failed sync drained is not
        // seen again, as in the iptables proxier and upstream). Within a second, so no stale
        // chain deletion takes the injected failure.
        nft.add_slices(&[dns_slice(&[])]);
        nft.nft.fail_next_runs(1);
        nft.now += Duration::from_millis(1);
        let NftSyncOutcome::Synced(failed) = nft.proxier.sync(nft.now) else { panic!("not initialized") };
        assert!(failed.result.is_err() && failed.conntrack_cleanup.is_none(), "{release}");
        let retried = nft.sync();
        assert!(retried.full, "{release}");
        if reconciles {
            assert!(retried.conntrack_cleanup.is_some_and(|job| job.rules == writes.current()), "{release}");
        }
    }
}
