//! Upstream's validation of a defaulted configuration (`validation.Validate
//! KubeProxyConfiguration`), plus the rules this implementation adds, as Kubernetes-style
//! field errors naming the field's path in the file.

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;

use super::duration::GoDuration;
use super::types::KubeProxyConfiguration;
use crate::compat::{Features, Release};
use crate::model::Cidr;
use crate::model::IpFamily;
use crate::model::ip::parse_ip_sloppy;

/// What is wrong with one field, in the shape of Kubernetes' `field.Error`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FieldErrorKind {
    /// The value is malformed or out of range.
    Invalid,
    /// The value is not one of an enumerated set.
    NotSupported,
}

/// One validation failure: the field's path in the file (e.g. `iptables.masqueradeBit`),
/// the offending value as text, and why it is wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {}: {value}: {detail}", kind_label(*.kind))]
pub struct FieldError {
    pub field: String,
    pub kind: FieldErrorKind,
    /// The rejected value, rendered (strings quoted).
    pub value: String,
    pub detail: String,
}

fn kind_label(kind: FieldErrorKind) -> &'static str {
    match kind {
        FieldErrorKind::Invalid => "Invalid value",
        FieldErrorKind::NotSupported => "Unsupported value",
    }
}

impl FieldError {
    fn invalid(field: &str, value: impl fmt::Display, detail: impl Into<String>) -> FieldError {
        FieldError {
            field: field.to_string(),
            kind: FieldErrorKind::Invalid,
            value: value.to_string(),
            detail: detail.into(),
        }
    }

    fn invalid_str(field: &str, value: &str, detail: impl Into<String>) -> FieldError {
        FieldError::invalid(field, format!("{value:?}"), detail)
    }

    fn not_supported(field: &str, value: &str, supported: &[&str]) -> FieldError {
        let list: Vec<String> = supported.iter().map(|s| format!("{s:?}")).collect();
        FieldError {
            field: field.to_string(),
            kind: FieldErrorKind::NotSupported,
            value: format!("{value:?}"),
            detail: format!("supported values: {}", list.join(", ")),
        }
    }
}

/// The fields each proxy mode's section shares (`iptables`, `nftables`).
struct ModeSection {
    masquerade_bit: Option<i32>,
    sync_period: GoDuration,
    min_sync_period: GoDuration,
}

impl KubeProxyConfiguration {
    /// Checks every field against upstream's validation rules, plus the ones this
    /// implementation adds (only the iptables mode). Call on a defaulted configuration.
    /// The release selected by `compatibilityVersion` (default: the newest) with
    /// `featureGates` applied; problems are pushed to `errs` and give `None`.
    fn features(&self, errs: &mut Vec<FieldError>) -> Option<Features> {
        let version = self.compatibility_version.trim();
        let release = if version.is_empty() {
            Release::NEWEST
        } else {
            match version.parse::<Release>() {
                Ok(release) => release,
                Err(e) => {
                    errs.push(FieldError::invalid_str("compatibilityVersion", version, e.to_string()));
                    return None;
                }
            }
        };
        match Features::resolve(release, &self.feature_gates) {
            Ok(features) => Some(features),
            Err(e) => {
                errs.push(FieldError::invalid("featureGates", format_gates(&self.feature_gates), e.to_string()));
                None
            }
        }
    }

    pub fn validate(&self) -> Result<(), Vec<FieldError>> {
        self.validated_features().map(|_| ())
    }

