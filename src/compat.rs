//! Which upstream kube-proxy release this proxy behaves as (`--compatibility-version`), and
//! the feature gates that follow from it.
//!
//! A cluster operator thinks in releases: "behave like the kube-proxy of my 1.31 cluster".
//! A release fixes the defaults of the gates that change iptables-mode behaviour (their
//! stage per release is in docs/upstream-versions.md, read from upstream's versioned gate
//! specs); `--feature-gates` may still flip a gate that is not locked in that release.
//! Gate names this module does not know are left to the caller (upstream's gate list is
//! large and cluster-wide flags carry gates kube-proxy never reads).

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

/// An upstream minor release, `1.<minor>`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Release {
    minor: u8,
}

impl Release {
    /// The release every golden file reproduces byte for byte.
    pub const V1_29: Release = Release { minor: 29 };
    pub(crate) const V1_30: Release = Release { minor: 30 };
    pub(crate) const V1_31: Release = Release { minor: 31 };
    pub(crate) const V1_32: Release = Release { minor: 32 };
    pub const V1_33: Release = Release { minor: 33 };
    pub(crate) const V1_34: Release = Release { minor: 34 };
    pub const V1_35: Release = Release { minor: 35 };
    pub const V1_36: Release = Release { minor: 36 };
    pub const V1_37: Release = Release { minor: 37 };
    /// The oldest release that can be selected.
    pub(crate) const OLDEST: Release = Release::V1_29;
    /// The newest release implemented, and the default.
    pub const NEWEST: Release = Release::V1_37;

    /// Every selectable release, oldest first.
    pub fn all() -> impl Iterator<Item = Release> {
        (Release::OLDEST.minor..=Release::NEWEST.minor).map(|minor| Release { minor })
    }

    pub(crate) fn minor(self) -> u8 {
        self.minor
    }

    /// Whether rules count with nfacct objects (added in 1.31, no gate).
    pub(crate) fn has_nfacct_counters(self) -> bool {
        self >= Release::V1_31
    }

    /// Whether stale UDP conntrack entries are found by the reconciler (list the table,
    /// delete what no serving endpoint answers) rather than per change (1.32, PR #127318).
    pub(crate) fn has_conntrack_reconciler(self) -> bool {
        self >= Release::V1_32
    }

    /// Whether the conntrack reconciler compares the endpoint's port too, not only its IP
    /// (1.34, PR #130542).
    pub(crate) fn conntrack_reconciler_matches_endpoint_port(self) -> bool {
        self >= Release::V1_34
    }

    /// Whether the conntrack reconciler also cleans UDP service ports without serving
    /// endpoints, every entry to them being stale (PR #139629, 1.37).
    pub(crate) fn conntrack_reconciler_cleans_services_without_endpoints(self) -> bool {
        self >= Release::V1_37
    }

    /// Whether the conntrack reconciler's two metrics exist (1.33, PRs #130200, #130204).
    pub(crate) fn has_conntrack_reconciler_metrics(self) -> bool {
        self >= Release::V1_33
    }

    /// Whether Service external IPs, load-balancer ingress IPs and source ranges are parsed
    /// (`net.IP` / `*net.IPNet`, Kubernetes' lenient parser) and written into rules in Go's
    /// canonical text (PR #122630, 1.30): `010.1.2.3` becomes `10.1.2.3`, `198.18.7.1/16`
    /// becomes `198.18.0.0/16`, IPv6 is compressed. 1.29 writes the strings as given.
    pub(crate) fn writes_canonical_service_addresses(self) -> bool {
        self >= Release::V1_30
    }

    /// Whether EndpointSlice addresses are parsed leniently and written canonically, in the
    /// DNAT target, the `-s` hairpin match and the endpoint chain's hash (`010.244.1.6` is
    /// `10.244.1.6`). Upstream's `TestBadIPs` (PR #126203, 1.31) found that endpoint
    /// addresses were still used as written and fixed it.
    pub(crate) fn writes_canonical_endpoint_addresses(self) -> bool {
        self >= Release::V1_31
    }

    /// Whether a sync is full, not partial, once the last full sync is more than
    /// [`FULL_SYNC_PERIOD`] old, so that rules changed from outside are repaired without a
    /// restart (1.33, PR #129329).
    pub(crate) fn has_periodic_full_sync(self) -> bool {
        self >= Release::V1_33
    }

