//! Loading Services, EndpointSlices and Nodes from YAML (or JSON) manifest files for the
//! `render` command: multi-document files, `kind: List` wrappers (as `kubectl get -o yaml`
//! prints), per-object warnings for anything that cannot be used, and hard errors only for
//! unreadable files and YAML syntax errors.
//!
//! Speed matters (a 100k-endpoint cluster dump is 20–30 MB), and serde_yaml alone parses
//! only ~25 MB/s. So each document is first run through [`fast`], a converter for the
//! block-style YAML that kubectl writes, producing JSON text whose line numbers match the
//! YAML's; serde_json then builds the typed objects directly from that text, one object at a
//! time. Anything the converter is not sure about (anchors, tags, flow collections,
//! directives, odd indentation, ...) makes it give up on that document, which then goes
//! through serde_yaml into a `serde_json::Value`. Both routes share JSON semantics, so an
//! object decodes the same way whichever one read it.

use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};

use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use serde::Deserialize;
use serde::de::DeserializeOwned;

/// The objects found in the manifests, in file order (a duplicate replaces the earlier
/// object in place).
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    pub services: Vec<Service>,
    pub endpoint_slices: Vec<EndpointSlice>,
    pub nodes: Vec<Node>,
}

/// A problem with one document or object that was skipped (or, for duplicates, replaced).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Warning {
    pub file: PathBuf,
    /// 1-based index of the YAML document in the file.
    pub document: usize,
    /// 1-based line where the object (or the error inside it) is, when known.
    pub line: Option<usize>,
    /// Index in the document's `items` when the object came from a List.
    pub item: Option<usize>,
    /// `Kind namespace/name` (or as much of it as is known).
    pub object: Option<String>,
    pub message: String,
}

impl fmt::Display for Warning {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.file.display())?;
        if let Some(line) = self.line {
            write!(f, ":{line}")?;
        }
        write!(f, ": document {}", self.document)?;
        if let Some(item) = self.item {
            write!(f, ", items[{item}]")?;
        }
        if let Some(object) = &self.object {
            write!(f, ", {object}")?;
        }
        write!(f, ": {}", self.message)
    }
}

/// A manifest that cannot be used at all (the `render` command exits with status 2).
#[derive(Debug, thiserror::Error)]
pub enum ManifestError {
    #[error("{}: cannot read manifest: {source}", .file.display())]
    Read {
        file: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{}{}: invalid YAML: {message}", .file.display(), fmt_location(*.location))]
    Yaml {
        file: PathBuf,
        /// 1-based line and column in the file, when known.
        location: Option<(usize, usize)>,
        message: String,
    },
}

fn fmt_location(location: Option<(usize, usize)>) -> String {
    match location {
        Some((line, column)) => format!(":{line}:{column}"),
        None => String::new(),
    }
}

/// Reads every file, in order, into one snapshot.
pub fn load_manifests(paths: &[PathBuf]) -> Result<(Snapshot, Vec<Warning>), ManifestError> {
    let mut collector = Collector::default();
    for path in paths {
        let text = std::fs::read_to_string(path).map_err(|source| ManifestError::Read {
            file: path.clone(),
            source,
        })?;
        collector.add_text(&text, path)?;
    }
    Ok((collector.snapshot, collector.warnings))
}

/// Parses manifest text as if it were the file `file` (used by tests and by callers that
/// already hold the text).
pub fn load_manifest_str(
    text: &str,
    file: &Path,
) -> Result<(Snapshot, Vec<Warning>), ManifestError> {
    let mut collector = Collector::default();
    collector.add_text(text, file)?;
    Ok((collector.snapshot, collector.warnings))
}

// ---------------------------------------------------------------------------------------------
// Dispatch
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum ObjKind {
    Service,
    EndpointSlice,
    Node,
}

impl ObjKind {
    fn name(self) -> &'static str {
        match self {
            ObjKind::Service => "Service",
            ObjKind::EndpointSlice => "EndpointSlice",
            ObjKind::Node => "Node",
        }
    }

    fn from_type(api_version: &str, kind: &str) -> Option<ObjKind> {
        match (api_version, kind) {
            ("v1", "Service") => Some(ObjKind::Service),
            ("discovery.k8s.io/v1", "EndpointSlice") => Some(ObjKind::EndpointSlice),
            ("v1", "Node") => Some(ObjKind::Node),
            _ => None,
        }
    }

    /// For `kind: List` any supported item; for typed lists (`ServiceList`, as the API
    /// returns them) the element kind, used when items omit their own type.
    fn list_element(api_version: &str, kind: &str) -> Option<Option<ObjKind>> {
        match (api_version, kind) {
            ("v1", "List") => Some(None),
            ("v1", "ServiceList") => Some(Some(ObjKind::Service)),
            ("discovery.k8s.io/v1", "EndpointSliceList") => Some(Some(ObjKind::EndpointSlice)),
            ("v1", "NodeList") => Some(Some(ObjKind::Node)),
            _ => None,
        }
    }
}

/// `apiVersion`, `kind` and `metadata.name/namespace` of an object, as far as they are
/// strings in the input.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Head {
    api_version: Option<String>,
    kind: Option<String>,
    name: Option<String>,
    namespace: Option<String>,
}

impl Head {
    fn from_value(value: &serde_json::Value) -> Head {
        let text = |v: Option<&serde_json::Value>| v.and_then(|v| v.as_str()).map(str::to_string);
        let metadata = value.get("metadata");
        Head {
            api_version: text(value.get("apiVersion")),
            kind: text(value.get("kind")),
            name: text(metadata.and_then(|m| m.get("name"))),
            namespace: text(metadata.and_then(|m| m.get("namespace"))),
        }
    }

    fn describe(&self) -> Option<String> {
        let name = match (&self.namespace, &self.name) {
            (Some(ns), Some(name)) if !ns.is_empty() => Some(format!("{ns}/{name}")),
            (_, Some(name)) => Some(name.clone()),
            _ => None,
        };
        match (&self.kind, name) {
            (Some(kind), Some(name)) => Some(format!("{kind} {name}")),
            (Some(kind), None) => Some(kind.clone()),
            (None, Some(name)) => Some(name),
            (None, None) => None,
        }
    }
}

/// An object's text or tree, waiting to be decoded into its type.
enum Body<'a> {
    /// JSON text whose first line is file line `line`.
    Json(&'a str),
    Value(serde_json::Value),
}

struct Candidate<'a> {
    head: Head,
    body: Body<'a>,
    /// File line where the object starts.
    line: Option<usize>,
    item: Option<usize>,
}

/// A decoded object's identity and source.
struct Placement {
    kind: ObjKind,
    namespace: String,
    name: String,
    origin: Origin,
    item: Option<usize>,
}

/// Where a decoded object came from, for duplicate warnings.
#[derive(Debug, Clone)]
struct Origin {
    file: PathBuf,
    document: usize,
    line: Option<usize>,
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.file.display())?;
        if let Some(line) = self.line {
            write!(f, ":{line}")?;
        }
        write!(f, " (document {})", self.document)
    }
}

#[derive(Default)]
struct Collector {
    snapshot: Snapshot,
    warnings: Vec<Warning>,
    /// (kind, namespace, name) → index in the snapshot's vector and where it came from.
    seen: HashMap<(ObjKind, String, String), (usize, Origin)>,
}

/// Strips serde's " at line L column C" suffix (we report lines ourselves).
fn strip_position(message: &str) -> &str {
    match message.rfind(" at line ") {
        Some(i) if message[i..].contains(" column ") => &message[..i],
        _ => message,
    }
}

impl Collector {
    fn add_text(&mut self, text: &str, file: &Path) -> Result<(), ManifestError> {
        let text = text.strip_prefix('\u{feff}').unwrap_or(text);
        match split_documents(text) {
            Some(chunks) => {
                for chunk in chunks {
                    self.add_chunk(&chunk, file)?;
                }
                Ok(())
            }
            None => self.add_whole_file_slowly(text, file),
        }
    }

    /// The route for files with YAML directives: serde_yaml over the whole file.
    fn add_whole_file_slowly(&mut self, text: &str, file: &Path) -> Result<(), ManifestError> {
        for (i, document) in serde_yaml::Deserializer::from_str(text).enumerate() {
            let value = serde_json::Value::deserialize(document)
                .map_err(|err| yaml_error(file, 0, &err))?;
            self.add_value(value, file, i + 1, None);
        }
        Ok(())
    }

    fn add_chunk(&mut self, chunk: &Chunk<'_>, file: &Path) -> Result<(), ManifestError> {
        match fast::convert(chunk.text) {
            Ok(fast::Converted::Empty) => Ok(()),
            Ok(fast::Converted::Json(content)) => {
                match serde_json::from_str::<serde_json::Value>(content) {
                    Ok(value) => {
                        self.add_value(value, file, chunk.document, Some(chunk.first_line));
                        Ok(())
                    }
                    Err(_) => self.add_chunk_slowly(chunk, file),
                }
            }
            Ok(fast::Converted::Doc(doc)) => {
                self.add_converted(&doc, chunk, file);
                Ok(())
            }
            Err(fast::Bail) => self.add_chunk_slowly(chunk, file),
        }
    }

