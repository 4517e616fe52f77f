//! The iptables runner against the real binaries, for both the nft and the legacy backend,
//! each test in private network namespaces it creates and always deletes.
//!
//! These tests need root (to create namespaces); without it they print why and pass.
//! Addresses in rules come only from 198.18.0.0/15 and 203.0.113.0/24.
//!
//! Where a whole rule set is checked, the expectation is what the fake iptables holds after
//! the same events, pushed through the kernel once (restored into a second, fresh namespace
//! and saved again) so that both sides carry the kernel's normalisation (`/32` suffixes,
//! quoting, match order).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube_proxy_rs::iptables::dump::Dump;
use kube_proxy_rs::iptables::fake::FakeIptables;
use kube_proxy_rs::iptables::monitor::{CANARY_TABLES, CanaryMonitor};
use kube_proxy_rs::iptables::restore_plan;
use kube_proxy_rs::iptables::runner::{Backend, IptablesVersion, RunnerOptions};
use kube_proxy_rs::iptables::{FlushFlag, Iptables, IptablesError, RestoreCounters, RulePosition, Table};
use kube_proxy_rs::model::{Cidr, IpFamily, NamespacedName};
use kube_proxy_rs::proxier::cleanup::cleanup_leftovers;
use kube_proxy_rs::proxier::local_detect::LocalDetector;
use kube_proxy_rs::proxier::nodeport_addresses::NodePortAddresses;
use kube_proxy_rs::proxier::{Proxier, ProxierConfig, RenderConfig, StaticInterfaces, SyncOutcome, SyncReport};
use kube_proxy_rs::tracker::testing::{ep, slice, svc};

use crate::require_root;
use crate::support::netns::Netns;
use crate::support::{canonical_rules, line_diff};

const BACKENDS: [Backend; 2] = [Backend::Nft, Backend::Legacy];
const NODE_NAME: &str = "test-node";

fn save(ipt: &dyn Iptables, table: Table) -> String {
    let mut buf = Vec::new();
    ipt.save_into(table, &mut buf).expect("save");
    String::from_utf8(buf).expect("utf-8")
}

fn canonical(ipt: &dyn Iptables) -> String {
    canonical_rules(ipt, &[])
}

/// Chain name to rule lines, for one table.
fn chain_rules(ipt: &dyn Iptables, table: Table) -> BTreeMap<String, Vec<String>> {
    let dump = Dump::parse(&save(ipt, table)).expect("save output parses");
    dump.tables.iter().flat_map(|t| t.chains.iter()).map(|c| (c.name.clone(), c.rules.clone())).collect()
}

fn assert_same_rules(expected: &str, actual: &str, what: &str) {
    if expected != actual {
        panic!("{what}: kernel rules differ (- expected, + actual):\n{}", line_diff(expected, actual));
    }
}

#[test]
fn runner_probes_the_installed_binaries() {
    require_root!();
    for backend in BACKENDS {
        let ns = Netns::create("probe");
        for family in [IpFamily::V4, IpFamily::V6] {
            let ipt = ns.runner(backend, family);
            let version = ipt.version().expect("version detected");
            assert!(version >= IptablesVersion::new(1, 8, 0), "{backend}: {version}");
            assert_eq!(ipt.wait_flag(), ["-w", "5", "-W", "100000"]);
            assert_eq!(ipt.restore_wait_flag(), ["-w", "5", "-W", "100000"]);
            assert!(ipt.has_random_fully());
            assert!(ipt.present(), "{backend} {family:?}: nat POSTROUTING present");
        }
    }
}

