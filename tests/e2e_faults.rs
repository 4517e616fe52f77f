//! Faults, end to end: the real `kube-proxy-rs` binary in a "node" namespace against the test
//! API server in an "api" namespace, with the API connection cut, its resource versions
//! expired (410 Gone), re-lists failing (500), the server stalled or down, `iptables-restore`
//! failing, and malformed objects served. Root only.
//!
//! "The node's rules match the API state exactly" is checked strongly: the expected rules are
//! computed by the library from the objects the server holds at that moment, through the
//! daemon's own assembly ([`Daemon::build`] from the same command line, on fake iptables with
//! the node's interface addresses and iptables features), rendered in one full sync, pushed
//! through the kernel once (restored into a fresh namespace and saved again, so both sides
//! carry the kernel's normalisation) and compared with the node's `iptables-nft-save` /
//! `ip6tables-nft-save` of filter and nat: chains sorted by name, counters zeroed, the
//! canary chains left out; rule order within each chain counts.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube_proxy_rs::daemon::sync_loop::lock;
use kube_proxy_rs::daemon::{Daemon, DaemonDeps};
use kube_proxy_rs::iptables::dump::Dump;
use kube_proxy_rs::iptables::fake::FakeIptables;
use kube_proxy_rs::iptables::runner::Backend;
use kube_proxy_rs::iptables::{FlushFlag, Iptables, RestoreCounters, Table};
use kube_proxy_rs::k8s::{LABEL_HEADLESS, LABEL_SERVICE_PROXY_NAME};
use kube_proxy_rs::model::{IpFamily, NamespacedName};
use kube_proxy_rs::proxier::{StaticInterfaces, SyncOutcome};
use kube_proxy_rs::tracker::testing::{ep, node, slice, svc};
use serde_json::json;

use crate::require_root;
use crate::support::apiserver::{ApiServer, Kind};
use crate::support::e2e::{
    DaemonProcess, HEALTHZ_ADDR, METRICS_ADDR, NODE_IP, TempDir, bind_in_netns, daemon_args, http_get,
    interface_addresses, nat, topology,
};
use crate::support::netns::Netns;
use crate::support::poll::poll_until;
use crate::support::{canonical_rules, line_diff};

const HOST: &str = "node-f";
const SYNC_PERIOD: Duration = Duration::from_secs(2);
/// How long the daemon gets to converge after a fault ends (watch backoff included).
const CONVERGE: Duration = Duration::from_secs(45);
/// Chains that are not the proxier's rules: the sync loop's canary and kubelet's.
const IGNORED_CHAINS: [&str; 2] = ["KUBE-PROXY-CANARY", "KUBE-KUBELET-CANARY"];
const FAMILIES: [IpFamily; 2] = [IpFamily::V4, IpFamily::V6];

/// A node running the daemon against the test API server. Fields drop in order: the daemon
/// first, then its files, the server and the namespaces.
struct Testbed {
    daemon: Option<DaemonProcess>,
    dir: TempDir,
    server: ApiServer,
    node_ns: Netns,
    api_ns: Netns,
    args: Vec<String>,
}

impl Testbed {
    /// The namespaces, the server holding this node's Node object, and the daemon's command
    /// line (not started yet).
    async fn new(tag: &str) -> Testbed {
        let (api_ns, node_ns, server) = topology(tag).await;
        server.create(&node(HOST, &[], &["198.19.0.0/24"], &[NODE_IP]));
        let dir = TempDir::new(tag);
        let mut args = daemon_args(&dir.kubeconfig(&server), HOST);
        args.extend([
            format!("--iptables-sync-period={}s", SYNC_PERIOD.as_secs()),
            "--iptables-min-sync-period=100ms".into(),
            "--cluster-cidr=198.19.0.0/16".into(),
            "-v=2".into(),
        ]);
        Testbed { daemon: None, dir, server, node_ns, api_ns, args }
    }

    /// Starts the daemon with `env` added to its environment.
    fn start(&mut self, env: &[(&str, &str)]) {
        let log = self.dir.path().join("daemon.log");
        self.daemon = Some(DaemonProcess::start(&self.node_ns, &self.args, log, env));
    }

    fn daemon(&mut self) -> &mut DaemonProcess {
        self.daemon.as_mut().expect("daemon started")
    }

    fn log(&self) -> String {
        self.daemon.as_ref().map(DaemonProcess::log_text).unwrap_or_default()
    }

