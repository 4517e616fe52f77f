//! detect-local-mode NodeCIDR needs this node's `spec.podCIDRs` before the proxier is built:
//! wait for the IPAM controller to assign them (upstream waits up to five minutes), and once
//! running, exit when they change, since the local-traffic rules were built from them and a
//! restart is the simplest correct way to rebuild everything (upstream does the same).
//!
//! From 1.37 the same holds for the Node's IPs (`NodeIpGuard`, PR #138183): a change of them,
//! or the Node's deletion, restarts the process.

use std::time::Duration;

use k8s_openapi::api::core::v1::Node;

/// How long upstream waits for the podCIDR allocation.
pub(crate) const POD_CIDR_WAIT: Duration = Duration::from_secs(5 * 60);

#[derive(Debug, thiserror::Error)]
pub enum PodCidrError {
    #[error("timeout waiting for PodCIDR allocation to configure detect-local-mode NodeCIDR (node {node}, {waited:?})")]
    Timeout { node: String, waited: Duration },
    #[error("failed to watch node {node} for its PodCIDR allocation: {reason}")]
    Watch { node: String, reason: String },
}

/// Whether `node` has its pod CIDRs assigned and is not being deleted (upstream's condition).
pub(crate) fn has_pod_cidrs(node: &Node) -> bool {
    let deleting = node.metadata.deletion_timestamp.is_some();
    let spec = node.spec.as_ref();
    let single = spec.and_then(|s| s.pod_cidr.as_deref()).is_some_and(|c| !c.is_empty());
    let many = spec.and_then(|s| s.pod_cidrs.as_ref()).is_some_and(|c| !c.is_empty());
    !deleting && single && many
}

fn pod_cidrs(node: &Node) -> Vec<String> {
    node.spec.as_ref().and_then(|s| s.pod_cidrs.clone()).unwrap_or_default()
}

/// Watches node `name` until it has pod CIDRs, for at most `limit`.
pub async fn wait_for_pod_cidrs(client: &kube::Client, name: &str, limit: Duration) -> Result<Node, PodCidrError> {
    let api: kube::Api<Node> = kube::Api::all(client.clone());
    let cond = |n: Option<&Node>| n.is_some_and(has_pod_cidrs);
    match tokio::time::timeout(limit, kube::runtime::wait::await_condition(api, name, cond)).await {
        Err(_) => Err(PodCidrError::Timeout { node: name.to_string(), waited: limit }),
        Ok(Err(e)) => Err(PodCidrError::Watch { node: name.to_string(), reason: e.to_string() }),
        Ok(Ok(Some(node))) => Ok(node),
        // The condition only holds for a present node.
        Ok(Ok(None)) => Err(PodCidrError::Watch { node: name.to_string(), reason: "node vanished".into() }),
    }
}

/// Remembers the pod CIDRs the proxier was built with and says when the Node no longer
/// matches them (upstream's NodePodCIDRHandler).
#[derive(Debug, Default)]
pub(crate) struct PodCidrGuard {
    pod_cidrs: Vec<String>,
}

impl PodCidrGuard {
    #[cfg(test)]
    pub fn new(initial: &[String]) -> Self {
        PodCidrGuard { pod_cidrs: initial.to_vec() }
    }

    /// A guard for the pod CIDRs of `node` (none when there is no Node).
    pub fn for_node(node: Option<&Node>) -> Self {
        PodCidrGuard { pod_cidrs: node.map(pod_cidrs).unwrap_or_default() }
    }

    /// Takes a Node update (`None` = deleted); returns why the process must restart, if it must.
    pub fn on_node(&mut self, node: Option<&Node>) -> Option<String> {
        let Some(node) = node else {
            tracing::error!("current node is being deleted");
            return None;
        };
        let current = pod_cidrs(node);
        if self.pod_cidrs.is_empty() && !current.is_empty() {
            tracing::info!(pod_cidrs = ?current, "setting current PodCIDRs");
            self.pod_cidrs = current;
            return None;
        }
        if current != self.pod_cidrs {
            return Some(format!(
                "detect-local-mode NodeCIDR: node podCIDRs changed from {:?} to {:?}; restarting",
                self.pod_cidrs, current
            ));
        }
        None
    }
}

/// Remembers the Node IPs the proxier was built with and says when the Node no longer has
/// them, or is deleted (upstream 1.37 `NodeManager.OnNodeChange` / `OnNodeDelete`).
#[derive(Debug, Default)]
pub(crate) struct NodeIpGuard {
    ips: Vec<std::net::IpAddr>,
}

