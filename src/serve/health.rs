//! The proxier's own health (upstream `ProxierHealthServer`) and the two node-level HTTP
//! servers: the health server on `healthzBindAddress` (`/healthz`, `/livez`) and the metrics
//! server on `metricsBindAddress` (`/metrics`, `/healthz`, `/proxyMode`, `/configz`).
//!
//! [`ProxierHealth`] is the pure state machine: it is told when an update was queued and when
//! rules were written, per IP family, and given `now` to decide. The proxier is healthy while
//! every family that has synced at least once has applied its oldest queued update within the
//! health timeout (upstream uses 2 × `iptables.syncPeriod`). `/healthz` additionally reports
//! the node ineligible (503) while the Node is being deleted or carries the cluster
//! autoscaler's `ToBeDeletedByClusterAutoscaler` taint, so load balancers drain it first.
//! The probe bodies follow the emulated release: up to 1.32 upstream wrote them with
//! `fmt.Fprintf` (Go's `time.Time.String()`); from 1.33 they are `json.Marshal` of a struct
//! with RFC 3339 times and a per-family `status`, and a proxy that knows no Node object is
//! not eligible (before, it was eligible until a Node event said otherwise).
//! [`ProxierHealthServer`] wraps the state with a [`Clock`] for the HTTP handlers and the
//! per-service health checks ([`ProxyHealthCheck`]). This module never touches iptables and
//! never decides when to sync.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use jiff::Timestamp;
use k8s_openapi::api::core::v1::Node;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::compat::Release;
use crate::metrics::{self, Metrics};
use crate::model::IpFamily;
use crate::serve::http::{self, Body, Limits, respond};

/// Taint the cluster autoscaler puts on a node it is about to delete.
pub const TO_BE_DELETED_TAINT: &str = "ToBeDeletedByClusterAutoscaler";

/// What `/proxyMode` answers unless told the mode ([`MetricsServer::with_proxy_mode`]).
pub const PROXY_MODE: &str = "iptables";

/// The key `/configz` files the configuration under (the API group of
/// KubeProxyConfiguration).
pub const CONFIGZ_KEY: &str = "kubeproxy.config.k8s.io";

/// The first release whose probe bodies are `json.Marshal` output and whose node
/// eligibility needs a known Node (upstream PR #129271; release inferred, see
/// docs/upstream-versions.md rows 11, 12).
pub const JSON_BODIES_SINCE: Release = Release::V1_33;

const JSON: &str = "application/json";
const TEXT: &str = "text/plain; charset=utf-8";

#[derive(Debug, thiserror::Error)]
pub enum HealthError {
    #[error("failed to encode the configuration for /configz: {0}")]
    Configz(#[source] serde_json::Error),
}

/// Where "now" comes from; injected so tests control time.
pub trait Clock: Send + Sync {
    fn now(&self) -> SystemTime;
}

/// The system's wall clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> SystemTime {
        SystemTime::now()
    }
}

/// A clock that moves only when told to.
#[cfg(any(test, feature = "testing"))]
#[derive(Debug)]
pub struct FakeClock {
    now: Mutex<SystemTime>,
}

#[cfg(any(test, feature = "testing"))]
impl FakeClock {
    pub fn new(now: SystemTime) -> Self {
        FakeClock { now: Mutex::new(now) }
    }

    pub fn set(&self, now: SystemTime) {
        *self.now.lock().unwrap_or_else(PoisonError::into_inner) = now;
    }

    pub fn advance(&self, by: Duration) {
        let mut now = self.now.lock().unwrap_or_else(PoisonError::into_inner);
        *now += by;
    }
}

#[cfg(any(test, feature = "testing"))]
impl Clock for FakeClock {
    fn now(&self) -> SystemTime {
        *self.now.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Whether the proxy is programming rules in time (node eligibility aside); what the
/// per-service health checks report as `serviceProxyHealthy`.
pub trait ProxyHealthCheck: Send + Sync {
    fn is_healthy(&self) -> bool;
}

/// The proxy's health at one instant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Health {
    pub healthy: bool,
    /// The latest successful sync of any family when healthy; when unhealthy, the last
    /// successful sync of the family that is late. `None` before any sync.
    pub last_updated: Option<SystemTime>,
}

/// One probe answer: status and the exact JSON body upstream writes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProbeResponse {
    pub healthy: bool,
    pub body: String,
}

impl ProbeResponse {
    pub fn status(&self) -> StatusCode {
        if self.healthy { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE }
    }
}

/// Where a sync stands in its family's queue of updates: the number queued before it took
/// its changes ([`ProxierHealth::sync_starting`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SyncMark(u64);

/// The proxier health state machine (pure: every decision takes `now`).
#[derive(Debug, Clone)]
pub struct ProxierHealth {
    health_timeout: Duration,
    last_updated: BTreeMap<IpFamily, SystemTime>,
    /// Per family, when the oldest update not yet applied was queued.
    oldest_pending_queued: BTreeMap<IpFamily, SystemTime>,
    /// Per family, how many updates were ever queued: a sync's [`SyncMark`] is this count
    /// when it started, so what was queued after it is told apart exactly.
    queued_count: BTreeMap<IpFamily, u64>,
    /// Per family, the running sync's mark and when the first update after it was queued:
    /// what stays pending when that sync succeeds ([`ProxierHealth::synced`]).
    running: BTreeMap<IpFamily, (SyncMark, Option<SystemTime>)>,
    /// Per family, when the sync in progress last showed progress (it finished one of the
    /// transactions a large restore is split into).
    last_progress: BTreeMap<IpFamily, SystemTime>,
    /// Eligibility from the last Node object seen; `None` while no Node is known (none yet,
    /// or it was deleted).
    node_eligible: Option<bool>,
    /// Selects the body format and what an unknown Node means.
    release: Release,
}

/// One family's state in the 1.33+ body (`ProxierHealth` upstream).
#[derive(serde::Serialize)]
struct FamilyBody {
    #[serde(rename = "lastUpdated")]
    last_updated: String,
    healthy: bool,
}

/// The 1.33+ body (`ProxyHealth` upstream); field order is the JSON key order.
#[derive(serde::Serialize)]
struct JsonBody {
    #[serde(rename = "lastUpdated")]
    last_updated: String,
    #[serde(rename = "currentTime")]
    current_time: String,
    #[serde(rename = "nodeEligible", skip_serializing_if = "Option::is_none")]
    node_eligible: Option<bool>,
    healthy: bool,
    /// Keyed by the API family name; a BTreeMap sorts as Go's encoder does.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    status: BTreeMap<&'static str, FamilyBody>,
}

