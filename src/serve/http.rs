//! The small HTTP/1 server the node services share: the proxier health server, the metrics
//! server and the per-service health-check node ports.
//!
//! Owns accepting connections, serving them with hyper, and shutting down when a
//! [`CancellationToken`] fires. Handlers are plain synchronous functions of the request head
//! (every endpoint kube-proxy serves answers from in-memory state), so nothing here knows what
//! is being served. A server's listening socket can be closed synchronously
//! ([`ServerHandle::close`]), so a port given up in one sync can be bound again in the same sync.

use std::convert::Infallible;
use std::io;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::Poll;
use std::time::Duration;

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::header::{CONTENT_TYPE, HeaderValue};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

/// Response bodies are always complete in memory.
pub type Body = Full<Bytes>;

/// Longest a client may take to send its request head before the connection is dropped.
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(30);

/// Pause after a failed `accept` (out of file descriptors, ...) so the loop does not spin.
const ACCEPT_ERROR_BACKOFF: Duration = Duration::from_millis(100);

/// `X-Content-Type-Options`, which every kube-proxy endpoint sets to `nosniff`.
pub const X_CONTENT_TYPE_OPTIONS: &str = "x-content-type-options";

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
pub fn respond(status: StatusCode, content_type: &'static str, body: impl Into<Bytes>) -> Response<Body> {
    let mut resp = Response::new(Full::new(body.into()));
    *resp.status_mut() = status;
    let headers = resp.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    headers.insert(X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    resp
}

/// Go's `http.NotFound`: `404 page not found`.
pub fn not_found() -> Response<Body> {
    respond(StatusCode::NOT_FOUND, "text/plain; charset=utf-8", "404 page not found\n")
}

/// Binds a listening socket (from async code; `SO_REUSEADDR` is set, as Go does).
pub async fn bind(addr: SocketAddr) -> Result<TcpListener> {
    TcpListener::bind(addr).await.map_err(|source| HttpError::Bind { addr, source })
}

/// Binds a listening socket synchronously and registers it with the runtime behind `runtime`.
pub fn bind_sync(addr: SocketAddr, runtime: &tokio::runtime::Handle) -> Result<TcpListener> {
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

/// Serves `listener` on `runtime` until the handle is closed or dropped, or `cancel` fires.
pub fn spawn(
    runtime: &tokio::runtime::Handle,
    listener: TcpListener,
    handler: Arc<dyn Handler>,
    cancel: CancellationToken,
) -> io::Result<ServerHandle> {
    let local_addr = listener.local_addr()?;
    let slot: ListenerSlot = Arc::new(Mutex::new(Some(listener)));
    let cancel = cancel.child_token();
    runtime.spawn(accept_loop(slot.clone(), handler, cancel.clone(), local_addr));
    Ok(ServerHandle { local_addr, slot, cancel })
}

/// Serves `listener` until `cancel` fires; open connections are then asked to finish their
/// current request and close (they are not waited for).
pub async fn serve(listener: TcpListener, handler: Arc<dyn Handler>, cancel: CancellationToken) {
    let local_addr = match listener.local_addr() {
        Ok(addr) => addr,
        Err(e) => {
            tracing::error!(error = %e, "cannot serve a listener without a local address");
            return;
        }
    };
    accept_loop(Arc::new(Mutex::new(Some(listener))), handler, cancel, local_addr).await;
}

async fn accept_loop(slot: ListenerSlot, handler: Arc<dyn Handler>, cancel: CancellationToken, addr: SocketAddr) {
    tracing::debug!(%addr, "serving HTTP");
    loop {
        let accepted = tokio::select! {
            () = cancel.cancelled() => break,
            accepted = accept(&slot) => accepted,
        };
        match accepted {
            None => break,
            Some(Ok((stream, _peer))) => {
                tokio::spawn(serve_connection(stream, handler.clone(), cancel.clone()));
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

async fn serve_connection(stream: TcpStream, handler: Arc<dyn Handler>, cancel: CancellationToken) {
    let service = service_fn(move |req: Request<Incoming>| {
        let resp = handler.handle(&req);
        async move { Ok::<_, Infallible>(resp) }
    });
    let conn = http1::Builder::new()
        // Header names as Go writes them (`X-Content-Type-Options`), for clients that compare
        // them byte for byte.
        .title_case_headers(true)
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_READ_TIMEOUT)
        .serve_connection(TokioIo::new(stream), service);
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

#[cfg(test)]
pub(crate) mod test_client {
    //! A bare HTTP/1.1 client for tests: one request per connection, the whole response read.

    use std::collections::BTreeMap;
    use std::net::SocketAddr;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    #[derive(Debug)]
    pub struct TestResponse {
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
        let task = tokio::spawn(serve(listener, echo_path(), cancel.clone()));
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
        let server = spawn(&runtime, listener, echo_path(), CancellationToken::new()).unwrap();
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
