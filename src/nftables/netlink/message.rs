//! nf_tables netlink messages as bytes: the netlink header, nfnetlink's `nfgenmsg`, nested
//! attributes, and the batch that makes many messages one kernel transaction
//! (`NFNL_MSG_BATCH_BEGIN` … `NFNL_MSG_BATCH_END`). Pure: no I/O.
//!
//! Constants are the kernel's uapi (include/uapi/linux/netfilter/nf_tables.h,
//! nfnetlink.h); attribute values are written as nft 1.0.6 writes them (network byte order
//! for lengths, registers, offsets and verdict codes; host order where the kernel compares
//! host-order data, such as marks).

/// `NETLINK_NETFILTER` subsystem of nf_tables.
pub const NFNL_SUBSYS_NFTABLES: u16 = 10;
/// Batch delimiters (not shifted by the subsystem).
pub const NFNL_MSG_BATCH_BEGIN: u16 = 16;
pub const NFNL_MSG_BATCH_END: u16 = 17;

pub const NLM_F_REQUEST: u16 = 0x1;
pub const NLM_F_ACK: u16 = 0x4;
/// With `NLM_F_CREATE`: refuse (EEXIST) rather than update an object of the same name.
pub const NLM_F_EXCL: u16 = 0x200;
pub const NLM_F_CREATE: u16 = 0x400;
pub const NLM_F_APPEND: u16 = 0x800;
/// A nested attribute's type carries this bit.
pub const NLA_F_NESTED: u16 = 0x8000;

/// `NFT_MSG_*`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u16)]
pub enum MsgType {
    NewChain = 3,
    DelChain = 5,
    NewRule = 6,
    DelRule = 8,
    NewSet = 9,
    DelSet = 11,
    NewSetElem = 12,
    DelSetElem = 14,
}

/// `AF_INET`, `AF_INET6` (nfgenmsg's family).
pub const AF_INET: u8 = 2;
pub const AF_INET6: u8 = 10;

/// Attributes of tables, chains, rules, sets, elements, expressions and data
/// (`NFTA_*`).
pub mod attr {
    pub const CHAIN_TABLE: u16 = 1;
    pub const CHAIN_NAME: u16 = 3;
    pub const RULE_TABLE: u16 = 1;
    pub const RULE_CHAIN: u16 = 2;
    pub const RULE_EXPRESSIONS: u16 = 4;
    pub const RULE_USERDATA: u16 = 7;
    pub const LIST_ELEM: u16 = 1;
    pub const EXPR_NAME: u16 = 1;
    pub const EXPR_DATA: u16 = 2;
    pub const SET_TABLE: u16 = 1;
    pub const SET_NAME: u16 = 2;
    pub const SET_FLAGS: u16 = 3;
    pub const SET_KEY_TYPE: u16 = 4;
    pub const SET_KEY_LEN: u16 = 5;
    pub const SET_DATA_TYPE: u16 = 6;
    pub const SET_DATA_LEN: u16 = 7;
    pub const SET_DESC: u16 = 9;
    pub const SET_ID: u16 = 10;
    pub const SET_TIMEOUT: u16 = 11;
    pub const SET_USERDATA: u16 = 13;
    pub const SET_DESC_SIZE: u16 = 1;
    pub const SET_ELEM_LIST_TABLE: u16 = 1;
    pub const SET_ELEM_LIST_SET: u16 = 2;
    pub const SET_ELEM_LIST_ELEMENTS: u16 = 3;
    pub const SET_ELEM_LIST_SET_ID: u16 = 4;
    pub const SET_ELEM_KEY: u16 = 1;
    pub const SET_ELEM_DATA: u16 = 2;
    pub const SET_ELEM_FLAGS: u16 = 3;
    pub const SET_ELEM_USERDATA: u16 = 6;
    pub const DATA_VALUE: u16 = 1;
    pub const DATA_VERDICT: u16 = 2;
    pub const VERDICT_CODE: u16 = 1;
    pub const VERDICT_CHAIN: u16 = 2;
}

/// A message's attributes being written: nested attributes are opened and closed in order.
#[derive(Debug, Default)]
pub struct Attrs {
    buf: Vec<u8>,
    open: Vec<usize>,
}

impl Attrs {
    pub fn new() -> Attrs {
        Attrs::default()
    }

    pub fn put(&mut self, kind: u16, value: &[u8]) -> &mut Self {
        let len = 4 + value.len();
        self.buf.extend_from_slice(&(len as u16).to_ne_bytes());
        self.buf.extend_from_slice(&kind.to_ne_bytes());
        self.buf.extend_from_slice(value);
        self.pad();
        self
    }

