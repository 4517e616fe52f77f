//! Identifiers shared by every layer: IP family, protocol, and the names that key the
//! service and endpoint maps.

use std::fmt;

/// The address family one proxier instance renders rules for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum IpFamily {
    V4,
    V6,
}

impl IpFamily {
    /// The family of an address, treating IPv4-mapped IPv6 addresses as IPv4 (as Go's `net.IP` does).
    pub fn of(ip: &std::net::IpAddr) -> IpFamily {
        match ip {
            std::net::IpAddr::V4(_) => IpFamily::V4,
            std::net::IpAddr::V6(v6) if v6.to_ipv4_mapped().is_some() => IpFamily::V4,
            std::net::IpAddr::V6(_) => IpFamily::V6,
        }
    }

    /// The Kubernetes API spelling (`IPv4` / `IPv6`).
    pub(crate) fn api_name(self) -> &'static str {
        match self {
            IpFamily::V4 => "IPv4",
            IpFamily::V6 => "IPv6",
        }
    }

    /// The spelling EndpointSlice `addressType` uses for this family.
    pub(crate) fn slice_address_type(self) -> &'static str {
        self.api_name()
    }
}

impl fmt::Display for IpFamily {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.api_name())
    }
}

/// A service port protocol, as iptables spells it in `-m tcp -p tcp`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Protocol {
    Tcp,
    Udp,
    Sctp,
}

impl Protocol {
    /// Parses the API spelling (`TCP`, `UDP`, `SCTP`); anything else is `None`.
    pub fn from_api(s: &str) -> Option<Protocol> {
        match s {
            "TCP" => Some(Protocol::Tcp),
            "UDP" => Some(Protocol::Udp),
            "SCTP" => Some(Protocol::Sctp),
            _ => None,
        }
    }

    /// Lower-case name used in iptables arguments and in chain-name hashes.
    pub fn lower(self) -> &'static str {
        match self {
            Protocol::Tcp => "tcp",
            Protocol::Udp => "udp",
            Protocol::Sctp => "sctp",
        }
    }

    /// The API spelling.
    pub(crate) fn api_name(self) -> &'static str {
        match self {
            Protocol::Tcp => "TCP",
            Protocol::Udp => "UDP",
            Protocol::Sctp => "SCTP",
        }
    }
}

impl fmt::Display for Protocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.api_name())
    }
}

/// `namespace/name` of a Service (EndpointSlices are grouped under their service's name).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct NamespacedName {
    pub namespace: String,
    pub name: String,
}

impl NamespacedName {
    pub fn new(namespace: impl Into<String>, name: impl Into<String>) -> Self {
        NamespacedName { namespace: namespace.into(), name: name.into() }
    }

    /// The namespace and name of an API object (empty when unset, as the watches key it).
    pub fn of_object(meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> Self {
        NamespacedName::new(meta.namespace.clone().unwrap_or_default(), meta.name.clone().unwrap_or_default())
    }
}

impl fmt::Display for NamespacedName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// One port of one service: the key of the service and endpoint maps.
///
/// Displays as upstream's `ServicePortName.String()`: `ns/name:port`, or `ns/name` when the
/// port is unnamed. The protocol is part of the key but not of the display string.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServicePortName {
    pub service: NamespacedName,
    pub port: String,
    pub protocol: Protocol,
}

impl ServicePortName {
    pub fn new(service: NamespacedName, port: impl Into<String>, protocol: Protocol) -> Self {
        ServicePortName { service, port: port.into(), protocol }
    }
}

impl fmt::Display for ServicePortName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.port.is_empty() { write!(f, "{}", self.service) } else { write!(f, "{}:{}", self.service, self.port) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn service_port_name_display_omits_empty_port() {
        let nn = NamespacedName::new("ns1", "svc1");
        assert_eq!(ServicePortName::new(nn.clone(), "p80", Protocol::Tcp).to_string(), "ns1/svc1:p80");
        assert_eq!(ServicePortName::new(nn, "", Protocol::Udp).to_string(), "ns1/svc1");
    }

    #[test]
    fn ipv4_mapped_counts_as_ipv4() {
        let ip: std::net::IpAddr = "::ffff:10.0.0.1".parse().unwrap();
        assert_eq!(IpFamily::of(&ip), IpFamily::V4);
        let ip: std::net::IpAddr = "fd00::1".parse().unwrap();
        assert_eq!(IpFamily::of(&ip), IpFamily::V6);
    }
}
