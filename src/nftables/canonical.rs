//! What `nft list` prints for a rule kube-proxy wrote: nft 1.0.6's canonical text of the
//! rule grammar kube-proxy uses, computed without asking the kernel.
//!
//! nft does not keep rule text: it compiles a rule into kernel expressions and, when listing,
//! prints those back in its own words. So `mark set mark or 0x4000` lists as
//! `meta mark set meta mark | 0x00004000`, `{ 198.18.0.0/16 }` as `198.18.0.0/16`, and an
//! anonymous set of ranges comes back sorted and merged. The proxier needs to know whether a
//! listed chain still holds what it would write (to repair changes made from outside without
//! rewriting every chain), and [`canonical_rule`] answers that with a pure function: a
//! listed rule equals what we wrote exactly when its text equals `canonical_rule(written)`.
//!
//! The transformations, each seen on nft 1.0.6 and checked for every rule shape kube-proxy
//! writes by `tests/nftables_real.rs` (which writes them through the real `nft` and reads
//! them back):
//!
//! * `mark` is `meta mark`; `or`, `xor`, `and` are `|`, `^`, `&`; mark values are written
//!   as eight hexadecimal digits (`0x00004000`).
//! * Addresses and prefixes in canonical text; host bits of a prefix are cleared; a /32
//!   (/128) prefix is the bare address.
//! * `dnat ip addr . port to …` is `dnat ip to …`.
//! * `iif NAME` quotes the name: `iif "NAME"`.
//! * An anonymous set written with one element is that element, without braces. Otherwise
//!   elements are separated by `, `; a set holding only single values is sorted; a set with
//!   a prefix or range is an interval set: sorted, elements inside another dropped,
//!   overlapping or adjacent ones merged (nft's automerge), each printed as an address, a
//!   prefix when it is one, else `low-high`.
//! * Anonymous maps (`vmap { … }`, `map { … }`) are separated by `, ` and sorted by key.
//!
//! Anything else is passed through unchanged. A rule this module does not predict right
//! only ever looks changed (and is rewritten), never unchanged when it was changed: the
//! comparison is with what the kernel lists.

use std::cmp::Ordering;
use std::net::IpAddr;

/// The text `nft list` shows for a rule written as `text` (rule comments are not part of
/// `text`; nft keeps them verbatim).
pub fn canonical_rule(text: &str) -> String {
    let tokens = tokenize(text);
    let mut out: Vec<String> = Vec::with_capacity(tokens.len());
    let mut i = 0;
    while i < tokens.len() {
        let token = tokens[i].as_str();
        match token {
            "mark" if out.last().is_none_or(|prev| prev != "meta" && prev != "ct") => {
                i = mark_expression(&tokens, i, &mut out);
                continue;
            }
            "{" => {
                let end = closing_brace(&tokens, i);
                let inner = &tokens[i + 1..end];
                let prev = out.last().map(String::as_str).unwrap_or("");
                if prev.starts_with('@') {
                    // `update @set { ip saddr }`: a key expression, not a set.
                    out.push("{".into());
                    out.extend(inner.iter().map(|t| canonical_token(t)));
                    out.push("}".into());
                } else if prev == "vmap" || prev == "map" {
                    out.push(anonymous_map(inner));
                } else {
                    out.push(anonymous_set(inner));
                }
                i = end + 1;
                continue;
            }
            "dnat"
                if matches!(tokens.get(i + 1).map(String::as_str), Some("ip" | "ip6"))
                    && tokens.get(i + 2).is_some_and(|t| t == "addr")
                    && tokens.get(i + 3).is_some_and(|t| t == ".")
                    && tokens.get(i + 4).is_some_and(|t| t == "port")
                    && tokens.get(i + 5).is_some_and(|t| t == "to") =>
            {
                out.extend(["dnat".to_string(), tokens[i + 1].clone(), "to".to_string()]);
                i += 6;
                continue;
            }
            "iif" | "oif" => {
                out.push(token.to_string());
                let mut j = i + 1;
                if tokens.get(j).is_some_and(|t| t == "!=") {
                    out.push("!=".into());
                    j += 1;
                }
                if let Some(name) = tokens.get(j) {
                    out.push(if name.starts_with('"') { name.clone() } else { format!("\"{name}\"") });
                    j += 1;
                }
                i = j;
                continue;
            }
            "jump" | "goto" => {
                // A chain name stays as written, whatever it looks like.
                out.push(token.to_string());
                if let Some(target) = tokens.get(i + 1) {
                    out.push(target.clone());
                }
                i += 2;
                continue;
            }
            _ => out.push(canonical_token(token)),
        }
        i += 1;
    }
    out.join(" ")
}

