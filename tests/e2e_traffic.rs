//! The whole product with real packets: the `kube-proxy-rs` binary in node-a of a small
//! cluster network (tests/support/cluster_net.rs), fed by the test API server, programming
//! node-a's iptables (nft backend), with clients and servers in pod, node and external
//! namespaces. Each test prints "scenario N: pass (Ts)" per scenario it covers. Root only.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use kube_proxy_rs::tracker::testing::svc;

use crate::require_root;
use crate::support::cluster_net::{
    CLIENT_IP, CLIENT_IP_ALT, CLIENT_TIMEOUT, CPOD, Cluster, Failure, NODE_A_IP, NODE_A_TO_B, NsName, Outcome, POD_A1,
    POD_A2, POD_B1, SERVE_PORT, SYNC_PERIOD, TcpFlow, UdpFlow, ok_all, pods_slice, pods_slice6, sa, tally, tcp_request,
    tcp_requests, udp_requests, web,
};
use crate::support::e2e::BIN;
use crate::support::poll::{SLOW_POLL, eventually, poll_until};

const NS: &str = crate::support::cluster_net::SCENARIO_NS;
/// How long the daemon may take to program a change (first sync included).
const PROGRAMMED: Duration = Duration::from_secs(30);

fn pass(scenario: &str, started: Instant) {
    eprintln!("scenario {scenario}: pass ({:.1}s)", started.elapsed().as_secs_f64());
}

/// Waits until a TCP request from `ns` to `dst` is answered by one of `pods`.
async fn wait_answered(c: &Cluster, from: &impl NsName, dst: std::net::SocketAddr, pods: &[&str]) {
    let mut last = None;
    let answered = poll_until(PROGRAMMED, SLOW_POLL, || {
        let o = tcp_request(from, dst, None);
        let done = matches!(&o, Ok(r) if pods.contains(&r.pod.as_str()));
        last = Some(o);
        done
    });
    if answered.await.is_some() {
        return;
    }
    panic!("{dst} not answered by {pods:?} within {PROGRAMMED:?}; last {last:?}\n{}\n{}", c.nat(), c.log());
}

fn assert_spread(outcomes: &[Outcome], pods: &[&str], min_share: f64, what: &str) {
    ok_all(outcomes, what);
    let (per_pod, _) = tally(outcomes);
    for p in pods {
        let n = per_pod.get(*p).copied().unwrap_or(0);
        assert!(
            n as f64 >= min_share * outcomes.len() as f64,
            "{what}: {p} got {n} of {}: {per_pod:?}",
            outcomes.len()
        );
    }
    assert!(per_pod.keys().all(|k| pods.contains(&k.as_str())), "{what}: unexpected pods {per_pod:?}");
}

/// Scenarios 1 and 2: a ClusterIP spreads TCP and UDP over 2 local + 1 remote endpoint;
/// scaling down and up changes where new connections go after the next sync.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_ip_spreads_and_follows_scaling() {
    require_root!();
    let c = Cluster::start("tr-spread").await;
    let t = Instant::now();
    let (a1, a2, b1, cpod) = (c.pod(POD_A1), c.pod(POD_A2), c.pod(POD_B1), &c.pod(CPOD).ns);
    c.server.create(&web("web", "198.19.0.10").build());
    c.server.create(&pods_slice("web", &[a1, a2, b1]).build());
    let (http, dns) = (sa("198.19.0.10", 80), sa("198.19.0.10", 53));
    wait_answered(&c, cpod, http, &[a1.name, a2.name, b1.name]).await;

    let all = [a1.name, a2.name, b1.name];
    let tcp = tcp_requests(cpod, http, None, 150);
    assert_spread(&tcp, &all, 0.15, "TCP over 150 connections");
    let udp = udp_requests(cpod, dns, None, 150);
    assert_spread(&udp, &all, 0.15, "UDP over 150 flows");
    // Pod to service is not masqueraded: the server sees the client pod.
    assert!(tcp.iter().chain(&udp).all(|o| o.as_ref().is_ok_and(|r| r.peer == c.pod(CPOD).ip)), "{tcp:?}");
    pass("1 (ClusterIP TCP+UDP spread over 2 local + 1 remote endpoints)", t);

    let t = Instant::now();
    c.server.update(&pods_slice("web", &[a1, a2]).build());
    eventually("pod-b1 removed from the rules", PROGRAMMED, || !c.nat().contains(&format!("{}:{SERVE_PORT}", b1.ip)))
        .await;
    let down = tcp_requests(cpod, http, None, 60);
    assert_spread(&down, &[a1.name, a2.name], 0.2, "TCP after scaling down");
    assert_spread(&udp_requests(cpod, dns, None, 60), &[a1.name, a2.name], 0.2, "UDP after scaling down");

    c.server.update(&pods_slice("web", &[a1, a2, b1]).build());
    eventually("pod-b1 back in the rules", PROGRAMMED, || c.nat().contains(&format!("{}:{SERVE_PORT}", b1.ip))).await;
    assert_spread(&tcp_requests(cpod, http, None, 90), &all, 0.12, "TCP after scaling up");
    assert_spread(&udp_requests(cpod, dns, None, 90), &all, 0.12, "UDP after scaling up");
    pass("2 (scale down / up)", t);
}

