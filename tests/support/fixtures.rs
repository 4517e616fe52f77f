//! Fixture builders that read like the scenario:
//! `svc("ns1", "svc1").cluster_ip("172.30.0.41").tcp("p80", 80)`.
//!
//! They build API objects exactly as written, with no defaulting, like the `render` command
//! takes manifests.

#![allow(dead_code)] // each test module uses a different subset

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    ClientIPConfig, LoadBalancerIngress, LoadBalancerStatus, Node, NodeAddress, NodeSpec, NodeStatus, Service,
    ServicePort, ServiceSpec, ServiceStatus, SessionAffinityConfig,
};
use k8s_openapi::api::discovery::v1::{
    Endpoint, EndpointConditions, EndpointHints, EndpointPort, EndpointSlice, ForNode, ForZone,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

pub struct SvcBuilder(pub Service);

pub fn svc(ns: &str, name: &str) -> SvcBuilder {
    SvcBuilder(Service {
        metadata: ObjectMeta { namespace: Some(ns.into()), name: Some(name.into()), ..Default::default() },
        spec: Some(ServiceSpec::default()),
        status: None,
    })
}

impl SvcBuilder {
    fn spec(&mut self) -> &mut ServiceSpec {
        self.0.spec.get_or_insert_with(Default::default)
    }

    pub fn type_(mut self, t: &str) -> Self {
        self.spec().type_ = Some(t.into());
        self
    }

    /// Sets clusterIP and clusterIPs (and the family list) to this one address.
    pub fn cluster_ip(mut self, ip: &str) -> Self {
        let fam = if ip.contains(':') { "IPv6" } else { "IPv4" };
        let s = self.spec();
        s.cluster_ip = Some(ip.into());
        s.cluster_ips = Some(vec![ip.into()]);
        s.ip_families = Some(vec![fam.into()]);
        if s.type_.is_none() {
            s.type_ = Some("ClusterIP".into());
        }
        self
    }

    /// Sets only `spec.clusterIP`, as upstream's test helpers do (no clusterIPs, no families,
    /// no type).
    pub fn bare_cluster_ip(mut self, ip: &str) -> Self {
        self.spec().cluster_ip = Some(ip.into());
        self
    }

    /// Dual-stack cluster IPs, primary first.
    pub fn cluster_ips(mut self, ips: &[&str]) -> Self {
        let s = self.spec();
        s.cluster_ip = Some(ips[0].into());
        s.cluster_ips = Some(ips.iter().map(|i| i.to_string()).collect());
        s.ip_families = Some(ips.iter().map(|i| if i.contains(':') { "IPv6".into() } else { "IPv4".into() }).collect());
        if s.type_.is_none() {
            s.type_ = Some("ClusterIP".into());
        }
        self
    }

    pub fn port(mut self, name: &str, proto: &str, port: i32, node_port: i32) -> Self {
        let p = ServicePort {
            name: Some(name.into()),
            protocol: Some(proto.into()),
            port,
            node_port: (node_port != 0).then_some(node_port),
            ..Default::default()
        };
        self.spec().ports.get_or_insert_with(Vec::new).push(p);
        self
    }

    pub fn tcp(self, name: &str, port: i32) -> Self {
        self.port(name, "TCP", port, 0)
    }

    pub fn udp(self, name: &str, port: i32) -> Self {
        self.port(name, "UDP", port, 0)
    }

    pub fn sctp(self, name: &str, port: i32) -> Self {
        self.port(name, "SCTP", port, 0)
    }

    pub fn node_port(self, name: &str, port: i32, node_port: i32) -> Self {
        self.port(name, "TCP", port, node_port)
    }

    pub fn external_ips(mut self, ips: &[&str]) -> Self {
        self.spec().external_ips = Some(ips.iter().map(|i| i.to_string()).collect());
        self
    }

    /// Load-balancer ingresses with `ipMode` (`VIP` or `Proxy`) given per IP.
    pub fn lb_ingress_modes(mut self, ingresses: &[(&str, &str)]) -> Self {
        self.0.status = Some(ServiceStatus {
            load_balancer: Some(LoadBalancerStatus {
                ingress: Some(
                    ingresses
                        .iter()
                        .map(|(ip, mode)| LoadBalancerIngress {
                            ip: Some(ip.to_string()),
                            ip_mode: Some(mode.to_string()),
                            ..Default::default()
                        })
                        .collect(),
                ),
            }),
            ..Default::default()
        });
        self
    }

    pub fn lb_ingress(mut self, ips: &[&str]) -> Self {
        self.0.status = Some(ServiceStatus {
            load_balancer: Some(LoadBalancerStatus {
                ingress: Some(
                    ips.iter()
                        .map(|ip| LoadBalancerIngress { ip: Some(ip.to_string()), ..Default::default() })
                        .collect(),
                ),
            }),
            ..Default::default()
        });
        self
    }

    pub fn source_ranges(mut self, ranges: &[&str]) -> Self {
        self.spec().load_balancer_source_ranges = Some(ranges.iter().map(|i| i.to_string()).collect());
        self
    }

    /// `spec.trafficDistribution` (kube-proxy never reads it; the EndpointSlice controller
    /// writes hints because of it).
    pub fn traffic_distribution(mut self, value: &str) -> Self {
        self.spec().traffic_distribution = Some(value.into());
        self
    }

    pub fn annotation(mut self, k: &str, v: &str) -> Self {
        self.0.metadata.annotations.get_or_insert_with(BTreeMap::new).insert(k.into(), v.into());
        self
    }

    pub fn local_traffic(mut self) -> Self {
        self.spec().external_traffic_policy = Some("Local".into());
        self
    }

    pub fn external_policy(mut self, p: &str) -> Self {
        self.spec().external_traffic_policy = Some(p.into());
        self
    }

    pub fn internal_local(mut self) -> Self {
        self.spec().internal_traffic_policy = Some("Local".into());
        self
    }

    pub fn health_check_node_port(mut self, p: i32) -> Self {
        self.spec().health_check_node_port = Some(p);
        self
    }

    pub fn affinity(mut self, seconds: Option<i32>) -> Self {
        let s = self.spec();
        s.session_affinity = Some("ClientIP".into());
        s.session_affinity_config =
            seconds.map(|t| SessionAffinityConfig { client_ip: Some(ClientIPConfig { timeout_seconds: Some(t) }) });
        self
    }

    pub fn build(self) -> Service {
        self.0
    }
}

pub struct SliceBuilder(pub EndpointSlice);

/// An EndpointSlice for service `ns/svc`, named `name`.
pub fn slice(ns: &str, svc: &str, name: &str) -> SliceBuilder {
    let mut labels = BTreeMap::new();
    labels.insert("kubernetes.io/service-name".to_string(), svc.to_string());
    SliceBuilder(EndpointSlice {
        metadata: ObjectMeta {
            namespace: Some(ns.into()),
            name: Some(name.into()),
            labels: Some(labels),
            ..Default::default()
        },
        address_type: "IPv4".into(),
        endpoints: Vec::new(),
        ports: Some(Vec::new()),
    })
}

pub struct Ep {
    pub ip: String,
    pub node: Option<String>,
    pub zone: Option<String>,
    pub ready: Option<bool>,
    pub serving: Option<bool>,
    pub terminating: Option<bool>,
    pub hints: Option<Vec<String>>,
    /// `hints.forNodes` names.
    pub node_hints: Option<Vec<String>>,
}

/// An endpoint with no conditions at all (ready, as upstream reads a nil `ready`).
pub fn bare_ep(ip: &str) -> Ep {
    Ep {
        ip: ip.into(),
        node: None,
        zone: None,
        ready: None,
        serving: None,
        terminating: None,
        hints: None,
        node_hints: None,
    }
}

/// A ready endpoint.
pub fn ep(ip: &str) -> Ep {
    Ep {
        ip: ip.into(),
        node: None,
        zone: None,
        ready: Some(true),
        serving: Some(true),
        terminating: Some(false),
        hints: None,
        node_hints: None,
    }
}

impl Ep {
    pub fn node(mut self, n: &str) -> Self {
        self.node = Some(n.into());
        self
    }
    pub fn zone(mut self, z: &str) -> Self {
        self.zone = Some(z.into());
        self
    }
    pub fn hints(mut self, zones: &[&str]) -> Self {
        self.hints = Some(zones.iter().map(|z| z.to_string()).collect());
        self
    }
    /// `hints.forNodes` (written for `trafficDistribution: PreferSameNode`).
    pub fn node_hints(mut self, nodes: &[&str]) -> Self {
        self.node_hints = Some(nodes.iter().map(|n| n.to_string()).collect());
        self
    }
    /// Not ready, still serving, terminating.
    pub fn terminating(mut self) -> Self {
        self.ready = Some(false);
        self.serving = Some(true);
        self.terminating = Some(true);
        self
    }
    pub fn not_ready(mut self) -> Self {
        self.ready = Some(false);
        self.serving = Some(false);
        self.terminating = Some(false);
        self
    }
}

impl SliceBuilder {
    pub fn ipv6(mut self) -> Self {
        self.0.address_type = "IPv6".into();
        self
    }

    pub fn port(mut self, name: &str, proto: &str, port: i32) -> Self {
        self.0.ports.get_or_insert_with(Vec::new).push(EndpointPort {
            name: Some(name.into()),
            protocol: Some(proto.into()),
            port: Some(port),
            app_protocol: None,
        });
        self
    }

    pub fn tcp(self, name: &str, port: i32) -> Self {
        self.port(name, "TCP", port)
    }

    pub fn udp(self, name: &str, port: i32) -> Self {
        self.port(name, "UDP", port)
    }

    pub fn endpoint(mut self, e: Ep) -> Self {
        self.0.endpoints.push(Endpoint {
            addresses: vec![e.ip],
            conditions: (e.ready.is_some() || e.serving.is_some() || e.terminating.is_some())
                .then_some(EndpointConditions { ready: e.ready, serving: e.serving, terminating: e.terminating }),
            node_name: e.node,
            zone: e.zone,
            hints: (e.hints.is_some() || e.node_hints.is_some()).then(|| EndpointHints {
                for_zones: e.hints.map(|zones| zones.into_iter().map(|name| ForZone { name }).collect()),
                for_nodes: e.node_hints.map(|nodes| nodes.into_iter().map(|name| ForNode { name }).collect()),
            }),
            ..Default::default()
        });
        self
    }

    pub fn ips(mut self, ips: &[&str]) -> Self {
        for ip in ips {
            self = self.endpoint(ep(ip));
        }
        self
    }

    pub fn build(self) -> EndpointSlice {
        self.0
    }
}

/// A Node with labels, pod CIDRs and InternalIP addresses.
pub fn node(name: &str, labels: &[(&str, &str)], pod_cidrs: &[&str], ips: &[&str]) -> Node {
    Node {
        metadata: ObjectMeta {
            name: Some(name.into()),
            labels: Some(labels.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()),
            ..Default::default()
        },
        spec: Some(NodeSpec {
            pod_cidr: pod_cidrs.first().map(|c| c.to_string()),
            pod_cidrs: Some(pod_cidrs.iter().map(|c| c.to_string()).collect()),
            ..Default::default()
        }),
        status: Some(NodeStatus {
            addresses: Some(
                ips.iter().map(|a| NodeAddress { type_: "InternalIP".into(), address: a.to_string() }).collect(),
            ),
            ..Default::default()
        }),
    }
}
