//! The daemon assembled on fakes: dual stack when both families work, sysctls set, the
//! watches' events programming both families, health and metrics following the syncs, and
//! a clean shutdown that removes the canaries and leaves the rules.

use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Node;
use kube::runtime::watcher::Event;
use kube_proxy_rs::config::{KubeProxyConfiguration, Settings};
use kube_proxy_rs::conntrack::FakeConntrack;
use kube_proxy_rs::daemon::{Daemon, DaemonDeps, DaemonError};
use kube_proxy_rs::iptables::Table;
use kube_proxy_rs::iptables::fake::FakeIptables;
use kube_proxy_rs::k8s::{ServiceEvents, SliceEvents};
use kube_proxy_rs::model::IpFamily;
use kube_proxy_rs::proxier::StaticInterfaces;
use kube_proxy_rs::sysctl::FakeSysctl;
use tokio_util::sync::CancellationToken;

use crate::support::fixtures::{node, slice, svc};

fn settings() -> Settings {
    Settings::from_config(&KubeProxyConfiguration::default()).expect("default settings")
}

struct Fakes {
    v4: Arc<FakeIptables>,
    v6: Arc<FakeIptables>,
    sysctl: Arc<FakeSysctl>,
}

fn deps(v6_present: bool) -> (Fakes, DaemonDeps) {
    let v4 = Arc::new(FakeIptables::new(IpFamily::V4));
    let v6 = Arc::new(FakeIptables::new(IpFamily::V6));
    v6.set_present(v6_present);
    let sysctl = Arc::new(FakeSysctl::new());
    let deps = DaemonDeps {
        iptables_v4: Some(v4.clone()),
        iptables_v6: Some(v6.clone()),
        sysctl: sysctl.clone(),
        interfaces: Arc::new(StaticInterfaces(Vec::new())),
        conntrack: Some(Arc::new(FakeConntrack::new())),
        events: Arc::new(kube_proxy_rs::events::NoopEventRecorder),
    };
    (Fakes { v4, v6, sysctl }, deps)
}

fn dual_stack_node() -> Node {
    node(
        "node-a",
        &[("topology.kubernetes.io/zone", "z1")],
        &["10.0.1.0/24", "fd00:10:1::/64"],
        &["198.18.0.2", "fd00::2"],
    )
}

fn has_chain(ipt: &FakeIptables, prefix: &str) -> bool {
    ipt.chains(Table::Nat).iter().any(|c| c.starts_with(prefix))
}

#[test]
fn primary_family_must_be_supported() {
    let (_f, deps) = deps(false);
    let v6_node = node("node-a", &[], &[], &["fd00::2"]);
    match Daemon::build(&settings(), "node-a".into(), Some(&v6_node), &deps) {
        Err(DaemonError::PrimaryFamilyUnsupported(IpFamily::V6)) => {}
        Err(e) => panic!("unexpected error {e}"),
        Ok(_) => panic!("an IPv6 node without ip6tables must be refused"),
    }
    let d = Daemon::build(&settings(), "node-a".into(), Some(&dual_stack_node()), &deps).expect("single stack");
    assert_eq!(d.families.iter().map(|f| f.family).collect::<Vec<_>>(), [IpFamily::V4]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dual_stack_daemon_programs_both_families_and_shuts_down_cleanly() {
    let (fakes, deps) = deps(true);
    let n = dual_stack_node();
    let daemon = Daemon::build(&settings(), "node-a".into(), Some(&n), &deps).expect("daemon");
    assert_eq!(daemon.families.len(), 2, "both families work: dual stack");
    assert_eq!(
        fakes.sysctl.value("net/ipv4/conf/all/route_localnet"),
        Some(1),
        "localhost NodePorts need route_localnet"
    );

    let set = daemon.proxier_set();
    let health = daemon.health.clone();
    let metrics = daemon.metrics.clone();
    let shutdown = CancellationToken::new();
    let loops = tokio::spawn(daemon.run_loops(shutdown.clone(), None));

    let web = svc("ns1", "web").cluster_ips(&["172.30.0.1", "fd00:30::1"]).tcp("http", 80).build();
    let v4 = slice("ns1", "web", "web-v4").tcp("http", 8080).ips(&["10.0.1.5"]).build();
    let v6 = slice("ns1", "web", "web-v6").ipv6().tcp("http", 8080).ips(&["fd00:10:1::5"]).build();
    let mut services = ServiceEvents::default();
    let mut slices = SliceEvents::default();
    for e in [Event::Init, Event::InitApply(web), Event::InitDone] {
        services.handle(e, &set);
    }
    for e in [Event::Init, Event::InitApply(v4), Event::InitApply(v6), Event::InitDone] {
        slices.handle(e, &set);
    }

    let deadline = Instant::now() + Duration::from_secs(10);
    while !(has_chain(&fakes.v4, "KUBE-SEP-") && has_chain(&fakes.v6, "KUBE-SEP-")) {
        assert!(Instant::now() < deadline, "both families should be programmed");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let v4_rules = fakes.v4.save_all();
    assert!(v4_rules.contains("10.0.1.5:8080") && !v4_rules.contains("fd00:10:1::5"));
    let v6_rules = fakes.v6.save_all();
    assert!(v6_rules.contains("[fd00:10:1::5]:8080") && !v6_rules.contains("10.0.1.5"));
    assert_eq!(health.healthz().status().as_u16(), 200);
    let text = metrics.encode_text().expect("metrics");
    assert!(text.contains("kubeproxy_sync_proxy_rules_last_timestamp_seconds"), "{text}");
    // The change metrics follow the trackers: one Service event seen by each family's proxier,
    // one slice of each address type, and nothing pending once synced.
    for (metric, value) in [
        ("kubeproxy_sync_proxy_rules_service_changes_total", "2"),
        ("kubeproxy_sync_proxy_rules_endpoint_changes_total", "2"),
        ("kubeproxy_sync_proxy_rules_service_changes_pending", "0"),
        ("kubeproxy_sync_proxy_rules_endpoint_changes_pending", "0"),
    ] {
        assert!(text.lines().any(|l| l == format!("{metric} {value}")), "{metric} should be {value}:\n{text}");
    }

    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(10), loops).await.expect("loops stop").expect("loop task");
    for ipt in [&fakes.v4, &fakes.v6] {
        assert!(!has_chain(ipt, "KUBE-PROXY-CANARY"), "canaries removed on shutdown");
        assert!(has_chain(ipt, "KUBE-SVC-"), "service rules stay on shutdown");
    }
}