    /// The daemon is still running and has not panicked.
    #[track_caller]
    fn assert_alive(&mut self) {
        let status = self.daemon().child.as_mut().expect("daemon running").try_wait().expect("wait");
        assert!(status.is_none(), "the daemon exited ({status:?}):\n{}", self.log());
        assert!(!self.log().contains("panicked"), "the daemon panicked:\n{}", self.log());
    }

    /// The expected rules of both families for the server's current objects (see the module
    /// docs), canonical.
    fn expected(&self) -> BTreeMap<IpFamily, String> {
        let cli = kube_proxy_rs::cmd::cli::Cli::try_parse_from(
            std::iter::once("kube-proxy-rs".to_string()).chain(self.args.clone()),
        )
        .expect("daemon flags parse");
        let cfg = kube_proxy_rs::cmd::options::effective_config(&cli.daemon).expect("effective config");
        let settings = kube_proxy_rs::config::Settings::from_config(&cfg).expect("valid settings");
        let hostname = settings.hostname_override.clone().expect("hostname override");
        let node: Option<Node> =
            self.server.objects::<Node>().into_iter().find(|n| n.metadata.name.as_deref() == Some(hostname.as_str()));

        let fakes: BTreeMap<IpFamily, Arc<FakeIptables>> = FAMILIES
            .into_iter()
            .map(|family| {
                let fake = Arc::new(FakeIptables::new(family));
                fake.set_has_random_fully(self.node_ns.runner(Backend::Nft, family).has_random_fully());
                (family, fake)
            })
            .collect();
        let deps = DaemonDeps {
            nftables_v4: None,
            nftables_v6: None,
            iptables_v4: Some(fakes[&IpFamily::V4].clone()),
            iptables_v6: Some(fakes[&IpFamily::V6].clone()),
            sysctl: Arc::new(kube_proxy_rs::node::sysctl::FakeSysctl::new()),
            interfaces: Arc::new(StaticInterfaces(interface_addresses(&self.node_ns))),
            conntrack: None,
            // The node under test has nfacct: its rules name the accounting objects.
            nfacct: Some(Arc::new(kube_proxy_rs::node::nfacct::FakeNfacct::new())),
            events: Arc::new(kube_proxy_rs::k8s::events::NoopEventRecorder),
        };
        let daemon = Daemon::build(&settings, hostname, node.as_ref(), &deps).expect("daemon assembles");
        assert_eq!(daemon.families.len(), 2, "dual stack, as the daemon runs in the namespace");

        let watched = |labels: &Option<BTreeMap<String, String>>| {
            labels.as_ref().is_none_or(|l| !l.contains_key(LABEL_SERVICE_PROXY_NAME) && !l.contains_key(LABEL_HEADLESS))
        };
        let services: Vec<Service> =
            self.server.objects::<Service>().into_iter().filter(|s| watched(&s.metadata.labels)).collect();
        let slices: Vec<EndpointSlice> =
            self.server.objects::<EndpointSlice>().into_iter().filter(|s| watched(&s.metadata.labels)).collect();
        let mut out = BTreeMap::new();
        for f in &daemon.families {
            let mut p = lock(f.iptables().expect("iptables mode"));
            for s in &services {
                p.on_service_state(NamespacedName::of_object(&s.metadata), Some(s));
            }
            for s in &slices {
                p.on_endpoint_slice_update(s, false);
            }
            p.on_services_synced();
            p.on_endpoint_slices_synced();
            match p.sync(Instant::now()) {
                SyncOutcome::Synced(report) => {
                    assert!(report.result.is_ok(), "expected-state sync failed: {:?}", report.result);
                }
                SyncOutcome::NotInitialized => panic!("expected-state proxier not initialized"),
            }
            let reference = Netns::create("ref");
            crate::support::e2e::create_nfacct_objects(&reference);
            let ipt = reference.runner(Backend::Nft, f.family);
            ipt.restore_all(fakes[&f.family].save_all().as_bytes(), FlushFlag::Flush, RestoreCounters::NoCounters)
                .expect("the expected rules restore into a real kernel");
            out.insert(f.family, canonical(&ipt));
        }
        out
    }

    /// The node's rules, canonical, per family.
    fn actual(&self) -> BTreeMap<IpFamily, String> {
        FAMILIES.into_iter().map(|f| (f, canonical(&self.node_ns.runner(Backend::Nft, f)))).collect()
    }

