//! The soak (issue 14): the real `kube-proxy-rs` binary in a "node" namespace against the test
//! API server in an "api" namespace, under continuous random churn from a seeded RNG
//! (Services of several kinds created, changed and deleted; EndpointSlices created, scaled,
//! split and deleted; the node's zone label changing) with faults injected on a schedule
//! (watch connections cut, resource versions expired so the re-watch gets 410 Gone, the API
//! server down for a few seconds, the next few `iptables-restore`s failing, our chains
//! flushed or the canary deleted behind the daemon's back). Root only.
//!
//! At every checkpoint the churn pauses and, once the daemon has caught up:
//! * the kernel equals a render of the API state exactly: `kube-proxy-rs render` of the
//!   objects the server holds, per family, restored into a fresh namespace and saved again
//!   (so both sides carry the kernel's normalisation), compared with the node's filter and
//!   nat tables (chains sorted, counters zeroed, canaries left out; rule order counts);
//! * the daemon's resources are sampled: VmRSS, open file descriptors (listening sockets
//!   apart: they must be exactly healthz, metrics and one health-check port per live
//!   `externalTrafficPolicy: Local` LoadBalancer), threads, child processes and zombies.
//!
//! At the end: every checkpoint matched, descriptors, threads and children stayed flat, RSS
//! growth is bounded and no zombie was ever seen. `soak_short` runs in the suite;
//! `soak_30_minutes` (ignored; `scripts/soak.sh`) runs `KPR_SOAK_SECONDS` (default 1800) and
//! its figures are in docs/performance.md.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube_proxy_rs::iptables::runner::Backend;
use kube_proxy_rs::model::IpFamily;
use kube_proxy_rs::tracker::testing::{ep, node, slice, svc};
use serde_json::json;

use crate::require_root;
use crate::support::apiserver::{ApiServer, Kind};
use crate::support::e2e::{
    BIN, DaemonProcess, NODE_IP, TempDir, bind_in_netns, create_nfacct_objects, daemon_args, interface_addresses,
    topology,
};
use crate::support::netns::Netns;
use crate::support::rng::Rng;
use crate::support::{canonical_rules, line_diff};

const HOST: &str = "node-soak";
const OTHER_NODE: &str = "node-other";
const SYNC_PERIOD: Duration = Duration::from_secs(2);
/// How long the daemon gets to catch up at a checkpoint (watch backoff after an outage
/// included).
const CONVERGE: Duration = Duration::from_secs(60);
/// Service slots: slot `i` owns its cluster IP, node port and health-check port, so live
/// services never collide.
const SLOTS: usize = 40;
const ZONES: [&str; 2] = ["zone-a", "zone-b"];
const ZONE_LABEL: &str = "topology.kubernetes.io/zone";
/// Chains that are not the proxier's rules: the sync loop's canary and kubelet's.
const IGNORED_CHAINS: [&str; 2] = ["KUBE-PROXY-CANARY", "KUBE-KUBELET-CANARY"];
const FAMILIES: [IpFamily; 2] = [IpFamily::V4, IpFamily::V6];
const HEALTHZ_PORT: u16 = 10256;
const METRICS_PORT: u16 = 10249;

/// What one soak run does.
#[derive(Debug, Clone, Copy)]
struct SoakPlan {
    /// Churn time (checkpoints come on top).
    duration: Duration,
    seed: u64,
    checkpoint_every: Duration,
    fault_every: Duration,
}

/// The kinds of Service the churn creates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Variant {
    ClusterTcp,
    ClusterUdp,
    NodePort,
    /// LoadBalancer with `externalTrafficPolicy: Local` and a health-check node port.
    LbLocal,
    /// `topology-mode: Auto`, endpoints with zone hints.
    Topology,
    Ipv6,
}

const VARIANTS: [Variant; 6] =
    [Variant::ClusterTcp, Variant::ClusterUdp, Variant::NodePort, Variant::LbLocal, Variant::Topology, Variant::Ipv6];

/// One live service slot as the churn left it.
#[derive(Debug, Clone)]
struct SlotState {
    variant: Variant,
    /// The service exists (slices may outlive it for a while).
    service: bool,
    port: i32,
    affinity: bool,
    source_ranges: bool,
    /// Which of the slot's two slices exist.
    slices: [bool; 2],
}

fn slot_ns(slot: usize) -> String {
    format!("soak{}", slot % 3)
}

fn slot_name(slot: usize) -> String {
    format!("s{slot}")
}

fn slice_name(slot: usize, k: usize) -> String {
    format!("s{slot}-{}", k + 1)
}

fn health_check_port(slot: usize) -> u16 {
    32000 + slot as u16
}

