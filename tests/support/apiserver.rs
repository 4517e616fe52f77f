//! A small in-process Kubernetes API server for the watch tests: plain HTTP on
//! `127.0.0.1:0`, serving what kube-runtime's `watcher` asks of Services, Nodes and
//! EndpointSlices, plus event POSTs.
//!
//! Supported requests:
//! - LIST `GET /api/v1/services`, `/api/v1/nodes`, `/apis/discovery.k8s.io/v1/endpointslices`
//!   (and the namespaced `/api/v1/namespaces/{ns}/services`,
//!   `/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices`): a `<Kind>List` with
//!   `metadata.resourceVersion` = the current global resource version. `labelSelector`
//!   (`key`, `!key`, `key=v`, `key==v`, `key!=v`) and `fieldSelector` (`metadata.name`,
//!   `metadata.namespace` with `=`, `==`, `!=`) are honoured; `limit`, `continue`,
//!   `resourceVersion` and `resourceVersionMatch` are accepted and ignored: the answer is
//!   always one page of the current state.
//! - WATCH (the same paths with `watch=true`, `resourceVersion=N`, `timeoutSeconds`,
//!   `allowWatchBookmarks`, selectors): newline-delimited `{"type","object"}` events after N,
//!   replayed from the history and then live. An object moving into / out of the selection is
//!   sent as `ADDED` / `DELETED`, like the real server. N older than the compaction point
//!   answers one `ERROR` event with a 410 `Expired` Status, then ends. `resourceVersion` `0` or
//!   empty starts with `ADDED` for every current object. `sendInitialEvents=true` also sends the
//!   current objects followed by a `BOOKMARK` annotated `k8s.io/initial-events-end`.
//! - POST `/api/v1/namespaces/{ns}/events` and `/apis/events.k8s.io/v1/namespaces/{ns}/events`:
//!   recorded ([`ApiServer::events`], in the path's namespace) and echoed back with
//!   `201 Created`; a name already taken in that namespace is `409 AlreadyExists`. PATCH of
//!   `…/events/{name}` applies a JSON merge patch (RFC 7386) to the stored event (`404` when
//!   there is none). [`ApiServer::fail_next_events`] answers the next event writes with an
//!   error status; [`ApiServer::delete_events`] drops them all, as their TTL would.
//!
//! The test drives the server through [`ApiServer`]'s methods: [`ApiServer::create`],
//! [`ApiServer::update`] and [`ApiServer::delete`] bump the global resource version and notify
//! watchers; [`ApiServer::close_watches`] ends every open watch stream cleanly and
//! [`ApiServer::cut_watches`] cuts their connections;
//! [`ApiServer::compact`] expires every older resource version; [`ApiServer::fail_next`]
//! answers the next requests with an error status; [`ApiServer::stall`] delays requests;
//! [`ApiServer::go_down`] / [`ApiServer::come_back_on`] take the server off the network and
//! back; [`ApiServer::apply_raw`] stores raw JSON (objects no valid API server would hold).

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use futures::StreamExt;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Bytes, Frame, Incoming};
use hyper::header::{CONTENT_TYPE, HeaderValue};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type Body = UnsyncBoxBody<Bytes, BoxError>;

/// What a watch stream is sent.
enum Msg {
    Data(Bytes),
    /// End the stream with an error: the connection is cut mid-body.
    Cut,
}

/// The resource kinds the server serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Kind {
    Service,
    Node,
    EndpointSlice,
}

impl Kind {
    fn from_kind(kind: &str) -> Option<Kind> {
        match kind {
            "Service" => Some(Kind::Service),
            "Node" => Some(Kind::Node),
            "EndpointSlice" => Some(Kind::EndpointSlice),
            _ => None,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Kind::Service => "Service",
            Kind::Node => "Node",
            Kind::EndpointSlice => "EndpointSlice",
        }
    }

    fn api_version(self) -> &'static str {
        match self {
            Kind::Service | Kind::Node => "v1",
            Kind::EndpointSlice => "discovery.k8s.io/v1",
        }
    }
}

/// One recorded request: method and path with query.
#[derive(Debug, Clone)]
pub struct RequestLog {
    pub method: String,
    pub uri: String,
    pub kind: Option<Kind>,
    pub watch: bool,
    /// The Authorization header, if any.
    pub authorization: Option<String>,
}

