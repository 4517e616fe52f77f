//! The daemon assembled on fakes: dual stack when both families work, sysctls set, the
//! watches' events programming both families, health and metrics following the syncs, and
//! a clean shutdown that removes the canaries and leaves the rules.

use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Node;
use kube::runtime::watcher::Event;
use kube_proxy_rs::config::{KubeProxyConfiguration, Settings};
use kube_proxy_rs::daemon::{Daemon, DaemonDeps, DaemonError};
use kube_proxy_rs::iptables::fake::FakeIptables;
use kube_proxy_rs::iptables::{FlushFlag, Iptables, RestoreCounters, Result as IptResult, RulePosition, Table};
use kube_proxy_rs::k8s::{ServiceEvents, SliceEvents};
use kube_proxy_rs::model::IpFamily;
use kube_proxy_rs::node::conntrack::FakeConntrack;
use kube_proxy_rs::node::sysctl::FakeSysctl;
use kube_proxy_rs::proxier::StaticInterfaces;
use kube_proxy_rs::tracker::testing::{node, slice, svc};
use tokio_util::sync::CancellationToken;

use crate::support::poll::{FAST_POLL, eventually_async, eventually_fast, poll_until};

/// How long a wait for the daemon's tasks may take.
const WAIT: Duration = Duration::from_secs(10);

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
        nftables_v4: None,
        nftables_v6: None,
        iptables_v4: Some(v4.clone()),
        iptables_v6: Some(v6.clone()),
        sysctl: sysctl.clone(),
        interfaces: Arc::new(StaticInterfaces(Vec::new())),
        conntrack: Some(Arc::new(FakeConntrack::new())),
        nfacct: None,
        events: Arc::new(kube_proxy_rs::k8s::events::NoopEventRecorder),
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

/// A slice whose address type changes (IPv6 → IPv4 under the same name) leaves the IPv6
/// proxier: its endpoints go from the IPv6 rules at once, and stay gone after the slice is
/// deleted (found by the soak: the IPv6 family kept them forever).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slice_changing_address_type_leaves_the_other_family() {
    let (fakes, deps) = deps(true);
    let daemon = Daemon::build(&settings(), "node-a".into(), Some(&dual_stack_node()), &deps).expect("daemon");
    let set = daemon.proxier_set();
    let shutdown = CancellationToken::new();
    let loops = tokio::spawn(daemon.run_loops(shutdown.clone(), None));
    let web = svc("ns1", "web").cluster_ips(&["172.30.0.1", "fd00:30::1"]).tcp("http", 80).build();
    let v6 = slice("ns1", "web", "web-x").ipv6().tcp("http", 8080).ips(&["fd00:10:1::5"]).build();
    let mut services = ServiceEvents::default();
    let mut slices = SliceEvents::default();
    for e in [Event::Init, Event::InitApply(web), Event::InitDone] {
        services.handle(e, &set);
    }
    for e in [Event::Init, Event::InitApply(v6), Event::InitDone] {
        slices.handle(e, &set);
    }
    eventually_fast("IPv6 endpoint programmed", WAIT, || fakes.v6.save_all().contains("[fd00:10:1::5]:8080")).await;
    let v4 = slice("ns1", "web", "web-x").tcp("http", 8080).ips(&["10.0.1.5"]).build();
    slices.handle(Event::Apply(v4.clone()), &set);
    let moved = poll_until(WAIT, FAST_POLL, || {
        fakes.v4.save_all().contains("10.0.1.5:8080") && !fakes.v6.save_all().contains("fd00:10:1::5")
    });
    if moved.await.is_none() {
        panic!("IPv6 rules still hold the old endpoint:\n{}", fakes.v6.save_all());
    }
    slices.handle(Event::Delete(v4), &set);
    eventually_fast("IPv4 endpoint removed on delete", WAIT, || !fakes.v4.save_all().contains("10.0.1.5:8080")).await;
    assert!(!fakes.v6.save_all().contains("fd00:10:1::5"), "{}", fakes.v6.save_all());
    shutdown.cancel();
    let stopped = tokio::time::timeout(Duration::from_secs(10), loops).await.expect("loops stop");
    stopped.expect("loop task").expect("no loop ended before shutdown");
}

