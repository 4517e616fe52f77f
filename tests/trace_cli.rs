//! The `trace` command's contract (an acceptance check depends on it exactly): flags, the
//! `--json` object's shape, verdict names, probabilities as numbers, destinations sorted, exit
//! codes, and errors that name the line.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_kube-proxy-rs");

fn golden(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden").join(name)
}

fn trace(args: &[&str]) -> Output {
    Command::new(BIN).arg("trace").args(args).output().expect("run kube-proxy-rs trace")
}

fn trace_stdin(args: &[&str], input: &str) -> Output {
    let mut child = Command::new(BIN)
        .arg("trace")
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn kube-proxy-rs trace");
    // A child that exits without reading all of stdin closes the pipe; its own output and
    // status, which the tests assert on, then say why.
    if let Err(e) = child.stdin.take().expect("stdin").write_all(input.as_bytes()) {
        assert_eq!(e.kind(), std::io::ErrorKind::BrokenPipe, "write stdin: {e}");
    }
    child.wait_with_output().expect("wait for trace")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[track_caller]
fn json(o: &Output) -> Value {
    assert!(o.status.success(), "trace failed: {}", stderr(o));
    let text = String::from_utf8_lossy(&o.stdout);
    assert_eq!(text.lines().count(), 1, "--json prints one line: {text}");
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"))
}

fn rules_of(scenario: &str) -> String {
    golden(scenario).join("expected.rules").display().to_string()
}

/// (address, probability, masquerade) of each destination, checking each field's type.
#[track_caller]
fn destinations(v: &Value) -> Vec<(String, f64, bool)> {
    v["destinations"]
        .as_array()
        .expect("destinations is an array")
        .iter()
        .map(|d| {
            let mut keys: Vec<&str> = d.as_object().expect("object").keys().map(String::as_str).collect();
            keys.sort_unstable();
            assert_eq!(keys, ["address", "masquerade", "probability"], "{d}");
            (
                d["address"].as_str().expect("address is a string").to_string(),
                d["probability"].as_f64().expect("probability is a number"),
                d["masquerade"].as_bool().expect("masquerade is a boolean"),
            )
        })
        .collect()
}

#[test]
fn json_object_has_exactly_the_contracted_shape() {
    let o = trace(&[
        "--rules",
        &rules_of("clusterip-probabilities"),
        "--local-address",
        "192.168.10.11",
        "--src",
        "10.64.1.50",
        "--dst",
        "172.30.0.10",
        "--dport",
        "80",
        "--proto",
        "tcp",
        "--json",
    ]);
    let v = json(&o);
    let mut keys: Vec<&str> = v.as_object().expect("one object").keys().map(String::as_str).collect();
    keys.sort_unstable();
    assert_eq!(keys, ["destinations", "path", "verdict"]);
    assert_eq!(v["verdict"], "DNAT");
    let d = destinations(&v);
    let addrs: Vec<&str> = d.iter().map(|(a, _, _)| a.as_str()).collect();
    // Sorted by address text (byte order: "10.64.2.100:" before "10.64.2.10:", as upstream
    // orders endpoints).
    assert_eq!(addrs, ["10.64.1.2:8080", "10.64.2.100:8080", "10.64.2.10:8080", "10.64.2.3:8080", "10.64.3.4:8080"]);
    let mut sorted = addrs.clone();
    sorted.sort_unstable();
    assert_eq!(addrs, sorted);
    for (a, p, masq) in &d {
        assert!((p - 0.2).abs() < 1e-6, "{a}: {p}");
        assert!(!masq, "pod to service is not masqueraded: {a}");
    }
    // The path: steps with table, chain, rule text, numeric probability.
    let path = v["path"].as_array().expect("path is an array");
    assert!(!path.is_empty());
    for s in path {
        assert!(s["table"].is_string() && s["chain"].is_string() && s["rule"].is_string(), "{s}");
        assert!(s["probability"].is_number() && s["depth"].is_u64(), "{s}");
    }
    assert!(path.iter().any(|s| s["rule"].as_str().unwrap().contains("app/web:http cluster IP")));
}

#[test]
fn verdict_names_for_reject_drop_and_accept() {
    let base = |scenario: &str, dst: &str, port: &str| {
        json(&trace(&[
            "--rules",
            &rules_of(scenario),
            "--local-address",
            "192.168.10.11",
            "--src",
            "10.64.1.50",
            "--dst",
            dst,
            "--dport",
            port,
            "--json",
        ]))
    };
    let v = base("no-endpoints", "172.30.16.10", "80");
    assert_eq!(v["verdict"], "REJECT");
    assert_eq!(v["destinations"], Value::Array(vec![]));
    let v = base("itp-local", "172.30.6.11", "80");
    assert_eq!(v["verdict"], "DROP");
    assert_eq!(v["destinations"], Value::Array(vec![]));
    // Not a service: passes unchanged.
    let v = base("no-endpoints", "10.64.9.9", "80");
    assert_eq!(v["verdict"], "ACCEPT");
    assert_eq!(destinations(&v), vec![("10.64.9.9:80".to_string(), 1.0, false)]);
}

#[test]
fn rules_from_stdin_from_manifests_and_from_a_file_agree() {
    let dir = golden("session-affinity");
    let common = ["--src", "192.168.10.11", "--dst", "192.168.10.11", "--dport", "31120", "--json"];
    let rules = std::fs::read_to_string(dir.join("expected.rules")).expect("golden rules");

    let rules_path = rules_of("session-affinity");
    let mut from_file = vec!["--rules", rules_path.as_str(), "--local-address", "192.168.10.11"];
    from_file.extend(common);
    let a = json(&trace(&from_file));

    let mut from_stdin = vec!["--rules", "-", "--local-address", "192.168.10.11"];
    from_stdin.extend(common);
    let b = json(&trace_stdin(&from_stdin, &rules));

    // Manifests: the node's addresses come from its Node object (192.168.10.11); rendered as
    // the release the golden file is (line numbers are compared).
    let cluster = dir.join("cluster.yaml").display().to_string();
    let mut from_manifests = vec!["--hostname-override", "node-a", "--compatibility-version", "1.29", cluster.as_str()];
    from_manifests.extend(common);
    let c = json(&trace(&from_manifests));

    assert_eq!(a, b);
    assert_eq!(a, c);
    assert_eq!(a["verdict"], "DNAT");
    assert_eq!(
        destinations(&a),
        vec![("10.64.1.112:8080".to_string(), 0.5, true), ("10.64.2.113:8080".to_string(), 0.5, true)]
    );
    // Affinity is reported as branches in the path.
    let affinity = a["path"].as_array().unwrap().iter().filter(|s| s["affinity"] == true).count();
    assert_eq!(affinity, 2, "{a}");
}

#[test]
fn upstream_iptables_save_text_traces_like_our_restore_text() {
    // What iptables-save prints for rules upstream kube-proxy wrote: /32 masks, -p before -m,
    // --set-xmark, 11-digit probabilities, policies and counters on the built-in chains.
    let save = r#"# Generated by iptables-save v1.8.9 on Mon Jan  1 00:00:00 2024
*nat
:PREROUTING ACCEPT [10:600]
:INPUT ACCEPT [0:0]
:OUTPUT ACCEPT [5:300]
:POSTROUTING ACCEPT [5:300]
:KUBE-MARK-MASQ - [0:0]
:KUBE-NODEPORTS - [0:0]
:KUBE-POSTROUTING - [0:0]
:KUBE-SEP-AAAAAAAAAAAAAAAA - [0:0]
:KUBE-SEP-BBBBBBBBBBBBBBBB - [0:0]
:KUBE-SERVICES - [0:0]
:KUBE-SVC-CCCCCCCCCCCCCCCC - [0:0]
-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A OUTPUT -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A POSTROUTING -m comment --comment "kubernetes postrouting rules" -j KUBE-POSTROUTING
-A KUBE-MARK-MASQ -j MARK --set-xmark 0x4000/0x4000
-A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN
-A KUBE-POSTROUTING -j MARK --set-xmark 0x4000/0x0
-A KUBE-POSTROUTING -m comment --comment "kubernetes service traffic requiring SNAT" -j MASQUERADE --random-fully
-A KUBE-SEP-AAAAAAAAAAAAAAAA -s 10.180.0.4/32 -m comment --comment "ns1/svc1:p80" -j KUBE-MARK-MASQ
-A KUBE-SEP-AAAAAAAAAAAAAAAA -p tcp -m comment --comment "ns1/svc1:p80" -m tcp -j DNAT --to-destination 10.180.0.4:80
-A KUBE-SEP-BBBBBBBBBBBBBBBB -s 10.180.0.5/32 -m comment --comment "ns1/svc1:p80" -j KUBE-MARK-MASQ
-A KUBE-SEP-BBBBBBBBBBBBBBBB -p tcp -m comment --comment "ns1/svc1:p80" -m tcp -j DNAT --to-destination 10.180.0.5:80
-A KUBE-SERVICES -d 172.30.0.41/32 -p tcp -m comment --comment "ns1/svc1:p80 cluster IP" -m tcp --dport 80 -j KUBE-SVC-CCCCCCCCCCCCCCCC
-A KUBE-SERVICES -m comment --comment "kubernetes service nodeports; NOTE: this must be the last rule in this chain" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS
-A KUBE-SVC-CCCCCCCCCCCCCCCC ! -s 10.0.0.0/8 -d 172.30.0.41/32 -p tcp -m comment --comment "ns1/svc1:p80 cluster IP" -m tcp --dport 80 -j KUBE-MARK-MASQ
-A KUBE-SVC-CCCCCCCCCCCCCCCC -m comment --comment "ns1/svc1:p80 -> 10.180.0.4:80" -m statistic --mode random --probability 0.50000000000 -j KUBE-SEP-AAAAAAAAAAAAAAAA
-A KUBE-SVC-CCCCCCCCCCCCCCCC -m comment --comment "ns1/svc1:p80 -> 10.180.0.5:80" -j KUBE-SEP-BBBBBBBBBBBBBBBB
COMMIT
"#;
    let common = ["--rules", "-", "--local-address", "192.168.0.2", "--dst", "172.30.0.41", "--dport", "80", "--json"];
    let mut from_node = vec!["--src", "192.168.0.2"];
    from_node.extend(common);
    let v = json(&trace_stdin(&from_node, save));
    assert_eq!(
        destinations(&v),
        vec![("10.180.0.4:80".to_string(), 0.5, true), ("10.180.0.5:80".to_string(), 0.5, true)]
    );
    // Built-in rules present: nothing is assumed (every step has a line).
    assert!(v["path"].as_array().unwrap().iter().all(|s| s["line"].is_u64()), "{v}");
    let mut from_pod = vec!["--src", "10.0.3.3"];
    from_pod.extend(common);
    let v = json(&trace_stdin(&from_pod, save));
    assert!(destinations(&v).iter().all(|(_, p, m)| *p == 0.5 && !m), "{v}");
}

#[test]
fn human_output_is_short_and_names_verdict_and_destinations() {
    let o = trace(&[
        "--rules",
        &rules_of("clusterip-probabilities"),
        "--local-address",
        "192.168.10.11",
        "--src",
        "10.64.1.50",
        "--dst",
        "172.30.0.10",
        "--dport",
        "80",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(text.starts_with("verdict: DNAT\n"), "{text}");
    assert!(text.contains("-> 10.64.2.100:8080") && text.contains("20.000%"), "{text}");
    assert!(text.contains("path:") && text.contains("KUBE-SERVICES"), "{text}");
    assert!(text.lines().count() < 30, "{text}");
}

#[test]
fn errors_name_the_line_and_exit_codes_separate_input_from_trace() {
    let common = [
        "--rules",
        "-",
        "--local-address",
        "192.168.0.2",
        "--src",
        "10.0.0.1",
        "--dst",
        "172.30.0.41",
        "--dport",
        "80",
    ];
    // Malformed: exit 2, the line named.
    let bad = "*nat\n:KUBE-SERVICES - [0:0]\n-A KUBE-SERVICES -d 172.30.0.300 -j X\nCOMMIT\n";
    let o = trace_stdin(&common, bad);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("line 3"), "{}", stderr(&o));
    let garbage = "*nat\n:KUBE-SERVICES - [0:0]\nnot a rule\nCOMMIT\n";
    let o = trace_stdin(&common, garbage);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("line 3"), "{}", stderr(&o));

    // A rule the tracer does not model, on the packet's way: reported, exit 1.
    let unknown = "*nat\n:KUBE-SERVICES - [0:0]\n:KUBE-X - [0:0]\n-A KUBE-SERVICES -m set --match-set allowed src -j KUBE-X\nCOMMIT\n";
    let o = trace_stdin(&common, unknown);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).contains("line 4") && stderr(&o).contains("-m set"), "{}", stderr(&o));
    let target = "*nat\n:KUBE-SERVICES - [0:0]\n-A KUBE-SERVICES -p tcp -j CT --notrack\nCOMMIT\n";
    let o = trace_stdin(&common, target);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).contains("line 3") && stderr(&o).contains("CT"), "{}", stderr(&o));

    // Unreadable file, family mismatch, missing and conflicting flags: exit 2.
    let o = trace(&["--rules", "/nonexistent/rules", "--src", "10.0.0.1", "--dst", "10.0.0.2", "--dport", "80"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("/nonexistent/rules"), "{}", stderr(&o));
    let o = trace(&["--rules", "x", "--src", "fd00::1", "--dst", "10.0.0.2", "--dport", "80"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    let o = trace(&["--rules", "x", "--dst", "10.0.0.2", "--dport", "80"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    let o = trace(&["--rules", "x", "m.yaml", "--src", "10.0.0.1", "--dst", "10.0.0.2", "--dport", "80"]);
    assert_eq!(o.status.code(), Some(2));
    let o = trace(&["--rules", "x", "--src", "10.0.0.1", "--dst", "10.0.0.2", "--dport", "80", "--proto", "icmp"]);
    assert_eq!(o.status.code(), Some(2));
}

#[test]
fn ipv6_family_follows_the_destination() {
    let rules = "*nat\n:KUBE-SERVICES - [0:0]\n-A KUBE-SERVICES -d fd00:30::41/128 -p udp -m udp --dport 53 -j DNAT --to-destination [fd00:180::4]:5353\nCOMMIT\n";
    let o = trace_stdin(
        &[
            "--rules",
            "-",
            "--local-address",
            "fd00:1::2",
            "--src",
            "fd00:1::9",
            "--dst",
            "fd00:30::41",
            "--dport",
            "53",
            "--proto",
            "udp",
            "--json",
        ],
        rules,
    );
    assert_eq!(destinations(&json(&o)), vec![("[fd00:180::4]:5353".to_string(), 1.0, false)]);
    let o = trace_stdin(
        &["--rules", "-", "--ip-family", "ipv4", "--src", "fd00:1::9", "--dst", "fd00:30::41", "--dport", "53"],
        rules,
    );
    assert_eq!(o.status.code(), Some(2));
}

/// `trace` reads iptables rules only: asked about nftables mode (the flag, or a config whose
/// mode is nftables) it refuses before reading anything, pointing at `render`, whatever the
/// rules' source; its help says so.
#[test]
fn nftables_mode_is_refused_with_a_pointer_to_render() {
    let packet = ["--src", "10.0.0.1", "--dst", "172.30.0.41", "--dport", "80"];
    let dir = std::env::temp_dir().join(format!("kpr-trace-nft-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("tmp");
    let config = dir.join("config.yaml");
    std::fs::write(
        &config,
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nmode: nftables\n",
    )
    .expect("write config");
    let config = config.display().to_string();
    let rules = rules_of("session-affinity");
    let cluster = golden("session-affinity").join("cluster.yaml").display().to_string();
    let cases: [Vec<&str>; 4] = [
        vec!["--proxy-mode", "nftables", "--rules", &rules],
        vec!["--proxy-mode", "nftables", "--hostname-override", "node-a", &cluster],
        vec!["--config", &config, "--hostname-override", "node-a", &cluster],
        // The live node: refused before its rules are read.
        vec!["--proxy-mode", "nftables"],
    ];
    for case in &cases {
        let args: Vec<&str> = case.iter().chain(packet.iter()).copied().collect();
        let o = trace(&args);
        assert_eq!(o.status.code(), Some(2), "{case:?}: {}", stderr(&o));
        let err = stderr(&o);
        assert!(err.contains("trace reads iptables rules only for now"), "{case:?}: {err}");
        assert!(err.contains("kube-proxy-rs render --proxy-mode nftables"), "{case:?}: {err}");
        assert!(o.stdout.is_empty(), "{case:?}");
    }
    // iptables mode, by flag or by the config's word, traces as before.
    let o = trace(
        &["--proxy-mode", "iptables", "--rules", &rules, "--local-address", "192.168.0.2", "--json"]
            .into_iter()
            .chain(packet)
            .collect::<Vec<_>>(),
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let _ = std::fs::remove_dir_all(&dir);

    let help = Command::new(BIN).args(["trace", "--help"]).output().expect("help");
    let help = String::from_utf8_lossy(&help.stdout);
    assert!(help.contains("Reads iptables rules only for now"), "{help}");
    assert!(help.contains("render --proxy-mode") && help.contains("nftables"), "{help}");
}