    /// Validates the configuration and returns the release it selects with its gates.
    pub(super) fn validated_features(&self) -> Result<Features, Vec<FieldError>> {
        let mut errs = Vec::new();
        self.validate_mode(&mut errs);
        self.validate_iptables(&mut errs);
        self.validate_conntrack(&mut errs);

        if self.client_connection.burst < 0 {
            errs.push(FieldError::invalid(
                "clientConnection.burst",
                self.client_connection.burst,
                "must be greater than or equal to 0",
            ));
        }
        if self.config_sync_period.0 <= 0 {
            errs.push(duration_error("configSyncPeriod", self.config_sync_period, "must be greater than 0"));
        }
        if parse_ip_sloppy(&self.bind_address).is_none() {
            errs.push(FieldError::invalid_str(
                "bindAddress",
                &self.bind_address,
                "not a valid textual representation of an IP address",
            ));
        }
        if !self.healthz_bind_address.is_empty() {
            validate_host_port("healthzBindAddress", &self.healthz_bind_address, &mut errs);
        }
        validate_host_port("metricsBindAddress", &self.metrics_bind_address, &mut errs);
        if let Some(adj) = self.oom_score_adj
            && !(-1000..=1000).contains(&adj)
        {
            errs.push(FieldError::invalid("oomScoreAdj", adj, "must be within the range [-1000, 1000]"));
        }
        if !self.cluster_cidr.is_empty() {
            validate_cluster_cidr(&self.cluster_cidr, &mut errs);
        }
        if let Err(detail) = parse_port_range(&self.port_range) {
            errs.push(FieldError::invalid_str(
                "portRange",
                &self.port_range,
                format!("must be a valid port range (e.g. 300-2000): {detail}"),
            ));
        }
        let features = self.features(&mut errs);
        if let Some(features) = &features {
            self.validate_mode_in_release(features, &mut errs);
        }
        let release = features.map_or(Release::NEWEST, |f| f.release);
        validate_node_port_addresses(self.node_port_addresses.as_deref().unwrap_or(&[]), release, &mut errs);
        validate_show_hidden_metrics(&self.show_hidden_metrics_for_version, release, &mut errs);
        self.validate_detect_local(&mut errs);
        if !self.hostname_override.is_empty() && self.hostname_override.trim().is_empty() {
            errs.push(FieldError::invalid_str(
                "hostnameOverride",
                &self.hostname_override,
                "empty hostname is invalid",
            ));
        }
        if !matches!(self.logging.format.as_str(), "" | "text" | "json") {
            errs.push(FieldError::invalid_str("logging.format", &self.logging.format, "Unsupported log format"));
        }
        // `features` is `None` only after it pushed an error.
        match features {
            Some(features) if errs.is_empty() => Ok(features),
            _ => Err(errs),
        }
    }

    fn validate_mode(&self, errs: &mut Vec<FieldError>) {
        match self.mode.as_str() {
            "" | "iptables" => {}
            "nftables" => self.validate_mode_section("nftables", &self.nftables_section(), errs),
            "ipvs" | "kernelspace" => errs.push(FieldError::invalid_str(
                "mode",
                &self.mode,
                "this implementation provides the iptables and nftables proxy modes; must be \"iptables\", \"nftables\" or blank",
            )),
            _ => errs.push(FieldError::invalid_str(
                "mode",
                &self.mode,
                "must be iptables, nftables or blank (blank means the best-available proxy [currently iptables])",
            )),
        }
    }

    /// `mode: nftables` in a release that has it with its gate on.
    fn validate_mode_in_release(&self, features: &Features, errs: &mut Vec<FieldError>) {
        if self.mode != "nftables" {
            return;
        }
        if features.release < Release::V1_31 {
            errs.push(FieldError::invalid_str(
                "mode",
                &self.mode,
                format!(
                    "nftables mode is provided for releases 1.31 and later (alpha and off by default in {}); set compatibilityVersion to 1.31 or later",
                    features.release
                ),
            ));
        } else if !features.nftables_proxy_mode {
            errs.push(FieldError::invalid_str("mode", &self.mode, "feature gate NFTablesProxyMode is disabled"));
        }
    }

    fn nftables_section(&self) -> ModeSection {
        let nft = &self.nftables;
        ModeSection {
            masquerade_bit: nft.masquerade_bit,
            sync_period: nft.sync_period,
            min_sync_period: nft.min_sync_period,
        }
    }

    /// `masqueradeBit`, `syncPeriod` and `minSyncPeriod` of one mode's section.
    fn validate_mode_section(&self, section: &str, values: &ModeSection, errs: &mut Vec<FieldError>) {
        if let Some(bit) = values.masquerade_bit
            && !(0..=31).contains(&bit)
        {
            errs.push(FieldError::invalid(
                &format!("{section}.masqueradeBit"),
                bit,
                "must be within the range [0, 31]",
            ));
        }
        if values.sync_period.0 <= 0 {
            errs.push(duration_error(&format!("{section}.syncPeriod"), values.sync_period, "must be greater than 0"));
        }
        if values.min_sync_period.0 < 0 {
            errs.push(duration_error(
                &format!("{section}.minSyncPeriod"),
                values.min_sync_period,
                "must be greater than or equal to 0",
            ));
        }
        if values.min_sync_period > values.sync_period {
            // Upstream reports this on syncPeriod, showing the minSyncPeriod value.
            errs.push(duration_error(
                &format!("{section}.syncPeriod"),
                values.min_sync_period,
                &format!("must be greater than or equal to {section}.minSyncPeriod"),
            ));
        }
    }

    fn validate_iptables(&self, errs: &mut Vec<FieldError>) {
        let ipt = &self.iptables;
        let section = ModeSection {
            masquerade_bit: ipt.masquerade_bit,
            sync_period: ipt.sync_period,
            min_sync_period: ipt.min_sync_period,
        };
        self.validate_mode_section("iptables", &section, errs);
    }

