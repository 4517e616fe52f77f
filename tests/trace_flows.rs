//! Packet-flow tables over the golden scenarios (upstream's `runPacketFlowTests`): for each
//! scenario, `{src, dst, port, proto} → destinations | REJECT | DROP | ACCEPT, masquerade`,
//! traced through the rules we render for `cluster.yaml` *and* through the hand-derived
//! `expected.rules`, so behaviour is asserted beside the text. They survive harmless
//! reshuffles that break goldens, and catch rules that read right but route wrong.

use std::net::IpAddr;
use std::path::{Path, PathBuf};

use clap::Parser;
use kube_proxy_rs::cmd::cli::{Cli, Command};
use kube_proxy_rs::trace::{Packet, Proto, Trace, Verdict, trace_text};

/// The node every scenario renders for (node-a's InternalIP).
const NODE_IP: &str = "192.168.10.11";
/// A pod on node-a (no endpoint of any scenario).
const POD: &str = "10.64.1.50";
/// A client outside the cluster.
const OUTSIDE: &str = "203.0.113.7";

fn dir(scenario: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden").join(scenario)
}

/// Renders a scenario with its own flags (as tests/golden.rs runs it), returning the rules
/// and the node's addresses as `render` resolved them.
fn rendered(scenario: &str) -> (String, Vec<IpAddr>) {
    let d = dir(scenario);
    let mut argv = vec!["kube-proxy-rs".to_string(), "render".to_string()];
    let args = std::fs::read_to_string(d.join("args")).expect("args");
    argv.extend(args.lines().filter(|l| !l.trim().is_empty()).map(str::to_string));
    if d.join("config.yaml").is_file() {
        argv.extend(["--config".to_string(), d.join("config.yaml").display().to_string()]);
    }
    argv.push(d.join("cluster.yaml").display().to_string());
    let Some(Command::Render(args)) = Cli::try_parse_from(&argv).expect("render args parse").command else {
        panic!("not a render command line: {argv:?}");
    };
    let mut out = Vec::new();
    let node = kube_proxy_rs::cmd::render::run_node(&args, &mut out).expect("render");
    (String::from_utf8(out).expect("UTF-8"), node.local_addresses())
}

struct Flow {
    src: &'static str,
    dst: &'static str,
    port: u16,
    proto: Proto,
    /// Space-separated `ip:port` destinations (verdict DNAT), or `REJECT`, `DROP`, `ACCEPT`
    /// (unchanged destination).
    expect: &'static str,
    masq: bool,
}

fn tcp(src: &'static str, dst: &'static str, port: u16, expect: &'static str, masq: bool) -> Flow {
    Flow { src, dst, port, proto: Proto::Tcp, expect, masq }
}

fn udp(src: &'static str, dst: &'static str, port: u16, expect: &'static str, masq: bool) -> Flow {
    Flow { src, dst, port, proto: Proto::Udp, expect, masq }
}

fn outcome(t: &Trace) -> String {
    match t.verdict {
        Verdict::Dnat => t.destinations.iter().map(|d| d.address.as_str()).collect::<Vec<_>>().join(" "),
        v => format!("{v:?}").to_uppercase(),
    }
}

fn check(rules: &str, source: &str, local: &[IpAddr], flows: &[Flow]) -> Vec<String> {
    let mut failures = Vec::new();
    for f in flows {
        let pkt = Packet {
            src: f.src.parse().expect("src"),
            dst: f.dst.parse().expect("dst"),
            dport: f.port,
            proto: f.proto,
            in_interface: None,
            out_interface: None,
        };
        let name = format!("{source}: {} -> {}:{} {}", f.src, f.dst, f.port, f.proto.as_str());
        let t = match trace_text(rules, &pkt, local) {
            Ok(t) => t,
            Err(e) => {
                failures.push(format!("{name}: {e}"));
                continue;
            }
        };
        let got = outcome(&t);
        if got != f.expect {
            failures.push(format!("{name}: expected {}, got {got}\n{}", f.expect, t.to_human()));
            continue;
        }
        if t.destinations.iter().any(|d| d.masquerade != f.masq) {
            failures.push(format!("{name}: expected masquerade {}\n{}", f.masq, t.to_human()));
        }
        let total: f64 = t.destinations.iter().map(|d| d.probability).sum();
        if !t.destinations.is_empty() && (total - 1.0).abs() > 1e-6 {
            failures.push(format!("{name}: probabilities sum to {total}"));
        }
    }
    failures
}

