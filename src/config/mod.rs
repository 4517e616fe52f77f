//! The `KubeProxyConfiguration` file (`kubeproxy.config.k8s.io/v1alpha1`, as of Kubernetes
//! v1.29): its serde types, upstream's defaulting and validation rules, Go-compatible
//! duration text, and the validated [`Settings`] the rest of the program reads.
//!
//! Reading goes `load_config_file` → [`KubeProxyConfiguration::with_defaults`] →
//! [`Settings::from_config`] (which validates). Decoding is strict: unknown fields, a wrong
//! `apiVersion` or `kind`, and values of the wrong type are errors naming the file, the line
//! and the field path. (Upstream falls back to lenient decoding with a logged warning for
//! v1alpha1; we do not.)

pub mod watch;

use std::collections::BTreeMap;
use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::compat::{Features, Release};
use crate::model::Cidr;
use crate::model::IpFamily;
use crate::model::ip::parse_ip_sloppy;

/// The only `apiVersion` accepted in a config file.
pub const API_VERSION: &str = "kubeproxy.config.k8s.io/v1alpha1";
/// The only `kind` accepted in a config file.
pub const KIND: &str = "KubeProxyConfiguration";

/// Upstream `ports.ProxyHealthzPort`.
const DEFAULT_HEALTHZ_PORT: u16 = 10256;
/// Upstream `ports.ProxyStatusPort` (the metrics server).
const DEFAULT_METRICS_PORT: u16 = 10249;
/// Upstream `qos.KubeProxyOOMScoreAdj`.
const DEFAULT_OOM_SCORE_ADJ: i32 = -999;
const DEFAULT_MASQUERADE_BIT: i32 = 14;
const DEFAULT_CONTENT_TYPE: &str = "application/vnd.kubernetes.protobuf";

const NANOS_PER_SECOND: i64 = 1_000_000_000;

// ---------------------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------------------

/// Why a config file could not be turned into a [`KubeProxyConfiguration`].
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{}: cannot read config file: {source}", .path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{}: config file is empty", .path.display())]
    Empty { path: PathBuf },
    /// YAML syntax, an unknown field, or a value of the wrong type. `message` starts with the
    /// field path (e.g. `iptables.masqueradeBit: invalid type ...`) when there is one.
    #[error("{}{}: {message}", .path.display(), fmt_location(*.location))]
    Decode {
        path: PathBuf,
        /// 1-based line and column, when the decoder knows them.
        location: Option<(usize, usize)>,
        message: String,
    },
    #[error(
        "{}: apiVersion {found:?} is not supported (expected {API_VERSION:?})",
        .path.display()
    )]
    ApiVersion { path: PathBuf, found: String },
    #[error("{}: kind {found:?} is not supported (expected {KIND:?})", .path.display())]
    Kind { path: PathBuf, found: String },
}

fn fmt_location(location: Option<(usize, usize)>) -> String {
    match location {
        Some((line, column)) => format!(":{line}:{column}"),
        None => String::new(),
    }
}

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

// ---------------------------------------------------------------------------------------------
// Go durations
// ---------------------------------------------------------------------------------------------

/// Why a duration string was rejected; the text matches Go's `time.ParseDuration` errors.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DurationError {
    #[error("time: invalid duration {0:?}")]
    Invalid(String),
    #[error("time: missing unit in duration {0:?}")]
    MissingUnit(String),
    #[error("time: unknown unit {unit:?} in duration {input:?}")]
    UnknownUnit { unit: String, input: String },
}

/// A signed span of nanoseconds written the way Go's `time.Duration` is (`"30s"`, `"1m0s"`,
/// `"1.5ms"`, `"-2h45m0s"`). Negative values are representable because the config format
/// allows writing them (validation then rejects most).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct GoDuration(pub i64);

impl GoDuration {
    pub const ZERO: GoDuration = GoDuration(0);

    pub fn from_secs(secs: i64) -> GoDuration {
        GoDuration(secs.saturating_mul(NANOS_PER_SECOND))
    }

    pub(crate) fn is_zero(self) -> bool {
        self.0 == 0
    }

    /// The duration as a `std` one; `None` when negative.
    pub(crate) fn to_std(self) -> Option<Duration> {
        u64::try_from(self.0).ok().map(Duration::from_nanos)
    }