/// A label or field selector requirement.
#[derive(Debug, Clone)]
enum Req {
    Exists(String),
    NotExists(String),
    Eq(String, String),
    Ne(String, String),
}

impl Req {
    fn matches(&self, get: impl Fn(&str) -> Option<String>) -> bool {
        match self {
            Req::Exists(k) => get(k).is_some(),
            Req::NotExists(k) => get(k).is_none(),
            Req::Eq(k, v) => get(k).as_deref() == Some(v.as_str()),
            Req::Ne(k, v) => get(k).as_deref() != Some(v.as_str()),
        }
    }
}

fn parse_selector(s: &str, allow_exists: bool) -> Result<Vec<Req>, String> {
    let mut out = Vec::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let req = if let Some((k, v)) = part.split_once("!=") {
            Req::Ne(k.trim().into(), v.trim().into())
        } else if let Some((k, v)) = part.split_once("==") {
            Req::Eq(k.trim().into(), v.trim().into())
        } else if let Some((k, v)) = part.split_once('=') {
            Req::Eq(k.trim().into(), v.trim().into())
        } else if !allow_exists {
            return Err(format!("invalid field selector {part:?}"));
        } else if let Some(k) = part.strip_prefix('!') {
            Req::NotExists(k.trim().into())
        } else {
            Req::Exists(part.into())
        };
        out.push(req);
    }
    Ok(out)
}

/// What a list or watch selects.
#[derive(Debug, Clone)]
struct Filter {
    kind: Kind,
    namespace: Option<String>,
    labels: Vec<Req>,
    fields: Vec<Req>,
}

impl Filter {
    fn matches(&self, obj: &Value) -> bool {
        let meta = &obj["metadata"];
        let str_of = |v: &Value| v.as_str().map(str::to_string);
        if let Some(ns) = &self.namespace
            && meta["namespace"].as_str() != Some(ns.as_str())
        {
            return false;
        }
        let labels = &meta["labels"];
        self.labels.iter().all(|r| r.matches(|k| str_of(&labels[k])))
            && self.fields.iter().all(|r| {
                r.matches(|k| match k {
                    "metadata.name" => str_of(&meta["name"]),
                    "metadata.namespace" => Some(str_of(&meta["namespace"]).unwrap_or_default()),
                    _ => None,
                })
            })
    }
}

/// One change, kept for replaying watches.
#[derive(Debug, Clone)]
struct Change {
    rv: u64,
    kind: Kind,
    old: Option<Value>,
    new: Option<Value>,
}

impl Change {
    /// The event a watcher with `filter` sees for this change, if any.
    fn event_for(&self, filter: &Filter) -> Option<Value> {
        if self.kind != filter.kind {
            return None;
        }
        let was = self.old.as_ref().is_some_and(|o| filter.matches(o));
        let is = self.new.as_ref().is_some_and(|o| filter.matches(o));
        match (was, is, &self.new) {
            (false, true, Some(new)) => Some(json!({"type": "ADDED", "object": new})),
            (true, true, Some(new)) => Some(json!({"type": "MODIFIED", "object": new})),
            // Moved out of the selection: DELETED with the new state.
            (true, false, Some(new)) => Some(json!({"type": "DELETED", "object": new})),
            (true, false, None) => {
                let mut gone = self.old.clone()?;
                gone["metadata"]["resourceVersion"] = json!(self.rv.to_string());
                Some(json!({"type": "DELETED", "object": gone}))
            }
            _ => None,
        }
    }
}

struct Watcher {
    filter: Filter,
    tx: mpsc::UnboundedSender<Msg>,
}

type ObjKey = (Kind, String, String);

#[derive(Default)]
struct State {
    rv: u64,
    objects: BTreeMap<ObjKey, Value>,
    history: Vec<Change>,
    /// Watches from a resource version below this get 410 Gone.
    compacted: u64,
    watchers: Vec<Watcher>,
    failures: Vec<(Option<Kind>, u16)>,
    /// Like `failures`, for list (non-watch) requests only.
    list_failures: Vec<(Option<Kind>, u16)>,
    stalled_until: Option<(Option<Kind>, Instant)>,
    events: Vec<Value>,
    event_failures: Vec<u16>,
    requests: Vec<RequestLog>,
    /// When set, every request must carry `Authorization: Bearer <token>` (else 401).
    required_token: Option<String>,
    expired: usize,
    /// Between [`ApiServer::go_down`] and [`ApiServer::come_back_on`]: a connection still
    /// being torn down must not serve anything (it could register a watch after the
    /// watchers were closed and pass on a change made during the outage).
    down: bool,
}

