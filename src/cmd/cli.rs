//! Command-line flags (clap). Parsing only: no behaviour lives here.
//!
//! The daemon's flags are upstream kube-proxy's (v1.29), with Go's flag syntax: `--flag=value`
//! and `--flag value` both work, booleans take `--flag`, `--flag=true` or `--flag=false` (any
//! of Go's `strconv.ParseBool` spellings), integers take Go's base prefixes (`0x10`, `010`),
//! durations are Go durations (`30s`, `1m30s`), and list flags are comma-separated and may be
//! repeated. Every flag that sets a configuration field is an `Option` (or an empty `Vec`) when
//! absent, so [`crate::cmd::options`] can tell "given" from "defaulted" and apply upstream's
//! precedence between `--config` and flags.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::PathBuf;

use clap::{ArgAction, Args, Parser, Subcommand, ValueEnum};

use crate::config::{GoDuration, ProxyMode, VModuleItem, split_host_port};
use crate::model::IpFamily;
use crate::model::ip::parse_ip_sloppy;

/// The version `--version` prints: the crate's version and the git commit it was built from
/// (recorded by build.rs; "unknown" when built outside a git checkout).
pub(crate) const VERSION: &str = concat!(env!("CARGO_PKG_VERSION"), " (git commit ", env!("KPRS_GIT_COMMIT"), ")");

/// The git commit the binary was built from (build.rs), or "unknown".
pub const GIT_COMMIT: &str = env!("KPRS_GIT_COMMIT");

/// A drop-in replacement for Kubernetes kube-proxy in iptables mode.
#[derive(Debug, Parser)]
#[command(name = "kube-proxy-rs", version = VERSION, about, long_about = None, args_conflicts_with_subcommands = true)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Option<Command>,
    #[command(flatten)]
    pub daemon: DaemonArgs,
}

