//! The server's log: lines from `zdisk` and `zdisk-nbd` (through the `log`
//! facade) to standard error, without ever stopping the server.
//!
//! Writing to stderr can block (a pipe whose reader is stuck) or fail (a
//! pipe whose reader left, a full disk). Either must not stall a request,
//! the accept loop or a signal handler, and must not end the process. So a
//! line is handed to a bounded queue and written by one logging thread; if
//! the queue is full the line is dropped and counted, and the count is
//! written once there is room again. Write errors are ignored.
//!
//! [`finish`] gives the thread a moment to write what is queued before the
//! process exits, and gives up after that moment.

use std::io::Write;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{sync_channel, SyncSender, TrySendError};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// Lines that may wait for the logging thread.
const QUEUE_LINES: usize = 4096;

struct Logger {
    lines: SyncSender<String>,
    /// Lines queued and not yet written.
    pending: AtomicUsize,
    /// Lines dropped because the queue was full, not yet reported.
    dropped: AtomicU64,
}

static LOGGER: OnceLock<Logger> = OnceLock::new();

/// Installs the logger for the rest of the process. Before this (and if
/// the logging thread cannot start) lines are written directly, still
/// ignoring errors.
pub fn init() {
    let (sender, receiver) = sync_channel::<String>(QUEUE_LINES);
    let logger = Logger {
        lines: sender,
        pending: AtomicUsize::new(0),
        dropped: AtomicU64::new(0),
    };
    if LOGGER.set(logger).is_err() {
        return;
    }
    let started = std::thread::Builder::new()
        .name("log".into())
        .spawn(move || {
            for line in receiver {
                let logger = LOGGER.get().expect("set before the thread starts");
                let dropped = logger.dropped.swap(0, Ordering::Relaxed);
                let mut stderr = std::io::stderr().lock();
                if dropped > 0 {
                    let _ = writeln!(
                        stderr,
                        "zdisk: {dropped} log line(s) dropped: standard error was not keeping up"
                    );
                }
                let _ = stderr.write_all(line.as_bytes());
                drop(stderr);
                logger.pending.fetch_sub(1, Ordering::Release);
            }
        });
    if started.is_ok() {
        log::set_logger(&Facade).expect("the logger is installed once");
        log::set_max_level(log::LevelFilter::Info);
    }
}

/// Queues one finished line (with its newline), or writes it directly if
/// no logger runs.
pub fn line(text: String) {
    let Some(logger) = LOGGER.get() else {
        let _ = std::io::stderr().write_all(text.as_bytes());
        return;
    };
    logger.pending.fetch_add(1, Ordering::Acquire);
    match logger.lines.try_send(text) {
        Ok(()) => {}
        Err(TrySendError::Full(_)) | Err(TrySendError::Disconnected(_)) => {
            logger.pending.fetch_sub(1, Ordering::Release);
            logger.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Waits up to `patience` for queued lines to be written.
pub fn finish(patience: Duration) {
    let Some(logger) = LOGGER.get() else {
        return;
    };
    let deadline = Instant::now() + patience;
    while logger.pending.load(Ordering::Acquire) > 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Formats `log` records as the server always has: `zdisk: ...` for the
/// binary, `zdisk-nbd: ...` for the protocol server, `warning:` where due.
struct Facade;

impl log::Log for Facade {
    fn enabled(&self, metadata: &log::Metadata<'_>) -> bool {
        metadata.level() <= log::Level::Info
    }

    fn log(&self, record: &log::Record<'_>) {
        if !self.enabled(record.metadata()) {
            return;
        }
        let source = if record.target().starts_with("zdisk_nbd") {
            "zdisk-nbd"
        } else {
            "zdisk"
        };
        let level = match record.level() {
            log::Level::Error => "error: ",
            log::Level::Warn => "warning: ",
            _ => "",
        };
        line(format!("{source}: {level}{}\n", record.args()));
    }

    fn flush(&self) {}
}
