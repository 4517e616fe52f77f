//! Kubernetes Events: the start-up event on the Node, one Warning per problem for Services and
//! EndpointSlices skipped as invalid (not repeated by syncs or re-lists), a busy health-check
//! port reported on its Service and retried, and the real recorder posting correctly shaped
//! events.k8s.io/v1 Events (repeats folded into a series) to the test API server.

use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::runtime::watcher::Event;
use kube_proxy_rs::config::{KubeProxyConfiguration, Settings};
use kube_proxy_rs::daemon::sync_loop::lock;
use kube_proxy_rs::daemon::{Daemon, DaemonDeps, report_conntrack_outcome};
use kube_proxy_rs::iptables::fake::FakeIptables;
use kube_proxy_rs::k8s::events::{
    EventOptions, EventRecord, EventRecorder, EventType, FakeEventRecorder, KubeEventRecorder, node_ref,
    reporting_instance, service_ref,
};
use kube_proxy_rs::k8s::{ServiceEvents, SliceEvents};
use kube_proxy_rs::model::{IpFamily, NamespacedName};
use kube_proxy_rs::node::sysctl::{ConntrackOutcome, FakeSysctl};
use kube_proxy_rs::proxier::StaticInterfaces;
use kube_proxy_rs::serve::healthcheck::ServiceHealthServer;
use kube_proxy_rs::tracker::testing::{node, slice, svc};
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use crate::support::apiserver::ApiServer;
use crate::support::poll::eventually_fast;

const NODE: &str = "node-a";
/// How long a wait for the recorder or the test API server may take.
const WAIT: Duration = Duration::from_secs(10);

/// A daemon on fake iptables (both families when `dual_stack`) reporting to `events`.
fn daemon(events: Arc<FakeEventRecorder>, dual_stack: bool) -> Daemon {
    daemon_on(events, dual_stack, Arc::new(FakeIptables::new(IpFamily::V4)))
}

/// [`daemon`], with its IPv4 rules in `v4`.
fn daemon_on(events: Arc<FakeEventRecorder>, dual_stack: bool, v4: Arc<FakeIptables>) -> Daemon {
    daemon_of_release(events, dual_stack, v4, "")
}

/// [`daemon_on`] behaving as `release` (`compatibilityVersion`; empty: the newest).
fn daemon_of_release(events: Arc<FakeEventRecorder>, dual_stack: bool, v4: Arc<FakeIptables>, release: &str) -> Daemon {
    let config = KubeProxyConfiguration { compatibility_version: release.into(), ..KubeProxyConfiguration::default() };
    let mut settings = Settings::from_config(&config).expect("default settings");
    settings.min_sync_period = Duration::from_millis(50);
    let v6 = Arc::new(FakeIptables::new(IpFamily::V6));
    v6.set_present(dual_stack);
    let deps = DaemonDeps {
        nftables_v4: None,
        nftables_v6: None,
        iptables_v4: Some(v4),
        iptables_v6: Some(v6),
        sysctl: Arc::new(FakeSysctl::new()),
        interfaces: Arc::new(StaticInterfaces(Vec::new())),
        conntrack: None,
        nfacct: None,
        events,
    };
    let n = node(NODE, &[], &["10.0.1.0/24", "fd00:10:1::/64"], &["198.18.0.2", "fd00::2"]);
    Daemon::build(&settings, NODE.into(), Some(&n), &deps).expect("daemon")
}

fn with_version<T: kube::Resource>(mut obj: T, uid: &str, rv: &str) -> T {
    obj.meta_mut().uid = Some(uid.into());
    obj.meta_mut().resource_version = Some(rv.into());
    obj
}

fn sync_all(d: &Daemon) {
    for f in &d.families {
        lock(f.iptables().expect("iptables mode")).sync(Instant::now());
    }
}

