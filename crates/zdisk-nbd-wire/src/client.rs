//! A blocking NBD client: one [`Connection`] per socket, over TCP or a
//! Unix socket, written from the specification.
//!
//! Two levels share one object. The high level —
//! [`Connection::connect`], then [`read_at`](Connection::read_at),
//! [`write_at`](Connection::write_at), [`flush`](Connection::flush),
//! [`trim`](Connection::trim), [`write_zeroes`](Connection::write_zeroes),
//! [`block_status`](Connection::block_status) — runs one request at a
//! time, splits what does not fit one request, refuses commands the export
//! does not advertise, and turns an error reply into a
//! [`ClientError::Request`]. The low level sends any option or request and
//! receives replies in the order the server sends them (requests may be
//! pipelined), returning a server's error replies as data; the protocol
//! tests drive the server with it, and reach the raw stream through
//! [`Connection::get_mut`] for what no well-behaved client would send.
//!
//! Invariants:
//! - Everything received is checked before it is used: magic values, the
//!   option a reply answers, the cookie (it must name a request in flight),
//!   every length against a bound fixed before reading it, and that a
//!   read's data chunks stay inside the read and, on success, cover it
//!   exactly. A server that breaks the protocol gets a
//!   [`ClientError::Protocol`] or [`ClientError::Wire`]; the connection is
//!   then out of step and should be dropped.
//! - A read's data goes straight into the caller's buffer (high level) or
//!   one buffer per read (low level): never more than the read's length,
//!   whatever lengths the server announces.
//! - The client never buffers what it reads, so raw reads through
//!   [`Connection::get_mut`] see exactly the bytes it has not consumed.

use std::collections::HashMap;
use std::fmt;
use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use thiserror::Error;

use crate::wire::*;

/// The port an `nbd://` URI means when it names none.
pub const DEFAULT_PORT: u16 = 10809;
/// The largest request this client sends when the server did not say
/// (NBD_INFO_BLOCK_SIZE): the specification's interoperable 32 MiB.
pub const DEFAULT_MAX_PAYLOAD_BYTES: u32 = 32 << 20;
/// Largest option reply data this client reads into memory.
pub const MAX_OPTION_REPLY_BYTES: u32 = 1 << 20;
/// Largest non-data chunk payload (block status, errors) this client reads.
pub const MAX_CHUNK_PAYLOAD_BYTES: u32 = MAX_PAYLOAD_BYTES + 8;
/// Largest range one trim or write-zeroes request covers: 1 GiB, aligned
/// for any block size, within the 32-bit length field.
pub const MAX_RANGE_REQUEST_BYTES: u64 = 1 << 30;
/// Payloads up to this size go out in one write with their request header.
const COALESCE_PAYLOAD_BYTES: usize = 64 << 10;

/// What can go wrong talking to an NBD server.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum ClientError {
    #[error("bad NBD URI {uri:?}: {why}")]
    BadUri { uri: String, why: String },
    #[error("cannot connect to {address}: {source}")]
    Connect { address: String, source: io::Error },
    #[error("the server closed the NBD connection")]
    Closed,
    #[error("NBD connection: {0}")]
    Io(io::Error),
    #[error("malformed NBD message: {0}")]
    Wire(#[from] WireError),
    #[error("the server does not speak fixed newstyle NBD (handshake flags {handshake_flags:#x})")]
    NotFixedNewstyle { handshake_flags: u16 },
    #[error("the server refused option {option} with reply type {reply_type:#x}: {message}")]
    OptionRefused {
        option: u32,
        reply_type: u32,
        message: String,
    },
    #[error("NBD protocol violation: {0}")]
    Protocol(String),
    #[error("the export does not support {}", command_name(*.command))]
    Unsupported { command: u16 },
    #[error("the export is read-only")]
    ReadOnly,
    #[error("NBD {} of {length} bytes at offset {offset} failed with error {error}{}",
        command_name(*.command),
        if .message.is_empty() { String::new() } else { format!(": {}", .message) })]
    Request {
        command: u16,
        offset: u64,
        length: u64,
        error: u32,
        message: String,
    },
}

/// A connection closed mid-message is [`ClientError::Closed`]; any other
/// socket error is [`ClientError::Io`].
impl From<io::Error> for ClientError {
    fn from(error: io::Error) -> ClientError {
        match error.kind() {
            io::ErrorKind::UnexpectedEof
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::BrokenPipe => ClientError::Closed,
            _ => ClientError::Io(error),
        }
    }
}

pub type Result<T, E = ClientError> = std::result::Result<T, E>;

fn protocol(what: impl Into<String>) -> ClientError {
    ClientError::Protocol(what.into())
}

// ---------------------------------------------------------------------------
// Addresses and sockets.

/// Where an NBD server listens, and which export to ask for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Address {
    /// `nbd://HOST[:PORT][/EXPORT]`.
    Tcp { host_port: String, export: String },
    /// `nbd+unix:///[EXPORT]?socket=PATH`.
    Unix { socket: String, export: String },
}

impl Address {
    /// Parses an `nbd://` or `nbd+unix://` URI (the forms libnbd and
    /// qemu accept, without TLS or query parameters other than `socket`).
    pub fn parse(uri: &str) -> Result<Address> {
        let bad = |why: &str| ClientError::BadUri {
            uri: uri.to_string(),
            why: why.to_string(),
        };
        if let Some(rest) = uri.strip_prefix("nbd+unix://") {
            let (path, query) = rest
                .split_once('?')
                .ok_or_else(|| bad("needs ?socket=PATH"))?;
            if !path.is_empty() && !path.starts_with('/') {
                return Err(bad("a Unix socket URI names no host"));
            }
            let socket = query
                .split('&')
                .find_map(|pair| pair.strip_prefix("socket="))
                .filter(|socket| !socket.is_empty())
                .ok_or_else(|| bad("needs ?socket=PATH"))?;
            Ok(Address::Unix {
                socket: socket.to_string(),
                export: path.strip_prefix('/').unwrap_or(path).to_string(),
            })
        } else if let Some(rest) = uri.strip_prefix("nbd://") {
            let (authority, export) = rest.split_once('/').unwrap_or((rest, ""));
            if authority.is_empty() {
                return Err(bad("needs a host"));
            }
            if export.contains('?') {
                return Err(bad("query parameters are not supported"));
            }
            let host_port = match authority.rsplit_once(':') {
                Some((host, port))
                    if !port.is_empty() && port.bytes().all(|b| b.is_ascii_digit()) =>
                {
                    if host.is_empty() {
                        return Err(bad("needs a host"));
                    }
                    authority.to_string()
                }
                _ => format!("{authority}:{DEFAULT_PORT}"),
            };
            Ok(Address::Tcp {
                host_port,
                export: export.to_string(),
            })
        } else {
            Err(bad(
                "expected nbd://HOST[:PORT][/EXPORT] or nbd+unix:///[EXPORT]?socket=PATH",
            ))
        }
    }

