//! One iptables rule (the words after `-A CHAIN`) parsed into the matches and the target the
//! tracer evaluates: exactly the ones kube-proxy writes (upstream's and ours), plus the few
//! every node has (`-i`/`-o`, `multiport`, `LOG`).
//!
//! Two kinds of failure, on purpose:
//! * [`RuleError::Syntax`]: the rule is malformed (unterminated quote, missing value, bad
//!   address, port or number). The whole dump is refused, naming the line.
//! * [`RuleError::Unsupported`]: a match module, option or target the tracer does not model
//!   (`-m set`, `-j CT`...). Real nodes carry such rules in other tools' chains; they are
//!   reported only when a packet reaches them, never guessed.
//!
//! Loading a dump runs the parser over every rule (443k in a 10k-Service dump), so the word
//! splitter is hand-written over bytes and borrows from the text; its tests compare it with
//! the straightforward char-by-char splitter it replaced.

use std::borrow::Cow;
use std::net::IpAddr;

use crate::model::ip::{Cidr, parse_ip_sloppy};

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RuleError {
    #[error("{0}")]
    Syntax(String),
    #[error("{0}")]
    Unsupported(String),
}

/// A parsed rule. The evaluation order of [`Rule::matches`] is the rule's own.
#[derive(Debug, Clone, PartialEq)]
pub struct Rule {
    pub matches: Vec<Match>,
    pub target: Target,
    /// The `--comment` text, if any.
    pub comment: Option<String>,
}

impl Rule {
    /// A key independent of spelling: rules iptables treats alike (option order, `/32`,
    /// `--or-mark` vs `--set-xmark`, probability digits, `-m tcp`) get the same key. For
    /// comparing the rules a node holds with the rules we would write.
    pub fn key(&self) -> String {
        let mut parts: Vec<String> = self
            .matches
            .iter()
            .map(|m| match m {
                // iptables keeps the probability as round(p * 2^31).
                Match::Probability(p) => format!("probability={}", (p * 2_147_483_648.0).round()),
                Match::CtState { neg, states } => {
                    let mut s = states.clone();
                    s.sort();
                    format!("ctstate neg={neg} {}", s.join(","))
                }
                other => format!("{other:?}"),
            })
            .collect();
        parts.sort();
        format!("{} comment={:?} target={:?}", parts.join(" "), self.comment, self.target)
    }
}

/// An IP protocol as `-p` names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Proto {
    Tcp,
    Udp,
    Sctp,
    /// Anything else, by number (`icmp` = 1, `icmpv6` = 58...).
    Other(u8),
}

impl Proto {
    /// Case-insensitive, as iptables reads it.
    pub fn parse(s: &str) -> Option<Proto> {
        let is = |names: &[&str]| names.iter().any(|n| s.eq_ignore_ascii_case(n));
        Some(if is(&["tcp", "6"]) {
            Proto::Tcp
        } else if is(&["udp", "17"]) {
            Proto::Udp
        } else if is(&["sctp", "132"]) {
            Proto::Sctp
        } else if is(&["icmp", "1"]) {
            Proto::Other(1)
        } else if is(&["icmpv6", "ipv6-icmp", "58"]) {
            Proto::Other(58)
        } else {
            Proto::Other(s.parse().ok()?)
        })
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Proto::Tcp => "tcp",
            Proto::Udp => "udp",
            Proto::Sctp => "sctp",
            Proto::Other(_) => "other",
        }
    }

    fn has_ports(self) -> bool {
        matches!(self, Proto::Tcp | Proto::Udp | Proto::Sctp)
    }
}

/// `-p`: `None` is `-p all`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProtoMatch(pub Option<Proto>);

