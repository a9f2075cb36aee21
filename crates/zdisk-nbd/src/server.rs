//! The NBD server: listening sockets, two threads per connection (a
//! reader, and a sender for its replies), a shared worker pool, limits, and
//! an orderly shutdown.
//!
//! Each accepted connection gets a reader thread that runs the handshake
//! (within [`ServerConfig::handshake_timeout`], TLS included) and then reads
//! requests; request execution happens on the shared
//! [`WorkerPool`](crate::pool::WorkerPool), and replies are queued for the
//! connection's sender thread (see `transmission.rs`). A worker therefore
//! never waits on a client's socket: a client that stops reading its
//! replies fills only its own in-flight budget, and after
//! [`ServerConfig::reply_timeout`] without progress it is disconnected.
//!
//! Limits (see [`ServerConfig`]): connections beyond `max_connections` are
//! answered with an error on every option, saying why, and closed; buffer
//! memory is bounded per connection and for the whole server (`budget.rs`).
//!
//! Shutdown, in order: [`ShutdownHandle::shutdown`] sets a flag and wakes the
//! accept loop through a socket pair; [`Server::run`] stops accepting, shuts
//! the read side of every connection (a blocked reader sees end of stream,
//! and readers check the flag before each request, so nothing new is read),
//! waits for every connection to answer its in-flight requests and close,
//! then stops the pool (which runs every job already queued) and returns.
//! While stopping, a sender gives up on a client that takes no reply data
//! for [`SHUTDOWN_REPLY_PATIENCE`]; [`ServerConfig::shutdown_timeout`] is
//! the backstop, after which remaining sockets are shut both ways.
//!
//! A Unix socket path is only ever removed if it is a socket nobody is
//! listening on (at bind), or the very socket this server created (on drop).

use std::fmt;
use std::fs;
use std::io::{self, BufReader, Write};
use std::net::{Shutdown, SocketAddr, TcpListener};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread;
use std::time::{Duration, Instant};

use zdisk_core::BlockDevice;

use crate::budget::{InFlightLimits, MemoryBudget};
use crate::handshake::{greet, haggle, Export, Outcome, Refusal, TlsState};
use crate::pool::{PoolHandle, WorkerPool};
use crate::request::Session;
use crate::session::{ConnLog, SessionEnd};
use crate::socket::Socket;
use crate::tls::{TlsConfig, TlsMode};
use crate::transmission::{serve, Connection, Outbox};
use crate::transport::Transport;
use crate::wire::{MAX_PAYLOAD_BYTES, MAX_STRING_BYTES, MIN_BLOCK_BYTES};

/// Buffer for reading requests: one syscall brings in many small requests.
const READ_BUFFER_BYTES: usize = 128 * 1024;
/// Pause after an accept error such as EMFILE, which would otherwise spin.
const ACCEPT_ERROR_PAUSE: Duration = Duration::from_millis(100);
/// While the server stops, how long a sender waits for a client to take
/// reply data before giving up on it (its requests have all run).
pub const SHUTDOWN_REPLY_PATIENCE: Duration = Duration::from_secs(2);
/// Connections over the limit answered at once; beyond these, they are
/// closed without a word.
const MAX_REFUSING: usize = 8;
/// How long an over-the-limit connection is given to hear why.
const REFUSAL_PATIENCE: Duration = Duration::from_secs(2);
/// Refusals are logged at most once per this period (with a count).
const REFUSAL_LOG_PERIOD: Duration = Duration::from_secs(10);