#[test]
fn primary_family_must_be_supported() {
    let (_f, deps) = deps(false);
    let v6_node = node("node-a", &[], &[], &["fd00::2"]);
    match Daemon::build(&settings(), "node-a".into(), Some(&v6_node), &deps) {
        Err(DaemonError::PrimaryFamilyUnsupported { family: IpFamily::V6, .. }) => {}
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

    eventually_fast("both families programmed", WAIT, || {
        has_chain(&fakes.v4, "KUBE-SEP-") && has_chain(&fakes.v6, "KUBE-SEP-")
    })
    .await;
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
    tokio::time::timeout(Duration::from_secs(10), loops)
        .await
        .expect("loops stop")
        .expect("loop task")
        .expect("no loop ended before shutdown");
    for ipt in [&fakes.v4, &fakes.v6] {
        assert!(!has_chain(ipt, "KUBE-PROXY-CANARY"), "canaries removed on shutdown");
        assert!(has_chain(ipt, "KUBE-SVC-"), "service rules stay on shutdown");
    }
}

/// A [`FakeIptables`] whose restores take time: `steps` transactions of `step` each, as a
/// large restore split on iptables-nft (one step: a single slow or hung `iptables-restore`).
struct SlowIptables {
    inner: Arc<FakeIptables>,
    delay: std::sync::Mutex<Option<(u32, Duration)>>,
    restoring: std::sync::atomic::AtomicBool,
    panic_on_restore: std::sync::atomic::AtomicBool,
}

impl SlowIptables {
    fn new(inner: Arc<FakeIptables>) -> Self {
        SlowIptables {
            inner,
            delay: std::sync::Mutex::new(None),
            restoring: Default::default(),
            panic_on_restore: Default::default(),
        }
    }

    fn slow_down(&self, steps: u32, step: Duration) {
        *self.delay.lock().expect("lock") = Some((steps, step));
    }

    /// Every later restore panics (a bug in the sync's path).
    fn panic_on_restore(&self) {
        self.panic_on_restore.store(true, std::sync::atomic::Ordering::SeqCst);
    }

    fn restoring(&self) -> bool {
        self.restoring.load(std::sync::atomic::Ordering::SeqCst)
    }
}

impl Iptables for SlowIptables {
    fn family(&self) -> IpFamily {
        self.inner.family()
    }
    fn ensure_chain(&self, table: Table, chain: &str) -> IptResult<bool> {
        self.inner.ensure_chain(table, chain)
    }
    fn flush_chain(&self, table: Table, chain: &str) -> IptResult<()> {
        self.inner.flush_chain(table, chain)
    }
    fn delete_chain(&self, table: Table, chain: &str) -> IptResult<()> {
        self.inner.delete_chain(table, chain)
    }
    fn chain_exists(&self, table: Table, chain: &str) -> IptResult<bool> {
        self.inner.chain_exists(table, chain)
    }
    fn ensure_rule(&self, position: RulePosition, table: Table, chain: &str, args: &[&str]) -> IptResult<bool> {
        self.inner.ensure_rule(position, table, chain, args)
    }
    fn rule_exists(&self, table: Table, chain: &str, args: &[&str]) -> IptResult<bool> {
        self.inner.rule_exists(table, chain, args)
    }
    fn delete_rule(&self, table: Table, chain: &str, args: &[&str]) -> IptResult<()> {
        self.inner.delete_rule(table, chain, args)
    }
    fn save_into(&self, table: Table, out: &mut Vec<u8>) -> IptResult<()> {
        self.inner.save_into(table, out)
    }
    fn list_chains(&self, table: Table) -> IptResult<Vec<String>> {
        self.inner.list_chains(table)
    }
    fn restore(&self, table: Table, data: &[u8], flush: FlushFlag, counters: RestoreCounters) -> IptResult<()> {
        self.inner.restore(table, data, flush, counters)
    }
    fn restore_all(&self, data: &[u8], flush: FlushFlag, counters: RestoreCounters) -> IptResult<()> {
        self.restore_input(&data, flush, counters, &mut || {})
    }
    fn restore_input(
        &self,
        input: &dyn kube_proxy_rs::iptables::RestoreInput,
        flush: FlushFlag,
        counters: RestoreCounters,
        on_step: &mut dyn FnMut(),
    ) -> IptResult<()> {
        if self.panic_on_restore.load(std::sync::atomic::Ordering::SeqCst) {
            panic!("injected restore panic");
        }
        let delay = *self.delay.lock().expect("lock");
        if let Some((steps, step)) = delay {
            self.restoring.store(true, std::sync::atomic::Ordering::SeqCst);
            for _ in 0..steps {
                std::thread::sleep(step);
                on_step();
            }
        }
        let result = self.inner.restore_input(input, flush, counters, &mut || {});
        self.restoring.store(false, std::sync::atomic::Ordering::SeqCst);
        result
    }
    fn has_random_fully(&self) -> bool {
        self.inner.has_random_fully()
    }
    fn present(&self) -> bool {
        self.inner.present()
    }
}

/// GET `path` from `addr`; the status code and how long the answer took.
async fn timed_get(addr: std::net::SocketAddr, path: &str) -> (u16, Duration) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let started = Instant::now();
    let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    stream
        .write_all(format!("GET {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n").as_bytes())
        .await
        .expect("write");
    let mut response = Vec::new();
    stream.read_to_end(&mut response).await.expect("read");
    let elapsed = started.elapsed();
    let text = String::from_utf8_lossy(&response);
    let status = text.split_whitespace().nth(1).and_then(|s| s.parse().ok()).expect("status line");
    (status, elapsed)
}

