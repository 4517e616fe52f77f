//! What a user invokes besides the daemon: `render` (the rules for cluster state given as
//! YAML), `trace` (where a new connection goes through a node's rules) and `diff` (the
//! node's rules against what the cluster state renders to).

pub mod diff;
pub mod render;
pub mod trace;
