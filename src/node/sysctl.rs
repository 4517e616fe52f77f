//! Kernel parameters kube-proxy reads and sets: the [`Sysctl`] trait over `/proc/sys` (with a
//! fake for tests), and the start-up steps upstream performs with it — `route_localnet` for
//! localhost NodePorts, the conntrack table size and timeouts (`conntrack.*` in the
//! configuration), the `tcp_be_liberal` probe that decides whether INVALID packets are dropped,
//! and the bridge-netfilter warning.
//!
//! Names use the slash form upstream uses (`net/ipv4/conf/all/route_localnet`); the dotted form
//! is accepted too. Most of these settings are per network namespace. This module only reads
//! and writes what it is asked to; deciding what is fatal is the caller's business (upstream
//! treats every failure here as fatal except a read-only `/sys`, which only raises an event).

#[cfg(any(test, feature = "testing"))]
use std::collections::{BTreeMap, BTreeSet};
use std::io;
use std::path::PathBuf;
#[cfg(any(test, feature = "testing"))]
use std::sync::{Mutex, MutexGuard, PoisonError};

use crate::compat::Release;
use crate::config::ConntrackSettings;

pub(crate) const ROUTE_LOCALNET: &str = "net/ipv4/conf/all/route_localnet";
pub(crate) const BRIDGE_NF_CALL_IPTABLES: &str = "net/bridge/bridge-nf-call-iptables";
pub(crate) const NF_CONNTRACK_MAX: &str = "net/netfilter/nf_conntrack_max";
pub(crate) const NF_CONNTRACK_TCP_TIMEOUT_ESTABLISHED: &str = "net/netfilter/nf_conntrack_tcp_timeout_established";
pub(crate) const NF_CONNTRACK_TCP_TIMEOUT_CLOSE_WAIT: &str = "net/netfilter/nf_conntrack_tcp_timeout_close_wait";
pub(crate) const NF_CONNTRACK_TCP_BE_LIBERAL: &str = "net/netfilter/nf_conntrack_tcp_be_liberal";
pub(crate) const NF_CONNTRACK_UDP_TIMEOUT: &str = "net/netfilter/nf_conntrack_udp_timeout";
pub(crate) const NF_CONNTRACK_UDP_TIMEOUT_STREAM: &str = "net/netfilter/nf_conntrack_udp_timeout_stream";

/// The conntrack hash table size (a module parameter in sysfs, not a sysctl).
pub(crate) const CONNTRACK_HASHSIZE_PATH: &str = "/sys/module/nf_conntrack/parameters/hashsize";

/// Reason of the Node event upstream raises when `/sys` is read-only.
pub(crate) const READ_ONLY_SYSFS_REASON: &str = "readOnlySysFS";
/// Message of that event.
pub(crate) const READ_ONLY_SYSFS_MESSAGE: &str = "CRI error: /sys is read-only: cannot modify conntrack limits, problems may arise later (If running Docker, see docker issue #24000)";

#[derive(Debug, thiserror::Error)]
pub enum SysctlError {
    #[error("invalid sysctl name {0:?}")]
    InvalidName(String),
    #[error("failed to read sysctl {name}: {source}")]
    Read { name: String, source: io::Error },
    #[error("sysctl {name} holds {value:?}, not an integer")]
    NotAnInteger { name: String, value: String },
    #[error("failed to set sysctl {name} to {value}: {source}{}", not_permitted_hint(.source, *.privileged))]
    Write {
        name: String,
        value: i64,
        source: io::Error,
        /// The process had `CAP_SYS_ADMIN` (a privileged container) when it was refused.
        privileged: bool,
    },
    #[error("failed to read {path}: {source}")]
    ReadFile { path: PathBuf, source: io::Error },
    #[error("{path} holds {value:?}, not an integer")]
    FileNotAnInteger { path: PathBuf, value: String },
    #[error("failed to write {value} to {path}: {source}{}", not_permitted_hint(.source, *.privileged))]
    WriteFile { path: PathBuf, value: i64, source: io::Error, privileged: bool },
    #[error("no sysfs mounted according to {0}")]
    NoSysfs(PathBuf),
}

