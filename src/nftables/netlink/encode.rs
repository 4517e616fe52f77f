//! Transactions as nf_tables messages, for the operations and rule forms kube-proxy's
//! per-service chains use; anything else is [`Unsupported`] and the whole transaction goes
//! to `nft` instead. Pure: no I/O.
//!
//! Each supported form is encoded as nft 1.0.6 compiles it (its `--debug=mnl` output was
//! the reference): the same expressions, registers, byte orders, anonymous-set flags and
//! user data, so the kernel holds what `nft -f` would have given it and `nft list` prints
//! the same text. tests/nft_netlink.rs checks every form against nft on the real kernel
//! (the bytecode as `nft --debug=netlink list` shows it, and the listing).
//!
//! Rule forms (F is `ip` or `ip6`, the table's family; V a verdict: `jump C`, `goto C`,
//! `drop`, `accept`, `return`):
//!
//! ```text
//! F saddr|daddr [!=] ADDR|CIDR …      F saddr @SET …      tcp|udp|sctp dport N …
//! meta l4proto tcp|udp|sctp …          fib saddr type local …
//! mark set mark or 0xM                 update @SET { F saddr }
//! meta l4proto P dnat to ADDR:PORT     numgen random mod N vmap { 0 : goto C , … }
//! meta l4proto P dnat F addr . port to numgen random mod N map { 0 : ADDR . PORT , … }
//! V
//! ```
//!
//! `F saddr|daddr [!=] { ADDR|CIDR }` (one element) is the plain match, as nft compiles it;
//! with several, an anonymous interval set (`{ A , B , … }`, a LoadBalancer's source ranges,
//! the service CIDRs).
//!
//! Not encoded (left to nft): address sets whose ranges touch or overlap (nft merges them)
//! or reach either end of the address space, interface names, base chains, comments on chains and sets, table operations, flushing
//! sets, counters, and any comment that is not plain printable ASCII.

use std::net::IpAddr;

use super::message::{AF_INET, AF_INET6, Attrs, Message, MsgType, NLM_F_APPEND, NLM_F_CREATE, NLM_F_EXCL, attr};
use crate::nftables::{Family, Operation, Rule, Set, SetKind, TABLE};

/// Why an operation is not encoded here (the transaction goes to nft).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("not encoded for netlink: {0}")]
pub struct Unsupported(pub String);

fn unsupported<T>(what: impl Into<String>) -> Result<T, Unsupported> {
    Err(Unsupported(what.into()))
}

/// A transaction's messages, each with the index of the operation it came from.
#[derive(Debug, Default)]
pub struct Encoded {
    pub messages: Vec<Message>,
    pub origins: Vec<usize>,
}

/// Names for the anonymous maps of our batches, unique to this process: `__k`, a random
/// part, and a counter (not `__map` or `__set` then digits, so the kernel's numbering of
/// nft's own `__map%d` sets never counts them, and they never meet nft's names; nft tells
/// anonymous sets by their flag, never by their name).
///
/// Why not `__map%d`, as nft sends: for such a name the kernel finds a free number by
/// parsing the name of every set in the table (`nf_tables_set_alloc_name`: a `sscanf` per
/// set), the costliest of the walks over the table's sets that every new set pays, and
/// the first write of a large table creates one anonymous map per service port. `nft
/// list` prints anonymous sets inline whatever their names, so the table reads the same.
#[derive(Debug)]
pub struct AnonymousNames {
    prefix: String,
    next: std::sync::atomic::AtomicU64,
}

impl AnonymousNames {
    /// `__k` and 8 random characters (47 bits, from std's `RandomState` keys): short,
    /// because every lookup by name in the kernel measures the name of every set in the
    /// table (`nla_strcmp`'s `strlen`), and a second process's prefix (a restart adopting
    /// the table) differs from the first's but once in ~10^14. Should two names still meet,
    /// the set is created with `NLM_F_EXCL`: the transaction is refused, never merged.
    pub fn random() -> AnonymousNames {
        use std::hash::{BuildHasher, Hasher};
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u32(std::process::id());
        let mut bits = h.finish();
        let mut prefix = String::from("__k");
        for _ in 0..8 {
            prefix.push(char::from(NAME_DIGITS[(bits % 62) as usize]));
            bits /= 62;
        }
        AnonymousNames::with_prefix(&prefix)
    }

    /// Names `PREFIXN` (N in base 62; the random prefix has a fixed width; tests pick it).
    pub fn with_prefix(prefix: &str) -> AnonymousNames {
        AnonymousNames { prefix: prefix.into(), next: std::sync::atomic::AtomicU64::new(0) }
    }

    fn next(&self) -> String {
        let mut n = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut digits = Vec::new();
        loop {
            digits.push(NAME_DIGITS[(n % 62) as usize]);
            n /= 62;
            if n == 0 {
                break;
            }
        }
        digits.reverse();
        format!("{}{}", self.prefix, String::from_utf8_lossy(&digits))
    }
}

const NAME_DIGITS: &[u8; 62] = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";

/// Encodes `ops` for the `family` table, or says why it cannot; anonymous maps are named
/// `__map%d` (the kernel numbers them), as nft names them.
pub fn transaction(family: Family, ops: &[Operation]) -> Result<Encoded, Unsupported> {
    transaction_named(family, ops, None)
}

/// [`transaction`], with the anonymous maps named from `names` when given.
pub fn transaction_named(
    family: Family,
    ops: &[Operation],
    names: Option<&AnonymousNames>,
) -> Result<Encoded, Unsupported> {
    let mut enc = Encoder { family, out: Encoded::default(), next_set_id: 1, op: 0, names };
    for (i, op) in ops.iter().enumerate() {
        enc.op = i;
        enc.operation(op)?;
    }
    Ok(enc.out)
}

/// nfgenmsg's family for `family`.
pub fn af(family: Family) -> u8 {
    match family {
        Family::Ip => AF_INET,
        Family::Ip6 => AF_INET6,
    }
}

// Registers (NFT_REG_VERDICT, NFT_REG_1, NFT_REG_2).
const REG_VERDICT: u32 = 0;
const REG_1: u32 = 1;
const REG_2: u32 = 2;
/// The second 32-bit register of register 1 (NFT_REG32_01).
const REG32_01: u32 = 9;

// Verdict codes.
const NF_DROP: i32 = 0;
const NF_ACCEPT: i32 = 1;
const NFT_JUMP: i32 = -3;
const NFT_GOTO: i32 = -4;
const NFT_RETURN: i32 = -5;