    pub fn export(&self) -> &str {
        match self {
            Address::Tcp { export, .. } | Address::Unix { export, .. } => export,
        }
    }
}

impl fmt::Display for Address {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Address::Tcp { host_port, export } => write!(f, "nbd://{host_port}/{export}"),
            Address::Unix { socket, export } => write!(f, "nbd+unix:///{export}?socket={socket}"),
        }
    }
}

/// A connected TCP or Unix socket.
#[derive(Debug)]
pub enum Stream {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Stream {
    /// Connects to `address`; with `io_timeout`, any single read or write
    /// that waits longer fails (`WouldBlock` or `TimedOut`).
    pub fn connect(address: &Address, io_timeout: Option<Duration>) -> Result<Stream> {
        let failed = |source| ClientError::Connect {
            address: address.to_string(),
            source,
        };
        let stream = match address {
            Address::Tcp { host_port, .. } => {
                let stream = TcpStream::connect(host_port.as_str()).map_err(failed)?;
                stream.set_nodelay(true).map_err(failed)?;
                Stream::Tcp(stream)
            }
            Address::Unix { socket, .. } => {
                Stream::Unix(UnixStream::connect(socket).map_err(failed)?)
            }
        };
        stream.set_timeout(io_timeout).map_err(failed)?;
        Ok(stream)
    }

    pub fn set_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        match self {
            Stream::Tcp(stream) => {
                stream.set_read_timeout(timeout)?;
                stream.set_write_timeout(timeout)
            }
            Stream::Unix(stream) => {
                stream.set_read_timeout(timeout)?;
                stream.set_write_timeout(timeout)
            }
        }
    }

    pub fn shutdown(&self, how: Shutdown) -> io::Result<()> {
        match self {
            Stream::Tcp(stream) => stream.shutdown(how),
            Stream::Unix(stream) => stream.shutdown(how),
        }
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(stream) => stream.read(buf),
            Stream::Unix(stream) => stream.read(buf),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(stream) => stream.write(buf),
            Stream::Unix(stream) => stream.write(buf),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

// ---------------------------------------------------------------------------
// What the handshake learns.

/// What [`Connection::connect`] negotiates.
#[derive(Debug, Clone, Default)]
pub struct Config {
    /// Ask for structured replies (implied by `meta_contexts`).
    pub structured_replies: bool,
    /// Metadata contexts to select for block status, e.g. `base:allocation`.
    pub meta_contexts: Vec<String>,
    /// Ask for NBD_INFO_BLOCK_SIZE, which promises the server that every
    /// request respects its minimum block size.
    pub block_sizes: bool,
    /// Fail a single socket read or write that waits longer than this.
    pub io_timeout: Option<Duration>,
}

/// Block size constraints from NBD_INFO_BLOCK_SIZE.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockSizes {
    pub min_bytes: u32,
    pub preferred_bytes: u32,
    pub max_payload_bytes: u32,
}

/// What the server said about the export.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Export {
    pub size_bytes: u64,
    /// Transmission flags (`NBD_FLAG_*`).
    pub flags: u16,
    pub block_sizes: Option<BlockSizes>,
    pub name: Option<String>,
    pub description: Option<String>,
}

impl Export {
    /// The export that a successful NBD_OPT_GO or NBD_OPT_INFO describes,
    /// from all its replies: NBD_REP_INFO items, then NBD_REP_ACK.
    pub fn from_replies(replies: &[OptionReply]) -> Result<Export> {
        let Some((last, infos)) = replies.split_last() else {
            return Err(protocol("no reply to NBD_OPT_GO"));
        };
        if last.reply_type != NBD_REP_ACK {
            return Err(last.refusal());
        }
        let mut export = Export::default();
        let mut saw_export = false;
        for reply in infos {
            if reply.reply_type != NBD_REP_INFO {
                return Err(protocol(format!(
                    "reply type {:#x} before NBD_REP_ACK",
                    reply.reply_type
                )));
            }
            match parse_info_reply(&reply.data)? {
                Info::Export { size_bytes, flags } => {
                    export.size_bytes = size_bytes;
                    export.flags = flags;
                    saw_export = true;
                }
                Info::BlockSize {
                    min_bytes,
                    preferred_bytes,
                    max_payload_bytes,
                } => {
                    export.block_sizes = Some(BlockSizes {
                        min_bytes,
                        preferred_bytes,
                        max_payload_bytes,
                    })
                }
                Info::Name(name) => export.name = Some(text(name)),
                Info::Description(description) => export.description = Some(text(description)),
                Info::Other { .. } => {}
            }
        }
        if !saw_export {
            return Err(protocol("NBD_OPT_GO succeeded without NBD_INFO_EXPORT"));
        }
        Ok(export)
    }

    pub fn has(&self, flag: u16) -> bool {
        self.flags & flag != 0
    }

    /// The largest read or write payload to send in one request.
    pub fn max_payload_bytes(&self) -> u32 {
        self.block_sizes
            .map_or(DEFAULT_MAX_PAYLOAD_BYTES, |sizes| sizes.max_payload_bytes)
            .max(1)
    }
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// One option reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OptionReply {
    pub option: u32,
    pub reply_type: u32,
    pub data: Vec<u8>,
}

impl OptionReply {
    pub fn is_error(&self) -> bool {
        self.reply_type & NBD_REP_FLAG_ERROR != 0
    }

    /// Whether no more replies follow for this option.
    pub fn is_final(&self) -> bool {
        self.reply_type == NBD_REP_ACK || self.is_error()
    }

    /// This reply as a refusal of its option.
    pub fn refusal(&self) -> ClientError {
        ClientError::OptionRefused {
            option: self.option,
            reply_type: self.reply_type,
            message: if self.is_error() {
                text(&self.data)
            } else {
                format!("unexpected reply type {:#x}", self.reply_type)
            },
        }
    }
}

/// A metadata context the server selected, with the id its block status
/// chunks carry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetaContext {
    pub id: u32,
    pub name: String,
}

// ---------------------------------------------------------------------------
// Replies.

