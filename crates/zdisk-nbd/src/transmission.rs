//! The transmission phase: read requests, check them, run them on the
//! device, send replies.
//!
//! One reader per connection parses requests and reads WRITE payloads; each
//! valid request becomes a job handed to a [`Dispatch`] (the shared worker
//! pool in the server, inline execution under the fuzzer). Jobs call the
//! device and send their reply under the connection's writer lock, so
//! replies go out whole but in completion order, which the specification
//! allows. The code is generic over `Read`/`Write` so the fuzzer runs it
//! without sockets.
//!
//! Invariants:
//! - Every request is checked by [`validate`] before the device sees it, and
//!   every rejected request still gets exactly one error reply. A rejected
//!   NBD_CMD_WRITE has its payload read and dropped in small chunks first,
//!   so the stream stays in sync whatever length it claims.
//! - A payload buffer is only allocated after the request passed validation
//!   (so it is at most [`MAX_PAYLOAD_BYTES`] and inside the export), and
//!   only once the connection's in-flight budget has room for it. Memory per
//!   connection is therefore bounded by that budget, plus one request.
//! - A reply is one `write_all` of a fully built buffer under the writer
//!   lock; a partial reply is never followed by another message.
//! - Device errors become NBD errno values here ([`errno_for`]) and nowhere
//!   else, and each one is logged with the engine's error text.
//! - A bad request magic means the stream cannot be resynchronised: the
//!   session ends with a hard disconnect. Everything else is answered and
//!   the connection carries on.
//! - When the reader stops (NBD_CMD_DISC, end of stream, shutdown, error),
//!   [`serve`] waits until every dispatched job has sent its reply.

use std::io::{self, Read, Write};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use zdisk_core::{BlockDevice, Error, ExtentState};

use crate::session::{discard, read_message, read_vec, ConnLog, SessionEnd};
use crate::wire::*;

/// The negotiated parameters a request is checked and executed against.
pub(crate) struct Session {
    pub device: Arc<dyn BlockDevice>,
    pub size_bytes: u64,
    pub read_only: bool,
    pub structured_replies: bool,
    pub base_allocation_id: Option<u32>,
    /// 512 if the client agreed to NBD_INFO_BLOCK_SIZE, else 1 (any byte).
    pub min_block_bytes: u64,
}

/// A request that passed [`validate`]; ranges are known to lie in the export.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Command {
    Read {
        offset: u64,
        length: u32,
    },
    Write {
        offset: u64,
        length: u32,
        fua: bool,
    },
    Flush,
    Trim {
        offset: u64,
        length: u32,
        fua: bool,
    },
    Cache {
        offset: u64,
        length: u32,
    },
    WriteZeroes {
        offset: u64,
        length: u32,
        may_punch: bool,
        fua: bool,
    },
    BlockStatus {
        offset: u64,
        length: u32,
        req_one: bool,
    },
    Disconnect,
}

impl Command {
    /// Bytes of buffer this command holds while in flight (payload or read data).
    fn buffer_bytes(&self) -> usize {
        match *self {
            Command::Read { length, .. } | Command::Write { length, .. } => length as usize,
            _ => 0,
        }
    }
}

impl std::fmt::Display for Command {
    /// The form used in log lines, e.g. `NBD_CMD_READ at 4096+512`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (name, range) = match *self {
            Command::Read { offset, length } => ("NBD_CMD_READ", Some((offset, length))),
            Command::Write { offset, length, .. } => ("NBD_CMD_WRITE", Some((offset, length))),
            Command::Flush => ("NBD_CMD_FLUSH", None),
            Command::Trim { offset, length, .. } => ("NBD_CMD_TRIM", Some((offset, length))),
            Command::Cache { offset, length } => ("NBD_CMD_CACHE", Some((offset, length))),
            Command::WriteZeroes { offset, length, .. } => {
                ("NBD_CMD_WRITE_ZEROES", Some((offset, length)))
            }
            Command::BlockStatus { offset, length, .. } => {
                ("NBD_CMD_BLOCK_STATUS", Some((offset, length)))
            }
            Command::Disconnect => ("NBD_CMD_DISC", None),
        };
        match range {
            Some((offset, length)) => write!(f, "{name} at {offset}+{length}"),
            None => write!(f, "{name}"),
        }
    }
}

/// Why a request was refused before reaching the device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Rejection {
    pub errno: u32,
    pub message: String,
}

fn reject(errno: u32, message: impl Into<String>) -> Rejection {
    Rejection {
        errno,
        message: message.into(),
    }
}

