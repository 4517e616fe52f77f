//! Local-traffic detection: the iptables match that tells traffic from pods on this node
//! apart from everything else (upstream's `LocalTrafficDetector`).

use crate::config::DetectLocal;
use crate::model::{Cidr, IpFamily};

/// How traffic originating from local pods is recognised.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum LocalDetector {
    /// No detector: masquerade decisions that need one are skipped.
    #[default]
    NoOp,
    /// `-s CIDR` (ClusterCIDR and NodeCIDR modes).
    Cidr(Cidr),
    /// `-i BRIDGE` (BridgeInterface mode).
    BridgeInterface(String),
    /// `-i PREFIX+` (InterfaceNamePrefix mode).
    InterfaceNamePrefix(String),
}

impl LocalDetector {
    /// The detector for one family from the configured mode (upstream `getLocalDetector`):
    /// the first CIDR of the family for ClusterCIDR and NodeCIDR modes (no-op when there is
    /// none), the interface for the interface modes.
    pub fn from_mode(mode: &DetectLocal, family: IpFamily, node_pod_cidrs: &[String]) -> LocalDetector {
        let detector = match mode {
            DetectLocal::ClusterCidr(cidrs) => {
                cidrs.iter().find(|c| c.family() == family).copied().map(LocalDetector::Cidr)
            }
            DetectLocal::NodeCidr => node_pod_cidrs
                .iter()
                .filter_map(|c| Cidr::parse_sloppy(c.trim()))
                .find(|c| c.family() == family)
                .map(LocalDetector::Cidr),
            DetectLocal::BridgeInterface(name) if !name.is_empty() => {
                Some(LocalDetector::BridgeInterface(name.clone()))
            }
            DetectLocal::InterfaceNamePrefix(prefix) if !prefix.is_empty() => {
                Some(LocalDetector::InterfaceNamePrefix(prefix.clone()))
            }
            _ => None,
        };
        detector.unwrap_or_else(|| {
            tracing::info!(%family, ?mode, "no local traffic detector for this family; defaulting to no-op detect-local");
            LocalDetector::NoOp
        })
    }

    pub(crate) fn is_implemented(&self) -> bool {
        !matches!(self, LocalDetector::NoOp)
    }

    /// Arguments matching traffic from local pods (empty for the no-op detector).
    pub(crate) fn if_local(&self) -> Vec<String> {
        self.args(false)
    }

    /// Arguments matching traffic not from local pods (empty for the no-op detector).
    pub(crate) fn if_not_local(&self) -> Vec<String> {
        self.args(true)
    }

    /// The nftables match for traffic from local pods (upstream `IfLocalNFT`), as rule text;
    /// empty for the no-op detector. `ip saddr CIDR` (`ip6` for an IPv6 CIDR), `iifname
    /// BRIDGE`, `iifname PREFIX*`.
    ///
    /// Upstream wrote `iif` for the interface modes until PR #134024 (1.35, cherry-picked
    /// into 1.34 as #134118); `iif` takes an existing interface and no wildcard, so `nft`
    /// rejected every transaction in InterfaceNamePrefix mode. `iifname` is written for every
    /// release (docs/upstream-versions.md, nftables mode).
    pub(crate) fn if_local_nft(&self) -> String {
        self.nft(false)
    }

    /// The nftables match for traffic not from local pods (upstream `IfNotLocalNFT`):
    /// `ip saddr != CIDR`, `iifname != BRIDGE`, `iifname != PREFIX*`; empty for the no-op
    /// detector.
    pub(crate) fn if_not_local_nft(&self) -> String {
        self.nft(true)
    }

    fn nft(&self, negate: bool) -> String {
        let not = if negate { "!= " } else { "" };
        match self {
            LocalDetector::NoOp => String::new(),
            LocalDetector::Cidr(c) => {
                let selector = if c.family() == IpFamily::V6 { "ip6" } else { "ip" };
                format!("{selector} saddr {not}{c}")
            }
            LocalDetector::BridgeInterface(i) => format!("iifname {not}{i}"),
            LocalDetector::InterfaceNamePrefix(p) => format!("iifname {not}{p}*"),
        }
    }

