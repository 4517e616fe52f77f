//! The real watches (`k8s::watch::run`, kube-runtime watchers) against the in-process test
//! API server: the proxier syncs only after both lists, follows changes, and after a dropped
//! watch, a 410 Gone or server errors its rules match the API exactly.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube_proxy_rs::daemon::runner::BoundedFrequencyRunner;
use kube_proxy_rs::daemon::sync_loop::{SharedProxier, SyncLoop, lock};
use kube_proxy_rs::iptables::fake::FakeIptables;
use kube_proxy_rs::k8s::ProxierSet;
use kube_proxy_rs::k8s::watch::{self, NodeCallback};
use kube_proxy_rs::model::IpFamily;
use kube_proxy_rs::proxier::{Proxier, ProxierConfig, StaticInterfaces, SyncOutcome};
use kube_proxy_rs::tracker::testing::{node, slice, svc};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::support::apiserver::{ApiServer, Kind};
use crate::support::assert_rules_eq;
use crate::support::harness::{
    TEST_NODE_NAME, TestProxier, proxier_set_member, shared_test_proxier, upstream_interfaces, upstream_render_config,
};
use crate::support::poll::{eventually_fast, poll_until};

/// How long a test may wait for the proxier to catch up with the API.
const CONVERGE: Duration = Duration::from_secs(30);
/// How often convergence is checked (each check may sync and saves the fake's tables).
const POLL: Duration = Duration::from_millis(50);

/// A proxier (fake iptables) fed by `watch::run` against `server`. Syncs are run by hand.
struct Rig {
    proxier: SharedProxier,
    ipt: Arc<FakeIptables>,
    nodes_seen: Arc<Mutex<Vec<Option<String>>>>,
    shutdown: CancellationToken,
    task: JoinHandle<()>,
    _runner: BoundedFrequencyRunner,
    now: Instant,
}

impl Drop for Rig {
    fn drop(&mut self) {
        self.shutdown.cancel();
        self.task.abort();
    }
}

impl Rig {
    fn start(server: &ApiServer) -> Rig {
        let (proxier, ipt, runner) = shared_test_proxier();
        let set = ProxierSet::new(vec![proxier_set_member(&proxier, runner.handle())]);
        let nodes_seen = Arc::new(Mutex::new(Vec::new()));
        let seen = nodes_seen.clone();
        let on_node: NodeCallback = Arc::new(move |n: Option<&Node>| {
            seen.lock().expect("lock").push(n.and_then(|n| n.metadata.name.clone()));
        });
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(watch::run(server.client(), TEST_NODE_NAME.into(), set, on_node, shutdown.clone()));
        Rig { proxier, ipt, nodes_seen, shutdown, task, _runner: runner, now: Instant::now() }
    }

    /// One sync; `None` while the proxier is not initialized.
    fn sync(&mut self) -> Option<bool> {
        self.now += Duration::from_secs(31);
        match lock(&self.proxier).sync(self.now) {
            SyncOutcome::NotInitialized => None,
            SyncOutcome::Synced(r) => {
                assert!(r.result.is_ok(), "{:?}", r.result);
                Some(r.full)
            }
        }
    }

    /// Syncs until the rules equal a fresh proxier's for exactly these objects.
    async fn converge(&mut self, services: &[Service], slices: &[EndpointSlice]) {
        let expected = reference(services, slices);
        let converged = poll_until(CONVERGE, POLL, || {
            self.sync();
            self.ipt.save_all() == expected
        })
        .await;
        if converged.is_none() {
            assert_rules_eq(&expected, &self.ipt.save_all());
        }
    }
}

/// The kernel state a fresh proxier produces for exactly these objects.
fn reference(services: &[Service], slices: &[EndpointSlice]) -> String {
    let mut fp = TestProxier::new(IpFamily::V4);
    fp.add_services(services);
    fp.add_slices(slices);
    fp.sync();
    fp.ipt.save_all()
}

fn web(ip: &str) -> Service {
    svc("ns1", "web").cluster_ip(ip).tcp("http", 80).build()
}

