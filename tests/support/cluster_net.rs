//! A small two-node cluster network for end-to-end traffic tests (root only), built on the
//! e2e topology (the test API server in an "api" namespace, the daemon in "node-a"):
//!
//! ```text
//!                       api 198.18.20.1 ── 198.18.20.2 node-a (daemon; InternalIPs 198.18.30.2, fd00:30::2)
//! client 198.18.30.1, .3, fd00:30::1 ──── 198.18.30.2 ┘ │ │ │ └ 198.18.21.1 ── 198.18.21.2 node-b
//!   pod-a1 198.18.101.2 fd00:101::2 ─── .1 ─────────────┘ │ │                                │
//!   pod-a2 198.18.102.2 fd00:102::2 ─── .1 ───────────────┘ │     pod-b1 198.18.103.2 ── .1 ──┘
//!   cpod   198.18.104.2 fd00:104::2 ─── .1 ─────────────────┘     (remote pod behind node-b)
//! ```
//!
//! Pods run in-process servers (threads entered into the pod namespace): TCP [`SERVE_PORT`]
//! answers "<pod> <peer-ip>\n" and closes, TCP [`ECHO_PORT`] answers every line it reads
//! that way and stays open, UDP [`SERVE_PORT`] answers each datagram. `cpod` is a client-only
//! pod on node-a; `client` is outside the cluster. Service addresses: ClusterIPs in
//! 198.19.0.0/16 and fd00:5019::/32, external/LB IPs in 198.18.40.0/24. Everything (daemon,
//! servers, namespaces) is torn down on drop, also when the test panics.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, ErrorKind, Write};
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube_proxy_rs::tracker::testing::{SliceBuilder, SvcBuilder, ep, node, slice, svc};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

use crate::support::apiserver::ApiServer;
use crate::support::e2e::{
    DaemonProcess, TempDir, daemon_args, enter_netns, in_netns, ip, nat, topology, topology_tls, veth_names,
};
use crate::support::netns::Netns;

pub const NODE_A: &str = "node-a";
pub const NODE_B: &str = "node-b";
/// node-a's InternalIPs (on the client link): NodePorts are reached here.
pub const NODE_A_IP: &str = "198.18.30.2";
pub const NODE_A_IP6: &str = "fd00:30::2";
/// The external client's two source addresses and its IPv6 one.
pub const CLIENT_IP: &str = "198.18.30.1";
pub const CLIENT_IP_ALT: &str = "198.18.30.3";
pub const CLIENT_IP6: &str = "fd00:30::1";
/// node-a's address on the node-b link (what a masqueraded packet to pod-b1 comes from).
pub const NODE_A_TO_B: &str = "198.18.21.1";
/// Pod ranges only (detect-local and masquerading key off it).
pub const CLUSTER_CIDR: &str = "198.18.96.0/19,fd00:100::/23";
pub const SYNC_PERIOD: Duration = Duration::from_secs(2);
pub const SERVE_PORT: u16 = 8080;
pub const ECHO_PORT: u16 = 8081;
/// Client connect/read timeout: a DROP shows as a timeout this long.
pub const CLIENT_TIMEOUT: Duration = Duration::from_millis(1500);

/// One pod: its namespace and addresses; `node_side` is the node end of its veth.
pub struct Pod {
    pub name: &'static str,
    pub node: &'static str,
    pub ip: String,
    pub ip6: String,
    pub node_side: String,
    pub ns: Netns,
}

/// The pods, by index into [`Cluster::pods`].
pub const POD_A1: usize = 0;
pub const POD_A2: usize = 1;
pub const POD_B1: usize = 2;
pub const CPOD: usize = 3;

const POD_PLAN: [(&str, &str, u8); 4] =
    [("pod-a1", NODE_A, 101), ("pod-a2", NODE_A, 102), ("pod-b1", NODE_B, 103), ("cpod", NODE_A, 104)];