    /// Parses Go's duration syntax: `[-+]?([0-9]*(\.[0-9]*)?[a-z]+)+`, or a bare `0`, with
    /// units `ns`, `us`/`µs`/`μs`, `ms`, `s`, `m`, `h`. Fractions are accepted per unit.
    pub fn parse(input: &str) -> Result<GoDuration, DurationError> {
        let invalid = || DurationError::Invalid(input.to_string());
        let mut rest = input.as_bytes();
        let mut negative = false;
        if let Some(&sign) = rest.first()
            && (sign == b'-' || sign == b'+')
        {
            negative = sign == b'-';
            rest = &rest[1..];
        }
        if rest == b"0" {
            return Ok(GoDuration::ZERO);
        }
        if rest.is_empty() {
            return Err(invalid());
        }
        const LIMIT: u64 = 1 << 63;
        let mut total: u64 = 0;
        while !rest.is_empty() {
            if !(rest[0] == b'.' || rest[0].is_ascii_digit()) {
                return Err(invalid());
            }
            let (whole, after_int) = leading_int(rest).ok_or_else(invalid)?;
            let had_int = after_int.len() != rest.len();
            rest = after_int;
            let mut fraction = 0u64;
            let mut scale = 1f64;
            let mut had_fraction = false;
            if rest.first() == Some(&b'.') {
                let (f, s, after_frac) = leading_fraction(&rest[1..]);
                had_fraction = after_frac.len() != rest.len() - 1;
                fraction = f;
                scale = s;
                rest = after_frac;
            }
            if !had_int && !had_fraction {
                return Err(invalid());
            }
            let unit_len = rest.iter().position(|&c| c == b'.' || c.is_ascii_digit()).unwrap_or(rest.len());
            if unit_len == 0 {
                return Err(DurationError::MissingUnit(input.to_string()));
            }
            let unit_text = &rest[..unit_len];
            rest = &rest[unit_len..];
            let unit: u64 = match unit_text {
                b"ns" => 1,
                b"us" => 1_000,
                // U+00B5 (micro sign) and U+03BC (Greek small letter mu).
                [0xC2, 0xB5, b's'] | [0xCE, 0xBC, b's'] => 1_000,
                b"ms" => 1_000_000,
                b"s" => 1_000_000_000,
                b"m" => 60_000_000_000,
                b"h" => 3_600_000_000_000,
                _ => {
                    return Err(DurationError::UnknownUnit {
                        unit: String::from_utf8_lossy(unit_text).into_owned(),
                        input: input.to_string(),
                    });
                }
            };
            if whole > LIMIT / unit {
                return Err(invalid());
            }
            let mut value = whole * unit;
            if fraction > 0 {
                // Go computes the fractional part in float64 too (exact to the nanosecond for
                // every unit up to hours).
                value += (fraction as f64 * (unit as f64 / scale)) as u64;
                if value > LIMIT {
                    return Err(invalid());
                }
            }
            total = total.checked_add(value).filter(|t| *t <= LIMIT).ok_or_else(invalid)?;
        }
        if negative {
            // total <= 2^63, so the negation fits (i64::MIN at most).
            return Ok(GoDuration((-(i128::from(total))) as i64));
        }
        i64::try_from(total).map(GoDuration).map_err(|_| invalid())
    }
}

/// Consumes `[0-9]*`; `None` on overflow past 2^63 (Go's `errLeadingInt`).
fn leading_int(s: &[u8]) -> Option<(u64, &[u8])> {
    let mut value: u64 = 0;
    let mut i = 0;
    while i < s.len() && s[i].is_ascii_digit() {
        if value > (1u64 << 63) / 10 {
            return None;
        }
        value = value * 10 + u64::from(s[i] - b'0');
        if value > 1u64 << 63 {
            return None;
        }
        i += 1;
    }
    Some((value, &s[i..]))
}

/// Consumes the digits after a decimal point, keeping as many as fit (like Go's
/// `leadingFraction`): returns the digits as an integer and the power of ten they scale by.
fn leading_fraction(s: &[u8]) -> (u64, f64, &[u8]) {
    let mut value: u64 = 0;
    let mut scale = 1f64;
    let mut overflow = false;
    let mut i = 0;
    while i < s.len() && s[i].is_ascii_digit() {
        if !overflow {
            if value > (i64::MAX as u64) / 10 {
                overflow = true;
            } else {
                let next = value * 10 + u64::from(s[i] - b'0');
                if next > 1u64 << 63 {
                    overflow = true;
                } else {
                    value = next;
                    scale *= 10.0;
                }
            }
        }
        i += 1;
    }
    (value, scale, &s[i..])
}

/// Appends `.ddd` for `frac` (which has `prec` decimal digits), dropping trailing zeros and
/// the point itself when nothing remains — Go's `fmtFrac`.
fn push_fraction(out: &mut String, frac: u64, prec: u32) {
    if frac == 0 {
        return;
    }
    let digits = format!("{frac:0width$}", width = prec as usize);
    out.push('.');
    out.push_str(digits.trim_end_matches('0'));
}

impl fmt::Display for GoDuration {
    /// Formats exactly like Go's `time.Duration.String()`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let magnitude = self.0.unsigned_abs();
        if magnitude == 0 {
            return f.write_str("0s");
        }
        let mut out = String::with_capacity(24);
        if self.0 < 0 {
            out.push('-');
        }
        if magnitude < NANOS_PER_SECOND as u64 {
            let (prec, unit) = match magnitude {
                0..1_000 => (0, "ns"),
                1_000..1_000_000 => (3, "µs"),
                _ => (6, "ms"),
            };
            let div = 10u64.pow(prec);
            out.push_str(&(magnitude / div).to_string());
            push_fraction(&mut out, magnitude % div, prec);
            out.push_str(unit);
        } else {
            let secs = magnitude / NANOS_PER_SECOND as u64;
            let minutes = secs / 60;
            let hours = minutes / 60;
            if hours > 0 {
                out.push_str(&format!("{hours}h"));
            }
            if minutes > 0 {
                out.push_str(&format!("{}m", minutes % 60));
            }
            out.push_str(&(secs % 60).to_string());
            push_fraction(&mut out, magnitude % NANOS_PER_SECOND as u64, 9);
            out.push('s');
        }
        f.write_str(&out)
    }
}

impl Serialize for GoDuration {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for GoDuration {
    /// Only strings are accepted, as with `metav1.Duration` (a bare number is an error).
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = GoDuration;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a duration string such as \"30s\" or \"1m30s\"")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<GoDuration, E> {
                GoDuration::parse(v).map_err(E::custom)
            }
        }
        deserializer.deserialize_str(Visitor)
    }
}

