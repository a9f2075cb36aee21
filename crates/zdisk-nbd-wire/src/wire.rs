//! The NBD wire format: every protocol constant, plus pure parsers and
//! encoders for the messages a server and a client exchange.
//!
//! This is the only module in zdisk that lays out NBD bytes. Each side has
//! its own half: the server parses options and requests and encodes
//! replies; the client ([`crate::client`]) encodes options and requests and
//! parses replies. The halves share only the constants, so a layout
//! mistake in one is caught by the other's tests, or by a foreign peer
//! (nbdkit, libnbd), instead of being mirrored. Constants keep
//! the names the specification (`doc/proto.md` of the NetworkBlockDevice
//! project) gives them, so each one can be checked against the text by
//! searching for its name. Every integer on the wire is big-endian.
//!
//! Invariants:
//! - Parsers take a complete message as a byte slice, check every length
//!   field against that slice before using it, and return [`WireError`] for
//!   anything malformed. They never panic and never allocate more than a
//!   small multiple of the slice they were given, so a fuzzer can feed them
//!   arbitrary bytes.
//! - Encoders append to a `Vec<u8>` and only ever emit well-formed messages;
//!   a caller passing something unencodable (a string over the protocol's
//!   4096-byte limit, say) is a programmer error and panics.

use thiserror::Error;

// ---------------------------------------------------------------------------
// Magic numbers.

/// `NBDMAGIC`, the first 8 bytes the server sends.
pub const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
/// `IHAVEOPT`: the newstyle greeting magic, repeated by the client before every option.
pub const IHAVEOPT: u64 = 0x4948_4156_454F_5054;
/// Magic that opens every option reply in fixed newstyle negotiation.
pub const NBD_OPTION_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
/// Magic that opens every transmission request.
pub const NBD_REQUEST_MAGIC: u32 = 0x2560_9513;
/// Magic of a request with extended headers; never negotiated by this server.
pub const NBD_EXTENDED_REQUEST_MAGIC: u32 = 0x21e4_1c71;
/// Magic that opens a simple reply.
pub const NBD_SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
/// Magic that opens a structured reply chunk.
pub const NBD_STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;

// ---------------------------------------------------------------------------
// Handshake flags (server, 16 bits) and client flags (32 bits).

pub const NBD_FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
pub const NBD_FLAG_NO_ZEROES: u16 = 1 << 1;

pub const NBD_FLAG_C_FIXED_NEWSTYLE: u32 = 1 << 0;
pub const NBD_FLAG_C_NO_ZEROES: u32 = 1 << 1;
/// Every client flag this server understands; any other bit ends the session.
pub const KNOWN_CLIENT_FLAGS: u32 = NBD_FLAG_C_FIXED_NEWSTYLE | NBD_FLAG_C_NO_ZEROES;

// ---------------------------------------------------------------------------
// Transmission flags (16 bits).

pub const NBD_FLAG_HAS_FLAGS: u16 = 1 << 0;
pub const NBD_FLAG_READ_ONLY: u16 = 1 << 1;
pub const NBD_FLAG_SEND_FLUSH: u16 = 1 << 2;
pub const NBD_FLAG_SEND_FUA: u16 = 1 << 3;
pub const NBD_FLAG_ROTATIONAL: u16 = 1 << 4;
pub const NBD_FLAG_SEND_TRIM: u16 = 1 << 5;
pub const NBD_FLAG_SEND_WRITE_ZEROES: u16 = 1 << 6;
pub const NBD_FLAG_SEND_DF: u16 = 1 << 7;
pub const NBD_FLAG_CAN_MULTI_CONN: u16 = 1 << 8;
pub const NBD_FLAG_SEND_RESIZE: u16 = 1 << 9;
pub const NBD_FLAG_SEND_CACHE: u16 = 1 << 10;
pub const NBD_FLAG_SEND_FAST_ZERO: u16 = 1 << 11;
pub const NBD_FLAG_BLOCK_STATUS_PAYLOAD: u16 = 1 << 12;

// ---------------------------------------------------------------------------
// Options.

pub const NBD_OPT_EXPORT_NAME: u32 = 1;
pub const NBD_OPT_ABORT: u32 = 2;
pub const NBD_OPT_LIST: u32 = 3;
pub const NBD_OPT_PEEK_EXPORT: u32 = 4;
pub const NBD_OPT_STARTTLS: u32 = 5;
pub const NBD_OPT_INFO: u32 = 6;
pub const NBD_OPT_GO: u32 = 7;
pub const NBD_OPT_STRUCTURED_REPLY: u32 = 8;
pub const NBD_OPT_LIST_META_CONTEXT: u32 = 9;
pub const NBD_OPT_SET_META_CONTEXT: u32 = 10;
pub const NBD_OPT_EXTENDED_HEADERS: u32 = 11;

// ---------------------------------------------------------------------------
// Option reply types. Errors have bit 31 set.

pub const NBD_REP_ACK: u32 = 1;
pub const NBD_REP_SERVER: u32 = 2;
pub const NBD_REP_INFO: u32 = 3;
pub const NBD_REP_META_CONTEXT: u32 = 4;
pub const NBD_REP_FLAG_ERROR: u32 = 1 << 31;
pub const NBD_REP_ERR_UNSUP: u32 = NBD_REP_FLAG_ERROR | 1;
pub const NBD_REP_ERR_POLICY: u32 = NBD_REP_FLAG_ERROR | 2;
pub const NBD_REP_ERR_INVALID: u32 = NBD_REP_FLAG_ERROR | 3;
pub const NBD_REP_ERR_PLATFORM: u32 = NBD_REP_FLAG_ERROR | 4;
pub const NBD_REP_ERR_TLS_REQD: u32 = NBD_REP_FLAG_ERROR | 5;
pub const NBD_REP_ERR_UNKNOWN: u32 = NBD_REP_FLAG_ERROR | 6;
pub const NBD_REP_ERR_SHUTDOWN: u32 = NBD_REP_FLAG_ERROR | 7;
pub const NBD_REP_ERR_BLOCK_SIZE_REQD: u32 = NBD_REP_FLAG_ERROR | 8;
pub const NBD_REP_ERR_TOO_BIG: u32 = NBD_REP_FLAG_ERROR | 9;
pub const NBD_REP_ERR_EXT_HEADER_REQD: u32 = NBD_REP_FLAG_ERROR | 10;