#[test]
fn chain_and_rule_operations_are_idempotent() {
    require_root!();
    for backend in BACKENDS {
        let ns = Netns::create("ops");
        for family in [IpFamily::V4, IpFamily::V6] {
            let ipt = ns.runner(backend, family);
            let ctx = format!("{backend} {family:?}");
            assert!(!ipt.chain_exists(Table::Nat, "KUBE-TEST").expect("check"), "{ctx}");
            assert!(!ipt.ensure_chain(Table::Nat, "KUBE-TEST").expect("create"), "{ctx}: created");
            assert!(ipt.ensure_chain(Table::Nat, "KUBE-TEST").expect("create"), "{ctx}: existed");
            assert!(ipt.chain_exists(Table::Nat, "KUBE-TEST").expect("check"), "{ctx}");

            let jump = ["-m", "comment", "--comment", "kube-proxy-rs test jump", "-j", "KUBE-TEST"];
            assert!(!ipt.ensure_rule(RulePosition::Prepend, Table::Nat, "PREROUTING", &jump).expect("add"), "{ctx}");
            assert!(ipt.ensure_rule(RulePosition::Prepend, Table::Nat, "PREROUTING", &jump).expect("add"), "{ctx}");
            let ret = ["-m", "comment", "--comment", "second", "-j", "RETURN"];
            assert!(!ipt.ensure_rule(RulePosition::Append, Table::Nat, "KUBE-TEST", &ret).expect("add"), "{ctx}");
            let nat = save(&ipt, Table::Nat);
            assert_eq!(nat.matches("kube-proxy-rs test jump").count(), 1, "{ctx}: one jump rule\n{nat}");
            assert!(nat.contains("-A KUBE-TEST -m comment --comment second -j RETURN"), "{ctx}\n{nat}");

            // A chain still referenced cannot be deleted.
            assert!(ipt.delete_chain(Table::Nat, "KUBE-TEST").is_err(), "{ctx}");
            ipt.delete_rule(Table::Nat, "PREROUTING", &jump).expect("delete");
            ipt.delete_rule(Table::Nat, "PREROUTING", &jump).expect("deleting an absent rule is fine");
            ipt.flush_chain(Table::Nat, "KUBE-TEST").expect("flush");
            assert!(!save(&ipt, Table::Nat).contains("second"), "{ctx}: flushed");
            ipt.delete_chain(Table::Nat, "KUBE-TEST").expect("delete chain");
            assert!(!ipt.chain_exists(Table::Nat, "KUBE-TEST").expect("check"), "{ctx}");
            let err = ipt.delete_chain(Table::Nat, "KUBE-TEST").expect_err("already gone");
            assert!(matches!(err, IptablesError::Failed { status: 1, .. }), "{ctx}: {err}");
            assert!(ipt.flush_chain(Table::Nat, "KUBE-TEST").is_err(), "{ctx}");
        }
    }
}

const FOREIGN: &str = "*nat\n\
:FOREIGN - [0:0]\n\
-A PREROUTING -d 203.0.113.99/32 -j FOREIGN\n\
-A FOREIGN -d 203.0.113.99/32 -j RETURN\n\
COMMIT\n\
*filter\n\
-A INPUT -s 203.0.113.98/32 -m comment --comment \"someone else\" -j ACCEPT\n\
COMMIT\n";

#[test]
fn restore_noflush_keeps_other_owners_rules() {
    require_root!();
    for backend in BACKENDS {
        let ns = Netns::create("restore");
        let ipt = ns.runner(backend, IpFamily::V4);
        ipt.restore_all(FOREIGN.as_bytes(), FlushFlag::NoFlush, RestoreCounters::NoCounters).expect("foreign rules");

        let ours = "*nat\n:KUBE-OURS - [0:0]\n-A KUBE-OURS -d 198.18.0.1/32 -j RETURN\nCOMMIT\n";
        ipt.restore_all(ours.as_bytes(), FlushFlag::NoFlush, RestoreCounters::Counters).expect("restore");
        // Redeclaring our chain flushes it; the restore of one table leaves the other alone.
        let ours2 = "*nat\n:KUBE-OURS - [0:0]\n-A KUBE-OURS -d 198.18.0.2/32 -j RETURN\nCOMMIT\n";
        ipt.restore(Table::Nat, ours2.as_bytes(), FlushFlag::NoFlush, RestoreCounters::NoCounters).expect("restore");

        let nat = save(&ipt, Table::Nat);
        let filter = save(&ipt, Table::Filter);
        assert!(nat.contains("-A PREROUTING -d 203.0.113.99/32 -j FOREIGN"), "{backend}\n{nat}");
        assert!(nat.contains("-A FOREIGN -d 203.0.113.99/32 -j RETURN"), "{backend}\n{nat}");
        assert!(filter.contains("-A INPUT -s 203.0.113.98/32"), "{backend}\n{filter}");
        assert!(nat.contains("-A KUBE-OURS -d 198.18.0.2/32 -j RETURN"), "{backend}\n{nat}");
        assert!(!nat.contains("198.18.0.1/32"), "{backend}: redeclared chain was flushed\n{nat}");

        // Also visible to the plain binaries, i.e. the runner really used this backend.
        let listed = ns.ok(&[&format!("iptables-{backend}-save"), "-t", "nat"]);
        assert!(listed.contains("KUBE-OURS"), "{backend}\n{listed}");
    }
}

