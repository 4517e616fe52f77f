//! Command-line flags (clap). Parsing only: no behaviour lives here.

use std::net::IpAddr;
use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

/// A drop-in replacement for Kubernetes kube-proxy in iptables mode.
#[derive(Debug, Parser)]
#[command(name = "kube-proxy-rs", version, about, long_about = None, args_conflicts_with_subcommands = true)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Option<Command>,
    #[command(flatten)]
    pub daemon: DaemonArgs,
}

/// Upstream kube-proxy's flags (those implemented so far).
#[derive(Debug, Args, Default)]
pub struct DaemonArgs {
    /// If true cleanup iptables rules created by kube-proxy and exit.
    #[arg(long)]
    pub cleanup: bool,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Print the iptables-restore input kube-proxy would write for the given cluster state.
    Render(RenderArgs),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum IpFamilyArg {
    Ipv4,
    Ipv6,
}

#[derive(Debug, Args)]
pub struct RenderArgs {
    /// KubeProxyConfiguration file; the fields that affect rules are honoured.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// The node name to act as (default: the config's hostnameOverride, else the OS hostname).
    #[arg(long, value_name = "NAME")]
    pub hostname_override: Option<String>,
    /// Which family's rules to render.
    #[arg(long, value_enum, default_value = "ipv4")]
    pub ip_family: IpFamilyArg,
    /// A host interface address, used to resolve nodePortAddresses (repeatable; default: the
    /// node's addresses).
    #[arg(long = "interface-address", value_name = "IP")]
    pub interface_addresses: Vec<IpAddr>,
    /// The iptables version to assume (`--random-fully` from 1.6.2 on).
    #[arg(long, value_name = "X.Y.Z", default_value = "1.8.9")]
    pub iptables_version: String,
    /// YAML manifests (Services, EndpointSlices, Nodes, Lists): the first cluster snapshot.
    #[arg(value_name = "MANIFEST", required = true)]
    pub manifests: Vec<PathBuf>,
    /// A later complete snapshot, rendered as a partial sync against the previous state
    /// (repeatable, applied in order).
    #[arg(long = "then", value_name = "MANIFEST")]
    pub then: Vec<PathBuf>,
}