fn command_name(command: u16) -> &'static str {
    match command {
        NBD_CMD_READ => "NBD_CMD_READ",
        NBD_CMD_WRITE => "NBD_CMD_WRITE",
        NBD_CMD_DISC => "NBD_CMD_DISC",
        NBD_CMD_FLUSH => "NBD_CMD_FLUSH",
        NBD_CMD_TRIM => "NBD_CMD_TRIM",
        NBD_CMD_CACHE => "NBD_CMD_CACHE",
        NBD_CMD_WRITE_ZEROES => "NBD_CMD_WRITE_ZEROES",
        NBD_CMD_BLOCK_STATUS => "NBD_CMD_BLOCK_STATUS",
        _ => "unknown command",
    }
}

/// Checks a request against the protocol and the session, in this order:
/// command type, flags, flush fields, metadata context, read-only, payload
/// limit, zero-length block status, range, alignment. Pure, so the error
/// table can be unit-tested without sockets.
pub(crate) fn validate(header: &RequestHeader, session: &Session) -> Result<Command, Rejection> {
    let command = header.command;
    let name = command_name(command);
    // FUA is valid on every command (the specification says servers must
    // accept it, ignoring it where nothing is written).
    let allowed_flags = match command {
        NBD_CMD_DISC => return Ok(Command::Disconnect),
        NBD_CMD_READ if session.structured_replies => NBD_CMD_FLAG_FUA | NBD_CMD_FLAG_DF,
        NBD_CMD_READ | NBD_CMD_WRITE | NBD_CMD_FLUSH | NBD_CMD_TRIM | NBD_CMD_CACHE => {
            NBD_CMD_FLAG_FUA
        }
        NBD_CMD_WRITE_ZEROES => NBD_CMD_FLAG_FUA | NBD_CMD_FLAG_NO_HOLE | NBD_CMD_FLAG_FAST_ZERO,
        NBD_CMD_BLOCK_STATUS => NBD_CMD_FLAG_FUA | NBD_CMD_FLAG_REQ_ONE,
        _ => return Err(reject(NBD_EINVAL, format!("unknown command {command}"))),
    };
    let bad_flags = header.flags & !allowed_flags;
    if bad_flags != 0 {
        return Err(reject(
            NBD_EINVAL,
            format!("command flags {bad_flags:#x} are not valid for {name}"),
        ));
    }
    let fua = header.flags & NBD_CMD_FLAG_FUA != 0;
    let offset = header.offset;
    let length = header.length;

    if command == NBD_CMD_FLUSH {
        if offset != 0 || length != 0 {
            return Err(reject(
                NBD_EINVAL,
                "NBD_CMD_FLUSH must have zero offset and length",
            ));
        }
        return Ok(Command::Flush);
    }
    if command == NBD_CMD_BLOCK_STATUS && session.base_allocation_id.is_none() {
        return Err(reject(
            NBD_EINVAL,
            "NBD_CMD_BLOCK_STATUS without a metadata context selected",
        ));
    }
    let writes = matches!(command, NBD_CMD_WRITE | NBD_CMD_TRIM | NBD_CMD_WRITE_ZEROES);
    if writes && session.read_only {
        return Err(reject(NBD_EPERM, format!("{name} on a read-only export")));
    }
    if matches!(command, NBD_CMD_READ | NBD_CMD_WRITE) && length > MAX_PAYLOAD_BYTES {
        return Err(reject(
            NBD_EINVAL,
            format!(
                "{name} of {length} bytes exceeds the {MAX_PAYLOAD_BYTES}-byte maximum payload"
            ),
        ));
    }
    if command == NBD_CMD_BLOCK_STATUS && length == 0 {
        return Err(reject(NBD_EINVAL, "NBD_CMD_BLOCK_STATUS of zero length"));
    }
    let Some(end) = offset.checked_add(u64::from(length)) else {
        return Err(reject(
            NBD_EINVAL,
            format!("offset {offset} + length {length} overflows"),
        ));
    };
    if end > session.size_bytes {
        let errno = if matches!(command, NBD_CMD_WRITE | NBD_CMD_WRITE_ZEROES) {
            NBD_ENOSPC
        } else {
            NBD_EINVAL
        };
        return Err(reject(
            errno,
            format!(
                "{name} at offset {offset} + length {length} is past the end of the {}-byte export",
                session.size_bytes
            ),
        ));
    }
    let block = session.min_block_bytes;
    // A request that runs exactly to the end of an export whose size is not
    // a multiple of the block may have a short length; otherwise the last
    // bytes would be unreachable.
    if !offset.is_multiple_of(block)
        || (u64::from(length) % block != 0 && end != session.size_bytes)
    {
        return Err(reject(
            NBD_EINVAL,
            format!("{name} at offset {offset}, length {length} is not aligned to the agreed {block}-byte block size"),
        ));
    }

    Ok(match command {
        NBD_CMD_READ => Command::Read { offset, length },
        NBD_CMD_WRITE => Command::Write {
            offset,
            length,
            fua,
        },
        NBD_CMD_TRIM => Command::Trim {
            offset,
            length,
            fua,
        },
        NBD_CMD_CACHE => Command::Cache { offset, length },
        NBD_CMD_WRITE_ZEROES => Command::WriteZeroes {
            offset,
            length,
            // FAST_ZERO needs no special path: zeroing is metadata-only on
            // zdisk, so it is never slower than the equivalent write.
            may_punch: header.flags & NBD_CMD_FLAG_NO_HOLE == 0,
            fua,
        },
        NBD_CMD_BLOCK_STATUS => Command::BlockStatus {
            offset,
            length,
            req_one: header.flags & NBD_CMD_FLAG_REQ_ONE != 0,
        },
        _ => unreachable!("command {command} was checked above"),
    })
}