#[test]
fn bad_restore_line_is_reported_with_its_number() {
    require_root!();
    for backend in BACKENDS {
        let ns = Netns::create("badline");
        let ipt = ns.runner(backend, IpFamily::V4);
        let before = canonical(&ipt);

        // An unknown option: both backends blame the rule's own line.
        let data = "*nat\n:KUBE-A - [0:0]\n-A KUBE-A -d 198.18.0.1/32 -j RETURN\n-A KUBE-A --bogus-option\nCOMMIT\n";
        let err = ipt.restore_all(data.as_bytes(), FlushFlag::NoFlush, RestoreCounters::Counters).expect_err("bad");
        assert_eq!(err.restore_line(), Some(4), "{backend}: {err}");
        let context = kube_proxy_rs::iptables::save::format_line_context(data.as_bytes(), 4, 1);
        assert!(context.contains("> 4 | -A KUBE-A --bogus-option"), "{context}");

        // A jump to a missing chain: legacy blames the rule, nft the COMMIT that applies it.
        let data = "*nat\n:KUBE-B - [0:0]\n-A KUBE-B -j KUBE-MISSING\n-A KUBE-B -j RETURN\nCOMMIT\n";
        let err = ipt.restore_all(data.as_bytes(), FlushFlag::NoFlush, RestoreCounters::Counters).expect_err("bad");
        let expected = match backend {
            Backend::Legacy => 3,
            _ => 5,
        };
        assert_eq!(err.restore_line(), Some(expected), "{backend}: {err}");

        // Nothing was applied.
        assert_same_rules(&before, &canonical(&ipt), &format!("{backend} after failed restores"));
    }
}

fn render_config(random_fully: bool) -> RenderConfig {
    RenderConfig {
        family: IpFamily::V4,
        masquerade_all: false,
        masquerade_mark: "0x4000".into(),
        localhost_nodeports: false,
        local_detector: LocalDetector::Cidr(Cidr::parse_sloppy("198.19.0.0/16").expect("cidr")),
        node_ip: Some("198.18.255.1".parse().expect("ip")),
        node_port_addresses: NodePortAddresses::new(IpFamily::V4, &[]),
        random_fully,
        conntrack_tcp_liberal: false,
        features: kube_proxy_rs::compat::Features::of(kube_proxy_rs::compat::Release::V1_29),
    }
}

fn new_proxier(ipt: Arc<dyn Iptables>) -> Proxier {
    let cfg = ProxierConfig {
        render: render_config(ipt.has_random_fully()),
        hostname: NODE_NAME.into(),
        sync_period: Duration::from_secs(30),
    };
    let proxier = Proxier::new(cfg, ipt, Arc::new(StaticInterfaces(vec!["198.18.255.1".parse().expect("ip")])))
        .with_payload_recording();
    proxier.on_services_synced();
    proxier.on_endpoint_slices_synced();
    proxier
}

#[track_caller]
fn sync(proxier: &mut Proxier, now: Instant) -> SyncReport {
    match proxier.sync(now) {
        SyncOutcome::Synced(report) => {
            if let Err(e) = &report.result {
                panic!("sync failed: {e}\npayload:\n{}", report.payload.as_deref().unwrap_or_default());
            }
            *report
        }
        SyncOutcome::NotInitialized => panic!("proxier not initialized"),
    }
}

