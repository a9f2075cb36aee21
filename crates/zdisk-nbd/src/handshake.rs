//! The fixed newstyle handshake: greeting, client flags, option haggling,
//! until the client enters transmission (NBD_OPT_EXPORT_NAME or a successful
//! NBD_OPT_GO) or leaves.
//!
//! The state machine answers one whole option at a time ([`Haggle::answer`]):
//! the server's lobby (`lobby.rs`) feeds it options as they arrive on
//! non-blocking sockets, and [`greet`] and [`haggle`] run it over any
//! `Read` and `Write`, so the fuzzer drives exactly this code from a byte
//! slice. Each option is taken whole (at most [`MAX_OPTION_BYTES`]) and
//! answered with one buffered write.
//!
//! Invariants and policy:
//! - Every option gets exactly one final reply (ACK or an error), except
//!   NBD_OPT_EXPORT_NAME, which cannot fail: an unknown name is a hard
//!   disconnect, as the specification requires.
//! - Options larger than [`MAX_OPTION_BYTES`] are read and discarded in
//!   small chunks, then refused with NBD_REP_ERR_TOO_BIG; memory stays
//!   bounded whatever length the client announces.
//! - Unknown options and NBD_OPT_EXTENDED_HEADERS get NBD_REP_ERR_UNSUP
//!   and negotiation continues.
//! - NBD_OPT_STARTTLS follows nbdkit: refused by policy when TLS is off
//!   (NBD_REP_ERR_POLICY), invalid with data or once TLS is up; when it
//!   is on or required, an ACK after which [`haggle`] returns
//!   [`Outcome::StartTls`] and the caller runs the TLS handshake, then
//!   haggles again from a clean slate (nothing negotiated in plain text
//!   survives). Under `require`, every other option but NBD_OPT_ABORT is
//!   refused with NBD_REP_ERR_TLS_REQD until TLS is up, and
//!   NBD_OPT_EXPORT_NAME (which cannot be refused) ends the connection.
//! - A connection the server will not serve (shutting down, or over the
//!   connection limit) is still answered: every option gets an error that
//!   says why, so the client can tell its user.
//! - The export answers to its configured name and to "" (the default).
//! - `block_size_agreed` is true only when the NBD_OPT_GO that entered
//!   transmission asked for NBD_INFO_BLOCK_SIZE; only then may the server
//!   insist on 512-byte alignment (the specification's size-constraint rule).

#[cfg(any(test, feature = "testing"))]
use std::io::{Read, Write};

use crate::session::SessionEnd;
#[cfg(any(test, feature = "testing"))]
use crate::session::{discard, read_message, read_vec};
use crate::tls::TlsMode;
use crate::wire::*;

/// What the server exports, as the handshake describes it.
#[derive(Debug, Clone)]
pub(crate) struct Export {
    pub name: String,
    pub description: Option<String>,
    pub size_bytes: u64,
    pub read_only: bool,
}

/// Every export: the main one, and those beside it (snapshots and
/// clones), which may come and go while the server runs.
#[derive(Clone)]
pub(crate) struct Exports {
    pub main: Export,
    pub extra: Option<std::sync::Arc<dyn crate::ExtraExports>>,
}

impl From<Export> for Exports {
    fn from(main: Export) -> Exports {
        Exports { main, extra: None }
    }
}

impl Exports {
    /// The export a client asks for by `name` (the main one for an empty
    /// name), and its id among the extra ones (`None`: the main one).
    fn find(&self, name: &[u8]) -> Option<(Export, Option<u64>)> {
        if name.is_empty() || name == self.main.name.as_bytes() {
            return Some((self.main.clone(), None));
        }
        let name = std::str::from_utf8(name).ok()?;
        let extra = self.extra.as_ref()?.find(name)?;
        Some((
            Export {
                name: extra.name,
                description: extra.description,
                size_bytes: extra.size_bytes,
                read_only: self.main.read_only || extra.read_only,
            },
            Some(extra.id),
        ))
    }

