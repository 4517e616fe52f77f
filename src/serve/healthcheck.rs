//! Health-check node ports (upstream `ServiceHealthServer`): for every Service with
//! `externalTrafficPolicy: Local` and a `healthCheckNodePort`, an HTTP server on that port
//! telling cloud load balancers whether this node has a ready endpoint of the Service.
//!
//! [`ServiceHealthServer::sync_services`] opens and closes listeners so that exactly the given
//! Services have one, on each listen address (the node's addresses matching
//! `nodePortAddresses`, or all addresses); [`ServiceHealthServer::sync_endpoints`] records the
//! local ready endpoint counts the answers are built from. Any GET or HEAD request, whatever
//! its path, gets a JSON answer with the Service's name, its local endpoint count and the
//! proxy's health: 200 when there is at least one local endpoint and the proxy is healthy, 503
//! otherwise. Each port has its own client limits ([`Limits`]: connection cap, timeouts, head
//! size; other methods get 405), so a flood on one port costs the others nothing but CPU. A
//! port that cannot be bound is logged and returned to the caller (to raise an event); the
//! Service is simply tried again on the next sync. Nothing here is ever fatal and nothing here decides when to sync.

use std::collections::BTreeMap;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use hyper::body::Incoming;
use hyper::header::HeaderValue;
use hyper::{Request, Response, StatusCode};
use tokio_util::sync::CancellationToken;

use crate::model::NamespacedName;
use crate::proxier::NetworkInterfaces;
use crate::proxier::nodeport_addresses::NodePortAddresses;
use crate::serve::health::ProxyHealthCheck;
use crate::serve::http::{self, Body, HttpError, Limits, ServerHandle, respond};
use crate::tracker::{HealthCheckNodePorts, LocalReadyEndpoints};

/// Header carrying the local endpoint count, for load balancers that weigh nodes by it.
pub(crate) const ENDPOINT_WEIGHT_HEADER: &str = "x-load-balancing-endpoint-weight";

#[derive(Debug, thiserror::Error)]
pub(crate) enum HealthCheckError {
    #[error("node {node} failed to start healthcheck \"{service}\" on port {port}: {source}")]
    Listen {
        node: String,
        service: NamespacedName,
        port: u16,
        #[source]
        source: HttpError,
    },
}

impl HealthCheckError {
    /// The Service whose health check could not be started (the object to put an event on).
    pub fn service(&self) -> &NamespacedName {
        match self {
            HealthCheckError::Listen { service, .. } => service,
        }
    }
}

/// The addresses health-check ports listen on: the node's addresses inside the
/// `nodePortAddresses` CIDRs of each family, or — when any family matches all addresses, or the
/// interfaces cannot be listed — the unspecified IPv6 address, which on Linux accepts IPv4 too
/// (falling back to `0.0.0.0` where IPv6 is off). An empty result means no address matched, so
/// no listener is opened (as upstream).
pub(crate) fn listen_addresses(families: &[&NodePortAddresses], interfaces: &dyn NetworkInterfaces) -> Vec<IpAddr> {
    let all = vec![IpAddr::V6(Ipv6Addr::UNSPECIFIED)];
    if families.is_empty() || families.iter().any(|n| n.match_all()) {
        return all;
    }
    let addrs = match interfaces.interface_addrs() {
        Ok(addrs) => addrs,
        Err(e) => {
            tracing::error!(
                error = %e,
                "failed to get node IP addresses matching nodePortAddresses; health check ports will listen on all node addresses"
            );
            return all;
        }
    };
    let mut out: Vec<IpAddr> = Vec::new();
    for family in families {
        for ip in family.node_ips(&addrs) {
            if !out.contains(&ip) {
                out.push(ip);
            }
        }
    }
    out
}

/// The JSON body of a health-check answer, byte for byte as upstream writes it.
pub(crate) fn response_body(service: &NamespacedName, local_endpoints: usize, proxy_healthy: bool) -> String {
    let quote = |s: &str| serde_json::to_string(s).unwrap_or_else(|_| format!("\"{s}\""));
    format!(
        "{{\n\t\"service\": {{\n\t\t\"namespace\": {},\n\t\t\"name\": {}\n\t}},\n\t\"localEndpoints\": {},\n\t\"serviceProxyHealthy\": {}\n}}",
        quote(&service.namespace),
        quote(&service.name),
        local_endpoints,
        proxy_healthy
    )
}

/// One Service's health check.
#[derive(Debug)]
struct Instance {
    port: u16,
    local_endpoints: usize,
    /// One per listen address; dropping them closes the listeners.
    servers: Vec<ServerHandle>,
}