/// One structured reply chunk. A data chunk's payload holds only its
/// offset (and a hole's length): the data itself is in [`Reply::data`] or
/// the caller's buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chunk {
    pub flags: u16,
    pub chunk_type: u16,
    pub payload: Vec<u8>,
}

/// A complete reply to one request.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Reply {
    pub cookie: u64,
    /// A simple reply, not structured chunks.
    pub simple: bool,
    /// The error of a simple reply, or of the first error chunk; 0 on success.
    pub error: u32,
    /// The first error chunk's message.
    pub message: String,
    /// A read's data, when the caller gave no buffer for it (empty after
    /// an error reply to a simple read).
    pub data: Vec<u8>,
    pub chunks: Vec<Chunk>,
}

/// One block status chunk: the context it describes and its runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContextStatus {
    pub context_id: u32,
    /// The chunk was marked NBD_REPLY_FLAG_DONE.
    pub done: bool,
    pub descriptors: Vec<Descriptor>,
}

impl Reply {
    /// The block status chunks of this reply, in order.
    pub fn block_status(&self) -> Result<Vec<ContextStatus>> {
        let mut statuses = Vec::new();
        for chunk in &self.chunks {
            if chunk.chunk_type == NBD_REPLY_TYPE_BLOCK_STATUS {
                let (context_id, descriptors) = parse_block_status_chunk(&chunk.payload)?;
                statuses.push(ContextStatus {
                    context_id,
                    done: chunk.flags & NBD_REPLY_FLAG_DONE != 0,
                    descriptors,
                });
            }
        }
        Ok(statuses)
    }
}

/// A request sent and not yet answered.
#[derive(Debug, Clone, Copy)]
struct InFlight {
    command: u16,
    offset: u64,
    length: u32,
}

/// What has arrived of a structured reply.
#[derive(Debug, Default)]
struct Partial {
    chunks: Vec<Chunk>,
    /// A read's data, when the caller gave no buffer.
    data: Vec<u8>,
    /// Bytes of the read that data and hole chunks covered.
    covered_bytes: u64,
    error: u32,
    message: String,
}

// ---------------------------------------------------------------------------
// The connection.

/// One NBD connection; see the module documentation.
#[derive(Debug)]
pub struct Connection<S = Stream> {
    stream: S,
    no_zeroes: bool,
    structured: bool,
    contexts: Vec<MetaContext>,
    export: Option<Export>,
    last_cookie: u64,
    in_flight: HashMap<u64, InFlight>,
    partial: HashMap<u64, Partial>,
    /// A request header with a small payload, sent with one write.
    send: Vec<u8>,
}

impl Connection<Stream> {
    /// Connects to an `nbd://` or `nbd+unix://` URI and negotiates per
    /// `config`, ending with NBD_OPT_GO.
    pub fn connect(uri: &str, config: &Config) -> Result<Connection> {
        Connection::connect_to(&Address::parse(uri)?, config)
    }

    pub fn connect_to(address: &Address, config: &Config) -> Result<Connection> {
        let stream = Stream::connect(address, config.io_timeout)?;
        Connection::handshake(stream, address.export(), config)
    }
}

impl<S: Read + Write> Connection<S> {
    /// A connection over `stream`, before anything is exchanged.
    pub fn new(stream: S) -> Connection<S> {
        Connection {
            stream,
            no_zeroes: false,
            structured: false,
            contexts: Vec::new(),
            export: None,
            last_cookie: 0,
            in_flight: HashMap::new(),
            partial: HashMap::new(),
            send: Vec::new(),
        }
    }

    /// The whole handshake over `stream`: greeting, structured replies and
    /// metadata contexts if `config` asks, then NBD_OPT_GO (or, from a
    /// server that does not know it, NBD_OPT_EXPORT_NAME).
    pub fn handshake(stream: S, export: &str, config: &Config) -> Result<Connection<S>> {
        let mut connection = Connection::new(stream);
        connection.start_handshake()?;
        if config.structured_replies || !config.meta_contexts.is_empty() {
            connection.structured_replies()?;
        }
        if !config.meta_contexts.is_empty() {
            let queries: Vec<&str> = config.meta_contexts.iter().map(String::as_str).collect();
            let selected = connection.set_meta_contexts(export, &queries)?;
            if let Some(missing) = queries
                .iter()
                .find(|query| !selected.iter().any(|context| context.name == **query))
            {
                return Err(ClientError::OptionRefused {
                    option: NBD_OPT_SET_META_CONTEXT,
                    reply_type: NBD_REP_ACK,
                    message: format!("context {missing} was not selected"),
                });
            }
        }
        let infos: &[u16] = if config.block_sizes {
            &[NBD_INFO_BLOCK_SIZE]
        } else {
            &[]
        };
        match connection.go(export, infos).map(drop) {
            Err(ClientError::OptionRefused {
                reply_type: NBD_REP_ERR_UNSUP,
                ..
            }) if !connection.structured => {
                connection.export_name(export)?;
            }
            other => other?,
        }
        Ok(connection)
    }

    pub fn get_ref(&self) -> &S {
        &self.stream
    }

