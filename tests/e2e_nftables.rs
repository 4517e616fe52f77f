//! nftables mode with real packets: the `kube-proxy-rs` binary in node-a of the small
//! cluster network (tests/support/cluster_net.rs) with `--proxy-mode=nftables` (release 1.37,
//! the default), programming node-a's `kube-proxy` tables. A node switches from iptables mode
//! to nftables mode and back with a TCP connection open through a ClusterIP the whole time,
//! each mode removing the other's rules once its own are in place; external IPs, a
//! load-balancer IP with source ranges, session affinity, externalTrafficPolicy Local with its
//! health-check node port, a Service without endpoints, hairpin traffic, UDP conntrack cleanup
//! and a dual-stack Service, as tests/e2e_traffic.rs checks them in iptables mode. Faults are
//! in tests/e2e_nftables_faults.rs. Root only.

use std::time::{Duration, Instant};

use kube_proxy_rs::tracker::testing::svc;

use crate::require_root;

use crate::support::cluster_net::{
    CLIENT_IP, CLIENT_IP_ALT, CLIENT_IP6, CLIENT_TIMEOUT, CPOD, Cluster, Failure, NODE_A_IP, NODE_A_IP6, NsName,
    Outcome, POD_A1, POD_A2, POD_B1, TcpFlow, UdpFlow, ok_all, pods_slice, pods_slice6, sa, tally, tcp_request,
    tcp_requests, udp_requests, web,
};
use crate::support::e2e::http_get;
use crate::support::poll::{SLOW_POLL, eventually, poll_until};

const NS: &str = crate::support::cluster_net::SCENARIO_NS;
const PROGRAMMED: Duration = Duration::from_secs(30);

fn assert_spread(outcomes: &[Outcome], pods: &[&str], what: &str) {
    let (per_pod, failures) = tally(outcomes);
    assert!(failures.is_empty(), "{what}: {} of {} failed: {failures:?}", failures.len(), outcomes.len());
    for p in pods {
        assert!(per_pod.get(*p).copied().unwrap_or(0) > 0, "{what}: {p} got nothing: {per_pod:?}");
    }
    assert!(per_pod.keys().all(|k| pods.contains(&k.as_str())), "{what}: unexpected pods {per_pod:?}");
}

async fn wait_answered(c: &Cluster, from: &impl NsName, dst: std::net::SocketAddr, pods: &[&str]) {
    wait_answered_from(c, from, dst, None, pods).await;
}

/// Waits until a TCP request from `from` (source address `src`) to `dst` is answered by one
/// of `pods`.
async fn wait_answered_from(
    c: &Cluster,
    from: &impl NsName,
    dst: std::net::SocketAddr,
    src: Option<&str>,
    pods: &[&str],
) {
    let mut last = None;
    let answered = poll_until(PROGRAMMED, SLOW_POLL, || {
        let o = tcp_request(from, dst, src);
        let done = matches!(&o, Ok(r) if pods.contains(&r.pod.as_str()));
        last = Some(o);
        done
    });
    if answered.await.is_none() {
        let family = if dst.is_ipv4() { "ip" } else { "ip6" };
        panic!("{dst} not answered by {pods:?}; last {last:?}\n{}\n{}", c.nft_table(family), c.log());
    }
}

