//! [`Settings`]: the configuration after defaulting and validation, in the types the rest of
//! the program uses.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use super::defaults::{DEFAULT_MASQUERADE_BIT, DEFAULT_OOM_SCORE_ADJ};
use super::duration::GoDuration;
use super::types::KubeProxyConfiguration;
use super::validation::{FieldError, parse_host_port};
use crate::compat::Features;
use crate::model::Cidr;
use crate::model::ip::parse_ip_sloppy;

/// How local (pod-originated) traffic is recognised, with the parameters of the mode.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DetectLocal {
    /// Source address inside the cluster CIDR(s); no CIDRs means nothing is local.
    ClusterCidr(Vec<Cidr>),
    /// Source address inside the Node object's `spec.podCIDRs`.
    NodeCidr,
    /// Arriving on this bridge interface.
    BridgeInterface(String),
    /// Arriving on an interface whose name starts with this prefix.
    InterfaceNamePrefix(String),
}

/// The proxy mode: which proxier writes the node's rules.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ProxyMode {
    /// iptables-restore into the nat, filter and mangle tables (the Linux default).
    Iptables,
    /// One nftables transaction per sync into the `kube-proxy` table of each family.
    Nftables,
}

impl ProxyMode {
    /// The mode as the config and `/proxyMode` spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            ProxyMode::Iptables => "iptables",
            ProxyMode::Nftables => "nftables",
        }
    }
}

impl std::fmt::Display for ProxyMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// `conntrack` with defaults applied; a zero means "leave the kernel's value alone".
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConntrackSettings {
    pub max_per_core: u32,
    pub min: u32,
    pub tcp_established_timeout: Duration,
    pub tcp_close_wait_timeout: Duration,
    pub tcp_be_liberal: bool,
    pub udp_timeout: Duration,
    pub udp_stream_timeout: Duration,
}

/// API client settings.
#[derive(Debug, Clone, PartialEq)]
pub struct ClientSettings {
    /// `None` means in-cluster configuration.
    pub kubeconfig: Option<PathBuf>,
    pub accept_content_types: String,
    pub content_type: String,
    pub qps: f32,
    pub burst: u32,
}

/// Logging settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoggingSettings {
    /// `text` or `json`.
    pub format: String,
    pub verbosity: u32,
    pub flush_frequency: Duration,
}

/// The configuration after defaulting and validation, in the types the program uses.
#[derive(Debug, Clone, PartialEq)]
pub struct Settings {
    /// Trimmed, lower-cased node name override (`nodeutil.GetHostname`); `None` when unset.
    pub hostname_override: Option<String>,
    /// Overrides the node's primary IP when not unspecified (0.0.0.0 / ::).
    pub bind_address: IpAddr,
    /// Health check server address; `None` disables it.
    pub healthz_bind_address: Option<SocketAddr>,
    /// Metrics server address.
    pub metrics_bind_address: Option<SocketAddr>,
    pub bind_address_hard_fail: bool,
    pub enable_profiling: bool,
    /// The proxy mode (`mode`; empty means iptables).
    pub mode: ProxyMode,
    /// The fwmark bit used for SNAT (the mode's section: `iptables.masqueradeBit` or
    /// `nftables.masqueradeBit`).
    pub masquerade_bit: u32,
    /// `1 << masquerade_bit` as Go's `fmt.Sprintf("%#08x", ...)` writes it: eight zero-padded
    /// hex digits after `0x` (bit 14 → `0x00004000`).
    pub masquerade_mark: String,
    /// The mode's `masqueradeAll` (upstream's conversion takes it from the mode's section).
    pub masquerade_all: bool,
    pub localhost_nodeports: bool,
    /// The mode's `syncPeriod` and `minSyncPeriod` (upstream's conversion, as above).
    pub sync_period: Duration,
    pub min_sync_period: Duration,
    pub config_sync_period: Duration,
    /// Parsed `clusterCIDR` (empty when unset).
    pub cluster_cidrs: Vec<Cidr>,
    pub detect_local: DetectLocal,
    /// `nodePortAddresses` as written (CIDRs or `primary`); empty means all addresses.
    pub node_port_addresses: Vec<String>,
    pub conntrack: ConntrackSettings,
    pub oom_score_adj: i32,
    pub feature_gates: BTreeMap<String, bool>,
    /// The release emulated and its gates (`compatibilityVersion` with `featureGates`).
    pub features: Features,
    pub client: ClientSettings,
    pub logging: LoggingSettings,
    pub show_hidden_metrics_for_version: Option<String>,
    /// `mode` was left empty (the Linux default applies); 1.37 warns about it.
    pub mode_unset: bool,
}

/// Go's `fmt.Sprintf("%#08x", 1<<bit)`: Go zero-pads the digits to the width and then adds
/// the `0x` prefix, so there are always at least eight hex digits.
pub fn masquerade_mark(bit: u32) -> String {
    let value: u64 = 1u64 << bit.min(63);
    format!("0x{value:08x}")
}

