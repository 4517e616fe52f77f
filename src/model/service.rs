//! `ServicePortInfo`: what the proxier needs to know about one port of one Service for one
//! IP family, extracted once from the v1 Service and kept compact (no API objects retained).
//!
//! [`service_ports`] owns the translation from a `v1.Service` (upstream's `ShouldSkipService`,
//! `newBaseServiceInfo` and the iptables proxier's `newServiceInfo`). Objects are read exactly
//! as written, with no API defaulting: an absent `type` is the empty string, not `ClusterIP`.
//! It never panics; input that upstream would turn into broken rules is rejected with an
//! [`InvalidService`] naming the object and the field.

use std::collections::HashSet;
use std::sync::Arc;

use k8s_openapi::api::core::v1::{LoadBalancerIngress, Service, ServiceSpec};

use super::ip::{self, AddressTextError, Cidr};
use super::names::{IpFamily, NamespacedName, Protocol, ServicePortName};
use crate::compat::Features;
use crate::model::chains::ServiceChainNames;

/// Annotation selecting topology-aware routing (`Auto`, `auto`, anything else but
/// `disabled`/`Disabled` enables hints in kube-proxy).
pub(crate) const ANNOTATION_TOPOLOGY_MODE: &str = "service.kubernetes.io/topology-mode";
/// The deprecated spelling of [`ANNOTATION_TOPOLOGY_MODE`]; it wins when both are present.
pub(crate) const ANNOTATION_TOPOLOGY_AWARE_HINTS: &str = "service.kubernetes.io/topology-aware-hints";
/// `status.loadBalancer.ingress[].ipMode` of a load balancer that delivers packets with
/// the service IP as destination (the node may short-circuit it).
pub(crate) const IP_MODE_VIP: &str = "VIP";
/// ClientIP affinity timeout used when `sessionAffinityConfig` is absent (the API default).
pub(crate) const DEFAULT_CLIENT_IP_TIMEOUT_SECONDS: i32 = 10800;
/// The legacy way to set source ranges (comma-separated CIDRs). Upstream kube-proxy 1.29
/// reads only the spec field; cloud providers fall back to this annotation when the field
/// is empty, and so do we, so that the node enforces what the load balancer enforces.
pub(crate) const ANNOTATION_LOAD_BALANCER_SOURCE_RANGES: &str =
    "service.beta.kubernetes.io/load-balancer-source-ranges";
/// Largest ClientIP affinity timeout the API accepts.
pub(crate) const MAX_CLIENT_IP_TIMEOUT_SECONDS: i32 = 86400;

/// One entry of `spec.loadBalancerSourceRanges` (or, when that is empty, of the
/// [`ANNOTATION_LOAD_BALANCER_SOURCE_RANGES`] annotation), as written in rules.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SourceRange {
    /// The text written after `-s` in the firewall chain.
    pub text: String,
    /// Parsed network, used to decide whether the node itself is allowed.
    pub cidr: Option<Cidr>,
}

/// One port of a Service, for the IP family being rendered.
///
/// Every address is validated when the port is built. The cluster IP is in Go's canonical
/// text form (1.29 holds it as a `net.IP`). External IPs, load-balancer IPs and source
/// ranges: 1.29 holds them as strings and writes them into rules verbatim, so they are kept
/// as written, but only when that text is canonical: other spellings are skipped (see
/// [`ip::parse_canonical_ip`]). From 1.30 upstream parses them (`net.IP`, `*net.IPNet`) and
/// writes Go's canonical text, so every spelling Kubernetes accepts is kept, canonicalised
/// ([`crate::compat::Release::writes_canonical_service_addresses`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServicePortInfo {
    pub name: ServicePortName,
    /// `ns/name:port` (upstream `svcPortNameString`), used in comments and hashes.
    pub name_string: String,
    pub cluster_ip: String,
    pub port: i32,
    pub protocol: Protocol,
    /// 0 when the port has no node port.
    pub node_port: i32,
    /// External IPs of this family, as written in `spec.externalIPs` (1.29) or canonical.
    pub external_ips: Vec<String>,
    /// Load-balancer ingress IPs of this family, as written in the status (1.29) or
    /// canonical.
    pub load_balancer_ips: Vec<String>,
    pub load_balancer_source_ranges: Vec<SourceRange>,
    /// Whether source ranges of this family were given but skipped as not canonical: the
    /// firewall then stays (allowing only what remains), it never opens up.
    pub source_ranges_skipped: bool,
    /// `Some(seconds)` when session affinity is ClientIP.
    pub sticky_seconds: Option<i32>,
    pub external_policy_local: bool,
    pub internal_policy_local: bool,
    /// 0 when none.
    pub health_check_node_port: i32,
    /// Whether topology hints may be used: the deprecated `topology-aware-hints`
    /// annotation if present, else `service.kubernetes.io/topology-mode`, holds anything but
    /// empty, `disabled` or `Disabled` (so `Auto`, `auto`, and even `aUto`).
    pub hints_enabled: bool,
    pub chains: ServiceChainNames,
}

impl ServicePortInfo {
    /// Whether NodePort, external IP or load-balancer traffic can reach this port.
    pub(crate) fn externally_accessible(&self) -> bool {
        self.node_port != 0 || !self.load_balancer_ips.is_empty() || !self.external_ips.is_empty()
    }

    /// Whether load-balancer traffic is filtered by source (a KUBE-FW- chain): source ranges
    /// were given for this family, even if every one was skipped as not canonical.
    pub(crate) fn filters_load_balancer_sources(&self) -> bool {
        !self.load_balancer_source_ranges.is_empty() || self.source_ranges_skipped
    }

    /// Whether any traffic to this port uses the "Cluster" endpoint set.
    pub(crate) fn uses_cluster_endpoints(&self) -> bool {
        // External traffic needs the Cluster set even with Local policy: pod and host traffic
        // to external destinations is short-circuited to it.
        !self.internal_policy_local || self.externally_accessible()
    }

    /// Whether any traffic to this port uses the "Local" endpoint set.
    pub(crate) fn uses_local_endpoints(&self) -> bool {
        self.internal_policy_local || (self.externally_accessible() && self.external_policy_local)
    }
}

/// Shared, immutable service port entries: the maps hand out clones of the `Arc`.
pub(crate) type ServicePortRef = Arc<ServicePortInfo>;

