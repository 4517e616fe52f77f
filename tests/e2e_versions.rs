//! Real packets through behaviour that changed after 1.29 (issue 11), with the daemon at its
//! default release (the newest): topology hints without the annotation
//! (`trafficDistribution: PreferClose`, 1.31), node hints (`PreferSameNode`, 1.34), and
//! load-balancer ingresses with `ipMode: Proxy` (1.30). Same cluster network as
//! e2e_traffic.rs. Root only.

use kube_proxy_rs::tracker::testing::{Ep, ep, node, slice, svc};
use std::time::{Duration, Instant};

use crate::require_root;
use crate::support::cluster_net::{
    CPOD, Cluster, NODE_A, NODE_A_IP, NODE_A_IP6, POD_A1, POD_A2, POD_B1, Pod, PodServer, SERVE_PORT, sa, tally,
    tcp_request, tcp_requests,
};
use crate::support::poll::eventually;

const NS: &str = "ns1";
const PROGRAMMED: Duration = Duration::from_secs(30);

fn pass(scenario: &str, started: Instant) {
    eprintln!("scenario {scenario}: pass ({:.1}s)", started.elapsed().as_secs_f64());
}

/// Pods that answered `n` requests from `from` to `dst` (every request must succeed).
fn answering(c: &Cluster, from: &Pod, dst: std::net::SocketAddr, n: usize) -> Vec<String> {
    let outcomes = tcp_requests(&from.ns, dst, None, n);
    let (per_pod, failures) = tally(&outcomes);
    assert!(failures.is_empty(), "{dst}: {failures:?}\n{}", c.nat());
    per_pod.into_keys().collect()
}

/// Scenario 13: zone hints apply without any topology annotation (the EndpointSlice
/// controller wrote them for `trafficDistribution: PreferClose`): only same-zone pods
/// answer; then node hints (`PreferSameNode`) narrow it to the pod hinted for this node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn traffic_distribution_keeps_traffic_in_the_zone_then_on_the_node() {
    require_root!();
    let c = Cluster::start("ver-topo").await;
    let t = Instant::now();
    let (a1, a2, b1, cpod) = (c.pod(POD_A1), c.pod(POD_A2), c.pod(POD_B1), c.pod(CPOD));
    c.server.update(&node(NODE_A, &[("topology.kubernetes.io/zone", "zone-a")], &[], &[NODE_A_IP, NODE_A_IP6]));
    let service = svc(NS, "near").cluster_ip("198.19.0.130").tcp("http", 80).traffic_distribution("PreferClose");
    c.server.create(&service.build());
    let hinted = |p: &Pod, zone: &str| -> Ep { ep(&p.ip).node(p.node).zone(zone).hints(&[zone]) };
    let zones = slice(NS, "near", "near-1")
        .tcp("http", i32::from(SERVE_PORT))
        .endpoint(hinted(a1, "zone-a"))
        .endpoint(hinted(a2, "zone-a"))
        .endpoint(hinted(b1, "zone-b"));
    c.server.create(&zones.build());
    let dst = sa("198.19.0.130", 80);
    eventually("the service answers", PROGRAMMED, || tcp_request(&cpod.ns, dst, None).is_ok()).await;
    eventually("only zone-a pods remain in the rules", PROGRAMMED, || !c.nat().contains(&b1.ip)).await;
    let got = answering(&c, cpod, dst, 60);
    assert_eq!(got, [a1.name, a2.name], "zone hints without annotation: zone-a pods only, both used");
    pass("13a (trafficDistribution PreferClose: zone hints honoured without the annotation)", t);

    let t = Instant::now();
    let node_hinted = |p: &Pod, zone: &str, for_node: &str| hinted(p, zone).node_hints(&[for_node]);
    let nodes = slice(NS, "near", "near-1")
        .tcp("http", i32::from(SERVE_PORT))
        .endpoint(node_hinted(a1, "zone-a", NODE_A))
        .endpoint(node_hinted(a2, "zone-a", "node-c"))
        .endpoint(node_hinted(b1, "zone-b", "node-b"));
    c.server.update(&nodes.build());
    eventually("only the node-hinted pod remains", PROGRAMMED, || !c.nat().contains(&a2.ip)).await;
    let got = answering(&c, cpod, dst, 40);
    assert_eq!(got, [a1.name], "node hints: the pod hinted for node-a only");
    pass("13b (trafficDistribution PreferSameNode: node hints)", t);
}

/// Scenario 14: a load-balancer ingress IP is short-circuited to the pods on the node while
/// its `ipMode` is VIP; with `ipMode: Proxy` the node leaves it alone and traffic reaches
/// the load balancer itself (here: a server in the client namespace owning the IP).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ip_mode_proxy_sends_load_balancer_traffic_to_the_load_balancer() {
    require_root!();
    let c = Cluster::start("ver-ipmode").await;
    let t = Instant::now();
    let (a1, b1, cpod) = (c.pod(POD_A1), c.pod(POD_B1), c.pod(CPOD));
    // The "load balancer": the client namespace owns the ingress IP, serves on the service
    // port, and routes replies for pod addresses back through node-a.
    let lb_ip = "198.18.40.30";
    c.client.ok(&["ip", "addr", "add", &format!("{lb_ip}/32"), "dev", "lo"]);
    c.client.ok(&["ip", "route", "add", "198.18.96.0/19", "via", NODE_A_IP]);
    let _lb = PodServer::start("load-balancer", &c.client.name);
    let lb = |mode: &str| {
        svc(NS, "lb")
            .type_("LoadBalancer")
            .cluster_ip("198.19.0.131")
            .tcp("http", i32::from(SERVE_PORT))
            .lb_ingress_modes(&[(lb_ip, mode)])
            .build()
    };
    c.server.create(&lb("VIP"));
    let pods = slice(NS, "lb", "lb-1")
        .tcp("http", i32::from(SERVE_PORT))
        .endpoint(ep(&a1.ip).node(a1.node))
        .endpoint(ep(&b1.ip).node(b1.node));
    c.server.create(&pods.build());
    let dst = sa(lb_ip, SERVE_PORT);
    eventually("ipMode VIP: the LB IP is DNATed on the node", PROGRAMMED, || {
        tcp_request(&cpod.ns, dst, None).is_ok_and(|r| r.pod != "load-balancer")
    })
    .await;
    let got = answering(&c, cpod, dst, 40);
    assert!(got.iter().all(|p| p == a1.name || p == b1.name), "VIP: pods answer, not the load balancer: {got:?}");
    pass("14a (ipMode VIP: load-balancer IP short-circuited to the pods)", t);

    let t = Instant::now();
    c.server.update(&lb("Proxy"));
    eventually("ipMode Proxy: the LB IP leaves the rules", PROGRAMMED, || !c.nat().contains(lb_ip)).await;
    let got = answering(&c, cpod, dst, 20);
    assert_eq!(got, ["load-balancer"], "Proxy: the load balancer answers");
    pass("14b (ipMode Proxy: load-balancer IP goes to the load balancer)", t);
}
