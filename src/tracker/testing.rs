//! Fixture builders for the tracker and model tests: Services and EndpointSlices that read
//! like the scenario (`service("ns1", "svc1").cluster_ip("10.0.0.1").port("p80", "TCP", 80)`).

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    ClientIPConfig, LoadBalancerIngress, LoadBalancerStatus, Service, ServicePort, ServiceSpec, ServiceStatus,
    SessionAffinityConfig,
};
use k8s_openapi::api::discovery::v1::{
    Endpoint, EndpointConditions, EndpointHints, EndpointPort, EndpointSlice, ForZone,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use super::endpoint_slice_cache::LABEL_SERVICE_NAME;

pub(crate) struct ServiceBuilder(Service);

pub(crate) fn service(namespace: &str, name: &str) -> ServiceBuilder {
    ServiceBuilder(Service {
        metadata: ObjectMeta { namespace: Some(namespace.into()), name: Some(name.into()), ..Default::default() },
        spec: Some(ServiceSpec::default()),
        status: None,
    })
}

impl ServiceBuilder {
    fn spec(&mut self) -> &mut ServiceSpec {
        self.0.spec.get_or_insert_with(Default::default)
    }

    pub(crate) fn type_(mut self, t: &str) -> Self {
        self.spec().type_ = Some(t.into());
        self
    }

    /// Sets `clusterIP` only (an old-style single-stack object without `ipFamilies`).
    pub(crate) fn cluster_ip(mut self, ip: &str) -> Self {
        self.spec().cluster_ip = Some(ip.into());
        self
    }

    /// Sets `clusterIP`, `clusterIPs` and `ipFamilies` as a dual-stack API server would.
    pub(crate) fn cluster_ips(mut self, ips: &[(&str, &str)]) -> Self {
        let spec = self.spec();
        spec.cluster_ip = ips.first().map(|(ip, _)| (*ip).into());
        spec.cluster_ips = Some(ips.iter().map(|(ip, _)| (*ip).into()).collect());
        spec.ip_families = Some(ips.iter().map(|(_, f)| (*f).into()).collect());
        self
    }

    pub(crate) fn port(self, name: &str, protocol: &str, port: i32) -> Self {
        self.node_port(name, protocol, port, 0)
    }

    pub(crate) fn node_port(mut self, name: &str, protocol: &str, port: i32, node_port: i32) -> Self {
        self.spec().ports.get_or_insert_with(Vec::new).push(ServicePort {
            name: Some(name.into()),
            protocol: (!protocol.is_empty()).then(|| protocol.into()),
            port,
            node_port: (node_port != 0).then_some(node_port),
            ..Default::default()
        });
        self
    }

    pub(crate) fn external_ips(mut self, ips: &[&str]) -> Self {
        self.spec().external_ips = Some(ips.iter().map(|s| (*s).into()).collect());
        self
    }

    pub(crate) fn source_ranges(mut self, ranges: &[&str]) -> Self {
        self.spec().load_balancer_source_ranges = Some(ranges.iter().map(|s| (*s).into()).collect());
        self
    }

    pub(crate) fn ingress_ips(mut self, ips: &[&str]) -> Self {
        self.0.status = Some(ServiceStatus {
            load_balancer: Some(LoadBalancerStatus {
                ingress: Some(
                    ips.iter().map(|ip| LoadBalancerIngress { ip: Some((*ip).into()), ..Default::default() }).collect(),
                ),
            }),
            ..Default::default()
        });
        self
    }

    pub(crate) fn external_policy(mut self, policy: &str) -> Self {
        self.spec().external_traffic_policy = Some(policy.into());
        self
    }

    pub(crate) fn internal_policy(mut self, policy: &str) -> Self {
        self.spec().internal_traffic_policy = Some(policy.into());
        self
    }

    pub(crate) fn health_check_node_port(mut self, port: i32) -> Self {
        self.spec().health_check_node_port = Some(port);
        self
    }

    /// ClientIP affinity; `None` leaves `sessionAffinityConfig` out.
    pub(crate) fn client_ip_affinity(mut self, timeout: Option<i32>) -> Self {
        let spec = self.spec();
        spec.session_affinity = Some("ClientIP".into());
        spec.session_affinity_config =
            timeout.map(|t| SessionAffinityConfig { client_ip: Some(ClientIPConfig { timeout_seconds: Some(t) }) });
        self
    }

    pub(crate) fn annotation(mut self, key: &str, value: &str) -> Self {
        self.0.metadata.annotations.get_or_insert_with(BTreeMap::new).insert(key.into(), value.into());
        self
    }

    pub(crate) fn build(self) -> Service {
        self.0
    }
}

pub(crate) struct SliceBuilder(EndpointSlice);

/// Slice `name` of Service `namespace/service`, IPv4, no ports or endpoints yet.
pub(crate) fn slice(namespace: &str, service: &str, name: &str) -> SliceBuilder {
    SliceBuilder(EndpointSlice {
        address_type: "IPv4".into(),
        endpoints: Vec::new(),
        metadata: ObjectMeta {
            namespace: Some(namespace.into()),
            name: Some(name.into()),
            labels: Some(BTreeMap::from([(LABEL_SERVICE_NAME.to_owned(), service.to_owned())])),
            ..Default::default()
        },
        ports: None,
    })
}

impl SliceBuilder {
    pub(crate) fn address_type(mut self, t: &str) -> Self {
        self.0.address_type = t.into();
        self
    }

    pub(crate) fn port(mut self, name: &str, port: i32, protocol: &str) -> Self {
        self.0.ports.get_or_insert_with(Vec::new).push(EndpointPort {
            name: Some(name.into()),
            port: Some(port),
            protocol: Some(protocol.into()),
            ..Default::default()
        });
        self
    }

    pub(crate) fn raw_port(mut self, port: EndpointPort) -> Self {
        self.0.ports.get_or_insert_with(Vec::new).push(port);
        self
    }

    pub(crate) fn endpoint(mut self, ep: EndpointBuilder) -> Self {
        self.0.endpoints.push(ep.0);
        self
    }

    pub(crate) fn annotation(mut self, key: &str, value: &str) -> Self {
        self.0.metadata.annotations.get_or_insert_with(BTreeMap::new).insert(key.into(), value.into());
        self
    }

    pub(crate) fn build(self) -> EndpointSlice {
        self.0
    }
}

pub(crate) struct EndpointBuilder(Endpoint);

/// An endpoint at `address` with no conditions, node or hints.
pub(crate) fn ep(address: &str) -> EndpointBuilder {
    EndpointBuilder(Endpoint { addresses: vec![address.into()], ..Default::default() })
}

impl EndpointBuilder {
    pub(crate) fn node(mut self, node: &str) -> Self {
        self.0.node_name = Some(node.into());
        self
    }

    pub(crate) fn conditions(mut self, ready: Option<bool>, serving: Option<bool>, terminating: Option<bool>) -> Self {
        self.0.conditions = Some(EndpointConditions { ready, serving, terminating });
        self
    }

    pub(crate) fn zones(mut self, zones: &[&str]) -> Self {
        self.0.hints = Some(EndpointHints {
            for_zones: Some(zones.iter().map(|z| ForZone { name: (*z).into() }).collect()),
            ..Default::default()
        });
        self
    }

    pub(crate) fn no_addresses(mut self) -> Self {
        self.0.addresses.clear();
        self
    }
}
