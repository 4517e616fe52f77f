//! The daemon's effective configuration: upstream kube-proxy's (v1.29) precedence between the
//! `--config` file and command-line flags, `--write-config-to`, and errors that name the flag
//! or file each bad value came from. No I/O beyond reading the config file and writing
//! `--write-config-to`; never starts anything.
//!
//! Precedence, as upstream's `Options.Complete` (cmd/kube-proxy/app/server.go) has it:
//!
//! 1. Without `--config`: the built-in defaults, overridden by every configuration flag given.
//!    Then, unless `--write-config-to` is given, the deprecated `--healthz-port` and
//!    `--metrics-port` (defaults 10256 and 10249) are applied to the server addresses: a port
//!    of 0 disables the server, otherwise it is appended to a bare IP.
//! 2. With `--config`: the file (defaulted) replaces the whole configuration, and every
//!    configuration flag is ignored, even ones given explicitly (`--kubeconfig`,
//!    `--proxy-mode`, `--cluster-cidr`...) — except the logging flags (`-v`, `--vmodule`,
//!    `--logging-format`, `--log-flush-frequency`), which override the file's `logging` when
//!    given (`--vmodule` entries go before the file's, so they win). `--healthz-port` and
//!    `--metrics-port` are ignored.
//! 3. Either way, an empty `mode` becomes `iptables` and an empty `detectLocalMode` becomes
//!    `ClusterCIDR` (upstream's `platformApplyDefaults`).
//! 4. Either way, a non-empty `--hostname-override` replaces `hostnameOverride`, trimmed and
//!    lower-cased; one of only whitespace is an error.
//! 5. The result is validated; every invalid field is reported, one line each.
//!
//! `--master`, `--cleanup`, `--init-only`, `--write-config-to` and `--config` are not part of
//! the configuration and always apply. `--write-config-to` writes the result of all of the
//! above (so `--config A --write-config-to B` writes A's content, defaulted).

use std::collections::BTreeSet;
use std::fmt;
use std::path::{Path, PathBuf};

use crate::cmd::cli::DaemonArgs;
use crate::config::{self, ConfigError, FieldError, FieldErrorKind, KubeProxyConfiguration, append_port_if_needed};

/// Upstream `ports.ProxyHealthzPort`, the default of `--healthz-port`.
const DEFAULT_HEALTHZ_PORT: i32 = 10256;
/// Upstream `ports.ProxyStatusPort`, the default of `--metrics-port`.
const DEFAULT_METRICS_PORT: i32 = 10249;

