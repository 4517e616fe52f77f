//! One read of the cluster state a node's rules depend on, for the commands that compare or
//! render without running the daemon (`diff --kubeconfig`): the Services and EndpointSlices
//! the watches would see (same label selector, same slim decoding) and this node's Node.

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
pub struct ClusterState {
    pub services: Vec<Service>,
    pub endpoint_slices: Vec<EndpointSlice>,
    /// This node's Node object, `None` when there is none of that name.
    pub node: Option<Node>,
}

/// Lists Services, EndpointSlices and the Node named `node_name`.
pub async fn cluster_state(client: &Client, node_name: &str) -> Result<ClusterState, ListError> {
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