struct Inner {
    node: String,
    proxy_health: Arc<dyn ProxyHealthCheck>,
    /// Held briefly by syncs and request handlers, never across an await.
    services: Mutex<BTreeMap<NamespacedName, Instance>>,
}

impl Inner {
    fn services(&self) -> MutexGuard<'_, BTreeMap<NamespacedName, Instance>> {
        self.services.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The health-check node port servers of this node.
pub struct ServiceHealthServer {
    inner: Arc<Inner>,
    listen_ips: Vec<IpAddr>,
    /// What each health-check port lets its clients hold (every port has its own cap).
    limits: Limits,
    /// Where the servers run (syncs may be called from outside the runtime).
    runtime: tokio::runtime::Handle,
    /// Parent of every server's token: cancelling it stops them all.
    cancel: CancellationToken,
}

impl std::fmt::Debug for ServiceHealthServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServiceHealthServer")
            .field("node", &self.inner.node)
            .field("listen_ips", &self.listen_ips)
            .field("services", &*self.inner.services())
            .finish_non_exhaustive()
    }
}

impl ServiceHealthServer {
    /// `node` names this node in messages; `listen_ips` comes from [`listen_addresses`];
    /// `proxy_health` decides `serviceProxyHealthy`. Servers run on `runtime` until they are
    /// closed by a sync, this value is dropped, or `cancel` fires.
    pub fn new(
        node: impl Into<String>,
        listen_ips: Vec<IpAddr>,
        proxy_health: Arc<dyn ProxyHealthCheck>,
        runtime: tokio::runtime::Handle,
        cancel: CancellationToken,
    ) -> Self {
        ServiceHealthServer {
            inner: Arc::new(Inner { node: node.into(), proxy_health, services: Mutex::new(BTreeMap::new()) }),
            listen_ips,
            limits: Limits::default(),
            runtime,
            cancel,
        }
    }

    /// Other client limits for the ports opened from now on (tests use short timeouts).
    #[cfg(test)]
    #[must_use]
    pub(crate) fn with_limits(mut self, limits: Limits) -> Self {
        self.limits = limits;
        self
    }

    /// Makes the set of health checks exactly `services` (Service → port): closes those no
    /// longer wanted or whose port changed, keeps the others, opens the new ones. Returns the
    /// health checks that could not be started; they are retried on the next call.
    pub(crate) fn sync_services(&self, services: &HealthCheckNodePorts) -> Vec<HealthCheckError> {
        let mut current = self.inner.services();
        current.retain(|name, instance| {
            let keep = services.get(name) == Some(&instance.port);
            if !keep {
                tracing::info!(service = %name, port = instance.port, "closing healthcheck");
                for server in &instance.servers {
                    server.close();
                }
            }
            keep
        });

        let mut failures = Vec::new();
        for (name, &port) in services {
            if current.contains_key(name) {
                tracing::trace!(service = %name, port, "existing healthcheck");
                continue;
            }
            tracing::info!(service = %name, port, "opening healthcheck");
            match self.listen_all(name, port) {
                Ok(servers) => {
                    current.insert(name.clone(), Instance { port, local_endpoints: 0, servers });
                }
                Err(source) => {
                    let err =
                        HealthCheckError::Listen { node: self.inner.node.clone(), service: name.clone(), port, source };
                    tracing::error!(error = %err, node = %self.inner.node, service = %name, port, "failed to start healthcheck");
                    failures.push(err);
                }
            }
        }
        failures
    }

    /// Records local ready endpoint counts; health checks of Services not in `counts` report
    /// zero, and counts of Services without a health check are ignored.
    pub(crate) fn sync_endpoints(&self, counts: &LocalReadyEndpoints) {
        let mut current = self.inner.services();
        for (name, instance) in current.iter_mut() {
            let count = counts.get(name).copied().unwrap_or(0);
            if count != instance.local_endpoints {
                tracing::debug!(service = %name, endpoints = count, "reporting endpoints for healthcheck");
            }
            instance.local_endpoints = count;
        }
    }

    /// The listening addresses of every open health check.
    pub fn listeners(&self) -> BTreeMap<NamespacedName, Vec<SocketAddr>> {
        self.inner
            .services()
            .iter()
            .map(|(name, instance)| (name.clone(), instance.servers.iter().map(ServerHandle::local_addr).collect()))
            .collect()
    }

