//! The NBD server: listening sockets, the lobby that runs handshakes, two
//! threads per established session (a reader, and a sender for its
//! replies), a shared worker pool, limits, and an orderly shutdown.
//!
//! Accepting and handshakes (TLS included, within
//! [`ServerConfig::handshake_timeout`]) happen on one thread, the lobby's
//! event loop (`lobby.rs`), with a budget of their own: a connection gets
//! threads only once it reaches transmission. Each session's reader thread
//! reads requests; request execution happens on the shared
//! [`WorkerPool`](crate::pool::WorkerPool), and replies are queued for the
//! connection's sender thread (see `transmission.rs`). A worker therefore
//! never waits on a client's socket: a client that stops reading its
//! replies fills only its own in-flight budget, and after
//! [`ServerConfig::reply_timeout`] without progress it is disconnected.
//!
//! Limits (see [`ServerConfig`]): while `max_connections` sessions are
//! established, a connection in its handshake is answered with an error on
//! every option, saying why; connections in their handshake are bounded by
//! `max_handshakes` and `max_handshakes_per_address` (the oldest silent
//! one makes room) and TLS handshakes by `max_tls_handshakes`; buffer
//! memory is bounded per connection and for the whole server (`budget.rs`).
//!
//! Shutdown, in order: [`ShutdownHandle::shutdown`] sets a flag and wakes the
//! lobby through a socket pair; [`Server::run`] stops accepting, closes
//! every connection still in its handshake, shuts
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
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread;
use std::time::{Duration, Instant};

use zdisk_core::BlockDevice;

use crate::admission::AdmissionLimits;
use crate::budget::{InFlightLimits, MemoryBudget};
use crate::counters::ServerCounters;
use crate::handshake::{Export, Exports, Negotiated};
use crate::lobby::{Accepted, Doors, Lobby, LobbyConfig, Sessions};
use crate::pool::{PoolHandle, WorkerPool};
use crate::request::Session;
use crate::session::{ConnLog, SessionEnd};
use crate::socket::Socket;
use crate::tls::{TlsConfig, TlsMode};
use crate::transmission::{serve, Connection, Outbox};
use crate::transport::Transport;
use crate::wire::{MAX_PAYLOAD_BYTES, MAX_STRING_BYTES, MIN_BLOCK_BYTES};