    fn add_chunk_slowly(&mut self, chunk: &Chunk<'_>, file: &Path) -> Result<(), ManifestError> {
        let value: serde_json::Value = serde_yaml::from_str(chunk.text)
            .map_err(|err| yaml_error(file, chunk.first_line - 1, &err))?;
        self.add_value(value, file, chunk.document, Some(chunk.first_line));
        Ok(())
    }

    fn add_converted(&mut self, doc: &fast::Document, chunk: &Chunk<'_>, file: &Path) {
        let root = &doc.root;
        let list = match (&root.api_version, &root.kind) {
            (Some(api_version), Some(kind)) => ObjKind::list_element(api_version, kind),
            _ => None,
        };
        let Some(element) = list else {
            let candidate = Candidate {
                head: root.clone(),
                body: Body::Json(&doc.json),
                line: Some(chunk.first_line),
                item: None,
            };
            self.add_candidate(candidate, file, chunk.document);
            return;
        };
        let Some(items) = &doc.items else {
            if doc.items_present {
                self.warn(
                    file,
                    chunk.document,
                    Some(chunk.first_line),
                    None,
                    root.describe(),
                    "items is not a list",
                );
            }
            return;
        };
        for (index, item) in items.iter().enumerate() {
            let mut head = item.head.clone();
            inherit_list_type(&mut head, element);
            let candidate = Candidate {
                head,
                body: Body::Json(&doc.json[item.start..item.end]),
                line: Some(chunk.first_line + item.line),
                item: Some(index),
            };
            self.add_candidate(candidate, file, chunk.document);
        }
    }

    fn add_value(
        &mut self,
        value: serde_json::Value,
        file: &Path,
        document: usize,
        line: Option<usize>,
    ) {
        match value {
            serde_json::Value::Null => {}
            serde_json::Value::Object(_) => {
                let head = Head::from_value(&value);
                let element = match (&head.api_version, &head.kind) {
                    (Some(api_version), Some(kind)) => ObjKind::list_element(api_version, kind),
                    _ => None,
                };
                let Some(element) = element else {
                    let candidate = Candidate {
                        head,
                        body: Body::Value(value),
                        line,
                        item: None,
                    };
                    self.add_candidate(candidate, file, document);
                    return;
                };
                let serde_json::Value::Object(mut map) = value else {
                    return;
                };
                match map.remove("items") {
                    None | Some(serde_json::Value::Null) => {}
                    Some(serde_json::Value::Array(items)) => {
                        for (index, item) in items.into_iter().enumerate() {
                            let mut item_head = Head::from_value(&item);
                            inherit_list_type(&mut item_head, element);
                            let candidate = Candidate {
                                head: item_head,
                                body: Body::Value(item),
                                line,
                                item: Some(index),
                            };
                            self.add_candidate(candidate, file, document);
                        }
                    }
                    Some(_) => self.warn(
                        file,
                        document,
                        line,
                        None,
                        head.describe(),
                        "items is not a list",
                    ),
                }
            }
            _ => self.warn(
                file,
                document,
                line,
                None,
                None,
                "document is not a mapping; skipped",
            ),
        }
    }

    fn add_candidate(&mut self, candidate: Candidate<'_>, file: &Path, document: usize) {
        let is_object = match &candidate.body {
            Body::Json(text) => text.trim_start().starts_with('{'),
            Body::Value(value) => value.is_object(),
        };
        let describe = candidate.head.describe();
        if !is_object {
            self.warn(
                file,
                document,
                candidate.line,
                candidate.item,
                describe,
                "not an object; skipped",
            );
            return;
        }
        let (api_version, kind) = match (&candidate.head.api_version, &candidate.head.kind) {
            (Some(a), Some(k)) => (a.as_str(), k.as_str()),
            _ => {
                let message = "apiVersion and kind must be set (strings); skipped";
                self.warn(
                    file,
                    document,
                    candidate.line,
                    candidate.item,
                    describe,
                    message,
                );
                return;
            }
        };
        let Some(kind) = ObjKind::from_type(api_version, kind) else {
            let message = format!(
                "unsupported object type apiVersion {api_version:?} kind {kind:?} \
                 (expected v1 Service, discovery.k8s.io/v1 EndpointSlice or v1 Node); skipped"
            );
            self.warn(
                file,
                document,
                candidate.line,
                candidate.item,
                describe,
                &message,
            );
            return;
        };
        let origin = Origin {
            file: file.to_path_buf(),
            document,
            line: candidate.line,
        };
        let place = |namespace: &Option<String>, name: &Option<String>| Placement {
            kind,
            namespace: namespace.clone().unwrap_or_default(),
            name: name.clone().unwrap_or_default(),
            origin: origin.clone(),
            item: candidate.item,
        };
        match kind {
            ObjKind::Service => {
                if let Some(obj) = self.decode::<Service>(&candidate, &origin, describe) {
                    let placement = place(&obj.metadata.namespace, &obj.metadata.name);
                    self.insert(placement, obj, |s| &mut s.services);
                }
            }
            ObjKind::EndpointSlice => {
                if let Some(obj) = self.decode::<EndpointSlice>(&candidate, &origin, describe) {
                    let placement = place(&obj.metadata.namespace, &obj.metadata.name);
                    self.insert(placement, obj, |s| &mut s.endpoint_slices);
                }
            }
            ObjKind::Node => {
                if let Some(obj) = self.decode::<Node>(&candidate, &origin, describe) {
                    let placement = place(&None, &obj.metadata.name);
                    self.insert(placement, obj, |s| &mut s.nodes);
                }
            }
        }
    }

    /// Decodes the body into `T`, or records a warning naming the line of the bad field.
    fn decode<T: DeserializeOwned>(
        &mut self,
        candidate: &Candidate<'_>,
        origin: &Origin,
        describe: Option<String>,
    ) -> Option<T> {
        let result = match &candidate.body {
            Body::Json(text) => serde_json::from_str::<T>(text).map_err(|err| {
                // The JSON text keeps the YAML's line breaks, so its line is the file's.
                let line = candidate
                    .line
                    .map(|start| start + err.line().saturating_sub(1));
                (line, err.to_string())
            }),
            Body::Value(value) => {
                T::deserialize(value).map_err(|err| (candidate.line, err.to_string()))
            }
        };
        match result {
            Ok(obj) => Some(obj),
            Err((line, message)) => {
                let message = format!("cannot decode: {}; skipped", strip_position(&message));
                self.warn(
                    &origin.file,
                    origin.document,
                    line,
                    candidate.item,
                    describe,
                    &message,
                );
                None
            }
        }
    }

    /// Adds a decoded object, or replaces the earlier one with the same name.
    fn insert<T>(
        &mut self,
        placement: Placement,
        obj: T,
        vector: fn(&mut Snapshot) -> &mut Vec<T>,
    ) {
        let Placement {
            kind,
            namespace,
            name,
            origin,
            item,
        } = placement;
        if name.is_empty() {
            let describe = if namespace.is_empty() {
                kind.name().to_string()
            } else {
                format!("{} in namespace {namespace}", kind.name())
            };
            let message = "metadata.name is missing; skipped";
            self.warn(
                &origin.file,
                origin.document,
                origin.line,
                item,
                Some(describe),
                message,
            );
            return;
        }
        let describe = if namespace.is_empty() {
            format!("{} {name}", kind.name())
        } else {
            format!("{} {namespace}/{name}", kind.name())
        };
        let key = (kind, namespace, name);
        if let Some((index, earlier)) = self.seen.get(&key).cloned() {
            vector(&mut self.snapshot)[index] = obj;
            let message = format!("duplicate of the object at {earlier}; the later one wins");
            self.warn(
                &origin.file,
                origin.document,
                origin.line,
                item,
                Some(describe),
                &message,
            );
            self.seen.insert(key, (index, origin));
            return;
        }
        let list = vector(&mut self.snapshot);
        list.push(obj);
        let index = list.len() - 1;
        self.seen.insert(key, (index, origin));
    }

    fn warn(
        &mut self,
        file: &Path,
        document: usize,
        line: Option<usize>,
        item: Option<usize>,
        object: Option<String>,
        message: &str,
    ) {
        let warning = Warning {
            file: file.to_path_buf(),
            document,
            line,
            item,
            object,
            message: message.to_string(),
        };
        self.warnings.push(warning);
    }
}

fn inherit_list_type(head: &mut Head, element: Option<ObjKind>) {
    if let Some(element) = element {
        if head.kind.is_none() {
            head.kind = Some(element.name().to_string());
        }
        if head.api_version.is_none() {
            let api_version = if element == ObjKind::EndpointSlice {
                "discovery.k8s.io/v1"
            } else {
                "v1"
            };
            head.api_version = Some(api_version.to_string());
        }
    }
}