struct Shared {
    state: Mutex<State>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// The running server; stops when dropped.
pub struct ApiServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    cancel: CancellationToken,
    scheme: &'static str,
    tls: Option<tokio_rustls::TlsAcceptor>,
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        self.cancel.cancel();
        self.close_watches();
    }
}

fn key_of(kind: Kind, obj: &Value) -> ObjKey {
    let meta = &obj["metadata"];
    (
        kind,
        meta["namespace"].as_str().unwrap_or_default().to_string(),
        meta["name"].as_str().unwrap_or_default().to_string(),
    )
}

async fn serve_connection<IO>(io: IO, shared: Arc<Shared>, cancel: CancellationToken)
where
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let service = service_fn(move |req| {
        let s = shared.clone();
        async move { Ok::<_, Infallible>(handle(s, req).await) }
    });
    let conn = http1::Builder::new().serve_connection(TokioIo::new(io), service);
    let mut conn = std::pin::pin!(conn);
    tokio::select! {
        _ = conn.as_mut() => {}
        () = cancel.cancelled() => {}
    }
}

fn to_value<K: k8s_openapi::Resource + serde::Serialize>(obj: &K) -> (Kind, Value) {
    let kind = Kind::from_kind(K::KIND).unwrap_or_else(|| panic!("the test API server does not serve {}", K::KIND));
    let mut v = serde_json::to_value(obj).expect("serializable object");
    v["apiVersion"] = json!(K::API_VERSION);
    v["kind"] = json!(K::KIND);
    (kind, v)
}

impl ApiServer {
    /// Binds `127.0.0.1:0` and serves until dropped.
    pub async fn start() -> ApiServer {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        Self::serve(listener)
    }

    /// Serves on an already bound listener (e.g. one bound inside a network namespace).
    pub fn start_on(listener: std::net::TcpListener) -> ApiServer {
        listener.set_nonblocking(true).expect("nonblocking");
        Self::serve(TcpListener::from_std(listener).expect("tokio listener"))
    }

    /// Serves HTTPS on an already bound listener with `acceptor`'s certificate.
    pub fn start_tls_on(listener: std::net::TcpListener, acceptor: tokio_rustls::TlsAcceptor) -> ApiServer {
        listener.set_nonblocking(true).expect("nonblocking");
        Self::serve_with(TcpListener::from_std(listener).expect("tokio listener"), Some(acceptor))
    }

    fn serve(listener: TcpListener) -> ApiServer {
        Self::serve_with(listener, None)
    }

    fn serve_with(listener: TcpListener, tls: Option<tokio_rustls::TlsAcceptor>) -> ApiServer {
        let addr = listener.local_addr().expect("local addr");
        let scheme = if tls.is_some() { "https" } else { "http" };
        let shared = Arc::new(Shared { state: Mutex::new(State { rv: 1, ..Default::default() }) });
        let cancel = CancellationToken::new();
        Self::accept_loop(listener, shared.clone(), cancel.clone(), tls.clone());
        ApiServer { addr, shared, cancel, scheme, tls }
    }

    fn accept_loop(
        listener: TcpListener,
        s: Arc<Shared>,
        c: CancellationToken,
        tls: Option<tokio_rustls::TlsAcceptor>,
    ) {
        tokio::spawn(async move {
            loop {
                let stream = tokio::select! {
                    () = c.cancelled() => return,
                    accepted = listener.accept() => match accepted {
                        Ok((stream, _)) => stream,
                        Err(_) => continue,
                    },
                };
                let (s, c, tls) = (s.clone(), c.clone(), tls.clone());
                tokio::spawn(async move {
                    match tls {
                        None => serve_connection(stream, s, c).await,
                        Some(acceptor) => {
                            if let Ok(stream) = acceptor.accept(stream).await {
                                serve_connection(stream, s, c).await;
                            }
                        }
                    }
                });
            }
        });
    }

    pub fn url(&self) -> String {
        format!("{}://{}", self.scheme, self.addr)
    }