/// Splits on whitespace, keeping a double-quoted string (which may hold spaces) whole.
fn tokenize(text: &str) -> Vec<String> {
    let mut tokens = Vec::new();
    let mut current = String::new();
    let mut quoted = false;
    for c in text.chars() {
        if quoted {
            current.push(c);
            if c == '"' {
                quoted = false;
            }
        } else if c.is_whitespace() {
            if !current.is_empty() {
                tokens.push(std::mem::take(&mut current));
            }
        } else {
            if c == '"' {
                quoted = true;
            }
            current.push(c);
        }
    }
    if !current.is_empty() {
        tokens.push(current);
    }
    tokens
}

/// The index of the `}` closing the `{` at `open` (the last token when there is none).
fn closing_brace(tokens: &[String], open: usize) -> usize {
    let mut depth = 0usize;
    for (index, token) in tokens.iter().enumerate().skip(open) {
        match token.as_str() {
            "{" => depth += 1,
            "}" => {
                depth -= 1;
                if depth == 0 {
                    return index;
                }
            }
            _ => {}
        }
    }
    tokens.len().saturating_sub(1).max(open)
}

/// `mark …` from `start`: appends its canonical tokens, returns the index after it.
fn mark_expression(tokens: &[String], start: usize, out: &mut Vec<String>) -> usize {
    out.extend(["meta".to_string(), "mark".to_string()]);
    let mut i = start + 1;
    let word = |i: usize| tokens.get(i).map(String::as_str);
    // `mark set mark OP V` / `mark set V`
    if word(i) == Some("set") {
        out.push("set".into());
        i += 1;
        if word(i) == Some("mark") {
            out.extend(["meta".to_string(), "mark".to_string()]);
            i += 1;
            if let (Some(op), Some(value)) = (word(i).and_then(bit_operator), word(i + 1).and_then(mark_value)) {
                out.extend([op.to_string(), value]);
                i += 2;
            }
        } else if let Some(value) = word(i).and_then(mark_value) {
            out.push(value);
            i += 1;
        }
        return i;
    }
    // `mark and V1 ==|!= V2`, `mark ==|!= V`, `mark V`
    if let (Some(op), Some(value)) = (word(i).and_then(bit_operator), word(i + 1).and_then(mark_value)) {
        out.extend([op.to_string(), value]);
        i += 2;
    }
    if let Some(rel @ ("==" | "!=")) = word(i) {
        out.push(rel.to_string());
        i += 1;
    }
    if let Some(value) = word(i).and_then(mark_value) {
        out.push(value);
        i += 1;
    }
    i
}

fn bit_operator(word: &str) -> Option<&'static str> {
    match word {
        "or" | "|" => Some("|"),
        "xor" | "^" => Some("^"),
        "and" | "&" => Some("&"),
        _ => None,
    }
}

/// A 32-bit mark value as nft prints it: `0x` and eight hexadecimal digits.
fn mark_value(word: &str) -> Option<String> {
    let value = match word.strip_prefix("0x").or_else(|| word.strip_prefix("0X")) {
        Some(hex) => u32::from_str_radix(hex, 16).ok()?,
        None => word.parse::<u32>().ok()?,
    };
    Some(format!("0x{value:08x}"))
}

/// One token outside sets and maps: addresses and prefixes in canonical form, the rest as is.
fn canonical_token(token: &str) -> String {
    if let Some(range) = AddrRange::parse(token) {
        return range.to_string();
    }
    if let Some(endpoint) = canonical_host_port(token) {
        return endpoint;
    }
    token.to_string()
}

/// `IP:PORT` or `[IPv6]:PORT` (a `dnat to` target) with the address in canonical form.
fn canonical_host_port(token: &str) -> Option<String> {
    if let Some(rest) = token.strip_prefix('[') {
        let (addr, port) = rest.split_once("]:")?;
        let addr: std::net::Ipv6Addr = addr.parse().ok()?;
        port.parse::<u16>().ok()?;
        return Some(format!("[{addr}]:{port}"));
    }
    let (addr, port) = token.split_once(':')?;
    let addr: std::net::Ipv4Addr = addr.parse().ok()?;
    port.parse::<u16>().ok()?;
    Some(format!("{addr}:{port}"))
}

