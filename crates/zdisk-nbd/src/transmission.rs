//! The transmission phase of one connection: read requests, dispatch them,
//! and deliver their replies.
//!
//! One reader per connection parses requests and reads WRITE payloads; each
//! valid request becomes a job handed to a [`Dispatch`] (the shared worker
//! pool in the server, inline execution under the fuzzer). A job runs the
//! request on the device and hands its complete reply to the connection's
//! [`Outbox`]: written at once if the socket takes it, otherwise queued for
//! the connection's own sender thread, so a worker never waits for a
//! client's socket and a client that stops reading its replies only stops
//! itself. Replies go out whole, in completion order, which the
//! specification allows.
//!
//! Invariants:
//! - Every request is checked by `request::validate` before the device
//!   sees it, and every request, valid or not, gets exactly one reply
//!   (unless the connection fails). A rejected NBD_CMD_WRITE has its payload
//!   read and dropped in small chunks first, so the stream stays in sync
//!   whatever length it claims.
//! - A payload buffer is only allocated after the request passed validation
//!   (so it is at most `MAX_PAYLOAD_BYTES` and inside the export), and only
//!   once the connection's and the server's in-flight budgets have room for
//!   it (`budget.rs`). Replies hold their place in those budgets until they
//!   are sent, so unsent replies are bounded too.
//! - A reply is one `write_all` of a fully built buffer; after a failed send
//!   nothing more is sent, the socket is shut, and the reader stops.
//! - When the reader stops (NBD_CMD_DISC, end of stream, shutdown, error),
//!   [`serve`] waits until every dispatched request has been answered.

use std::collections::VecDeque;
use std::io;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use crate::budget::{InFlight, InFlightLimits, MemoryBudget};
use crate::buffers::Buffers;
use crate::reply::{error_reply, execute};
use crate::request::{validate, Command, Session};
use crate::session::{discard, ConnLog, RequestStream, SessionEnd};
use crate::wire::*;

/// After a write this long, the next header is read alone (see
/// [`RequestStream::read_header`]).
const DIRECT_HEADER_AFTER_BYTES: usize = 64 * 1024;

/// Rejected requests logged per connection before the log goes quiet about
/// them (the closing line still counts them all).
const LOGGED_REJECTIONS: u64 = 5;

/// A unit of work handed from a reader to whoever executes requests.
pub(crate) type Job = Box<dyn FnOnce() + Send + 'static>;

/// Which queue a job waits in. Reads must not wait behind writes: a
/// streaming writer keeps every general worker compressing for a
/// millisecond or more per request, so reads (and the other requests that
/// only look) have workers of their own (`pool.rs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Lane {
    /// READ, CACHE, BLOCK_STATUS: served by the read workers first.
    Quick,
    /// Everything that changes or syncs the device.
    Bulk,
}

impl Lane {
    pub(crate) fn of(command: &Command) -> Lane {
        match command {
            Command::Read { .. } | Command::Cache { .. } | Command::BlockStatus { .. } => {
                Lane::Quick
            }
            _ => Lane::Bulk,
        }
    }
}

/// Executes jobs: the server's worker pool, or [`Inline`] for the fuzzer.
pub(crate) trait Dispatch {
    fn dispatch(&self, job: Job, lane: Lane);
}

/// Runs each job on the calling thread before returning.
#[cfg(any(test, feature = "testing"))]
pub(crate) struct Inline;