// Payload bases, cmp operators, meta keys and other expression constants.
const PAYLOAD_NETWORK: u32 = 1;
const PAYLOAD_TRANSPORT: u32 = 2;
const CMP_EQ: u32 = 0;
const CMP_NEQ: u32 = 1;
const META_MARK: u32 = 3;
const META_L4PROTO: u32 = 16;
const FIB_F_SADDR: u32 = 1;
const FIB_RESULT_ADDRTYPE: u32 = 3;
const RTN_LOCAL: u32 = 2;
const NG_RANDOM: u32 = 1;
const DYNSET_OP_UPDATE: u32 = 1;
const NAT_DNAT: u32 = 1;
const NAT_RANGE_PROTO_SPECIFIED: u32 = 2;

// Set flags and types.
const SET_ANONYMOUS: u32 = 0x1;
const SET_CONSTANT: u32 = 0x2;
const SET_INTERVAL: u32 = 0x4;
/// NFT_SET_ELEM_INTERVAL_END.
const SET_ELEM_INTERVAL_END: u32 = 0x1;
const SET_MAP: u32 = 0x8;
const SET_TIMEOUT: u32 = 0x10;
const SET_EVAL: u32 = 0x20;
const TYPE_INTEGER: u32 = 4;
const TYPE_IPADDR: u32 = 7;
const TYPE_IP6ADDR: u32 = 8;
const TYPE_INET_SERVICE: u32 = 13;
const DATA_VERDICT: u32 = 0xffff_ff00;

/// The user data nft 1.0.6 gives the anonymous map of `numgen random mod N vmap { … }`:
/// key byte order host, data byte order unset, the key's `typeof` (numgen), no interval
/// data (libnftnl's NFTNL_UDATA_SET_* records).
const NUMGEN_VMAP_USERDATA: [u8; 28] =
    [0, 4, 1, 0, 0, 0, 1, 4, 0, 0, 0, 0, 4, 8, 0, 4, 1, 0, 0, 0, 1, 0, 6, 4, 0, 0, 0, 0];

/// The user data nft 1.0.6 gives the anonymous map of `dnat … to numgen … map { … }`: key
/// byte order host, data byte order unset, no interval data.
const NUMGEN_DNAT_MAP_USERDATA: [u8; 18] = [0, 4, 1, 0, 0, 0, 1, 4, 0, 0, 0, 0, 6, 4, 0, 0, 0, 0];

/// nft's protocol descriptions (`proto_ip`, `proto_ip6`) as its `typeof` user data numbers them.
const PROTO_DESC_IP: u8 = 12;
const PROTO_DESC_IP6: u8 = 13;

/// The user data nft 1.0.6 gives the anonymous interval set of `F saddr|daddr { … }`: key
/// byte order big endian, elements merged, the key's `typeof` (a payload expression: the
/// protocol and its field, ip 11 saddr / 12 daddr, ip6 8 / 9).
fn address_typeof_userdata(proto: u8, saddr: bool) -> Vec<u8> {
    let field = match (proto, saddr) {
        (PROTO_DESC_IP, true) => 11,
        (PROTO_DESC_IP, false) => 12,
        (_, true) => 8,
        (_, false) => 9,
    };
    vec![
        0, 4, 2, 0, 0, 0, // key byte order: big endian
        2, 4, 1, 0, 0, 0, // merge elements
        3, 20, // typeof the key:
        0, 4, 7, 0, 0, 0, // a payload expression
        1, 12, 0, 4, proto, 0, 0, 0, 1, 4, field, 0, 0, 0, // of this protocol and field
    ]
}

/// The user data of an address set declared by type (key byte order: big endian).
const ADDRESS_SET_USERDATA: [u8; 6] = [0, 4, 2, 0, 0, 0];

struct Encoder<'n> {
    family: Family,
    out: Encoded,
    next_set_id: u32,
    op: usize,
    names: Option<&'n AnonymousNames>,
}