/// A serde_yaml error as a [`ManifestError`], its line shifted by `line_offset`.
fn yaml_error(file: &Path, line_offset: usize, err: &serde_yaml::Error) -> ManifestError {
    let message = err.to_string();
    ManifestError::Yaml {
        file: file.to_path_buf(),
        location: err.location().map(|l| (l.line() + line_offset, l.column())),
        message: strip_position(&message).to_string(),
    }
}

// ---------------------------------------------------------------------------------------------
// Document splitting
// ---------------------------------------------------------------------------------------------

/// One YAML document's text, starting at its `---` line if it has one.
struct Chunk<'a> {
    text: &'a str,
    /// File line (1-based) of the chunk's first line.
    first_line: usize,
    /// 1-based document number.
    document: usize,
}

fn is_separator(line: &str) -> bool {
    let line = line.trim_end_matches(['\n', '\r']);
    line.strip_prefix("---")
        .is_some_and(|rest| rest.is_empty() || rest.starts_with([' ', '\t']))
}

fn is_blank_or_comment(line: &str) -> bool {
    let t = line.trim_matches([' ', '\t', '\n', '\r']);
    t.is_empty() || t.starts_with('#')
}

/// Splits at `---` lines. `None` when the file has YAML directives (`%YAML`, `%TAG`), which
/// only serde_yaml's own document handling gets right.
fn split_documents(text: &str) -> Option<Vec<Chunk<'_>>> {
    let mut chunks = Vec::new();
    let mut start = 0;
    let mut start_line = 1;
    let mut offset = 0;
    let mut has_content = false;
    let mut document = 0;
    for (line_no, line) in (1..).zip(text.split_inclusive('\n')) {
        if line.starts_with('%') {
            return None;
        }
        if is_separator(line) {
            if offset > start && (start > 0 || has_content) {
                document += 1;
                chunks.push(Chunk {
                    text: &text[start..offset],
                    first_line: start_line,
                    document,
                });
            }
            start = offset;
            start_line = line_no;
            has_content = true;
        } else if !has_content && !is_blank_or_comment(line) {
            has_content = true;
        }
        offset += line.len();
    }
    if offset > start && has_content {
        document += 1;
        chunks.push(Chunk {
            text: &text[start..offset],
            first_line: start_line,
            document,
        });
    }
    Some(chunks)
}

// ---------------------------------------------------------------------------------------------
// The fast path
// ---------------------------------------------------------------------------------------------

/// Block-style YAML to JSON text, for the subset kubectl and most people write; gives up
/// ([`Bail`]) on anything else so that serde_yaml can take over.
///
/// The JSON keeps the YAML's line structure (a newline is emitted wherever the YAML starts a
/// new line before a key or value), so serde_json's error lines are YAML lines. Plain
/// scalars are typed exactly as serde_yaml types them (YAML 1.2 core schema: `null`, `true`,
/// decimal integers, floats; leading-zero digit strings stay strings); where the typing is
/// unusual (hex/octal, `+5`, `.inf`, huge integers) the converter bails.
mod fast {
    use std::borrow::Cow;
    use std::collections::HashSet;

    use super::Head;

    /// The converter does not handle this document; use serde_yaml.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub(super) struct Bail;

    type Res<T> = Result<T, Bail>;

    /// Nesting deeper than this is handed to serde_yaml (which errors past 128 levels).
    const MAX_DEPTH: usize = 100;

    pub(super) enum Converted<'a> {
        /// Only comments, blank lines and a separator.
        Empty,
        /// The document is JSON (flow style); here is its text.
        Json(&'a str),
        Doc(Document),
    }

    /// One object (or one element of the root's `items`).
    pub(super) struct Item {
        pub head: Head,
        /// Byte range in [`Document::json`].
        pub start: usize,
        pub end: usize,
        /// Line offset of the item from the chunk's first line.
        pub line: usize,
    }

    pub(super) struct Document {
        pub json: String,
        pub root: Head,
        /// Elements of a root-level `items` block sequence.
        pub items: Option<Vec<Item>>,
        /// Whether the root has an `items` key at all.
        pub items_present: bool,
    }

    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum Role {
        /// The document's root mapping.
        Root,
        /// The root's `items` sequence.
        Items,
        /// An element of `items`.
        Item,
        /// `metadata` of the root or of an item.
        Meta,
        Other,
    }

    /// A resolved scalar.
    enum Scalar<'a> {
        Null,
        Bool(bool),
        Unsigned(u64),
        Negative(i64),
        Float(f64),
        Str(Cow<'a, str>),
    }

