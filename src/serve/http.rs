//! The small HTTP/1 server the node services share: the proxier health server, the metrics
//! server and the per-service health-check node ports.
//!
//! Owns accepting connections, serving them with hyper, and shutting down when a
//! [`CancellationToken`] fires. Handlers are plain synchronous functions of the request head
//! (every endpoint kube-proxy serves answers from in-memory state), so nothing here knows what
//! is being served. A server's listening socket can be closed synchronously
//! ([`ServerHandle::close`]), so a port given up in one sync can be bound again in the same sync.
//!
//! These ports face the node network (`:10256` listens on every address by default), so every
//! server bounds what a client can make it hold ([`Limits`], production values by default):
//!
//! - **Concurrent connections** ([`MAX_CONNECTIONS`] per server). At the cap the accept loop
//!   stops accepting until a connection ends; further clients wait in the kernel's listen
//!   backlog, which costs this process neither a file descriptor nor memory (the kernel bounds
//!   the queue by the backlog and `somaxconn`, and drops or cookies SYNs beyond it). Accepting
//!   and closing instead would spend an fd and an accept per attempt and turn every waiting
//!   client, probes included, into an immediate failure; in the backlog a probe is answered as
//!   soon as a slot frees, which the timeouts below guarantee within seconds.
//! - **Idle connections** ([`IDLE_TIMEOUT`]): a connection that moves no byte in either
//!   direction for that long is closed, whether it is between keep-alive requests, has never
//!   sent anything, or stalls part-way through a head or a response. hyper has no such timer,
//!   so [`IdleTimeout`] wraps the socket (see there for why it is hand-written).
//! - **Slow heads** ([`HEADER_READ_TIMEOUT`], hyper's timer): a client trickling its head a
//!   byte at a time (slowloris) keeps the idle timer fresh, so a head must also be complete
//!   within this time.
//! - **Large heads** ([`MAX_HEAD_BYTES`], hyper's `max_buf_size`): a request head that does not
//!   fit is answered `431 Request Header Fields Too Large` and the connection closed, so a
//!   connection holds at most that much of a client's bytes (hyper's default is ~400 KiB).
//! - **Methods**: only `GET` and `HEAD` reach a handler; anything else is answered `405 Method
//!   Not Allowed` with `Allow: GET, HEAD` and the connection closed (an unread request body is
//!   never drained). Upstream answers any method; no client of these endpoints sends another.
//!
//! So one server holds at most [`MAX_CONNECTIONS`] descriptors and about [`MAX_HEAD_BYTES`] of
//! buffered request per connection, whatever its clients do, and the daemon keeps descriptors
//! and memory for iptables-restore, conntrack and its watches.

use std::convert::Infallible;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::header::{ALLOW, CONNECTION, CONTENT_TYPE, HeaderValue};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::{Instant, Sleep};
use tokio_util::sync::CancellationToken;

/// Response bodies are always complete in memory.
pub type Body = Full<Bytes>;

/// Connections one server serves at once. Its clients are a kubelet probe, a Prometheus
/// scraper and a cloud load balancer's health checkers (a handful each), so 100 leaves ample
/// room while bounding descriptors per server.
pub const MAX_CONNECTIONS: usize = 100;

/// Longest a client may take to send a request head, counted from when the server is ready
/// for it (hyper starts the timer then, so it also bounds a keep-alive wait). Real clients send
/// their head in one packet; 10 s frees a slot held by a slowloris client quickly, yet leaves
/// a slow network plenty of margin.
pub(crate) const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// Longest a connection may move no byte in either direction. Probes and scrapes are one
/// request every few seconds or more, and reconnecting costs a loopback or LAN round trip, so
/// keeping idle connections longer buys clients little and costs a slot each.
pub(crate) const IDLE_TIMEOUT: Duration = Duration::from_secs(5);

/// Largest request head (request line and headers) read. The requests these endpoints get are
/// a few hundred bytes; 16 KiB is what common proxies allow per header block.
pub(crate) const MAX_HEAD_BYTES: usize = 16 * 1024;

/// The smallest head limit hyper accepts (its initial read buffer); smaller values are raised
/// to it, since hyper panics below it.
pub(crate) const MIN_HEAD_BYTES: usize = 8192;

/// Pause after a failed `accept` (out of file descriptors, ...) so the loop does not spin.
const ACCEPT_ERROR_BACKOFF: Duration = Duration::from_millis(100);

