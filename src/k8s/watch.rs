//! The real watches: kube-runtime watchers (list, then watch, re-listing on expiry or
//! errors with backoff) for Services, EndpointSlices and this Node, consumed into the event
//! handlers of [`super`].

use std::sync::Arc;

use futures::{Stream, StreamExt};
use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use kube::{Api, Client};
use tokio_util::sync::CancellationToken;

use crate::k8s::events::EventRecorder;

use super::objects::{ServiceView, SliceView, convert_event};
use super::{NodeEvents, ProxierSet, ServiceEvents, SliceEvents, WATCH_LABEL_SELECTOR};

/// Called with every state of this Node (`None`: deleted).
pub type NodeCallback = Arc<dyn Fn(Option<&Node>) + Send + Sync>;

/// Feeds `stream` to `handle` until it ends or `shutdown`. Watch errors are logged; the
/// watcher itself retries with backoff and re-lists.
pub(crate) async fn consume<K, S>(
    kind: &'static str,
    stream: S,
    shutdown: CancellationToken,
    mut handle: impl FnMut(Event<K>),
) where
    S: Stream<Item = Result<Event<K>, watcher::Error>>,
{
    let mut stream = std::pin::pin!(stream);
    loop {
        tokio::select! {
            biased;
            () = shutdown.cancelled() => return,
            next = stream.next() => match next {
                Some(Ok(event)) => handle(event),
                Some(Err(e)) => log_watch_failure(kind, &e),
                None => {
                    tracing::warn!(kind, "watch stream ended");
                    return;
                }
            },
        }
    }
}

/// Logs a watch error: authentication, authorisation and TLS failures as errors naming the
/// client's credentials (`k8s::client::log_request_failure`), the rest as a warning (the
/// watcher retries with backoff either way).
fn log_watch_failure(kind: &'static str, err: &watcher::Error) {
    let what = format!("list/watch {kind}");
    match err {
        watcher::Error::InitialListFailed(e) | watcher::Error::WatchStartFailed(e) | watcher::Error::WatchFailed(e) => {
            crate::k8s::client::log_request_failure(&what, e);
        }
        watcher::Error::WatchError(status) if matches!(status.code, 401 | 403) => {
            crate::k8s::client::log_request_failure(&what, &kube::Error::Api(status.clone()));
        }
        other => tracing::warn!(kind, error = %other, "watch failed; retrying"),
    }
}

/// Runs the three watches until `shutdown`.
pub async fn run(
    client: Client,
    hostname: String,
    proxiers: ProxierSet,
    on_node: NodeCallback,
    shutdown: CancellationToken,
) {
    run_with_events(client, hostname, proxiers, on_node, None, shutdown).await;
}

/// Like [`run`]; with `events`, Services and EndpointSlices skipped as invalid get a Warning
/// event.
pub(crate) async fn run_with_events(
    client: Client,
    hostname: String,
    proxiers: ProxierSet,
    on_node: NodeCallback,
    events: Option<Arc<dyn EventRecorder>>,
    shutdown: CancellationToken,
) {
    let selector = watcher::Config::default().labels(WATCH_LABEL_SELECTOR);
    // Services and slices are decoded slim (see `objects`), then handed on as k8s-openapi
    // objects holding only what the proxier reads.
    let services = watcher(Api::<ServiceView>::all(client.clone()), selector.clone()).default_backoff();
    let slices = watcher(Api::<SliceView>::all(client.clone()), selector).default_backoff();
    let node_cfg = watcher::Config::default().fields(&format!("metadata.name={hostname}"));
    let nodes = watcher(Api::<Node>::all(client), node_cfg).default_backoff();

    let (p1, p2, p3) = (proxiers.clone(), proxiers.clone(), proxiers);
    let (mut svc_state, mut slice_state) = match events {
        Some(recorder) => (ServiceEvents::with_events(recorder.clone()), SliceEvents::with_events(recorder)),
        None => (ServiceEvents::default(), SliceEvents::default()),
    };
    let mut node_state = NodeEvents::default();
    tokio::join!(
        consume("Service", services, shutdown.clone(), move |e| svc_state.handle(convert_event::<_, Service>(e), &p1)),
        consume("EndpointSlice", slices, shutdown.clone(), move |e| {
            slice_state.handle(convert_event::<_, EndpointSlice>(e), &p2)
        }),
        consume("Node", nodes, shutdown, move |e| node_state.handle(e, &p3, on_node.as_ref())),
    );
}

fn watcher<K>(api: Api<K>, config: watcher::Config) -> impl Stream<Item = Result<Event<K>, watcher::Error>> + Send
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + 'static,
    K::DynamicType: Default,
{
    watcher::watcher(api, config)
}
