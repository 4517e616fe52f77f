//! The tracer against the real kernel (root only):
//!
//! * in the small cluster network (tests/support/cluster_net.rs) with the daemon programming
//!   node-a, `kube-proxy-rs trace` run on node-a (live rules, live addresses) predicts what
//!   real connections do: which pods answer, whether the server sees the client or the node
//!   (masquerade), and DROP (timeout) / REJECT (refused);
//! * `kube-proxy-rs diff` run on that node with the daemon's configuration (written with
//!   `--write-config-to`) reads the cluster from the API server and finds no difference;
//! * `kube-proxy-rs diff` run in a namespace holding rules restored from `render` output
//!   finds no difference (iptables-save's spelling equals ours), then reports each change
//!   made behind its back, grouped by service.

use std::collections::BTreeSet;
use std::path::Path;

use serde_json::Value;

use crate::require_root;
use crate::support::cluster_net::{
    CLIENT_IP, CLIENT_IP_ALT, CPOD, Cluster, Failure, NODE_A_IP, NsName, POD_A1, POD_A2, POD_B1, Pod, SERVE_PORT, sa,
    tcp_request, tcp_requests,
};
use crate::support::e2e::BIN;
use crate::support::netns::Netns;
use crate::support::poll::eventually;
use kube_proxy_rs::exec::Output;
use kube_proxy_rs::tracker::testing::{ep, slice, svc};

const NS: &str = "tr";

fn endpoints(name: &str, pods: &[&Pod]) -> k8s_openapi::api::discovery::v1::EndpointSlice {
    let mut b = slice(NS, name, &format!("{name}-1")).tcp("http", i32::from(SERVE_PORT));
    for p in pods {
        b = b.endpoint(ep(&p.ip).node(p.node));
    }
    b.build()
}

/// `kube-proxy-rs trace --json` on node-a's live rules.
fn trace_on_node(c: &Cluster, src: &str, dst: &str, port: u16) -> Value {
    let port = port.to_string();
    let out = c.node_a.run(&[BIN, "trace", "--src", src, "--dst", dst, "--dport", &port, "--json"]);
    assert!(out.success(), "trace failed: {}", out.combined());
    serde_json::from_slice(&out.stdout).expect("trace --json prints JSON")
}

/// The predicted destinations' IPs and whether every one is masqueraded.
fn predicted(v: &Value) -> (BTreeSet<String>, bool, bool) {
    let d = v["destinations"].as_array().expect("destinations");
    let ips = d
        .iter()
        .map(|d| {
            let a = d["address"].as_str().expect("address");
            a.rsplit_once(':').expect("ip:port").0.to_string()
        })
        .collect();
    let all_masq = d.iter().all(|d| d["masquerade"] == true);
    let none_masq = d.iter().all(|d| d["masquerade"] == false);
    (ips, all_masq, none_masq)
}