/// `X-Content-Type-Options`, which every kube-proxy endpoint sets to `nosniff`.
pub(crate) const X_CONTENT_TYPE_OPTIONS: &str = "x-content-type-options";

/// What a server answers to a method other than GET or HEAD lists in `Allow`.
pub(crate) const ALLOWED_METHODS: &str = "GET, HEAD";

/// What one server lets its clients hold; [`Limits::default`] is the production setting
/// (tests use short timeouts).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Connections served at once; more wait in the listen backlog. At least 1.
    pub max_connections: usize,
    /// See [`HEADER_READ_TIMEOUT`].
    pub header_read_timeout: Duration,
    /// See [`IDLE_TIMEOUT`].
    pub idle_timeout: Duration,
    /// See [`MAX_HEAD_BYTES`]; at least [`MIN_HEAD_BYTES`].
    pub max_head_bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_connections: MAX_CONNECTIONS,
            header_read_timeout: HEADER_READ_TIMEOUT,
            idle_timeout: IDLE_TIMEOUT,
            max_head_bytes: MAX_HEAD_BYTES,
        }
    }
}

impl Limits {
    /// The values actually applied: a cap of at least one connection and a head limit hyper
    /// accepts.
    fn effective(self) -> Limits {
        Limits {
            max_connections: self.max_connections.max(1),
            max_head_bytes: self.max_head_bytes.max(MIN_HEAD_BYTES),
            ..self
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    #[error("failed to listen on {addr}: {source}")]
    Bind { addr: SocketAddr, source: io::Error },
    #[error("failed to register the listener on {addr} with the runtime: {source}")]
    Register { addr: SocketAddr, source: io::Error },
}

pub type Result<T, E = HttpError> = std::result::Result<T, E>;

/// Answers one request from its head; must not block.
pub trait Handler: Send + Sync + 'static {
    fn handle(&self, req: &Request<Incoming>) -> Response<Body>;
}

impl<F> Handler for F
where
    F: Fn(&Request<Incoming>) -> Response<Body> + Send + Sync + 'static,
{
    fn handle(&self, req: &Request<Incoming>) -> Response<Body> {
        self(req)
    }
}

/// A response with the given status, `Content-Type`, `X-Content-Type-Options: nosniff` and body.
pub(crate) fn respond(status: StatusCode, content_type: &'static str, body: impl Into<Bytes>) -> Response<Body> {
    let mut resp = Response::new(Full::new(body.into()));
    *resp.status_mut() = status;
    let headers = resp.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    headers.insert(X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    resp
}

/// Go's `http.NotFound`: `404 page not found`.
pub(crate) fn not_found() -> Response<Body> {
    respond(StatusCode::NOT_FOUND, "text/plain; charset=utf-8", "404 page not found\n")
}

/// `405 Method Not Allowed` as Go's `ServeMux` writes it, with `Allow: GET, HEAD`; the
/// connection is closed after it, so a request body is never read.
pub(crate) fn method_not_allowed() -> Response<Body> {
    let mut resp = respond(StatusCode::METHOD_NOT_ALLOWED, "text/plain; charset=utf-8", "Method Not Allowed\n");
    resp.headers_mut().insert(ALLOW, HeaderValue::from_static(ALLOWED_METHODS));
    resp.headers_mut().insert(CONNECTION, HeaderValue::from_static("close"));
    resp
}

/// Binds a listening socket (from async code; `SO_REUSEADDR` is set, as Go does).
pub async fn bind(addr: SocketAddr) -> Result<TcpListener> {
    TcpListener::bind(addr).await.map_err(|source| HttpError::Bind { addr, source })
}

/// Binds a listening socket synchronously and registers it with the runtime behind `runtime`.
pub(crate) fn bind_sync(addr: SocketAddr, runtime: &tokio::runtime::Handle) -> Result<TcpListener> {
    let std_listener = std::net::TcpListener::bind(addr).map_err(|source| HttpError::Bind { addr, source })?;
    std_listener.set_nonblocking(true).map_err(|source| HttpError::Register { addr, source })?;
    let _entered = runtime.enter();
    TcpListener::from_std(std_listener).map_err(|source| HttpError::Register { addr, source })
}

/// The listening socket, shared between the accept loop and [`ServerHandle::close`]: taking
/// it out of the slot closes it at once, whatever the accept loop is doing.
type ListenerSlot = Arc<Mutex<Option<TcpListener>>>;

/// A running server started with [`spawn`].
#[derive(Debug)]
pub struct ServerHandle {
    local_addr: SocketAddr,
    slot: ListenerSlot,
    /// Stops the accept loop and asks open connections to finish their current request.
    cancel: CancellationToken,
}

impl ServerHandle {
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Closes the listening socket (the port is free when this returns) and lets open
    /// connections finish the request they are serving.
    pub fn close(&self) {
        drop(self.slot.lock().unwrap_or_else(PoisonError::into_inner).take());
        self.cancel.cancel();
    }
}

impl Drop for ServerHandle {
    fn drop(&mut self) {
        self.close();
    }
}

/// Serves `listener` on `runtime` with `limits` until the handle is closed or dropped, or
/// `cancel` fires.
pub fn spawn(
    runtime: &tokio::runtime::Handle,
    listener: TcpListener,
    handler: Arc<dyn Handler>,
    limits: Limits,
    cancel: CancellationToken,
) -> io::Result<ServerHandle> {
    let local_addr = listener.local_addr()?;
    let slot: ListenerSlot = Arc::new(Mutex::new(Some(listener)));
    let cancel = cancel.child_token();
    runtime.spawn(accept_loop(slot.clone(), handler, limits, cancel.clone(), local_addr));
    Ok(ServerHandle { local_addr, slot, cancel })
}

/// Serves `listener` with `limits` until `cancel` fires; open connections are then asked to
/// finish their current request and close (they are not waited for).
pub async fn serve(listener: TcpListener, handler: Arc<dyn Handler>, limits: Limits, cancel: CancellationToken) {
    let local_addr = match listener.local_addr() {
        Ok(addr) => addr,
        Err(e) => {
            tracing::error!(error = %e, "cannot serve a listener without a local address");
            return;
        }
    };
    accept_loop(Arc::new(Mutex::new(Some(listener))), handler, limits, cancel, local_addr).await;
}

async fn accept_loop(
    slot: ListenerSlot,
    handler: Arc<dyn Handler>,
    limits: Limits,
    cancel: CancellationToken,
    addr: SocketAddr,
) {
    let limits = limits.effective();
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    tracing::debug!(%addr, max_connections = limits.max_connections, "serving HTTP");
    let mut at_cap_logged = false;
    loop {
        // A slot first, then a connection: at the cap, clients wait in the listen backlog.
        let permit = match slots.clone().try_acquire_owned() {
            Ok(permit) => permit,
            Err(_) => {
                if !at_cap_logged {
                    tracing::warn!(%addr, max_connections = limits.max_connections, "connection limit reached; new clients wait in the listen backlog");
                    at_cap_logged = true;
                }
                tokio::select! {
                    () = cancel.cancelled() => break,
                    permit = slots.clone().acquire_owned() => match permit {
                        Ok(permit) => permit,
                        Err(_) => break,
                    },
                }
            }
        };
        let accepted = tokio::select! {
            () = cancel.cancelled() => break,
            accepted = accept(&slot) => accepted,
        };
        match accepted {
            None => break,
            Some(Ok((stream, _peer))) => {
                if slots.available_permits() > 0 {
                    at_cap_logged = false;
                }
                tokio::spawn(serve_connection(stream, handler.clone(), limits, permit, cancel.clone()));
            }
            Some(Err(e)) => {
                tracing::warn!(%addr, error = %e, "failed to accept a connection");
                tokio::time::sleep(ACCEPT_ERROR_BACKOFF).await;
            }
        }
    }
    drop(slot.lock().unwrap_or_else(PoisonError::into_inner).take());
    tracing::debug!(%addr, "stopped serving HTTP");
}

/// Accepts the next connection, or `None` once the listener has been taken out of the slot.
async fn accept(slot: &Mutex<Option<TcpListener>>) -> Option<io::Result<(TcpStream, SocketAddr)>> {
    std::future::poll_fn(|cx| {
        let guard = slot.lock().unwrap_or_else(PoisonError::into_inner);
        match guard.as_ref() {
            None => Poll::Ready(None),
            Some(listener) => listener.poll_accept(cx).map(Some),
        }
    })
    .await
}

/// Serves one connection; `_slot` is its place under the connection cap, given back when the
/// connection ends.
async fn serve_connection(
    stream: TcpStream,
    handler: Arc<dyn Handler>,
    limits: Limits,
    _slot: OwnedSemaphorePermit,
    cancel: CancellationToken,
) {
    let service = service_fn(move |req: Request<Incoming>| {
        let resp = if req.method() == Method::GET || req.method() == Method::HEAD {
            handler.handle(&req)
        } else {
            tracing::debug!(method = %req.method(), path = req.uri().path(), "method not allowed");
            method_not_allowed()
        };
        async move { Ok::<_, Infallible>(resp) }
    });
    let conn = http1::Builder::new()
        // Header names as Go writes them (`X-Content-Type-Options`), for clients that compare
        // them byte for byte.
        .title_case_headers(true)
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .max_buf_size(limits.max_head_bytes)
        .serve_connection(TokioIo::new(IdleTimeout::new(stream, limits.idle_timeout)), service);
    tokio::pin!(conn);
    let result = tokio::select! {
        result = conn.as_mut() => result,
        () = cancel.cancelled() => {
            conn.as_mut().graceful_shutdown();
            conn.await
        }
    };
    if let Err(e) = result {
        tracing::debug!(error = %e, "HTTP connection ended with an error");
    }
}

/// A stream that fails with [`io::ErrorKind::TimedOut`] once no byte has moved in either
/// direction for `idle`, which makes hyper drop the connection.
///
/// Hand-written because nothing in the dependency tree offers it for a server: hyper 1 has
/// only the header timer, hyper-timeout's stream wrapper is private to its client connector,
/// and tokio-io-timeout times reads and writes separately and is not otherwise needed. It is a
/// deadline reset on progress, tested through the server (`idle_connections_are_closed`).
#[derive(Debug)]
pub(crate) struct IdleTimeout<S> {
    inner: S,
    idle: Duration,
    deadline: Pin<Box<Sleep>>,
}

impl<S> IdleTimeout<S> {
    pub fn new(inner: S, idle: Duration) -> Self {
        IdleTimeout { inner, idle, deadline: Box::pin(tokio::time::sleep(idle)) }
    }

    fn progressed(&mut self) {
        let next = Instant::now() + self.idle;
        self.deadline.as_mut().reset(next);
    }

    /// The outcome of a write on the inner stream: bytes written count as progress; not ready
    /// means the idle deadline decides.
    fn after_write(&mut self, cx: &mut Context<'_>, polled: Poll<io::Result<usize>>) -> Poll<io::Result<usize>> {
        match polled {
            Poll::Ready(Ok(n)) => {
                if n > 0 {
                    self.progressed();
                }
                Poll::Ready(Ok(n))
            }
            Poll::Pending => self.poll_idle(cx),
            ready => ready,
        }
    }

    /// Called when the inner stream is not ready: time out if the deadline has passed (the
    /// task is woken when it does).
    fn poll_idle<T>(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<T>> {
        match self.deadline.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(io::Error::new(io::ErrorKind::TimedOut, "connection idle"))),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for IdleTimeout<S> {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        match Pin::new(&mut this.inner).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                if buf.filled().len() > before {
                    this.progressed();
                }
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => this.poll_idle(cx),
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for IdleTimeout<S> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.inner).poll_write(cx, buf);
        this.after_write(cx, polled)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.inner).poll_write_vectored(cx, bufs);
        this.after_write(cx, polled)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        match Pin::new(&mut this.inner).poll_flush(cx) {
            Poll::Pending => this.poll_idle(cx),
            ready => ready,
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        match Pin::new(&mut this.inner).poll_shutdown(cx) {
            Poll::Pending => this.poll_idle(cx),
            ready => ready,
        }
    }
}

#[cfg(test)]
pub(crate) mod test_client {
    //! A bare HTTP/1.1 client for tests: one request per connection, the whole response read.

    use std::collections::BTreeMap;
    use std::net::SocketAddr;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    #[derive(Debug)]
    pub(crate) struct TestResponse {
        pub status: u16,
        /// Lower-cased header names.
        pub headers: BTreeMap<String, String>,
        pub body: String,
        /// Status line and headers as received.
        pub raw_head: String,
    }

    impl TestResponse {
        pub fn header(&self, name: &str) -> Option<&str> {
            self.headers.get(&name.to_ascii_lowercase()).map(String::as_str)
        }

        pub fn json(&self) -> serde_json::Value {
            serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("invalid JSON {:?}: {e}", self.body))
        }
    }

    pub async fn request(addr: SocketAddr, method: &str, path: &str) -> std::io::Result<TestResponse> {
        let mut stream = TcpStream::connect(addr).await?;
        let req = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
        stream.write_all(req.as_bytes()).await?;
        let mut raw = Vec::new();
        stream.read_to_end(&mut raw).await?;
        let text = String::from_utf8_lossy(&raw).into_owned();
        let (head, body) = text.split_once("\r\n\r\n").unwrap_or((text.as_str(), ""));
        let mut lines = head.split("\r\n");
        let status = lines.next().and_then(|l| l.split(' ').nth(1)).and_then(|s| s.parse().ok()).unwrap_or(0);
        let headers = lines
            .filter_map(|l| l.split_once(':'))
            .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
            .collect();
        Ok(TestResponse { status, headers, body: body.to_string(), raw_head: head.to_string() })
    }

    /// Whether a connection to `addr` that sends nothing is closed by the server within
    /// `limit`.
    pub(crate) async fn silent_connection_closed(addr: SocketAddr, limit: std::time::Duration) -> bool {
        let Ok(mut stream) = TcpStream::connect(addr).await else {
            return false;
        };
        let mut buf = [0u8; 64];
        matches!(tokio::time::timeout(limit, stream.read(&mut buf)).await, Ok(Ok(0) | Err(_)))
    }

    pub async fn get(addr: SocketAddr, path: &str) -> TestResponse {
        request(addr, "GET", path).await.unwrap_or_else(|e| panic!("GET http://{addr}{path}: {e}"))
    }
}

#[cfg(test)]
mod tests {
    use super::test_client::get;
    use super::*;