    /// Every export's name and description, the main one first.
    fn list(&self) -> Vec<(String, Option<String>)> {
        let mut all = vec![(self.main.name.clone(), self.main.description.clone())];
        if let Some(extra) = &self.extra {
            all.extend(extra.list().into_iter().map(|e| (e.name, e.description)));
        }
        all
    }
}

/// What the handshake settled, for the transmission phase.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Negotiated {
    pub structured_replies: bool,
    /// The id of `base:allocation` if the last NBD_OPT_SET_META_CONTEXT selected it.
    pub base_allocation_id: Option<u32>,
    /// The id of `zdisk:compression` if the last NBD_OPT_SET_META_CONTEXT selected it.
    pub compression_id: Option<u32>,
    /// The client promised to honour NBD_INFO_BLOCK_SIZE (see module docs).
    pub block_size_agreed: bool,
    /// Which export: `None` for the main one, else an extra one's id.
    pub export: Option<u64>,
}

/// The transmission flags for an export. Write-type features are left out
/// of read-only exports, and NBD_FLAG_SEND_DF only makes sense (and is only
/// allowed) once structured replies are on. CAN_MULTI_CONN is honest because
/// the device's flush covers completed writes from every connection.
pub(crate) fn transmission_flags(read_only: bool, structured_replies: bool) -> u16 {
    let mut flags = NBD_FLAG_HAS_FLAGS
        | NBD_FLAG_SEND_FLUSH
        | NBD_FLAG_SEND_FUA
        | NBD_FLAG_CAN_MULTI_CONN
        | NBD_FLAG_SEND_CACHE;
    if read_only {
        flags |= NBD_FLAG_READ_ONLY;
    } else {
        flags |= NBD_FLAG_SEND_TRIM | NBD_FLAG_SEND_WRITE_ZEROES | NBD_FLAG_SEND_FAST_ZERO;
    }
    if structured_replies {
        flags |= NBD_FLAG_SEND_DF;
    }
    flags
}

/// Why the server will not serve a connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// The server is shutting down.
    Shutdown,
    /// Over the connection limit; the text says so, with the limit.
    Busy(String),
}

/// Whether TLS may or must be used, and whether it already is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TlsState {
    pub mode: TlsMode,
    pub active: bool,
}

impl TlsState {
    pub const OFF: TlsState = TlsState {
        mode: TlsMode::Off,
        active: false,
    };

    /// True while options other than STARTTLS must be refused.
    fn required_first(&self) -> bool {
        self.mode == TlsMode::Require && !self.active
    }
}

/// Option-haggling state that options change. It holds no reference to
/// the export, so a connection waiting in the server's event loop keeps
/// only these few bytes between its options.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Haggle {
    no_zeroes: bool,
    tls: TlsState,
    structured_replies: bool,
    base_allocation_id: Option<u32>,
    compression_id: Option<u32>,
}

/// What one option did to the conversation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Next {
    Continue,
    Transmission(Negotiated),
    StartTls,
    Abort,
}

/// How option haggling ended, short of the client leaving.
#[cfg(any(test, feature = "testing"))]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    Transmission(Negotiated),
    /// NBD_OPT_STARTTLS was acknowledged: the TLS handshake comes next,
    /// then [`haggle`] again with TLS active.
    StartTls,
}

/// The server's greeting, the first bytes of every connection.
pub(crate) fn put_server_greeting(out: &mut Vec<u8>) {
    put_greeting(out, NBD_FLAG_FIXED_NEWSTYLE | NBD_FLAG_NO_ZEROES);
}

/// The client's flags, which follow the greeting.
pub(crate) fn client_flags(bytes: &[u8; CLIENT_FLAGS_BYTES]) -> Result<u32, SessionEnd> {
    parse_client_flags(bytes).map_err(|e| SessionEnd::Protocol(e.to_string()))
}

/// An option's header, checked.
pub(crate) fn option_header(bytes: &[u8; OPTION_HEADER_BYTES]) -> Result<OptionHeader, SessionEnd> {
    parse_option_header(bytes).map_err(|e| SessionEnd::Protocol(e.to_string()))
}

