//! The real `kube-proxy-rs` binary as a node runs it: an "api" namespace serving the test API
//! server and a "node" namespace running the daemon, joined by a veth link. Root only. Shared
//! by the end-to-end tests (daemon lifecycle, traffic, faults).

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::support::apiserver::ApiServer;
use crate::support::netns::Netns;
use crate::support::poll::poll_until;

pub const BIN: &str = env!("CARGO_BIN_EXE_kube-proxy-rs");
pub const API_IP: &str = "198.18.20.1";
pub const NODE_IP: &str = "198.18.20.2";

/// Binds a TCP listener inside network namespace `ns` (the socket stays in that namespace).
pub fn bind_in_netns(ns: &str, addr: &str) -> std::net::TcpListener {
    in_netns(ns, {
        let addr = addr.to_string();
        move || std::net::TcpListener::bind(&addr).expect("bind in netns")
    })
}

/// Runs `f` on a fresh thread that has entered network namespace `ns`; sockets it creates stay
/// in that namespace.
pub fn in_netns<T: Send + 'static>(ns: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let path = format!("/var/run/netns/{ns}");
    std::thread::spawn(move || {
        enter_netns(&path);
        f()
    })
    .join()
    .expect("netns thread")
}

/// Moves the calling thread into the network namespace at `path` (a thread of its own: the
/// namespace sticks to it).
pub fn enter_netns(path: &str) {
    let f = std::fs::File::open(path).expect("open netns");
    nix::sched::setns(&f, nix::sched::CloneFlags::CLONE_NEWNET).expect("setns");
}