#[test]
fn startup_event_is_on_the_node() {
    let events = Arc::new(FakeEventRecorder::new());
    let d = daemon(events.clone(), false);
    assert!(events.records().is_empty(), "building the daemon raises nothing");
    d.birth_cry();
    assert_eq!(
        events.records(),
        vec![EventRecord {
            regarding: node_ref(NODE),
            type_: EventType::Normal,
            reason: "Starting".into(),
            action: "StartKubeProxy".into(),
            note: String::new(),
        }]
    );
    let r = &events.records()[0].regarding;
    assert_eq!((r.kind.as_deref(), r.name.as_deref(), r.uid.as_deref()), (Some("Node"), Some(NODE), Some(NODE)));
}

#[test]
fn a_read_only_sys_is_reported_on_the_node_as_upstream_does() {
    let events = FakeEventRecorder::new();
    report_conntrack_outcome(&ConntrackOutcome { read_only_sysfs: false }, NODE, &events);
    assert!(events.records().is_empty());
    report_conntrack_outcome(&ConntrackOutcome { read_only_sysfs: true }, NODE, &events);
    let records = events.records();
    assert_eq!(records.len(), 1);
    assert_eq!(records[0].regarding, node_ref(NODE));
    assert_eq!(records[0].type_, EventType::Warning);
    assert_eq!(records[0].reason, "readOnlySysFS");
    assert_eq!(records[0].action, "StartKubeProxy");
    assert!(records[0].note.starts_with("CRI error: /sys is read-only"), "{}", records[0].note);
}

#[test]
fn an_invalid_service_gets_one_warning_per_problem_and_version() {
    let events = Arc::new(FakeEventRecorder::new());
    let d = daemon(events.clone(), true);
    let set = d.proxier_set();
    let mut services = ServiceEvents::with_events(events.clone());
    let bad = |rv: &str| {
        with_version(svc("ns1", "bad").cluster_ips(&["172.30.0.9", "fd00:30::9"]).tcp("http", 0).build(), "uid-bad", rv)
    };
    let good = svc("ns1", "good").cluster_ips(&["172.30.0.1", "fd00:30::1"]).tcp("http", 80).build();
    for e in [Event::Init, Event::InitApply(bad("5")), Event::InitApply(good.clone()), Event::InitDone] {
        services.handle(e, &set);
    }
    let warnings = events.records();
    // Both families reject it for the same reason: one event.
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    let w = &warnings[0];
    assert_eq!((w.type_, w.reason.as_str(), w.action.as_str()), (EventType::Warning, "InvalidService", "Skip"));
    assert_eq!(w.note, "service ns1/bad: spec.ports[0] (\"http\") has port 0 outside 1-65535");
    assert_eq!(w.regarding.kind.as_deref(), Some("Service"));
    assert_eq!(w.regarding.api_version.as_deref(), Some("v1"));
    assert_eq!(w.regarding.namespace.as_deref(), Some("ns1"));
    assert_eq!(w.regarding.name.as_deref(), Some("bad"));
    assert_eq!(w.regarding.uid.as_deref(), Some("uid-bad"));

    // Syncs and a re-list of the same version repeat nothing.
    for _ in 0..3 {
        sync_all(&d);
    }
    for e in [Event::Init, Event::InitApply(bad("5")), Event::InitApply(good.clone()), Event::InitDone] {
        services.handle(e, &set);
    }
    sync_all(&d);
    assert_eq!(events.records().len(), 1, "{:?}", events.records());

    // A new version still broken: reported again. Fixed: nothing. Broken again: reported.
    services.handle(Event::Apply(bad("6")), &set);
    assert_eq!(events.records().len(), 2);
    let fixed = with_version(
        svc("ns1", "bad").cluster_ips(&["172.30.0.9", "fd00:30::9"]).tcp("http", 80).build(),
        "uid-bad",
        "7",
    );
    services.handle(Event::Apply(fixed), &set);
    assert_eq!(events.records().len(), 2);
    services.handle(Event::Apply(bad("8")), &set);
    assert_eq!(events.records().len(), 3);

    // A problem of one family only (an IPv6 cluster IP that is not IPv6) names that family.
    let family = with_version(
        svc("ns1", "fam").cluster_ips(&["172.30.0.3", "172.30.0.4"]).tcp("http", 80).build(),
        "uid-fam",
        "9",
    );
    let mut family = family;
    family.spec.as_mut().unwrap().ip_families = Some(vec!["IPv4".into(), "IPv6".into()]);
    events.clear();
    services.handle(Event::Apply(family), &set);
    let notes: Vec<String> = events.records().into_iter().map(|r| r.note).collect();
    assert_eq!(notes.len(), 1, "{notes:?}");
    assert!(notes[0].contains("\"172.30.0.4\"") && notes[0].contains("IPv6"), "{notes:?}");
    // Valid services never raise anything.
    assert!(events.records().iter().all(|r| r.regarding.name.as_deref() != Some("good")));
}