fn std_duration(d: GoDuration) -> Duration {
    d.to_std().unwrap_or_default()
}

impl Settings {
    /// Defaults (idempotently), validates and converts a configuration.
    pub fn from_config(config: &KubeProxyConfiguration) -> Result<Settings, Vec<FieldError>> {
        let cfg = config.clone().with_defaults();
        let features = cfg.validated_features()?;

        let cluster_cidrs: Vec<Cidr> = if cfg.cluster_cidr.trim().is_empty() {
            Vec::new()
        } else {
            cfg.cluster_cidr.trim().split(',').filter_map(Cidr::parse_sloppy).collect()
        };
        let detect_local = match cfg.detect_local_mode.as_str() {
            "NodeCIDR" => DetectLocal::NodeCidr,
            "BridgeInterface" => DetectLocal::BridgeInterface(cfg.detect_local.bridge_interface.clone()),
            "InterfaceNamePrefix" => DetectLocal::InterfaceNamePrefix(cfg.detect_local.interface_name_prefix.clone()),
            _ => DetectLocal::ClusterCidr(cluster_cidrs.clone()),
        };
        let hostname = cfg.hostname_override.trim();
        // Upstream's v1alpha1 conversion: the mode's own section decides these.
        let mode = if cfg.mode == "nftables" { ProxyMode::Nftables } else { ProxyMode::Iptables };
        let (masquerade_bit, masquerade_all, sync_period, min_sync_period) = match mode {
            ProxyMode::Iptables => (
                cfg.iptables.masquerade_bit,
                cfg.iptables.masquerade_all,
                cfg.iptables.sync_period,
                cfg.iptables.min_sync_period,
            ),
            ProxyMode::Nftables => (
                cfg.nftables.masquerade_bit,
                cfg.nftables.masquerade_all,
                cfg.nftables.sync_period,
                cfg.nftables.min_sync_period,
            ),
        };
        let masquerade_bit = masquerade_bit.unwrap_or(DEFAULT_MASQUERADE_BIT).clamp(0, 31) as u32;
        let non_negative = |v: Option<i32>| v.unwrap_or(0).max(0) as u32;
        let ct = &cfg.conntrack;
        let kubeconfig = cfg.client_connection.kubeconfig.trim();

        Ok(Settings {
            hostname_override: (!hostname.is_empty()).then(|| hostname.to_lowercase()),
            bind_address: parse_ip_sloppy(&cfg.bind_address).unwrap_or(IpAddr::from([0, 0, 0, 0])),
            healthz_bind_address: parse_host_port(&cfg.healthz_bind_address),
            metrics_bind_address: parse_host_port(&cfg.metrics_bind_address),
            bind_address_hard_fail: cfg.bind_address_hard_fail,
            enable_profiling: cfg.enable_profiling,
            mode,
            masquerade_bit,
            masquerade_mark: masquerade_mark(masquerade_bit),
            masquerade_all,
            localhost_nodeports: cfg.iptables.localhost_node_ports.unwrap_or(true),
            sync_period: std_duration(sync_period),
            min_sync_period: std_duration(min_sync_period),
            config_sync_period: std_duration(cfg.config_sync_period),
            cluster_cidrs,
            detect_local,
            node_port_addresses: cfg.node_port_addresses.clone().unwrap_or_default(),
            conntrack: ConntrackSettings {
                max_per_core: non_negative(ct.max_per_core),
                min: non_negative(ct.min),
                tcp_established_timeout: std_duration(ct.tcp_established_timeout.unwrap_or_default()),
                tcp_close_wait_timeout: std_duration(ct.tcp_close_wait_timeout.unwrap_or_default()),
                tcp_be_liberal: ct.tcp_be_liberal,
                udp_timeout: std_duration(ct.udp_timeout),
                udp_stream_timeout: std_duration(ct.udp_stream_timeout),
            },
            oom_score_adj: cfg.oom_score_adj.unwrap_or(DEFAULT_OOM_SCORE_ADJ),
            feature_gates: cfg.feature_gates.clone(),
            features,
            client: ClientSettings {
                kubeconfig: (!kubeconfig.is_empty()).then(|| PathBuf::from(kubeconfig)),
                accept_content_types: cfg.client_connection.accept_content_types.clone(),
                content_type: cfg.client_connection.content_type.clone(),
                qps: cfg.client_connection.qps,
                burst: cfg.client_connection.burst.max(0) as u32,
            },
            logging: LoggingSettings {
                format: cfg.logging.format.clone(),
                verbosity: cfg.logging.verbosity,
                flush_frequency: std_duration(cfg.logging.flush_frequency.duration),
            },
            show_hidden_metrics_for_version: (!cfg.show_hidden_metrics_for_version.is_empty())
                .then(|| cfg.show_hidden_metrics_for_version.clone()),
            mode_unset: cfg.mode.is_empty(),
        })
    }
}
