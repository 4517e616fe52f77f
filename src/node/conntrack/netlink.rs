//! Conntrack over netlink (ctnetlink), as upstream talks to the table since 1.32 (PR #126847
//! dropped its use of the `conntrack` tool): one dump of a family's table
//! (`IPCTNL_MSG_CT_GET` with `NLM_F_DUMP`) and deletions of exact entries
//! (`IPCTNL_MSG_CT_DELETE` naming the original tuple, the zone and the entry's id), many to
//! one `sendmsg`, each acknowledged.
//!
//! Why: the reconciler's cost with the tool was one `conntrack -L` (1.4 s at 250k UDP entries
//! on the benchmark's node, mostly formatting and parsing text) plus one `conntrack -D` per
//! stale filter, each a walk of the whole table (0.8 s at 250k whether it matches or not); the
//! tool cannot delete a batch (`-R` with `-D` lines walks once per line: 0.7 s per entry).
//! Over netlink a listing is one dump decoded in process and a deletion is a hash lookup in
//! the kernel, so a rollout's cleanup is one walk plus microseconds per stale entry
//! (docs/performance.md has the figures, measured beside the tool and upstream's way).
//!
//! The socket is `netlink-sys`'s and the messages are `netlink-packet-netfilter`'s (the
//! rust-netlink project): no `unsafe` here. [`NetlinkConntrack::in_netns`] opens its sockets
//! inside a named network namespace (a short-lived thread enters it; the socket stays
//! there), which the real-kernel tests and the benchmark use. The per-change requests of
//! 1.29–1.31 ([`Conntrack::clear`]) still go to the `conntrack` tool, with upstream's exact
//! arguments, as those releases ran it.

use std::io;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use netlink_packet_core::{
    DefaultNla, NLM_F_ACK, NLM_F_DUMP, NLM_F_REQUEST, NetlinkHeader, NetlinkMessage, NetlinkPayload, Nla,
};
use netlink_packet_netfilter::conntrack::{
    ConntrackAttribute, ConntrackMessage, IPTuple, ProtoTuple, Protocol as CtProtocol, Tuple,
};
use netlink_packet_netfilter::{NetfilterHeader, NetfilterMessage, NetfilterMessageInner, NetfilterProtoFamily};
use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_NETFILTER};
use nix::sys::socket::{setsockopt, sockopt};
use nix::sys::time::{TimeVal, TimeValLike};

use super::{
    ClearRequest, Conntrack, ConntrackEntry, ConntrackError, EntryDeletions, ExecConntrack, FlowFilter, Result,
};
use crate::exec::Exec;
use crate::model::{IpFamily, Protocol};

/// `CTA_ID`, `CTA_ZONE` (include/uapi/linux/netfilter/nfnetlink_conntrack.h); the crate leaves
/// them to `Other`.
const CTA_ID: u16 = 12;
const CTA_ZONE: u16 = 18;

/// A receive that waits longer than this fails the call (the kernel answers a dump or a
/// batch in milliseconds; this only guards against a socket that never answers).
const RECEIVE_TIMEOUT: Duration = Duration::from_secs(30);

/// Bytes of one `recv` (the kernel fills up to this much of a dump per call).
const RECEIVE_BUFFER: usize = 1 << 20;

/// The socket's receive buffer (`SO_RCVBUF`): room for a batch's acknowledgements.
const SOCKET_RECEIVE_BUFFER: usize = 4 << 20;

/// Deletion messages sent with one `sendmsg` (about 100 bytes each; their acknowledgements,
/// 36 bytes each with `NETLINK_CAP_ACK`, stay well inside the receive buffer).
const DELETIONS_PER_SEND: usize = 512;

/// Lists and deletes conntrack entries over netlink; the 1.29–1.31 requests and filter
/// deletions go to the `conntrack` tool ([`ExecConntrack`]).
pub struct NetlinkConntrack {
    netns: Option<String>,
    tool: ExecConntrack,
}

impl std::fmt::Debug for NetlinkConntrack {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NetlinkConntrack").field("netns", &self.netns).finish_non_exhaustive()
    }
}