    /// Whether the periodic full sync is skipped in large-cluster mode, where it rewrites
    /// every rule for nothing (PR #138571, cherry-picked into the 1.34, 1.35 and 1.36
    /// patch releases of May 2026; the newest patch of each release is what is reproduced).
    pub(crate) fn skips_periodic_full_sync_in_large_clusters(self) -> bool {
        self >= Release::V1_34
    }

    /// Whether syncs are paced by the runner of `pkg/proxy/runner` (PR #131615, 1.34):
    /// `minSyncPeriod` from the end of one sync to the start of the next, no burst of two.
    pub(crate) fn paces_syncs_after_completion(self) -> bool {
        self >= Release::V1_34
    }

    /// Whether only the Node's zone label is tracked (`NodeTopologyConfig`, PR #133059,
    /// 1.34): other label changes and the Node's deletion no longer force a full sync.
    pub(crate) fn tracks_only_topology_labels(self) -> bool {
        self >= Release::V1_34
    }

    /// Whether `nodePortAddresses` may be the keyword `primary` (added in 1.31).
    pub(crate) fn accepts_primary_node_port_addresses(self) -> bool {
        self >= Release::V1_31
    }

    /// Whether `nodePortAddresses` also takes the keywords `localhost` and `all`, and
    /// `primary` combined with CIDRs and keywords (PR #138427, 1.37).
    pub(crate) fn accepts_node_port_address_keywords(self) -> bool {
        self >= Release::V1_37
    }

    /// Whether a zero-prefix CIDR (`0.0.0.0/0`, `::/0`) in `loadBalancerSourceRanges` means
    /// "allow all" for its family, as no source ranges do (PR #132722, `newBaseServiceInfo`):
    /// no firewall chain. Merged in the 1.35 cycle as far as could be established (release
    /// note NONE; docs/upstream-versions.md row 28). Traffic is the same either way.
    pub(crate) fn zero_source_range_allows_all(self) -> bool {
        self >= Release::V1_35
    }

    /// Whether, of two endpoints with the same address and port in a service's slices, a
    /// later one replaces an earlier one unless it is terminating (PR #135593, 1.36: a pod IP
    /// reused while the old Pod is still terminating). Before, the first one seen was kept
    /// unless a later duplicate was local to this node.
    pub(crate) fn prefers_non_terminating_duplicate_endpoints(self) -> bool {
        self >= Release::V1_36
    }

    /// Whether the automatically computed `nf_conntrack_max` (maxPerCore × CPUs) is capped at
    /// [`CONNTRACK_MAX_CAP`] (PR #137002, 1.36).
    pub(crate) fn caps_computed_conntrack_max(self) -> bool {
        self >= Release::V1_36
    }

    /// Whether the process exits (to be restarted) when its Node's IPs change or the Node is
    /// deleted (PR #138183, 1.37); before, both were only logged.
    pub(crate) fn exits_on_node_ip_change(self) -> bool {
        self >= Release::V1_37
    }

    /// Whether an empty `mode` is warned about at start-up (PR #139957, 1.37): the default
    /// on Linux is to move from iptables to nftables in a later release.
    pub(crate) fn warns_about_empty_mode(self) -> bool {
        self >= Release::V1_37
    }
}

/// The cap on an automatically computed `nf_conntrack_max` from 1.36
/// ([`Release::caps_computed_conntrack_max`]).
pub(crate) const CONNTRACK_MAX_CAP: i64 = 1_048_576;

/// nftables mode (issue 27): the releases it exists in and how its rules change between them
/// (docs/upstream-versions.md, "nftables mode"). A block of its own so that it merges apart
/// from the iptables-mode predicates above.
impl Release {
    /// The first release with nftables mode on by default (beta in 1.31, GA in 1.33).
    pub const NFTABLES_OLDEST: Release = Release::V1_31;
    /// The newest release whose nftables proxier is reproduced.
    pub const NFTABLES_NEWEST: Release = Release::V1_37;