impl ProxierHealth {
    /// `health_timeout` is how late a queued update may be; kube-proxy uses 2 × syncPeriod.
    /// `release` selects the probe bodies and node eligibility rules.
    pub fn new(health_timeout: Duration, release: Release) -> Self {
        ProxierHealth {
            health_timeout,
            last_updated: BTreeMap::new(),
            oldest_pending_queued: BTreeMap::new(),
            queued_count: BTreeMap::new(),
            running: BTreeMap::new(),
            last_progress: BTreeMap::new(),
            node_eligible: None,
            release,
        }
    }

    pub fn release(&self) -> Release {
        self.release
    }

    fn json_bodies(&self) -> bool {
        self.release >= JSON_BODIES_SINCE
    }

    pub fn health_timeout(&self) -> Duration {
        self.health_timeout
    }

    /// The proxier of `family` received a change it has not yet written. Only the oldest
    /// pending change counts: later calls do not move the deadline.
    pub fn queued_update(&mut self, family: IpFamily, now: SystemTime) {
        self.oldest_pending_queued.entry(family).or_insert(now);
        *self.queued_count.entry(family).or_default() += 1;
        if let Some((_, first_after)) = self.running.get_mut(&family) {
            first_after.get_or_insert(now);
        }
    }

    /// A sync of `family` is about to take its changes: every update queued so far is in
    /// it (the watches record a change before they queue its update), any later one is not.
    pub fn sync_starting(&mut self, family: IpFamily) -> SyncMark {
        let mark = SyncMark(self.queued_count.get(&family).copied().unwrap_or(0));
        self.running.insert(family, (mark, None));
        mark
    }

    /// The sync of `family` is making progress (it applied one step of a restore split
    /// into several): a long sync that keeps moving is not late.
    pub fn sync_progress(&mut self, family: IpFamily, now: SystemTime) {
        self.last_progress.insert(family, now);
    }

    /// The sync of `family` failed: the steps it applied do not count as progress (a sync
    /// that fails again and again is not alive because each attempt gets some way).
    pub fn sync_failed(&mut self, family: IpFamily) {
        self.last_progress.remove(&family);
        self.running.remove(&family);
    }

    /// The proxier of `family` wrote rules reflecting everything queued so far.
    pub fn updated(&mut self, family: IpFamily, now: SystemTime) {
        let mark = self.sync_starting(family);
        self.synced(family, mark, now);
    }

    /// The sync of `family` that started at `mark` succeeded at `now`: what was queued
    /// before the mark is written. A change queued after it (one watch event arriving while
    /// the sync of another runs) is still pending, judged from its own queueing, or a sync
    /// after it that fails would never count as late. (Upstream clears the mark whatever was
    /// queued during the sync; the next sync, which that queueing requested, clears it here.)
    /// A mark, not a time: a start time worked out from the sync's duration lands after the
    /// real start whenever the report is late, and a change queued in between was lost.
    pub fn synced(&mut self, family: IpFamily, mark: SyncMark, now: SystemTime) {
        let queued = self.queued_count.get(&family).copied().unwrap_or(0);
        let first_after = match self.running.remove(&family) {
            Some((running, first_after)) if running == mark => first_after,
            // Not the running sync's mark (a caller's mistake): judge what came after it
            // from now, the latest it can have been queued.
            _ => Some(now),
        };
        if queued > mark.0 {
            self.oldest_pending_queued.insert(family, first_after.unwrap_or(now));
        } else {
            self.oldest_pending_queued.remove(&family);
        }
        self.last_progress.remove(&family);
        self.last_updated.insert(family, now);
    }

    /// Records this node's eligibility for load-balancer traffic from its Node object (on
    /// add, update and delete events alike).
    pub fn sync_node(&mut self, node: &Node) {
        self.node_eligible = Some(node_eligible(node));
    }

    /// The Node object is gone. From 1.33 that makes the node ineligible (no Node known);
    /// 1.29 kept the eligibility of the last object seen.
    pub fn node_deleted(&mut self) {
        if self.json_bodies() {
            self.node_eligible = None;
        }
    }

    /// 1.29 treats a node as eligible until a Node event says otherwise; from 1.33 a node
    /// nobody has seen is not eligible.
    pub fn node_eligible(&self) -> bool {
        self.node_eligible.unwrap_or(!self.json_bodies())
    }

    /// Healthy unless a family that has synced at least once has an update queued for
    /// `health_timeout` or longer, with no sync progress in that time either (upstream
    /// counts from the queueing alone; a sync that takes longer than the timeout but keeps
    /// applying steps is alive, one stuck in a step is not). A family that never synced is
    /// not judged (the sync loop marks each family updated when it starts).
    pub fn health(&self, now: SystemTime) -> Health {
        let mut last_updated: Option<SystemTime> = None;
        for (&family, &family_updated) in &self.last_updated {
            last_updated = Some(last_updated.map_or(family_updated, |t| t.max(family_updated)));
            if self.family_late(family, now) {
                return Health { healthy: false, last_updated: Some(family_updated) };
            }
        }
        Health { healthy: true, last_updated }
    }

    pub fn is_healthy(&self, now: SystemTime) -> bool {
        self.health(now).healthy
    }

    /// Whether `family` (which has synced) has an update late by the rule of [`Self::health`].
    fn family_late(&self, family: IpFamily, now: SystemTime) -> bool {
        let Some(&queued) = self.oldest_pending_queued.get(&family) else {
            return false;
        };
        let since = self.last_progress.get(&family).map_or(queued, |&p| p.max(queued));
        // A clock that went backwards counts as no time passed.
        now.duration_since(since).unwrap_or_default() >= self.health_timeout
    }

    /// `/healthz`: healthy and the node eligible. When healthy, `lastUpdated` is `now`, as
    /// upstream keeps for compatibility with releases where it meant "the sync loop ran".
    pub fn healthz(&self, now: SystemTime) -> ProbeResponse {
        let health = self.health(now);
        let eligible = self.node_eligible();
        let healthy = health.healthy && eligible;
        if self.json_bodies() {
            return ProbeResponse { healthy, body: self.json_body(now, healthy, Some(eligible)) };
        }
        let last_updated = if healthy { Some(now) } else { health.last_updated };
        let body = format!(
            r#"{{"lastUpdated": "{}","currentTime": "{}", "nodeEligible": {}}}"#,
            go_time_string(last_updated),
            go_time_string(Some(now)),
            eligible
        );
        ProbeResponse { healthy, body }
    }