/// The NBD error value for an engine error. This is the only place engine
/// errors meet protocol errno values.
pub(crate) fn errno_for(error: &Error) -> u32 {
    match error {
        Error::ReadOnly => NBD_EPERM,
        Error::OutOfRange { .. } | Error::InvalidArgument(_) => NBD_EINVAL,
        Error::NoSpace { .. } => NBD_ENOSPC,
        Error::ShutDown => NBD_ESHUTDOWN,
        // Io, ChecksumMismatch, DamagedBlock, and anything added later.
        _ => NBD_EIO,
    }
}

/// The base:allocation flags for an extent state.
pub(crate) fn allocation_flags(state: ExtentState) -> u32 {
    match state {
        ExtentState::Hole => NBD_STATE_HOLE | NBD_STATE_ZERO,
        ExtentState::Zero => NBD_STATE_ZERO,
        ExtentState::Data => 0,
    }
}

fn error_reply(session: &Session, cookie: u64, errno: u32, message: &str) -> Vec<u8> {
    let mut out = Vec::new();
    if session.structured_replies {
        put_chunk_error(&mut out, cookie, errno, message);
    } else {
        put_simple_reply(&mut out, errno, cookie);
    }
    out
}

fn ok_reply(cookie: u64) -> Vec<u8> {
    // A simple reply is allowed for any successful non-READ command, with or
    // without structured replies, and is the shortest.
    let mut out = Vec::with_capacity(SIMPLE_REPLY_BYTES);
    put_simple_reply(&mut out, 0, cookie);
    out
}

/// Runs a validated command on the device and returns the complete reply.
/// Device errors are logged here, with the request they failed.
pub(crate) fn execute(
    session: &Session,
    log: &ConnLog,
    cookie: u64,
    command: Command,
    payload: &[u8],
) -> Vec<u8> {
    let device = &*session.device;
    let result = match command {
        Command::Read { offset, length } => {
            return read_reply(session, log, cookie, offset, length)
        }
        Command::BlockStatus {
            offset,
            length,
            req_one,
        } => return block_status_reply(session, log, cookie, offset, length, req_one),
        Command::Disconnect => unreachable!("NBD_CMD_DISC is handled by the reader"),
        Command::Write { length: 0, .. }
        | Command::Trim { length: 0, .. }
        | Command::Cache { length: 0, .. }
        | Command::WriteZeroes { length: 0, .. } => Ok(()),
        Command::Write { offset, fua, .. } => device.write(offset, payload, fua),
        Command::Flush => device.flush(),
        Command::Trim {
            offset,
            length,
            fua,
        } => device.trim(offset, u64::from(length), fua),
        Command::Cache { offset, length } => device.cache(offset, u64::from(length)),
        Command::WriteZeroes {
            offset,
            length,
            may_punch,
            fua,
        } => device.write_zeroes(offset, u64::from(length), may_punch, fua),
    };
    match result {
        Ok(()) => ok_reply(cookie),
        Err(error) => device_error_reply(session, log, cookie, command, &error),
    }
}

fn device_error_reply(
    session: &Session,
    log: &ConnLog,
    cookie: u64,
    command: Command,
    error: &Error,
) -> Vec<u8> {
    log.line(format_args!("device error on {command}: {error}"));
    error_reply(session, cookie, errno_for(error), &error.to_string())
}