async fn stop_daemon(c: &mut Cluster) {
    let daemon = c.daemon.as_mut().expect("daemon running");
    daemon.signal("TERM");
    let status = daemon.wait_exit(Duration::from_secs(20)).await;
    assert!(status.success(), "exit {status}\n{}", daemon.log_text());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nftables_mode_serves_services_and_switches_with_iptables_mode_both_ways() {
    require_root!();
    let mut c = Cluster::network("nftmode").await;
    let (a1, a2, b1) = (c.pod(POD_A1), c.pod(POD_A2), c.pod(POD_B1));
    let names = [a1.name, a2.name, b1.name];
    let (all_three, scaled_down) = (pods_slice("web", &[a1, a2, b1]).build(), pods_slice("web", &[a1, a2]).build());
    let (a1, a2, b1_ip) = (a1.name, a2.name, b1.ip.clone());
    let cpod = c.pod(CPOD).ns.name.clone();
    let web = svc(NS, "web").type_("NodePort").cluster_ip("198.19.0.10").node_port("http", 80, 30080);
    c.server.create(&web.udp("dns", 53).tcp("echo", 81).build());
    c.server.create(&all_three);
    let (http, dns, echo) = (sa("198.19.0.10", 80), sa("198.19.0.10", 53), sa("198.19.0.10", 81));

    // iptables mode first, as the node ran before.
    c.start_daemon();
    wait_answered(&c, &cpod, http, &names).await;
    let mut flow = TcpFlow::open(&cpod, echo).expect("a connection through the ClusterIP");
    assert!(flow.request().is_ok());
    stop_daemon(&mut c).await;

    // nftables mode: the service answers, the connection opened under iptables mode goes on,
    // and iptables mode's rules are removed once the nftables rules are in place.
    let t = Instant::now();
    c.start_daemon_with(&["--proxy-mode=nftables"]);
    eventually("the kube-proxy table programmed", PROGRAMMED, || c.nft_table("ip").contains("198.19.0.10")).await;
    eventually("iptables mode's rules removed", PROGRAMMED, || !c.nat().contains("KUBE-SERVICES")).await;
    let table = c.nft_table("ip");
    assert!(table.contains("chain service-") && table.contains("ns1/web/tcp/http"), "{table}");
    assert!(flow.request().is_ok(), "the connection survives the switch to nftables mode\n{}", c.log());
    wait_answered(&c, &cpod, http, &names).await;
    assert_spread(&tcp_requests(&cpod, http, None, 60), &names, "TCP through the ClusterIP (nftables)");
    assert_spread(&udp_requests(&cpod, dns, None, 60), &names, "UDP through the ClusterIP (nftables)");
    assert_spread(
        &tcp_requests(&c.client, sa(NODE_A_IP, 30080), Some(CLIENT_IP), 40),
        &names,
        "NodePort from outside (nftables)",
    );
    eprintln!("switched to nftables mode and served in {:.1}s", t.elapsed().as_secs_f64());
    let get = |path: &str| {
        c.node_a.ok(&[
            "bash",
            "-c",
            &format!("exec 3<>/dev/tcp/127.0.0.1/10249; printf 'GET {path} HTTP/1.0\\r\\n\\r\\n' >&3; cat <&3"),
        ])
    };
    assert!(get("/proxyMode").ends_with("nftables"), "{}", get("/proxyMode"));
    let metrics = get("/metrics");
    assert!(metrics.contains("kubeproxy_sync_proxy_rules_last_timestamp_seconds{ip_family=\"IPv4\"}"), "{metrics}");
    assert!(!metrics.contains("kubeproxy_sync_proxy_rules_iptables_total"), "iptables-only metrics (1.34+): {metrics}");

    // A change is followed by a partial sync.
    c.server.update(&scaled_down);
    eventually("pod-b1 removed", PROGRAMMED, || !c.nft_table("ip").contains(&b1_ip)).await;
    assert_spread(&tcp_requests(&cpod, http, None, 40), &[a1, a2], "TCP after scaling down (nftables)");
    assert!(c.log().contains("mode=nftables"), "{}", c.log());
    stop_daemon(&mut c).await;
    assert!(c.nft_table("ip").contains("198.19.0.10"), "the rules stay on shutdown");

    // And back: iptables mode deletes the kube-proxy tables once its own rules are in.
    c.start_daemon();
    eventually("the kube-proxy table deleted", PROGRAMMED, || c.nft_table("ip").is_empty()).await;
    assert!(c.nat().contains("KUBE-SERVICES"), "{}", c.nat());
    assert!(flow.request().is_ok(), "the connection survives the switch back\n{}", c.log());
    wait_answered(&c, &cpod, http, &[a1, a2]).await;
    stop_daemon(&mut c).await;
}

fn pass(scenario: &str, started: Instant) {
    eprintln!("nftables scenario {scenario}: pass ({:.1}s)", started.elapsed().as_secs_f64());
}

/// The health-check node port's answer from outside: status and `localEndpoints`.
fn health_check(c: &Cluster, port: u16) -> Option<(u16, i64)> {
    let (status, body) = http_get(&c.client, &format!("{NODE_A_IP}:{port}"), "/")?;
    let json: serde_json::Value = serde_json::from_str(&body).ok()?;
    Some((status, json["localEndpoints"].as_i64()?))
}

/// The Service kinds beyond ClusterIP and NodePort, in one cluster, one daemon in nftables
/// mode: an external IP; a load-balancer IP with loadBalancerSourceRanges (the allowed
/// source passes, another is dropped); session affinity ClientIP (each client sticks to one
/// pod); externalTrafficPolicy Local (local pod only, client source kept) with its
/// health-check node port answering 200 with a local endpoint and 503 without; a Service
/// without endpoints (refused at once, TCP and UDP, by the `reject` verdict); a pod reaching
/// its own Service (lands on itself, masqueraded).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nftables_external_ips_source_ranges_affinity_local_policy_reject_and_hairpin() {
    require_root!();
    let mut c = Cluster::network("nftkinds").await;
    c.start_daemon_with(&["--proxy-mode=nftables"]);
    let t = Instant::now();
    let (a1, a2, b1) = (c.pod(POD_A1), c.pod(POD_A2), c.pod(POD_B1));
    let cpod = &c.pod(CPOD).ns;
    let all = [a1.name, a2.name, b1.name];
    let both = [a1.name, b1.name];
    c.server.create(&web("edge", "198.19.0.40").external_ips(&["198.18.40.10"]).build());
    c.server.create(&pods_slice("edge", &[a1, b1]).build());
    let lb = svc(NS, "lb").type_("LoadBalancer").cluster_ip("198.19.0.41").node_port("http", 80, 30081);
    c.server.create(&lb.lb_ingress(&["198.18.40.20"]).source_ranges(&[&format!("{CLIENT_IP}/32")]).build());
    c.server.create(&pods_slice("lb", &[a1, b1]).build());
    c.server.create(&web("sticky", "198.19.0.30").affinity(Some(600)).build());
    c.server.create(&pods_slice("sticky", &[a1, a2, b1]).build());
    let local = || {
        svc(NS, "local")
            .type_("LoadBalancer")
            .cluster_ip("198.19.0.50")
            .node_port("http", 80, 30082)
            .lb_ingress(&["198.18.40.30"])
            .external_policy("Local")
            .health_check_node_port(30700)
    };
    c.server.create(&local().build());
    c.server.create(&pods_slice("local", &[a1, b1]).build());
    c.server.create(&web("empty", "198.19.0.61").build());
    c.server.create(&web("self", "198.19.0.70").build());
    c.server.create(&pods_slice("self", &[a1]).build());

    // External IP, from outside.
    let external = sa("198.18.40.10", 80);
    wait_answered_from(&c, &c.client, external, Some(CLIENT_IP_ALT), &both).await;
    assert_spread(&tcp_requests(&c.client, external, Some(CLIENT_IP_ALT), 40), &both, "external IP");
    pass("external IP", t);

    // Load-balancer IP with source ranges.
    let t = Instant::now();
    let lb_ip = sa("198.18.40.20", 80);
    wait_answered_from(&c, &c.client, lb_ip, Some(CLIENT_IP), &both).await;
    assert_spread(&tcp_requests(&c.client, lb_ip, Some(CLIENT_IP), 40), &both, "LB IP from the allowed source");
    let started = Instant::now();
    let denied = tcp_request(&c.client, lb_ip, Some(CLIENT_IP_ALT));
    assert_eq!(denied, Err(Failure::Timeout), "a source outside loadBalancerSourceRanges is dropped");
    assert!(started.elapsed() >= CLIENT_TIMEOUT, "dropped, not refused");
    let table = c.nft_table("ip");
    assert!(table.contains("firewall-ips") && table.contains("198.18.40.20 . tcp . 80"), "{table}");
    pass("LB IP with loadBalancerSourceRanges", t);

    // Session affinity: each client sticks to one pod.
    let t = Instant::now();
    let sticky = sa("198.19.0.30", 80);
    wait_answered(&c, cpod, sticky, &all).await;
    for (who, ns, src) in
        [("cpod", cpod, None), ("client .1", &c.client, Some(CLIENT_IP)), ("client .3", &c.client, Some(CLIENT_IP_ALT))]
    {
        let out = tcp_requests(ns, sticky, src, 30);
        ok_all(&out, who);
        let (per_pod, _) = tally(&out);
        assert_eq!(per_pod.len(), 1, "{who} must stick to one pod: {per_pod:?}");
    }
    let table = c.nft_table("ip");
    let affinity_sets = table
        .lines()
        .filter(|l| l.trim_start().starts_with("set affinity-") && l.contains("/sticky/tcp/http__"))
        .count();
    assert_eq!(affinity_sets, 3, "one affinity set per endpoint of ns1/sticky:http\n{table}");
    pass("session affinity ClientIP", t);

    // externalTrafficPolicy Local: the local pod only, the client's source kept; the
    // health-check node port says whether the node has a local endpoint.
    let t = Instant::now();
    let node_port = sa(NODE_A_IP, 30082);
    wait_answered_from(&c, &c.client, node_port, Some(CLIENT_IP), &[a1.name]).await;
    let out = tcp_requests(&c.client, node_port, Some(CLIENT_IP), 30);
    ok_all(&out, "ETP Local");
    for r in out.iter().flatten() {
        assert_eq!((r.pod.as_str(), r.peer.as_str()), (a1.name, CLIENT_IP), "ETP Local: local pod, client source kept");
    }
    eventually("the health-check node port answers 200", PROGRAMMED, || health_check(&c, 30700) == Some((200, 1)))
        .await;
    c.server.update(&pods_slice("local", &[b1]).build());
    eventually("the health-check node port answers 503", PROGRAMMED, || health_check(&c, 30700) == Some((503, 0)))
        .await;
    assert_eq!(tcp_request(&c.client, node_port, Some(CLIENT_IP)), Err(Failure::Timeout), "no local endpoint: dropped");
    pass("externalTrafficPolicy Local and its health-check node port", t);

    // No endpoints: rejected at once.
    let t = Instant::now();
    eventually("the endpoint-less service is rejected", PROGRAMMED, || {
        tcp_request(cpod, sa("198.19.0.61", 80), None) == Err(Failure::Refused)
    })
    .await;
    let started = Instant::now();
    let tcp = tcp_request(cpod, sa("198.19.0.61", 80), None);
    let tcp_took = started.elapsed();
    assert_eq!(tcp, Err(Failure::Refused), "no endpoints: reject");
    assert!(tcp_took < Duration::from_millis(500), "reject must refuse at once, took {tcp_took:?}");
    let started = Instant::now();
    let udp = udp_requests(cpod, sa("198.19.0.61", 53), None, 1).remove(0);
    let udp_took = started.elapsed();
    assert_eq!(udp, Err(Failure::Refused), "no endpoints: reject (UDP)");
    assert!(udp_took < Duration::from_millis(500), "UDP reject took {udp_took:?}");
    let table = c.nft_table("ip");
    assert!(table.contains("198.19.0.61 . tcp . 80 comment \"ns1/empty:http\" : goto reject-chain"), "{table}");
    pass(&format!("no endpoints (refused in {tcp_took:?})"), t);

    // Hairpin.
    let t = Instant::now();
    let own = sa("198.19.0.70", 80);
    wait_answered(&c, &a1.ns, own, &[a1.name]).await;
    for o in
        tcp_requests(&a1.ns, own, None, 10).into_iter().chain(udp_requests(&a1.ns, sa("198.19.0.70", 53), None, 10))
    {
        let r = o.expect("hairpin request");
        assert_eq!(
            (r.pod.as_str(), r.peer.as_str()),
            (a1.name, a1.node_side.as_str()),
            "hairpin lands on itself, masqueraded"
        );
    }
    pass("hairpin", t);
    assert!(!c.log().contains("sync failed"), "{}", c.log());
    stop_daemon(&mut c).await;
}