// ---------------------------------------------------------------------------
// Information types in NBD_OPT_INFO / NBD_OPT_GO.

pub const NBD_INFO_EXPORT: u16 = 0;
pub const NBD_INFO_NAME: u16 = 1;
pub const NBD_INFO_DESCRIPTION: u16 = 2;
pub const NBD_INFO_BLOCK_SIZE: u16 = 3;

// ---------------------------------------------------------------------------
// Commands and command flags.

pub const NBD_CMD_READ: u16 = 0;
pub const NBD_CMD_WRITE: u16 = 1;
pub const NBD_CMD_DISC: u16 = 2;
pub const NBD_CMD_FLUSH: u16 = 3;
pub const NBD_CMD_TRIM: u16 = 4;
pub const NBD_CMD_CACHE: u16 = 5;
pub const NBD_CMD_WRITE_ZEROES: u16 = 6;
pub const NBD_CMD_BLOCK_STATUS: u16 = 7;
pub const NBD_CMD_RESIZE: u16 = 8;

pub const NBD_CMD_FLAG_FUA: u16 = 1 << 0;
pub const NBD_CMD_FLAG_NO_HOLE: u16 = 1 << 1;
pub const NBD_CMD_FLAG_DF: u16 = 1 << 2;
pub const NBD_CMD_FLAG_REQ_ONE: u16 = 1 << 3;
pub const NBD_CMD_FLAG_FAST_ZERO: u16 = 1 << 4;
pub const NBD_CMD_FLAG_PAYLOAD_LEN: u16 = 1 << 5;

// ---------------------------------------------------------------------------
// Structured replies.

pub const NBD_REPLY_FLAG_DONE: u16 = 1 << 0;

pub const NBD_REPLY_TYPE_NONE: u16 = 0;
pub const NBD_REPLY_TYPE_OFFSET_DATA: u16 = 1;
pub const NBD_REPLY_TYPE_OFFSET_HOLE: u16 = 2;
pub const NBD_REPLY_TYPE_BLOCK_STATUS: u16 = 5;
pub const NBD_REPLY_TYPE_BLOCK_STATUS_EXT: u16 = 6;
pub const NBD_REPLY_TYPE_ERROR: u16 = (1 << 15) | 1;
pub const NBD_REPLY_TYPE_ERROR_OFFSET: u16 = (1 << 15) | 2;

// ---------------------------------------------------------------------------
// Metadata contexts: base:allocation and zdisk:compression.

/// The standard allocation context.
pub const BASE_ALLOCATION: &str = "base:allocation";
/// The `base:` wildcard query, valid in NBD_OPT_LIST_META_CONTEXT only.
pub const BASE_NAMESPACE: &str = "base:";
/// Context id handed out for `base:allocation` by NBD_OPT_SET_META_CONTEXT.
/// Ids are opaque to clients; any nonzero constant will do with one context.
pub const BASE_ALLOCATION_ID: u32 = 1;
pub const NBD_STATE_HOLE: u32 = 1 << 0;
pub const NBD_STATE_ZERO: u32 = 1 << 1;

/// How each extent is stored (docs/semantics.md, "zdisk:compression").
pub const ZDISK_COMPRESSION: &str = "zdisk:compression";
/// The `zdisk:` wildcard query, valid in NBD_OPT_LIST_META_CONTEXT only.
pub const ZDISK_NAMESPACE: &str = "zdisk:";
/// Context id handed out for `zdisk:compression`.
pub const ZDISK_COMPRESSION_ID: u32 = 2;
/// zdisk:compression bits 0-3: how the extent is stored.
pub const ZDISK_KIND_HOLE: u32 = 0;
pub const ZDISK_KIND_ZERO: u32 = 1;
pub const ZDISK_KIND_RAW: u32 = 2;
pub const ZDISK_KIND_COMPRESSED: u32 = 3;
pub const ZDISK_KIND_DAMAGED: u32 = 4;
pub const ZDISK_KIND_MASK: u32 = 0xf;
/// Bits 4-7: the codec of a compressed extent (zdisk's codec ids: 1 lz4,
/// 2 zstd, 3 deflate), 15 if it could not be read; 0 otherwise.
pub const ZDISK_CODEC_SHIFT: u32 = 4;
pub const ZDISK_CODEC_UNKNOWN: u32 = 15;
/// Bits 8-11: stored bytes per logical block in sixteenths of a block,
/// rounded up, minus one (0: at most 1/16; 15: more than 15/16); 0 for
/// holes, zeros and damaged extents.
pub const ZDISK_SIZE_SHIFT: u32 = 8;
/// Bit 12: compressed together with neighbouring blocks, as one unit.
pub const ZDISK_UNIT: u32 = 1 << 12;
/// Bit 13: the block's stored content is shared with other blocks (cloned
/// or deduplicated), stored once for all of them (format 5).
pub const ZDISK_SHARED: u32 = 1 << 13;