/// The cluster: services and their slices by name.
struct Cluster {
    services: BTreeMap<&'static str, Service>,
    slices: BTreeMap<&'static str, EndpointSlice>,
}

fn cluster() -> Cluster {
    let services = BTreeMap::from([
        ("web", svc("ns1", "web").cluster_ip("198.18.0.10").tcp("p80", 80).build()),
        ("np", svc("ns1", "np").type_("NodePort").cluster_ip("198.18.0.11").node_port("p80", 80, 30080).build()),
        (
            "lb",
            svc("ns2", "lb")
                .type_("LoadBalancer")
                .cluster_ip("198.18.0.12")
                .node_port("p80", 80, 30081)
                .lb_ingress(&["203.0.113.10"])
                .source_ranges(&["203.0.113.0/25"])
                .external_ips(&["203.0.113.20"])
                .build(),
        ),
        ("dns", svc("ns2", "dns").cluster_ip("198.18.0.13").udp("dns", 53).affinity(Some(10800)).build()),
        ("empty", svc("ns3", "empty").cluster_ip("198.18.0.14").tcp("p80", 80).build()),
    ]);
    let slices = BTreeMap::from([
        ("web", slice("ns1", "web", "web-1").tcp("p80", 8080).ips(&["198.19.1.1", "198.19.1.2"]).build()),
        ("np", slice("ns1", "np", "np-1").tcp("p80", 8080).ips(&["198.19.2.1"]).build()),
        (
            "lb",
            slice("ns2", "lb", "lb-1")
                .tcp("p80", 8080)
                .endpoint(ep("198.19.3.1").node(NODE_NAME))
                .endpoint(ep("198.19.3.2").node("other-node"))
                .build(),
        ),
        ("dns", slice("ns2", "dns", "dns-1").udp("dns", 53).ips(&["198.19.4.1"]).build()),
    ]);
    Cluster { services, slices }
}

impl Cluster {
    fn apply_to(&self, proxier: &mut Proxier) {
        for s in self.services.values() {
            proxier.on_service_state(NamespacedName::of_object(&s.metadata), Some(s));
        }
        for s in self.slices.values() {
            proxier.on_endpoint_slice_update(s, false);
        }
    }
}

/// What the kernel holds after restoring the rules a fresh fake-backed proxier writes for
/// `cluster` in one full sync (starting from the foreign rules).
fn expected_rules(backend: Backend, cluster: &Cluster, random_fully: bool) -> String {
    let fake = Arc::new(FakeIptables::new(IpFamily::V4));
    fake.set_has_random_fully(random_fully);
    fake.seed(FOREIGN.as_bytes()).expect("seed foreign rules");
    let mut proxier = new_proxier(fake.clone());
    cluster.apply_to(&mut proxier);
    let report = sync(&mut proxier, Instant::now());
    assert!(report.full);

    let reference = Netns::create("ref");
    let ipt = reference.runner(backend, IpFamily::V4);
    ipt.restore_all(fake.save_all().as_bytes(), FlushFlag::Flush, RestoreCounters::NoCounters)
        .expect("the fake's state restores into a real kernel");
    canonical(&ipt)
}

fn svc_chains(rules: &BTreeMap<String, Vec<String>>, comment: &str) -> Vec<String> {
    rules
        .iter()
        .filter(|(name, r)| {
            (name.starts_with("KUBE-SVC-") || name.starts_with("KUBE-SEP-") || name.starts_with("KUBE-EXT-"))
                && !r.is_empty()
                && r.iter().all(|rule| rule.contains(comment))
        })
        .map(|(name, _)| name.clone())
        .collect()
}

