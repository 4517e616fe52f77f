//! Least privilege, as deploy/kube-proxy-rs.yaml runs the daemon: `--init-only` privileged
//! first (the init container), then the daemon as uid 0 with every capability dropped but the
//! ones the manifest adds (read from the manifest, so the two cannot drift), no privilege
//! escalation, and read-only `/`, `/proc/sys` and `/sys` except the xtables lock (its hostPath
//! mount). It must program Services that answer real traffic, follow a change (clearing a UDP
//! flow's conntrack entry), answer /healthz, stop cleanly, and `--cleanup` must work the same
//! way; on an iptables-legacy node too. With any one capability of the set removed, the daemon
//! and `--cleanup` exit non-zero with an error naming it, before touching a rule. Root only.
//!
//! nftables mode, as deploy/kube-proxy-rs-nftables.yaml runs it: NET_ADMIN is all `nft` and
//! conntrack need (found by experiment: without it nft's transactions fail with "Operation not
//! permitted"; NET_RAW changes nothing for nft). With exactly that set the daemon programs its
//! `kube-proxy` table, serves real traffic, clears a UDP flow's entry and removes iptables-nft
//! leftovers of iptables mode; without it, it exits at once naming CAP_NET_ADMIN and writes no
//! table.
//!
//! The restrictions are applied the way a container runtime does, inside the node namespace:
//! `ip netns exec` gives the command a mount namespace of its own, where `sh` bind-remounts
//! the paths read-only, then `setpriv` limits the bounding set (a root process's capabilities
//! after `execve`), clears the inheritable set and sets no_new_privs before exec'ing the daemon.

use kube_proxy_rs::tracker::testing::{SliceBuilder, ep, node, slice, svc};
use std::process::Command;
use std::time::{Duration, Instant};

use crate::require_root;
use crate::support::cluster_net::{CPOD, Cluster, NODE_A, POD_A1, POD_A2, Pod, SERVE_PORT, UdpFlow, sa};
use crate::support::e2e::{BIN, DaemonProcess, HEALTHZ_ADDR, NODE_IP, TempDir, daemon_args, topology};
use crate::support::netns::Netns;
use crate::support::poll::eventually;

const PROGRAMMED: Duration = Duration::from_secs(30);

/// The capabilities deploy/kube-proxy-rs.yaml adds to the daemon container, as `setpriv`
/// names them (`net_admin`); also checks it drops all the others.
fn manifest_capabilities() -> Vec<String> {
    capabilities_of("deploy/kube-proxy-rs.yaml")
}

/// [`manifest_capabilities`] of the manifest at `file` (relative to the repository).
fn capabilities_of(file: &str) -> Vec<String> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(file);
    let text = std::fs::read_to_string(&path).expect("read the manifest");
    for doc in serde_yaml::Deserializer::from_str(&text) {
        let value: serde_yaml::Value = serde::Deserialize::deserialize(doc).expect("manifest YAML");
        if value["kind"].as_str() != Some("DaemonSet") {
            continue;
        }
        let containers = value["spec"]["template"]["spec"]["containers"].as_sequence().expect("containers");
        let daemon = containers.iter().find(|c| c["name"].as_str() == Some("kube-proxy-rs")).expect("daemon container");
        let caps = &daemon["securityContext"]["capabilities"];
        assert_eq!(caps["drop"].as_sequence().map(Vec::len), Some(1), "drops ALL: {caps:?}");
        assert_eq!(caps["drop"][0].as_str(), Some("ALL"));
        let add: Vec<String> = caps["add"]
            .as_sequence()
            .expect("capabilities.add")
            .iter()
            .map(|c| c.as_str().expect("capability name").to_ascii_lowercase())
            .collect();
        assert!(!add.is_empty(), "the daemon needs at least NET_ADMIN");
        return add;
    }
    panic!("no DaemonSet in {}", path.display());
}

/// The kernel's mask for `caps` (setpriv names).
fn mask(caps: &[String]) -> u64 {
    caps.iter()
        .map(|c| {
            let cap = kube_proxy_rs::node::capabilities::Capability::from_name(c)
                .unwrap_or_else(|| panic!("the manifest adds {c}, which the daemon does not know it needs"));
            1u64 << cap.number()
        })
        .fold(0, |a, b| a | b)
}