/// One condition of a rule; `neg` is a preceding `!`.
#[derive(Debug, Clone, PartialEq)]
pub enum Match {
    Source {
        neg: bool,
        net: Cidr,
    },
    Destination {
        neg: bool,
        net: Cidr,
    },
    Protocol {
        neg: bool,
        proto: ProtoMatch,
    },
    /// `--dport`, `--dports` (multiport): inclusive ranges.
    DestPort {
        neg: bool,
        ranges: Vec<(u16, u16)>,
    },
    /// `--sport`: the tracer has no source port, so reaching one is an error.
    SourcePort,
    InInterface {
        neg: bool,
        name: String,
    },
    OutInterface {
        neg: bool,
        name: String,
    },
    /// `-m addrtype --src-type/--dst-type`: only `LOCAL` is modelled.
    SrcTypeLocal {
        neg: bool,
    },
    DstTypeLocal {
        neg: bool,
    },
    /// `-m mark --mark value/mask`.
    Mark {
        neg: bool,
        value: u32,
        mask: u32,
    },
    /// `-m conntrack --ctstate` / `-m state --state`, upper-case names.
    CtState {
        neg: bool,
        states: Vec<String>,
    },
    /// `-m statistic --mode random --probability P`.
    Probability(f64),
    /// `-m recent --rcheck/--update --name NAME`: session affinity; a first packet has no
    /// entry, so it does not match, and the tracer reports the rule as an affinity branch.
    RecentCheck {
        neg: bool,
        name: String,
        seconds: Option<u64>,
    },
    /// `-m recent --set --name NAME`: records the client; always matches.
    RecentSet {
        name: String,
    },
    /// `-m nfacct --nfacct-name NAME` (1.31+ accounting): counts, always matches.
    Nfacct {
        name: String,
    },
}

/// What a rule does when it matches.
#[derive(Debug, Clone, PartialEq)]
pub enum Target {
    /// No `-j`: counts, continues.
    None,
    Jump(String),
    Goto(String),
    Accept,
    Drop,
    Reject,
    Return,
    /// `MARK`, normalised to `--set-xmark value/mask`: `mark = (mark & !mask) ^ value`.
    Mark {
        value: u32,
        mask: u32,
    },
    Masquerade,
    Snat,
    /// `DNAT --to-destination ADDR[:PORT]`.
    Dnat {
        addr: IpAddr,
        port: Option<u16>,
    },
    /// `LOG`: continues.
    Log,
}

impl Target {
    /// The target's name as written after `-j`.
    pub fn name(&self) -> String {
        match self {
            Target::None => String::new(),
            Target::Jump(c) | Target::Goto(c) => c.clone(),
            Target::Accept => "ACCEPT".into(),
            Target::Drop => "DROP".into(),
            Target::Reject => "REJECT".into(),
            Target::Return => "RETURN".into(),
            Target::Mark { .. } => "MARK".into(),
            Target::Masquerade => "MASQUERADE".into(),
            Target::Snat => "SNAT".into(),
            Target::Dnat { .. } => "DNAT".into(),
            Target::Log => "LOG".into(),
        }
    }
}

/// Splits a rule into words the way iptables-save quotes them: a word starting with `"` runs
/// to the next unescaped `"` (`\"` and `\\` are escapes), quotes removed.
pub fn split_words(text: &str) -> Result<Vec<String>, RuleError> {
    Ok(words(text)?.into_iter().map(Cow::into_owned).collect())
}

/// [`split_words`] borrowing from `text`: only a quoted word with an escape in it is copied.
/// Loading a dump runs this on every rule, so it scans bytes and allocates one `Vec`.
fn words(text: &str) -> Result<Vec<Cow<'_, str>>, RuleError> {
    let bytes = text.as_bytes();
    let mut words = Vec::with_capacity(24);
    let mut at = 0;
    loop {
        while at < bytes.len() && bytes[at].is_ascii_whitespace() {
            at += 1;
        }
        if at == bytes.len() {
            break;
        }
        if bytes[at] == b'"' {
            let start = at + 1;
            let mut end = start;
            let mut escaped = false;
            // Find the closing quote; a backslash always takes the next byte with it.
            loop {
                match bytes.get(end) {
                    None => return Err(RuleError::Syntax("unterminated quoted string".into())),
                    Some(b'"') => break,
                    Some(b'\\') => {
                        escaped = true;
                        end += 2;
                    }
                    Some(_) => end += 1,
                }
            }
            let inner = &text[start..end];
            words.push(if escaped { Cow::Owned(unescape(inner)) } else { Cow::Borrowed(inner) });
            at = end + 1;
        } else {
            let start = at;
            while at < bytes.len() && !bytes[at].is_ascii_whitespace() {
                at += 1;
            }
            words.push(Cow::Borrowed(&text[start..at]));
        }
    }
    Ok(words)
}