    fn echo_path() -> Arc<dyn Handler> {
        Arc::new(|req: &Request<Incoming>| respond(StatusCode::OK, "text/plain", req.uri().path().to_string()))
    }

    #[tokio::test]
    async fn serves_until_cancelled() {
        let listener = bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let cancel = CancellationToken::new();
        let task = tokio::spawn(serve(listener, echo_path(), Limits::default(), cancel.clone()));
        let resp = get(addr, "/hello").await;
        assert_eq!((resp.status, resp.body.as_str()), (200, "/hello"));
        assert_eq!(resp.header("x-content-type-options"), Some("nosniff"));
        assert!(resp.raw_head.contains("\r\nX-Content-Type-Options: nosniff\r\n"), "{}", resp.raw_head);
        cancel.cancel();
        task.await.unwrap();
        assert!(TcpStream::connect(addr).await.is_err(), "listener still open after shutdown");
    }

    #[tokio::test]
    async fn close_frees_the_port_synchronously() {
        let runtime = tokio::runtime::Handle::current();
        let listener = bind_sync("127.0.0.1:0".parse().unwrap(), &runtime).unwrap();
        let server = spawn(&runtime, listener, echo_path(), Limits::default(), CancellationToken::new()).unwrap();
        let addr = server.local_addr();
        assert_eq!(get(addr, "/x").await.status, 200);
        server.close();
        // The same port can be bound again straight away.
        let again = bind_sync(addr, &runtime).expect("port not released by close()");
        drop(again);
    }