    /// Every release nftables mode can emulate, oldest first.
    pub fn nftables_all() -> impl Iterator<Item = Release> {
        (Release::NFTABLES_OLDEST.minor..=Release::NFTABLES_NEWEST.minor).map(|minor| Release { minor })
    }

    /// Whether this release has nftables mode (the NFTablesProxyMode gate is on by default:
    /// beta from 1.31, GA from 1.33; alpha and off before).
    pub fn has_nftables_mode(self) -> bool {
        self >= Release::NFTABLES_OLDEST
    }

    /// Whether the filter hooks are `filter-prerouting-pre-dnat` / `filter-output-pre-dnat`
    /// at priority -110 and input/forward/output at 0 (PR #132456, 1.34), rather than
    /// `filter-prerouting`, input, forward, output at -110 and `filter-output-post-dnat` at -90.
    pub(crate) fn nft_pre_dnat_filter_chains(self) -> bool {
        self >= Release::V1_34
    }

    /// Whether the ClusterIP masquerade rule of a service chain matches the service port
    /// (`ip daddr CIP tcp dport 80 …`); from 1.34 it matches the address only (PR #131492).
    pub(crate) fn nft_cluster_ip_masquerade_matches_port(self) -> bool {
        self < Release::V1_34
    }

    /// Whether masquerading goes through the `mark-for-masquerade` chain with a
    /// three-rule `masquerading` chain and per-endpoint hairpin rules; from 1.36 the mark is
    /// set inline, hairpin traffic is matched by the `hairpin-connections` set, and one
    /// `services` rule masquerades ClusterIP traffic (PRs #135800, #136499).
    pub(crate) fn nft_has_mark_for_masquerade_chain(self) -> bool {
        self < Release::V1_36
    }

    /// Whether services without session affinity DNAT straight from their service chain
    /// through a `numgen` map, with endpoint chains only for ClientIP affinity (1.36).
    pub(crate) fn nft_dnat_maps(self) -> bool {
        self >= Release::V1_36
    }

    /// Whether a sync is full once the last full sync is an hour old, and a failed
    /// stale-chain deletion makes the sync full (the `pkg/proxy/runner` move, 1.34).
    pub(crate) fn nft_has_periodic_full_sync(self) -> bool {
        self >= Release::V1_34
    }
}

/// How old the last full sync may get before a sync is full again, where the release has
/// periodic full syncs ([`Release::has_periodic_full_sync`]; upstream's
/// `proxyutil.FullSyncPeriod`).
pub(crate) const FULL_SYNC_PERIOD: std::time::Duration = std::time::Duration::from_secs(3600);

impl Default for Release {
    fn default() -> Self {
        Release::NEWEST
    }
}