/// Said after a refused write, fitting how the process was started. Unprivileged (our
/// least-privilege DaemonSet), `/proc/sys` is read-only (EROFS) and module parameters need
/// more than root's uid (EACCES, EPERM): the init container makes these settings. Privileged
/// (kubeadm's DaemonSet runs kube-proxy so), a refusal means the setting is not this network
/// namespace's to change: a nested or user-namespaced node, where the host owns it.
fn not_permitted_hint(source: &io::Error, privileged: bool) -> &'static str {
    // EPERM and EACCES are both PermissionDenied.
    if !matches!(source.kind(), io::ErrorKind::PermissionDenied | io::ErrorKind::ReadOnlyFilesystem) {
        ""
    } else if privileged {
        " (refused although this process is privileged: on a nested or user-namespaced node, such as kind or \
         a node inside a container, this kernel setting belongs to the host; set it there, or set \
         conntrack.maxPerCore to 0 (and the other conntrack fields to 0s) so kube-proxy leaves it alone)"
    } else {
        " (not permitted in this container: kernel settings are made by `kube-proxy-rs --init-only` in a \
         privileged init container, as deploy/kube-proxy-rs.yaml does; see docs/operations.md, \"Privileges\")"
    }
}

pub type Result<T, E = SysctlError> = std::result::Result<T, E>;

/// Reads and writes integer kernel parameters (upstream `utilsysctl.Interface`).
pub trait Sysctl: Send + Sync {
    fn get(&self, name: &str) -> Result<i64>;
    fn set(&self, name: &str, value: i64) -> Result<()>;
}

/// The slash form of a sysctl name, refusing anything that could leave the sysctl tree.
fn normalize(name: &str) -> Result<String> {
    let slashed = if name.contains('/') { name.to_string() } else { name.replace('.', "/") };
    let valid = slashed.split('/').all(|part| !part.is_empty() && part != "." && part != "..");
    if valid { Ok(slashed) } else { Err(SysctlError::InvalidName(name.to_string())) }
}

fn parse_int(text: &str) -> Option<i64> {
    text.trim_matches(|c| c == ' ' || c == '\n').parse().ok()
}

/// Sysctls under `/proc/sys` (of the calling thread's network namespace).
#[derive(Debug, Clone)]
pub(crate) struct ProcSysctl {
    root: PathBuf,
}

impl Default for ProcSysctl {
    fn default() -> Self {
        ProcSysctl { root: PathBuf::from("/proc/sys") }
    }
}

impl ProcSysctl {
    pub fn new() -> Self {
        ProcSysctl::default()
    }

    /// Sysctls under another root (tests).
    #[cfg(test)]
    pub(crate) fn with_root(root: impl Into<PathBuf>) -> Self {
        ProcSysctl { root: root.into() }
    }
}

impl Sysctl for ProcSysctl {
    fn get(&self, name: &str) -> Result<i64> {
        let rel = normalize(name)?;
        let text = std::fs::read_to_string(self.root.join(&rel))
            .map_err(|source| SysctlError::Read { name: rel.clone(), source })?;
        parse_int(&text).ok_or(SysctlError::NotAnInteger { name: rel, value: text })
    }

    fn set(&self, name: &str, value: i64) -> Result<()> {
        let rel = normalize(name)?;
        std::fs::write(self.root.join(&rel), value.to_string()).map_err(|source| SysctlError::Write {
            name: rel,
            value,
            source,
            privileged: crate::node::capabilities::this_process_is_privileged(),
        })
    }
}

/// An in-memory [`Sysctl`] that records writes.
#[cfg(any(test, feature = "testing"))]
#[derive(Debug, Default)]
pub struct FakeSysctl {
    values: Mutex<BTreeMap<String, i64>>,
    writes: Mutex<Vec<(String, i64)>>,
    read_only: Mutex<BTreeSet<String>>,
}

#[cfg(any(test, feature = "testing"))]
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

#[cfg(any(test, feature = "testing"))]
impl FakeSysctl {
    pub fn new() -> Self {
        FakeSysctl::default()
    }

    /// A fake holding these values; other names do not exist.
    pub fn with(values: &[(&str, i64)]) -> Self {
        let fake = FakeSysctl::new();
        lock(&fake.values).extend(values.iter().map(|(k, v)| (k.to_string(), *v)));
        fake
    }

    /// Makes writes to `name` fail with "permission denied".
    pub fn make_read_only(&self, name: &str) {
        lock(&self.read_only).insert(name.to_string());
    }

    pub fn value(&self, name: &str) -> Option<i64> {
        lock(&self.values).get(name).copied()
    }

    /// Every successful write, in order.
    pub fn writes(&self) -> Vec<(String, i64)> {
        lock(&self.writes).clone()
    }
}