/// Why a Service was not turned into service ports. Every variant names the Service; the
/// caller logs it and treats the Service as absent.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InvalidService {
    #[error("service {service}: cluster IP {ip:?} (spec.clusterIP/clusterIPs) is not a valid {family} address")]
    ClusterIp { service: NamespacedName, family: IpFamily, ip: String },
    #[error("service {service}: spec.ports[{index}] ({port_name:?}) has port {port} outside 1-65535")]
    Port { service: NamespacedName, index: usize, port_name: String, port: i32 },
    #[error("service {service}: spec.ports[{index}] ({port_name:?}) has nodePort {node_port} outside 0-65535")]
    NodePort { service: NamespacedName, index: usize, port_name: String, node_port: i32 },
    #[error("service {service}: spec.ports[{index}] ({port_name:?}) has unknown protocol {protocol:?}")]
    Protocol { service: NamespacedName, index: usize, port_name: String, protocol: String },
    #[error("service {service}: spec.ports[{index}] duplicates port name {port_name:?} ({protocol})")]
    DuplicatePort { service: NamespacedName, index: usize, port_name: String, protocol: Protocol },
    #[error("service {service}: spec.healthCheckNodePort {port} is outside 0-65535")]
    HealthCheckNodePort { service: NamespacedName, port: i32 },
    #[error("service {service}: spec.sessionAffinityConfig.clientIP.timeoutSeconds {seconds} is outside 1-86400")]
    AffinityTimeout { service: NamespacedName, seconds: i32 },
    /// A name that goes into rule comments holds characters the restore input cannot carry
    /// (API servers only allow DNS labels): it could break the line or end the quoted
    /// comment, costing every service its rules or adding rules of its own.
    #[error(
        "service {namespace:?}/{name:?}: {field} {value:?} cannot be written into rule comments (only letters, digits, '-', '.' and '_', at most 63)"
    )]
    Name { namespace: String, name: String, field: &'static str, value: String },
}

/// The ports of `svc` that a proxier for `family` serves, in `spec.ports` order.
///
/// Empty (not an error) when upstream skips the Service: headless (`clusterIP` empty or
/// `None`), `type: ExternalName`, or no cluster IP of this family. A port without a protocol
/// is treated as TCP, the API default, which API servers always fill in.
pub(crate) fn service_ports(
    svc: &Service,
    family: IpFamily,
    features: &Features,
) -> Result<Vec<ServicePortInfo>, InvalidService> {
    let Some(spec) = svc.spec.as_ref() else {
        return Ok(Vec::new());
    };
    if should_skip(spec) {
        return Ok(Vec::new());
    }
    let Some(cluster_ip_text) = cluster_ip_for_family(spec, family) else {
        return Ok(Vec::new());
    };
    let (namespace, name) =
        (svc.metadata.namespace.as_deref().unwrap_or(""), svc.metadata.name.as_deref().unwrap_or(""));
    let bad_name = |field: &'static str, value: &str| InvalidService::Name {
        namespace: namespace.to_owned(),
        name: name.to_owned(),
        field,
        value: value.to_owned(),
    };
    if !is_comment_safe(namespace) {
        return Err(bad_name("metadata.namespace", namespace));
    }
    if !is_comment_safe(name) {
        return Err(bad_name("metadata.name", name));
    }
    let service = NamespacedName::new(namespace.to_owned(), name.to_owned());
    let cluster_ip = match ip::parse_ip_sloppy(cluster_ip_text) {
        Some(addr) if IpFamily::of(&addr) == family => ip::format_ip(&addr),
        _ => {
            return Err(InvalidService::ClusterIp { service, family, ip: cluster_ip_text.to_owned() });
        }
    };

    let shared = SharedFields::new(svc, spec, &service, family, features)?;
    let mut seen = HashSet::new();
    let mut ports = Vec::new();
    for (index, port) in spec.ports.iter().flatten().enumerate() {
        let port_name = port.name.clone().unwrap_or_default();
        if !port_name.is_empty() && !is_comment_safe(&port_name) {
            return Err(bad_name("spec.ports[].name", &port_name));
        }
        let protocol = match port.protocol.as_deref() {
            None => Protocol::Tcp,
            Some(p) => Protocol::from_api(p).ok_or_else(|| InvalidService::Protocol {
                service: service.clone(),
                index,
                port_name: port_name.clone(),
                protocol: p.to_owned(),
            })?,
        };
        if !(1..=65535).contains(&port.port) {
            return Err(InvalidService::Port { service: service.clone(), index, port_name, port: port.port });
        }
        let node_port = port.node_port.unwrap_or(0);
        if !(0..=65535).contains(&node_port) {
            return Err(InvalidService::NodePort { service: service.clone(), index, port_name, node_port });
        }
        if !seen.insert((port_name.clone(), protocol)) {
            return Err(InvalidService::DuplicatePort { service: service.clone(), index, port_name, protocol });
        }

        let name = ServicePortName::new(service.clone(), port_name, protocol);
        let name_string = name.to_string();
        let chains = ServiceChainNames::new(&name_string, protocol.lower());
        ports.push(ServicePortInfo {
            name,
            name_string,
            cluster_ip: cluster_ip.clone(),
            port: port.port,
            protocol,
            node_port,
            external_ips: shared.external_ips.clone(),
            load_balancer_ips: shared.load_balancer_ips.clone(),
            load_balancer_source_ranges: shared.source_ranges.clone(),
            source_ranges_skipped: shared.source_ranges_skipped,
            sticky_seconds: shared.sticky_seconds,
            external_policy_local: shared.external_policy_local,
            internal_policy_local: shared.internal_policy_local,
            health_check_node_port: shared.health_check_node_port,
            hints_enabled: shared.hints_enabled,
            chains,
        });
    }
    Ok(ports)
}

/// Upstream `ShouldSkipService`: headless and ExternalName services are not proxied.
fn should_skip(spec: &ServiceSpec) -> bool {
    let cluster_ip = spec.cluster_ip.as_deref().unwrap_or("");
    cluster_ip.is_empty() || cluster_ip == "None" || spec.type_.as_deref() == Some("ExternalName")
}

/// Upstream `GetClusterIPByFamily`: with `ipFamilies` set, the `clusterIPs` entry at the
/// index of `family`; without (an old API server), `clusterIP` if it is of `family`, where
/// anything that does not parse as IPv6 counts as IPv4.
fn cluster_ip_for_family(spec: &ServiceSpec, family: IpFamily) -> Option<&str> {
    let families = spec.ip_families.as_deref().unwrap_or_default();
    if families.is_empty() {
        let cluster_ip = spec.cluster_ip.as_deref().unwrap_or("");
        if cluster_ip.is_empty() || cluster_ip == "None" {
            return None;
        }
        let is_v6 = ip::parse_ip_sloppy(cluster_ip).is_some_and(|a| IpFamily::of(&a) == IpFamily::V6);
        return ((family == IpFamily::V6) == is_v6).then_some(cluster_ip);
    }
    let cluster_ips = spec.cluster_ips.as_deref().unwrap_or_default();
    families
        .iter()
        .enumerate()
        .filter(|(_, f)| f.as_str() == family.api_name())
        .find_map(|(index, _)| cluster_ips.get(index).map(String::as_str))
}