impl fmt::Display for Release {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "1.{}", self.minor)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CompatError {
    #[error("compatibility version {value:?}: expected a Kubernetes release like 1.31 (or v1.31.2)")]
    Malformed { value: String },
    #[error("compatibility version {value:?}: supported releases are {} to {}", Release::OLDEST, Release::NEWEST)]
    Unsupported { value: String },
    #[error("feature gate {gate} does not exist in Kubernetes {release}")]
    UnknownInRelease { gate: &'static str, release: Release },
    #[error("feature gate {gate} is locked to {locked} in Kubernetes {release} and cannot be set to {requested}")]
    Locked { gate: &'static str, release: Release, locked: bool, requested: bool },
}

impl FromStr for Release {
    type Err = CompatError;

    /// `1.31`, `v1.31` and `1.31.4` (the patch release does not matter to behaviour here).
    fn from_str(value: &str) -> Result<Release, CompatError> {
        let malformed = || CompatError::Malformed { value: value.to_string() };
        let text = value.trim();
        let text = text.strip_prefix('v').unwrap_or(text);
        let mut parts = text.split('.');
        let (Some(major), Some(minor)) = (parts.next(), parts.next()) else {
            return Err(malformed());
        };
        let patch_ok = match parts.next() {
            None => true,
            Some(patch) => !patch.is_empty() && patch.bytes().all(|b| b.is_ascii_digit()) && parts.next().is_none(),
        };
        let digits = |s: &str| !s.is_empty() && s.len() <= 3 && s.bytes().all(|b| b.is_ascii_digit());
        if !patch_ok || major != "1" || !digits(minor) {
            return Err(malformed());
        }
        let minor: u16 = minor.parse().map_err(|_| malformed())?;
        if minor < u16::from(Release::OLDEST.minor) || minor > u16::from(Release::NEWEST.minor) {
            return Err(CompatError::Unsupported { value: value.to_string() });
        }
        Ok(Release { minor: minor as u8 })
    }
}

/// The gates that change iptables-mode behaviour after 1.29.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Gate {
    /// `status.loadBalancer.ingress[].ipMode: Proxy` IPs are not short-circuited.
    LoadBalancerIpMode,
    /// Zone hints are honoured at all.
    TopologyAwareHints,
    /// Hints are honoured without the topology annotation (`spec.trafficDistribution`).
    ServiceTrafficDistribution,
    /// Node hints (`trafficDistribution: PreferSameNode`) are honoured.
    PreferSameTrafficDistribution,
    /// `spec.externalIPs` are programmed at all (KEP-5707; deprecated from its first
    /// release, 1.36, default on, planned off in 1.40).
    AllowServiceExternalIps,
    /// The IPVS proxy mode may be used (KEP-5495; deprecated from 1.37, default on). No
    /// effect here (IPVS is not implemented); known so that clusters that set it start.
    KubeProxyIpvs,
    /// `mode: nftables` may be used (alpha 1.29, beta and on 1.31, GA 1.33).
    NfTablesProxyMode,
    /// ServiceCIDR objects are watched; in nftables mode traffic to a ClusterIP inside them
    /// that no Service holds is dropped (beta and off 1.31, GA and on 1.33, removed 1.36).
    MultiCidrServiceAllocator,
}

/// A gate's stage in one release: its default and whether it is locked to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stage {
    default: bool,
    locked: bool,
}

const OFF: Option<Stage> = Some(Stage { default: false, locked: false });
const ON: Option<Stage> = Some(Stage { default: true, locked: false });
const GA: Option<Stage> = Some(Stage { default: true, locked: true });

impl Gate {
    pub const ALL: [Gate; 8] = [
        Gate::LoadBalancerIpMode,
        Gate::TopologyAwareHints,
        Gate::ServiceTrafficDistribution,
        Gate::PreferSameTrafficDistribution,
        Gate::AllowServiceExternalIps,
        Gate::KubeProxyIpvs,
        Gate::NfTablesProxyMode,
        Gate::MultiCidrServiceAllocator,
    ];

    /// The name `--feature-gates` uses.
    pub fn name(self) -> &'static str {
        match self {
            Gate::LoadBalancerIpMode => "LoadBalancerIPMode",
            Gate::TopologyAwareHints => "TopologyAwareHints",
            Gate::ServiceTrafficDistribution => "ServiceTrafficDistribution",
            Gate::PreferSameTrafficDistribution => "PreferSameTrafficDistribution",
            Gate::AllowServiceExternalIps => "AllowServiceExternalIPs",
            Gate::KubeProxyIpvs => "KubeProxyIPVS",
            Gate::NfTablesProxyMode => "NFTablesProxyMode",
            Gate::MultiCidrServiceAllocator => "MultiCIDRServiceAllocator",
        }
    }

    /// The gate's value in a release that does not have it: on once it was removed after
    /// going GA, off before it existed (the deprecated gates have not been removed in any
    /// selectable release, and were on before they existed: external IPs and IPVS simply
    /// worked).
    fn value_when_absent(self, release: Release) -> bool {
        match self {
            Gate::LoadBalancerIpMode => release.minor >= 35,
            Gate::ServiceTrafficDistribution => release.minor >= 36,
            Gate::TopologyAwareHints | Gate::PreferSameTrafficDistribution => false,
            Gate::AllowServiceExternalIps | Gate::KubeProxyIpvs | Gate::NfTablesProxyMode => true,
            Gate::MultiCidrServiceAllocator => release.minor >= 36,
        }
    }

    /// Upstream's versioned gate specs (pkg/features/kube_features.go); `None`: the gate
    /// does not exist in that release.
    fn stage(self, release: Release) -> Option<Stage> {
        let minor = release.minor;
        match self {
            // GA 1.32, removed in 1.35 (website gate page: stable 1.32–1.34, removed).
            Gate::LoadBalancerIpMode => match minor {
                ..=29 => OFF,
                30..=31 => ON,
                32..=34 => GA,
                _ => None,
            },
            Gate::TopologyAwareHints => match minor {
                ..=32 => ON,
                _ => GA,
            },
            // GA 1.33, "remove in 1.36".
            Gate::ServiceTrafficDistribution => match minor {
                ..=29 => None,
                30 => OFF,
                31..=32 => ON,
                33..=35 => GA,
                _ => None,
            },
            Gate::PreferSameTrafficDistribution => match minor {
                ..=32 => None,
                33 => OFF,
                34 => ON,
                _ => GA,
            },
            Gate::AllowServiceExternalIps => match minor {
                ..=35 => None,
                _ => ON,
            },
            Gate::KubeProxyIpvs => match minor {
                ..=36 => None,
                _ => ON,
            },
            // Still GA and locked in the 1.35 specs; not seen removed since.
            Gate::NfTablesProxyMode => match minor {
                ..=30 => OFF,
                31..=32 => ON,
                _ => GA,
            },
            // "remove in 1.36"; GA but not locked in 1.33-1.35.
            Gate::MultiCidrServiceAllocator => match minor {
                ..=32 => OFF,
                33..=35 => ON,
                _ => None,
            },
        }
    }

    /// Whether setting the gate deserves upstream's warning ("Setting deprecated feature
    /// gate X=v. It will be removed in a future release."): deprecated gates, and GA ones.
    fn deprecated_or_ga(self, release: Release) -> Option<&'static str> {
        match self.stage(release)? {
            Stage { locked: true, .. } => Some("GA"),
            _ if matches!(self, Gate::AllowServiceExternalIps | Gate::KubeProxyIpvs) => Some("deprecated"),
            _ => None,
        }
    }
}