    fn validate_conntrack(&self, errs: &mut Vec<FieldError>) {
        let ct = &self.conntrack;
        const NON_NEGATIVE: &str = "must be greater than or equal to 0";
        if let Some(v) = ct.max_per_core
            && v < 0
        {
            errs.push(FieldError::invalid("conntrack.maxPerCore", v, NON_NEGATIVE));
        }
        if let Some(v) = ct.min
            && v < 0
        {
            errs.push(FieldError::invalid("conntrack.min", v, NON_NEGATIVE));
        }
        let durations = [
            ("conntrack.tcpEstablishedTimeout", ct.tcp_established_timeout.unwrap_or_default()),
            ("conntrack.tcpCloseWaitTimeout", ct.tcp_close_wait_timeout.unwrap_or_default()),
            ("conntrack.udpTimeout", ct.udp_timeout),
            ("conntrack.udpStreamTimeout", ct.udp_stream_timeout),
        ];
        for (field, value) in durations {
            if value.0 < 0 {
                errs.push(duration_error(field, value, NON_NEGATIVE));
            }
        }
    }

    fn validate_detect_local(&self, errs: &mut Vec<FieldError>) {
        const MODES: [&str; 5] = ["ClusterCIDR", "NodeCIDR", "BridgeInterface", "InterfaceNamePrefix", ""];
        match self.detect_local_mode.as_str() {
            "BridgeInterface" if self.detect_local.bridge_interface.is_empty() => {
                errs.push(FieldError::invalid_str("detectLocal.bridgeInterface", "", "must not be empty"));
            }
            "InterfaceNamePrefix" if self.detect_local.interface_name_prefix.is_empty() => {
                errs.push(FieldError::invalid_str("detectLocal.interfaceNamePrefix", "", "must not be empty"));
            }
            mode if !MODES.contains(&mode) => {
                errs.push(FieldError::not_supported("detectLocalMode", mode, &MODES));
            }
            _ => {}
        }
    }
}

fn duration_error(field: &str, value: GoDuration, detail: &str) -> FieldError {
    FieldError::invalid(field, format!("\"{value}\""), detail)
}

/// Go's `net.SplitHostPort`: `host:port` or `[host]:port`; the port may be empty.
pub(crate) fn split_host_port(input: &str) -> Result<(&str, &str), &'static str> {
    if let Some(rest) = input.strip_prefix('[') {
        let close = rest.find(']').ok_or("missing ']' in address")?;
        let host = &rest[..close];
        let after = &rest[close + 1..];
        let port = after.strip_prefix(':').ok_or("missing port in address")?;
        if port.contains([':', '[', ']']) || host.contains('[') {
            return Err("too many colons in address");
        }
        return Ok((host, port));
    }
    let colon = input.rfind(':').ok_or("missing port in address")?;
    let (host, port) = (&input[..colon], &input[colon + 1..]);
    if host.contains(':') {
        return Err("too many colons in address");
    }
    if host.contains(['[', ']']) || port.contains(['[', ']']) {
        return Err("unexpected bracket in address");
    }
    Ok((host, port))
}

/// Go's `strconv.Atoi` for the small numbers used here (optional sign, ASCII digits).
fn atoi(s: &str) -> Option<i64> {
    let digits = s.strip_prefix(['+', '-']).unwrap_or(s);
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse::<i64>().ok()
}

/// Parses `ip:port` the way validation accepts it (lenient IPv4, port 1..=65535).
pub(super) fn parse_host_port(input: &str) -> Option<SocketAddr> {
    let (host, port) = split_host_port(input).ok()?;
    let ip = parse_ip_sloppy(host)?;
    let port = atoi(port).filter(|p| (1..=65535).contains(p))?;
    Some(SocketAddr::new(ip, port as u16))
}

fn validate_host_port(field: &str, input: &str, errs: &mut Vec<FieldError>) {
    let Ok((host, port)) = split_host_port(input) else {
        errs.push(FieldError::invalid_str(field, input, "must be IP:port"));
        return;
    };
    if parse_ip_sloppy(host).is_none() {
        errs.push(FieldError::invalid_str(field, host, "must be a valid IP"));
    }
    if !atoi(port).is_some_and(|p| (1..=65535).contains(&p)) {
        errs.push(FieldError::invalid_str(field, port, "must be a valid port"));
    }
}