/// The node's conntrack entries of UDP flows to `service_ip`, one a line.
fn udp_entries(c: &Cluster, service_ip: &str) -> String {
    let out = c.node_a.run(&["conntrack", "-L", "-p", "udp", "--orig-dst", service_ip]);
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// UDP conntrack cleanup: a UDP flow's entry is deleted when its endpoint is removed, so the
/// same client socket reaches the replacement endpoint. A dual-stack Service is reached over
/// both families (ClusterIP TCP and UDP, NodePort from outside), each family's table
/// programmed by its own proxier.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nftables_udp_conntrack_cleanup_and_dual_stack() {
    require_root!();
    let mut c = Cluster::network("nftudp6").await;
    c.start_daemon_with(&["--proxy-mode=nftables"]);
    let t = Instant::now();
    let (a1, a2, cpod) = (c.pod(POD_A1), c.pod(POD_A2), c.pod(CPOD));
    c.server.create(&web("dns", "198.19.0.80").build());
    c.server.create(&pods_slice("dns", &[a1]).build());
    let web6 = svc(NS, "web6").type_("NodePort").cluster_ips(&["198.19.0.90", "fd00:5019::90"]);
    c.server.create(&web6.node_port("http", 80, 30090).udp("dns", 53).build());
    c.server.create(&pods_slice("web6", &[a1, a2]).build());
    c.server.create(&pods_slice6("web6", &[a1, a2]));

    let flow = UdpFlow::open(&cpod.ns, sa("198.19.0.80", 53));
    eventually("UDP flow answered by pod-a1", PROGRAMMED, || flow.request().is_ok_and(|r| r.pod == a1.name)).await;
    for _ in 0..3 {
        assert_eq!(flow.request().map(|r| r.pod), Ok(a1.name.to_string()));
    }
    let entries = udp_entries(&c, "198.19.0.80");
    assert!(entries.lines().any(|l| l.contains(&format!("src={}", a1.ip))), "the flow's entry to pod-a1:\n{entries}");
    let replaced = Instant::now();
    c.server.update(&pods_slice("dns", &[a2]).build());
    // The entry goes away without the client sending anything (nothing else would remove it
    // before its timeout).
    eventually("the flow's conntrack entry to pod-a1 deleted", PROGRAMMED, || {
        !udp_entries(&c, "198.19.0.80").contains(&format!("src={}", a1.ip))
    })
    .await;
    let deleted = replaced.elapsed();
    for _ in 0..3 {
        assert_eq!(flow.request().map(|r| r.pod), Ok(a2.name.to_string()), "the same socket reaches pod-a2");
    }
    pass(&format!("UDP conntrack cleanup (entry deleted {deleted:?} after the change)"), t);

    let t = Instant::now();
    let both = [a1.name, a2.name];
    let http6 = sa("fd00:5019::90", 80);
    wait_answered(&c, &cpod.ns, http6, &both).await;
    let tcp = tcp_requests(&cpod.ns, http6, None, 40);
    assert_spread(&tcp, &both, "IPv6 TCP through the ClusterIP");
    let udp = udp_requests(&cpod.ns, sa("fd00:5019::90", 53), None, 40);
    assert_spread(&udp, &both, "IPv6 UDP through the ClusterIP");
    assert!(tcp.iter().chain(&udp).all(|o| o.as_ref().is_ok_and(|r| r.peer == cpod.ip6)), "{tcp:?}");
    assert_spread(&tcp_requests(&cpod.ns, sa("198.19.0.90", 80), None, 30), &both, "IPv4 TCP of the same Service");
    let node_port6 = sa(NODE_A_IP6, 30090);
    wait_answered_from(&c, &c.client, node_port6, Some(CLIENT_IP6), &both).await;
    assert_spread(&tcp_requests(&c.client, node_port6, Some(CLIENT_IP6), 30), &both, "IPv6 NodePort from outside");
    let (v4, v6) = (c.nft_table("ip"), c.nft_table("ip6"));
    assert!(v6.starts_with("table ip6 kube-proxy") && v6.contains("fd00:5019::90"), "{v6}");
    assert!(
        !v6.contains("198.19.0.90") && !v4.contains("fd00:5019::90"),
        "each family's table has its own\n{v4}\n{v6}"
    );
    assert!(c.log().contains("dual-stack"), "the daemon must say it runs dual-stack:\n{}", c.log());
    pass("dual stack (IPv6 and IPv4 ClusterIP, IPv6 NodePort)", t);
    stop_daemon(&mut c).await;
}