    /// Waits until the node's rules are exactly the expected rules for the API's current
    /// state, then checks they stay so across a periodic sync.
    async fn wait_exact(&mut self, what: &str) {
        let expected = self.expected();
        if poll_until(CONVERGE, Duration::from_millis(250), || self.actual() == expected).await.is_none() {
            let actual = self.actual();
            let mut text = String::new();
            for f in FAMILIES {
                text.push_str(&format!("{f}:\n{}", line_diff(&expected[&f], &actual[&f])));
            }
            panic!(
                "{what}: the node's rules do not match the API state (- expected, + actual):\n{text}\ndaemon log:\n{}",
                self.log()
            );
        }
        self.assert_alive();
        tokio::time::sleep(SYNC_PERIOD + Duration::from_millis(500)).await;
        let actual = self.actual();
        for f in FAMILIES {
            assert!(
                actual[&f] == expected[&f],
                "{what}: {f} rules changed after a periodic sync:\n{}",
                line_diff(&expected[&f], &actual[&f])
            );
        }
    }
}

/// filter and nat, chains sorted by name, counters zeroed, canaries left out.
fn canonical(ipt: &dyn Iptables) -> String {
    canonical_rules(ipt, &IGNORED_CHAINS)
}

/// A metric on the daemon's metrics port, summed over its series (from 1.33 the per-sync
/// metrics have one per `ip_family`); `None` when it has no series.
fn metric(ns: &Netns, name: &str) -> Option<f64> {
    let (_, body) = http_get(ns, METRICS_ADDR, "/metrics")?;
    let values: Vec<f64> = body
        .lines()
        .filter_map(|l| {
            let rest = l.strip_prefix(name)?;
            let value = match rest.strip_prefix('{') {
                Some(labelled) => labelled.split_once("} ")?.1,
                None => rest.strip_prefix(' ')?,
            };
            value.trim().parse().ok()
        })
        .collect();
    (!values.is_empty()).then(|| values.iter().sum())
}

fn web_slice(ips: &[&str]) -> EndpointSlice {
    slice("ns1", "web", "web-1").tcp("http", 8080).ips(ips).build()
}

/// A cluster with a service of each kind: ClusterIP with two endpoints, NodePort, UDP with
/// affinity, LoadBalancer with Local traffic policy and source ranges, and one without
/// endpoints (REJECT).
fn seed(server: &ApiServer) {
    server.create(&svc("ns1", "web").cluster_ip("198.18.100.1").tcp("http", 80).build());
    server.create(&web_slice(&["198.19.1.1", "198.19.1.2"]));
    server.create(&svc("ns1", "np").type_("NodePort").cluster_ip("198.18.100.2").node_port("http", 80, 30080).build());
    server.create(&slice("ns1", "np", "np-1").tcp("http", 8080).ips(&["198.19.2.1"]).build());
    server.create(&svc("ns2", "dns").cluster_ip("198.18.100.3").udp("dns", 53).affinity(Some(600)).build());
    server.create(&slice("ns2", "dns", "dns-1").udp("dns", 53).ips(&["198.19.3.1"]).build());
    server.create(
        &svc("ns2", "lb")
            .type_("LoadBalancer")
            .cluster_ip("198.18.100.4")
            .node_port("https", 443, 30443)
            .lb_ingress(&["198.18.200.10"])
            .source_ranges(&["198.18.201.0/24"])
            .external_policy("Local")
            .health_check_node_port(30600)
            .build(),
    );
    server.create(
        &slice("ns2", "lb", "lb-1")
            .tcp("https", 8443)
            .endpoint(ep("198.19.4.1").node(HOST))
            .endpoint(ep("198.19.4.2").node("other-node"))
            .build(),
    );
    server.create(&svc("ns3", "empty").cluster_ip("198.18.100.5").tcp("http", 80).build());
}

/// A seeded cluster with the daemon started and synced exactly.
async fn synced_testbed(tag: &str) -> Testbed {
    synced_testbed_with(tag, &[]).await
}

/// [`synced_testbed`] with `extra` daemon flags.
async fn synced_testbed_with(tag: &str, extra: &[&str]) -> Testbed {
    let mut t = Testbed::new(tag).await;
    t.args.extend(extra.iter().map(|a| a.to_string()));
    seed(&t.server);
    t.start(&[]);
    t.wait_exact("initial sync").await;
    t
}