impl Encoder<'_> {
    fn push(&mut self, kind: MsgType, flags: u16, attrs: Attrs) {
        self.out.messages.push(Message { kind, flags, attrs: attrs.into_bytes() });
        self.out.origins.push(self.op);
    }

    fn table_attrs(&self, kind: u16) -> Attrs {
        let mut a = Attrs::new();
        a.put_str(kind, TABLE);
        a
    }

    fn operation(&mut self, op: &Operation) -> Result<(), Unsupported> {
        match op {
            Operation::AddChain(chain) => {
                if chain.base.is_some() || chain.comment.is_some() {
                    return unsupported(format!("chain {} with a hook or comment", chain.name));
                }
                let mut a = self.table_attrs(attr::CHAIN_TABLE);
                a.put_str(attr::CHAIN_NAME, checked_name(&chain.name)?);
                self.push(MsgType::NewChain, NLM_F_CREATE, a);
            }
            Operation::FlushChain(name) => {
                let mut a = self.table_attrs(attr::RULE_TABLE);
                a.put_str(attr::RULE_CHAIN, checked_name(name)?);
                self.push(MsgType::DelRule, 0, a);
            }
            Operation::DeleteChain(name) => {
                let mut a = self.table_attrs(attr::CHAIN_TABLE);
                a.put_str(attr::CHAIN_NAME, checked_name(name)?);
                self.push(MsgType::DelChain, 0, a);
            }
            Operation::AddRule(rule) => self.rule(rule)?,
            Operation::AddSet(set) => self.address_set(set)?,
            Operation::DeleteSet { name, .. } => {
                let mut a = self.table_attrs(attr::SET_TABLE);
                a.put_str(attr::SET_NAME, checked_name(name)?);
                self.push(MsgType::DelSet, 0, a);
            }
            Operation::AddElement(e) => {
                let key = self.key(&e.key)?;
                let value = match (e.kind, e.value.as_slice()) {
                    (SetKind::Set, []) => None,
                    (SetKind::Map, [v]) => Some(verdict(v)?),
                    _ => return unsupported(format!("element value {:?} of {}", e.value, e.set)),
                };
                let comment = e.comment.as_deref().map(userdata_comment).transpose()?;
                let mut a = self.table_attrs(attr::SET_ELEM_LIST_TABLE);
                a.put_str(attr::SET_ELEM_LIST_SET, checked_name(&e.set)?);
                a.begin(attr::SET_ELEM_LIST_ELEMENTS).begin(1);
                a.begin(attr::SET_ELEM_KEY).put(attr::DATA_VALUE, &key).end();
                if let Some(v) = value {
                    a.begin(attr::SET_ELEM_DATA);
                    put_verdict(&mut a, &v);
                    a.end();
                }
                if let Some(c) = comment {
                    a.put(attr::SET_ELEM_USERDATA, &c);
                }
                a.end().end();
                self.push(MsgType::NewSetElem, NLM_F_CREATE, a);
            }
            Operation::DeleteElement { set, key, .. } => {
                let key = self.key(key)?;
                let mut a = self.table_attrs(attr::SET_ELEM_LIST_TABLE);
                a.put_str(attr::SET_ELEM_LIST_SET, checked_name(set)?);
                a.begin(attr::SET_ELEM_LIST_ELEMENTS).begin(1);
                a.begin(attr::SET_ELEM_KEY).put(attr::DATA_VALUE, &key).end();
                a.end().end();
                self.push(MsgType::DelSetElem, 0, a);
            }
            Operation::AddTable
            | Operation::DeleteTable
            | Operation::FlushSet { .. }
            | Operation::AddCounter(_)
            | Operation::DeleteCounter(_) => return unsupported(format!("{op:?}")),
        }
        Ok(())
    }

    /// `add set … { type ipv4_addr|ipv6_addr ; flags dynamic,timeout ; timeout Ns ; }`
    /// (the affinity sets).
    fn address_set(&mut self, set: &Set) -> Result<(), Unsupported> {
        let dynamic_timeout = set.flags.len() == 2
            && set.flags.iter().any(|f| f == "dynamic")
            && set.flags.iter().any(|f| f == "timeout");
        let (Some(timeout), true, SetKind::Set, None) = (set.timeout_secs, dynamic_timeout, set.kind, &set.comment)
        else {
            return unsupported(format!("set {} of this shape", set.name));
        };
        if set.set_type != self.family.addr_type() {
            return unsupported(format!("set {} of type {}", set.name, set.set_type));
        }
        let (key_type, key_len) = match self.family {
            Family::Ip => (TYPE_IPADDR, 4),
            Family::Ip6 => (TYPE_IP6ADDR, 16),
        };
        let id = self.set_id();
        let mut a = self.table_attrs(attr::SET_TABLE);
        a.put_str(attr::SET_NAME, checked_name(&set.name)?)
            .put_be32(attr::SET_FLAGS, SET_TIMEOUT | SET_EVAL)
            .put_be32(attr::SET_KEY_TYPE, key_type)
            .put_be32(attr::SET_KEY_LEN, key_len)
            .put_be32(attr::SET_ID, id)
            .put_be64(attr::SET_TIMEOUT, timeout.checked_mul(1000).ok_or_else(|| Unsupported("timeout".into()))?)
            .put(attr::SET_USERDATA, &ADDRESS_SET_USERDATA);
        self.push(MsgType::NewSet, NLM_F_CREATE, a);
        Ok(())
    }

    fn set_id(&mut self) -> u32 {
        let id = self.next_set_id;
        self.next_set_id += 1;
        id
    }

    /// An element key: one part (an address), or a concatenation of addresses, protocols
    /// and ports, each padded to 4 bytes.
    fn key(&self, parts: &[String]) -> Result<Vec<u8>, Unsupported> {
        match parts {
            [single] => match parse_addr(single, self.family) {
                Some(ip) => Ok(ip_bytes(ip)),
                None => unsupported(format!("key {single}")),
            },
            _ => {
                let mut out = Vec::with_capacity(parts.len() * 4);
                for part in parts {
                    if let Some(ip) = parse_addr(part, self.family) {
                        out.extend_from_slice(&ip_bytes(ip));
                    } else if let Some(p) = protocol_number(part) {
                        out.extend_from_slice(&[p, 0, 0, 0]);
                    } else if let Ok(port) = part.parse::<u16>() {
                        let [hi, lo] = port.to_be_bytes();
                        out.extend_from_slice(&[hi, lo, 0, 0]);
                    } else {
                        return unsupported(format!("key part {part}"));
                    }
                }
                Ok(out)
            }
        }
    }

    fn rule(&mut self, rule: &Rule) -> Result<(), Unsupported> {
        let comment = rule.comment.as_deref().map(userdata_comment).transpose()?;
        let mut exprs = Exprs::default();
        let tokens: Vec<&str> = rule.text.split_ascii_whitespace().collect();
        let mut t = Tokens { tokens: &tokens, at: 0, text: &rule.text };
        let ip = self.family.addr_selector();
        let mut ended = false;
        while let Some(tok) = t.next() {
            if ended {
                return unsupported(format!("rule continues after its verdict: {}", rule.text));
            }
            match tok {
                _ if tok == ip => {
                    let offset = match t.expect_any(&["saddr", "daddr"])? {
                        "saddr" => self.saddr_offset(),
                        _ => self.saddr_offset() + self.addr_len(),
                    };
                    let mut value = t.expect()?;
                    let op = if value == "!=" {
                        value = t.expect()?;
                        CMP_NEQ
                    } else {
                        CMP_EQ
                    };
                    if let Some(set) = value.strip_prefix('@') {
                        if op != CMP_EQ {
                            return unsupported("a negated set lookup");
                        }
                        exprs.payload(PAYLOAD_NETWORK, offset, self.addr_len());
                        exprs.lookup_named(checked_name(set)?);
                    } else if value == "{" {
                        // `{ A }` (a LoadBalancer's one source range, a family's one
                        // service CIDR): nft compiles a set of one element as the plain
                        // match, and so do we. More than one is an interval set: nft's.
                        let mut items = Vec::new();
                        loop {
                            let tok = t.expect()?;
                            if tok == "}" {
                                break;
                            }
                            items.extend(tok.split(',').filter(|s| !s.is_empty()));
                        }
                        match items.as_slice() {
                            [single] => self.address_match(&mut exprs, offset, op, single)?,
                            _ => self.address_set_match(&mut exprs, offset, op, &items)?,
                        }
                    } else {
                        self.address_match(&mut exprs, offset, op, value)?;
                    }
                }
                "tcp" | "udp" | "sctp" => {
                    let proto = protocol_number(tok).expect("a protocol");
                    t.expect_word("dport")?;
                    let port: u16 = t.number()?;
                    exprs.meta_load(META_L4PROTO);
                    exprs.cmp(CMP_EQ, &[proto]);
                    exprs.payload(PAYLOAD_TRANSPORT, 2, 2);
                    exprs.cmp(CMP_EQ, &port.to_be_bytes());
                }
                "meta" => {
                    t.expect_word("l4proto")?;
                    let proto = t.expect()?;
                    let Some(p) = protocol_number(proto) else { return unsupported(format!("l4proto {proto}")) };
                    exprs.meta_load(META_L4PROTO);
                    exprs.cmp(CMP_EQ, &[p]);
                }
                "fib" => {
                    t.expect_word("saddr")?;
                    t.expect_word("type")?;
                    t.expect_word("local")?;
                    exprs.fib_saddr_type();
                    exprs.cmp(CMP_EQ, &RTN_LOCAL.to_ne_bytes());
                }
                "mark" => {
                    t.expect_word("set")?;
                    t.expect_word("mark")?;
                    t.expect_word("or")?;
                    let mark = t.hex()?;
                    exprs.meta_load(META_MARK);
                    exprs.mark_or(mark);
                    exprs.meta_set(META_MARK);
                }
                "update" => {
                    let set = t.expect()?.strip_prefix('@').ok_or_else(|| Unsupported(rule.text.clone()))?;
                    t.expect_word("{")?;
                    t.expect_word(ip)?;
                    t.expect_word("saddr")?;
                    t.expect_word("}")?;
                    exprs.payload(PAYLOAD_NETWORK, self.saddr_offset(), self.addr_len());
                    exprs.dynset_update(checked_name(set)?);
                }
                "dnat" => {
                    if t.expect()? == "to" {
                        let (addr, port) = dnat_target(t.expect()?, self.family)?;
                        exprs.immediate_data(REG_1, &ip_bytes(addr));
                        exprs.immediate_data(REG_2, &port.to_be_bytes());
                        exprs.nat_dnat(af(self.family), REG_2, true);
                        ended = true;
                        continue;
                    }
                    // `dnat F addr . port to numgen random mod N map { 0 : ADDR . PORT , … }`
                    // (the word after `dnat` was the family, checked by the prefix below).
                    t.at -= 1;
                    t.expect_word(ip)?;
                    for word in ["addr", ".", "port", "to", "numgen", "random"] {
                        t.expect_word(word)?;
                    }
                    let entries = t.numgen_entries("map", |t| {
                        let addr = parse_addr(t.expect()?, self.family)
                            .ok_or_else(|| Unsupported(format!("dnat map address in: {}", t.text)))?;
                        t.expect_word(".")?;
                        let port: u16 = t.number()?;
                        let mut data = ip_bytes(addr);
                        data.extend_from_slice(&port.to_be_bytes());
                        data.extend_from_slice(&[0, 0]);
                        Ok(data)
                    })?;
                    let modulus = entries.len() as u32;
                    let (id, name) = self.numgen_dnat_map(&entries);
                    exprs.numgen_random(modulus);
                    exprs.lookup_anonymous_map(id, &name, REG_1);
                    // The port follows the address in the registers: the next 32-bit register
                    // after an IPv4 address (NFT_REG32_01), the next 128-bit one after IPv6.
                    let port_reg = match self.family {
                        Family::Ip => REG32_01,
                        Family::Ip6 => REG_2,
                    };
                    exprs.nat_dnat(af(self.family), port_reg, false);
                    ended = true;
                }
                "numgen" => {
                    t.expect_word("random")?;
                    let entries = t.numgen_entries("vmap", |t| {
                        let v = t.expect_any(&["goto", "jump"])?;
                        let chain = checked_name(t.expect()?)?;
                        verdict(&format!("{v} {chain}"))
                    })?;
                    let modulus = entries.len() as u32;
                    let (id, name) = self.numgen_vmap(&entries);
                    exprs.numgen_random(modulus);
                    exprs.lookup_anonymous_vmap(id, &name);
                    ended = true;
                }
                "jump" | "goto" => {
                    let chain = checked_name(t.expect()?)?;
                    exprs.verdict(&verdict(&format!("{tok} {chain}"))?);
                    ended = true;
                }
                "drop" | "accept" | "return" => {
                    exprs.verdict(&verdict(tok)?);
                    ended = true;
                }
                _ => return unsupported(format!("rule {}", rule.text)),
            }
        }
        if exprs.count == 0 {
            return unsupported("an empty rule");
        }
        let mut a = self.table_attrs(attr::RULE_TABLE);
        a.put_str(attr::RULE_CHAIN, checked_name(&rule.chain)?);
        a.begin(attr::RULE_EXPRESSIONS);
        exprs.write_into(&mut a);
        a.end();
        if let Some(c) = comment {
            a.put(attr::RULE_USERDATA, &c);
        }
        self.push(MsgType::NewRule, NLM_F_CREATE | NLM_F_APPEND, a);
        Ok(())
    }

    fn saddr_offset(&self) -> u32 {
        match self.family {
            Family::Ip => 12,
            Family::Ip6 => 8,
        }
    }

    fn addr_len(&self) -> u32 {
        match self.family {
            Family::Ip => 4,
            Family::Ip6 => 16,
        }
    }

    /// An address or a prefix compared as nft compiles it: whole bytes of a byte-aligned
    /// prefix, else the address masked.
    fn address_match(&self, exprs: &mut Exprs, offset: u32, op: u32, value: &str) -> Result<(), Unsupported> {
        let (addr, prefix) = match value.split_once('/') {
            Some((a, p)) => (a, p.parse::<u32>().map_err(|_| Unsupported(format!("prefix {value}")))?),
            None => (value, self.addr_len() * 8),
        };
        let Some(ip) = parse_addr(addr, self.family) else { return unsupported(format!("address {value}")) };
        let bytes = ip_bytes(ip);
        let bits = self.addr_len() * 8;
        if prefix == 0 || prefix > bits {
            return unsupported(format!("prefix {value}"));
        }
        let mask = prefix_mask(prefix, bytes.len());
        if bytes.iter().zip(&mask).any(|(b, m)| b & !m != 0) {
            return unsupported(format!("{value} has bits outside its prefix"));
        }
        if prefix.is_multiple_of(8) {
            let n = prefix / 8;
            exprs.payload(PAYLOAD_NETWORK, offset, n);
            exprs.cmp(op, &bytes[..n as usize]);
        } else {
            exprs.payload(PAYLOAD_NETWORK, offset, self.addr_len());
            exprs.bitwise_mask(&mask);
            exprs.cmp(op, &bytes);
        }
        Ok(())
    }

    /// `F saddr|daddr [!=] { A , B , … }`: the addresses and prefixes as an anonymous
    /// interval set, as nft compiles them: elements ascending, each range its first address
    /// and (flagged as an interval's end) the address after its last, led by an end at
    /// address zero. nft merges ranges that touch or overlap and treats ranges at either end
    /// of the address space specially: those sets are left to it.
    fn address_set_match(
        &mut self,
        exprs: &mut Exprs,
        offset: u32,
        op: u32,
        items: &[&str],
    ) -> Result<(), Unsupported> {
        let bits = self.addr_len() * 8;
        let top: u128 = if bits == 128 { u128::MAX } else { (1u128 << bits) - 1 };
        let mut ranges = Vec::with_capacity(items.len());
        for item in items {
            let (addr, prefix) = match item.split_once('/') {
                Some((a, p)) => (a, p.parse::<u32>().map_err(|_| Unsupported(format!("prefix {item}")))?),
                None => (*item, bits),
            };
            let Some(ip) = parse_addr(addr, self.family) else { return unsupported(format!("address {item}")) };
            if prefix == 0 || prefix > bits {
                return unsupported(format!("prefix {item}"));
            }
            let first = ip_bytes(ip).iter().fold(0u128, |acc, b| (acc << 8) | u128::from(*b));
            let host = if prefix == bits { 0 } else { top >> prefix };
            if first & host != 0 {
                return unsupported(format!("{item} has bits outside its prefix"));
            }
            ranges.push((first, first | host));
        }
        ranges.sort_unstable();
        let touching = ranges.windows(2).any(|w| w[0].1.saturating_add(1) >= w[1].0);
        let (Some(lowest), Some(highest)) = (ranges.first(), ranges.last()) else {
            return unsupported("an empty set");
        };
        if touching || lowest.0 == 0 || highest.1 == top {
            return unsupported(format!("an address set nft merges or bounds: {}", items.join(", ")));
        }
        let len = self.addr_len() as usize;
        let key = |v: u128| v.to_be_bytes()[16 - len..].to_vec();
        let mut elements = vec![(key(0), true)];
        for (first, last) in &ranges {
            elements.push((key(*first), false));
            elements.push((key(last + 1), true));
        }

        let id = self.set_id();
        let (name, flags) = self.anonymous_name("__set%d");
        let (key_type, userdata) = match self.family {
            Family::Ip => (TYPE_IPADDR, address_typeof_userdata(PROTO_DESC_IP, offset == 12)),
            Family::Ip6 => (TYPE_IP6ADDR, address_typeof_userdata(PROTO_DESC_IP6, offset == 8)),
        };
        let mut a = self.table_attrs(attr::SET_TABLE);
        a.put_str(attr::SET_NAME, &name)
            .put_be32(attr::SET_FLAGS, SET_ANONYMOUS | SET_CONSTANT | SET_INTERVAL)
            .put_be32(attr::SET_KEY_TYPE, key_type)
            .put_be32(attr::SET_KEY_LEN, self.addr_len())
            .put_be32(attr::SET_ID, id);
        a.begin(attr::SET_DESC).put_be32(attr::SET_DESC_SIZE, elements.len() as u32).end();
        a.put(attr::SET_USERDATA, &userdata);
        self.push(MsgType::NewSet, flags, a);

        let mut a = self.table_attrs(attr::SET_ELEM_LIST_TABLE);
        a.put_str(attr::SET_ELEM_LIST_SET, &name).put_be32(attr::SET_ELEM_LIST_SET_ID, id);
        a.begin(attr::SET_ELEM_LIST_ELEMENTS);
        for (i, (key, end)) in elements.iter().enumerate() {
            a.begin(i as u16 + 1);
            if *end {
                a.put_be32(attr::SET_ELEM_FLAGS, SET_ELEM_INTERVAL_END);
            }
            a.begin(attr::SET_ELEM_KEY).put(attr::DATA_VALUE, key).end();
            a.end();
        }
        a.end();
        self.push(MsgType::NewSetElem, NLM_F_CREATE, a);

        exprs.payload(PAYLOAD_NETWORK, offset, self.addr_len());
        exprs.lookup_anonymous_set(id, &name, op == CMP_NEQ);
        Ok(())
    }

    /// The name of a new anonymous set (nft's form, `__set%d` or `__map%d`, unless this
    /// encoder names them itself) and the flags its creation takes.
    fn anonymous_name(&self, nft_form: &str) -> (String, u16) {
        match self.names {
            // A name of ours must be new: never add to a set that happens to have it.
            Some(names) => (names.next(), NLM_F_CREATE | NLM_F_EXCL),
            None => (nft_form.to_string(), NLM_F_CREATE),
        }
    }

    /// The anonymous map of `dnat … to numgen … map { i : ADDR . PORT }`: declared, then
    /// filled; its id. Data: the address and the port (network order), padded to 4 bytes.
    fn numgen_dnat_map(&mut self, entries: &[(u32, Vec<u8>)]) -> (u32, String) {
        let (data_type, data_len) = match self.family {
            Family::Ip => ((TYPE_IPADDR << 6) | TYPE_INET_SERVICE, 8),
            Family::Ip6 => ((TYPE_IP6ADDR << 6) | TYPE_INET_SERVICE, 20),
        };
        let entries: Vec<(u32, MapData)> = entries.iter().map(|(k, d)| (*k, MapData::Value(d.clone()))).collect();
        self.numgen_map(data_type, data_len, &NUMGEN_DNAT_MAP_USERDATA, &entries)
    }

    /// The anonymous verdict map of a `numgen … vmap` rule: declared, then filled; its id.
    fn numgen_vmap(&mut self, entries: &[(u32, Verdict)]) -> (u32, String) {
        let entries: Vec<(u32, MapData)> = entries.iter().map(|(k, v)| (*k, MapData::Verdict(v.clone()))).collect();
        self.numgen_map(DATA_VERDICT, 0, &NUMGEN_VMAP_USERDATA, &entries)
    }

    /// An anonymous constant map keyed by `numgen`'s integers (host order), as nft declares
    /// and fills it; its id, for the rule's lookup.
    fn numgen_map(
        &mut self,
        data_type: u32,
        data_len: u32,
        userdata: &[u8],
        entries: &[(u32, MapData)],
    ) -> (u32, String) {
        let id = self.set_id();
        let (name, flags) = self.anonymous_name("__map%d");
        let mut a = self.table_attrs(attr::SET_TABLE);
        a.put_str(attr::SET_NAME, &name)
            .put_be32(attr::SET_FLAGS, SET_ANONYMOUS | SET_CONSTANT | SET_MAP)
            .put_be32(attr::SET_KEY_TYPE, TYPE_INTEGER)
            .put_be32(attr::SET_KEY_LEN, 4)
            .put_be32(attr::SET_DATA_TYPE, data_type)
            .put_be32(attr::SET_DATA_LEN, data_len)
            .put_be32(attr::SET_ID, id);
        a.begin(attr::SET_DESC).put_be32(attr::SET_DESC_SIZE, entries.len() as u32).end();
        a.put(attr::SET_USERDATA, userdata);
        self.push(MsgType::NewSet, flags, a);

        let mut a = self.table_attrs(attr::SET_ELEM_LIST_TABLE);
        a.put_str(attr::SET_ELEM_LIST_SET, &name).put_be32(attr::SET_ELEM_LIST_SET_ID, id);
        a.begin(attr::SET_ELEM_LIST_ELEMENTS);
        for (i, (key, data)) in entries.iter().enumerate() {
            a.begin(i as u16 + 1);
            a.begin(attr::SET_ELEM_KEY).put(attr::DATA_VALUE, &key.to_ne_bytes()).end();
            a.begin(attr::SET_ELEM_DATA);
            match data {
                MapData::Verdict(v) => put_verdict(&mut a, v),
                MapData::Value(bytes) => {
                    a.put(attr::DATA_VALUE, bytes);
                }
            }
            a.end();
            a.end();
        }
        a.end();
        self.push(MsgType::NewSetElem, NLM_F_CREATE, a);
        (id, name)
    }
}