fn build_service(slot: usize, s: &SlotState) -> Service {
    let (ns, name) = (slot_ns(slot), slot_name(slot));
    let v4 = format!("198.19.100.{}", slot + 1);
    let node_port = 30000 + slot as i32;
    let mut b = match s.variant {
        Variant::ClusterTcp => svc(&ns, &name).cluster_ip(&v4).tcp("http", s.port),
        Variant::ClusterUdp => svc(&ns, &name).cluster_ip(&v4).udp("dns", s.port),
        Variant::NodePort => svc(&ns, &name).type_("NodePort").cluster_ip(&v4).node_port("http", s.port, node_port),
        Variant::LbLocal => {
            let mut b = svc(&ns, &name)
                .type_("LoadBalancer")
                .cluster_ip(&v4)
                .node_port("http", s.port, node_port)
                .lb_ingress(&[&format!("203.0.113.{}", slot + 1)])
                .external_policy("Local")
                .health_check_node_port(health_check_port(slot) as i32);
            if s.source_ranges {
                b = b.source_ranges(&["198.18.64.0/20", "203.0.113.128/25"]);
            }
            b
        }
        Variant::Topology => svc(&ns, &name)
            .cluster_ip(&v4)
            .tcp("http", s.port)
            .annotation("service.kubernetes.io/topology-mode", "Auto"),
        Variant::Ipv6 => svc(&ns, &name).cluster_ip(&format!("fd00:5019::{:x}", slot + 1)).tcp("http", s.port),
    };
    if s.affinity {
        b = b.affinity(Some(300));
    }
    b.build()
}

/// Slice `k` of `slot` with a random set of endpoints (none to five).
fn build_slice(rng: &mut Rng, slot: usize, k: usize, variant: Variant) -> EndpointSlice {
    let (ns, name) = (slot_ns(slot), slot_name(slot));
    let mut b = slice(&ns, &name, &slice_name(slot, k));
    b = match variant {
        Variant::ClusterUdp => b.udp("dns", 5353),
        _ => b.tcp("http", 8080),
    };
    if variant == Variant::Ipv6 {
        b = b.ipv6();
    }
    let count = rng.below(6);
    // Slice k's addresses come from its own half of the slot's range: no duplicates.
    let hosts: BTreeSet<usize> = (0..count).map(|_| k * 120 + 1 + rng.below(120)).collect();
    for h in hosts {
        let ip = match variant {
            Variant::Ipv6 => format!("fd00:19:{slot:x}::{h:x}"),
            _ => format!("198.19.{}.{h}", slot + 1),
        };
        let node = if rng.chance(50) { HOST } else { OTHER_NODE };
        let zone = *rng.pick(&ZONES);
        let mut e = ep(&ip).node(node).zone(zone);
        if variant == Variant::Topology && rng.chance(85) {
            e = e.hints(&[*rng.pick(&ZONES)]);
        }
        match rng.below(20) {
            0 | 1 => e = e.terminating(),
            2 => e = e.not_ready(),
            _ => {}
        }
        b = b.endpoint(e);
    }
    b.build()
}

/// Stores `obj` whether or not it exists yet.
fn put<K: k8s_openapi::Resource + serde::Serialize>(server: &ApiServer, obj: &K) {
    let mut v = serde_json::to_value(obj).expect("serializable object");
    v["kind"] = json!(K::KIND);
    server.apply_raw(v);
}

/// The random churn: a model of what it created, and counts of what it did.
struct Churn {
    rng: Rng,
    slots: Vec<Option<SlotState>>,
    zone: Option<&'static str>,
    ops: BTreeMap<&'static str, usize>,
}

impl Churn {
    fn new(seed: u64) -> Churn {
        Churn { rng: Rng::new(seed), slots: vec![None; SLOTS], zone: None, ops: BTreeMap::new() }
    }

    fn node(&self) -> k8s_openapi::api::core::v1::Node {
        let labels: Vec<(&str, &str)> = self.zone.map(|z| (ZONE_LABEL, z)).into_iter().collect();
        node(HOST, &labels, &[], &[NODE_IP])
    }

    fn live_services(&self) -> Vec<usize> {
        (0..SLOTS).filter(|&i| self.slots[i].as_ref().is_some_and(|s| s.service)).collect()
    }

    /// The health-check ports the daemon must be listening on.
    fn health_check_ports(&self) -> BTreeSet<u16> {
        self.live_services()
            .into_iter()
            .filter(|&i| self.slots[i].as_ref().is_some_and(|s| s.variant == Variant::LbLocal))
            .map(health_check_port)
            .collect()
    }

    fn count(&mut self, what: &'static str) {
        *self.ops.entry(what).or_insert(0) += 1;
    }