/// Sends the greeting and reads the client's flags (the fuzzer's way in;
/// the server's lobby reads them as they arrive).
#[cfg(any(test, feature = "testing"))]
pub(crate) fn greet<R: Read + ?Sized, W: Write + ?Sized>(
    reader: &mut R,
    writer: &mut W,
) -> Result<u32, SessionEnd> {
    let mut out = Vec::with_capacity(GREETING_BYTES);
    put_server_greeting(&mut out);
    writer.write_all(&out)?;

    let mut flag_bytes = [0u8; CLIENT_FLAGS_BYTES];
    if !read_message(reader, &mut flag_bytes)? {
        return Err(SessionEnd::ClientClosed);
    }
    client_flags(&flag_bytes)
}

/// Haggles options until the client enters transmission, asks for TLS, or
/// leaves. `refusal` is asked before each option; while it says the
/// server will not serve, options are refused with the reason. The
/// fuzzer's way in; the server's lobby feeds [`Haggle::answer`] itself.
#[cfg(any(test, feature = "testing"))]
pub(crate) fn haggle<R: Read + ?Sized, W: Write + ?Sized>(
    reader: &mut R,
    writer: &mut W,
    exports: &Exports,
    client_flags: u32,
    tls: TlsState,
    refusal: &dyn Fn() -> Option<Refusal>,
) -> Result<Outcome, SessionEnd> {
    let mut haggle = Haggle::new(client_flags, tls);
    let mut out = Vec::new();
    loop {
        let mut header_bytes = [0u8; OPTION_HEADER_BYTES];
        if !read_message(reader, &mut header_bytes)? {
            return Err(SessionEnd::ClientClosed);
        }
        let header = option_header(&header_bytes)?;

        out.clear();
        let next = if header.length > MAX_OPTION_BYTES {
            Haggle::check_oversized(header)?;
            discard(reader, u64::from(header.length))?;
            haggle.answer(exports, &mut out, header, None, refusal())?
        } else {
            let data = read_vec(reader, header.length as usize)?;
            haggle.answer(exports, &mut out, header, Some(&data), refusal())?
        };
        writer.write_all(&out)?;
        match next {
            Next::Continue => {}
            Next::Transmission(negotiated) => return Ok(Outcome::Transmission(negotiated)),
            Next::StartTls => return Ok(Outcome::StartTls),
            Next::Abort => return Err(SessionEnd::ClientAbort),
        }
    }
}

impl Haggle {
    /// A clean slate, after the client's flags or after STARTTLS.
    pub fn new(client_flags: u32, tls: TlsState) -> Haggle {
        Haggle {
            no_zeroes: client_flags & NBD_FLAG_C_NO_ZEROES != 0,
            tls,
            structured_replies: false,
            base_allocation_id: None,
            compression_id: None,
        }
    }

    /// Whether an option announced larger than [`MAX_OPTION_BYTES`] may be
    /// discarded and refused; NBD_OPT_EXPORT_NAME cannot be refused, and no
    /// export has a name this long, so it ends the connection at once.
    pub fn check_oversized(header: OptionHeader) -> Result<(), SessionEnd> {
        if header.option == NBD_OPT_EXPORT_NAME {
            return Err(SessionEnd::Protocol(format!(
                "NBD_OPT_EXPORT_NAME with a {}-byte name",
                header.length
            )));
        }
        Ok(())
    }

    /// Answers one option into `out`. `data` is None for an option whose
    /// data was too large and has been discarded (after
    /// [`Haggle::check_oversized`]); `refusal` says why the server will not
    /// serve this connection, if it will not.
    pub fn answer(
        &mut self,
        exports: &Exports,
        out: &mut Vec<u8>,
        header: OptionHeader,
        data: Option<&[u8]>,
        refusal: Option<Refusal>,
    ) -> Result<Next, SessionEnd> {
        match data {
            None => oversized_option(out, header),
            Some(data) => match refusal {
                Some(refusal) => refuse(out, header.option, &refusal),
                None => self.option(exports, out, header.option, data),
            },
        }
    }
}

