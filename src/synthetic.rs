//! Synthetic clusters for benchmarks and scale tests: N services with M endpoints each, with a
//! realistic mix of service types, as API objects or as a YAML manifest.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use k8s_openapi::api::core::v1::{
    LoadBalancerIngress, LoadBalancerStatus, Node, NodeAddress, NodeSpec, NodeStatus, Service, ServicePort,
    ServiceSpec, ServiceStatus,
};
use k8s_openapi::api::discovery::v1::{Endpoint, EndpointConditions, EndpointPort, EndpointSlice};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

/// The node the synthetic cluster is rendered for.
pub const NODE_NAME: &str = "node-0";
/// Endpoints are spread over this many nodes; one in `NODES` is local.
pub(crate) const NODES: usize = 50;

/// Shape of a synthetic cluster.
#[derive(Debug, Clone, Copy)]
pub struct ClusterShape {
    pub services: usize,
    pub endpoints_per_service: usize,
    /// Every this-many-th service has ClientIP session affinity; 0: none has. Affinity is
    /// what makes iptables-legacy slow at scale (one xt_recent table per endpoint chain), so
    /// benchmarks vary it.
    pub affinity_every: usize,
}

impl ClusterShape {
    /// The default mix: every 7th service with session affinity.
    pub const DEFAULT_AFFINITY_EVERY: usize = 7;

    /// `services` services of `endpoints_per_service` endpoints each, in the default mix.
    pub fn new(services: usize, endpoints_per_service: usize) -> Self {
        Self { services, endpoints_per_service, affinity_every: Self::DEFAULT_AFFINITY_EVERY }
    }
}

/// A generated cluster.
#[derive(Debug, Clone, Default)]
pub struct Cluster {
    pub services: Vec<Service>,
    pub slices: Vec<EndpointSlice>,
    pub node: Node,
}

fn cluster_ip(i: usize) -> String {
    // 172.16.0.0/12 holds a million services.
    let n = i + 1;
    format!("172.{}.{}.{}", 16 + (n >> 16) % 16, (n >> 8) & 255, n & 255)
}

fn endpoint_ip(i: usize, j: usize, per: usize) -> String {
    let n = i * per + j + 1;
    format!("10.{}.{}.{}", (n >> 16) & 255, (n >> 8) & 255, n & 255)
}

// Node ports are allocated as the API server would, each once (up to 10k services; beyond,
// they repeat): NodePort services (every 10th) in 30000–30999, load balancers (every 25th)
// in 31000–31799 and their health-check ports in 31800–32599. A repeated health-check port
// would fail to bind on every sync, which no real cluster does.
fn node_port(i: usize) -> i32 {
    30000 + ((i / 10) % 1000) as i32
}

fn load_balancer_node_port(i: usize) -> i32 {
    31000 + ((i / 25) % 800) as i32
}

fn health_check_node_port(i: usize) -> i32 {
    31800 + ((i / 25) % 800) as i32
}

/// Service `i` of the cluster in the default mix: mostly ClusterIP; every 10th NodePort,
/// every 25th a LoadBalancer with externalTrafficPolicy Local and source ranges, every 7th
/// with session affinity.
pub fn service(i: usize) -> Service {
    shaped_service(i, ClusterShape::DEFAULT_AFFINITY_EVERY)
}

/// Service `i`, with session affinity on every `affinity_every`-th (none if 0).
pub fn shaped_service(i: usize, affinity_every: usize) -> Service {
    let ns = format!("ns-{}", i % 100);
    let name = format!("svc-{i}");
    let ip = cluster_ip(i);
    let mut spec = ServiceSpec {
        type_: Some("ClusterIP".into()),
        cluster_ip: Some(ip.clone()),
        cluster_ips: Some(vec![ip]),
        ip_families: Some(vec!["IPv4".into()]),
        ports: Some(vec![ServicePort {
            name: Some("http".into()),
            protocol: Some("TCP".into()),
            port: 80,
            ..Default::default()
        }]),
        ..Default::default()
    };
    let mut status = None;
    if i % 10 == 3 {
        spec.type_ = Some("NodePort".into());
        if let Some(p) = spec.ports.as_mut().and_then(|p| p.first_mut()) {
            p.node_port = Some(node_port(i));
        }
        spec.external_traffic_policy = Some("Cluster".into());
    }
    if i % 25 == 5 {
        spec.type_ = Some("LoadBalancer".into());
        if let Some(p) = spec.ports.as_mut().and_then(|p| p.first_mut()) {
            p.node_port = Some(load_balancer_node_port(i));
        }
        spec.external_traffic_policy = Some("Local".into());
        spec.health_check_node_port = Some(health_check_node_port(i));
        spec.load_balancer_source_ranges = Some(vec!["203.0.113.0/24".into()]);
        status = Some(ServiceStatus {
            load_balancer: Some(LoadBalancerStatus {
                ingress: Some(vec![LoadBalancerIngress {
                    ip: Some(format!("198.18.{}.{}", (i >> 8) & 255, i & 255)),
                    ..Default::default()
                }]),
            }),
            ..Default::default()
        });
    }
    if affinity_every > 0 && i % affinity_every == 2 % affinity_every {
        spec.session_affinity = Some("ClientIP".into());
    }
    Service {
        metadata: ObjectMeta { namespace: Some(ns), name: Some(name), ..Default::default() },
        spec: Some(spec),
        status,
    }
}