/// Scenario 3: session affinity ClientIP keeps each client on one pod; turning it off
/// spreads again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_affinity_sticks_and_unsticks() {
    require_root!();
    let c = Cluster::start("tr-aff").await;
    let t = Instant::now();
    let (a1, a2, b1) = (c.pod(POD_A1), c.pod(POD_A2), c.pod(POD_B1));
    let all = [a1.name, a2.name, b1.name];
    c.server.create(&web("sticky", "198.19.0.30").affinity(Some(600)).build());
    c.server.create(&pods_slice("sticky", &[a1, a2, b1]).build());
    let http = sa("198.19.0.30", 80);
    wait_answered(&c, &c.pod(CPOD).ns, http, &all).await;

    for (who, ns, src) in [
        ("cpod", &c.pod(CPOD).ns, None),
        ("client .1", &c.client, Some(CLIENT_IP)),
        ("client .3", &c.client, Some(CLIENT_IP_ALT)),
    ] {
        let out = tcp_requests(ns, http, src, 40);
        ok_all(&out, who);
        let (per_pod, _) = tally(&out);
        assert_eq!(per_pod.len(), 1, "{who} must stick to one pod: {per_pod:?}");
    }

    c.server.update(&web("sticky", "198.19.0.30").build());
    eventually("affinity off spreads again", PROGRAMMED, || {
        let (per_pod, failures) = tally(&tcp_requests(&c.pod(CPOD).ns, http, None, 60));
        failures.is_empty() && per_pod.len() == 3
    })
    .await;
    pass("3 (session affinity ClientIP on and off)", t);
}

/// Scenario 4: NodePort and external IP from outside; a load-balancer IP with source ranges
/// admits the allowed source and drops the other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_port_external_ip_and_load_balancer_source_ranges() {
    require_root!();
    let c = Cluster::start("tr-ext").await;
    let t = Instant::now();
    let (a1, b1) = (c.pod(POD_A1), c.pod(POD_B1));
    let both = [a1.name, b1.name];
    let edge = svc(NS, "edge").type_("NodePort").cluster_ip("198.19.0.40").node_port("http", 80, 30080);
    c.server.create(&edge.external_ips(&["198.18.40.10"]).build());
    c.server.create(&pods_slice("edge", &[a1, b1]).build());
    let lb = svc(NS, "lb").type_("LoadBalancer").cluster_ip("198.19.0.41").node_port("http", 80, 30081);
    c.server.create(&lb.lb_ingress(&["198.18.40.20"]).source_ranges(&[&format!("{CLIENT_IP}/32")]).build());
    c.server.create(&pods_slice("lb", &[a1, b1]).build());

    let node_port = sa(NODE_A_IP, 30080);
    wait_answered(&c, &c.client, node_port, &both).await;
    for src in [CLIENT_IP, CLIENT_IP_ALT] {
        assert_spread(&tcp_requests(&c.client, node_port, Some(src), 40), &both, 0.1, &format!("NodePort from {src}"));
    }
    let external = sa("198.18.40.10", 80);
    assert_spread(&tcp_requests(&c.client, external, Some(CLIENT_IP_ALT), 40), &both, 0.1, "external IP");

    let lb_ip = sa("198.18.40.20", 80);
    eventually("LB IP answers the allowed source", PROGRAMMED, || {
        tcp_request(&c.client, lb_ip, Some(CLIENT_IP)).is_ok()
    })
    .await;
    assert_spread(&tcp_requests(&c.client, lb_ip, Some(CLIENT_IP), 40), &both, 0.1, "LB IP from the allowed source");
    let denied = tcp_request(&c.client, lb_ip, Some(CLIENT_IP_ALT));
    assert_eq!(denied, Err(Failure::Timeout), "a source outside loadBalancerSourceRanges is dropped");
    pass("4 (NodePort, external IP, LB IP with source ranges)", t);
}