impl NetlinkConntrack {
    /// `exec` runs the tool for the requests of 1.29–1.31.
    pub fn new(exec: Arc<dyn Exec>) -> Self {
        NetlinkConntrack { netns: None, tool: ExecConntrack::new(exec) }
    }

    /// Talks to the table of the named network namespace (tests and benchmarks).
    pub fn in_netns(self, name: impl Into<String>) -> Self {
        let name = name.into();
        NetlinkConntrack { tool: self.tool.in_netns(name.clone()), netns: Some(name) }
    }

    fn open(&self) -> io::Result<Socket> {
        match &self.netns {
            None => open_socket(),
            Some(name) => {
                let path = format!("/var/run/netns/{name}");
                // A socket belongs to the namespace of the thread that made it.
                std::thread::spawn(move || {
                    let ns = std::fs::File::open(&path)?;
                    nix::sched::setns(&ns, nix::sched::CloneFlags::CLONE_NEWNET).map_err(io::Error::from)?;
                    open_socket()
                })
                .join()
                .map_err(|_| io::Error::other("the thread entering the network namespace panicked"))?
            }
        }
    }

    /// Every entry of `family` in the table (all protocols), as the kernel dumps them.
    pub fn dump(&self, family: IpFamily) -> Result<Vec<ConntrackEntry>> {
        self.dump_matching(family, |_| true)
    }

    fn dump_matching(&self, family: IpFamily, keep: impl Fn(&ConntrackEntry) -> bool) -> Result<Vec<ConntrackEntry>> {
        let io_err = |source| ConntrackError::Netlink { action: "list", family, source };
        let socket = self.open().map_err(io_err)?;
        let mut request = message(NLM_F_REQUEST | NLM_F_DUMP, 1, family, ConntrackMessage::Get(Vec::new()));
        request.finalize();
        let mut bytes = vec![0; request.buffer_len()];
        request.serialize(&mut bytes);
        socket.send(&bytes, 0).map_err(io_err)?;

        let mut entries = Vec::new();
        let mut buf = Vec::with_capacity(RECEIVE_BUFFER);
        loop {
            buf.clear();
            let n = socket.recv(&mut buf, 0).map_err(io_err)?;
            if n == 0 {
                return Err(ConntrackError::NetlinkMessage {
                    action: "list",
                    family,
                    reason: "the socket closed before the dump ended".into(),
                });
            }
            for reply in Messages::new(&buf[..n.min(buf.len())]) {
                let reply =
                    reply.map_err(|reason| ConntrackError::NetlinkMessage { action: "list", family, reason })?;
                match reply.payload {
                    NetlinkPayload::Done(_) => return Ok(entries),
                    NetlinkPayload::Error(e) => {
                        if let Some(code) = e.code {
                            return Err(io_err(io::Error::from_raw_os_error(-code.get())));
                        }
                    }
                    NetlinkPayload::InnerMessage(NetfilterMessage {
                        inner: NetfilterMessageInner::Conntrack(ConntrackMessage::New(attributes)),
                        ..
                    }) => {
                        if let Some(entry) = entry_of(&attributes).filter(|e| keep(e)) {
                            entries.push(entry);
                        }
                    }
                    _ => {}
                }
            }
        }
    }
}

/// A netlink socket to the kernel's netfilter subsystem.
fn open_socket() -> io::Result<Socket> {
    let mut socket = Socket::new(NETLINK_NETFILTER)?;
    socket.bind_auto()?;
    socket.connect(&SocketAddr::new(0, 0))?;
    // Acknowledgements carry the request's header only, not the whole request.
    socket.set_cap_ack(true)?;
    socket.set_rx_buf_sz(SOCKET_RECEIVE_BUFFER)?;
    let timeout = TimeVal::milliseconds(i64::try_from(RECEIVE_TIMEOUT.as_millis()).unwrap_or(i64::MAX));
    setsockopt(&socket, sockopt::ReceiveTimeout, &timeout).map_err(io::Error::from)?;
    Ok(socket)
}