/// How the server behaves. `Default` gives sensible values for everything.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// The export's name. Clients may also ask for "" (the default export).
    pub export_name: String,
    /// Shown to clients by NBD_OPT_LIST and NBD_INFO_DESCRIPTION.
    pub description: Option<String>,
    /// Refuse write-type requests with EPERM, and advertise NBD_FLAG_READ_ONLY.
    /// A device that reports itself read-only is served read-only regardless.
    pub read_only: bool,
    /// Threads executing requests, shared by all connections.
    pub worker_threads: usize,
    /// Connections served at once; more are refused with a reason.
    pub max_connections: usize,
    /// Requests one connection may have dispatched but not yet answered;
    /// its reader stops reading at this limit.
    pub max_in_flight_per_conn: usize,
    /// Bytes of READ/WRITE buffers one connection may hold in flight. A
    /// single request larger than this is still admitted when it is alone.
    pub max_in_flight_bytes_per_conn: usize,
    /// Bytes of READ/WRITE buffers all connections together may hold.
    pub max_in_flight_bytes: usize,
    /// A connection must finish its handshake (TLS included) in this time.
    pub handshake_timeout: Duration,
    /// A client that takes no reply data for this long, while replies wait
    /// for it, is disconnected.
    pub reply_timeout: Duration,
    /// How long shutdown waits for clients to take their last replies
    /// before closing their sockets anyway.
    pub shutdown_timeout: Duration,
    /// Whether clients may or must use TLS.
    pub tls_mode: TlsMode,
    /// Credentials for TLS; required unless `tls_mode` is off.
    pub tls: Option<TlsConfig>,
}

impl Default for ServerConfig {
    fn default() -> Self {
        let cpus = thread::available_parallelism().map_or(1, |n| n.get());
        ServerConfig {
            export_name: "zdisk".to_string(),
            description: None,
            read_only: false,
            worker_threads: (2 * cpus).max(4),
            max_connections: 128,
            max_in_flight_per_conn: 64,
            max_in_flight_bytes_per_conn: 128 * 1024 * 1024,
            max_in_flight_bytes: 512 * 1024 * 1024,
            handshake_timeout: Duration::from_secs(10),
            reply_timeout: Duration::from_secs(30),
            shutdown_timeout: Duration::from_secs(30),
            tls_mode: TlsMode::Off,
            tls: None,
        }
    }
}

impl ServerConfig {
    /// Checks the configuration; [`Server::bind`] does too, but a caller
    /// can ask first, before it does anything that leaves traces.
    pub fn check(&self) -> io::Result<()> {
        let invalid = |what: &str| {
            Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                what.to_string(),
            ))
        };
        let bad_string = |s: &str| s.len() > MAX_STRING_BYTES || s.contains('\0');
        if bad_string(&self.export_name) {
            return invalid("export name must be at most 4096 bytes without NUL characters");
        }
        if self.description.as_deref().is_some_and(bad_string) {
            return invalid("description must be at most 4096 bytes without NUL characters");
        }
        if self.worker_threads == 0 {
            return invalid("worker_threads must be at least 1");
        }
        if self.max_connections == 0 {
            return invalid("max_connections must be at least 1");
        }
        if self.max_in_flight_per_conn == 0 {
            return invalid("max_in_flight_per_conn must be at least 1");
        }
        if self.max_in_flight_bytes < MAX_PAYLOAD_BYTES as usize {
            return invalid(&format!(
                "the in-flight memory budget must hold at least one maximal request ({} MiB)",
                MAX_PAYLOAD_BYTES >> 20
            ));
        }
        if self.handshake_timeout.is_zero() || self.reply_timeout.is_zero() {
            return invalid("handshake and reply timeouts must be positive");
        }
        if self.tls_mode != TlsMode::Off && self.tls.is_none() {
            return invalid("TLS needs credentials: certificates or a PSK file");
        }
        Ok(())
    }
}

/// Where the server listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ListenAddr {
    Tcp(SocketAddr),
    Unix(PathBuf),
}

impl fmt::Display for ListenAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ListenAddr::Tcp(addr) => write!(f, "{addr}"),
            ListenAddr::Unix(path) => write!(f, "unix:{}", path.display()),
        }
    }
}

enum Listener {
    Tcp(TcpListener),
    Unix {
        listener: UnixListener,
        path: PathBuf,
        /// (device, inode) of the socket file we created, so drop removes
        /// only that file and never one that replaced it.
        identity: (u64, u64),
    },
}

impl Listener {
    fn local_addr(&self) -> io::Result<ListenAddr> {
        match self {
            Listener::Tcp(listener) => Ok(ListenAddr::Tcp(listener.local_addr()?)),
            Listener::Unix { path, .. } => Ok(ListenAddr::Unix(path.clone())),
        }
    }