    /// From now on every request must carry this bearer token (as a service account's);
    /// others get 401 Unauthorized, as a real API server answers a wrong token.
    pub fn require_token(&self, token: &str) {
        self.shared.lock().required_token = Some(token.to_string());
    }

    /// A client for this server: plain HTTP, no auth.
    pub fn client(&self) -> kube::Client {
        let config = kube::Config::new(self.url().parse().expect("url"));
        kube::Client::try_from(config).expect("client")
    }

    /// The current global resource version.
    pub fn resource_version(&self) -> u64 {
        self.shared.lock().rv
    }

    /// Creates `obj` (which must not exist); returns its resource version.
    #[track_caller]
    pub fn create<K: k8s_openapi::Resource + serde::Serialize>(&self, obj: &K) -> u64 {
        let (kind, v) = to_value(obj);
        let key = key_of(kind, &v);
        let mut st = self.shared.lock();
        assert!(!st.objects.contains_key(&key), "{key:?} already exists");
        st.change(kind, key, Some(v))
    }

    /// Replaces `obj` (which must exist); returns its new resource version.
    #[track_caller]
    pub fn update<K: k8s_openapi::Resource + serde::Serialize>(&self, obj: &K) -> u64 {
        let (kind, v) = to_value(obj);
        let key = key_of(kind, &v);
        let mut st = self.shared.lock();
        assert!(st.objects.contains_key(&key), "{key:?} does not exist");
        st.change(kind, key, Some(v))
    }

    /// Deletes `obj` (by namespace and name; it must exist); returns the deletion's version.
    #[track_caller]
    pub fn delete<K: k8s_openapi::Resource + serde::Serialize>(&self, obj: &K) -> u64 {
        let (kind, v) = to_value(obj);
        let key = key_of(kind, &v);
        let mut st = self.shared.lock();
        assert!(st.objects.contains_key(&key), "{key:?} does not exist");
        st.change(kind, key, None)
    }

    /// Ends every open watch stream (cleanly: the chunked body ends).
    pub fn close_watches(&self) {
        self.shared.lock().watchers.clear();
    }

    /// Cuts every open watch connection mid-body (no final chunk), as a network failure would.
    pub fn cut_watches(&self) {
        let mut st = self.shared.lock();
        for w in st.watchers.drain(..) {
            let _ = w.tx.send(Msg::Cut);
        }
    }

    /// Expires every resource version handed out so far: the next watch from any of them gets
    /// a 410 Gone `ERROR` event, so only a re-list (at a newer version) recovers. Also ends
    /// open watches, as an apiserver restart would.
    pub fn compact(&self) {
        let mut st = self.shared.lock();
        st.rv += 1;
        st.compacted = st.rv;
        st.history.clear();
        st.watchers.clear();
    }

    /// Sends a `BOOKMARK` with the current resource version to open watches that allow them.
    pub fn bookmark(&self) {
        let mut st = self.shared.lock();
        let rv = st.rv;
        st.watchers.retain(|w| {
            let bm = bookmark(w.filter.kind, rv, false);
            w.tx.send(Msg::Data(line(&bm))).is_ok()
        });
    }

    /// Answers the next `n` list/watch requests (of any kind) with `status`.
    pub fn fail_next(&self, n: usize, status: u16) {
        self.shared.lock().failures.extend(std::iter::repeat_n((None, status), n));
    }

    /// Answers the next `n` list/watch requests of `kind` with `status`.
    pub fn fail_next_of(&self, kind: Kind, n: usize, status: u16) {
        self.shared.lock().failures.extend(std::iter::repeat_n((Some(kind), status), n));
    }

    /// Holds list/watch requests arriving in the next `duration` until it has passed.
    pub fn stall(&self, duration: Duration) {
        self.shared.lock().stalled_until = Some((None, Instant::now() + duration));
    }

    /// Like [`ApiServer::stall`], for requests of `kind` only.
    pub fn stall_of(&self, kind: Kind, duration: Duration) {
        self.shared.lock().stalled_until = Some((Some(kind), Instant::now() + duration));
    }

    /// The events POSTed so far (with their patches applied).
    pub fn events(&self) -> Vec<Value> {
        self.shared.lock().events.clone()
    }