/// The whole cluster network. Field order is drop order: daemon, servers, then namespaces.
pub struct Cluster {
    pub daemon: Option<DaemonProcess>,
    servers: Vec<PodServer>,
    pub pods: Vec<Pod>,
    pub client: Netns,
    pub node_b: Netns,
    pub node_a: Netns,
    pub api_ns: Netns,
    pub server: ApiServer,
    pub dir: TempDir,
}

/// Links namespace `a` (address `a_addrs`) and `b` (address `b_addrs`) with a veth pair;
/// addresses are CIDRs, IPv6 ones added without duplicate address detection.
fn link(a: &Netns, a_addrs: &[&str], b: &Netns, b_addrs: &[&str]) {
    let (x, y) = veth_names("kt");
    ip(&["link", "add", &x, "type", "veth", "peer", "name", &y]);
    ip(&["link", "set", &x, "netns", &a.name]);
    ip(&["link", "set", &y, "netns", &b.name]);
    for (ns, dev, addrs) in [(a, &x, a_addrs), (b, &y, b_addrs)] {
        for addr in addrs {
            if addr.contains(':') {
                ns.ok(&["ip", "-6", "addr", "add", addr, "dev", dev, "nodad"]);
            } else {
                ns.ok(&["ip", "addr", "add", addr, "dev", dev]);
            }
        }
        ns.ok(&["ip", "link", "set", dev, "up"]);
    }
}

fn forwarding(ns: &Netns) {
    ns.ok(&["sysctl", "-qw", "net.ipv4.ip_forward=1"]);
    ns.ok(&["sysctl", "-qw", "net.ipv6.conf.all.forwarding=1"]);
}

impl Cluster {
    /// Builds the network, starts the pod servers, creates node-a's Node object and starts
    /// the daemon in node-a.
    pub async fn start(tag: &str) -> Cluster {
        let mut cluster = Cluster::network(tag).await;
        cluster.start_daemon();
        cluster
    }

    /// Like [`Cluster::start`] without starting the daemon (the test starts it its own way).
    pub async fn network(tag: &str) -> Cluster {
        let (api_ns, node_a, server) = topology(tag).await;
        Cluster::around(tag, api_ns, node_a, server).await
    }

    /// [`Cluster::network`] with the API server serving HTTPS with `acceptor`'s certificate.
    pub async fn network_tls(tag: &str, acceptor: tokio_rustls::TlsAcceptor) -> Cluster {
        let (api_ns, node_a, server) = topology_tls(tag, acceptor).await;
        Cluster::around(tag, api_ns, node_a, server).await
    }

