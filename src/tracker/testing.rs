//! Fixture builders for the unit and integration tests (the `testing` feature): Services,
//! EndpointSlices and Nodes that read like the scenario:
//! `svc("ns1", "svc1").cluster_ip("172.30.0.41").tcp("p80", 80)`.
//!
//! They build API objects exactly as written, with no defaulting, like the `render` command
//! takes manifests.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    ClientIPConfig, LoadBalancerIngress, LoadBalancerStatus, Node, NodeAddress, NodeSpec, NodeStatus, Service,
    ServicePort, ServiceSpec, ServiceStatus, SessionAffinityConfig,
};
use k8s_openapi::api::discovery::v1::{
    Endpoint, EndpointConditions, EndpointHints, EndpointPort, EndpointSlice, ForNode, ForZone,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use super::endpoint_slice_cache::LABEL_SERVICE_NAME;

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

    /// `clusterIP`, `clusterIPs` and `ipFamilies` exactly as given (the families need not
    /// match the addresses), primary first; `type` untouched.
    pub fn cluster_ips_with_families(mut self, ips: &[(&str, &str)]) -> Self {
        let s = self.spec();
        s.cluster_ip = ips.first().map(|(ip, _)| (*ip).into());
        s.cluster_ips = Some(ips.iter().map(|(ip, _)| (*ip).into()).collect());
        s.ip_families = Some(ips.iter().map(|(_, f)| (*f).into()).collect());
        self
    }

    /// A port; an empty `proto` leaves `protocol` out, a `node_port` of 0 leaves `nodePort`
    /// out.
    pub fn port(mut self, name: &str, proto: &str, port: i32, node_port: i32) -> Self {
        let p = ServicePort {
            name: Some(name.into()),
            protocol: (!proto.is_empty()).then(|| proto.into()),
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

    pub fn internal_local(self) -> Self {
        self.internal_policy("Local")
    }

    pub fn internal_policy(mut self, p: &str) -> Self {
        self.spec().internal_traffic_policy = Some(p.into());
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
    labels.insert(LABEL_SERVICE_NAME.to_string(), svc.to_string());
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

/// An endpoint of a [`SliceBuilder`].
pub struct Ep(pub Endpoint);

/// An endpoint with no conditions at all (ready, as upstream reads a nil `ready`).
pub fn bare_ep(ip: &str) -> Ep {
    Ep(Endpoint { addresses: vec![ip.into()], ..Default::default() })
}

/// A ready endpoint.
pub fn ep(ip: &str) -> Ep {
    bare_ep(ip).conditions(Some(true), Some(true), Some(false))
}

impl Ep {
    pub fn node(mut self, n: &str) -> Self {
        self.0.node_name = Some(n.into());
        self
    }
    pub fn zone(mut self, z: &str) -> Self {
        self.0.zone = Some(z.into());
        self
    }
    /// `hints.forZones`.
    pub fn hints(mut self, zones: &[&str]) -> Self {
        let hints = self.0.hints.get_or_insert_with(EndpointHints::default);
        hints.for_zones = Some(zones.iter().map(|z| ForZone { name: z.to_string() }).collect());
        self
    }
    /// `hints.forNodes` (written for `trafficDistribution: PreferSameNode`).
    pub fn node_hints(mut self, nodes: &[&str]) -> Self {
        let hints = self.0.hints.get_or_insert_with(EndpointHints::default);
        hints.for_nodes = Some(nodes.iter().map(|n| ForNode { name: n.to_string() }).collect());
        self
    }
    /// `conditions` exactly as given (all three `None` still writes an empty `conditions`).
    pub fn conditions(mut self, ready: Option<bool>, serving: Option<bool>, terminating: Option<bool>) -> Self {
        self.0.conditions = Some(EndpointConditions { ready, serving, terminating });
        self
    }
    /// Not ready, still serving, terminating.
    pub fn terminating(self) -> Self {
        self.conditions(Some(false), Some(true), Some(true))
    }
    pub fn not_ready(self) -> Self {
        self.conditions(Some(false), Some(false), Some(false))
    }
    /// No addresses at all (an invalid endpoint the API server would refuse).
    pub fn no_addresses(mut self) -> Self {
        self.0.addresses.clear();
        self
    }
}

impl SliceBuilder {
    pub fn ipv6(self) -> Self {
        self.address_type("IPv6")
    }

    pub fn address_type(mut self, t: &str) -> Self {
        self.0.address_type = t.into();
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

    /// A port exactly as given.
    pub fn raw_port(mut self, port: EndpointPort) -> Self {
        self.0.ports.get_or_insert_with(Vec::new).push(port);
        self
    }

    pub fn endpoint(mut self, e: Ep) -> Self {
        self.0.endpoints.push(e.0);
        self
    }

    pub fn annotation(mut self, k: &str, v: &str) -> Self {
        self.0.metadata.annotations.get_or_insert_with(BTreeMap::new).insert(k.into(), v.into());
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