#[cfg(any(test, feature = "testing"))]
impl Sysctl for FakeSysctl {
    fn get(&self, name: &str) -> Result<i64> {
        let name = normalize(name)?;
        self.value(&name).ok_or_else(|| SysctlError::Read { name, source: io::ErrorKind::NotFound.into() })
    }

    fn set(&self, name: &str, value: i64) -> Result<()> {
        let name = normalize(name)?;
        if lock(&self.read_only).contains(&name) {
            return Err(SysctlError::Write {
                name,
                value,
                source: io::ErrorKind::PermissionDenied.into(),
                privileged: false,
            });
        }
        lock(&self.values).insert(name.clone(), value);
        lock(&self.writes).push((name, value));
        Ok(())
    }
}

/// Sets `name` to `value` unless it already holds it (upstream `EnsureSysctl`; an unreadable
/// value counts as different).
pub(crate) fn ensure_sysctl(sysctl: &dyn Sysctl, name: &str, value: i64) -> Result<()> {
    let before = sysctl.get(name).ok();
    if before == Some(value) {
        return Ok(());
    }
    sysctl.set(name, value)?;
    tracing::info!(name, before = ?before, after = value, "changed sysctl");
    Ok(())
}

/// `route_localnet=1`, which NodePorts on 127.0.0.1 need (only when localhost NodePorts are
/// on and nodePortAddresses includes loopback).
pub(crate) fn ensure_route_localnet(sysctl: &dyn Sysctl) -> Result<()> {
    tracing::info!(
        "setting route_localnet=1 to allow node-ports on localhost; to change this either disable \
         iptables.localhostNodePorts (--iptables-localhost-nodeports) or set nodePortAddresses \
         (--nodeport-addresses) to filter loopback addresses"
    );
    ensure_sysctl(sysctl, ROUTE_LOCALNET, 1)
}

/// Whether `nf_conntrack_tcp_be_liberal` is set, in which case conntrack never marks
/// out-of-window packets INVALID and the rule dropping them is not needed.
pub(crate) fn conntrack_tcp_be_liberal(sysctl: &dyn Sysctl) -> bool {
    let liberal = sysctl.get(NF_CONNTRACK_TCP_BE_LIBERAL).is_ok_and(|v| v != 0);
    if liberal {
        tracing::info!("nf_conntrack_tcp_be_liberal set, not installing DROP rules for INVALID packets");
    }
    liberal
}

/// Warns when bridged traffic bypasses iptables (`br_netfilter` missing or
/// `bridge-nf-call-iptables` off). Returns false when it warned. Upstream 1.29 does this check
/// in IPVS mode only; iptables mode is affected just the same.
pub(crate) fn check_bridge_nf_call_iptables(sysctl: &dyn Sysctl) -> bool {
    match sysctl.get(BRIDGE_NF_CALL_IPTABLES) {
        Ok(v) if v != 1 => {
            tracing::warn!(
                value = v,
                "missing br-netfilter module or unset sysctl br-nf-call-iptables, proxy may not work as intended"
            );
            false
        }
        _ => true,
    }
}

/// The conntrack hash table size and whether sysfs can be written (upstream's
/// `realConntracker` internals), behind a trait so tests need no real `/sys`.
pub(crate) trait ConntrackSysfs: Send + Sync {
    fn hashsize(&self) -> Result<i64>;
    fn set_hashsize(&self, value: i64) -> Result<()>;
    /// Whether the first sysfs mount is read-write.
    fn sysfs_writable(&self) -> Result<bool>;
}

/// The real `/sys/module/nf_conntrack/parameters/hashsize`, with `/proc/mounts` to tell
/// whether sysfs is writable.
#[derive(Debug, Clone)]
pub(crate) struct RealConntrackSysfs {
    pub hashsize_path: PathBuf,
    pub mounts_path: PathBuf,
}

impl Default for RealConntrackSysfs {
    fn default() -> Self {
        RealConntrackSysfs { hashsize_path: CONNTRACK_HASHSIZE_PATH.into(), mounts_path: "/proc/mounts".into() }
    }
}

impl ConntrackSysfs for RealConntrackSysfs {
    fn hashsize(&self) -> Result<i64> {
        let path = &self.hashsize_path;
        let text =
            std::fs::read_to_string(path).map_err(|source| SysctlError::ReadFile { path: path.clone(), source })?;
        parse_int(&text).ok_or_else(|| SysctlError::FileNotAnInteger { path: path.clone(), value: text })
    }