// ---------------------------------------------------------------------------
// Error values in replies.

pub const NBD_EPERM: u32 = 1;
pub const NBD_EIO: u32 = 5;
pub const NBD_ENOMEM: u32 = 12;
pub const NBD_EINVAL: u32 = 22;
pub const NBD_ENOSPC: u32 = 28;
pub const NBD_EOVERFLOW: u32 = 75;
pub const NBD_ENOTSUP: u32 = 95;
pub const NBD_ESHUTDOWN: u32 = 108;

// ---------------------------------------------------------------------------
// Sizes and limits.

/// Minimum block size advertised in NBD_INFO_BLOCK_SIZE. Enforced only for
/// clients that asked for NBD_INFO_BLOCK_SIZE in NBD_OPT_GO; others get the
/// specification's default minimum of 1 byte.
pub const MIN_BLOCK_BYTES: u32 = 512;
/// Preferred block size advertised in NBD_INFO_BLOCK_SIZE.
pub const PREFERRED_BLOCK_BYTES: u32 = 4096;
/// Largest READ or WRITE payload this server accepts, and advertises in
/// NBD_INFO_BLOCK_SIZE. Twice the specification's interoperable 32 MiB:
/// some clients send reads of ~50 MiB, which nbdkit and nbd-server take.
pub const MAX_PAYLOAD_BYTES: u32 = 64 * 1024 * 1024;
/// Largest option payload read into memory during the handshake. Larger
/// options are discarded and answered with NBD_REP_ERR_TOO_BIG.
pub const MAX_OPTION_BYTES: u32 = 64 * 1024;
/// The specification's hard limit on any string (export names, messages).
pub const MAX_STRING_BYTES: usize = 4096;
/// Most block status descriptors returned in one reply chunk.
pub const MAX_BLOCK_STATUS_EXTENTS: usize = 4096;

/// Bytes in the server greeting: NBDMAGIC, IHAVEOPT, handshake flags.
pub const GREETING_BYTES: usize = 18;
/// Bytes in the client flags field that answers the greeting.
pub const CLIENT_FLAGS_BYTES: usize = 4;
/// Bytes in an option request header: IHAVEOPT, option, length.
pub const OPTION_HEADER_BYTES: usize = 16;
/// Bytes in an option reply header: magic, option, type, length.
pub const OPTION_REPLY_HEADER_BYTES: usize = 20;
/// Bytes in a transmission request header.
pub const REQUEST_HEADER_BYTES: usize = 28;
/// Bytes in a simple reply (payload excluded).
pub const SIMPLE_REPLY_BYTES: usize = 16;
/// Bytes in a structured reply chunk header (payload excluded).
pub const CHUNK_HEADER_BYTES: usize = 20;
/// Zero padding after the NBD_OPT_EXPORT_NAME reply unless NO_ZEROES was negotiated.
pub const EXPORT_NAME_PADDING_BYTES: usize = 124;

// ---------------------------------------------------------------------------
// Parsing.

/// Why a message could not be parsed. Each variant names what a peer got wrong.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum WireError {
    #[error("message truncated: needed {needed} more bytes, {available} left")]
    Truncated { needed: usize, available: usize },
    #[error("{count} unexpected trailing bytes")]
    TrailingBytes { count: usize },
    #[error("bad magic {actual:#x}, expected {expected:#x}")]
    BadMagic { expected: u64, actual: u64 },
    #[error("string of {length} bytes exceeds the {MAX_STRING_BYTES}-byte limit")]
    StringTooLong { length: usize },
    #[error("unknown client flags {flags:#x}")]
    UnknownClientFlags { flags: u32 },
    #[error("{what}")]
    Invalid { what: &'static str },
}

/// A bounds-checked reader over a borrowed message.
struct Bytes<'a> {
    rest: &'a [u8],
}

impl<'a> Bytes<'a> {
    fn new(bytes: &'a [u8]) -> Self {
        Bytes { rest: bytes }
    }

    fn take(&mut self, count: usize) -> Result<&'a [u8], WireError> {
        if count > self.rest.len() {
            return Err(WireError::Truncated {
                needed: count,
                available: self.rest.len(),
            });
        }
        let (head, tail) = self.rest.split_at(count);
        self.rest = tail;
        Ok(head)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], WireError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    fn u16(&mut self) -> Result<u16, WireError> {
        Ok(u16::from_be_bytes(self.array()?))
    }

    fn u32(&mut self) -> Result<u32, WireError> {
        Ok(u32::from_be_bytes(self.array()?))
    }

    fn u64(&mut self) -> Result<u64, WireError> {
        Ok(u64::from_be_bytes(self.array()?))
    }

    /// A string prefixed by a 32-bit length, capped at [`MAX_STRING_BYTES`].
    fn string32(&mut self) -> Result<&'a [u8], WireError> {
        let length = self.u32()? as usize;
        if length > MAX_STRING_BYTES {
            return Err(WireError::StringTooLong { length });
        }
        self.take(length)
    }

    fn finish(self) -> Result<(), WireError> {
        if self.rest.is_empty() {
            Ok(())
        } else {
            Err(WireError::TrailingBytes {
                count: self.rest.len(),
            })
        }
    }
}

/// Parses the 32-bit client flags that answer the greeting. Unknown bits are
/// an error because the specification requires the server to drop such
/// clients.
pub fn parse_client_flags(bytes: &[u8]) -> Result<u32, WireError> {
    let mut input = Bytes::new(bytes);
    let flags = input.u32()?;
    input.finish()?;
    if flags & !KNOWN_CLIENT_FLAGS != 0 {
        return Err(WireError::UnknownClientFlags { flags });
    }
    Ok(flags)
}