fn read_reply(session: &Session, log: &ConnLog, cookie: u64, offset: u64, length: u32) -> Vec<u8> {
    let header_bytes = if session.structured_replies {
        CHUNK_HEADER_BYTES + 8
    } else {
        SIMPLE_REPLY_BYTES
    };
    if length == 0 {
        let mut out = Vec::new();
        if session.structured_replies {
            // OFFSET_DATA must carry at least one byte.
            put_chunk_none(&mut out, cookie);
        } else {
            put_simple_reply(&mut out, 0, cookie);
        }
        return out;
    }
    // Header and data share one buffer so the reply is a single write.
    let mut out = Vec::with_capacity(header_bytes + length as usize);
    if session.structured_replies {
        put_offset_data_header(&mut out, cookie, offset, length);
    } else {
        put_simple_reply(&mut out, 0, cookie);
    }
    debug_assert_eq!(out.len(), header_bytes);
    out.resize(header_bytes + length as usize, 0);
    match session.device.read(offset, &mut out[header_bytes..]) {
        Ok(()) => out,
        Err(error) => device_error_reply(
            session,
            log,
            cookie,
            Command::Read { offset, length },
            &error,
        ),
    }
}

fn block_status_reply(
    session: &Session,
    log: &ConnLog,
    cookie: u64,
    offset: u64,
    length: u32,
    req_one: bool,
) -> Vec<u8> {
    let command = Command::BlockStatus {
        offset,
        length,
        req_one,
    };
    let Some(context_id) = session.base_allocation_id else {
        unreachable!("validate() refuses block status without a context");
    };
    let max_descriptors = if req_one { 1 } else { MAX_BLOCK_STATUS_EXTENTS };
    let extents = match session
        .device
        .block_status(offset, u64::from(length), max_descriptors)
    {
        Ok(extents) => extents,
        Err(error) => return device_error_reply(session, log, cookie, command, &error),
    };
    let descriptors = merge_extents(
        extents.iter().map(|e| (e.length_bytes, e.state)),
        length,
        max_descriptors,
    );
    let mut out = Vec::new();
    if descriptors.is_empty() {
        log.line(format_args!(
            "device error on {command}: the device described no extents"
        ));
        put_chunk_error(
            &mut out,
            cookie,
            NBD_EIO,
            "the device described no extents for this range",
        );
    } else {
        put_block_status_chunk(&mut out, cookie, context_id, &descriptors);
    }
    out
}

/// Turns device extents into wire descriptors: clipped so they cover at
/// most `length` bytes (which also makes every descriptor fit 32 bits and
/// keeps REQ_ONE replies within the request), zero-length runs dropped,
/// neighbours with equal flags merged, at most `max_descriptors` kept.
pub(crate) fn merge_extents(
    extents: impl Iterator<Item = (u64, ExtentState)>,
    length: u32,
    max_descriptors: usize,
) -> Vec<Descriptor> {
    let mut remaining = u64::from(length);
    let mut descriptors: Vec<Descriptor> = Vec::new();
    for (extent_bytes, state) in extents {
        let run_bytes = extent_bytes.min(remaining);
        if run_bytes == 0 {
            if remaining == 0 {
                break;
            }
            continue;
        }
        // run_bytes <= remaining <= length, a u32.
        let run_bytes = run_bytes as u32;
        let flags = allocation_flags(state);
        let count = descriptors.len();
        match descriptors.last_mut() {
            Some(last) if last.flags == flags => last.length_bytes += run_bytes,
            _ if count == max_descriptors => break,
            _ => descriptors.push(Descriptor {
                length_bytes: run_bytes,
                flags,
            }),
        }
        remaining -= u64::from(run_bytes);
    }
    descriptors
}

// ---------------------------------------------------------------------------
// Connections and dispatch.

/// A unit of work handed from a reader to whoever executes requests.
pub(crate) type Job = Box<dyn FnOnce() + Send + 'static>;

/// Executes jobs: the server's worker pool, or [`Inline`] for the fuzzer.
pub(crate) trait Dispatch {
    fn dispatch(&self, job: Job);
}

/// Runs each job on the calling thread before returning.
pub(crate) struct Inline;

impl Dispatch for Inline {
    fn dispatch(&self, job: Job) {
        job();
    }
}

/// Limits on what one connection may have in flight at once.
#[derive(Debug, Clone, Copy)]
pub(crate) struct InFlightLimits {
    pub max_requests: usize,
    pub max_buffer_bytes: usize,
}

#[derive(Default)]
struct Budget {
    requests: usize,
    buffer_bytes: usize,
}