/// The EndpointSlice of service `i`, with `per` ready endpoints on `version`-dependent
/// addresses (bump `version` to simulate a rollout of one service).
pub fn slice(i: usize, per: usize, version: usize) -> EndpointSlice {
    let ns = format!("ns-{}", i % 100);
    let svc = format!("svc-{i}");
    let mut labels = BTreeMap::new();
    labels.insert("kubernetes.io/service-name".to_string(), svc.clone());
    let endpoints = (0..per)
        .map(|j| Endpoint {
            addresses: vec![endpoint_ip(i, j + version * per, per)],
            conditions: Some(EndpointConditions { ready: Some(true), serving: Some(true), terminating: Some(false) }),
            node_name: Some(format!("node-{}", (i + j) % NODES)),
            ..Default::default()
        })
        .collect();
    EndpointSlice {
        metadata: ObjectMeta {
            namespace: Some(ns),
            name: Some(format!("{svc}-abcde")),
            labels: Some(labels),
            ..Default::default()
        },
        address_type: "IPv4".into(),
        endpoints,
        ports: Some(vec![EndpointPort {
            name: Some("http".into()),
            protocol: Some("TCP".into()),
            port: Some(8080),
            app_protocol: None,
        }]),
    }
}

/// This cluster's node object.
pub fn node() -> Node {
    Node {
        metadata: ObjectMeta { name: Some(NODE_NAME.into()), ..Default::default() },
        spec: Some(NodeSpec {
            pod_cidr: Some("10.0.0.0/8".into()),
            pod_cidrs: Some(vec!["10.0.0.0/8".into()]),
            ..Default::default()
        }),
        status: Some(NodeStatus {
            addresses: Some(vec![NodeAddress { type_: "InternalIP".into(), address: "192.168.0.2".into() }]),
            ..Default::default()
        }),
    }
}

/// Generates the whole cluster.
pub fn cluster(shape: ClusterShape) -> Cluster {
    Cluster {
        services: (0..shape.services).map(|i| shaped_service(i, shape.affinity_every)).collect(),
        slices: (0..shape.services).map(|i| slice(i, shape.endpoints_per_service, 0)).collect(),
        node: node(),
    }
}

/// The cluster as one YAML manifest (multi-document), as `render` reads it.
pub fn cluster_yaml(c: &Cluster) -> Result<String, serde_yaml::Error> {
    let mut out = String::new();
    let mut doc = |kind: &str, api: &str, value: serde_yaml::Value| -> Result<(), serde_yaml::Error> {
        let mut map = match value {
            serde_yaml::Value::Mapping(m) => m,
            _ => serde_yaml::Mapping::new(),
        };
        map.insert("apiVersion".into(), api.into());
        map.insert("kind".into(), kind.into());
        out.push_str("---\n");
        out.push_str(&serde_yaml::to_string(&map)?);
        Ok(())
    };
    doc("Node", "v1", serde_yaml::to_value(&c.node)?)?;
    for s in &c.services {
        doc("Service", "v1", serde_yaml::to_value(s)?)?;
    }
    for s in &c.slices {
        doc("EndpointSlice", "discovery.k8s.io/v1", serde_yaml::to_value(s)?)?;
    }
    let _ = writeln!(out);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_affinity(shape: ClusterShape) -> Vec<usize> {
        cluster(shape)
            .services
            .iter()
            .enumerate()
            .filter(|(_, s)| s.spec.as_ref().and_then(|s| s.session_affinity.as_deref()) == Some("ClientIP"))
            .map(|(i, _)| i)
            .collect()
    }

    #[test]
    fn the_default_mix_gives_every_seventh_service_affinity() {
        assert_eq!(with_affinity(ClusterShape::new(30, 1)), vec![2, 9, 16, 23]);
        let default: Vec<_> = (0..30).map(service).collect();
        assert_eq!(default, cluster(ClusterShape::new(30, 1)).services);
    }

    #[test]
    fn node_ports_are_unique_up_to_ten_thousand_services() {
        let mut seen = std::collections::HashSet::new();
        for s in cluster(ClusterShape::new(10_000, 1)).services {
            let spec = s.spec.unwrap_or_default();
            let ports = spec.ports.unwrap_or_default().into_iter().filter_map(|p| p.node_port);
            for port in ports.chain(spec.health_check_node_port) {
                assert!((30000..=32767).contains(&port), "{port} in the node port range");
                assert!(seen.insert(port), "node port {port} allocated twice");
            }
        }
        assert_eq!(seen.len(), 1000 + 2 * 400);
    }

    #[test]
    fn affinity_can_be_varied_or_left_out() {
        let mut shape = ClusterShape::new(30, 1);
        shape.affinity_every = 0;
        assert!(with_affinity(shape).is_empty());
        shape.affinity_every = 10;
        assert_eq!(with_affinity(shape), vec![2, 12, 22]);
        shape.affinity_every = 1;
        assert_eq!(with_affinity(shape).len(), 30);
    }
}