    /// Answers the next `n` event writes (POST or PATCH) with `status`.
    pub fn fail_next_events(&self, n: usize, status: u16) {
        self.shared.lock().event_failures.extend(std::iter::repeat_n(status, n));
    }

    /// Forgets every stored event (as expiry would): later patches of them get 404.
    pub fn delete_events(&self) {
        self.shared.lock().events.clear();
    }

    /// Every request so far.
    pub fn requests(&self) -> Vec<RequestLog> {
        self.shared.lock().requests.clone()
    }

    /// How many watches were answered 410 Gone.
    pub fn expired_watches(&self) -> usize {
        self.shared.lock().expired
    }

    /// The number of open watch streams of `kind`.
    pub fn open_watches(&self, kind: Kind) -> usize {
        let mut st = self.shared.lock();
        st.watchers.retain(|w| !w.tx.is_closed());
        st.watchers.iter().filter(|w| w.filter.kind == kind).count()
    }

    /// Takes the server off the network, as an apiserver outage would: the listener closes
    /// (connections are refused) and every open connection, watches included, is dropped.
    /// The objects stay; [`ApiServer::come_back_on`] serves them again.
    pub fn go_down(&mut self) {
        self.cancel.cancel();
        let mut st = self.shared.lock();
        st.down = true;
        st.watchers.clear();
    }

    /// Serves the same objects again on `listener` (bound to the same address, so clients
    /// reconnect) after [`ApiServer::go_down`].
    pub fn come_back_on(&mut self, listener: std::net::TcpListener) {
        listener.set_nonblocking(true).expect("nonblocking");
        let listener = TcpListener::from_std(listener).expect("tokio listener");
        assert_eq!(listener.local_addr().expect("local addr"), self.addr, "come back on the same address");
        self.cancel = CancellationToken::new();
        self.shared.lock().down = false;
        Self::accept_loop(listener, self.shared.clone(), self.cancel.clone(), self.tls.clone());
    }

    /// The address the server listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The current objects of `kind` as stored (JSON, sorted by namespace and name).
    pub fn values(&self, kind: Kind) -> Vec<Value> {
        self.shared.lock().objects.iter().filter(|(k, _)| k.0 == kind).map(|(_, v)| v.clone()).collect()
    }

    /// The current objects of type `K`, decoded from what is stored.
    pub fn objects<K: k8s_openapi::Resource + serde::de::DeserializeOwned>(&self) -> Vec<K> {
        let kind = Kind::from_kind(K::KIND).unwrap_or_else(|| panic!("the test API server does not serve {}", K::KIND));
        self.values(kind).into_iter().map(|v| serde_json::from_value(v).expect("stored object decodes")).collect()
    }

    /// Creates or replaces a raw JSON object (`kind` and `metadata.name` must be set;
    /// `apiVersion` is filled in). For objects the typed builders cannot express, such as a
    /// field no valid object would hold. Returns the resource version.
    #[track_caller]
    pub fn apply_raw(&self, mut obj: Value) -> u64 {
        let kind = obj["kind"].as_str().and_then(Kind::from_kind).expect("raw object with a served kind");
        obj["apiVersion"] = json!(kind.api_version());
        assert!(obj["metadata"]["name"].is_string(), "raw object without metadata.name: {obj}");
        let key = key_of(kind, &obj);
        self.shared.lock().change(kind, key, Some(obj))
    }

    /// Deletes the object of `kind` named `namespace`/`name` (which must exist).
    #[track_caller]
    pub fn delete_named(&self, kind: Kind, namespace: &str, name: &str) -> u64 {
        let key = (kind, namespace.to_string(), name.to_string());
        let mut st = self.shared.lock();
        assert!(st.objects.contains_key(&key), "{key:?} does not exist");
        st.change(kind, key, None)
    }

    /// Answers the next `n` list requests (not watches) of `kind` with `status`: a re-list
    /// that fails while watches would not.
    pub fn fail_next_lists_of(&self, kind: Kind, n: usize, status: u16) {
        self.shared.lock().list_failures.extend(std::iter::repeat_n((Some(kind), status), n));
    }

    /// How many injected failures ([`ApiServer::fail_next`], [`ApiServer::fail_next_lists_of`])
    /// are still to be answered.
    pub fn pending_failures(&self) -> usize {
        let st = self.shared.lock();
        st.failures.len() + st.list_failures.len()
    }
}