/// Counts a connection's dispatched-but-unanswered requests and their
/// buffers; the reader waits here when the connection is at its limit.
struct InFlight {
    limits: InFlightLimits,
    budget: Mutex<Budget>,
    changed: Condvar,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding one of these locks leaves consistent state
    // (counters, a socket), so poisoning carries no information here.
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl InFlight {
    fn acquire(&self, buffer_bytes: usize) {
        let mut budget = lock(&self.budget);
        // A request larger than the byte budget is admitted when it is alone,
        // so no valid request can wait forever.
        while budget.requests >= self.limits.max_requests
            || (budget.requests > 0
                && budget.buffer_bytes + buffer_bytes > self.limits.max_buffer_bytes)
        {
            budget = self
                .changed
                .wait(budget)
                .unwrap_or_else(|poisoned| poisoned.into_inner());
        }
        budget.requests += 1;
        budget.buffer_bytes += buffer_bytes;
    }

    fn release(&self, buffer_bytes: usize) {
        let mut budget = lock(&self.budget);
        assert!(budget.requests > 0, "release without acquire");
        assert!(
            budget.buffer_bytes >= buffer_bytes,
            "released more bytes than held"
        );
        budget.requests -= 1;
        budget.buffer_bytes -= buffer_bytes;
        self.changed.notify_all();
    }

    fn wait_idle(&self) {
        let mut budget = lock(&self.budget);
        while budget.requests > 0 {
            budget = self
                .changed
                .wait(budget)
                .unwrap_or_else(|poisoned| poisoned.into_inner());
        }
    }
}

/// One client connection in the transmission phase, shared by its reader
/// and by every job it dispatched.
pub(crate) struct Connection {
    session: Session,
    log: ConnLog,
    writer: Mutex<Box<dyn Write + Send>>,
    /// Why sending a reply failed, once it has; no further replies are sent.
    send_failure: Mutex<Option<String>>,
    /// Called once when sending fails, to wake the reader (shuts the socket).
    on_send_failure: Box<dyn Fn() + Send + Sync>,
    in_flight: InFlight,
    requests: AtomicU64,
}

impl Connection {
    pub fn new(
        session: Session,
        log: ConnLog,
        writer: Box<dyn Write + Send>,
        on_send_failure: Box<dyn Fn() + Send + Sync>,
        limits: InFlightLimits,
    ) -> Self {
        assert!(
            limits.max_requests > 0,
            "a connection needs room for one request"
        );
        Connection {
            session,
            log,
            writer: Mutex::new(writer),
            send_failure: Mutex::new(None),
            on_send_failure,
            in_flight: InFlight {
                limits,
                budget: Mutex::new(Budget::default()),
                changed: Condvar::new(),
            },
            requests: AtomicU64::new(0),
        }
    }

    /// Requests read so far, valid or not.
    pub fn request_count(&self) -> u64 {
        self.requests.load(Ordering::Relaxed)
    }

    fn send_failed(&self) -> Option<String> {
        lock(&self.send_failure).clone()
    }

    fn send_failure_end(&self) -> Option<SessionEnd> {
        self.send_failed().map(|failure| {
            SessionEnd::Io(io::Error::other(format!(
                "sending a reply failed: {failure}"
            )))
        })
    }

    /// Writes one complete reply, unless an earlier reply already failed.
    fn send(&self, reply: &[u8]) {
        if self.send_failed().is_some() {
            return;
        }
        let mut writer = lock(&self.writer);
        if let Err(error) = writer.write_all(reply).and_then(|()| writer.flush()) {
            drop(writer);
            let mut failure = lock(&self.send_failure);
            if failure.is_none() {
                *failure = Some(error.to_string());
                drop(failure);
                (self.on_send_failure)();
            }
        }
    }
}

/// A place in the connection's in-flight budget, held by a dispatched job
/// until its reply is sent; released on drop, even if the job panics.
struct Permit {
    connection: Arc<Connection>,
    buffer_bytes: usize,
}

impl Permit {
    fn acquire(connection: &Arc<Connection>, buffer_bytes: usize) -> Self {
        connection.in_flight.acquire(buffer_bytes);
        Permit {
            connection: Arc::clone(connection),
            buffer_bytes,
        }
    }