/// Undoes `\"` and `\\` inside a quoted word; any other backslash stays.
fn unescape(inner: &str) -> String {
    let mut word = String::with_capacity(inner.len());
    let mut chars = inner.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            word.push(c);
            continue;
        }
        match chars.next() {
            Some(e @ ('"' | '\\')) => word.push(e),
            Some(other) => {
                word.push('\\');
                word.push(other);
            }
            None => word.push('\\'),
        }
    }
    word
}

/// Match modules whose options the parser knows.
const KNOWN_MODULES: &[&str] = &[
    "comment",
    "tcp",
    "udp",
    "sctp",
    "addrtype",
    "mark",
    "statistic",
    "recent",
    "conntrack",
    "state",
    "multiport",
    "nfacct",
];

/// Parses the words after `-A CHAIN`.
pub(crate) fn parse_rule(text: &str) -> Result<Rule, RuleError> {
    let words = words(text)?;
    let words = words.as_slice();
    let mut rule = Rule { matches: Vec::new(), target: Target::None, comment: None };
    let mut neg = false;
    let mut target_name: Option<&str> = None;
    let mut goto = false;
    // Options of the target (after -j), checked once the whole rule is read.
    let mut target_opts: Vec<(&str, Option<&str>)> = Vec::new();
    let mut stat_mode: Option<&str> = None;
    let mut stat_prob: Option<f64> = None;
    let mut recent_check: Option<bool> = None;
    let mut recent_set = false;
    let mut recent_seconds: Option<u64> = None;
    let mut recent_name: Option<&str> = None;
    let mut proto: Option<Proto> = None;
    let mut unsupported: Option<String> = None;

    let mut i = 0;
    while i < words.len() {
        let w: &str = &words[i];
        if w == "!" {
            if neg {
                return Err(RuleError::Syntax("double negation \"! !\"".into()));
            }
            neg = true;
            i += 1;
            continue;
        }
        let was_neg = std::mem::take(&mut neg);
        // Once the target is known, every further option is the target's.
        if target_name.is_some() && w.starts_with("--") {
            let takes_value = !matches!(
                w,
                "--random"
                    | "--random-fully"
                    | "--persistent"
                    | "--log-uid"
                    | "--log-tcp-sequence"
                    | "--log-tcp-options"
                    | "--log-ip-options"
            );
            let v = if takes_value { Some(value(words, &mut i, w)?) } else { None };
            target_opts.push((w, v));
            i += 1;
            continue;
        }
        match w {
            "-s" | "--source" | "-d" | "--destination" => {
                let net = parse_net(value(words, &mut i, w)?)?;
                rule.matches.push(if matches!(w, "-s" | "--source") {
                    Match::Source { neg: was_neg, net }
                } else {
                    Match::Destination { neg: was_neg, net }
                });
            }
            "-p" | "--protocol" => {
                let v = value(words, &mut i, w)?;
                let p = if v.eq_ignore_ascii_case("all") {
                    None
                } else {
                    Some(Proto::parse(v).ok_or_else(|| RuleError::Syntax(format!("unknown protocol {v:?}")))?)
                };
                if !was_neg {
                    proto = p;
                }
                rule.matches.push(Match::Protocol { neg: was_neg, proto: ProtoMatch(p) });
            }
            "-i" | "--in-interface" => {
                let name = value(words, &mut i, w)?.to_string();
                rule.matches.push(Match::InInterface { neg: was_neg, name });
            }
            "-o" | "--out-interface" => {
                let name = value(words, &mut i, w)?.to_string();
                rule.matches.push(Match::OutInterface { neg: was_neg, name });
            }
            "-m" | "--match" => {
                let m = value(words, &mut i, w)?;
                if !KNOWN_MODULES.contains(&m) && unsupported.is_none() {
                    unsupported = Some(format!("unsupported match module \"-m {m}\""));
                }
                if unsupported.is_some() {
                    // Options of an unknown module cannot be told apart from anything else.
                    break;
                }
            }
            "-j" | "--jump" | "-g" | "--goto" => {
                let t = value(words, &mut i, w)?;
                if is_builtin_target_name(t) {
                    // Its options' arity is unknown: nothing after it can be read.
                    unsupported.get_or_insert(format!("unsupported target {t:?}"));
                    break;
                }
                goto = w == "-g" || w == "--goto";
                target_name = Some(t);
            }
            "--comment" => rule.comment = Some(value(words, &mut i, w)?.to_string()),
            "--dport" | "--destination-port" | "--dports" | "--destination-ports" => {
                let v = value(words, &mut i, w)?;
                let ranges = v.split(',').map(parse_port_range).collect::<Result<Vec<_>, _>>()?;
                rule.matches.push(Match::DestPort { neg: was_neg, ranges });
            }
            "--sport" | "--source-port" | "--sports" | "--source-ports" => {
                value(words, &mut i, w)?;
                rule.matches.push(Match::SourcePort);
            }
            "--src-type" | "--dst-type" => {
                let v = value(words, &mut i, w)?;
                if v != "LOCAL" {
                    unsupported.get_or_insert(format!("unsupported address type \"{w} {v}\" (only LOCAL is modelled)"));
                }
                rule.matches.push(if w == "--src-type" {
                    Match::SrcTypeLocal { neg: was_neg }
                } else {
                    Match::DstTypeLocal { neg: was_neg }
                });
            }
            "--mark" => {
                let v = value(words, &mut i, w)?;
                let (value, mask) = parse_mark(v)?;
                rule.matches.push(Match::Mark { neg: was_neg, value, mask });
            }
            "--ctstate" | "--state" => {
                let v = value(words, &mut i, w)?;
                let states = v.split(',').map(|s| s.trim().to_ascii_uppercase()).collect();
                rule.matches.push(Match::CtState { neg: was_neg, states });
            }
            "--mode" => stat_mode = Some(value(words, &mut i, w)?),
            "--probability" => {
                let v = value(words, &mut i, w)?;
                let p: f64 = v.parse().map_err(|_| RuleError::Syntax(format!("bad probability {v:?}")))?;
                if !(0.0..=1.0).contains(&p) {
                    return Err(RuleError::Syntax(format!("probability {v} is not between 0 and 1")));
                }
                stat_prob = Some(p);
            }
            "--every" | "--packet" => {
                value(words, &mut i, w)?;
                unsupported.get_or_insert("unsupported statistic mode nth".into());
            }
            "--name" => recent_name = Some(value(words, &mut i, w)?),
            "--nfacct-name" => {
                let name = value(words, &mut i, w)?.to_string();
                rule.matches.push(Match::Nfacct { name });
            }
            "--rcheck" | "--update" => recent_check = Some(was_neg),
            "--set" => recent_set = true,
            "--rsource" | "--rdest" | "--reap" => {}
            "--seconds" => {
                let v = value(words, &mut i, w)?;
                recent_seconds = Some(v.parse().map_err(|_| RuleError::Syntax(format!("bad --seconds {v:?}")))?);
            }
            "--hitcount" | "--mask" => {
                value(words, &mut i, w)?;
            }
            "--remove" => {
                unsupported.get_or_insert("unsupported recent --remove".into());
            }
            _ => {
                unsupported.get_or_insert(format!("unsupported option {w:?}"));
                break;
            }
        }
        i += 1;
    }
    if neg {
        return Err(RuleError::Syntax("\"!\" at the end of the rule".into()));
    }
    if let Some(reason) = unsupported {
        return Err(RuleError::Unsupported(reason));
    }
    match (stat_mode, stat_prob) {
        (None, None) => {}
        (Some("random"), Some(p)) => rule.matches.push(Match::Probability(p)),
        (Some("random"), None) => {
            return Err(RuleError::Syntax("statistic --mode random without --probability".into()));
        }
        (Some(m), _) => return Err(RuleError::Unsupported(format!("unsupported statistic mode {m:?}"))),
        (None, Some(_)) => return Err(RuleError::Syntax("--probability without --mode random".into())),
    }
    let recent_name = recent_name.unwrap_or("DEFAULT").to_string();
    if let Some(neg) = recent_check {
        rule.matches.push(Match::RecentCheck { neg, name: recent_name, seconds: recent_seconds });
    } else if recent_set {
        rule.matches.push(Match::RecentSet { name: recent_name });
    }
    if rule.matches.iter().any(|m| matches!(m, Match::DestPort { .. })) && !proto.is_some_and(Proto::has_ports) {
        return Err(RuleError::Syntax("a port match needs -p tcp, udp or sctp".into()));
    }
    if let Some(name) = target_name {
        rule.target = parse_target(name, goto, &target_opts)?;
    }
    Ok(rule)
}