    fn create_service(&mut self, server: &ApiServer, slot: usize) {
        let variant = *self.rng.pick(&VARIANTS);
        let mut old_slices = self.slots[slot].as_ref().map(|s| s.slices).unwrap_or([false; 2]);
        // A slice's addressType is immutable (the API server rejects changing it): slices
        // orphaned by an earlier deletion are deleted and recreated when the family changes,
        // as the EndpointSlice controller does.
        let was_ipv6 = self.slots[slot].as_ref().is_some_and(|s| s.variant == Variant::Ipv6);
        if was_ipv6 != (variant == Variant::Ipv6) {
            for (k, present) in old_slices.iter_mut().enumerate() {
                if *present {
                    server.delete_named(Kind::EndpointSlice, &slot_ns(slot), &slice_name(slot, k));
                    *present = false;
                }
            }
        }
        let state = SlotState {
            variant,
            service: true,
            port: 80 + self.rng.below(4) as i32,
            affinity: self.rng.chance(20),
            source_ranges: self.rng.chance(50),
            slices: [true, old_slices[1]],
        };
        put(server, &build_service(slot, &state));
        // Orphaned slices left by an earlier deletion are rewritten for the new variant.
        for k in 0..2 {
            if state.slices[k] {
                put(server, &build_slice(&mut self.rng, slot, k, variant));
            }
        }
        self.slots[slot] = Some(state);
        self.count("service created");
    }

    fn delete_service(&mut self, server: &ApiServer, slot: usize) {
        let keep_slices = self.rng.chance(20);
        let state = self.slots[slot].as_mut().expect("live slot");
        server.delete_named(Kind::Service, &slot_ns(slot), &slot_name(slot));
        state.service = false;
        if !keep_slices {
            for k in 0..2 {
                if state.slices[k] {
                    server.delete_named(Kind::EndpointSlice, &slot_ns(slot), &slice_name(slot, k));
                    state.slices[k] = false;
                }
            }
        }
        if !state.slices.iter().any(|&s| s) {
            self.slots[slot] = None;
        }
        self.count("service deleted");
    }

    fn change_service(&mut self, server: &ApiServer, slot: usize) {
        let mut state = self.slots[slot].clone().expect("live slot");
        match self.rng.below(3) {
            0 => state.port = 80 + self.rng.below(4) as i32,
            1 => state.affinity = !state.affinity,
            _ => state.source_ranges = !state.source_ranges,
        }
        put(server, &build_service(slot, &state));
        self.slots[slot] = Some(state);
        self.count("service changed");
    }

    fn scale(&mut self, server: &ApiServer, slot: usize) {
        let variant = self.slots[slot].as_ref().expect("live slot").variant;
        put(server, &build_slice(&mut self.rng, slot, 0, variant));
        self.slots[slot].as_mut().expect("live slot").slices[0] = true;
        self.count("slice scaled");
    }

    fn split_or_merge(&mut self, server: &ApiServer, slot: usize) {
        let state = self.slots[slot].clone().expect("live slot");
        if state.slices[1] {
            server.delete_named(Kind::EndpointSlice, &slot_ns(slot), &slice_name(slot, 1));
            self.count("second slice deleted");
        } else {
            put(server, &build_slice(&mut self.rng, slot, 1, state.variant));
            self.count("second slice created");
        }
        self.slots[slot].as_mut().expect("live slot").slices[1] = !state.slices[1];
    }

    fn relabel_node(&mut self, server: &ApiServer) {
        self.zone = match self.rng.below(3) {
            0 => None,
            i => Some(ZONES[i - 1]),
        };
        put(server, &self.node());
        self.count("node relabelled");
    }

    /// One random change.
    fn step(&mut self, server: &ApiServer) {
        let live = self.live_services();
        let free: Vec<usize> = (0..SLOTS).filter(|&i| self.slots[i].as_ref().is_none_or(|s| !s.service)).collect();
        let roll = self.rng.below(100);
        // Below a third of the slots, creations win; the population hovers around half.
        let create_weight = if live.len() < SLOTS / 3 { 45 } else { 20 };
        if live.is_empty() || (roll < create_weight && !free.is_empty()) {
            let slot = *self.rng.pick(&free);
            self.create_service(server, slot);
            return;
        }
        let slot = *self.rng.pick(&live);
        match roll {
            r if r < create_weight + 15 && live.len() > SLOTS / 4 => self.delete_service(server, slot),
            r if r < create_weight + 30 => self.change_service(server, slot),
            r if r < create_weight + 40 => self.split_or_merge(server, slot),
            r if r < create_weight + 45 => self.relabel_node(server),
            _ => self.scale(server, slot),
        }
    }
}

/// The faults, injected in turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Fault {
    WatchCut,
    Gone410,
    ApiDown,
    RestoreFailures,
    ChainFlush,
}

const FAULTS: [Fault; 5] = [Fault::WatchCut, Fault::Gone410, Fault::ApiDown, Fault::RestoreFailures, Fault::ChainFlush];

