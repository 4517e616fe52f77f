//! The module graph of src/ points one way (the layers are stated in src/lib.rs): a
//! `crate::` path in a module may name only modules of a lower layer or of its own folder, and
//! the files of one folder may not import each other in a cycle. Test modules
//! (`#[cfg(test)]`) are not part of the graph.
//!
//! The check reads the source text: every `crate::a::b` path outside comments and test
//! modules is an edge from the file's folder (or root file) to `a`, and, inside a folder,
//! from the file to `b`; `super::b` inside a folder is an edge to its sibling `b`. Items a
//! folder's `mod.rs` re-exports are reached through the folder, so `mod.rs` itself takes no
//! part in the sibling-cycle check (it declares and uses its files by construction).

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Layers, lowest first; a module may use modules of lower layers only.
const LAYERS: &[&[&str]] = &[
    &["exec", "compat", "time"],
    &["model"],
    &["tracker", "iptables", "nftables", "config"],
    &["node"],
    &["proxier"],
    &["metrics", "trace", "manifest", "synthetic"],
    &["serve"],
    &["k8s"],
    &["daemon"],
    &["cmd"],
];

fn layer_of(module: &str) -> Option<usize> {
    LAYERS.iter().position(|layer| layer.contains(&module))
}

/// One source file: its top-level module, its name inside that module's folder (`None` for
/// a root file or a folder's `mod.rs`), and its text.
struct Source {
    path: String,
    module: String,
    sibling: Option<String>,
    text: String,
}

fn source(path: &str, text: String) -> Option<Source> {
    let rel = path.strip_prefix("src/")?.strip_suffix(".rs")?;
    let parts: Vec<&str> = rel.split('/').collect();
    let module = parts[0].to_string();
    if matches!(module.as_str(), "lib" | "main") {
        return None;
    }
    let sibling = match parts.get(1) {
        Some(&"mod") | None => None,
        Some(s) => Some((*s).to_string()),
    };
    Some(Source { path: path.to_string(), module, sibling, text })
}

/// The file's code without comments and without `#[cfg(test)]` items (from the attribute to
/// the end of the file: test modules come last in this code base).
fn production_code(text: &str) -> String {
    let text = text.split("#[cfg(test)]").next().unwrap_or_default();
    text.lines()
        .map(|line| match line.find("//") {
            Some(i) => &line[..i],
            None => line,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// `prefix::ident` paths in `code`: the identifiers that follow, with the one after it.
fn paths_after<'a>(code: &'a str, prefix: &str) -> Vec<(&'a str, Option<&'a str>)> {
    let ident = |s: &'a str| -> &'a str {
        let end = s.find(|c: char| !(c.is_alphanumeric() || c == '_')).unwrap_or(s.len());
        &s[..end]
    };
    let mut out = Vec::new();
    let mut rest = code;
    while let Some(i) = rest.find(prefix) {
        let before_ok = rest[..i].chars().next_back().is_none_or(|c| !(c.is_alphanumeric() || c == '_'));
        let after = &rest[i + prefix.len()..];
        if before_ok {
            let first = ident(after);
            let second = after[first.len()..].strip_prefix("::").map(ident).filter(|s| !s.is_empty());
            if !first.is_empty() {
                out.push((first, second));
            }
            // `use crate::{a, b::c}`: every name in the braces.
            if let Some(group) = after.strip_prefix('{') {
                let end = group.find('}').unwrap_or(group.len());
                for item in group[..end].split(',') {
                    let item = item.trim();
                    let first = ident(item);
                    if !first.is_empty() {
                        let second = item[first.len()..].strip_prefix("::").map(ident).filter(|s| !s.is_empty());
                        out.push((first, second));
                    }
                }
            }
        }
        rest = &rest[i + prefix.len()..];
    }
    out
}

/// Every edge that breaks the layering or closes a cycle among a folder's files.
fn violations(sources: &[Source]) -> Vec<String> {
    let mut problems = Vec::new();
    let mut siblings: BTreeMap<&str, BTreeMap<&str, BTreeSet<&str>>> = BTreeMap::new();
    let mut known_siblings: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
    for s in sources {
        if let Some(sib) = &s.sibling {
            known_siblings.entry(&s.module).or_default().insert(sib);
        }
    }
    let mut codes = Vec::new();
    for s in sources {
        codes.push(production_code(&s.text));
    }
    for (s, code) in sources.iter().zip(&codes) {
        let Some(own_layer) = layer_of(&s.module) else {
            problems.push(format!("{}: module `{}` is in no layer of tests/architecture.rs", s.path, s.module));
            continue;
        };
        for (target, next) in paths_after(code, "crate::") {
            if target == s.module {
                if let (Some(me), Some(next)) = (&s.sibling, next)
                    && next != me
                    && known_siblings.get(s.module.as_str()).is_some_and(|k| k.contains(next))
                {
                    siblings.entry(&s.module).or_default().entry(me).or_default().insert(next);
                }
                continue;
            }
            match layer_of(target) {
                Some(layer) if layer < own_layer => {}
                Some(_) => {
                    problems.push(format!("{}: `{}` (layer {own_layer}) uses `crate::{target}`", s.path, s.module))
                }
                None => problems.push(format!("{}: `crate::{target}` is in no layer", s.path)),
            }
        }
        if let Some(me) = &s.sibling {
            for (target, _) in paths_after(code, "super::") {
                if target != me.as_str() && known_siblings.get(s.module.as_str()).is_some_and(|k| k.contains(target)) {
                    siblings.entry(&s.module).or_default().entry(me).or_default().insert(target);
                }
            }
        }
    }
    for (module, graph) in &siblings {
        if let Some(cycle) = find_cycle(graph) {
            problems.push(format!("src/{module}/: its files import each other in a cycle: {}", cycle.join(" → ")));
        }
    }
    problems
}

fn find_cycle<'a>(graph: &BTreeMap<&'a str, BTreeSet<&'a str>>) -> Option<Vec<&'a str>> {
    fn visit<'a>(
        node: &'a str,
        graph: &BTreeMap<&'a str, BTreeSet<&'a str>>,
        stack: &mut Vec<&'a str>,
        done: &mut BTreeSet<&'a str>,
    ) -> Option<Vec<&'a str>> {
        if let Some(i) = stack.iter().position(|n| *n == node) {
            let mut cycle = stack[i..].to_vec();
            cycle.push(node);
            return Some(cycle);
        }
        if !done.insert(node) {
            return None;
        }
        stack.push(node);
        for next in graph.get(node).into_iter().flatten() {
            if let Some(c) = visit(next, graph, stack, done) {
                return Some(c);
            }
        }
        stack.pop();
        None
    }
    let mut done = BTreeSet::new();
    for node in graph.keys() {
        let mut stack = Vec::new();
        if let Some(c) = visit(node, graph, &mut stack, &mut done) {
            return Some(c);
        }
    }
    None
}