// ---------------------------------------------------------------------------------------------
// Serde helpers for Go-shaped values
// ---------------------------------------------------------------------------------------------

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

// ---------------------------------------------------------------------------------------------
// The file format
// ---------------------------------------------------------------------------------------------

/// `clientConnection` (component-base `ClientConnectionConfiguration`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase", default)]
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
#[serde(deny_unknown_fields, rename_all = "camelCase", default)]
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
#[serde(deny_unknown_fields, rename_all = "camelCase", default)]
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
#[serde(deny_unknown_fields, rename_all = "camelCase", default)]
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
#[serde(deny_unknown_fields, rename_all = "camelCase", default)]
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
#[serde(deny_unknown_fields, rename_all = "camelCase", default)]
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
#[serde(deny_unknown_fields, rename_all = "camelCase", default)]
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
#[serde(deny_unknown_fields, rename_all = "camelCase", default)]
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
#[serde(deny_unknown_fields, rename_all = "camelCase", default)]
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
#[serde(deny_unknown_fields, rename_all = "camelCase", default)]
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
#[serde(deny_unknown_fields, rename_all = "camelCase", default)]
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
#[serde(deny_unknown_fields, rename_all = "camelCase", default)]
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

/// Only `apiVersion` and `kind`, read leniently before the strict decode so that a file of
/// another type is reported as such rather than as a pile of unknown fields.
#[derive(Deserialize)]
struct TypeProbe {
    #[serde(rename = "apiVersion")]
    api_version: Option<serde_yaml::Value>,
    kind: Option<serde_yaml::Value>,
}

fn probe_text(value: Option<serde_yaml::Value>) -> String {
    match value {
        Some(serde_yaml::Value::String(s)) => s,
        Some(serde_yaml::Value::Null) | None => String::new(),
        Some(other) => serde_yaml::to_string(&other).unwrap_or_default().trim().to_string(),
    }
}

/// Reads and strictly decodes a config file. Defaults are not applied.
pub fn load_config_file(path: impl AsRef<Path>) -> Result<KubeProxyConfiguration, ConfigError> {
    let path = path.as_ref();
    let text =
        std::fs::read_to_string(path).map_err(|source| ConfigError::Read { path: path.to_path_buf(), source })?;
    parse_config(&text, path)
}