/// `kube-proxy-rs args…` in `ns` as the DaemonSet's daemon container runs: only `caps`,
/// no_new_privs, read-only root filesystem, `/proc/sys` and `/sys`, a writable xtables lock.
fn restricted(ns: &Netns, caps: &[String], args: &[String]) -> Command {
    // The lock is a hostPath (FileOrCreate) in the pod; here a bind mount of the host's file.
    std::fs::OpenOptions::new().create(true).append(true).open("/run/xtables.lock").expect("xtables lock");
    let bounding: String =
        std::iter::once("-all".to_string()).chain(caps.iter().map(|c| format!("+{c}"))).collect::<Vec<_>>().join(",");
    let script = "set -e
        mount --bind /proc/sys /proc/sys && mount -o remount,bind,ro /proc/sys
        mount -o remount,bind,ro /sys
        mount --bind /run/xtables.lock /run/xtables.lock
        mount -o remount,bind,ro /
        exec setpriv --bounding-set=\"$0\" --inh-caps=-all --no-new-privs -- \"$@\"";
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", &ns.name, "sh", "-c", script, &bounding, BIN]).args(args);
    cmd
}

/// Waits until `pid` runs the daemon itself (the wrappers exec it in place), then checks it
/// really is restricted: effective capabilities exactly `caps`, no_new_privs, `/` and
/// `/proc/sys` read-only. Without this the test could pass with a wrapper that does nothing.
async fn assert_restricted(daemon: &DaemonProcess, caps: &[String]) {
    let pid = daemon.pid();
    let read = |file: &str| {
        std::fs::read_to_string(format!("/proc/{pid}/{file}"))
            .unwrap_or_else(|e| panic!("/proc/{pid}/{file}: {e} (has the daemon exited?)\n{}", daemon.log_text()))
    };
    eventually("the wrappers exec the daemon", Duration::from_secs(10), || {
        std::fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|c| c.trim() == "kube-proxy-rs")
    })
    .await;
    let status = read("status");
    let caps_now = kube_proxy_rs::node::capabilities::parse_status(&status).expect("status parses");
    assert_eq!(caps_now.effective, mask(caps), "effective capabilities\n{status}");
    assert_eq!(caps_now.effective_uid, 0);
    assert!(status.lines().any(|l| l.split_whitespace().eq(["NoNewPrivs:", "1"])), "{status}");
    let mountinfo = read("mountinfo");
    let options = |target: &str| {
        mountinfo
            .lines()
            .rfind(|l| l.split_whitespace().nth(4) == Some(target))
            .and_then(|l| l.split_whitespace().nth(5).map(str::to_string))
            .unwrap_or_else(|| panic!("{target} not mounted:\n{mountinfo}"))
    };
    for target in ["/", "/proc/sys", "/sys"] {
        assert!(options(target).split(',').any(|o| o == "ro"), "{target} must be read-only:\n{mountinfo}");
    }
    assert!(options("/run/xtables.lock").split(',').any(|o| o == "rw"), "{mountinfo}");
}

/// A slice for `svc` with "http" (TCP) and "dns" (UDP) on the pod servers.
fn pods_slice(svc: &str, pods: &[&Pod]) -> SliceBuilder {
    let mut b =
        slice("ns1", svc, &format!("{svc}-1")).tcp("http", i32::from(SERVE_PORT)).udp("dns", i32::from(SERVE_PORT));
    for p in pods {
        b = b.endpoint(ep(&p.ip).node(p.node));
    }
    b
}

/// Errors a missing privilege would cause somewhere in the daemon's log, except the one
/// expected warning (oom_score_adj -999 needs CAP_SYS_RESOURCE, which is not granted).
fn assert_no_permission_errors(log: &str) {
    for line in log.lines().filter(|l| !l.contains("cannot set oom_score_adj")) {
        for refusal in ["ermission denied", "not permitted", "you must be root", "Read-only file system"] {
            assert!(!line.contains(refusal), "{refusal:?} in the daemon's log: {line}\n{log}");
        }
    }
}

fn healthz(ns: &Netns) -> String {
    let (ip, port) = HEALTHZ_ADDR.split_once(':').expect("addr");
    ns.ok(&[
        "bash",
        "-c",
        &format!("exec 3<>/dev/tcp/{ip}/{port}; printf 'GET /healthz HTTP/1.0\\r\\n\\r\\n' >&3; cat <&3"),
    ])
}