    #[tokio::test]
    async fn bind_error_names_the_address() {
        let taken = bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
        let addr = taken.local_addr().unwrap();
        let err = bind(addr).await.unwrap_err();
        assert!(err.to_string().starts_with(&format!("failed to listen on {addr}: ")), "{err}");
    }
}

/// The hostile-client properties of [`Limits`], each against a real server on loopback with
/// short timeouts. Every bound asserted is generous (these tests measure nothing; figures are
/// in docs/performance.md) yet several times below what the server would allow without the
/// limit under test.
#[cfg(test)]
mod limits_tests {
    use std::collections::HashSet;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpSocket;

    use super::test_client::{get, request};
    use super::*;

    /// Long enough never to fire in a test that is not about it.
    const NEVER: Duration = Duration::from_secs(600);
    /// How long a test waits for something the limits must make happen within milliseconds.
    const PATIENCE: Duration = Duration::from_secs(20);

    /// Answers every request `ok`, counting them.
    fn counting() -> (Arc<dyn Handler>, Arc<AtomicUsize>) {
        let calls = Arc::new(AtomicUsize::new(0));
        let seen = calls.clone();
        let handler = Arc::new(move |_: &Request<Incoming>| {
            seen.fetch_add(1, Ordering::SeqCst);
            respond(StatusCode::OK, "text/plain", "ok")
        });
        (handler, calls)
    }

