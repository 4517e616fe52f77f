//! The file format: `KubeProxyConfiguration` (`kubeproxy.config.k8s.io/v1alpha1`) field for
//! field as upstream's types have it, with the serde helpers for Go-shaped values (`null` as
//! the zero value, `float32` and `resource.Quantity` text). Unknown fields are not rejected
//! here: [`super::load`] reports them (strict decoding) and decodes leniently, as upstream.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::duration::GoDuration;
use super::{API_VERSION, KIND};

/// Go leaves a non-pointer field at its zero value when the input says `null`; serde would
/// reject it (or, for strings, read the text "null"). Used on every non-`Option` field.
fn null_default<'de, D, T>(deserializer: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de> + Default,
{
    Ok(Option::<T>::deserialize(deserializer)?.unwrap_or_default())
}

/// Writes a `float32` as Go's JSON encoder does: integral values without a fraction.
fn serialize_qps<S: Serializer>(qps: &f32, serializer: S) -> Result<S::Ok, S::Error> {
    if qps.is_finite() && qps.fract() == 0.0 && qps.abs() < 1e15 {
        serializer.serialize_i64(*qps as i64)
    } else {
        // The shortest text that reads back as this f32, widened without noise digits.
        let widened: f64 = qps.to_string().parse().unwrap_or(f64::from(*qps));
        serializer.serialize_f64(widened)
    }
}

/// A `resource.Quantity`, kept as text (`"0"`, `"64Ki"`); numbers in the input are accepted
/// and turned into their decimal text, as the Go type does.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(transparent)]
pub struct Quantity(pub String);

impl<'de> Deserialize<'de> for Quantity {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = Quantity;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a quantity such as \"0\" or \"64Ki\"")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Quantity, E> {
                Ok(Quantity(v.to_string()))
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Quantity, E> {
                Ok(Quantity(v.to_string()))
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Quantity, E> {
                Ok(Quantity(v.to_string()))
            }
            fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<Quantity, E> {
                Ok(Quantity(v.to_string()))
            }
        }
        deserializer.deserialize_any(Visitor)
    }
}

/// `logging.flushFrequency` (Go `TimeOrMetaDuration`): either integer nanoseconds or a
/// duration string; written back in the form it was read in.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FlushFrequency {
    pub duration: GoDuration,
    /// Whether it is written as a duration string (true) or as integer nanoseconds.
    pub as_string: bool,
}

impl Serialize for FlushFrequency {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        if self.as_string { self.duration.serialize(serializer) } else { serializer.serialize_i64(self.duration.0) }
    }
}

impl<'de> Deserialize<'de> for FlushFrequency {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = FlushFrequency;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a duration string or integer nanoseconds")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<FlushFrequency, E> {
                let duration = GoDuration::parse(v).map_err(E::custom)?;
                Ok(FlushFrequency { duration, as_string: true })
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<FlushFrequency, E> {
                Ok(FlushFrequency { duration: GoDuration(v), as_string: false })
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<FlushFrequency, E> {
                let nanos = i64::try_from(v).map_err(|_| E::custom("flushFrequency overflows"))?;
                Ok(FlushFrequency { duration: GoDuration(nanos), as_string: false })
            }
        }
        deserializer.deserialize_any(Visitor)
    }
}

/// `clientConnection` (component-base `ClientConnectionConfiguration`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct ClientConnection {
    /// Path to a kubeconfig file; empty means in-cluster configuration (or `--master`).
    #[serde(deserialize_with = "null_default")]
    pub kubeconfig: String,
    /// The `Accept` header sent to the API server (overrides the client default).
    #[serde(deserialize_with = "null_default")]
    pub accept_content_types: String,
    /// Content type of requests sent to the API server. Default: protobuf.
    #[serde(deserialize_with = "null_default")]
    pub content_type: String,
    /// Client-side rate limit in queries per second. Default: 5.
    #[serde(deserialize_with = "null_default", serialize_with = "serialize_qps")]
    pub qps: f32,
    /// Extra queries allowed to accumulate while under the QPS limit. Default: 10.
    #[serde(deserialize_with = "null_default")]
    pub burst: i32,
}