    fn raw_fd(&self) -> RawFd {
        match self {
            Listener::Tcp(listener) => listener.as_raw_fd(),
            Listener::Unix { listener, .. } => listener.as_raw_fd(),
        }
    }

    fn accept(&self) -> io::Result<(Socket, String)> {
        match self {
            Listener::Tcp(listener) => {
                // TCP sizes its own buffers (and stops if told a size).
                let (stream, peer) = listener.accept()?;
                Ok((Socket::Tcp(stream), peer.to_string()))
            }
            Listener::Unix { listener, .. } => {
                let (stream, _) = listener.accept()?;
                let socket = Socket::Unix(stream);
                socket.request_send_buffer(UNIX_SEND_BUFFER_BYTES);
                Ok((socket, "unix socket".to_string()))
            }
        }
    }
}

/// The send buffer asked for each Unix-socket connection: a 1 MiB read
/// reply and its header fit (the kernel doubles the figure for its
/// bookkeeping), so it goes out in one write rather than through the
/// sender thread; 1 MiB sequential reads took 10% less server CPU per
/// byte. The kernel holds it, and only while a client is slow to read.
const UNIX_SEND_BUFFER_BYTES: usize = 1 << 20;

/// State shared between the server and its shutdown handles.
struct Shared {
    stopping: AtomicBool,
    wake_sender: UnixStream,
    wake_receiver: UnixStream,
}

/// Makes [`Server::run`] return. Cloneable and `Send`, so a signal handler
/// thread or a test can hold one.
#[derive(Clone)]
pub struct ShutdownHandle {
    shared: Arc<Shared>,
}

impl ShutdownHandle {
    /// Starts an orderly shutdown (see the module documentation) and
    /// returns at once; `run()` returns when it is complete. Idempotent.
    pub fn shutdown(&self) {
        self.shared.stopping.store(true, Ordering::SeqCst);
        // The wake socket is non-blocking; if its buffer is full, a wake-up
        // is already pending, which is all that is needed.
        let _ = (&self.shared.wake_sender).write(&[1]);
    }
}

type Connections = std::collections::HashMap<u64, Arc<Transport>>;

/// Live connections: a transport handle each, for shutting them down.
#[derive(Default)]
struct Registry {
    transports: Mutex<Connections>,
    emptied: Condvar,
}

impl Registry {
    fn lock(&self) -> MutexGuard<'_, Connections> {
        self.transports
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn shutdown_all(&self, how: Shutdown) {
        for transport in self.lock().values() {
            transport.shutdown(how);
        }
    }

    /// Waits until no connection is left, or the timeout passes (false).
    fn wait_empty(&self, timeout: Option<Duration>) -> bool {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut transports = self.lock();
        while !transports.is_empty() {
            transports = match deadline {
                None => self
                    .emptied
                    .wait(transports)
                    .unwrap_or_else(|poisoned| poisoned.into_inner()),
                Some(deadline) => {
                    let now = Instant::now();
                    if now >= deadline {
                        return false;
                    }
                    self.emptied
                        .wait_timeout(transports, deadline - now)
                        .unwrap_or_else(|poisoned| poisoned.into_inner())
                        .0
                }
            };
        }
        true
    }
}

/// Removes a connection from the registry when its thread ends, however it ends.
struct Registration {
    registry: Arc<Registry>,
    id: u64,
}

impl Drop for Registration {
    fn drop(&mut self) {
        let mut transports = self.registry.lock();
        transports.remove(&self.id);
        if transports.is_empty() {
            self.registry.emptied.notify_all();
        }
    }
}

/// Counts connections refused over the limit, and logs them without
/// letting a flood of them flood the log.
#[derive(Default)]
struct Refusals {
    /// Refusing threads running now.
    answering: AtomicUsize,
    log: Mutex<RefusalLog>,
}

#[derive(Default)]
struct RefusalLog {
    last_line: Option<Instant>,
    unlogged: u64,
}

