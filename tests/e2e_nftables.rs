//! nftables mode with real packets: the `kube-proxy-rs` binary in node-a of the small
//! cluster network (tests/support/cluster_net.rs) with `--proxy-mode=nftables`, programming
//! node-a's `kube-proxy` tables. A node switches from iptables mode to nftables mode and back
//! with a TCP connection open through a ClusterIP the whole time, each mode removing the other's
//! rules once its own are in place. Root only.

use std::time::{Duration, Instant};

use kube_proxy_rs::tracker::testing::{SliceBuilder, ep, slice, svc};

use crate::require_root;
use crate::support::cluster_net::{
    CLIENT_IP, CPOD, Cluster, ECHO_PORT, NODE_A_IP, NsName, Outcome, POD_A1, POD_A2, POD_B1, Pod, SERVE_PORT, TcpFlow,
    sa, tally, tcp_request, tcp_requests, udp_requests,
};
use crate::support::poll::{SLOW_POLL, eventually, poll_until};

const NS: &str = "ns1";
const PROGRAMMED: Duration = Duration::from_secs(30);

fn pods_slice(svc: &str, pods: &[&Pod]) -> SliceBuilder {
    let mut b = slice(NS, svc, &format!("{svc}-1"))
        .tcp("http", i32::from(SERVE_PORT))
        .udp("dns", i32::from(SERVE_PORT))
        .tcp("echo", i32::from(ECHO_PORT));
    for p in pods {
        b = b.endpoint(ep(&p.ip).node(p.node));
    }
    b
}

fn assert_spread(outcomes: &[Outcome], pods: &[&str], what: &str) {
    let (per_pod, failures) = tally(outcomes);
    assert!(failures.is_empty(), "{what}: {} of {} failed: {failures:?}", failures.len(), outcomes.len());
    for p in pods {
        assert!(per_pod.get(*p).copied().unwrap_or(0) > 0, "{what}: {p} got nothing: {per_pod:?}");
    }
    assert!(per_pod.keys().all(|k| pods.contains(&k.as_str())), "{what}: unexpected pods {per_pod:?}");
}

async fn wait_answered(c: &Cluster, from: &impl NsName, dst: std::net::SocketAddr, pods: &[&str]) {
    let answered = poll_until(
        PROGRAMMED,
        SLOW_POLL,
        || matches!(tcp_request(from, dst, None), Ok(r) if pods.contains(&r.pod.as_str())),
    );
    if answered.await.is_none() {
        panic!("{dst} not answered by {pods:?}\n{}\n{}", c.nft_table("ip"), c.log());
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