    /// The rest of the network around the API server's and node-a's namespaces.
    async fn around(tag: &str, api_ns: Netns, node_a: Netns, server: ApiServer) -> Cluster {
        let node_b = Netns::create(&format!("{tag}-nodeb"));
        let client = Netns::create(&format!("{tag}-client"));
        for ns in [&node_b, &client] {
            ns.ok(&["ip", "link", "set", "lo", "up"]);
        }
        forwarding(&node_a);
        forwarding(&node_b);

        link(
            &node_a,
            &["198.18.30.2/24", "fd00:30::2/64"],
            &client,
            &["198.18.30.1/24", "198.18.30.3/24", "fd00:30::1/64"],
        );
        link(&node_a, &["198.18.21.1/30", "fd00:21::1/64"], &node_b, &["198.18.21.2/30", "fd00:21::2/64"]);
        let mut pods = Vec::new();
        for (name, host, net) in POD_PLAN {
            let ns = Netns::create(&format!("{tag}-{name}"));
            ns.ok(&["ip", "link", "set", "lo", "up"]);
            let host_ns = if host == NODE_A { &node_a } else { &node_b };
            let (gw, gw6) = (format!("198.18.{net}.1"), format!("fd00:{net}::1"));
            link(
                host_ns,
                &[&format!("{gw}/30"), &format!("{gw6}/64")],
                &ns,
                &[&format!("198.18.{net}.2/30"), &format!("fd00:{net}::2/64")],
            );
            ns.ok(&["ip", "route", "add", "default", "via", &gw]);
            ns.ok(&["ip", "-6", "route", "add", "default", "via", &gw6]);
            pods.push(Pod {
                name,
                node: host,
                ip: format!("198.18.{net}.2"),
                ip6: format!("fd00:{net}::2"),
                node_side: gw,
                ns,
            });
        }
        // node-a reaches the remote pod via node-b; node-b sends everything else back.
        node_a.ok(&["ip", "route", "add", "198.18.103.0/30", "via", "198.18.21.2"]);
        node_a.ok(&["ip", "-6", "route", "add", "fd00:103::/64", "via", "fd00:21::2"]);
        node_b.ok(&["ip", "route", "add", "default", "via", "198.18.21.1"]);
        node_b.ok(&["ip", "-6", "route", "add", "default", "via", "fd00:21::1"]);
        // A default route on node-a so locally generated traffic to service IPs has a route
        // (and so gets to the nat OUTPUT chain).
        node_a.ok(&["ip", "route", "add", "default", "via", CLIENT_IP]);
        node_a.ok(&["ip", "-6", "route", "add", "default", "via", CLIENT_IP6]);
        // The client sends service traffic to node-a.
        for range in ["198.19.0.0/16", "198.18.40.0/24"] {
            client.ok(&["ip", "route", "add", range, "via", NODE_A_IP]);
        }
        client.ok(&["ip", "-6", "route", "add", "fd00:5019::/32", "via", NODE_A_IP6]);
        tokio::time::sleep(Duration::from_secs(1)).await;

        let servers = pods.iter().filter(|p| p.name != "cpod").map(|p| PodServer::start(p.name, &p.ns.name)).collect();
        server.create(&node(NODE_A, &[], &[], &[NODE_A_IP, NODE_A_IP6]));
        let dir = TempDir::new(tag);
        Cluster { daemon: None, servers, pods, client, node_b, node_a, api_ns, server, dir }
    }

    /// The daemon's flags: short sync periods, our cluster CIDR, servers inside node-a.
    pub fn daemon_args(&self) -> Vec<String> {
        let mut args = daemon_args(&self.dir.kubeconfig(&self.server), NODE_A);
        args.extend([
            format!("--iptables-sync-period={}s", SYNC_PERIOD.as_secs()),
            "--iptables-min-sync-period=100ms".into(),
            format!("--cluster-cidr={CLUSTER_CIDR}"),
            "-v=2".into(),
        ]);
        args
    }

    /// (Re)starts the daemon in node-a, appending to its log.
    pub fn start_daemon(&mut self) {
        self.start_daemon_with(&[]);
    }

    /// (Re)starts the daemon in node-a with `extra` flags after [`Cluster::daemon_args`].
    pub fn start_daemon_with(&mut self, extra: &[&str]) {
        let mut args = self.daemon_args();
        args.extend(extra.iter().map(|a| a.to_string()));
        self.start_daemon_exactly(&args, &[]);
    }

    /// (Re)starts the daemon in node-a with exactly `args` (e.g. a `--config` file instead of
    /// [`Cluster::daemon_args`]) and `env` added to its environment, into a log of its own.
    pub fn start_daemon_exactly(&mut self, args: &[String], env: &[(&str, &str)]) {
        static RUNS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = RUNS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let log = self.dir.path().join(format!("daemon-{n}.log"));
        self.daemon = Some(DaemonProcess::start(&self.node_a, args, log, env));
    }

    /// node-a's nftables `kube-proxy` table of `family` (`ip` / `ip6`), empty when absent.
    pub fn nft_table(&self, family: &str) -> String {
        String::from_utf8_lossy(&self.node_a.run(&["nft", "list", "table", family, "kube-proxy"]).stdout).into_owned()
    }

    pub fn daemon(&self) -> &DaemonProcess {
        self.daemon.as_ref().expect("daemon started")
    }

