//! The Linux capabilities the long-running daemon (and `--cleanup`) need, checked at start-up
//! so that a container started with too few fails at once with an error naming the missing
//! capability, instead of later with an iptables message such as "Permission denied (you must
//! be root)", or not at all.
//!
//! The set was found by experiment (tests/e2e_privileges.rs runs the daemon with exactly the
//! capabilities deploy/kube-proxy-rs.yaml adds, and with each of them removed in turn):
//!
//! * `CAP_NET_ADMIN`: iptables-nft, iptables-legacy, `conntrack` and `nfacct` all talk to
//!   netfilter, which refuses them without it.
//! * `CAP_NET_RAW`: iptables-legacy reads and writes its tables through a raw socket. Without
//!   it every legacy command fails with "Permission denied (you must be root)", and the backend
//!   detection, which counts a failed save as an empty one, would silently choose nft on a node
//!   whose kubelet uses legacy.
//!
//! nftables mode needs less (tests/e2e_privileges.rs runs it the same way with
//! deploy/kube-proxy-rs-nftables.yaml's set): `nft` and conntrack's netlink socket need
//! `CAP_NET_ADMIN` only (without it nft fails with "Operation not permitted"), so
//! [`REQUIRED_NFTABLES`] is that one. `CAP_NET_RAW` there serves one thing only, reading and
//! removing iptables mode's leftover rules in iptables-legacy ([`NFTABLES_LEGACY_LEFTOVERS`]):
//! without it the daemon says so at start-up and carries on (iptables-nft's leftovers are
//! still removed; `--cleanup`, which needs both, removes legacy ones).
//!
//! Nothing else is needed: the health and metrics ports are unprivileged (≥ 1024), raising the
//! soft open-file limit to the hard one needs no capability, sysctls are set by `--init-only`
//! in a privileged init container (the daemon only writes one when it differs), and lowering
//! `oom_score_adj` (which needs `CAP_SYS_RESOURCE`) is best effort, as upstream's is.
//!
//! The effective set is read from `/proc/self/status` (`CapEff`, and `CapAmb` with `Uid` for
//! the case below): two hex words are all that is needed, so no crate for it.

use std::fmt;
use std::path::PathBuf;

/// A Linux capability the daemon may need (numbers from `linux/capability.h`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Capability {
    NetAdmin,
    NetRaw,
}

impl Capability {
    /// The bit number in the kernel's capability masks.
    pub fn number(self) -> u32 {
        match self {
            Capability::NetAdmin => 12,
            Capability::NetRaw => 13,
        }
    }

    /// The name Kubernetes uses in `securityContext.capabilities` (`NET_ADMIN`).
    pub fn kubernetes_name(self) -> &'static str {
        match self {
            Capability::NetAdmin => "NET_ADMIN",
            Capability::NetRaw => "NET_RAW",
        }
    }

    /// Parses a Kubernetes name, with or without the `CAP_` prefix, in any case.
    pub fn from_name(name: &str) -> Option<Capability> {
        let upper = name.to_ascii_uppercase();
        let bare = upper.strip_prefix("CAP_").unwrap_or(&upper);
        [Capability::NetAdmin, Capability::NetRaw].into_iter().find(|c| c.kubernetes_name() == bare)
    }
}

impl fmt::Display for Capability {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CAP_{}", self.kubernetes_name())
    }
}

/// A capability and what it is needed for (the error message says both).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Requirement {
    pub capability: Capability,
    pub purpose: &'static str,
}

/// What the daemon and `--cleanup` need (see the module documentation for how it was found).
pub const REQUIRED: &[Requirement] = &[
    Requirement {
        capability: Capability::NetAdmin,
        purpose: "to program iptables rules, delete stale conntrack entries and create nfacct counters",
    },
    Requirement {
        capability: Capability::NetRaw,
        purpose: "by iptables-legacy, which opens a raw socket for every command (without it a legacy node's rules \
                  cannot be read and the wrong backend would be chosen)",
    },
];

/// What the daemon needs in nftables mode (see the module documentation).
pub const REQUIRED_NFTABLES: &[Requirement] = &[Requirement {
    capability: Capability::NetAdmin,
    purpose: "to program nftables rules (nft) and delete stale conntrack entries",
}];