/// `iptables`: settings of the iptables proxier (the one this program implements).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct IptablesConfig {
    /// Bit of the fwmark space marking packets for SNAT, 0..=31. Default: 14.
    pub masquerade_bit: Option<i32>,
    /// SNAT all traffic sent to Service cluster IPs (some CNI plugins need it).
    #[serde(deserialize_with = "null_default")]
    pub masquerade_all: bool,
    /// Allow NodePort services on IPv4 loopback addresses (sets `route_localnet`).
    /// Default: true.
    pub localhost_node_ports: Option<bool>,
    /// How often a full resync runs. Must be > 0. Default: 30s.
    #[serde(deserialize_with = "null_default")]
    pub sync_period: GoDuration,
    /// Minimum time between resyncs triggered by changes; 0 means immediately. Upstream
    /// defaulting turns 0 into 1s, so 0 cannot actually be configured. Default: 1s.
    #[serde(deserialize_with = "null_default")]
    pub min_sync_period: GoDuration,
}

/// `ipvs`: accepted and kept for compatibility; the IPVS mode is not implemented.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct IpvsConfig {
    /// Full resync interval of the IPVS proxier. Default: 30s.
    #[serde(deserialize_with = "null_default")]
    pub sync_period: GoDuration,
    /// Minimum time between IPVS resyncs.
    #[serde(deserialize_with = "null_default")]
    pub min_sync_period: GoDuration,
    /// IPVS scheduler name (e.g. `rr`).
    #[serde(deserialize_with = "null_default")]
    pub scheduler: String,
    /// CIDRs the IPVS proxier leaves alone when cleaning up.
    #[serde(rename = "excludeCIDRs")]
    pub exclude_cidrs: Option<Vec<String>>,
    /// Configure `arp_ignore`/`arp_announce` for the `kube-ipvs0` interface.
    #[serde(rename = "strictARP", deserialize_with = "null_default")]
    pub strict_arp: bool,
    /// Idle timeout of IPVS TCP sessions; 0 keeps the system value.
    #[serde(deserialize_with = "null_default")]
    pub tcp_timeout: GoDuration,
    /// Timeout of IPVS TCP sessions after a FIN; 0 keeps the system value.
    #[serde(deserialize_with = "null_default")]
    pub tcp_fin_timeout: GoDuration,
    /// Timeout of IPVS UDP packets; 0 keeps the system value.
    #[serde(deserialize_with = "null_default")]
    pub udp_timeout: GoDuration,
}

/// `nftables` (new in v1.29): accepted and kept for compatibility; the mode is not
/// implemented.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct NftablesConfig {
    /// Bit of the fwmark space used for SNAT in nftables mode. Default: 14.
    pub masquerade_bit: Option<i32>,
    /// SNAT all traffic sent to Service cluster IPs in nftables mode.
    #[serde(deserialize_with = "null_default")]
    pub masquerade_all: bool,
    /// Full resync interval in nftables mode. Default: 30s.
    #[serde(deserialize_with = "null_default")]
    pub sync_period: GoDuration,
    /// Minimum time between nftables resyncs. Default: 1s.
    #[serde(deserialize_with = "null_default")]
    pub min_sync_period: GoDuration,
}

/// `winkernel`: Windows/HNS settings, accepted and kept for compatibility only.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct WinkernelConfig {
    /// HNS network kube-proxy creates endpoints and policies in.
    #[serde(deserialize_with = "null_default")]
    pub network_name: String,
    /// Source VIP endpoint address used for NAT when load balancing.
    #[serde(deserialize_with = "null_default")]
    pub source_vip: String,
    /// Create HNS policies with direct server return.
    #[serde(rename = "enableDSR", deserialize_with = "null_default")]
    pub enable_dsr: bool,
    /// HNS endpoint attached to the l2bridge for the root network namespace.
    #[serde(deserialize_with = "null_default")]
    pub root_hns_endpoint_name: String,
    /// Forward the service VIP for the health check port on Windows.
    #[serde(deserialize_with = "null_default")]
    pub forward_health_check_vip: bool,
}