fn web_slice(ips: &[&str]) -> EndpointSlice {
    slice("ns1", "web", "web-1").tcp("http", 8080).ips(ips).build()
}

fn api() -> Service {
    svc("ns1", "api").cluster_ip("172.30.0.2").tcp("http", 80).build()
}

fn api_slice() -> EndpointSlice {
    slice("ns1", "api", "api-1").tcp("http", 8080).ips(&["10.2.0.1"]).build()
}

fn db() -> Service {
    svc("ns2", "db").cluster_ip("172.30.0.3").udp("dns", 53).build()
}

fn db_slice() -> EndpointSlice {
    slice("ns2", "db", "db-1").udp("dns", 5353).ips(&["10.3.0.1"]).build()
}

/// web and api with their slices, this node and another one.
fn populate(server: &ApiServer) {
    server.create(&web("172.30.0.1"));
    server.create(&api());
    server.create(&web_slice(&["10.1.0.1"]));
    server.create(&api_slice());
    server.create(&node(TEST_NODE_NAME, &[], &[], &[]));
    server.create(&node("other-node", &[], &[], &[]));
}

fn list_requests(server: &ApiServer, kind: Kind) -> usize {
    server.requests().iter().filter(|r| r.kind == Some(kind) && !r.watch).count()
}

/// Runs `f` with a deadline, so a hung watch fails the test instead of hanging it.
async fn bounded<F: std::future::Future<Output = ()>>(f: F) {
    tokio::time::timeout(Duration::from_secs(60), f).await.expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn syncs_only_after_both_lists() {
    bounded(async {
        let server = ApiServer::start().await;
        populate(&server);
        // Hold the slice list back so the service list is in alone for a while.
        server.stall_of(Kind::EndpointSlice, Duration::from_secs(3));
        let mut rig = Rig::start(&server);
        eventually_fast("the service watch", CONVERGE, || server.open_watches(Kind::Service) > 0).await;
        eventually_fast("the slice list", CONVERGE, || list_requests(&server, Kind::EndpointSlice) > 0).await;
        assert_eq!(server.open_watches(Kind::EndpointSlice), 0);
        assert_eq!(rig.sync(), None, "services listed, slices not: no sync yet");

        rig.converge(&[web("172.30.0.1"), api()], &[web_slice(&["10.1.0.1"]), api_slice()]).await;
        eventually_fast("this node", CONVERGE, || !rig.nodes_seen.lock().expect("lock").is_empty()).await;
        assert_eq!(*rig.nodes_seen.lock().expect("lock"), vec![Some(TEST_NODE_NAME.to_string())]);

        // The watches asked for what upstream's informers ask for.
        let requests = server.requests();
        let svc_list = requests.iter().find(|r| r.kind == Some(Kind::Service) && !r.watch).expect("service list");
        assert!(
            svc_list.uri.contains(
                "labelSelector=%21service.kubernetes.io%2Fservice-proxy-name%2C%21service.kubernetes.io%2Fheadless"
            ),
            "{}",
            svc_list.uri
        );
        let node_watch = requests.iter().find(|r| r.kind == Some(Kind::Node) && r.watch).expect("node watch");
        assert!(node_watch.uri.contains("fieldSelector=metadata.name%3Dtest-node"), "{}", node_watch.uri);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn follows_adds_updates_and_deletes() {
    bounded(async {
        let server = ApiServer::start().await;
        populate(&server);
        let mut rig = Rig::start(&server);
        rig.converge(&[web("172.30.0.1"), api()], &[web_slice(&["10.1.0.1"]), api_slice()]).await;

        server.create(&db());
        server.create(&db_slice());
        server.update(&web("172.30.0.9"));
        server.update(&web_slice(&["10.1.0.2", "10.1.0.3"]));
        rig.converge(
            &[web("172.30.0.9"), api(), db()],
            &[web_slice(&["10.1.0.2", "10.1.0.3"]), api_slice(), db_slice()],
        )
        .await;

        // Labelled for another proxy: it leaves the selection, which the watch reports as a
        // deletion.
        let mut other = api();
        other.metadata.labels =
            Some([("service.kubernetes.io/service-proxy-name".to_string(), "other".to_string())].into());
        server.update(&other);
        rig.converge(&[web("172.30.0.9"), db()], &[web_slice(&["10.1.0.2", "10.1.0.3"]), api_slice(), db_slice()])
            .await;

        server.delete(&web_slice(&[]));
        server.delete(&web("172.30.0.9"));
        server.delete(&db_slice());
        server.delete(&db());
        rig.converge(&[], &[api_slice()]).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_watches_resume_without_losing_changes() {
    bounded(async {
        let server = ApiServer::start().await;
        populate(&server);
        let mut rig = Rig::start(&server);
        rig.converge(&[web("172.30.0.1"), api()], &[web_slice(&["10.1.0.1"]), api_slice()]).await;
        let watches_before = server.requests().iter().filter(|r| r.watch).count();
        let lists_before = server.requests().iter().filter(|r| !r.watch).count();

        // The watches drop; the changes land before they are back.
        server.stall(Duration::from_millis(800));
        server.close_watches();
        server.create(&db());
        server.create(&db_slice());
        server.delete(&api());
        server.delete(&api_slice());
        server.update(&web_slice(&["10.1.0.7"]));
        rig.converge(&[web("172.30.0.1"), db()], &[web_slice(&["10.1.0.7"]), db_slice()]).await;
        assert!(server.requests().iter().filter(|r| r.watch).count() > watches_before, "the watches were re-opened");
        assert_eq!(server.requests().iter().filter(|r| !r.watch).count(), lists_before, "resumed, not re-listed");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gone_relists_and_sees_deletions() {
    bounded(async {
        let server = ApiServer::start().await;
        populate(&server);
        let mut rig = Rig::start(&server);
        rig.converge(&[web("172.30.0.1"), api()], &[web_slice(&["10.1.0.1"]), api_slice()]).await;
        let lists_before = list_requests(&server, Kind::Service);

        // The history is compacted away while the watches are down: resuming gets 410 Gone,
        // and only a re-list can tell that api was deleted.
        server.stall(Duration::from_millis(800));
        server.compact();
        server.delete(&api());
        server.delete(&api_slice());
        server.create(&db());
        server.create(&db_slice());
        server.update(&web_slice(&["10.1.0.7"]));
        rig.converge(&[web("172.30.0.1"), db()], &[web_slice(&["10.1.0.7"]), db_slice()]).await;
        assert!(server.expired_watches() >= 3, "each watch resumed into 410 Gone");
        assert!(list_requests(&server, Kind::Service) > lists_before, "services were re-listed");
        assert!(list_requests(&server, Kind::EndpointSlice) > 1, "slices were re-listed");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_errors_are_retried() {
    bounded(async {
        let server = ApiServer::start().await;
        populate(&server);
        server.fail_next_of(Kind::Service, 3, 500);
        let mut rig = Rig::start(&server);
        rig.converge(&[web("172.30.0.1"), api()], &[web_slice(&["10.1.0.1"]), api_slice()]).await;
        assert!(list_requests(&server, Kind::Service) >= 4, "three failed lists, then one that worked");

        // Failing watch re-opens are retried too, and resume where they left off.
        server.fail_next(2, 500);
        server.close_watches();
        server.create(&db());
        server.create(&db_slice());
        rig.converge(&[web("172.30.0.1"), api(), db()], &[web_slice(&["10.1.0.1"]), api_slice(), db_slice()]).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_are_recorded() {
    use k8s_openapi::api::events::v1::Event;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
    use kube::api::{Api, PostParams};

    bounded(async {
        let server = ApiServer::start().await;
        let events: Api<Event> = Api::namespaced(server.client(), "default");
        let event = Event {
            metadata: ObjectMeta {
                name: Some("test-node.1".into()),
                namespace: Some("default".into()),
                ..Default::default()
            },
            event_time: Some(MicroTime(k8s_openapi::jiff::Timestamp::UNIX_EPOCH)),
            reason: Some("Starting".into()),
            action: Some("StartKubeProxy".into()),
            reporting_controller: Some("kube-proxy".into()),
            reporting_instance: Some("kube-proxy-test-node".into()),
            type_: Some("Normal".into()),
            ..Default::default()
        };
        let created = events.create(&PostParams::default(), &event).await.expect("event accepted");
        assert_eq!(created.reason.as_deref(), Some("Starting"));
        let recorded = server.events();
        assert_eq!(recorded.len(), 1);
        assert_eq!(recorded[0]["reason"], "Starting");
    })
    .await;
}

/// Waits (bounded) until the rules, without the sync loop's canary chains, are `expected`.
async fn wait_rules(ipt: &FakeIptables, expected: &str) {
    let rules = || -> String {
        ipt.save_all().lines().filter(|l| !l.contains("KUBE-PROXY-CANARY")).map(|l| format!("{l}\n")).collect()
    };
    if poll_until(CONVERGE, POLL, || rules() == expected).await.is_none() {
        assert_rules_eq(expected, &rules());
    }
}

/// The production wiring: `watch::run` feeding a proxier that its real `SyncLoop` syncs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sync_loop_follows_the_api_through_cut_connections() {
    bounded(async {
        let server = ApiServer::start().await;
        populate(&server);
        let ipt = Arc::new(FakeIptables::new(IpFamily::V4));
        let cfg = ProxierConfig {
            render: upstream_render_config(IpFamily::V4),
            hostname: TEST_NODE_NAME.into(),
            sync_period: Duration::from_secs(30),
        };
        let proxier =
            Arc::new(Mutex::new(Proxier::new(cfg, ipt.clone(), Arc::new(StaticInterfaces(upstream_interfaces())))));
        let sync_loop = SyncLoop::new(proxier, ipt.clone(), Duration::from_millis(100), Duration::from_secs(30))
            .expect("sync loop");
        let set = ProxierSet::new(vec![proxier_set_member(&sync_loop.proxier(), sync_loop.handle())]);
        let shutdown = CancellationToken::new();
        let on_node: NodeCallback = Arc::new(|_: Option<&Node>| {});
        let loop_task = tokio::spawn(sync_loop.run(shutdown.clone(), |_| {}));
        let watch_task =
            tokio::spawn(watch::run(server.client(), TEST_NODE_NAME.into(), set, on_node, shutdown.clone()));

        let expected = reference(&[web("172.30.0.1"), api()], &[web_slice(&["10.1.0.1"]), api_slice()]);
        wait_rules(&ipt, &expected).await;

        // The connections drop mid-stream; the changes land before the watches are back.
        server.stall(Duration::from_millis(500));
        server.cut_watches();
        server.create(&db());
        server.create(&db_slice());
        server.delete(&api());
        server.delete(&api_slice());
        server.update(&web_slice(&["10.1.0.7"]));
        let expected = reference(&[web("172.30.0.1"), db()], &[web_slice(&["10.1.0.7"]), db_slice()]);
        wait_rules(&ipt, &expected).await;

        shutdown.cancel();
        let stopped = tokio::time::timeout(Duration::from_secs(10), loop_task).await.expect("stops on shutdown");
        stopped.expect("task").expect("no sync panicked");
        tokio::time::timeout(Duration::from_secs(10), watch_task).await.expect("stops on shutdown").expect("task");
    })
    .await;
}

/// The server answers kube's own requests as the API server would: selectors, list versions,
/// watch event types, 410 Gone and error statuses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_speaks_the_api() {
    use futures::{StreamExt, TryStreamExt};
    use kube::api::{Api, ListParams, WatchEvent, WatchParams};
    use kube_proxy_rs::k8s::WATCH_LABEL_SELECTOR;

    bounded(async {
        let server = ApiServer::start().await;
        populate(&server);
        let mut other = db();
        other.metadata.labels =
            Some([("service.kubernetes.io/service-proxy-name".to_string(), "other".to_string())].into());
        server.create(&other);
        let client = server.client();

        let services: Api<Service> = Api::all(client.clone());
        let list = services.list(&ListParams::default().labels(WATCH_LABEL_SELECTOR)).await.expect("list");
        let names: Vec<_> = list.items.iter().filter_map(|s| s.metadata.name.clone()).collect();
        assert_eq!(names, ["api", "web"], "labelled service excluded");
        let rv = list.metadata.resource_version.expect("list version");
        assert_eq!(rv, server.resource_version().to_string());
        let nodes: Api<Node> = Api::all(client.clone());
        let listed = nodes.list(&ListParams::default().fields("metadata.name=test-node")).await.expect("nodes");
        assert_eq!(listed.items.len(), 1);

        // Changes after the listed version arrive in order, with their versions.
        let wp = WatchParams::default().labels(WATCH_LABEL_SELECTOR);
        let mut stream = services.watch(&wp, &rv).await.expect("watch").boxed();
        server.update(&web("172.30.0.9"));
        let deleted_at = server.delete(&api());
        server.update(&other); // Not selected: not sent.
        server.create(&db_slice()); // Another kind: not sent.
        let mut seen = Vec::new();
        while seen.len() < 2 {
            match stream.try_next().await.expect("event").expect("open stream") {
                WatchEvent::Modified(s) => seen.push(("MODIFIED", s.metadata.name, s.metadata.resource_version)),
                WatchEvent::Deleted(s) => seen.push(("DELETED", s.metadata.name, s.metadata.resource_version)),
                other => panic!("unexpected {other:?}"),
            }
        }
        assert_eq!(seen[0].0, "MODIFIED");
        assert_eq!(seen[1], ("DELETED", Some("api".to_string()), Some(deleted_at.to_string())));

        // A compacted version: one ERROR event with a 410 Expired Status.
        server.compact();
        let mut stream = services.watch(&wp, &rv).await.expect("watch").boxed();
        match stream.try_next().await.expect("event") {
            Some(WatchEvent::Error(status)) => {
                assert_eq!((status.code, status.reason.as_str()), (410, "Expired"));
            }
            other => panic!("expected 410 Gone, got {other:?}"),
        }
        assert!(stream.next().await.is_none(), "the stream ends after the error");

        // Injected failures answer an error Status.
        server.fail_next(1, 500);
        match services.list(&ListParams::default()).await {
            Err(kube::Error::Api(status)) => assert_eq!(status.code, 500),
            other => panic!("expected a 500, got {other:?}"),
        }
        services.list(&ListParams::default()).await.expect("the next request works");
    })
    .await;
}

/// detect-local-mode NodeCIDR: the wait returns once the IPAM controller assigns the node's
/// podCIDRs, and times out (naming the node) when it never does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waits_for_the_node_pod_cidr_allocation() {
    use kube_proxy_rs::k8s::pod_cidr::{PodCidrError, wait_for_pod_cidrs};
    let server = ApiServer::start().await;
    server.create(&node("node-a", &[], &[], &["10.0.0.1"]));
    server.create(&node("node-b", &[], &[], &["10.0.0.2"]));
    let client = server.client();
    let waiting = tokio::spawn(async move { wait_for_pod_cidrs(&client, "node-a", Duration::from_secs(20)).await });
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!waiting.is_finished(), "no podCIDRs yet: must keep waiting");
    server.update(&node("node-b", &[], &["10.244.9.0/24"], &["10.0.0.2"]));
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiting.is_finished(), "another node's allocation does not count");
    server.update(&node("node-a", &[], &["10.244.1.0/24"], &["10.0.0.1"]));
    let got = tokio::time::timeout(CONVERGE, waiting).await.expect("wait returns").expect("task").expect("node");
    assert_eq!(got.spec.and_then(|s| s.pod_cidrs), Some(vec!["10.244.1.0/24".to_string()]));

    let err = wait_for_pod_cidrs(&server.client(), "node-b-missing", Duration::from_millis(500)).await.unwrap_err();
    assert!(matches!(err, PodCidrError::Timeout { .. }), "{err}");
    assert!(err.to_string().contains("node-b-missing") && err.to_string().contains("NodeCIDR"), "{err}");
}