impl State {
    fn change(&mut self, kind: Kind, key: ObjKey, new: Option<Value>) -> u64 {
        self.rv += 1;
        let rv = self.rv;
        let new = new.map(|mut v| {
            v["metadata"]["resourceVersion"] = json!(rv.to_string());
            v
        });
        let old = match &new {
            Some(v) => self.objects.insert(key, v.clone()),
            None => self.objects.remove(&key),
        };
        let change = Change { rv, kind, old, new };
        self.watchers.retain(|w| match change.event_for(&w.filter) {
            Some(event) => w.tx.send(Msg::Data(line(&event))).is_ok(),
            None => !w.tx.is_closed(),
        });
        self.history.push(change);
        rv
    }
}

fn line(v: &Value) -> Bytes {
    let mut s = v.to_string();
    s.push('\n');
    Bytes::from(s)
}

fn bookmark(kind: Kind, rv: u64, initial_end: bool) -> Value {
    let mut meta = json!({"resourceVersion": rv.to_string()});
    if initial_end {
        meta["annotations"] = json!({"k8s.io/initial-events-end": "true"});
    }
    json!({"type": "BOOKMARK", "object": {"apiVersion": kind.api_version(), "kind": kind.name(), "metadata": meta}})
}

fn status(code: u16, reason: &str, message: &str) -> Value {
    json!({
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    })
}

fn full(v: &Value) -> Body {
    Full::new(Bytes::from(v.to_string())).map_err(|never| match never {}).boxed_unsync()
}

fn json_response(code: u16, v: &Value) -> Response<Body> {
    let mut res = Response::new(full(v));
    *res.status_mut() = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    res.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    res
}

fn error_response(code: u16, reason: &str, message: &str) -> Response<Body> {
    json_response(code, &status(code, reason, message))
}

/// The kind and namespace a collection path names.
fn route(path: &str) -> Option<(Kind, Option<String>)> {
    let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
    match segs.as_slice() {
        ["api", "v1", "services"] => Some((Kind::Service, None)),
        ["api", "v1", "nodes"] => Some((Kind::Node, None)),
        ["apis", "discovery.k8s.io", "v1", "endpointslices"] => Some((Kind::EndpointSlice, None)),
        ["api", "v1", "namespaces", ns, "services"] => Some((Kind::Service, Some(ns.to_string()))),
        ["apis", "discovery.k8s.io", "v1", "namespaces", ns, "endpointslices"] => {
            Some((Kind::EndpointSlice, Some(ns.to_string())))
        }
        _ => None,
    }
}

/// A single object: `(kind, namespace, name)`.
fn route_one(path: &str) -> Option<(Kind, Option<String>, String)> {
    let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
    match segs.as_slice() {
        ["api", "v1", "nodes", name] => Some((Kind::Node, None, name.to_string())),
        ["api", "v1", "namespaces", ns, "services", name] => {
            Some((Kind::Service, Some(ns.to_string()), name.to_string()))
        }
        ["apis", "discovery.k8s.io", "v1", "namespaces", ns, "endpointslices", name] => {
            Some((Kind::EndpointSlice, Some(ns.to_string()), name.to_string()))
        }
        _ => None,
    }
}

/// The namespace of an events collection path, and the event's name for an item path.
fn events_path(path: &str) -> Option<(String, Option<String>)> {
    let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
    match segs.as_slice() {
        ["api", "v1", "namespaces", ns, "events"] | ["apis", "events.k8s.io", "v1", "namespaces", ns, "events"] => {
            Some((ns.to_string(), None))
        }
        ["api", "v1", "namespaces", ns, "events", name]
        | ["apis", "events.k8s.io", "v1", "namespaces", ns, "events", name] => {
            Some((ns.to_string(), Some(name.to_string())))
        }
        _ => None,
    }
}

/// RFC 7386 JSON merge patch.
fn merge_patch(target: &mut Value, patch: &Value) {
    let Value::Object(patch) = patch else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = json!({});
    }
    let Value::Object(map) = target else { unreachable!("made an object above") };
    for (k, v) in patch {
        if v.is_null() {
            map.remove(k);
        } else {
            merge_patch(map.entry(k.clone()).or_insert(Value::Null), v);
        }
    }
}