/// `conntrack`: the netfilter connection-tracking sysctls kube-proxy sets at startup.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct ConntrackConfig {
    /// Connections to track per CPU core; 0 leaves the limit alone (and ignores `min`).
    /// Default: 32768.
    pub max_per_core: Option<i32>,
    /// Lower bound for the table size regardless of `maxPerCore`. Default: 131072.
    pub min: Option<i32>,
    /// Idle timeout of established TCP connections; 0 leaves it alone. Default: 24h.
    pub tcp_established_timeout: Option<GoDuration>,
    /// How long a CLOSE_WAIT entry stays; 0 leaves it alone. Default: 1h.
    pub tcp_close_wait_timeout: Option<GoDuration>,
    /// Set `nf_conntrack_tcp_be_liberal` so out-of-window packets are not marked INVALID.
    #[serde(deserialize_with = "null_default")]
    pub tcp_be_liberal: bool,
    /// Timeout of unreplied UDP entries; 0 leaves it alone.
    #[serde(deserialize_with = "null_default")]
    pub udp_timeout: GoDuration,
    /// Timeout of assured (streaming) UDP entries; 0 leaves it alone.
    #[serde(deserialize_with = "null_default")]
    pub udp_stream_timeout: GoDuration,
}

/// `detectLocal`: parameters of the interface-based local-traffic detectors.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct DetectLocalConfig {
    /// Bridge whose traffic counts as local when `detectLocalMode` is `BridgeInterface`.
    #[serde(deserialize_with = "null_default")]
    pub bridge_interface: String,
    /// Interface name prefix whose traffic counts as local when `detectLocalMode` is
    /// `InterfaceNamePrefix`.
    #[serde(deserialize_with = "null_default")]
    pub interface_name_prefix: String,
}

/// One `logging.vmodule` entry.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct VModuleItem {
    /// Glob matched against source file names.
    #[serde(deserialize_with = "null_default")]
    pub file_pattern: String,
    /// Verbosity for matching files.
    #[serde(deserialize_with = "null_default")]
    pub verbosity: u32,
}

/// Output routing of one log format (`logging.options.json` / `.text`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct OutputRouting {
    /// Write info messages to stdout and errors to stderr (alpha upstream).
    #[serde(deserialize_with = "null_default", skip_serializing_if = "is_false")]
    pub split_stream: bool,
    /// Buffer size for info messages when splitting streams. Default: "0".
    #[serde(skip_serializing_if = "Option::is_none")]
    pub info_buffer_size: Option<Quantity>,
}

fn is_false(b: &bool) -> bool {
    !*b
}

/// `logging.options`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct LoggingOptions {
    /// Options of the `text` format (newer releases write this too; accepted).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub text: Option<OutputRouting>,
    /// Options of the `json` format.
    #[serde(deserialize_with = "null_default")]
    pub json: OutputRouting,
}

/// `logging` (component-base `LoggingConfiguration`). Only `format` is validated; the rest is
/// accepted and handed to the logger as far as it applies.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct LoggingConfig {
    /// `text` or `json`. Default: text.
    #[serde(deserialize_with = "null_default", skip_serializing_if = "String::is_empty")]
    pub format: String,
    /// Maximum time between log flushes. Default: 5s.
    #[serde(deserialize_with = "null_default")]
    pub flush_frequency: FlushFrequency,
    /// Log verbosity (klog `-v`).
    #[serde(deserialize_with = "null_default")]
    pub verbosity: u32,
    /// Per-file verbosity overrides.
    #[serde(skip_serializing_if = "vmodule_is_empty")]
    pub vmodule: Option<Vec<VModuleItem>>,
    /// Format-specific options.
    #[serde(deserialize_with = "null_default")]
    pub options: LoggingOptions,
}