#[test]
fn proxier_full_and_partial_syncs_on_real_iptables() {
    require_root!();
    // nft once more with every restore split one chain per transaction (the path a large
    // cluster takes): the same states must result.
    for (backend, split_budget) in [
        (Backend::Nft, Some(restore_plan::DEFAULT_BUDGET)),
        (Backend::Legacy, Some(restore_plan::DEFAULT_BUDGET)),
        (Backend::Nft, Some(1)),
    ] {
        let ns = Netns::create("sync");
        let ipt =
            Arc::new(ns.runner_with(RunnerOptions { backend, split_budget, ..RunnerOptions::default() }, IpFamily::V4));
        let backend_name = format!("{backend} (split budget {split_budget:?})");
        let random_fully = ipt.has_random_fully();
        ipt.restore_all(FOREIGN.as_bytes(), FlushFlag::NoFlush, RestoreCounters::NoCounters).expect("foreign rules");

        let mut cluster = cluster();
        let mut proxier = new_proxier(ipt.clone());
        cluster.apply_to(&mut proxier);
        let mut now = Instant::now();

        // Full sync: exactly the rendered rules (and the jumps), foreign rules intact.
        let report = sync(&mut proxier, now);
        assert!(report.full, "{backend_name}: first sync is full");
        let after_full = canonical(ipt.as_ref());
        assert_same_rules(
            &expected_rules(backend, &cluster, random_fully),
            &after_full,
            &format!("{backend_name} full"),
        );
        let nat = chain_rules(ipt.as_ref(), Table::Nat);
        for chain in ["KUBE-SERVICES", "KUBE-NODEPORTS", "KUBE-POSTROUTING", "KUBE-MARK-MASQ", "FOREIGN"] {
            assert!(nat.contains_key(chain), "{backend_name}: nat {chain} exists");
        }
        assert!(nat["PREROUTING"].iter().any(|r| r.contains("kubernetes service portals")), "{backend_name}");
        assert!(nat["PREROUTING"].iter().any(|r| r.contains("-j FOREIGN")), "{backend_name}");
        let web_chains = svc_chains(&nat, "ns1/web:p80");
        assert_eq!(web_chains.len(), 3, "{backend_name}: web has a SVC chain and two SEP chains: {web_chains:?}");

        // Partial sync: one more web endpoint changes only web's chains.
        let before = chain_rules(ipt.as_ref(), Table::Nat);
        let filter_before = chain_rules(ipt.as_ref(), Table::Filter);
        cluster.slices.insert(
            "web",
            slice("ns1", "web", "web-1").tcp("p80", 8080).ips(&["198.19.1.1", "198.19.1.2", "198.19.1.3"]).build(),
        );
        proxier.on_endpoint_slice_update(&cluster.slices["web"], false);
        now += Duration::from_secs(1);
        let report = sync(&mut proxier, now);
        assert!(!report.full, "{backend_name}: second sync is partial");
        assert!(
            !report.payload.as_deref().expect("recorded").contains("ns1/np:p80"),
            "{backend_name}: partial payload skips unchanged services"
        );
        let after = chain_rules(ipt.as_ref(), Table::Nat);
        let changed: Vec<&String> = before
            .keys()
            .chain(after.keys())
            .filter(|c| before.get(*c) != after.get(*c))
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .collect();
        assert!(!changed.is_empty(), "{backend_name}: something changed");
        let web_after = svc_chains(&after, "ns1/web:p80");
        assert_eq!(web_after.len(), 4, "{backend_name}: {web_after:?}");
        for chain in &changed {
            assert!(web_after.contains(chain), "{backend_name}: partial sync changed {chain}, not one of web's chains");
        }
        assert_eq!(filter_before, chain_rules(ipt.as_ref(), Table::Filter), "{backend_name}: filter untouched");
        assert_same_rules(
            &expected_rules(backend, &cluster, random_fully),
            &canonical(ipt.as_ref()),
            &format!("{backend_name} partial equals full"),
        );

        // Deleting services removes their chains at the next sync.
        let np_chains = svc_chains(&after, "ns1/np:p80");
        assert!(!np_chains.is_empty(), "{backend_name}");
        let np = cluster.services.remove("np").expect("np");
        let np_slice = cluster.slices.remove("np").expect("np slice");
        proxier.on_service_state(NamespacedName::of_object(&np.metadata), None);
        proxier.on_endpoint_slice_update(&np_slice, true);
        let empty = cluster.services.remove("empty").expect("empty");
        proxier.on_service_state(NamespacedName::of_object(&empty.metadata), None);
        now += Duration::from_secs(1);
        sync(&mut proxier, now);
        let nat = chain_rules(ipt.as_ref(), Table::Nat);
        for chain in &np_chains {
            assert!(!nat.contains_key(chain), "{backend_name}: {chain} of the deleted service is gone");
        }
        assert!(!save(ipt.as_ref(), Table::Filter).contains("ns3/empty"), "{backend_name}: REJECT rule gone");
        assert_same_rules(
            &expected_rules(backend, &cluster, random_fully),
            &canonical(ipt.as_ref()),
            &format!("{backend_name} after deletes"),
        );

        // Our chains flushed from outside: the next full sync repairs them.
        ns.ok(&[&format!("iptables-{backend}"), "-t", "nat", "-F", "KUBE-SERVICES"]);
        ns.ok(&[
            &format!("iptables-{backend}"),
            "-t",
            "nat",
            "-D",
            "PREROUTING",
            "-m",
            "comment",
            "--comment",
            "kubernetes service portals",
            "-j",
            "KUBE-SERVICES",
        ]);
        proxier.force_full_sync();
        now += Duration::from_secs(1);
        assert!(sync(&mut proxier, now).full);
        assert_same_rules(
            &expected_rules(backend, &cluster, random_fully),
            &canonical(ipt.as_ref()),
            &format!("{backend_name} after repair"),
        );
    }
}