#[test]
fn an_endpoint_slice_without_a_service_is_warned_about_once() {
    let events = Arc::new(FakeEventRecorder::new());
    let d = daemon(events.clone(), false);
    let set = d.proxier_set();
    let mut slices = SliceEvents::with_events(events.clone());
    let orphan = |rv: &str| -> EndpointSlice {
        let mut s = slice("ns1", "web", "orphan").tcp("http", 8080).ips(&["10.0.1.5"]).build();
        s.metadata.labels = None;
        with_version(s, "uid-orphan", rv)
    };
    let fine = slice("ns1", "web", "web-1").tcp("http", 8080).ips(&["10.0.1.6"]).build();
    for e in [Event::Init, Event::InitApply(orphan("3")), Event::InitApply(fine.clone()), Event::InitDone] {
        slices.handle(e, &set);
    }
    for e in [Event::Init, Event::InitApply(orphan("3")), Event::InitApply(fine), Event::InitDone] {
        slices.handle(e, &set);
    }
    sync_all(&d);
    let records = events.records();
    assert_eq!(records.len(), 1, "{records:?}");
    assert_eq!(records[0].reason, "InvalidEndpointSlice");
    assert_eq!(records[0].note, "endpoint slice ns1/orphan: no kubernetes.io/service-name label");
    assert_eq!(records[0].regarding.kind.as_deref(), Some("EndpointSlice"));
    assert_eq!(records[0].regarding.api_version.as_deref(), Some("discovery.k8s.io/v1"));

    // FQDN slices are not for proxies: never invalid here.
    let mut fqdn = orphan("4");
    fqdn.address_type = "FQDN".into();
    fqdn.metadata.name = Some("fqdn".into());
    slices.handle(Event::Apply(fqdn), &set);
    assert_eq!(events.records().len(), 1);
}

/// A Service and a slice with address spellings a 1.29-era API server accepts but iptables
/// rejects or reads as octal.
fn oddly_spelled_objects() -> (Service, EndpointSlice) {
    let lb = svc("ns1", "lb")
        .type_("LoadBalancer")
        .cluster_ips(&["172.30.0.5", "fd00:30::5"])
        .tcp("http", 80)
        .external_ips(&["010.1.1.1", "203.0.113.9"])
        .lb_ingress(&["203.0.113.10", "::ffff:203.0.113.11"])
        .source_ranges(&["203.0.113.0/24", "10.0.0.0/08", "fd00::/08"])
        .build();
    let web = slice("ns1", "lb", "lb-1").tcp("http", 8080).ips(&["10.0.1.5", "010.244.1.6", "10.244.1.09"]).build();
    (lb, web)
}