fn find_event<'a>(events: &'a mut [Value], ns: &str, name: &str) -> Option<&'a mut Value> {
    events.iter_mut().find(|e| e["metadata"]["namespace"] == ns && e["metadata"]["name"] == name)
}

async fn handle_event_write(
    shared: &Shared,
    req: Request<Incoming>,
    ns: String,
    name: Option<String>,
) -> Response<Body> {
    let method = req.method().clone();
    let content_type = req.headers().get(CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or("").to_string();
    let body = match req.into_body().collect().await {
        Ok(b) => b.to_bytes(),
        Err(e) => return error_response(400, "BadRequest", &e.to_string()),
    };
    let body: Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => return error_response(400, "BadRequest", &e.to_string()),
    };
    let mut st = shared.lock();
    if !st.event_failures.is_empty() {
        let code = st.event_failures.remove(0);
        return error_response(code, "InternalError", "injected failure");
    }
    match (method, name) {
        (Method::POST, None) => {
            let mut event = body;
            event["metadata"]["namespace"] = json!(ns);
            let name = event["metadata"]["name"].as_str().unwrap_or_default().to_string();
            if find_event(&mut st.events, &ns, &name).is_some() {
                return error_response(409, "AlreadyExists", &format!("events \"{name}\" already exists"));
            }
            st.rv += 1;
            event["metadata"]["resourceVersion"] = json!(st.rv.to_string());
            st.events.push(event.clone());
            json_response(201, &event)
        }
        (Method::PATCH, Some(name)) => {
            if content_type != "application/merge-patch+json" {
                return error_response(415, "UnsupportedMediaType", &format!("unsupported patch type {content_type}"));
            }
            st.rv += 1;
            let rv = st.rv;
            let Some(event) = find_event(&mut st.events, &ns, &name) else {
                return error_response(404, "NotFound", &format!("events \"{name}\" not found"));
            };
            merge_patch(event, &body);
            event["metadata"]["resourceVersion"] = json!(rv.to_string());
            json_response(200, event)
        }
        _ => error_response(405, "MethodNotAllowed", "events accept POST and PATCH"),
    }
}

/// What a connection still open when the server went down gets (it is being dropped).
fn down_response() -> Response<Body> {
    error_response(503, "ServiceUnavailable", "the test API server is down")
}