struct SlowRig {
    slow: Arc<SlowIptables>,
    set: kube_proxy_rs::k8s::ProxierSet,
    recorder: Arc<kube_proxy_rs::tracker::ChangeRecorder>,
    health_addr: std::net::SocketAddr,
    metrics_addr: std::net::SocketAddr,
    shutdown: CancellationToken,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    loops: tokio::task::JoinHandle<Result<(), kube_proxy_rs::daemon::tasks::TaskEnded>>,
}

/// A single-stack daemon on a [`SlowIptables`], its health and metrics servers listening,
/// synced once with one Service.
async fn slow_rig(sync_period: Duration) -> SlowRig {
    let (fakes, mut deps) = deps(false);
    let slow = Arc::new(SlowIptables::new(fakes.v4.clone()));
    deps.iptables_v4 = Some(slow.clone());
    let mut config = KubeProxyConfiguration::default();
    config.iptables.sync_period = kube_proxy_rs::config::GoDuration(sync_period.as_nanos() as i64);
    config.iptables.min_sync_period = kube_proxy_rs::config::GoDuration(1_000_000);
    let settings = Settings::from_config(&config).expect("settings");
    let n = node("node-a", &[], &["10.0.1.0/24"], &["198.18.0.2"]);
    let daemon = Daemon::build(&settings, "node-a".into(), Some(&n), &deps).expect("daemon");
    let set = daemon.proxier_set();
    let recorder =
        kube_proxy_rs::daemon::sync_loop::lock(daemon.families[0].iptables().expect("iptables mode")).recorder();
    let health_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let metrics_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let health_addr = health_listener.local_addr().expect("addr");
    let metrics_addr = metrics_listener.local_addr().expect("addr");
    let metrics_server = Arc::new(
        kube_proxy_rs::serve::health::MetricsServer::new(daemon.metrics.clone(), &serde_json::json!({})).expect("m"),
    );
    let shutdown = CancellationToken::new();
    let tasks = vec![
        tokio::spawn(daemon.health.clone().serve(health_listener, shutdown.clone())),
        tokio::spawn(metrics_server.serve(metrics_listener, shutdown.clone())),
    ];
    let loops = tokio::spawn(daemon.run_loops(shutdown.clone(), None));
    let mut services = ServiceEvents::default();
    let mut slices = SliceEvents::default();
    let web = svc("ns1", "web").cluster_ip("172.30.0.1").tcp("http", 80).build();
    for e in [Event::Init, Event::InitApply(web), Event::InitDone] {
        services.handle(e, &set);
    }
    let web_slice = slice("ns1", "web", "web-1").tcp("http", 8080).ips(&["10.0.1.5"]).build();
    for e in [Event::Init, Event::InitApply(web_slice), Event::InitDone] {
        slices.handle(e, &set);
    }
    eventually_fast("first sync", WAIT, || has_chain(&fakes.v4, "KUBE-SVC-")).await;
    SlowRig { slow, set, recorder, health_addr, metrics_addr, shutdown, tasks, loops }
}

