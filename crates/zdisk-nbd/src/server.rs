//! The NBD server: listening sockets, one thread per connection, a shared
//! worker pool, and an orderly shutdown.
//!
//! Each accepted connection gets a thread that runs the handshake and then
//! reads requests; request execution happens on the shared
//! [`WorkerPool`](crate::pool::WorkerPool) (see `transmission.rs`).
//!
//! Shutdown, in order: [`ShutdownHandle::shutdown`] sets a flag and wakes the
//! accept loop through a socket pair; [`Server::run`] stops accepting, shuts
//! the read side of every connection (a blocked reader sees end of stream,
//! and readers check the flag before each request, so nothing new is read),
//! waits for every connection to answer its in-flight requests and close,
//! then stops the pool and returns. A client that stops reading its replies
//! could hold this up forever, so after [`ServerConfig::shutdown_timeout`]
//! the remaining sockets are shut in both directions, which fails their
//! pending sends.
//!
//! A Unix socket path is only ever removed if it is a socket nobody is
//! listening on (at bind), or the very socket this server created (on drop).

use std::fmt;
use std::fs;
use std::io::{self, BufReader, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread;
use std::time::{Duration, Instant};

use zdisk_core::BlockDevice;

use crate::handshake::{negotiate, Export};
use crate::pool::{PoolHandle, WorkerPool};
use crate::session::{ConnLog, SessionEnd};
use crate::transmission::{serve, Connection, InFlightLimits, Session};
use crate::wire::{MAX_STRING_BYTES, MIN_BLOCK_BYTES};

/// Buffer for reading requests: one syscall brings in many small requests.
const READ_BUFFER_BYTES: usize = 128 * 1024;
/// Pause after an accept error such as EMFILE, which would otherwise spin.
const ACCEPT_ERROR_PAUSE: Duration = Duration::from_millis(100);

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
    /// Requests one connection may have dispatched but not yet answered;
    /// its reader stops reading at this limit.
    pub max_in_flight_per_conn: usize,
    /// Bytes of READ/WRITE buffers one connection may hold in flight. A
    /// single request larger than this is still admitted when it is alone.
    pub max_in_flight_bytes_per_conn: usize,
    /// How long shutdown waits for clients to take their last replies
    /// before closing their sockets anyway.
    pub shutdown_timeout: Duration,
}

impl Default for ServerConfig {
    fn default() -> Self {
        let cpus = thread::available_parallelism().map_or(1, |n| n.get());
        ServerConfig {
            export_name: "zdisk".to_string(),
            description: None,
            read_only: false,
            worker_threads: (2 * cpus).max(4),
            max_in_flight_per_conn: 64,
            max_in_flight_bytes_per_conn: 128 * 1024 * 1024,
            shutdown_timeout: Duration::from_secs(30),
        }
    }
}

