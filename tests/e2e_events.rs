//! The real binary's Kubernetes Events, end to end: started in a "node" namespace against the
//! test API server, it posts the start-up event on its Node, a Warning on a Service it skips
//! as invalid (once, however often it syncs), and FailedToStartServiceHealthcheck on a Service
//! whose health-check port is taken, all through events.k8s.io/v1. Root only.

use std::time::Duration;

use kube_proxy_rs::tracker::testing::{node, slice, svc};
use serde_json::Value;

use crate::require_root;
use crate::support::e2e::{DaemonProcess, NODE_IP, TempDir, bind_in_netns, daemon_args, nat, topology};
use crate::support::poll::eventually;

fn find<'a>(events: &'a [Value], reason: &str, name: &str) -> Vec<&'a Value> {
    events.iter().filter(|e| e["reason"] == reason && e["regarding"]["name"] == name).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn daemon_posts_startup_invalid_object_and_health_check_events() {
    require_root!();
    let (_api_ns, node_ns, server) = topology("e2eev").await;
    server.create(&node("node-ev", &[], &[], &[NODE_IP]));
    server.create(&svc("ns1", "web").cluster_ip("172.30.0.1").tcp("http", 80).build());
    server.create(&slice("ns1", "web", "web-1").tcp("http", 8080).ips(&["10.1.0.1"]).build());
    // Invalid: port 0 (a real API server would refuse it; the proxy must not trust that).
    server.create(&svc("ns1", "bad").cluster_ip("172.30.0.9").tcp("http", 0).build());
    // Its health-check port is already taken on the node.
    let squatter = bind_in_netns(&node_ns.name, "0.0.0.0:0");
    let hc_port = squatter.local_addr().expect("addr").port();
    server.create(
        &svc("ns1", "lb")
            .type_("LoadBalancer")
            .cluster_ip("172.30.0.5")
            .node_port("http", 80, 30080)
            .local_traffic()
            .health_check_node_port(i32::from(hc_port))
            .build(),
    );
    server.create(&slice("ns1", "lb", "lb-1").tcp("http", 8080).ips(&["10.1.0.5"]).build());

    let dir = TempDir::new("e2eev");
    let mut args = daemon_args(&dir.kubeconfig(&server), "node-ev");
    args.push("--iptables-min-sync-period=100ms".into());
    let mut daemon = DaemonProcess::start(&node_ns, &args, dir.path().join("daemon.log"), &[]);
    let limit = Duration::from_secs(30);
    eventually("initial rules", limit, || nat(&node_ns).contains("--to-destination 10.1.0.1:8080")).await;

    eventually("the start-up event", limit, || !find(&server.events(), "Starting", "node-ev").is_empty()).await;
    eventually("the invalid-service warning", limit, || !find(&server.events(), "InvalidService", "bad").is_empty())
        .await;
    eventually("the health-check failure", limit, || {
        !find(&server.events(), "FailedToStartServiceHealthcheck", "lb").is_empty()
    })
    .await;

    let events = server.events();
    let start = find(&events, "Starting", "node-ev")[0];
    assert_eq!(start["apiVersion"], "events.k8s.io/v1", "{start:#}");
    assert_eq!(start["type"], "Normal");
    assert_eq!(start["action"], "StartKubeProxy");
    assert_eq!(start["metadata"]["namespace"], "default");
    assert_eq!(start["reportingController"], "kube-proxy");
    assert!(start["reportingInstance"].as_str().is_some_and(|i| i.starts_with("kube-proxy-")), "{start:#}");
    assert_eq!(start["regarding"]["kind"], "Node");

    let bad = find(&events, "InvalidService", "bad")[0];
    assert_eq!(bad["type"], "Warning");
    assert_eq!(bad["metadata"]["namespace"], "ns1");
    assert!(bad["note"].as_str().is_some_and(|n| n.contains("port 0 outside 1-65535")), "{bad:#}");

    let hc = find(&events, "FailedToStartServiceHealthcheck", "lb")[0];
    assert_eq!(hc["type"], "Warning");
    assert_eq!(hc["action"], "Listen");
    let note = hc["note"].as_str().unwrap_or("");
    assert!(
        note.starts_with(&format!("node node-ev failed to start healthcheck \"ns1/lb\" on port {hc_port}: ")),
        "{note}"
    );

    // More syncs (endpoint changes) do not raise the invalid-service warning again.
    for ip in ["10.1.0.2", "10.1.0.3"] {
        server.update(&slice("ns1", "web", "web-1").tcp("http", 8080).ips(&[ip]).build());
        eventually("the update", limit, || nat(&node_ns).contains(&format!("--to-destination {ip}:8080"))).await;
    }
    assert_eq!(find(&server.events(), "InvalidService", "bad").len(), 1, "{:#?}", server.events());

    daemon.signal("TERM");
    let status = daemon.wait_exit(Duration::from_secs(20)).await;
    assert!(status.success(), "exit status {status}\n{}", daemon.log_text());
    drop(squatter);
}