/// Runs the table through our rendering and through the hand-derived expected rules.
#[track_caller]
fn run_flows(scenario: &str, flows: &[Flow]) {
    let (ours, local) = rendered(scenario);
    let expected = std::fs::read_to_string(dir(scenario).join("expected.rules")).expect("expected.rules");
    let mut failures = check(&ours, &format!("{scenario} (rendered)"), &local, flows);
    failures.extend(check(&expected, &format!("{scenario} (expected.rules)"), &local, flows));
    assert!(failures.is_empty(), "{} flow(s) failed:\n{}", failures.len(), failures.join("\n"));
}

#[test]
fn cluster_ip_spreads_evenly() {
    let web = "10.64.1.2:8080 10.64.2.100:8080 10.64.2.10:8080 10.64.2.3:8080 10.64.3.4:8080";
    let api = "10.64.2.21:8443 10.64.2.22:8443 10.64.2.23:8443 10.64.2.24:8443 10.64.2.25:8443 10.64.2.26:8443 10.64.2.27:8443";
    run_flows(
        "clusterip-probabilities",
        &[
            tcp(POD, "172.30.0.10", 80, web, false),
            tcp(OUTSIDE, "172.30.0.10", 80, web, false),
            tcp(NODE_IP, "172.30.0.10", 80, web, false),
            tcp(POD, "172.30.0.11", 443, api, false),
            tcp(POD, "172.30.0.10", 81, "ACCEPT", false),
            udp(POD, "172.30.0.10", 80, "ACCEPT", false),
        ],
    );
    let (rules, local) = rendered("clusterip-probabilities");
    let pkt = Packet {
        src: POD.parse().unwrap(),
        dst: "172.30.0.11".parse().unwrap(),
        dport: 443,
        proto: Proto::Tcp,
        in_interface: None,
        out_interface: None,
    };
    let t = trace_text(&rules, &pkt, &local).unwrap();
    assert!(t.destinations.iter().all(|d| (d.probability - 1.0 / 7.0).abs() < 1e-6), "{}", t.to_human());
}

#[test]
fn node_ports_masquerade_external_and_local_clients() {
    let cart = "10.64.1.32:8080 10.64.2.31:8080";
    run_flows(
        "nodeport",
        &[
            tcp(POD, "172.30.1.10", 80, cart, false),
            tcp(OUTSIDE, NODE_IP, 30080, cart, true),
            tcp(NODE_IP, NODE_IP, 30080, cart, true),
            tcp("127.0.0.1", "127.0.0.1", 30080, cart, true),
            tcp(POD, NODE_IP, 30443, "10.64.1.40:8443", true),
            tcp(OUTSIDE, NODE_IP, 30081, "ACCEPT", false),
            // A node port on another address is not ours.
            tcp(OUTSIDE, "192.168.10.99", 30080, "ACCEPT", false),
        ],
    );
}

#[test]
fn external_traffic_policy_local_keeps_the_source_and_drops_without_local_endpoints() {
    run_flows(
        "etp-local",
        &[
            tcp(OUTSIDE, "203.0.113.50", 80, "10.64.1.90:8080 10.64.1.91:8080", false),
            // From the node itself: all endpoints, masqueraded ("route LOCAL traffic").
            tcp(NODE_IP, "203.0.113.50", 80, "10.64.1.90:8080 10.64.1.91:8080 10.64.2.92:8080", true),
            tcp(OUTSIDE, NODE_IP, 31100, "10.64.1.90:8080 10.64.1.91:8080", false),
            tcp(OUTSIDE, "203.0.113.51", 80, "DROP", false),
            tcp(OUTSIDE, "198.18.0.51", 80, "DROP", false),
            tcp(OUTSIDE, NODE_IP, 31101, "DROP", false),
            tcp(NODE_IP, NODE_IP, 31101, "10.64.2.93:8080", true),
            tcp(POD, "172.30.5.12", 80, "10.64.2.95:8080", false),
            // Health check node port: accepted to the node.
            tcp(OUTSIDE, NODE_IP, 32100, "ACCEPT", false),
        ],
    );
}