    pub fn log(&self) -> String {
        self.daemon.as_ref().map(DaemonProcess::log_text).unwrap_or_default()
    }

    pub fn pod(&self, i: usize) -> &Pod {
        &self.pods[i]
    }

    pub fn nat(&self) -> String {
        nat(&self.node_a)
    }

    pub fn filter(&self) -> String {
        self.node_a.ok(&["iptables-nft-save", "-t", "filter"])
    }
}

/// A socket address from an IP text and port.
pub fn sa(ip: &str, port: u16) -> SocketAddr {
    SocketAddr::new(ip.parse().expect("ip"), port)
}

/// What a pod server said: its name and the peer address it saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reply {
    pub pod: String,
    pub peer: String,
}

impl Reply {
    fn parse(line: &str) -> Result<Reply, Failure> {
        let mut it = line.split_whitespace();
        match (it.next(), it.next()) {
            (Some(pod), Some(peer)) => Ok(Reply { pod: pod.into(), peer: peer.into() }),
            _ => Err(Failure::Other(format!("unexpected reply {line:?}"))),
        }
    }
}

/// How a request failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Failure {
    /// Connection refused (a REJECT, or ICMP port unreachable for UDP).
    Refused,
    /// No answer within the timeout (a DROP, or no rule).
    Timeout,
    Other(String),
}

fn classify(e: &std::io::Error) -> Failure {
    match e.kind() {
        ErrorKind::ConnectionRefused => Failure::Refused,
        ErrorKind::WouldBlock | ErrorKind::TimedOut => Failure::Timeout,
        _ => Failure::Other(e.to_string()),
    }
}

pub type Outcome = Result<Reply, Failure>;

fn client_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().expect("client runtime")
}

/// Connects from the calling thread's namespace (optionally from source address `src`).
fn tcp_connect(
    rt: &tokio::runtime::Runtime,
    dst: SocketAddr,
    src: Option<IpAddr>,
) -> Result<std::net::TcpStream, Failure> {
    rt.block_on(async {
        let sock = if dst.is_ipv4() { tokio::net::TcpSocket::new_v4() } else { tokio::net::TcpSocket::new_v6() }
            .map_err(|e| classify(&e))?;
        if let Some(src) = src {
            sock.bind(SocketAddr::new(src, 0)).map_err(|e| classify(&e))?;
        }
        let stream = match tokio::time::timeout(CLIENT_TIMEOUT, sock.connect(dst)).await {
            Err(_) => return Err(Failure::Timeout),
            Ok(Err(e)) => return Err(classify(&e)),
            Ok(Ok(s)) => s,
        };
        let std = stream.into_std().map_err(|e| classify(&e))?;
        std.set_nonblocking(false).map_err(|e| classify(&e))?;
        std.set_read_timeout(Some(CLIENT_TIMEOUT)).map_err(|e| classify(&e))?;
        Ok(std)
    })
}

fn read_reply(stream: &mut BufReader<std::net::TcpStream>) -> Outcome {
    let mut line = String::new();
    match stream.read_line(&mut line) {
        Ok(0) => Err(Failure::Other("connection closed without a reply".into())),
        Ok(_) => Reply::parse(&line),
        Err(e) => Err(classify(&e)),
    }
}

/// `n` TCP requests (a connection each) from namespace `ns` to `dst`.
pub fn tcp_requests(ns: &impl NsName, dst: SocketAddr, src: Option<&str>, n: usize) -> Vec<Outcome> {
    let src: Option<IpAddr> = src.map(|s| s.parse().expect("src ip"));
    in_netns(ns.ns_name(), move || {
        let rt = client_runtime();
        (0..n)
            .map(|_| {
                let stream = tcp_connect(&rt, dst, src)?;
                read_reply(&mut BufReader::new(stream))
            })
            .collect()
    })
}

/// One TCP request.
pub fn tcp_request(ns: &impl NsName, dst: SocketAddr, src: Option<&str>) -> Outcome {
    tcp_requests(ns, dst, src, 1).remove(0)
}