    fn set_hashsize(&self, value: i64) -> Result<()> {
        let path = &self.hashsize_path;
        std::fs::write(path, value.to_string()).map_err(|source| SysctlError::WriteFile {
            path: path.clone(),
            value,
            source,
            privileged: crate::node::capabilities::this_process_is_privileged(),
        })
    }

    fn sysfs_writable(&self) -> Result<bool> {
        let mounts = std::fs::read_to_string(&self.mounts_path)
            .map_err(|source| SysctlError::ReadFile { path: self.mounts_path.clone(), source })?;
        sysfs_writable_in(&mounts).ok_or_else(|| SysctlError::NoSysfs(self.mounts_path.clone()))
    }
}

/// Whether the first `sysfs` mount in a `/proc/mounts` listing is `rw`; `None` without one.
pub(crate) fn sysfs_writable_in(mounts: &str) -> Option<bool> {
    mounts.lines().find_map(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        (fields.get(2) == Some(&"sysfs")).then(|| fields.get(3).and_then(|o| o.split(',').next()) == Some("rw"))
    })
}

/// Number of CPUs for `conntrack.maxPerCore`: the online CPUs sysfs lists (not limited by
/// cgroups or affinity, like upstream), else what the standard library sees.
pub(crate) fn detect_num_cpu() -> usize {
    std::fs::read_to_string("/sys/devices/system/cpu/online")
        .ok()
        .and_then(|s| parse_cpu_list(&s))
        .filter(|n| *n > 0)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, usize::from))
}

/// Counts the CPUs in a kernel CPU list such as `0-3,6,8-9`.
pub(crate) fn parse_cpu_list(list: &str) -> Option<usize> {
    let mut count = 0usize;
    for part in list.trim().split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b): (usize, usize) = (a.parse().ok()?, b.parse().ok()?);
                count += b.checked_sub(a)? + 1;
            }
            None => {
                part.parse::<usize>().ok()?;
                count += 1;
            }
        }
    }
    Some(count)
}

/// `nf_conntrack_max` to set: `maxPerCore × cpus` (from 1.36 at most
/// [`crate::compat::CONNTRACK_MAX_CAP`]), at least `min`; `None` when `maxPerCore` is 0
/// (leave the kernel's value alone).
pub(crate) fn conntrack_max(settings: &ConntrackSettings, num_cpus: usize, release: Release) -> Option<i64> {
    if settings.max_per_core == 0 {
        return None;
    }
    let cpus = i64::try_from(num_cpus).unwrap_or(i64::MAX);
    let mut scaled = i64::from(settings.max_per_core).saturating_mul(cpus);
    if release.caps_computed_conntrack_max() {
        scaled = scaled.min(crate::compat::CONNTRACK_MAX_CAP);
    }
    let floor = i64::from(settings.min);
    Some(if scaled > floor { scaled } else { floor })
}

/// What [`apply_conntrack_settings`] could not do without failing.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ConntrackOutcome {
    /// The hash table needed resizing but `/sys` is read-only: raise a Warning event on the
    /// Node with [`READ_ONLY_SYSFS_REASON`] and [`READ_ONLY_SYSFS_MESSAGE`].
    pub read_only_sysfs: bool,
}

