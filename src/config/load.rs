//! Reading a config file: the type check (`apiVersion`, `kind`), then decoding as upstream
//! does it: strictly first, and when strict decoding fails only because of unknown or
//! duplicated fields, leniently (unknown fields skipped, the last of duplicated keys wins),
//! reporting what strict decoding rejected so the caller can log it
//! (`cmd/kube-proxy/app/server.go`, "Using lenient decoding as strict decoding failed").
//! Malformed YAML and values of the wrong type stay errors naming the file, line and field.

use std::cell::RefCell;
use std::fmt;
use std::path::Path;

use serde::Deserialize;
use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};

use super::types::KubeProxyConfiguration;
use super::{API_VERSION, ConfigError, KIND};

/// Only `apiVersion` and `kind`, read leniently before the strict decode so that a file of
/// another type is reported as such rather than as a pile of unknown fields.
#[derive(Deserialize)]
struct TypeProbe {
    #[serde(rename = "apiVersion")]
    api_version: Option<serde_yaml::Value>,
    kind: Option<serde_yaml::Value>,
}

fn probe_text(value: Option<serde_yaml::Value>) -> String {
    match value {
        Some(serde_yaml::Value::String(s)) => s,
        Some(serde_yaml::Value::Null) | None => String::new(),
        Some(other) => serde_yaml::to_string(&other).unwrap_or_default().trim().to_string(),
    }
}

/// What strict decoding rejects and lenient decoding gets past.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StrictDecodingError {
    /// A field the type does not have (skipped), by its path in the file (`iptables.foo`).
    UnknownField(String),
    /// A key given twice in one mapping (the last value is used), by its path.
    DuplicateField(String),
}

impl fmt::Display for StrictDecodingError {
    /// The text apimachinery's strict decoder uses for each problem.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StrictDecodingError::UnknownField(path) => write!(f, "unknown field {path:?}"),
            StrictDecodingError::DuplicateField(path) => write!(f, "duplicate field {path:?}"),
        }
    }
}

/// A decoded config file, with whatever strict decoding would have rejected.
#[derive(Debug, Clone, PartialEq)]
pub struct DecodedConfig {
    pub config: KubeProxyConfiguration,
    /// Empty when the file decodes strictly.
    pub strict_errors: Vec<StrictDecodingError>,
}

impl DecodedConfig {
    /// Whether strict decoding failed and the file was decoded leniently.
    pub fn is_lenient(&self) -> bool {
        !self.strict_errors.is_empty()
    }

    /// The strict decoding errors in one line, as apimachinery joins them:
    /// `strict decoding error: unknown field "foo", duplicate field "mode"`.
    pub fn strict_error_text(&self) -> String {
        let list: Vec<String> = self.strict_errors.iter().map(ToString::to_string).collect();
        format!("strict decoding error: {}", list.join(", "))
    }

    /// The configuration when it decoded strictly.
    pub fn into_strict(self) -> Option<KubeProxyConfiguration> {
        self.strict_errors.is_empty().then_some(self.config)
    }

    /// Logs the lenient decoding, if there was one, as upstream does (naming the file and each
    /// field), and returns the configuration.
    pub fn into_config_logged(self, path: &Path) -> KubeProxyConfiguration {
        if self.is_lenient() {
            tracing::warn!(
                path = %path.display(),
                err = %self.strict_error_text(),
                "Using lenient decoding as strict decoding failed"
            );
        }
        self.config
    }
}

/// Reads and decodes a config file (strictly, else leniently; see the module documentation).
/// Defaults are not applied.
pub fn load_config_file(path: impl AsRef<Path>) -> Result<DecodedConfig, ConfigError> {
    let path = path.as_ref();
    let text =
        std::fs::read_to_string(path).map_err(|source| ConfigError::Read { path: path.to_path_buf(), source })?;
    parse_config(&text, path)
}

/// Decodes config text; `path` is only used in error messages.
pub fn parse_config(text: &str, path: &Path) -> Result<DecodedConfig, ConfigError> {
    let decode_error = |err: serde_yaml::Error| {
        let location = err.location().map(|l| (l.line(), l.column()));
        let mut message = err.to_string();
        if let Some((line, column)) = location {
            let suffix = format!(" at line {line} column {column}");
            if let Some(stripped) = message.strip_suffix(&suffix) {
                message = stripped.to_string();
            }
        }
        ConfigError::Decode { path: path.to_path_buf(), location, message }
    };

    let is_blank = text.lines().all(|l| l.trim().is_empty() || l.trim_start().starts_with('#') || l.trim() == "---");
    if is_blank {
        return Err(ConfigError::Empty { path: path.to_path_buf() });
    }
    let probe: TypeProbe = serde_yaml::from_str(text).map_err(decode_error)?;
    let api_version = probe_text(probe.api_version);
    if api_version != API_VERSION {
        return Err(ConfigError::ApiVersion { path: path.to_path_buf(), found: api_version });
    }
    let kind = probe_text(probe.kind);
    if kind != KIND {
        return Err(ConfigError::Kind { path: path.to_path_buf(), found: kind });
    }

    let mut unknown = Vec::new();
    let decoded: Result<KubeProxyConfiguration, _> =
        serde_ignored::deserialize(serde_yaml::Deserializer::from_str(text), |field| unknown.push(field_path(&field)));
    match decoded {
        Ok(config) => Ok(DecodedConfig {
            config,
            strict_errors: unknown.into_iter().map(StrictDecodingError::UnknownField).collect(),
        }),
        // A key given twice: serde's derive rejects it, so read the document with the last
        // value of each key winning (as Go's lenient YAML decoding does) and decode that.
        Err(err) if err.to_string().starts_with("duplicate field") || err.to_string().contains(": duplicate field") => {
            decode_last_wins(text).map_err(|err| match err {
                LastWinsError::Yaml(err) => decode_error(err),
                LastWinsError::Field(err) => {
                    ConfigError::Decode { path: path.to_path_buf(), location: None, message: err.to_string() }
                }
            })
        }
        Err(err) => Err(decode_error(err)),
    }
}