impl ServerConfig {
    fn check(&self) -> io::Result<()> {
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
        if self.max_in_flight_per_conn == 0 {
            return invalid("max_in_flight_per_conn must be at least 1");
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
    fn raw_fd(&self) -> RawFd {
        match self {
            Listener::Tcp(listener) => listener.as_raw_fd(),
            Listener::Unix { listener, .. } => listener.as_raw_fd(),
        }
    }

    fn accept(&self) -> io::Result<(Socket, String)> {
        match self {
            Listener::Tcp(listener) => {
                let (stream, peer) = listener.accept()?;
                Ok((Socket::Tcp(stream), peer.to_string()))
            }
            Listener::Unix { listener, .. } => {
                let (stream, _) = listener.accept()?;
                Ok((Socket::Unix(stream), "unix socket".to_string()))
            }
        }
    }
}

/// An accepted connection of either kind.
enum Socket {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Socket {
    fn try_clone(&self) -> io::Result<Socket> {
        Ok(match self {
            Socket::Tcp(stream) => Socket::Tcp(stream.try_clone()?),
            Socket::Unix(stream) => Socket::Unix(stream.try_clone()?),
        })
    }

    fn shutdown(&self, how: Shutdown) {
        // Fails only if the socket is already disconnected, which is the goal.
        let _ = match self {
            Socket::Tcp(stream) => stream.shutdown(how),
            Socket::Unix(stream) => stream.shutdown(how),
        };
    }

    fn prepare(&self) -> io::Result<()> {
        match self {
            Socket::Tcp(stream) => {
                stream.set_nonblocking(false)?;
                // Replies are written whole; Nagle would only delay them.
                stream.set_nodelay(true)
            }
            Socket::Unix(stream) => stream.set_nonblocking(false),
        }
    }
}

impl Read for Socket {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Socket::Tcp(stream) => stream.read(buf),
            Socket::Unix(stream) => stream.read(buf),
        }
    }
}

impl Write for Socket {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Socket::Tcp(stream) => stream.write(buf),
            Socket::Unix(stream) => stream.write(buf),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

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

/// Live connections: a socket handle each, for shutting them down.
#[derive(Default)]
struct Registry {
    sockets: Mutex<std::collections::HashMap<u64, Socket>>,
    emptied: Condvar,
}

impl Registry {
    fn lock(&self) -> MutexGuard<'_, std::collections::HashMap<u64, Socket>> {
        self.sockets
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn shutdown_all(&self, how: Shutdown) {
        for socket in self.lock().values() {
            socket.shutdown(how);
        }
    }

