//! Loading Services, EndpointSlices, Nodes and ServiceCIDRs from YAML (or JSON) manifest files
//! for the `render` command: multi-document files, `kind: List` wrappers (as `kubectl get -o yaml`
//! prints), per-object warnings for anything that cannot be used, and hard errors only for
//! unreadable files and YAML syntax errors.
//!
//! Speed matters (a 100k-endpoint cluster dump is 20–30 MB), and serde_yaml alone parses
//! only ~25 MB/s. So each document is first run through `fast`, a converter for the
//! block-style YAML that kubectl writes, producing JSON text whose line numbers match the
//! YAML's; serde_json then builds the typed objects directly from that text, one object at a
//! time. Anything the converter is not sure about (anchors, tags, flow collections,
//! directives, odd indentation, ...) makes it give up on that document, which then goes
//! through serde_yaml into a `serde_json::Value`. Both routes share JSON semantics, so an
//! object decodes the same way whichever one read it, and both build the tree with `value`'s
//! rules: a repeated key is an error, a huge integer fails only the object holding it.
//!
//! Why a converter of our own rather than only a maintained YAML crate (`examples/yaml_bench.rs`
//! on the 16.9 MB manifest of 10 000 Services and 100 000 endpoints, medians, quiet machine):
//! this loader 0.27 s to typed objects, serde_yaml 0.56 s and serde-saphyr 1.6 s to untyped
//! values (2.6 s with other builds running), where all of `render` takes 1.0 s with this loader
//! and has a 3 s budget. serde-saphyr would also read plain scalars by YAML 1.1 rules into the
//! untyped tree the per-object warnings need (`yes` → true, `010` → 10.0, `1_000` → 1000),
//! where serde_yaml and this converter read strings. So the converter stays; it bails on
//! anything unusual, and the differential tests below hold it to serde_yaml's reading.

use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};

use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::networking::v1::ServiceCIDR;
use serde::Deserialize;
use serde::de::DeserializeOwned;

mod fast;
mod value;

use value::Tree;

/// The objects found in the manifests, in file order (a duplicate replaces the earlier
/// object in place).
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    pub services: Vec<Service>,
    pub endpoint_slices: Vec<EndpointSlice>,
    pub nodes: Vec<Node>,
    /// networking.k8s.io/v1 ServiceCIDRs (nftables mode drops traffic to their unallocated
    /// addresses; the iptables proxier does not read them, as upstream's).
    pub service_cidrs: Vec<ServiceCIDR>,
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
        let text =
            std::fs::read_to_string(path).map_err(|source| ManifestError::Read { file: path.clone(), source })?;
        collector.add_text(&text, path)?;
    }
    Ok((collector.snapshot, collector.warnings))
}

/// Parses manifest text as if it were the file `file` (used by tests and by callers that
/// already hold the text).
pub fn load_manifest_str(text: &str, file: &Path) -> Result<(Snapshot, Vec<Warning>), ManifestError> {
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
    ServiceCidr,
}