fn message(flags: u16, sequence: u32, family: IpFamily, body: ConntrackMessage) -> NetlinkMessage<NetfilterMessage> {
    let mut header = NetlinkHeader::default();
    header.flags = flags;
    header.sequence_number = sequence;
    let family = match family {
        IpFamily::V4 => NetfilterProtoFamily::IPv4,
        IpFamily::V6 => NetfilterProtoFamily::IPv6,
    };
    NetlinkMessage::new(header, NetlinkPayload::from(NetfilterMessage::new(NetfilterHeader::new(family, 0, 0), body)))
}

/// The netlink messages in one received buffer.
struct Messages<'a> {
    buf: &'a [u8],
}

impl<'a> Messages<'a> {
    fn new(buf: &'a [u8]) -> Self {
        Messages { buf }
    }
}

impl Iterator for Messages<'_> {
    type Item = std::result::Result<NetlinkMessage<NetfilterMessage>, String>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.buf.is_empty() {
            return None;
        }
        match NetlinkMessage::<NetfilterMessage>::deserialize(self.buf) {
            Ok(message) => {
                let len = message.header.length as usize;
                // Messages are 4-byte aligned in a buffer.
                let next = len.div_ceil(4) * 4;
                if len == 0 {
                    self.buf = &[];
                    return Some(Err("a netlink message of length 0".into()));
                }
                self.buf = self.buf.get(next..).unwrap_or_default();
                Some(Ok(message))
            }
            Err(e) => {
                self.buf = &[];
                Some(Err(format!("undecodable netlink message: {e}")))
            }
        }
    }
}

/// The entry a dumped message describes; `None` for one without both tuples (or of a
/// protocol without ports, which the cleanup never deletes).
fn entry_of(attributes: &[ConntrackAttribute]) -> Option<ConntrackEntry> {
    let (mut orig, mut reply, mut zone, mut id) = (None, None, 0, None);
    for attribute in attributes {
        match attribute {
            ConntrackAttribute::CtaTupleOrig(tuple) => orig = tuple_of(tuple),
            ConntrackAttribute::CtaTupleReply(tuple) => reply = tuple_of(tuple),
            ConntrackAttribute::Other(nla) if nla.kind() == CTA_ZONE => {
                zone = u16::from_be_bytes(value_of::<2>(nla)?);
            }
            ConntrackAttribute::Other(nla) if nla.kind() == CTA_ID => {
                id = Some(u32::from_be_bytes(value_of::<4>(nla)?));
            }
            _ => {}
        }
    }
    let (protocol, (orig_src, orig_sport), (orig_dst, orig_dport)) = orig?;
    let (_, (reply_src, reply_sport), (reply_dst, reply_dport)) = reply?;
    Some(ConntrackEntry {
        protocol,
        orig_src,
        orig_dst,
        orig_sport,
        orig_dport,
        reply_src,
        reply_dst,
        reply_sport,
        reply_dport,
        zone,
        id,
    })
}

/// The value of a fixed-size attribute.
fn value_of<const N: usize>(nla: &DefaultNla) -> Option<[u8; N]> {
    if nla.value_len() != N {
        return None;
    }
    let mut value = [0; N];
    nla.emit_value(&mut value);
    Some(value)
}

type Endpoint = (IpAddr, u16);

/// Protocol, source and destination of a tuple with ports (TCP, UDP, SCTP).
fn tuple_of(tuple: &[Tuple]) -> Option<(Protocol, Endpoint, Endpoint)> {
    let (mut src, mut dst, mut protocol, mut sport, mut dport) = (None, None, None, None, None);
    for part in tuple {
        match part {
            Tuple::Ip(ips) => {
                for ip in ips {
                    match ip {
                        IPTuple::SourceAddress(a) => src = Some(*a),
                        IPTuple::DestinationAddress(a) => dst = Some(*a),
                        _ => {}
                    }
                }
            }
            Tuple::Proto(fields) => {
                for field in fields {
                    match field {
                        ProtoTuple::Protocol(p) => {
                            protocol = match p {
                                CtProtocol::Tcp => Some(Protocol::Tcp),
                                CtProtocol::Udp => Some(Protocol::Udp),
                                CtProtocol::Sctp => Some(Protocol::Sctp),
                                _ => None,
                            }
                        }
                        ProtoTuple::SourcePort(p) => sport = Some(*p),
                        ProtoTuple::DestinationPort(p) => dport = Some(*p),
                        _ => {}
                    }
                }
            }
            _ => {}
        }
    }
    Some((protocol?, (src?, sport?), (dst?, dport?)))
}