/// Upstream kube-proxy's flags (v1.29 names and meanings).
///
/// Precedence (upstream's): without `--config`, every flag given overrides the built-in
/// default. With `--config`, the file replaces all configuration flags except
/// `--hostname-override` and the logging flags (`-v`, `--vmodule`, `--logging-format`,
/// `--log-flush-frequency`), which still override it; see `crate::cmd::options`.
#[derive(Debug, Args, Default, Clone)]
pub struct DaemonArgs {
    // ---- Program mode --------------------------------------------------------------------
    /// The path to the configuration file (a KubeProxyConfiguration). When given, the other
    /// configuration flags are ignored, except --hostname-override and the logging flags.
    #[arg(long, value_name = "FILE", allow_hyphen_values = true)]
    pub config: Option<PathBuf>,
    /// If set, write the complete effective configuration to this file and exit.
    #[arg(long, value_name = "FILE", allow_hyphen_values = true)]
    pub write_config_to: Option<PathBuf>,
    /// If true cleanup iptables rules created by kube-proxy and exit.
    #[arg(long, value_name = "BOOL", action = ArgAction::Set, value_parser = go_bool, default_value = "false",
          num_args = 0..=1, require_equals = true, default_missing_value = "true", hide_default_value = true)]
    pub cleanup: bool,
    /// If true, perform the initialization steps that need full root privileges (sysctls),
    /// then exit.
    #[arg(long, value_name = "BOOL", action = ArgAction::Set, value_parser = go_bool, default_value = "false",
          num_args = 0..=1, require_equals = true, default_missing_value = "true", hide_default_value = true)]
    pub init_only: bool,

    // ---- API server connection ----------------------------------------------------------
    /// Path to a kubeconfig file with authorization information (the master location can be
    /// overridden by --master). Empty: in-cluster configuration.
    #[arg(long, value_name = "FILE", allow_hyphen_values = true, help_heading = "API server")]
    pub kubeconfig: Option<String>,
    /// The address of the Kubernetes API server (overrides any value in the kubeconfig).
    #[arg(long, value_name = "URL", allow_hyphen_values = true, help_heading = "API server")]
    pub master: Option<String>,
    /// Content type of requests sent to the API server [default: application/vnd.kubernetes.protobuf].
    #[arg(long, value_name = "TYPE", allow_hyphen_values = true, help_heading = "API server")]
    pub kube_api_content_type: Option<String>,
    /// Queries per second to use while talking with the API server [default: 5].
    #[arg(long, value_name = "FLOAT32", value_parser = go_float32, allow_hyphen_values = true, help_heading = "API server")]
    pub kube_api_qps: Option<f32>,
    /// Burst to use while talking with the API server [default: 10].
    #[arg(long, value_name = "INT32", value_parser = go_int32, allow_hyphen_values = true, help_heading = "API server")]
    pub kube_api_burst: Option<i32>,
    /// How often configuration from the API server is refreshed; must be greater than 0
    /// [default: 15m0s].
    #[arg(long, value_name = "DURATION", value_parser = go_duration, allow_hyphen_values = true, help_heading = "API server")]
    pub config_sync_period: Option<GoDuration>,

    // ---- Node and servers ---------------------------------------------------------------
    /// If non-empty, the name of the Node kube-proxy runs on (otherwise the hostname).
    /// Overrides the config file's hostnameOverride.
    #[arg(long, value_name = "NAME", allow_hyphen_values = true, help_heading = "Node and servers")]
    pub hostname_override: Option<String>,
    /// Overrides kube-proxy's idea of its node's primary IP (nothing binds to it, despite the
    /// name) [default: 0.0.0.0].
    #[arg(long, value_name = "IP", value_parser = ip_flag, allow_hyphen_values = true, help_heading = "Node and servers")]
    pub bind_address: Option<String>,
    /// IP address and port of the health check server; empty disables it [default: 0.0.0.0:10256].
    #[arg(long, value_name = "IP[:PORT]", value_parser = ip_port_flag, allow_hyphen_values = true, help_heading = "Node and servers")]
    pub healthz_bind_address: Option<String>,
    /// IP address and port of the metrics server ("0.0.0.0:10249" / "[::]:10249" for all
    /// interfaces) [default: 127.0.0.1:10249].
    // The text is the flag's help, upstream's wording: `[::]` is an address, not a doc link.
    #[allow(rustdoc::broken_intra_doc_links)]
    #[arg(long, value_name = "IP[:PORT]", value_parser = ip_port_flag, allow_hyphen_values = true, help_heading = "Node and servers")]
    pub metrics_bind_address: Option<String>,
    /// If true, failing to bind a server port is fatal.
    #[arg(long, value_name = "BOOL", action = ArgAction::Set, value_parser = go_bool, num_args = 0..=1,
          require_equals = true, default_missing_value = "true", help_heading = "Node and servers")]
    pub bind_address_hard_fail: Option<bool>,
    /// Deprecated: the health check server's port (0 disables it); use --healthz-bind-address.
    #[arg(long, value_name = "INT32", value_parser = go_int32, allow_hyphen_values = true, help_heading = "Node and servers")]
    pub healthz_port: Option<i32>,
    /// Deprecated: the metrics server's port (0 disables it); use --metrics-bind-address.
    #[arg(long, value_name = "INT32", value_parser = go_int32, allow_hyphen_values = true, help_heading = "Node and servers")]
    pub metrics_port: Option<i32>,
    /// If true, serve /debug/pprof on the metrics server.
    #[arg(long, value_name = "BOOL", action = ArgAction::Set, value_parser = go_bool, num_args = 0..=1,
          require_equals = true, default_missing_value = "true", help_heading = "Node and servers")]
    pub profiling: Option<bool>,
    /// The previous minor version whose hidden metrics to show (e.g. "1.28"); only the
    /// previous minor version is allowed.
    #[arg(long, value_name = "VERSION", allow_hyphen_values = true, help_heading = "Node and servers")]
    pub show_hidden_metrics_for_version: Option<String>,
    /// The oom_score_adj of the process, within [-1000, 1000] [default: -999].
    #[arg(long, value_name = "INT32", value_parser = go_int32, allow_hyphen_values = true, help_heading = "Node and servers")]
    pub oom_score_adj: Option<i32>,
    /// A set of key=value pairs enabling or disabling feature gates (comma-separated,
    /// repeatable).
    #[arg(long, value_name = "KEY=BOOL,...", value_parser = feature_gates_flag, action = ArgAction::Append,
          allow_hyphen_values = true, help_heading = "Node and servers")]
    pub feature_gates: Vec<FeatureGatesArg>,
    /// The upstream kube-proxy release to behave as (1.29 to 1.37; default: the newest),
    /// with that release's feature-gate defaults. A kube-proxy-rs extension.
    #[arg(long, value_name = "1.MINOR", help_heading = "Node and servers")]
    pub compatibility_version: Option<String>,

    // ---- Proxying ---------------------------------------------------------------------------
    /// Which proxy mode to use; only 'iptables' (the default) is implemented.
    #[arg(long, value_name = "MODE", allow_hyphen_values = true, help_heading = "Proxying")]
    pub proxy_mode: Option<String>,
    /// The pod CIDR range of the cluster (a comma-separated dual-stack pair for dual-stack
    /// clusters); with --detect-local-mode=ClusterCIDR, traffic from it counts as local.
    #[arg(long, value_name = "CIDR[,CIDR]", allow_hyphen_values = true, help_heading = "Proxying")]
    pub cluster_cidr: Option<String>,
    /// SNAT all traffic sent via Service cluster IPs (some CNI plugins need it).
    #[arg(long, value_name = "BOOL", action = ArgAction::Set, value_parser = go_bool, num_args = 0..=1,
          require_equals = true, default_missing_value = "true", help_heading = "Proxying")]
    pub masquerade_all: Option<bool>,
    /// How often re-synchronizing and cleanup work runs (the canary check, the retry after a
    /// failed sync, stale chains in large clusters); must be greater than 0 [default: 30s].
    #[arg(long, value_name = "DURATION", value_parser = go_duration, allow_hyphen_values = true, help_heading = "Proxying")]
    pub iptables_sync_period: Option<GoDuration>,
    /// The minimum period between rule resyncs; 0 means every Service or EndpointSlice
    /// change triggers an immediate resync [default: 1s].
    #[arg(long, value_name = "DURATION", value_parser = go_duration, allow_hyphen_values = true, help_heading = "Proxying")]
    pub iptables_min_sync_period: Option<GoDuration>,
    /// The bit of the fwmark space marking packets that need SNAT, within [0, 31] [default: 14].
    #[arg(long, value_name = "INT32", value_parser = go_int32, allow_hyphen_values = true, help_heading = "Proxying")]
    pub iptables_masquerade_bit: Option<i32>,
    /// If false, NodePort services are not reachable via localhost (IPv4 only) [default: true].
    #[arg(long, value_name = "BOOL", action = ArgAction::Set, value_parser = go_bool, num_args = 0..=1,
          require_equals = true, default_missing_value = "true", help_heading = "Proxying")]
    pub iptables_localhost_nodeports: Option<bool>,
    /// CIDR ranges containing the node IPs that accept NodePort connections, or the single
    /// value 'primary'; unset means all local IPs (comma-separated, repeatable).
    #[arg(long, value_name = "CIDR,...", value_parser = csv_flag, action = ArgAction::Append,
          allow_hyphen_values = true, help_heading = "Proxying")]
    pub nodeport_addresses: Vec<CsvList>,
    /// How traffic from local pods is recognised: ClusterCIDR (default), NodeCIDR,
    /// BridgeInterface or InterfaceNamePrefix.
    #[arg(long, value_name = "MODE", allow_hyphen_values = true, help_heading = "Proxying")]
    pub detect_local_mode: Option<String>,
    /// With --detect-local-mode=BridgeInterface: traffic from this bridge is local.
    #[arg(long, value_name = "NAME", allow_hyphen_values = true, help_heading = "Proxying")]
    pub pod_bridge_interface: Option<String>,
    /// With --detect-local-mode=InterfaceNamePrefix: traffic from interfaces whose name
    /// starts with this prefix is local.
    #[arg(long, value_name = "PREFIX", allow_hyphen_values = true, help_heading = "Proxying")]
    pub pod_interface_name_prefix: Option<String>,
    /// Deprecated and unused (the userspace proxy's port range).
    #[arg(long, value_name = "RANGE", allow_hyphen_values = true, help_heading = "Proxying")]
    pub proxy_port_range: Option<String>,

    // ---- Conntrack ------------------------------------------------------------------------
    /// Maximum tracked connections per CPU core (0 leaves the limit alone and ignores
    /// --conntrack-min) [default: 32768].
    #[arg(long, value_name = "INT32", value_parser = go_int32, allow_hyphen_values = true, help_heading = "Conntrack")]
    pub conntrack_max_per_core: Option<i32>,
    /// Minimum conntrack table size, regardless of --conntrack-max-per-core [default: 131072].
    #[arg(long, value_name = "INT32", value_parser = go_int32, allow_hyphen_values = true, help_heading = "Conntrack")]
    pub conntrack_min: Option<i32>,
    /// Idle timeout of established TCP connections (0 leaves it alone) [default: 24h0m0s].
    #[arg(long, value_name = "DURATION", value_parser = go_duration, allow_hyphen_values = true, help_heading = "Conntrack")]
    pub conntrack_tcp_timeout_established: Option<GoDuration>,
    /// NAT timeout of TCP connections in the CLOSE_WAIT state [default: 1h0m0s].
    #[arg(long, value_name = "DURATION", value_parser = go_duration, allow_hyphen_values = true, help_heading = "Conntrack")]
    pub conntrack_tcp_timeout_close_wait: Option<GoDuration>,
    /// Set nf_conntrack_tcp_be_liberal, so out-of-window TCP packets are not marked INVALID.
    #[arg(long, value_name = "BOOL", action = ArgAction::Set, value_parser = go_bool, num_args = 0..=1,
          require_equals = true, default_missing_value = "true", help_heading = "Conntrack")]
    pub conntrack_tcp_be_liberal: Option<bool>,
    /// Idle timeout of UNREPLIED UDP connections (0 leaves it alone).
    #[arg(long, value_name = "DURATION", value_parser = go_duration, allow_hyphen_values = true, help_heading = "Conntrack")]
    pub conntrack_udp_timeout: Option<GoDuration>,
    /// Idle timeout of ASSURED UDP connections (0 leaves it alone).
    #[arg(long, value_name = "DURATION", value_parser = go_duration, allow_hyphen_values = true, help_heading = "Conntrack")]
    pub conntrack_udp_timeout_stream: Option<GoDuration>,

    // ---- IPVS (accepted, stored in the configuration, unused) ---------------------------
    /// IPVS mode: full resync interval [default: 30s].
    #[arg(long, value_name = "DURATION", value_parser = go_duration, allow_hyphen_values = true, help_heading = "IPVS (accepted for compatibility; unused)")]
    pub ipvs_sync_period: Option<GoDuration>,
    /// IPVS mode: minimum period between resyncs.
    #[arg(long, value_name = "DURATION", value_parser = go_duration, allow_hyphen_values = true, help_heading = "IPVS (accepted for compatibility; unused)")]
    pub ipvs_min_sync_period: Option<GoDuration>,
    /// IPVS mode: scheduler type.
    #[arg(
        long,
        value_name = "NAME",
        allow_hyphen_values = true,
        help_heading = "IPVS (accepted for compatibility; unused)"
    )]
    pub ipvs_scheduler: Option<String>,
    /// IPVS mode: CIDRs left alone when cleaning up (comma-separated, repeatable).
    #[arg(long, value_name = "CIDR,...", value_parser = csv_flag, action = ArgAction::Append,
          allow_hyphen_values = true, help_heading = "IPVS (accepted for compatibility; unused)")]
    pub ipvs_exclude_cidrs: Vec<CsvList>,
    /// IPVS mode: strict ARP (arp_ignore=1, arp_announce=2).
    #[arg(long, value_name = "BOOL", action = ArgAction::Set, value_parser = go_bool, num_args = 0..=1,
          require_equals = true, default_missing_value = "true", help_heading = "IPVS (accepted for compatibility; unused)")]
    pub ipvs_strict_arp: Option<bool>,
    /// IPVS mode: idle TCP timeout.
    #[arg(long, value_name = "DURATION", value_parser = go_duration, allow_hyphen_values = true, help_heading = "IPVS (accepted for compatibility; unused)")]
    pub ipvs_tcp_timeout: Option<GoDuration>,
    /// IPVS mode: TCP timeout after a FIN.
    #[arg(long, value_name = "DURATION", value_parser = go_duration, allow_hyphen_values = true, help_heading = "IPVS (accepted for compatibility; unused)")]
    pub ipvs_tcpfin_timeout: Option<GoDuration>,
    /// IPVS mode: UDP timeout.
    #[arg(long, value_name = "DURATION", value_parser = go_duration, allow_hyphen_values = true, help_heading = "IPVS (accepted for compatibility; unused)")]
    pub ipvs_udp_timeout: Option<GoDuration>,

    // ---- Logging (these override the config file's `logging`) ------------------------
    /// Log verbosity (klog's -v): 0-1 info, 2-4 debug, 5 and above trace.
    #[arg(short = 'v', long = "v", value_name = "LEVEL", value_parser = go_verbosity, allow_hyphen_values = true, help_heading = "Logging")]
    pub verbosity: Option<u32>,
    /// Per-file verbosity: comma-separated pattern=N settings (repeatable).
    #[arg(long, value_name = "PATTERN=N,...", value_parser = vmodule_flag, action = ArgAction::Append,
          allow_hyphen_values = true, help_heading = "Logging")]
    pub vmodule: Vec<VModuleArg>,
    /// Log format: "text" or "json" [default: text].
    #[arg(long, value_name = "FORMAT", allow_hyphen_values = true, help_heading = "Logging")]
    pub logging_format: Option<String>,
    /// Maximum time between log flushes [default: 5s].
    #[arg(long, value_name = "DURATION", value_parser = go_duration, allow_hyphen_values = true, help_heading = "Logging")]
    pub log_flush_frequency: Option<GoDuration>,
}

