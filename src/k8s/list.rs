//! One read of the cluster state a node's rules depend on, for the commands that compare or
//! render without running the daemon (`diff --kubeconfig`): the Services and EndpointSlices
//! the watches would see (same label selector, same slim decoding) and this node's Node;
//! and the daemon's wait for its Node at start-up.

use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::ListParams;
use kube::{Api, Client};

use super::WATCH_LABEL_SELECTOR;
use super::objects::{ServiceView, SliceView};

#[derive(Debug, thiserror::Error)]
#[error("failed to list {what} from the API server: {source}")]
pub struct ListError {
    pub what: &'static str,
    #[source]
    pub source: kube::Error,
}

/// What the watches would hold once synced.
#[derive(Debug, Clone, Default)]
pub(crate) struct ClusterState {
    pub services: Vec<Service>,
    pub endpoint_slices: Vec<EndpointSlice>,
    /// This node's Node object, `None` when there is none of that name.
    pub node: Option<Node>,
}

/// Lists Services, EndpointSlices and the Node named `node_name`.
pub(crate) async fn cluster_state(client: &Client, node_name: &str) -> Result<ClusterState, ListError> {
    let params = ListParams::default().labels(WATCH_LABEL_SELECTOR);
    let services = Api::<ServiceView>::all(client.clone())
        .list(&params)
        .await
        .map_err(|source| ListError { what: "Services", source })?;
    let slices = Api::<SliceView>::all(client.clone())
        .list(&params)
        .await
        .map_err(|source| ListError { what: "EndpointSlices", source })?;
    let node = Api::<Node>::all(client.clone())
        .get_opt(node_name)
        .await
        .map_err(|source| ListError { what: "Nodes", source })?;
    Ok(ClusterState {
        services: services.items.into_iter().map(Service::from).collect(),
        endpoint_slices: slices.items.into_iter().map(EndpointSlice::from).collect(),
        node,
    })
}

/// Upstream waits for its Node for a while to learn the node IPs; so do we (about 30 s).
pub(crate) async fn wait_for_node(client: &Client, name: &str) -> Option<Node> {
    let api: Api<Node> = Api::all(client.clone());
    let mut delay = std::time::Duration::from_millis(500);
    for _ in 0..8 {
        match api.get_opt(name).await {
            Ok(Some(node)) => return Some(node),
            Ok(None) => tracing::info!(node = name, "node not found yet"),
            Err(e) => {
                crate::k8s::client::log_request_failure(&format!("get Node {name}"), &e);
            }
        }
        tokio::time::sleep(delay).await;
        delay = (delay * 2).min(std::time::Duration::from_secs(8));
    }
    tracing::warn!(node = name, "could not get this node; assuming loopback node IPs (set --bind-address if wrong)");
    None
}