fn udp_exchange(sock: &std::net::UdpSocket) -> Outcome {
    sock.send(b"ping\n").map_err(|e| classify(&e))?;
    let mut buf = [0u8; 512];
    match sock.recv(&mut buf) {
        Ok(n) => Reply::parse(&String::from_utf8_lossy(&buf[..n])),
        Err(e) => Err(classify(&e)),
    }
}

fn udp_socket(dst: SocketAddr, src: Option<IpAddr>) -> std::io::Result<std::net::UdpSocket> {
    let unspecified: IpAddr = if dst.is_ipv4() { "0.0.0.0".parse().expect("ip") } else { "::".parse().expect("ip") };
    let sock = std::net::UdpSocket::bind(SocketAddr::new(src.unwrap_or(unspecified), 0))?;
    // Connected, so an ICMP port unreachable (REJECT) comes back as ECONNREFUSED.
    sock.connect(dst)?;
    sock.set_read_timeout(Some(CLIENT_TIMEOUT))?;
    Ok(sock)
}

/// `n` UDP requests (a fresh socket, so a fresh conntrack entry, each) from `ns` to `dst`.
pub fn udp_requests(ns: &impl NsName, dst: SocketAddr, src: Option<&str>, n: usize) -> Vec<Outcome> {
    let src: Option<IpAddr> = src.map(|s| s.parse().expect("src ip"));
    in_netns(ns.ns_name(), move || {
        (0..n).map(|_| udp_exchange(&udp_socket(dst, src).map_err(|e| classify(&e))?)).collect()
    })
}

/// A UDP socket in a namespace kept across requests (same source port, same conntrack entry).
pub struct UdpFlow(std::net::UdpSocket);

impl UdpFlow {
    pub fn open(ns: &impl NsName, dst: SocketAddr) -> UdpFlow {
        UdpFlow(in_netns(ns.ns_name(), move || udp_socket(dst, None)).expect("udp socket"))
    }

    pub fn request(&self) -> Outcome {
        udp_exchange(&self.0)
    }
}

/// A long-lived TCP connection to an echo port: every line sent gets a reply.
pub struct TcpFlow(BufReader<std::net::TcpStream>);

impl TcpFlow {
    pub fn open(ns: &impl NsName, dst: SocketAddr) -> Result<TcpFlow, Failure> {
        in_netns(ns.ns_name(), move || {
            let rt = client_runtime();
            tcp_connect(&rt, dst, None).map(|s| TcpFlow(BufReader::new(s)))
        })
    }

    pub fn request(&mut self) -> Outcome {
        self.0.get_mut().write_all(b"ping\n").map_err(|e| classify(&e))?;
        read_reply(&mut self.0)
    }
}

/// Something naming a network namespace: a [`Netns`] or its name (threads take the name).
pub trait NsName {
    fn ns_name(&self) -> &str;
}

impl NsName for Netns {
    fn ns_name(&self) -> &str {
        &self.name
    }
}

impl NsName for String {
    fn ns_name(&self) -> &str {
        self
    }
}

/// Successful replies per pod name, and the failures.
pub fn tally(outcomes: &[Outcome]) -> (BTreeMap<String, usize>, Vec<Failure>) {
    let mut per_pod = BTreeMap::new();
    let mut failures = Vec::new();
    for o in outcomes {
        match o {
            Ok(r) => *per_pod.entry(r.pod.clone()).or_insert(0) += 1,
            Err(f) => failures.push(f.clone()),
        }
    }
    (per_pod, failures)
}