impl NodeIpGuard {
    /// A guard for the host IPs of `node` (none when there is no Node: the first Node seen
    /// with IPs then restarts the process, as upstream's does).
    pub fn for_node(node: Option<&Node>) -> Self {
        NodeIpGuard { ips: node.map(|n| crate::model::node::NodeInfo::from_node(n).host_ips).unwrap_or_default() }
    }

    /// Takes a Node update (`None` = deleted); returns why the process must restart, if it must.
    pub fn on_node(&mut self, node: Option<&Node>) -> Option<String> {
        let Some(node) = node else {
            return Some("Node is being deleted".to_string());
        };
        let current = crate::model::node::NodeInfo::from_node(node).host_ips;
        (current != self.ips).then(|| format!("NodeIPs changed for the node: from {:?} to {:?}", self.ips, current))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::NodeSpec;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};

    fn node(cidrs: &[&str]) -> Node {
        Node {
            metadata: ObjectMeta { name: Some("n".into()), ..Default::default() },
            spec: Some(NodeSpec {
                pod_cidr: cidrs.first().map(|c| c.to_string()),
                pod_cidrs: Some(cidrs.iter().map(|c| c.to_string()).collect()),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn pod_cidrs_must_be_assigned_and_node_not_deleting() {
        assert!(!has_pod_cidrs(&node(&[])));
        assert!(has_pod_cidrs(&node(&["10.0.1.0/24"])));
        let mut deleting = node(&["10.0.1.0/24"]);
        deleting.metadata.deletion_timestamp = Some(Time(Default::default()));
        assert!(!has_pod_cidrs(&deleting));
        let mut only_list = node(&["10.0.1.0/24"]);
        only_list.spec.as_mut().unwrap().pod_cidr = None;
        assert!(!has_pod_cidrs(&only_list), "upstream wants both podCIDR and podCIDRs");
    }

    #[test]
    fn same_cidrs_keep_running_changed_cidrs_restart() {
        let mut guard = PodCidrGuard::new(&["10.0.1.0/24".into()]);
        assert_eq!(guard.on_node(Some(&node(&["10.0.1.0/24"]))), None);
        assert_eq!(guard.on_node(None), None, "deletion is only logged");
        let why = guard.on_node(Some(&node(&["10.0.2.0/24"]))).expect("restart");
        assert!(why.contains("10.0.1.0/24") && why.contains("10.0.2.0/24"), "{why}");
        assert!(guard.on_node(Some(&node(&[]))).is_some(), "losing the CIDRs is a change too");
    }

    fn node_with_ips(ips: &[&str]) -> Node {
        let mut n = node(&[]);
        n.status = Some(k8s_openapi::api::core::v1::NodeStatus {
            addresses: Some(
                ips.iter()
                    .map(|ip| k8s_openapi::api::core::v1::NodeAddress {
                        type_: "InternalIP".into(),
                        address: ip.to_string(),
                    })
                    .collect(),
            ),
            ..Default::default()
        });
        n
    }

    #[test]
    fn node_ip_changes_and_deletion_restart() {
        let mut guard = NodeIpGuard::for_node(Some(&node_with_ips(&["198.18.0.2"])));
        assert_eq!(guard.on_node(Some(&node_with_ips(&["198.18.0.2"]))), None);
        let why = guard.on_node(Some(&node_with_ips(&["198.18.0.3"]))).expect("restart");
        assert!(why.starts_with("NodeIPs changed for the node") && why.contains("198.18.0.3"), "{why}");
        assert_eq!(guard.on_node(None).as_deref(), Some("Node is being deleted"));
        // Started without a Node: its first IPs are a change, as upstream's captured IPs are empty.
        let mut guard = NodeIpGuard::for_node(None);
        assert!(guard.on_node(Some(&node_with_ips(&["198.18.0.2"]))).is_some());
    }

    #[test]
    fn first_assignment_is_adopted_without_restart() {
        let mut guard = PodCidrGuard::new(&[]);
        assert_eq!(guard.on_node(Some(&node(&[]))), None);
        assert_eq!(guard.on_node(Some(&node(&["fd00:1::/64", "10.0.1.0/24"]))), None);
        assert!(guard.on_node(Some(&node(&["10.0.1.0/24"]))).is_some());
    }
}