    /// The raw stream, for bytes no well-behaved client sends. Anything
    /// read or written through it is unknown to the connection.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.stream
    }

    pub fn into_inner(self) -> S {
        self.stream
    }

    /// The export, once NBD_OPT_GO or NBD_OPT_EXPORT_NAME succeeded.
    pub fn export(&self) -> Option<&Export> {
        self.export.as_ref()
    }

    /// Whether structured replies were negotiated.
    pub fn structured(&self) -> bool {
        self.structured
    }

    /// The metadata contexts the last NBD_OPT_SET_META_CONTEXT selected.
    pub fn meta_contexts(&self) -> &[MetaContext] {
        &self.contexts
    }

    // -- handshake ---------------------------------------------------------

    /// Reads the server greeting; returns the handshake flags.
    pub fn read_greeting(&mut self) -> Result<u16> {
        let mut greeting = [0u8; GREETING_BYTES];
        self.stream.read_exact(&mut greeting)?;
        Ok(parse_greeting(&greeting)?)
    }

    pub fn send_client_flags(&mut self, flags: u32) -> Result<()> {
        self.no_zeroes = flags & NBD_FLAG_C_NO_ZEROES != 0;
        self.stream.write_all(&flags.to_be_bytes())?;
        Ok(())
    }

    /// Reads the greeting, requires fixed newstyle, and answers with
    /// FIXED_NEWSTYLE (and NO_ZEROES when offered). Returns the handshake
    /// flags.
    pub fn start_handshake(&mut self) -> Result<u16> {
        let handshake_flags = self.read_greeting()?;
        if handshake_flags & NBD_FLAG_FIXED_NEWSTYLE == 0 {
            return Err(ClientError::NotFixedNewstyle { handshake_flags });
        }
        let mut flags = NBD_FLAG_C_FIXED_NEWSTYLE;
        if handshake_flags & NBD_FLAG_NO_ZEROES != 0 {
            flags |= NBD_FLAG_C_NO_ZEROES;
        }
        self.send_client_flags(flags)?;
        Ok(handshake_flags)
    }

    pub fn send_option(&mut self, option: u32, data: &[u8]) -> Result<()> {
        self.send.clear();
        put_option_request(&mut self.send, option, data);
        self.stream.write_all(&self.send)?;
        Ok(())
    }

    /// Reads one option reply, which must answer `option`.
    pub fn option_reply(&mut self, option: u32) -> Result<OptionReply> {
        let mut header = [0u8; OPTION_REPLY_HEADER_BYTES];
        self.stream.read_exact(&mut header)?;
        let header = parse_option_reply_header(&header)?;
        if header.option != option {
            return Err(protocol(format!(
                "a reply to option {} while waiting for option {option}",
                header.option
            )));
        }
        if header.length > MAX_OPTION_REPLY_BYTES {
            return Err(protocol(format!(
                "an option reply of {} bytes",
                header.length
            )));
        }
        let mut data = vec![0u8; header.length as usize];
        self.stream.read_exact(&mut data)?;
        Ok(OptionReply {
            option,
            reply_type: header.reply_type,
            data,
        })
    }

    /// Reads replies to `option` up to the final one (ACK or an error).
    pub fn option_replies(&mut self, option: u32) -> Result<Vec<OptionReply>> {
        let mut replies = Vec::new();
        loop {
            let reply = self.option_reply(option)?;
            let last = reply.is_final();
            replies.push(reply);
            if last {
                return Ok(replies);
            }
        }
    }

    /// Sends an option and reads all its replies.
    pub fn option(&mut self, option: u32, data: &[u8]) -> Result<Vec<OptionReply>> {
        self.send_option(option, data)?;
        self.option_replies(option)
    }

    /// NBD_OPT_STRUCTURED_REPLY.
    pub fn structured_replies(&mut self) -> Result<()> {
        let replies = self.option(NBD_OPT_STRUCTURED_REPLY, &[])?;
        let last = replies
            .last()
            .expect("option_replies returns the final reply");
        if replies.len() != 1 || last.reply_type != NBD_REP_ACK {
            return Err(last.refusal());
        }
        self.structured = true;
        Ok(())
    }

    /// NBD_OPT_SET_META_CONTEXT; returns the contexts the server selected.
    pub fn set_meta_contexts(&mut self, export: &str, queries: &[&str]) -> Result<&[MetaContext]> {
        let mut data = Vec::new();
        put_meta_context_data(&mut data, export, queries);
        let replies = self.option(NBD_OPT_SET_META_CONTEXT, &data)?;
        let (last, selected) = replies.split_last().expect("at least the final reply");
        if last.reply_type != NBD_REP_ACK {
            return Err(last.refusal());
        }
        let mut contexts = Vec::with_capacity(selected.len());
        for reply in selected {
            if reply.reply_type != NBD_REP_META_CONTEXT {
                return Err(protocol(format!(
                    "reply type {:#x} to NBD_OPT_SET_META_CONTEXT",
                    reply.reply_type
                )));
            }
            let (id, name) = parse_meta_context_reply(&reply.data)?;
            contexts.push(MetaContext {
                id,
                name: text(name),
            });
        }
        self.contexts = contexts;
        Ok(&self.contexts)
    }

    /// NBD_OPT_GO, asking for the information types `info_requests`; on
    /// success the connection is in the transmission phase.
    pub fn go(&mut self, export: &str, info_requests: &[u16]) -> Result<&Export> {
        let mut data = Vec::new();
        put_go_data(&mut data, export, info_requests);
        let replies = self.option(NBD_OPT_GO, &data)?;
        Ok(self.export.insert(Export::from_replies(&replies)?))
    }

    /// NBD_OPT_EXPORT_NAME, the old way into the transmission phase (a
    /// server refuses an unknown name by closing the connection).
    pub fn export_name(&mut self, export: &str) -> Result<&Export> {
        self.send_option(NBD_OPT_EXPORT_NAME, export.as_bytes())?;
        let mut reply = [0u8; 10];
        self.stream.read_exact(&mut reply)?;
        let (size_bytes, flags) = parse_export_name_reply(&reply)?;
        if !self.no_zeroes {
            self.stream
                .read_exact(&mut [0u8; EXPORT_NAME_PADDING_BYTES])?;
        }
        Ok(self.export.insert(Export {
            size_bytes,
            flags,
            ..Export::default()
        }))
    }

    // -- transmission: the low level ----------------------------------------

    /// A fresh cookie. Cookies use all 64 bits, so a server that drops the
    /// high half is caught.
    pub fn next_cookie(&mut self) -> u64 {
        self.last_cookie += 1;
        self.last_cookie.wrapping_mul(0x1_0000_0001)
    }

    /// Sends a request header and `payload` exactly as given (a write's
    /// payload may be short here and follow through [`get_mut`](Self::get_mut))
    /// and returns its cookie. The reply comes from
    /// [`receive_reply`](Self::receive_reply).
    pub fn send_request(
        &mut self,
        flags: u16,
        command: u16,
        offset: u64,
        length: u32,
        payload: &[u8],
    ) -> Result<u64> {
        let cookie = self.next_cookie();
        self.send.clear();
        put_request_header(
            &mut self.send,
            &RequestHeader {
                flags,
                command,
                cookie,
                offset,
                length,
            },
        );
        if payload.len() <= COALESCE_PAYLOAD_BYTES {
            self.send.extend_from_slice(payload);
            self.stream.write_all(&self.send)?;
        } else {
            self.stream.write_all(&self.send)?;
            self.stream.write_all(payload)?;
        }
        if command != NBD_CMD_DISC {
            self.in_flight.insert(
                cookie,
                InFlight {
                    command,
                    offset,
                    length,
                },
            );
        }
        Ok(cookie)
    }

    /// Reads until some request's reply is complete and returns it; a
    /// read's data is in [`Reply::data`].
    pub fn receive_reply(&mut self) -> Result<Reply> {
        self.receive(None)
    }

    /// Sends a request and waits for its reply, which must be the next one
    /// to complete. Error replies are returned, not turned into errors.
    pub fn request(
        &mut self,
        flags: u16,
        command: u16,
        offset: u64,
        length: u32,
        payload: &[u8],
    ) -> Result<Reply> {
        let cookie = self.send_request(flags, command, offset, length, payload)?;
        let reply = self.receive_reply()?;
        if reply.cookie != cookie {
            return Err(protocol(format!(
                "a reply to cookie {:#x} while waiting for {cookie:#x}",
                reply.cookie
            )));
        }
        Ok(reply)
    }

    /// NBD_CMD_DISC: the server closes the connection without a reply.
    pub fn disconnect(mut self) -> Result<()> {
        self.send_request(0, NBD_CMD_DISC, 0, 0, &[])?;
        Ok(())
    }

    /// Reads messages until a reply completes. With `into`, the one request
    /// in flight is a read whose data lands there.
    fn receive(&mut self, mut into: Option<&mut [u8]>) -> Result<Reply> {
        loop {
            // Every reply message is at least a simple reply long, so its
            // first 16 bytes come in one read.
            let mut head = [0u8; CHUNK_HEADER_BYTES];
            self.stream.read_exact(&mut head[..SIMPLE_REPLY_BYTES])?;
            let magic = u32::from_be_bytes(head[..4].try_into().expect("4 bytes"));
            let reply = match magic {
                NBD_SIMPLE_REPLY_MAGIC => {
                    Some(self.receive_simple(&head[..SIMPLE_REPLY_BYTES], into.as_deref_mut())?)
                }
                NBD_STRUCTURED_REPLY_MAGIC => {
                    self.stream.read_exact(&mut head[SIMPLE_REPLY_BYTES..])?;
                    self.receive_chunk(&head, into.as_deref_mut())?
                }
                actual => {
                    return Err(ClientError::Wire(WireError::BadMagic {
                        expected: u64::from(NBD_SIMPLE_REPLY_MAGIC),
                        actual: u64::from(actual),
                    }))
                }
            };
            if let Some(reply) = reply {
                return Ok(reply);
            }
        }
    }

    fn take_in_flight(&mut self, cookie: u64) -> Result<InFlight> {
        self.in_flight
            .remove(&cookie)
            .ok_or_else(|| protocol(format!("a reply to cookie {cookie:#x}, not in flight")))
    }

    fn receive_simple(&mut self, bytes: &[u8], into: Option<&mut [u8]>) -> Result<Reply> {
        let simple = parse_simple_reply(bytes)?;
        if self.partial.contains_key(&simple.cookie) {
            return Err(protocol("a simple reply after structured chunks"));
        }
        let request = self.take_in_flight(simple.cookie)?;
        let mut reply = Reply {
            cookie: simple.cookie,
            simple: true,
            error: simple.error,
            ..Reply::default()
        };
        if request.command == NBD_CMD_READ {
            if self.structured {
                return Err(protocol(
                    "a simple reply to a read with structured replies negotiated",
                ));
            }
            if simple.error == 0 {
                match into {
                    Some(buffer) => self.stream.read_exact(buffer)?,
                    None => {
                        reply.data = vec![0u8; request.length as usize];
                        self.stream.read_exact(&mut reply.data)?;
                    }
                }
            }
        }
        Ok(reply)
    }

    /// Reads one chunk; returns the reply if the chunk completed it.
    fn receive_chunk(&mut self, bytes: &[u8], into: Option<&mut [u8]>) -> Result<Option<Reply>> {
        let header = parse_chunk_header(bytes)?;
        if !self.structured {
            return Err(protocol("a structured reply that was not negotiated"));
        }
        let request = *self.in_flight.get(&header.cookie).ok_or_else(|| {
            protocol(format!(
                "a chunk for cookie {:#x}, not in flight",
                header.cookie
            ))
        })?;
        let mut partial = self.partial.remove(&header.cookie).unwrap_or_default();
        let payload = match header.chunk_type {
            NBD_REPLY_TYPE_OFFSET_DATA | NBD_REPLY_TYPE_OFFSET_HOLE => {
                self.receive_data(&header, &request, &mut partial, into)?
            }
            NBD_REPLY_TYPE_NONE => {
                if header.length != 0 || header.flags & NBD_REPLY_FLAG_DONE == 0 {
                    return Err(protocol("a NONE chunk with a payload or not final"));
                }
                Vec::new()
            }
            chunk_type => {
                let is_error = chunk_type & (1 << 15) != 0;
                if chunk_type != NBD_REPLY_TYPE_BLOCK_STATUS && !is_error {
                    return Err(protocol(format!("unknown chunk type {chunk_type}")));
                }
                if chunk_type == NBD_REPLY_TYPE_BLOCK_STATUS
                    && request.command != NBD_CMD_BLOCK_STATUS
                {
                    return Err(protocol("block status chunk for another command"));
                }
                if header.length > MAX_CHUNK_PAYLOAD_BYTES {
                    return Err(protocol(format!("a chunk of {} bytes", header.length)));
                }
                let mut payload = vec![0u8; header.length as usize];
                self.stream.read_exact(&mut payload)?;
                if is_error {
                    let error = parse_error_chunk(chunk_type, &payload)?;
                    if partial.error == 0 {
                        partial.error = error.error;
                        partial.message = text(error.message);
                    }
                }
                payload
            }
        };
        partial.chunks.push(Chunk {
            flags: header.flags,
            chunk_type: header.chunk_type,
            payload,
        });
        if header.flags & NBD_REPLY_FLAG_DONE == 0 {
            self.partial.insert(header.cookie, partial);
            return Ok(None);
        }
        self.in_flight.remove(&header.cookie);
        if request.command == NBD_CMD_READ
            && partial.error == 0
            && partial.covered_bytes != u64::from(request.length)
        {
            return Err(protocol(format!(
                "a successful read of {} bytes answered with {} bytes",
                request.length, partial.covered_bytes
            )));
        }
        let mut data = partial.data;
        if partial.error != 0 {
            data.clear();
        }
        Ok(Some(Reply {
            cookie: header.cookie,
            simple: false,
            error: partial.error,
            message: partial.message,
            data,
            chunks: partial.chunks,
        }))
    }

    /// An OFFSET_DATA or OFFSET_HOLE chunk: checks that it lies inside the
    /// read, puts its bytes in place, returns its payload without the data.
    fn receive_data(
        &mut self,
        header: &ChunkHeader,
        request: &InFlight,
        partial: &mut Partial,
        into: Option<&mut [u8]>,
    ) -> Result<Vec<u8>> {
        if request.command != NBD_CMD_READ {
            return Err(protocol("a data chunk for a command other than read"));
        }
        let hole = header.chunk_type == NBD_REPLY_TYPE_OFFSET_HOLE;
        let fixed_bytes: u32 = if hole { 12 } else { 8 };
        if (hole && header.length != fixed_bytes) || (!hole && header.length <= fixed_bytes) {
            return Err(protocol(format!("a data chunk of {} bytes", header.length)));
        }
        let mut fixed = vec![0u8; fixed_bytes as usize];
        self.stream.read_exact(&mut fixed)?;
        let offset = u64::from_be_bytes(fixed[..8].try_into().expect("8 bytes"));
        let length = if hole {
            u32::from_be_bytes(fixed[8..12].try_into().expect("4 bytes"))
        } else {
            header.length - fixed_bytes
        };
        let end = offset.checked_add(u64::from(length));
        let request_end = request.offset + u64::from(request.length);
        if offset < request.offset || end.is_none_or(|end| end > request_end) || length == 0 {
            return Err(protocol(format!(
                "{length} bytes at offset {offset} answer a read of {} at {}",
                request.length, request.offset
            )));
        }
        let buffer: &mut [u8] = match into {
            Some(buffer) => buffer,
            None => {
                if partial.data.is_empty() {
                    partial.data = vec![0u8; request.length as usize];
                }
                &mut partial.data
            }
        };
        let start = (offset - request.offset) as usize;
        let target = &mut buffer[start..start + length as usize];
        if hole {
            target.fill(0);
        } else {
            self.stream.read_exact(target)?;
        }
        partial.covered_bytes += u64::from(length);
        Ok(fixed)
    }

    // -- transmission: the high level ----------------------------------------

    /// The export, for a high-level call: none may start while a request
    /// is unanswered (after an error the connection is out of step).
    fn ready_export(&self) -> Result<&Export> {
        if !self.in_flight.is_empty() {
            return Err(protocol(format!(
                "{} requests unanswered: the connection is out of step",
                self.in_flight.len()
            )));
        }
        Ok(self
            .export
            .as_ref()
            .expect("the handshake ended in the transmission phase"))
    }

    fn writable_export(&self) -> Result<&Export> {
        let export = self.ready_export()?;
        if export.has(NBD_FLAG_READ_ONLY) {
            return Err(ClientError::ReadOnly);
        }
        Ok(export)
    }

    fn require(&self, flag: u16, command: u16) -> Result<()> {
        if self.ready_export()?.has(flag) {
            Ok(())
        } else {
            Err(ClientError::Unsupported { command })
        }
    }

    fn succeeded(reply: Reply, command: u16, offset: u64, length: u64) -> Result<Reply> {
        if reply.error == 0 {
            return Ok(reply);
        }
        Err(ClientError::Request {
            command,
            offset,
            length,
            error: reply.error,
            message: reply.message,
        })
    }

    /// Fills `buf` from `offset`, in requests of at most the export's
    /// maximum payload.
    pub fn read_at(&mut self, offset: u64, buf: &mut [u8]) -> Result<()> {
        let max = self.ready_export()?.max_payload_bytes() as usize;
        let mut done = 0;
        let total = buf.len();
        while done < total {
            let piece = &mut buf[done..(done + max).min(total)];
            let at = offset + done as u64;
            let length = piece.len() as u32;
            let cookie = self.send_request(0, NBD_CMD_READ, at, length, &[])?;
            let reply = self.receive(Some(&mut *piece))?;
            assert_eq!(reply.cookie, cookie, "the only request in flight");
            Self::succeeded(reply, NBD_CMD_READ, at, u64::from(length))?;
            done += piece.len();
        }
        Ok(())
    }

    /// Writes `data` at `offset`, in requests of at most the export's
    /// maximum payload.
    pub fn write_at(&mut self, offset: u64, data: &[u8]) -> Result<()> {
        let max = self.writable_export()?.max_payload_bytes() as usize;
        for (index, piece) in data.chunks(max).enumerate() {
            let at = offset + (index * max) as u64;
            let reply = self.request(0, NBD_CMD_WRITE, at, piece.len() as u32, piece)?;
            Self::succeeded(reply, NBD_CMD_WRITE, at, piece.len() as u64)?;
        }
        Ok(())
    }

    /// Makes every write completed before it durable.
    pub fn flush(&mut self) -> Result<()> {
        self.require(NBD_FLAG_SEND_FLUSH, NBD_CMD_FLUSH)?;
        let reply = self.request(0, NBD_CMD_FLUSH, 0, 0, &[])?;
        Self::succeeded(reply, NBD_CMD_FLUSH, 0, 0).map(drop)
    }

    /// A range command (trim, write zeroes) in pieces of at most
    /// [`MAX_RANGE_REQUEST_BYTES`].
    fn range_command(&mut self, command: u16, flag: u16, offset: u64, length: u64) -> Result<()> {
        self.writable_export()?;
        self.require(flag, command)?;
        let mut done = 0;
        while done < length {
            let piece = (length - done).min(MAX_RANGE_REQUEST_BYTES);
            let at = offset + done;
            let reply = self.request(0, command, at, piece as u32, &[])?;
            Self::succeeded(reply, command, at, piece)?;
            done += piece;
        }
        Ok(())
    }

    /// NBD_CMD_TRIM: the range may read back as anything until written.
    pub fn trim(&mut self, offset: u64, length: u64) -> Result<()> {
        self.range_command(NBD_CMD_TRIM, NBD_FLAG_SEND_TRIM, offset, length)
    }

    /// NBD_CMD_WRITE_ZEROES: the range reads back as zeros.
    pub fn write_zeroes(&mut self, offset: u64, length: u64) -> Result<()> {
        self.range_command(
            NBD_CMD_WRITE_ZEROES,
            NBD_FLAG_SEND_WRITE_ZEROES,
            offset,
            length,
        )
    }

    /// NBD_CMD_BLOCK_STATUS over at most `length` bytes at `offset`: one
    /// [`ContextStatus`] per selected context (the server may describe less
    /// than asked for).
    pub fn block_status(&mut self, offset: u64, length: u32) -> Result<Vec<ContextStatus>> {
        self.ready_export()?;
        if self.contexts.is_empty() {
            return Err(ClientError::Unsupported {
                command: NBD_CMD_BLOCK_STATUS,
            });
        }
        let reply = self.request(0, NBD_CMD_BLOCK_STATUS, offset, length, &[])?;
        let reply = Self::succeeded(reply, NBD_CMD_BLOCK_STATUS, offset, u64::from(length))?;
        let statuses = reply.block_status()?;
        for status in &statuses {
            if !self.contexts.iter().any(|c| c.id == status.context_id) {
                return Err(protocol(format!(
                    "block status for context {}, never selected",
                    status.context_id
                )));
            }
        }
        Ok(statuses)
    }
}