/// The servers of one pod, running on a thread inside the pod's namespace until dropped.
pub struct PodServer {
    stop: CancellationToken,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl PodServer {
    pub fn start(pod: &'static str, ns: &str) -> PodServer {
        let stop = CancellationToken::new();
        let path = format!("/var/run/netns/{ns}");
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let token = stop.clone();
        let thread = std::thread::spawn(move || {
            enter_netns(&path);
            client_runtime().block_on(serve(pod, token, ready_tx));
        });
        ready_rx.recv_timeout(Duration::from_secs(10)).expect("pod server ready");
        PodServer { stop, thread: Some(thread) }
    }
}

impl Drop for PodServer {
    fn drop(&mut self) {
        self.stop.cancel();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn answer(pod: &str, peer: SocketAddr) -> String {
    format!("{pod} {}\n", peer.ip().to_canonical())
}

/// Serves until `stop`: "[::]" sockets take IPv4 (mapped) and IPv6 alike.
async fn serve(pod: &'static str, stop: CancellationToken, ready: std::sync::mpsc::Sender<()>) {
    let tcp = tokio::net::TcpListener::bind(("::", SERVE_PORT)).await.expect("bind tcp");
    let echo = tokio::net::TcpListener::bind(("::", ECHO_PORT)).await.expect("bind echo");
    let udp = tokio::net::UdpSocket::bind(("::", SERVE_PORT)).await.expect("bind udp");
    let _ = ready.send(());
    let mut buf = [0u8; 512];
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            Ok((mut s, peer)) = tcp.accept() => {
                tokio::spawn(async move {
                    let _ = s.write_all(answer(pod, peer).as_bytes()).await;
                    let _ = s.shutdown().await;
                });
            }
            Ok((s, peer)) = echo.accept() => {
                let stop = stop.clone();
                tokio::spawn(async move {
                    let (r, mut w) = s.into_split();
                    let mut lines = tokio::io::BufReader::new(r).lines();
                    loop {
                        tokio::select! {
                            () = stop.cancelled() => return,
                            line = lines.next_line() => match line {
                                Ok(Some(_)) => if w.write_all(answer(pod, peer).as_bytes()).await.is_err() { return },
                                _ => return,
                            },
                        }
                    }
                });
            }
            Ok((_, peer)) = udp.recv_from(&mut buf) => {
                let _ = udp.send_to(answer(pod, peer).trim_end().as_bytes(), peer).await;
            }
        }
    }
}

/// The namespace of the traffic scenarios' Services (e2e_traffic, e2e_nftables).
pub const SCENARIO_NS: &str = "ns1";

/// A slice for `svc` with port "http" (TCP) and "dns" (UDP) to the pod servers, plus "echo"
/// (TCP) to their echo port; each endpoint carries its pod's node name.
pub fn pods_slice(svc: &str, pods: &[&Pod]) -> SliceBuilder {
    let mut b = slice(SCENARIO_NS, svc, &format!("{svc}-1"))
        .tcp("http", i32::from(SERVE_PORT))
        .udp("dns", i32::from(SERVE_PORT))
        .tcp("echo", i32::from(ECHO_PORT));
    for p in pods {
        b = b.endpoint(ep(&p.ip).node(p.node));
    }
    b
}

/// The IPv6 slice of `svc`: "http" (TCP) and "dns" (UDP) to the pods' IPv6 addresses.
pub fn pods_slice6(svc: &str, pods: &[&Pod]) -> EndpointSlice {
    let mut b = slice(SCENARIO_NS, svc, &format!("{svc}-6"))
        .ipv6()
        .tcp("http", i32::from(SERVE_PORT))
        .udp("dns", i32::from(SERVE_PORT));
    for p in pods {
        b = b.endpoint(ep(&p.ip6).node(p.node));
    }
    b.build()
}

/// A ClusterIP Service with ports http 80/TCP, dns 53/UDP and echo 81/TCP.
pub fn web(name: &str, ip: &str) -> SvcBuilder {
    svc(SCENARIO_NS, name).cluster_ip(ip).tcp("http", 80).udp("dns", 53).tcp("echo", 81)
}

/// Every request answered.
pub fn ok_all(outcomes: &[Outcome], what: &str) {
    let (_, failures) = tally(outcomes);
    assert!(failures.is_empty(), "{what}: {} of {} failed: {failures:?}", failures.len(), outcomes.len());
}