/// Requests of `kind` made after the first `from` requests: (lists, watches).
fn requests_since(server: &ApiServer, from: usize, kind: Kind) -> (usize, usize) {
    let reqs = server.requests();
    let of_kind: Vec<_> = reqs[from..].iter().filter(|r| r.kind == Some(kind)).collect();
    (of_kind.iter().filter(|r| !r.watch).count(), of_kind.iter().filter(|r| r.watch).count())
}

/// Watches cut mid-stream while disconnected (requests held) a service is added, a slice
/// changes and a service with endpoints is deleted: the re-watch replays them and the rules
/// match the API exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_cut_while_services_change() {
    require_root!();
    let mut t = synced_testbed("fcut").await;
    let mark = t.server.requests().len();

    t.server.stall(Duration::from_secs(3));
    t.server.cut_watches();
    t.server.create(&svc("ns4", "added").cluster_ip("198.18.100.6").tcp("http", 80).build());
    t.server.create(&slice("ns4", "added", "added-1").tcp("http", 9090).ips(&["198.19.6.1"]).build());
    t.server.update(&web_slice(&["198.19.1.2", "198.19.1.3"]));
    t.server.delete(&svc("ns2", "dns").build());
    t.server.delete(&slice("ns2", "dns", "dns-1").build());
    assert_eq!(t.server.open_watches(Kind::Service), 0, "the changes were made while disconnected");
    assert_eq!(t.server.open_watches(Kind::EndpointSlice), 0, "the changes were made while disconnected");

    t.wait_exact("after the watch cut").await;
    let n = nat(&t.node_ns);
    assert!(n.contains("198.19.6.1:9090") && !n.contains("198.19.1.1:8080") && !n.contains("ns2/dns"), "{n}");
    let (_, watches) = requests_since(&t.server, mark, Kind::Service);
    assert!(watches >= 1, "the service watch was re-established");

    // Closed cleanly this time (an apiserver ending the watch): same outcome.
    t.server.close_watches();
    t.server.delete(&svc("ns1", "np").build());
    t.server.update(&slice("ns2", "lb", "lb-1").tcp("https", 8443).endpoint(ep("198.19.4.3").node(HOST)).build());
    t.wait_exact("after the watch was closed").await;
}

/// The resource versions expire while disconnected (410 Gone on the re-watch), with changes
/// including deletions of a service and of a slice: only a re-list recovers, and whatever is
/// not listed again must be deleted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_expired_410_relists_and_drops_deleted() {
    require_root!();
    let mut t = synced_testbed("fgone").await;
    let mark = t.server.requests().len();
    let expired_before = t.server.expired_watches();

    t.server.stall(Duration::from_secs(3));
    t.server.compact();
    t.server.delete(&svc("ns1", "web").build());
    t.server.delete(&web_slice(&[]));
    t.server.delete(&svc("ns3", "empty").build());
    t.server.delete(&slice("ns2", "lb", "lb-1").build());
    t.server.update(&slice("ns1", "np", "np-1").tcp("http", 8080).ips(&["198.19.2.1", "198.19.2.7"]).build());
    t.server.create(&svc("ns4", "late").cluster_ip("198.18.100.7").udp("dns", 53).build());
    t.server.create(&slice("ns4", "late", "late-1").udp("dns", 5353).ips(&["198.19.7.1"]).build());

    t.wait_exact("after 410 Gone").await;
    assert!(t.server.expired_watches() > expired_before, "the re-watch was answered 410 Gone");
    let (lists, _) = requests_since(&t.server, mark, Kind::Service);
    assert!(lists >= 1, "services were re-listed");
    let (lists, _) = requests_since(&t.server, mark, Kind::EndpointSlice);
    assert!(lists >= 1, "slices were re-listed");
    let n = nat(&t.node_ns);
    assert!(!n.contains("ns1/web") && !n.contains("198.19.4.1"), "deleted during the outage:\n{n}");
}