/// What an anonymous map's element maps to.
enum MapData {
    Verdict(Verdict),
    Value(Vec<u8>),
}

/// A verdict: its code and, for jump and goto, the chain.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Verdict {
    code: i32,
    chain: Option<String>,
}

fn verdict(text: &str) -> Result<Verdict, Unsupported> {
    let mut words = text.split_ascii_whitespace();
    let v = match (words.next(), words.next(), words.next()) {
        (Some("drop"), None, None) => Verdict { code: NF_DROP, chain: None },
        (Some("accept"), None, None) => Verdict { code: NF_ACCEPT, chain: None },
        (Some("return"), None, None) => Verdict { code: NFT_RETURN, chain: None },
        (Some("jump"), Some(c), None) => Verdict { code: NFT_JUMP, chain: Some(checked_name(c)?.to_string()) },
        (Some("goto"), Some(c), None) => Verdict { code: NFT_GOTO, chain: Some(checked_name(c)?.to_string()) },
        _ => return unsupported(format!("verdict {text}")),
    };
    Ok(v)
}

/// `NFTA_DATA_VERDICT { code [, chain] }` inside an open data attribute.
fn put_verdict(a: &mut Attrs, v: &Verdict) {
    a.begin(attr::DATA_VERDICT).put(attr::VERDICT_CODE, &v.code.to_be_bytes());
    if let Some(chain) = &v.chain {
        a.put_str(attr::VERDICT_CHAIN, chain);
    }
    a.end();
}