/// The deletion of exactly `entry`: its original tuple, its zone and (when known) its id.
/// (A deletion without a tuple flushes the table: this always names one.)
fn deletion(entry: &ConntrackEntry) -> ConntrackMessage {
    let protocol = match entry.protocol {
        Protocol::Tcp => CtProtocol::Tcp,
        Protocol::Udp => CtProtocol::Udp,
        Protocol::Sctp => CtProtocol::Sctp,
    };
    let mut attributes = vec![ConntrackAttribute::CtaTupleOrig(vec![
        Tuple::Ip(vec![IPTuple::SourceAddress(entry.orig_src), IPTuple::DestinationAddress(entry.orig_dst)]),
        Tuple::Proto(vec![
            ProtoTuple::Protocol(protocol),
            ProtoTuple::SourcePort(entry.orig_sport),
            ProtoTuple::DestinationPort(entry.orig_dport),
        ]),
    ])];
    if entry.zone != 0 {
        attributes.push(ConntrackAttribute::Other(DefaultNla::new(CTA_ZONE, entry.zone.to_be_bytes().to_vec())));
    }
    if let Some(id) = entry.id {
        attributes.push(ConntrackAttribute::Other(DefaultNla::new(CTA_ID, id.to_be_bytes().to_vec())));
    }
    ConntrackMessage::Delete(attributes)
}

impl Conntrack for NetlinkConntrack {
    fn clear(&self, request: &ClearRequest) -> Result<()> {
        self.tool.clear(request)
    }

    fn list_entries(&self, family: IpFamily, protocol: Protocol) -> Result<Vec<ConntrackEntry>> {
        self.dump_matching(family, |e| e.protocol == protocol)
    }

    fn delete_flows(&self, filter: &FlowFilter) -> Result<u64> {
        self.tool.delete_flows(filter)
    }

