//! The `KubeProxyConfiguration` file (`kubeproxy.config.k8s.io/v1alpha1`) and the validated
//! [`Settings`] the rest of the program reads. Laid out as upstream keeps it:
//!
//! * `types`: the file format, field for field (serde), and Go-shaped value helpers;
//! * `duration`: Go's duration text;
//! * `defaults`: upstream's defaulting ([`KubeProxyConfiguration::with_defaults`]);
//! * `validation`: upstream's validation, as Kubernetes-style [`FieldError`]s;
//! * `load`: reading a file: type check, strict decoding, and upstream's lenient fallback
//!   (unknown and duplicated fields are reported, not fatal);
//! * `settings`: [`Settings::from_config`] (defaults, validates, converts).
//!
//! Reading goes [`load_config_file`] → [`KubeProxyConfiguration::with_defaults`] →
//! [`Settings::from_config`]. A wrong `apiVersion` or `kind`, malformed YAML and values of the
//! wrong type are errors naming the file, the line and the field path.

pub mod watch;

mod defaults;
mod duration;
mod load;
mod settings;
mod types;
mod validation;

#[cfg(test)]
mod tests;

use std::path::PathBuf;

pub(crate) use defaults::append_port_if_needed;
pub use duration::{DurationError, GoDuration};
pub use load::{DecodedConfig, StrictDecodingError, load_config_file, parse_config};
pub use settings::{
    ClientSettings, ConntrackSettings, DetectLocal, LoggingSettings, ProxyMode, Settings, masquerade_mark,
};
pub use types::*;
pub use validation::{FieldError, FieldErrorKind};
pub(crate) use validation::{
    NODE_PORT_ADDRESSES_ALL, NODE_PORT_ADDRESSES_LOCALHOST, NODE_PORT_ADDRESSES_PRIMARY, split_host_port,
};

/// The only `apiVersion` accepted in a config file.
pub const API_VERSION: &str = "kubeproxy.config.k8s.io/v1alpha1";
/// The only `kind` accepted in a config file.
pub const KIND: &str = "KubeProxyConfiguration";

// ---------------------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------------------

/// Why a config file could not be turned into a [`KubeProxyConfiguration`].
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{}: cannot read config file: {source}", .path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{}: config file is empty", .path.display())]
    Empty { path: PathBuf },
    /// YAML syntax, an unknown field, or a value of the wrong type. `message` starts with the
    /// field path (e.g. `iptables.masqueradeBit: invalid type ...`) when there is one.
    #[error("{}{}: {message}", .path.display(), fmt_location(*.location))]
    Decode {
        path: PathBuf,
        /// 1-based line and column, when the decoder knows them.
        location: Option<(usize, usize)>,
        message: String,
    },
    #[error(
        "{}: apiVersion {found:?} is not supported (expected {API_VERSION:?})",
        .path.display()
    )]
    ApiVersion { path: PathBuf, found: String },
    #[error("{}: kind {found:?} is not supported (expected {KIND:?})", .path.display())]
    Kind { path: PathBuf, found: String },
}

fn fmt_location(location: Option<(usize, usize)>) -> String {
    match location {
        Some((line, column)) => format!(":{line}:{column}"),
        None => String::new(),
    }
}