/// The fixed part of an option request; `length` bytes of data follow it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptionHeader {
    pub option: u32,
    pub length: u32,
}

/// Parses the 16-byte option header (IHAVEOPT, option, length).
pub fn parse_option_header(bytes: &[u8]) -> Result<OptionHeader, WireError> {
    let mut input = Bytes::new(bytes);
    let magic = input.u64()?;
    if magic != IHAVEOPT {
        return Err(WireError::BadMagic {
            expected: IHAVEOPT,
            actual: magic,
        });
    }
    let option = input.u32()?;
    let length = input.u32()?;
    input.finish()?;
    Ok(OptionHeader { option, length })
}

/// The data of an NBD_OPT_INFO or NBD_OPT_GO option (both share one format).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GoOption<'a> {
    pub export_name: &'a [u8],
    /// Information types requested, in the client's order (may repeat; the
    /// server answers each type once).
    pub info_requests: Vec<u16>,
}

impl GoOption<'_> {
    pub fn requests(&self, info: u16) -> bool {
        self.info_requests.contains(&info)
    }
}

/// Parses the data of NBD_OPT_INFO / NBD_OPT_GO: a 32-bit name length, the
/// name, a 16-bit count and that many 16-bit information types, filling the
/// data exactly.
pub fn parse_go_option(data: &[u8]) -> Result<GoOption<'_>, WireError> {
    let mut input = Bytes::new(data);
    let export_name = input.string32()?;
    let count = input.u16()?;
    // Bounded by the data itself: each request needs two bytes, and take()
    // fails before the vector could outgrow the input.
    let mut info_requests = Vec::new();
    for _ in 0..count {
        info_requests.push(input.u16()?);
    }
    input.finish()?;
    Ok(GoOption {
        export_name,
        info_requests,
    })
}

/// The data of NBD_OPT_LIST_META_CONTEXT / NBD_OPT_SET_META_CONTEXT.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetaContextOption<'a> {
    pub export_name: &'a [u8],
    pub queries: Vec<&'a [u8]>,
}

/// Parses the data of NBD_OPT_LIST_META_CONTEXT / NBD_OPT_SET_META_CONTEXT:
/// a length-prefixed export name, a 32-bit query count, then that many
/// length-prefixed query strings, filling the data exactly.
pub fn parse_meta_context_option(data: &[u8]) -> Result<MetaContextOption<'_>, WireError> {
    let mut input = Bytes::new(data);
    let export_name = input.string32()?;
    let count = input.u32()?;
    // Each query consumes at least its 4-byte length, so a lying count runs
    // out of input long before the vector grows past data.len() / 4 entries.
    let mut queries = Vec::new();
    for _ in 0..count {
        queries.push(input.string32()?);
    }
    input.finish()?;
    Ok(MetaContextOption {
        export_name,
        queries,
    })
}

/// A transmission request header. `length` payload bytes follow it only for
/// NBD_CMD_WRITE.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestHeader {
    pub flags: u16,
    pub command: u16,
    pub cookie: u64,
    pub offset: u64,
    pub length: u32,
}

/// Parses the 28-byte request header. A wrong magic means the stream is out
/// of sync and cannot be recovered; the caller must hang up.
pub fn parse_request_header(bytes: &[u8]) -> Result<RequestHeader, WireError> {
    let mut input = Bytes::new(bytes);
    let magic = input.u32()?;
    if magic != NBD_REQUEST_MAGIC {
        return Err(WireError::BadMagic {
            expected: u64::from(NBD_REQUEST_MAGIC),
            actual: u64::from(magic),
        });
    }
    let flags = input.u16()?;
    let command = input.u16()?;
    let cookie = input.u64()?;
    let offset = input.u64()?;
    let length = input.u32()?;
    input.finish()?;
    Ok(RequestHeader {
        flags,
        command,
        cookie,
        offset,
        length,
    })
}

// ---------------------------------------------------------------------------
// Encoding.

fn put_u16(out: &mut Vec<u8>, value: u16) {
    out.extend_from_slice(&value.to_be_bytes());
}

fn put_u32(out: &mut Vec<u8>, value: u32) {
    out.extend_from_slice(&value.to_be_bytes());
}

fn put_u64(out: &mut Vec<u8>, value: u64) {
    out.extend_from_slice(&value.to_be_bytes());
}

fn length_u32(length: usize) -> u32 {
    u32::try_from(length).expect("encoded payload fits the 32-bit length field")
}