/// Applies the `conntrack` configuration as upstream does at start-up: table size (and hash
/// size, a quarter of it, when smaller), TCP established and close-wait timeouts, liberal TCP
/// tracking when asked, UDP timeouts. Zero values leave the kernel alone; each sysctl is written
/// only when it differs. Stops at the first error.
pub(crate) fn apply_conntrack_settings(
    sysctl: &dyn Sysctl,
    sysfs: &dyn ConntrackSysfs,
    settings: &ConntrackSettings,
    num_cpus: usize,
    release: Release,
) -> Result<ConntrackOutcome> {
    let mut outcome = ConntrackOutcome::default();
    if let Some(max) = conntrack_max(settings, num_cpus, release) {
        tracing::info!(nf_conntrack_max = max, "setting nf_conntrack_max");
        ensure_sysctl(sysctl, NF_CONNTRACK_MAX, max)?;
        // Resizing the hash table is refused outside the initial network namespace, so it is
        // only attempted when the table is too small.
        let wanted = max / 4;
        if sysfs.hashsize()? < wanted {
            if sysfs.sysfs_writable()? {
                tracing::info!(hashsize = wanted, "setting conntrack hashsize");
                sysfs.set_hashsize(wanted)?;
            } else {
                tracing::error!("sysfs is not writable: cannot resize the conntrack hash table");
                outcome.read_only_sysfs = true;
            }
        }
    }
    let seconds = |d: std::time::Duration| i64::try_from(d.as_secs()).unwrap_or(i64::MAX);
    let timeouts = [
        (NF_CONNTRACK_TCP_TIMEOUT_ESTABLISHED, settings.tcp_established_timeout),
        (NF_CONNTRACK_TCP_TIMEOUT_CLOSE_WAIT, settings.tcp_close_wait_timeout),
    ];
    for (name, timeout) in timeouts {
        if !timeout.is_zero() {
            ensure_sysctl(sysctl, name, seconds(timeout))?;
        }
    }
    if settings.tcp_be_liberal {
        ensure_sysctl(sysctl, NF_CONNTRACK_TCP_BE_LIBERAL, 1)?;
    }
    let udp = [
        (NF_CONNTRACK_UDP_TIMEOUT, settings.udp_timeout),
        (NF_CONNTRACK_UDP_TIMEOUT_STREAM, settings.udp_stream_timeout),
    ];
    for (name, timeout) in udp {
        if !timeout.is_zero() {
            ensure_sysctl(sysctl, name, seconds(timeout))?;
        }
    }
    Ok(outcome)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn settings() -> ConntrackSettings {
        ConntrackSettings {
            max_per_core: 32_768,
            min: 131_072,
            tcp_established_timeout: Duration::from_secs(86_400),
            tcp_close_wait_timeout: Duration::from_secs(3_600),
            tcp_be_liberal: false,
            udp_timeout: Duration::ZERO,
            udp_stream_timeout: Duration::ZERO,
        }
    }

    #[derive(Debug)]
    struct FakeSysfs {
        hashsize: Mutex<i64>,
        writable: bool,
    }

    impl ConntrackSysfs for FakeSysfs {
        fn hashsize(&self) -> Result<i64> {
            Ok(*lock(&self.hashsize))
        }
        fn set_hashsize(&self, value: i64) -> Result<()> {
            *lock(&self.hashsize) = value;
            Ok(())
        }
        fn sysfs_writable(&self) -> Result<bool> {
            Ok(self.writable)
        }
    }

    fn sysfs(hashsize: i64, writable: bool) -> FakeSysfs {
        FakeSysfs { hashsize: Mutex::new(hashsize), writable }
    }

    #[test]
    fn names() {
        assert_eq!(normalize("net.ipv4.conf.all.route_localnet").unwrap(), ROUTE_LOCALNET);
        assert_eq!(normalize(ROUTE_LOCALNET).unwrap(), ROUTE_LOCALNET);
        assert_eq!(normalize("net/ipv4/conf/eth0.100/rp_filter").unwrap(), "net/ipv4/conf/eth0.100/rp_filter");
        for bad in ["", "/etc/passwd", "net/../../etc/passwd", "net/./x"] {
            assert!(matches!(normalize(bad), Err(SysctlError::InvalidName(_))), "{bad}");
        }
    }

    #[test]
    fn ensure_writes_only_on_change() {
        let fake = FakeSysctl::with(&[(ROUTE_LOCALNET, 1)]);
        ensure_route_localnet(&fake).unwrap();
        assert!(fake.writes().is_empty());

        let fake = FakeSysctl::with(&[(ROUTE_LOCALNET, 0)]);
        ensure_route_localnet(&fake).unwrap();
        assert_eq!(fake.writes(), vec![(ROUTE_LOCALNET.to_string(), 1)]);

        // Unreadable counts as different.
        let fake = FakeSysctl::new();
        ensure_sysctl(&fake, "net.ipv4.ip_forward", 1).unwrap();
        assert_eq!(fake.value("net/ipv4/ip_forward"), Some(1));

        let fake = FakeSysctl::with(&[(ROUTE_LOCALNET, 0)]);
        fake.make_read_only(ROUTE_LOCALNET);
        let err = ensure_route_localnet(&fake).unwrap_err();
        assert!(err.to_string().starts_with("failed to set sysctl net/ipv4/conf/all/route_localnet to 1: "), "{err}");
    }

    #[test]
    fn probes() {
        assert!(!conntrack_tcp_be_liberal(&FakeSysctl::new()));
        assert!(!conntrack_tcp_be_liberal(&FakeSysctl::with(&[(NF_CONNTRACK_TCP_BE_LIBERAL, 0)])));
        assert!(conntrack_tcp_be_liberal(&FakeSysctl::with(&[(NF_CONNTRACK_TCP_BE_LIBERAL, 1)])));
        assert!(check_bridge_nf_call_iptables(&FakeSysctl::new()), "absent module: nothing to say");
        assert!(check_bridge_nf_call_iptables(&FakeSysctl::with(&[(BRIDGE_NF_CALL_IPTABLES, 1)])));
        assert!(!check_bridge_nf_call_iptables(&FakeSysctl::with(&[(BRIDGE_NF_CALL_IPTABLES, 0)])));
    }

    #[test]
    fn conntrack_max_scales_with_cpus() {
        let s = settings();
        let r = Release::V1_35;
        assert_eq!(conntrack_max(&s, 2, r), Some(131_072), "min wins over 2 × 32768");
        assert_eq!(conntrack_max(&s, 8, r), Some(262_144));
        assert_eq!(conntrack_max(&ConntrackSettings { max_per_core: 0, ..s.clone() }, 8, r), None);
        assert_eq!(conntrack_max(&ConntrackSettings { min: 0, ..s.clone() }, 1, r), Some(32_768));
        // From 1.36 the computed value is capped at 1Mi (PR #137002); a larger min still wins.
        assert_eq!(conntrack_max(&s, 64, Release::V1_35), Some(2_097_152));
        assert_eq!(conntrack_max(&s, 64, Release::V1_36), Some(1_048_576));
        assert_eq!(conntrack_max(&ConntrackSettings { min: 2_000_000, ..s }, 64, Release::V1_36), Some(2_000_000));
    }

    #[test]
    fn applies_upstream_defaults() {
        let fake = FakeSysctl::with(&[
            (NF_CONNTRACK_MAX, 65_536),
            (NF_CONNTRACK_TCP_TIMEOUT_ESTABLISHED, 432_000),
            (NF_CONNTRACK_TCP_TIMEOUT_CLOSE_WAIT, 3_600),
            (NF_CONNTRACK_UDP_TIMEOUT, 30),
        ]);
        let fs = sysfs(16_384, true);
        let outcome = apply_conntrack_settings(&fake, &fs, &settings(), 8, Release::NEWEST).unwrap();
        assert_eq!(outcome, ConntrackOutcome::default());
        // close_wait already right: not written; UDP and liberal untouched.
        assert_eq!(
            fake.writes(),
            vec![(NF_CONNTRACK_MAX.to_string(), 262_144), (NF_CONNTRACK_TCP_TIMEOUT_ESTABLISHED.to_string(), 86_400)]
        );
        assert_eq!(*lock(&fs.hashsize), 65_536);
    }

    #[test]
    fn applies_optional_settings() {
        let fake = FakeSysctl::new();
        let s = ConntrackSettings {
            max_per_core: 0,
            tcp_established_timeout: Duration::ZERO,
            tcp_close_wait_timeout: Duration::from_millis(1_500),
            tcp_be_liberal: true,
            udp_timeout: Duration::from_secs(30),
            udp_stream_timeout: Duration::from_secs(120),
            ..settings()
        };
        let fs = sysfs(0, false);
        apply_conntrack_settings(&fake, &fs, &s, 4, Release::NEWEST).unwrap();
        assert_eq!(
            fake.writes(),
            vec![
                (NF_CONNTRACK_TCP_TIMEOUT_CLOSE_WAIT.to_string(), 1),
                (NF_CONNTRACK_TCP_BE_LIBERAL.to_string(), 1),
                (NF_CONNTRACK_UDP_TIMEOUT.to_string(), 30),
                (NF_CONNTRACK_UDP_TIMEOUT_STREAM.to_string(), 120),
            ]
        );
        assert_eq!(*lock(&fs.hashsize), 0, "no table size asked for: hashsize untouched");
    }

    #[test]
    fn hashsize_is_left_alone_when_big_enough_and_read_only_sysfs_is_not_fatal() {
        let fake = FakeSysctl::new();
        let fs = sysfs(100_000, false);
        let outcome = apply_conntrack_settings(&fake, &fs, &settings(), 8, Release::NEWEST).unwrap();
        assert!(!outcome.read_only_sysfs, "no resize needed, so sysfs is not even checked");

        let fake = FakeSysctl::new();
        let fs = sysfs(1_000, false);
        let outcome = apply_conntrack_settings(&fake, &fs, &settings(), 8, Release::NEWEST).unwrap();
        assert!(outcome.read_only_sysfs);
        assert_eq!(*lock(&fs.hashsize), 1_000);
        // The timeouts are still applied.
        assert_eq!(fake.value(NF_CONNTRACK_TCP_TIMEOUT_ESTABLISHED), Some(86_400));
    }

    #[test]
    fn failures_stop_and_name_the_sysctl() {
        let fake = FakeSysctl::new();
        fake.make_read_only(NF_CONNTRACK_TCP_TIMEOUT_ESTABLISHED);
        let err = apply_conntrack_settings(&fake, &sysfs(1 << 20, true), &settings(), 8, Release::NEWEST).unwrap_err();
        assert!(err.to_string().contains("nf_conntrack_tcp_timeout_established"), "{err}");
        assert_eq!(fake.value(NF_CONNTRACK_TCP_TIMEOUT_CLOSE_WAIT), None, "stopped at the first error");
        // A refusal says where kernel settings are made instead.
        assert!(err.to_string().contains("not permitted in this container") && err.to_string().contains("--init-only"));
    }

    #[test]
    fn only_refusals_get_the_privilege_hint() {
        let write = |kind: io::ErrorKind, privileged: bool| {
            SysctlError::Write { name: ROUTE_LOCALNET.into(), value: 1, source: kind.into(), privileged }.to_string()
        };
        for refused in [io::ErrorKind::ReadOnlyFilesystem, io::ErrorKind::PermissionDenied] {
            let text = write(refused, false);
            assert!(text.starts_with("failed to set sysctl net/ipv4/conf/all/route_localnet to 1: "), "{text}");
            assert!(text.contains("privileged init container"), "{text}");
            // Privileged, as kubeadm runs kube-proxy: no init container to point at.
            let text = write(refused, true);
            assert!(!text.contains("init") && text.contains("nested or user-namespaced node"), "{text}");
        }
        assert!(!write(io::ErrorKind::NotFound, false).contains("init container"));
        let file = SysctlError::WriteFile {
            path: CONNTRACK_HASHSIZE_PATH.into(),
            value: 4,
            source: io::Error::from_raw_os_error(1), // EPERM
            privileged: false,
        };
        assert!(file.to_string().contains("privileged init container"), "{file}");
    }

    #[test]
    fn mounts_and_cpu_lists() {
        let mounts = "proc /proc proc rw,nosuid 0 0\nsysfs /sys sysfs ro,nosuid,nodev 0 0\nsysfs /x sysfs rw 0 0\n";
        assert_eq!(sysfs_writable_in(mounts), Some(false));
        assert_eq!(sysfs_writable_in("sysfs /sys sysfs rw,relatime 0 0\n"), Some(true));
        assert_eq!(sysfs_writable_in("proc /proc proc rw 0 0\n"), None);

        assert_eq!(parse_cpu_list("0-3\n"), Some(4));
        assert_eq!(parse_cpu_list("0-3,6,8-9"), Some(7));
        assert_eq!(parse_cpu_list("0"), Some(1));
        assert_eq!(parse_cpu_list("3-1"), None);
        assert_eq!(parse_cpu_list("x"), None);
        assert!(detect_num_cpu() >= 1);
    }

    /// A scratch directory under the system temp dir, removed on drop.
    struct Scratch(PathBuf);

    impl Scratch {
        fn new(tag: &str) -> Scratch {
            let dir = std::env::temp_dir().join(format!("kube-proxy-rs-sysctl-{tag}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            Scratch(dir)
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn proc_sysctl_reads_and_writes_files() {
        let scratch = Scratch::new("files");
        let dir = scratch.0.join("net/ipv4/conf/all");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("route_localnet"), "0\n").unwrap();
        std::fs::write(dir.join("weird"), "abc\n").unwrap();
        let sysctl = ProcSysctl::with_root(&scratch.0);

        assert_eq!(sysctl.get(ROUTE_LOCALNET).unwrap(), 0);
        ensure_route_localnet(&sysctl).unwrap();
        assert_eq!(std::fs::read_to_string(dir.join("route_localnet")).unwrap(), "1");
        assert_eq!(sysctl.get("net.ipv4.conf.all.route_localnet").unwrap(), 1);

        assert!(matches!(sysctl.get("net/ipv4/conf/all/weird"), Err(SysctlError::NotAnInteger { .. })));
        let err = sysctl.get("net/ipv4/missing").unwrap_err();
        assert!(err.to_string().starts_with("failed to read sysctl net/ipv4/missing: "), "{err}");
        assert!(matches!(sysctl.set("../escape", 1), Err(SysctlError::InvalidName(_))));

        let hashsize = scratch.0.join("hashsize");
        std::fs::write(&hashsize, "16384\n").unwrap();
        let mounts = scratch.0.join("mounts");
        std::fs::write(&mounts, "sysfs /sys sysfs rw,nosuid 0 0\n").unwrap();
        let fs = RealConntrackSysfs { hashsize_path: hashsize.clone(), mounts_path: mounts };
        assert_eq!(fs.hashsize().unwrap(), 16_384);
        assert!(fs.sysfs_writable().unwrap());
        fs.set_hashsize(65_536).unwrap();
        assert_eq!(std::fs::read_to_string(&hashsize).unwrap(), "65536");
    }

    const NETNS_CHILD_ENV: &str = "KUBE_PROXY_RS_SYSCTL_NETNS_CHILD";

    fn is_root() -> bool {
        std::fs::read_to_string("/proc/self/status").is_ok_and(|s| {
            s.lines().find(|l| l.starts_with("Uid:")).and_then(|l| l.split_whitespace().nth(2)) == Some("0")
        })
    }

    /// Writes real per-namespace sysctls inside a fresh network namespace: this test binary is
    /// re-run under `unshare --net` to execute [`netns_child`].
    #[test]
    fn real_sysctls_in_a_fresh_network_namespace() {
        if !is_root() {
            // Under CI (root by contract) a skip would hide a broken runner.
            assert!(std::env::var_os("CI").is_none_or(|v| v.is_empty()), "needs root for unshare --net, and CI is set");
            eprintln!("skipping real_sysctls_in_a_fresh_network_namespace: needs root for unshare --net");
            return;
        }
        let exe = std::env::current_exe().unwrap();
        let out = std::process::Command::new("unshare")
            .arg("--net")
            .arg(&exe)
            .args(["--exact", "node::sysctl::tests::netns_child", "--ignored", "--nocapture", "--test-threads=1"])
            .env(NETNS_CHILD_ENV, "1")
            .output()
            .expect("failed to run unshare (util-linux)");
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "child failed:\n{stdout}\n{stderr}");
        assert!(stdout.contains("1 passed"), "child test did not run:\n{stdout}\n{stderr}");
    }

    /// Runs only inside the namespace [`real_sysctls_in_a_fresh_network_namespace`] creates.
    #[test]
    #[ignore = "run by real_sysctls_in_a_fresh_network_namespace inside a new network namespace"]
    fn netns_child() {
        if std::env::var_os(NETNS_CHILD_ENV).is_none() {
            return;
        }
        let sysctl = ProcSysctl::new();
        assert_eq!(sysctl.get(ROUTE_LOCALNET).unwrap(), 0, "a fresh namespace starts with route_localnet=0");
        ensure_route_localnet(&sysctl).unwrap();
        assert_eq!(sysctl.get(ROUTE_LOCALNET).unwrap(), 1);
        assert_eq!(std::fs::read_to_string("/proc/sys/net/ipv4/conf/all/route_localnet").unwrap().trim(), "1");

        // Conntrack timeouts are per namespace too, when the module is loaded.
        if sysctl.get(NF_CONNTRACK_UDP_TIMEOUT).is_ok() {
            let s = ConntrackSettings {
                max_per_core: 0,
                tcp_be_liberal: true,
                udp_timeout: Duration::from_secs(42),
                ..settings()
            };
            let unused_sysfs = sysfs(0, false);
            apply_conntrack_settings(&sysctl, &unused_sysfs, &s, 1, Release::NEWEST).unwrap();
            assert_eq!(sysctl.get(NF_CONNTRACK_UDP_TIMEOUT).unwrap(), 42);
            assert_eq!(sysctl.get(NF_CONNTRACK_TCP_BE_LIBERAL).unwrap(), 1);
            assert!(conntrack_tcp_be_liberal(&sysctl));
            assert_eq!(sysctl.get(NF_CONNTRACK_TCP_TIMEOUT_ESTABLISHED).unwrap(), 86_400);
        } else {
            eprintln!("nf_conntrack is not loaded: only route_localnet was checked");
        }
    }
}