/// Object names kube-proxy writes are plain words; anything else is left to nft (which
/// knows its quoting and reserved words).
fn checked_name(name: &str) -> Result<&str, Unsupported> {
    let plain = !name.is_empty()
        && name.len() < 256
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_./".contains(&b))
        && name.as_bytes()[0].is_ascii_alphabetic();
    if plain { Ok(name) } else { unsupported(format!("name {name:?}")) }
}

/// A comment as nft stores it in user data: record type 0 (comment), its length with the
/// terminating NUL, the bytes and the NUL.
fn userdata_comment(comment: &str) -> Result<Vec<u8>, Unsupported> {
    let plain = comment.len() < 255 && comment.bytes().all(|b| (0x20..0x7f).contains(&b) && b != b'"' && b != b'\\');
    if !plain {
        return unsupported(format!("comment {comment:?}"));
    }
    let mut out = Vec::with_capacity(comment.len() + 3);
    out.push(0);
    out.push(comment.len() as u8 + 1);
    out.extend_from_slice(comment.as_bytes());
    out.push(0);
    Ok(out)
}

fn parse_addr(text: &str, family: Family) -> Option<IpAddr> {
    let ip: IpAddr = text.parse().ok()?;
    (ip.is_ipv4() == (family == Family::Ip)).then_some(ip)
}

