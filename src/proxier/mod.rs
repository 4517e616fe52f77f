//! The proxiers, one per proxy mode, and what they share.
//!
//! * [`iptables`]: iptables mode (upstream's `pkg/proxy/iptables`): [`Proxier`] renders
//!   iptables-restore input ([`render`]) and removes the mode's rules on `--cleanup`
//!   ([`cleanup`]).
//! * [`nftables`]: nftables mode (upstream's `pkg/proxy/nftables`): `NftablesProxier` plans
//!   one nftables transaction per sync.
//! * Shared by both: the local-traffic detector ([`local_detect`]) and the node-port
//!   addresses ([`nodeport_addresses`]); the model, trackers, endpoint categorisation and
//!   conntrack jobs come from lower layers.
//!
//! The iptables proxier's items are re-exported here under their long-standing paths
//! (`crate::proxier::Proxier`, `crate::proxier::render`, ...).

pub mod iptables;
pub mod local_detect;
pub mod nftables;
pub mod nodeport_addresses;

pub use iptables::*;
pub use iptables::{cleanup, render};