/// Scenario 5: externalTrafficPolicy Local answers from local pods only and keeps the client
/// source; Cluster spreads over all and masquerades.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn external_traffic_policy_local_and_cluster() {
    require_root!();
    let c = Cluster::start("tr-etp").await;
    let t = Instant::now();
    let (a1, b1) = (c.pod(POD_A1), c.pod(POD_B1));
    let local = || svc(NS, "local").type_("NodePort").cluster_ip("198.19.0.50").node_port("http", 80, 30082);
    c.server.create(&local().external_policy("Local").build());
    c.server.create(&pods_slice("local", &[a1, b1]).build());
    let node_port = sa(NODE_A_IP, 30082);
    wait_answered(&c, &c.client, node_port, &[a1.name]).await;
    let out = tcp_requests(&c.client, node_port, Some(CLIENT_IP), 40);
    ok_all(&out, "ETP Local");
    for r in out.iter().flatten() {
        assert_eq!((r.pod.as_str(), r.peer.as_str()), (a1.name, CLIENT_IP), "ETP Local: local pod, client source kept");
    }

    c.server.update(&local().external_policy("Cluster").build());
    eventually("ETP Cluster reaches the remote pod", PROGRAMMED, || {
        tcp_requests(&c.client, node_port, Some(CLIENT_IP), 10)
            .iter()
            .any(|o| o.as_ref().is_ok_and(|r| r.pod == b1.name))
    })
    .await;
    let out = tcp_requests(&c.client, node_port, Some(CLIENT_IP), 60);
    assert_spread(&out, &[a1.name, b1.name], 0.1, "ETP Cluster");
    for r in out.iter().flatten() {
        let node_addr = if r.pod == a1.name { a1.node_side.as_str() } else { NODE_A_TO_B };
        assert_eq!(r.peer, node_addr, "ETP Cluster masquerades to the node ({r:?})");
    }
    pass("5 (externalTrafficPolicy Local keeps the source; Cluster masquerades)", t);
}

/// Scenario 6: internalTrafficPolicy Local without a local endpoint drops; a Service without
/// endpoints rejects at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn internal_local_without_local_endpoints_drops_and_no_endpoints_rejects() {
    require_root!();
    let c = Cluster::start("tr-itp").await;
    let t = Instant::now();
    let (b1, cpod) = (c.pod(POD_B1), &c.pod(CPOD).ns);
    c.server.create(&web("internal", "198.19.0.60").build());
    c.server.create(&pods_slice("internal", &[b1]).build());
    let http = sa("198.19.0.60", 80);
    // Control: with the Cluster policy the remote endpoint answers.
    wait_answered(&c, cpod, http, &[b1.name]).await;
    c.server.update(&web("internal", "198.19.0.60").internal_local().build());
    eventually("no-local-endpoints rule", PROGRAMMED, || {
        c.node_a.ok(&["iptables-nft-save"]).contains("\"ns1/internal:http has no local endpoints\"")
    })
    .await;
    let started = Instant::now();
    assert_eq!(tcp_request(cpod, http, None), Err(Failure::Timeout), "ITP Local without local endpoints drops");
    assert!(started.elapsed() >= CLIENT_TIMEOUT);
    assert_eq!(udp_requests(cpod, sa("198.19.0.60", 53), None, 1)[0], Err(Failure::Timeout));

    c.server.create(&web("empty", "198.19.0.61").build());
    eventually("REJECT for the endpoint-less service", PROGRAMMED, || {
        c.filter().contains("\"ns1/empty:http has no endpoints\"")
    })
    .await;
    let started = Instant::now();
    let tcp = tcp_request(cpod, sa("198.19.0.61", 80), None);
    let tcp_took = started.elapsed();
    assert_eq!(tcp, Err(Failure::Refused), "no endpoints: REJECT");
    assert!(tcp_took < Duration::from_millis(500), "REJECT must refuse at once, took {tcp_took:?}");
    let started = Instant::now();
    let udp = udp_requests(cpod, sa("198.19.0.61", 53), None, 1).remove(0);
    let udp_took = started.elapsed();
    assert_eq!(udp, Err(Failure::Refused), "no endpoints: REJECT (UDP)");
    assert!(udp_took < Duration::from_millis(500), "UDP REJECT took {udp_took:?}");
    pass(&format!("6 (ITP Local without local endpoints: drop; no endpoints: refused in {tcp_took:?})"), t);
}