/// Our chains (KUBE-*) and the rules in built-in chains that jump to them.
fn kube_state(ipt: &dyn Iptables) -> BTreeMap<String, Vec<String>> {
    let mut state = BTreeMap::new();
    for table in [Table::Filter, Table::Nat] {
        for (chain, rules) in chain_rules(ipt, table) {
            let kept: Vec<String> = if chain.starts_with("KUBE-") {
                rules
            } else {
                rules.into_iter().filter(|r| r.contains("-j KUBE-")).collect()
            };
            state.insert(format!("{table}/{chain}"), kept);
        }
    }
    state
}

#[test]
fn canary_flush_is_repaired_and_cleanup_removes_only_ours() {
    require_root!();
    for backend in BACKENDS {
        let ns = Netns::create("canary");
        let ipt = Arc::new(ns.runner(backend, IpFamily::V4));
        ipt.restore_all(FOREIGN.as_bytes(), FlushFlag::NoFlush, RestoreCounters::NoCounters).expect("foreign rules");
        let cluster = cluster();
        let mut proxier = new_proxier(ipt.clone());
        cluster.apply_to(&mut proxier);
        let mut now = Instant::now();
        sync(&mut proxier, now);
        let synced = kube_state(ipt.as_ref());

        let mut monitor = CanaryMonitor::new(ipt.clone(), "KUBE-PROXY-CANARY", &CANARY_TABLES, Duration::from_secs(30));
        assert!(!monitor.step(now).reload, "{backend}: canaries created");
        for table in ["mangle", "nat", "filter"] {
            ns.ok(&[&format!("iptables-{backend}"), "-t", table, "-S", "KUBE-PROXY-CANARY"]);
        }
        now += Duration::from_secs(30);
        assert!(!monitor.step(now).reload, "{backend}: nothing happened yet");

        // Someone flushes nat and removes the canaries, as a firewall reload would.
        let iptables = format!("iptables-{backend}");
        ns.ok(&[&iptables, "-t", "nat", "-F"]);
        for table in ["mangle", "nat", "filter"] {
            ns.ok(&[&iptables, "-t", table, "-X", "KUBE-PROXY-CANARY"]);
        }
        assert_ne!(kube_state(ipt.as_ref()), synced, "{backend}: the flush broke our rules");
        now += Duration::from_secs(30);
        let step = monitor.step(now);
        assert!(step.reload, "{backend}: the monitor notices within one interval");
        proxier.force_full_sync();
        assert!(sync(&mut proxier, now).full);
        assert_eq!(kube_state(ipt.as_ref()), synced, "{backend}: a full resync repaired our rules");
        assert!(!monitor.step(now).reload, "{backend}: canaries re-created");
        ns.ok(&[&iptables, "-t", "mangle", "-S", "KUBE-PROXY-CANARY"]);
        monitor.remove_canaries();

        // --cleanup: none of our chains left, other owners' rules untouched, idempotent.
        ipt.restore_all(FOREIGN.as_bytes(), FlushFlag::NoFlush, RestoreCounters::NoCounters).expect("foreign again");
        let report = cleanup_leftovers(ipt.as_ref());
        assert!(report.success(), "{backend}: {:?}", report.errors);
        assert!(report.kept_referenced.is_empty(), "{backend}");
        let after = kube_state(ipt.as_ref());
        let left: Vec<&String> =
            after.iter().filter(|(k, v)| k.contains("/KUBE-") || !v.is_empty()).map(|(k, _)| k).collect();
        assert_eq!(left, ["filter/INPUT", "filter/KUBE-FIREWALL", "filter/OUTPUT"], "{backend}: only kubelet's");
        assert_eq!(after["filter/INPUT"], ["-j KUBE-FIREWALL"], "{backend}");
        let nat = save(ipt.as_ref(), Table::Nat);
        assert!(nat.contains("-A FOREIGN -d 203.0.113.99/32 -j RETURN"), "{backend}\n{nat}");
        assert!(nat.contains("-A PREROUTING -d 203.0.113.99/32 -j FOREIGN"), "{backend}\n{nat}");
        assert!(save(ipt.as_ref(), Table::Filter).contains("203.0.113.98/32"), "{backend}");

        let before_second = canonical(ipt.as_ref());
        let report = cleanup_leftovers(ipt.as_ref());
        assert!(report.success(), "{backend}: second cleanup: {:?}", report.errors);
        assert!(report.deleted.is_empty(), "{backend}");
        assert_same_rules(&before_second, &canonical(ipt.as_ref()), &format!("{backend} second cleanup"));
    }
}