/// After 410 Gone the re-lists themselves fail (a burst of 500s) before one succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relist_500s_then_recovers() {
    require_root!();
    let mut t = synced_testbed("f500").await;
    let mark = t.server.requests().len();

    t.server.stall(Duration::from_secs(2));
    t.server.compact();
    t.server.fail_next_lists_of(Kind::Service, 3, 500);
    t.server.fail_next_lists_of(Kind::EndpointSlice, 3, 500);
    t.server.delete(&svc("ns1", "np").build());
    t.server.delete(&slice("ns1", "np", "np-1").build());
    t.server.update(&web_slice(&["198.19.1.9"]));
    t.server
        .create(&svc("ns4", "new").type_("NodePort").cluster_ip("198.18.100.8").node_port("http", 80, 30081).build());
    t.server.create(&slice("ns4", "new", "new-1").tcp("http", 80).ips(&["198.19.8.1", "198.19.8.2"]).build());

    t.wait_exact("after failing re-lists").await;
    assert_eq!(t.server.pending_failures(), 0, "every injected 500 was answered");
    for kind in [Kind::Service, Kind::EndpointSlice] {
        let (lists, _) = requests_since(&t.server, mark, kind);
        assert!(lists >= 4, "{kind:?}: three failed re-lists and a good one, got {lists}");
    }
}

/// `iptables-restore` wrappers, first on PATH: while `flag` exists they read their input and
/// fail as the real binary does when the kernel refuses a transaction; otherwise they run the
/// real binary. Every name the runner may run (default, nft and legacy, both families).
fn failing_restore_wrappers(bin: &std::path::Path, flag: &std::path::Path) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(bin).expect("wrapper dir");
    for family in ["iptables", "ip6tables"] {
        for infix in ["", "-nft", "-legacy"] {
            let name = format!("{family}{infix}-restore");
            let script = format!(
                "#!/bin/sh\nif [ -e '{flag}' ]; then\n  cat >/dev/null\n  echo \"{name} v1.8.9: injected failure: Resource temporarily unavailable\" >&2\n  exit 1\nfi\nexec /usr/sbin/{name} \"$@\"\n",
                flag = flag.display()
            );
            let path = bin.join(&name);
            std::fs::write(&path, script).expect("write wrapper");
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("chmod wrapper");
        }
    }
}

fn healthz(ns: &Netns) -> Option<u16> {
    http_get(ns, HEALTHZ_ADDR, "/healthz").map(|(status, _)| status)
}