/// (a) The privilege split end to end on the nft backend, with real traffic.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn daemon_works_with_exactly_the_manifest_capabilities() {
    require_root!();
    let caps = manifest_capabilities();
    let mut c = Cluster::network("e2epriv").await;
    let args = c.daemon_args();

    // The init container: privileged, sets route_localnet (localhost NodePorts) and exits.
    assert_eq!(c.node_a.ok(&["cat", "/proc/sys/net/ipv4/conf/all/route_localnet"]).trim(), "0");
    let mut init = vec![BIN, "--init-only"];
    init.extend(args.iter().map(String::as_str));
    let out = c.node_a.run(&init);
    assert!(out.success(), "--init-only failed: {}", out.combined());
    assert_eq!(c.node_a.ok(&["cat", "/proc/sys/net/ipv4/conf/all/route_localnet"]).trim(), "1");

    // The daemon container.
    let log = c.dir.path().join("daemon.log");
    c.daemon = Some(DaemonProcess::spawn(restricted(&c.node_a, &caps, &args), log));
    assert_restricted(c.daemon(), &caps).await;

    let t = Instant::now();
    let (a1, a2) = (c.pod(POD_A1), c.pod(POD_A2));
    c.server.create(&svc("ns1", "dns").cluster_ip("198.19.0.80").tcp("http", 80).udp("dns", 53).build());
    c.server.create(&pods_slice("dns", &[a1]).build());
    let flow = UdpFlow::open(&c.pod(CPOD).ns, sa("198.19.0.80", 53));
    eventually("a UDP flow answered by pod-a1", PROGRAMMED, || flow.request().is_ok_and(|r| r.pod == a1.name)).await;
    eventually("TCP from outside the cluster answered", PROGRAMMED, || {
        crate::support::cluster_net::tcp_request(&c.client, sa("198.19.0.80", 80), None).is_ok_and(|r| r.pod == a1.name)
    })
    .await;
    eprintln!("programmed in {:?}", t.elapsed());

    // A change: the only endpoint is replaced. The same UDP socket reaches the new pod only if
    // the daemon deleted the flow's conntrack entry (pod-a1 still answers).
    c.server.update(&pods_slice("dns", &[a2]).build());
    eventually("the UDP flow moves to pod-a2 (conntrack entry deleted)", PROGRAMMED, || {
        std::thread::sleep(Duration::from_millis(100));
        flow.request().is_ok_and(|r| r.pod == a2.name)
    })
    .await;

    let answer = healthz(&c.node_a);
    assert!(answer.contains(" 200 ") && answer.contains("\"healthy\":true"), "{answer}\n{}", c.log());
    // oom_score_adj -999 needs CAP_SYS_RESOURCE: a warning, not a failure.
    assert!(c.log().contains("cannot set oom_score_adj"), "{}", c.log());
    assert_no_permission_errors(&c.log());

    // SIGTERM: exit 0, the canaries removed (an iptables write under the same privileges).
    c.daemon().signal("TERM");
    let mut daemon = c.daemon.take().expect("daemon");
    let status = daemon.wait_exit(Duration::from_secs(20)).await;
    assert!(status.success(), "exit status {status}\n{}", daemon.log_text());
    assert!(!c.nat().contains("KUBE-PROXY-CANARY"), "canaries removed on shutdown");

    // The cleanup Job runs with the same capabilities.
    let out = restricted(&c.node_a, &caps, &["--cleanup".to_string()]).output().expect("run --cleanup");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "--cleanup failed: {stderr}");
    assert_no_permission_errors(&stderr);
    assert!(!c.nat().contains("KUBE-SERVICES"), "--cleanup removed the rules:\n{}", c.nat());
}