    /// `/livez`: the proxy's health alone (a node being drained is still alive).
    pub fn livez(&self, now: SystemTime) -> ProbeResponse {
        let health = self.health(now);
        if self.json_bodies() {
            return ProbeResponse { healthy: health.healthy, body: self.json_body(now, health.healthy, None) };
        }
        let last_updated = if health.healthy { Some(now) } else { health.last_updated };
        let body = format!(
            r#"{{"lastUpdated": "{}","currentTime": "{}"}}"#,
            go_time_string(last_updated),
            go_time_string(Some(now))
        );
        ProbeResponse { healthy: health.healthy, body }
    }

    /// The 1.33+ body. `healthy` is the answer's (for `/healthz` it includes eligibility):
    /// when true, the top-level `lastUpdated` is `now`; otherwise it is the newest sync of
    /// any family (upstream's `Health()`, unlike 1.29's late family), and `healthy` in the
    /// body is the proxy's own health, without eligibility, as upstream writes it.
    fn json_body(&self, now: SystemTime, healthy: bool, node_eligible: Option<bool>) -> String {
        let mut proxy_healthy = true;
        let mut status = BTreeMap::new();
        for (&family, &updated) in &self.last_updated {
            let family_healthy = !self.family_late(family, now);
            proxy_healthy &= family_healthy;
            status.insert(
                family.api_name(),
                FamilyBody { last_updated: go_rfc3339_nano(Some(updated)), healthy: family_healthy },
            );
        }
        let newest = self.last_updated.values().max().copied();
        let body = JsonBody {
            last_updated: go_rfc3339_nano(if healthy { Some(now) } else { newest }),
            current_time: go_rfc3339_nano(Some(now)),
            node_eligible,
            healthy: proxy_healthy,
            status,
        };
        // Strings, bools and maps of them: serialising cannot fail.
        serde_json::to_string(&body).unwrap_or_default()
    }
}

/// A node is eligible for load-balancer traffic unless it is being deleted or the cluster
/// autoscaler has marked it for deletion.
pub fn node_eligible(node: &Node) -> bool {
    if node.metadata.deletion_timestamp.is_some() {
        return false;
    }
    let taints = node.spec.as_ref().and_then(|spec| spec.taints.as_deref()).unwrap_or_default();
    !taints.iter().any(|taint| taint.key == TO_BE_DELETED_TAINT)
}

/// Go's zero `time.Time`, 0001-01-01 00:00:00 UTC: what Go prints for a time never set.
const GO_ZERO_TIME: Timestamp = Timestamp::constant(-62_135_596_800, 0);

/// A time as Go's `time.Time.String()` prints it in UTC (`2006-01-02 15:04:05.999999999 -0700
/// MST`, fraction trimmed), which is what upstream's probe bodies carry. `None` is Go's zero
/// time. Go also appends the monotonic clock reading (`m=+1.5`); that is process-local and
/// left out.
pub fn go_time_string(t: Option<SystemTime>) -> String {
    go_format("%Y-%m-%d %H:%M:%S%.f +0000 UTC", t)
}

/// A time as Go's `json.Marshal` writes a `time.Time` in UTC: `time.RFC3339Nano`
/// (`2006-01-02T15:04:05.999999999Z07:00`, fraction trimmed of trailing zeros, `Z` for
/// UTC). `None` is Go's zero time.
pub fn go_rfc3339_nano(t: Option<SystemTime>) -> String {
    go_format("%Y-%m-%dT%H:%M:%S%.fZ", t)
}

/// `t` (Go's zero time for `None`) in UTC through a strftime `format`. jiff's `%Y` pads to
/// four digits and `%.f` trims trailing zeros (nothing for a whole second), as Go's layouts
/// do.
fn go_format(format: &str, t: Option<SystemTime>) -> String {
    let timestamp = match t {
        None => GO_ZERO_TIME,
        // jiff spans years -9999 to 9999; a clock outside them is clamped to the nearest end
        // (Go would print the year, but no clock that the probes report reads one).
        Some(t) => Timestamp::try_from(t).unwrap_or(if t < UNIX_EPOCH { Timestamp::MIN } else { Timestamp::MAX }),
    };
    // A timestamp has every field these formats name: formatting cannot fail.
    jiff::fmt::strtime::format(format, timestamp).unwrap_or_default()
}

/// The proxier health shared by the sync loop (writer) and the HTTP handlers (readers).
pub struct ProxierHealthServer {
    /// Held only to read or update the state, never across an await.
    state: Mutex<ProxierHealth>,
    clock: Arc<dyn Clock>,
    metrics: Option<Arc<Metrics>>,
}

impl std::fmt::Debug for ProxierHealthServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProxierHealthServer").field("state", &self.state).finish_non_exhaustive()
    }
}

impl ProxierHealthServer {
    /// `metrics`, when given, counts `/healthz` and `/livez` answers by status code;
    /// `release` selects the bodies (see [`ProxierHealth::new`]).
    pub fn new(
        health_timeout: Duration,
        release: Release,
        clock: Arc<dyn Clock>,
        metrics: Option<Arc<Metrics>>,
    ) -> Self {
        ProxierHealthServer { state: Mutex::new(ProxierHealth::new(health_timeout, release)), clock, metrics }
    }

    fn with_state<T>(&self, f: impl FnOnce(&mut ProxierHealth) -> T) -> T {
        f(&mut self.state.lock().unwrap_or_else(PoisonError::into_inner))
    }

    /// See [`ProxierHealth::queued_update`].
    pub fn queued_update(&self, family: IpFamily) {
        let now = self.clock.now();
        self.with_state(|s| s.queued_update(family, now));
    }

    /// See [`ProxierHealth::sync_progress`].
    pub fn sync_progress(&self, family: IpFamily) {
        let now = self.clock.now();
        self.with_state(|s| s.sync_progress(family, now));
    }

    /// See [`ProxierHealth::sync_failed`].
    pub fn sync_failed(&self, family: IpFamily) {
        self.with_state(|s| s.sync_failed(family));
    }

    /// See [`ProxierHealth::updated`].
    pub fn updated(&self, family: IpFamily) {
        let now = self.clock.now();
        self.with_state(|s| s.updated(family, now));
    }

    /// See [`ProxierHealth::sync_starting`].
    pub fn sync_starting(&self, family: IpFamily) -> SyncMark {
        self.with_state(|s| s.sync_starting(family))
    }