/// The value after option `opt` at `words[*i]`, moving `i` onto it.
fn value<'w>(words: &'w [Cow<'_, str>], i: &mut usize, opt: &str) -> Result<&'w str, RuleError> {
    *i += 1;
    words.get(*i).map(|w| &**w).ok_or_else(|| RuleError::Syntax(format!("option {opt} needs a value")))
}

fn parse_target(name: &str, goto: bool, opts: &[(&str, Option<&str>)]) -> Result<Target, RuleError> {
    let opt = |key: &str| opts.iter().find(|(k, _)| *k == key).and_then(|(_, v)| *v);
    let only = |allowed: &[&str]| -> Result<(), RuleError> {
        match opts.iter().find(|(k, _)| !allowed.contains(k)) {
            Some((k, _)) => Err(RuleError::Unsupported(format!("unsupported option {k:?} for target {name}"))),
            None => Ok(()),
        }
    };
    let t = match name {
        "ACCEPT" => Target::Accept,
        "DROP" => Target::Drop,
        "RETURN" => Target::Return,
        "REJECT" => {
            only(&["--reject-with"])?;
            Target::Reject
        }
        "MASQUERADE" => {
            only(&["--random", "--random-fully", "--to-ports"])?;
            Target::Masquerade
        }
        "SNAT" => {
            only(&["--to-source", "--random", "--random-fully", "--persistent"])?;
            Target::Snat
        }
        "LOG" => Target::Log,
        "DNAT" => {
            only(&["--to-destination", "--random", "--persistent"])?;
            let to =
                opt("--to-destination").ok_or_else(|| RuleError::Syntax("DNAT without --to-destination".into()))?;
            let (addr, port) = parse_dnat(to)?;
            Target::Dnat { addr, port }
        }
        "MARK" => {
            let (key, v) = opts.first().ok_or_else(|| RuleError::Syntax("MARK without a mark option".into()))?;
            let v = v.unwrap_or_default();
            let (value, mask) = match *key {
                "--set-xmark" => parse_mark(v)?,
                "--set-mark" => {
                    let (value, mask) = parse_mark(v)?;
                    // --set-mark v/m clears the mask bits then ORs v: same as xmark when v ⊆ m.
                    (value, mask | value)
                }
                "--or-mark" => {
                    let v = parse_u32(v)?;
                    (v, v)
                }
                "--xor-mark" => (parse_u32(v)?, 0),
                "--and-mark" => (0, !parse_u32(v)?),
                other => return Err(RuleError::Unsupported(format!("unsupported MARK option {other:?}"))),
            };
            Target::Mark { value, mask }
        }
        _ if name.chars().all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '-' || c == '_')
            && is_builtin_target_name(name) =>
        {
            return Err(RuleError::Unsupported(format!("unsupported target {name:?}")));
        }
        chain => {
            if !opts.is_empty() {
                return Err(RuleError::Unsupported(format!("unsupported target {chain:?} with options")));
            }
            if goto { Target::Goto(chain.to_string()) } else { Target::Jump(chain.to_string()) }
        }
    };
    if goto && !matches!(t, Target::Goto(_)) {
        return Err(RuleError::Syntax(format!("-g needs a chain, not {name}")));
    }
    Ok(t)
}