    async fn start(limits: Limits, handler: Arc<dyn Handler>) -> (SocketAddr, CancellationToken) {
        let listener = bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
        start_on(listener, limits, handler)
    }

    fn start_on(listener: TcpListener, limits: Limits, handler: Arc<dyn Handler>) -> (SocketAddr, CancellationToken) {
        let addr = listener.local_addr().unwrap();
        let cancel = CancellationToken::new();
        tokio::spawn(serve(listener, handler, limits, cancel.clone()));
        (addr, cancel)
    }

    /// Descriptors this process holds for server-side connections of `port`: sockets whose
    /// local port is `port` and are not the listener (client sockets of the same test have
    /// `port` as their remote port, so they are not counted).
    fn server_connection_fds(port: u16) -> usize {
        let mut inodes = HashSet::new();
        for table in ["/proc/self/net/tcp", "/proc/self/net/tcp6"] {
            let Ok(text) = std::fs::read_to_string(table) else { continue };
            for line in text.lines().skip(1) {
                let fields: Vec<&str> = line.split_whitespace().collect();
                let Some((local, state, inode)) =
                    fields.get(1).zip(fields.get(3)).zip(fields.get(9)).map(|((l, s), i)| (l, s, i))
                else {
                    continue;
                };
                let local_port = local.rsplit(':').next().and_then(|p| u16::from_str_radix(p, 16).ok());
                // 0A is LISTEN; inode 0 is a connection still in the accept queue (no fd).
                if local_port == Some(port) && *state != "0A" && *inode != "0" {
                    inodes.insert((*inode).to_string());
                }
            }
        }
        std::fs::read_dir("/proc/self/fd")
            .expect("/proc/self/fd")
            .filter_map(|entry| std::fs::read_link(entry.ok()?.path()).ok())
            .filter(|target| {
                let target = target.to_string_lossy();
                target.strip_prefix("socket:[").and_then(|s| s.strip_suffix(']')).is_some_and(|i| inodes.contains(i))
            })
            .count()
    }