    fn args(&self, negate: bool) -> Vec<String> {
        let (flag, value) = match self {
            LocalDetector::NoOp => return Vec::new(),
            LocalDetector::Cidr(c) => ("-s", c.to_string()),
            LocalDetector::BridgeInterface(i) => ("-i", i.clone()),
            LocalDetector::InterfaceNamePrefix(p) => ("-i", format!("{p}+")),
        };
        let mut v = Vec::with_capacity(3);
        if negate {
            v.push("!".to_string());
        }
        v.push(flag.to_string());
        v.push(value);
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn detector_args() {
        let d = LocalDetector::Cidr(Cidr::parse_sloppy("10.0.0.0/24").unwrap());
        assert_eq!(d.if_local(), ["-s", "10.0.0.0/24"]);
        assert_eq!(d.if_not_local(), ["!", "-s", "10.0.0.0/24"]);
        let d = LocalDetector::InterfaceNamePrefix("veth".into());
        assert_eq!(d.if_not_local(), ["!", "-i", "veth+"]);
        let d = LocalDetector::BridgeInterface("cbr0".into());
        assert_eq!(d.if_local(), ["-i", "cbr0"]);
        assert!(LocalDetector::NoOp.if_local().is_empty());
        assert!(!LocalDetector::NoOp.is_implemented());
    }

    #[test]
    fn nft_matches() {
        let d = LocalDetector::Cidr(Cidr::parse_sloppy("10.0.0.0/8").unwrap());
        assert_eq!(d.if_local_nft(), "ip saddr 10.0.0.0/8");
        assert_eq!(d.if_not_local_nft(), "ip saddr != 10.0.0.0/8");
        let d = LocalDetector::Cidr(Cidr::parse_sloppy("fd00:10::/64").unwrap());
        assert_eq!(d.if_not_local_nft(), "ip6 saddr != fd00:10::/64");
        let d = LocalDetector::InterfaceNamePrefix("veth".into());
        assert_eq!(d.if_local_nft(), "iifname veth*");
        assert_eq!(d.if_not_local_nft(), "iifname != veth*");
        let d = LocalDetector::BridgeInterface("cbr0".into());
        assert_eq!(d.if_not_local_nft(), "iifname != cbr0");
        assert_eq!(LocalDetector::NoOp.if_local_nft(), "");
    }

    #[test]
    fn from_mode_picks_the_family() {
        let cidrs = vec![Cidr::parse_sloppy("fd00:10::/64").unwrap(), Cidr::parse_sloppy("10.0.0.0/8").unwrap()];
        let mode = DetectLocal::ClusterCidr(cidrs);
        assert_eq!(LocalDetector::from_mode(&mode, IpFamily::V4, &[]).if_local(), ["-s", "10.0.0.0/8"]);
        assert_eq!(LocalDetector::from_mode(&mode, IpFamily::V6, &[]).if_local(), ["-s", "fd00:10::/64"]);
        assert_eq!(LocalDetector::from_mode(&DetectLocal::ClusterCidr(vec![]), IpFamily::V4, &[]), LocalDetector::NoOp);
        let pods = vec!["10.244.1.0/24".to_string()];
        assert_eq!(
            LocalDetector::from_mode(&DetectLocal::NodeCidr, IpFamily::V4, &pods).if_local(),
            ["-s", "10.244.1.0/24"]
        );
        assert_eq!(LocalDetector::from_mode(&DetectLocal::NodeCidr, IpFamily::V6, &pods), LocalDetector::NoOp);
        assert_eq!(
            LocalDetector::from_mode(&DetectLocal::InterfaceNamePrefix("veth".into()), IpFamily::V6, &[]).if_local(),
            ["-i", "veth+"]
        );
    }
}