/// An option whose data exceeded [`MAX_OPTION_BYTES`] and was discarded.
fn oversized_option(out: &mut Vec<u8>, header: OptionHeader) -> Result<Next, SessionEnd> {
    Haggle::check_oversized(header)?;
    if header.option == NBD_OPT_ABORT {
        put_option_reply(out, header.option, NBD_REP_ACK, &[]);
        return Ok(Next::Abort);
    }
    put_option_error(
        out,
        header.option,
        NBD_REP_ERR_TOO_BIG,
        &format!(
            "option data of {} bytes exceeds this server's {MAX_OPTION_BYTES}-byte limit",
            header.length
        ),
    );
    Ok(Next::Continue)
}

/// Answers an option on a connection the server will not serve.
fn refuse(out: &mut Vec<u8>, option: u32, refusal: &Refusal) -> Result<Next, SessionEnd> {
    match option {
        NBD_OPT_EXPORT_NAME => Err(match refusal {
            Refusal::Shutdown => SessionEnd::Shutdown,
            Refusal::Busy(why) => SessionEnd::Protocol(format!("refused: {why}")),
        }),
        NBD_OPT_ABORT => {
            put_option_reply(out, option, NBD_REP_ACK, &[]);
            Ok(Next::Abort)
        }
        _ => {
            match refusal {
                Refusal::Shutdown => {
                    put_option_error(out, option, NBD_REP_ERR_SHUTDOWN, "server is shutting down")
                }
                Refusal::Busy(why) => put_option_error(out, option, NBD_REP_ERR_POLICY, why),
            }
            Ok(Next::Continue)
        }
    }
}

impl Haggle {
    fn option(
        &mut self,
        exports: &Exports,
        out: &mut Vec<u8>,
        option: u32,
        data: &[u8],
    ) -> Result<Next, SessionEnd> {
        if self.tls.required_first() && !matches!(option, NBD_OPT_STARTTLS | NBD_OPT_ABORT) {
            if option == NBD_OPT_EXPORT_NAME {
                return Err(SessionEnd::Protocol(
                    "NBD_OPT_EXPORT_NAME before NBD_OPT_STARTTLS, and this server requires TLS"
                        .into(),
                ));
            }
            put_option_error(
                out,
                option,
                NBD_REP_ERR_TLS_REQD,
                "this server requires TLS: send NBD_OPT_STARTTLS first",
            );
            return Ok(Next::Continue);
        }
        match option {
            NBD_OPT_STARTTLS => Ok(self.start_tls(out, data)),
            NBD_OPT_EXPORT_NAME => self.export_name(exports, out, data),
            NBD_OPT_ABORT => {
                // The specification asks servers to ignore any data here.
                put_option_reply(out, option, NBD_REP_ACK, &[]);
                Ok(Next::Abort)
            }
            NBD_OPT_LIST => {
                if data.is_empty() {
                    for (name, description) in exports.list() {
                        put_rep_server(out, option, &name, description.as_deref());
                    }
                    put_option_reply(out, option, NBD_REP_ACK, &[]);
                } else {
                    put_option_error(
                        out,
                        option,
                        NBD_REP_ERR_INVALID,
                        "NBD_OPT_LIST takes no data",
                    );
                }
                Ok(Next::Continue)
            }
            NBD_OPT_INFO | NBD_OPT_GO => Ok(self.info_or_go(exports, out, option, data)),
            NBD_OPT_STRUCTURED_REPLY => {
                if data.is_empty() {
                    self.structured_replies = true;
                    put_option_reply(out, option, NBD_REP_ACK, &[]);
                } else {
                    put_option_error(
                        out,
                        option,
                        NBD_REP_ERR_INVALID,
                        "NBD_OPT_STRUCTURED_REPLY takes no data",
                    );
                }
                Ok(Next::Continue)
            }
            NBD_OPT_LIST_META_CONTEXT => {
                self.list_meta_context(exports, out, data);
                Ok(Next::Continue)
            }
            NBD_OPT_SET_META_CONTEXT => {
                self.set_meta_context(exports, out, data);
                Ok(Next::Continue)
            }
            _ => {
                put_option_error(
                    out,
                    option,
                    NBD_REP_ERR_UNSUP,
                    &format!("option {option} is not supported by this server"),
                );
                Ok(Next::Continue)
            }
        }
    }