/// Scenario 7: a pod reaching its own Service (it is the only endpoint) gets its own answer,
/// masqueraded so the reply comes back through the node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hairpin_pod_reaches_itself_through_its_service() {
    require_root!();
    let c = Cluster::start("tr-hairpin").await;
    let t = Instant::now();
    let a1 = c.pod(POD_A1);
    c.server.create(&web("self", "198.19.0.70").build());
    c.server.create(&pods_slice("self", &[a1]).build());
    let http = sa("198.19.0.70", 80);
    wait_answered(&c, &a1.ns, http, &[a1.name]).await;
    for o in
        tcp_requests(&a1.ns, http, None, 10).into_iter().chain(udp_requests(&a1.ns, sa("198.19.0.70", 53), None, 10))
    {
        let r = o.expect("hairpin request");
        assert_eq!(
            (r.pod.as_str(), r.peer.as_str()),
            (a1.name, a1.node_side.as_str()),
            "hairpin lands on itself, masqueraded"
        );
    }
    pass("7 (hairpin)", t);
}

/// Scenario 8: a UDP client that keeps its socket reaches the new endpoint after the only
/// endpoint is replaced (the daemon clears the stale conntrack entry; the old pod still
/// answers, so without that the flow would stay on it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn udp_flow_moves_to_the_replacement_endpoint() {
    require_root!();
    let c = Cluster::start("tr-udp").await;
    let t = Instant::now();
    let (a1, a2) = (c.pod(POD_A1), c.pod(POD_A2));
    c.server.create(&web("dns", "198.19.0.80").build());
    c.server.create(&pods_slice("dns", &[a1]).build());
    let flow = UdpFlow::open(&c.pod(CPOD).ns, sa("198.19.0.80", 53));
    eventually("UDP flow answered by pod-a1", PROGRAMMED, || flow.request().is_ok_and(|r| r.pod == a1.name)).await;
    for _ in 0..5 {
        assert_eq!(flow.request().map(|r| r.pod), Ok(a1.name.to_string()));
    }
    let replaced = Instant::now();
    c.server.update(&pods_slice("dns", &[a2]).build());
    let limit = SYNC_PERIOD + Duration::from_secs(5);
    eventually("same UDP socket reaches the new pod", limit, || {
        std::thread::sleep(Duration::from_millis(100));
        flow.request().is_ok_and(|r| r.pod == a2.name)
    })
    .await;
    let moved = replaced.elapsed();
    for _ in 0..5 {
        assert_eq!(flow.request().map(|r| r.pod), Ok(a2.name.to_string()));
    }
    pass(&format!("8 (UDP flow follows the replaced endpoint after {moved:?})"), t);
}