/// (a) on an iptables-legacy node (a kubelet canary chain in the legacy mangle table decides
/// the backend): NET_RAW is what lets the daemon see that chain and program legacy tables.
/// Also: without the init container the daemon cannot set route_localnet and exits saying
/// where kernel settings are made, and `--init-only` run unprivileged fails the same way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn legacy_backend_works_with_exactly_the_manifest_capabilities() {
    require_root!();
    let caps = manifest_capabilities();
    let (_api_ns, node_ns, server) = topology("e2eprivleg").await;
    node_ns.ok(&["iptables-legacy", "-t", "mangle", "-N", "KUBE-KUBELET-CANARY"]);
    server.create(&node("node-e2e", &[], &[], &[NODE_IP]));
    server.create(&svc("ns1", "web").cluster_ip("172.30.0.1").tcp("http", 80).build());
    server.create(&slice("ns1", "web", "web-1").tcp("http", 8080).ips(&["10.1.0.1"]).build());
    let dir = TempDir::new("e2eprivleg");
    let mut args = daemon_args(&dir.kubeconfig(&server), "node-e2e");
    args.extend(["--iptables-sync-period=2s", "--iptables-min-sync-period=100ms"].map(String::from));

    let mut no_init = DaemonProcess::spawn(restricted(&node_ns, &caps, &args), dir.path().join("no-init.log"));
    let status = no_init.wait_exit(Duration::from_secs(20)).await;
    let text = no_init.log_text();
    assert!(!status.success(), "route_localnet cannot be set without the init container\n{text}");
    assert!(
        text.contains("failed to set sysctl net/ipv4/conf/all/route_localnet to 1: Read-only file system")
            && text.contains("privileged init container"),
        "{text}"
    );

    // --init-only itself unprivileged: it exits 1, saying why.
    let mut init_args = vec!["--init-only".to_string()];
    init_args.extend(args.iter().cloned());
    let out = restricted(&node_ns, &caps, &init_args).output().expect("run --init-only");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "--init-only cannot work unprivileged: {stderr}");
    assert!(
        stderr.contains("--init-only: failed to apply conntrack settings: failed to set sysctl net/netfilter/")
            && stderr.contains("not permitted in this container"),
        "{stderr}"
    );

    let mut init = vec![BIN, "--init-only"];
    init.extend(args.iter().map(String::as_str));
    let out = node_ns.run(&init);
    assert!(out.success(), "--init-only failed: {}", out.combined());
    let mut daemon = DaemonProcess::spawn(restricted(&node_ns, &caps, &args), dir.path().join("daemon.log"));
    assert_restricted(&daemon, &caps).await;

    let legacy_nat = || node_ns.ok(&["iptables-legacy-save", "-t", "nat"]);
    eventually("rules in the legacy tables", PROGRAMMED, || legacy_nat().contains("--to-destination 10.1.0.1:8080"))
        .await;
    server.update(&slice("ns1", "web", "web-1").tcp("http", 8080).ips(&["10.1.0.2"]).build());
    eventually("a change followed", PROGRAMMED, || {
        let n = legacy_nat();
        n.contains("--to-destination 10.1.0.2:8080") && !n.contains("10.1.0.1:8080")
    })
    .await;
    let log = daemon.log_text();
    assert!(log.contains("backend=legacy"), "{log}");
    assert_no_permission_errors(&log);
    daemon.signal("TERM");
    let status = daemon.wait_exit(Duration::from_secs(20)).await;
    assert!(status.success(), "exit status {status}\n{}", daemon.log_text());
}

/// (b) One capability fewer than the manifest's: the daemon and `--cleanup` exit non-zero at
/// once, naming that capability (and only it), and program nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_capability_fewer_is_a_clear_error_naming_it() {
    require_root!();
    let caps = manifest_capabilities();
    let (_api_ns, node_ns, server) = topology("e2eprivmiss").await;
    server.create(&node(NODE_A, &[], &[], &[NODE_IP]));
    server.create(&svc("ns1", "web").cluster_ip("172.30.0.1").tcp("http", 80).build());
    let dir = TempDir::new("e2eprivmiss");
    let args = daemon_args(&dir.kubeconfig(&server), NODE_A);
    for missing in &caps {
        let fewer: Vec<String> = caps.iter().filter(|c| *c != missing).cloned().collect();
        let named = format!("missing capability CAP_{}", missing.to_ascii_uppercase());
        let log = dir.path().join(format!("daemon-without-{missing}.log"));
        let mut daemon = DaemonProcess::spawn(restricted(&node_ns, &fewer, &args), log);
        let status = daemon.wait_exit(Duration::from_secs(20)).await;
        let text = daemon.log_text();
        assert!(!status.success(), "without {missing} the daemon must fail\n{text}");
        assert!(text.contains(&named) && text.contains("securityContext.capabilities.add"), "{text}");
        for other in &fewer {
            assert!(!text.contains(&format!("CAP_{}", other.to_ascii_uppercase())), "only {missing} is named: {text}");
        }
        let nat = node_ns.ok(&["iptables-nft-save", "-t", "nat"]);
        assert!(!nat.contains("KUBE-"), "nothing programmed without {missing}:\n{nat}");

        let out = restricted(&node_ns, &fewer, &["--cleanup".to_string()]).output().expect("run --cleanup");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && stderr.contains(&named), "--cleanup without {missing}: {stderr}");
    }
}