    /// A NUL-terminated string.
    pub fn put_str(&mut self, kind: u16, value: &str) -> &mut Self {
        let mut bytes = Vec::with_capacity(value.len() + 1);
        bytes.extend_from_slice(value.as_bytes());
        bytes.push(0);
        self.put(kind, &bytes)
    }

    /// A 32-bit value in network byte order.
    pub fn put_be32(&mut self, kind: u16, value: u32) -> &mut Self {
        self.put(kind, &value.to_be_bytes())
    }

    pub fn put_be64(&mut self, kind: u16, value: u64) -> &mut Self {
        self.put(kind, &value.to_be_bytes())
    }

    /// Opens a nested attribute; [`Attrs::end`] closes the innermost one.
    pub fn begin(&mut self, kind: u16) -> &mut Self {
        self.open.push(self.buf.len());
        self.buf.extend_from_slice(&[0, 0]);
        self.buf.extend_from_slice(&(kind | NLA_F_NESTED).to_ne_bytes());
        self
    }

    pub fn end(&mut self) -> &mut Self {
        let start = self.open.pop().expect("end() without begin()");
        let len = (self.buf.len() - start) as u16;
        self.buf[start..start + 2].copy_from_slice(&len.to_ne_bytes());
        self
    }

    /// Attributes written elsewhere (already aligned), at the current nesting level.
    pub fn extend_raw(&mut self, bytes: &[u8]) -> &mut Self {
        self.buf.extend_from_slice(bytes);
        self.pad();
        self
    }

    fn pad(&mut self) {
        while !self.buf.len().is_multiple_of(4) {
            self.buf.push(0);
        }
    }

    pub fn into_bytes(self) -> Vec<u8> {
        debug_assert!(self.open.is_empty(), "unclosed nested attribute");
        self.buf
    }
}

/// One message of a batch: its type, its netlink flags (besides `NLM_F_REQUEST`, which every
/// message carries, and `NLM_F_ACK`, which the last carries) and its attributes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    pub kind: MsgType,
    pub flags: u16,
    pub attrs: Vec<u8>,
}

/// Writes `messages` as one batch for `family`, sequence numbers from `first_seq` (the
/// begin message has `first_seq`, message `i` has `first_seq + 1 + i`, the end message the
/// next). The kernel answers every message that fails; the last message also asks for an
/// acknowledgement, which the kernel sends after every error of the batch (it delivers its
/// answers once the whole batch is processed), so that answer ends the reading. Asking for
/// one per message would queue thousands of answers for a large batch, more than a socket's
/// receive buffer takes (each is a whole socket buffer to the kernel's accounting).
pub fn batch(family: u8, messages: &[Message], first_seq: u32) -> Vec<u8> {
    let mut out = Vec::with_capacity(messages.iter().map(|m| m.attrs.len() + 20).sum::<usize>() + 40);
    // The batch delimiters name the subsystem in nfgenmsg's res_id (network order).
    header(&mut out, NFNL_MSG_BATCH_BEGIN, NLM_F_REQUEST, first_seq, 0, &[]);
    for (i, m) in messages.iter().enumerate() {
        let kind = (NFNL_SUBSYS_NFTABLES << 8) | m.kind as u16;
        let ack = if i + 1 == messages.len() { NLM_F_ACK } else { 0 };
        header(&mut out, kind, NLM_F_REQUEST | ack | m.flags, first_seq + 1 + i as u32, family, &m.attrs);
    }
    header(&mut out, NFNL_MSG_BATCH_END, NLM_F_REQUEST, first_seq + 1 + messages.len() as u32, 0, &[]);
    out
}

fn header(out: &mut Vec<u8>, kind: u16, flags: u16, seq: u32, family: u8, attrs: &[u8]) {
    let len = 16 + 4 + attrs.len();
    out.extend_from_slice(&(len as u32).to_ne_bytes());
    out.extend_from_slice(&kind.to_ne_bytes());
    out.extend_from_slice(&flags.to_ne_bytes());
    out.extend_from_slice(&seq.to_ne_bytes());
    out.extend_from_slice(&0u32.to_ne_bytes()); // port id: the kernel's
    // nfgenmsg: family, version 0, res_id (the subsystem, for batch delimiters).
    out.push(family);
    out.push(0);
    let res_id = if family == 0 { NFNL_SUBSYS_NFTABLES } else { 0 };
    out.extend_from_slice(&res_id.to_be_bytes());
    out.extend_from_slice(attrs);
}

/// An acknowledgement or error from the kernel (`NLMSG_ERROR`): the sequence number it
/// answers and its error (0: done).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ack {
    pub seq: u32,
    pub errno: i32,
}

pub const NLMSG_ERROR: u16 = 2;
pub const NLMSG_DONE: u16 = 3;