/// Why the command line could not be turned into a valid configuration.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// The `--config` file is unreadable, not YAML, of another type, or has unknown fields or
    /// values of the wrong type (the message names the file, line and field).
    #[error("--config {0}")]
    ConfigFile(#[from] ConfigError),
    /// `--hostname-override` was only whitespace.
    #[error("--hostname-override: empty hostname-override is invalid")]
    EmptyHostnameOverride,
    /// A deprecated port flag out of range.
    #[error("--{flag}: invalid port {value}: must be within the range [0, 65535]")]
    Port { flag: &'static str, value: i32 },
    /// Fields that failed validation; [`fmt::Display`] writes one line per field.
    #[error("{}", InvalidFields(.0))]
    Invalid(Vec<LocatedFieldError>),
    /// `--write-config-to` could not be written.
    #[error("--write-config-to {}: failed to write the configuration: {source}", .path.display())]
    WriteConfig {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Where an invalid value came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ValueOrigin {
    /// The command-line flag of this name (without dashes).
    Flag(&'static str),
    /// The `--config` file.
    File(PathBuf),
    /// Neither: a built-in default (or a combination of fields).
    Default,
}

/// A validation error and the origin of the value it is about.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocatedFieldError {
    pub error: FieldError,
    pub origin: ValueOrigin,
}

impl fmt::Display for LocatedFieldError {
    /// One line: `[FILE: ]invalid configuration: FIELD[ (--flag)]: Invalid value: VALUE: DETAIL`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let e = &self.error;
        let kind = match e.kind {
            FieldErrorKind::Invalid => "Invalid value",
            FieldErrorKind::NotSupported => "Unsupported value",
        };
        match &self.origin {
            ValueOrigin::Flag(flag) => {
                write!(f, "invalid configuration: {} (--{flag}): {kind}: {}: {}", e.field, e.value, e.detail)
            }
            ValueOrigin::File(path) => {
                write!(f, "{}: invalid configuration: {}: {kind}: {}: {}", path.display(), e.field, e.value, e.detail)
            }
            ValueOrigin::Default => write!(f, "invalid configuration: {}: {kind}: {}: {}", e.field, e.value, e.detail),
        }
    }
}

struct InvalidFields<'a>(&'a [LocatedFieldError]);

impl fmt::Display for InvalidFields<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str("\n")?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

/// The configuration fields each configuration flag sets (field paths as validation names
/// them; a list flag's elements are `field[i]`).
const FLAG_FIELDS: &[(&str, &str)] = &[
    ("kubeconfig", "clientConnection.kubeconfig"),
    ("kube-api-content-type", "clientConnection.contentType"),
    ("kube-api-qps", "clientConnection.qps"),
    ("kube-api-burst", "clientConnection.burst"),
    ("config-sync-period", "configSyncPeriod"),
    ("bind-address", "bindAddress"),
    ("healthz-bind-address", "healthzBindAddress"),
    ("metrics-bind-address", "metricsBindAddress"),
    ("healthz-port", "healthzBindAddress"),
    ("metrics-port", "metricsBindAddress"),
    ("bind-address-hard-fail", "bindAddressHardFail"),
    ("profiling", "enableProfiling"),
    ("show-hidden-metrics-for-version", "showHiddenMetricsForVersion"),
    ("oom-score-adj", "oomScoreAdj"),
    ("feature-gates", "featureGates"),
    ("compatibility-version", "compatibilityVersion"),
    ("proxy-mode", "mode"),
    ("cluster-cidr", "clusterCIDR"),
    ("masquerade-all", "iptables.masqueradeAll"),
    ("iptables-sync-period", "iptables.syncPeriod"),
    ("iptables-min-sync-period", "iptables.minSyncPeriod"),
    ("iptables-masquerade-bit", "iptables.masqueradeBit"),
    ("iptables-localhost-nodeports", "iptables.localhostNodePorts"),
    ("nodeport-addresses", "nodePortAddresses"),
    ("detect-local-mode", "detectLocalMode"),
    ("pod-bridge-interface", "detectLocal.bridgeInterface"),
    ("pod-interface-name-prefix", "detectLocal.interfaceNamePrefix"),
    ("proxy-port-range", "portRange"),
    ("conntrack-max-per-core", "conntrack.maxPerCore"),
    ("conntrack-min", "conntrack.min"),
    ("conntrack-tcp-timeout-established", "conntrack.tcpEstablishedTimeout"),
    ("conntrack-tcp-timeout-close-wait", "conntrack.tcpCloseWaitTimeout"),
    ("conntrack-tcp-be-liberal", "conntrack.tcpBeLiberal"),
    ("conntrack-udp-timeout", "conntrack.udpTimeout"),
    ("conntrack-udp-timeout-stream", "conntrack.udpStreamTimeout"),
    ("ipvs-sync-period", "ipvs.syncPeriod"),
    ("ipvs-min-sync-period", "ipvs.minSyncPeriod"),
    ("ipvs-scheduler", "ipvs.scheduler"),
    ("ipvs-exclude-cidrs", "ipvs.excludeCIDRs"),
    ("ipvs-strict-arp", "ipvs.strictARP"),
    ("ipvs-tcp-timeout", "ipvs.tcpTimeout"),
    ("ipvs-tcpfin-timeout", "ipvs.tcpFinTimeout"),
    ("ipvs-udp-timeout", "ipvs.udpTimeout"),
    ("v", "logging.verbosity"),
    ("vmodule", "logging.vmodule"),
    ("logging-format", "logging.format"),
    ("log-flush-frequency", "logging.flushFrequency"),
];

/// The logging flags, which override the config file.
const LOGGING_FLAGS: &[&str] = &["v", "vmodule", "logging-format", "log-flush-frequency"];

/// The configuration flags present on the command line, by name (without dashes), in
/// `FLAG_FIELDS` order. `--hostname-override` is not included (it always applies).
pub(crate) fn given_config_flags(a: &DaemonArgs) -> Vec<&'static str> {
    // The length is checked at compile time; the order by `every_flag_is_tracked`.
    let given: [bool; FLAG_FIELDS.len()] = [
        a.kubeconfig.is_some(),
        a.kube_api_content_type.is_some(),
        a.kube_api_qps.is_some(),
        a.kube_api_burst.is_some(),
        a.config_sync_period.is_some(),
        a.bind_address.is_some(),
        a.healthz_bind_address.is_some(),
        a.metrics_bind_address.is_some(),
        a.healthz_port.is_some(),
        a.metrics_port.is_some(),
        a.bind_address_hard_fail.is_some(),
        a.profiling.is_some(),
        a.show_hidden_metrics_for_version.is_some(),
        a.oom_score_adj.is_some(),
        !a.feature_gates.is_empty(),
        a.compatibility_version.is_some(),
        a.proxy_mode.is_some(),
        a.cluster_cidr.is_some(),
        a.masquerade_all.is_some(),
        a.iptables_sync_period.is_some(),
        a.iptables_min_sync_period.is_some(),
        a.iptables_masquerade_bit.is_some(),
        a.iptables_localhost_nodeports.is_some(),
        !a.nodeport_addresses.is_empty(),
        a.detect_local_mode.is_some(),
        a.pod_bridge_interface.is_some(),
        a.pod_interface_name_prefix.is_some(),
        a.proxy_port_range.is_some(),
        a.conntrack_max_per_core.is_some(),
        a.conntrack_min.is_some(),
        a.conntrack_tcp_timeout_established.is_some(),
        a.conntrack_tcp_timeout_close_wait.is_some(),
        a.conntrack_tcp_be_liberal.is_some(),
        a.conntrack_udp_timeout.is_some(),
        a.conntrack_udp_timeout_stream.is_some(),
        a.ipvs_sync_period.is_some(),
        a.ipvs_min_sync_period.is_some(),
        a.ipvs_scheduler.is_some(),
        !a.ipvs_exclude_cidrs.is_empty(),
        a.ipvs_strict_arp.is_some(),
        a.ipvs_tcp_timeout.is_some(),
        a.ipvs_tcpfin_timeout.is_some(),
        a.ipvs_udp_timeout.is_some(),
        a.verbosity.is_some(),
        !a.vmodule.is_empty(),
        a.logging_format.is_some(),
        a.log_flush_frequency.is_some(),
    ];
    FLAG_FIELDS.iter().zip(given).filter(|(_, g)| *g).map(|((flag, _), _)| *flag).collect()
}

