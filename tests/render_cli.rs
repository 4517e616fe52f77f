//! The `render` command's contract: headers, exit codes, warnings on stderr, flags.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const BIN: &str = env!("CARGO_BIN_EXE_kube-proxy-rs");

/// A scratch directory removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("kpr-cli-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("scratch dir");
        Scratch(dir)
    }

    fn file(&self, name: &str, text: &str) -> PathBuf {
        let p = self.0.join(name);
        std::fs::write(&p, text).expect("write fixture");
        p
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn render(args: &[&str], files: &[&Path]) -> Output {
    Command::new(BIN).arg("render").args(args).args(files).output().expect("run kube-proxy-rs render")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

const WEB: &str = r#"
apiVersion: v1
kind: Service
metadata: {namespace: default, name: web}
spec:
  type: ClusterIP
  clusterIP: 172.30.0.10
  ports: [{name: http, port: 80, protocol: TCP}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  namespace: default
  name: web-1
  labels: {kubernetes.io/service-name: web}
addressType: IPv4
ports: [{name: http, port: 8080, protocol: TCP}]
endpoints:
- addresses: [10.1.0.1]
  conditions: {ready: true}
"#;

#[test]
fn example_cluster_renders_one_full_sync() {
    let out = render(&["--hostname-override", "node-a"], &[Path::new("examples/cluster.yaml")]);
    assert!(out.status.success(), "stderr: {}", stderr(&out));
    let text = stdout(&out);
    assert!(text.starts_with("# sync 1: full\n*filter\n"), "{text}");
    assert_eq!(text.matches("# sync").count(), 1);
    assert!(text.ends_with("COMMIT\n"));
    // Default masquerade bit 14, printed like Go's %#08x.
    assert!(text.contains("-A KUBE-MARK-MASQ -j MARK --or-mark 0x00004000\n"), "{text}");
    // iptables 1.8.9 by default: --random-fully.
    assert!(text.contains("-j MASQUERADE --random-fully\n"));
}

#[test]
fn then_snapshots_are_partial_syncs() {
    let dir = Scratch::new("then");
    let first = dir.file("a.yaml", WEB);
    let second = dir.file("b.yaml", &WEB.replace("10.1.0.1", "10.1.0.2"));
    let third = dir.file("c.yaml", "");
    let out = Command::new(BIN)
        .args(["render", "--hostname-override", "n1"])
        .arg(&first)
        .arg("--then")
        .arg(&second)
        .arg("--then")
        .arg(&third)
        .output()
        .expect("run");
    assert!(out.status.success(), "stderr: {}", stderr(&out));
    let text = stdout(&out);
    let headers: Vec<&str> = text.lines().filter(|l| l.starts_with("# sync")).collect();
    assert_eq!(headers, ["# sync 1: full", "# sync 2: partial", "# sync 3: partial"]);
    let syncs: Vec<&str> = text.split("# sync ").skip(1).collect();
    // Sync 2 rewrites only web's chains; the old endpoint chain is deleted.
    assert!(syncs[1].contains("--to-destination 10.1.0.2:8080"));
    assert!(!syncs[1].contains("KUBE-FORWARD"), "unchanged top-level chains are left out: {}", syncs[1]);
    assert_eq!(syncs[1].matches("\n-X KUBE-SEP-").count(), 1, "{}", syncs[1]);
    // Sync 3: the service is gone, its chains deleted, KUBE-SERVICES rewritten.
    assert!(syncs[2].contains("\n-X KUBE-SVC-"), "{}", syncs[2]);
    assert!(syncs[2].contains(":KUBE-SERVICES - [0:0]"));
}

#[test]
fn unreadable_file_exits_2_naming_it() {
    let out = render(&[], &[Path::new("/nonexistent/cluster.yaml")]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("/nonexistent/cluster.yaml"), "{}", stderr(&out));
    assert!(out.stdout.is_empty(), "nothing printed before failing");
}

#[test]
fn invalid_yaml_exits_2_naming_file_and_line() {
    let dir = Scratch::new("badyaml");
    let bad = dir.file("bad.yaml", "apiVersion: v1\nkind: Service\nmetadata: {name: x\n  namespace: y\n");
    let out = render(&[], &[&bad]);
    assert_eq!(out.status.code(), Some(2));
    let err = stderr(&out);
    assert!(err.contains("bad.yaml"), "{err}");
    assert!(err.contains(":3") || err.contains("line 3") || err.contains(":4"), "line number expected: {err}");
}

#[test]
fn invalid_then_snapshot_fails_before_any_output() {
    let dir = Scratch::new("badthen");
    let good = dir.file("good.yaml", WEB);
    let out =
        Command::new(BIN).args(["render"]).arg(&good).args(["--then", "/nonexistent/then.yaml"]).output().expect("run");
    assert_eq!(out.status.code(), Some(2));
    assert!(out.stdout.is_empty());
}

#[test]
fn invalid_objects_are_skipped_with_a_warning() {
    let dir = Scratch::new("invalid");
    let bad = r#"
apiVersion: v1
kind: Service
metadata: {namespace: default, name: bad-ip}
spec:
  type: ClusterIP
  clusterIP: 300.1.2.3
  ports: [{name: http, port: 80, protocol: TCP}]
---
apiVersion: v1
kind: Service
metadata: {namespace: default, name: bad-port}
spec:
  type: ClusterIP
  clusterIP: 172.30.0.11
  ports: [{name: http, port: 70000, protocol: TCP}]
---
apiVersion: v1
kind: Service
metadata: {namespace: default, name: bad-proto}
spec:
  type: ClusterIP
  clusterIP: 172.30.0.12
  ports: [{name: http, port: 80, protocol: ICMP}]
---
apiVersion: v1
kind: Service
metadata: {namespace: default, name: bad-type}
spec:
  ports: "not a list"
---
apiVersion: v1
kind: ConfigMap
metadata: {namespace: default, name: unrelated}
"#;
    let f = dir.file("mixed.yaml", &format!("{WEB}---{bad}"));
    let out = render(&["--hostname-override", "n1"], &[&f]);
    assert!(out.status.success(), "stderr: {}", stderr(&out));
    let err = stderr(&out);
    for name in ["bad-ip", "bad-port", "bad-proto", "bad-type", "ConfigMap"] {
        assert!(err.contains(name), "warning should name {name}: {err}");
    }
    let text = stdout(&out);
    assert!(text.contains("\"default/web:http cluster IP\""), "the valid service still renders");
    for name in ["bad-ip", "bad-port", "bad-proto", "bad-type"] {
        assert!(!text.contains(name), "{name} must not render");
    }
}

#[test]
fn config_file_is_honoured() {
    let dir = Scratch::new("config");
    let cluster = dir.file("c.yaml", WEB);
    let config = dir.file(
        "config.yaml",
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nclusterCIDR: 10.0.0.0/8\niptables:\n  masqueradeBit: 0\n  masqueradeAll: true\n",
    );
    let out = render(&["--config", config.to_str().unwrap_or_default()], &[&cluster]);
    assert!(out.status.success(), "stderr: {}", stderr(&out));
    let text = stdout(&out);
    assert!(text.contains("--or-mark 0x00000001"), "{text}");
    // masqueradeAll wins over the detector: the cluster-IP rule masquerades everything.
    assert!(text.contains("--dport 80 -j KUBE-MARK-MASQ\n"), "{text}");
    assert!(!text.contains("! -s 10.0.0.0/8"), "{text}");
}

#[test]
fn invalid_config_exits_2_naming_the_field() {
    let dir = Scratch::new("badconfig");
    let cluster = dir.file("c.yaml", WEB);
    let config = dir.file(
        "config.yaml",
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\niptables:\n  masqueradeBit: 40\n",
    );
    let out = render(&["--config", config.to_str().unwrap_or_default()], &[&cluster]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("iptables.masqueradeBit"), "{}", stderr(&out));
    let config = dir.file(
        "unknown.yaml",
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nbogusField: 1\n",
    );
    // A field we do not know is skipped with a warning naming it, as upstream's lenient
    // decoding does; a value of the wrong type is still an error naming the field.
    let out = render(&["--config", config.to_str().unwrap_or_default()], &[&cluster]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(stderr(&out).contains("Using lenient decoding") && stderr(&out).contains("bogusField"), "{}", stderr(&out));
    let config = dir.file(
        "wrong-type.yaml",
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\niptables:\n  syncPeriod: [1]\n",
    );
    let out = render(&["--config", config.to_str().unwrap_or_default()], &[&cluster]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("iptables.syncPeriod"), "{}", stderr(&out));
}

#[test]
fn old_iptables_has_no_random_fully() {
    let out = render(&["--iptables-version", "1.6.1"], &[Path::new("examples/cluster.yaml")]);
    assert!(out.status.success());
    assert!(stdout(&out).contains("-j MASQUERADE\n"));
    let out = render(&["--iptables-version", "1.6.2"], &[Path::new("examples/cluster.yaml")]);
    assert!(stdout(&out).contains("-j MASQUERADE --random-fully\n"));
    let out = render(&["--iptables-version", "one.two"], &[Path::new("examples/cluster.yaml")]);
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn interface_addresses_resolve_node_port_addresses() {
    let dir = Scratch::new("npa");
    let cluster = dir.file("c.yaml", WEB);
    let config = dir.file(
        "config.yaml",
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nnodePortAddresses: [198.18.0.0/16]\n",
    );
    let out = render(
        &[
            "--config",
            config.to_str().unwrap_or_default(),
            "--interface-address",
            "198.18.1.1",
            "--interface-address",
            "203.0.113.9",
            "--interface-address",
            "198.18.2.2",
        ],
        &[&cluster],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    let tail: Vec<&str> = text.lines().filter(|l| l.contains("must be the last rule")).collect();
    assert_eq!(tail.len(), 2, "{text}");
    assert!(tail[0].contains("-d 198.18.1.1 -j KUBE-NODEPORTS"));
    assert!(tail[1].contains("-d 198.18.2.2 -j KUBE-NODEPORTS"));
    // nodePortAddresses without loopback turns localhost NodePorts (and KUBE-FIREWALL) off.
    assert!(!text.contains("KUBE-FIREWALL"));
}

#[test]
fn ipv6_family_renders_ipv6_objects_only() {
    let dir = Scratch::new("v6");
    let cluster = dir.file(
        "c.yaml",
        r#"
apiVersion: v1
kind: Service
metadata: {namespace: default, name: web}
spec:
  type: ClusterIP
  clusterIP: fd00:30::10
  clusterIPs: [fd00:30::10, 172.30.0.10]
  ipFamilies: [IPv6, IPv4]
  ports: [{name: http, port: 80, protocol: TCP}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {namespace: default, name: web-v6, labels: {kubernetes.io/service-name: web}}
addressType: IPv6
ports: [{name: http, port: 8080, protocol: TCP}]
endpoints:
- addresses: ["fd00:10::1"]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {namespace: default, name: web-v4, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
ports: [{name: http, port: 8080, protocol: TCP}]
endpoints:
- addresses: [10.1.0.1]
"#,
    );
    let v6 = stdout(&render(&["--ip-family", "ipv6"], &[&cluster]));
    assert!(v6.contains("-d fd00:30::10 --dport 80"), "{v6}");
    assert!(v6.contains("--to-destination [fd00:10::1]:8080"), "{v6}");
    assert!(v6.contains("! -d ::1/128 -j KUBE-NODEPORTS"), "{v6}");
    assert!(!v6.contains("10.1.0.1") && !v6.contains("KUBE-FIREWALL"), "{v6}");
    let v4 = stdout(&render(&["--ip-family", "ipv4"], &[&cluster]));
    assert!(v4.contains("-d 172.30.0.10 --dport 80") && v4.contains("--to-destination 10.1.0.1:8080"), "{v4}");
}

/// A LoadBalancer whose only ingress is `ipMode: Proxy`, with an endpoint.
const PROXY_LB: &str = r#"
apiVersion: v1
kind: Service
metadata: {namespace: default, name: lb}
spec:
  type: LoadBalancer
  clusterIP: 172.30.0.20
  allocateLoadBalancerNodePorts: false
  ports: [{name: http, port: 80, protocol: TCP}]
status:
  loadBalancer:
    ingress: [{ip: 203.0.113.9, ipMode: Proxy}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  namespace: default
  name: lb-1
  labels: {kubernetes.io/service-name: lb}
addressType: IPv4
ports: [{name: http, port: 8080, protocol: TCP}]
endpoints:
- addresses: [10.1.0.9]
  conditions: {ready: true}
"#;

#[test]
fn compatibility_version_selects_the_release_behaviour() {
    let dir = Scratch::new("compat");
    let cluster = dir.file("c.yaml", PROXY_LB);
    let lb_rule = "-d 203.0.113.9";
    // 1.29: LoadBalancerIPMode is off, the Proxy IP is short-circuited like a VIP.
    let out = render(&["--compatibility-version", "1.29"], &[&cluster]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).contains(lb_rule), "{}", stdout(&out));
    // The default is the newest release: the gate is GA there.
    let out = render(&[], &[&cluster]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(!stdout(&out).contains(lb_rule), "{}", stdout(&out));
    // 1.31 with the gate switched off by flag behaves as 1.29 again.
    let out =
        render(&["--compatibility-version", "v1.31.4", "--feature-gates", "LoadBalancerIPMode=false"], &[&cluster]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).contains(lb_rule), "{}", stdout(&out));
    // The same through the config file's extension field.
    let config = dir.file(
        "config.yaml",
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\ncompatibilityVersion: \"1.29\"\n",
    );
    let out = render(&["--config", config.to_str().unwrap_or_default()], &[&cluster]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).contains(lb_rule), "{}", stdout(&out));
}

#[test]
fn bad_compatibility_version_or_locked_gate_exits_2_naming_it() {
    let dir = Scratch::new("compat-bad");
    let cluster = dir.file("c.yaml", WEB);
    for (args, needle) in [
        (vec!["--compatibility-version", "1.28"], "supported releases are 1.29 to 1.37"),
        (vec!["--compatibility-version", "1.35", "--feature-gates", "LoadBalancerIPMode=true"], "does not exist"),
        (vec!["--compatibility-version", "2.0"], "compatibilityVersion"),
        (vec!["--compatibility-version", "1.33", "--feature-gates", "TopologyAwareHints=false"], "locked to true"),
        (
            vec!["--compatibility-version", "1.29", "--feature-gates", "PreferSameTrafficDistribution=true"],
            "does not exist",
        ),
    ] {
        let out = render(&args, &[&cluster]);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", stderr(&out));
        assert!(stderr(&out).contains(needle), "{args:?}: {}", stderr(&out));
        assert!(out.stdout.is_empty(), "{args:?}");
    }
    // `primary` nodePortAddresses arrived in 1.31.
    let config = dir.file(
        "config.yaml",
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nnodePortAddresses: [primary]\n",
    );
    let path = config.to_str().unwrap_or_default();
    let out = render(&["--config", path, "--compatibility-version", "1.30"], &[&cluster]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("nodePortAddresses[0]"), "{}", stderr(&out));
    let out = render(&["--config", path, "--compatibility-version", "1.31"], &[&cluster]);
    assert!(out.status.success(), "{}", stderr(&out));
}