    /// Closes every health check.
    pub(crate) fn close_all(&self) {
        let mut current = self.inner.services();
        for instance in current.values() {
            for server in &instance.servers {
                server.close();
            }
        }
        current.clear();
    }

    /// Opens `port` on every listen address; on any failure closes what was opened.
    fn listen_all(&self, name: &NamespacedName, port: u16) -> Result<Vec<ServerHandle>, HttpError> {
        let handler: Arc<dyn http::Handler> = Arc::new(HcHandler { inner: self.inner.clone(), name: name.clone() });
        let mut servers = Vec::with_capacity(self.listen_ips.len());
        for &ip in &self.listen_ips {
            let listener = bind(SocketAddr::new(ip, port), &self.runtime)?;
            let addr =
                listener.local_addr().map_err(|source| HttpError::Register { addr: (ip, port).into(), source })?;
            // On error the servers opened so far are dropped, which closes them.
            let server = http::spawn(&self.runtime, listener, handler.clone(), self.limits, self.cancel.clone())
                .map_err(|source| HttpError::Register { addr, source })?;
            tracing::debug!(service = %name, address = %addr, "healthcheck listening");
            servers.push(server);
        }
        Ok(servers)
    }
}

impl Drop for ServiceHealthServer {
    fn drop(&mut self) {
        self.close_all();
    }
}

/// Binds `addr`; the unspecified IPv6 address falls back to `0.0.0.0` when IPv6 is unusable.
fn bind(addr: SocketAddr, runtime: &tokio::runtime::Handle) -> Result<tokio::net::TcpListener, HttpError> {
    match http::bind_sync(addr, runtime) {
        Err(HttpError::Bind { source, .. })
            if addr.ip() == IpAddr::V6(Ipv6Addr::UNSPECIFIED) && !ipv6_bind_error_is_final(&source) =>
        {
            http::bind_sync(SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), addr.port()), runtime)
        }
        other => other,
    }
}

/// Errors that would happen on `0.0.0.0` too, so falling back is pointless.
fn ipv6_bind_error_is_final(e: &io::Error) -> bool {
    matches!(e.kind(), io::ErrorKind::AddrInUse | io::ErrorKind::PermissionDenied)
}

struct HcHandler {
    inner: Arc<Inner>,
    name: NamespacedName,
}