fn ip_bytes(ip: IpAddr) -> Vec<u8> {
    match ip {
        IpAddr::V4(v4) => v4.octets().to_vec(),
        IpAddr::V6(v6) => v6.octets().to_vec(),
    }
}

fn prefix_mask(prefix: u32, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| {
            let bits = prefix.saturating_sub(i as u32 * 8).min(8);
            if bits == 0 { 0 } else { 0xffu8 << (8 - bits) }
        })
        .collect()
}

fn protocol_number(name: &str) -> Option<u8> {
    match name {
        "tcp" => Some(6),
        "udp" => Some(17),
        "sctp" => Some(132),
        _ => None,
    }
}

/// `10.0.0.1:80` or `[fd00::1]:80`.
fn dnat_target(text: &str, family: Family) -> Result<(IpAddr, u16), Unsupported> {
    let (host, port) = text.rsplit_once(':').ok_or_else(|| Unsupported(format!("dnat target {text}")))?;
    let host = match family {
        Family::Ip => host,
        Family::Ip6 => host
            .strip_prefix('[')
            .and_then(|h| h.strip_suffix(']'))
            .ok_or_else(|| Unsupported(format!("dnat target {text}")))?,
    };
    let ip = parse_addr(host, family).ok_or_else(|| Unsupported(format!("dnat target {text}")))?;
    let port = port.parse().map_err(|_| Unsupported(format!("dnat target {text}")))?;
    Ok((ip, port))
}

/// The words of a rule being read.
struct Tokens<'a> {
    tokens: &'a [&'a str],
    at: usize,
    text: &'a str,
}