    fn run(self, cookie: u64, command: Command, payload: Vec<u8>) {
        let connection = &*self.connection;
        let outcome = catch_unwind(AssertUnwindSafe(|| {
            execute(
                &connection.session,
                &connection.log,
                cookie,
                command,
                &payload,
            )
        }));
        drop(payload);
        let reply = outcome.unwrap_or_else(|_| {
            // A panic below us is a bug in the device; answer the client
            // rather than leave it waiting for this cookie forever.
            connection
                .log
                .line(format_args!("device panicked on {command}"));
            error_reply(
                &connection.session,
                cookie,
                NBD_EIO,
                "internal error in the server",
            )
        });
        connection.send(&reply);
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.connection.in_flight.release(self.buffer_bytes);
    }
}

/// Reads and dispatches requests until the session ends, then waits until
/// every dispatched request has been answered. `stopping` is polled before
/// each request; once true, no further request is read.
pub(crate) fn serve<R: Read + ?Sized>(
    reader: &mut R,
    connection: &Arc<Connection>,
    dispatch: &dyn Dispatch,
    stopping: &dyn Fn() -> bool,
) -> SessionEnd {
    let end = loop {
        if stopping() {
            break SessionEnd::Shutdown;
        }
        if let Some(end) = connection.send_failure_end() {
            break end;
        }
        let mut header_bytes = [0u8; REQUEST_HEADER_BYTES];
        let read = read_message(reader, &mut header_bytes);
        // A read cut short by shutdown or by a failed send is reported as
        // that, not as the client's doing.
        if !matches!(read, Ok(true)) {
            if stopping() {
                break SessionEnd::Shutdown;
            }
            if let Some(end) = connection.send_failure_end() {
                break end;
            }
        }
        match read {
            Ok(true) => {}
            Ok(false) => break SessionEnd::ClientClosed,
            Err(error) => break error.into(),
        }
        match handle_request(reader, connection, dispatch, &header_bytes) {
            Ok(true) => {}
            Ok(false) => break SessionEnd::ClientDisconnect,
            Err(end) => break end,
        }
    };
    connection.in_flight.wait_idle();
    end
}

/// Handles one request whose header has been read. Returns `Ok(false)` for
/// NBD_CMD_DISC.
fn handle_request<R: Read + ?Sized>(
    reader: &mut R,
    connection: &Arc<Connection>,
    dispatch: &dyn Dispatch,
    header_bytes: &[u8],
) -> Result<bool, SessionEnd> {
    let header = parse_request_header(header_bytes).map_err(|error| {
        SessionEnd::Protocol(format!("cannot resynchronise after a bad request: {error}"))
    })?;
    connection.requests.fetch_add(1, Ordering::Relaxed);
    match validate(&header, &connection.session) {
        Ok(Command::Disconnect) => Ok(false),
        Ok(command) => {
            let permit = Permit::acquire(connection, command.buffer_bytes());
            let payload = match command {
                Command::Write { length, .. } => read_vec(reader, length as usize)?,
                _ => Vec::new(),
            };
            let cookie = header.cookie;
            dispatch.dispatch(Box::new(move || permit.run(cookie, command, payload)));
            Ok(true)
        }
        Err(rejection) => {
            if header.command == NBD_CMD_WRITE {
                discard(reader, u64::from(header.length))?;
            }
            connection.send(&error_reply(
                &connection.session,
                header.cookie,
                rejection.errno,
                &rejection.message,
            ));
            Ok(true)
        }
    }
}

#[cfg(test)]
mod tests {
    //! The request validation table, errno mapping and extent merging, without
    //! sockets: each error rule from the specification (and the project brief)
    //! is checked on its own, with a valid neighbour that must pass.

    use super::*;
    use crate::testing::RamDevice;

    const SIZE: u64 = 1 << 20;

    fn session(structured: bool, context: bool, aligned: bool, read_only: bool) -> Session {
        Session {
            device: Arc::new(RamDevice::new(SIZE)),
            size_bytes: SIZE,
            read_only,
            structured_replies: structured,
            base_allocation_id: context.then_some(BASE_ALLOCATION_ID),
            min_block_bytes: if aligned { 512 } else { 1 },
        }
    }

    fn header(command: u16, flags: u16, offset: u64, length: u32) -> RequestHeader {
        RequestHeader {
            flags,
            command,
            cookie: 1,
            offset,
            length,
        }
    }

    fn errno(result: Result<Command, Rejection>) -> u32 {
        match result {
            Ok(command) => panic!("expected a rejection, got {command:?}"),
            Err(rejection) => rejection.errno,
        }
    }