/// The elements of an anonymous set or map: the tokens between the braces joined with
/// spaces and split at commas (kube-proxy writes both `a , b` and `a,b`).
fn elements(inner: &[String]) -> Vec<String> {
    inner.join(" ").split(',').map(|e| e.trim().to_string()).filter(|e| !e.is_empty()).collect()
}

fn anonymous_set(inner: &[String]) -> String {
    let written = elements(inner);
    if written.len() == 1 {
        return canonical_element(&written[0]);
    }
    let ranges: Option<Vec<AddrRange>> = written.iter().map(|e| AddrRange::parse(e)).collect();
    let printed: Vec<String> = match ranges {
        Some(ranges) if ranges.iter().any(|r| r.written_as_interval) => {
            merge_intervals(ranges).iter().map(ToString::to_string).collect()
        }
        _ => {
            let mut values: Vec<String> = written.iter().map(|e| canonical_element(e)).collect();
            values.sort_by(|a, b| compare_keys(a, b));
            values.dedup();
            values
        }
    };
    format!("{{ {} }}", printed.join(", "))
}

fn anonymous_map(inner: &[String]) -> String {
    let mut entries: Vec<(String, String)> = elements(inner)
        .iter()
        .map(|e| match e.split_once(" : ") {
            Some((key, value)) => (canonical_element(key), canonical_element(value)),
            None => (canonical_element(e), String::new()),
        })
        .collect();
    entries.sort_by(|a, b| compare_keys(&a.0, &b.0));
    let printed: Vec<String> =
        entries.into_iter().map(|(k, v)| if v.is_empty() { k } else { format!("{k} : {v}") }).collect();
    format!("{{ {} }}", printed.join(", "))
}

/// A set or map element (possibly a concatenation `a . b . c`, or a verdict `goto X`) as
/// nft lists it.
pub fn canonical_element(element: &str) -> String {
    if element.starts_with("goto ") || element.starts_with("jump ") {
        return element.to_string();
    }
    element.split(" . ").map(|part| canonical_token(part.trim())).collect::<Vec<_>>().join(" . ")
}

/// Orders element keys as nft lists them: by value, part by part (addresses and numbers
/// numerically, protocols by number).
fn compare_keys(a: &str, b: &str) -> Ordering {
    let parts = |s: &str| s.split(" . ").map(part_order).collect::<Vec<_>>();
    parts(a).cmp(&parts(b))
}

fn part_order(part: &str) -> (u8, u128, String) {
    if let Some(range) = AddrRange::parse(part) {
        return (0, range.low, String::new());
    }
    if let Ok(n) = part.parse::<u128>() {
        return (0, n, String::new());
    }
    let proto = match part {
        "tcp" => Some(6),
        "udp" => Some(17),
        "sctp" => Some(132),
        _ => None,
    };
    match proto {
        Some(n) => (0, n, String::new()),
        None => (1, 0, part.to_string()),
    }
}

/// An address, prefix or `low-high` range of one family, as an inclusive range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct AddrRange {
    v6: bool,
    low: u128,
    high: u128,
    /// Written as a prefix or range (makes an anonymous set an interval set), not a
    /// single address (a /32 counts: nft sees a prefix).
    written_as_interval: bool,
}

impl AddrRange {
    fn bits(v6: bool) -> u32 {
        if v6 { 128 } else { 32 }
    }

    fn parse(text: &str) -> Option<AddrRange> {
        if let Some((low, high)) = text.split_once('-') {
            let (low, high) = (parse_addr(low)?, parse_addr(high)?);
            if low.0 != high.0 || low.1 > high.1 {
                return None;
            }
            return Some(AddrRange { v6: low.0, low: low.1, high: high.1, written_as_interval: true });
        }
        if let Some((addr, len)) = text.split_once('/') {
            let (v6, value) = parse_addr(addr)?;
            let len: u32 = len.parse().ok()?;
            let bits = Self::bits(v6);
            if len > bits {
                return None;
            }
            let host = if len == 0 { max_value(v6) } else { max_value(v6) >> len };
            let low = value & !host;
            return Some(AddrRange { v6, low, high: low | host, written_as_interval: true });
        }
        let (v6, value) = parse_addr(text)?;
        Some(AddrRange { v6, low: value, high: value, written_as_interval: false })
    }