/// One occurrence of a comma-separated list flag (pflag's `StringSlice`, read as one CSV
/// record: fields may be quoted, spaces are kept).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CsvList(pub Vec<String>);

/// One occurrence of `--feature-gates`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FeatureGatesArg(pub BTreeMap<String, bool>);

/// One occurrence of `--vmodule`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VModuleArg(pub Vec<VModuleItem>);

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Print the iptables-restore input kube-proxy would write for the given cluster state, or
    /// with --proxy-mode nftables the whole kube-proxy table after each sync.
    Render(RenderArgs),
    /// Trace a new connection through a node's iptables rules: verdict, destinations, path.
    /// Reads iptables rules only for now: nftables mode is refused (`render --proxy-mode
    /// nftables` prints that mode's table).
    Trace(TraceArgs),
    /// Compare the node's iptables rules with what the cluster state renders to (exit 1 if
    /// they differ). Reads iptables rules only for now: nftables mode is refused (`render
    /// --proxy-mode nftables` prints that mode's table).
    Diff(DiffArgs),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum IpFamilyArg {
    Ipv4,
    Ipv6,
}

impl From<IpFamilyArg> for IpFamily {
    fn from(arg: IpFamilyArg) -> IpFamily {
        match arg {
            IpFamilyArg::Ipv4 => IpFamily::V4,
            IpFamilyArg::Ipv6 => IpFamily::V6,
        }
    }
}