    fn start_tls(&self, out: &mut Vec<u8>, data: &[u8]) -> Next {
        let option = NBD_OPT_STARTTLS;
        let refusal = if !data.is_empty() {
            Some((NBD_REP_ERR_INVALID, "NBD_OPT_STARTTLS takes no data"))
        } else if self.tls.mode == TlsMode::Off {
            Some((NBD_REP_ERR_POLICY, "TLS is not enabled on this server"))
        } else if self.tls.active {
            Some((NBD_REP_ERR_INVALID, "TLS is already in use"))
        } else {
            None
        };
        match refusal {
            Some((reply_type, message)) => {
                put_option_error(out, option, reply_type, message);
                Next::Continue
            }
            None => {
                put_option_reply(out, option, NBD_REP_ACK, &[]);
                Next::StartTls
            }
        }
    }

    fn export_name(
        &self,
        exports: &Exports,
        out: &mut Vec<u8>,
        name: &[u8],
    ) -> Result<Next, SessionEnd> {
        let Some((export, id)) = exports.find(name) else {
            let shown = &name[..name.len().min(256)];
            return Err(SessionEnd::Protocol(format!(
                "NBD_OPT_EXPORT_NAME for unknown export {:?}",
                String::from_utf8_lossy(shown)
            )));
        };
        let flags = transmission_flags(export.read_only, self.structured_replies);
        put_export_name_reply(out, export.size_bytes, flags, self.no_zeroes);
        Ok(Next::Transmission(Negotiated {
            structured_replies: self.structured_replies,
            base_allocation_id: self.base_allocation_id,
            compression_id: self.compression_id,
            block_size_agreed: false,
            export: id,
        }))
    }

    fn unknown_export(exports: &Exports, out: &mut Vec<u8>, option: u32, name: &[u8]) {
        put_option_error(
            out,
            option,
            NBD_REP_ERR_UNKNOWN,
            &format!(
                "no export named {:?}; this server exports {:?}",
                String::from_utf8_lossy(name),
                exports
                    .list()
                    .into_iter()
                    .map(|(name, _)| name)
                    .collect::<Vec<_>>()
            ),
        );
    }

    fn info_or_go(
        &mut self,
        exports: &Exports,
        out: &mut Vec<u8>,
        option: u32,
        data: &[u8],
    ) -> Next {
        let request = match parse_go_option(data) {
            Ok(request) => request,
            Err(error) => {
                put_option_error(out, option, NBD_REP_ERR_INVALID, &error.to_string());
                return Next::Continue;
            }
        };
        let Some((export, id)) = exports.find(request.export_name) else {
            Self::unknown_export(exports, out, option, request.export_name);
            return Next::Continue;
        };
        let flags = transmission_flags(export.read_only, self.structured_replies);
        put_info_export(out, option, export.size_bytes, flags);
        // Sent whether asked for or not: it tells every client our limits,
        // and the specification allows unrequested information replies.
        put_info_block_size(
            out,
            option,
            MIN_BLOCK_BYTES,
            PREFERRED_BLOCK_BYTES,
            MAX_PAYLOAD_BYTES,
        );
        if request.requests(NBD_INFO_NAME) {
            put_info_string(out, option, NBD_INFO_NAME, &export.name);
        }
        if request.requests(NBD_INFO_DESCRIPTION) {
            if let Some(description) = &export.description {
                put_info_string(out, option, NBD_INFO_DESCRIPTION, description);
            }
        }
        put_option_reply(out, option, NBD_REP_ACK, &[]);
        if option == NBD_OPT_GO {
            Next::Transmission(Negotiated {
                structured_replies: self.structured_replies,
                base_allocation_id: self.base_allocation_id,
                compression_id: self.compression_id,
                block_size_agreed: request.requests(NBD_INFO_BLOCK_SIZE),
                export: id,
            })
        } else {
            Next::Continue
        }
    }