/// Extension targets iptables ships that are not chains (so a typo'd chain is not mistaken for
/// one of them, and one of them is not mistaken for a missing chain).
fn is_builtin_target_name(name: &str) -> bool {
    matches!(
        name,
        "CT" | "NOTRACK"
            | "TPROXY"
            | "REDIRECT"
            | "NETMAP"
            | "CONNMARK"
            | "TCPMSS"
            | "NFQUEUE"
            | "NFLOG"
            | "TRACE"
            | "CLASSIFY"
            | "DSCP"
            | "TOS"
            | "TTL"
            | "HL"
            | "SET"
            | "AUDIT"
            | "CHECKSUM"
            | "ULOG"
            | "SECMARK"
            | "CONNSECMARK"
            | "IDLETIMER"
            | "LED"
    )
}

/// `ADDR`, `ADDR/PREFIX` or `ADDR/MASK` (dotted IPv4 mask).
fn parse_net(s: &str) -> Result<Cidr, RuleError> {
    let bad = || RuleError::Syntax(format!("bad address {s:?}"));
    if s.contains(',') {
        return Err(RuleError::Unsupported(format!("unsupported address list {s:?}")));
    }
    match s.split_once('/') {
        None => {
            let ip = parse_ip_sloppy(s).ok_or_else(bad)?;
            let prefix = if ip.is_ipv4() { 32 } else { 128 };
            Cidr::new(ip, prefix).ok_or_else(bad)
        }
        Some((addr, mask)) if mask.contains('.') => {
            let ip = parse_ip_sloppy(addr).ok_or_else(bad)?;
            let m: std::net::Ipv4Addr = mask.parse().map_err(|_| bad())?;
            let m = u32::from(m);
            if m.leading_ones() + m.trailing_zeros() != 32 {
                return Err(RuleError::Unsupported(format!("unsupported non-contiguous mask in {s:?}")));
            }
            Cidr::new(ip, u8::try_from(m.leading_ones()).map_err(|_| bad())?).ok_or_else(bad)
        }
        Some(_) => Cidr::parse_sloppy(s).ok_or_else(bad),
    }
}