/// Runs `ip` in the test's own namespace, which must succeed.
pub fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().expect("ip");
    assert!(out.status.success(), "ip {args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

/// A unique veth pair name pair (interface names are limited to 15 bytes).
pub fn veth_names(prefix: &str) -> (String, String) {
    static LINKS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = LINKS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    let id = std::process::id() % 10_000;
    (format!("{prefix}a{id}x{n}"), format!("{prefix}b{id}x{n}"))
}

/// The nat table of `ns` as iptables-nft-save prints it.
pub fn nat(ns: &Netns) -> String {
    ns.ok(&["iptables-nft-save", "-t", "nat"])
}

/// An "api" and a "node" namespace joined by a veth pair (api 198.18.20.1/30, node
/// 198.18.20.2/30), with the test API server bound in the api namespace. The namespaces (and
/// so the veth) go away when dropped.
pub async fn topology(tag: &str) -> (Netns, Netns, ApiServer) {
    let (api_ns, node_ns) = api_and_node_namespaces(tag).await;
    let server = ApiServer::start_on(bind_in_netns(&api_ns.name, &format!("{API_IP}:0")));
    (api_ns, node_ns, server)
}

/// Like [`topology`], with the API server speaking HTTPS with `acceptor`'s certificate.
pub async fn topology_tls(tag: &str, acceptor: tokio_rustls::TlsAcceptor) -> (Netns, Netns, ApiServer) {
    let (api_ns, node_ns) = api_and_node_namespaces(tag).await;
    let server = ApiServer::start_tls_on(bind_in_netns(&api_ns.name, &format!("{API_IP}:0")), acceptor);
    (api_ns, node_ns, server)
}

/// The "api" and "node" namespaces of [`topology`], linked, without a server.
pub async fn api_and_node_namespaces(tag: &str) -> (Netns, Netns) {
    let api_ns = Netns::create(&format!("{tag}-api"));
    let node_ns = Netns::create(&format!("{tag}-node"));
    let (a, b) = veth_names("kp");
    ip(&["link", "add", &a, "type", "veth", "peer", "name", &b]);
    ip(&["link", "set", &a, "netns", &api_ns.name]);
    ip(&["link", "set", &b, "netns", &node_ns.name]);
    api_ns.ok(&["ip", "addr", "add", &format!("{API_IP}/30"), "dev", &a]);
    node_ns.ok(&["ip", "addr", "add", &format!("{NODE_IP}/30"), "dev", &b]);
    for (ns, dev) in [(&api_ns, &a), (&node_ns, &b)] {
        ns.ok(&["ip", "link", "set", dev, "up"]);
        ns.ok(&["ip", "link", "set", "lo", "up"]);
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    (api_ns, node_ns)
}

/// `GET path` on `addr` from inside `ns`: status and body, `None` if nothing answered.
pub fn http_get(ns: &Netns, addr: &str, path: &str) -> Option<(u16, String)> {
    let (addr, path) = (addr.to_string(), path.to_string());
    in_netns(&ns.name, move || {
        let mut s = std::net::TcpStream::connect_timeout(&addr.parse().ok()?, Duration::from_secs(2)).ok()?;
        s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
        write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").ok()?;
        let mut text = String::new();
        s.read_to_string(&mut text).ok()?;
        let status = text.split_whitespace().nth(1)?.parse().ok()?;
        let body = text.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default();
        Some((status, body))
    })
}

/// Where the daemon's servers listen inside the node namespace.
pub const HEALTHZ_ADDR: &str = "198.18.20.2:10256";
pub const METRICS_ADDR: &str = "127.0.0.1:10249";

/// The flags every end-to-end daemon runs with: the test API server's kubeconfig, the node's
/// name, no conntrack table resizing (the namespace shares the host's), and the health and
/// metrics servers inside the node namespace. Tests append their own.
pub fn daemon_args(kubeconfig: &Path, hostname: &str) -> Vec<String> {
    vec![
        format!("--kubeconfig={}", kubeconfig.display()),
        format!("--hostname-override={hostname}"),
        "--conntrack-max-per-core=0".into(),
        format!("--healthz-bind-address={HEALTHZ_ADDR}"),
        format!("--metrics-bind-address={METRICS_ADDR}"),
    ]
}

pub fn kubeconfig_text(server: &ApiServer) -> String {
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: t\n  cluster: {{server: \"{}\"}}\nusers:\n- name: t\n  user: {{}}\ncontexts:\n- name: t\n  context: {{cluster: t, user: t}}\ncurrent-context: t\n",
        server.url()
    )
}

/// A scratch directory removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> TempDir {
        static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let dir = std::env::temp_dir().join(format!("kpr-{tag}-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("create temp dir");
        TempDir(dir)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }

    /// Writes a kubeconfig for `server` into the directory and returns its path.
    pub fn kubeconfig(&self, server: &ApiServer) -> PathBuf {
        let path = self.0.join("kubeconfig");
        std::fs::write(&path, kubeconfig_text(server)).expect("write kubeconfig");
        path
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The daemon running in a namespace; killed (SIGKILL) on drop if the test has not stopped it.
pub struct DaemonProcess {
    pub child: Option<Child>,
    pub log: PathBuf,
}

impl DaemonProcess {
    /// Starts `kube-proxy-rs args…` inside `ns`, stderr into `log`. `env` is added to the
    /// environment (e.g. a PATH with a failing iptables-restore first).
    pub fn start(ns: &Netns, args: &[String], log: PathBuf, env: &[(&str, &str)]) -> DaemonProcess {
        let file = std::fs::File::create(&log).expect("create daemon log");
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &ns.name, BIN]).args(args).stdout(Stdio::null()).stderr(file);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let child = cmd.spawn().expect("start daemon");
        DaemonProcess { child: Some(child), log }
    }

    /// Starts a prepared command (e.g. the daemon wrapped in `unshare`), stderr into `log`.
    pub fn spawn(mut cmd: Command, log: PathBuf) -> DaemonProcess {
        let file = std::fs::File::create(&log).expect("create daemon log");
        let child = cmd.stdout(Stdio::null()).stderr(file).spawn().expect("start daemon");
        DaemonProcess { child: Some(child), log }
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("daemon running").id()
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Sends `signal` (e.g. "TERM", "KILL") to the daemon.
    pub fn signal(&self, signal: &str) {
        let _ = Command::new("kill").args([format!("-{signal}"), self.pid().to_string()]).status();
    }

    /// Waits up to `limit` for the daemon to exit and returns its status.
    pub async fn wait_exit(&mut self, limit: Duration) -> std::process::ExitStatus {
        let mut child = self.child.take().expect("daemon running");
        let mut status = None;
        poll_until(limit, Duration::from_millis(100), || {
            status = child.try_wait().expect("wait");
            status.is_some()
        })
        .await;
        status.unwrap_or_else(|| {
            let _ = child.kill();
            let _ = child.wait();
            panic!("daemon did not exit within {limit:?}\n{}", self.log_text())
        })
    }
}

impl Drop for DaemonProcess {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// The namespace's interface addresses (what the daemon reads from /proc there).
pub fn interface_addresses(ns: &Netns) -> Vec<std::net::IpAddr> {
    let out = ns.ok(&["ip", "-o", "addr", "show"]);
    out.lines()
        .filter_map(|l| {
            let mut words = l.split_whitespace();
            words.find(|w| *w == "inet" || *w == "inet6")?;
            words.next()?.split('/').next()?.parse().ok()
        })
        .collect()
}

/// Creates the accounting objects the daemon makes before its rules name them (releases
/// 1.31+; `render` assumes they exist), so a rendered payload restores into `ns`.
pub fn create_nfacct_objects(ns: &Netns) {
    for name in [
        kube_proxy_rs::node::nfacct::CT_STATE_INVALID_DROPPED,
        kube_proxy_rs::node::nfacct::LOCALHOST_NODEPORTS_ACCEPTED,
    ] {
        ns.ok(&["nfacct", "add", name]);
    }
}

/// Generates a test CA and a server certificate for `ip` with openssl into `dir`.
pub fn test_certificates(dir: &std::path::Path, ip: &str) {
    let run = |args: &[&str]| {
        let out = Command::new("openssl").args(args).current_dir(dir).output().expect("run openssl");
        assert!(out.status.success(), "openssl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    };
    let ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"];
    run(&[&["req", "-x509"][..], &ec, &["-keyout", "ca.key", "-out", "ca.crt", "-days", "1", "-subj", "/CN=test-ca"]]
        .concat());
    run(&[&["req"][..], &ec, &["-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=kube-apiserver"]].concat());
    std::fs::write(
        dir.join("ext.cnf"),
        format!("subjectAltName=IP:{ip}\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n"),
    )
    .expect("ext.cnf");
    run(&[
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "server.crt",
        "-days",
        "1",
        "-extfile",
        "ext.cnf",
    ]);
}

pub fn tls_acceptor(dir: &std::path::Path) -> tokio_rustls::TlsAcceptor {
    use tokio_rustls::rustls;
    use tokio_rustls::rustls::pki_types::pem::PemObject;
    use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(dir.join("server.crt"))
        .expect("server.crt")
        .collect::<Result<_, _>>()
        .expect("certificate");
    let key = PrivateKeyDer::from_pem_file(dir.join("server.key")).expect("server.key");
    let config =
        rustls::ServerConfig::builder_with_provider(std::sync::Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .expect("protocol versions")
            .with_no_client_auth()
            .with_single_cert(certs, key)
            .expect("server certificate");
    tokio_rustls::TlsAcceptor::from(std::sync::Arc::new(config))
}
