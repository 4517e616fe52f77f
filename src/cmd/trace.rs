//! The `trace` command: where would a new connection go? Rules come from a file, from
//! manifests rendered as `render` does, or from the live node; the tracer ([`crate::trace`])
//! follows the packet and this prints the result, briefly or as one JSON object.
//!
//! It reads iptables rules only, for now: asked about nftables mode (`--proxy-mode nftables`,
//! or a config with `mode: nftables`) it says so and points at `render --proxy-mode nftables`.

use std::io::{Read, Write};
use std::net::IpAddr;
use std::sync::Arc;

use super::render::{self, RenderCmdError};
use crate::cmd::cli::{ProtoArg, RenderArgs, TraceArgs};
use crate::exec::{Exec, RealExec};
use crate::iptables::{Iptables, Table};
use crate::model::IpFamily;
use crate::proxier::NetworkInterfaces;
use crate::trace::{LoadError, Packet, Proto, RuleSet, TraceError};

#[derive(Debug, thiserror::Error)]
pub enum TraceCmdError {
    #[error("{path}: {source}")]
    ReadRules { path: String, source: std::io::Error },
    #[error("{source_name}: {source}")]
    Rules { source_name: String, source: LoadError },
    #[error(transparent)]
    Render(#[from] RenderCmdError),
    #[error("--{flag} {ip} is not an {family} address")]
    Family { flag: &'static str, ip: IpAddr, family: IpFamily },
    #[error("failed to read the node's rules: {0}")]
    Live(String),
    #[error("failed to read the node's addresses: {0}")]
    Addresses(std::io::Error),
    #[error(transparent)]
    Trace(#[from] TraceError),
    #[error("failed to write output: {0}")]
    Output(#[from] std::io::Error),
}

impl TraceCmdError {
    /// 2 for bad input (flags, files, rules text, manifests); 1 when the trace itself could
    /// not be completed (a rule it cannot evaluate, the node unreachable).
    pub fn exit_code(&self) -> u8 {
        match self {
            TraceCmdError::ReadRules { .. } | TraceCmdError::Rules { .. } | TraceCmdError::Family { .. } => 2,
            TraceCmdError::Render(e) => u8::try_from(e.exit_code()).unwrap_or(1),
            _ => 1,
        }
    }
}

/// Where the live node's rules and addresses come from (real: iptables-save and /proc).
pub trait LiveNode {
    /// `iptables-save` of nat and filter for `family`.
    fn rules(&self, family: IpFamily) -> Result<String, String>;
    fn addresses(&self) -> std::io::Result<Vec<IpAddr>>;
    /// What the node's rules depend on besides the cluster: its nfacct objects and its
    /// `nf_conntrack_tcp_be_liberal` sysctl (`diff` renders with them).
    fn facts(&self) -> super::render::NodeFacts {
        super::render::NodeFacts::default()
    }
}

/// The node this process runs on.
pub struct RealNode;

impl LiveNode for RealNode {
    fn rules(&self, family: IpFamily) -> Result<String, String> {
        let exec: Arc<dyn Exec> = Arc::new(RealExec);
        save_tables(crate::daemon::app::iptables_runners(exec).iter().find(|r| r.family() == family), family)
    }

    fn addresses(&self) -> std::io::Result<Vec<IpAddr>> {
        crate::daemon::app::HostInterfaces.interface_addrs()
    }

    fn facts(&self) -> super::render::NodeFacts {
        use crate::node::nfacct::{CT_STATE_INVALID_DROPPED, ExecNfacct, Nfacct};
        let exec: Arc<dyn Exec> = Arc::new(RealExec);
        super::render::NodeFacts {
            // The daemon makes sure of both objects together; one readable means support.
            nfacct: ExecNfacct::new(exec).packets(CT_STATE_INVALID_DROPPED).is_ok(),
            conntrack_tcp_be_liberal: crate::node::sysctl::conntrack_tcp_be_liberal(
                &crate::node::sysctl::ProcSysctl::new(),
            ),
        }
    }
}

/// `iptables-save -t nat` and `-t filter` through `ipt`.
pub(crate) fn save_tables(ipt: Option<&impl Iptables>, family: IpFamily) -> Result<String, String> {
    let Some(ipt) = ipt.filter(|i| i.present()) else {
        return Err(format!("iptables for {family} is not available on this node"));
    };
    let mut out = Vec::new();
    for table in [Table::Nat, Table::Filter] {
        ipt.save_into(table, &mut out).map_err(|e| e.to_string())?;
    }
    String::from_utf8(out).map_err(|e| format!("iptables-save output is not UTF-8: {e}"))
}

fn family_of(ip: IpAddr) -> IpFamily {
    if ip.is_ipv4() { IpFamily::V4 } else { IpFamily::V6 }
}

/// The rules to trace through and the node's addresses, from the flags. The rules borrow
/// from their text, which is read into `text`.
pub(crate) fn load_rules<'t>(
    args: &TraceArgs,
    node: &dyn LiveNode,
    text: &'t mut String,
) -> Result<(RuleSet<'t>, Vec<IpAddr>), TraceCmdError> {
    // The tracer evaluates iptables rules: nftables mode is refused, whatever the rules' source.
    render::require_iptables_mode(&args.render, "trace")?;
    let family = args.ip_family.map_or_else(|| family_of(args.dst), IpFamily::from);
    for (flag, ip) in [("src", args.src), ("dst", args.dst)] {
        if family_of(ip) != family {
            return Err(TraceCmdError::Family { flag, ip, family });
        }
    }
    let (source_name, read, rendered_local) = if let Some(path) = &args.rules {
        let name = path.display().to_string();
        let text = read_rules(path).map_err(|source| TraceCmdError::ReadRules { path: name.clone(), source })?;
        (name, text, None)
    } else if !args.manifests.is_empty() {
        let render_args = RenderArgs {
            options: args.render.clone(),
            ip_family: family.into(),
            manifests: args.manifests.clone(),
            then: args.then.clone(),
        };
        let mut buf = Vec::new();
        let rendered = render::run_node(&render_args, &mut buf)?;
        ("rendered rules".to_string(), String::from_utf8_lossy(&buf).into_owned(), Some(rendered.local_addresses()))
    } else {
        ("the node's rules".to_string(), node.rules(family).map_err(TraceCmdError::Live)?, None)
    };
    *text = read;
    let text: &'t String = text;
    let mut rules = RuleSet::parse(text).map_err(|source| TraceCmdError::Rules { source_name, source })?;
    rules.assume_jump_rules_if_missing();
    let local = if !args.local_addresses.is_empty() {
        args.local_addresses.clone()
    } else if let Some(local) = rendered_local {
        local
    } else {
        node.addresses().map_err(TraceCmdError::Addresses)?
    };
    Ok((rules, local))
}

fn read_rules(path: &std::path::Path) -> std::io::Result<String> {
    if path.as_os_str() == "-" {
        let mut s = String::new();
        std::io::stdin().read_to_string(&mut s)?;
        Ok(s)
    } else {
        std::fs::read_to_string(path)
    }
}

/// Runs `trace`, printing the result to `out`.
pub fn run(args: &TraceArgs, node: &dyn LiveNode, out: &mut dyn Write) -> Result<(), TraceCmdError> {
    let mut text = String::new();
    let (rules, local) = load_rules(args, node, &mut text)?;
    let pkt = Packet {
        src: args.src,
        dst: args.dst,
        dport: args.dport,
        proto: match args.proto {
            ProtoArg::Tcp => Proto::Tcp,
            ProtoArg::Udp => Proto::Udp,
            ProtoArg::Sctp => Proto::Sctp,
        },
        in_interface: args.in_interface.clone(),
        out_interface: args.out_interface.clone(),
    };
    let result = crate::trace::trace(&rules, &pkt, &local)?;
    if args.json {
        writeln!(out, "{}", result.to_json())?;
    } else {
        out.write_all(result.to_human().as_bytes())?;
    }
    out.flush()?;
    Ok(())
}