impl Refusals {
    fn note(&self, limit: usize, peer: &str) {
        let mut log = self
            .log
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        log.unlogged += 1;
        if log
            .last_line
            .is_none_or(|at| at.elapsed() >= REFUSAL_LOG_PERIOD)
        {
            log::warn!(
                target: "zdisk_nbd",
                "refused {} connection(s) over the limit of {limit} (latest from {peer}); raise --max-connections if they are expected",
                log.unlogged
            );
            log.unlogged = 0;
            log.last_line = Some(Instant::now());
        }
    }
}

/// What every connection thread needs.
struct Context {
    device: Arc<dyn BlockDevice>,
    config: ServerConfig,
    shared: Arc<Shared>,
    pool: PoolHandle,
    memory: Arc<MemoryBudget>,
}

impl Context {
    fn stopping(&self) -> bool {
        self.shared.stopping.load(Ordering::SeqCst)
    }
}

/// A listening socket bound before there is a device to serve, so that a
/// caller can claim its address before doing anything that leaves traces
/// (such as creating an image). Dropping it closes the socket, and removes
/// a Unix socket file it created.
pub struct BoundListener {
    listener: Listener,
}

impl BoundListener {
    /// Binds `addr`. For a Unix socket, a leftover socket file that nobody
    /// listens on is replaced; any other existing file is an error.
    pub fn bind(addr: &ListenAddr) -> io::Result<BoundListener> {
        let listener = match addr {
            ListenAddr::Tcp(addr) => Listener::Tcp(TcpListener::bind(addr)?),
            ListenAddr::Unix(path) => {
                remove_stale_socket(path)?;
                let listener = UnixListener::bind(path)?;
                let metadata = fs::metadata(path)?;
                Listener::Unix {
                    listener,
                    path: path.clone(),
                    identity: (metadata.dev(), metadata.ino()),
                }
            }
        };
        match &listener {
            Listener::Tcp(listener) => listener.set_nonblocking(true)?,
            Listener::Unix { listener, .. } => listener.set_nonblocking(true)?,
        }
        Ok(BoundListener { listener })
    }

    /// The address actually bound, e.g. the port chosen for port 0.
    pub fn local_addr(&self) -> io::Result<ListenAddr> {
        self.listener.local_addr()
    }
}

/// An NBD server for one export backed by a [`BlockDevice`].
pub struct Server {
    listener: Listener,
    device: Arc<dyn BlockDevice>,
    config: ServerConfig,
    shared: Arc<Shared>,
    started: AtomicBool,
}

impl Server {
    /// Binds the listening socket (see [`BoundListener::bind`]) and makes a
    /// server for `device` on it.
    pub fn bind(
        addr: &ListenAddr,
        device: Arc<dyn BlockDevice>,
        config: ServerConfig,
    ) -> io::Result<Server> {
        config.check()?;
        Self::with_listener(BoundListener::bind(addr)?, device, config)
    }

    /// A server on a socket bound earlier.
    pub fn with_listener(
        bound: BoundListener,
        device: Arc<dyn BlockDevice>,
        config: ServerConfig,
    ) -> io::Result<Server> {
        config.check()?;
        let (wake_sender, wake_receiver) = UnixStream::pair()?;
        wake_sender.set_nonblocking(true)?;
        Ok(Server {
            listener: bound.listener,
            device,
            config,
            shared: Arc::new(Shared {
                stopping: AtomicBool::new(false),
                wake_sender,
                wake_receiver,
            }),
            started: AtomicBool::new(false),
        })
    }

    /// The address actually bound, e.g. the port chosen for port 0.
    pub fn local_addr(&self) -> io::Result<ListenAddr> {
        self.listener.local_addr()
    }

    /// A handle that makes [`Server::run`] return.
    pub fn shutdown_handle(&self) -> ShutdownHandle {
        ShutdownHandle {
            shared: Arc::clone(&self.shared),
        }
    }