    /// The prefix length when the range is exactly one prefix.
    fn prefix_len(&self) -> Option<u32> {
        let span = self.high - self.low;
        if span == max_value(self.v6) {
            return (self.low == 0).then_some(0);
        }
        let size = span + 1;
        if !size.is_power_of_two() || self.low & span != 0 {
            return None;
        }
        Some(Self::bits(self.v6) - size.trailing_zeros())
    }
}

impl std::fmt::Display for AddrRange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let addr = |value: u128| -> IpAddr {
            if self.v6 { IpAddr::V6(value.into()) } else { IpAddr::V4((value as u32).into()) }
        };
        if self.low == self.high {
            return write!(f, "{}", addr(self.low));
        }
        match self.prefix_len() {
            Some(len) => write!(f, "{}/{len}", addr(self.low)),
            None => write!(f, "{}-{}", addr(self.low), addr(self.high)),
        }
    }
}

fn max_value(v6: bool) -> u128 {
    if v6 { u128::MAX } else { u32::MAX as u128 }
}

fn parse_addr(text: &str) -> Option<(bool, u128)> {
    match text.parse::<IpAddr>().ok()? {
        IpAddr::V4(a) => Some((false, u32::from(a) as u128)),
        IpAddr::V6(a) => Some((true, u128::from(a))),
    }
}

/// nft's automerge of an anonymous interval set (src/intervals.c `setelem_automerge`):
/// sorted by low end; a range inside the previous one is dropped; one overlapping or
/// adjacent to it extends it.
fn merge_intervals(mut ranges: Vec<AddrRange>) -> Vec<AddrRange> {
    ranges.sort_by_key(|r| r.low);
    let mut merged: Vec<AddrRange> = Vec::with_capacity(ranges.len());
    for range in ranges {
        if let Some(prev) = merged.last_mut()
            && prev.v6 == range.v6
        {
            if prev.low <= range.low && prev.high >= range.high {
                continue;
            }
            if range.low <= prev.high || range.low - prev.high == 1 {
                prev.high = range.high;
                continue;
            }
        }
        merged.push(range);
    }
    merged
}

/// nft's order of set flags when listing (src/rule.c `set_print_declaration`).
const FLAG_ORDER: &[&str] = &["constant", "dynamic", "interval", "timeout"];

/// Orders set flags as nft lists them; unknown flags keep their place after the known ones.
pub fn listed_flag_order(flags: &[String]) -> Vec<String> {
    let mut known: Vec<String> =
        FLAG_ORDER.iter().filter(|f| flags.iter().any(|g| g == *f)).map(|f| f.to_string()).collect();
    known.extend(flags.iter().filter(|f| !FLAG_ORDER.contains(&f.as_str())).cloned());
    known.dedup();
    known
}

#[cfg(test)]
mod tests {
    use super::*;

    #[track_caller]
    fn same(written: &str, listed: &str) {
        assert_eq!(canonical_rule(written), listed, "written: {written}");
        // Canonical text is its own canonical form (a listed rule read back stays equal)…
        assert_eq!(canonical_rule(listed), listed, "listed: {listed}");
    }

    /// …except where nft merged several elements into one: it keeps the braces, while one
    /// element written in braces loses them.
    #[track_caller]
    fn merged(written: &str, listed: &str) {
        assert_eq!(canonical_rule(written), listed, "written: {written}");
    }

    #[test]
    fn marks_are_meta_marks_in_hex() {
        same("mark set mark or 0x4000", "meta mark set meta mark | 0x00004000");
        same("mark and 0x4000 == 0 return", "meta mark & 0x00004000 == 0x00000000 return");
        same("mark set mark xor 0x00004000", "meta mark set meta mark ^ 0x00004000");
        same(
            "mark and 0x00004000 != 0 mark set mark xor 0x00004000 masquerade fully-random",
            "meta mark & 0x00004000 != 0x00000000 meta mark set meta mark ^ 0x00004000 masquerade fully-random",
        );
        same(
            "ip daddr @cluster-ips ip saddr != 10.0.0.0/8 mark set mark or 0x00004000",
            "ip daddr @cluster-ips ip saddr != 10.0.0.0/8 meta mark set meta mark | 0x00004000",
        );
    }