impl From<IpFamily> for IpFamilyArg {
    fn from(family: IpFamily) -> IpFamilyArg {
        match family {
            IpFamily::V4 => IpFamilyArg::Ipv4,
            IpFamily::V6 => IpFamilyArg::Ipv6,
        }
    }
}

/// How rules are rendered from manifests: the flags `render`, `trace` and `diff` share.
#[derive(Debug, Clone, Args)]
pub struct RenderOptions {
    /// KubeProxyConfiguration file; the fields that affect rules are honoured.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// The node name to act as (default: the config's hostnameOverride, else the OS hostname).
    #[arg(long, value_name = "NAME")]
    pub hostname_override: Option<String>,
    /// A host interface address, used to resolve nodePortAddresses (repeatable; default: the
    /// node's addresses).
    #[arg(long = "interface-address", value_name = "IP")]
    pub interface_addresses: Vec<IpAddr>,
    /// The iptables version to assume (`--random-fully` from 1.6.2 on; iptables mode).
    #[arg(long, value_name = "X.Y.Z", default_value = "1.8.9")]
    pub iptables_version: String,
    /// The upstream kube-proxy release to render as (1.29 to 1.37; default: the config's
    /// compatibilityVersion, else the newest).
    #[arg(long, value_name = "1.MINOR")]
    pub compatibility_version: Option<String>,
    /// The proxy mode to render (default: the config's mode, else iptables); nftables needs
    /// release 1.31 or later. `trace` and `diff` read iptables rules only and refuse
    /// nftables.
    #[arg(long, value_enum, value_name = "iptables|nftables")]
    pub proxy_mode: Option<ProxyModeArg>,
    /// Feature gates, as the daemon takes them (applied over the config's featureGates).
    #[arg(long, value_name = "KEY=BOOL,...", value_parser = feature_gates_flag, action = ArgAction::Append)]
    pub feature_gates: Vec<FeatureGatesArg>,
    /// Whether the node has the nfacct accounting objects releases from 1.31 count with
    /// (`present`, as upstream's unit tests assume, unless `diff` reads the node), or not
    /// (`absent`: the rules a node without nfacct support gets).
    #[arg(long, value_enum, value_name = "present|absent")]
    pub nfacct: Option<NfacctArg>,
    /// The node's `net.netfilter.nf_conntrack_tcp_be_liberal` is set (no INVALID-drop rule), as
    /// the config's `conntrack.tcpBeLiberal: true` also makes it (default: unset, unless `diff`
    /// reads the node).
    #[arg(long, value_name = "BOOL", num_args = 0..=1, require_equals = true, default_missing_value = "true", value_parser = go_bool)]
    pub conntrack_tcp_be_liberal: Option<bool>,
}