fn vmodule_is_empty(v: &Option<Vec<VModuleItem>>) -> bool {
    v.as_ref().is_none_or(Vec::is_empty)
}

/// The whole config file, field for field as upstream v1.29 `v1alpha1` has it.
///
/// Fields that are pointers upstream are `Option`s here (`null` and absent both mean unset);
/// for every other field `null` means the zero value, as in Go.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct KubeProxyConfiguration {
    /// Always `kubeproxy.config.k8s.io/v1alpha1`.
    pub api_version: String,
    /// Always `KubeProxyConfiguration`.
    pub kind: String,
    /// Feature gate names mapped to enabled/disabled. Not checked against upstream's gate
    /// list (we cannot know it); recorded for the components that care.
    #[serde(deserialize_with = "null_default", skip_serializing_if = "BTreeMap::is_empty")]
    pub feature_gates: BTreeMap<String, bool>,
    /// kube-proxy-rs extension, not an upstream field: the upstream release whose behaviour
    /// and gate defaults apply (`1.29` … `1.35`); empty means the newest. Left out of a
    /// written config when empty, so such files stay readable by upstream.
    #[serde(deserialize_with = "null_default", skip_serializing_if = "String::is_empty")]
    pub compatibility_version: String,
    /// How to reach the API server.
    #[serde(deserialize_with = "null_default")]
    pub client_connection: ClientConnection,
    /// Log format and verbosity.
    #[serde(deserialize_with = "null_default")]
    pub logging: LoggingConfig,
    /// Name of this node; empty means the machine's hostname. Trimmed and lower-cased.
    #[serde(deserialize_with = "null_default")]
    pub hostname_override: String,
    /// Overrides the node's primary IP (despite the name, nothing binds to it).
    /// Default: 0.0.0.0.
    #[serde(deserialize_with = "null_default")]
    pub bind_address: String,
    /// `ip:port` of the health check server; empty disables it. Default: 0.0.0.0:10256
    /// (`[::]:10256` when bindAddress is IPv6).
    #[serde(deserialize_with = "null_default")]
    pub healthz_bind_address: String,
    /// `ip:port` of the metrics server. Default: 127.0.0.1:10249 (`[::1]:10249` when
    /// bindAddress is IPv6).
    #[serde(deserialize_with = "null_default")]
    pub metrics_bind_address: String,
    /// Exit when a server port cannot be bound instead of logging.
    #[serde(deserialize_with = "null_default")]
    pub bind_address_hard_fail: bool,
    /// Serve `/debug/pprof` on the metrics server.
    #[serde(deserialize_with = "null_default")]
    pub enable_profiling: bool,
    /// Show metrics hidden since this release (only the previous minor is allowed).
    #[serde(deserialize_with = "null_default")]
    pub show_hidden_metrics_for_version: String,
    /// Proxy mode; empty means iptables on Linux. Only iptables is implemented here.
    #[serde(deserialize_with = "null_default")]
    pub mode: String,
    /// iptables proxier settings.
    #[serde(deserialize_with = "null_default")]
    pub iptables: IptablesConfig,
    /// IPVS proxier settings (not implemented; kept).
    #[serde(deserialize_with = "null_default")]
    pub ipvs: IpvsConfig,
    /// nftables proxier settings (not implemented; kept).
    #[serde(deserialize_with = "null_default")]
    pub nftables: NftablesConfig,
    /// Windows settings (not implemented; kept).
    #[serde(deserialize_with = "null_default")]
    pub winkernel: WinkernelConfig,
    /// How traffic is recognised as coming from local pods: `ClusterCIDR` (the default when
    /// empty), `NodeCIDR`, `BridgeInterface` or `InterfaceNamePrefix`.
    #[serde(deserialize_with = "null_default")]
    pub detect_local_mode: String,
    /// Parameters of the interface-based `detectLocalMode`s.
    #[serde(deserialize_with = "null_default")]
    pub detect_local: DetectLocalConfig,
    /// Pod CIDR range(s) of the cluster: one CIDR, or a comma-separated dual-stack pair.
    #[serde(rename = "clusterCIDR", deserialize_with = "null_default")]
    pub cluster_cidr: String,
    /// CIDRs whose node addresses accept NodePort connections (unset: all). The single value
    /// `primary` (a v1.30 addition, accepted here) means the node's primary IPs.
    pub node_port_addresses: Option<Vec<String>>,
    /// oom_score_adj of the process, -1000..=1000. Default: -999.
    pub oom_score_adj: Option<i32>,
    /// Connection-tracking sysctls.
    #[serde(deserialize_with = "null_default")]
    pub conntrack: ConntrackConfig,
    /// How often informers resync from the API server. Must be > 0. Default: 15m.
    #[serde(deserialize_with = "null_default")]
    pub config_sync_period: GoDuration,
    /// Unused since the userspace proxy was removed; still parsed as a port range.
    #[serde(deserialize_with = "null_default")]
    pub port_range: String,
    /// Windows service control manager integration (added in 1.31, Windows only):
    /// accepted and ignored, so that configuration files written by 1.31+ load.
    #[serde(deserialize_with = "null_default", skip_serializing_if = "is_false")]
    pub windows_run_as_service: bool,
}

