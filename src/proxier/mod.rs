//! The proxier: turns the tracked service and endpoint state into iptables rules.

pub mod chains;