/// `--proxy-mode` of `render`, `trace` and `diff`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ProxyModeArg {
    Iptables,
    Nftables,
}

impl From<ProxyModeArg> for ProxyMode {
    fn from(arg: ProxyModeArg) -> ProxyMode {
        match arg {
            ProxyModeArg::Iptables => ProxyMode::Iptables,
            ProxyModeArg::Nftables => ProxyMode::Nftables,
        }
    }
}

/// `--nfacct`: whether the node has the accounting objects.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum NfacctArg {
    Present,
    Absent,
}

#[derive(Debug, Args)]
pub struct RenderArgs {
    #[command(flatten)]
    pub options: RenderOptions,
    /// Which family's rules to render (in nftables mode: the `ip` or the `ip6` table).
    #[arg(long, value_enum, default_value = "ipv4")]
    pub ip_family: IpFamilyArg,
    /// YAML manifests (Services, EndpointSlices, Nodes, ServiceCIDRs, Lists): the first
    /// cluster snapshot.
    #[arg(value_name = "MANIFEST", required = true)]
    pub manifests: Vec<PathBuf>,
    /// A later complete snapshot, rendered as a partial sync against the previous state
    /// (repeatable, applied in order; in nftables mode each is a sync two seconds after the
    /// previous one).
    #[arg(long = "then", value_name = "MANIFEST")]
    pub then: Vec<PathBuf>,
}

// ---------------------------------------------------------------------------------------------
// Go-compatible value parsers (the error text becomes clap's "invalid value" message)
// ---------------------------------------------------------------------------------------------

/// Go's `strconv.ParseBool`.
pub(crate) fn go_bool(s: &str) -> Result<bool, String> {
    match s {
        "1" | "t" | "T" | "TRUE" | "true" | "True" => Ok(true),
        "0" | "f" | "F" | "FALSE" | "false" | "False" => Ok(false),
        _ => Err(format!("strconv.ParseBool: parsing {s:?}: invalid syntax")),
    }
}

/// A Go duration (`time.ParseDuration`).
pub(crate) fn go_duration(s: &str) -> Result<GoDuration, String> {
    GoDuration::parse(s).map_err(|e| e.to_string())
}

/// Go's `strconv.ParseInt(s, 0, 32)`: optional sign, then decimal, `0x` hex, `0o`/`0` octal
/// or `0b` binary; underscores only between digits after a base prefix.
pub(crate) fn go_int32(s: &str) -> Result<i32, String> {
    let syntax = || format!("strconv.ParseInt: parsing {s:?}: invalid syntax");
    let (negative, body) = match s.as_bytes().first() {
        Some(b'-') => (true, &s[1..]),
        Some(b'+') => (false, &s[1..]),
        _ => (false, s),
    };
    let lower = body.to_ascii_lowercase();
    let (radix, digits, prefixed) = if let Some(rest) = lower.strip_prefix("0x") {
        (16, rest.to_string(), true)
    } else if let Some(rest) = lower.strip_prefix("0o") {
        (8, rest.to_string(), true)
    } else if let Some(rest) = lower.strip_prefix("0b") {
        (2, rest.to_string(), true)
    } else if lower.len() > 1 && lower.starts_with('0') {
        (8, lower[1..].to_string(), true)
    } else {
        (10, lower.clone(), false)
    };
    if digits.contains('_') {
        let well_placed = prefixed && !digits.starts_with('_') && !digits.ends_with('_') && !digits.contains("__");
        if !well_placed {
            return Err(syntax());
        }
    }
    let digits: String = digits.chars().filter(|c| *c != '_').collect();
    if digits.is_empty() || !digits.chars().all(|c| c.is_digit(radix)) {
        return Err(syntax());
    }
    let magnitude = i64::from_str_radix(&digits, radix).unwrap_or(i64::MAX);
    let value = if negative { -magnitude } else { magnitude };
    i32::try_from(value).map_err(|_| format!("strconv.ParseInt: parsing {s:?}: value out of range"))
}