impl<'a> Tokens<'a> {
    fn next(&mut self) -> Option<&'a str> {
        let t = self.tokens.get(self.at).copied();
        self.at += 1;
        t
    }

    fn expect(&mut self) -> Result<&'a str, Unsupported> {
        self.next().ok_or_else(|| Unsupported(format!("rule ends early: {}", self.text)))
    }

    fn expect_word(&mut self, word: &str) -> Result<(), Unsupported> {
        match self.expect()? {
            w if w == word => Ok(()),
            w => unsupported(format!("{w} where {word} was expected in: {}", self.text)),
        }
    }

    fn expect_any(&mut self, words: &[&'static str]) -> Result<&'static str, Unsupported> {
        let w = self.expect()?;
        words.iter().copied().find(|x| *x == w).ok_or_else(|| Unsupported(format!("{w} in: {}", self.text)))
    }

    fn number<T: std::str::FromStr>(&mut self) -> Result<T, Unsupported> {
        let w = self.expect()?;
        w.parse().map_err(|_| Unsupported(format!("{w} in: {}", self.text)))
    }

    /// `mod N KIND { K : VALUE , … }` after `numgen random`: the entries, whose number must
    /// be N (each value read by `value`).
    fn numgen_entries<T>(
        &mut self,
        kind: &str,
        mut value: impl FnMut(&mut Self) -> Result<T, Unsupported>,
    ) -> Result<Vec<(u32, T)>, Unsupported> {
        self.expect_word("mod")?;
        let modulus: usize = self.number()?;
        self.expect_word(kind)?;
        self.expect_word("{")?;
        let mut entries = Vec::new();
        loop {
            let key: u32 = self.number()?;
            self.expect_word(":")?;
            entries.push((key, value(self)?));
            if self.expect_any(&[",", "}"])? == "}" {
                break;
            }
        }
        if entries.len() != modulus {
            return unsupported(format!("numgen map of {} entries mod {modulus}", entries.len()));
        }
        Ok(entries)
    }

    fn hex(&mut self) -> Result<u32, Unsupported> {
        let w = self.expect()?;
        w.strip_prefix("0x")
            .and_then(|h| u32::from_str_radix(h, 16).ok())
            .ok_or_else(|| Unsupported(format!("{w} in: {}", self.text)))
    }
}

/// A rule's expressions being written (each `NFTA_LIST_ELEM { name, data }`).
#[derive(Default)]
struct Exprs {
    attrs: Attrs,
    count: usize,
}

impl Exprs {
    fn expr(&mut self, name: &str, data: impl FnOnce(&mut Attrs)) {
        self.count += 1;
        self.attrs.begin(attr::LIST_ELEM).put_str(attr::EXPR_NAME, name).begin(attr::EXPR_DATA);
        data(&mut self.attrs);
        self.attrs.end().end();
    }

    fn payload(&mut self, base: u32, offset: u32, len: u32) {
        self.expr("payload", |a| {
            a.put_be32(1, REG_1).put_be32(2, base).put_be32(3, offset).put_be32(4, len);
        });
    }

    fn cmp(&mut self, op: u32, value: &[u8]) {
        self.expr("cmp", |a| {
            a.put_be32(1, REG_1).put_be32(2, op);
            a.begin(3).put(attr::DATA_VALUE, value).end();
        });
    }

    fn meta_load(&mut self, key: u32) {
        self.expr("meta", |a| {
            a.put_be32(2, key).put_be32(1, REG_1);
        });
    }

    fn meta_set(&mut self, key: u32) {
        self.expr("meta", |a| {
            a.put_be32(2, key).put_be32(3, REG_1);
        });
    }

    /// `mark or M` as nft compiles it: `(reg & ~M) ^ M`, host byte order.
    fn mark_or(&mut self, mark: u32) {
        self.expr("bitwise", |a| {
            a.put_be32(1, REG_1).put_be32(2, REG_1).put_be32(6, 0).put_be32(3, 4);
            a.begin(4).put(attr::DATA_VALUE, &(!mark).to_ne_bytes()).end();
            a.begin(5).put(attr::DATA_VALUE, &mark.to_ne_bytes()).end();
        });
    }

    fn bitwise_mask(&mut self, mask: &[u8]) {
        self.expr("bitwise", |a| {
            a.put_be32(1, REG_1).put_be32(2, REG_1).put_be32(3, mask.len() as u32);
            a.begin(4).put(attr::DATA_VALUE, mask).end();
            a.begin(5).put(attr::DATA_VALUE, &vec![0; mask.len()]).end();
        });
    }

    fn fib_saddr_type(&mut self) {
        self.expr("fib", |a| {
            a.put_be32(3, FIB_F_SADDR).put_be32(2, FIB_RESULT_ADDRTYPE).put_be32(1, REG_1);
        });
    }

    fn lookup_named(&mut self, set: &str) {
        self.expr("lookup", |a| {
            a.put_be32(2, REG_1).put_str(1, set);
        });
    }

    /// `lookup` of an anonymous set (no data), inverted for `!=` (NFT_LOOKUP_F_INV).
    fn lookup_anonymous_set(&mut self, id: u32, name: &str, inverted: bool) {
        self.expr("lookup", |a| {
            a.put_be32(2, REG_1).put_str(1, name).put_be32(4, id);
            if inverted {
                a.put_be32(5, 1);
            }
        });
    }

    fn lookup_anonymous_vmap(&mut self, id: u32, name: &str) {
        self.lookup_anonymous_map(id, name, REG_VERDICT);
    }

    fn lookup_anonymous_map(&mut self, id: u32, name: &str, dreg: u32) {
        self.expr("lookup", |a| {
            a.put_be32(2, REG_1).put_be32(3, dreg).put_str(1, name).put_be32(4, id);
        });
    }

    fn dynset_update(&mut self, set: &str) {
        self.expr("dynset", |a| {
            a.put_be32(4, DYNSET_OP_UPDATE).put_be32(3, REG_1).put_str(1, set);
        });
    }

    fn numgen_random(&mut self, modulus: u32) {
        self.expr("numgen", |a| {
            a.put_be32(1, REG_1).put_be32(2, modulus).put_be32(3, NG_RANDOM).put_be32(4, 0);
        });
    }

    fn immediate_data(&mut self, reg: u32, value: &[u8]) {
        self.expr("immediate", |a| {
            a.put_be32(1, reg);
            a.begin(2).put(attr::DATA_VALUE, value).end();
        });
    }

    fn verdict(&mut self, v: &Verdict) {
        self.expr("immediate", |a| {
            a.put_be32(1, REG_VERDICT);
            a.begin(2);
            put_verdict(a, v);
            a.end();
        });
    }

    /// `dnat`: the address in register 1, the port in `port_reg`; nft states the range
    /// flags for an immediate target only.
    fn nat_dnat(&mut self, family: u8, port_reg: u32, flags: bool) {
        self.expr("nat", |a| {
            a.put_be32(1, NAT_DNAT).put_be32(2, u32::from(family)).put_be32(3, REG_1).put_be32(5, port_reg);
            if flags {
                a.put_be32(7, NAT_RANGE_PROTO_SPECIFIED);
            }
        });
    }

    fn write_into(self, a: &mut Attrs) {
        a.extend_raw(&self.attrs.into_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nftables::{Chain, Element};

    fn rule(text: &str) -> Operation {
        Operation::AddRule(Rule { chain: "c".into(), text: text.into(), comment: None })
    }

    #[test]
    fn the_per_service_forms_are_encoded() {
        for (family, text) in [
            (Family::Ip, "ip saddr 10.180.0.1 jump mark-for-masquerade"),
            (Family::Ip, "meta l4proto tcp dnat to 10.180.0.1:80"),
            (Family::Ip6, "meta l4proto udp dnat to [fd00::1]:53"),
            (Family::Ip, "numgen random mod 2 vmap { 0 : goto a , 1 : goto b }"),
            (Family::Ip, "ip daddr 172.30.0.41 tcp dport 80 ip saddr != 10.0.0.0/12 jump mark-for-masquerade"),
            (Family::Ip, "ip saddr @affinity-X goto endpoint-A"),
            (Family::Ip6, "update @affinity-X { ip6 saddr }"),
            (Family::Ip, "fib saddr type local goto cluster-x"),
            (Family::Ip, "mark set mark or 0x4000"),
            (Family::Ip, "goto external-x"),
            (Family::Ip, "meta l4proto tcp dnat ip addr . port to numgen random mod 1 map { 0 : 10.0.0.1 . 80 }"),
            (Family::Ip6, "meta l4proto sctp dnat ip6 addr . port to numgen random mod 1 map { 0 : fd00::1 . 80 }"),
        ] {
            let enc = transaction(family, &[rule(text)]).unwrap_or_else(|e| panic!("{text}: {e}"));
            assert_eq!(enc.messages.last().unwrap().kind, MsgType::NewRule, "{text}");
        }
    }

    #[test]
    fn other_forms_are_left_to_nft() {
        for text in [
            // Ranges nft merges (touching, overlapping, repeated) or that reach either end.
            "ip saddr != { 10.0.0.0/24 , 10.0.1.0/24 } drop",
            "ip saddr != { 10.0.0.0/16 , 10.0.5.0/24 } drop",
            "ip saddr != { 10.0.0.1 , 10.0.0.1 } drop",
            "ip saddr != { 0.0.0.0/1 , 203.0.113.0/24 } drop",
            "ip saddr != { 128.0.0.0/1 , 10.0.0.0/8 } drop",
            "ip saddr != { 10.0.0.1/8 , 203.0.113.0/24 } drop",
            "ip daddr { 10.96.0.0/12,fd00::/108 } drop",
            "iifname != \"veth*\" goto x",
            "meta l4proto tcp dnat ip addr . port to numgen random mod 2 map { 0 : 10.0.0.1 . 80 }",
            "ip6 saddr fd00::1 drop",
            "ip saddr 10.0.0.1/8 drop",
            "goto x drop",
            "numgen random mod 3 vmap { 0 : goto a , 1 : goto b }",
        ] {
            assert!(transaction(Family::Ip, &[rule(text)]).is_err(), "{text}");
        }
        for op in [
            Operation::AddTable,
            Operation::AddChain(Chain { name: "x".into(), base: None, comment: Some("c".into()) }),
            Operation::FlushSet { kind: SetKind::Set, name: "s".into() },
        ] {
            assert!(transaction(Family::Ip, &[op]).is_err());
        }
    }

    #[test]
    fn a_numgen_rule_declares_and_fills_its_map_first() {
        let enc = transaction(Family::Ip, &[rule("numgen random mod 2 vmap { 0 : goto a , 1 : goto b }")]).unwrap();
        let kinds: Vec<MsgType> = enc.messages.iter().map(|m| m.kind).collect();
        assert_eq!(kinds, vec![MsgType::NewSet, MsgType::NewSetElem, MsgType::NewRule]);
        assert_eq!(enc.origins, vec![0, 0, 0]);
    }

    #[test]
    fn a_set_of_one_address_is_the_plain_match() {
        for (family, braced, plain) in [
            (Family::Ip, "ip saddr != { 203.0.113.0/24 } drop", "ip saddr != 203.0.113.0/24 drop"),
            (Family::Ip, "ip daddr { 10.96.0.0/12 } drop", "ip daddr 10.96.0.0/12 drop"),
            (Family::Ip6, "ip6 saddr != { fd00::1 } drop", "ip6 saddr != fd00::1 drop"),
        ] {
            let a = transaction(family, &[rule(braced)]).unwrap_or_else(|e| panic!("{braced}: {e}"));
            let b = transaction(family, &[rule(plain)]).unwrap();
            assert_eq!(a.messages, b.messages, "{braced}");
        }
    }

    /// `{ A , B }`: an interval set, its elements ascending from an end at zero, each range
    /// its first address and the address after its last (flagged), as nft sends them.
    #[test]
    fn an_address_set_is_an_interval_set() {
        let enc = transaction(Family::Ip, &[rule("ip saddr != { 203.0.113.0/24 , 198.18.0.5 , 198.19.0.0/16 } drop")])
            .unwrap();
        let kinds: Vec<MsgType> = enc.messages.iter().map(|m| m.kind).collect();
        assert_eq!(kinds, vec![MsgType::NewSet, MsgType::NewSetElem, MsgType::NewRule]);
        let elems = &enc.messages[1].attrs;
        let at = |key: [u8; 4]| elems.windows(4).position(|w| w == key).unwrap_or_else(|| panic!("{key:?}"));
        let order =
            [[198, 18, 0, 5], [198, 18, 0, 6], [198, 19, 0, 0], [198, 20, 0, 0], [203, 0, 113, 0], [203, 0, 114, 0]];
        assert!(order.windows(2).all(|w| at(w[0]) < at(w[1])), "ascending");
        // The user data nft gives it (ip saddr), byte for byte from `nft --debug=mnl`.
        let userdata =
            [0, 4, 2, 0, 0, 0, 2, 4, 1, 0, 0, 0, 3, 20, 0, 4, 7, 0, 0, 0, 1, 12, 0, 4, 12, 0, 0, 0, 1, 4, 11, 0, 0, 0];
        assert!(enc.messages[0].attrs.windows(userdata.len()).any(|w| w == userdata));
        for text in ["ip daddr { 198.18.0.0/15 , 203.0.113.7 } drop", "ip6 saddr != { fd00:18::/64 , fd00::5 } drop"] {
            let family = if text.starts_with("ip6") { Family::Ip6 } else { Family::Ip };
            assert!(transaction(family, &[rule(text)]).is_ok(), "{text}");
        }
    }

    /// Our names: distinct, never read as nft's `__map%d` (the kernel's numbering parses
    /// `__map` then digits), short; the set is created exclusively and the elements and the
    /// rule's lookup name it.
    #[test]
    fn anonymous_maps_named_by_us_are_distinct_and_created_exclusively() {
        let names = AnonymousNames::random();
        let first = names.next();
        assert!(first.starts_with("__k") && first.len() == 12, "{first}");
        let mut seen: std::collections::BTreeSet<String> = (0..5000).map(|_| names.next()).collect();
        assert_eq!(seen.len(), 5000);
        assert!(seen.insert(first));
        assert_ne!(AnonymousNames::random().prefix, names.prefix, "each writer its own prefix");

        let names = AnonymousNames::with_prefix("__kT");
        let text = "numgen random mod 2 vmap { 0 : goto a , 1 : goto b }";
        let enc = transaction_named(Family::Ip, &[rule(text), rule(text)], Some(&names)).unwrap();
        let contains = |m: &Message, s: &[u8]| m.attrs.windows(s.len()).any(|w| w == s);
        for (i, name) in [b"__kT0\0", b"__kT1\0"].iter().enumerate() {
            let [set, elems, lookup] = &enc.messages[i * 3..i * 3 + 3] else { unreachable!() };
            assert_eq!(set.flags, NLM_F_CREATE | NLM_F_EXCL);
            assert!(contains(set, *name) && contains(elems, *name) && contains(lookup, *name), "map {i}");
        }
        // nft's own naming leaves the number to the kernel, and may meet an existing set.
        let enc = transaction(Family::Ip, &[rule(text)]).unwrap();
        assert_eq!(enc.messages[0].flags, NLM_F_CREATE);
        assert!(contains(&enc.messages[0], b"__map%d\0"));
    }

    #[test]
    fn concatenated_keys_are_padded() {
        let enc = transaction(
            Family::Ip,
            &[Operation::AddElement(Element {
                kind: SetKind::Map,
                set: "service-ips".into(),
                key: vec!["172.30.0.50".into(), "udp".into(), "53".into()],
                value: vec!["goto a".into()],
                comment: Some("ns1/svc1:p80".into()),
            })],
        )
        .unwrap();
        let bytes = &enc.messages[0].attrs;
        let key = [172, 30, 0, 50, 17, 0, 0, 0, 0, 53, 0, 0];
        assert!(bytes.windows(key.len()).any(|w| w == key));
        assert!(bytes.windows(13).any(|w| w == b"ns1/svc1:p80\0"));
    }
}