/// Connections the kernel queues for accept (it caps this at
/// `net.core.somaxconn`, 4096 by default).
const LISTEN_BACKLOG: libc::c_int = 4096;
/// Buffer for reading requests: one syscall brings in many small requests.
const READ_BUFFER_BYTES: usize = 128 * 1024;
/// While the server stops, how long a sender waits for a client to take
/// reply data before giving up on it (its requests have all run).
pub const SHUTDOWN_REPLY_PATIENCE: Duration = Duration::from_secs(2);

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
    /// Further threads that execute only reads (and the other requests
    /// that change nothing), so that reads never wait for a worker while
    /// writers keep the others busy. 0: none. The default is one per
    /// core, at least 2 and at most 8: they sleep unless reads wait.
    pub read_threads: usize,
    /// Established sessions served at once; while this many are, a
    /// connection in its handshake is refused with a reason.
    pub max_connections: usize,
    /// Connections in their handshake at once; a newcomer beyond this
    /// drops the waiting connection that has done least (the oldest silent
    /// one first).
    pub max_handshakes: usize,
    /// Connections in their handshake at once from one IPv4 address or
    /// IPv6 /64; a newcomer beyond this drops one of that address's.
    pub max_handshakes_per_address: usize,
    /// TLS handshakes in progress at once; more wait in a queue served in
    /// turn by source address.
    pub max_tls_handshakes: usize,
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
            read_threads: cpus.clamp(2, 8),
            max_connections: 128,
            max_handshakes: 1024,
            max_handshakes_per_address: 256,
            max_tls_handshakes: 32,
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
        if self.max_handshakes == 0
            || self.max_handshakes_per_address == 0
            || self.max_tls_handshakes == 0
        {
            return invalid("the handshake limits must be at least 1");
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
        // Deadlines are instants (accepted + timeout): keep them far from
        // overflow. The CLI takes at most 10^6 s; a month is above it.
        const TIMEOUT_MAX: Duration = Duration::from_secs(30 * 24 * 3600);
        if self.handshake_timeout > TIMEOUT_MAX || self.reply_timeout > TIMEOUT_MAX {
            return invalid("handshake and reply timeouts must be at most 30 days");
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

    fn accept(&self) -> io::Result<Accepted> {
        match self {
            Listener::Tcp(listener) => {
                // TCP sizes its own buffers (and stops if told a size).
                let (stream, peer) = listener.accept()?;
                Ok(Accepted {
                    socket: Socket::Tcp(stream),
                    peer: peer.to_string(),
                    ip: Some(peer.ip()),
                })
            }
            Listener::Unix { listener, .. } => {
                let (stream, _) = listener.accept()?;
                let socket = Socket::Unix(stream);
                socket.request_send_buffer(UNIX_SEND_BUFFER_BYTES);
                Ok(Accepted {
                    socket,
                    peer: "unix socket".to_string(),
                    ip: None,
                })
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

/// Established sessions: a transport handle each, for shutting them down.
#[derive(Default)]
struct Registry {
    transports: Mutex<Connections>,
    emptied: Condvar,
    counters: Arc<ServerCounters>,
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
        let sessions = &self.registry.counters.sessions;
        sessions.store(transports.len() as u64, Ordering::Relaxed);
        if transports.is_empty() {
            self.registry.emptied.notify_all();
        }
    }
}

/// What every connection thread needs.
struct Context {
    device: Arc<dyn BlockDevice>,
    extra: Option<Arc<dyn ExtraExports>>,
    config: ServerConfig,
    shared: Arc<Shared>,
    pool: PoolHandle,
    memory: Arc<MemoryBudget>,
}

impl Context {
    fn stopping(&self) -> bool {
        self.shared.stopping.load(Ordering::SeqCst)
    }

    /// The exports as the handshake describes them.
    fn exports(&self) -> Exports {
        Exports {
            main: Export {
                name: self.config.export_name.clone(),
                description: self.config.description.clone(),
                size_bytes: self.device.size_bytes(),
                read_only: self.config.read_only || self.device.is_read_only(),
            },
            extra: self.extra.clone(),
        }
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
        // A longer queue than std's: under a flood of connections, an honest
        // client's connection waits there for the lobby, instead of having
        // its handshake dropped by the kernel and retried a second later.
        // Calling listen again on a listening socket only resizes its queue.
        // SAFETY: a valid listening descriptor.
        if unsafe { libc::listen(listener.raw_fd(), LISTEN_BACKLOG) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(BoundListener { listener })
    }

    /// The address actually bound, e.g. the port chosen for port 0.
    pub fn local_addr(&self) -> io::Result<ListenAddr> {
        self.listener.local_addr()
    }
}

/// An export served beside the main one (a snapshot, read-only, or a
/// clone), as the handshake describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExtraExport {
    /// Names it to [`ExtraExports::open`] for as long as it exists.
    pub id: u64,
    pub name: String,
    pub description: Option<String>,
    pub size_bytes: u64,
    /// Served read-only (a server serving read-only serves every export
    /// so).
    pub read_only: bool,
}

/// Exports beside the main one, which may come and go while the server
/// runs: each handshake asks what exists then.
pub trait ExtraExports: Send + Sync {
    /// Every extra export now.
    fn list(&self) -> Vec<ExtraExport>;
    /// The extra export named `name`, if it exists now.
    fn find(&self, name: &str) -> Option<ExtraExport>;
    /// The device behind extra export `id`, if it still exists.
    fn open(&self, id: u64) -> Option<Arc<dyn BlockDevice>>;
}

/// An NBD server for an export backed by a [`BlockDevice`], and any extra
/// exports ([`Server::set_extra_exports`]).
pub struct Server {
    listener: Listener,
    device: Arc<dyn BlockDevice>,
    extra: Option<Arc<dyn ExtraExports>>,
    config: ServerConfig,
    shared: Arc<Shared>,
    started: AtomicBool,
    counters: Arc<ServerCounters>,
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
            extra: None,
            config,
            shared: Arc::new(Shared {
                stopping: AtomicBool::new(false),
                wake_sender,
                wake_receiver,
            }),
            started: AtomicBool::new(false),
            counters: Arc::new(ServerCounters::default()),
        })
    }

    /// The address actually bound, e.g. the port chosen for port 0.
    pub fn local_addr(&self) -> io::Result<ListenAddr> {
        self.listener.local_addr()
    }

    /// Serves `extra` beside the main export (before [`Server::run`]).
    pub fn set_extra_exports(&mut self, extra: Arc<dyn ExtraExports>) {
        self.extra = Some(extra);
    }

    /// The server's connection counters, live: handshakes, evictions,
    /// refusals (for statistics and `/metrics`).
    pub fn counters(&self) -> Arc<ServerCounters> {
        Arc::clone(&self.counters)
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
        let mut pool = WorkerPool::new(self.config.worker_threads, self.config.read_threads)?;
        let context = Arc::new(Context {
            device: Arc::clone(&self.device),
            extra: self.extra.clone(),
            config: self.config.clone(),
            shared: Arc::clone(&self.shared),
            pool: pool.handle(),
            memory: Arc::new(MemoryBudget::new(self.config.max_in_flight_bytes)),
        });
        let registry = Arc::new(Registry {
            counters: Arc::clone(&self.counters),
            ..Registry::default()
        });

        let result = self.run_lobby(&context, &registry);

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

    /// Accepts connections and runs their handshakes until shut down.
    fn run_lobby(&self, context: &Arc<Context>, registry: &Arc<Registry>) -> io::Result<()> {
        let config = &self.config;
        let export = context.exports();
        let starter = Starter { context, registry };
        let mut lobby = Lobby::new(
            LobbyConfig {
                handshake_timeout: config.handshake_timeout,
                limits: AdmissionLimits {
                    max_total: config.max_handshakes,
                    max_per_source: config.max_handshakes_per_address,
                },
                max_tls_handshakes: config.max_tls_handshakes,
                max_connections: config.max_connections,
                tls_mode: config.tls_mode,
                tls: config.tls.as_ref(),
            },
            &export,
            &starter,
            &self.counters,
        )?;
        let accept = || self.listener.accept();
        lobby.run(&Doors {
            listener: self.listener.raw_fd(),
            wake: self.shared.wake_receiver.as_raw_fd(),
            accept: &accept,
        })
    }
}

/// Starts sessions for the lobby.
struct Starter<'a> {
    context: &'a Arc<Context>,
    registry: &'a Arc<Registry>,
}

impl Sessions for Starter<'_> {
    fn established(&self) -> usize {
        self.registry.lock().len()
    }

    fn stopping(&self) -> bool {
        self.context.stopping()
    }

    fn start(&self, transport: Transport, negotiated: Negotiated, log: ConnLog, took: Duration) {
        start_session(
            self.context,
            self.registry,
            transport,
            negotiated,
            log,
            took,
        );
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

/// Gives an established session its threads: a reader (this one) and,
/// from `transmit`, a sender.
fn start_session(
    context: &Arc<Context>,
    registry: &Arc<Registry>,
    transport: Transport,
    negotiated: Negotiated,
    log: ConnLog,
    took: Duration,
) {
    let transport = Arc::new(transport);
    let id = {
        let mut transports = registry.lock();
        let id = transports.keys().max().map_or(1, |max| max + 1);
        transports.insert(id, Arc::clone(&transport));
        registry
            .counters
            .sessions
            .store(transports.len() as u64, Ordering::Relaxed);
        id
    };
    let registration = Registration {
        registry: Arc::clone(registry),
        id,
    };
    let context = Arc::clone(context);
    let label = log.label.clone();
    let spawned = thread::Builder::new()
        .name("nbd-conn".into())
        .spawn(move || {
            let _registration = registration;
            run_session(&context, &transport, negotiated, &log, took);
        });
    if let Err(error) = spawned {
        // The closure (and with it the registration and socket) was dropped.
        log::warn!(target: "zdisk_nbd", "{label}: no thread for it: {error}");
    }
}

fn run_session(
    context: &Context,
    transport: &Arc<Transport>,
    negotiated: Negotiated,
    log: &ConnLog,
    took: Duration,
) {
    match transport.tls_description() {
        Some(tls) => log.line(format_args!(
            "opened after a {:.1} ms handshake; TLS: {tls}",
            took.as_secs_f64() * 1000.0
        )),
        None => log.line(format_args!(
            "opened after a {:.1} ms handshake",
            took.as_secs_f64() * 1000.0
        )),
    }
    let (mut end, (requests, rejected)) = transmit(context, transport, negotiated, log);
    // Shutdown closes the read side, which a reader sees as the client leaving.
    if context.stopping() && matches!(end, SessionEnd::ClientClosed) {
        end = SessionEnd::Shutdown;
    }
    transport.close();
    match rejected {
        0 => log.line(format_args!("closed after {requests} requests: {end}")),
        _ => log.line(format_args!(
            "closed after {requests} requests ({rejected} rejected): {end}"
        )),
    }
}

/// The transmission phase of an established session. Returns why it
/// ended, and the requests read and rejected.
fn transmit(
    context: &Context,
    transport: &Arc<Transport>,
    negotiated: Negotiated,
    log: &ConnLog,
) -> (SessionEnd, (u64, u64)) {
    // An extra export (a snapshot or a clone) deleted since the handshake
    // chose it ends the session.
    let device = match negotiated.export {
        None => Arc::clone(&context.device),
        Some(id) => match context.extra.as_ref().and_then(|extra| extra.open(id)) {
            Some(device) => device,
            None => {
                return (
                    SessionEnd::Protocol("the export chosen went away before transmission".into()),
                    (0, 0),
                )
            }
        },
    };
    let device = &device;
    let read_only = context.config.read_only || device.is_read_only();
    let mut reader = BufReader::with_capacity(READ_BUFFER_BYTES, transport.reader(None));
    let session = Session {
        device: Arc::clone(device),
        size_bytes: device.size_bytes(),
        read_only,
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
        Err(error) => return (SessionEnd::Io(error), (0, 0)),
    };
    let stopping = || context.stopping();
    let end = serve(&mut reader, &connection, &context.pool, &stopping);
    // serve() closed the outbox after the last reply was handed over.
    let _ = sender.join();
    (
        end,
        (connection.request_count(), connection.rejection_count()),
    )
}
