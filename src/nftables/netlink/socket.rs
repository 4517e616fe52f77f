//! The side effect of the netlink writer: one batch sent to the kernel's nf_tables over a
//! `NETLINK_NETFILTER` socket and its acknowledgements read back. [`KernelNetlink`] is the
//! real one (`netlink-sys`'s socket, as the conntrack code uses); [`FakeNetlink`] records
//! batches and answers as told.

use std::io;
use std::time::Duration;

use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_NETFILTER};
use nix::sys::socket::{setsockopt, sockopt};
use nix::sys::time::{TimeVal, TimeValLike};

use super::message::{Ack, parse_acks};

/// Why a batch was not answered.
#[derive(Debug, thiserror::Error)]
pub enum NetlinkError {
    /// The kernel never saw the batch (no socket, the batch too large to send): nothing of
    /// it was applied, so it can be written another way.
    #[error("the batch was not sent: {0}")]
    NotSent(io::Error),
    /// Sent, but its answer could not be read: whether the kernel applied it is unknown.
    #[error("the batch was sent but not answered: {0}")]
    Unanswered(io::Error),
}

/// Sends nf_tables batches.
pub trait Netlink: Send + Sync {
    /// Sends `batch` (sequence numbers `first_seq` to `first_seq + messages + 1`, the
    /// delimiters included) and returns the kernel's answers: the errors of failed messages,
    /// then the acknowledgement of the last message; or, when the kernel refused the batch as
    /// a whole (no permission, a failed commit), the error answering the begin message.
    fn transact(&self, batch: &[u8], first_seq: u32, messages: u32) -> Result<Vec<Ack>, NetlinkError>;
}

/// A receive that waits longer than this fails (the kernel answers a batch while it is
/// sent; this guards only against a socket that never answers).
const RECEIVE_TIMEOUT: Duration = Duration::from_secs(60);

/// Bytes of one `recv`.
const RECEIVE_CHUNK: usize = 1 << 20;

/// The kernel's nf_tables, in this process's network namespace or a named one.
#[derive(Debug, Clone, Default)]
pub struct KernelNetlink {
    netns: Option<String>,
}

impl KernelNetlink {
    pub fn new() -> KernelNetlink {
        KernelNetlink::default()
    }

    /// Talks to the named network namespace (tests and benchmarks).
    pub fn in_netns(name: impl Into<String>) -> KernelNetlink {
        KernelNetlink { netns: Some(name.into()) }
    }

    fn open(&self, batch_len: usize, messages: u32) -> io::Result<Socket> {
        match &self.netns {
            None => open_socket(batch_len, messages),
            Some(name) => {
                let path = format!("/var/run/netns/{name}");
                // A socket belongs to the namespace of the thread that made it.
                std::thread::spawn(move || {
                    let ns = std::fs::File::open(&path)?;
                    nix::sched::setns(&ns, nix::sched::CloneFlags::CLONE_NEWNET).map_err(io::Error::from)?;
                    open_socket(batch_len, messages)
                })
                .join()
                .map_err(|_| io::Error::other("the thread entering the network namespace panicked"))?
            }
        }
    }
}

fn open_socket(batch_len: usize, messages: u32) -> io::Result<Socket> {
    let mut socket = Socket::new(NETLINK_NETFILTER)?;
    socket.bind_auto()?;
    socket.connect(&SocketAddr::new(0, 0))?;
    // Acknowledgements carry the request's header only.
    socket.set_cap_ack(true)?;
    // Room for the whole batch in one send, and for the answers queued while it is sent
    // (errors only, and one acknowledgement; a batch with thousands of errors may overflow
    // it, which fails the call: the kernel aborted that batch anyway). Forcing the sizes
    // needs CAP_NET_ADMIN in the initial user namespace; without it the system's limits
    // apply, and a batch too large for them is not sent (the caller writes it another way).
    let send = (batch_len + 4096).max(1 << 20);
    if setsockopt(&socket, sockopt::SndBufForce, &send).is_err() {
        let _ = setsockopt(&socket, sockopt::SndBuf, &send);
    }
    let receive = (messages as usize * 64).clamp(1 << 20, 16 << 20);
    if setsockopt(&socket, sockopt::RcvBufForce, &receive).is_err() {
        let _ = setsockopt(&socket, sockopt::RcvBuf, &receive);
    }
    let timeout = TimeVal::milliseconds(i64::try_from(RECEIVE_TIMEOUT.as_millis()).unwrap_or(i64::MAX));
    setsockopt(&socket, sockopt::ReceiveTimeout, &timeout).map_err(io::Error::from)?;
    Ok(socket)
}

impl Netlink for KernelNetlink {
    fn transact(&self, batch: &[u8], first_seq: u32, messages: u32) -> Result<Vec<Ack>, NetlinkError> {
        let socket = self.open(batch.len(), messages).map_err(NetlinkError::NotSent)?;
        // A datagram is sent whole or not at all.
        socket.send(batch, 0).map_err(NetlinkError::NotSent)?;
        self.answers(&socket, first_seq, messages).map_err(NetlinkError::Unanswered)
    }
}

impl KernelNetlink {
    fn answers(&self, socket: &Socket, first_seq: u32, messages: u32) -> io::Result<Vec<Ack>> {
        let (last_message, end) = (first_seq + messages, first_seq + messages + 1);
        let mut acks = Vec::new();
        let mut buf = Vec::with_capacity(RECEIVE_CHUNK);
        loop {
            buf.clear();
            let n = socket.recv(&mut buf, 0)?;
            if n == 0 {
                return Err(io::Error::other("the socket closed before the batch was answered"));
            }
            for ack in parse_acks(&buf[..n.min(buf.len())]).map_err(io::Error::other)? {
                if ack.seq == first_seq || ack.seq == end {
                    // The batch itself was refused (no permission, a failed commit).
                    if ack.errno != 0 {
                        acks.push(ack);
                        return Ok(acks);
                    }
                } else if ack.seq > first_seq && ack.seq < end {
                    acks.push(ack);
                    if ack.seq == last_message {
                        return Ok(acks);
                    }
                }
            }
        }
    }
}

/// Records every batch; answers as the kernel does: the message at `fail_at` (its index in
/// the batch) with `errno`, then the last message.
#[cfg(any(test, feature = "testing"))]
#[derive(Debug, Default)]
pub struct FakeNetlink {
    pub batches: std::sync::Mutex<Vec<Vec<u8>>>,
    pub fail_at: std::sync::Mutex<Option<(u32, i32)>>,
    /// Batches are not sent (as without a socket).
    pub unsendable: std::sync::atomic::AtomicBool,
}

#[cfg(any(test, feature = "testing"))]
impl Netlink for FakeNetlink {
    fn transact(&self, batch: &[u8], first_seq: u32, messages: u32) -> Result<Vec<Ack>, NetlinkError> {
        if self.unsendable.load(std::sync::atomic::Ordering::Relaxed) {
            return Err(NetlinkError::NotSent(io::Error::from_raw_os_error(1)));
        }
        self.batches.lock().expect("not poisoned").push(batch.to_vec());
        let fail = *self.fail_at.lock().expect("not poisoned");
        let last = Ack { seq: first_seq + messages, errno: 0 };
        Ok(match fail {
            Some((at, errno)) if at + 1 == messages => vec![Ack { seq: last.seq, errno }],
            Some((at, errno)) => vec![Ack { seq: first_seq + 1 + at, errno }, last],
            None => vec![last],
        })
    }
}