/// Scenario 9: dual stack: the daemon runs both proxiers and an IPv6 ClusterIP works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ipv6_cluster_ip_in_dual_stack() {
    require_root!();
    let c = Cluster::start("tr-v6").await;
    let t = Instant::now();
    let (a1, a2, cpod) = (c.pod(POD_A1), c.pod(POD_A2), c.pod(CPOD));
    c.server
        .create(&svc(NS, "web6").cluster_ips(&["198.19.0.90", "fd00:5019::90"]).tcp("http", 80).udp("dns", 53).build());
    c.server.create(&pods_slice("web6", &[a1, a2]).build());
    c.server.create(&pods_slice6("web6", &[a1, a2]));
    let http6 = sa("fd00:5019::90", 80);
    wait_answered(&c, &cpod.ns, http6, &[a1.name, a2.name]).await;
    let tcp = tcp_requests(&cpod.ns, http6, None, 60);
    assert_spread(&tcp, &[a1.name, a2.name], 0.2, "IPv6 TCP");
    let udp = udp_requests(&cpod.ns, sa("fd00:5019::90", 53), None, 60);
    assert_spread(&udp, &[a1.name, a2.name], 0.2, "IPv6 UDP");
    assert!(tcp.iter().chain(&udp).all(|o| o.as_ref().is_ok_and(|r| r.peer == cpod.ip6)), "{tcp:?}");
    // The IPv4 ClusterIP of the same Service works too.
    assert_spread(&tcp_requests(&cpod.ns, sa("198.19.0.90", 80), None, 30), &[a1.name, a2.name], 0.1, "IPv4 TCP");
    assert!(c.log().contains("dual-stack"), "the daemon must say it runs dual-stack:\n{}", c.log());
    pass("9 (IPv6 ClusterIP, dual-stack)", t);
}