/// The flags given on the command line that upstream ignores because `--config` is given
/// (empty without `--config`). Worth a warning: upstream drops them silently.
pub fn ignored_flags(a: &DaemonArgs) -> Vec<&'static str> {
    if a.config.is_none() {
        return Vec::new();
    }
    given_config_flags(a).into_iter().filter(|f| !LOGGING_FLAGS.contains(f)).collect()
}

/// Builds the effective configuration from the command line (reading `--config` when given)
/// with upstream's precedence, defaults and validation; see the module docs.
pub fn effective_config(args: &DaemonArgs) -> Result<KubeProxyConfiguration, CliError> {
    effective_config_reporting(args).map(|(cfg, _)| cfg)
}

/// The `--config` file was decoded leniently: strict decoding failed on unknown or duplicated
/// fields, which upstream logs and gets past (see [`config::DecodedConfig`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LenientDecoding {
    pub path: PathBuf,
    /// `strict decoding error: unknown field "foo", ...`
    pub error: String,
}

impl LenientDecoding {
    /// Logs it as upstream does (a warning naming the file and the fields).
    pub fn log(&self) {
        tracing::warn!(
            path = %self.path.display(),
            err = %self.error,
            "Using lenient decoding as strict decoding failed"
        );
    }
}

/// [`effective_config`], also saying whether the file was decoded leniently (to be logged once
/// logging is set up from the configuration).
pub fn effective_config_reporting(
    args: &DaemonArgs,
) -> Result<(KubeProxyConfiguration, Option<LenientDecoding>), CliError> {
    let Some(path) = &args.config else {
        return resolve(args, None).map(|cfg| (cfg, None));
    };
    let decoded = config::load_config_file(path)?;
    let lenient =
        decoded.is_lenient().then(|| LenientDecoding { path: path.clone(), error: decoded.strict_error_text() });
    resolve(args, Some((path.as_path(), decoded.config))).map(|cfg| (cfg, lenient))
}

/// [`effective_config`] with the config file already decoded (not yet defaulted).
pub fn resolve(
    args: &DaemonArgs,
    file: Option<(&Path, KubeProxyConfiguration)>,
) -> Result<KubeProxyConfiguration, CliError> {
    let (mut cfg, file_path, applied): (KubeProxyConfiguration, Option<PathBuf>, Vec<&'static str>) = match file {
        Some((path, decoded)) => {
            let mut cfg = decoded.with_defaults();
            apply_logging_flags(&mut cfg, args);
            let applied = given_config_flags(args).into_iter().filter(|f| LOGGING_FLAGS.contains(f)).collect();
            (cfg, Some(path.to_path_buf()), applied)
        }
        None => {
            let mut cfg = KubeProxyConfiguration::default().with_defaults();
            apply_config_flags(&mut cfg, args);
            apply_logging_flags(&mut cfg, args);
            if args.write_config_to.is_none() {
                apply_deprecated_ports(&mut cfg, args)?;
            }
            (cfg, None, given_config_flags(args))
        }
    };

    if cfg.mode.is_empty() {
        cfg.mode = "iptables".to_string();
    }
    if cfg.detect_local_mode.is_empty() {
        cfg.detect_local_mode = "ClusterCIDR".to_string();
    }
    let mut hostname_from_flag = false;
    if let Some(name) = args.hostname_override.as_deref().filter(|n| !n.is_empty()) {
        let name = name.trim();
        if name.is_empty() {
            return Err(CliError::EmptyHostnameOverride);
        }
        cfg.hostname_override = name.to_lowercase();
        hostname_from_flag = true;
    }

    cfg.validate().map_err(|errors| {
        let located = errors
            .into_iter()
            .map(|error| {
                let origin = if hostname_from_flag && error.field == "hostnameOverride" {
                    ValueOrigin::Flag("hostname-override")
                } else if let Some(flag) = flag_for_field(&error.field, &applied) {
                    ValueOrigin::Flag(flag)
                } else if let Some(path) = &file_path {
                    ValueOrigin::File(path.clone())
                } else {
                    ValueOrigin::Default
                };
                LocatedFieldError { error, origin }
            })
            .collect();
        CliError::Invalid(located)
    })?;
    Ok(cfg)
}