/// Restores start failing after the daemon has synced; a change arrives. /healthz stays 200
/// for the first sync period and turns 503 once the change has waited 2 × syncPeriod; the
/// daemon keeps retrying (restore failures counted); once restores work again it recovers:
/// 200, and the rules include the change.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn iptables_restore_failures_turn_healthz_503_and_recover() {
    require_root!();
    let mut t = Testbed::new("frestore").await;
    seed(&t.server);
    let bin = t.dir.path().join("bin");
    let flag = t.dir.path().join("fail-restores");
    failing_restore_wrappers(&bin, &flag);
    let path = format!("{}:/usr/sbin:/usr/bin:/sbin:/bin", bin.display());
    t.start(&[("PATH", &path)]);
    t.wait_exact("initial sync through the wrappers").await;
    let (status, body) = http_get(&t.node_ns, HEALTHZ_ADDR, "/healthz").expect("healthz answers");
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("\"lastUpdated\""), "JSON body: {body}");
    // From 1.31 (the default is newer) the accounting objects' packet counts are exported,
    // read from the kernel at each scrape.
    for counter in [
        "kubeproxy_iptables_ct_state_invalid_dropped_packets_total",
        "kubeproxy_iptables_localhost_nodeports_accepted_packets_total",
    ] {
        let value = metric(&t.node_ns, counter);
        assert!(value.is_some_and(|v| v >= 0.0), "{counter}: {value:?}\n{}", t.log());
    }
    // From 1.33 (the default) a family's failure counter appears with its first failure.
    let failures_before =
        metric(&t.node_ns, "kubeproxy_sync_proxy_rules_iptables_restore_failures_total").unwrap_or(0.0);

    std::fs::write(&flag, "").expect("flag");
    let changed = Instant::now();
    t.server.create(&svc("ns4", "during").cluster_ip("198.18.100.9").tcp("http", 80).build());
    t.server.create(&slice("ns4", "during", "during-1").tcp("http", 8081).ips(&["198.19.9.1"]).build());

    // Healthy until the change has waited 2 × syncPeriod (upstream's health timeout).
    let mut saw_healthy_after_one_period = false;
    let unhealthy_at = loop {
        let status = healthz(&t.node_ns);
        let at = changed.elapsed();
        match status {
            Some(503) => break at,
            Some(200) => saw_healthy_after_one_period |= at >= SYNC_PERIOD,
            other => panic!("unexpected /healthz answer {other:?}\n{}", t.log()),
        }
        assert!(at < 2 * SYNC_PERIOD + Duration::from_secs(8), "/healthz never turned 503\n{}", t.log());
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    eprintln!("/healthz turned 503 {unhealthy_at:?} after the change");
    assert!(unhealthy_at >= 2 * SYNC_PERIOD, "503 after {unhealthy_at:?}, before 2 × syncPeriod");
    assert!(saw_healthy_after_one_period, "still 200 one sync period after the change");
    let (_, body) = http_get(&t.node_ns, HEALTHZ_ADDR, "/healthz").expect("healthz answers");
    assert!(body.contains("\"lastUpdated\"") && body.contains("\"currentTime\""), "JSON body: {body}");
    assert!(!nat(&t.node_ns).contains("198.19.9.1"), "nothing was written while restores fail");

    // It keeps retrying, every sync period.
    let mut failures = 0.0;
    let retried = poll_until(Duration::from_secs(20), Duration::from_millis(250), || {
        failures = metric(&t.node_ns, "kubeproxy_sync_proxy_rules_iptables_restore_failures_total").unwrap_or(0.0);
        failures >= failures_before + 3.0
    });
    if retried.await.is_none() {
        panic!("restore failures not retried: {failures}\n{}", t.log());
    }
    let log = t.log();
    assert!(log.matches("sync failed").count() >= 3, "each failure is logged:\n{log}");
    assert!(log.contains("injected failure"), "the restore's own message is logged:\n{log}");
    // Sync logs name their family (a dual-stack node runs two sync loops).
    assert!(log.contains("sync{family=IPv4}"), "sync logs carry the family span:\n{log}");
    t.assert_alive();

    std::fs::remove_file(&flag).expect("remove flag");
    let recovered =
        poll_until(Duration::from_secs(20), Duration::from_millis(100), || healthz(&t.node_ns) == Some(200));
    if recovered.await.is_none() {
        panic!("/healthz did not recover\n{}", t.log());
    }
    t.wait_exact("after restores work again").await;
    assert!(nat(&t.node_ns).contains("198.19.9.1:8081"), "the change made during the failure is programmed");
    assert_eq!(healthz(&t.node_ns), Some(200));
}

fn raw_service(name: &str, cluster_ip: &str, ports: serde_json::Value) -> serde_json::Value {
    json!({
        "kind": "Service",
        "metadata": {"namespace": "ns5", "name": name},
        "spec": {"type": "ClusterIP", "clusterIP": cluster_ip, "clusterIPs": [cluster_ip], "ipFamilies": ["IPv4"], "ports": ports},
    })
}

fn raw_slice(ns: &str, service: &str, name: &str, address: &str, protocol: &str) -> serde_json::Value {
    json!({
        "kind": "EndpointSlice",
        "metadata": {"namespace": ns, "name": name, "labels": {"kubernetes.io/service-name": service}},
        "addressType": "IPv4",
        "endpoints": [{"addresses": [address], "conditions": {"ready": true, "serving": true, "terminating": false}}],
        "ports": [{"name": "http", "protocol": protocol, "port": 8080}],
    })
}

