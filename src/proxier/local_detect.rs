//! Local-traffic detection: the iptables match that tells traffic from pods on this node
//! apart from everything else (upstream's `LocalTrafficDetector`).

use crate::model::Cidr;

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
    pub fn is_implemented(&self) -> bool {
        !matches!(self, LocalDetector::NoOp)
    }

    /// Arguments matching traffic from local pods (empty for the no-op detector).
    pub fn if_local(&self) -> Vec<String> {
        self.args(false)
    }

    /// Arguments matching traffic not from local pods (empty for the no-op detector).
    pub fn if_not_local(&self) -> Vec<String> {
        self.args(true)
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
}