    /// Accepts and serves connections until shut down, then drains them
    /// (see the module documentation). May be called once.
    pub fn run(&self) -> io::Result<()> {
        if self.started.swap(true, Ordering::SeqCst) {
            return Err(io::Error::other("Server::run may only be called once"));
        }
        let mut pool = WorkerPool::new(self.config.worker_threads)?;
        let context = Arc::new(Context {
            device: Arc::clone(&self.device),
            config: self.config.clone(),
            shared: Arc::clone(&self.shared),
            pool: pool.handle(),
            memory: Arc::new(MemoryBudget::new(self.config.max_in_flight_bytes)),
        });
        let registry = Arc::new(Registry::default());
        let refusals = Arc::new(Refusals::default());

        let result = self.accept_loop(&context, &registry, &refusals);

        // Also covers an accept loop that failed: readers must stop too.
        self.shared.stopping.store(true, Ordering::SeqCst);
        registry.shutdown_all(Shutdown::Read);
        if !registry.wait_empty(Some(self.config.shutdown_timeout)) {
            log::warn!(
                target: "zdisk_nbd",
                "{} connection(s) still busy after {:?}; closing them",
                registry.lock().len(),
                self.config.shutdown_timeout
            );
            registry.shutdown_all(Shutdown::Both);
            registry.wait_empty(None);
        }
        pool.shut_down();
        result
    }

    fn accept_loop(
        &self,
        context: &Arc<Context>,
        registry: &Arc<Registry>,
        refusals: &Arc<Refusals>,
    ) -> io::Result<()> {
        let mut next_id: u64 = 0;
        loop {
            if self.shared.stopping.load(Ordering::SeqCst) {
                return Ok(());
            }
            wait_readable(
                self.listener.raw_fd(),
                self.shared.wake_receiver.as_raw_fd(),
            )?;
            loop {
                if self.shared.stopping.load(Ordering::SeqCst) {
                    return Ok(());
                }
                match self.listener.accept() {
                    Ok((socket, peer)) => {
                        next_id += 1;
                        if registry.lock().len() >= self.config.max_connections {
                            refuse_connection(context, refusals, socket, peer);
                        } else {
                            start_connection(context, registry, next_id, socket, peer);
                        }
                    }
                    Err(error) if error.kind() == io::ErrorKind::WouldBlock => break,
                    Err(error)
                        if matches!(
                            error.kind(),
                            io::ErrorKind::Interrupted | io::ErrorKind::ConnectionAborted
                        ) => {}
                    Err(error) => {
                        log::warn!(target: "zdisk_nbd", "accepting a connection failed: {error}");
                        thread::sleep(ACCEPT_ERROR_PAUSE);
                        break;
                    }
                }
            }
        }
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        if let Listener::Unix { path, identity, .. } = &*self {
            let ours = fs::symlink_metadata(path)
                .is_ok_and(|m| m.file_type().is_socket() && (m.dev(), m.ino()) == *identity);
            if ours {
                let _ = fs::remove_file(path);
            }
        }
    }
}

/// Removes `path` if it is a socket file that nobody is listening on.
fn remove_stale_socket(path: &std::path::Path) -> io::Result<()> {
    let metadata = match fs::symlink_metadata(path) {
        Ok(metadata) => metadata,
        Err(error) if error.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(error) => return Err(error),
    };
    if !metadata.file_type().is_socket() {
        return Err(io::Error::new(
            io::ErrorKind::AlreadyExists,
            format!("{} exists and is not a socket", path.display()),
        ));
    }
    if UnixStream::connect(path).is_ok() {
        return Err(io::Error::new(
            io::ErrorKind::AddrInUse,
            format!("another server is listening on {}", path.display()),
        ));
    }
    fs::remove_file(path)
}

/// Blocks until the listener or the wake socket is readable.
fn wait_readable(listener: RawFd, wake: RawFd) -> io::Result<()> {
    let mut fds = [
        libc::pollfd {
            fd: listener,
            events: libc::POLLIN,
            revents: 0,
        },
        libc::pollfd {
            fd: wake,
            events: libc::POLLIN,
            revents: 0,
        },
    ];
    // SAFETY: `fds` is a valid array of two pollfd structs that outlives the
    // call, and its length is passed alongside.
    let result = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, -1) };
    if result < 0 {
        let error = io::Error::last_os_error();
        if error.kind() != io::ErrorKind::Interrupted {
            return Err(error);
        }
    }
    Ok(())
}