/// Feeds `lb` and `web` through the watches' event handling and syncs; returns the Warning
/// notes raised, as (object, note).
fn warnings_for(d: &Daemon, events: &Arc<FakeEventRecorder>, lb: Service, web: EndpointSlice) -> Vec<(String, String)> {
    let set = d.proxier_set();
    let mut services = ServiceEvents::with_events(events.clone());
    let mut slices = SliceEvents::with_events(events.clone());
    for e in [Event::Init, Event::InitApply(with_version(lb, "uid-lb", "1")), Event::InitDone] {
        services.handle(e, &set);
    }
    for e in [Event::Init, Event::InitApply(with_version(web, "uid-web", "1")), Event::InitDone] {
        slices.handle(e, &set);
    }
    sync_all(d);
    assert!(events.records().iter().all(|r| r.type_ == EventType::Warning));
    events.records().into_iter().map(|r| (r.regarding.name.unwrap_or_default(), r.note)).collect()
}

/// 1.29 writes these strings verbatim, so kube-proxy-rs skips the ones not spelled
/// canonically: each raises a Warning on its object, naming the field and what it means,
/// while the rest of the object is still used.
#[test]
fn addresses_not_in_canonical_form_are_warned_about_on_their_objects() {
    let events = Arc::new(FakeEventRecorder::new());
    let v4 = Arc::new(FakeIptables::new(IpFamily::V4));
    let d = daemon_of_release(events.clone(), true, v4.clone(), "1.29");
    let (lb, web) = oddly_spelled_objects();
    let notes = warnings_for(&d, &events, lb, web);
    // The problems an object shows at once are one Warning (notes joined by "; ").
    let expected = [
        (
            "lb",
            [
                "service ns1/lb: spec.externalIPs: \"010.1.1.1\" is not in canonical form (it means 10.1.1.1); skipped",
                "service ns1/lb: status.loadBalancer.ingress: \"::ffff:203.0.113.11\" is not in canonical form (it means 203.0.113.11); skipped",
                "service ns1/lb: spec.loadBalancerSourceRanges: \"10.0.0.0/08\" is not in canonical form (it means 10.0.0.0/8); skipped",
                "service ns1/lb: spec.loadBalancerSourceRanges: \"fd00::/08\" is not in canonical form (it means fd00::/8); skipped",
            ]
            .as_slice(),
        ),
        (
            "lb-1",
            [
                "endpoint slice ns1/lb-1: endpoints[1].addresses[0]: \"010.244.1.6\" is not in canonical form (it means 10.244.1.6); endpoint skipped",
                "endpoint slice ns1/lb-1: endpoints[2].addresses[0]: \"10.244.1.09\" is not in canonical form (it means 10.244.1.9); endpoint skipped",
            ]
            .as_slice(),
        ),
    ];
    let expected: Vec<(String, String)> = expected.iter().map(|(o, n)| ((*o).to_owned(), n.join("; "))).collect();
    assert_eq!(notes, expected);

    // What remains is used: the canonical external IP, ingress IP, range and endpoint.
    let nat = v4.save_all();
    for present in ["-d 203.0.113.9 ", "-d 203.0.113.10 ", "-s 203.0.113.0/24", "10.0.1.5:8080"] {
        assert!(nat.contains(present), "{present} missing:\n{nat}");
    }
    for absent in ["010.1.1.1", "8.1.1.1", "10.1.1.1", "203.0.113.11", "10.0.0.0", "244.1.6", "244.1.9"] {
        assert!(!nat.contains(absent), "{absent} must not be programmed:\n{nat}");
    }
}

/// From 1.30 upstream parses Service addresses, from 1.31 EndpointSlice addresses too, and
/// writes them canonically (upstream-versions.md rows 14, 15): the same objects raise no
/// Warning and every address is programmed in canonical form.
#[test]
fn from_1_31_addresses_are_written_canonically_without_warnings() {
    let events = Arc::new(FakeEventRecorder::new());
    let v4 = Arc::new(FakeIptables::new(IpFamily::V4));
    let d = daemon_on(events.clone(), true, v4.clone());
    let (lb, web) = oddly_spelled_objects();
    let notes = warnings_for(&d, &events, lb, web);
    assert!(notes.is_empty(), "{notes:#?}");

    let nat = v4.save_all();
    for present in [
        "-d 10.1.1.1 ",
        "-d 203.0.113.9 ",
        "-d 203.0.113.10 ",
        "-d 203.0.113.11 ",
        "-s 10.0.0.0/8 ",
        "-s 203.0.113.0/24",
        "10.0.1.5:8080",
        "--to-destination 10.244.1.6:8080",
        "--to-destination 10.244.1.9:8080",
    ] {
        assert!(nat.contains(present), "{present} missing:\n{nat}");
    }
    for absent in ["010.", "::ffff:", "/08", "1.09"] {
        assert!(!nat.contains(absent), "{absent} must not be programmed:\n{nat}");
    }
}