async fn handle(shared: Arc<Shared>, req: Request<Incoming>) -> Response<Body> {
    let path = req.uri().path().to_string();
    let query: BTreeMap<String, String> =
        form_urlencoded::parse(req.uri().query().unwrap_or("").as_bytes()).into_owned().collect();
    let watch = query.get("watch").is_some_and(|w| w == "true" || w == "1");
    let routed = route(&path);
    let authorization = req.headers().get("authorization").and_then(|v| v.to_str().ok()).map(str::to_string);
    let required = {
        let mut st = shared.lock();
        st.requests.push(RequestLog {
            method: req.method().to_string(),
            uri: req.uri().to_string(),
            kind: routed.as_ref().map(|(k, _)| *k),
            watch,
            authorization: authorization.clone(),
        });
        st.required_token.clone()
    };
    if let Some(token) = required
        && authorization.as_deref() != Some(format!("Bearer {token}").as_str())
    {
        return error_response(401, "Unauthorized", "Unauthorized");
    }

    if matches!(*req.method(), Method::POST | Method::PATCH)
        && let Some((ns, name)) = events_path(&path)
    {
        return handle_event_write(&shared, req, ns, name).await;
    }

    if let Some((kind, namespace, name)) = route_one(&path)
        && req.method() == Method::GET
    {
        let st = shared.lock();
        if st.down {
            return down_response();
        }
        let found = st.objects.iter().find(|(k, v)| {
            k.0 == kind
                && v["metadata"]["name"].as_str() == Some(name.as_str())
                && namespace.as_deref().is_none_or(|ns| v["metadata"]["namespace"].as_str() == Some(ns))
        });
        return match found {
            Some((_, v)) => json_response(200, v),
            None => error_response(404, "NotFound", &format!("{} \"{name}\" not found", kind.name())),
        };
    }
    let Some((kind, namespace)) = routed else {
        return error_response(404, "NotFound", &format!("the server could not find {path}"));
    };
    if req.method() != Method::GET {
        return error_response(405, "MethodNotAllowed", "only GET is served for this resource");
    }

    // Stalls and injected failures.
    let stall = shared.lock().stalled_until.filter(|(k, _)| k.is_none_or(|k| k == kind)).map(|(_, until)| until);
    if let Some(until) = stall {
        tokio::time::sleep_until(until).await;
    }
    let failure = {
        let mut st = shared.lock();
        let at = st.failures.iter().position(|(k, _)| k.is_none_or(|k| k == kind));
        let list_at =
            (!watch).then(|| st.list_failures.iter().position(|(k, _)| k.is_none_or(|k| k == kind))).flatten();
        match (at, list_at) {
            (Some(i), _) => Some(st.failures.remove(i).1),
            (None, Some(i)) => Some(st.list_failures.remove(i).1),
            (None, None) => None,
        }
    };
    if let Some(code) = failure {
        return error_response(code, "InternalError", "injected failure");
    }

    let labels = match parse_selector(query.get("labelSelector").map_or("", String::as_str), true) {
        Ok(l) => l,
        Err(e) => return error_response(400, "BadRequest", &e),
    };
    let fields = match parse_selector(query.get("fieldSelector").map_or("", String::as_str), false) {
        Ok(f) => f,
        Err(e) => return error_response(400, "BadRequest", &e),
    };
    let filter = Filter { kind, namespace, labels, fields };

    if !watch {
        let st = shared.lock();
        if st.down {
            return down_response();
        }
        let items: Vec<&Value> =
            st.objects.iter().filter(|(k, v)| k.0 == kind && filter.matches(v)).map(|(_, v)| v).collect();
        let list = json!({
            "apiVersion": kind.api_version(),
            "kind": format!("{}List", kind.name()),
            "metadata": {"resourceVersion": st.rv.to_string()},
            "items": items,
        });
        return json_response(200, &list);
    }

    let timeout = query.get("timeoutSeconds").and_then(|t| t.parse::<u64>().ok()).unwrap_or(1800);
    let bookmarks = query.get("allowWatchBookmarks").is_some_and(|b| b == "true");
    let initial_events = query.get("sendInitialEvents").is_some_and(|b| b == "true");
    let rv_param = query.get("resourceVersion").cloned().unwrap_or_default();
    let (tx, rx) = mpsc::unbounded_channel::<Msg>();
    {
        let mut st = shared.lock();
        if st.down {
            return down_response();
        }
        let from_scratch = rv_param.is_empty() || rv_param == "0" || initial_events;
        if from_scratch {
            for (_, v) in st.objects.iter().filter(|(k, v)| k.0 == kind && filter.matches(v)) {
                let _ = tx.send(Msg::Data(line(&json!({"type": "ADDED", "object": v}))));
            }
            if initial_events && bookmarks {
                let _ = tx.send(Msg::Data(line(&bookmark(kind, st.rv, true))));
            }
        } else {
            let Ok(from) = rv_param.parse::<u64>() else {
                return error_response(400, "BadRequest", &format!("invalid resourceVersion {rv_param:?}"));
            };
            if from < st.compacted {
                st.expired += 1;
                let gone = status(410, "Expired", &format!("too old resource version: {from} ({})", st.compacted));
                let body = line(&json!({"type": "ERROR", "object": gone}));
                return stream_response(
                    StreamBody::new(futures::stream::iter([Ok::<_, BoxError>(Frame::data(body))])).boxed_unsync(),
                );
            }
            for change in st.history.iter().filter(|c| c.rv > from) {
                if let Some(event) = change.event_for(&filter) {
                    let _ = tx.send(Msg::Data(line(&event)));
                }
            }
        }
        st.watchers.push(Watcher { filter, tx });
    }
    let deadline = Instant::now() + Duration::from_secs(timeout);
    let stream = futures::stream::unfold(Some(rx), move |rx| async move {
        let mut rx = rx?;
        match tokio::time::timeout_at(deadline, rx.recv()).await {
            Ok(Some(Msg::Data(bytes))) => Some((Ok::<_, BoxError>(Frame::data(bytes)), Some(rx))),
            Ok(Some(Msg::Cut)) => Some((Err(BoxError::from("watch cut by the test")), None)),
            _ => None,
        }
    });
    stream_response(StreamBody::new(stream.boxed()).boxed_unsync())
}

fn stream_response(body: Body) -> Response<Body> {
    let mut res = Response::new(body);
    res.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    res
}