fn parse_port(s: &str) -> Result<u16, RuleError> {
    s.parse().map_err(|_| RuleError::Syntax(format!("bad port {s:?}")))
}

fn parse_port_range(s: &str) -> Result<(u16, u16), RuleError> {
    match s.split_once(':') {
        Some((a, b)) => {
            let lo = if a.is_empty() { 0 } else { parse_port(a)? };
            let hi = if b.is_empty() { u16::MAX } else { parse_port(b)? };
            Ok((lo, hi))
        }
        None => {
            let p = parse_port(s)?;
            Ok((p, p))
        }
    }
}

fn parse_u32(s: &str) -> Result<u32, RuleError> {
    let r = match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        Some(hex) => u32::from_str_radix(hex, 16),
        None => s.parse(),
    };
    r.map_err(|_| RuleError::Syntax(format!("bad mark value {s:?}")))
}

/// `value[/mask]`, mask defaulting to all ones.
fn parse_mark(s: &str) -> Result<(u32, u32), RuleError> {
    match s.split_once('/') {
        Some((v, m)) => Ok((parse_u32(v)?, parse_u32(m)?)),
        None => Ok((parse_u32(s)?, u32::MAX)),
    }
}

/// `--to-destination`: `IP`, `IP:PORT`, `[IPv6]:PORT`, `IPv6`.
fn parse_dnat(s: &str) -> Result<(IpAddr, Option<u16>), RuleError> {
    let bad = || RuleError::Syntax(format!("bad DNAT destination {s:?}"));
    if s.contains('-') {
        return Err(RuleError::Unsupported(format!("unsupported DNAT range {s:?}")));
    }
    if let Some(rest) = s.strip_prefix('[') {
        let (ip, after) = rest.split_once(']').ok_or_else(bad)?;
        let ip = parse_ip_sloppy(ip).ok_or_else(bad)?;
        let port = match after.strip_prefix(':') {
            Some(p) => Some(parse_port(p)?),
            None if after.is_empty() => None,
            None => return Err(bad()),
        };
        return Ok((ip, port));
    }
    if let Some(ip) = parse_ip_sloppy(s) {
        return Ok((ip, None));
    }
    let (ip, port) = s.rsplit_once(':').ok_or_else(bad)?;
    let ip = parse_ip_sloppy(ip).ok_or_else(bad)?;
    if ip.is_ipv6() {
        return Err(bad());
    }
    Ok((ip, Some(parse_port(port)?)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn net(s: &str) -> Cidr {
        Cidr::parse_sloppy(s).unwrap()
    }

    #[test]
    fn words_follow_iptables_save_quoting() {
        assert_eq!(
            split_words(r#"-m comment --comment "ns/a b:p \"x\" \\" -j X"#).unwrap(),
            vec!["-m", "comment", "--comment", r#"ns/a b:p "x" \"#, "-j", "X"]
        );
        assert!(matches!(split_words(r#"--comment "open"#), Err(RuleError::Syntax(_))));
    }

    /// The char-by-char splitter `words` replaced (kept as the reference it must agree with).
    fn reference_split_words(text: &str) -> Result<Vec<String>, RuleError> {
        let mut words = Vec::new();
        let mut chars = text.chars().peekable();
        loop {
            while chars.peek().is_some_and(|c| c.is_ascii_whitespace()) {
                chars.next();
            }
            let Some(&first) = chars.peek() else { break };
            let mut word = String::new();
            if first == '"' {
                chars.next();
                let mut closed = false;
                while let Some(c) = chars.next() {
                    match c {
                        '\\' => match chars.next() {
                            Some(e @ ('"' | '\\')) => word.push(e),
                            Some(other) => {
                                word.push('\\');
                                word.push(other);
                            }
                            None => word.push('\\'),
                        },
                        '"' => {
                            closed = true;
                            break;
                        }
                        c => word.push(c),
                    }
                }
                if !closed {
                    return Err(RuleError::Syntax("unterminated quoted string".into()));
                }
            } else {
                while let Some(&c) = chars.peek() {
                    if c.is_ascii_whitespace() {
                        break;
                    }
                    word.push(c);
                    chars.next();
                }
            }
            words.push(word);
        }
        Ok(words)
    }

    #[test]
    fn byte_splitter_agrees_with_the_reference_on_golden_rules_and_odd_quoting() {
        let golden = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden");
        let mut lines: Vec<String> = Vec::new();
        for entry in std::fs::read_dir(&golden).unwrap() {
            let rules = entry.unwrap().path().join("expected.rules");
            if let Ok(text) = std::fs::read_to_string(rules) {
                lines.extend(text.lines().filter(|l| l.starts_with("-A ")).map(str::to_string));
            }
        }
        assert!(lines.len() > 1000, "golden rules not found under {}", golden.display());
        let odd = [
            "",
            "   ",
            r#""""#,
            r#"a"b c"#,
            r#""a"b"#,
            r#""a\"#,
            r#""a\""#,
            r#""a\\" b"#,
            r#""tab\there" \x"#,
            "\"é \\ü\" ü",
            "\"\\é\"",
            "-m comment --comment \"x\ty\"\t-j\tX",
            r#"--comment "unterminated"#,
            r#"--comment "ends in backslash\"#,
        ];
        for line in lines.iter().map(String::as_str).chain(odd) {
            let got = words(line).map(|w| w.into_iter().map(Cow::into_owned).collect::<Vec<_>>());
            assert_eq!(got, reference_split_words(line), "{line:?}");
            assert_eq!(split_words(line), reference_split_words(line), "{line:?}");
        }
    }

    #[test]
    fn protocol_names_are_case_insensitive() {
        for (name, proto) in [
            ("tcp", Some(Proto::Tcp)),
            ("TCP", Some(Proto::Tcp)),
            ("6", Some(Proto::Tcp)),
            ("Udp", Some(Proto::Udp)),
            ("17", Some(Proto::Udp)),
            ("SCTP", Some(Proto::Sctp)),
            ("132", Some(Proto::Sctp)),
            ("ICMP", Some(Proto::Other(1))),
            ("IPv6-ICMP", Some(Proto::Other(58))),
            ("icmpv6", Some(Proto::Other(58))),
            ("47", Some(Proto::Other(47))),
            ("gre", None),
            ("256", None),
        ] {
            assert_eq!(Proto::parse(name), proto, "{name}");
        }
    }

    #[test]
    fn parses_what_render_writes() {
        let r = parse_rule(
            r#"-m comment --comment "ns1/svc1:p80 cluster IP" -m tcp -p tcp -d 172.30.0.41 --dport 80 -j KUBE-SVC-X"#,
        )
        .unwrap();
        assert_eq!(r.comment.as_deref(), Some("ns1/svc1:p80 cluster IP"));
        assert_eq!(
            r.matches,
            vec![
                Match::Protocol { neg: false, proto: ProtoMatch(Some(Proto::Tcp)) },
                Match::Destination { neg: false, net: net("172.30.0.41/32") },
                Match::DestPort { neg: false, ranges: vec![(80, 80)] },
            ]
        );
        assert_eq!(r.target, Target::Jump("KUBE-SVC-X".into()));
    }

    #[test]
    fn parses_what_iptables_save_prints() {
        let r = parse_rule("-m mark ! --mark 0x4000/0x4000 -j RETURN").unwrap();
        assert_eq!(r.matches, vec![Match::Mark { neg: true, value: 0x4000, mask: 0x4000 }]);
        let r = parse_rule("-j MARK --set-xmark 0x4000/0x0").unwrap();
        assert_eq!(r.target, Target::Mark { value: 0x4000, mask: 0 });
        let r = parse_rule("-j MARK --or-mark 0x00004000").unwrap();
        assert_eq!(r.target, Target::Mark { value: 0x4000, mask: 0x4000 });
        let r = parse_rule("-m statistic --mode random --probability 0.33333333349 -j KUBE-SEP-A").unwrap();
        assert_eq!(r.matches, vec![Match::Probability(0.33333333349)]);
        let r = parse_rule(
            "-m recent --rcheck --seconds 10800 --reap --name KUBE-SEP-A --mask 255.255.255.255 --rsource -j KUBE-SEP-A",
        )
        .unwrap();
        assert_eq!(r.matches, vec![Match::RecentCheck { neg: false, name: "KUBE-SEP-A".into(), seconds: Some(10800) }]);
        let r = parse_rule("-p tcp -m tcp -j DNAT --to-destination 10.180.0.4:80").unwrap();
        assert_eq!(r.target, Target::Dnat { addr: "10.180.0.4".parse().unwrap(), port: Some(80) });
        let r = parse_rule("-p tcp -j DNAT --to-destination [fd00::4]:80").unwrap();
        assert_eq!(r.target, Target::Dnat { addr: "fd00::4".parse().unwrap(), port: Some(80) });
        let r = parse_rule("-s 10.0.0.0/255.0.0.0 ! -i cbr0 -j MASQUERADE --random-fully").unwrap();
        assert_eq!(r.matches[0], Match::Source { neg: false, net: net("10.0.0.0/8") });
        assert_eq!(r.matches[1], Match::InInterface { neg: true, name: "cbr0".into() });
        assert_eq!(r.target, Target::Masquerade);
        let r = parse_rule("-m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j DROP").unwrap();
        assert_eq!(
            r.matches,
            vec![Match::CtState { neg: true, states: vec!["RELATED".into(), "ESTABLISHED".into(), "DNAT".into()] }]
        );
        let r = parse_rule("-p tcp -m multiport --dports 80,8000:8080 -g KUBE-X").unwrap();
        assert_eq!(r.matches[1], Match::DestPort { neg: false, ranges: vec![(80, 80), (8000, 8080)] });
        assert_eq!(r.target, Target::Goto("KUBE-X".into()));
        // 1.31+ accounting; iptables-save puts two spaces before the name and moves -d first.
        let saved = parse_rule(
            "-d 127.0.0.0/8 -p tcp -m comment --comment \"a/b:http\" -m tcp --dport 30080 -m nfacct --nfacct-name  localhost_nps_accepted_pkts -j KUBE-EXT-A",
        )
        .unwrap();
        let rendered = parse_rule(
            "-m comment --comment a/b:http -m tcp -p tcp -d 127.0.0.0/8 --dport 30080 -m nfacct --nfacct-name localhost_nps_accepted_pkts -j KUBE-EXT-A",
        )
        .unwrap();
        assert!(saved.matches.contains(&Match::Nfacct { name: "localhost_nps_accepted_pkts".into() }));
        assert_eq!(saved.key(), rendered.key());
    }

    #[test]
    fn malformed_rules_are_syntax_errors() {
        for bad in [
            "-d 300.1.1.1 -j X",
            "-p tcp --dport 70000 -j X",
            "--dport 80 -j X",
            "-s",
            "-m statistic --mode random --probability 1.5 -j X",
            "-j DNAT --to-destination nowhere",
            "! ! -s 1.2.3.4",
            "-j MARK --or-mark 0xzz",
        ] {
            assert!(matches!(parse_rule(bad), Err(RuleError::Syntax(_))), "{bad}: {:?}", parse_rule(bad));
        }
    }

    #[test]
    fn unknown_modules_and_targets_are_unsupported_not_guessed() {
        for (rule, what) in [
            ("-m set --match-set foo src -j ACCEPT", "-m set"),
            ("-p tcp -m tcp --tcp-flags SYN SYN -j ACCEPT", "--tcp-flags"),
            ("-j CT --notrack", "CT"),
            ("-m addrtype --dst-type BROADCAST -j DROP", "BROADCAST"),
            ("-m statistic --mode nth --every 2 -j X", "nth"),
            ("-j DNAT --to-destination 10.0.0.1-10.0.0.2", "range"),
        ] {
            match parse_rule(rule) {
                Err(RuleError::Unsupported(reason)) => assert!(reason.contains(what), "{rule}: {reason}"),
                other => panic!("{rule}: {other:?}"),
            }
        }
    }
}