/// In nftables mode, what `CAP_NET_RAW` is still good for: the leftovers of iptables mode in
/// iptables-legacy (a node that ran kube-proxy in iptables mode on iptables-legacy).
pub const NFTABLES_LEGACY_LEFTOVERS: Requirement = Requirement {
    capability: Capability::NetRaw,
    purpose: "to read and remove iptables mode's leftover rules in iptables-legacy",
};

/// The capability state of a process, as far as the check needs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcessCapabilities {
    pub effective: u64,
    /// Kept across `execve` by a non-root process (what the iptables children get).
    pub ambient: u64,
    pub effective_uid: u32,
}

impl ProcessCapabilities {
    /// Whether `capability` reaches the commands this process runs: effective here, and for a
    /// non-root process also ambient (otherwise `execve` drops it).
    fn passes_on(&self, capability: Capability) -> (bool, bool) {
        let bit = 1u64 << capability.number();
        let effective = self.effective & bit != 0;
        let inherited = self.effective_uid == 0 || self.ambient & bit != 0;
        (effective, inherited)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum CapabilityError {
    #[error("cannot check this process's capabilities: failed to read {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("cannot check this process's capabilities: {path} has no valid {field} line")]
    Parse { path: PathBuf, field: &'static str },
    #[error("{}", missing_message(.missing, *.effective_uid))]
    Missing { missing: Vec<(Requirement, bool)>, effective_uid: u32 },
}

/// One sentence per missing capability; `bool` says whether it is effective but not ambient.
fn missing_message(missing: &[(Requirement, bool)], uid: u32) -> String {
    let sentences: Vec<String> = missing
        .iter()
        .map(|(r, effective_only)| {
            let c = r.capability;
            if *effective_only {
                format!(
                    "capability {c} is effective but not ambient, so the iptables, nft and conntrack commands this \
                     process (uid {uid}) runs would not get it; it is needed {}; run as root (runAsUser: 0) or make it ambient",
                    r.purpose
                )
            } else {
                format!(
                    "missing capability {c}: needed {}; run with securityContext.capabilities.add: [{}]",
                    r.purpose,
                    c.kubernetes_name()
                )
            }
        })
        .collect();
    sentences.join("; ")
}

/// Reads the calling process's capabilities.
pub trait CapabilityProbe {
    fn read(&self) -> Result<ProcessCapabilities, CapabilityError>;
}

/// `/proc/self/status` (or another file in its format, for tests).
#[derive(Debug, Clone)]
pub(crate) struct ProcStatus {
    path: PathBuf,
}

impl Default for ProcStatus {
    fn default() -> Self {
        ProcStatus { path: PathBuf::from("/proc/self/status") }
    }
}

impl ProcStatus {
    #[cfg(test)]
    pub fn at(path: impl Into<PathBuf>) -> Self {
        ProcStatus { path: path.into() }
    }
}

impl CapabilityProbe for ProcStatus {
    fn read(&self) -> Result<ProcessCapabilities, CapabilityError> {
        let text = std::fs::read_to_string(&self.path)
            .map_err(|source| CapabilityError::Read { path: self.path.clone(), source })?;
        parse_status(&text).map_err(|field| CapabilityError::Parse { path: self.path.clone(), field })
    }
}

/// The `CapEff`, `CapAmb` and effective `Uid` of a `/proc/<pid>/status` text; on failure, the
/// field that is missing or malformed.
pub fn parse_status(text: &str) -> Result<ProcessCapabilities, &'static str> {
    let field = |name: &'static str| {
        text.lines().find_map(|l| l.strip_prefix(name).and_then(|rest| rest.strip_prefix(':'))).ok_or(name)
    };
    let mask = |name: &'static str| field(name).and_then(|v| u64::from_str_radix(v.trim(), 16).map_err(|_| name));
    let effective = mask("CapEff")?;
    // Kernels before 4.3 have no ambient set.
    let ambient = match field("CapAmb") {
        Ok(_) => mask("CapAmb")?,
        Err(_) => 0,
    };
    // "Uid:\treal\teffective\tsaved\tfs"
    let effective_uid =
        field("Uid").and_then(|v| v.split_whitespace().nth(1).and_then(|u| u.parse().ok()).ok_or("Uid"))?;
    Ok(ProcessCapabilities { effective, ambient, effective_uid })
}

/// `CAP_SYS_ADMIN`: what a privileged container has and an unprivileged one does not.
const CAP_SYS_ADMIN: u32 = 21;

/// Whether this process runs privileged (it has `CAP_SYS_ADMIN`, as kubeadm's kube-proxy
/// DaemonSet's `privileged: true` gives it); false when that cannot be read. Used to make
/// hints fit how the process was started.
pub fn this_process_is_privileged() -> bool {
    ProcStatus::default().read().is_ok_and(|c| c.effective & (1u64 << CAP_SYS_ADMIN) != 0)
}

/// A fixed answer, for tests.
#[cfg(any(test, feature = "testing"))]
#[derive(Debug, Clone)]
pub struct FakeProbe(pub Result<ProcessCapabilities, &'static str>);

#[cfg(any(test, feature = "testing"))]
impl CapabilityProbe for FakeProbe {
    fn read(&self) -> Result<ProcessCapabilities, CapabilityError> {
        self.0.map_err(|field| CapabilityError::Parse { path: PathBuf::from("fake"), field })
    }
}

/// Checks that every capability in `required` is there (and reaches child processes); the
/// error names each one that is not, and what it is for.
pub fn check(probe: &dyn CapabilityProbe, required: &[Requirement]) -> Result<(), CapabilityError> {
    let caps = probe.read()?;
    let missing: Vec<(Requirement, bool)> = required
        .iter()
        .filter_map(|r| match caps.passes_on(r.capability) {
            (true, true) => None,
            (true, false) => Some((*r, true)),
            (false, _) => Some((*r, false)),
        })
        .collect();
    if missing.is_empty() {
        tracing::debug!(effective = format!("{:016x}", caps.effective), "required capabilities present");
        Ok(())
    } else {
        Err(CapabilityError::Missing { missing, effective_uid: caps.effective_uid })
    }
}

/// [`check`] of [`REQUIRED`] (iptables mode, `--cleanup`) against this process.
pub fn check_this_process() -> Result<(), CapabilityError> {
    check(&ProcStatus::default(), REQUIRED)
}

/// [`check`] of `required` against this process.
pub fn check_this_process_for(required: &[Requirement]) -> Result<(), CapabilityError> {
    check(&ProcStatus::default(), required)
}

#[cfg(test)]
mod tests {
    use super::*;

    const NET_ADMIN: u64 = 1 << 12;
    const NET_RAW: u64 = 1 << 13;

    fn root_with(effective: u64) -> FakeProbe {
        FakeProbe(Ok(ProcessCapabilities { effective, ambient: 0, effective_uid: 0 }))
    }

    #[test]
    fn parses_proc_status() {
        let text = "Name:\tkube-proxy-rs\nUid:\t0\t0\t0\t0\nCapInh:\t0000000000000000\nCapPrm:\t0000000000003000\n\
                    CapEff:\t0000000000003000\nCapBnd:\t0000000000003000\nCapAmb:\t0000000000001000\n";
        assert_eq!(
            parse_status(text),
            Ok(ProcessCapabilities { effective: NET_ADMIN | NET_RAW, ambient: NET_ADMIN, effective_uid: 0 })
        );
        // The effective uid is the second column.
        let text = "Uid:\t0\t1000\t0\t0\nCapEff:\t0000000000001000\n";
        assert_eq!(
            parse_status(text),
            Ok(ProcessCapabilities { effective: NET_ADMIN, ambient: 0, effective_uid: 1000 })
        );
        assert_eq!(parse_status("Uid:\t0\t0\t0\t0\n"), Err("CapEff"));
        assert_eq!(parse_status("Uid:\t0\t0\t0\t0\nCapEff:\tzz\n"), Err("CapEff"));
        assert_eq!(parse_status("Uid:\t0\t0\t0\t0\nCapEff:\t0\nCapAmb:\t-1\n"), Err("CapAmb"));
        assert_eq!(parse_status("CapEff:\t0\n"), Err("Uid"));
    }

    #[test]
    fn reads_this_process() {
        // Whatever this process holds, the file parses and names its own uid.
        let caps = ProcStatus::default().read().expect("/proc/self/status");
        let uid = std::fs::read_to_string("/proc/self/status")
            .unwrap()
            .lines()
            .find_map(|l| l.strip_prefix("Uid:").map(|v| v.split_whitespace().nth(1).unwrap().parse::<u32>().unwrap()))
            .unwrap();
        assert_eq!(caps.effective_uid, uid);
        let err = ProcStatus::at("/nonexistent/status").read().unwrap_err();
        assert!(err.to_string().contains("failed to read /nonexistent/status"), "{err}");
    }

    #[test]
    fn the_full_set_passes() {
        check(&root_with(NET_ADMIN | NET_RAW), REQUIRED).expect("both present");
        check(&root_with(u64::MAX), REQUIRED).expect("privileged");
    }

    #[test]
    fn each_missing_capability_is_named_with_its_purpose_and_the_fix() {
        let err = check(&root_with(NET_RAW), REQUIRED).unwrap_err().to_string();
        assert!(err.starts_with("missing capability CAP_NET_ADMIN: needed to program iptables rules"), "{err}");
        assert!(err.ends_with("securityContext.capabilities.add: [NET_ADMIN]"), "{err}");
        assert!(!err.contains("CAP_NET_RAW"), "{err}");

        let err = check(&root_with(NET_ADMIN), REQUIRED).unwrap_err().to_string();
        assert!(err.starts_with("missing capability CAP_NET_RAW: needed by iptables-legacy"), "{err}");
        assert!(err.ends_with("[NET_RAW]"), "{err}");

        let err = check(&root_with(0), REQUIRED).unwrap_err().to_string();
        assert!(err.contains("missing capability CAP_NET_ADMIN") && err.contains("missing capability CAP_NET_RAW"));
    }

    #[test]
    fn a_non_root_process_needs_them_ambient() {
        let probe = |ambient| {
            FakeProbe(Ok(ProcessCapabilities { effective: NET_ADMIN | NET_RAW, ambient, effective_uid: 1000 }))
        };
        check(&probe(NET_ADMIN | NET_RAW), REQUIRED).expect("ambient: children get them");
        let err = check(&probe(NET_ADMIN), REQUIRED).unwrap_err().to_string();
        assert!(err.starts_with("capability CAP_NET_RAW is effective but not ambient"), "{err}");
        assert!(err.contains("(uid 1000)"), "{err}");
    }

    #[test]
    fn an_unreadable_status_is_an_error_not_a_pass() {
        let err = check(&FakeProbe(Err("CapEff")), REQUIRED).unwrap_err();
        assert!(matches!(err, CapabilityError::Parse { field: "CapEff", .. }), "{err}");
    }

    #[test]
    fn nftables_mode_needs_net_admin_only() {
        check(&root_with(NET_ADMIN), REQUIRED_NFTABLES).expect("NET_ADMIN is enough");
        let err = check(&root_with(NET_RAW), REQUIRED_NFTABLES).unwrap_err().to_string();
        assert_eq!(
            err,
            "missing capability CAP_NET_ADMIN: needed to program nftables rules (nft) and delete stale conntrack \
             entries; run with securityContext.capabilities.add: [NET_ADMIN]"
        );
        let err = check(&root_with(NET_ADMIN), &[NFTABLES_LEGACY_LEFTOVERS]).unwrap_err().to_string();
        assert!(err.starts_with("missing capability CAP_NET_RAW: needed to read and remove iptables mode's"), "{err}");
    }

    #[test]
    fn names() {
        assert_eq!(Capability::NetAdmin.to_string(), "CAP_NET_ADMIN");
        assert_eq!(Capability::from_name("NET_RAW"), Some(Capability::NetRaw));
        assert_eq!(Capability::from_name("cap_net_admin"), Some(Capability::NetAdmin));
        assert_eq!(Capability::from_name("SYS_ADMIN"), None);
    }
}