#[test]
fn failed_restore_is_reported_with_context_and_retried_full() {
    require_root!();
    for backend in BACKENDS {
        let ns = Netns::create("retry");
        let ipt = Arc::new(ns.runner(backend, IpFamily::V4));
        let mut cluster = cluster();
        let mut proxier = new_proxier(ipt.clone());
        cluster.apply_to(&mut proxier);
        let mut now = Instant::now();
        sync(&mut proxier, now);

        // Another owner jumps to web's service chain, so deleting web cannot delete it.
        let nat = chain_rules(ipt.as_ref(), Table::Nat);
        let web_svc = svc_chains(&nat, "ns1/web:p80").into_iter().find(|c| c.starts_with("KUBE-SVC-")).expect("svc");
        let iptables = format!("iptables-{backend}");
        ns.ok(&[&iptables, "-t", "nat", "-N", "FOREIGN"]);
        ns.ok(&[&iptables, "-t", "nat", "-A", "FOREIGN", "-d", "203.0.113.7/32", "-j", &web_svc]);

        let web = cluster.services.remove("web").expect("web");
        let web_slice = cluster.slices.remove("web").expect("web slice");
        proxier.on_service_state(NamespacedName::of_object(&web.metadata), None);
        proxier.on_endpoint_slice_update(&web_slice, true);
        now += Duration::from_secs(1);
        let report = match proxier.sync(now) {
            SyncOutcome::Synced(report) => report,
            SyncOutcome::NotInitialized => panic!("initialized"),
        };
        let err = report.result.as_ref().expect_err("the kernel refuses to delete a referenced chain");
        let message = err.to_string();
        let marked = message.lines().find(|l| l.starts_with('>')).unwrap_or_else(|| panic!("{backend}: {message}"));
        assert!(marked.contains(&format!("-X {web_svc}")), "{backend}: failing line marked: {message}");
        assert_eq!(report.retry_after, Some(Duration::from_secs(30)), "{backend}");

        // Once the reference is gone the retry, a full sync, succeeds and cleans up.
        ns.ok(&[&iptables, "-t", "nat", "-F", "FOREIGN"]);
        now += Duration::from_secs(30);
        let report = sync(&mut proxier, now);
        assert!(report.full, "{backend}: the sync after a failure is full");
        assert!(!chain_rules(ipt.as_ref(), Table::Nat).contains_key(&web_svc), "{backend}: {web_svc} deleted");
    }
}