#[cfg(test)]
mod tests {
    //! URI parsing, and the client against scripted server bytes: every
    //! framing mistake a server could make is an error, never a panic or
    //! a read past the request.

    use super::*;

    #[test]
    fn parses_tcp_and_unix_uris() {
        assert_eq!(
            Address::parse("nbd://127.0.0.1:10810/vol").unwrap(),
            Address::Tcp {
                host_port: "127.0.0.1:10810".into(),
                export: "vol".into()
            }
        );
        assert_eq!(
            Address::parse("nbd://localhost").unwrap(),
            Address::Tcp {
                host_port: "localhost:10809".into(),
                export: String::new()
            }
        );
        assert_eq!(
            Address::parse("nbd+unix:///disk?socket=/tmp/s").unwrap(),
            Address::Unix {
                socket: "/tmp/s".into(),
                export: "disk".into()
            }
        );
        assert_eq!(
            Address::parse("nbd+unix://?socket=/tmp/s")
                .unwrap()
                .export(),
            ""
        );
        let address = Address::parse("nbd+unix:///x?socket=/tmp/s").unwrap();
        assert_eq!(Address::parse(&address.to_string()).unwrap(), address);
    }

    #[test]
    fn refuses_bad_uris() {
        for uri in [
            "",
            "http://x",
            "nbd://",
            "nbd://:10809",
            "nbd://host/export?tls=on",
            "nbd+unix:///",
            "nbd+unix:///?socket=",
            "nbd+unix://host/?socket=/tmp/s",
        ] {
            assert!(
                matches!(Address::parse(uri), Err(ClientError::BadUri { .. })),
                "{uri:?} was accepted"
            );
        }
    }