/// The parts of a `ServicePortInfo` that are the same for every port of the Service.
struct SharedFields {
    external_ips: Vec<String>,
    load_balancer_ips: Vec<String>,
    source_ranges: Vec<SourceRange>,
    source_ranges_skipped: bool,
    sticky_seconds: Option<i32>,
    external_policy_local: bool,
    internal_policy_local: bool,
    health_check_node_port: i32,
    hints_enabled: bool,
}

impl SharedFields {
    fn new(
        svc: &Service,
        spec: &ServiceSpec,
        service: &NamespacedName,
        family: IpFamily,
        features: &Features,
    ) -> Result<SharedFields, InvalidService> {
        let type_ = spec.type_.as_deref().unwrap_or("");
        let has_external_ips = !spec.external_ips.as_deref().unwrap_or_default().is_empty();
        // apiservice.ExternallyAccessible: note the literal comparison, an absent type is
        // not ClusterIP here.
        let externally_accessible =
            type_ == "LoadBalancer" || type_ == "NodePort" || (type_ == "ClusterIP" && has_external_ips);
        let external_policy_local = externally_accessible && spec.external_traffic_policy.as_deref() == Some("Local");
        let internal_policy_local = spec.internal_traffic_policy.as_deref() == Some("Local");

        let sticky_seconds = if spec.session_affinity.as_deref() == Some("ClientIP") {
            let seconds = spec
                .session_affinity_config
                .as_ref()
                .and_then(|c| c.client_ip.as_ref())
                .and_then(|c| c.timeout_seconds)
                .unwrap_or(DEFAULT_CLIENT_IP_TIMEOUT_SECONDS);
            if !(1..=MAX_CLIENT_IP_TIMEOUT_SECONDS).contains(&seconds) {
                return Err(InvalidService::AffinityTimeout { service: service.clone(), seconds });
            }
            Some(seconds)
        } else {
            None
        };

        // apiservice.NeedsHealthCheck: LoadBalancer with external policy Local. Upstream
        // logs and ignores a zero port.
        let mut health_check_node_port = 0;
        if type_ == "LoadBalancer" && external_policy_local {
            let port = spec.health_check_node_port.unwrap_or(0);
            if !(0..=65535).contains(&port) {
                return Err(InvalidService::HealthCheckNodePort { service: service.clone(), port });
            }
            if port == 0 {
                tracing::warn!(%service, "service has no healthCheckNodePort");
            }
            health_check_node_port = port;
        }

        let canonical = features.release.writes_canonical_service_addresses();
        // With `AllowServiceExternalIPs` off (1.36+, KEP-5707) external IPs are not
        // programmed at all.
        let external_ips = if features.allow_service_external_ips {
            addresses_of_family(
                service,
                "spec.externalIPs",
                spec.external_ips.iter().flatten().map(String::as_str),
                family,
                canonical,
            )
        } else {
            Vec::new()
        };
        // Upstream `IsVIPMode`: with LoadBalancerIPMode on, only ingresses whose ipMode is
        // absent or `VIP` are short-circuited on the node; a `Proxy` load balancer must see
        // the traffic (it may add a PROXY-protocol header).
        let ingress = svc.status.as_ref().and_then(|s| s.load_balancer.as_ref()).and_then(|lb| lb.ingress.as_ref());
        let is_vip = |i: &&LoadBalancerIngress| {
            !features.load_balancer_ip_mode || i.ip_mode.as_deref().is_none_or(|mode| mode == IP_MODE_VIP)
        };
        let load_balancer_ips = addresses_of_family(
            service,
            "status.loadBalancer.ingress",
            ingress.into_iter().flatten().filter(is_vip).filter_map(|i| i.ip.as_deref()).filter(|s| !s.is_empty()),
            family,
            canonical,
        );
        let (mut source_ranges, source_ranges_skipped) =
            source_ranges_of_family(service, source_range_texts(svc, spec), family, canonical);
        // A zero-prefix range admits every source, as no ranges do: no firewall at all.
        if features.release.zero_source_range_allows_all()
            && source_ranges.iter().any(|r| r.cidr.is_some_and(|c| c.prefix() == 0))
        {
            source_ranges.clear();
        }

        Ok(SharedFields {
            external_ips,
            load_balancer_ips,
            source_ranges,
            source_ranges_skipped,
            sticky_seconds,
            external_policy_local,
            internal_policy_local,
            health_check_node_port,
            hints_enabled: hints_enabled(svc, features),
        })
    }
}

/// A name rule comments can carry as upstream writes them (unquoted in endpoint chains,
/// inside `"..."` elsewhere) and iptables reads back unchanged: no whitespace, quotes,
/// backslashes or control characters, and short enough for the 256-byte comment with the
/// other parts. A superset of the DNS labels API servers require (upstream's own unit tests
/// use names like `validIPv4`).
fn is_comment_safe(s: &str) -> bool {
    !s.is_empty() && s.len() <= 63 && s.bytes().all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'.' | b'_'))
}

/// The addresses of `family` among `texts`. Unparseable entries are dropped (upstream
/// `MapIPsByIPFamily` logs and skips them; blank ones silently). With `canonical` (1.30+,
/// which parses them into `net.IP`) every entry is written as Go prints it. Otherwise they
/// are kept as written, as 1.29 stores these as strings and writes them into rules verbatim,
/// and entries not spelled canonically, which iptables would reject or misread, are skipped.
fn addresses_of_family<'a>(
    service: &NamespacedName,
    field: &'static str,
    texts: impl Iterator<Item = &'a str>,
    family: IpFamily,
    canonical: bool,
) -> Vec<String> {
    let mut out = Vec::new();
    for text in texts {
        if canonical {
            match ip::parse_ip_sloppy(text) {
                Some(addr) if IpFamily::of(&addr) == family => out.push(ip::format_ip(&addr)),
                Some(_) => {}
                None if text.trim().is_empty() => {}
                None => tracing::warn!(%service, field, ip = text, "skipping invalid IP"),
            }
            continue;
        }
        match ip::parse_canonical_ip(text) {
            Ok(addr) if IpFamily::of(&addr) == family => out.push(text.to_owned()),
            Ok(_) => {}
            Err(AddressTextError::NotCanonical { canonical, .. }) => {
                if ip::parse_ip_sloppy(text).is_some_and(|addr| IpFamily::of(&addr) == family) {
                    tracing::warn!(%service, field, ip = text, canonical, "skipping IP not in canonical form");
                }
            }
            Err(AddressTextError::Invalid { .. }) => {
                if !text.trim().is_empty() {
                    tracing::warn!(%service, field, ip = text, "skipping invalid IP");
                }
            }
        }
    }
    out
}