/// Cuts `text` to at most [`MAX_STRING_BYTES`] on a character boundary, so a
/// human-readable message can always be sent.
pub fn truncate_message(text: &str) -> &str {
    if text.len() <= MAX_STRING_BYTES {
        return text;
    }
    let mut end = MAX_STRING_BYTES;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

/// The server greeting: NBDMAGIC, IHAVEOPT and the handshake flags.
pub fn put_greeting(out: &mut Vec<u8>, handshake_flags: u16) {
    put_u64(out, NBDMAGIC);
    put_u64(out, IHAVEOPT);
    put_u16(out, handshake_flags);
}

/// The reply that ends NBD_OPT_EXPORT_NAME: size, transmission flags and,
/// unless the client negotiated NO_ZEROES, 124 bytes of padding.
pub fn put_export_name_reply(out: &mut Vec<u8>, size_bytes: u64, flags: u16, no_zeroes: bool) {
    put_u64(out, size_bytes);
    put_u16(out, flags);
    if !no_zeroes {
        out.extend_from_slice(&[0u8; EXPORT_NAME_PADDING_BYTES]);
    }
}

/// One option reply with its data.
pub fn put_option_reply(out: &mut Vec<u8>, option: u32, reply_type: u32, data: &[u8]) {
    put_u64(out, NBD_OPTION_REPLY_MAGIC);
    put_u32(out, option);
    put_u32(out, reply_type);
    put_u32(out, length_u32(data.len()));
    out.extend_from_slice(data);
}

/// An error option reply carrying a human-readable message.
pub fn put_option_error(out: &mut Vec<u8>, option: u32, reply_type: u32, message: &str) {
    assert!(
        reply_type & NBD_REP_FLAG_ERROR != 0,
        "not an error reply type"
    );
    put_option_reply(
        out,
        option,
        reply_type,
        truncate_message(message).as_bytes(),
    );
}

/// NBD_REP_SERVER: an export name, optionally followed by its description.
pub fn put_rep_server(out: &mut Vec<u8>, option: u32, name: &str, description: Option<&str>) {
    assert!(name.len() <= MAX_STRING_BYTES, "export name too long");
    let mut data = Vec::with_capacity(4 + name.len());
    put_u32(&mut data, length_u32(name.len()));
    data.extend_from_slice(name.as_bytes());
    if let Some(text) = description {
        data.extend_from_slice(truncate_message(text).as_bytes());
    }
    put_option_reply(out, option, NBD_REP_SERVER, &data);
}

/// NBD_REP_INFO carrying NBD_INFO_EXPORT.
pub fn put_info_export(out: &mut Vec<u8>, option: u32, size_bytes: u64, flags: u16) {
    let mut data = Vec::with_capacity(12);
    put_u16(&mut data, NBD_INFO_EXPORT);
    put_u64(&mut data, size_bytes);
    put_u16(&mut data, flags);
    put_option_reply(out, option, NBD_REP_INFO, &data);
}

/// NBD_REP_INFO carrying NBD_INFO_BLOCK_SIZE.
pub fn put_info_block_size(
    out: &mut Vec<u8>,
    option: u32,
    min_bytes: u32,
    preferred_bytes: u32,
    max_payload_bytes: u32,
) {
    let mut data = Vec::with_capacity(14);
    put_u16(&mut data, NBD_INFO_BLOCK_SIZE);
    put_u32(&mut data, min_bytes);
    put_u32(&mut data, preferred_bytes);
    put_u32(&mut data, max_payload_bytes);
    put_option_reply(out, option, NBD_REP_INFO, &data);
}

/// NBD_REP_INFO carrying a string item (NBD_INFO_NAME or NBD_INFO_DESCRIPTION).
pub fn put_info_string(out: &mut Vec<u8>, option: u32, info: u16, text: &str) {
    assert!(text.len() <= MAX_STRING_BYTES, "info string too long");
    let mut data = Vec::with_capacity(2 + text.len());
    put_u16(&mut data, info);
    data.extend_from_slice(text.as_bytes());
    put_option_reply(out, option, NBD_REP_INFO, &data);
}

/// NBD_REP_META_CONTEXT naming one context.
pub fn put_meta_context(out: &mut Vec<u8>, option: u32, context_id: u32, name: &str) {
    let mut data = Vec::with_capacity(4 + name.len());
    put_u32(&mut data, context_id);
    data.extend_from_slice(name.as_bytes());
    put_option_reply(out, option, NBD_REP_META_CONTEXT, &data);
}

/// A simple reply header; for a successful simple READ the data follows it.
pub fn put_simple_reply(out: &mut Vec<u8>, error: u32, cookie: u64) {
    put_u32(out, NBD_SIMPLE_REPLY_MAGIC);
    put_u32(out, error);
    put_u64(out, cookie);
}

/// A structured reply chunk header; `payload_bytes` of payload must follow.
pub fn put_chunk_header(
    out: &mut Vec<u8>,
    flags: u16,
    chunk_type: u16,
    cookie: u64,
    payload_bytes: u32,
) {
    put_u32(out, NBD_STRUCTURED_REPLY_MAGIC);
    put_u16(out, flags);
    put_u16(out, chunk_type);
    put_u64(out, cookie);
    put_u32(out, payload_bytes);
}

/// The header and offset of a final NBD_REPLY_TYPE_OFFSET_DATA chunk;
/// `data_bytes` of data must follow.
pub fn put_offset_data_header(out: &mut Vec<u8>, cookie: u64, offset: u64, data_bytes: u32) {
    assert!(data_bytes > 0, "an OFFSET_DATA chunk must carry data");
    let payload_bytes = data_bytes
        .checked_add(8)
        .expect("OFFSET_DATA payload fits 32 bits");
    put_chunk_header(
        out,
        NBD_REPLY_FLAG_DONE,
        NBD_REPLY_TYPE_OFFSET_DATA,
        cookie,
        payload_bytes,
    );
    put_u64(out, offset);
}

/// A final NBD_REPLY_TYPE_NONE chunk: success with nothing to say.
pub fn put_chunk_none(out: &mut Vec<u8>, cookie: u64) {
    put_chunk_header(out, NBD_REPLY_FLAG_DONE, NBD_REPLY_TYPE_NONE, cookie, 0);
}

/// A final NBD_REPLY_TYPE_ERROR chunk with a human-readable message.
pub fn put_chunk_error(out: &mut Vec<u8>, cookie: u64, error: u32, message: &str) {
    assert!(error != 0, "an error chunk needs a nonzero error");
    let message = truncate_message(message);
    put_chunk_header(
        out,
        NBD_REPLY_FLAG_DONE,
        NBD_REPLY_TYPE_ERROR,
        cookie,
        length_u32(6 + message.len()),
    );
    put_u32(out, error);
    put_u16(
        out,
        u16::try_from(message.len()).expect("message was truncated to 4096 bytes"),
    );
    out.extend_from_slice(message.as_bytes());
}

/// One block status descriptor: a run length and its status flags.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Descriptor {
    pub length_bytes: u32,
    pub flags: u32,
}

