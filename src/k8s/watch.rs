//! The real watches: kube-runtime watchers (list, then watch, re-listing on expiry or
//! errors with backoff) for Services, EndpointSlices and this Node, consumed into the event
//! handlers of [`super`].

use std::sync::Arc;

use futures::{Stream, StreamExt};
use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::networking::v1::ServiceCIDR;
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use kube::{Api, Client};
use tokio_util::sync::CancellationToken;

use crate::k8s::events::EventRecorder;

use super::objects::{ServiceView, SliceView, convert_event};
use super::{NodeEvents, ProxierSet, ServiceEvents, SliceEvents, WATCH_LABEL_SELECTOR};

/// Called with every state of this Node (`None`: deleted).
pub type NodeCallback = Arc<dyn Fn(Option<&Node>) + Send + Sync>;

/// Called with the CIDRs of all ServiceCIDR objects, sorted and without repeats, whenever
/// they change (nftables mode drops traffic to unallocated ClusterIPs inside them).
pub type ServiceCidrCallback = Arc<dyn Fn(&[String]) + Send + Sync>;

/// The ServiceCIDR objects seen so far, by name (upstream's handler keeps the union of
/// their `spec.cidrs`).
#[derive(Default)]
pub(crate) struct ServiceCidrEvents {
    by_name: std::collections::BTreeMap<String, Vec<String>>,
    listed: Option<std::collections::BTreeMap<String, Vec<String>>>,
}

impl ServiceCidrEvents {
    /// Applies one watch event; `Some(union)` when the CIDRs changed (or the first listing
    /// finished).
    pub(crate) fn handle(&mut self, event: Event<ServiceCIDR>) -> Option<Vec<String>> {
        let cidrs_of = |o: &ServiceCIDR| o.spec.as_ref().and_then(|s| s.cidrs.clone()).unwrap_or_default();
        let name_of = |o: &ServiceCIDR| o.metadata.name.clone().unwrap_or_default();
        let before = self.union();
        match event {
            Event::Apply(o) => {
                self.by_name.insert(name_of(&o), cidrs_of(&o));
            }
            Event::Delete(o) => {
                self.by_name.remove(&name_of(&o));
            }
            Event::Init => self.listed = Some(Default::default()),
            Event::InitApply(o) => {
                self.listed.get_or_insert_with(Default::default).insert(name_of(&o), cidrs_of(&o));
            }
            Event::InitDone => {
                self.by_name = self.listed.take().unwrap_or_default();
                return Some(self.union());
            }
        }
        let after = self.union();
        (after != before).then_some(after)
    }

    fn union(&self) -> Vec<String> {
        let all: std::collections::BTreeSet<&String> = self.by_name.values().flatten().collect();
        all.into_iter().cloned().collect()
    }
}

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
    run_with_events(client, hostname, proxiers, on_node, None, None, shutdown).await;
}

/// Like [`run`]; with `events`, Services and EndpointSlices skipped as invalid get a Warning
/// event; with `on_service_cidrs`, ServiceCIDR objects are watched too.
pub(crate) async fn run_with_events(
    client: Client,
    hostname: String,
    proxiers: ProxierSet,
    on_node: NodeCallback,
    on_service_cidrs: Option<ServiceCidrCallback>,
    events: Option<Arc<dyn EventRecorder>>,
    shutdown: CancellationToken,
) {
    let service_cidrs = on_service_cidrs.map(|callback| {
        let stream = watcher(Api::<ServiceCIDR>::all(client.clone()), watcher::Config::default()).default_backoff();
        let mut state = ServiceCidrEvents::default();
        consume("ServiceCIDR", stream, shutdown.clone(), move |e| {
            if let Some(cidrs) = state.handle(e) {
                tracing::info!(cidrs = ?cidrs, "ServiceCIDRs changed");
                callback(&cidrs);
            }
        })
    });
    let service_cidrs = async move {
        if let Some(watch) = service_cidrs {
            watch.await;
        }
    };
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
        service_cidrs,
    );
}

fn watcher<K>(api: Api<K>, config: watcher::Config) -> impl Stream<Item = Result<Event<K>, watcher::Error>> + Send
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + 'static,
    K::DynamicType: Default,
{
    watcher::watcher(api, config)
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::networking::v1::ServiceCIDRSpec;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    fn cidr(name: &str, cidrs: &[&str]) -> ServiceCIDR {
        ServiceCIDR {
            metadata: ObjectMeta { name: Some(name.into()), ..Default::default() },
            spec: Some(ServiceCIDRSpec { cidrs: Some(cidrs.iter().map(|c| c.to_string()).collect()) }),
            ..Default::default()
        }
    }

    #[test]
    fn service_cidrs_are_the_union_of_all_objects_reported_on_change() {
        let mut state = ServiceCidrEvents::default();
        assert_eq!(state.handle(Event::Init), None);
        assert_eq!(state.handle(Event::InitApply(cidr("kubernetes", &["198.19.0.0/16", "fd00:10::/108"]))), None);
        assert_eq!(state.handle(Event::InitDone), Some(vec!["198.19.0.0/16".to_string(), "fd00:10::/108".to_string()]));
        // Another object with an overlapping list: only the new CIDR is added.
        assert_eq!(
            state.handle(Event::Apply(cidr("extra", &["198.19.0.0/16", "203.0.113.0/24"]))),
            Some(vec!["198.19.0.0/16".into(), "203.0.113.0/24".into(), "fd00:10::/108".into()])
        );
        assert_eq!(state.handle(Event::Apply(cidr("extra", &["203.0.113.0/24", "198.19.0.0/16"]))), None);
        assert_eq!(
            state.handle(Event::Delete(cidr("kubernetes", &[]))),
            Some(vec!["198.19.0.0/16".into(), "203.0.113.0/24".into()])
        );
        // A re-list replaces everything once it is complete.
        assert_eq!(state.handle(Event::Init), None);
        assert_eq!(state.handle(Event::InitDone), Some(vec![]));
    }
}