    /// A scripted server: what it will send, and what the client wrote.
    struct Script {
        incoming: io::Cursor<Vec<u8>>,
        outgoing: Vec<u8>,
    }

    impl Read for Script {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            self.incoming.read(buf)
        }
    }

    impl Write for Script {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.outgoing.extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    /// A connection in the transmission phase, structured or not, whose
    /// server will send `incoming`.
    fn scripted(structured: bool, incoming: Vec<u8>) -> Connection<Script> {
        let mut connection = Connection::new(Script {
            incoming: io::Cursor::new(incoming),
            outgoing: Vec::new(),
        });
        connection.structured = structured;
        connection.export = Some(Export {
            size_bytes: 1 << 20,
            flags: NBD_FLAG_HAS_FLAGS | NBD_FLAG_SEND_FLUSH,
            ..Export::default()
        });
        connection
    }

    /// The cookie the connection's first request gets.
    fn first_cookie() -> u64 {
        Connection::new(io::Cursor::new(Vec::new())).next_cookie()
    }

    fn data_chunk(cookie: u64, flags: u16, offset: u64, data: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        put_chunk_header(
            &mut out,
            flags,
            NBD_REPLY_TYPE_OFFSET_DATA,
            cookie,
            8 + data.len() as u32,
        );
        out.extend_from_slice(&offset.to_be_bytes());
        out.extend_from_slice(data);
        out
    }

    #[test]
    fn reads_assemble_data_and_hole_chunks_in_any_order() {
        let cookie = first_cookie();
        let mut incoming = data_chunk(cookie, 0, 4096 + 8, &[7u8; 8]);
        put_chunk_header(&mut incoming, 0, NBD_REPLY_TYPE_OFFSET_HOLE, cookie, 12);
        incoming.extend_from_slice(&4096u64.to_be_bytes());
        incoming.extend_from_slice(&8u32.to_be_bytes());
        put_chunk_none(&mut incoming, cookie);
        let mut connection = scripted(true, incoming);
        let mut buf = [0xffu8; 16];
        connection.read_at(4096, &mut buf).unwrap();
        assert_eq!(buf[..8], [0u8; 8]);
        assert_eq!(buf[8..], [7u8; 8]);
    }

    #[test]
    fn a_read_not_fully_covered_is_a_protocol_error() {
        let cookie = first_cookie();
        let incoming = data_chunk(cookie, NBD_REPLY_FLAG_DONE, 0, &[1u8; 8]);
        let mut connection = scripted(true, incoming);
        let mut buf = [0u8; 16];
        let error = connection.read_at(0, &mut buf).unwrap_err();
        assert!(matches!(error, ClientError::Protocol(_)), "{error}");
    }

    #[test]
    fn data_outside_the_read_is_refused_before_it_is_read() {
        let cookie = first_cookie();
        for (offset, length) in [(4095u64, 8usize), (4096 + 12, 8), (u64::MAX - 3, 8)] {
            let incoming = data_chunk(cookie, NBD_REPLY_FLAG_DONE, offset, &vec![1u8; length]);
            let mut connection = scripted(true, incoming);
            let mut buf = [0u8; 16];
            let error = connection.read_at(4096, &mut buf).unwrap_err();
            assert!(
                matches!(error, ClientError::Protocol(_)),
                "{offset}: {error}"
            );
            assert_eq!(buf, [0u8; 16], "nothing written for offset {offset}");
        }
    }

    #[test]
    fn error_chunks_become_request_errors_with_their_message() {
        let cookie = first_cookie();
        let mut incoming = Vec::new();
        put_chunk_error(&mut incoming, cookie, NBD_EIO, "medium error");
        let mut connection = scripted(true, incoming);
        let error = connection.read_at(0, &mut [0u8; 512]).unwrap_err();
        match error {
            ClientError::Request {
                command,
                error,
                message,
                ..
            } => {
                assert_eq!(command, NBD_CMD_READ);
                assert_eq!(error, NBD_EIO);
                assert_eq!(message, "medium error");
            }
            other => panic!("{other}"),
        }
    }

    #[test]
    fn replies_to_unknown_cookies_and_wrong_magic_are_refused() {
        let mut incoming = Vec::new();
        put_simple_reply(&mut incoming, 0, first_cookie() + 1);
        let mut connection = scripted(false, incoming);
        assert!(matches!(
            connection.flush().unwrap_err(),
            ClientError::Protocol(_)
        ));

        let mut connection = scripted(false, [0x12, 0x34, 0x56, 0x78].repeat(4));
        assert!(matches!(
            connection.flush().unwrap_err(),
            ClientError::Wire(WireError::BadMagic { .. })
        ));

        // A structured chunk that was never negotiated.
        let mut incoming = Vec::new();
        put_chunk_none(&mut incoming, first_cookie());
        let mut connection = scripted(false, incoming);
        assert!(matches!(
            connection.flush().unwrap_err(),
            ClientError::Protocol(_)
        ));
    }

    /// What a well-behaved server sends for [`run_session`]: the
    /// handshake (structured replies, base:allocation, GO), then replies
    /// to a 4 KiB read, a block status and a flush.
    fn good_session() -> Vec<u8> {
        let mut out = Vec::new();
        put_greeting(&mut out, NBD_FLAG_FIXED_NEWSTYLE | NBD_FLAG_NO_ZEROES);
        put_option_reply(&mut out, NBD_OPT_STRUCTURED_REPLY, NBD_REP_ACK, &[]);
        put_meta_context(&mut out, NBD_OPT_SET_META_CONTEXT, 1, BASE_ALLOCATION);
        put_option_reply(&mut out, NBD_OPT_SET_META_CONTEXT, NBD_REP_ACK, &[]);
        let flags = NBD_FLAG_HAS_FLAGS | NBD_FLAG_SEND_FLUSH | NBD_FLAG_SEND_DF;
        put_info_export(&mut out, NBD_OPT_GO, 1 << 20, flags);
        put_info_block_size(&mut out, NBD_OPT_GO, 512, 4096, 1 << 20);
        put_option_reply(&mut out, NBD_OPT_GO, NBD_REP_ACK, &[]);
        let mut cookies = Connection::new(io::Cursor::new(Vec::new()));
        let read = cookies.next_cookie();
        out.extend(data_chunk(read, 0, 0, &[9u8; 2048]));
        put_chunk_header(
            &mut out,
            NBD_REPLY_FLAG_DONE,
            NBD_REPLY_TYPE_OFFSET_HOLE,
            read,
            12,
        );
        out.extend_from_slice(&2048u64.to_be_bytes());
        out.extend_from_slice(&2048u32.to_be_bytes());
        let descriptors = [Descriptor {
            length_bytes: 4096,
            flags: NBD_STATE_HOLE | NBD_STATE_ZERO,
        }];
        put_block_status_chunk(&mut out, cookies.next_cookie(), 1, &descriptors, true);
        put_simple_reply(&mut out, 0, cookies.next_cookie());
        out
    }

    /// A whole session against scripted bytes; the first error ends it.
    fn run_session(incoming: Vec<u8>) -> Result<Vec<u8>> {
        let script = Script {
            incoming: io::Cursor::new(incoming),
            outgoing: Vec::new(),
        };
        let config = Config {
            meta_contexts: vec![BASE_ALLOCATION.to_string()],
            block_sizes: true,
            ..Config::default()
        };
        let mut connection = Connection::handshake(script, "", &config)?;
        let mut buf = vec![0xeeu8; 4096];
        connection.read_at(0, &mut buf)?;
        connection.block_status(0, 4096)?;
        connection.flush()?;
        Ok(buf)
    }

    #[test]
    fn a_scripted_session_succeeds_and_any_damage_to_it_is_an_error_not_a_panic() {
        let good = good_session();
        let mut expected = vec![9u8; 2048];
        expected.resize(4096, 0);
        assert_eq!(run_session(good.clone()).unwrap(), expected);
        // Seeded damage: a few bytes changed, or the stream cut short. The
        // outcome may be success (a changed byte that does not matter) or
        // any error; it must never be a panic or a read outside the buffer.
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let mut failures = 0;
        for _ in 0..4000 {
            let mut damaged = good.clone();
            if next() % 4 == 0 {
                damaged.truncate((next() % good.len() as u64) as usize);
            } else {
                for _ in 0..1 + next() % 4 {
                    let at = (next() % good.len() as u64) as usize;
                    damaged[at] = next() as u8;
                }
            }
            if run_session(damaged).is_err() {
                failures += 1;
            }
        }
        assert!(failures > 1000, "only {failures} damaged sessions failed");
    }

    #[test]
    fn a_server_gone_mid_reply_is_a_closed_connection() {
        let mut incoming = Vec::new();
        put_simple_reply(&mut incoming, 0, first_cookie());
        incoming.truncate(10);
        let mut connection = scripted(false, incoming);
        let error = connection.flush().unwrap_err();
        assert!(matches!(error, ClientError::Closed), "{error}");
        assert_eq!(error.to_string(), "the server closed the NBD connection");
    }

    #[test]
    fn commands_the_export_does_not_advertise_are_not_sent() {
        let mut connection = scripted(false, Vec::new());
        assert!(matches!(
            connection.trim(0, 4096).unwrap_err(),
            ClientError::Unsupported {
                command: NBD_CMD_TRIM
            }
        ));
        assert!(matches!(
            connection.block_status(0, 4096).unwrap_err(),
            ClientError::Unsupported { .. }
        ));
        connection.export.as_mut().unwrap().flags |= NBD_FLAG_READ_ONLY;
        assert!(matches!(
            connection.write_at(0, &[0u8; 512]).unwrap_err(),
            ClientError::ReadOnly
        ));
        assert!(connection.get_ref().outgoing.is_empty());
    }

    #[test]
    fn requests_are_encoded_as_the_server_parses_them() {
        let mut connection = scripted(false, Vec::new());
        let cookie = connection
            .send_request(NBD_CMD_FLAG_FUA, NBD_CMD_WRITE, 4096, 3, b"abc")
            .unwrap();
        let sent = &connection.get_ref().outgoing;
        assert_eq!(
            parse_request_header(&sent[..REQUEST_HEADER_BYTES]).unwrap(),
            RequestHeader {
                flags: NBD_CMD_FLAG_FUA,
                command: NBD_CMD_WRITE,
                cookie,
                offset: 4096,
                length: 3,
            }
        );
        assert_eq!(&sent[REQUEST_HEADER_BYTES..], b"abc");
        assert_ne!(cookie >> 32, 0, "cookies use the high half");
    }
}