/// Objects no valid API server would hold, served beside good ones: an invalid cluster IP, a
/// port out of range, duplicate port names, an unknown protocol, a slice endpoint with an
/// invalid address or one not in canonical form (`198.019.1.9`, `::ffff:198.19.1.10`, which
/// iptables rejects) and a slice port with an unknown protocol. The daemon stays up, warns
/// naming each, programs every good service exactly as the API says, and once the bad
/// objects are fixed or deleted matches the API exactly again. Run as 1.29, the release that
/// writes slice addresses as given (from 1.31 they are canonicalised instead, as the golden
/// scenario `bad-ips-1.31` shows, so the two spellings are not malformed there).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_objects_are_skipped_with_warnings() {
    require_root!();
    let mut t = synced_testbed_with("fbad", &["--compatibility-version=1.29"]).await;
    let http = |port: i64| json!([{"name": "http", "protocol": "TCP", "port": port}]);
    t.server.apply_raw(raw_service("bad-ip", "198.18.300.1", http(80)));
    t.server.apply_raw(raw_service("bad-port", "198.18.100.21", http(70000)));
    t.server.apply_raw(raw_service(
        "dup-ports",
        "198.18.100.22",
        json!([{"name": "http", "protocol": "TCP", "port": 80}, {"name": "http", "protocol": "TCP", "port": 81}]),
    ));
    t.server.apply_raw(raw_service(
        "bad-proto",
        "198.18.100.23",
        json!([{"name": "x", "protocol": "FOO", "port": 80}]),
    ));
    // A good service beside them, whose slice also carries a port of unknown protocol.
    t.server.create(&svc("ns5", "good").cluster_ip("198.18.100.24").tcp("http", 80).build());
    t.server.create(&slice("ns5", "good", "good-1").tcp("http", 8080).ips(&["198.19.5.1"]).build());
    t.server.apply_raw(raw_slice("ns5", "good", "good-proto", "198.19.5.2", "FOO"));
    // A second slice of web with an endpoint address that is not an IP, and two more whose
    // addresses a 1.29-era API server accepts but iptables rejects (every restore of the
    // family would fail, as it does with upstream 1.29).
    t.server.apply_raw(raw_slice("ns1", "web", "web-bad", "198.19.999.1", "TCP"));
    t.server.apply_raw(raw_slice("ns1", "web", "web-zeros", "198.019.1.9", "TCP"));
    t.server.apply_raw(raw_slice("ns1", "web", "web-mapped", "::ffff:198.19.1.10", "TCP"));

    t.wait_exact("with malformed objects").await;
    let n = nat(&t.node_ns);
    for good in ["198.19.5.1:8080", "198.19.1.1:8080", "198.19.2.1:8080", "198.19.4.1:8443"] {
        assert!(n.contains(&format!("--to-destination {good}")), "good endpoint {good} programmed:\n{n}");
    }
    for bad in
        ["198.18.100.21", "198.18.100.22", "198.18.100.23", "198.19.999.1", "198.19.5.2", "198.19.1.9", "198.19.1.10"]
    {
        assert!(!n.contains(bad), "{bad} of a malformed object must not be programmed:\n{n}");
    }
    let log = t.log();
    let warnings: Vec<&str> = log.lines().filter(|l| l.contains("WARN")).collect();
    // Services by namespace/name; slices by their name and their service's namespace/name.
    let named = |words: &[&str]| warnings.iter().any(|l| words.iter().all(|w| l.contains(w)));
    for words in [
        &["ns5/bad-ip", "198.18.300.1"][..],
        &["ns5/bad-port", "70000"],
        &["ns5/dup-ports", "duplicates port name"],
        &["ns5/bad-proto", "FOO"],
        &["ns5/good", "\"good-proto\"", "FOO"],
        &["ns1/web", "\"web-bad\"", "198.19.999.1"],
        &["ns1/web", "\"web-zeros\"", "198.019.1.9", "canonical"],
        &["ns1/web", "\"web-mapped\"", "::ffff:198.19.1.10", "canonical"],
    ] {
        assert!(named(words), "no warning naming {words:?}:\n{}", warnings.join("\n"));
    }
    t.assert_alive();

    // Fixed or deleted: exactly the API again.
    t.server.apply_raw(raw_service("bad-ip", "198.18.100.20", http(80)));
    t.server.apply_raw(raw_service("bad-port", "198.18.100.21", http(7000)));
    t.server.delete_named(Kind::Service, "ns5", "dup-ports");
    t.server.delete_named(Kind::Service, "ns5", "bad-proto");
    t.server.apply_raw(raw_slice("ns5", "good", "good-proto", "198.19.5.2", "TCP"));
    t.server.delete_named(Kind::EndpointSlice, "ns1", "web-bad");
    t.server.apply_raw(raw_slice("ns1", "web", "web-zeros", "198.19.1.9", "TCP"));
    t.server.delete_named(Kind::EndpointSlice, "ns1", "web-mapped");
    t.wait_exact("after the malformed objects were fixed").await;
    assert!(nat(&t.node_ns).contains("--to-destination 198.19.5.2:8080"), "the fixed slice port is programmed");
    assert!(nat(&t.node_ns).contains("--to-destination 198.19.1.9:8080"), "the fixed slice address is programmed");
    let filter = t.node_ns.ok(&["iptables-nft-save", "-t", "filter"]);
    assert!(filter.contains("-d 198.18.100.20/32") && filter.contains("ns5/bad-ip:http has no endpoints"), "{filter}");
    t.assert_alive();
}