impl http::Handler for HcHandler {
    fn handle(&self, _req: &Request<Incoming>) -> Response<Body> {
        let count = self.inner.services().get(&self.name).map(|instance| instance.local_endpoints);
        let Some(count) = count else {
            // Upstream answers an empty 200 here; a closed health check must not attract
            // traffic, so this says 503.
            tracing::error!(service = %self.name, "received request for closed healthcheck");
            return respond(StatusCode::SERVICE_UNAVAILABLE, "application/json", "");
        };
        let healthy = self.inner.proxy_health.is_healthy();
        let status = if count != 0 && healthy { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
        let mut resp = respond(status, "application/json", response_body(&self.name, count, healthy));
        resp.headers_mut().insert(ENDPOINT_WEIGHT_HEADER, HeaderValue::from(count));
        resp
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};

    use super::*;
    use crate::model::IpFamily;
    use crate::proxier::StaticInterfaces;
    use crate::serve::http::test_client::{get, request, silent_connection_closed};

    #[derive(Default)]
    struct FakeHealth(AtomicBool);

    impl ProxyHealthCheck for FakeHealth {
        fn is_healthy(&self) -> bool {
            self.0.load(Ordering::SeqCst)
        }
    }

    fn nn(ns: &str, name: &str) -> NamespacedName {
        NamespacedName::new(ns, name)
    }

    fn free_port() -> u16 {
        std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
    }

    fn loopback(port: u16) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], port))
    }

    fn server(health: Arc<FakeHealth>, ips: Vec<IpAddr>) -> ServiceHealthServer {
        ServiceHealthServer::new("node-a", ips, health, tokio::runtime::Handle::current(), CancellationToken::new())
    }

    #[test]
    fn body_is_upstreams_dedented_json() {
        let body = response_body(&nn("default", "wp-nginx-service"), 1, true);
        assert_eq!(
            body,
            "{\n\t\"service\": {\n\t\t\"namespace\": \"default\",\n\t\t\"name\": \"wp-nginx-service\"\n\t},\n\t\"localEndpoints\": 1,\n\t\"serviceProxyHealthy\": true\n}"
        );
        // Upstream's answer for this Service is 127 bytes long.
        assert_eq!(body.len(), 127);
    }

    #[test]
    fn listen_addresses_follow_node_port_addresses() {
        let ifaces = StaticInterfaces(vec![
            "10.0.0.5".parse().unwrap(),
            "192.168.1.2".parse().unwrap(),
            "fd00::5".parse().unwrap(),
        ]);
        let all = NodePortAddresses::new(IpFamily::V4, &[]);
        assert_eq!(listen_addresses(&[&all], &ifaces), vec![IpAddr::V6(Ipv6Addr::UNSPECIFIED)]);
        let v4 = NodePortAddresses::new(IpFamily::V4, &["192.168.0.0/16".to_string()]);
        let v6 = NodePortAddresses::new(IpFamily::V6, &["fd00::/8".to_string()]);
        assert_eq!(
            listen_addresses(&[&v4, &v6], &ifaces),
            vec!["192.168.1.2".parse::<IpAddr>().unwrap(), "fd00::5".parse().unwrap()]
        );
        let none = NodePortAddresses::new(IpFamily::V4, &["172.16.0.0/12".to_string()]);
        assert!(listen_addresses(&[&none], &ifaces).is_empty());

        struct Broken;
        impl NetworkInterfaces for Broken {
            fn interface_addrs(&self) -> io::Result<Vec<IpAddr>> {
                Err(io::Error::other("netlink unavailable"))
            }
        }
        assert_eq!(listen_addresses(&[&v4], &Broken), vec![IpAddr::V6(Ipv6Addr::UNSPECIFIED)]);
    }

    #[tokio::test]
    async fn answers_follow_endpoints_and_proxy_health() {
        let health = Arc::new(FakeHealth(AtomicBool::new(true)));
        let hc = server(health.clone(), vec![IpAddr::V4(Ipv4Addr::LOCALHOST)]);
        let (p1, p2) = (free_port(), free_port());
        let web = nn("ns1", "web");
        let db = nn("ns2", "db");
        let failures = hc.sync_services(&BTreeMap::from([(web.clone(), p1), (db.clone(), p2)]));
        assert!(failures.is_empty(), "{failures:?}");
        assert_eq!(hc.listeners()[&web], vec![loopback(p1)]);

        // No local endpoint yet: 503.
        let resp = get(loopback(p1), "/").await;
        assert_eq!(resp.status, 503);
        assert_eq!(resp.header(ENDPOINT_WEIGHT_HEADER), Some("0"));
        let body = resp.json();
        assert_eq!(body["service"]["namespace"], "ns1");
        assert_eq!(body["service"]["name"], "web");
        assert_eq!(body["localEndpoints"], 0);
        assert_eq!(body["serviceProxyHealthy"], true);

        // An endpoint becomes local and ready: 200, whatever the path; GET and HEAD alike.
        hc.sync_endpoints(&BTreeMap::from([(web.clone(), 2), (nn("ns3", "no-healthcheck"), 5)]));
        let resp = get(loopback(p1), "/healthz").await;
        assert_eq!(resp.status, 200);
        assert_eq!(resp.header("content-type"), Some("application/json"));
        assert_eq!(resp.header("x-content-type-options"), Some("nosniff"));
        assert_eq!(resp.header(ENDPOINT_WEIGHT_HEADER), Some("2"));
        assert_eq!(resp.body, response_body(&web, 2, true));
        assert!(resp.raw_head.contains("\r\nX-Load-Balancing-Endpoint-Weight: 2\r\n"), "{}", resp.raw_head);
        assert_eq!(request(loopback(p1), "HEAD", "/").await.unwrap().status, 200);
        let refused = request(loopback(p1), "POST", "/").await.unwrap();
        assert_eq!((refused.status, refused.header("allow")), (405, Some("GET, HEAD")));
        assert_eq!(get(loopback(p2), "/").await.status, 503);

        // The proxy falls behind: 503 even with local endpoints.
        health.0.store(false, Ordering::SeqCst);
        let resp = get(loopback(p1), "/").await;
        assert_eq!(resp.status, 503);
        assert_eq!(resp.json()["serviceProxyHealthy"], false);
        assert_eq!(resp.json()["localEndpoints"], 2);
        health.0.store(true, Ordering::SeqCst);

        // Endpoints gone from the map: back to zero.
        hc.sync_endpoints(&BTreeMap::new());
        assert_eq!(get(loopback(p1), "/").await.json()["localEndpoints"], 0);

        // db goes away, web moves to another port: the old ports close at once.
        let p3 = free_port();
        let failures = hc.sync_services(&BTreeMap::from([(web.clone(), p3)]));
        assert!(failures.is_empty(), "{failures:?}");
        assert!(request(loopback(p2), "GET", "/").await.is_err(), "db's port still open");
        assert!(request(loopback(p1), "GET", "/").await.is_err(), "web's old port still open");
        assert_eq!(get(loopback(p3), "/").await.status, 503);
        assert_eq!(hc.listeners().keys().cloned().collect::<Vec<_>>(), vec![web.clone()]);

        // Another service can take a port given up in the same sync.
        let failures = hc.sync_services(&BTreeMap::from([(web.clone(), p1), (db.clone(), p3)]));
        assert!(failures.is_empty(), "{failures:?}");
        assert_eq!(get(loopback(p3), "/").await.json()["service"]["name"], "db");

        drop(hc);
        assert!(request(loopback(p1), "GET", "/").await.is_err(), "dropping the server closes its ports");
    }

    #[tokio::test]
    async fn health_check_ports_apply_their_client_limits() {
        let health = Arc::new(FakeHealth(AtomicBool::new(true)));
        let limits = Limits {
            idle_timeout: std::time::Duration::from_millis(100),
            header_read_timeout: std::time::Duration::from_secs(600),
            ..Limits::default()
        };
        let hc = server(health, vec![IpAddr::V4(Ipv4Addr::LOCALHOST)]).with_limits(limits);
        let port = free_port();
        assert!(hc.sync_services(&BTreeMap::from([(nn("ns", "lb"), port)])).is_empty());
        assert!(silent_connection_closed(loopback(port), std::time::Duration::from_secs(20)).await);
        assert_eq!(get(loopback(port), "/").await.status, 503);
    }

    #[tokio::test]
    async fn a_port_in_use_is_reported_and_retried() {
        let health = Arc::new(FakeHealth(AtomicBool::new(true)));
        let hc = server(health, vec![IpAddr::V4(Ipv4Addr::LOCALHOST)]);
        let squatter = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = squatter.local_addr().unwrap().port();
        let ok_port = free_port();
        let svc = nn("ns", "lb");
        let wanted = BTreeMap::from([(svc.clone(), port), (nn("ns", "other"), ok_port)]);

        let failures = hc.sync_services(&wanted);
        assert_eq!(failures.len(), 1);
        assert_eq!(failures[0].service(), &svc);
        let msg = failures[0].to_string();
        assert!(
            msg.starts_with(&format!("node node-a failed to start healthcheck \"ns/lb\" on port {port}: ")),
            "{msg}"
        );
        // The other service is unaffected.
        assert_eq!(get(loopback(ok_port), "/").await.status, 503);
        assert!(!hc.listeners().contains_key(&svc));

        // The next sync tries again and succeeds once the port is free.
        drop(squatter);
        assert!(hc.sync_services(&wanted).is_empty());
        hc.sync_endpoints(&BTreeMap::from([(svc.clone(), 1)]));
        assert_eq!(get(loopback(port), "/").await.status, 200);
    }

    #[tokio::test]
    async fn all_addresses_by_default() {
        let health = Arc::new(FakeHealth(AtomicBool::new(true)));
        let hc = server(health, listen_addresses(&[], &StaticInterfaces::default()));
        let port = free_port();
        let svc = nn("ns", "any");
        assert!(hc.sync_services(&BTreeMap::from([(svc.clone(), port)])).is_empty());
        hc.sync_endpoints(&BTreeMap::from([(svc, 1)]));
        // The wildcard listener (dual-stack `[::]`, or `0.0.0.0` without IPv6) answers on
        // loopback.
        assert_eq!(get(loopback(port), "/").await.status, 200);
    }

    #[tokio::test]
    async fn cancelling_the_parent_token_stops_serving() {
        let health = Arc::new(FakeHealth(AtomicBool::new(true)));
        let cancel = CancellationToken::new();
        let hc = ServiceHealthServer::new(
            "node-a",
            vec![IpAddr::V4(Ipv4Addr::LOCALHOST)],
            health,
            tokio::runtime::Handle::current(),
            cancel.clone(),
        );
        let port = free_port();
        assert!(hc.sync_services(&BTreeMap::from([(nn("ns", "s"), port)])).is_empty());
        assert_eq!(get(loopback(port), "/").await.status, 503);
        cancel.cancel();
        // The accept loop drops the listener once it sees the cancellation.
        let mut closed = false;
        for _ in 0..100 {
            if request(loopback(port), "GET", "/").await.is_err() {
                closed = true;
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        assert!(closed, "listener still open after cancellation");
    }
}