    /// Waits until no connection is left, or the timeout passes (false).
    fn wait_empty(&self, timeout: Option<Duration>) -> bool {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut sockets = self.lock();
        while !sockets.is_empty() {
            sockets = match deadline {
                None => self
                    .emptied
                    .wait(sockets)
                    .unwrap_or_else(|poisoned| poisoned.into_inner()),
                Some(deadline) => {
                    let now = Instant::now();
                    if now >= deadline {
                        return false;
                    }
                    self.emptied
                        .wait_timeout(sockets, deadline - now)
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
        let mut sockets = self.registry.lock();
        sockets.remove(&self.id);
        if sockets.is_empty() {
            self.registry.emptied.notify_all();
        }
    }
}

/// What every connection thread needs.
struct Context {
    device: Arc<dyn BlockDevice>,
    config: ServerConfig,
    shared: Arc<Shared>,
    pool: PoolHandle,
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
    /// Binds the listening socket. For a Unix socket, a leftover socket file
    /// that nobody listens on is replaced; any other existing file is an error.
    pub fn bind(
        addr: &ListenAddr,
        device: Arc<dyn BlockDevice>,
        config: ServerConfig,
    ) -> io::Result<Server> {
        config.check()?;
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
        let (wake_sender, wake_receiver) = UnixStream::pair()?;
        wake_sender.set_nonblocking(true)?;
        Ok(Server {
            listener,
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
        match &self.listener {
            Listener::Tcp(listener) => Ok(ListenAddr::Tcp(listener.local_addr()?)),
            Listener::Unix { path, .. } => Ok(ListenAddr::Unix(path.clone())),
        }
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
        });
        let registry = Arc::new(Registry::default());

        let result = self.accept_loop(&context, &registry);

        // Also covers an accept loop that failed: readers must stop too.
        self.shared.stopping.store(true, Ordering::SeqCst);
        registry.shutdown_all(Shutdown::Read);
        if !registry.wait_empty(Some(self.config.shutdown_timeout)) {
            eprintln!(
                "zdisk-nbd: {} connection(s) still busy after {:?}; closing them",
                registry.lock().len(),
                self.config.shutdown_timeout
            );
            registry.shutdown_all(Shutdown::Both);
            registry.wait_empty(None);
        }
        pool.shut_down();
        result
    }

    fn accept_loop(&self, context: &Arc<Context>, registry: &Arc<Registry>) -> io::Result<()> {
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
                        start_connection(context, registry, next_id, socket, peer);
                    }
                    Err(error) if error.kind() == io::ErrorKind::WouldBlock => break,
                    Err(error)
                        if matches!(
                            error.kind(),
                            io::ErrorKind::Interrupted | io::ErrorKind::ConnectionAborted
                        ) => {}
                    Err(error) => {
                        eprintln!("zdisk-nbd: accepting a connection failed: {error}");
                        thread::sleep(ACCEPT_ERROR_PAUSE);
                        break;
                    }
                }
            }
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Listener::Unix { path, identity, .. } = &self.listener {
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
    let handle = match socket.prepare().and_then(|()| socket.try_clone()) {
        Ok(handle) => handle,
        Err(error) => {
            log.line(format_args!("dropped at accept: {error}"));
            return;
        }
    };
    registry.lock().insert(id, handle);
    let registration = Registration {
        registry: Arc::clone(registry),
        id,
    };
    let context = Arc::clone(context);
    let spawned = thread::Builder::new()
        .name(format!("nbd-conn-{id}"))
        .spawn(move || {
            let _registration = registration;
            run_connection(&context, socket, &log);
        });
    if let Err(error) = spawned {
        // The closure (and with it the registration and socket) was dropped.
        eprintln!("zdisk-nbd: conn {id} ({peer}): no thread for it: {error}");
    }
}

fn run_connection(context: &Context, socket: Socket, log: &ConnLog) {
    log.line(format_args!("opened"));
    let (mut end, requests) = match converse(context, &socket, log) {
        Ok(outcome) => outcome,
        Err(error) => (SessionEnd::Io(error), 0),
    };
    // Shutdown closes the read side, which a reader sees as the client leaving.
    let stopping = context.shared.stopping.load(Ordering::SeqCst);
    if stopping && matches!(end, SessionEnd::ClientClosed) {
        end = SessionEnd::Shutdown;
    }
    socket.shutdown(Shutdown::Both);
    log.line(format_args!("closed after {requests} requests: {end}"));
}

/// The whole conversation: handshake, then transmission. Returns why it
/// ended and how many requests it read.
fn converse(context: &Context, socket: &Socket, log: &ConnLog) -> io::Result<(SessionEnd, u64)> {
    let mut reader = BufReader::with_capacity(READ_BUFFER_BYTES, socket.try_clone()?);
    let mut writer = socket.try_clone()?;
    let waker = socket.try_clone()?;
    let stopping = || context.shared.stopping.load(Ordering::SeqCst);

    let device = &context.device;
    let export = Export {
        name: context.config.export_name.clone(),
        description: context.config.description.clone(),
        size_bytes: device.size_bytes(),
        read_only: context.config.read_only || device.is_read_only(),
    };
    let negotiated = match negotiate(&mut reader, &mut writer, &export, &stopping) {
        Ok(negotiated) => negotiated,
        Err(end) => return Ok((end, 0)),
    };
    let session = Session {
        device: Arc::clone(device),
        size_bytes: export.size_bytes,
        read_only: export.read_only,
        structured_replies: negotiated.structured_replies,
        base_allocation_id: negotiated.base_allocation_id,
        min_block_bytes: if negotiated.block_size_agreed {
            u64::from(MIN_BLOCK_BYTES)
        } else {
            1
        },
    };
    let connection = Arc::new(Connection::new(
        session,
        log.clone(),
        Box::new(writer),
        // A failed send leaves the stream unusable; waking the reader ends
        // the session instead of reading requests nobody can answer.
        Box::new(move || waker.shutdown(Shutdown::Both)),
        InFlightLimits {
            max_requests: context.config.max_in_flight_per_conn,
            max_buffer_bytes: context.config.max_in_flight_bytes_per_conn,
        },
    ));
    let end = serve(&mut reader, &connection, &context.pool, &stopping);
    Ok((end, connection.request_count()))
}