/// The applied flag that set `field` (or, for `list[i]`, the list), if any.
fn flag_for_field(field: &str, applied: &[&'static str]) -> Option<&'static str> {
    let base = field.split('[').next().unwrap_or(field);
    // Both deprecated port flags and the address flags feed the addresses; prefer the
    // address flag when both were given.
    FLAG_FIELDS.iter().filter(|(flag, f)| *f == base && applied.contains(flag)).map(|(flag, _)| *flag).next()
}

fn set<T: Clone>(target: &mut T, value: &Option<T>) {
    if let Some(v) = value {
        *target = v.clone();
    }
}

/// Every configuration flag given (the no-`--config` path), except logging.
fn apply_config_flags(cfg: &mut KubeProxyConfiguration, a: &DaemonArgs) {
    let cc = &mut cfg.client_connection;
    set(&mut cc.kubeconfig, &a.kubeconfig);
    set(&mut cc.content_type, &a.kube_api_content_type);
    set(&mut cc.qps, &a.kube_api_qps);
    set(&mut cc.burst, &a.kube_api_burst);
    set(&mut cfg.config_sync_period, &a.config_sync_period);

    set(&mut cfg.bind_address, &a.bind_address);
    set(&mut cfg.healthz_bind_address, &a.healthz_bind_address);
    set(&mut cfg.metrics_bind_address, &a.metrics_bind_address);
    set(&mut cfg.bind_address_hard_fail, &a.bind_address_hard_fail);
    set(&mut cfg.enable_profiling, &a.profiling);
    set(&mut cfg.show_hidden_metrics_for_version, &a.show_hidden_metrics_for_version);
    if a.oom_score_adj.is_some() {
        cfg.oom_score_adj = a.oom_score_adj;
    }
    // pflag's MapStringBool: the first occurrence replaces the default map, later ones merge.
    if !a.feature_gates.is_empty() {
        cfg.feature_gates = a.feature_gates.iter().flat_map(|g| g.0.clone()).collect();
    }
    set(&mut cfg.compatibility_version, &a.compatibility_version);

    set(&mut cfg.mode, &a.proxy_mode);
    set(&mut cfg.cluster_cidr, &a.cluster_cidr);
    let ipt = &mut cfg.iptables;
    set(&mut ipt.masquerade_all, &a.masquerade_all);
    set(&mut ipt.sync_period, &a.iptables_sync_period);
    set(&mut ipt.min_sync_period, &a.iptables_min_sync_period);
    if a.iptables_masquerade_bit.is_some() {
        ipt.masquerade_bit = a.iptables_masquerade_bit;
    }
    if a.iptables_localhost_nodeports.is_some() {
        ipt.localhost_node_ports = a.iptables_localhost_nodeports;
    }
    // pflag's StringSlice: the first occurrence replaces the default, later ones append.
    if !a.nodeport_addresses.is_empty() {
        cfg.node_port_addresses = Some(a.nodeport_addresses.iter().flat_map(|l| l.0.clone()).collect());
    }
    set(&mut cfg.detect_local_mode, &a.detect_local_mode);
    set(&mut cfg.detect_local.bridge_interface, &a.pod_bridge_interface);
    set(&mut cfg.detect_local.interface_name_prefix, &a.pod_interface_name_prefix);
    set(&mut cfg.port_range, &a.proxy_port_range);

    let ct = &mut cfg.conntrack;
    if a.conntrack_max_per_core.is_some() {
        ct.max_per_core = a.conntrack_max_per_core;
    }
    if a.conntrack_min.is_some() {
        ct.min = a.conntrack_min;
    }
    if a.conntrack_tcp_timeout_established.is_some() {
        ct.tcp_established_timeout = a.conntrack_tcp_timeout_established;
    }
    if a.conntrack_tcp_timeout_close_wait.is_some() {
        ct.tcp_close_wait_timeout = a.conntrack_tcp_timeout_close_wait;
    }
    set(&mut ct.tcp_be_liberal, &a.conntrack_tcp_be_liberal);
    set(&mut ct.udp_timeout, &a.conntrack_udp_timeout);
    set(&mut ct.udp_stream_timeout, &a.conntrack_udp_timeout_stream);

    let ipvs = &mut cfg.ipvs;
    set(&mut ipvs.sync_period, &a.ipvs_sync_period);
    set(&mut ipvs.min_sync_period, &a.ipvs_min_sync_period);
    set(&mut ipvs.scheduler, &a.ipvs_scheduler);
    if !a.ipvs_exclude_cidrs.is_empty() {
        ipvs.exclude_cidrs = Some(a.ipvs_exclude_cidrs.iter().flat_map(|l| l.0.clone()).collect());
    }
    set(&mut ipvs.strict_arp, &a.ipvs_strict_arp);
    set(&mut ipvs.tcp_timeout, &a.ipvs_tcp_timeout);
    set(&mut ipvs.tcp_fin_timeout, &a.ipvs_tcpfin_timeout);
    set(&mut ipvs.udp_timeout, &a.ipvs_udp_timeout);
}

/// The logging flags given (both paths; upstream's `copyLogsFromFlags`). `--vmodule`
/// entries are put before any already configured, so they take priority.
fn apply_logging_flags(cfg: &mut KubeProxyConfiguration, a: &DaemonArgs) {
    let log = &mut cfg.logging;
    set(&mut log.verbosity, &a.verbosity);
    set(&mut log.format, &a.logging_format);
    if let Some(d) = a.log_flush_frequency {
        log.flush_frequency.duration = d;
    }
    if !a.vmodule.is_empty() {
        let mut items: Vec<_> = a.vmodule.iter().flat_map(|v| v.0.clone()).collect();
        items.extend(log.vmodule.take().unwrap_or_default());
        log.vmodule = Some(items);
    }
}

/// `--healthz-port` / `--metrics-port` (upstream's `addressFromDeprecatedFlags`): 0 disables
/// the server, otherwise the port is appended to an address that has none.
fn apply_deprecated_ports(cfg: &mut KubeProxyConfiguration, a: &DaemonArgs) -> Result<(), CliError> {
    let healthz = a.healthz_port.unwrap_or(DEFAULT_HEALTHZ_PORT);
    let metrics = a.metrics_port.unwrap_or(DEFAULT_METRICS_PORT);
    cfg.healthz_bind_address = address_from_port(&cfg.healthz_bind_address, healthz, "healthz-port")?;
    cfg.metrics_bind_address = address_from_port(&cfg.metrics_bind_address, metrics, "metrics-port")?;
    Ok(())
}

fn address_from_port(addr: &str, port: i32, flag: &'static str) -> Result<String, CliError> {
    if port == 0 {
        return Ok(String::new());
    }
    let port = u16::try_from(port).map_err(|_| CliError::Port { flag, value: port })?;
    Ok(append_port_if_needed(addr, port))
}

/// `--write-config-to`: writes `cfg` as complete YAML. Returns the fields that will read back
/// differently through `--config`, because file defaulting replaces their zero values (for
/// example `--iptables-min-sync-period=0` reads back as 1s, an empty `--healthz-bind-address`
/// as 0.0.0.0:10256) — upstream writes the same file; the caller may warn.
pub fn write_config(cfg: &KubeProxyConfiguration, path: &Path) -> Result<Vec<String>, CliError> {
    let yaml = cfg.to_yaml();
    std::fs::write(path, &yaml).map_err(|source| CliError::WriteConfig { path: path.to_path_buf(), source })?;
    Ok(round_trip_changes(cfg, &yaml))
}

/// The field paths whose value differs after `yaml` is read back and defaulted.
fn round_trip_changes(cfg: &KubeProxyConfiguration, yaml: &str) -> Vec<String> {
    let Ok(reread) = config::parse_config(yaml, Path::new("--write-config-to")) else {
        return vec!["<whole file>".to_string()];
    };
    let reread = reread.config.with_defaults();
    if &reread == cfg {
        return Vec::new();
    }
    let (Ok(before), Ok(after)) = (serde_yaml::to_value(cfg), serde_yaml::to_value(&reread)) else {
        return vec!["<whole file>".to_string()];
    };
    let mut changed = BTreeSet::new();
    diff_values("", &before, &after, &mut changed);
    changed.into_iter().collect()
}

fn diff_values(prefix: &str, a: &serde_yaml::Value, b: &serde_yaml::Value, out: &mut BTreeSet<String>) {
    match (a, b) {
        (serde_yaml::Value::Mapping(ma), serde_yaml::Value::Mapping(mb)) => {
            let keys: BTreeSet<String> =
                ma.keys().chain(mb.keys()).filter_map(|k| k.as_str().map(str::to_string)).collect();
            for key in keys {
                let path = if prefix.is_empty() { key.clone() } else { format!("{prefix}.{key}") };
                let null = serde_yaml::Value::Null;
                let va = ma.get(key.as_str()).unwrap_or(&null);
                let vb = mb.get(key.as_str()).unwrap_or(&null);
                diff_values(&path, va, vb, out);
            }
        }
        (a, b) if a != b => {
            out.insert(prefix.to_string());
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cmd::cli::Cli;
    use crate::config::GoDuration;
    use clap::Parser;

    fn args(argv: &[&str]) -> DaemonArgs {
        let argv = std::iter::once("kube-proxy-rs").chain(argv.iter().copied());
        Cli::try_parse_from(argv).expect("flags parse").daemon
    }

    const HEADER: &str = "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n";

    fn file(text: &str) -> Option<(&'static Path, KubeProxyConfiguration)> {
        let path = Path::new("/etc/kp/config.yaml");
        Some((path, config::parse_config(&format!("{HEADER}{text}"), path).expect("config parses").config))
    }

    fn errors(result: Result<KubeProxyConfiguration, CliError>) -> Vec<LocatedFieldError> {
        match result {
            Err(CliError::Invalid(errs)) => errs,
            other => panic!("expected validation errors, got {other:?}"),
        }
    }

    #[test]
    fn no_flags_gives_defaults_with_platform_defaults() {
        let cfg = resolve(&args(&[]), None).unwrap();
        let mut expected = KubeProxyConfiguration::default().with_defaults();
        expected.mode = "iptables".into();
        expected.detect_local_mode = "ClusterCIDR".into();
        assert_eq!(cfg, expected);
    }

    #[test]
    fn flags_override_defaults_without_config() {
        let cfg = resolve(
            &args(&[
                "--proxy-mode=iptables",
                "--masquerade-all",
                "--iptables-masquerade-bit=0x0f",
                "--iptables-sync-period=10s",
                "--iptables-min-sync-period=0",
                "--iptables-localhost-nodeports=false",
                "--cluster-cidr=10.244.0.0/16,fd00:10:244::/56",
                "--nodeport-addresses=10.0.0.0/8",
                "--nodeport-addresses=192.168.0.0/16",
                "--kubeconfig=/var/lib/kube-proxy/kubeconfig.conf",
                "--kube-api-qps=20",
                "--kube-api-burst=40",
                "--kube-api-content-type=application/json",
                "--bind-address=10.0.0.5",
                "--healthz-bind-address=10.0.0.5",
                "--metrics-bind-address=0.0.0.0:9999",
                "--bind-address-hard-fail",
                "--profiling=true",
                "--show-hidden-metrics-for-version=1.36",
                "--oom-score-adj=-500",
                "--feature-gates=Foo=true,Bar=false",
                "--detect-local-mode=InterfaceNamePrefix",
                "--pod-interface-name-prefix=veth",
                "--pod-bridge-interface=cbr0",
                "--conntrack-max-per-core=0",
                "--conntrack-min=1000",
                "--conntrack-tcp-timeout-established=2h",
                "--conntrack-tcp-timeout-close-wait=30m",
                "--conntrack-tcp-be-liberal",
                "--conntrack-udp-timeout=30s",
                "--conntrack-udp-timeout-stream=2m",
                "--config-sync-period=5m",
                "--ipvs-scheduler=rr",
                "-v=3",
                "--logging-format=json",
            ]),
            None,
        )
        .unwrap();
        assert_eq!(cfg.mode, "iptables");
        assert!(cfg.iptables.masquerade_all);
        assert_eq!(cfg.iptables.masquerade_bit, Some(15));
        assert_eq!(cfg.iptables.sync_period.to_string(), "10s");
        assert_eq!(cfg.iptables.min_sync_period, GoDuration::ZERO, "flags are not re-defaulted");
        assert_eq!(cfg.iptables.localhost_node_ports, Some(false));
        assert_eq!(cfg.cluster_cidr, "10.244.0.0/16,fd00:10:244::/56");
        assert_eq!(cfg.node_port_addresses, Some(vec!["10.0.0.0/8".into(), "192.168.0.0/16".into()]));
        assert_eq!(cfg.client_connection.kubeconfig, "/var/lib/kube-proxy/kubeconfig.conf");
        assert_eq!(cfg.client_connection.qps, 20.0);
        assert_eq!(cfg.client_connection.burst, 40);
        assert_eq!(cfg.client_connection.content_type, "application/json");
        assert_eq!(cfg.bind_address, "10.0.0.5");
        assert_eq!(cfg.healthz_bind_address, "10.0.0.5:10256", "--healthz-port's default is appended");
        assert_eq!(cfg.metrics_bind_address, "0.0.0.0:9999");
        assert!(cfg.bind_address_hard_fail && cfg.enable_profiling);
        assert_eq!(cfg.show_hidden_metrics_for_version, "1.36");
        assert_eq!(cfg.oom_score_adj, Some(-500));
        assert_eq!(cfg.feature_gates.get("Foo"), Some(&true));
        assert_eq!(cfg.feature_gates.get("Bar"), Some(&false));
        assert_eq!(cfg.detect_local_mode, "InterfaceNamePrefix");
        assert_eq!(cfg.detect_local.interface_name_prefix, "veth");
        assert_eq!(cfg.detect_local.bridge_interface, "cbr0");
        assert_eq!(cfg.conntrack.max_per_core, Some(0));
        assert_eq!(cfg.conntrack.min, Some(1000));
        assert_eq!(cfg.conntrack.tcp_established_timeout, Some(GoDuration::from_secs(7200)));
        assert_eq!(cfg.conntrack.tcp_close_wait_timeout, Some(GoDuration::from_secs(1800)));
        assert!(cfg.conntrack.tcp_be_liberal);
        assert_eq!(cfg.conntrack.udp_timeout, GoDuration::from_secs(30));
        assert_eq!(cfg.conntrack.udp_stream_timeout, GoDuration::from_secs(120));
        assert_eq!(cfg.config_sync_period, GoDuration::from_secs(300));
        assert_eq!(cfg.ipvs.scheduler, "rr");
        assert_eq!(cfg.logging.verbosity, 3);
        assert_eq!(cfg.logging.format, "json");
    }

    #[test]
    fn config_file_wins_over_config_flags() {
        let a = args(&[
            "--config=/etc/kp/config.yaml",
            "--proxy-mode=ipvs",
            "--masquerade-all",
            "--cluster-cidr=not-a-cidr",
            "--kubeconfig=/flag/kubeconfig",
            "--iptables-masquerade-bit=99",
            "--healthz-port=0",
            "--metrics-bind-address=1.2.3.4:5",
        ]);
        let cfg = resolve(&a, file("clusterCIDR: 10.0.0.0/8\niptables:\n  masqueradeBit: 3\n")).unwrap();
        assert_eq!(cfg.mode, "iptables", "file's empty mode defaults; --proxy-mode ignored");
        assert!(!cfg.iptables.masquerade_all);
        assert_eq!(cfg.cluster_cidr, "10.0.0.0/8");
        assert_eq!(cfg.client_connection.kubeconfig, "", "--kubeconfig is a config flag too");
        assert_eq!(cfg.iptables.masquerade_bit, Some(3));
        assert_eq!(cfg.healthz_bind_address, "0.0.0.0:10256", "--healthz-port ignored with --config");
        assert_eq!(cfg.metrics_bind_address, "127.0.0.1:10249");
        assert_eq!(
            ignored_flags(&a),
            [
                "kubeconfig",
                "metrics-bind-address",
                "healthz-port",
                "proxy-mode",
                "cluster-cidr",
                "masquerade-all",
                "iptables-masquerade-bit"
            ]
        );
        assert!(ignored_flags(&args(&["--masquerade-all"])).is_empty(), "nothing ignored without --config");
    }

    #[test]
    fn logging_flags_and_hostname_override_win_over_config_file() {
        let a = args(&[
            "--config=/etc/kp/config.yaml",
            "-v",
            "4",
            "--vmodule=proxier*=5",
            "--logging-format=json",
            "--log-flush-frequency=1s",
            "--hostname-override=  Node-A ",
        ]);
        let text = "hostnameOverride: from-file\nlogging:\n  verbosity: 1\n  vmodule:\n  - filePattern: sync\n    verbosity: 2\n";
        let cfg = resolve(&a, file(text)).unwrap();
        assert_eq!(cfg.logging.verbosity, 4);
        assert_eq!(cfg.logging.format, "json");
        assert_eq!(cfg.logging.flush_frequency.duration, GoDuration::from_secs(1));
        let patterns: Vec<&str> =
            cfg.logging.vmodule.iter().flatten().map(|v| v.file_pattern.as_str()).collect::<Vec<_>>();
        assert_eq!(patterns, ["proxier*", "sync"], "flag entries first");
        assert_eq!(cfg.hostname_override, "node-a");
        assert!(ignored_flags(&a).is_empty());

        // Without the flags the file's values stay.
        let cfg = resolve(&args(&["--config=/etc/kp/config.yaml"]), file(text)).unwrap();
        assert_eq!(cfg.logging.verbosity, 1);
        assert_eq!(cfg.hostname_override, "from-file");
        // An empty --hostname-override does not override.
        let cfg = resolve(&args(&["--config=x", "--hostname-override="]), file(text)).unwrap();
        assert_eq!(cfg.hostname_override, "from-file");
    }

    #[test]
    fn every_flag_is_tracked() {
        // One value per configuration flag, in FLAG_FIELDS order.
        let values = [
            "/k",
            "application/json",
            "1",
            "1",
            "1m",
            "10.0.0.1",
            "10.0.0.1:1",
            "10.0.0.1:2",
            "1",
            "2",
            "true",
            "true",
            "1.36",
            "0",
            "A=true",
            "1.31",
            "iptables",
            "10.0.0.0/8",
            "true",
            "1s",
            "1s",
            "1",
            "true",
            "10.0.0.0/8",
            "ClusterCIDR",
            "br0",
            "veth",
            "1-2",
            "1",
            "1",
            "1s",
            "1s",
            "true",
            "1s",
            "1s",
            "1s",
            "1s",
            "rr",
            "10.0.0.0/8",
            "true",
            "1s",
            "1s",
            "1s",
            "1",
            "a=1",
            "text",
            "1s",
        ];
        assert_eq!(values.len(), FLAG_FIELDS.len());
        for ((flag, _), value) in FLAG_FIELDS.iter().zip(values) {
            let a = args(&[&format!("--{flag}={value}")]);
            assert_eq!(given_config_flags(&a), [*flag], "--{flag}");
        }
    }

    #[test]
    fn whitespace_hostname_override_is_an_error() {
        let err = resolve(&args(&["--hostname-override=   "]), None).unwrap_err();
        assert!(matches!(err, CliError::EmptyHostnameOverride));
        assert_eq!(err.to_string(), "--hostname-override: empty hostname-override is invalid");
    }

    #[test]
    fn file_mode_and_detect_local_mode_are_kept_when_set() {
        let cfg = resolve(&args(&["--config=x"]), file("mode: iptables\ndetectLocalMode: NodeCIDR\n")).unwrap();
        assert_eq!((cfg.mode.as_str(), cfg.detect_local_mode.as_str()), ("iptables", "NodeCIDR"));
    }

    #[test]
    fn deprecated_port_flags() {
        let cfg = resolve(&args(&["--healthz-port=0", "--metrics-port=1234", "--metrics-bind-address=10.0.0.1"]), None)
            .unwrap();
        assert_eq!(cfg.healthz_bind_address, "", "port 0 disables the health server");
        assert_eq!(cfg.metrics_bind_address, "10.0.0.1:1234");
        // An address that already has a port keeps it.
        let cfg = resolve(&args(&["--healthz-port=1"]), None).unwrap();
        assert_eq!(cfg.healthz_bind_address, "0.0.0.0:10256");
        let err = resolve(&args(&["--healthz-port=70000"]), None).unwrap_err();
        assert_eq!(err.to_string(), "--healthz-port: invalid port 70000: must be within the range [0, 65535]");
        // Upstream skips the deprecated ports with --write-config-to, so a bare IP stays bare
        // and fails validation there.
        let errs = errors(resolve(&args(&["--write-config-to=/x", "--healthz-bind-address=10.0.0.1"]), None));
        assert_eq!(errs[0].origin, ValueOrigin::Flag("healthz-bind-address"));
        assert_eq!(errs[0].error.field, "healthzBindAddress");
    }

    #[test]
    fn invalid_flags_name_flag_and_field() {
        let errs = errors(resolve(
            &args(&[
                "--iptables-masquerade-bit=40",
                "--proxy-mode=ipvs",
                "--cluster-cidr=10.0.0.0",
                "--nodeport-addresses=10.0.0.0/8,bogus",
                "--oom-score-adj=5000",
                "--logging-format=xml",
                "--detect-local-mode=Guess",
            ]),
            None,
        ));
        let lines: Vec<String> = errs.iter().map(ToString::to_string).collect();
        for (field, flag) in [
            ("mode", "proxy-mode"),
            ("iptables.masqueradeBit", "iptables-masquerade-bit"),
            ("clusterCIDR", "cluster-cidr"),
            ("nodePortAddresses[1]", "nodeport-addresses"),
            ("oomScoreAdj", "oom-score-adj"),
            ("logging.format", "logging-format"),
            ("detectLocalMode", "detect-local-mode"),
        ] {
            let needle = format!("invalid configuration: {field} (--{flag}): ");
            assert!(lines.iter().any(|l| l.starts_with(&needle)), "missing {needle:?} in {lines:#?}");
        }
        assert!(lines.iter().all(|l| !l.contains('\n')));
        let mode = lines.iter().find(|l| l.contains("(--proxy-mode)")).unwrap();
        assert!(mode.contains("the iptables and nftables proxy modes"), "{mode}");
    }

    #[test]
    fn invalid_file_fields_name_the_file() {
        let errs = errors(resolve(&args(&["--config=x"]), file("mode: ipvs\niptables:\n  syncPeriod: -1s\n")));
        let lines: Vec<String> = errs.iter().map(ToString::to_string).collect();
        assert!(
            lines
                .iter()
                .any(|l| l.starts_with("/etc/kp/config.yaml: invalid configuration: mode: Invalid value: \"ipvs\"")),
            "{lines:#?}"
        );
        assert!(lines.iter().any(|l| l.contains("iptables.syncPeriod")), "{lines:#?}");
        // A logging flag given with --config is named as the flag.
        let errs = errors(resolve(&args(&["--config=x", "--logging-format=xml"]), file("")));
        assert_eq!(errs[0].origin, ValueOrigin::Flag("logging-format"));
    }

    #[test]
    fn config_file_errors_name_the_flag_and_file() {
        let a = args(&["--config=/nonexistent/kube-proxy-rs.yaml"]);
        let err = effective_config(&a).unwrap_err().to_string();
        assert!(err.starts_with("--config /nonexistent/kube-proxy-rs.yaml: cannot read config file"), "{err}");
    }

    #[test]
    fn written_config_round_trips_and_zero_values_are_reported() {
        let dir = std::env::temp_dir().join(format!("kpr-options-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("out.yaml");
        let cfg = resolve(&args(&["--masquerade-all", "--cluster-cidr=10.0.0.0/8"]), None).unwrap();
        assert_eq!(write_config(&cfg, &path).unwrap(), Vec::<String>::new());
        let again =
            resolve(&args(&["--config=x"]), Some((&path, config::load_config_file(&path).unwrap().config))).unwrap();
        assert_eq!(again, cfg);

        let cfg =
            resolve(&args(&["--write-config-to=x", "--iptables-min-sync-period=0", "--healthz-bind-address="]), None)
                .unwrap();
        assert_eq!(write_config(&cfg, &path).unwrap(), ["healthzBindAddress", "iptables.minSyncPeriod"]);
        let err = write_config(&cfg, &dir.join("missing/dir/out.yaml")).unwrap_err().to_string();
        assert!(err.starts_with("--write-config-to "), "{err}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