/// Go's `strconv.ParseFloat(s, 32)` (close enough: Rust's float syntax).
pub(crate) fn go_float32(s: &str) -> Result<f32, String> {
    s.trim().parse::<f32>().map_err(|_| format!("strconv.ParseFloat: parsing {s:?}: invalid syntax"))
}

/// klog's `-v`: an unsigned 32-bit decimal.
pub(crate) fn go_verbosity(s: &str) -> Result<u32, String> {
    s.parse::<u32>().map_err(|_| format!("strconv.ParseUint: parsing {s:?}: invalid syntax"))
}

/// An IP flag (`--bind-address`): must be an IP address; kept as written.
pub(crate) fn ip_flag(s: &str) -> Result<String, String> {
    if parse_ip_sloppy(s).is_none() {
        return Err(format!("{s:?} is not a valid IP address"));
    }
    Ok(s.to_string())
}

/// An `ip` or `ip:port` flag (`--healthz-bind-address`, `--metrics-bind-address`); blank
/// means empty (which disables the server). Kept as written.
pub(crate) fn ip_port_flag(s: &str) -> Result<String, String> {
    if s.trim().is_empty() {
        return Ok(String::new());
    }
    if parse_ip_sloppy(s).is_some() {
        return Ok(s.to_string());
    }
    let (host, port) =
        split_host_port(s).map_err(|e| format!("{s:?} is not in a valid format (ip or ip:port): {e}"))?;
    if parse_ip_sloppy(host).is_none() {
        return Err(format!("{host:?} is not a valid IP address"));
    }
    if !port.parse::<u16>().is_ok_and(|_| port.bytes().all(|b| b.is_ascii_digit())) {
        return Err(format!("{port:?} is not a valid number"));
    }
    Ok(s.to_string())
}

/// One CSV record, as pflag's `StringSlice` reads it; the empty string is an empty list.
pub(crate) fn csv_flag(s: &str) -> Result<CsvList, String> {
    if s.is_empty() {
        return Ok(CsvList(Vec::new()));
    }
    let mut fields = Vec::new();
    let mut chars = s.chars().peekable();
    loop {
        let mut field = String::new();
        if chars.peek() == Some(&'"') {
            chars.next();
            loop {
                match chars.next() {
                    Some('"') if chars.peek() == Some(&'"') => {
                        chars.next();
                        field.push('"');
                    }
                    Some('"') => break,
                    Some(c) => field.push(c),
                    None => return Err(format!("{s:?}: extraneous or missing \" in quoted-field")),
                }
            }
            match chars.next() {
                None => {
                    fields.push(field);
                    return Ok(CsvList(fields));
                }
                Some(',') => fields.push(field),
                Some(_) => return Err(format!("{s:?}: extraneous or missing \" in quoted-field")),
            }
        } else {
            loop {
                match chars.next() {
                    None => {
                        fields.push(field);
                        return Ok(CsvList(fields));
                    }
                    Some(',') => break,
                    Some('"') => return Err(format!("{s:?}: bare \" in non-quoted-field")),
                    Some(c) => field.push(c),
                }
            }
            fields.push(field);
        }
    }
}

/// `--feature-gates`: `Name=bool` pairs separated by commas (blank pairs skipped).
pub(crate) fn feature_gates_flag(s: &str) -> Result<FeatureGatesArg, String> {
    let mut gates = BTreeMap::new();
    for pair in s.split(',').filter(|p| !p.is_empty()) {
        let Some((key, value)) = pair.split_once('=') else {
            return Err(format!("malformed pair {pair:?}, expect string=bool"));
        };
        let (key, value) = (key.trim(), value.trim());
        let enabled = go_bool(value).map_err(|e| format!("invalid value of {key}: {value}, err: {e}"))?;
        gates.insert(key.to_string(), enabled);
    }
    Ok(FeatureGatesArg(gates))
}

/// `--vmodule`: `pattern=N` items separated by commas (blank items skipped).
pub(crate) fn vmodule_flag(s: &str) -> Result<VModuleArg, String> {
    let mut items = Vec::new();
    for item in s.split(',').filter(|p| !p.is_empty()) {
        let parts: Vec<&str> = item.split('=').collect();
        let [pattern, level] = parts.as_slice() else {
            return Err(format!("{item:?} does not have the pattern=N format"));
        };
        if pattern.is_empty() || level.is_empty() {
            return Err(format!("{item:?} does not have the pattern=N format"));
        }
        let verbosity = level
            .parse::<u32>()
            .ok()
            .filter(|v| *v < (1 << 31))
            .ok_or_else(|| format!("parsing verbosity in {item:?}: invalid syntax"))?;
        items.push(VModuleItem { file_pattern: (*pattern).to_string(), verbosity });
    }
    Ok(VModuleArg(items))
}