/// An NBD_REPLY_TYPE_BLOCK_STATUS chunk for one metadata context; `done`
/// marks the reply's last chunk.
pub fn put_block_status_chunk(
    out: &mut Vec<u8>,
    cookie: u64,
    context_id: u32,
    descriptors: &[Descriptor],
    done: bool,
) {
    assert!(!descriptors.is_empty(), "block status needs a descriptor");
    put_chunk_header(
        out,
        if done { NBD_REPLY_FLAG_DONE } else { 0 },
        NBD_REPLY_TYPE_BLOCK_STATUS,
        cookie,
        length_u32(4 + 8 * descriptors.len()),
    );
    put_u32(out, context_id);
    for descriptor in descriptors {
        assert!(
            descriptor.length_bytes > 0,
            "descriptor lengths are nonzero"
        );
        put_u32(out, descriptor.length_bytes);
        put_u32(out, descriptor.flags);
    }
}

// ---------------------------------------------------------------------------
// The client's half: what a client encodes and parses.

/// The name of a command, for messages.
pub fn command_name(command: u16) -> &'static str {
    match command {
        NBD_CMD_READ => "read",
        NBD_CMD_WRITE => "write",
        NBD_CMD_DISC => "disconnect",
        NBD_CMD_FLUSH => "flush",
        NBD_CMD_TRIM => "trim",
        NBD_CMD_CACHE => "cache",
        NBD_CMD_WRITE_ZEROES => "write zeroes",
        NBD_CMD_BLOCK_STATUS => "block status",
        NBD_CMD_RESIZE => "resize",
        _ => "unknown command",
    }
}

/// Parses the server greeting ([`GREETING_BYTES`]): NBDMAGIC, IHAVEOPT,
/// then the handshake flags, which it returns. Oldstyle servers send a
/// different second magic and are refused.
pub fn parse_greeting(bytes: &[u8]) -> Result<u16, WireError> {
    let mut input = Bytes::new(bytes);
    for expected in [NBDMAGIC, IHAVEOPT] {
        let actual = input.u64()?;
        if actual != expected {
            return Err(WireError::BadMagic { expected, actual });
        }
    }
    let flags = input.u16()?;
    input.finish()?;
    Ok(flags)
}

/// An option request: IHAVEOPT, the option, its data's length, the data.
pub fn put_option_request(out: &mut Vec<u8>, option: u32, data: &[u8]) {
    put_u64(out, IHAVEOPT);
    put_u32(out, option);
    put_u32(out, length_u32(data.len()));
    out.extend_from_slice(data);
}

fn put_string32(out: &mut Vec<u8>, text: &str) {
    assert!(text.len() <= MAX_STRING_BYTES, "string too long");
    put_u32(out, length_u32(text.len()));
    out.extend_from_slice(text.as_bytes());
}

/// The data of NBD_OPT_GO / NBD_OPT_INFO: the export name and the
/// information types requested.
pub fn put_go_data(out: &mut Vec<u8>, export_name: &str, info_requests: &[u16]) {
    put_string32(out, export_name);
    put_u16(
        out,
        u16::try_from(info_requests.len()).expect("information requests fit 16 bits"),
    );
    for info in info_requests {
        put_u16(out, *info);
    }
}

/// The data of NBD_OPT_LIST_META_CONTEXT / NBD_OPT_SET_META_CONTEXT: the
/// export name and the queries.
pub fn put_meta_context_data(out: &mut Vec<u8>, export_name: &str, queries: &[&str]) {
    put_string32(out, export_name);
    put_u32(out, length_u32(queries.len()));
    for query in queries {
        put_string32(out, query);
    }
}

/// An option reply header; `length` bytes of data follow it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptionReplyHeader {
    pub option: u32,
    pub reply_type: u32,
    pub length: u32,
}

/// Parses an option reply header ([`OPTION_REPLY_HEADER_BYTES`]).
pub fn parse_option_reply_header(bytes: &[u8]) -> Result<OptionReplyHeader, WireError> {
    let mut input = Bytes::new(bytes);
    let magic = input.u64()?;
    if magic != NBD_OPTION_REPLY_MAGIC {
        return Err(WireError::BadMagic {
            expected: NBD_OPTION_REPLY_MAGIC,
            actual: magic,
        });
    }
    let option = input.u32()?;
    let reply_type = input.u32()?;
    let length = input.u32()?;
    input.finish()?;
    Ok(OptionReplyHeader {
        option,
        reply_type,
        length,
    })
}

/// One information item of an NBD_REP_INFO reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Info<'a> {
    Export {
        size_bytes: u64,
        flags: u16,
    },
    BlockSize {
        min_bytes: u32,
        preferred_bytes: u32,
        max_payload_bytes: u32,
    },
    Name(&'a [u8]),
    Description(&'a [u8]),
    /// A type this client does not know; the specification lets it ignore one.
    Other {
        info: u16,
    },
}

/// Parses the data of an NBD_REP_INFO reply.
pub fn parse_info_reply(data: &[u8]) -> Result<Info<'_>, WireError> {
    let mut input = Bytes::new(data);
    let info_type = input.u16()?;
    let info = match info_type {
        NBD_INFO_EXPORT => Info::Export {
            size_bytes: input.u64()?,
            flags: input.u16()?,
        },
        NBD_INFO_BLOCK_SIZE => Info::BlockSize {
            min_bytes: input.u32()?,
            preferred_bytes: input.u32()?,
            max_payload_bytes: input.u32()?,
        },
        NBD_INFO_NAME | NBD_INFO_DESCRIPTION => {
            let text = input.take(input.rest.len())?;
            if text.len() > MAX_STRING_BYTES {
                return Err(WireError::StringTooLong { length: text.len() });
            }
            if info_type == NBD_INFO_NAME {
                Info::Name(text)
            } else {
                Info::Description(text)
            }
        }
        info => return Ok(Info::Other { info }),
    };
    input.finish()?;
    Ok(info)
}