    /// See [`ProxierHealth::synced`]: the sync that started at `mark` has just succeeded.
    pub fn synced(&self, family: IpFamily, mark: SyncMark) {
        let now = self.clock.now();
        self.with_state(|s| s.synced(family, mark, now));
    }

    /// See [`ProxierHealth::sync_node`].
    pub fn sync_node(&self, node: &Node) {
        let eligible = self.with_state(|s| {
            s.sync_node(node);
            s.node_eligible()
        });
        tracing::debug!(node = node.metadata.name.as_deref().unwrap_or(""), eligible, "node eligibility");
    }

    /// See [`ProxierHealth::node_deleted`].
    pub fn node_deleted(&self) {
        let eligible = self.with_state(|s| {
            s.node_deleted();
            s.node_eligible()
        });
        tracing::debug!(eligible, "node deleted");
    }

    pub fn node_eligible(&self) -> bool {
        self.with_state(|s| s.node_eligible())
    }

    pub fn health(&self) -> Health {
        let now = self.clock.now();
        self.with_state(|s| s.health(now))
    }

    /// Answers `/healthz` (and counts it).
    pub fn healthz(&self) -> ProbeResponse {
        let now = self.clock.now();
        let resp = self.with_state(|s| s.healthz(now));
        if let Some(m) = &self.metrics {
            m.healthz_answered(resp.status().as_u16());
        }
        resp
    }

    /// Answers `/livez` (and counts it).
    pub fn livez(&self) -> ProbeResponse {
        let now = self.clock.now();
        let resp = self.with_state(|s| s.livez(now));
        if let Some(m) = &self.metrics {
            m.livez_answered(resp.status().as_u16());
        }
        resp
    }

    fn handle(&self, req: &Request<Incoming>) -> Response<Body> {
        let probe = match req.uri().path() {
            "/healthz" => self.healthz(),
            "/livez" => self.livez(),
            _ => return http::not_found(),
        };
        respond(probe.status(), JSON, probe.body)
    }

    /// Serves `/healthz` and `/livez` on `listener` until `cancel` fires, with the
    /// production [`Limits`].
    pub async fn serve(self: Arc<Self>, listener: TcpListener, cancel: CancellationToken) {
        self.serve_with_limits(listener, Limits::default(), cancel).await;
    }

    /// [`Self::serve`] with other client limits (tests use short timeouts).
    pub async fn serve_with_limits(self: Arc<Self>, listener: TcpListener, limits: Limits, cancel: CancellationToken) {
        if let Ok(addr) = listener.local_addr() {
            tracing::info!(address = %addr, "starting healthz HTTP server");
        }
        let handler = Arc::new(move |req: &Request<Incoming>| self.handle(req));
        http::serve(listener, handler, limits, cancel).await;
    }
}

impl ProxyHealthCheck for ProxierHealthServer {
    fn is_healthy(&self) -> bool {
        self.health().healthy
    }
}

/// The metrics server: `/metrics`, `/healthz` (always `ok` while the process serves),
/// `/proxyMode` and `/configz`.
#[derive(Debug)]
pub struct MetricsServer {
    metrics: Arc<Metrics>,
    /// `/configz` body, rendered once.
    configz: String,
    /// What `/proxyMode` answers.
    proxy_mode: &'static str,
}

impl MetricsServer {
    /// `config` is what `/configz` shows (the effective KubeProxyConfiguration).
    pub fn new(metrics: Arc<Metrics>, config: &serde_json::Value) -> Result<Self, HealthError> {
        let mut doc = serde_json::Map::new();
        doc.insert(CONFIGZ_KEY.to_string(), config.clone());
        let configz = serde_json::to_string(&doc).map_err(HealthError::Configz)?;
        Ok(MetricsServer { metrics, configz, proxy_mode: PROXY_MODE })
    }

    /// `/proxyMode` answers `mode` (`iptables` or `nftables`).
    pub fn with_proxy_mode(mut self, mode: crate::config::ProxyMode) -> Self {
        self.proxy_mode = mode.as_str();
        self
    }

    fn handle(&self, req: &Request<Incoming>) -> Response<Body> {
        match req.uri().path() {
            "/metrics" => match self.metrics.encode_text() {
                Ok(text) => respond(StatusCode::OK, metrics::TEXT_CONTENT_TYPE, text),
                Err(e) => {
                    tracing::error!(error = %e, "failed to render /metrics");
                    respond(StatusCode::INTERNAL_SERVER_ERROR, TEXT, format!("{e}\n"))
                }
            },
            "/healthz" => {
                let verbose =
                    req.uri().query().is_some_and(|q| q.split('&').any(|kv| kv.split('=').next() == Some("verbose")));
                let body = if verbose { "[+]ping ok\nhealthz check passed\n" } else { "ok" };
                respond(StatusCode::OK, TEXT, body)
            }
            "/healthz/ping" => respond(StatusCode::OK, TEXT, "ok"),
            "/proxyMode" => respond(StatusCode::OK, TEXT, self.proxy_mode),
            "/configz" => respond(StatusCode::OK, JSON, self.configz.clone()),
            _ => http::not_found(),
        }
    }

    /// Serves until `cancel` fires, with the production [`Limits`].
    pub async fn serve(self: Arc<Self>, listener: TcpListener, cancel: CancellationToken) {
        self.serve_with_limits(listener, Limits::default(), cancel).await;
    }

    /// [`Self::serve`] with other client limits (tests use short timeouts).
    pub async fn serve_with_limits(self: Arc<Self>, listener: TcpListener, limits: Limits, cancel: CancellationToken) {
        if let Ok(addr) = listener.local_addr() {
            tracing::info!(address = %addr, "starting metrics HTTP server");
        }
        let handler = Arc::new(move |req: &Request<Incoming>| self.handle(req));
        http::serve(listener, handler, limits, cancel).await;
    }
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;

    use k8s_openapi::api::core::v1::{NodeSpec, Taint};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
    use k8s_openapi::jiff::Timestamp;

    use super::*;
    use crate::serve::http::test_client::{get, request, silent_connection_closed};

    const TIMEOUT: Duration = Duration::from_secs(60);