/// `iptables-restore` wrappers, first on PATH: while `counter` holds a positive number they
/// decrement it, read their input and fail as the real binary does when the kernel refuses a
/// transaction; otherwise they run the real binary. Every name the runner may run.
fn failing_restore_wrappers(bin: &Path, counter: &Path) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(bin).expect("wrapper dir");
    for family in ["iptables", "ip6tables"] {
        for infix in ["", "-nft", "-legacy"] {
            let name = format!("{family}{infix}-restore");
            let script = format!(
                "#!/bin/sh\nn=$(cat '{counter}' 2>/dev/null)\nif [ \"${{n:-0}}\" -gt 0 ]; then\n  echo $((n - 1)) > '{counter}'\n  cat >/dev/null\n  echo \"{name} v1.8.9: injected failure: Resource temporarily unavailable\" >&2\n  exit 1\nfi\nexec /usr/sbin/{name} \"$@\"\n",
                counter = counter.display()
            );
            let path = bin.join(&name);
            std::fs::write(&path, script).expect("write wrapper");
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("chmod wrapper");
        }
    }
}

/// What a checkpoint saw.
#[derive(Debug, Clone)]
struct Checkpoint {
    at: Duration,
    services: usize,
    slices: usize,
    /// Time from the churn pausing to the kernel matching (or giving up).
    converge: Duration,
    mismatch: Option<String>,
    rss_kb: u64,
    /// Open descriptors other than listening sockets.
    fds: usize,
    listen_ports: BTreeSet<u16>,
    expected_ports: BTreeSet<u16>,
    threads: usize,
    /// Children and zombies: the fewest seen over a second of samples (a child that an
    /// ordinary sync runs comes and goes; a leaked one stays).
    children: usize,
    zombies: usize,
}

/// The daemon's resources at one instant.
#[derive(Debug, Clone, Default)]
struct Sample {
    rss_kb: u64,
    fds: usize,
    listen_ports: BTreeSet<u16>,
    threads: usize,
    children: usize,
    zombies: usize,
}

/// Local ports of the listening TCP sockets in `/proc/PID/net/tcp*` (the daemon's
/// namespace), by socket inode.
fn listening_sockets(pid: u32) -> BTreeMap<u64, u16> {
    let mut out = BTreeMap::new();
    for file in ["tcp", "tcp6"] {
        let text = std::fs::read_to_string(format!("/proc/{pid}/net/{file}")).unwrap_or_default();
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            // sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode
            if f.len() > 9 && f[3] == "0A" {
                let port = f[1].rsplit(':').next().and_then(|p| u16::from_str_radix(p, 16).ok());
                if let (Some(port), Ok(inode)) = (port, f[9].parse()) {
                    out.insert(inode, port);
                }
            }
        }
    }
    out
}

fn sample(pid: u32) -> Sample {
    let listening = listening_sockets(pid);
    let mut s = Sample::default();
    for entry in std::fs::read_dir(format!("/proc/{pid}/fd")).into_iter().flatten().flatten() {
        let target = std::fs::read_link(entry.path()).map(|t| t.to_string_lossy().into_owned()).unwrap_or_default();
        let inode = target.strip_prefix("socket:[").and_then(|t| t.strip_suffix(']')).and_then(|i| i.parse().ok());
        match inode.and_then(|i: u64| listening.get(&i)) {
            Some(port) => {
                s.listen_ports.insert(*port);
            }
            None => s.fds += 1,
        }
    }
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    s.rss_kb = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0);
    s.threads = std::fs::read_dir(format!("/proc/{pid}/task")).map(|d| d.count()).unwrap_or(0);
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else { continue };
        // pid (comm) state ppid …; comm may hold spaces and parentheses.
        let Some((_, rest)) = stat.rsplit_once(')') else { continue };
        let mut f = rest.split_whitespace();
        let (state, ppid) = (f.next(), f.next().and_then(|p| p.parse::<u32>().ok()));
        if ppid == Some(pid) {
            s.children += 1;
            s.zombies += usize::from(state == Some("Z"));
        }
    }
    s
}

/// The median of `values` (the lower middle for an even count).
fn median<T: Copy + Ord>(values: &[T]) -> T {
    let mut v = values.to_vec();
    v.sort();
    v[(v.len() - 1) / 2]
}

/// The node running the daemon, the API server and the churn. Fields drop in order: the
/// daemon first, then its files, the server and the namespaces.
struct Soak {
    daemon: DaemonProcess,
    dir: TempDir,
    server: ApiServer,
    node_ns: Netns,
    api_ns: Netns,
    churn: Churn,
    restore_counter: PathBuf,
    interface_addresses: Vec<std::net::IpAddr>,
    /// The jumps from the built-in chains, fixed at the first match.
    jumps: Option<BTreeMap<IpFamily, Vec<String>>>,
    started: Instant,
}