/// The protocol of a traced packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ProtoArg {
    Tcp,
    Udp,
    Sctp,
}

#[derive(Debug, Args)]
pub struct TraceArgs {
    /// Rules to trace through: iptables-save output or iptables-restore input (`-` for
    /// stdin). Without it and without manifests, the live node's rules.
    #[arg(long, value_name = "FILE", conflicts_with = "manifests")]
    pub rules: Option<PathBuf>,
    /// With manifests: how they are rendered, as for `render`.
    #[command(flatten)]
    pub render: RenderOptions,
    /// YAML manifests to render the rules from, as for `render`.
    #[arg(value_name = "MANIFEST")]
    pub manifests: Vec<PathBuf>,
    /// With manifests: a later snapshot, as for `render` (repeatable).
    #[arg(long = "then", value_name = "MANIFEST", requires = "manifests")]
    pub then: Vec<PathBuf>,
    /// The family of the rules (default: the family of --dst).
    #[arg(long, value_enum)]
    pub ip_family: Option<IpFamilyArg>,
    /// An address of the node, for `addrtype LOCAL` (repeatable; default: the live node's
    /// interface addresses, or with manifests the node's addresses as `render` resolves them).
    #[arg(long = "local-address", value_name = "IP")]
    pub local_addresses: Vec<IpAddr>,
    /// Source address of the packet (one of the node's: locally generated).
    #[arg(long, value_name = "IP")]
    pub src: IpAddr,
    /// Destination address.
    #[arg(long, value_name = "IP")]
    pub dst: IpAddr,
    /// Destination port.
    #[arg(long, value_name = "PORT")]
    pub dport: u16,
    /// Protocol.
    #[arg(long, value_enum, default_value = "tcp")]
    pub proto: ProtoArg,
    /// The interface the packet arrives on, for rules matching `-i`.
    #[arg(long, value_name = "NAME")]
    pub in_interface: Option<String>,
    /// The interface the packet leaves by, for rules matching `-o`.
    #[arg(long, value_name = "NAME")]
    pub out_interface: Option<String>,
    /// Print one JSON object: {"verdict", "destinations": [{"address", "probability",
    /// "masquerade"}], "path": [...]}.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct DiffArgs {
    /// How the manifests are rendered, as for `render`.
    #[command(flatten)]
    pub render: RenderOptions,
    /// Which family's rules to compare.
    #[arg(long, value_enum, default_value = "ipv4")]
    pub ip_family: IpFamilyArg,
    /// The node's rules from a file (iptables-save output of nat and filter) instead of the
    /// live node.
    #[arg(long, value_name = "FILE")]
    pub node_rules: Option<PathBuf>,
    /// Read the cluster state from the API server with this kubeconfig (default: the config
    /// file's clientConnection.kubeconfig, else in-cluster), as the daemon does.
    #[arg(long, value_name = "FILE", conflicts_with = "manifests")]
    pub kubeconfig: Option<PathBuf>,
    /// The API server's address (overrides the kubeconfig's), as the daemon's --master.
    #[arg(long, value_name = "URL", conflicts_with = "manifests")]
    pub master: Option<String>,
    /// The cluster state: YAML manifests (Services, EndpointSlices, Nodes), as for `render`.
    /// Without any, the state is read from the API server.
    #[arg(value_name = "MANIFEST")]
    pub manifests: Vec<PathBuf>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<DaemonArgs, clap::Error> {
        let argv = std::iter::once("kube-proxy-rs").chain(args.iter().copied());
        Cli::try_parse_from(argv).map(|cli| cli.daemon)
    }

    #[test]
    fn no_flags_means_nothing_given() {
        let a = parse(&[]).unwrap();
        assert!(a.config.is_none() && a.proxy_mode.is_none() && a.masquerade_all.is_none());
        assert!(!a.cleanup && !a.init_only);
        assert!(a.nodeport_addresses.is_empty() && a.feature_gates.is_empty());
    }

    #[test]
    fn go_flag_syntax_equals_and_space() {
        let a =
            parse(&["--proxy-mode=iptables", "--cluster-cidr", "10.0.0.0/8", "--iptables-sync-period=10s"]).unwrap();
        assert_eq!(a.proxy_mode.as_deref(), Some("iptables"));
        assert_eq!(a.cluster_cidr.as_deref(), Some("10.0.0.0/8"));
        assert_eq!(a.iptables_sync_period, Some(GoDuration::from_secs(10)));
        let a = parse(&["--iptables-min-sync-period", "-1s", "--oom-score-adj", "-999"]).unwrap();
        assert_eq!(a.iptables_min_sync_period, Some(GoDuration(-1_000_000_000)));
        assert_eq!(a.oom_score_adj, Some(-999));
    }