fn read_sources(dir: &Path, out: &mut Vec<Source>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir).expect("read src").map(|e| e.expect("entry").path()).collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            read_sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            let rel = path.strip_prefix(env!("CARGO_MANIFEST_DIR")).expect("inside the crate");
            let text = std::fs::read_to_string(&path).expect("read source");
            if let Some(s) = source(&rel.to_string_lossy(), text) {
                out.push(s);
            }
        }
    }
}

#[test]
fn module_graph_points_one_way() {
    let mut sources = Vec::new();
    read_sources(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"), &mut sources);
    assert!(sources.len() > 50, "read {} files", sources.len());
    let problems = violations(&sources);
    assert!(problems.is_empty(), "module graph:\n{}", problems.join("\n"));
}

/// The checker itself finds what it is for (an upward edge, a sibling cycle, a module in no
/// layer) and ignores comments and test modules.
#[test]
fn the_checker_finds_upward_edges_and_cycles() {
    let s = |path: &str, text: &str| source(path, text.to_string()).expect("a module file");
    let bad = [
        s("src/model/service.rs", "use crate::proxier::chains::X;\n// crate::daemon in a comment\n"),
        s("src/tracker/a.rs", "use super::b::Thing;\n"),
        s("src/tracker/b.rs", "use crate::tracker::a::Other;\n"),
        s("src/tracker/c.rs", "use super::a::Thing;\n"),
        s("src/newthing.rs", "use crate::model::X;\n"),
        s("src/proxier/render.rs", "use crate::{model::chains, daemon::app};\n"),
    ];
    let found = violations(&bad);
    assert_eq!(
        found,
        [
            "src/model/service.rs: `model` (layer 1) uses `crate::proxier`",
            "src/newthing.rs: module `newthing` is in no layer of tests/architecture.rs",
            "src/proxier/render.rs: `proxier` (layer 4) uses `crate::daemon`",
            "src/tracker/: its files import each other in a cycle: a → b → a",
        ]
    );
    let fine = [
        s("src/proxier/render.rs", "use crate::model::X;\n#[cfg(test)]\nmod tests { use crate::daemon::app; }\n"),
        s("src/tracker/a.rs", "use super::b::Thing;\n"),
        s("src/tracker/b.rs", "use crate::model::Y;\n"),
    ];
    assert_eq!(violations(&fine), Vec::<String>::new());
}
