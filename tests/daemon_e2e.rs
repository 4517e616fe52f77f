//! The real binary as a node runs it: `kube-proxy-rs` in a "node" network namespace, talking
//! to the test API server bound in an "api" namespace over a veth link. It waits for the
//! lists, programs the node's iptables, follows changes, answers /healthz, and on SIGTERM
//! exits 0 leaving the service rules (and removing its canaries). Root only.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use k8s_openapi::api::discovery::v1::EndpointSlice;

use crate::require_root;
use crate::support::apiserver::ApiServer;
use crate::support::fixtures::{node, slice, svc};
use crate::support::netns::Netns;

const BIN: &str = env!("CARGO_BIN_EXE_kube-proxy-rs");
const API_IP: &str = "198.18.20.1";
const NODE_IP: &str = "198.18.20.2";

/// Binds a TCP listener inside network namespace `ns` (the socket stays in that namespace).
fn bind_in_netns(ns: &str, addr: &str) -> std::net::TcpListener {
    let path = format!("/var/run/netns/{ns}");
    let addr = addr.to_string();
    std::thread::spawn(move || {
        let f = std::fs::File::open(&path).expect("open netns");
        nix::sched::setns(&f, nix::sched::CloneFlags::CLONE_NEWNET).expect("setns");
        std::net::TcpListener::bind(&addr).expect("bind in netns")
    })
    .join()
    .expect("bind thread")
}

fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().expect("ip");
    assert!(out.status.success(), "ip {args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

/// Kills the daemon if the test fails before stopping it.
struct Daemon(Option<Child>);

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn nat(ns: &Netns) -> String {
    ns.ok(&["iptables-nft-save", "-t", "nat"])
}

async fn eventually(what: &str, limit: Duration, mut check: impl FnMut() -> bool) {
    let start = Instant::now();
    while !check() {
        assert!(start.elapsed() < limit, "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn web_slice(ip: &str) -> EndpointSlice {
    slice("ns1", "web", "web-1").tcp("http", 8080).ips(&[ip]).build()
}

/// An "api" and a "node" namespace joined by a veth pair, with the test API server bound in
/// the api namespace. The namespaces (and so the veth) go away when dropped.
async fn topology(tag: &str) -> (Netns, Netns, ApiServer) {
    static LINKS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let api_ns = Netns::create(&format!("{tag}-api"));
    let node_ns = Netns::create(&format!("{tag}-node"));
    let n = LINKS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    let (a, b) = (format!("kpa{}x{n}", std::process::id() % 10_000), format!("kpn{}x{n}", std::process::id() % 10_000));
    ip(&["link", "add", &a, "type", "veth", "peer", "name", &b]);
    ip(&["link", "set", &a, "netns", &api_ns.name]);
    ip(&["link", "set", &b, "netns", &node_ns.name]);
    api_ns.ok(&["ip", "addr", "add", &format!("{API_IP}/30"), "dev", &a]);
    node_ns.ok(&["ip", "addr", "add", &format!("{NODE_IP}/30"), "dev", &b]);
    for (ns, dev) in [(&api_ns, &a), (&node_ns, &b)] {
        ns.ok(&["ip", "link", "set", dev, "up"]);
        ns.ok(&["ip", "link", "set", "lo", "up"]);
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let server = ApiServer::start_on(bind_in_netns(&api_ns.name, &format!("{API_IP}:0")));
    (api_ns, node_ns, server)
}

fn kubeconfig_text(server: &ApiServer) -> String {
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: t\n  cluster: {{server: \"{}\"}}\nusers:\n- name: t\n  user: {{}}\ncontexts:\n- name: t\n  context: {{cluster: t, user: t}}\ncurrent-context: t\n",
        server.url()
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn daemon_programs_follows_and_exits_cleanly() {
    require_root!();
    let (_api_ns, node_ns, server) = topology("e2e").await;
    server.create(&node("node-e2e", &[], &[], &[NODE_IP]));
    let web = svc("ns1", "web").cluster_ip("172.30.0.1").tcp("http", 80).build();
    server.create(&web);
    server.create(&web_slice("10.1.0.1"));

    let dir = std::env::temp_dir().join(format!("kpr-e2e-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("tmp");
    let kubeconfig = dir.join("kubeconfig");
    std::fs::write(&kubeconfig, kubeconfig_text(&server)).expect("write kubeconfig");
    let log = std::fs::File::create(dir.join("daemon.log")).expect("log");
    let child = Command::new("ip")
        .args(["netns", "exec", &node_ns.name, BIN])
        .arg("--kubeconfig")
        .arg(&kubeconfig)
        .args([
            "--hostname-override=node-e2e",
            "--iptables-sync-period=2s",
            "--iptables-min-sync-period=100ms",
            "--conntrack-max-per-core=0",
            &format!("--healthz-bind-address={NODE_IP}:10256"),
            "--metrics-bind-address=127.0.0.1:10249",
            "-v=2",
        ])
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("start daemon");
    let pid = child.id();
    let mut daemon = Daemon(Some(child));
    let log_text = || std::fs::read_to_string(dir.join("daemon.log")).unwrap_or_default();

    let limit = Duration::from_secs(30);
    eventually("initial rules", limit, || nat(&node_ns).contains("--to-destination 10.1.0.1:8080")).await;
    let n = nat(&node_ns);
    assert!(n.contains("-A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES"), "{n}");
    assert!(n.contains(":KUBE-PROXY-CANARY"), "{n}");

    // Follow a rollout and a new service.
    server.update(&web_slice("10.1.0.2"));
    let db = svc("ns2", "db").cluster_ip("172.30.0.2").udp("dns", 53).build();
    server.create(&db);
    eventually("updates followed", limit, || {
        let n = nat(&node_ns);
        n.contains("--to-destination 10.1.0.2:8080") && !n.contains("10.1.0.1:8080")
    })
    .await;
    eventually("REJECT for the endpoint-less service", limit, || {
        node_ns.ok(&["iptables-nft-save", "-t", "filter"]).contains("\"ns2/db:dns has no endpoints\"")
    })
    .await;

    // /healthz answers 200 with upstream's JSON.
    let healthz = node_ns.ok(&[
        "bash",
        "-c",
        &format!("exec 3<>/dev/tcp/{NODE_IP}/10256; printf 'GET /healthz HTTP/1.0\\r\\n\\r\\n' >&3; cat <&3"),
    ]);
    assert!(healthz.starts_with("HTTP/1.") && healthz.contains(" 200 "), "{healthz}\n{}", log_text());
    assert!(healthz.contains("lastUpdated"), "{healthz}");

    // SIGTERM: exit 0, rules stay, canaries go.
    let _ = Command::new("kill").args(["-TERM", &pid.to_string()]).status();
    let mut child = daemon.0.take().expect("child");
    let deadline = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait") {
            break s;
        }
        assert!(Instant::now() < deadline, "daemon did not exit on SIGTERM\n{}", log_text());
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(status.success(), "exit status {status}\n{}", log_text());
    let n = nat(&node_ns);
    assert!(n.contains("--to-destination 10.1.0.2:8080"), "rules must stay after shutdown:\n{n}");
    assert!(!n.contains("KUBE-PROXY-CANARY"), "canaries removed on shutdown:\n{n}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// With `--config`, a change to the file makes the daemon exit (non-zero, saying why) so the
/// DaemonSet restarts it with the new configuration; its rules stay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn config_file_change_makes_the_daemon_exit() {
    require_root!();
    let (_api_ns, node_ns, server) = topology("e2ecfg").await;
    server.create(&node("node-e2e", &[], &[], &[NODE_IP]));
    server.create(&svc("ns1", "web").cluster_ip("172.30.0.1").tcp("http", 80).build());
    server.create(&web_slice("10.1.0.1"));
    let dir = std::env::temp_dir().join(format!("kpr-e2ecfg-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("tmp");
    let kubeconfig = dir.join("kubeconfig");
    std::fs::write(&kubeconfig, kubeconfig_text(&server)).expect("kubeconfig");
    let config = dir.join("config.yaml");
    let text = format!(
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nclientConnection:\n  kubeconfig: {}\nhostnameOverride: node-e2e\nhealthzBindAddress: {NODE_IP}:10256\nmetricsBindAddress: 127.0.0.1:10249\nconntrack:\n  maxPerCore: 0\niptables:\n  syncPeriod: 2s\n  minSyncPeriod: 100ms\n",
        kubeconfig.display()
    );
    std::fs::write(&config, &text).expect("config");
    let log = std::fs::File::create(dir.join("daemon.log")).expect("log");
    let child = Command::new("ip")
        .args(["netns", "exec", &node_ns.name, BIN, "--config"])
        .arg(&config)
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("start daemon");
    let mut daemon = Daemon(Some(child));
    let log_text = || std::fs::read_to_string(dir.join("daemon.log")).unwrap_or_default();
    eventually("initial rules", Duration::from_secs(30), || nat(&node_ns).contains("--to-destination 10.1.0.1:8080"))
        .await;

    std::fs::write(&config, text.replace("syncPeriod: 2s", "syncPeriod: 3s")).expect("edit config");
    let mut child = daemon.0.take().expect("child");
    let deadline = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait") {
            break s;
        }
        assert!(Instant::now() < deadline, "daemon did not exit after its config changed\n{}", log_text());
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(!status.success(), "a config change is an error exit so it gets restarted");
    assert!(log_text().contains("configuration file changed"), "{}", log_text());
    assert!(nat(&node_ns).contains("--to-destination 10.1.0.1:8080"), "rules stay");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Benchmark, run by hand (`cargo test --release --test integration -- --ignored
/// daemon_memory`): the daemon's resident memory holding 10k Services / 100k endpoints,
/// after programming them into a namespace's iptables. Reported in docs/performance.md.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark: run by hand, reported in docs/performance.md"]
async fn daemon_memory_at_10k_services() {
    require_root!();
    let services: usize = std::env::var("KPR_SERVICES").ok().and_then(|v| v.parse().ok()).unwrap_or(10_000);
    let (_api_ns, node_ns, server) = topology("e2emem").await;
    let cluster = kube_proxy_rs::synthetic::cluster(kube_proxy_rs::synthetic::ClusterShape {
        services,
        endpoints_per_service: 10,
    });
    let mut n = cluster.node.clone();
    n.metadata.name = Some("node-e2e".into());
    server.create(&n);
    for s in &cluster.services {
        server.create(s);
    }
    for s in &cluster.slices {
        server.create(s);
    }
    let dir = std::env::temp_dir().join(format!("kpr-e2emem-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("tmp");
    let kubeconfig = dir.join("kubeconfig");
    std::fs::write(&kubeconfig, kubeconfig_text(&server)).expect("kubeconfig");
    let log = std::fs::File::create(dir.join("daemon.log")).expect("log");
    let started = Instant::now();
    let child = Command::new("ip")
        .args(["netns", "exec", &node_ns.name, BIN])
        .arg("--kubeconfig")
        .arg(&kubeconfig)
        .args(["--hostname-override=node-e2e", "--conntrack-max-per-core=0", "--metrics-bind-address=127.0.0.1:10249"])
        .arg(format!("--healthz-bind-address={NODE_IP}:10256"))
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("start daemon");
    let pid = child.id();
    let _daemon = Daemon(Some(child));
    let last = format!("svc-{}", services - 1);
    eventually("all services programmed", Duration::from_secs(600), || {
        node_ns
            .ok(&["iptables-nft-save", "-t", "nat"])
            .contains(&format!("\"ns-{}/{last}:http cluster IP\"", (services - 1) % 100))
    })
    .await;
    let programmed = started.elapsed();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    let rss = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap_or("VmRSS: ?").to_string();
    let hwm = status.lines().find(|l| l.starts_with("VmHWM:")).unwrap_or("VmHWM: ?").to_string();
    eprintln!("{services} services / {} endpoints: programmed in {programmed:?}; {rss}; {hwm}", services * 10);
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--init-only` initialises the node (route_localnet for localhost NodePorts) and exits 0
/// without programming any rule.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn init_only_sets_sysctls_and_exits() {
    require_root!();
    let (_api_ns, node_ns, server) = topology("e2einit").await;
    server.create(&node("node-e2e", &[], &[], &[NODE_IP]));
    server.create(&svc("ns1", "web").cluster_ip("172.30.0.1").tcp("http", 80).build());
    let dir = std::env::temp_dir().join(format!("kpr-e2einit-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("tmp");
    let kubeconfig = dir.join("kubeconfig");
    std::fs::write(&kubeconfig, kubeconfig_text(&server)).expect("kubeconfig");
    assert_eq!(node_ns.ok(&["cat", "/proc/sys/net/ipv4/conf/all/route_localnet"]).trim(), "0");
    let out = Command::new("ip")
        .args([
            "netns",
            "exec",
            &node_ns.name,
            BIN,
            "--init-only",
            "--hostname-override=node-e2e",
            "--conntrack-max-per-core=0",
        ])
        .arg("--kubeconfig")
        .arg(&kubeconfig)
        .output()
        .expect("run --init-only");
    let _ = std::fs::remove_dir_all(&dir);
    assert!(out.status.success(), "--init-only failed: {}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(node_ns.ok(&["cat", "/proc/sys/net/ipv4/conf/all/route_localnet"]).trim(), "1");
    assert!(!nat(&node_ns).contains("KUBE-SERVICES"), "--init-only must not program rules");
}