/// The source-range texts in force, trimmed: `spec.loadBalancerSourceRanges`, or when that is
/// empty the [`ANNOTATION_LOAD_BALANCER_SOURCE_RANGES`] annotation (blank entries dropped).
fn source_range_texts<'a>(svc: &'a Service, spec: &'a ServiceSpec) -> Box<dyn Iterator<Item = &'a str> + 'a> {
    let spec_ranges = spec.load_balancer_source_ranges.as_deref().unwrap_or_default();
    if spec_ranges.is_empty() {
        let annotation = svc
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(ANNOTATION_LOAD_BALANCER_SOURCE_RANGES))
            .map(String::as_str)
            .unwrap_or("");
        Box::new(annotation.split(',').map(str::trim).filter(|s| !s.is_empty()))
    } else {
        Box::new(spec_ranges.iter().map(|s| s.trim()))
    }
}

/// The source ranges of `family` among the (already trimmed) `texts`, with the parsed
/// network alongside, and whether any range of `family` was skipped as not canonical.
/// Unparseable entries are dropped with a warning, like upstream `MapCIDRsByIPFamily`. As in
/// Go, the family is that of the network address, so an IPv4-mapped IPv6 range counts as
/// IPv4. With `canonical` (1.30+, `*net.IPNet`) each range is written as `IPNet.String()`
/// prints it: host bits cleared (`198.18.7.1/16` is `198.18.0.0/16`), IPv6 compressed.
/// Otherwise the text is kept as written (1.29 writes the string after `-s`) and ranges not
/// spelled canonically are skipped.
fn source_ranges_of_family<'a>(
    service: &NamespacedName,
    texts: impl Iterator<Item = &'a str>,
    family: IpFamily,
    canonical: bool,
) -> (Vec<SourceRange>, bool) {
    let mut out = Vec::new();
    let mut skipped = false;
    for text in texts {
        if canonical {
            match Cidr::parse_sloppy(text).map(Cidr::canonical) {
                Some(cidr) if cidr.family() == family => {
                    out.push(SourceRange { text: cidr.to_string(), cidr: Some(cidr) })
                }
                Some(_) => {}
                None => tracing::warn!(%service, cidr = text, "skipping invalid loadBalancerSourceRanges entry"),
            }
            continue;
        }
        match Cidr::parse_canonical(text) {
            Ok(cidr) if IpFamily::of(&cidr.network()) == family => {
                out.push(SourceRange { text: text.to_owned(), cidr: Some(cidr) })
            }
            Ok(_) => {}
            Err(AddressTextError::NotCanonical { canonical, .. }) => {
                if Cidr::parse_sloppy(text).is_some_and(|cidr| IpFamily::of(&cidr.network()) == family) {
                    skipped = true;
                    tracing::warn!(
                        %service,
                        cidr = text,
                        canonical,
                        "skipping loadBalancerSourceRanges entry not in canonical form; the firewall stays"
                    );
                }
            }
            Err(AddressTextError::Invalid { .. }) => {
                tracing::warn!(%service, cidr = text, "skipping invalid loadBalancerSourceRanges entry")
            }
        }
    }
    (out, skipped)
}

/// Every address of `svc` that is skipped because its text cannot be written into rules
/// (invalid, or, before 1.30, not in canonical form), whatever its family: one line per
/// entry, naming the Service and the field, for the Warning events the watch side raises.
pub(crate) fn skipped_addresses(svc: &Service, features: &Features) -> Vec<String> {
    let Some(spec) = svc.spec.as_ref() else {
        return Vec::new();
    };
    if should_skip(spec) {
        return Vec::new();
    }
    let service = NamespacedName::new(
        svc.metadata.namespace.clone().unwrap_or_default(),
        svc.metadata.name.clone().unwrap_or_default(),
    );
    let mut out = Vec::new();
    let mut note = |field: &str, err: AddressTextError| out.push(format!("service {service}: {field}: {err}; skipped"));
    // From 1.30 every spelling Kubernetes parses is written canonically: only invalid text
    // is skipped.
    let canonical = features.release.writes_canonical_service_addresses();
    let check_ip = |text: &str| match ip::parse_canonical_ip(text) {
        Err(AddressTextError::NotCanonical { .. }) if canonical => Ok(()),
        other => other.map(|_| ()),
    };
    for text in spec.external_ips.iter().flatten().filter(|t| !t.trim().is_empty()) {
        if let Err(err) = check_ip(text) {
            note("spec.externalIPs", err);
        }
    }
    let ingress = svc.status.as_ref().and_then(|s| s.load_balancer.as_ref()).and_then(|lb| lb.ingress.as_ref());
    for text in ingress.into_iter().flatten().filter_map(|i| i.ip.as_deref()).filter(|t| !t.trim().is_empty()) {
        if let Err(err) = check_ip(text) {
            note("status.loadBalancer.ingress", err);
        }
    }
    let ranges_field = if spec.load_balancer_source_ranges.as_deref().unwrap_or_default().is_empty() {
        ANNOTATION_LOAD_BALANCER_SOURCE_RANGES
    } else {
        "spec.loadBalancerSourceRanges"
    };
    for text in source_range_texts(svc, spec) {
        match Cidr::parse_canonical(text) {
            Err(AddressTextError::NotCanonical { .. }) if canonical => {}
            Err(err) => note(ranges_field, err),
            Ok(_) => {}
        }
    }
    out
}