    fn delete_entries(&self, family: IpFamily, entries: &[ConntrackEntry]) -> Result<EntryDeletions> {
        let io_err = |source| ConntrackError::Netlink { action: "delete", family, source };
        let mut outcome = EntryDeletions::default();
        if entries.is_empty() {
            return Ok(outcome);
        }
        let socket = self.open().map_err(io_err)?;
        let mut bytes = Vec::new();
        let mut buf = Vec::with_capacity(RECEIVE_BUFFER);
        for (chunk_index, chunk) in entries.chunks(DELETIONS_PER_SEND).enumerate() {
            bytes.clear();
            // Sequence numbers name the entries of this chunk (from 1: 0 is the kernel's own).
            let first = (chunk_index * DELETIONS_PER_SEND) as u32 + 1;
            for (i, entry) in chunk.iter().enumerate() {
                let mut request = message(NLM_F_REQUEST | NLM_F_ACK, first + i as u32, family, deletion(entry));
                request.finalize();
                let at = bytes.len();
                bytes.resize(at + request.buffer_len(), 0);
                request.serialize(&mut bytes[at..]);
            }
            // The kernel handles every message of a send before the call returns, so their
            // acknowledgements are all queued once it has.
            socket.send(&bytes, 0).map_err(io_err)?;
            let mut answered = 0;
            while answered < chunk.len() {
                buf.clear();
                let n = socket.recv(&mut buf, 0).map_err(io_err)?;
                for reply in Messages::new(&buf[..n.min(buf.len())]) {
                    let reply =
                        reply.map_err(|reason| ConntrackError::NetlinkMessage { action: "delete", family, reason })?;
                    let NetlinkPayload::Error(ack) = reply.payload else {
                        continue;
                    };
                    let Some(entry) =
                        reply.header.sequence_number.checked_sub(first).and_then(|i| chunk.get(i as usize))
                    else {
                        continue;
                    };
                    answered += 1;
                    match ack.code.map(|c| -c.get()) {
                        None => outcome.deleted += 1,
                        Some(code) if code == nix::libc::ENOENT => outcome.gone += 1,
                        Some(code) => {
                            outcome.fail(|| format!("deleting {entry}: {}", io::Error::from_raw_os_error(code)))
                        }
                    }
                }
            }
        }
        Ok(outcome)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry() -> ConntrackEntry {
        ConntrackEntry {
            protocol: Protocol::Udp,
            orig_src: "198.18.0.10".parse().unwrap(),
            orig_dst: "198.18.100.10".parse().unwrap(),
            orig_sport: 40001,
            orig_dport: 53,
            reply_src: "198.18.1.5".parse().unwrap(),
            reply_dst: "198.18.0.10".parse().unwrap(),
            reply_sport: 5353,
            reply_dport: 40001,
            zone: 7,
            id: Some(0xdead_beef),
        }
    }

    /// A deletion names the original tuple, the zone and the id, and decodes back to them.
    #[test]
    fn a_deletion_names_the_entry_exactly() {
        let mut request = message(NLM_F_REQUEST | NLM_F_ACK, 9, IpFamily::V4, deletion(&entry()));
        request.finalize();
        let mut bytes = vec![0; request.buffer_len()];
        request.serialize(&mut bytes);
        let decoded = NetlinkMessage::<NetfilterMessage>::deserialize(&bytes).expect("decodes");
        assert_eq!(decoded.header.sequence_number, 9);
        // IPCTNL_MSG_CT_DELETE in the ctnetlink subsystem.
        assert_eq!(decoded.header.message_type, (1 << 8) | 2);
        let NetlinkPayload::InnerMessage(NetfilterMessage {
            inner: NetfilterMessageInner::Conntrack(ConntrackMessage::Delete(attributes)),
            ..
        }) = decoded.payload
        else {
            panic!("not a deletion: {decoded:?}");
        };
        let ConntrackAttribute::CtaTupleOrig(tuple) = &attributes[0] else { panic!("{attributes:?}") };
        let e = entry();
        assert_eq!(tuple_of(tuple), Some((Protocol::Udp, (e.orig_src, 40001), (e.orig_dst, 53))));
        // A dumped entry carries the same attributes plus its reply tuple.
        let mut dumped = attributes.clone();
        dumped.push(ConntrackAttribute::CtaTupleReply(vec![
            Tuple::Ip(vec![IPTuple::SourceAddress(e.reply_src), IPTuple::DestinationAddress(e.reply_dst)]),
            Tuple::Proto(vec![
                ProtoTuple::Protocol(CtProtocol::Udp),
                ProtoTuple::SourcePort(5353),
                ProtoTuple::DestinationPort(40001),
            ]),
        ]));
        assert_eq!(entry_of(&dumped), Some(e));
    }

    #[test]
    fn entries_without_both_tuples_or_ports_are_skipped() {
        let icmp = vec![ConntrackAttribute::CtaTupleOrig(vec![
            Tuple::Ip(vec![
                IPTuple::SourceAddress("198.18.0.1".parse().unwrap()),
                IPTuple::DestinationAddress("198.18.0.2".parse().unwrap()),
            ]),
            Tuple::Proto(vec![ProtoTuple::Protocol(CtProtocol::Icmp)]),
        ])];
        assert_eq!(entry_of(&icmp), None);
        assert_eq!(entry_of(&[]), None);
    }

    #[test]
    fn garbage_in_a_buffer_is_an_error_not_a_panic() {
        for buf in [&[1u8, 2, 3][..], &[0u8; 16][..], &[255u8; 40][..]] {
            let all: Vec<_> = Messages::new(buf).collect();
            assert!(all.iter().all(|m| m.is_err()) && all.len() <= 1, "{all:?}");
        }
    }
}