impl SlowRig {
    /// Records a new Service (which asks for a sync) and waits until its restore is running.
    async fn start_slow_sync(&self, name: &str, ip: &str) {
        let mut services = ServiceEvents::default();
        let s = svc("ns1", name).cluster_ip(ip).tcp("http", 80).build();
        services.handle(Event::Apply(s), &self.set);
        eventually_fast("the slow restore to start", WAIT, || self.slow.restoring()).await;
    }

    async fn stop(self) {
        self.shutdown.cancel();
        let loops = tokio::time::timeout(Duration::from_secs(30), self.loops).await.expect("loops stop");
        loops.expect("loops task").expect("no loop ended before shutdown");
        for t in self.tasks {
            let _ = tokio::time::timeout(Duration::from_secs(30), t).await;
        }
    }
}

/// A sync that panics ends its family's loop, and `run_loops` with an error naming the loop
/// and the panic (the daemon then exits, as upstream's process would have crashed); no sync
/// runs on a proxier whose state the panic may have left half-updated.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_sync_ends_the_loops_with_an_error_naming_it() {
    let rig = slow_rig(Duration::from_secs(30)).await;
    rig.slow.panic_on_restore();
    let mut services = ServiceEvents::default();
    services.handle(Event::Apply(svc("ns1", "next").cluster_ip("172.30.0.9").tcp("http", 80).build()), &rig.set);
    let ended = tokio::time::timeout(Duration::from_secs(10), rig.loops)
        .await
        .expect("the loops end without a shutdown")
        .expect("loops task")
        .expect_err("a panicked sync is an error");
    assert_eq!(ended.task, "sync loop (IPv4)", "{ended}");
    assert_eq!(ended.how, "failed: a IPv4 sync panicked: injected restore panic", "{ended}");
    assert!(!rig.shutdown.is_cancelled(), "the loop stopped on its own");
    rig.shutdown.cancel();
    for t in rig.tasks {
        let _ = tokio::time::timeout(Duration::from_secs(30), t).await;
    }
}

/// Nothing on the async runtime waits for a sync: while a restore blocks for seconds,
/// `/livez` and `/metrics` answer at once and watch events are still recorded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn servers_and_watches_do_not_wait_for_a_long_restore() {
    let rig = slow_rig(Duration::from_secs(30)).await;
    rig.slow.slow_down(1, Duration::from_secs(4));
    rig.start_slow_sync("slow", "172.30.0.2").await;
    let mut slowest = Duration::ZERO;
    for i in 0..10u32 {
        for (addr, path) in [(rig.health_addr, "/livez"), (rig.metrics_addr, "/metrics")] {
            let (status, took) = timed_get(addr, path).await;
            assert_eq!(status, 200, "{path}");
            slowest = slowest.max(took);
        }
        // Recording a change goes through the recorder's own lock, not the proxier's.
        let mut services = ServiceEvents::default();
        let name = format!("during-{i}");
        let started = Instant::now();
        let s = svc("ns1", &name).cluster_ip(&format!("172.30.1.{}", i + 1)).tcp("http", 80).build();
        services.handle(Event::Apply(s), &rig.set);
        slowest = slowest.max(started.elapsed());
        assert!(rig.recorder.pending_services().iter().any(|n| n.name == name), "{name} recorded");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(rig.slow.restoring(), "the checks ran while the restore was blocked");
    assert!(slowest < Duration::from_millis(100), "slowest answer {slowest:?}");
    rig.stop().await;
}