/// Upstream `canUseTopology`'s annotation test: the deprecated annotation wins when present
/// (even if empty), and any value other than empty, `disabled` or `Disabled` enables hints.
///
/// Later releases drop the annotation requirement with ServiceTrafficDistribution (the
/// EndpointSlice controller only writes hints when the service asks for them, by annotation
/// or `spec.trafficDistribution`), and TopologyAwareHints off disables hints unless
/// ServiceTrafficDistribution is on.
fn hints_enabled(svc: &Service, features: &Features) -> bool {
    if features.service_traffic_distribution {
        return true;
    }
    if !features.topology_aware_hints {
        return false;
    }
    let annotations = svc.metadata.annotations.as_ref();
    let value = annotations
        .and_then(|a| a.get(ANNOTATION_TOPOLOGY_AWARE_HINTS))
        .or_else(|| annotations.and_then(|a| a.get(ANNOTATION_TOPOLOGY_MODE)))
        .map(String::as_str)
        .unwrap_or("");
    !matches!(value, "" | "disabled" | "Disabled")
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::compat::Release;
    use crate::tracker::testing;

    /// The release of the upstream unit tests these cases come from.
    fn v1_29() -> Features {
        Features::of(Release::V1_29)
    }

    fn ports(svc: &Service, family: IpFamily) -> Vec<ServicePortInfo> {
        service_ports(svc, family, &v1_29()).expect("valid service")
    }

    fn ranges(info: &ServicePortInfo) -> Vec<&str> {
        info.load_balancer_source_ranges.iter().map(|r| r.text.as_str()).collect()
    }

    #[test]
    fn cluster_ip_service() {
        let svc = testing::svc("ns1", "svc1")
            .type_("ClusterIP")
            .bare_cluster_ip("172.30.0.41")
            .port("p80", "TCP", 80, 0)
            .port("p53", "UDP", 53, 0)
            .build();
        let got = ports(&svc, IpFamily::V4);
        assert_eq!(got.len(), 2);
        let p80 = &got[0];
        assert_eq!(p80.name, ServicePortName::new(NamespacedName::new("ns1", "svc1"), "p80", Protocol::Tcp));
        assert_eq!(p80.name_string, "ns1/svc1:p80");
        assert_eq!(p80.cluster_ip, "172.30.0.41");
        assert_eq!(p80.port, 80);
        assert_eq!(p80.node_port, 0);
        assert_eq!(p80.chains.cluster_policy, "KUBE-SVC-XPGD46QRK7WJZT7O");
        assert!(!p80.externally_accessible());
        assert!(p80.uses_cluster_endpoints() && !p80.uses_local_endpoints());
        assert_eq!(got[1].protocol, Protocol::Udp);
        assert_eq!(got[1].chains, ServiceChainNames::new("ns1/svc1:p53", "udp"));
    }

    #[test]
    fn skipped_services_have_no_ports() {
        let headless =
            testing::svc("ns", "headless").type_("ClusterIP").bare_cluster_ip("None").port("rpc", "UDP", 1234, 0);
        let no_ip = testing::svc("ns", "no-ip").port("rpc", "UDP", 1234, 0);
        // ExternalName is skipped even with a cluster IP.
        let external_name =
            testing::svc("ns", "ext").type_("ExternalName").bare_cluster_ip("172.30.55.4").port("blah", "UDP", 1235, 0);
        for svc in [headless, no_ip, external_name] {
            let svc = svc.build();
            assert!(ports(&svc, IpFamily::V4).is_empty(), "{:?}", svc.metadata.name);
        }
        let mut no_spec = testing::svc("ns", "nospec").build();
        no_spec.spec = None;
        assert!(ports(&no_spec, IpFamily::V4).is_empty());
    }

    #[test]
    fn legacy_single_stack_cluster_ip_is_filtered_by_family() {
        let v6 = testing::svc("ns", "v6").bare_cluster_ip("2001:db8::1").port("p", "TCP", 80, 0).build();
        assert!(ports(&v6, IpFamily::V4).is_empty());
        assert_eq!(ports(&v6, IpFamily::V6)[0].cluster_ip, "2001:db8::1");
        let v4 = testing::svc("ns", "v4").bare_cluster_ip("10.0.0.1").port("p", "TCP", 80, 0).build();
        assert!(ports(&v4, IpFamily::V6).is_empty());
    }

    #[test]
    fn dual_stack_uses_cluster_ip_of_family() {
        let svc = testing::svc("ns", "dual")
            .cluster_ips_with_families(&[("FD00::0001", "IPv6"), ("010.000.000.001", "IPv4")])
            .port("p", "TCP", 80, 0)
            .build();
        assert_eq!(ports(&svc, IpFamily::V4)[0].cluster_ip, "10.0.0.1");
        assert_eq!(ports(&svc, IpFamily::V6)[0].cluster_ip, "fd00::1");
        let single = testing::svc("ns", "single")
            .cluster_ips_with_families(&[("10.0.0.1", "IPv4")])
            .port("p", "TCP", 80, 0)
            .build();
        assert!(ports(&single, IpFamily::V6).is_empty());
    }

    // Upstream: "service with both ipv4 and ipv6 configurations under ipv4/ipv6 mode,
    // fields of the other family should be filtered".
    #[test]
    fn addresses_and_ranges_filtered_by_family() {
        let svc = testing::svc("test", "validIPv4")
            .type_("LoadBalancer")
            .cluster_ips_with_families(&[("10.0.0.1", "IPv4"), ("fd00::1", "IPv6")])
            .port("testPort", "TCP", 12345, 30000)
            .external_ips(&["10.1.2.3", "2001:db8::1:1", "not-an-ip", ""])
            .source_ranges(&["10.1.2.0/28", " 2001:db8::/64 ", "bogus"])
            .lb_ingress(&["10.1.2.4", "2001:db8::1:2", ""])
            .build();
        let v4 = &ports(&svc, IpFamily::V4)[0];
        assert_eq!(v4.external_ips, ["10.1.2.3"]);
        assert_eq!(v4.load_balancer_ips, ["10.1.2.4"]);
        assert_eq!(ranges(v4), ["10.1.2.0/28"]);
        assert!(v4.externally_accessible());
        let v6 = &ports(&svc, IpFamily::V6)[0];
        assert_eq!(v6.cluster_ip, "fd00::1");
        assert_eq!(v6.external_ips, ["2001:db8::1:1"]);
        assert_eq!(v6.load_balancer_ips, ["2001:db8::1:2"]);
        assert_eq!(ranges(v6), ["2001:db8::/64"]);
    }

    #[test]
    fn addresses_are_kept_as_written_except_the_cluster_ip() {
        let svc = testing::svc("ns", "lb")
            .type_("LoadBalancer")
            .cluster_ips_with_families(&[("2001:DB8::10", "IPv6")])
            .port("p", "TCP", 80, 0)
            .external_ips(&["2001:0db8:0:0::1"])
            .lb_ingress(&["2001:DB8:0::2"])
            .source_ranges(&["2001:db8::1/64"])
            .build();
        let p = &ports(&svc, IpFamily::V6)[0];
        // ClusterIP is a net.IP in 1.29 (printed canonically); the rest are strings.
        assert_eq!(p.cluster_ip, "2001:db8::10");
        assert_eq!(p.external_ips, ["2001:0db8:0:0::1"]);
        assert_eq!(p.load_balancer_ips, ["2001:DB8:0::2"]);
        assert_eq!(ranges(p), ["2001:db8::1/64"]);
        // The parsed network (host bits masked) decides whether the node is allowed.
        let cidr = p.load_balancer_source_ranges[0].cidr.expect("parsed");
        assert_eq!(cidr.to_string(), "2001:db8::/64");
        assert!(skipped_addresses(&svc, &v1_29()).is_empty());
    }

    /// Spellings that parse but are not canonical never reach rules: iptables rejects
    /// `::ffff:1.2.3.4` and `08.1.1.1` and reads `010.1.1.1` as 8.1.1.1.
    #[test]
    fn addresses_not_in_canonical_form_are_skipped() {
        let svc = testing::svc("ns", "s")
            .type_("LoadBalancer")
            .cluster_ips_with_families(&[("10.0.0.1", "IPv4"), ("fd00::1", "IPv6")])
            .port("p", "TCP", 80, 0)
            .external_ips(&["::ffff:1.2.3.4", "010.001.002.003", "08.1.1.1", "1.2.3.5", "2001:0db8::1", "2001:db8::9"])
            .lb_ingress(&["010.1.1.2", "1.1.1.2", "::FFFF:1.1.1.3"])
            .source_ranges(&["10.0.0.0/08", "192.168.0.0/16", "2001:db8::/064"])
            .build();
        let v4 = &ports(&svc, IpFamily::V4)[0];
        assert_eq!(v4.external_ips, ["1.2.3.5"]);
        assert_eq!(v4.load_balancer_ips, ["1.1.1.2"]);
        assert_eq!(ranges(v4), ["192.168.0.0/16"]);
        assert!(v4.source_ranges_skipped && v4.filters_load_balancer_sources());
        let v6 = &ports(&svc, IpFamily::V6)[0];
        // IPv6 spellings mean the same to ip6tables: kept as written, as 1.29 does.
        assert_eq!(v6.external_ips, ["2001:0db8::1", "2001:db8::9"]);
        assert!(v6.load_balancer_ips.is_empty());
        // Every IPv6 range was skipped: the firewall stays, closed, rather than opening up.
        assert!(ranges(v6).is_empty());
        assert!(v6.source_ranges_skipped && v6.filters_load_balancer_sources());
        let skipped = skipped_addresses(&svc, &v1_29());
        assert_eq!(skipped.len(), 7, "{skipped:#?}");
        assert_eq!(
            skipped[0],
            "service ns/s: spec.externalIPs: \"::ffff:1.2.3.4\" is not in canonical form (it means 1.2.3.4); skipped"
        );
        assert_eq!(
            skipped[6],
            "service ns/s: spec.loadBalancerSourceRanges: \"2001:db8::/064\" is not in canonical form (it means 2001:db8::/64); skipped"
        );
        // Without source ranges there is no firewall to keep.
        let open =
            testing::svc("ns", "o").type_("LoadBalancer").bare_cluster_ip("10.0.0.1").port("p", "TCP", 80, 0).build();
        assert!(!ports(&open, IpFamily::V4)[0].filters_load_balancer_sources());
    }

    /// From 1.30 (PR #122630) upstream parses these fields into `net.IP` / `*net.IPNet` with
    /// the lenient parser and writes `String()`: every spelling the 1.29 rules skip above is
    /// kept, canonicalised, and source ranges lose their host bits.
    #[test]
    fn from_1_30_addresses_are_parsed_and_written_canonically() {
        let svc = testing::svc("ns", "s")
            .type_("LoadBalancer")
            .cluster_ips_with_families(&[("10.0.0.1", "IPv4"), ("fd00::1", "IPv6")])
            .port("p", "TCP", 80, 0)
            .external_ips(&["::ffff:1.2.3.4", "010.001.002.003", "08.1.1.1", "1.2.3.5", "2001:0db8::1", "bogus", ""])
            .lb_ingress(&["010.1.1.2", "1.1.1.2", "::FFFF:1.1.1.3", "2001:DB8:0::2"])
            .source_ranges(&["10.0.0.0/08", "198.18.7.1/16", "::ffff:203.0.113.9/120", "2001:db8::1/064", "bogus"])
            .build();
        for release in [Release::V1_30, Release::NEWEST] {
            let features = Features::of(release);
            let v4 = &service_ports(&svc, IpFamily::V4, &features).unwrap()[0];
            assert_eq!(v4.external_ips, ["1.2.3.4", "10.1.2.3", "8.1.1.1", "1.2.3.5"], "{release}");
            assert_eq!(v4.load_balancer_ips, ["10.1.1.2", "1.1.1.2", "1.1.1.3"], "{release}");
            assert_eq!(ranges(v4), ["10.0.0.0/8", "198.18.0.0/16", "203.0.113.0/24"], "{release}");
            assert!(!v4.source_ranges_skipped, "{release}");
            let mapped = v4.load_balancer_source_ranges[2].cidr.expect("parsed");
            assert!(mapped.contains(&"203.0.113.200".parse().unwrap()), "IPv4 network, as Go's IPNet");
            let v6 = &service_ports(&svc, IpFamily::V6, &features).unwrap()[0];
            assert_eq!(v6.external_ips, ["2001:db8::1"], "{release}");
            assert_eq!(v6.load_balancer_ips, ["2001:db8::2"], "{release}");
            assert_eq!(ranges(v6), ["2001:db8::/64"], "{release}");
            // Only text Kubernetes cannot parse is skipped (and reported).
            assert_eq!(
                skipped_addresses(&svc, &features),
                [
                    "service ns/s: spec.externalIPs: \"bogus\" is not an IP address; skipped",
                    "service ns/s: spec.loadBalancerSourceRanges: \"bogus\" is not an IP address; skipped",
                ],
                "{release}"
            );
        }
        // 1.29 keeps its verbatim-or-skip behaviour for the same object.
        let v4 = &ports(&svc, IpFamily::V4)[0];
        assert_eq!(v4.external_ips, ["1.2.3.5"]);
        assert_eq!(ranges(v4), ["198.18.7.1/16"]);
        assert!(v4.source_ranges_skipped);
    }

    /// From 1.35 (PR #132722) a zero-prefix source range admits everyone: the family's ranges
    /// are dropped, so no firewall chain is written for it.
    #[test]
    fn a_zero_source_range_means_no_firewall_from_1_35() {
        let svc = testing::svc("ns", "z")
            .type_("LoadBalancer")
            .cluster_ips_with_families(&[("10.0.0.1", "IPv4"), ("fd00::1", "IPv6")])
            .port("p", "TCP", 80, 0)
            .lb_ingress(&["198.18.0.9", "fd00::9"])
            .source_ranges(&["198.18.0.0/16", "0.0.0.0/0", "fd00::/64"])
            .build();
        let v4 = |release| service_ports(&svc, IpFamily::V4, &Features::of(release)).unwrap().remove(0);
        assert_eq!(ranges(&v4(Release::V1_34)), ["198.18.0.0/16", "0.0.0.0/0"]);
        assert!(v4(Release::V1_34).filters_load_balancer_sources());
        for release in [Release::V1_35, Release::V1_37] {
            assert!(ranges(&v4(release)).is_empty(), "{release}");
            assert!(!v4(release).filters_load_balancer_sources(), "{release}");
            // Per family: the IPv6 ranges still filter.
            let v6 = service_ports(&svc, IpFamily::V6, &Features::of(release)).unwrap().remove(0);
            assert_eq!(ranges(&v6), ["fd00::/64"], "{release}");
        }
    }

    /// `AllowServiceExternalIPs` (1.36+, on by default) turned off: no external IPs at all.
    #[test]
    fn external_ips_follow_allow_service_external_ips() {
        let svc = testing::svc("ns", "e")
            .bare_cluster_ip("10.0.0.1")
            .port("p", "TCP", 80, 0)
            .external_ips(&["198.18.0.5"])
            .build();
        let on = Features::of(Release::V1_36);
        assert_eq!(service_ports(&svc, IpFamily::V4, &on).unwrap()[0].external_ips, ["198.18.0.5"]);
        let gates = [("AllowServiceExternalIPs".to_string(), false)].into_iter().collect();
        let off = Features::resolve(Release::V1_36, &gates).unwrap();
        let port = &service_ports(&svc, IpFamily::V4, &off).unwrap()[0];
        assert!(port.external_ips.is_empty());
        assert!(!port.externally_accessible());
    }

    #[test]
    fn skipped_annotation_ranges_are_named_by_the_annotation() {
        let svc = testing::svc("ns", "a")
            .type_("LoadBalancer")
            .bare_cluster_ip("10.0.0.1")
            .port("p", "TCP", 80, 0)
            .annotation(ANNOTATION_LOAD_BALANCER_SOURCE_RANGES, "192.168.0.0/016, 10.0.0.0/8")
            .build();
        assert_eq!(ranges(&ports(&svc, IpFamily::V4)[0]), ["10.0.0.0/8"]);
        assert_eq!(
            skipped_addresses(&svc, &v1_29()),
            [format!(
                "service ns/a: {ANNOTATION_LOAD_BALANCER_SOURCE_RANGES}: \"192.168.0.0/016\" is not in canonical form (it means 192.168.0.0/16); skipped"
            )]
        );
    }

    // Upstream: "service with extra space in LoadBalancerSourceRanges".
    #[test]
    fn source_ranges_are_trimmed() {
        let svc = testing::svc("test", "extra-space")
            .type_("LoadBalancer")
            .bare_cluster_ip("172.16.55.12")
            .port("testPort", "TCP", 1234, 0)
            .source_ranges(&[" 10.1.2.0/28"])
            .build();
        assert_eq!(ranges(&ports(&svc, IpFamily::V4)[0]), ["10.1.2.0/28"]);
    }

    #[test]
    fn source_ranges_fall_back_to_the_annotation() {
        let svc = testing::svc("test", "annotated")
            .type_("LoadBalancer")
            .bare_cluster_ip("172.16.55.12")
            .port("testPort", "TCP", 1234, 0)
            .annotation(ANNOTATION_LOAD_BALANCER_SOURCE_RANGES, " 10.1.2.0/28, 192.168.0.0/16,,2001:db8::/64")
            .build();
        assert_eq!(ranges(&ports(&svc, IpFamily::V4)[0]), ["10.1.2.0/28", "192.168.0.0/16"]);
        // The spec field wins when set.
        let svc = testing::svc("test", "both")
            .type_("LoadBalancer")
            .bare_cluster_ip("172.16.55.12")
            .port("testPort", "TCP", 1234, 0)
            .source_ranges(&["10.9.0.0/16"])
            .annotation(ANNOTATION_LOAD_BALANCER_SOURCE_RANGES, "10.1.2.0/28")
            .build();
        assert_eq!(ranges(&ports(&svc, IpFamily::V4)[0]), ["10.9.0.0/16"]);
    }

    #[test]
    fn external_policy_local_needs_external_access() {
        let base = |t: Option<&str>| {
            let b =
                testing::svc("ns", "s").bare_cluster_ip("10.0.0.1").port("p", "TCP", 80, 0).external_policy("Local");
            match t {
                Some(t) => b.type_(t),
                None => b,
            }
        };
        // An absent type is not ClusterIP: objects are read as written.
        assert!(!ports(&base(None).external_ips(&["1.2.3.4"]).build(), IpFamily::V4)[0].external_policy_local);
        assert!(!ports(&base(Some("ClusterIP")).build(), IpFamily::V4)[0].external_policy_local);
        assert!(
            ports(&base(Some("ClusterIP")).external_ips(&["1.2.3.4"]).build(), IpFamily::V4)[0].external_policy_local
        );
        assert!(ports(&base(Some("NodePort")).build(), IpFamily::V4)[0].external_policy_local);
        assert!(ports(&base(Some("LoadBalancer")).build(), IpFamily::V4)[0].external_policy_local);
        let cluster = testing::svc("ns", "s")
            .type_("NodePort")
            .bare_cluster_ip("10.0.0.1")
            .port("p", "TCP", 80, 0)
            .external_policy("Cluster");
        assert!(!ports(&cluster.build(), IpFamily::V4)[0].external_policy_local);
    }

    #[test]
    fn internal_policy_local() {
        let svc = testing::svc("ns", "s")
            .bare_cluster_ip("10.0.0.1")
            .port("p", "TCP", 80, 0)
            .internal_policy("Local")
            .build();
        let p = &ports(&svc, IpFamily::V4)[0];
        assert!(p.internal_policy_local);
        assert!(!p.uses_cluster_endpoints() && p.uses_local_endpoints());
    }

    #[test]
    fn health_check_node_port_only_for_local_load_balancers() {
        let lb = |policy: &str, t: &str| {
            testing::svc("ns", "s")
                .type_(t)
                .bare_cluster_ip("10.0.0.1")
                .port("p", "TCP", 80, 30080)
                .external_policy(policy)
                .health_check_node_port(30500)
                .build()
        };
        assert_eq!(ports(&lb("Local", "LoadBalancer"), IpFamily::V4)[0].health_check_node_port, 30500);
        assert_eq!(ports(&lb("Cluster", "LoadBalancer"), IpFamily::V4)[0].health_check_node_port, 0);
        assert_eq!(ports(&lb("Local", "NodePort"), IpFamily::V4)[0].health_check_node_port, 0);
        let missing = testing::svc("ns", "s")
            .type_("LoadBalancer")
            .bare_cluster_ip("10.0.0.1")
            .port("p", "TCP", 80, 0)
            .external_policy("Local")
            .build();
        assert_eq!(ports(&missing, IpFamily::V4)[0].health_check_node_port, 0);
    }

    #[test]
    fn session_affinity() {
        let base = || testing::svc("ns", "s").bare_cluster_ip("10.0.0.1").port("p", "TCP", 80, 0);
        assert_eq!(ports(&base().build(), IpFamily::V4)[0].sticky_seconds, None);
        assert_eq!(ports(&base().affinity(Some(300)).build(), IpFamily::V4)[0].sticky_seconds, Some(300));
        assert_eq!(ports(&base().affinity(None).build(), IpFamily::V4)[0].sticky_seconds, Some(10800));
        let err = service_ports(&base().affinity(Some(0)).build(), IpFamily::V4, &v1_29()).unwrap_err();
        assert!(matches!(err, InvalidService::AffinityTimeout { seconds: 0, .. }));
    }

    #[test]
    fn topology_annotations() {
        let with = |pairs: &[(&str, &str)]| {
            let mut b = testing::svc("ns", "s").bare_cluster_ip("10.0.0.1").port("p", "TCP", 80, 0);
            for (k, v) in pairs {
                b = b.annotation(k, v);
            }
            ports(&b.build(), IpFamily::V4)[0].hints_enabled
        };
        assert!(!with(&[]));
        assert!(with(&[(ANNOTATION_TOPOLOGY_MODE, "Auto")]));
        assert!(with(&[(ANNOTATION_TOPOLOGY_MODE, "auto")]));
        // Any value but empty/disabled counts, including odd capitalisation.
        assert!(with(&[(ANNOTATION_TOPOLOGY_MODE, "aUto")]));
        assert!(!with(&[(ANNOTATION_TOPOLOGY_MODE, "Disabled")]));
        assert!(!with(&[(ANNOTATION_TOPOLOGY_MODE, "disabled")]));
        assert!(with(&[(ANNOTATION_TOPOLOGY_AWARE_HINTS, "Auto")]));
        // The deprecated annotation wins, even when empty.
        assert!(!with(&[(ANNOTATION_TOPOLOGY_AWARE_HINTS, ""), (ANNOTATION_TOPOLOGY_MODE, "Auto")]));
        assert!(!with(&[(ANNOTATION_TOPOLOGY_AWARE_HINTS, "disabled"), (ANNOTATION_TOPOLOGY_MODE, "Auto")]));
        assert!(with(&[(ANNOTATION_TOPOLOGY_AWARE_HINTS, "Auto"), (ANNOTATION_TOPOLOGY_MODE, "disabled")]));
    }

    #[test]
    fn absent_protocol_is_tcp() {
        let svc = testing::svc("ns", "s").bare_cluster_ip("10.0.0.1").port("p", "", 80, 0).build();
        let p = &ports(&svc, IpFamily::V4)[0];
        assert_eq!(p.protocol, Protocol::Tcp);
        assert_eq!(p.name.protocol, Protocol::Tcp);
    }

    #[test]
    fn unnamed_port() {
        let svc = testing::svc("ns1", "svc1").bare_cluster_ip("10.0.0.1").port("", "TCP", 80, 0).build();
        assert_eq!(ports(&svc, IpFamily::V4)[0].name_string, "ns1/svc1");
    }

    #[test]
    fn invalid_services_are_rejected_with_context() {
        let base = || testing::svc("ns1", "bad").bare_cluster_ip("10.0.0.1");
        let cases = [
            (base().port("p", "TCP", 0, 0).build(), "spec.ports[0]"),
            (base().port("p", "TCP", 65536, 0).build(), "outside 1-65535"),
            (base().port("p", "TCP", 80, 70000).build(), "nodePort 70000"),
            (base().port("p", "TCP", 80, -1).build(), "nodePort -1"),
            (base().port("p", "ICMP", 80, 0).build(), "unknown protocol \"ICMP\""),
            (base().port("p", "TCP", 80, 0).port("p", "TCP", 81, 0).build(), "duplicates port name"),
            (
                testing::svc("ns1", "bad").bare_cluster_ip("10.0.0.300").port("p", "TCP", 80, 0).build(),
                "cluster IP \"10.0.0.300\"",
            ),
            (
                testing::svc("ns1", "bad")
                    .cluster_ips_with_families(&[("fd00::1", "IPv4")])
                    .port("p", "TCP", 80, 0)
                    .build(),
                "is not a valid IPv4 address",
            ),
        ];
        for (svc, needle) in cases {
            let err = service_ports(&svc, IpFamily::V4, &v1_29()).expect_err(needle).to_string();
            assert!(err.starts_with("service ns1/bad: "), "{err}");
            assert!(err.contains(needle), "{err} does not mention {needle}");
        }
        let hc = base().type_("LoadBalancer").external_policy("Local").health_check_node_port(70000);
        let err = service_ports(&hc.port("p", "TCP", 80, 0).build(), IpFamily::V4, &v1_29()).unwrap_err();
        assert!(matches!(err, InvalidService::HealthCheckNodePort { port: 70000, .. }));
        // The same name with another protocol is a different port.
        let ok = base().port("dns", "TCP", 53, 0).port("dns", "UDP", 53, 0).build();
        assert_eq!(ports(&ok, IpFamily::V4).len(), 2);
    }

    #[test]
    fn names_that_cannot_be_written_into_comments_are_rejected() {
        for (ns, name, port, field) in [
            ("ns1", "svc1", "x\n-A INPUT -j ACCEPT", "spec.ports[].name"),
            ("ns1", "svc1", "q\"uote", "spec.ports[].name"),
            ("n s", "svc1", "http", "metadata.namespace"),
            ("ns1", "a b", "http", "metadata.name"),
            ("ns1", "svc\\1", "http", "metadata.name"),
            ("", "svc1", "http", "metadata.namespace"),
        ] {
            let svc = testing::svc(ns, name).bare_cluster_ip("172.30.0.1").port(port, "TCP", 80, 0).build();
            let err = service_ports(&svc, IpFamily::V4, &v1_29()).unwrap_err();
            assert!(matches!(&err, InvalidService::Name { field: f, .. } if *f == field), "{ns}/{name}:{port}: {err}");
            assert!(!err.to_string().contains('\n'), "the message escapes what it quotes: {err}");
        }
        // An unnamed port (single-port services) is fine.
        let svc = testing::svc("ns1", "svc1").bare_cluster_ip("172.30.0.1").port("", "TCP", 80, 0).build();
        assert_eq!(service_ports(&svc, IpFamily::V4, &v1_29()).unwrap().len(), 1);
    }
}