impl ObjKind {
    fn name(self) -> &'static str {
        match self {
            ObjKind::Service => "Service",
            ObjKind::EndpointSlice => "EndpointSlice",
            ObjKind::Node => "Node",
            ObjKind::ServiceCidr => "ServiceCIDR",
        }
    }

    fn from_type(api_version: &str, kind: &str) -> Option<ObjKind> {
        match (api_version, kind) {
            ("v1", "Service") => Some(ObjKind::Service),
            ("discovery.k8s.io/v1", "EndpointSlice") => Some(ObjKind::EndpointSlice),
            ("v1", "Node") => Some(ObjKind::Node),
            ("networking.k8s.io/v1", "ServiceCIDR") => Some(ObjKind::ServiceCidr),
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
            ("networking.k8s.io/v1", "ServiceCIDRList") => Some(Some(ObjKind::ServiceCidr)),
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
            let Tree(value) = Tree::deserialize(document).map_err(|err| yaml_error(file, 0, &err))?;
            self.add_value(value, file, i + 1, None);
        }
        Ok(())
    }

    fn add_chunk(&mut self, chunk: &Chunk<'_>, file: &Path) -> Result<(), ManifestError> {
        match fast::convert(chunk.text) {
            Ok(fast::Converted::Empty) => Ok(()),
            Ok(fast::Converted::Json(content)) => match serde_json::from_str::<Tree>(content) {
                Ok(Tree(value)) => {
                    self.add_value(value, file, chunk.document, Some(chunk.first_line));
                    Ok(())
                }
                Err(_) => self.add_chunk_slowly(chunk, file),
            },
            Ok(fast::Converted::Doc(doc)) => {
                self.add_converted(&doc, chunk, file);
                Ok(())
            }
            Err(fast::Bail) => self.add_chunk_slowly(chunk, file),
        }
    }

    fn add_chunk_slowly(&mut self, chunk: &Chunk<'_>, file: &Path) -> Result<(), ManifestError> {
        let Tree(value) =
            serde_yaml::from_str(chunk.text).map_err(|err| yaml_error(file, chunk.first_line - 1, &err))?;
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
            let candidate =
                Candidate { head: root.clone(), body: Body::Json(&doc.json), line: Some(chunk.first_line), item: None };
            self.add_candidate(candidate, file, chunk.document);
            return;
        };
        let Some(items) = &doc.items else {
            if doc.items_present {
                self.warn(file, chunk.document, Some(chunk.first_line), None, root.describe(), "items is not a list");
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

    fn add_value(&mut self, value: serde_json::Value, file: &Path, document: usize, line: Option<usize>) {
        match value {
            serde_json::Value::Null => {}
            serde_json::Value::Object(_) => {
                let head = Head::from_value(&value);
                let element = match (&head.api_version, &head.kind) {
                    (Some(api_version), Some(kind)) => ObjKind::list_element(api_version, kind),
                    _ => None,
                };
                let Some(element) = element else {
                    let candidate = Candidate { head, body: Body::Value(value), line, item: None };
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
                            let candidate =
                                Candidate { head: item_head, body: Body::Value(item), line, item: Some(index) };
                            self.add_candidate(candidate, file, document);
                        }
                    }
                    Some(_) => self.warn(file, document, line, None, head.describe(), "items is not a list"),
                }
            }
            _ => self.warn(file, document, line, None, None, "document is not a mapping; skipped"),
        }
    }

    fn add_candidate(&mut self, candidate: Candidate<'_>, file: &Path, document: usize) {
        let is_object = match &candidate.body {
            Body::Json(text) => text.trim_start().starts_with('{'),
            Body::Value(value) => value.is_object(),
        };
        let describe = candidate.head.describe();
        if !is_object {
            self.warn(file, document, candidate.line, candidate.item, describe, "not an object; skipped");
            return;
        }
        let (api_version, kind) = match (&candidate.head.api_version, &candidate.head.kind) {
            (Some(a), Some(k)) => (a.as_str(), k.as_str()),
            _ => {
                let message = "apiVersion and kind must be set (strings); skipped";
                self.warn(file, document, candidate.line, candidate.item, describe, message);
                return;
            }
        };
        let Some(kind) = ObjKind::from_type(api_version, kind) else {
            let message = format!(
                "unsupported object type apiVersion {api_version:?} kind {kind:?} \
                 (expected v1 Service, discovery.k8s.io/v1 EndpointSlice, v1 Node or \
                 networking.k8s.io/v1 ServiceCIDR); skipped"
            );
            self.warn(file, document, candidate.line, candidate.item, describe, &message);
            return;
        };
        let origin = Origin { file: file.to_path_buf(), document, line: candidate.line };
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
            ObjKind::ServiceCidr => {
                if let Some(obj) = self.decode::<ServiceCIDR>(&candidate, &origin, describe) {
                    let placement = place(&None, &obj.metadata.name);
                    self.insert(placement, obj, |s| &mut s.service_cidrs);
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
                let line = candidate.line.map(|start| start + err.line().saturating_sub(1));
                (line, err.to_string())
            }),
            Body::Value(value) => T::deserialize(value).map_err(|err| (candidate.line, err.to_string())),
        };
        match result {
            Ok(obj) => Some(obj),
            Err((line, message)) => {
                let message = format!("cannot decode: {}; skipped", strip_position(&message));
                self.warn(&origin.file, origin.document, line, candidate.item, describe, &message);
                None
            }
        }
    }

    /// Adds a decoded object, or replaces the earlier one with the same name.
    fn insert<T>(&mut self, placement: Placement, obj: T, vector: fn(&mut Snapshot) -> &mut Vec<T>) {
        let Placement { kind, namespace, name, origin, item } = placement;
        if name.is_empty() {
            let describe = if namespace.is_empty() {
                kind.name().to_string()
            } else {
                format!("{} in namespace {namespace}", kind.name())
            };
            let message = "metadata.name is missing; skipped";
            self.warn(&origin.file, origin.document, origin.line, item, Some(describe), message);
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
            self.warn(&origin.file, origin.document, origin.line, item, Some(describe), &message);
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
        let warning = Warning { file: file.to_path_buf(), document, line, item, object, message: message.to_string() };
        self.warnings.push(warning);
    }
}

