//! What `render` prints is accepted by the real `iptables-restore`, nft and legacy, in a
//! private network namespace: the full sync and the partial syncs after it, in order, and the
//! kernel ends up with exactly our chains. In nftables mode, each sync's table is accepted by
//! `nft -f` and lists back as rendered. Needs root (CI runs as root); skips otherwise.

use std::process::Command;

use crate::require_root;
use crate::support::netns::Netns;

const BIN: &str = env!("CARGO_BIN_EXE_kube-proxy-rs");

/// Splits `render` output into its sync payloads.
fn syncs(text: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for line in text.lines() {
        if line.starts_with("# sync ") {
            out.push(String::new());
        } else if let Some(cur) = out.last_mut() {
            cur.push_str(line);
            cur.push('\n');
        }
    }
    out
}

#[test]
fn render_output_is_accepted_by_real_iptables_restore() {
    require_root!();
    let dir = std::env::temp_dir().join(format!("kpr-restore-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("tmp");
    let base = std::fs::read_to_string("examples/cluster.yaml").expect("example");
    // Snapshot 2: a rollout of web's endpoints and api removed; snapshot 3: api back, with
    // new options.
    let second = base.replace("10.244.1.5", "10.244.1.6").replace("name: api\n", "name: api-renamed\n");
    let third = base.replace("sessionAffinity: ClientIP", "sessionAffinity: None");
    std::fs::write(dir.join("2.yaml"), second).expect("write");
    std::fs::write(dir.join("3.yaml"), third).expect("write");
    let out = Command::new(BIN)
        .args(["render", "--hostname-override", "node-a", "examples/cluster.yaml", "--then"])
        .arg(dir.join("2.yaml"))
        .arg("--then")
        .arg(dir.join("3.yaml"))
        .output()
        .expect("render");
    let _ = std::fs::remove_dir_all(&dir);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let payloads = syncs(&String::from_utf8_lossy(&out.stdout));
    assert_eq!(payloads.len(), 3);

    for backend in ["nft", "legacy"] {
        let ns = Netns::create(backend);
        crate::support::e2e::create_nfacct_objects(&ns);
        let restore = format!("iptables-{backend}-restore");
        let save = format!("iptables-{backend}-save");
        // Someone else's rules, which must survive every restore.
        let out = ns.run_with_stdin(
            &[&restore, "--noflush"],
            "*nat\n:OTHER-OWNER - [0:0]\n-A OTHER-OWNER -d 198.18.0.1/32 -j RETURN\nCOMMIT\n",
        );
        assert!(out.success(), "{backend}: seeding foreign rules: {}", out.combined());
        for (i, payload) in payloads.iter().enumerate() {
            let out = ns.run_with_stdin(&[&restore, "--noflush", "--counters"], payload);
            assert!(out.success(), "{backend}: sync {} rejected: {}\n{payload}", i + 1, out.combined());
        }
        let saved = ns.ok(&[&save, "-t", "nat"]);
        assert!(saved.contains("-A OTHER-OWNER -d 198.18.0.1/32 -j RETURN"), "{backend}: foreign rule lost:\n{saved}");
        // Every KUBE- chain in the kernel is one the last full picture declares: nothing
        // stale left behind by the partial syncs.
        let kernel: Vec<&str> = saved
            .lines()
            .filter_map(|l| l.strip_prefix(':'))
            .filter_map(|l| l.split(' ').next())
            .filter(|c| c.starts_with("KUBE-"))
            .collect();
        let last_nat = payloads[0].split("*nat\n").nth(1).unwrap_or("");
        let expected_after_3: Vec<&str> =
            last_nat.lines().filter_map(|l| l.strip_prefix(':')).filter_map(|l| l.split(' ').next()).collect();
        // Snapshot 3 is snapshot 1 without affinity: same chain set as the first full sync.
        let mut k = kernel.clone();
        k.sort_unstable();
        let mut e = expected_after_3.clone();
        e.sort_unstable();
        assert_eq!(k, e, "{backend}: chains after the partial syncs differ from a full sync");
        assert!(!saved.contains("--rcheck"), "{backend}: affinity rules should be gone after sync 3:\n{saved}");
    }
}

/// Every address spelling from the hardening findings that a 1.29-era API server accepts but
/// iptables rejects (failing the whole payload) or reads as octal (widening a firewall).
const HOSTILE_ADDRESSES: &str = r#"
apiVersion: v1
kind: Service
metadata: {namespace: ns1, name: lb}
spec:
  type: LoadBalancer
  clusterIP: 172.30.0.5
  clusterIPs: [172.30.0.5]
  ipFamilies: [IPv4]
  externalIPs: ["08.1.1.1", "010.1.1.1", "203.0.113.9"]
  loadBalancerSourceRanges: ["10.0.0.0/008", "10.0.0.0/08", "::ffff:10.0.0.0/104", "10.64.0.0/010", "203.0.113.0/24"]
  ports:
  - {name: http, port: 80, protocol: TCP, nodePort: 30080}
status:
  loadBalancer:
    ingress: [{ip: "010.1.1.2"}, {ip: "203.0.113.10"}]
---
apiVersion: v1
kind: Service
metadata:
  namespace: ns1
  name: closed
  annotations: {service.beta.kubernetes.io/load-balancer-source-ranges: "192.168.0.0/016, ::ffff:203.0.113.0/120"}
spec:
  type: LoadBalancer
  clusterIP: 172.30.0.6
  clusterIPs: [172.30.0.6]
  ipFamilies: [IPv4]
  ports:
  - {name: http, port: 80, protocol: TCP, nodePort: 30081}
status:
  loadBalancer:
    ingress: [{ip: "203.0.113.20"}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {namespace: ns1, name: lb-1, labels: {kubernetes.io/service-name: lb}}
addressType: IPv4
ports: [{name: http, port: 8080, protocol: TCP}]
endpoints:
- addresses: ["010.244.1.5"]
- addresses: ["10.244.1.09"]
- addresses: ["::ffff:10.244.1.6"]
- addresses: ["10.244.1.7"]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {namespace: ns1, name: closed-1, labels: {kubernetes.io/service-name: closed}}
addressType: IPv4
ports: [{name: http, port: 8080, protocol: TCP}]
endpoints:
- addresses: ["10.244.1.8"]
---
apiVersion: v1
kind: Service
metadata: {namespace: ns1, name: v6}
spec:
  type: LoadBalancer
  clusterIP: fd00:30::6
  clusterIPs: [fd00:30::6]
  ipFamilies: [IPv6]
  externalIPs: ["FD00:99::1", "fd00:99::2"]
  loadBalancerSourceRanges: ["fd00::/064"]
  ports:
  - {name: http, port: 80, protocol: TCP, nodePort: 30082}
status:
  loadBalancer:
    ingress: [{ip: "fd00:ee::60"}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {namespace: ns1, name: v6-1, labels: {kubernetes.io/service-name: v6}}
addressType: IPv6
ports: [{name: http, port: 8080, protocol: TCP}]
endpoints:
- addresses: ["FD00:10::5"]
- addresses: ["::ffff:10.244.1.6"]
- addresses: ["fd00:10::7"]
"#;

/// Renders [`HOSTILE_ADDRESSES`] for `family` as `release`: (stdout payload, stderr).
fn render_hostile(family: &str, release: &str) -> (String, String) {
    render_manifest(&format!("addresses-{release}"), HOSTILE_ADDRESSES, family, &["--compatibility-version", release])
}

/// Restores the IPv4 and IPv6 payloads into a fresh network namespace with each iptables
/// backend; returns each backend's saved nat table.
fn restore_in_kernel(name: &str, v4: &str, v6: &str) -> Vec<(&'static str, String)> {
    let mut saved = Vec::new();
    for backend in ["nft", "legacy"] {
        let ns = Netns::create(&format!("{name}-{backend}"));
        crate::support::e2e::create_nfacct_objects(&ns);
        for (tool, payload) in [("iptables", v4), ("ip6tables", v6)] {
            let out = ns.run_with_stdin(&[&format!("{tool}-{backend}-restore"), "--noflush"], payload);
            assert!(out.success(), "{tool}-{backend}: payload rejected: {}\n{payload}", out.combined());
        }
        saved.push((backend, ns.ok(&[&format!("iptables-{backend}-save"), "-t", "nat"])));
    }
    saved
}

/// Renders the manifest `yaml` for `family` as node-a, with `extra` arguments: (the first
/// sync's payload, stderr).
fn render_manifest(name: &str, yaml: &str, family: &str, extra: &[&str]) -> (String, String) {
    let dir = std::env::temp_dir().join(format!("kpr-hostile-{name}-{family}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("tmp");
    let file = dir.join("cluster.yaml");
    std::fs::write(&file, yaml).expect("write");
    let out = Command::new(BIN)
        .args(["render", "--hostname-override", "node-a", "--ip-family", family])
        .args(extra)
        .arg(&file)
        .output()
        .expect("render");
    let _ = std::fs::remove_dir_all(&dir);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let payload = syncs(&String::from_utf8_lossy(&out.stdout)).remove(0);
    (payload, String::from_utf8_lossy(&out.stderr).into_owned())
}

/// As 1.29 (which writes Service addresses verbatim), non-canonical addresses are skipped
/// with a warning naming the object, everything else of the object is rendered, a firewall
/// never opens up, and the payload is accepted by the real iptables-restore (nft and legacy)
/// — with upstream 1.29 it is rejected as a whole.
#[test]
fn addresses_not_in_canonical_form_are_skipped_and_the_payload_restores() {
    let (v4, warnings) = render_hostile("ipv4", "1.29");
    for bad in [
        "08.1.1.1", "010.1.1", "8.1.1.1", "10.1.1.1", "10.1.1.2", "/008", "/08", "/010", "::ffff", "/016", "244.1.5",
        "244.1.9", "244.1.6",
    ] {
        assert!(!v4.contains(bad), "{bad} must not be written:\n{v4}");
    }
    for good in ["-d 203.0.113.9 ", "-d 203.0.113.10 ", "-s 203.0.113.0/24", "10.244.1.7:8080", "10.244.1.8:8080"] {
        assert!(v4.contains(good), "{good} missing:\n{v4}");
    }
    for named in [
        "\"08.1.1.1\"",
        "\"010.1.1.1\"",
        "\"010.1.1.2\"",
        "\"10.0.0.0/008\"",
        "\"10.0.0.0/08\"",
        "\"::ffff:10.0.0.0/104\"",
        "\"10.64.0.0/010\"",
        "\"192.168.0.0/016\"",
        "\"::ffff:203.0.113.0/120\"",
        "\"010.244.1.5\"",
        "\"10.244.1.09\"",
        "\"::ffff:10.244.1.6\"",
    ] {
        let line = warnings.lines().find(|l| l.contains(named));
        assert!(line.is_some_and(|l| l.contains("ns1/")), "no warning naming {named} and its object:\n{warnings}");
    }
    // `closed` lists only ranges that are not canonical: its firewall stays and lets nothing
    // through (the octal reading would have opened it to a /14 and a /24).
    let fw: Vec<&str> = v4.lines().filter(|l| l.starts_with("-A KUBE-FW-") && l.contains("ns1/closed:http")).collect();
    assert_eq!(fw.len(), 1, "{v4}");
    assert!(fw[0].contains("other traffic to ns1/closed:http will be dropped"), "{fw:?}");
    assert!(v4.contains("ns1/closed:http traffic not accepted by KUBE-FW-"), "{v4}");

    let (v6, warnings) = render_hostile("ipv6", "1.29");
    // IPv6 text means the same to ip6tables in any spelling: written as given, as 1.29 does.
    for good in ["-d FD00:99::1 ", "-d fd00:99::2 ", "[FD00:10::5]:8080", "[fd00:10::7]:8080"] {
        assert!(v6.contains(good), "{good} missing:\n{v6}");
    }
    assert!(!v6.contains("/064") && !v6.contains("::ffff") && !v6.contains("-s fd00::"), "{v6}");
    for named in ["\"fd00::/064\"", "\"::ffff:10.244.1.6\""] {
        assert!(warnings.contains(named), "no warning naming {named}:\n{warnings}");
    }
    assert!(v6.contains("other traffic to ns1/v6:http will be dropped"), "the IPv6 firewall stays:\n{v6}");

    require_root!();
    for (backend, saved) in restore_in_kernel("hostile", &v4, &v6) {
        assert!(!saved.contains("8.1.1.1") && !saved.contains("10.0.0.0/8"), "{backend}: octal reading:\n{saved}");
    }
}

/// From 1.30 upstream parses Service addresses (`net.IP`, `*net.IPNet`, leading zeros
/// decimal) and writes Go's canonical text (upstream-versions.md row 14): the same Services
/// keep every address, canonically spelled, with no warning about them, and the payload
/// restores with the decimal meaning (not iptables' octal reading).
#[test]
fn from_1_30_service_addresses_are_written_canonically_and_restore() {
    let (v4, warnings) = render_hostile("ipv4", "1.30");
    for good in [
        "-d 8.1.1.1 ",
        "-d 10.1.1.1 ",
        "-d 203.0.113.9 ",
        "-d 10.1.1.2 ",
        "-d 203.0.113.10 ",
        "-s 10.0.0.0/8 ",
        "-s 10.64.0.0/10 ",
        "-s 203.0.113.0/24 ",
        "-s 192.168.0.0/16 ",
    ] {
        assert!(v4.contains(good), "{good} missing:\n{v4}");
    }
    for bad in ["08.1.1.1", "010.1", "/008", "/08 ", "/010", "/016", "::ffff"] {
        assert!(!v4.contains(bad), "{bad} must not be written:\n{v4}");
    }
    for service_text in ["\"08.1.1.1\"", "\"010.1.1.1\"", "\"010.1.1.2\"", "\"10.0.0.0/08\"", "\"192.168.0.0/016\""] {
        assert!(!warnings.contains(service_text), "{service_text} is written, not skipped:\n{warnings}");
    }
    // Slice addresses are still skipped by 1.30; 1.31 writes them canonically too (row 15).
    assert!(!v4.contains("10.244.1.5:8080") && !v4.contains("10.244.1.9:8080"), "{v4}");
    let (v4_1_31, warnings) = render_hostile("ipv4", "1.31");
    for good in ["10.244.1.5:8080", "10.244.1.9:8080", "10.244.1.6:8080", "10.244.1.7:8080"] {
        assert!(v4_1_31.contains(good), "{good} missing:\n{v4_1_31}");
    }
    assert!(!warnings.contains("\"010.244.1.5\""), "{warnings}");
    let (v6, _) = render_hostile("ipv6", "1.30");
    for good in ["-d fd00:99::1 ", "-d fd00:99::2 ", "-s fd00::/64 "] {
        assert!(v6.contains(good), "{good} missing:\n{v6}");
    }
    assert!(!v6.contains("FD00:99") && !v6.contains("/064"), "{v6}");

    require_root!();
    for (backend, saved) in restore_in_kernel("canonical", &v4, &v6) {
        for meaning in ["10.64.0.0/10", "192.168.0.0/16", "-d 10.1.1.1/32"] {
            assert!(saved.contains(meaning), "{backend}: {meaning} missing:\n{saved}");
        }
    }
}

/// Services whose names would break the restore input (a port name with a newline and a
/// rule of its own, one with a quote, a namespace with a space) next to a valid one.
const HOSTILE_NAMES: &str = r#"
apiVersion: v1
kind: Service
metadata: {namespace: ns1, name: inject}
spec:
  clusterIP: 172.30.9.1
  ports: [{name: "x\n-A INPUT -j ACCEPT", port: 80, protocol: TCP}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {namespace: ns1, name: inject-1, labels: {kubernetes.io/service-name: inject}}
addressType: IPv4
ports: [{name: "x\n-A INPUT -j ACCEPT", port: 8080, protocol: TCP}]
endpoints: [{addresses: [10.244.9.1]}]
---
apiVersion: v1
kind: Service
metadata: {namespace: ns1, name: quote}
spec:
  clusterIP: 172.30.9.2
  ports: [{name: "q\"uote", port: 80, protocol: TCP}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {namespace: ns1, name: quote-1, labels: {kubernetes.io/service-name: quote}}
addressType: IPv4
ports: [{name: "q\"uote", port: 8080, protocol: TCP}]
endpoints: [{addresses: [10.244.9.2]}]
---
apiVersion: v1
kind: Service
metadata: {namespace: "n s", name: spaced}
spec:
  clusterIP: 172.30.9.3
  ports: [{name: http, port: 80, protocol: TCP}]
---
apiVersion: v1
kind: Service
metadata: {namespace: ns1, name: fine}
spec:
  clusterIP: 172.30.9.4
  ports: [{name: http, port: 80, protocol: TCP}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {namespace: ns1, name: fine-1, labels: {kubernetes.io/service-name: fine}}
addressType: IPv4
ports: [{name: http, port: 8080, protocol: TCP}]
endpoints: [{addresses: [10.244.9.4]}]
"#;

/// Names that would inject lines or break quoting are skipped with a warning naming the
/// object; the valid service is rendered and the payload restores into a real kernel.
#[test]
fn names_that_would_break_the_restore_input_are_skipped() {
    let (payload, warnings) = render_manifest("names", HOSTILE_NAMES, "ipv4", &[]);
    assert!(!payload.contains("-A INPUT"), "an injected rule:\n{payload}");
    for gone in ["172.30.9.1", "172.30.9.2", "172.30.9.3", "uote", "n s/"] {
        assert!(!payload.contains(gone), "{gone} must not be written:\n{payload}");
    }
    assert!(payload.contains("-d 172.30.9.4 ") && payload.contains("10.244.9.4:8080"), "{payload}");
    for named in ["\"inject\"", "\"quote\"", "\"n s\""] {
        assert!(
            warnings.lines().any(|l| l.contains(named) && l.contains("cannot be written into rule comments")),
            "no warning for {named}:\n{warnings}"
        );
    }

    require_root!();
    let ns = Netns::create("hostile-names");
    crate::support::e2e::create_nfacct_objects(&ns);
    let restored = ns.run_with_stdin(&["iptables-nft-restore", "--noflush"], &payload);
    assert!(restored.success(), "payload rejected: {}\n{payload}", restored.combined());
}

/// `render --nfacct absent` writes the rules of a node without the accounting objects, which
/// `iptables-restore --test` accepts on such a node; the default (`present`, as upstream's unit
/// tests assume) names them and is rejected there until they exist. And the config's
/// `conntrack.tcpBeLiberal` (or the node's sysctl, `--conntrack-tcp-be-liberal`) leaves the
/// INVALID drop out, as the daemon does.
#[test]
fn render_says_what_node_it_renders_for() {
    require_root!();
    let example = std::fs::read_to_string("examples/cluster.yaml").expect("example");
    let (absent, _) = render_manifest("nfacct-absent", &example, "ipv4", &["--nfacct", "absent"]);
    let (present, _) = render_manifest("nfacct-present", &example, "ipv4", &[]);
    assert!(!absent.contains("-m nfacct") && present.contains("-m nfacct"), "{absent}\n{present}");
    for backend in ["nft", "legacy"] {
        let ns = Netns::create(&format!("nfacct-{backend}"));
        // `--test` does not reach the kernel's check of the objects; a real restore does.
        let restore =
            |payload: &str, flag: &str| ns.run_with_stdin(&[&format!("iptables-{backend}-restore"), flag], payload);
        let out = restore(&absent, "--test");
        assert!(out.success(), "{backend}: --nfacct absent rejected on a node without nfacct: {}", out.combined());
        assert!(!restore(&present, "--noflush").success(), "{backend}: the default names objects this node lacks");
        let out = restore(&absent, "--noflush");
        assert!(out.success(), "{backend}: --nfacct absent restores on a node without nfacct: {}", out.combined());
        crate::support::e2e::create_nfacct_objects(&ns);
        let out = restore(&present, "--noflush");
        assert!(out.success(), "{backend}: accepted once the objects exist: {}", out.combined());
    }

    const INVALID_DROP: &str = "--ctstate INVALID";
    assert!(present.contains(INVALID_DROP), "{present}");
    let (liberal_flag, _) = render_manifest("liberal-flag", &example, "ipv4", &["--conntrack-tcp-be-liberal"]);
    assert!(!liberal_flag.contains(INVALID_DROP), "{liberal_flag}");
    let dir = std::env::temp_dir().join(format!("kpr-liberal-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("tmp");
    let config = dir.join("config.yaml");
    std::fs::write(
        &config,
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nconntrack:\n  tcpBeLiberal: true\n",
    )
    .expect("write");
    let (liberal_config, _) =
        render_manifest("liberal-config", &example, "ipv4", &["--config", &config.display().to_string()]);
    let _ = std::fs::remove_dir_all(&dir);
    assert!(!liberal_config.contains(INVALID_DROP), "{liberal_config}");
}

/// An IPv6 cluster for nftables mode: a ClusterIP with affinity, a NodePort, a LoadBalancer
/// with source ranges and a local endpoint, a Service without endpoints, and ServiceCIDRs.
const NFT_V6_CLUSTER: &str = r#"
apiVersion: v1
kind: Node
metadata: {name: node-a}
spec: {podCIDRs: ["fd00:244:1::/64"]}
status: {addresses: [{type: InternalIP, address: "fd00:10::11"}]}
---
apiVersion: networking.k8s.io/v1
kind: ServiceCIDR
metadata: {name: kubernetes}
spec: {cidrs: ["198.18.96.0/20", "fd00:96::/112"]}
---
apiVersion: v1
kind: Service
metadata: {namespace: default, name: web}
spec:
  type: NodePort
  clusterIP: "fd00:96::10"
  clusterIPs: ["fd00:96::10"]
  ipFamilies: [IPv6]
  sessionAffinity: ClientIP
  ports: [{name: http, port: 80, protocol: TCP, targetPort: 8080, nodePort: 30080}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {namespace: default, name: web-1, labels: {kubernetes.io/service-name: web}}
addressType: IPv6
ports: [{name: http, port: 8080, protocol: TCP}]
endpoints:
- {addresses: ["fd00:244:1::5"], conditions: {ready: true}, nodeName: node-a}
- {addresses: ["fd00:244:2::7"], conditions: {ready: true}, nodeName: node-b}
---
apiVersion: v1
kind: Service
metadata: {namespace: shop, name: front}
spec:
  type: LoadBalancer
  clusterIP: "fd00:96::30"
  clusterIPs: ["fd00:96::30"]
  ipFamilies: [IPv6]
  externalTrafficPolicy: Local
  healthCheckNodePort: 32000
  loadBalancerSourceRanges: ["fd00:203::/64"]
  ports: [{name: http, port: 80, protocol: TCP, nodePort: 31080}]
status: {loadBalancer: {ingress: [{ip: "fd00:198::7"}]}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {namespace: shop, name: front-1, labels: {kubernetes.io/service-name: front}}
addressType: IPv6
ports: [{name: http, port: 80, protocol: TCP}]
endpoints:
- {addresses: ["fd00:244:1::20"], conditions: {ready: true}, nodeName: node-a}
---
apiVersion: v1
kind: Service
metadata: {namespace: default, name: empty}
spec:
  clusterIP: "fd00:96::53"
  clusterIPs: ["fd00:96::53"]
  ipFamilies: [IPv6]
  ports: [{name: dns, port: 53, protocol: UDP}]
"#;

/// Splits nftables-mode render output into its syncs, each with its `# sync` line (a comment
/// to `nft`).
fn nft_syncs(text: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for line in text.lines() {
        if line.starts_with("# sync ") {
            out.push(String::new());
        }
        let current = out.last_mut().expect("output starts with a sync line");
        current.push_str(line);
        current.push('\n');
    }
    out
}

/// `render --proxy-mode nftables`: each sync's output, given as is to `nft -f` in a namespace
/// without the table, is accepted by the real nft and kernel, and the kernel then lists
/// exactly the table the render shows (read back with the project's listing parser, compared
/// with the render's table in nft's canonical words): both families, a full sync and the
/// partial syncs after it (stale chains flushed, then deleted), every release 1.31 to 1.37.
#[test]
fn nftables_render_is_accepted_by_real_nft_and_lists_back_the_same_table() {
    use std::sync::Arc;
    use std::time::Duration;

    use kube_proxy_rs::exec::RealExec;
    use kube_proxy_rs::nftables::{Family, NftOptions, NftRunner, Nftables};

    use crate::support::nft::parse_dump;

    require_root!();
    let dir = crate::support::e2e::TempDir::new("render-nft-kernel");
    // v4: the example, then without `web` and with api's endpoint replaced, twice (a Service's
    // and an endpoint's chains flushed, then deleted), plus ServiceCIDRs (the drop rule).
    let example = std::fs::read_to_string("examples/cluster.yaml").expect("example");
    let cidrs = "apiVersion: networking.k8s.io/v1\nkind: ServiceCIDR\nmetadata: {name: kubernetes}\n\
                 spec: {cidrs: [10.96.0.0/16, 10.97.0.0/16]}\n";
    let first_v4 = format!("{example}\n---\n{cidrs}");
    let docs: Vec<&str> =
        first_v4.split("\n---\n").filter(|d| !d.contains("name: web}") && !d.contains("name: web-abc12")).collect();
    let later_v4 = docs.join("\n---\n").replace("10.244.2.9]", "10.244.2.10]");
    // v6: the cluster above, then without `web` and with front's endpoint replaced.
    let later_v6: String = NFT_V6_CLUSTER
        .split("\n---\n")
        .filter(|d| !d.contains("name: web}") && !d.contains("name: web-1,"))
        .collect::<Vec<_>>()
        .join("\n---\n")
        .replace("fd00:244:1::20", "fd00:244:1::21");
    let file = |name: &str, text: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, text).expect("write manifest");
        path.display().to_string()
    };
    let (first_v4, later_v4) = (file("v4-1.yaml", &first_v4), file("v4-2.yaml", &later_v4));
    let (first_v6, later_v6) = (file("v6-1.yaml", NFT_V6_CLUSTER), file("v6-2.yaml", &later_v6));

    let ns = Netns::create("render-nft");
    let options =
        NftOptions { netns: Some(ns.name.clone()), command_timeout: Duration::from_secs(60), ..NftOptions::default() };
    for (family, ip_family, first, later) in
        [(Family::Ip, "ipv4", &first_v4, &later_v4), (Family::Ip6, "ipv6", &first_v6, &later_v6)]
    {
        let nft = NftRunner::new(Arc::new(RealExec), family, options.clone()).expect("nft is usable");
        for release in ["1.31", "1.32", "1.33", "1.34", "1.35", "1.36", "1.37"] {
            let out = Command::new(BIN)
                .args(["render", "--proxy-mode", "nftables", "--hostname-override", "node-a"])
                .args(["--ip-family", ip_family, "--compatibility-version", release, first])
                .args(["--then", later, "--then", later])
                .output()
                .expect("render");
            assert!(out.status.success(), "{release} {family}: {}", String::from_utf8_lossy(&out.stderr));
            let syncs = nft_syncs(&String::from_utf8_lossy(&out.stdout));
            assert_eq!(syncs.len(), 3, "{release} {family}");
            for (i, sync) in syncs.iter().enumerate() {
                let what = format!("{release} {family} sync {}", i + 1);
                // A node without the table.
                let _ = ns.run(&["nft", "delete", "table", family.as_str(), "kube-proxy"]);
                assert_eq!(nft.list_table().expect("list"), None, "{what}: no table before");
                let applied = ns.run_with_stdin(&["nft", "-f", "-"], sync);
                assert!(applied.success(), "{what}: nft -f refused it: {}\n{sync}", applied.combined());
                let listed = nft.list_table().expect("list").expect("the table exists");
                let rendered = parse_dump(sync, family);
                assert_eq!(listed.counts(), rendered.counts(), "{what}: chains, rules, sets, elements");
                assert_eq!(listed, rendered.as_listed(), "{what}: the kernel's table is the render's");
            }
            let last = parse_dump(&syncs[2], family);
            assert!(
                !last.chains.keys().any(|c| c.contains("/web/")),
                "{release} {family}: web's chains deleted by sync 3: {:?}",
                last.chains.keys().collect::<Vec<_>>()
            );
            let drop = last.chains["cluster-ips-check"].rules.iter().any(|(text, _)| text.ends_with("} drop"));
            let with_cidrs = release >= "1.33";
            assert_eq!(drop, with_cidrs, "{release} {family}: the ServiceCIDR drop rule (MultiCIDRServiceAllocator)");
        }
        let _ = ns.run(&["nft", "delete", "table", family.as_str(), "kube-proxy"]);
    }
}