    #[test]
    fn sets_and_maps_as_nft_lists_them() {
        same("ip daddr { 198.18.0.0/16 } drop", "ip daddr 198.18.0.0/16 drop");
        merged("ip daddr { 10.96.0.0/16,10.97.0.0/16 } drop", "ip daddr { 10.96.0.0/15 } drop");
        same(
            "ip saddr != { 192.168.0.0/24 , 203.0.113.0/25 , 1.2.3.4 , 5.6.7.8 } drop",
            "ip saddr != { 1.2.3.4, 5.6.7.8, 192.168.0.0/24, 203.0.113.0/25 } drop",
        );
        merged("ip saddr != { 1.2.3.0/24 , 1.2.3.4 } drop", "ip saddr != { 1.2.3.0/24 } drop");
        merged("ip saddr != { 10.0.0.0/25 , 10.0.0.128/26 } drop", "ip saddr != { 10.0.0.0-10.0.0.191 } drop");
        same(
            "ip saddr != { 10.0.0.128 , 10.0.0.0/25 , 9.9.9.9/32 } drop",
            "ip saddr != { 9.9.9.9, 10.0.0.0-10.0.0.128 } drop",
        );
        same("ip saddr != { 203.0.113.8 , 203.0.113.7 } drop", "ip saddr != { 203.0.113.7, 203.0.113.8 } drop");
        same("ip saddr { 10.0.0.1/8, 1.1.1.1 } drop", "ip saddr { 1.1.1.1, 10.0.0.0/8 } drop");
        same("ip saddr 10.0.0.1/32 drop", "ip saddr 10.0.0.1 drop");
        same("ip6 saddr != { fd00::/64 , FD00:1:0::1 } drop", "ip6 saddr != { fd00::/64, fd00:1::1 } drop");
        same(
            "numgen random mod 2 vmap { 0 : goto endpoint-A , 1 : goto endpoint-B }",
            "numgen random mod 2 vmap { 0 : goto endpoint-A, 1 : goto endpoint-B }",
        );
        same(
            "numgen random mod 3 vmap { 2 : drop , 0 : accept , 1 : drop }",
            "numgen random mod 3 vmap { 0 : accept, 1 : drop, 2 : drop }",
        );
        same(
            "meta l4proto tcp dnat ip addr . port to numgen random mod 2 map { 0 : 198.19.0.1 . 80 , 1 : 198.19.0.2 . 8080 }",
            "meta l4proto tcp dnat ip to numgen random mod 2 map { 0 : 198.19.0.1 . 80, 1 : 198.19.0.2 . 8080 }",
        );
        same(
            "meta l4proto tcp dnat ip6 addr . port to numgen random mod 1 map { 0 : fd00:10:180::2:1 . 80 }",
            "meta l4proto tcp dnat ip6 to numgen random mod 1 map { 0 : fd00:10:180::2:1 . 80 }",
        );
    }

    #[test]
    fn other_shapes() {
        same("update @affinity-A { ip saddr }", "update @affinity-A { ip saddr }");
        same("ip saddr @affinity-A goto endpoint-A", "ip saddr @affinity-A goto endpoint-A");
        same(
            "ip daddr 172.30.0.41 iif != cbr0 jump mark-for-masquerade",
            "ip daddr 172.30.0.41 iif != \"cbr0\" jump mark-for-masquerade",
        );
        same("meta l4proto tcp dnat to [fd00:10:180::2:1]:80", "meta l4proto tcp dnat to [fd00:10:180::2:1]:80");
        same("meta l4proto tcp dnat to 10.180.0.1:80", "meta l4proto tcp dnat to 10.180.0.1:80");
        same("counter name \"rejected tcp\" reject", "counter name \"rejected tcp\" reject");
        same("goto 1.2.3.4", "goto 1.2.3.4");
        same(
            "ct status dnat ip saddr . ip daddr . meta l4proto . th dport @hairpin-connections masquerade fully-random",
            "ct status dnat ip saddr . ip daddr . meta l4proto . th dport @hairpin-connections masquerade fully-random",
        );
    }
}