/// A field's path as the file spells it (`iptables.masqueradeBits`, `nodePortAddresses.0`):
/// serde's wrappers (`Option`, newtypes) add no component.
fn field_path(path: &serde_ignored::Path<'_>) -> String {
    fn walk(path: &serde_ignored::Path<'_>, out: &mut Vec<String>) {
        match path {
            serde_ignored::Path::Root => {}
            serde_ignored::Path::Seq { parent, index } => {
                walk(parent, out);
                out.push(index.to_string());
            }
            serde_ignored::Path::Map { parent, key } => {
                walk(parent, out);
                out.push(key.clone());
            }
            serde_ignored::Path::Some { parent }
            | serde_ignored::Path::NewtypeStruct { parent }
            | serde_ignored::Path::NewtypeVariant { parent } => walk(parent, out),
        }
    }
    let mut parts = Vec::new();
    walk(path, &mut parts);
    parts.join(".")
}

/// Why the duplicated-keys path failed: the YAML itself, or a field's value (named by its
/// path, since a value carries no line numbers).
enum LastWinsError {
    Yaml(serde_yaml::Error),
    Field(serde_path_to_error::Error<serde_yaml::Error>),
}

/// The lenient path for duplicated keys: the document as a value in which the last of each
/// duplicated key wins, then decoded with unknown fields skipped.
fn decode_last_wins(text: &str) -> Result<DecodedConfig, LastWinsError> {
    let duplicates = RefCell::new(Vec::new());
    let value = LastWins { path: String::new(), duplicates: &duplicates }
        .deserialize(serde_yaml::Deserializer::from_str(text))
        .map_err(LastWinsError::Yaml)?;
    let mut unknown = Vec::new();
    let config: KubeProxyConfiguration =
        serde_path_to_error::deserialize(serde_ignored::Deserializer::new(value, &mut |field: serde_ignored::Path<
            '_,
        >| {
            unknown.push(field_path(&field))
        }))
        .map_err(LastWinsError::Field)?;
    let mut strict_errors: Vec<StrictDecodingError> =
        duplicates.into_inner().into_iter().map(StrictDecodingError::DuplicateField).collect();
    strict_errors.extend(unknown.into_iter().map(StrictDecodingError::UnknownField));
    Ok(DecodedConfig { config, strict_errors })
}

/// Reads any YAML node into a [`serde_yaml::Value`], keeping the last value of a key given
/// more than once in a mapping (serde_yaml's own `Mapping` rejects those) and recording the
/// key's path.
struct LastWins<'a> {
    path: String,
    duplicates: &'a RefCell<Vec<String>>,
}

impl LastWins<'_> {
    fn child(&self, key: &str) -> LastWins<'_> {
        let path = if self.path.is_empty() { key.to_string() } else { format!("{}.{key}", self.path) };
        LastWins { path, duplicates: self.duplicates }
    }
}

impl<'de> DeserializeSeed<'de> for LastWins<'_> {
    type Value = serde_yaml::Value;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for LastWins<'_> {
    type Value = serde_yaml::Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any YAML value")
    }

    fn visit_bool<E: de::Error>(self, v: bool) -> Result<Self::Value, E> {
        Ok(serde_yaml::Value::Bool(v))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
        Ok(serde_yaml::Value::Number(v.into()))
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
        Ok(serde_yaml::Value::Number(v.into()))
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Self::Value, E> {
        Ok(serde_yaml::Value::Number(v.into()))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
        Ok(serde_yaml::Value::String(v.to_string()))
    }

    fn visit_string<E: de::Error>(self, v: String) -> Result<Self::Value, E> {
        Ok(serde_yaml::Value::String(v))
    }

    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(serde_yaml::Value::Null)
    }

    fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(serde_yaml::Value::Null)
    }

    fn visit_some<D: Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_any(self)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut items = Vec::new();
        while let Some(item) = seq.next_element_seed(self.child(&items.len().to_string()))? {
            items.push(item);
        }
        Ok(serde_yaml::Value::Sequence(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut out = serde_yaml::Mapping::new();
        while let Some(key) = map.next_key_seed(LastWins { path: self.path.clone(), duplicates: self.duplicates })? {
            let key_text = match &key {
                serde_yaml::Value::String(s) => s.clone(),
                other => serde_yaml::to_string(other).unwrap_or_default().trim().to_string(),
            };
            let value = map.next_value_seed(self.child(&key_text))?;
            if out.insert(key, value).is_some() {
                self.duplicates.borrow_mut().push(self.child(&key_text).path);
            }
        }
        Ok(serde_yaml::Value::Mapping(out))
    }
}
