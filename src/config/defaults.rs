//! Upstream's defaulting (`SetDefaults_KubeProxyConfiguration`, and component-base's
//! recommended logging defaults): what an absent or zero field means.

use std::net::IpAddr;

use super::duration::GoDuration;
use super::types::{FlushFrequency, KubeProxyConfiguration, Quantity};
use super::validation::split_host_port;
use crate::model::ip::parse_ip_sloppy;

/// Upstream `ports.ProxyHealthzPort`.
const DEFAULT_HEALTHZ_PORT: u16 = 10256;
/// Upstream `ports.ProxyStatusPort` (the metrics server).
const DEFAULT_METRICS_PORT: u16 = 10249;
/// Upstream `qos.KubeProxyOOMScoreAdj`.
pub(super) const DEFAULT_OOM_SCORE_ADJ: i32 = -999;
pub(super) const DEFAULT_MASQUERADE_BIT: i32 = 14;
const DEFAULT_CONTENT_TYPE: &str = "application/vnd.kubernetes.protobuf";

/// Go's `proxyutil.AppendPortIfNeeded`: adds `:port` to a bare IP, leaves anything else.
pub(crate) fn append_port_if_needed(addr: &str, port: u16) -> String {
    if split_host_port(addr).is_ok() {
        return addr.to_string();
    }
    match parse_ip_sloppy(addr) {
        Some(IpAddr::V4(_)) => format!("{addr}:{port}"),
        Some(IpAddr::V6(_)) => format!("[{addr}]:{port}"),
        None => addr.to_string(),
    }
}

impl KubeProxyConfiguration {
    /// Applies upstream's `SetDefaults_KubeProxyConfiguration` (v1.29). Idempotent.
    ///
    /// `mode` and `detectLocalMode` stay empty (they mean iptables and ClusterCIDR).
    pub fn with_defaults(mut self) -> Self {
        if self.bind_address.is_empty() {
            self.bind_address = "0.0.0.0".to_string();
        }
        let bind_is_v4 = matches!(parse_ip_sloppy(&self.bind_address), Some(IpAddr::V4(_)));
        let (healthz_host, metrics_host) = if bind_is_v4 { ("0.0.0.0", "127.0.0.1") } else { ("[::]", "[::1]") };
        self.healthz_bind_address = if self.healthz_bind_address.is_empty() {
            format!("{healthz_host}:{DEFAULT_HEALTHZ_PORT}")
        } else {
            append_port_if_needed(&self.healthz_bind_address, DEFAULT_HEALTHZ_PORT)
        };
        self.metrics_bind_address = if self.metrics_bind_address.is_empty() {
            format!("{metrics_host}:{DEFAULT_METRICS_PORT}")
        } else {
            append_port_if_needed(&self.metrics_bind_address, DEFAULT_METRICS_PORT)
        };
        self.oom_score_adj.get_or_insert(DEFAULT_OOM_SCORE_ADJ);

        let ipt = &mut self.iptables;
        if ipt.sync_period.is_zero() {
            ipt.sync_period = GoDuration::from_secs(30);
        }
        if ipt.min_sync_period.is_zero() {
            ipt.min_sync_period = GoDuration::from_secs(1);
        }
        ipt.masquerade_bit.get_or_insert(DEFAULT_MASQUERADE_BIT);
        ipt.localhost_node_ports.get_or_insert(true);

        if self.ipvs.sync_period.is_zero() {
            self.ipvs.sync_period = GoDuration::from_secs(30);
        }
        let nft = &mut self.nftables;
        if nft.sync_period.is_zero() {
            nft.sync_period = GoDuration::from_secs(30);
        }
        if nft.min_sync_period.is_zero() {
            nft.min_sync_period = GoDuration::from_secs(1);
        }
        nft.masquerade_bit.get_or_insert(DEFAULT_MASQUERADE_BIT);

        let ct = &mut self.conntrack;
        ct.max_per_core.get_or_insert(32 * 1024);
        ct.min.get_or_insert(128 * 1024);
        ct.tcp_established_timeout.get_or_insert(GoDuration::from_secs(24 * 3600));
        ct.tcp_close_wait_timeout.get_or_insert(GoDuration::from_secs(3600));

        if self.config_sync_period.is_zero() {
            self.config_sync_period = GoDuration::from_secs(15 * 60);
        }
        let cc = &mut self.client_connection;
        if cc.content_type.is_empty() {
            cc.content_type = DEFAULT_CONTENT_TYPE.to_string();
        }
        if cc.qps == 0.0 {
            cc.qps = 5.0;
        }
        if cc.burst == 0 {
            cc.burst = 10;
        }

        // component-base SetRecommendedLoggingConfiguration.
        let log = &mut self.logging;
        if log.format.is_empty() {
            log.format = "text".to_string();
        }
        if log.flush_frequency.duration.is_zero() {
            log.flush_frequency = FlushFrequency { duration: GoDuration::from_secs(5), as_string: true };
        }
        log.options.json.info_buffer_size.get_or_insert(Quantity("0".to_string()));
        if let Some(text) = &mut log.options.text {
            text.info_buffer_size.get_or_insert(Quantity("0".to_string()));
        }
        self
    }
}