/// Checks a DNAT prediction against `n` real connections from `from` (source `src`).
fn check_against_traffic(c: &Cluster, from: &impl NsName, src: &str, dst: &str, port: u16, n: usize) {
    let v = trace_on_node(c, src, dst, port);
    assert_eq!(v["verdict"], "DNAT", "{v}");
    let (ips, all_masq, none_masq) = predicted(&v);
    let outcomes = tcp_requests(from, sa(dst, port), Some(src), n);
    let mut answered = BTreeSet::new();
    for o in &outcomes {
        let r = o.as_ref().unwrap_or_else(|e| panic!("{src} -> {dst}:{port}: {e:?}; trace predicted {v}"));
        let pod = c.pods.iter().find(|p| p.name == r.pod).expect("known pod");
        answered.insert(pod.ip.clone());
        let masqueraded = r.peer != src;
        assert!(
            if masqueraded { all_masq } else { none_masq },
            "{src} -> {dst}:{port}: server saw {} but trace predicted {v}",
            r.peer
        );
    }
    assert_eq!(answered, ips, "{src} -> {dst}:{port}: pods that answered vs trace's destinations {v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trace_predicts_what_real_packets_do() {
    require_root!();
    let c = Cluster::start("tr-trace").await;
    let (a1, a2, b1, cpod) = (c.pod(POD_A1), c.pod(POD_A2), c.pod(POD_B1), &c.pod(CPOD).ns);
    let cpod_ip = c.pod(CPOD).ip.clone();
    c.server.create(&svc(NS, "web").cluster_ip("198.19.0.70").tcp("http", 80).build());
    c.server.create(&endpoints("web", &[a1, a2, b1]));
    c.server.create(&svc(NS, "edge").type_("NodePort").cluster_ip("198.19.0.71").node_port("http", 80, 30090).build());
    c.server.create(&endpoints("edge", &[a1, b1]));
    let local = svc(NS, "local").type_("NodePort").cluster_ip("198.19.0.72").node_port("http", 80, 30091);
    c.server.create(&local.external_policy("Local").build());
    c.server.create(&endpoints("local", &[a1, b1]));
    let lb = svc(NS, "lb").type_("LoadBalancer").cluster_ip("198.19.0.73").node_port("http", 80, 30092);
    c.server.create(&lb.lb_ingress(&["198.18.40.30"]).source_ranges(&[&format!("{CLIENT_IP}/32")]).build());
    c.server.create(&endpoints("lb", &[a1]));
    c.server.create(&svc(NS, "empty").cluster_ip("198.19.0.74").tcp("http", 80).build());

    eventually("all services programmed", std::time::Duration::from_secs(30), || {
        let nat = c.nat();
        nat.contains("tr/lb:http") && nat.contains("tr/web:http") && c.filter().contains("tr/empty:http")
    })
    .await;

    // ClusterIP from a pod: three endpoints, the client's own address kept.
    check_against_traffic(&c, cpod, &cpod_ip, "198.19.0.70", 80, 60);
    // NodePort from outside (Cluster policy): both endpoints, masqueraded.
    check_against_traffic(&c, &c.client, CLIENT_IP, NODE_A_IP, 30090, 40);
    // NodePort with externalTrafficPolicy Local: the local endpoint, source kept.
    check_against_traffic(&c, &c.client, CLIENT_IP, NODE_A_IP, 30091, 20);
    // LB IP from the allowed source.
    check_against_traffic(&c, &c.client, CLIENT_IP, "198.18.40.30", 80, 10);

    // LB IP from a source outside loadBalancerSourceRanges: DROP, a timeout for real.
    let v = trace_on_node(&c, CLIENT_IP_ALT, "198.18.40.30", 80);
    assert_eq!(v["verdict"], "DROP", "{v}");
    assert_eq!(tcp_request(&c.client, sa("198.18.40.30", 80), Some(CLIENT_IP_ALT)), Err(Failure::Timeout));
    // No endpoints: REJECT, refused for real.
    let v = trace_on_node(&c, &cpod_ip, "198.19.0.74", 80);
    assert_eq!(v["verdict"], "REJECT", "{v}");
    assert_eq!(tcp_request(cpod, sa("198.19.0.74", 80), None), Err(Failure::Refused));

    // `diff` on the node needs only the daemon's configuration as a file: it reads the cluster
    // from the API server as the daemon does, and finds the daemon's rules as it renders them.
    let config = c.dir.path().join("written.conf");
    let mut args = c.daemon_args();
    args.push(format!("--write-config-to={}", config.display()));
    let written = std::process::Command::new(BIN).args(&args).output().expect("write config");
    assert!(written.status.success(), "{}", String::from_utf8_lossy(&written.stderr));
    let config = config.display().to_string();
    let out = c.node_a.run(&[BIN, "diff", "--config", &config]);
    assert_eq!(out.status, Some(0), "{}", out.combined());
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "no differences");
}