#[test]
fn internal_traffic_policy_local() {
    run_flows("itp-local", &[tcp(POD, "172.30.6.11", 80, "DROP", false), tcp(POD, "172.30.6.12", 80, "DROP", false)]);
}

#[test]
fn load_balancer_source_ranges() {
    run_flows(
        "loadbalancer-source-ranges",
        &[
            tcp("203.0.113.10", "203.0.113.30", 80, "10.64.2.80:8080", true),
            tcp("198.18.200.1", "203.0.113.31", 80, "10.64.2.80:8080", true),
            tcp("198.51.100.7", "203.0.113.30", 80, "DROP", false),
            // The node's own address is inside an allowed range.
            tcp(NODE_IP, "203.0.113.30", 80, "10.64.2.80:8080", true),
            // Annotated: ETP Local; allowed source gets the local endpoint only.
            tcp("198.51.100.7", "203.0.113.40", 80, "10.64.1.81:8080", false),
            tcp("203.0.113.10", "203.0.113.40", 80, "DROP", false),
            // Node ports are not subject to source ranges.
            tcp("198.51.100.7", NODE_IP, 31090, "10.64.2.80:8080", true),
            tcp(POD, "172.30.4.10", 80, "10.64.2.80:8080", false),
        ],
    );
}

#[test]
fn services_without_endpoints_reject() {
    run_flows(
        "no-endpoints",
        &[
            tcp(POD, "172.30.16.10", 80, "REJECT", false),
            tcp(POD, "172.30.16.11", 80, "REJECT", false),
            tcp(OUTSIDE, "203.0.113.70", 80, "REJECT", false),
            tcp(OUTSIDE, NODE_IP, 31200, "REJECT", false),
            tcp(NODE_IP, "172.30.16.12", 80, "REJECT", false),
        ],
    );
}

#[test]
fn session_affinity_is_a_branch_not_a_destination() {
    run_flows(
        "session-affinity",
        &[
            tcp(POD, "172.30.7.10", 80, "10.64.2.110:8080 10.64.2.111:8080", false),
            tcp(POD, "172.30.7.12", 80, "10.64.2.114:8080", false),
            tcp(OUTSIDE, NODE_IP, 31120, "10.64.1.112:8080", false),
        ],
    );
    let (rules, local) = rendered("session-affinity");
    let pkt = Packet {
        src: POD.parse().unwrap(),
        dst: "172.30.7.10".parse().unwrap(),
        dport: 80,
        proto: Proto::Tcp,
        in_interface: None,
        out_interface: None,
    };
    let t = trace_text(&rules, &pkt, &local).unwrap();
    assert_eq!(t.path.iter().filter(|s| s.affinity).count(), 2, "{}", t.to_human());
}

#[test]
fn cluster_cidr_masquerades_traffic_from_outside_the_cluster() {
    let (rules, _) = rendered("detect-local-cluster-cidr");
    assert!(rules.contains("! -s 10.64.0.0/10"), "scenario changed: {rules}");
    let plain = "172.30.13.10";
    let t = |src: &str| {
        let pkt = Packet {
            src: src.parse().unwrap(),
            dst: plain.parse().unwrap(),
            dport: 80,
            proto: Proto::Tcp,
            in_interface: None,
            out_interface: None,
        };
        trace_text(&rules, &pkt, &[NODE_IP.parse().unwrap()]).unwrap()
    };
    assert!(t(POD).destinations.iter().all(|d| !d.masquerade));
    assert!(t(OUTSIDE).destinations.iter().all(|d| d.masquerade));
    assert_eq!(t(OUTSIDE).verdict, Verdict::Dnat);
}