impl Default for KubeProxyConfiguration {
    /// An empty (undefaulted) configuration carrying the right `apiVersion` and `kind`.
    fn default() -> Self {
        KubeProxyConfiguration {
            api_version: API_VERSION.to_string(),
            kind: KIND.to_string(),
            feature_gates: BTreeMap::new(),
            compatibility_version: String::new(),
            client_connection: ClientConnection::default(),
            logging: LoggingConfig::default(),
            hostname_override: String::new(),
            bind_address: String::new(),
            healthz_bind_address: String::new(),
            metrics_bind_address: String::new(),
            bind_address_hard_fail: false,
            enable_profiling: false,
            show_hidden_metrics_for_version: String::new(),
            mode: String::new(),
            iptables: IptablesConfig::default(),
            ipvs: IpvsConfig::default(),
            nftables: NftablesConfig::default(),
            winkernel: WinkernelConfig::default(),
            detect_local_mode: String::new(),
            detect_local: DetectLocalConfig::default(),
            cluster_cidr: String::new(),
            node_port_addresses: None,
            oom_score_adj: None,
            conntrack: ConntrackConfig::default(),
            config_sync_period: GoDuration::ZERO,
            port_range: String::new(),
            windows_run_as_service: false,
        }
    }
}

impl KubeProxyConfiguration {
    /// The complete configuration as YAML with keys sorted (as Go's encoder writes them).
    /// [`super::parse_config`] reads it back to an equal value.
    pub fn to_yaml(&self) -> String {
        match serde_yaml::to_value(self) {
            Ok(value) => serde_yaml::to_string(&sort_mappings(value)).unwrap_or_default(),
            // Serializing these plain data types cannot fail; stay total anyway.
            Err(_) => String::new(),
        }
    }
}

/// Recursively sorts mapping keys so output order does not depend on declaration order.
fn sort_mappings(value: serde_yaml::Value) -> serde_yaml::Value {
    match value {
        serde_yaml::Value::Mapping(map) => {
            let mut entries: Vec<(serde_yaml::Value, serde_yaml::Value)> = map.into_iter().collect();
            entries.sort_by(|a, b| a.0.as_str().cmp(&b.0.as_str()));
            serde_yaml::Value::Mapping(entries.into_iter().map(|(k, v)| (k, sort_mappings(v))).collect())
        }
        serde_yaml::Value::Sequence(items) => {
            serde_yaml::Value::Sequence(items.into_iter().map(sort_mappings).collect())
        }
        other => other,
    }
}