/// nftables mode with exactly deploy/kube-proxy-rs-nftables.yaml's capabilities (NET_ADMIN):
/// the `kube-proxy` table programmed, real traffic served, a UDP flow's conntrack entry
/// cleared on a change, iptables-nft leftovers of iptables mode removed, /healthz, a clean
/// stop. With that capability removed the daemon exits at once naming it and writes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nftables_mode_works_with_exactly_its_manifest_capabilities() {
    require_root!();
    let caps = capabilities_of("deploy/kube-proxy-rs-nftables.yaml");
    assert_eq!(caps, ["net_admin"], "nftables mode's set (see the module documentation)");
    let mut c = Cluster::network("e2eprivnft").await;
    let mut args = c.daemon_args();
    args.push("--proxy-mode=nftables".into());
    // A leftover of iptables mode (iptables-nft), for the daemon to remove under NET_ADMIN alone.
    c.node_a.ok(&["iptables-nft", "-t", "nat", "-N", "KUBE-SERVICES"]);

    // Without NET_ADMIN (no capability at all): an error naming it, nothing written.
    let mut daemon = DaemonProcess::spawn(restricted(&c.node_a, &[], &args), c.dir.path().join("no-caps.log"));
    let status = daemon.wait_exit(Duration::from_secs(20)).await;
    let text = daemon.log_text();
    assert!(!status.success(), "without NET_ADMIN the daemon must fail\n{text}");
    assert!(
        text.contains("missing capability CAP_NET_ADMIN: needed to program nftables rules")
            && text.contains("securityContext.capabilities.add: [NET_ADMIN]"),
        "{text}"
    );
    assert!(!text.contains("CAP_NET_RAW"), "nftables mode does not require NET_RAW: {text}");
    assert!(c.nft_table("ip").is_empty() && c.nft_table("ip6").is_empty(), "nothing programmed without NET_ADMIN");
    assert!(c.nat().contains(":KUBE-SERVICES"), "nothing removed either");

    let mut init = vec![BIN, "--init-only"];
    init.extend(args.iter().map(String::as_str));
    let out = c.node_a.run(&init);
    assert!(out.success(), "--init-only failed: {}", out.combined());
    let log = c.dir.path().join("daemon.log");
    c.daemon = Some(DaemonProcess::spawn(restricted(&c.node_a, &caps, &args), log));
    assert_restricted(c.daemon(), &caps).await;

    let t = Instant::now();
    let (a1, a2) = (c.pod(POD_A1), c.pod(POD_A2));
    c.server.create(&svc("ns1", "dns").cluster_ip("198.19.0.80").tcp("http", 80).udp("dns", 53).build());
    c.server.create(&pods_slice("dns", &[a1]).build());
    let flow = UdpFlow::open(&c.pod(CPOD).ns, sa("198.19.0.80", 53));
    eventually("a UDP flow answered by pod-a1", PROGRAMMED, || flow.request().is_ok_and(|r| r.pod == a1.name)).await;
    eventually("TCP from outside the cluster answered", PROGRAMMED, || {
        crate::support::cluster_net::tcp_request(&c.client, sa("198.19.0.80", 80), None).is_ok_and(|r| r.pod == a1.name)
    })
    .await;
    eprintln!("programmed in {:?}", t.elapsed());
    let table = c.nft_table("ip");
    assert!(table.contains("198.19.0.80") && table.contains("ns1/dns/udp/dns"), "{table}");
    eventually("iptables mode's leftover removed", PROGRAMMED, || !c.nat().contains("KUBE-SERVICES")).await;

    // A change: the same UDP socket reaches pod-a2 only if the flow's entry was deleted.
    c.server.update(&pods_slice("dns", &[a2]).build());
    eventually("the UDP flow moves to pod-a2 (conntrack entry deleted)", PROGRAMMED, || {
        std::thread::sleep(Duration::from_millis(100));
        flow.request().is_ok_and(|r| r.pod == a2.name)
    })
    .await;

    let answer = healthz(&c.node_a);
    assert!(answer.contains(" 200 ") && answer.contains("\"healthy\":true"), "{answer}\n{}", c.log());
    let log = c.log();
    assert!(log.contains("mode=nftables") || log.contains("nftables"), "{log}");
    // Said once, not an error: without NET_RAW iptables-legacy is not read.
    assert!(log.contains("missing capability CAP_NET_RAW") && log.contains("--cleanup"), "{log}");
    assert!(!log.contains(" ERROR "), "{log}");
    assert_no_permission_errors(&log);

    c.daemon().signal("TERM");
    let mut daemon = c.daemon.take().expect("daemon");
    let status = daemon.wait_exit(Duration::from_secs(20)).await;
    assert!(status.success(), "exit status {status}\n{}", daemon.log_text());
    assert!(c.nft_table("ip").contains("198.19.0.80"), "the rules stay on shutdown");
}