/// A restore slower than the health timeout that keeps making progress leaves `/livez`
/// healthy; one stuck longer than the timeout in a single step does not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn livez_follows_restore_progress() {
    // Health timeout: 2 × sync period = 1 s.
    let rig = slow_rig(Duration::from_millis(500)).await;
    rig.slow.slow_down(12, Duration::from_millis(250));
    rig.start_slow_sync("progressing", "172.30.0.2").await;
    while rig.slow.restoring() {
        let (status, _) = timed_get(rig.health_addr, "/livez").await;
        assert_eq!(status, 200, "a restore that keeps making progress is alive");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    rig.slow.slow_down(1, Duration::from_secs(3));
    rig.start_slow_sync("stuck", "172.30.0.3").await;
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    assert!(rig.slow.restoring());
    let (status, _) = timed_get(rig.health_addr, "/livez").await;
    assert_eq!(status, 503, "a step stuck past the health timeout is not alive");
    let addr = rig.health_addr;
    eventually_async(
        "/livez healthy again once the restore completes",
        Duration::from_secs(10),
        Duration::from_millis(100),
        || async move { timed_get(addr, "/livez").await.0 == 200 },
    )
    .await;
    rig.stop().await;
}

/// Issue 28: a conntrack cleanup that takes its time (a large UDP table) holds up nothing.
/// While it runs, the sync that left it has already recorded its network-programming
/// latency and last-sync timestamp and refreshed `/healthz` (upstream records them at the
/// restore's success, before its cleanup), a later change of another Service is programmed,
/// and shutdown does not wait for it. When it finishes, exactly the stale entry is gone and
/// the reconciler's metrics count it. (With the cleanup inside the sync, as before, the
/// metrics waited for the cleanup and the second change for both.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_conntrack_cleanup_holds_up_nothing() {
    use k8s_openapi::jiff::Timestamp;
    use kube_proxy_rs::model::Protocol;
    use kube_proxy_rs::node::conntrack::ConntrackEntry;

    let ipt = Arc::new(FakeIptables::new(IpFamily::V4));
    let ct = Arc::new(FakeConntrack::new());
    let client = "10.0.9.9".parse().unwrap();
    let dns_ip = "172.30.0.10".parse().unwrap();
    let flow = |port: u16, endpoint: &str| {
        ConntrackEntry::new(
            Protocol::Udp,
            (client, port),
            (dns_ip, 53),
            (endpoint.parse().unwrap(), 5353),
            (client, port),
        )
    };
    let (gone, kept) = (flow(40001, "10.0.1.1"), flow(40002, "10.0.1.2"));
    ct.set_entries(vec![gone, kept]);
    let deps = DaemonDeps {
        nftables_v4: None,
        nftables_v6: None,
        iptables_v4: Some(ipt.clone()),
        iptables_v6: None,
        sysctl: Arc::new(FakeSysctl::new()),
        interfaces: Arc::new(StaticInterfaces(Vec::new())),
        conntrack: Some(ct.clone()),
        nfacct: None,
        events: Arc::new(kube_proxy_rs::k8s::events::NoopEventRecorder),
    };
    let v4_node = node("node-a", &[], &["10.0.1.0/24"], &["198.18.0.2"]);
    let daemon = Daemon::build(&settings(), "node-a".into(), Some(&v4_node), &deps).expect("daemon");
    let (set, health, metrics) = (daemon.proxier_set(), daemon.health.clone(), daemon.metrics.clone());
    let shutdown = CancellationToken::new();
    let loops = tokio::spawn(daemon.run_loops(shutdown.clone(), None));

    let dns = svc("kube-system", "dns").cluster_ip("172.30.0.10").udp("dns", 53).build();
    let web = svc("ns1", "web").cluster_ip("172.30.0.20").tcp("http", 80).build();
    let dns_slice = |ips: &[&str]| {
        slice("kube-system", "dns", "dns-1")
            .udp("dns", 5353)
            .ips(ips)
            .annotation("endpoints.kubernetes.io/last-change-trigger-time", &Timestamp::now().to_string())
            .build()
    };
    let web_slice = |ip: &str| slice("ns1", "web", "web-1").tcp("http", 8080).ips(&[ip]).build();
    let (mut services, mut slices) = (ServiceEvents::default(), SliceEvents::default());
    for e in [Event::Init, Event::InitApply(dns), Event::InitApply(web), Event::InitDone] {
        services.handle(e, &set);
    }
    for e in [
        Event::Init,
        Event::InitApply(dns_slice(&["10.0.1.1", "10.0.1.2"])),
        Event::InitApply(web_slice("10.0.1.7")),
        Event::InitDone,
    ] {
        slices.handle(e, &set);
    }
    eventually_fast("first sync", WAIT, || ipt.save_all().contains("10.0.1.7:8080")).await;
    // The first sync's cleanup (every endpoint is new) finds nothing stale.
    eventually_fast("first cleanup", WAIT, || ct.listings().len() == 1 && ct.waiting() == 0).await;
    let count = |text: &str, metric: &str| {
        text.lines().find(|l| l.starts_with(metric)).map(|l| l.rsplit(' ').next().unwrap_or("").to_owned())
    };
    let programmed = |text: &str| count(text, "kubeproxy_network_programming_duration_seconds_count");
    let reconciled = |text: &str| count(text, "kubeproxy_conntrack_reconciler_sync_duration_seconds_count");
    let text = metrics.encode_text().expect("metrics");
    let before = (programmed(&text), health.health().last_updated, reconciled(&text));
    assert_eq!(before.2.as_deref(), Some("1"), "{text}");

    // Endpoint .1 goes away; its cleanup blocks in the listing.
    ct.hold();
    slices.handle(Event::Apply(dns_slice(&["10.0.1.2"])), &set);
    eventually_fast("the rules drop 10.0.1.1", WAIT, || !ipt.save_all().contains("10.0.1.1:5353")).await;
    eventually_fast("the cleanup to be running", WAIT, || ct.waiting() == 1).await;
    let text = metrics.encode_text().expect("metrics");
    assert_ne!(programmed(&text), before.0, "network programming latency recorded before the cleanup ends:\n{text}");
    assert!(health.health().last_updated > before.1, "/healthz updated before the cleanup ends");
    assert_eq!(reconciled(&text), before.2, "the running cleanup is not recorded yet:\n{text}");

    // Another Service's change is programmed while the cleanup still runs.
    slices.handle(Event::Apply(web_slice("10.0.1.8")), &set);
    eventually_fast("the web change", WAIT, || ipt.save_all().contains("10.0.1.8:8080")).await;
    assert_eq!(ct.waiting(), 1, "the cleanup is still running");
    assert_eq!(ct.entries(), [gone, kept], "nothing deleted yet");

    ct.release();
    eventually_fast("the stale entry deleted", WAIT, || ct.entries() == [kept]).await;
    eventually_fast("the reconciler's metrics", WAIT, || {
        let text = metrics.encode_text().expect("metrics");
        text.contains(r#"kubeproxy_conntrack_reconciler_deleted_entries_total{ip_family="IPv4"} 1"#)
    })
    .await;

    // Shutdown while a cleanup runs does not wait for it.
    ct.hold();
    slices.handle(Event::Apply(dns_slice(&["10.0.1.3"])), &set);
    eventually_fast("another cleanup running", WAIT, || ct.waiting() == 1).await;
    let stopping = Instant::now();
    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(5), loops)
        .await
        .expect("loops stop while the cleanup runs")
        .expect("loop task")
        .expect("no loop ended before shutdown");
    assert!(stopping.elapsed() < Duration::from_secs(5));
    assert_eq!(ct.waiting(), 1, "the cleanup was still running");
    ct.release();
}