/// A free port on loopback, held by the returned listener until it is dropped.
fn squat() -> (std::net::TcpListener, u16) {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = l.local_addr().expect("addr").port();
    (l, port)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_health_check_port_is_reported_on_its_service_and_retried() {
    let events = Arc::new(FakeEventRecorder::new());
    let d = daemon(events.clone(), false);
    let (squatter, port) = squat();
    let lb = svc("ns1", "lb")
        .type_("LoadBalancer")
        .cluster_ip("172.30.0.5")
        .node_port("http", 80, 30080)
        .local_traffic()
        .health_check_node_port(i32::from(port))
        .build();
    let ep = |ip: &str| slice("ns1", "lb", "lb-1").tcp("http", 8080).ips(&[ip]).build();

    let set = d.proxier_set();
    let shutdown = CancellationToken::new();
    let hc = Arc::new(ServiceHealthServer::new(
        NODE,
        vec![IpAddr::V4(Ipv4Addr::LOCALHOST)],
        d.health.clone(),
        tokio::runtime::Handle::current(),
        shutdown.clone(),
    ));
    let loops = tokio::spawn(d.run_loops(shutdown.clone(), Some(hc.clone())));
    let mut services = ServiceEvents::default();
    let mut slices = SliceEvents::default();
    for e in [Event::Init, Event::InitApply(lb), Event::InitDone] {
        services.handle(e, &set);
    }
    for e in [Event::Init, Event::InitApply(ep("10.0.1.5")), Event::InitDone] {
        slices.handle(e, &set);
    }

    let failed = || events.with_reason("FailedToStartServiceHealthcheck");
    eventually_fast("a FailedToStartServiceHealthcheck event", WAIT, || !failed().is_empty()).await;
    let e = &failed()[0];
    assert_eq!(e.type_, EventType::Warning);
    assert_eq!(e.action, "Listen");
    assert_eq!(e.regarding, service_ref(&NamespacedName::new("ns1", "lb")));
    let prefix = format!("node {NODE} failed to start healthcheck \"ns1/lb\" on port {port}: ");
    assert!(e.note.starts_with(&prefix), "{}", e.note);
    // The next sync (here: after an endpoint change) retries, and reports again; the
    // recorder folds the repeats into a series.
    slices.handle(Event::Apply(ep("10.0.1.6")), &set);
    eventually_fast("a retry", WAIT, || failed().len() >= 2).await;
    assert!(hc.listeners().is_empty());

    // The port comes free: the next sync opens it, and the reports stop.
    drop(squatter);
    slices.handle(Event::Apply(ep("10.0.1.7")), &set);
    eventually_fast("the health check to open", WAIT, || !hc.listeners().is_empty()).await;
    let reported = failed().len();
    slices.handle(Event::Apply(ep("10.0.1.8")), &set);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(failed().len(), reported, "no report once the port is open");

    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(10), loops)
        .await
        .expect("loops stop")
        .expect("loop task")
        .expect("no loop ended before shutdown");
}

fn fast_options() -> EventOptions {
    EventOptions { flush_interval: Duration::from_millis(100), ..EventOptions::default() }
}