/// Parses the data of an NBD_REP_META_CONTEXT reply: the context id the
/// server chose, and the context's name.
pub fn parse_meta_context_reply(data: &[u8]) -> Result<(u32, &[u8]), WireError> {
    let mut input = Bytes::new(data);
    let id = input.u32()?;
    let name = input.take(input.rest.len())?;
    if name.len() > MAX_STRING_BYTES {
        return Err(WireError::StringTooLong { length: name.len() });
    }
    Ok((id, name))
}

/// Parses the size and transmission flags that answer NBD_OPT_EXPORT_NAME
/// (10 bytes; the padding, if any, is read and dropped by the caller).
pub fn parse_export_name_reply(bytes: &[u8]) -> Result<(u64, u16), WireError> {
    let mut input = Bytes::new(bytes);
    let size_bytes = input.u64()?;
    let flags = input.u16()?;
    input.finish()?;
    Ok((size_bytes, flags))
}

/// A transmission request header ([`REQUEST_HEADER_BYTES`]); a write's
/// payload must follow it.
pub fn put_request_header(out: &mut Vec<u8>, header: &RequestHeader) {
    put_u32(out, NBD_REQUEST_MAGIC);
    put_u16(out, header.flags);
    put_u16(out, header.command);
    put_u64(out, header.cookie);
    put_u64(out, header.offset);
    put_u32(out, header.length);
}

/// A simple reply ([`SIMPLE_REPLY_BYTES`]): the error (0 for success) and
/// the cookie. A successful read's data follows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SimpleReply {
    pub error: u32,
    pub cookie: u64,
}

/// Parses a simple reply, magic included.
pub fn parse_simple_reply(bytes: &[u8]) -> Result<SimpleReply, WireError> {
    let mut input = Bytes::new(bytes);
    let magic = input.u32()?;
    if magic != NBD_SIMPLE_REPLY_MAGIC {
        return Err(WireError::BadMagic {
            expected: u64::from(NBD_SIMPLE_REPLY_MAGIC),
            actual: u64::from(magic),
        });
    }
    let error = input.u32()?;
    let cookie = input.u64()?;
    input.finish()?;
    Ok(SimpleReply { error, cookie })
}

/// A structured reply chunk header; `length` bytes of payload follow it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkHeader {
    pub flags: u16,
    pub chunk_type: u16,
    pub cookie: u64,
    pub length: u32,
}

/// Parses a structured reply chunk header ([`CHUNK_HEADER_BYTES`]), magic
/// included.
pub fn parse_chunk_header(bytes: &[u8]) -> Result<ChunkHeader, WireError> {
    let mut input = Bytes::new(bytes);
    let magic = input.u32()?;
    if magic != NBD_STRUCTURED_REPLY_MAGIC {
        return Err(WireError::BadMagic {
            expected: u64::from(NBD_STRUCTURED_REPLY_MAGIC),
            actual: u64::from(magic),
        });
    }
    let flags = input.u16()?;
    let chunk_type = input.u16()?;
    let cookie = input.u64()?;
    let length = input.u32()?;
    input.finish()?;
    Ok(ChunkHeader {
        flags,
        chunk_type,
        cookie,
        length,
    })
}

/// The payload of an error chunk (NBD_REPLY_TYPE_ERROR, or _ERROR_OFFSET
/// with the offset it names).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ErrorChunk<'a> {
    pub error: u32,
    pub message: &'a [u8],
    pub offset: Option<u64>,
}

/// Parses an error chunk's payload: a nonzero error, a 16-bit message
/// length, the message, and for NBD_REPLY_TYPE_ERROR_OFFSET an offset.
/// An error type this client does not know carries the same error and
/// message, then something it ignores.
pub fn parse_error_chunk(chunk_type: u16, payload: &[u8]) -> Result<ErrorChunk<'_>, WireError> {
    let mut input = Bytes::new(payload);
    let error = input.u32()?;
    if error == 0 {
        return Err(WireError::Invalid {
            what: "an error chunk with error 0",
        });
    }
    let length = input.u16()?;
    let message = input.take(usize::from(length))?;
    let offset = match chunk_type {
        NBD_REPLY_TYPE_ERROR => None,
        NBD_REPLY_TYPE_ERROR_OFFSET => Some(input.u64()?),
        _ => {
            return Ok(ErrorChunk {
                error,
                message,
                offset: None,
            })
        }
    };
    input.finish()?;
    Ok(ErrorChunk {
        error,
        message,
        offset,
    })
}

/// Parses an NBD_REPLY_TYPE_BLOCK_STATUS payload: the context id and at
/// least one descriptor, each with a nonzero length.
pub fn parse_block_status_chunk(payload: &[u8]) -> Result<(u32, Vec<Descriptor>), WireError> {
    let mut input = Bytes::new(payload);
    let context_id = input.u32()?;
    if input.rest.is_empty() {
        return Err(WireError::Invalid {
            what: "a block status chunk without descriptors",
        });
    }
    if !input.rest.len().is_multiple_of(8) {
        return Err(WireError::TrailingBytes {
            count: input.rest.len() % 8,
        });
    }
    let mut descriptors = Vec::with_capacity(input.rest.len() / 8);
    while !input.rest.is_empty() {
        let length_bytes = input.u32()?;
        let flags = input.u32()?;
        if length_bytes == 0 {
            return Err(WireError::Invalid {
                what: "a block status descriptor of length 0",
            });
        }
        descriptors.push(Descriptor {
            length_bytes,
            flags,
        });
    }
    Ok((context_id, descriptors))
}