/// The `NLMSG_ERROR` answers in a buffer received from the socket (other messages are
/// skipped). An error is a malformed buffer.
pub fn parse_acks(buf: &[u8]) -> Result<Vec<Ack>, String> {
    let mut acks = Vec::new();
    let mut rest = buf;
    while rest.len() >= 16 {
        let len = u32::from_ne_bytes(rest[0..4].try_into().expect("4 bytes")) as usize;
        let kind = u16::from_ne_bytes(rest[4..6].try_into().expect("2 bytes"));
        if len < 16 || len > rest.len() {
            return Err(format!("a netlink message of length {len} in {} bytes", rest.len()));
        }
        if kind == NLMSG_ERROR {
            if len < 16 + 4 + 16 {
                return Err("a short netlink error message".into());
            }
            let errno = i32::from_ne_bytes(rest[16..20].try_into().expect("4 bytes"));
            // The answered request's header follows: its sequence number.
            let seq = u32::from_ne_bytes(rest[28..32].try_into().expect("4 bytes"));
            acks.push(Ack { seq, errno });
        }
        rest = rest.get(len.div_ceil(4) * 4..).unwrap_or_default();
    }
    Ok(acks)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nested_attributes_are_sized_and_padded() {
        let mut a = Attrs::new();
        a.put_str(1, "kube-proxy");
        a.begin(4).begin(1).put_be32(2, 7).end().end();
        let bytes = a.into_bytes();
        // "kube-proxy\0" is 11 bytes: a 15-byte attribute padded to 16.
        assert_eq!(&bytes[0..4], &[15, 0, 1, 0]);
        assert_eq!(&bytes[4..15], b"kube-proxy\0");
        assert_eq!(bytes[15], 0);
        // Nested: 4 (outer) + 4 (inner) + 8 (u32).
        assert_eq!(&bytes[16..20], &[16, 0, 4, 0x80]);
        assert_eq!(&bytes[20..24], &[12, 0, 1, 0x80]);
        assert_eq!(&bytes[24..32], &[8, 0, 2, 0, 0, 0, 0, 7]);
    }

    #[test]
    fn a_batch_frames_its_messages() {
        let m = Message { kind: MsgType::NewChain, flags: NLM_F_CREATE, attrs: vec![8, 0, 1, 0, 1, 2, 3, 4] };
        let b = batch(AF_INET, &[m.clone(), m], 100);
        assert_eq!(b.len(), 20 + 28 + 28 + 20);
        // Begin: type 16, res_id 10 (network order), seq 100.
        assert_eq!(u16::from_ne_bytes([b[4], b[5]]), NFNL_MSG_BATCH_BEGIN);
        assert_eq!(&b[18..20], &[0, 10]);
        assert_eq!(u32::from_ne_bytes(b[8..12].try_into().unwrap()), 100);
        // The messages: subsystem 10, NEWCHAIN, request|create, seq 101, family 2; the last
        // also asks for an acknowledgement.
        assert_eq!(u16::from_ne_bytes([b[24], b[25]]), (10 << 8) | 3);
        assert_eq!(u16::from_ne_bytes([b[26], b[27]]), NLM_F_REQUEST | NLM_F_CREATE);
        assert_eq!(u32::from_ne_bytes(b[28..32].try_into().unwrap()), 101);
        assert_eq!(b[36], AF_INET);
        assert_eq!(u16::from_ne_bytes([b[54], b[55]]), NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE);
        assert_eq!(u32::from_ne_bytes(b[56..60].try_into().unwrap()), 102);
        // End: seq 103.
        assert_eq!(u16::from_ne_bytes([b[80], b[81]]), NFNL_MSG_BATCH_END);
        assert_eq!(u32::from_ne_bytes(b[84..88].try_into().unwrap()), 103);
    }

    #[test]
    fn acknowledgements_are_read() {
        let mut buf = Vec::new();
        for (seq, errno) in [(5u32, 0i32), (6, -2)] {
            buf.extend_from_slice(&36u32.to_ne_bytes());
            buf.extend_from_slice(&NLMSG_ERROR.to_ne_bytes());
            buf.extend_from_slice(&0u16.to_ne_bytes());
            buf.extend_from_slice(&seq.to_ne_bytes());
            buf.extend_from_slice(&0u32.to_ne_bytes());
            buf.extend_from_slice(&errno.to_ne_bytes());
            // The request's header.
            buf.extend_from_slice(&20u32.to_ne_bytes());
            buf.extend_from_slice(&0u32.to_ne_bytes());
            buf.extend_from_slice(&seq.to_ne_bytes());
            buf.extend_from_slice(&0u32.to_ne_bytes());
        }
        assert_eq!(parse_acks(&buf).unwrap(), vec![Ack { seq: 5, errno: 0 }, Ack { seq: 6, errno: -2 }]);
        assert!(parse_acks(&buf[..30]).is_err(), "a cut message is an error");
    }
}