fn event_named<'a>(events: &'a [Value], reason: &str, note: &str) -> Option<&'a Value> {
    events.iter().find(|e| e["reason"] == reason && e["note"] == note)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kube_recorder_posts_events_k8s_io_v1_events_and_folds_repeats() {
    let server = ApiServer::start().await;
    let shutdown = CancellationToken::new();
    let (recorder, task) =
        KubeEventRecorder::start(server.client(), reporting_instance(NODE), fast_options(), shutdown.clone());
    let lb = service_ref(&NamespacedName::new("ns1", "lb"));
    let busy = "node node-a failed to start healthcheck \"ns1/lb\" on port 30000: address in use";

    recorder.record(node_ref(NODE), EventType::Normal, "Starting", "StartKubeProxy", "");
    for _ in 0..3 {
        recorder.record(lb.clone(), EventType::Warning, "FailedToStartServiceHealthcheck", "Listen", busy);
    }
    eventually_fast("the series count", WAIT, || {
        event_named(&server.events(), "FailedToStartServiceHealthcheck", busy)
            .is_some_and(|e| e["series"]["count"] == 3)
    })
    .await;

    let events = server.events();
    assert_eq!(events.len(), 2, "repeats patch one Event: {events:#?}");
    let start = event_named(&events, "Starting", "").expect("start-up event");
    assert_eq!(start["apiVersion"], "events.k8s.io/v1");
    assert_eq!(start["kind"], "Event");
    let name = start["metadata"]["name"].as_str().expect("name");
    let suffix = name.strip_prefix("node-a.").expect("named after the node");
    assert!(u64::from_str_radix(suffix, 16).is_ok(), "hex timestamp suffix: {name}");
    assert_eq!(start["metadata"]["namespace"], "default");
    assert_eq!(start["reportingController"], "kube-proxy");
    assert_eq!(start["reportingInstance"], "kube-proxy-node-a");
    assert_eq!(start["action"], "StartKubeProxy");
    assert_eq!(start["type"], "Normal");
    assert_eq!(start["regarding"], serde_json::json!({"kind": "Node", "name": "node-a", "uid": "node-a"}));
    let time = start["eventTime"].as_str().expect("eventTime");
    assert!(time.len() == 27 && time.ends_with('Z') && time.as_bytes()[19] == b'.', "microseconds: {time}");
    assert!(start.get("series").is_none(), "a singleton has no series");

    let warn = event_named(&events, "FailedToStartServiceHealthcheck", busy).expect("warning");
    assert_eq!(warn["metadata"]["namespace"], "ns1");
    assert_eq!(warn["type"], "Warning");
    assert_eq!(warn["action"], "Listen");
    assert_eq!(
        warn["regarding"],
        serde_json::json!({"apiVersion": "v1", "kind": "Service", "namespace": "ns1", "name": "lb"})
    );
    assert!(warn["series"]["lastObservedTime"].is_string());
    let warn_name = warn["metadata"]["name"].as_str().expect("name").to_string();
    assert!(warn_name.starts_with("lb."), "{warn_name}");

    // Only the events.k8s.io API is used: two creates, one series patch.
    let writes: Vec<(String, String)> = server
        .requests()
        .into_iter()
        .filter(|r| r.method != "GET")
        .map(|r| (r.method, r.uri.split('?').next().unwrap_or("").to_string()))
        .collect();
    let posts = writes.iter().filter(|(m, _)| m == "POST").count();
    assert_eq!(posts, 2, "{writes:?}");
    assert!(writes.contains(&("POST".into(), "/apis/events.k8s.io/v1/namespaces/default/events".into())));
    assert!(writes.contains(&("POST".into(), "/apis/events.k8s.io/v1/namespaces/ns1/events".into())));
    assert_eq!(
        writes.iter().filter(|(m, _)| m == "PATCH").collect::<Vec<_>>(),
        vec![&("PATCH".to_string(), format!("/apis/events.k8s.io/v1/namespaces/ns1/events/{warn_name}"))]
    );

    // Transient failures are retried.
    server.fail_next_events(2, 503);
    // (Another object: the same object and reason would count in lb's series, note or not.)
    let other = service_ref(&NamespacedName::new("ns1", "other"));
    recorder.record(other, EventType::Warning, "FailedToStartServiceHealthcheck", "Listen", "second");
    eventually_fast("the retried event", WAIT, || {
        event_named(&server.events(), "FailedToStartServiceHealthcheck", "second").is_some()
    })
    .await;

    // A rejected event is dropped, and the recorder goes on.
    server.fail_next_events(1, 422);
    recorder.record(lb.clone(), EventType::Warning, "Rejected", "Listen", "dropped");
    recorder.record(lb.clone(), EventType::Warning, "Accepted", "Listen", "after");
    eventually_fast("the next event", WAIT, || event_named(&server.events(), "Accepted", "after").is_some()).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(event_named(&server.events(), "Rejected", "dropped").is_none(), "422 is not retried");

    // The Event expired on the server: the next series patch re-creates it, count included.
    server.delete_events();
    recorder.record(lb.clone(), EventType::Warning, "FailedToStartServiceHealthcheck", "Listen", busy);
    eventually_fast("the re-created series", WAIT, || {
        event_named(&server.events(), "FailedToStartServiceHealthcheck", busy)
            .is_some_and(|e| e["series"]["count"] == 4 && e["metadata"]["name"] == warn_name.as_str())
    })
    .await;

    assert_eq!(recorder.dropped(), 0);
    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(5), task).await.expect("recorder stops").expect("task");
}