fn validate_cluster_cidr(value: &str, errs: &mut Vec<FieldError>) {
    // Like upstream, the pieces are not trimmed: "a, b" is rejected.
    let pieces: Vec<&str> = value.split(',').collect();
    match pieces.len() {
        1 => {
            if Cidr::parse_sloppy(value).is_none() {
                errs.push(FieldError::invalid_str(
                    "clusterCIDR",
                    value,
                    "must be a valid CIDR block (e.g. 10.100.0.0/16 or fde4:8dba:82e1::/48)",
                ));
            }
        }
        2 => {
            let families: Option<Vec<IpFamily>> =
                pieces.iter().map(|p| Cidr::parse_sloppy(p).map(|c| c.family())).collect();
            let dual = families.is_some_and(|f| f[0] != f[1]);
            if !dual {
                errs.push(FieldError::invalid_str(
                    "clusterCIDR",
                    value,
                    "must be a valid DualStack CIDR (e.g. 10.100.0.0/16,fde4:8dba:82e1::/48)",
                ));
            }
        }
        _ => errs.push(FieldError::invalid_str(
            "clusterCIDR",
            value,
            "only one CIDR allowed or a valid DualStack CIDR (e.g. 10.100.0.0/16,fde4:8dba:82e1::/48)",
        )),
    }
}

/// apimachinery `utilnet.ParsePortRange`: empty, `N`, `A-B` or `A+offset`.
pub(super) fn parse_port_range(value: &str) -> Result<Option<(u16, u16)>, String> {
    let value = value.trim();
    if value.is_empty() {
        return Ok(None);
    }
    let num = |s: &str| atoi(s).ok_or_else(|| format!("invalid number {s:?}"));
    let (low, high) = match (value.find('-'), value.find('+')) {
        (None, None) => {
            let port = num(value)?;
            (port, port)
        }
        (Some(i), None) => (num(&value[..i])?, num(&value[i + 1..])?),
        (None, Some(i)) => {
            let low = num(&value[..i])?;
            (low, low.saturating_add(num(&value[i + 1..])?))
        }
        (Some(_), Some(_)) => return Err(format!("unable to parse port range: {value}")),
    };
    if low > 65535 || high > 65535 {
        return Err(format!("the port range cannot be greater than 65535: {value}"));
    }
    if high < low {
        return Err(format!("end port cannot be less than start port: {value}"));
    }
    if low < 0 {
        return Err(format!("invalid port range: {value}"));
    }
    Ok(Some((low as u16, high as u16)))
}

/// `featureGates` as `--feature-gates` spells them, for error messages.
fn format_gates(gates: &BTreeMap<String, bool>) -> String {
    gates.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(",")
}

/// The keyword accepted in `nodePortAddresses` besides CIDRs (1.31).
pub(crate) const NODE_PORT_ADDRESSES_PRIMARY: &str = "primary";
/// `127.0.0.0/8` and `::1/128` (1.37).
pub(crate) const NODE_PORT_ADDRESSES_LOCALHOST: &str = "localhost";
/// `0.0.0.0/0` and `::/0` (1.37).
pub(crate) const NODE_PORT_ADDRESSES_ALL: &str = "all";

fn validate_node_port_addresses(addresses: &[String], release: Release, errs: &mut Vec<FieldError>) {
    if release.accepts_node_port_address_keywords() {
        // From 1.37 every entry is a CIDR or a keyword, in any combination.
        for (i, addr) in addresses.iter().enumerate() {
            let keyword = [NODE_PORT_ADDRESSES_PRIMARY, NODE_PORT_ADDRESSES_LOCALHOST, NODE_PORT_ADDRESSES_ALL]
                .contains(&addr.as_str());
            if !keyword && Cidr::parse_sloppy(addr).is_none() {
                errs.push(FieldError::invalid_str(
                    &format!("nodePortAddresses[{i}]"),
                    addr,
                    "must be a valid CIDR or one of 'primary', 'localhost', 'all'",
                ));
            }
        }
        return;
    }
    for (i, addr) in addresses.iter().enumerate() {
        let field = format!("nodePortAddresses[{i}]");
        if addr == NODE_PORT_ADDRESSES_PRIMARY && release.accepts_primary_node_port_addresses() {
            // Accepted alone from 1.31 on; earlier releases validate it as a CIDR (below).
            if addresses.len() != 1 {
                errs.push(FieldError::invalid_str(&field, addr, "can't use both 'primary' and CIDRs"));
            }
            break;
        }
        if Cidr::parse_sloppy(addr).is_none() {
            errs.push(FieldError::invalid_str(&field, addr, "must be a valid CIDR"));
        }
    }
}

/// Only the release before the one emulated is allowed, as upstream.
fn validate_show_hidden_metrics(version: &str, release: Release, errs: &mut Vec<FieldError>) {
    if version.is_empty() {
        return;
    }
    let allowed = format!("1.{}", release.minor() - 1);
    if version != allowed {
        errs.push(FieldError::invalid_str(
            "showHiddenMetricsForVersion",
            version,
            format!(
                "--show-hidden-metrics-for-version must be omitted or have the value '{allowed}'. \
                 Only the previous minor version is allowed"
            ),
        ));
    }
}