    #[test]
    fn unknown_commands_and_flags_are_einval() {
        let s = session(true, true, true, false);
        assert_eq!(errno(validate(&header(9, 0, 0, 512), &s)), NBD_EINVAL);
        assert_eq!(
            errno(validate(&header(NBD_CMD_RESIZE, 0, 0, 0), &s)),
            NBD_EINVAL
        );
        assert_eq!(
            errno(validate(
                &header(NBD_CMD_WRITE, NBD_CMD_FLAG_NO_HOLE, 0, 512),
                &s
            )),
            NBD_EINVAL
        );
        assert_eq!(
            errno(validate(&header(NBD_CMD_READ, 1 << 15, 0, 512), &s)),
            NBD_EINVAL
        );
        // FUA is accepted everywhere, DF on structured reads only.
        for command in [
            NBD_CMD_READ,
            NBD_CMD_WRITE,
            NBD_CMD_TRIM,
            NBD_CMD_CACHE,
            NBD_CMD_WRITE_ZEROES,
            NBD_CMD_BLOCK_STATUS,
        ] {
            assert!(validate(&header(command, NBD_CMD_FLAG_FUA, 0, 512), &s).is_ok());
        }
        assert!(validate(&header(NBD_CMD_FLUSH, NBD_CMD_FLAG_FUA, 0, 0), &s).is_ok());
        assert!(validate(&header(NBD_CMD_READ, NBD_CMD_FLAG_DF, 0, 512), &s).is_ok());
        let simple = session(false, false, true, false);
        assert_eq!(
            errno(validate(
                &header(NBD_CMD_READ, NBD_CMD_FLAG_DF, 0, 512),
                &simple
            )),
            NBD_EINVAL
        );
    }

    #[test]
    fn ranges_past_the_end() {
        let s = session(true, true, false, false);
        assert_eq!(
            errno(validate(&header(NBD_CMD_READ, 0, SIZE - 1, 2), &s)),
            NBD_EINVAL
        );
        assert_eq!(
            errno(validate(&header(NBD_CMD_WRITE, 0, SIZE - 1, 2), &s)),
            NBD_ENOSPC
        );
        assert_eq!(
            errno(validate(&header(NBD_CMD_WRITE_ZEROES, 0, SIZE, 1), &s)),
            NBD_ENOSPC
        );
        assert_eq!(
            errno(validate(&header(NBD_CMD_TRIM, 0, SIZE, 1), &s)),
            NBD_EINVAL
        );
        assert_eq!(
            errno(validate(&header(NBD_CMD_CACHE, 0, SIZE, 1), &s)),
            NBD_EINVAL
        );
        assert_eq!(
            errno(validate(&header(NBD_CMD_BLOCK_STATUS, 0, SIZE, 1), &s)),
            NBD_EINVAL
        );
        assert_eq!(
            errno(validate(&header(NBD_CMD_WRITE, 0, u64::MAX, 1), &s)),
            NBD_EINVAL,
            "overflow is EINVAL even for writes"
        );
        assert!(validate(&header(NBD_CMD_READ, 0, SIZE - 1, 1), &s).is_ok());
        assert!(validate(&header(NBD_CMD_READ, 0, SIZE, 0), &s).is_ok());
    }

    #[test]
    fn lengths_and_special_fields() {
        let s = session(true, true, false, false);
        let too_big = MAX_PAYLOAD_BYTES + 1;
        let big = session_with_size(u64::from(too_big) * 2);
        assert_eq!(
            errno(validate(&header(NBD_CMD_READ, 0, 0, too_big), &big)),
            NBD_EINVAL
        );
        assert_eq!(
            errno(validate(&header(NBD_CMD_WRITE, 0, 0, too_big), &big)),
            NBD_EINVAL
        );
        assert!(validate(&header(NBD_CMD_TRIM, 0, 0, too_big), &big).is_ok());
        assert!(validate(&header(NBD_CMD_WRITE, 0, 0, MAX_PAYLOAD_BYTES), &big).is_ok());
        assert_eq!(
            errno(validate(&header(NBD_CMD_BLOCK_STATUS, 0, 0, 0), &s)),
            NBD_EINVAL
        );
        assert!(validate(&header(NBD_CMD_WRITE, 0, 0, 0), &s).is_ok());
        assert_eq!(
            errno(validate(&header(NBD_CMD_FLUSH, 0, 1, 0), &s)),
            NBD_EINVAL
        );
        assert_eq!(
            errno(validate(&header(NBD_CMD_FLUSH, 0, 0, 1), &s)),
            NBD_EINVAL
        );
        let no_context = session(true, false, false, false);
        assert_eq!(
            errno(validate(
                &header(NBD_CMD_BLOCK_STATUS, 0, 0, 512),
                &no_context
            )),
            NBD_EINVAL
        );
        assert_eq!(
            validate(&header(NBD_CMD_DISC, 0xffff, 7, 7), &s),
            Ok(Command::Disconnect)
        );
    }

    fn session_with_size(size_bytes: u64) -> Session {
        Session {
            size_bytes,
            ..session(true, true, false, false)
        }
    }