fn start_connection(
    context: &Arc<Context>,
    registry: &Arc<Registry>,
    id: u64,
    socket: Socket,
    peer: String,
) {
    let log = ConnLog {
        enabled: true,
        label: format!("conn {id} ({peer})"),
    };
    let transport = match Transport::new(socket) {
        Ok(transport) => Arc::new(transport),
        Err(error) => {
            log.line(format_args!("dropped at accept: {error}"));
            return;
        }
    };
    registry.lock().insert(id, Arc::clone(&transport));
    let registration = Registration {
        registry: Arc::clone(registry),
        id,
    };
    let context = Arc::clone(context);
    let spawned = thread::Builder::new()
        .name(format!("nbd-conn-{id}"))
        .spawn(move || {
            let _registration = registration;
            run_connection(&context, &transport, &log);
        });
    if let Err(error) = spawned {
        // The closure (and with it the registration and socket) was dropped.
        log::warn!(target: "zdisk_nbd", "conn {id} ({peer}): no thread for it: {error}");
    }
}

/// Tells a connection over the limit why it is not served, briefly and on
/// a thread of its own, or, if too many are being told already, closes it.
fn refuse_connection(
    context: &Arc<Context>,
    refusals: &Arc<Refusals>,
    socket: Socket,
    peer: String,
) {
    let limit = context.config.max_connections;
    refusals.note(limit, &peer);
    if refusals.answering.fetch_add(1, Ordering::SeqCst) >= MAX_REFUSING {
        refusals.answering.fetch_sub(1, Ordering::SeqCst);
        return; // dropping the socket closes it
    }
    let answering = Arc::clone(refusals);
    let spawned = thread::Builder::new()
        .name("nbd-refuse".into())
        .spawn(move || {
            if let Ok(transport) = Transport::new(socket) {
                let deadline = Instant::now() + REFUSAL_PATIENCE;
                let mut reader = transport.reader(Some(deadline));
                let give_up = |_stalled: Duration| Instant::now() >= deadline;
                let mut writer = transport.writer(&give_up);
                let why = format!(
                    "the server has too many connections (its limit is {limit}); try again later"
                );
                let refusal = || Some(Refusal::Busy(why.clone()));
                if let Ok(flags) = greet(&mut reader, &mut writer) {
                    let export = Export {
                        name: String::new(),
                        description: None,
                        size_bytes: 0,
                        read_only: true,
                    };
                    let _ = haggle(
                        &mut reader,
                        &mut writer,
                        &export,
                        flags,
                        TlsState::OFF,
                        &refusal,
                    );
                }
                transport.shutdown(Shutdown::Both);
            }
            answering.answering.fetch_sub(1, Ordering::SeqCst);
        });
    if spawned.is_err() {
        refusals.answering.fetch_sub(1, Ordering::SeqCst);
    }
}

fn run_connection(context: &Context, transport: &Arc<Transport>, log: &ConnLog) {
    log.line(format_args!("opened"));
    let (mut end, counts) = converse(context, transport, log);
    // Shutdown closes the read side, which a reader sees as the client leaving.
    if context.stopping() && matches!(end, SessionEnd::ClientClosed) {
        end = SessionEnd::Shutdown;
    }
    transport.close();
    match counts {
        Some((requests, 0)) => log.line(format_args!("closed after {requests} requests: {end}")),
        Some((requests, rejected)) => log.line(format_args!(
            "closed after {requests} requests ({rejected} rejected): {end}"
        )),
        None => log.line(format_args!("closed during the handshake: {end}")),
    }
}