/// The behaviour selected: a release and the state of each gate in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Features {
    pub release: Release,
    pub load_balancer_ip_mode: bool,
    pub topology_aware_hints: bool,
    pub service_traffic_distribution: bool,
    pub prefer_same_traffic_distribution: bool,
    /// `spec.externalIPs` are programmed (`AllowServiceExternalIPs`, on unless turned off).
    pub allow_service_external_ips: bool,
    /// `mode: nftables` is allowed (`NFTablesProxyMode`).
    pub nftables_proxy_mode: bool,
    /// ServiceCIDR objects are watched (`MultiCIDRServiceAllocator`).
    pub multi_cidr_service_allocator: bool,
}

impl Default for Features {
    fn default() -> Self {
        Features::of(Release::NEWEST)
    }
}

impl Features {
    /// `release` with every gate at its default.
    pub fn of(release: Release) -> Features {
        let default = |gate: Gate| gate.stage(release).map_or(gate.value_when_absent(release), |s| s.default);
        Features {
            release,
            load_balancer_ip_mode: default(Gate::LoadBalancerIpMode),
            topology_aware_hints: default(Gate::TopologyAwareHints),
            service_traffic_distribution: default(Gate::ServiceTrafficDistribution),
            prefer_same_traffic_distribution: default(Gate::PreferSameTrafficDistribution),
            allow_service_external_ips: default(Gate::AllowServiceExternalIps),
            nftables_proxy_mode: default(Gate::NfTablesProxyMode),
            multi_cidr_service_allocator: default(Gate::MultiCidrServiceAllocator),
        }
    }

    /// `release` with `gates` (from `--feature-gates` / `featureGates`) applied. Names
    /// this module does not know are ignored here; a known gate that the release does not
    /// have, or a locked gate set against its lock, is an error, as upstream.
    pub fn resolve(release: Release, gates: &BTreeMap<String, bool>) -> Result<Features, CompatError> {
        let mut features = Features::of(release);
        for gate in Gate::ALL {
            let Some(&requested) = gates.get(gate.name()) else { continue };
            let Some(stage) = gate.stage(release) else {
                return Err(CompatError::UnknownInRelease { gate: gate.name(), release });
            };
            if stage.locked && requested != stage.default {
                return Err(CompatError::Locked { gate: gate.name(), release, locked: stage.default, requested });
            }
            if let Some(value) = features.gate_mut(gate) {
                *value = requested;
            }
        }
        Ok(features)
    }