    #[test]
    fn alignment_only_when_agreed() {
        let aligned = session(true, true, true, false);
        let any = session(true, true, false, false);
        for (offset, length) in [(1, 512), (512, 1), (100, 100)] {
            for command in [
                NBD_CMD_READ,
                NBD_CMD_WRITE,
                NBD_CMD_TRIM,
                NBD_CMD_WRITE_ZEROES,
            ] {
                assert_eq!(
                    errno(validate(&header(command, 0, offset, length), &aligned)),
                    NBD_EINVAL
                );
                assert!(validate(&header(command, 0, offset, length), &any).is_ok());
            }
        }
        // The unaligned tail of an unaligned export stays reachable.
        let odd = Session {
            size_bytes: 1000,
            ..session(true, true, true, false)
        };
        assert!(validate(&header(NBD_CMD_READ, 0, 512, 488), &odd).is_ok());
        assert_eq!(
            errno(validate(&header(NBD_CMD_READ, 0, 0, 488), &odd)),
            NBD_EINVAL
        );
    }

    #[test]
    fn read_only_refuses_write_types_with_eperm() {
        let s = session(true, true, true, true);
        for command in [NBD_CMD_WRITE, NBD_CMD_TRIM, NBD_CMD_WRITE_ZEROES] {
            assert_eq!(errno(validate(&header(command, 0, 0, 512), &s)), NBD_EPERM);
        }
        for command in [NBD_CMD_READ, NBD_CMD_CACHE, NBD_CMD_BLOCK_STATUS] {
            assert!(validate(&header(command, 0, 0, 512), &s).is_ok());
        }
        assert!(validate(&header(NBD_CMD_FLUSH, 0, 0, 0), &s).is_ok());
    }

    #[test]
    fn write_zeroes_flags_map_to_device_arguments() {
        let s = session(true, true, true, false);
        let flags = NBD_CMD_FLAG_NO_HOLE | NBD_CMD_FLAG_FAST_ZERO | NBD_CMD_FLAG_FUA;
        assert_eq!(
            validate(&header(NBD_CMD_WRITE_ZEROES, flags, 512, 1024), &s),
            Ok(Command::WriteZeroes {
                offset: 512,
                length: 1024,
                may_punch: false,
                fua: true
            })
        );
    }

    #[test]
    fn engine_errors_map_to_protocol_errnos() {
        assert_eq!(errno_for(&Error::ReadOnly), NBD_EPERM);
        assert_eq!(
            errno_for(&Error::OutOfRange {
                offset: 1,
                length: 2,
                size: 3
            }),
            NBD_EINVAL
        );
        assert_eq!(errno_for(&Error::InvalidArgument("x".into())), NBD_EINVAL);
        assert_eq!(
            errno_for(&Error::NoSpace {
                free_segments: 0,
                reserved_segments: 2
            }),
            NBD_ENOSPC
        );
        assert_eq!(errno_for(&Error::ShutDown), NBD_ESHUTDOWN);
        assert_eq!(
            errno_for(&Error::io("reading", io::Error::other("x"))),
            NBD_EIO
        );
        assert_eq!(
            errno_for(&Error::ChecksumMismatch {
                lba: 0,
                segment: 0,
                offset: 0,
                expected: 0,
                actual: 1
            }),
            NBD_EIO
        );
        assert_eq!(errno_for(&Error::CorruptImage("x".into())), NBD_EIO);
    }

    #[test]
    fn extents_are_clipped_merged_and_capped() {
        use ExtentState::*;
        let merged = merge_extents(
            [(100, Hole), (50, Hole), (10, Zero), (5, Data), (1000, Data)].into_iter(),
            200,
            10,
        );
        assert_eq!(
            merged,
            vec![
                Descriptor {
                    length_bytes: 150,
                    flags: NBD_STATE_HOLE | NBD_STATE_ZERO
                },
                Descriptor {
                    length_bytes: 10,
                    flags: NBD_STATE_ZERO
                },
                Descriptor {
                    length_bytes: 40,
                    flags: 0
                },
            ]
        );
        // REQ_ONE: one descriptor, never longer than the request.
        let one = merge_extents([(1 << 40, Data)].into_iter(), 4096, 1);
        assert_eq!(
            one,
            vec![Descriptor {
                length_bytes: 4096,
                flags: 0
            }]
        );
        let capped = merge_extents(
            [(1, Hole), (1, Data), (1, Hole), (1, Data)].into_iter(),
            4,
            2,
        );
        assert_eq!(capped.len(), 2);
        assert!(merge_extents([(0, Data)].into_iter(), 4, 2).is_empty());
    }
}