/// The handshake, TLS included, under the handshake deadline. Returns what
/// it settled, or why the conversation ended.
fn handshake(
    context: &Context,
    transport: &Transport,
    reader: &mut BufReader<crate::transport::TransportReader<'_>>,
    log: &ConnLog,
    export: &Export,
) -> Result<crate::handshake::Negotiated, SessionEnd> {
    let deadline = Instant::now() + context.config.handshake_timeout;
    reader.get_mut().deadline = Some(deadline);
    let give_up = |_stalled: Duration| Instant::now() >= deadline;
    let mut writer = transport.writer(&give_up);
    let refusal = || context.stopping().then_some(Refusal::Shutdown);
    let flags = greet(reader, &mut writer)?;
    let mut tls = TlsState {
        mode: context.config.tls_mode,
        active: false,
    };
    loop {
        match haggle(reader, &mut writer, export, flags, tls, &refusal)? {
            Outcome::Transmission(negotiated) => {
                reader.get_mut().deadline = None;
                return Ok(negotiated);
            }
            Outcome::StartTls => {
                // Bytes the client sent after STARTTLS, before the TLS
                // handshake, would otherwise be taken as protected.
                if !reader.buffer().is_empty() {
                    return Err(SessionEnd::Protocol(
                        "data after NBD_OPT_STARTTLS ahead of the TLS handshake".into(),
                    ));
                }
                let config = context
                    .config
                    .tls
                    .as_ref()
                    .expect("check() requires credentials when TLS is on");
                let description = transport.start_tls(config, deadline)?;
                log.line(format_args!("TLS: {description}"));
                tls.active = true;
            }
        }
    }
}

/// The whole conversation: handshake, then transmission. Returns why it
/// ended, and the requests read and rejected if it reached transmission.
fn converse(
    context: &Context,
    transport: &Arc<Transport>,
    log: &ConnLog,
) -> (SessionEnd, Option<(u64, u64)>) {
    let device = &context.device;
    let export = Export {
        name: context.config.export_name.clone(),
        description: context.config.description.clone(),
        size_bytes: device.size_bytes(),
        read_only: context.config.read_only || device.is_read_only(),
    };
    let mut reader = BufReader::with_capacity(READ_BUFFER_BYTES, transport.reader(None));
    let negotiated = match handshake(context, transport, &mut reader, log, &export) {
        Ok(negotiated) => negotiated,
        Err(end) => return (end, None),
    };
    let session = Session {
        device: Arc::clone(device),
        size_bytes: export.size_bytes,
        read_only: export.read_only,
        structured_replies: negotiated.structured_replies,
        base_allocation_id: negotiated.base_allocation_id,
        compression_id: negotiated.compression_id,
        min_block_bytes: if negotiated.block_size_agreed {
            u64::from(MIN_BLOCK_BYTES)
        } else {
            1
        },
    };
    let waker = Arc::clone(transport);
    let direct = Arc::clone(transport);
    let connection = Arc::new(Connection::new(
        session,
        log.clone(),
        Outbox::new(Box::new(move |reply| direct.try_write(reply))),
        // A failed send leaves the stream unusable; waking the reader ends
        // the session instead of reading requests nobody can answer.
        Box::new(move || waker.shutdown(Shutdown::Both)),
        InFlightLimits {
            max_requests: context.config.max_in_flight_per_conn,
            max_buffer_bytes: context.config.max_in_flight_bytes_per_conn,
        },
        Arc::clone(&context.memory),
    ));
    let sender = {
        let connection = Arc::clone(&connection);
        let transport = Arc::clone(transport);
        let reply_timeout = context.config.reply_timeout;
        let shared = Arc::clone(&context.shared);
        thread::Builder::new()
            .name("nbd-send".into())
            .spawn(move || {
                let give_up = |stalled: Duration| {
                    let stopping = shared.stopping.load(Ordering::SeqCst);
                    stalled
                        >= if stopping {
                            SHUTDOWN_REPLY_PATIENCE
                        } else {
                            reply_timeout
                        }
                };
                connection.send_loop(&|reply| transport.write_all(reply, &give_up));
            })
    };
    let sender = match sender {
        Ok(sender) => sender,
        Err(error) => return (SessionEnd::Io(error), Some((0, 0))),
    };
    let stopping = || context.stopping();
    let end = serve(&mut reader, &connection, &context.pool, &stopping);
    // serve() closed the outbox after the last reply was handed over.
    let _ = sender.join();
    (
        end,
        Some((connection.request_count(), connection.rejection_count())),
    )
}