#[test]
fn split_restore_reports_failing_lines_with_context_and_steps() {
    require_root!();
    let ns = Netns::create("split");
    let ipt = ns.runner_with(
        RunnerOptions { backend: Backend::Nft, split_budget: Some(1), ..RunnerOptions::default() },
        IpFamily::V4,
    );
    let data =
        "*nat\n:KUBE-A - [0:0]\n:KUBE-B - [0:0]\n-A KUBE-B -d 198.18.0.1/32 -j KUBE-A\n-A KUBE-A -j RETURN\nCOMMIT\n";
    let mut steps = 0;
    ipt.restore_input(&data.as_bytes(), FlushFlag::NoFlush, RestoreCounters::Counters, &mut || steps += 1)
        .expect("restore");
    assert_eq!(steps, 2, "one transaction per chain, leaf first");
    let nat = chain_rules(&ipt, Table::Nat);
    assert_eq!(nat["KUBE-B"], ["-d 198.18.0.1/32 -j KUBE-A"]);

    // The bad rule is in the second piece; its line in the input as applied (chains in
    // dependency order, declarations next to their rules) is reported, with its text.
    let data = "*nat\n:KUBE-C - [0:0]\n:KUBE-D - [0:0]\n-A KUBE-C -j RETURN\n-A KUBE-D --bogus-option\nCOMMIT\n";
    let err = ipt.restore_all(data.as_bytes(), FlushFlag::NoFlush, RestoreCounters::Counters).expect_err("bad");
    assert_eq!(err.restore_line(), Some(5), "{err}");
    let context = err.restore_context().expect("context");
    assert!(context.contains("> 5 | -A KUBE-D --bogus-option"), "{context}");
    assert!(context.contains("  4 | :KUBE-D - [0:0]"), "{context}");
    let nat = chain_rules(&ipt, Table::Nat);
    assert!(nat.contains_key("KUBE-C") && !nat.contains_key("KUBE-D"), "the first piece applied, the failed one not");
}

#[test]
fn chain_names_are_listed_cheaply_and_match_iptables_save() {
    require_root!();
    for backend in BACKENDS {
        let ns = Netns::create("list");
        let ipt = ns.runner(backend, IpFamily::V4);
        ipt.restore_all(FOREIGN.as_bytes(), FlushFlag::NoFlush, RestoreCounters::NoCounters).expect("foreign rules");
        let ours = "*nat\n:KUBE-SVC-ABCDEFGHIJKLMNOP - [0:0]\n:KUBE-SEP-ABCDEFGHIJKLMNOP - [0:0]\nCOMMIT\n";
        ipt.restore_all(ours.as_bytes(), FlushFlag::NoFlush, RestoreCounters::NoCounters).expect("ours");
        // Built-in chains nothing uses may be missing from nft's listing (iptables-nft-save
        // prints them regardless); they are never stale, so only the others must agree.
        let builtin = |c: &String| ["PREROUTING", "INPUT", "OUTPUT", "POSTROUTING"].contains(&c.as_str());
        let mut listed = ipt.list_chains(Table::Nat).expect("list chains");
        listed.retain(|c| !builtin(c));
        listed.sort();
        let mut saved: Vec<String> =
            kube_proxy_rs::iptables::save::chains_from_table(save(&ipt, Table::Nat).as_bytes()).into_iter().collect();
        saved.retain(|c| !builtin(c));
        saved.sort();
        assert_eq!(listed, saved, "{backend}");
        assert!(listed.iter().any(|c| c == "KUBE-SEP-ABCDEFGHIJKLMNOP"), "{backend}: {listed:?}");
    }
}