/// Our chains (other than the canary) in the node's filter and nat tables, both families.
fn programmed_chains(ns: &Netns) -> Vec<String> {
    let mut out = Vec::new();
    for family in FAMILIES {
        let ipt = ns.runner(Backend::Nft, family);
        for table in [Table::Filter, Table::Nat] {
            let mut buf = Vec::new();
            ipt.save_into(table, &mut buf).expect("save");
            let dump = Dump::parse(&String::from_utf8(buf).expect("utf-8")).expect("save output parses");
            for t in &dump.tables {
                for c in &t.chains {
                    let ours = c.name.starts_with("KUBE-") && !IGNORED_CHAINS.contains(&c.name.as_str());
                    let jumps = c.rules.iter().any(|r| r.contains("-j KUBE-"));
                    if ours || jumps {
                        out.push(format!("{family} {table} {}", c.name));
                    }
                }
            }
        }
    }
    out
}

/// The EndpointSlice list is held at start-up while the Service list answers at once: the
/// daemon must not program anything until both initial lists are in (upstream's
/// initialized gate), then programs exactly the API state.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_slice_list_at_startup_programs_nothing_until_listed() {
    require_root!();
    let mut t = Testbed::new("fstall").await;
    seed(&t.server);
    let stall = Duration::from_secs(8);
    t.server.stall_of(Kind::EndpointSlice, stall);
    let stalled = Instant::now();
    t.start(&[]);

    let mut services_listed = false;
    while stalled.elapsed() < stall - Duration::from_millis(1500) {
        services_listed |= t.log().contains("services listed");
        let chains = programmed_chains(&t.node_ns);
        assert!(chains.is_empty(), "programmed before the slices were listed: {chains:?}\n{}", t.log());
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    assert!(services_listed, "the service list came in while slices were held:\n{}", t.log());
    assert!(!t.log().contains("endpoint slices listed"), "the slice list was held:\n{}", t.log());
    t.wait_exact("once the slice list arrived").await;
}

/// The API server goes away (connections refused, open watches dropped) and comes back on
/// the same address, twice: the rules stay while it is gone, and the changes made meanwhile
/// (the second time with the resource versions expired too, as after an etcd compaction)
/// are all applied once it is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_server_down_then_back_loses_nothing() {
    require_root!();
    let mut t = synced_testbed("fdown").await;
    let addr = t.server.addr().to_string();
    for round in 0..2 {
        let before = t.actual();
        t.server.go_down();
        let down = Instant::now();
        if round == 1 {
            t.server.compact();
        }
        t.server.create(
            &svc("ns6", &format!("while-down-{round}"))
                .cluster_ip(&format!("198.18.100.{}", 30 + round))
                .tcp("http", 80)
                .build(),
        );
        t.server.create(
            &slice("ns6", &format!("while-down-{round}"), &format!("while-down-{round}-1"))
                .tcp("http", 80)
                .ips(&[&format!("198.19.6.{}", 10 + round)])
                .build(),
        );
        if round == 0 {
            t.server.delete(&svc("ns2", "dns").build());
            t.server.update(&web_slice(&["198.19.1.5"]));
        } else {
            t.server.delete(&svc("ns1", "web").build());
            t.server.delete(&web_slice(&[]));
            t.server.delete(&slice("ns2", "dns", "dns-1").build());
        }
        // Gone for a while: the rules stay as they were and the daemon keeps running.
        while down.elapsed() < Duration::from_secs(4) {
            tokio::time::sleep(Duration::from_millis(500)).await;
            let now = t.actual();
            if now != before {
                let text: String =
                    FAMILIES.into_iter().map(|f| format!("{f}:\n{}", line_diff(&before[&f], &now[&f]))).collect();
                panic!(
                    "round {round}: rules changed while the API server was down (- before, + now):\n{text}\n{}",
                    t.log()
                );
            }
            assert_eq!(healthz(&t.node_ns), Some(200), "round {round}: nothing queued, so still healthy");
        }
        t.assert_alive();
        t.server.come_back_on(bind_in_netns(&t.api_ns.name, &addr));
        t.wait_exact(&format!("round {round}: after the API server came back")).await;
    }
    assert!(t.server.expired_watches() >= 1, "the second outage expired the watches");
}