/// Decodes config text; `path` is only used in error messages.
pub fn parse_config(text: &str, path: &Path) -> Result<KubeProxyConfiguration, ConfigError> {
    let decode_error = |err: serde_yaml::Error| {
        let location = err.location().map(|l| (l.line(), l.column()));
        let mut message = err.to_string();
        if let Some((line, column)) = location {
            let suffix = format!(" at line {line} column {column}");
            if let Some(stripped) = message.strip_suffix(&suffix) {
                message = stripped.to_string();
            }
        }
        ConfigError::Decode { path: path.to_path_buf(), location, message }
    };

    let is_blank = text.lines().all(|l| l.trim().is_empty() || l.trim_start().starts_with('#') || l.trim() == "---");
    if is_blank {
        return Err(ConfigError::Empty { path: path.to_path_buf() });
    }
    let probe: TypeProbe = serde_yaml::from_str(text).map_err(decode_error)?;
    let api_version = probe_text(probe.api_version);
    if api_version != API_VERSION {
        return Err(ConfigError::ApiVersion { path: path.to_path_buf(), found: api_version });
    }
    let kind = probe_text(probe.kind);
    if kind != KIND {
        return Err(ConfigError::Kind { path: path.to_path_buf(), found: kind });
    }
    serde_yaml::from_str(text).map_err(decode_error)
}

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

    /// The complete configuration as YAML with keys sorted (as Go's encoder writes them).
    /// [`parse_config`] reads it back to an equal value.
    pub fn to_yaml(&self) -> String {
        match serde_yaml::to_value(self) {
            Ok(value) => serde_yaml::to_string(&sort_mappings(value)).unwrap_or_default(),
            // Serializing these plain data types cannot fail; stay total anyway.
            Err(_) => String::new(),
        }
    }

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
    fn validated_features(&self) -> Result<Features, Vec<FieldError>> {
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
            "ipvs" | "nftables" | "kernelspace" => errs.push(FieldError::invalid_str(
                "mode",
                &self.mode,
                "this implementation provides only the iptables proxy mode; must be \"iptables\" or blank",
            )),
            _ => errs.push(FieldError::invalid_str(
                "mode",
                &self.mode,
                "must be iptables or blank (blank means the best-available proxy [currently iptables])",
            )),
        }
    }

    fn validate_iptables(&self, errs: &mut Vec<FieldError>) {
        let ipt = &self.iptables;
        if let Some(bit) = ipt.masquerade_bit
            && !(0..=31).contains(&bit)
        {
            errs.push(FieldError::invalid("iptables.masqueradeBit", bit, "must be within the range [0, 31]"));
        }
        if ipt.sync_period.0 <= 0 {
            errs.push(duration_error("iptables.syncPeriod", ipt.sync_period, "must be greater than 0"));
        }
        if ipt.min_sync_period.0 < 0 {
            errs.push(duration_error(
                "iptables.minSyncPeriod",
                ipt.min_sync_period,
                "must be greater than or equal to 0",
            ));
        }
        if ipt.min_sync_period > ipt.sync_period {
            // Upstream reports this on syncPeriod, showing the minSyncPeriod value.
            errs.push(duration_error(
                "iptables.syncPeriod",
                ipt.min_sync_period,
                "must be greater than or equal to iptables.minSyncPeriod",
            ));
        }
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
fn parse_host_port(input: &str) -> Option<SocketAddr> {
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
fn parse_port_range(value: &str) -> Result<Option<(u16, u16)>, String> {
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

/// The keyword accepted in `nodePortAddresses` besides CIDRs.
pub(crate) const NODE_PORT_ADDRESSES_PRIMARY: &str = "primary";

fn validate_node_port_addresses(addresses: &[String], release: Release, errs: &mut Vec<FieldError>) {
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

// ---------------------------------------------------------------------------------------------
// Settings: the validated, parsed view
// ---------------------------------------------------------------------------------------------

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
    /// The fwmark bit used for SNAT.
    pub masquerade_bit: u32,
    /// `1 << masquerade_bit` as Go's `fmt.Sprintf("%#08x", ...)` writes it: eight zero-padded
    /// hex digits after `0x` (bit 14 → `0x00004000`).
    pub masquerade_mark: String,
    pub masquerade_all: bool,
    pub localhost_nodeports: bool,
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
        let masquerade_bit = cfg.iptables.masquerade_bit.unwrap_or(DEFAULT_MASQUERADE_BIT).clamp(0, 31) as u32;
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
            masquerade_bit,
            masquerade_mark: masquerade_mark(masquerade_bit),
            masquerade_all: cfg.iptables.masquerade_all,
            localhost_nodeports: cfg.iptables.localhost_node_ports.unwrap_or(true),
            sync_period: std_duration(cfg.iptables.sync_period),
            min_sync_period: std_duration(cfg.iptables.min_sync_period),
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
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<KubeProxyConfiguration, ConfigError> {
        parse_config(text, Path::new("test.yaml"))
    }

    const HEADER: &str = "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n";

    fn defaulted() -> KubeProxyConfiguration {
        KubeProxyConfiguration::default().with_defaults()
    }

    /// Validates and returns the field paths of the errors.
    fn error_fields(cfg: &KubeProxyConfiguration) -> Vec<String> {
        match cfg.validate() {
            Ok(()) => Vec::new(),
            Err(errs) => errs.into_iter().map(|e| e.field).collect(),
        }
    }

    #[test]
    fn duration_parse_accepts_go_syntax() {
        let cases: &[(&str, i64)] = &[
            ("0", 0),
            ("-0", 0),
            ("30s", 30_000_000_000),
            ("1m0s", 60_000_000_000),
            ("1h2m3.5s", 3_723_500_000_000),
            ("1.5ms", 1_500_000),
            ("100ns", 100),
            ("1us", 1_000),
            ("1µs", 1_000),
            ("1μs", 1_000),
            ("-2h", -7_200_000_000_000),
            ("+5s", 5_000_000_000),
            ("5.s", 5_000_000_000),
            (".5s", 500_000_000),
            ("0.000000001s", 1),
            ("9223372036854775807ns", i64::MAX),
            ("-9223372036854775808ns", i64::MIN),
        ];
        for (text, nanos) in cases {
            assert_eq!(GoDuration::parse(text), Ok(GoDuration(*nanos)), "{text}");
        }
    }

    #[test]
    fn duration_parse_rejects_like_go() {
        assert_eq!(GoDuration::parse(""), Err(DurationError::Invalid(String::new())));
        assert_eq!(GoDuration::parse("1"), Err(DurationError::MissingUnit("1".into())));
        assert!(matches!(GoDuration::parse("1x"), Err(DurationError::UnknownUnit { .. })));
        for bad in [".s", "s", "-", "1s2", "9223372036854775808ns", "1.2.3s", "3000000h"] {
            assert!(GoDuration::parse(bad).is_err(), "{bad} should be rejected");
        }
        assert_eq!(GoDuration::parse("5 s").unwrap_err().to_string(), "time: unknown unit \" s\" in duration \"5 s\"");
    }

    #[test]
    fn duration_formats_like_go() {
        let cases: &[(i64, &str)] = &[
            (0, "0s"),
            (1, "1ns"),
            (1_100, "1.1µs"),
            (2_200_000, "2.2ms"),
            (1_000_000_000, "1s"),
            (1_500_000_000, "1.5s"),
            (60_000_000_000, "1m0s"),
            (90_000_000_000, "1m30s"),
            (900_000_000_000, "15m0s"),
            (86_400_000_000_000, "24h0m0s"),
            (3_723_500_000_000, "1h2m3.5s"),
            (-1_000_000_000, "-1s"),
            (i64::MAX, "2562047h47m16.854775807s"),
            (i64::MIN, "-2562047h47m16.854775808s"),
        ];
        for (nanos, text) in cases {
            assert_eq!(GoDuration(*nanos).to_string(), *text);
            assert_eq!(GoDuration::parse(text), Ok(GoDuration(*nanos)), "re-parse {text}");
        }
    }

    #[test]
    fn defaults_match_upstream() {
        let cfg = defaulted();
        assert_eq!(cfg.bind_address, "0.0.0.0");
        assert_eq!(cfg.healthz_bind_address, "0.0.0.0:10256");
        assert_eq!(cfg.metrics_bind_address, "127.0.0.1:10249");
        assert_eq!(cfg.oom_score_adj, Some(-999));
        assert_eq!(cfg.iptables.masquerade_bit, Some(14));
        assert_eq!(cfg.iptables.localhost_node_ports, Some(true));
        assert_eq!(cfg.iptables.sync_period.to_string(), "30s");
        assert_eq!(cfg.iptables.min_sync_period.to_string(), "1s");
        assert_eq!(cfg.ipvs.sync_period.to_string(), "30s");
        assert_eq!(cfg.ipvs.min_sync_period, GoDuration::ZERO);
        assert_eq!(cfg.nftables.masquerade_bit, Some(14));
        assert_eq!(cfg.conntrack.max_per_core, Some(32768));
        assert_eq!(cfg.conntrack.min, Some(131072));
        assert_eq!(cfg.conntrack.tcp_established_timeout.unwrap().to_string(), "24h0m0s");
        assert_eq!(cfg.conntrack.tcp_close_wait_timeout.unwrap().to_string(), "1h0m0s");
        assert_eq!(cfg.conntrack.udp_timeout, GoDuration::ZERO);
        assert_eq!(cfg.config_sync_period.to_string(), "15m0s");
        assert_eq!(cfg.client_connection.content_type, "application/vnd.kubernetes.protobuf");
        assert_eq!(cfg.client_connection.qps, 5.0);
        assert_eq!(cfg.client_connection.burst, 10);
        assert_eq!(cfg.logging.format, "text");
        assert_eq!(cfg.logging.flush_frequency.duration.to_string(), "5s");
        assert_eq!(cfg.mode, "");
        assert_eq!(cfg.detect_local_mode, "");
        assert_eq!(cfg.clone().with_defaults(), cfg, "defaulting is idempotent");
        assert_eq!(cfg.validate(), Ok(()));
    }

    #[test]
    fn defaults_follow_bind_address_family() {
        let cfg = KubeProxyConfiguration { bind_address: "fd00::1".into(), ..Default::default() };
        let cfg = cfg.with_defaults();
        assert_eq!(cfg.healthz_bind_address, "[::]:10256");
        assert_eq!(cfg.metrics_bind_address, "[::1]:10249");

        let cfg = KubeProxyConfiguration {
            healthz_bind_address: "10.0.0.1".into(),
            metrics_bind_address: "::1".into(),
            ..Default::default()
        };
        let cfg = cfg.with_defaults();
        assert_eq!(cfg.healthz_bind_address, "10.0.0.1:10256");
        assert_eq!(cfg.metrics_bind_address, "[::1]:10249");
    }

    #[test]
    fn minimal_file_loads_and_defaults() {
        let cfg = parse(HEADER).unwrap();
        assert_eq!(cfg, KubeProxyConfiguration::default());
        let text = format!(
            "{HEADER}mode: iptables\nclusterCIDR: 10.244.0.0/16\niptables:\n  masqueradeBit: null\n  syncPeriod: 10s\nhostnameOverride: null\n"
        );
        let cfg = parse(&text).unwrap().with_defaults();
        assert_eq!(cfg.iptables.masquerade_bit, Some(14));
        assert_eq!(cfg.iptables.sync_period.to_string(), "10s");
        assert_eq!(cfg.hostname_override, "");
    }

    #[test]
    fn kubeadm_style_file_with_nulls_loads() {
        let text = r#"apiVersion: kubeproxy.config.k8s.io/v1alpha1
bindAddress: 0.0.0.0
bindAddressHardFail: false
clientConnection:
  acceptContentTypes: ""
  burst: 0
  contentType: ""
  kubeconfig: /var/lib/kube-proxy/kubeconfig.conf
  qps: 0
clusterCIDR: 10.244.0.0/16
configSyncPeriod: 0s
conntrack:
  maxPerCore: null
  min: null
  tcpBeLiberal: false
  tcpCloseWaitTimeout: null
  tcpEstablishedTimeout: null
  udpStreamTimeout: 0s
  udpTimeout: 0s
detectLocal:
  bridgeInterface: ""
  interfaceNamePrefix: ""
detectLocalMode: ""
enableProfiling: false
healthzBindAddress: ""
hostnameOverride: ""
iptables:
  localhostNodePorts: null
  masqueradeAll: false
  masqueradeBit: null
  minSyncPeriod: 0s
  syncPeriod: 0s
ipvs:
  excludeCIDRs: null
  minSyncPeriod: 0s
  scheduler: ""
  strictARP: false
  syncPeriod: 0s
  tcpFinTimeout: 0s
  tcpTimeout: 0s
  udpTimeout: 0s
kind: KubeProxyConfiguration
logging:
  flushFrequency: 0
  options:
    json:
      infoBufferSize: "0"
    text:
      infoBufferSize: "0"
  verbosity: 0
metricsBindAddress: ""
mode: ""
nftables:
  masqueradeAll: false
  masqueradeBit: null
  minSyncPeriod: 0s
  syncPeriod: 0s
nodePortAddresses: null
oomScoreAdj: null
portRange: ""
showHiddenMetricsForVersion: ""
winkernel:
  enableDSR: false
  forwardHealthCheckVip: false
  networkName: ""
  rootHnsEndpointName: ""
  sourceVip: ""
"#;
        let cfg = parse(text).unwrap().with_defaults();
        assert_eq!(cfg.validate(), Ok(()));
        let settings = Settings::from_config(&cfg).unwrap();
        assert_eq!(settings.client.kubeconfig, Some(PathBuf::from("/var/lib/kube-proxy/kubeconfig.conf")));
        assert_eq!(settings.cluster_cidrs, vec![Cidr::parse_sloppy("10.244.0.0/16").unwrap()]);
    }

    #[test]
    fn to_yaml_round_trips() {
        let cfg = defaulted();
        let yaml = cfg.to_yaml();
        assert!(yaml.starts_with("apiVersion: kubeproxy.config.k8s.io/v1alpha1\n"), "{yaml}");
        for needle in [
            "masqueradeBit: 14",
            "syncPeriod: 30s",
            "minSyncPeriod: 1s",
            "tcpEstablishedTimeout: 24h0m0s",
            "configSyncPeriod: 15m0s",
            "qps: 5\n",
            "oomScoreAdj: -999",
            "nodePortAddresses: null",
            "kind: KubeProxyConfiguration",
        ] {
            assert!(yaml.contains(needle), "missing {needle:?} in\n{yaml}");
        }
        assert_eq!(parse(&yaml).unwrap(), cfg);

        let mut custom = defaulted();
        custom.feature_gates.insert("SomeGate".into(), true);
        custom.node_port_addresses = Some(vec!["10.0.0.0/8".into(), "fd00::/64".into()]);
        custom.client_connection.qps = 0.5;
        custom.logging.flush_frequency = FlushFrequency { duration: GoDuration(2_000_000_000), as_string: false };
        custom.logging.vmodule = Some(vec![VModuleItem { file_pattern: "proxier*".into(), verbosity: 4 }]);
        custom.hostname_override = "null".into();
        custom.port_range = "30000-32767".into();
        custom.iptables.min_sync_period = GoDuration(1_500_000);
        let yaml = custom.to_yaml();
        assert!(yaml.contains("qps: 0.5"), "{yaml}");
        assert!(yaml.contains("flushFrequency: 2000000000"), "{yaml}");
        assert_eq!(parse(&yaml).unwrap(), custom, "{yaml}");
    }

    #[test]
    fn unknown_field_is_rejected_with_path_and_line() {
        let text = format!("{HEADER}iptables:\n  masqueradeBits: 3\n");
        let err = parse(&text).unwrap_err();
        let ConfigError::Decode { location, message, .. } = &err else { panic!("{err}") };
        assert_eq!(location.map(|l| l.0), Some(4));
        assert!(message.starts_with("iptables: unknown field `masqueradeBits`"), "{message}");
        assert!(err.to_string().starts_with("test.yaml:4:"), "{err}");

        let err = parse(&format!("{HEADER}bogus: 1\n")).unwrap_err();
        assert!(err.to_string().contains("unknown field `bogus`"), "{err}");
    }

    #[test]
    fn wrong_types_name_the_field() {
        let err = parse(&format!("{HEADER}iptables:\n  masqueradeBit: x\n")).unwrap_err();
        assert!(err.to_string().contains("iptables.masqueradeBit: invalid type"), "{err}");
        // Durations must be strings, as with metav1.Duration.
        let err = parse(&format!("{HEADER}configSyncPeriod: 30\n")).unwrap_err();
        assert!(err.to_string().contains("configSyncPeriod"), "{err}");
        let err = parse(&format!("{HEADER}iptables:\n  syncPeriod: 3 seconds\n")).unwrap_err();
        assert!(err.to_string().contains("iptables.syncPeriod: time: unknown unit"), "{err}");
        let err = parse(&format!("{HEADER}iptables: [\n")).unwrap_err();
        assert!(matches!(err, ConfigError::Decode { location: Some(_), .. }), "{err}");
    }

    #[test]
    fn wrong_type_meta_is_rejected() {
        let err = parse("apiVersion: v1\nkind: KubeProxyConfiguration\n").unwrap_err();
        assert!(matches!(err, ConfigError::ApiVersion { ref found, .. } if found == "v1"), "{err}");
        let err = parse("apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeletConfiguration\n").unwrap_err();
        assert!(matches!(err, ConfigError::Kind { ref found, .. } if found == "KubeletConfiguration"));
        let err = parse("kind: KubeProxyConfiguration\n").unwrap_err();
        assert!(matches!(err, ConfigError::ApiVersion { ref found, .. } if found.is_empty()));
        let err = parse("apiVersion: kubeproxy.config.k8s.io/v1alpha1\n").unwrap_err();
        assert!(matches!(err, ConfigError::Kind { .. }));
        assert!(matches!(parse("# nothing\n\n").unwrap_err(), ConfigError::Empty { .. }));
        assert!(matches!(parse("- a\n- b\n").unwrap_err(), ConfigError::Decode { .. }));
    }

    #[test]
    fn load_config_file_names_the_file() {
        let err = load_config_file("/nonexistent/kube-proxy-rs/config.yaml").unwrap_err();
        assert!(matches!(err, ConfigError::Read { .. }));
        assert!(err.to_string().starts_with("/nonexistent/kube-proxy-rs/config.yaml: cannot read"), "{err}");

        let path = std::env::temp_dir().join(format!("kube-proxy-rs-config-{}.yaml", std::process::id()));
        std::fs::write(&path, format!("{HEADER}mode: iptables\n")).unwrap();
        let cfg = load_config_file(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        assert_eq!(cfg.mode, "iptables");
    }

    #[test]
    fn validation_names_each_field() {
        type Mutate = fn(&mut KubeProxyConfiguration);
        let cases: Vec<(Mutate, &[&str])> = vec![
            (|c| c.iptables.masquerade_bit = Some(32), &["iptables.masqueradeBit"]),
            (|c| c.iptables.masquerade_bit = Some(-1), &["iptables.masqueradeBit"]),
            (|c| c.iptables.sync_period = GoDuration::ZERO, &["iptables.syncPeriod", "iptables.syncPeriod"]),
            (|c| c.iptables.min_sync_period = GoDuration(-1), &["iptables.minSyncPeriod"]),
            (|c| c.iptables.min_sync_period = GoDuration::from_secs(60), &["iptables.syncPeriod"]),
            (|c| c.cluster_cidr = "10.0.0.0".into(), &["clusterCIDR"]),
            (|c| c.cluster_cidr = "10.0.0.0/8,10.1.0.0/16".into(), &["clusterCIDR"]),
            (|c| c.cluster_cidr = "10.0.0.0/8,fd00::/48,10.1.0.0/16".into(), &["clusterCIDR"]),
            (|c| c.cluster_cidr = "10.0.0.0/8, fd00::/48".into(), &["clusterCIDR"]),
            (|c| c.node_port_addresses = Some(vec!["10.0.0.0/8".into(), "x".into()]), &["nodePortAddresses[1]"]),
            (|c| c.node_port_addresses = Some(vec!["10.0.0.0/8".into(), "primary".into()]), &["nodePortAddresses[1]"]),
            (|c| c.bind_address = "10.0.0.1:80".into(), &["bindAddress"]),
            (|c| c.healthz_bind_address = "0.0.0.0".into(), &["healthzBindAddress"]),
            (|c| c.metrics_bind_address = "localhost:10249".into(), &["metricsBindAddress"]),
            (|c| c.metrics_bind_address = "127.0.0.1:0".into(), &["metricsBindAddress"]),
            (|c| c.detect_local_mode = "Guess".into(), &["detectLocalMode"]),
            (|c| c.detect_local_mode = "BridgeInterface".into(), &["detectLocal.bridgeInterface"]),
            (|c| c.detect_local_mode = "InterfaceNamePrefix".into(), &["detectLocal.interfaceNamePrefix"]),
            (|c| c.mode = "ipvs".into(), &["mode"]),
            (|c| c.mode = "userspace".into(), &["mode"]),
            (|c| c.oom_score_adj = Some(1001), &["oomScoreAdj"]),
            (|c| c.conntrack.max_per_core = Some(-1), &["conntrack.maxPerCore"]),
            (|c| c.conntrack.min = Some(-1), &["conntrack.min"]),
            (|c| c.conntrack.tcp_established_timeout = Some(GoDuration(-1)), &["conntrack.tcpEstablishedTimeout"]),
            (|c| c.conntrack.tcp_close_wait_timeout = Some(GoDuration(-1)), &["conntrack.tcpCloseWaitTimeout"]),
            (|c| c.conntrack.udp_timeout = GoDuration(-1), &["conntrack.udpTimeout"]),
            (|c| c.conntrack.udp_stream_timeout = GoDuration(-1), &["conntrack.udpStreamTimeout"]),
            (|c| c.client_connection.burst = -1, &["clientConnection.burst"]),
            (|c| c.config_sync_period = GoDuration(-1), &["configSyncPeriod"]),
            (|c| c.port_range = "2000-1000".into(), &["portRange"]),
            (|c| c.port_range = "a-b".into(), &["portRange"]),
            (|c| c.show_hidden_metrics_for_version = "1.20".into(), &["showHiddenMetricsForVersion"]),
            (|c| c.show_hidden_metrics_for_version = "1.28".into(), &["showHiddenMetricsForVersion"]),
            (|c| c.compatibility_version = "1.28".into(), &["compatibilityVersion"]),
            (|c| c.compatibility_version = "latest".into(), &["compatibilityVersion"]),
            (
                |c| {
                    c.compatibility_version = "1.32".into();
                    c.feature_gates.insert("LoadBalancerIPMode".into(), false);
                },
                &["featureGates"],
            ),
            (
                |c| {
                    c.compatibility_version = "1.30".into();
                    c.node_port_addresses = Some(vec!["primary".into()]);
                },
                &["nodePortAddresses[0]"],
            ),
            (|c| c.logging.format = "xml".into(), &["logging.format"]),
            (|c| c.hostname_override = "  ".into(), &["hostnameOverride"]),
        ];
        for (i, (mutate, expected)) in cases.into_iter().enumerate() {
            let mut cfg = defaulted();
            mutate(&mut cfg);
            assert_eq!(error_fields(&cfg), expected.to_vec(), "case {i}");
        }
    }

    #[test]
    fn validation_accepts_valid_variants() {
        type Mutate = fn(&mut KubeProxyConfiguration);
        let cases: Vec<Mutate> = vec![
            |c| c.mode = "iptables".into(),
            |c| c.cluster_cidr = "10.0.0.0/8,fd00::/48".into(),
            |c| c.cluster_cidr = "fd00::/48".into(),
            |c| c.node_port_addresses = Some(vec!["primary".into()]),
            |c| c.node_port_addresses = Some(vec!["127.0.0.0/8".into(), "::1/128".into()]),
            |c| c.healthz_bind_address = String::new(),
            |c| c.metrics_bind_address = "[::]:10249".into(),
            |c| c.bind_address = "010.000.000.001".into(),
            |c| c.iptables.min_sync_period = GoDuration::from_secs(30),
            |c| c.detect_local_mode = "NodeCIDR".into(),
            |c| {
                c.detect_local_mode = "BridgeInterface".into();
                c.detect_local.bridge_interface = "cbr0".into();
            },
            |c| c.port_range = "30000+100".into(),
            |c| c.show_hidden_metrics_for_version = "1.34".into(),
            |c| {
                c.compatibility_version = "1.29".into();
                c.show_hidden_metrics_for_version = "1.28".into();
            },
            |c| c.compatibility_version = "v1.31.2".into(),
            |c| c.node_port_addresses = Some(vec!["primary".into()]),
            |c| c.logging.format = "json".into(),
        ];
        for (i, mutate) in cases.into_iter().enumerate() {
            let mut cfg = defaulted();
            mutate(&mut cfg);
            assert_eq!(cfg.validate(), Ok(()), "case {i}");
        }
    }

    #[test]
    fn field_errors_render_like_kubernetes() {
        let mut cfg = defaulted();
        cfg.iptables.masquerade_bit = Some(40);
        cfg.detect_local_mode = "Guess".into();
        let errs = cfg.validate().unwrap_err();
        assert_eq!(errs[0].to_string(), "iptables.masqueradeBit: Invalid value: 40: must be within the range [0, 31]");
        assert_eq!(errs[0].value, "40");
        assert_eq!(
            errs[1].to_string(),
            "detectLocalMode: Unsupported value: \"Guess\": supported values: \"ClusterCIDR\", \
             \"NodeCIDR\", \"BridgeInterface\", \"InterfaceNamePrefix\", \"\""
        );
        cfg = defaulted();
        cfg.mode = "nftables".into();
        let errs = cfg.validate().unwrap_err();
        assert!(errs[0].to_string().contains("only the iptables proxy mode"), "{}", errs[0]);
    }

    #[test]
    fn masquerade_mark_formats_like_go_percent_hash_08x() {
        // Go pads the digits to eight and then prepends 0x (kube-proxy writes 0x00004000).
        assert_eq!(masquerade_mark(0), "0x00000001");
        assert_eq!(masquerade_mark(14), "0x00004000");
        assert_eq!(masquerade_mark(31), "0x80000000");
    }

    #[test]
    fn settings_from_config() {
        let mut cfg = KubeProxyConfiguration {
            hostname_override: "  Node-A ".into(),
            cluster_cidr: "10.244.0.0/16,fd00:10:244::/56".into(),
            ..Default::default()
        };
        cfg.iptables.masquerade_bit = Some(31);
        cfg.iptables.localhost_node_ports = Some(false);
        let s = Settings::from_config(&cfg).unwrap();
        assert_eq!(s.hostname_override.as_deref(), Some("node-a"));
        assert_eq!(s.masquerade_mark, "0x80000000");
        assert_eq!(s.masquerade_bit, 31);
        assert!(!s.localhost_nodeports);
        assert_eq!(s.sync_period, Duration::from_secs(30));
        assert_eq!(s.min_sync_period, Duration::from_secs(1));
        assert_eq!(s.config_sync_period, Duration::from_secs(900));
        assert_eq!(s.bind_address, IpAddr::from([0, 0, 0, 0]));
        assert_eq!(s.healthz_bind_address, Some("0.0.0.0:10256".parse().unwrap()));
        assert_eq!(s.metrics_bind_address, Some("127.0.0.1:10249".parse().unwrap()));
        assert_eq!(s.cluster_cidrs.len(), 2);
        assert_eq!(s.detect_local, DetectLocal::ClusterCidr(s.cluster_cidrs.clone()));
        assert_eq!(s.conntrack.max_per_core, 32768);
        assert_eq!(s.conntrack.tcp_established_timeout, Duration::from_secs(86400));
        assert_eq!(s.oom_score_adj, -999);
        assert_eq!(s.client.kubeconfig, None);

        cfg.detect_local_mode = "InterfaceNamePrefix".into();
        cfg.detect_local.interface_name_prefix = "veth".into();
        let s = Settings::from_config(&cfg).unwrap();
        assert_eq!(s.detect_local, DetectLocal::InterfaceNamePrefix("veth".into()));

        cfg.iptables.masquerade_bit = Some(99);
        let errs = Settings::from_config(&cfg).unwrap_err();
        assert_eq!(errs[0].field, "iptables.masqueradeBit");
    }

    #[test]
    fn files_written_by_newer_releases_load() {
        // 1.31 added windowsRunAsService (omitempty); our extension field rides along.
        let text = "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n\
                    windowsRunAsService: true\ncompatibilityVersion: \"1.31\"\n";
        let cfg = parse_config(text, Path::new("c.yaml")).expect("loads");
        assert!(cfg.windows_run_as_service);
        let settings = Settings::from_config(&cfg).expect("valid");
        assert_eq!(settings.features.release, crate::compat::Release::V1_31);
        // Neither is written back when unset, so our files stay readable by upstream.
        let written = serde_yaml::to_string(&KubeProxyConfiguration::default().with_defaults()).expect("yaml");
        assert!(!written.contains("windowsRunAsService") && !written.contains("compatibilityVersion"), "{written}");
    }
}