    fn open_fds() -> usize {
        std::fs::read_dir("/proc/self/fd").expect("/proc/self/fd").count()
    }

    /// Reads until the peer closes (EOF or reset); `None` if it is still open after `limit`.
    async fn closed_within(stream: &mut TcpStream, limit: Duration) -> Option<Vec<u8>> {
        let mut seen = Vec::new();
        let read = tokio::time::timeout(limit, async {
            let mut buf = [0u8; 4096];
            loop {
                match stream.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => seen.extend_from_slice(&buf[..n]),
                }
            }
        })
        .await;
        read.ok().map(|()| seen)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn ten_thousand_connection_attempts_keep_descriptors_bounded_and_healthz_answering() {
        // The clients' sockets live in this process too: 1000 at a time, fewer if the
        // open-file limit cannot allow that (still several times the cap).
        use crate::node::fd_limit::{OpenFileLimit, ProcessOpenFileLimit, raise_open_file_limit};
        raise_open_file_limit(&ProcessOpenFileLimit);
        let soft = ProcessOpenFileLimit.get().map_or(1024, |(soft, _)| usize::try_from(soft).unwrap_or(usize::MAX));
        let limits = Limits {
            idle_timeout: Duration::from_millis(100),
            header_read_timeout: Duration::from_secs(1),
            ..Limits::default()
        };
        let cap = limits.max_connections;
        let (handler, _) = counting();
        let (addr, cancel) = start(limits, handler).await;
        let baseline = open_fds();
        let per_burst = soft.saturating_sub(baseline + cap + 64).min(1000);
        assert!(per_burst >= 3 * cap, "open-file limit {soft} too low for bursts of several times the cap");
        let bursts = 10_000usize.div_ceil(per_burst);
        let mut connected = 0;
        let mut max_seen = 0;
        for burst in 0..bursts {
            // A burst of idle connections, held open.
            let attempts =
                (0..per_burst).map(|_| tokio::time::timeout(Duration::from_secs(5), TcpStream::connect(addr)));
            let clients: Vec<TcpStream> =
                join_spawned(attempts).await.into_iter().filter_map(|r| r.ok().and_then(Result::ok)).collect();
            connected += clients.len();
            // A probe queued behind them is answered once the idle timeout frees slots,
            // and the server never holds more than the cap meanwhile.
            let probe = tokio::spawn(async move { request(addr, "GET", "/healthz").await });
            let started = Instant::now();
            while !probe.is_finished() {
                max_seen = max_seen.max(server_connection_fds(addr.port()));
                assert!(max_seen <= cap, "burst {burst}: {max_seen} server connections open, cap {cap}");
                assert!(started.elapsed() < Duration::from_secs(60), "burst {burst}: /healthz not answered");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            let resp = probe.await.unwrap().unwrap_or_else(|e| panic!("burst {burst}: /healthz failed: {e}"));
            assert_eq!((resp.status, resp.body.as_str()), (200, "ok"), "burst {burst}");
            drop(clients);
        }
        assert!(connected >= bursts * per_burst / 2, "only {connected} of {} attempts connected", bursts * per_burst);
        assert_eq!(max_seen, cap, "the bursts never filled the cap: the test exercised nothing");
        // Everything is given back once the clients are gone.
        let started = Instant::now();
        while server_connection_fds(addr.port()) > 0 || open_fds() > baseline + 8 {
            assert!(started.elapsed() < PATIENCE, "descriptors not released: {} open, {baseline} before", open_fds());
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        cancel.cancel();
    }

    /// Runs every future as its own task and collects the results in order.
    async fn join_spawned<F>(futures: impl Iterator<Item = F>) -> Vec<F::Output>
    where
        F: std::future::Future + Send + 'static,
        F::Output: Send + 'static,
    {
        let handles: Vec<_> = futures.map(tokio::spawn).collect();
        let mut out = Vec::with_capacity(handles.len());
        for handle in handles {
            out.push(handle.await.expect("connect task"));
        }
        out
    }

    #[tokio::test]
    async fn slowloris_heads_are_dropped_by_the_header_timeout() {
        // The idle timer never fires (a byte arrives every 20 ms): only the head timer can.
        let limits =
            Limits { header_read_timeout: Duration::from_millis(300), idle_timeout: NEVER, ..Limits::default() };
        let (handler, calls) = counting();
        let (addr, cancel) = start(limits, handler).await;
        let stream = TcpStream::connect(addr).await.unwrap();
        let (mut reader, mut writer) = stream.into_split();
        let closed = tokio::spawn(async move {
            let mut buf = [0u8; 256];
            loop {
                match reader.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {}
                }
            }
        });
        writer.write_all(b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: ").await.unwrap();
        let started = Instant::now();
        while !closed.is_finished() {
            assert!(started.elapsed() < PATIENCE, "a client trickling its head is still connected");
            if writer.write_all(b"a").await.is_err() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        closed.await.unwrap();
        assert_eq!(calls.load(Ordering::SeqCst), 0);
        cancel.cancel();
    }

    #[tokio::test]
    async fn oversized_heads_get_431_after_at_most_the_bound() {
        // Small socket buffers on both sides, so what the client manages to write is close to
        // what the server read: with hyper's default (~400 KiB) it would write far more.
        let socket = TcpSocket::new_v4().unwrap();
        socket.set_recv_buffer_size(4096).unwrap();
        socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let listener = socket.listen(16).unwrap();
        let (handler, calls) = counting();
        let (addr, cancel) = start_on(listener, Limits::default(), handler);

        let client = TcpSocket::new_v4().unwrap();
        client.set_send_buffer_size(4096).unwrap();
        let stream = client.connect(addr).await.unwrap();
        let (mut reader, mut writer) = stream.into_split();
        let response = tokio::spawn(async move {
            let mut seen = Vec::new();
            let _ = reader.read_to_end(&mut seen).await;
            seen
        });
        let total = 1024 * 1024;
        let mut written = 0;
        writer.write_all(b"GET / HTTP/1.1\r\nHost: x\r\nX-Pad: ").await.unwrap();
        let chunk = [b'a'; 4096];
        while written < total {
            match tokio::time::timeout(PATIENCE, writer.write(&chunk)).await {
                Err(_) => panic!("the server neither read nor closed after {written} bytes"),
                Ok(Err(_)) => break,
                Ok(Ok(n)) => written += n,
            }
        }
        assert!(written < 128 * 1024, "the server took {written} bytes of a head limited to {MAX_HEAD_BYTES}");
        let response = tokio::time::timeout(PATIENCE, response).await.expect("connection not closed").unwrap();
        let text = String::from_utf8_lossy(&response);
        assert!(text.starts_with("HTTP/1.1 431 Request Header Fields Too Large\r\n"), "{text:?}");
        assert_eq!(calls.load(Ordering::SeqCst), 0);
        cancel.cancel();
    }

    #[tokio::test]
    async fn heads_within_the_bound_are_served() {
        let (handler, _) = counting();
        let (addr, cancel) = start(Limits::default(), handler).await;
        let mut stream = TcpStream::connect(addr).await.unwrap();
        let pad = "a".repeat(MAX_HEAD_BYTES / 2);
        let req = format!("GET / HTTP/1.1\r\nHost: x\r\nX-Pad: {pad}\r\nConnection: close\r\n\r\n");
        stream.write_all(req.as_bytes()).await.unwrap();
        let resp = closed_within(&mut stream, PATIENCE).await.expect("not answered");
        assert!(resp.starts_with(b"HTTP/1.1 200 OK\r\n"), "{}", String::from_utf8_lossy(&resp));
        cancel.cancel();
    }

    #[tokio::test]
    async fn idle_connections_are_closed() {
        // The head timer never fires: only the idle timer can close these.
        let limits =
            Limits { header_read_timeout: NEVER, idle_timeout: Duration::from_millis(200), ..Limits::default() };
        let (handler, calls) = counting();
        let (addr, cancel) = start(limits, handler).await;

        // A keep-alive connection after its request.
        let mut kept = TcpStream::connect(addr).await.unwrap();
        kept.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").await.unwrap();
        let seen = closed_within(&mut kept, PATIENCE).await.expect("an idle keep-alive connection stayed open");
        assert!(seen.starts_with(b"HTTP/1.1 200 OK\r\n"), "{}", String::from_utf8_lossy(&seen));
        assert!(seen.ends_with(b"\r\n\r\nok"), "{}", String::from_utf8_lossy(&seen));
        assert_eq!(calls.load(Ordering::SeqCst), 1);

        // A connection that never sends anything, and one that stops half-way through a head.
        let mut silent = TcpStream::connect(addr).await.unwrap();
        assert_eq!(closed_within(&mut silent, PATIENCE).await.as_deref(), Some(&b""[..]), "silent connection");
        let mut stalled = TcpStream::connect(addr).await.unwrap();
        stalled.write_all(b"GET / HTTP/1.1\r\nHo").await.unwrap();
        assert!(closed_within(&mut stalled, PATIENCE).await.is_some(), "stalled head stayed open");
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        cancel.cancel();
    }

    #[tokio::test]
    async fn only_get_and_head_reach_the_handler() {
        let (handler, calls) = counting();
        let (addr, cancel) = start(Limits::default(), handler).await;
        for method in ["POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE"] {
            let resp = request(addr, method, "/healthz").await.unwrap_or_else(|e| panic!("{method}: {e}"));
            assert_eq!(resp.status, 405, "{method}");
            assert_eq!(resp.header("allow"), Some("GET, HEAD"), "{method}");
            assert_eq!(resp.body, "Method Not Allowed\n", "{method}");
            assert_eq!(resp.header("content-type"), Some("text/plain; charset=utf-8"), "{method}");
        }
        assert_eq!(calls.load(Ordering::SeqCst), 0);
        assert_eq!(get(addr, "/healthz").await.status, 200);
        let head = request(addr, "HEAD", "/healthz").await.unwrap();
        assert_eq!((head.status, head.body.as_str()), (200, ""));
        assert_eq!(calls.load(Ordering::SeqCst), 2);

        // A body sent with a refused method is not read: the connection is closed after the
        // answer.
        let mut stream = TcpStream::connect(addr).await.unwrap();
        stream.write_all(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n\r\nabc").await.unwrap();
        let resp = closed_within(&mut stream, PATIENCE).await.expect("connection kept open after 405");
        assert!(resp.starts_with(b"HTTP/1.1 405 Method Not Allowed\r\n"), "{}", String::from_utf8_lossy(&resp));
        cancel.cancel();
    }

    #[tokio::test]
    async fn large_responses_are_not_limited_by_the_head_bound() {
        let body = "m".repeat(1024 * 1024);
        let expected = body.clone();
        let handler: Arc<dyn Handler> =
            Arc::new(move |_: &Request<Incoming>| respond(StatusCode::OK, "text/plain", body.clone()));
        let (addr, cancel) = start(Limits::default(), handler).await;
        let resp = get(addr, "/metrics").await;
        assert_eq!(resp.status, 200);
        assert!(resp.body == expected, "body of {} bytes", resp.body.len());
        cancel.cancel();
    }

    #[tokio::test]
    async fn out_of_range_limits_are_raised_not_panicked_on() {
        let limits = Limits { max_connections: 0, max_head_bytes: 0, ..Limits::default() };
        assert_eq!(limits.effective(), Limits { max_connections: 1, max_head_bytes: MIN_HEAD_BYTES, ..limits });
        let (handler, _) = counting();
        let (addr, cancel) = start(limits, handler).await;
        assert_eq!(get(addr, "/").await.status, 200);
        cancel.cancel();
    }
}