    fn at(secs: u64) -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(secs)
    }

    fn node(deleting: bool, taints: &[&str]) -> Node {
        Node {
            metadata: ObjectMeta {
                name: Some("node-a".into()),
                deletion_timestamp: deleting.then_some(Time(Timestamp::UNIX_EPOCH)),
                ..ObjectMeta::default()
            },
            spec: Some(NodeSpec {
                taints: Some(
                    taints
                        .iter()
                        .map(|k| Taint { key: k.to_string(), effect: "NoSchedule".into(), ..Taint::default() })
                        .collect(),
                ),
                ..NodeSpec::default()
            }),
            ..Node::default()
        }
    }

    #[test]
    fn go_time_format() {
        assert_eq!(go_time_string(None), "0001-01-01 00:00:00 +0000 UTC");
        assert_eq!(go_time_string(Some(UNIX_EPOCH)), "1970-01-01 00:00:00 +0000 UTC");
        assert_eq!(go_time_string(Some(at(1_700_000_000))), "2023-11-14 22:13:20 +0000 UTC");
        let t = at(951_825_600) + Duration::from_nanos(120_000_000); // 2000-02-29 12:00:00.12
        assert_eq!(go_time_string(Some(t)), "2000-02-29 12:00:00.12 +0000 UTC");
        assert_eq!(go_time_string(Some(at(0) + Duration::from_nanos(1))), "1970-01-01 00:00:00.000000001 +0000 UTC");
        let before = UNIX_EPOCH - Duration::from_millis(500);
        assert_eq!(go_time_string(Some(before)), "1969-12-31 23:59:59.5 +0000 UTC");
        // Trailing zeros of the fraction are trimmed, inner ones kept.
        assert_eq!(go_time_string(Some(at(0) + Duration::from_millis(100))), "1970-01-01 00:00:00.1 +0000 UTC");
        assert_eq!(
            go_time_string(Some(at(0) + Duration::from_nanos(100_020_300))),
            "1970-01-01 00:00:00.1000203 +0000 UTC"
        );
        // Years below 1000 are padded to four digits (seconds from Python's proleptic
        // Gregorian calendar, as Go's).
        assert_eq!(go_time_string(Some(before_epoch(30_610_224_001))), "0999-12-31 23:59:59 +0000 UTC");
        assert_eq!(
            go_time_string(Some(before_epoch(60_836_381_633) + Duration::from_micros(250))),
            "0042-03-04 05:06:07.00025 +0000 UTC"
        );
        // Go's zero time, given as a time rather than as `None`.
        assert_eq!(go_time_string(Some(before_epoch(62_135_596_800))), "0001-01-01 00:00:00 +0000 UTC");
    }

    /// `secs` seconds before the Unix epoch.
    fn before_epoch(secs: u64) -> SystemTime {
        UNIX_EPOCH - Duration::from_secs(secs)
    }

    #[test]
    fn healthy_until_a_queued_update_is_late() {
        let mut h = ProxierHealth::new(TIMEOUT, Release::V1_29);
        // Nothing synced yet: healthy, and queued updates of a family that never synced are
        // not judged.
        assert_eq!(h.health(at(100)), Health { healthy: true, last_updated: None });
        h.queued_update(IpFamily::V4, at(100));
        assert!(h.is_healthy(at(1_000)));

        h.updated(IpFamily::V4, at(1_000));
        h.queued_update(IpFamily::V4, at(1_010));
        // A later queue does not move the deadline.
        h.queued_update(IpFamily::V4, at(1_060));
        assert!(h.is_healthy(at(1_069)));
        assert_eq!(h.health(at(1_070)), Health { healthy: false, last_updated: Some(at(1_000)) });

        h.updated(IpFamily::V4, at(1_080));
        assert_eq!(h.health(at(5_000)), Health { healthy: true, last_updated: Some(at(1_080)) });
        // A clock that went backwards is not "late".
        h.queued_update(IpFamily::V4, at(6_000));
        assert!(h.is_healthy(at(10)));
    }

    #[test]
    fn a_change_queued_during_a_sync_stays_pending() {
        let mut h = ProxierHealth::new(TIMEOUT, Release::V1_29);
        h.updated(IpFamily::V4, at(1_000));
        // Two changes are queued, a sync takes them; two more are queued while it runs
        // (at 1 011 and 1 012); it succeeds at 1 015. Those two are not written.
        h.queued_update(IpFamily::V4, at(1_005));
        h.queued_update(IpFamily::V4, at(1_006));
        let mark = h.sync_starting(IpFamily::V4);
        h.queued_update(IpFamily::V4, at(1_011));
        h.queued_update(IpFamily::V4, at(1_012));
        h.synced(IpFamily::V4, mark, at(1_015));
        assert_eq!(h.health(at(1_020)).last_updated, Some(at(1_015)));
        // Judged from the first of them.
        assert!(h.is_healthy(at(1_011 + 59)));
        // The sync that takes them fails: late from their queueing.
        h.sync_starting(IpFamily::V4);
        h.sync_failed(IpFamily::V4);
        assert!(!h.is_healthy(at(1_011 + 60)));
        // A sync that took them succeeds: nothing pending.
        let mark = h.sync_starting(IpFamily::V4);
        h.synced(IpFamily::V4, mark, at(1_101));
        assert!(h.is_healthy(at(5_000)));
    }

    /// The CI failure this replaced a time estimate for: a sync that took 0 ms (nothing to
    /// write) is reported late; a change queued just after it took its changes but before
    /// "report time − duration" must stay pending.
    #[test]
    fn a_late_report_does_not_swallow_a_change_queued_during_the_sync() {
        let mut h = ProxierHealth::new(TIMEOUT, Release::V1_29);
        h.updated(IpFamily::V4, at(1_000));
        h.queued_update(IpFamily::V4, at(1_010));
        let mark = h.sync_starting(IpFamily::V4);
        h.queued_update(IpFamily::V4, at(1_010));
        // Reported (much) later than it ran.
        h.synced(IpFamily::V4, mark, at(1_030));
        assert!(h.is_healthy(at(1_069)));
        assert!(!h.is_healthy(at(1_070)), "the change queued after the mark is still pending");
        // A change queued exactly before the mark counts as taken.
        h.queued_update(IpFamily::V4, at(2_000));
        let mark = h.sync_starting(IpFamily::V4);
        h.synced(IpFamily::V4, mark, at(2_001));
        assert!(h.is_healthy(at(9_000)));
    }

    #[test]
    fn a_sync_that_keeps_making_progress_is_not_late() {
        let mut h = ProxierHealth::new(TIMEOUT, Release::V1_29);
        h.updated(IpFamily::V4, at(1_000));
        h.queued_update(IpFamily::V4, at(1_010));
        // The sync starts and applies a step every 50 s: never TIMEOUT (60 s) without one.
        for step in 0..10 {
            h.sync_progress(IpFamily::V4, at(1_010 + step * 50));
            assert!(h.is_healthy(at(1_010 + step * 50 + 59)), "step {step}");
        }
        // Then it stops moving: late TIMEOUT after its last step.
        assert!(!h.is_healthy(at(1_460 + 60)));
        // Progress from before the update was queued does not help it.
        h.updated(IpFamily::V4, at(2_000));
        h.sync_progress(IpFamily::V4, at(2_000));
        h.queued_update(IpFamily::V4, at(2_100));
        h.sync_progress(IpFamily::V4, at(2_050));
        assert!(!h.is_healthy(at(2_160)));
        // A failed sync's steps stop counting.
        h.sync_progress(IpFamily::V4, at(2_150));
        assert!(h.is_healthy(at(2_160)));
        h.sync_failed(IpFamily::V4);
        assert!(!h.is_healthy(at(2_160)));
        // Finishing clears the progress: the next update is judged from its queueing.
        h.updated(IpFamily::V4, at(2_200));
        h.queued_update(IpFamily::V4, at(2_300));
        assert!(!h.is_healthy(at(2_360)));
    }

    #[test]
    fn every_family_must_keep_up() {
        let mut h = ProxierHealth::new(TIMEOUT, Release::V1_29);
        h.updated(IpFamily::V4, at(100));
        h.updated(IpFamily::V6, at(50));
        assert_eq!(h.health(at(200)).last_updated, Some(at(100)));
        h.queued_update(IpFamily::V6, at(60));
        h.queued_update(IpFamily::V4, at(150));
        h.updated(IpFamily::V4, at(160));
        // IPv4 is current, IPv6 is late: unhealthy, reporting IPv6's last sync.
        assert_eq!(h.health(at(200)), Health { healthy: false, last_updated: Some(at(50)) });
    }

    #[test]
    fn probe_bodies() {
        let mut h = ProxierHealth::new(TIMEOUT, Release::V1_29);
        h.updated(IpFamily::V4, at(1_700_000_000));
        let now = at(1_700_000_030);
        let ok = h.healthz(now);
        assert!(ok.healthy);
        assert_eq!(
            ok.body,
            r#"{"lastUpdated": "2023-11-14 22:13:50 +0000 UTC","currentTime": "2023-11-14 22:13:50 +0000 UTC", "nodeEligible": true}"#
        );
        h.queued_update(IpFamily::V4, at(1_700_000_000));
        let late = at(1_700_000_100);
        let bad = h.livez(late);
        assert_eq!(bad.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(
            bad.body,
            r#"{"lastUpdated": "2023-11-14 22:13:20 +0000 UTC","currentTime": "2023-11-14 22:15:00 +0000 UTC"}"#
        );
    }

    #[test]
    fn node_eligibility() {
        assert!(node_eligible(&node(false, &[])));
        assert!(node_eligible(&node(false, &["node.kubernetes.io/unschedulable"])));
        assert!(!node_eligible(&node(false, &["node.kubernetes.io/unschedulable", TO_BE_DELETED_TAINT])));
        assert!(!node_eligible(&node(true, &[])));
        assert!(node_eligible(&Node::default()));

        let mut h = ProxierHealth::new(TIMEOUT, Release::V1_29);
        h.updated(IpFamily::V4, at(10));
        h.sync_node(&node(false, &[TO_BE_DELETED_TAINT]));
        let resp = h.healthz(at(20));
        assert!(!resp.healthy, "an ineligible node fails /healthz");
        assert!(resp.body.ends_with(r#""nodeEligible": false}"#), "{}", resp.body);
        // Its lastUpdated is the real one, since the answer is not healthy.
        assert!(resp.body.starts_with(r#"{"lastUpdated": "1970-01-01 00:00:10 +0000 UTC""#), "{}", resp.body);
        assert!(h.livez(at(20)).healthy, "an ineligible node is still alive");
        h.sync_node(&node(false, &[]));
        assert!(h.healthz(at(20)).healthy);
    }

    #[test]
    fn rfc3339_nano_format() {
        assert_eq!(go_rfc3339_nano(None), "0001-01-01T00:00:00Z");
        assert_eq!(go_rfc3339_nano(Some(UNIX_EPOCH)), "1970-01-01T00:00:00Z");
        assert_eq!(go_rfc3339_nano(Some(at(1_700_000_000))), "2023-11-14T22:13:20Z");
        let t = at(951_825_600) + Duration::from_nanos(120_000_000);
        assert_eq!(go_rfc3339_nano(Some(t)), "2000-02-29T12:00:00.12Z");
        assert_eq!(go_rfc3339_nano(Some(at(0) + Duration::from_nanos(1))), "1970-01-01T00:00:00.000000001Z");
        assert_eq!(go_rfc3339_nano(Some(UNIX_EPOCH - Duration::from_millis(500))), "1969-12-31T23:59:59.5Z");
        assert_eq!(go_rfc3339_nano(Some(at(0) + Duration::from_millis(100))), "1970-01-01T00:00:00.1Z");
        assert_eq!(go_rfc3339_nano(Some(at(0) + Duration::from_nanos(100_020_300))), "1970-01-01T00:00:00.1000203Z");
        assert_eq!(go_rfc3339_nano(Some(before_epoch(30_610_224_001))), "0999-12-31T23:59:59Z");
        assert_eq!(
            go_rfc3339_nano(Some(before_epoch(60_836_381_633) + Duration::from_micros(250))),
            "0042-03-04T05:06:07.00025Z"
        );
        assert_eq!(go_rfc3339_nano(Some(before_epoch(62_135_596_800))), "0001-01-01T00:00:00Z");
    }

    /// 2023-11-14T22:13:50.123456789Z
    fn now_1_35() -> SystemTime {
        at(1_700_000_030) + Duration::from_nanos(123_456_789)
    }

    #[test]
    fn json_probe_bodies_from_1_33() {
        for release in [Release::V1_33, Release::V1_35] {
            let mut h = ProxierHealth::new(TIMEOUT, release);
            h.sync_node(&node(false, &[]));
            h.updated(IpFamily::V4, at(1_700_000_021) + Duration::from_millis(500));
            let ok = h.healthz(now_1_35());
            assert_eq!(ok.status(), StatusCode::OK, "{release}");
            assert_eq!(
                ok.body,
                r#"{"lastUpdated":"2023-11-14T22:13:50.123456789Z","currentTime":"2023-11-14T22:13:50.123456789Z","nodeEligible":true,"healthy":true,"status":{"IPv4":{"lastUpdated":"2023-11-14T22:13:41.5Z","healthy":true}}}"#,
                "{release}"
            );
            let live = h.livez(now_1_35());
            assert_eq!(live.status(), StatusCode::OK);
            assert_eq!(
                live.body,
                r#"{"lastUpdated":"2023-11-14T22:13:50.123456789Z","currentTime":"2023-11-14T22:13:50.123456789Z","healthy":true,"status":{"IPv4":{"lastUpdated":"2023-11-14T22:13:41.5Z","healthy":true}}}"#
            );
        }
        // The day before 1.33 still writes the Fprintf form.
        let mut h = ProxierHealth::new(TIMEOUT, Release::V1_32);
        h.updated(IpFamily::V4, at(1_700_000_000));
        assert_eq!(
            h.healthz(at(1_700_000_030)).body,
            r#"{"lastUpdated": "2023-11-14 22:13:50 +0000 UTC","currentTime": "2023-11-14 22:13:50 +0000 UTC", "nodeEligible": true}"#
        );
    }

    #[test]
    fn json_bodies_when_unhealthy_dual_stack() {
        let mut h = ProxierHealth::new(TIMEOUT, Release::V1_35);
        h.sync_node(&node(false, &[]));
        // IPv6 synced first, then IPv4: the map order is not the insertion order.
        h.updated(IpFamily::V6, at(1_700_000_000));
        h.updated(IpFamily::V4, at(1_700_000_010));
        h.queued_update(IpFamily::V6, at(1_700_000_001));
        let late = at(1_700_000_100);
        let resp = h.healthz(late);
        assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
        // The top-level lastUpdated is the newest family's (upstream Health()), not now.
        assert_eq!(
            resp.body,
            r#"{"lastUpdated":"2023-11-14T22:13:30Z","currentTime":"2023-11-14T22:15:00Z","nodeEligible":true,"healthy":false,"status":{"IPv4":{"lastUpdated":"2023-11-14T22:13:30Z","healthy":true},"IPv6":{"lastUpdated":"2023-11-14T22:13:20Z","healthy":false}}}"#
        );
        let live = h.livez(late);
        assert_eq!(live.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(
            live.body,
            r#"{"lastUpdated":"2023-11-14T22:13:30Z","currentTime":"2023-11-14T22:15:00Z","healthy":false,"status":{"IPv4":{"lastUpdated":"2023-11-14T22:13:30Z","healthy":true},"IPv6":{"lastUpdated":"2023-11-14T22:13:20Z","healthy":false}}}"#
        );
    }

    #[test]
    fn json_bodies_before_any_sync_and_without_a_node() {
        let h = ProxierHealth::new(TIMEOUT, Release::V1_35);
        // No Node known: not eligible, so /healthz fails and its lastUpdated is the zero
        // time; no family synced: no status.
        let resp = h.healthz(at(1_700_000_000));
        assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(
            resp.body,
            r#"{"lastUpdated":"0001-01-01T00:00:00Z","currentTime":"2023-11-14T22:13:20Z","nodeEligible":false,"healthy":true}"#
        );
        let live = h.livez(at(1_700_000_000));
        assert_eq!(live.status(), StatusCode::OK);
        assert_eq!(
            live.body,
            r#"{"lastUpdated":"2023-11-14T22:13:20Z","currentTime":"2023-11-14T22:13:20Z","healthy":true}"#
        );
    }

    #[test]
    fn node_eligibility_per_release() {
        let mut old = ProxierHealth::new(TIMEOUT, Release::V1_29);
        let mut new = ProxierHealth::new(TIMEOUT, Release::V1_33);
        old.updated(IpFamily::V4, at(10));
        new.updated(IpFamily::V4, at(10));
        // No Node seen: 1.29 eligible, 1.33 not.
        assert!(old.node_eligible() && old.healthz(at(20)).healthy);
        assert!(!new.node_eligible() && !new.healthz(at(20)).healthy);
        assert!(new.livez(at(20)).healthy, "an unknown node is still alive");
        for h in [&mut old, &mut new] {
            h.sync_node(&node(false, &[]));
            assert!(h.healthz(at(20)).healthy, "{}", h.release());
            h.sync_node(&node(false, &[TO_BE_DELETED_TAINT]));
            assert!(!h.healthz(at(20)).healthy, "{}", h.release());
            h.sync_node(&node(false, &[]));
        }
        // The Node is deleted: 1.33 forgets it, 1.29 keeps the last eligibility.
        old.node_deleted();
        new.node_deleted();
        assert!(old.healthz(at(20)).healthy);
        assert!(!new.healthz(at(20)).healthy);
        assert!(new.healthz(at(20)).body.contains(r#""nodeEligible":false"#));
    }

    async fn start_health(
        release: Release,
        clock: Arc<FakeClock>,
        metrics: Arc<Metrics>,
    ) -> (Arc<ProxierHealthServer>, SocketAddr, CancellationToken) {
        let server = Arc::new(ProxierHealthServer::new(TIMEOUT, release, clock, Some(metrics)));
        let listener = http::bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let cancel = CancellationToken::new();
        tokio::spawn(server.clone().serve(listener, cancel.clone()));
        (server, addr, cancel)
    }

    #[tokio::test]
    async fn health_server_follows_state() {
        let clock = Arc::new(FakeClock::new(at(1_700_000_000)));
        let metrics = Arc::new(Metrics::new(Release::NEWEST).unwrap());
        let (health, addr, cancel) = start_health(Release::V1_29, clock.clone(), metrics.clone()).await;

        health.updated(IpFamily::V4);
        let resp = get(addr, "/healthz").await;
        assert_eq!(resp.status, 200);
        assert_eq!(resp.header("content-type"), Some("application/json"));
        assert_eq!(resp.header("x-content-type-options"), Some("nosniff"));
        let body = resp.json();
        assert_eq!(body["lastUpdated"], "2023-11-14 22:13:20 +0000 UTC");
        assert_eq!(body["currentTime"], "2023-11-14 22:13:20 +0000 UTC");
        assert_eq!(body["nodeEligible"], true);

        // A change is queued and not applied for 2 × syncPeriod: stale.
        health.queued_update(IpFamily::V4);
        clock.advance(TIMEOUT);
        let resp = get(addr, "/healthz").await;
        assert_eq!(resp.status, 503);
        let body = resp.json();
        assert_eq!(body["lastUpdated"], "2023-11-14 22:13:20 +0000 UTC");
        assert_eq!(body["currentTime"], "2023-11-14 22:14:20 +0000 UTC");
        let resp = get(addr, "/livez").await;
        assert_eq!(resp.status, 503);
        assert!(resp.json().get("nodeEligible").is_none());

        // The sync catches up.
        health.updated(IpFamily::V4);
        assert_eq!(get(addr, "/healthz").await.status, 200);
        assert_eq!(get(addr, "/livez").await.status, 200);

        // The autoscaler marks the node: /healthz fails, /livez does not.
        health.sync_node(&node(false, &[TO_BE_DELETED_TAINT]));
        let resp = get(addr, "/healthz").await;
        assert_eq!(resp.status, 503);
        assert_eq!(resp.json()["nodeEligible"], false);
        assert_eq!(get(addr, "/livez").await.status, 200);
        health.sync_node(&node(true, &[]));
        assert_eq!(get(addr, "/healthz").await.status, 503);

        assert_eq!(get(addr, "/metrics").await.status, 404);
        assert_eq!(get(addr, "/healthz/").await.status, 404);
        // Other methods are refused before the probe is evaluated (and counted).
        let refused = request(addr, "POST", "/healthz").await.unwrap();
        assert_eq!((refused.status, refused.header("allow")), (405, Some("GET, HEAD")));

        let text = metrics.encode_text().unwrap();
        assert!(text.contains("kubeproxy_proxy_healthz_total{code=\"200\"} 2"), "{text}");
        assert!(text.contains("kubeproxy_proxy_healthz_total{code=\"503\"} 3"), "{text}");
        assert!(text.contains("kubeproxy_proxy_livez_total{code=\"200\"} 2"), "{text}");
        assert!(text.contains("kubeproxy_proxy_livez_total{code=\"503\"} 1"), "{text}");
        cancel.cancel();
    }

    #[tokio::test]
    async fn health_server_serves_json_from_1_33() {
        let clock = Arc::new(FakeClock::new(now_1_35()));
        let metrics = Arc::new(Metrics::new(Release::NEWEST).unwrap());
        let (health, addr, cancel) = start_health(Release::NEWEST, clock.clone(), metrics.clone()).await;
        health.updated(IpFamily::V4);
        // No Node yet.
        let resp = get(addr, "/healthz").await;
        assert_eq!(resp.status, 503);
        assert_eq!(resp.header("content-type"), Some("application/json"));
        assert_eq!(resp.json()["nodeEligible"], false);
        health.sync_node(&node(false, &[]));
        let resp = get(addr, "/healthz").await;
        assert_eq!(resp.status, 200);
        assert_eq!(
            resp.body,
            r#"{"lastUpdated":"2023-11-14T22:13:50.123456789Z","currentTime":"2023-11-14T22:13:50.123456789Z","nodeEligible":true,"healthy":true,"status":{"IPv4":{"lastUpdated":"2023-11-14T22:13:50.123456789Z","healthy":true}}}"#
        );
        health.node_deleted();
        assert_eq!(get(addr, "/healthz").await.status, 503);
        let resp = get(addr, "/livez").await;
        assert_eq!(resp.status, 200);
        assert_eq!(resp.json()["status"]["IPv4"]["healthy"], true);
        cancel.cancel();
    }

    /// Both servers run with the limits they are given (the shared layer's tests cover each
    /// limit): here an idle connection is closed after a short idle timeout.
    #[tokio::test]
    async fn both_servers_apply_their_client_limits() {
        let limits = Limits {
            idle_timeout: Duration::from_millis(100),
            header_read_timeout: Duration::from_secs(600),
            ..Limits::default()
        };
        let metrics = Arc::new(Metrics::new(Release::NEWEST).unwrap());
        let cancel = CancellationToken::new();
        let health = Arc::new(ProxierHealthServer::new(TIMEOUT, Release::NEWEST, Arc::new(SystemClock), None));
        let listener = http::bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
        let health_addr = listener.local_addr().unwrap();
        tokio::spawn(health.serve_with_limits(listener, limits, cancel.clone()));
        let server = Arc::new(MetricsServer::new(metrics, &serde_json::json!({})).unwrap());
        let listener = http::bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
        let metrics_addr = listener.local_addr().unwrap();
        tokio::spawn(server.serve_with_limits(listener, limits, cancel.clone()));
        for addr in [health_addr, metrics_addr] {
            assert!(silent_connection_closed(addr, Duration::from_secs(20)).await, "{addr}");
            assert_eq!(get(addr, "/healthz").await.status, if addr == health_addr { 503 } else { 200 });
        }
        cancel.cancel();
    }

    #[tokio::test]
    async fn metrics_server_endpoints() {
        let metrics = Arc::new(Metrics::new(Release::NEWEST).unwrap());
        metrics.service_update_observed(3);
        let config = serde_json::json!({"mode": "iptables", "iptables": {"syncPeriod": "30s"}});
        let server = Arc::new(MetricsServer::new(metrics, &config).unwrap());
        let listener = http::bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let cancel = CancellationToken::new();
        let task = tokio::spawn(server.serve(listener, cancel.clone()));

        let resp = get(addr, "/metrics").await;
        assert_eq!(resp.status, 200);
        assert_eq!(resp.header("content-type"), Some(metrics::TEXT_CONTENT_TYPE));
        assert!(resp.body.contains("# TYPE kubeproxy_sync_proxy_rules_service_changes_total counter"));
        assert!(resp.body.contains("kubeproxy_sync_proxy_rules_service_changes_pending 3"));

        let resp = get(addr, "/proxyMode").await;
        assert_eq!((resp.status, resp.body.as_str()), (200, "iptables"));
        assert_eq!(resp.header("content-type"), Some("text/plain; charset=utf-8"));

        let resp = get(addr, "/healthz").await;
        assert_eq!((resp.status, resp.body.as_str()), (200, "ok"));
        let resp = get(addr, "/healthz?verbose").await;
        assert_eq!(resp.body, "[+]ping ok\nhealthz check passed\n");

        let resp = get(addr, "/configz").await;
        assert_eq!(resp.status, 200);
        assert_eq!(resp.header("content-type"), Some("application/json"));
        assert_eq!(resp.json(), serde_json::json!({ CONFIGZ_KEY: config }));

        let resp = get(addr, "/nope").await;
        assert_eq!((resp.status, resp.body.as_str()), (404, "404 page not found\n"));
        let resp = request(addr, "DELETE", "/metrics").await.unwrap();
        assert_eq!((resp.status, resp.header("allow")), (405, Some("GET, HEAD")));

        cancel.cancel();
        task.await.unwrap();
    }
}