    #[test]
    fn booleans_take_optional_values() {
        let a = parse(&["--masquerade-all", "--iptables-localhost-nodeports=false", "--profiling=T"]).unwrap();
        assert_eq!(a.masquerade_all, Some(true));
        assert_eq!(a.iptables_localhost_nodeports, Some(false));
        assert_eq!(a.profiling, Some(true));
        assert!(parse(&["--cleanup=0"]).is_ok_and(|a| !a.cleanup));
        assert!(parse(&["--cleanup"]).is_ok_and(|a| a.cleanup));
        assert!(parse(&["--init-only=true"]).is_ok_and(|a| a.init_only));
        let err = parse(&["--masquerade-all=yes"]).unwrap_err().to_string();
        assert!(err.contains("--masquerade-all"), "{err}");
        // A separate word after a boolean flag is not its value (as with pflag).
        assert!(parse(&["--masquerade-all", "false"]).is_err());
    }

    #[test]
    fn verbosity_short_and_long() {
        for argv in [&["-v", "4"][..], &["-v4"], &["-v=4"], &["--v=4"], &["--v", "4"]] {
            assert_eq!(parse(argv).unwrap().verbosity, Some(4), "{argv:?}");
        }
        assert!(parse(&["-v", "x"]).is_err());
    }

    #[test]
    fn list_flags_accumulate() {
        let a =
            parse(&["--nodeport-addresses=10.0.0.0/8,fd00::/64", "--nodeport-addresses", "192.168.0.0/16"]).unwrap();
        let all: Vec<String> = a.nodeport_addresses.iter().flat_map(|l| l.0.clone()).collect();
        assert_eq!(all, ["10.0.0.0/8", "fd00::/64", "192.168.0.0/16"]);
        let a = parse(&["--nodeport-addresses="]).unwrap();
        assert_eq!(a.nodeport_addresses, vec![CsvList(Vec::new())]);
        let a = parse(&["--feature-gates=A=true, B=false", "--feature-gates", "C=1"]).unwrap();
        assert_eq!(a.feature_gates.len(), 2);
        assert_eq!(a.feature_gates[0].0.get("B"), Some(&false));
        let a = parse(&["--vmodule=proxier*=4,sync=2"]).unwrap();
        assert_eq!(a.vmodule[0].0[1], VModuleItem { file_pattern: "sync".into(), verbosity: 2 });
    }

    #[test]
    fn value_parsers_reject_like_go() {
        for (argv, flag) in [
            (&["--iptables-masquerade-bit=x"][..], "--iptables-masquerade-bit"),
            (&["--iptables-sync-period=30"], "--iptables-sync-period"),
            (&["--bind-address=1.2.3"], "--bind-address"),
            (&["--healthz-bind-address=1.2.3.4:http"], "--healthz-bind-address"),
            (&["--metrics-bind-address=localhost:10249"], "--metrics-bind-address"),
            (&["--kube-api-qps=fast"], "--kube-api-qps"),
            (&["--feature-gates=A"], "--feature-gates"),
            (&["--vmodule=x"], "--vmodule"),
            (&["--nodeport-addresses=a\"b"], "--nodeport-addresses"),
            (&["--conntrack-min=99999999999"], "--conntrack-min"),
        ] {
            let err = parse(argv).unwrap_err().to_string();
            assert!(err.contains(flag), "{argv:?}: {err}");
        }
    }

    #[test]
    fn go_int32_bases() {
        assert_eq!(go_int32("14"), Ok(14));
        assert_eq!(go_int32("-1000"), Ok(-1000));
        assert_eq!(go_int32("+7"), Ok(7));
        assert_eq!(go_int32("0x10"), Ok(16));
        assert_eq!(go_int32("010"), Ok(8));
        assert_eq!(go_int32("0o17"), Ok(15));
        assert_eq!(go_int32("0b101"), Ok(5));
        assert_eq!(go_int32("0x_1F"), Err("strconv.ParseInt: parsing \"0x_1F\": invalid syntax".into()));
        assert_eq!(go_int32("1_000"), Err("strconv.ParseInt: parsing \"1_000\": invalid syntax".into()));
        assert_eq!(go_int32("0x1_F"), Ok(31));
        assert_eq!(go_int32("0"), Ok(0));
        assert!(go_int32("").is_err());
        assert!(go_int32("08").is_err());
        assert!(go_int32("2147483648").unwrap_err().contains("out of range"));
        assert_eq!(go_int32("-2147483648"), Ok(i32::MIN));
    }

    #[test]
    fn csv_records() {
        assert_eq!(csv_flag("a,b").unwrap().0, ["a", "b"]);
        assert_eq!(csv_flag("a, b").unwrap().0, ["a", " b"]);
        assert_eq!(csv_flag("\"a,b\",c").unwrap().0, ["a,b", "c"]);
        assert_eq!(csv_flag("\"say \"\"hi\"\"\"").unwrap().0, ["say \"hi\""]);
        assert_eq!(csv_flag("a,").unwrap().0, ["a", ""]);
        assert!(csv_flag("\"open").is_err());
        assert!(csv_flag("\"x\"y").is_err());
    }

    #[test]
    fn render_subcommand_still_parses() {
        let cli = Cli::try_parse_from(["kube-proxy-rs", "render", "--config", "c.yaml", "m.yaml"]).unwrap();
        assert!(matches!(cli.command, Some(Command::Render(_))));
        // Daemon flags do not mix with the subcommand.
        assert!(Cli::try_parse_from(["kube-proxy-rs", "--masquerade-all", "render", "m.yaml"]).is_err());
    }
}