fn inherit_list_type(head: &mut Head, element: Option<ObjKind>) {
    if let Some(element) = element {
        if head.kind.is_none() {
            head.kind = Some(element.name().to_string());
        }
        if head.api_version.is_none() {
            let api_version = match element {
                ObjKind::EndpointSlice => "discovery.k8s.io/v1",
                ObjKind::ServiceCidr => "networking.k8s.io/v1",
                ObjKind::Service | ObjKind::Node => "v1",
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
    line.strip_prefix("---").is_some_and(|rest| rest.is_empty() || rest.starts_with([' ', '\t']))
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
                chunks.push(Chunk { text: &text[start..offset], first_line: start_line, document });
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
        chunks.push(Chunk { text: &text[start..offset], first_line: start_line, document });
    }
    Some(chunks)
}

// ---------------------------------------------------------------------------------------------
// The fast path
// ---------------------------------------------------------------------------------------------

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
        serde_yaml::from_str::<Tree>(text).unwrap().0
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
        assert_eq!(slice.endpoints[0].conditions.as_ref().unwrap().ready, Some(true));
        assert_eq!(snap.nodes[0].spec.as_ref().unwrap().pod_cidr.as_deref(), Some("10.244.1.0/24"));
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
        let config_map =
            "apiVersion: v1\ndata:\n  a: b\nkind: ConfigMap\nmetadata:\n  name: cm\n  namespace: default\n";
        let text = format!(
            "apiVersion: v1\nitems:\n{}{}{}{}kind: List\nmetadata:\n  resourceVersion: \"\"\n",
            as_item(SERVICE),
            as_item(config_map),
            as_item(SLICE),
            as_item(NODE)
        );
        let (snap, warnings) = load(&text);
        assert_eq!((snap.services.len(), snap.endpoint_slices.len(), snap.nodes.len()), (1, 1, 1));
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        let w = &warnings[0];
        assert_eq!(w.item, Some(1));
        assert_eq!(w.object.as_deref(), Some("ConfigMap default/cm"));
        assert_eq!(w.line, Some(3 + SERVICE.lines().count()));
        assert!(w.message.contains("unsupported object type"), "{w}");
    }

    #[test]
    fn service_cidrs_are_read_alone_and_from_their_typed_list() {
        let one = "apiVersion: networking.k8s.io/v1\nkind: ServiceCIDR\nmetadata:\n  name: kubernetes\n\
                   spec:\n  cidrs: [10.96.0.0/16, fd00:96::/112]\n";
        let item = "metadata:\n  name: extra\nspec:\n  cidrs: [10.97.0.0/16]\n";
        let list = format!("apiVersion: networking.k8s.io/v1\nkind: ServiceCIDRList\nitems:\n{}", as_item(item));
        let bad = "apiVersion: networking.k8s.io/v1\nkind: ServiceCIDR\nmetadata:\n  name: broken\nspec:\n  cidrs: 7\n";
        let (snap, warnings) = load(&format!("{one}---\n{list}---\n{bad}"));
        let names: Vec<_> = snap.service_cidrs.iter().map(|c| c.metadata.name.clone().unwrap_or_default()).collect();
        assert_eq!(names, ["kubernetes", "extra"]);
        let cidrs = snap.service_cidrs[0].spec.as_ref().and_then(|s| s.cidrs.clone()).unwrap_or_default();
        assert_eq!(cidrs, ["10.96.0.0/16", "fd00:96::/112"]);
        // A bad one is skipped with a warning naming it.
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        assert_eq!(warnings[0].object.as_deref(), Some("ServiceCIDR broken"), "{}", warnings[0]);
        assert!(warnings[0].message.starts_with("cannot decode"), "{}", warnings[0]);
    }

    #[test]
    fn typed_list_items_need_no_kind() {
        let item = "metadata:\n  name: a\n  namespace: ns\nspec:\n  clusterIP: None\n";
        let text = format!("apiVersion: v1\nkind: ServiceList\nitems:\n{}", as_item(item));
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
        let text = format!("{SERVICE}---\napiVersion: v1\nkind: Node\nmetadata:\n  name: [a\n  labels: {{}}\n");
        let err = load_manifest_str(&text, Path::new("bad.yaml")).unwrap_err();
        let ManifestError::Yaml { location, .. } = &err else { panic!("{err}") };
        let separator_line = SERVICE.lines().count() + 1;
        let line = location.unwrap().0;
        assert!(
            line > separator_line && line <= separator_line + 6,
            "error at line {line}, second document starts at {separator_line}: {err}"
        );
        assert!(err.to_string().starts_with("bad.yaml:"), "{err}");

        let err = load_manifest_str("a: b\n c\nd: [\n", Path::new("x.yaml")).unwrap_err();
        assert!(matches!(err, ManifestError::Yaml { location: Some(_), .. }), "{err}");
    }

    #[test]
    fn unreadable_file_is_an_error() {
        let err = load_manifests(&[PathBuf::from("/nonexistent/kube-proxy-rs.yaml")]).unwrap_err();
        assert!(matches!(err, ManifestError::Read { .. }));
        assert!(err.to_string().contains("/nonexistent/kube-proxy-rs.yaml"), "{err}");
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
        let port_line = NODE.lines().count() + 1 + 1 + bad.lines().position(|l| l.contains("eighty")).unwrap();
        assert_eq!(w.line, Some(port_line), "{w}");
        assert!(w.message.contains("invalid type"), "{w}");
        assert!(w.to_string().starts_with(&format!("m.yaml:{port_line}: document 2, Service default/web:")), "{w}");
    }

    #[test]
    fn objects_without_name_or_type_are_skipped() {
        let text = "apiVersion: v1\nkind: Service\nmetadata:\n  namespace: x\n---\nkind: Service\nmetadata:\n  name: a\n---\n- a\n- b\n---\njust text\n";
        let (snap, warnings) = load(text);
        assert!(snap.services.is_empty());
        assert_eq!(warnings.len(), 4, "{warnings:?}");
        assert!(warnings[0].message.contains("metadata.name"), "{}", warnings[0]);
        assert!(warnings[1].message.contains("apiVersion and kind"), "{}", warnings[1]);
        assert!(warnings[2].message.contains("not a mapping"), "{}", warnings[2]);
        assert!(warnings[3].message.contains("not a mapping"), "{}", warnings[3]);
        assert_eq!(warnings.iter().map(|w| w.document).collect::<Vec<_>>(), vec![1, 2, 3, 4]);
    }

    #[test]
    fn duplicates_warn_and_the_later_wins() {
        let second = SERVICE.replace("10.96.0.10", "10.96.0.11");
        let text = format!("{SERVICE}---\n{NODE}---\n{second}");
        let (snap, warnings) = load(&text);
        assert_eq!(snap.services.len(), 1);
        assert_eq!(snap.services[0].spec.as_ref().unwrap().cluster_ip.as_deref(), Some("10.96.0.11"));
        assert_eq!(warnings.len(), 1);
        assert!(warnings[0].message.contains("duplicate of the object at m.yaml:1"), "{}", warnings[0]);
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
    fn files_with_directives_use_serde_yaml_for_the_whole_file() {
        let text = format!("%YAML 1.2\n---\n{NODE}---\n{SERVICE}");
        let (snap, warnings) = load(&text);
        assert!(warnings.is_empty(), "{warnings:?}");
        assert_eq!((snap.nodes.len(), snap.services.len()), (1, 1));
        let err = load_manifest_str("%YAML 1.2\n---\na: [\n", Path::new("d.yaml")).unwrap_err();
        assert!(matches!(err, ManifestError::Yaml { location: Some(_), .. }), "{err}");
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
            assert_eq!(fast.as_ref(), Some(&slow), "case {i}: fast path differs or bailed\n{text}");
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
            "a: \"x\u{85}y\"\n",
            "a: 'x\u{2028}y'\n",
            "a: x\u{2029}y\n",
        ] {
            assert!(fast_value(text).is_none(), "fast path should bail on {text:?}");
        }
    }

    #[test]
    fn unicode_line_breaks_in_values_read_as_serde_yaml_reads_them() {
        // serde_yaml folds NEL inside double quotes into a space and keeps LS/PS as they are.
        let text = format!("{SERVICE}---\n{}", SERVICE.replace("name: web", "name: \"w\u{85}eb\""));
        let (snapshot, warnings) = load(&text);
        assert!(warnings.is_empty(), "{warnings:?}");
        let names: Vec<_> = snapshot.services.iter().map(|s| s.metadata.name.clone().unwrap()).collect();
        assert_eq!(names, ["web", "w eb"]);
        let text = SERVICE.replace("name: web", "name: \"w\u{2028}eb\"");
        assert_eq!(load(&text).0.services[0].metadata.name.as_deref(), Some("w\u{2028}eb"));
    }

    #[test]
    fn a_repeated_key_fails_the_file_naming_its_line_whichever_route_reads_it() {
        // Block style (the converter bails, serde_yaml reads it), nested.
        let block = SERVICE.replace("  name: web\n", "  name: web\n  name: other\n");
        let err = load_manifest_str(&block, Path::new("m.yaml")).unwrap_err().to_string();
        // serde_yaml points at the mapping's first entry.
        assert!(err.starts_with("m.yaml:4:") && err.contains("duplicate mapping key \"name\""), "{err}");
        // A later document: the line is the file's.
        let later = format!("{SERVICE}---\n{block}");
        let err = load_manifest_str(&later, Path::new("m.yaml")).unwrap_err().to_string();
        let expected_line = SERVICE.lines().count() + 1 + 4;
        assert!(err.starts_with(&format!("m.yaml:{expected_line}:")), "{err}");
        // Flow style (JSON).
        let json = r#"{"apiVersion": "v1", "kind": "Service", "metadata": {"name": "a", "name": "b"}}"#;
        let err = load_manifest_str(json, Path::new("m.json")).unwrap_err().to_string();
        assert!(err.contains("duplicate mapping key \"name\""), "{err}");
        // A file with directives (serde_yaml reads the whole file).
        let err = load_manifest_str(&format!("%YAML 1.2\n---\n{block}"), Path::new("m.yaml")).unwrap_err();
        assert!(err.to_string().contains("duplicate mapping key \"name\""), "{err}");
    }

    #[test]
    fn an_integer_beyond_64_bits_skips_only_its_object() {
        let big = SERVICE.replace("  clusterIP: 10.96.0.10\n", "  clusterIP: 10.96.0.10\n  sessionAffinityConfig:\n    clientIP:\n      timeoutSeconds: 99999999999999999999999\n");
        let other = SERVICE.replace("name: web", "name: other");
        let (snapshot, warnings) = load(&format!("{big}---\n{other}"));
        let names: Vec<_> = snapshot.services.iter().map(|s| s.metadata.name.clone().unwrap()).collect();
        assert_eq!(names, ["other"]);
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        let w = warnings[0].to_string();
        assert!(w.contains("Service default/web") && w.contains("cannot decode") && w.contains("skipped"), "{w}");
        // In a field nothing reads, it costs nothing.
        let unread = SERVICE
            .replace("  clusterIP: 10.96.0.10\n", "  clusterIP: 10.96.0.10\n  futureField: 99999999999999999999999\n");
        let (snapshot, warnings) = load(&unread);
        assert_eq!((snapshot.services.len(), warnings.len()), (1, 0), "{warnings:?}");
    }

    /// Builds random block-YAML documents from fragments (valid or not) and checks that
    /// whenever the converter accepts one, serde_yaml reads the same thing.
    #[test]
    fn converter_agrees_with_serde_yaml_on_random_documents() {
        const KEYS: [&str; 8] = ["a", "b", "name", "\"q k\"", "'s'", "k8s.io/x", "-d", "x y"];
        const SCALARS: [&str; 63] = [
            "\"nel\u{85}x\"",
            "\"ls\u{2028}x\"",
            "'ps\u{2029}x'",
            "plain\u{85}nel",
            "99999999999999999999999",
            "1",
            "-2",
            "0",
            "010",
            "1.5",
            "1e3",
            "0x1F",
            "0b7c",
            "true",
            "False",
            "null",
            "~",
            "",
            "10.0.0.1",
            "a b",
            "a#b",
            "a #c",
            "'q'",
            "'it''s'",
            "\"d\\tq\"",
            "\"x\\u00e9\"",
            "{}",
            "[]",
            "[a]",
            "&x y",
            "*x",
            "|",
            ">-",
            "\"multi",
            "'multi",
            "a: b",
            "x:",
            "- y",
            "\"a\" b",
            "|+",
            ">",
            "|-",
            "a\tb",
            "#",
            "-1.5e-3",
            "-",
            "?",
            ": x",
            "@x",
            "`x",
            "%x",
            "!x",
            ".5",
            "1.",
            "+1",
            "-.inf",
            ".nan",
            "0o17",
            "-0x1",
            "1_0",
            "12:30",
            "é",
            "\"\\\"",
        ];
        let mut seed: u64 = 0x2545_f491_4f6c_dd1d;
        let mut next = |n: usize| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed % n as u64) as usize
        };
        let (mut accepted, mut checked) = (0, 0);
        for _ in 0..5000 {
            let mut text = String::new();
            let mut indent = 0usize;
            for _ in 0..(1 + next(12)) {
                let pad = " ".repeat(indent);
                match next(10) {
                    0..=3 => {
                        let key = KEYS[next(KEYS.len())];
                        let value = SCALARS[next(SCALARS.len())];
                        text.push_str(&format!("{pad}{key}: {value}\n"));
                        if value == "|" || value == ">-" {
                            text.push_str(&format!("{pad}  line one\n{pad}  line two\n\n"));
                        }
                    }
                    4 => {
                        text.push_str(&format!("{pad}{}:\n", KEYS[next(KEYS.len())]));
                        indent += 2;
                    }
                    5 => {
                        let value = SCALARS[next(SCALARS.len())];
                        text.push_str(&format!("{pad}- {value}\n"));
                    }
                    6 => {
                        let key = KEYS[next(KEYS.len())];
                        text.push_str(&format!("{pad}- {key}: {}\n", SCALARS[next(SCALARS.len())]));
                    }
                    7 => indent = indent.saturating_sub(2 * (1 + next(2))),
                    8 => {
                        let extra = [" ", "  ", "   ", "", "    "][next(5)];
                        let piece = ["continued text", "more\"", "end'", "x: y", "- z", "# c", "\"", "\\", "", "\t x"]
                            [next(10)];
                        text.push_str(&format!("{pad}{extra}{piece}\n"));
                    }
                    _ => text.push_str(&format!("{pad}# comment\n")),
                }
            }
            let Some(fast) = fast_value(&text) else {
                continue;
            };
            accepted += 1;
            if let Ok(Tree(slow)) = serde_yaml::from_str::<Tree>(&text) {
                checked += 1;
                assert_eq!(fast, slow, "converter and serde_yaml disagree on\n{text}");
            } else if fast.is_object() {
                panic!("converter accepted YAML that serde_yaml rejects:\n{text}");
            }
        }
        assert!(accepted > 200 && checked > 200, "too few documents exercised: {accepted}/{checked}");
    }

    #[test]
    fn converter_keeps_line_numbers() {
        let text = "a: 1\nb:\n  c: |\n    x\n    y\n  d: \"two\n    lines\"\ne:\n- f: [oops\n";
        // Valid up to the flow sequence, which makes it bail: check on a valid variant instead.
        assert!(fast_value(text).is_none());
        let text = "a: 1\nb:\n  c: |\n    x\n    y\n  d: \"two\n    lines\"\ne:\n- f: g\n";
        let Ok(fast::Converted::Doc(doc)) = fast::convert(text) else { panic!("bailed") };
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
        let Ok(fast::Converted::Doc(doc)) = fast::convert(&text) else { panic!("bailed") };
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
        let path = std::env::temp_dir().join(format!("kube-proxy-rs-cluster-{}.yaml", std::process::id()));
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
        assert_eq!(snap.endpoint_slices.iter().map(|s| s.endpoints.len()).sum::<usize>(), 100_000);
        eprintln!(
            "loaded {:.1} MB: {} services, {} slices, 100000 endpoints in {elapsed:?} \
             (YAML to JSON alone: {convert_time:?})",
            text.len() as f64 / 1e6,
            snap.services.len(),
            snap.endpoint_slices.len()
        );
    }
}