    fn list_meta_context(&self, exports: &Exports, out: &mut Vec<u8>, data: &[u8]) {
        let option = NBD_OPT_LIST_META_CONTEXT;
        let request = match parse_meta_context_option(data) {
            Ok(request) => request,
            Err(error) => {
                put_option_error(out, option, NBD_REP_ERR_INVALID, &error.to_string());
                return;
            }
        };
        if exports.find(request.export_name).is_none() {
            Self::unknown_export(exports, out, option, request.export_name);
            return;
        }
        // No queries lists everything; `base:` and `zdisk:` are namespace
        // wildcards. Queries for other namespaces or leaves are ignored, as
        // required.
        let asked = |namespace: &str, name: &str| {
            request.queries.is_empty()
                || request
                    .queries
                    .iter()
                    .any(|query| *query == namespace.as_bytes() || *query == name.as_bytes())
        };
        // Context ids in LIST replies are reserved and should be zero.
        if asked(BASE_NAMESPACE, BASE_ALLOCATION) {
            put_meta_context(out, option, 0, BASE_ALLOCATION);
        }
        if asked(ZDISK_NAMESPACE, ZDISK_COMPRESSION) {
            put_meta_context(out, option, 0, ZDISK_COMPRESSION);
        }
        put_option_reply(out, option, NBD_REP_ACK, &[]);
    }

    fn set_meta_context(&mut self, exports: &Exports, out: &mut Vec<u8>, data: &[u8]) {
        let option = NBD_OPT_SET_META_CONTEXT;
        // Every SET replaces the previous selection, even when it fails.
        self.base_allocation_id = None;
        self.compression_id = None;
        if !self.structured_replies {
            put_option_error(
                out,
                option,
                NBD_REP_ERR_INVALID,
                "NBD_OPT_SET_META_CONTEXT requires NBD_OPT_STRUCTURED_REPLY first",
            );
            return;
        }
        let request = match parse_meta_context_option(data) {
            Ok(request) => request,
            Err(error) => {
                put_option_error(out, option, NBD_REP_ERR_INVALID, &error.to_string());
                return;
            }
        };
        if exports.find(request.export_name).is_none() {
            Self::unknown_export(exports, out, option, request.export_name);
            return;
        }
        // A namespace alone must select nothing in SET; unknown queries
        // are ignored.
        let asked = |name: &str| request.queries.contains(&name.as_bytes());
        if asked(BASE_ALLOCATION) {
            self.base_allocation_id = Some(BASE_ALLOCATION_ID);
            put_meta_context(out, option, BASE_ALLOCATION_ID, BASE_ALLOCATION);
        }
        if asked(ZDISK_COMPRESSION) {
            self.compression_id = Some(ZDISK_COMPRESSION_ID);
            put_meta_context(out, option, ZDISK_COMPRESSION_ID, ZDISK_COMPRESSION);
        }
        put_option_reply(out, option, NBD_REP_ACK, &[]);
    }
}

#[cfg(test)]
mod tests {
    //! Flag computation; the option state machine itself is exercised over
    //! real sockets in `tests/handshake.rs` and by the fuzz entry points.

    use super::*;

    #[test]
    fn flags_follow_read_only_and_structured_replies() {
        let writable = transmission_flags(false, false);
        assert_ne!(writable & NBD_FLAG_SEND_TRIM, 0);
        assert_ne!(writable & NBD_FLAG_SEND_FAST_ZERO, 0);
        assert_eq!(writable & NBD_FLAG_READ_ONLY, 0);
        assert_eq!(writable & NBD_FLAG_SEND_DF, 0);

        let read_only = transmission_flags(true, true);
        assert_ne!(read_only & NBD_FLAG_READ_ONLY, 0);
        assert_eq!(read_only & NBD_FLAG_SEND_WRITE_ZEROES, 0);
        assert_eq!(read_only & NBD_FLAG_SEND_FAST_ZERO, 0);
        assert_ne!(read_only & NBD_FLAG_SEND_DF, 0);
        assert_ne!(read_only & NBD_FLAG_HAS_FLAGS, 0);
    }
}