impl Soak {
    /// Namespaces, a seeded cluster of `initial` services, and the daemon started on it.
    async fn start(tag: &str, seed: u64, initial: usize) -> Soak {
        let (api_ns, node_ns, server) = topology(tag).await;
        let mut churn = Churn::new(seed);
        put(&server, &churn.node());
        for slot in 0..initial {
            churn.create_service(&server, slot);
        }
        let dir = TempDir::new(tag);
        let bin = dir.path().join("bin");
        let restore_counter = dir.path().join("failing-restores");
        failing_restore_wrappers(&bin, &restore_counter);
        let path = format!("{}:/usr/sbin:/usr/bin:/sbin:/bin", bin.display());
        let mut args = daemon_args(&dir.kubeconfig(&server), HOST);
        args.extend([
            format!("--iptables-sync-period={}s", SYNC_PERIOD.as_secs()),
            "--iptables-min-sync-period=200ms".into(),
            "-v=2".into(),
        ]);
        let daemon = DaemonProcess::start(&node_ns, &args, dir.path().join("daemon.log"), &[("PATH", &path)]);
        let interface_addresses = interface_addresses(&node_ns);
        Soak {
            daemon,
            dir,
            server,
            node_ns,
            api_ns,
            churn,
            restore_counter,
            interface_addresses,
            jumps: None,
            started: Instant::now(),
        }
    }

    /// The daemon is still running.
    #[track_caller]
    fn assert_alive(&mut self) {
        let status = self.daemon.child.as_mut().expect("daemon running").try_wait().expect("wait");
        assert!(status.is_none(), "the daemon exited ({status:?}):\n{}", tail(&self.daemon.log_text(), 200));
    }

    /// What `render` prints for the server's current objects, per family, pushed through a
    /// fresh kernel and canonical.
    fn expected(&self) -> BTreeMap<IpFamily, String> {
        let mut items = Vec::new();
        for kind in [Kind::Node, Kind::Service, Kind::EndpointSlice] {
            items.extend(self.server.values(kind));
        }
        let manifest = self.dir.path().join("state.yaml");
        let list = json!({"apiVersion": "v1", "kind": "List", "items": items});
        std::fs::write(&manifest, serde_yaml::to_string(&list).expect("yaml")).expect("write manifest");
        let mut out = BTreeMap::new();
        for family in FAMILIES {
            let (flag, restore) = match family {
                IpFamily::V4 => ("ipv4", "iptables-nft-restore"),
                IpFamily::V6 => ("ipv6", "ip6tables-nft-restore"),
            };
            let mut cmd = std::process::Command::new(BIN);
            cmd.args(["render", "--hostname-override", HOST, "--ip-family", flag]);
            for a in &self.interface_addresses {
                cmd.arg(format!("--interface-address={a}"));
            }
            let rendered = cmd.arg(&manifest).output().expect("run render");
            assert!(rendered.status.success(), "render: {}", String::from_utf8_lossy(&rendered.stderr));
            let payload = String::from_utf8(rendered.stdout).expect("utf-8");
            let reference = Netns::create("soakref");
            create_nfacct_objects(&reference);
            let restored = reference.run_with_stdin(&[restore], &payload);
            assert!(restored.success(), "the rendered {family} rules restore: {}", restored.combined());
            let (own, builtin) =
                split_builtin(&canonical_rules(&reference.runner(Backend::Nft, family), &IGNORED_CHAINS), "");
            assert!(builtin.is_empty(), "render wrote rules into built-in chains: {builtin:?}");
            out.insert(family, own);
        }
        out
    }

    /// The node's rules per family: the proxier's chains, and the jumps in the built-in ones.
    fn actual(&self, expected: &BTreeMap<IpFamily, String>) -> BTreeMap<IpFamily, (String, Vec<String>)> {
        FAMILIES
            .into_iter()
            .map(|f| {
                let canonical = canonical_rules(&self.node_ns.runner(Backend::Nft, f), &IGNORED_CHAINS);
                (f, split_builtin(&canonical, &expected[&f]))
            })
            .collect()
    }

