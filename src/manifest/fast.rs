//! Block-style YAML to JSON text, for the subset kubectl and most people write; gives up
//! ([`Bail`]) on anything else so that serde_yaml can take over.
//!
//! The JSON keeps the YAML's line structure (a newline is emitted wherever the YAML starts a
//! new line before a key or value), so serde_json's error lines are YAML lines. Plain
//! scalars are typed exactly as serde_yaml types them (YAML 1.2 core schema: `null`, `true`,
//! decimal integers, floats; leading-zero digit strings stay strings); where the typing is
//! unusual (hex/octal, `+5`, `.inf`, huge integers) the converter bails.

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
    if text.bytes().any(|b| (b < 0x20 && b != b'\n' && b != b'\t') || b == 0x7f) {
        return Err(Bail);
    }
    // NEL, LINE SEPARATOR and PARAGRAPH SEPARATOR are line breaks to serde_yaml in some places
    // (it folds NEL in double-quoted scalars) and plain characters here: leave them to it.
    // The byte test first, so ASCII text is not scanned char by char.
    if text.bytes().any(|b| b == 0xC2 || b == 0xE2) && text.contains(['\u{85}', '\u{2028}', '\u{2029}']) {
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
    Ok(Converted::Doc(Document { json: conv.out, root, items: conv.items, items_present: conv.items_present }))
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
            Some(rest) if rest.is_empty() || rest.starts_with([' ', '\t']) => Ok(Some((key, rest))),
            _ => Ok(None),
        };
    }
    if matches!(first, b'?' | b'&' | b'*' | b'!' | b'|' | b'>' | b'%' | b'@' | b'`' | b'[' | b'{') {
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
                let value = if escaped { Cow::Owned(unescape_double(raw)?) } else { Cow::Borrowed(raw) };
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
        if self.depth > MAX_DEPTH { Err(Bail) } else { Ok(()) }
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
    fn parse_mapping(&mut self, indent: usize, inline_first: bool, role: Role, mut head: Option<&mut Head>) -> Res<()> {
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
                let child_head = if child_role == Role::Meta { head.as_deref_mut() } else { None };
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
            let role = if role == Role::Items { Role::Other } else { role };
            return self.parse_mapping(ind, false, role, head);
        }
        if content.starts_with(['|', '>']) {
            return Err(Bail);
        }
        self.parse_inline_value(content, parent_indent, false).map(|_| ())
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
            let element_role = if role == Role::Items { Role::Item } else { Role::Other };
            let mut item_head = Head::default();
            let head = if role == Role::Items { Some(&mut item_head) } else { None };
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
                let item = Item { head: item_head, start, end: self.out.len(), line: item_line };
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
    fn parse_inline_value(&mut self, rest: &'a str, parent_indent: usize, want_str: bool) -> Res<Option<String>> {
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
            b'?' | b':' | b'-' if next.is_none() || next == Some(b' ') || next == Some(b'\t') => {
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
            while j < self.lines.len() && self.lines[j].trim_start_matches([' ', '\t']).is_empty() {
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
                || piece.starts_with(['[', '{', '&', '*', '!', '|', '>', '\'', '"', '%', '@', '`', '?', ':'])
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
            while j < self.lines.len() && self.lines[j].trim_start_matches([' ', '\t']).is_empty() {
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
        let content_indent = if j < self.lines.len() { self.indent_at(j)? } else { 0 };
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
    if text.ends_with(':') || text.contains(": ") || text.contains(":\t") || text.contains(" #") {
        return Err(Bail);
    }
    Ok(())
}