#[cfg(test)]
mod tests {
    //! Parsers against hand-built messages: each accepts exactly the layout
    //! in the specification and rejects truncation, trailing bytes, wrong
    //! magic and lengths that point outside the message.

    use super::*;

    fn go_data(name: &[u8], infos: &[u16]) -> Vec<u8> {
        let mut data = Vec::new();
        put_u32(&mut data, name.len() as u32);
        data.extend_from_slice(name);
        put_u16(&mut data, infos.len() as u16);
        for info in infos {
            put_u16(&mut data, *info);
        }
        data
    }

    #[test]
    fn request_header_round_trip() {
        let mut bytes = Vec::new();
        put_u32(&mut bytes, NBD_REQUEST_MAGIC);
        put_u16(&mut bytes, NBD_CMD_FLAG_FUA);
        put_u16(&mut bytes, NBD_CMD_WRITE);
        put_u64(&mut bytes, 0xdead_beef);
        put_u64(&mut bytes, 4096);
        put_u32(&mut bytes, 512);
        assert_eq!(bytes.len(), REQUEST_HEADER_BYTES);
        let header = parse_request_header(&bytes).unwrap();
        assert_eq!(
            header,
            RequestHeader {
                flags: NBD_CMD_FLAG_FUA,
                command: NBD_CMD_WRITE,
                cookie: 0xdead_beef,
                offset: 4096,
                length: 512,
            }
        );
        assert!(matches!(
            parse_request_header(&bytes[..27]),
            Err(WireError::Truncated { .. })
        ));
        bytes[0] ^= 1;
        assert!(matches!(
            parse_request_header(&bytes),
            Err(WireError::BadMagic { .. })
        ));
    }

    #[test]
    fn option_header_checks_magic() {
        let mut bytes = Vec::new();
        put_u64(&mut bytes, IHAVEOPT);
        put_u32(&mut bytes, NBD_OPT_GO);
        put_u32(&mut bytes, 7);
        assert_eq!(
            parse_option_header(&bytes).unwrap(),
            OptionHeader {
                option: NBD_OPT_GO,
                length: 7
            }
        );
        bytes[7] = 0;
        assert!(parse_option_header(&bytes).is_err());
    }

    #[test]
    fn client_flags_reject_unknown_bits() {
        assert_eq!(parse_client_flags(&3u32.to_be_bytes()).unwrap(), 3);
        assert_eq!(parse_client_flags(&0u32.to_be_bytes()).unwrap(), 0);
        assert!(matches!(
            parse_client_flags(&4u32.to_be_bytes()),
            Err(WireError::UnknownClientFlags { flags: 4 })
        ));
    }

    #[test]
    fn go_option_parses_and_rejects_bad_lengths() {
        let data = go_data(b"zdisk", &[NBD_INFO_BLOCK_SIZE, NBD_INFO_NAME]);
        let go = parse_go_option(&data).unwrap();
        assert_eq!(go.export_name, b"zdisk");
        assert!(go.requests(NBD_INFO_BLOCK_SIZE));
        assert!(!go.requests(NBD_INFO_DESCRIPTION));

        // Truncated at every length, and one trailing byte.
        for cut in 0..data.len() {
            assert!(parse_go_option(&data[..cut]).is_err(), "cut at {cut}");
        }
        let mut long = data.clone();
        long.push(0);
        assert_eq!(
            parse_go_option(&long),
            Err(WireError::TrailingBytes { count: 1 })
        );

        // A name length pointing past the end, and an oversized name.
        let mut lying = data.clone();
        lying[3] = 200;
        assert!(parse_go_option(&lying).is_err());
        let huge = go_data(&[b'a'; MAX_STRING_BYTES + 1], &[]);
        assert!(matches!(
            parse_go_option(&huge),
            Err(WireError::StringTooLong { .. })
        ));
    }

    #[test]
    fn meta_context_option_parses_and_rejects_lying_counts() {
        let mut data = Vec::new();
        put_u32(&mut data, 0);
        put_u32(&mut data, 2);
        for query in [&b"base:allocation"[..], b"qemu:dirty-bitmap:x"] {
            put_u32(&mut data, query.len() as u32);
            data.extend_from_slice(query);
        }
        let parsed = parse_meta_context_option(&data).unwrap();
        assert_eq!(parsed.export_name, b"");
        assert_eq!(
            parsed.queries,
            vec![&b"base:allocation"[..], b"qemu:dirty-bitmap:x"]
        );

        let mut lying = Vec::new();
        put_u32(&mut lying, 0);
        put_u32(&mut lying, u32::MAX);
        assert!(parse_meta_context_option(&lying).is_err());
    }

    #[test]
    fn error_chunk_message_is_truncated_on_a_char_boundary() {
        let text = "é".repeat(MAX_STRING_BYTES);
        let cut = truncate_message(&text);
        assert!(cut.len() <= MAX_STRING_BYTES);
        assert!(cut.len() >= MAX_STRING_BYTES - 1);
        let mut out = Vec::new();
        put_chunk_error(&mut out, 9, NBD_EIO, &text);
        let payload_bytes = u32::from_be_bytes(out[16..20].try_into().unwrap()) as usize;
        assert_eq!(out.len(), CHUNK_HEADER_BYTES + payload_bytes);
    }
}
