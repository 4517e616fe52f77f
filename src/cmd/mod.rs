//! What a user invokes besides the daemon: `render` (the rules for cluster state given as
//! YAML), `trace` (where a new connection goes through a node's rules) and `diff` (the
//! node's rules against what the cluster state renders to), and the flags of every command
//! ([`cli`]), merged with the `--config` file the way upstream does ([`options`]).

pub mod cli;
pub mod diff;
pub mod options;
pub mod render;
pub mod trace;