    /// Waits (churn paused) until the kernel equals the render of the API state, then
    /// samples the daemon.
    async fn checkpoint(&mut self) -> Checkpoint {
        let paused = Instant::now();
        self.assert_alive();
        let expected = self.expected();
        let mismatch = loop {
            let actual = self.actual(&expected);
            let pending_failures = self.pending_restore_failures();
            let own_match = FAMILIES.iter().all(|f| actual[f].0 == expected[f]);
            if own_match && self.jumps.is_none() {
                // The first match fixes the jumps every later checkpoint must show.
                self.jumps = Some(checked_jumps(&actual, &expected));
            }
            let jumps_match = self.jumps.as_ref().is_some_and(|j| FAMILIES.iter().all(|f| actual[f].1 == j[f]));
            if own_match && jumps_match && pending_failures == 0 {
                break None;
            }
            if paused.elapsed() > CONVERGE {
                let mut text = format!("{pending_failures} injected restore failures still pending\n");
                for f in FAMILIES {
                    text.push_str(&format!("{f}:\n{}", line_diff(&expected[&f], &actual[&f].0)));
                    if let Some(jumps) = &self.jumps {
                        let (want, got) = (jumps[&f].join("\n") + "\n", actual[&f].1.join("\n") + "\n");
                        text.push_str(&format!("{f} built-in chains:\n{}", line_diff(&want, &got)));
                    }
                }
                break Some(text);
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        };
        let converge = paused.elapsed();
        // Five samples over a second; the one with the fewest children describes the
        // daemon between syncs (its descriptors then hold no pipes to a running child).
        let pid = self.daemon.pid();
        let mut samples = Vec::new();
        for _ in 0..5 {
            samples.push(sample(pid));
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        let quiet = samples.iter().min_by_key(|s| s.children).expect("samples").clone();
        let mut expected_ports = self.churn.health_check_ports();
        expected_ports.extend([HEALTHZ_PORT, METRICS_PORT]);
        self.assert_alive();
        Checkpoint {
            at: self.started.elapsed(),
            services: self.churn.live_services().len(),
            slices: self.server.values(Kind::EndpointSlice).len(),
            converge,
            mismatch,
            rss_kb: quiet.rss_kb,
            fds: quiet.fds,
            listen_ports: quiet.listen_ports,
            expected_ports,
            threads: quiet.threads,
            children: quiet.children,
            zombies: samples.iter().map(|s| s.zombies).min().unwrap_or(0),
        }
    }

    fn pending_restore_failures(&self) -> usize {
        std::fs::read_to_string(&self.restore_counter).ok().and_then(|t| t.trim().parse().ok()).unwrap_or(0)
    }

    fn flush_our_chains(&self, round: usize) {
        match round % 3 {
            // The whole IPv4 nat table deleted at once (a `-F` then `-X` would race the
            // daemon's own restores).
            0 => {
                self.node_ns.ok(&["nft", "delete", "table", "ip", "nat"]);
            }
            // KUBE-SERVICES emptied and the mangle canary deleted (the signal to rewrite).
            1 => {
                self.node_ns.ok(&["iptables-nft", "-t", "nat", "-F", "KUBE-SERVICES"]);
                self.node_ns.ok(&["iptables-nft", "-t", "mangle", "-X", "KUBE-PROXY-CANARY"]);
            }
            // The whole IPv6 filter table deleted.
            _ => {
                self.node_ns.ok(&["nft", "delete", "table", "ip6", "filter"]);
            }
        }
    }
}

/// The chains the kernel owns: the daemon inserts its jumps into them with `iptables -I`
/// (render's restore payload does not carry those).
const BUILTIN_CHAINS: [&str; 5] = ["PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING"];

/// Splits a canonical dump into the proxier's chains (what `render` writes) and what the
/// daemon ensures outside its restores: the rules in the built-in chains, and the empty
/// chains only they jump to (IPv6's KUBE-FIREWALL, which upstream ensures but never fills).
/// The latter are prefixed with their table; chains `render` declares stay with its own.
fn split_builtin(canonical: &str, render: &str) -> (String, Vec<String>) {
    let rendered = declared_chains(render);
    let rule_chain =
        |line: &str| line.strip_prefix("-A ").and_then(|r| r.split_whitespace().next()).map(str::to_string);
    let mut filled = BTreeSet::new();
    let mut targets = BTreeSet::new();
    let mut table = "";
    for line in canonical.lines() {
        if let Some(t) = line.strip_prefix('*') {
            table = t;
        }
        if let Some(chain) = rule_chain(line) {
            if BUILTIN_CHAINS.contains(&chain.as_str())
                && let Some(target) = line.rsplit("-j ").next().and_then(|t| t.split_whitespace().next())
            {
                targets.insert((table.to_string(), target.to_string()));
            }
            filled.insert((table.to_string(), chain));
        }
    }
    let (mut own, mut builtin) = (String::new(), Vec::new());
    for line in canonical.lines() {
        if let Some(t) = line.strip_prefix('*') {
            table = t;
        }
        let declared = line.strip_prefix(':').and_then(|r| r.split_whitespace().next());
        let ensured_empty = declared.is_some_and(|c| {
            let key = (table.to_string(), c.to_string());
            targets.contains(&key) && !filled.contains(&key) && !rendered.contains(&key)
        });
        if ensured_empty || rule_chain(line).is_some_and(|c| BUILTIN_CHAINS.contains(&c.as_str())) {
            builtin.push(format!("{table}: {line}"));
        } else {
            own.push_str(line);
            own.push('\n');
        }
    }
    (own, builtin)
}

/// The (table, chain) pairs a canonical dump declares.
fn declared_chains(canonical: &str) -> BTreeSet<(String, String)> {
    let mut out = BTreeSet::new();
    let mut table = "";
    for line in canonical.lines() {
        if let Some(t) = line.strip_prefix('*') {
            table = t;
        }
        if let Some(chain) = line.strip_prefix(':').and_then(|r| r.split_whitespace().next()) {
            out.insert((table.to_string(), chain.to_string()));
        }
    }
    out
}

/// The daemon's jumps from the built-in chains once its own chains first match: present in
/// both tables of both families, and every one leads to a chain the render declares.
fn checked_jumps(
    actual: &BTreeMap<IpFamily, (String, Vec<String>)>,
    expected: &BTreeMap<IpFamily, String>,
) -> BTreeMap<IpFamily, Vec<String>> {
    let mut out = BTreeMap::new();
    for f in FAMILIES {
        let jumps = &actual[&f].1;
        for table in ["filter", "nat"] {
            assert!(jumps.iter().any(|j| j.starts_with(&format!("{table}: "))), "{f}: no jumps in {table}: {jumps:?}");
        }
        for j in jumps.iter().filter(|j| j.contains(" -j ")) {
            let target = j.rsplit("-j ").next().and_then(|t| t.split_whitespace().next()).unwrap_or("");
            let table = j.split(':').next().unwrap_or("");
            let ensured = jumps.iter().any(|d| d.starts_with(&format!("{table}: :{target} ")));
            assert!(ensured || expected[&f].contains(&format!(":{target} ")), "{f}: jump to an undeclared chain: {j}");
        }
        out.insert(f, jumps.clone());
    }
    out
}

/// The changed lines of a diff (and the headers), at most `lines` of them.
fn head(diff: &str, lines: usize) -> String {
    let changed = diff.lines().filter(|l| !l.starts_with(' ') || l.starts_with(" *") || l.ends_with(':'));
    changed.take(lines).collect::<Vec<_>>().join("\n")
}

fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

fn print_checkpoint(i: usize, c: &Checkpoint) {
    eprintln!(
        "soak| {i:>3} | {:>6.0} | {:>4} | {:>4} | {:>7.1} | {:>8} | {:>7.1} | {:>3} | {:>3} | {:>7} | {:>8} | {:>6} | {}",
        c.at.as_secs_f64(),
        c.services,
        c.slices,
        c.converge.as_secs_f64(),
        if c.mismatch.is_none() { "yes" } else { "NO" },
        c.rss_kb as f64 / 1024.0,
        c.fds,
        c.listen_ports.len(),
        c.threads,
        c.children,
        c.zombies,
        if c.listen_ports == c.expected_ports { "" } else { "listeners differ" },
    );
}

/// Runs the soak and asserts what it must show; returns the checkpoints.
async fn soak(tag: &str, plan: SoakPlan) -> Vec<Checkpoint> {
    eprintln!("soak: {plan:?}");
    let mut s = Soak::start(tag, plan.seed, 12).await;
    let addr = s.server.addr().to_string();
    eprintln!(
        "soak| cp  |  t (s) | svcs | slcs | conv(s) | matched  | RSS(MB) | fds | lst | threads | children | zombie |"
    );
    let mut checkpoints = vec![s.checkpoint().await];
    print_checkpoint(0, &checkpoints[0]);
    if let Some(diff) = &checkpoints[0].mismatch {
        eprintln!("soak: checkpoint 0 mismatch:\n{}", head(diff, 80));
    }

    let mut faults: BTreeMap<Fault, usize> = BTreeMap::new();
    let mut fault_round = 0usize;
    let mut down_until: Option<Instant> = None;
    let mut churned = Duration::ZERO;
    let mut next_checkpoint = plan.checkpoint_every;
    let mut next_fault = plan.fault_every / 2;
    while churned < plan.duration {
        let tick = Instant::now();
        s.churn.step(&s.server);
        if churned >= next_fault {
            let fault = FAULTS[fault_round % FAULTS.len()];
            match fault {
                Fault::WatchCut => s.server.cut_watches(),
                Fault::Gone410 => s.server.compact(),
                Fault::ApiDown => {
                    s.server.go_down();
                    down_until = Some(Instant::now() + Duration::from_secs(3 + s.churn.rng.below(4) as u64));
                }
                Fault::RestoreFailures => {
                    let n = 2 + s.churn.rng.below(4);
                    std::fs::write(&s.restore_counter, n.to_string()).expect("write restore counter");
                }
                Fault::ChainFlush => s.flush_our_chains(fault_round / FAULTS.len()),
            }
            *faults.entry(fault).or_insert(0) += 1;
            fault_round += 1;
            next_fault += plan.fault_every;
        }
        if down_until.is_some_and(|t| Instant::now() >= t) {
            s.server.come_back_on(bind_in_netns(&s.api_ns.name, &addr));
            down_until = None;
        }
        tokio::time::sleep(Duration::from_millis(100 + s.churn.rng.below(300) as u64)).await;
        churned += tick.elapsed();
        if churned >= next_checkpoint || churned >= plan.duration {
            if down_until.take().is_some() {
                s.server.come_back_on(bind_in_netns(&s.api_ns.name, &addr));
            }
            let c = s.checkpoint().await;
            print_checkpoint(checkpoints.len(), &c);
            if let Some(diff) = &c.mismatch {
                eprintln!("soak: checkpoint {} mismatch:\n{}", checkpoints.len(), head(diff, 80));
            }
            checkpoints.push(c);
            next_checkpoint += plan.checkpoint_every;
        }
    }

    let log = s.daemon.log_text();
    let ops: usize = s.churn.ops.values().sum();
    eprintln!("soak: {ops} changes: {:?}", s.churn.ops);
    eprintln!(
        "soak: faults: {faults:?}; watches answered 410 Gone: {}; restore failures logged: {}; sync lines: {}",
        s.server.expired_watches(),
        log.matches("injected failure").count(),
        log.matches("sync complete").count(),
    );
    summarise(&checkpoints);

    // Every fault was injected, and took effect where the daemon can tell.
    for fault in FAULTS {
        assert!(faults.get(&fault).is_some_and(|&n| n > 0), "{fault:?} never injected: {faults:?}");
    }
    assert!(s.server.expired_watches() > 0, "no re-watch was answered 410 Gone");
    assert!(log.contains("injected failure"), "no injected restore failure reached the daemon's log");
    assert!(!log.contains("panicked"), "the daemon panicked:\n{}", tail(&log, 200));

    for (i, c) in checkpoints.iter().enumerate() {
        if let Some(diff) = &c.mismatch {
            panic!(
                "checkpoint {i} ({:.0} s): the kernel does not equal the render of the API state (- render, + kernel):\n{}\ndaemon log:\n{}",
                c.at.as_secs_f64(),
                tail(diff, 300),
                tail(&log, 200)
            );
        }
        assert_eq!(
            c.listen_ports, c.expected_ports,
            "checkpoint {i}: listening ports are exactly healthz, metrics and the live health-check ports"
        );
        assert_eq!(c.zombies, 0, "checkpoint {i}: zombie children of the daemon");
        assert_eq!(c.children, 0, "checkpoint {i}: child processes outlived their sync");
    }
    assert_flat(&checkpoints);
    checkpoints
}

/// Descriptors, threads and memory after the warm-up (the first checkpoint after churn and
/// faults began) bound every later checkpoint.
fn assert_flat(checkpoints: &[Checkpoint]) {
    assert!(checkpoints.len() >= 3, "too few checkpoints to judge: {}", checkpoints.len());
    let base = &checkpoints[1];
    let later = &checkpoints[2..];
    let max_fds = later.iter().map(|c| c.fds).max().unwrap_or(0);
    assert!(max_fds <= base.fds + 2, "open descriptors grew: {} after warm-up, up to {max_fds} later", base.fds);
    let max_threads = later.iter().map(|c| c.threads).max().unwrap_or(0);
    assert!(max_threads <= base.threads + 4, "threads grew: {} after warm-up, up to {max_threads} later", base.threads);
    let last = checkpoints.last().expect("checkpoints");
    let bound = (base.rss_kb * 5 / 4).max(base.rss_kb + 8 * 1024);
    assert!(
        last.rss_kb <= bound,
        "RSS grew from {} kB after warm-up to {} kB (bound {bound} kB)",
        base.rss_kb,
        last.rss_kb
    );
}

fn summarise(checkpoints: &[Checkpoint]) {
    let steady = &checkpoints[1.min(checkpoints.len() - 1)..];
    let line = |name: &str, values: Vec<u64>| {
        let (min, max) = (values.iter().min().copied().unwrap_or(0), values.iter().max().copied().unwrap_or(0));
        eprintln!(
            "soak: {name:<10} first {:>8} middle {:>8} last {:>8} | min {min:>8} median {:>8} max {max:>8}",
            values[0],
            values[values.len() / 2],
            values[values.len() - 1],
            median(&values)
        );
    };
    eprintln!("soak: over the {} checkpoints after warm-up:", steady.len());
    line("RSS (kB)", steady.iter().map(|c| c.rss_kb).collect());
    line("fds", steady.iter().map(|c| c.fds as u64).collect());
    line("listeners", steady.iter().map(|c| c.listen_ports.len() as u64).collect());
    line("threads", steady.iter().map(|c| c.threads as u64).collect());
    line("children", steady.iter().map(|c| c.children as u64).collect());
    line("converge ms", steady.iter().map(|c| c.converge.as_millis() as u64).collect());
}

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// The soak in the suite: about 100 s of churn, every fault injected at least once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn soak_short() {
    require_root!();
    let plan = SoakPlan {
        duration: Duration::from_secs(100),
        seed: env_u64("KPR_SOAK_SEED", 14),
        checkpoint_every: Duration::from_secs(25),
        fault_every: Duration::from_secs(12),
    };
    soak("soak", plan).await;
}

/// The soak of issue 14 (run by `scripts/soak.sh`; figures in docs/performance.md):
/// `KPR_SOAK_SECONDS` (default 1800) of churn, a checkpoint a minute, a fault every 20 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "30 minutes; run by scripts/soak.sh"]
async fn soak_30_minutes() {
    require_root!();
    let plan = SoakPlan {
        duration: Duration::from_secs(env_u64("KPR_SOAK_SECONDS", 1800)),
        seed: env_u64("KPR_SOAK_SEED", 1414),
        checkpoint_every: Duration::from_secs(60),
        fault_every: Duration::from_secs(20),
    };
    soak("soakl", plan).await;
}