/// Waits until the service answers again and returns how long that took since `since`.
fn restored_after(c: &Cluster, dst: std::net::SocketAddr, since: Instant, limit: Duration) -> Duration {
    loop {
        if tcp_request(&c.pod(CPOD).ns, dst, None).is_ok() {
            return since.elapsed();
        }
        assert!(since.elapsed() < limit, "service not restored within {limit:?}\n{}\n{}", c.nat(), c.log());
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Scenario 10: someone flushes the nat table, or flushes and deletes the chains: service
/// traffic is back within a sync period (plus slack).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn service_traffic_recovers_from_flushed_rules() {
    require_root!();
    let c = Cluster::start("tr-flush").await;
    let t = Instant::now();
    let (a1, a2) = (c.pod(POD_A1), c.pod(POD_A2));
    c.server.create(&web("web", "198.19.0.100").build());
    c.server.create(&pods_slice("web", &[a1, a2]).build());
    let http = sa("198.19.0.100", 80);
    wait_answered(&c, &c.pod(CPOD).ns, http, &[a1.name, a2.name]).await;
    // Let the canaries settle (they are created when the loop starts).
    tokio::time::sleep(SYNC_PERIOD).await;
    let limit = SYNC_PERIOD + Duration::from_secs(3);
    let mut took = Vec::new();
    for (what, fault) in [
        (
            "all tables flushed and chains deleted",
            "for t in mangle nat filter; do iptables-nft -t $t -F && iptables-nft -t $t -X; done",
        ),
        ("nat -F", "iptables-nft -t nat -F"),
        ("nat -F and -X", "iptables-nft -t nat -F && iptables-nft -t nat -X"),
    ] {
        let since = Instant::now();
        c.node_a.ok(&["sh", "-c", fault]);
        let restored = restored_after(&c, http, since, limit);
        assert!(c.nat().contains("-A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES"));
        ok_all(&tcp_requests(&c.pod(CPOD).ns, http, None, 20), "after recovery");
        took.push(format!("{what}: {:.1}s", restored.as_secs_f64()));
        // The next fault only after the monitor has seen the repaired rules.
        tokio::time::sleep(SYNC_PERIOD + Duration::from_millis(500)).await;
    }
    pass(&format!("10 (traffic restored after {})", took.join(", ")), t);
}

/// Scenario 11: SIGKILL and restart: an established connection and new connections keep
/// working during the gap and the restart, the nat table never loses KUBE-SERVICES, and the
/// restarted daemon converges (programs a Service created while it was down).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn daemon_kill_and_restart_keeps_traffic_flowing() {
    require_root!();
    let mut c = Cluster::start("tr-restart").await;
    let t = Instant::now();
    let (a1, a2) = (c.pod(POD_A1), c.pod(POD_A2));
    let pods = [a1.name, a2.name];
    c.server.create(&web("long", "198.19.0.110").build());
    c.server.create(&pods_slice("long", &[a1, a2]).build());
    let after_slice = pods_slice("after", &[a1, a2]).build();
    let http = sa("198.19.0.110", 80);
    wait_answered(&c, &c.client, http, &pods).await;
    let mut flow = TcpFlow::open(&c.client, sa("198.19.0.110", 81)).expect("long-lived connection");
    let first = flow.request().expect("echo");

    // Probes: the nat table and new connections, continuously until stopped.
    let stop = Arc::new(AtomicBool::new(false));
    let (rounds, missing, failed) =
        (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let probe = {
        let (stop, rounds, missing, failed) = (stop.clone(), rounds.clone(), missing.clone(), failed.clone());
        let (node, client) = (c.node_a.name.clone(), c.client.name.clone());
        std::thread::spawn(move || {
            let mut problems = Vec::new();
            while !stop.load(Ordering::SeqCst) {
                let nat = nat_of(&node);
                if !nat.contains("-j KUBE-SERVICES") || !nat.contains("198.18.101.2:8080") {
                    missing.fetch_add(1, Ordering::SeqCst);
                    problems.push(nat);
                }
                if let Err(e) = tcp_request(&client, http, Some(CLIENT_IP)) {
                    failed.fetch_add(1, Ordering::SeqCst);
                    problems.push(format!("{e:?}"));
                }
                rounds.fetch_add(1, Ordering::SeqCst);
                std::thread::sleep(Duration::from_millis(30));
            }
            problems
        })
    };

    c.daemon().signal("KILL");
    let mut daemon = c.daemon.take().expect("daemon");
    let status = daemon.wait_exit(Duration::from_secs(10)).await;
    assert!(!status.success(), "killed");
    // The gap: rules stay, old and new connections work.
    let during = flow.request().expect("long-lived connection during the gap");
    assert_eq!(during.pod, first.pod);
    ok_all(&tcp_requests(&c.client, http, None, 30), "new connections during the gap");
    c.server.create(&web("after", "198.19.0.111").build());
    c.server.create(&after_slice);
    tokio::time::sleep(Duration::from_secs(1)).await;

    c.start_daemon();
    wait_answered(&c, &c.client, sa("198.19.0.111", 80), &pods).await;
    // A couple more sync periods of probing after convergence.
    tokio::time::sleep(SYNC_PERIOD * 2).await;
    stop.store(true, Ordering::SeqCst);
    let problems = probe.join().expect("probe thread");
    let rounds = rounds.load(Ordering::SeqCst);
    assert!(rounds > 20, "probe ran only {rounds} rounds");
    assert!(problems.is_empty(), "{} of {rounds} probe rounds saw a problem; first: {}", problems.len(), problems[0]);
    assert_eq!(missing.load(Ordering::SeqCst) + failed.load(Ordering::SeqCst), 0);
    let after = flow.request().expect("long-lived connection after the restart");
    assert_eq!(after.pod, first.pod);
    pass(&format!("11 (SIGKILL + restart, {rounds} probe rounds clean)"), t);
}

/// The nat table of namespace `ns` (by name, for probe threads).
fn nat_of(ns: &str) -> String {
    let out = std::process::Command::new("ip").args(["netns", "exec", ns, "iptables-nft-save", "-t", "nat"]).output();
    out.map(|o| String::from_utf8_lossy(&o.stdout).into_owned()).unwrap_or_default()
}

const FOREIGN: &str = "*nat\n:OTHER-OWNER - [0:0]\n-A OTHER-OWNER -d 198.18.250.1/32 -j RETURN\n-A PREROUTING -j OTHER-OWNER\nCOMMIT\n*filter\n:OTHER-FILTER - [0:0]\n-A OTHER-FILTER -s 198.18.250.0/24 -j ACCEPT\n-A INPUT -j OTHER-FILTER\nCOMMIT\n";

/// Rules of all tables, comments dropped.
fn save_all(c: &Cluster, cmd: &str) -> String {
    c.node_a.ok(&[cmd]).lines().filter(|l| !l.starts_with('#')).map(|l| format!("{l}\n")).collect()
}

/// Scenario 12: `--cleanup` with traffic flowing removes every rule of ours and nothing else.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cleanup_with_traffic_removes_ours_only() {
    require_root!();
    let mut c = Cluster::start("tr-cleanup").await;
    let t = Instant::now();
    let out = c.node_a.run_with_stdin(&["iptables-nft-restore", "--noflush"], FOREIGN);
    assert!(out.success(), "seeding foreign rules: {}", out.combined());
    let (a1, b1) = (c.pod(POD_A1), c.pod(POD_B1));
    let lb = svc(NS, "lb").type_("LoadBalancer").cluster_ip("198.19.0.120").node_port("http", 80, 30090);
    c.server.create(&lb.lb_ingress(&["198.18.40.30"]).source_ranges(&["198.18.30.0/24"]).affinity(None).build());
    c.server.create(&pods_slice("lb", &[a1, b1]).build());
    c.server.create(&web("empty", "198.19.0.121").build());
    let local = svc(NS, "local").type_("NodePort").cluster_ip("198.19.0.122").node_port("http", 80, 30091);
    c.server.create(&local.external_policy("Local").build());
    c.server.create(&pods_slice("local", &[b1]).build());
    c.server.create(&svc(NS, "web6").cluster_ips(&["198.19.0.123", "fd00:5019::123"]).tcp("http", 80).build());
    c.server.create(&pods_slice6("web6", &[a1]));
    let node_port = sa(NODE_A_IP, 30090);
    wait_answered(&c, &c.client, node_port, &[a1.name, b1.name]).await;
    wait_answered(&c, &c.pod(CPOD).ns, sa("fd00:5019::123", 80), &[a1.name]).await;
    eventually("all services programmed", PROGRAMMED, || {
        let all = save_all(&c, "iptables-nft-save");
        all.contains("ns1/empty:http has no endpoints") && all.contains("ns1/local:http has no local endpoints")
    })
    .await;
    for cmd in ["iptables-nft-save", "ip6tables-nft-save"] {
        let before = save_all(&c, cmd);
        assert!(before.contains(":KUBE-SVC-") && before.contains(":KUBE-SEP-"), "{cmd}: nothing installed:\n{before}");
    }

    // The daemon stops (its rules stay), then --cleanup runs while clients keep connecting.
    c.daemon().signal("TERM");
    let mut daemon = c.daemon.take().expect("daemon");
    assert!(daemon.wait_exit(Duration::from_secs(20)).await.success(), "{}", daemon.log_text());
    let stop = Arc::new(AtomicBool::new(false));
    let traffic = {
        let stop = stop.clone();
        let client = c.client.name.clone();
        std::thread::spawn(move || {
            let mut answered = 0;
            while !stop.load(Ordering::SeqCst) {
                answered += usize::from(tcp_request(&client, node_port, None).is_ok());
            }
            answered
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let out = c.node_a.run(&[BIN, "--cleanup"]);
    assert!(out.success(), "--cleanup failed: {}", out.combined());
    stop.store(true, Ordering::SeqCst);
    let answered = traffic.join().expect("traffic thread");
    assert!(answered > 0, "traffic flowed before the cleanup");

    for cmd in ["iptables-nft-save", "ip6tables-nft-save"] {
        let after = save_all(&c, cmd);
        let ours: Vec<&str> = after
            .lines()
            .filter(|l| l.contains("KUBE-") && !l.contains("KUBE-FIREWALL") && !l.contains("KUBE-KUBELET-CANARY"))
            .collect();
        assert!(ours.is_empty(), "{cmd}: left behind after --cleanup:\n{}", ours.join("\n"));
    }
    let after = save_all(&c, "iptables-nft-save");
    for foreign in [
        ":OTHER-OWNER",
        "-A OTHER-OWNER -d 198.18.250.1/32 -j RETURN",
        "-A PREROUTING -j OTHER-OWNER",
        ":OTHER-FILTER",
        "-A OTHER-FILTER -s 198.18.250.0/24 -j ACCEPT",
        "-A INPUT -j OTHER-FILTER",
    ] {
        assert!(after.contains(foreign), "foreign rule {foreign:?} lost:\n{after}");
    }
    // With the rules gone the Service no longer answers.
    assert!(tcp_request(&c.client, node_port, None).is_err(), "the NodePort must be gone");
    pass(&format!("12 (--cleanup under traffic; {answered} requests answered before it)"), t);
}