#[cfg(any(test, feature = "testing"))]
impl Dispatch for Inline {
    fn dispatch(&self, job: Job, _lane: Lane) {
        job();
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding one of these locks leaves consistent state
    // (a queue, a writer), so poisoning carries no information here.
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Replies on their way to one client.
///
/// A worker with a finished reply writes it itself when nothing else is
/// being written and the socket takes it at once (the common case, which
/// costs no thread switch); whatever the socket does not take goes to the
/// front of the queue, and the connection's sender thread, which may wait
/// on the socket, writes the rest. `busy` makes one writer at a time, so
/// replies never interleave.
pub(crate) struct Outbox {
    queue: Mutex<OutboxState>,
    ready: Condvar,
    /// Writes what the socket takes now, without waiting.
    try_write: TryWrite,
}

/// See [`Outbox`]: a write that never waits, returning the bytes taken.
pub(crate) type TryWrite = Box<dyn Fn(&[u8]) -> io::Result<usize> + Send + Sync>;

impl Outbox {
    pub fn new(try_write: TryWrite) -> Outbox {
        Outbox {
            queue: Mutex::new(OutboxState::default()),
            ready: Condvar::new(),
            try_write,
        }
    }
}

/// A reply, how much of it is already sent, and its place in the budget.
type Pending = (Vec<u8>, usize, Permit);

#[derive(Default)]
struct OutboxState {
    replies: VecDeque<Pending>,
    /// A thread is writing to the socket.
    busy: bool,
    /// No more replies will come; the sender exits once the queue is empty.
    closed: bool,
}

/// One client connection in the transmission phase, shared by its reader,
/// its sender and every job it dispatched.
pub(crate) struct Connection {
    session: Session,
    log: ConnLog,
    outbox: Outbox,
    /// Why sending a reply failed, once it has; no further replies are sent.
    send_failure: Mutex<Option<String>>,
    /// Called once when sending fails, to wake the reader (shuts the socket).
    on_send_failure: Box<dyn Fn() + Send + Sync>,
    in_flight: InFlight,
    /// Large buffers kept for the next read reply or write payload.
    buffers: Buffers,
    requests: AtomicU64,
    rejections: AtomicU64,
}

impl Connection {
    pub fn new(
        session: Session,
        log: ConnLog,
        outbox: Outbox,
        on_send_failure: Box<dyn Fn() + Send + Sync>,
        limits: InFlightLimits,
        server_budget: Arc<MemoryBudget>,
    ) -> Self {
        Connection {
            session,
            log,
            outbox,
            send_failure: Mutex::new(None),
            on_send_failure,
            in_flight: InFlight::new(limits, server_budget),
            buffers: Buffers::default(),
            requests: AtomicU64::new(0),
            rejections: AtomicU64::new(0),
        }
    }

    /// Requests read so far, valid or not.
    pub fn request_count(&self) -> u64 {
        self.requests.load(Ordering::Relaxed)
    }

    /// Requests refused before reaching the device.
    pub fn rejection_count(&self) -> u64 {
        self.rejections.load(Ordering::Relaxed)
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

    fn fail_sending(&self, error: &io::Error) {
        let mut failure = lock(&self.send_failure);
        if failure.is_none() {
            *failure = Some(error.to_string());
            drop(failure);
            (self.on_send_failure)();
        }
    }

    /// Hands over one complete reply; its permit is released once it has
    /// been written (or dropped, if sending already failed).
    fn deliver(&self, reply: Vec<u8>, permit: Permit) {
        if self.send_failed().is_some() {
            return;
        }
        let outbox = &self.outbox;
        let mut state = lock(&outbox.queue);
        if state.busy || !state.replies.is_empty() {
            state.replies.push_back((reply, 0, permit));
            drop(state);
            outbox.ready.notify_one();
            return;
        }
        state.busy = true;
        drop(state);
        let sent = (outbox.try_write)(&reply);
        let mut state = lock(&outbox.queue);
        state.busy = false;
        match sent {
            Ok(sent) if sent == reply.len() => {
                drop(permit);
                self.buffers.give(reply);
            }
            Ok(sent) => state.replies.push_front((reply, sent, permit)),
            Err(error) => {
                drop(state);
                self.log
                    .line(format_args!("sending a reply failed: {error}"));
                self.fail_sending(&error);
                outbox.ready.notify_one();
                return;
            }
        }
        let waiting = !state.replies.is_empty();
        drop(state);
        if waiting {
            outbox.ready.notify_one();
        }
    }

    /// The sender thread's body: writes queued replies with `write` until
    /// the outbox is closed and empty. After a failed write, later replies
    /// are dropped unsent.
    pub fn send_loop(&self, write: &dyn Fn(&[u8]) -> io::Result<()>) {
        let outbox = &self.outbox;
        loop {
            let next = {
                let mut state = lock(&outbox.queue);
                loop {
                    if !state.busy {
                        if let Some(next) = state.replies.pop_front() {
                            state.busy = true;
                            break Some(next);
                        }
                        if state.closed {
                            break None;
                        }
                    }
                    state = outbox
                        .ready
                        .wait(state)
                        .unwrap_or_else(|poisoned| poisoned.into_inner());
                }
            };
            let Some((reply, sent, permit)) = next else {
                return;
            };
            if self.send_failed().is_none() {
                if let Err(error) = write(&reply[sent..]) {
                    self.log
                        .line(format_args!("sending a reply failed: {error}"));
                    self.fail_sending(&error);
                }
            }
            lock(&outbox.queue).busy = false;
            drop(permit);
            self.buffers.give(reply);
        }
    }

    /// Tells the sender that no more replies will come.
    fn close_outbox(&self) {
        lock(&self.outbox.queue).closed = true;
        self.outbox.ready.notify_all();
    }

    /// Answers a request refused before the device saw it, and logs the
    /// first few refusals of the connection with their reasons.
    fn reject(&self, permit: Permit, cookie: u64, errno: u32, message: &str) {
        let count = self.rejections.fetch_add(1, Ordering::Relaxed) + 1;
        if count <= LOGGED_REJECTIONS {
            self.log.line(format_args!("rejected a request: {message}"));
            if count == LOGGED_REJECTIONS {
                self.log.line(format_args!(
                    "further rejected requests are counted, not logged"
                ));
            }
        }
        self.deliver(error_reply(&self.session, cookie, errno, message), permit);
    }
}

/// A place in the connection's in-flight budget, held by a request from
/// before its payload is read until its reply is sent; released on drop,
/// even if the job panics.
pub(crate) struct Permit {
    connection: Arc<Connection>,
    buffer_bytes: usize,
}

impl Permit {
    /// Waits for room; `None` if `stop()` turned true first.
    fn acquire(
        connection: &Arc<Connection>,
        buffer_bytes: usize,
        stop: &dyn Fn() -> bool,
    ) -> Option<Self> {
        connection
            .in_flight
            .acquire(buffer_bytes, stop)
            .then(|| Permit {
                connection: Arc::clone(connection),
                buffer_bytes,
            })
    }

    fn run(self, cookie: u64, command: Command, payload: Vec<u8>) {
        let connection = Arc::clone(&self.connection);
        let outcome = catch_unwind(AssertUnwindSafe(|| {
            execute(
                &connection.session,
                &connection.log,
                &connection.buffers,
                cookie,
                command,
                &payload,
            )
        }));
        connection.buffers.give(payload);
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
        connection.deliver(reply, self);
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.connection.in_flight.release(self.buffer_bytes);
    }
}

/// Reads and dispatches requests until the session ends, then waits until
/// every dispatched request has been answered and closes the outbox.
/// `stopping` is polled before each request and while waiting for budget;
/// once true, no further request is read.
pub(crate) fn serve<R: RequestStream + ?Sized>(
    reader: &mut R,
    connection: &Arc<Connection>,
    dispatch: &dyn Dispatch,
    stopping: &dyn Fn() -> bool,
) -> SessionEnd {
    // The last request was a large write: read the next header alone.
    let mut direct = false;
    let end = loop {
        if stopping() {
            break SessionEnd::Shutdown;
        }
        if let Some(end) = connection.send_failure_end() {
            break end;
        }
        let mut header_bytes = [0u8; REQUEST_HEADER_BYTES];
        let read = reader.read_header(&mut header_bytes, direct);
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
        direct = parse_request_header(&header_bytes).is_ok_and(|header| {
            header.command == NBD_CMD_WRITE && header.length as usize >= DIRECT_HEADER_AFTER_BYTES
        });
        match handle_request(reader, connection, dispatch, &header_bytes, stopping) {
            Ok(true) => {}
            Ok(false) => break SessionEnd::ClientDisconnect,
            Err(end) => break end,
        }
    };
    connection.in_flight.wait_idle();
    connection.close_outbox();
    end
}

/// Handles one request whose header has been read. Returns `Ok(false)` for
/// NBD_CMD_DISC.
fn handle_request<R: RequestStream + ?Sized>(
    reader: &mut R,
    connection: &Arc<Connection>,
    dispatch: &dyn Dispatch,
    header_bytes: &[u8],
    stopping: &dyn Fn() -> bool,
) -> Result<bool, SessionEnd> {
    let header = parse_request_header(header_bytes).map_err(|error| {
        SessionEnd::Protocol(format!("cannot resynchronise after a bad request: {error}"))
    })?;
    connection.requests.fetch_add(1, Ordering::Relaxed);
    let validated = validate(&header, &connection.session);
    if let Ok(Command::Disconnect) = validated {
        return Ok(false);
    }
    let buffer_bytes = validated.as_ref().map_or(0, Command::buffer_bytes);
    // Even an error reply takes a place: a client that floods bad requests
    // and reads no replies must stop itself too.
    let permit = Permit::acquire(connection, buffer_bytes, stopping).ok_or(SessionEnd::Shutdown)?;
    match validated {
        Ok(command) => {
            let payload = match command {
                Command::Write { length, .. } => {
                    let mut payload = connection.buffers.take(length as usize);
                    reader.read_payload(&mut payload)?;
                    payload
                }
                _ => Vec::new(),
            };
            let cookie = header.cookie;
            let lane = Lane::of(&command);
            dispatch.dispatch(Box::new(move || permit.run(cookie, command, payload)), lane);
        }
        Err(rejection) => {
            if header.command == NBD_CMD_WRITE {
                discard(reader, u64::from(header.length))?;
            }
            connection.reject(permit, header.cookie, rejection.errno, &rejection.message);
        }
    }
    Ok(true)
}