    pub(super) fn convert(text: &str) -> Res<Converted<'_>> {
        // Control characters (other than tab and newline), CR line ends and tabs in odd places
        // are left to serde_yaml, which knows which of them are errors.
        if text
            .bytes()
            .any(|b| (b < 0x20 && b != b'\n' && b != b'\t') || b == 0x7f)
        {
            return Err(Bail);
        }
        let lines: Vec<&str> = text.split('\n').collect();
        let mut conv = Converter {
            lines,
            ends_with_newline: text.ends_with('\n'),
            pos: 0,
            out: String::with_capacity(text.len() + text.len() / 8),
            out_line: 0,
            items: None,
            items_present: false,
            key_pool: Vec::new(),
            depth: 0,
        };
        if let Some(first) = conv.lines.first()
            && let Some(rest) = first.strip_prefix("---")
        {
            let rest = rest.trim_start_matches([' ', '\t']);
            if !(rest.is_empty() || rest.starts_with('#')) {
                return Err(Bail);
            }
            conv.pos = 1;
        }
        conv.skip_blank();
        if conv.pos >= conv.lines.len() {
            return Ok(Converted::Empty);
        }
        let indent = conv.indent_at(conv.pos)?;
        let content = &conv.lines[conv.pos][indent..];
        if content.starts_with('{') || content.starts_with('[') {
            let start: usize = conv.lines[..conv.pos].iter().map(|l| l.len() + 1).sum();
            return Ok(Converted::Json(&text[start..]));
        }
        if split_key(content)?.is_none() {
            return Err(Bail);
        }
        let mut root = Head::default();
        conv.parse_mapping(indent, false, Role::Root, Some(&mut root))?;
        conv.skip_blank();
        if conv.pos < conv.lines.len() {
            return Err(Bail);
        }
        Ok(Converted::Doc(Document {
            json: conv.out,
            root,
            items: conv.items,
            items_present: conv.items_present,
        }))
    }

    struct Converter<'a> {
        lines: Vec<&'a str>,
        ends_with_newline: bool,
        /// Index of the line being read.
        pos: usize,
        out: String,
        /// Newlines written to `out` so far.
        out_line: usize,
        items: Option<Vec<Item>>,
        items_present: bool,
        /// Reused key lists for duplicate detection, one per open mapping.
        key_pool: Vec<Vec<Cow<'a, str>>>,
        /// Open collections; deep nesting is left to serde_yaml and its recursion limit.
        depth: usize,
    }

    fn is_blank_or_comment(line: &str) -> bool {
        let t = line.trim_start_matches([' ', '\t']);
        t.is_empty() || t.starts_with('#')
    }

    fn leading_spaces(s: &str) -> usize {
        s.bytes().take_while(|&b| b == b' ').count()
    }

    fn is_seq_entry(content: &str) -> bool {
        content == "-" || content.starts_with("- ")
    }

    /// Cuts a trailing comment (` #...`) off plain text.
    fn strip_comment(s: &str) -> &str {
        let bytes = s.as_bytes();
        for i in 0..bytes.len() {
            if bytes[i] == b'#' && (i == 0 || bytes[i - 1] == b' ' || bytes[i - 1] == b'\t') {
                return &s[..i];
            }
        }
        s
    }

    /// Whether what follows a closing quote or block header may end the line.
    fn only_comment_left(s: &str) -> bool {
        let t = s.trim_start_matches([' ', '\t']);
        t.is_empty() || (t.starts_with('#') && t.len() < s.len())
    }

    /// `key: rest` → `Some((key, rest))`; a scalar that is not a key → `None`.
    fn split_key(content: &str) -> Res<Option<(Cow<'_, str>, &str)>> {
        let first = content.as_bytes().first().copied().unwrap_or(b' ');
        if first == b'"' || first == b'\'' {
            let Some((key, after)) = single_line_quoted(content)? else {
                return Ok(None);
            };
            let after = after.trim_start_matches(' ');
            return match after.strip_prefix(':') {
                Some(rest) if rest.is_empty() || rest.starts_with([' ', '\t']) => {
                    Ok(Some((key, rest)))
                }
                _ => Ok(None),
            };
        }
        if matches!(
            first,
            b'?' | b'&' | b'*' | b'!' | b'|' | b'>' | b'%' | b'@' | b'`' | b'[' | b'{'
        ) {
            return Err(Bail);
        }
        let bytes = content.as_bytes();
        for i in 0..bytes.len() {
            match bytes[i] {
                b':' if i + 1 == bytes.len() || bytes[i + 1] == b' ' || bytes[i + 1] == b'\t' => {
                    let key = content[..i].trim_end_matches([' ', '\t']);
                    if key.is_empty() || key == "<<" || key == "-" || key.starts_with("- ") {
                        return Err(Bail);
                    }
                    return Ok(Some((Cow::Borrowed(key), &content[i + 1..])));
                }
                b'#' if i > 0 && (bytes[i - 1] == b' ' || bytes[i - 1] == b'\t') => {
                    return Ok(None);
                }
                _ => {}
            }
        }
        Ok(None)
    }

    /// A quoted scalar that closes on its own line: `(value, text after the closing quote)`;
    /// `None` when it does not close on this line.
    fn single_line_quoted(content: &str) -> Res<Option<(Cow<'_, str>, &str)>> {
        let quote = content.as_bytes()[0];
        let body = &content[1..];
        if quote == b'\'' {
            let mut value = String::new();
            let mut rest = body;
            loop {
                let Some(i) = rest.find('\'') else {
                    return Ok(None);
                };
                value.push_str(&rest[..i]);
                if rest[i + 1..].starts_with('\'') {
                    value.push('\'');
                    rest = &rest[i + 2..];
                } else {
                    return Ok(Some((Cow::Owned(value), &rest[i + 1..])));
                }
            }
        }
        let bytes = body.as_bytes();
        let mut i = 0;
        let mut escaped = false;
        while i < bytes.len() {
            match bytes[i] {
                b'\\' => {
                    escaped = true;
                    i += 2;
                    continue;
                }
                b'"' => {
                    let raw = &body[..i];
                    let value = if escaped {
                        Cow::Owned(unescape_double(raw)?)
                    } else {
                        Cow::Borrowed(raw)
                    };
                    return Ok(Some((value, &body[i + 1..])));
                }
                _ => i += 1,
            }
        }
        Ok(None)
    }

    /// Decodes the escapes of a single-line double-quoted scalar body.
    fn unescape_double(raw: &str) -> Res<String> {
        let mut out = String::with_capacity(raw.len());
        let mut chars = raw.chars();
        while let Some(c) = chars.next() {
            if c != '\\' {
                out.push(c);
                continue;
            }
            let e = chars.next().ok_or(Bail)?;
            let simple = match e {
                '0' => '\0',
                'a' => '\u{7}',
                'b' => '\u{8}',
                't' | '\t' => '\t',
                'n' => '\n',
                'v' => '\u{b}',
                'f' => '\u{c}',
                'r' => '\r',
                'e' => '\u{1b}',
                ' ' => ' ',
                '"' => '"',
                '/' => '/',
                '\\' => '\\',
                'N' => '\u{85}',
                '_' => '\u{a0}',
                'L' => '\u{2028}',
                'P' => '\u{2029}',
                'x' | 'u' | 'U' => {
                    let width = match e {
                        'x' => 2,
                        'u' => 4,
                        _ => 8,
                    };
                    let hex: String = chars.by_ref().take(width).collect();
                    if hex.len() != width {
                        return Err(Bail);
                    }
                    let code = u32::from_str_radix(&hex, 16).map_err(|_| Bail)?;
                    char::from_u32(code).ok_or(Bail)?
                }
                _ => return Err(Bail),
            };
            out.push(simple);
        }
        Ok(out)
    }

    /// Types a plain scalar as serde_yaml does, bailing where the rules get unusual.
    fn resolve_plain(s: &str) -> Res<Scalar<'_>> {
        match s {
            "" | "~" | "null" | "Null" | "NULL" => return Ok(Scalar::Null),
            "true" | "True" | "TRUE" => return Ok(Scalar::Bool(true)),
            "false" | "False" | "FALSE" => return Ok(Scalar::Bool(false)),
            _ => {}
        }
        let first = s.as_bytes()[0];
        if !(first.is_ascii_digit() || first == b'-' || first == b'.' || first == b'+') {
            return Ok(Scalar::Str(Cow::Borrowed(s)));
        }
        if first == b'+' {
            return Err(Bail);
        }
        let (negative, digits) = match s.strip_prefix('-') {
            Some(d) => (true, d),
            None => (false, s),
        };
        // 0x1F, 0o17, 0b101 are integers to serde_yaml; rare enough to leave to it. Text that
        // merely starts that way (a UID like `0b7c...`) falls through to the string rules.
        for (prefix, radix) in [("0x", 16), ("0o", 8), ("0b", 2)] {
            if let Some(rest) = digits.strip_prefix(prefix)
                && !rest.is_empty()
                && rest.chars().all(|c| c.is_digit(radix))
            {
                return Err(Bail);
            }
        }
        if !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()) {
            if digits.len() > 1 && digits.starts_with('0') {
                // YAML 1.2: leading zeros make it a string.
                return Ok(Scalar::Str(Cow::Borrowed(s)));
            }
            return if negative {
                s.parse::<i64>().map(Scalar::Negative).map_err(|_| Bail)
            } else {
                s.parse::<u64>().map(Scalar::Unsigned).map_err(|_| Bail)
            };
        }
        match s {
            ".inf" | ".Inf" | ".INF" | "-.inf" | "-.Inf" | "-.INF" | ".nan" | ".NaN" | ".NAN" => {
                return Err(Bail);
            }
            _ => {}
        }
        match s.parse::<f64>() {
            Ok(f) if f.is_finite() => Ok(Scalar::Float(f)),
            _ => Ok(Scalar::Str(Cow::Borrowed(s))),
        }
    }

    fn push_json_string(out: &mut String, s: &str) {
        out.push('"');
        let bytes = s.as_bytes();
        let mut run_start = 0;
        for (i, &b) in bytes.iter().enumerate() {
            let escape: Option<&str> = match b {
                b'"' => Some("\\\""),
                b'\\' => Some("\\\\"),
                b'\n' => Some("\\n"),
                b'\t' => Some("\\t"),
                b'\r' => Some("\\r"),
                0..0x20 | 0x7f => None,
                _ => continue,
            };
            out.push_str(&s[run_start..i]);
            match escape {
                Some(text) => out.push_str(text),
                None => out.push_str(&format!("\\u{b:04x}")),
            }
            run_start = i + 1;
        }
        out.push_str(&s[run_start..]);
        out.push('"');
    }

    impl<'a> Converter<'a> {
        fn skip_blank(&mut self) {
            while self.pos < self.lines.len() && is_blank_or_comment(self.lines[self.pos]) {
                self.pos += 1;
            }
        }

        /// Spaces before the content of line `i`; tabs there are left to serde_yaml.
        fn indent_at(&self, i: usize) -> Res<usize> {
            let line = self.lines[i];
            let n = leading_spaces(line);
            if line.as_bytes().get(n) == Some(&b'\t') {
                return Err(Bail);
            }
            if n == 0 && (line.starts_with("---") || line.starts_with("...")) {
                return Err(Bail);
            }
            Ok(n)
        }

        fn enter(&mut self) -> Res<()> {
            self.depth += 1;
            if self.depth > MAX_DEPTH {
                Err(Bail)
            } else {
                Ok(())
            }
        }

        /// Pads the output with newlines so that it is on line `line`.
        fn sync(&mut self, line: usize) {
            while self.out_line < line {
                self.out.push('\n');
                self.out_line += 1;
            }
        }

        fn emit_scalar(&mut self, scalar: &Scalar<'_>) {
            match scalar {
                Scalar::Null => self.out.push_str("null"),
                Scalar::Bool(true) => self.out.push_str("true"),
                Scalar::Bool(false) => self.out.push_str("false"),
                Scalar::Unsigned(n) => self.out.push_str(&n.to_string()),
                Scalar::Negative(n) => self.out.push_str(&n.to_string()),
                // Debug keeps a `.0` or an exponent, so serde_json reads a float back.
                Scalar::Float(f) => self.out.push_str(&format!("{f:?}")),
                Scalar::Str(s) => push_json_string(&mut self.out, s),
            }
        }

        /// A block mapping whose keys sit at column `indent`, starting on line `pos`. With
        /// `inline_first`, the first key follows a `- ` on its line.
        fn parse_mapping(
            &mut self,
            indent: usize,
            inline_first: bool,
            role: Role,
            mut head: Option<&mut Head>,
        ) -> Res<()> {
            self.enter()?;
            let mut keys = self.key_pool.pop().unwrap_or_default();
            keys.clear();
            let mut big: Option<HashSet<Cow<'a, str>>> = None;
            self.out.push('{');
            let mut first = true;
            loop {
                if !(first && inline_first) {
                    self.skip_blank();
                    if self.pos >= self.lines.len() {
                        break;
                    }
                    let ind = self.indent_at(self.pos)?;
                    if ind < indent {
                        break;
                    }
                    if ind > indent {
                        return Err(Bail);
                    }
                }
                let line: &'a str = self.lines[self.pos];
                let content = line.get(indent..).ok_or(Bail)?;
                if is_seq_entry(content) {
                    return Err(Bail);
                }
                let (key, after_colon) = split_key(content)?.ok_or(Bail)?;
                match &mut big {
                    Some(set) => {
                        if !set.insert(key.clone()) {
                            return Err(Bail);
                        }
                    }
                    None => {
                        if keys.contains(&key) {
                            return Err(Bail);
                        }
                        keys.push(key.clone());
                        if keys.len() > 32 {
                            big = Some(keys.drain(..).collect());
                        }
                    }
                }
                if !first {
                    self.out.push(',');
                }
                self.sync(self.pos);
                push_json_string(&mut self.out, &key);
                self.out.push(':');

                let wanted = match role {
                    Role::Root | Role::Item => matches!(&*key, "apiVersion" | "kind"),
                    Role::Meta => matches!(&*key, "name" | "namespace"),
                    _ => false,
                };
                let child_role = match (role, &*key) {
                    (Role::Root | Role::Item, "metadata") => Role::Meta,
                    (Role::Root, "items") => {
                        self.items_present = true;
                        Role::Items
                    }
                    _ => Role::Other,
                };
                let rest = after_colon.trim_start_matches([' ', '\t']);
                let value = if rest.is_empty() || rest.starts_with('#') {
                    self.pos += 1;
                    let child_head = if child_role == Role::Meta {
                        head.as_deref_mut()
                    } else {
                        None
                    };
                    self.parse_block_node(indent, true, child_role, child_head)?;
                    None
                } else {
                    self.parse_inline_value(rest, indent, wanted)?
                };
                if child_role == Role::Items
                    && self.items.is_none()
                    && (self.out.ends_with("[]") || self.out.ends_with("null"))
                {
                    // `items: []` or an empty value: an empty list.
                    self.items = Some(Vec::new());
                }
                if let (Some(value), Some(h)) = (value, head.as_deref_mut()) {
                    match &*key {
                        "apiVersion" => h.api_version = Some(value),
                        "kind" => h.kind = Some(value),
                        "name" => h.name = Some(value),
                        "namespace" => h.namespace = Some(value),
                        _ => {}
                    }
                }
                first = false;
            }
            self.out.push('}');
            keys.clear();
            self.key_pool.push(keys);
            self.depth -= 1;
            Ok(())
        }

        /// The value of a `key:` or `-` with nothing after it on its line; `pos` is the next
        /// line. A sequence may sit at the parent's own column when the parent is a mapping.
        fn parse_block_node(
            &mut self,
            parent_indent: usize,
            seq_at_parent: bool,
            role: Role,
            head: Option<&mut Head>,
        ) -> Res<()> {
            self.skip_blank();
            if self.pos >= self.lines.len() {
                self.out.push_str("null");
                return Ok(());
            }
            let ind = self.indent_at(self.pos)?;
            let line: &'a str = self.lines[self.pos];
            let content = &line[ind..];
            let seq = is_seq_entry(content);
            if !(ind > parent_indent || (seq_at_parent && ind == parent_indent && seq)) {
                self.out.push_str("null");
                return Ok(());
            }
            self.sync(self.pos);
            if seq {
                return self.parse_sequence(ind, role);
            }
            if split_key(content)?.is_some() {
                let role = if role == Role::Items {
                    Role::Other
                } else {
                    role
                };
                return self.parse_mapping(ind, false, role, head);
            }
            if content.starts_with(['|', '>']) {
                return Err(Bail);
            }
            self.parse_inline_value(content, parent_indent, false)
                .map(|_| ())
        }

        fn parse_sequence(&mut self, indent: usize, role: Role) -> Res<()> {
            self.enter()?;
            self.out.push('[');
            let mut first = true;
            loop {
                self.skip_blank();
                if self.pos >= self.lines.len() {
                    break;
                }
                let ind = self.indent_at(self.pos)?;
                if ind < indent {
                    break;
                }
                if ind > indent {
                    return Err(Bail);
                }
                let line: &'a str = self.lines[self.pos];
                let content = &line[indent..];
                if !is_seq_entry(content) {
                    break;
                }
                if !first {
                    self.out.push(',');
                }
                self.sync(self.pos);
                let start = self.out.len();
                let item_line = self.pos;
                let after_dash = &content[1..];
                if after_dash.starts_with('\t') {
                    return Err(Bail);
                }
                let spaces = leading_spaces(after_dash);
                let rest = &after_dash[spaces..];
                let element_role = if role == Role::Items {
                    Role::Item
                } else {
                    Role::Other
                };
                let mut item_head = Head::default();
                let head = if role == Role::Items {
                    Some(&mut item_head)
                } else {
                    None
                };
                if rest.is_empty() || rest.starts_with('#') {
                    self.pos += 1;
                    self.parse_block_node(indent, false, element_role, head)?;
                } else if is_seq_entry(rest) {
                    return Err(Bail);
                } else if split_key(rest)?.is_some() {
                    self.parse_mapping(indent + 1 + spaces, true, element_role, head)?;
                } else {
                    self.parse_inline_value(rest, indent, false)?;
                }
                if role == Role::Items {
                    let item = Item {
                        head: item_head,
                        start,
                        end: self.out.len(),
                        line: item_line,
                    };
                    self.items.get_or_insert_with(Vec::new).push(item);
                }
                first = false;
            }
            if role == Role::Items && self.items.is_none() {
                self.items = Some(Vec::new());
            }
            self.out.push(']');
            self.depth -= 1;
            Ok(())
        }

        /// A value that starts on line `pos` with `rest`; consumes its lines. Returns the
        /// value when `want_str` and it is a string.
        fn parse_inline_value(
            &mut self,
            rest: &'a str,
            parent_indent: usize,
            want_str: bool,
        ) -> Res<Option<String>> {
            let first = rest.as_bytes()[0];
            let next = rest.as_bytes().get(1).copied();
            let string = match first {
                b'"' | b'\'' => self.parse_quoted(rest, parent_indent)?,
                b'|' | b'>' => self.parse_block_scalar(rest, parent_indent)?,
                b'{' | b'[' => {
                    let text = strip_comment(rest).trim_end_matches([' ', '\t']);
                    match text {
                        "{}" | "[]" => self.out.push_str(text),
                        _ => return Err(Bail),
                    }
                    self.pos += 1;
                    return Ok(None);
                }
                b'&' | b'*' | b'!' | b'%' | b'@' | b'`' | b',' | b']' | b'}' | b'#' => {
                    return Err(Bail);
                }
                b'?' | b':' | b'-'
                    if next.is_none() || next == Some(b' ') || next == Some(b'\t') =>
                {
                    return Err(Bail);
                }
                _ => {
                    let text = self.parse_plain(rest, parent_indent)?;
                    let scalar = resolve_plain(&text)?;
                    self.emit_scalar(&scalar);
                    return Ok(match scalar {
                        Scalar::Str(s) if want_str => Some(s.into_owned()),
                        _ => None,
                    });
                }
            };
            push_json_string(&mut self.out, &string);
            Ok(want_str.then_some(string))
        }

        /// A plain scalar, folding continuation lines indented past `parent_indent`.
        fn parse_plain(&mut self, rest: &'a str, parent_indent: usize) -> Res<Cow<'a, str>> {
            let uncommented = strip_comment(rest);
            let had_comment = uncommented.len() != rest.len();
            let text = uncommented.trim_end_matches([' ', '\t']);
            check_plain_line(text)?;
            self.pos += 1;
            if had_comment {
                return Ok(Cow::Borrowed(text));
            }
            let mut folded: Option<String> = None;
            loop {
                let mut blank = 0;
                let mut j = self.pos;
                while j < self.lines.len()
                    && self.lines[j].trim_start_matches([' ', '\t']).is_empty()
                {
                    blank += 1;
                    j += 1;
                }
                if j >= self.lines.len() {
                    break;
                }
                let ind = self.indent_at(j)?;
                let content = &self.lines[j][ind..];
                if ind <= parent_indent || content.starts_with('#') {
                    break;
                }
                let uncommented = strip_comment(content);
                let piece = uncommented.trim_end_matches([' ', '\t']);
                check_plain_line(piece)?;
                if is_seq_entry(piece)
                    || piece.starts_with([
                        '[', '{', '&', '*', '!', '|', '>', '\'', '"', '%', '@', '`', '?', ':',
                    ])
                {
                    return Err(Bail);
                }
                let buf = folded.get_or_insert_with(|| text.to_string());
                if blank == 0 {
                    buf.push(' ');
                } else {
                    buf.extend(std::iter::repeat_n('\n', blank));
                }
                buf.push_str(piece);
                self.pos = j + 1;
                if uncommented.len() != content.len() {
                    break;
                }
            }
            Ok(folded.map_or(Cow::Borrowed(text), Cow::Owned))
        }

        /// A single- or double-quoted scalar, possibly folded over several lines.
        fn parse_quoted(&mut self, rest: &'a str, parent_indent: usize) -> Res<String> {
            if let Some((value, after)) = single_line_quoted(rest)? {
                if !only_comment_left(after) {
                    return Err(Bail);
                }
                self.pos += 1;
                return Ok(value.into_owned());
            }
            let double = rest.starts_with('"');
            let mut value = String::new();
            // Length of `value` that trailing-whitespace trimming must not cut into.
            let mut protected = 0;
            let mut text: &str = &rest[1..];
            loop {
                let mut chars = text.char_indices();
                let mut closed_at = None;
                let mut line_escaped = false;
                while let Some((i, c)) = chars.next() {
                    if double && c == '\\' {
                        let Some((j, e)) = chars.next() else {
                            line_escaped = true;
                            break;
                        };
                        let escape_text = &text[i..j + e.len_utf8()];
                        let escape_text = if matches!(e, 'x' | 'u' | 'U') {
                            let width = match e {
                                'x' => 2,
                                'u' => 4,
                                _ => 8,
                            };
                            let end = j + 1 + width;
                            let hex = text.get(j + 1..end).ok_or(Bail)?;
                            for _ in 0..width {
                                chars.next();
                            }
                            &text[i..i + 2 + hex.len()]
                        } else {
                            escape_text
                        };
                        value.push_str(&unescape_double(escape_text)?);
                        protected = value.len();
                    } else if c == '"' && double {
                        closed_at = Some(i);
                        break;
                    } else if c == '\'' && !double {
                        if text[i + 1..].starts_with('\'') {
                            chars.next();
                            value.push('\'');
                            protected = value.len();
                        } else {
                            closed_at = Some(i);
                            break;
                        }
                    } else {
                        value.push(c);
                    }
                }
                if let Some(i) = closed_at {
                    if !only_comment_left(&text[i + 1..]) {
                        return Err(Bail);
                    }
                    self.pos += 1;
                    return Ok(value);
                }
                if !line_escaped {
                    let keep = value.trim_end_matches([' ', '\t']).len().max(protected);
                    value.truncate(keep);
                }
                // Move to the next line, counting empty ones.
                let mut blank = 0;
                let mut j = self.pos + 1;
                while j < self.lines.len()
                    && self.lines[j].trim_start_matches([' ', '\t']).is_empty()
                {
                    blank += 1;
                    j += 1;
                }
                if j >= self.lines.len() {
                    return Err(Bail);
                }
                let ind = self.indent_at(j)?;
                if ind <= parent_indent {
                    return Err(Bail);
                }
                if !line_escaped || blank > 0 {
                    if blank == 0 {
                        value.push(' ');
                    } else {
                        value.extend(std::iter::repeat_n('\n', blank));
                    }
                }
                protected = value.len();
                self.pos = j;
                text = self.lines[j].trim_start_matches([' ', '\t']);
            }
        }

        /// `|` and `>` block scalars without an explicit indentation indicator.
        fn parse_block_scalar(&mut self, rest: &'a str, parent_indent: usize) -> Res<String> {
            let literal = rest.starts_with('|');
            let header = &rest[1..];
            let (chomp, after) = match header.as_bytes().first() {
                Some(b'-') => (Chomp::Strip, &header[1..]),
                Some(b'+') => (Chomp::Keep, &header[1..]),
                _ => (Chomp::Clip, header),
            };
            if !only_comment_left(after) {
                return Err(Bail);
            }
            let mut j = self.pos + 1;
            let mut leading_blank = 0;
            let mut max_blank_spaces = 0;
            while j < self.lines.len() && self.lines[j].trim_start_matches(' ').is_empty() {
                max_blank_spaces = max_blank_spaces.max(self.lines[j].len());
                leading_blank += 1;
                j += 1;
            }
            let content_indent = if j < self.lines.len() {
                self.indent_at(j)?
            } else {
                0
            };
            if j >= self.lines.len() || content_indent <= parent_indent {
                // Empty scalar: only its (blank) lines.
                if chomp == Chomp::Keep && leading_blank > 0 {
                    return Err(Bail);
                }
                self.pos = j.min(self.lines.len());
                return Ok(String::new());
            }
            if max_blank_spaces > content_indent {
                return Err(Bail);
            }
            let mut body: Vec<&str> = vec![""; leading_blank];
            while j < self.lines.len() {
                let line = self.lines[j];
                if line.trim_start_matches(' ').is_empty() {
                    body.push(line.get(content_indent..).unwrap_or(""));
                } else {
                    let ind = leading_spaces(line);
                    if ind < content_indent {
                        break;
                    }
                    body.push(&line[content_indent..]);
                }
                j += 1;
            }
            if j == self.lines.len() && !self.ends_with_newline {
                // The last line has no line break; the chomping rules then differ.
                return Err(Bail);
            }
            // split('\n') yields a final empty "line" after the last newline; never content.
            if j == self.lines.len() && body.last() == Some(&"") {
                body.pop();
            }
            self.pos = j;
            let trailing = body.iter().rev().take_while(|l| l.is_empty()).count();
            let content = &body[..body.len() - trailing];
            let mut value = String::new();
            if literal {
                for line in content {
                    value.push_str(line);
                    value.push('\n');
                }
            } else {
                let mut pending_breaks = 0;
                let mut started = false;
                for line in content {
                    if line.is_empty() {
                        pending_breaks += 1;
                        continue;
                    }
                    if line.starts_with([' ', '\t']) {
                        return Err(Bail);
                    }
                    if started {
                        if pending_breaks == 0 {
                            value.push(' ');
                        } else {
                            value.extend(std::iter::repeat_n('\n', pending_breaks));
                        }
                    } else {
                        value.extend(std::iter::repeat_n('\n', pending_breaks));
                    }
                    pending_breaks = 0;
                    started = true;
                    value.push_str(line);
                }
                if started {
                    value.push('\n');
                }
            }
            match chomp {
                Chomp::Clip => {}
                Chomp::Strip => {
                    let keep = value.trim_end_matches('\n').len();
                    value.truncate(keep);
                }
                Chomp::Keep => {
                    if content.is_empty() {
                        return Err(Bail);
                    }
                    value.extend(std::iter::repeat_n('\n', trailing));
                }
            }
            Ok(value)
        }
    }

    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum Chomp {
        Clip,
        Strip,
        Keep,
    }

    /// Rejects plain text that YAML would read as something else (a nested key).
    fn check_plain_line(text: &str) -> Res<()> {
        if text.ends_with(':') || text.contains(": ") || text.contains(":\t") || text.contains(" #")
        {
            return Err(Bail);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(text: &str) -> (Snapshot, Vec<Warning>) {
        load_manifest_str(text, Path::new("m.yaml")).unwrap()
    }

    /// The fast converter's JSON for `text`, or `None` if it bailed.
    fn fast_value(text: &str) -> Option<serde_json::Value> {
        match fast::convert(text) {
            Ok(fast::Converted::Doc(doc)) => Some(serde_json::from_str(&doc.json).unwrap()),
            Ok(fast::Converted::Empty) => Some(serde_json::Value::Null),
            Ok(fast::Converted::Json(t)) => Some(serde_json::from_str(t).unwrap()),
            Err(fast::Bail) => None,
        }
    }

    fn slow_value(text: &str) -> serde_json::Value {
        serde_yaml::from_str(text).unwrap()
    }

    const SERVICE: &str = "apiVersion: v1
kind: Service
metadata:
  name: web
  namespace: default
spec:
  clusterIP: 10.96.0.10
  ports:
  - name: http
    port: 80
    protocol: TCP
    targetPort: 8080
  selector:
    app: web
";

    const SLICE: &str = "addressType: IPv4
apiVersion: discovery.k8s.io/v1
endpoints:
- addresses:
  - 10.244.1.5
  conditions:
    ready: true
  nodeName: node-a
kind: EndpointSlice
metadata:
  labels:
    kubernetes.io/service-name: web
  name: web-abc12
  namespace: default
ports:
- name: http
  port: 8080
  protocol: TCP
";

    const NODE: &str = "apiVersion: v1
kind: Node
metadata:
  name: node-a
spec:
  podCIDR: 10.244.1.0/24
status:
  addresses:
  - address: 192.168.0.10
    type: InternalIP
";

    #[test]
    fn multi_document_file() {
        let text = format!("# cluster dump\n---\n{SERVICE}---\n{SLICE}\n---\n---\n{NODE}");
        let (snap, warnings) = load(&text);
        assert!(warnings.is_empty(), "{warnings:?}");
        assert_eq!(snap.services.len(), 1);
        assert_eq!(snap.endpoint_slices.len(), 1);
        assert_eq!(snap.nodes.len(), 1);
        let svc = &snap.services[0];
        assert_eq!(svc.metadata.name.as_deref(), Some("web"));
        let spec = svc.spec.as_ref().unwrap();
        assert_eq!(spec.cluster_ip.as_deref(), Some("10.96.0.10"));
        assert_eq!(spec.ports.as_ref().unwrap()[0].port, 80);
        // Not defaulted: sessionAffinity etc. stay unset.
        assert_eq!(spec.session_affinity, None);
        let slice = &snap.endpoint_slices[0];
        assert_eq!(slice.endpoints[0].addresses, vec!["10.244.1.5".to_string()]);
        assert_eq!(
            slice.endpoints[0].conditions.as_ref().unwrap().ready,
            Some(true)
        );
        assert_eq!(
            snap.nodes[0].spec.as_ref().unwrap().pod_cidr.as_deref(),
            Some("10.244.1.0/24")
        );
    }

    fn indent(text: &str, by: &str) -> String {
        text.lines().map(|l| format!("{by}{l}\n")).collect()
    }

    /// Turns a document into a `kubectl get -o yaml` list item.
    fn as_item(text: &str) -> String {
        let body = indent(text, "  ");
        format!("- {}", &body[2..])
    }

    #[test]
    fn kind_list_with_items() {
        let config_map = "apiVersion: v1\ndata:\n  a: b\nkind: ConfigMap\nmetadata:\n  name: cm\n  namespace: default\n";
        let text = format!(
            "apiVersion: v1\nitems:\n{}{}{}{}kind: List\nmetadata:\n  resourceVersion: \"\"\n",
            as_item(SERVICE),
            as_item(config_map),
            as_item(SLICE),
            as_item(NODE)
        );
        let (snap, warnings) = load(&text);
        assert_eq!(
            (
                snap.services.len(),
                snap.endpoint_slices.len(),
                snap.nodes.len()
            ),
            (1, 1, 1)
        );
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        let w = &warnings[0];
        assert_eq!(w.item, Some(1));
        assert_eq!(w.object.as_deref(), Some("ConfigMap default/cm"));
        assert_eq!(w.line, Some(3 + SERVICE.lines().count()));
        assert!(w.message.contains("unsupported object type"), "{w}");
    }

    #[test]
    fn typed_list_items_need_no_kind() {
        let item = "metadata:\n  name: a\n  namespace: ns\nspec:\n  clusterIP: None\n";
        let text = format!(
            "apiVersion: v1\nkind: ServiceList\nitems:\n{}",
            as_item(item)
        );
        let (snap, warnings) = load(&text);
        assert!(warnings.is_empty(), "{warnings:?}");
        assert_eq!(snap.services.len(), 1);
    }

    #[test]
    fn empty_documents_are_ignored() {
        let (snap, warnings) = load("---\n---\n# only a comment\n---\n\n");
        assert!(warnings.is_empty());
        assert!(snap.services.is_empty() && snap.nodes.is_empty());
        let (snap, _) = load("");
        assert!(snap.services.is_empty());
    }

    #[test]
    fn bad_yaml_is_an_error_with_the_line() {
        let text = format!(
            "{SERVICE}---\napiVersion: v1\nkind: Node\nmetadata:\n  name: [a\n  labels: {{}}\n"
        );
        let err = load_manifest_str(&text, Path::new("bad.yaml")).unwrap_err();
        let ManifestError::Yaml { location, .. } = &err else {
            panic!("{err}")
        };
        let separator_line = SERVICE.lines().count() + 1;
        let line = location.unwrap().0;
        assert!(
            line > separator_line && line <= separator_line + 6,
            "error at line {line}, second document starts at {separator_line}: {err}"
        );
        assert!(err.to_string().starts_with("bad.yaml:"), "{err}");

        let err = load_manifest_str("a: b\n c\nd: [\n", Path::new("x.yaml")).unwrap_err();
        assert!(
            matches!(
                err,
                ManifestError::Yaml {
                    location: Some(_),
                    ..
                }
            ),
            "{err}"
        );
    }

    #[test]
    fn unreadable_file_is_an_error() {
        let err = load_manifests(&[PathBuf::from("/nonexistent/kube-proxy-rs.yaml")]).unwrap_err();
        assert!(matches!(err, ManifestError::Read { .. }));
        assert!(
            err.to_string().contains("/nonexistent/kube-proxy-rs.yaml"),
            "{err}"
        );
    }

    #[test]
    fn invalid_object_is_skipped_with_a_warning() {
        let bad = SERVICE.replace("port: 80", "port: eighty");
        let text = format!("{NODE}---\n{bad}");
        let (snap, warnings) = load(&text);
        assert_eq!(snap.nodes.len(), 1);
        assert!(snap.services.is_empty());
        assert_eq!(warnings.len(), 1);
        let w = &warnings[0];
        assert_eq!(w.document, 2);
        assert_eq!(w.object.as_deref(), Some("Service default/web"));
        let port_line =
            NODE.lines().count() + 1 + 1 + bad.lines().position(|l| l.contains("eighty")).unwrap();
        assert_eq!(w.line, Some(port_line), "{w}");
        assert!(w.message.contains("invalid type"), "{w}");
        assert!(
            w.to_string().starts_with(&format!(
                "m.yaml:{port_line}: document 2, Service default/web:"
            )),
            "{w}"
        );
    }

    #[test]
    fn objects_without_name_or_type_are_skipped() {
        let text = "apiVersion: v1\nkind: Service\nmetadata:\n  namespace: x\n---\nkind: Service\nmetadata:\n  name: a\n---\n- a\n- b\n---\njust text\n";
        let (snap, warnings) = load(text);
        assert!(snap.services.is_empty());
        assert_eq!(warnings.len(), 4, "{warnings:?}");
        assert!(
            warnings[0].message.contains("metadata.name"),
            "{}",
            warnings[0]
        );
        assert!(
            warnings[1].message.contains("apiVersion and kind"),
            "{}",
            warnings[1]
        );
        assert!(
            warnings[2].message.contains("not a mapping"),
            "{}",
            warnings[2]
        );
        assert!(
            warnings[3].message.contains("not a mapping"),
            "{}",
            warnings[3]
        );
        assert_eq!(
            warnings.iter().map(|w| w.document).collect::<Vec<_>>(),
            vec![1, 2, 3, 4]
        );
    }

    #[test]
    fn duplicates_warn_and_the_later_wins() {
        let second = SERVICE.replace("10.96.0.10", "10.96.0.11");
        let text = format!("{SERVICE}---\n{NODE}---\n{second}");
        let (snap, warnings) = load(&text);
        assert_eq!(snap.services.len(), 1);
        assert_eq!(
            snap.services[0]
                .spec
                .as_ref()
                .unwrap()
                .cluster_ip
                .as_deref(),
            Some("10.96.0.11")
        );
        assert_eq!(warnings.len(), 1);
        assert!(
            warnings[0]
                .message
                .contains("duplicate of the object at m.yaml:1"),
            "{}",
            warnings[0]
        );
        // Same name in another namespace is not a duplicate.
        let other_ns = SERVICE.replace("namespace: default", "namespace: other");
        let (snap, warnings) = load(&format!("{SERVICE}---\n{other_ns}"));
        assert_eq!(snap.services.len(), 2);
        assert!(warnings.is_empty());
    }

    #[test]
    fn json_documents_are_accepted() {
        let json = r#"{"apiVersion": "v1", "kind": "List", "items": [
            {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1"}},
            {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "s", "namespace": "d"}, "spec": {"ports": [{"port": "x"}]}}
        ]}"#;
        let (snap, warnings) = load(json);
        assert_eq!(snap.nodes.len(), 1);
        assert_eq!(warnings.len(), 1);
        assert_eq!(warnings[0].item, Some(1));
        assert_eq!(warnings[0].object.as_deref(), Some("Service d/s"));
    }

    #[test]
    fn slow_path_handles_anchors_and_flow_style() {
        let text = "apiVersion: v1\nkind: Service\nmetadata: {name: a, namespace: b, labels: &l {x: y}}\nspec:\n  selector: *l\n  ports: [{port: 80}]\n";
        assert!(fast_value(text).is_none(), "converter should bail");
        let (snap, warnings) = load(text);
        assert!(warnings.is_empty(), "{warnings:?}");
        let spec = snap.services[0].spec.as_ref().unwrap();
        assert_eq!(spec.selector.as_ref().unwrap()["x"], "y");
        assert_eq!(spec.ports.as_ref().unwrap()[0].port, 80);
    }

    #[test]
    fn converter_matches_serde_yaml() {
        let cases = [
            SERVICE,
            SLICE,
            NODE,
            "a: 1\nb: -2\nc: 1.5\nd: 1e3\ne: 010\nf: 10.0.0.1\ng: null\nh: ~\ni:\nj: true\nk: False\nl: ''\nm: \"\"\n",
            "u: 0b7c4e2a-0000\nv: 0xZZ\nw: 0e5\nx: 1.\ny: -.5\nz: 6e1c\na: 18446744073709551615\nb: -9223372036854775808\nc: 0\nd: -0\ne: 1_000\nf: 12:30\ng: 2024-01-01T00:00:00Z\n",
            "a: 'it''s'\nb: \"tab\\tq\\\"uote\\u00e9\\x41\\\\\"\nc: plain # comment\nd: \"#not comment\"\ne: a#b\n",
            "k: \"line one\n  line two\n\n  line three\"\nq: 'single\n  folded  \n   again'\n",
            "k: \"escaped \\\n  break\"\nj: \"trailing\\t\n  x\"\n",
            "plain: this is a long\n  folded plain\n\n  scalar\nnext: x\n",
            "lit: |\n  line 1\n    indented\n\n  line 3\nstrip: |-\n  a\n  b\n\nkeep: |+\n  a\n\n\nafter: 1\n",
            "fold: >\n  a\n  b\n\n  c\nfold2: >-\n  x\n  y\nempty: |\nz: 1\n",
            "seq:\n- a\n- b: 1\n  c: 2\n-\n  d: 3\n",
            "seq:\n  - a\n  - b\nmap:\n    deep:\n        deeper: {}\n    list: []\n",
            "\"quoted key\": 1\n'single key': 2\nkey with spaces: 3\n\"a:b\": 4\nurl: http://example.com/a:b\n",
            "# leading comment\n\na: 1 # trailing\n# between\nb:\n  # inside\n  c: 2\n",
            "metadata:\n  annotations:\n    last-applied: |\n      {\"apiVersion\":\"v1\"}\n  name: x\n",
            "a:\n- 1\n- 2\nb: x\n",
            "items:\n- kind: Service\n  metadata:\n    name: a\n- kind: Node\n",
            "a: b\n ---\n",
            "é: ü\nemoji: \"😀\"\n",
            "a: |\n  x\n  # not a comment\nb: 1\n",
        ];
        for (i, text) in cases.iter().enumerate() {
            let slow = slow_value(text);
            let fast = fast_value(text);
            assert_eq!(
                fast.as_ref(),
                Some(&slow),
                "case {i}: fast path differs or bailed\n{text}"
            );
        }
        // Documents the converter must hand to serde_yaml.
        let deep: String = (0..200).map(|i| format!("{}k:\n", " ".repeat(i))).collect();
        for text in [
            "a: &x 1\nb: *x\n",
            "a: !!str 1\n",
            "? complex\n: key\n",
            "a: [1, 2]\n",
            "a: 0x1F\n",
            "a: -0b101\n",
            "a: +5\n",
            "a: .inf\n",
            "a: 1\na: 2\n",
            "a:\tb\n\tc: d\n",
            "a: |2\n   x\n",
            &deep,
            "a: 99999999999999999999999\n",
            "- a\n- b\n",
            "a: b\r\nc: d\r\n",
        ] {
            assert!(
                fast_value(text).is_none(),
                "fast path should bail on {text:?}"
            );
        }
    }

    #[test]
    fn converter_keeps_line_numbers() {
        let text = "a: 1\nb:\n  c: |\n    x\n    y\n  d: \"two\n    lines\"\ne:\n- f: [oops\n";
        // Valid up to the flow sequence, which makes it bail: check on a valid variant instead.
        assert!(fast_value(text).is_none());
        let text = "a: 1\nb:\n  c: |\n    x\n    y\n  d: \"two\n    lines\"\ne:\n- f: g\n";
        let Ok(fast::Converted::Doc(doc)) = fast::convert(text) else {
            panic!("bailed")
        };
        let line_of = |needle: &str| doc.json.lines().position(|l| l.contains(needle)).unwrap();
        assert_eq!(line_of("\"a\""), 0);
        assert_eq!(line_of("\"c\""), 2);
        assert_eq!(line_of("\"d\""), 5);
        assert_eq!(line_of("\"f\""), 8);
    }

    /// A `kubectl get svc,endpointslices -A -o yaml`-style dump of a large cluster.
    fn generate_cluster(services: usize, endpoints_per_slice: usize) -> String {
        use std::fmt::Write;
        let mut s = String::from("apiVersion: v1\nitems:\n");
        for i in 0..services {
            let ns = i % 50;
            let (a, b) = (i / 256 % 256, i % 256);
            let _ = write!(
                s,
                "- apiVersion: v1\n  kind: Service\n  metadata:\n    annotations:\n      \
                 description: a long description that kubectl would fold over more than one\n        \
                 line because it has spaces\n    creationTimestamp: \"2024-01-01T00:00:00Z\"\n    \
                 labels:\n      app: svc-{i}\n    name: svc-{i}\n    namespace: ns-{ns}\n    \
                 resourceVersion: \"{i}\"\n    uid: 6f1c2c1e-0000-4000-8000-{i:012}\n  spec:\n    \
                 clusterIP: 10.96.{a}.{b}\n    clusterIPs:\n    - 10.96.{a}.{b}\n    \
                 internalTrafficPolicy: Cluster\n    ipFamilies:\n    - IPv4\n    ipFamilyPolicy: SingleStack\n    \
                 ports:\n    - name: http\n      port: 80\n      protocol: TCP\n      targetPort: 8080\n    \
                 - name: https\n      port: 443\n      protocol: TCP\n      targetPort: 8443\n    \
                 selector:\n      app: svc-{i}\n    sessionAffinity: None\n    type: ClusterIP\n  \
                 status:\n    loadBalancer: {{}}\n"
            );
        }
        for i in 0..services {
            let ns = i % 50;
            s.push_str("- addressType: IPv4\n  apiVersion: discovery.k8s.io/v1\n  endpoints:\n");
            for e in 0..endpoints_per_slice {
                let n = i * endpoints_per_slice + e;
                let _ = write!(
                    s,
                    "  - addresses:\n    - 172.{}.{}.{}\n    conditions:\n      ready: true\n      \
                     serving: true\n      terminating: false\n    nodeName: node-{}\n    targetRef:\n      \
                     kind: Pod\n      name: pod-{n}\n      namespace: ns-{ns}\n      \
                     uid: 0b7c4e2a-0000-4000-8000-{n:012}\n    zone: zone-a\n",
                    16 + n / 65536,
                    n / 256 % 256,
                    n % 256,
                    n % 100
                );
            }
            let _ = write!(
                s,
                "  kind: EndpointSlice\n  metadata:\n    generateName: svc-{i}-\n    labels:\n      \
                 endpointslice.kubernetes.io/managed-by: endpointslice-controller.k8s.io\n      \
                 kubernetes.io/service-name: svc-{i}\n    name: svc-{i}-x7k2p\n    namespace: ns-{ns}\n    \
                 ownerReferences:\n    - apiVersion: v1\n      blockOwnerDeletion: true\n      controller: true\n      \
                 kind: Service\n      name: svc-{i}\n      uid: 6f1c2c1e-0000-4000-8000-{i:012}\n  \
                 ports:\n  - name: http\n    port: 8080\n    protocol: TCP\n  - name: https\n    port: 8443\n    \
                 protocol: TCP\n"
            );
        }
        s.push_str("kind: List\nmetadata:\n  resourceVersion: \"\"\n");
        s
    }

    #[test]
    fn generated_cluster_takes_the_fast_path() {
        let text = generate_cluster(20, 3);
        let Ok(fast::Converted::Doc(doc)) = fast::convert(&text) else {
            panic!("bailed")
        };
        assert_eq!(doc.items.as_ref().map(Vec::len), Some(40));
        let fast: serde_json::Value = serde_json::from_str(&doc.json).unwrap();
        assert_eq!(fast, slow_value(&text));
        let (snap, warnings) = load(&text);
        assert!(warnings.is_empty(), "{warnings:?}");
        assert_eq!((snap.services.len(), snap.endpoint_slices.len()), (20, 20));
    }

    /// `cargo test --release --lib manifest::tests::load_time_large_cluster -- --ignored --nocapture`
    #[test]
    #[ignore = "timing; run in release"]
    fn load_time_large_cluster() {
        let text = generate_cluster(10_000, 10);
        let path =
            std::env::temp_dir().join(format!("kube-proxy-rs-cluster-{}.yaml", std::process::id()));
        std::fs::write(&path, &text).unwrap();
        let start = std::time::Instant::now();
        let converted = fast::convert(&text).is_ok();
        let convert_time = start.elapsed();
        assert!(converted);
        let start = std::time::Instant::now();
        let (snap, warnings) = load_manifests(std::slice::from_ref(&path)).unwrap();
        let elapsed = start.elapsed();
        std::fs::remove_file(&path).unwrap();
        assert!(warnings.is_empty());
        assert_eq!(
            snap.endpoint_slices
                .iter()
                .map(|s| s.endpoints.len())
                .sum::<usize>(),
            100_000
        );
        eprintln!(
            "loaded {:.1} MB: {} services, {} slices, 100000 endpoints in {elapsed:?} \
             (YAML to JSON alone: {convert_time:?})",
            text.len() as f64 / 1e6,
            snap.services.len(),
            snap.endpoint_slices.len()
        );
    }
}