fn golden(name: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden").join(name)
}

fn diff_in(ns: &Netns, cluster: &Path) -> Output {
    let cluster = cluster.display().to_string();
    ns.run(&[BIN, "diff", "--hostname-override", "node-a", cluster.as_str()])
}

#[test]
fn diff_finds_nothing_on_restored_rules_then_reports_each_change() {
    require_root!();
    let ns = Netns::create("diff");
    crate::support::e2e::create_nfacct_objects(&ns);
    for scenario in ["nodeport", "session-affinity", "loadbalancer-source-ranges", "clusterip-probabilities"] {
        let cluster = golden(scenario).join("cluster.yaml");
        let render = std::process::Command::new(BIN)
            .args(["render", "--hostname-override", "node-a"])
            .arg(&cluster)
            .output()
            .expect("render");
        assert!(render.status.success());
        // Start clean: flush everything the previous scenario left.
        for table in ["nat", "filter"] {
            ns.ok(&["iptables", "-t", table, "-F"]);
            ns.ok(&["iptables", "-t", table, "-X"]);
        }
        let out = ns.run_with_stdin(&["iptables-restore", "--noflush"], &String::from_utf8_lossy(&render.stdout));
        assert!(out.success(), "restore: {}", out.combined());
        for jump in kube_proxy_rs::proxier::JUMP_CHAINS {
            let mut argv = vec!["iptables", "-t", jump.table.as_str(), "-I", jump.src];
            argv.extend(jump.args());
            ns.ok(&argv);
        }
        let out = diff_in(&ns, &cluster);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert_eq!(out.status, Some(0), "{scenario}: {stdout}{}", String::from_utf8_lossy(&out.stderr));
        assert_eq!(stdout.trim(), "no differences");
    }

    // Drift on the last scenario (clusterip-probabilities): a rule deleted from a service
    // chain, a stale service chain, a jump rule removed.
    let save = ns.ok(&["iptables-save", "-t", "nat"]);
    let svc_rule = save
        .lines()
        .find(|l| l.starts_with("-A KUBE-SVC-") && l.contains("app/web:http ->"))
        .expect("a web endpoint rule");
    let mut del: Vec<String> = vec!["iptables".into(), "-t".into(), "nat".into(), "-D".into()];
    del.extend(kube_proxy_rs::trace::rule::split_words(&svc_rule[3..]).expect("words"));
    let del: Vec<&str> = del.iter().map(String::as_str).collect();
    ns.ok(&del);
    ns.ok(&["iptables", "-t", "nat", "-N", "KUBE-SVC-STALESTALESTALE1"]);
    ns.ok(&[
        "iptables",
        "-t",
        "nat",
        "-A",
        "KUBE-SVC-STALESTALESTALE1",
        "-m",
        "comment",
        "--comment",
        "old/gone:http",
        "-j",
        "RETURN",
    ]);
    ns.ok(&[
        "iptables",
        "-t",
        "nat",
        "-D",
        "POSTROUTING",
        "-m",
        "comment",
        "--comment",
        "kubernetes postrouting rules",
        "-j",
        "KUBE-POSTROUTING",
    ]);

    let out = diff_in(&ns, &golden("clusterip-probabilities").join("cluster.yaml"));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status, Some(1), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("app/web:http:\n"), "{stdout}");
    assert!(stdout.contains("old/gone:http:\n") && stdout.contains("+ -A KUBE-SVC-STALESTALESTALE1"), "{stdout}");
    assert!(stdout.contains("(node-wide rules):\n") && stdout.contains("- -A POSTROUTING"), "{stdout}");
    // The deleted endpoint rule shows as missing, and the changed probabilities that follow
    // from it do not (the rule is gone, the others are unchanged).
    assert!(stdout.lines().filter(|l| l.trim_start().starts_with("- -A KUBE-SVC-")).count() == 1, "{stdout}");
}