    /// Where a gate's value is kept; `None` for a gate with no behaviour here (accepted and
    /// not kept).
    fn gate_mut(&mut self, gate: Gate) -> Option<&mut bool> {
        Some(match gate {
            Gate::LoadBalancerIpMode => &mut self.load_balancer_ip_mode,
            Gate::TopologyAwareHints => &mut self.topology_aware_hints,
            Gate::ServiceTrafficDistribution => &mut self.service_traffic_distribution,
            Gate::PreferSameTrafficDistribution => &mut self.prefer_same_traffic_distribution,
            Gate::AllowServiceExternalIps => &mut self.allow_service_external_ips,
            Gate::NfTablesProxyMode => &mut self.nftables_proxy_mode,
            Gate::MultiCidrServiceAllocator => &mut self.multi_cidr_service_allocator,
            Gate::KubeProxyIpvs => return None,
        })
    }

    /// Upstream's warnings for the gates in `gates` that are deprecated or GA in `release`
    /// ("Setting deprecated feature gate AllowServiceExternalIPs=false. It will be removed in
    /// a future release."), to be logged at start-up.
    pub fn gate_warnings(release: Release, gates: &BTreeMap<String, bool>) -> Vec<String> {
        Gate::ALL
            .iter()
            .filter_map(|gate| {
                let value = gates.get(gate.name())?;
                let stage = gate.deprecated_or_ga(release)?;
                Some(format!(
                    "Setting {stage} feature gate {}={value}. It will be removed in a future release.",
                    gate.name()
                ))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gates(pairs: &[(&str, bool)]) -> BTreeMap<String, bool> {
        pairs.iter().map(|(k, v)| (k.to_string(), *v)).collect()
    }

    #[test]
    fn parses_release_spellings() {
        assert_eq!("1.31".parse(), Ok(Release::V1_31));
        assert_eq!("v1.29".parse(), Ok(Release::V1_29));
        assert_eq!(" 1.35.2 ".parse(), Ok(Release::V1_35));
        for bad in ["", "1", "2.31", "1.", "1.x", "1.31.", "1.31.2.1", "1.31-rc", "one.two"] {
            assert!(matches!(bad.parse::<Release>(), Err(CompatError::Malformed { .. })), "{bad:?}");
        }
        for unsupported in ["1.28", "1.38", "1.999"] {
            let err = unsupported.parse::<Release>().unwrap_err();
            assert!(matches!(err, CompatError::Unsupported { .. }), "{unsupported:?}");
            assert!(err.to_string().contains("1.29 to 1.37"), "{err}");
        }
        assert_eq!("1.36.1".parse(), Ok(Release::V1_36));
        assert_eq!("v1.37.0".parse(), Ok(Release::V1_37));
        assert_eq!(Release::all().count(), 9);
        assert_eq!(Release::V1_33.to_string(), "1.33");
    }

    #[test]
    fn defaults_follow_upstream_gate_stages() {
        // (release, ipMode, topology hints, trafficDistribution, preferSameNode, externalIPs);
        // a removed gate keeps its final value (ipMode from 1.35, trafficDistribution from 1.36).
        let table = [
            (Release::V1_29, false, true, false, false, true),
            (Release::V1_30, true, true, false, false, true),
            (Release::V1_31, true, true, true, false, true),
            (Release::V1_32, true, true, true, false, true),
            (Release::V1_33, true, true, true, false, true),
            (Release::V1_34, true, true, true, true, true),
            (Release::V1_35, true, true, true, true, true),
            (Release::V1_36, true, true, true, true, true),
            (Release::V1_37, true, true, true, true, true),
        ];
        for (release, ip_mode, hints, distribution, same_node, external_ips) in table {
            let f = Features::of(release);
            assert_eq!(
                (
                    f.load_balancer_ip_mode,
                    f.topology_aware_hints,
                    f.service_traffic_distribution,
                    f.prefer_same_traffic_distribution,
                    f.allow_service_external_ips,
                ),
                (ip_mode, hints, distribution, same_node, external_ips),
                "{release}"
            );
        }
        assert_eq!(Features::default().release, Release::NEWEST);
    }

    #[test]
    fn gates_override_unless_locked_or_absent() {
        let f = Features::resolve(Release::V1_30, &gates(&[("ServiceTrafficDistribution", true)])).unwrap();
        assert!(f.service_traffic_distribution);
        let f = Features::resolve(Release::V1_31, &gates(&[("LoadBalancerIPMode", false), ("SomeOtherGate", true)]))
            .unwrap();
        assert!(!f.load_balancer_ip_mode);
        // Setting a locked gate to its locked value is allowed, as upstream.
        assert!(Features::resolve(Release::V1_33, &gates(&[("TopologyAwareHints", true)])).is_ok());

        let err = Features::resolve(Release::V1_32, &gates(&[("LoadBalancerIPMode", false)])).unwrap_err();
        assert_eq!(
            err,
            CompatError::Locked { gate: "LoadBalancerIPMode", release: Release::V1_32, locked: true, requested: false }
        );
        assert!(err.to_string().contains("locked to true in Kubernetes 1.32"), "{err}");
        let err = Features::resolve(Release::V1_29, &gates(&[("ServiceTrafficDistribution", true)])).unwrap_err();
        assert_eq!(err, CompatError::UnknownInRelease { gate: "ServiceTrafficDistribution", release: Release::V1_29 });
    }

    #[test]
    fn removed_gates_cannot_be_set_and_new_ones_appear_in_their_release() {
        // Removed: LoadBalancerIPMode in 1.35, ServiceTrafficDistribution in 1.36.
        let err = Features::resolve(Release::V1_35, &gates(&[("LoadBalancerIPMode", true)])).unwrap_err();
        assert_eq!(err, CompatError::UnknownInRelease { gate: "LoadBalancerIPMode", release: Release::V1_35 });
        assert!(Features::resolve(Release::V1_34, &gates(&[("LoadBalancerIPMode", true)])).is_ok());
        let err = Features::resolve(Release::V1_36, &gates(&[("ServiceTrafficDistribution", true)])).unwrap_err();
        assert_eq!(err, CompatError::UnknownInRelease { gate: "ServiceTrafficDistribution", release: Release::V1_36 });
        // AllowServiceExternalIPs from 1.36 (deprecated, may be turned off); KubeProxyIPVS from 1.37.
        let err = Features::resolve(Release::V1_35, &gates(&[("AllowServiceExternalIPs", false)])).unwrap_err();
        assert!(matches!(err, CompatError::UnknownInRelease { .. }));
        let f = Features::resolve(Release::V1_36, &gates(&[("AllowServiceExternalIPs", false)])).unwrap();
        assert!(!f.allow_service_external_ips);
        assert!(Features::resolve(Release::V1_36, &gates(&[("KubeProxyIPVS", true)])).is_err());
        let f = Features::resolve(Release::V1_37, &gates(&[("KubeProxyIPVS", false)])).unwrap();
        assert_eq!(f, Features::of(Release::V1_37), "KubeProxyIPVS changes nothing here");
        // Upstream warns about setting deprecated and GA gates.
        assert_eq!(
            Features::gate_warnings(
                Release::V1_37,
                &gates(&[("AllowServiceExternalIPs", false), ("TopologyAwareHints", true), ("Other", true)])
            ),
            [
                "Setting GA feature gate TopologyAwareHints=true. It will be removed in a future release.",
                "Setting deprecated feature gate AllowServiceExternalIPs=false. It will be removed in a future release.",
            ]
        );
        assert!(Features::gate_warnings(Release::V1_31, &gates(&[("LoadBalancerIPMode", true)])).is_empty());
    }

    #[test]
    fn canonical_service_addresses_arrive_in_1_30() {
        assert!(!Release::V1_29.writes_canonical_service_addresses());
        assert!(Release::V1_30.writes_canonical_service_addresses());
        assert!(Release::NEWEST.writes_canonical_service_addresses());
        assert!(!Release::V1_30.writes_canonical_endpoint_addresses());
        assert!(Release::V1_31.writes_canonical_endpoint_addresses());
    }

    #[test]
    fn primary_node_port_addresses_arrive_in_1_31() {
        assert!(!Release::V1_30.accepts_primary_node_port_addresses());
        assert!(Release::V1_31.accepts_primary_node_port_addresses());
    }
}
