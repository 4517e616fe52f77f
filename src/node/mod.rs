//! The node's side effects besides iptables, each behind a small trait with a real and a fake
//! implementation: kernel settings ([`sysctl`]), stale conntrack entries ([`conntrack`]),
//! netfilter accounting objects ([`nfacct`]), the process's OOM score ([`oom`]) and open-file
//! limit ([`fd_limit`]), and the capabilities it runs with ([`capabilities`]).

pub mod capabilities;
pub mod conntrack;
pub mod fd_limit;
pub mod nfacct;
pub mod oom;
pub mod sysctl;