#[tokio::test]
async fn a_full_queue_drops_and_counts_without_blocking() {
    let server = ApiServer::start().await;
    let options = EventOptions { queue_capacity: 2, ..fast_options() };
    let shutdown = CancellationToken::new();
    let (recorder, task) =
        KubeEventRecorder::start(server.client(), reporting_instance(NODE), options, shutdown.clone());
    // On this single-threaded runtime the task cannot run before the test yields.
    // Five objects, so no record folds into another's series.
    for i in 0..5 {
        recorder.record(
            node_ref(&format!("node-{i}")),
            EventType::Normal,
            "Starting",
            "StartKubeProxy",
            &format!("n{i}"),
        );
    }
    assert_eq!(recorder.dropped(), 3);
    eventually_fast("the queued events", WAIT, || server.events().len() == 2).await;
    let events = server.events();
    let mut got: Vec<&str> = events.iter().filter_map(|e| e["note"].as_str()).collect();
    got.sort_unstable();
    assert_eq!(got, ["n0", "n1"]);

    // After shutdown recording is still harmless.
    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(5), task).await.expect("recorder stops").expect("task");
    recorder.record(node_ref(NODE), EventType::Normal, "Starting", "StartKubeProxy", "late");
    assert_eq!(recorder.dropped(), 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_api_server_neither_blocks_callers_nor_holds_shutdown() {
    // Accepts connections and never answers.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    let hold = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((stream, _)) = listener.accept().await {
            held.push(stream);
        }
    });
    let client = kube::Client::try_from(kube::Config::new(url.parse().expect("url"))).expect("client");
    let options = EventOptions {
        write_timeout: Duration::from_millis(200),
        shutdown_flush: Duration::from_millis(200),
        ..fast_options()
    };
    let shutdown = CancellationToken::new();
    let (recorder, task) = KubeEventRecorder::start(client, reporting_instance(NODE), options, shutdown.clone());
    let started = Instant::now();
    for i in 0..50 {
        recorder.record(node_ref(NODE), EventType::Normal, "Starting", "StartKubeProxy", &format!("n{i}"));
    }
    assert!(started.elapsed() < Duration::from_millis(100), "recording never waits for the server");
    tokio::time::sleep(Duration::from_millis(500)).await;

    let stopping = Instant::now();
    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(2), task).await.expect("stops despite the hung server").expect("task");
    assert!(stopping.elapsed() < Duration::from_secs(1), "took {:?}", stopping.elapsed());
    hold.abort();
}
