//! The lobby: one thread that accepts connections and runs every handshake,
//! TLS included, as an event loop over epoll. A connection that has not
//! finished its handshake costs a file descriptor and a few hundred bytes,
//! never a thread, so silent connections cannot starve real clients; only
//! a connection that reaches transmission gets its threads (`server.rs`).
//!
//! Policy, and why:
//! - Budget: connections in their handshake are bounded apart from
//!   established sessions, in total and per source address; a newcomer
//!   always gets in and the waiting connection that has done least goes
//!   (`admission.rs`). Before a silent connection is dropped it is read
//!   once more, so a client whose first message is already in the socket
//!   is not taken for silent.
//! - Deadline: the whole handshake, TLS included, must finish within
//!   `handshake_timeout` of the accept. A client dripping a byte at a time
//!   never resets it.
//! - TLS: a handshake costs the server public-key work for every
//!   ClientHello, so at most `max_tls_handshakes` run at once; others
//!   wait in a queue served in turn by source address (`FairQueue`), their
//!   ClientHello left in the kernel. While some wait and every slot is
//!   taken, a handshake past [`TLS_SLOT_GRACE`] is served once more and,
//!   if still unfinished, dropped to free its slot: of those past it, one
//!   from the source holding the most slots, the oldest of them; a source
//!   holding a single slot keeps it while another holds more (the queue
//!   waits at most the grace for one of theirs to age). So a flood's
//!   handshakes go before the lone handshake of an honest client from
//!   another address that is slow to answer (starved of CPU, say),
//!   however long it takes, while a client that sends a ClientHello and
//!   stalls still holds
//!   nothing for long, and a flood of them costs at most
//!   `max_tls_handshakes` key exchanges per grace period. (A longer grace
//!   lets a one-address flood outgrow that address's budget, and
//!   admission then drops its connections, honest ones behind the same
//!   address included, with no grace at all.)
//! - File descriptors: when accept fails with EMFILE or ENFILE, the first
//!   connection in eviction order (read once more first, as above) is
//!   dropped to make room; if none waits,
//!   a reserve descriptor is released to accept the connection and close
//!   it at once, so the backlog drains and the loop never spins; if even
//!   that fails, the listener rests for [`ACCEPT_PAUSE`].
//! - Work per turn is bounded: at most [`ACCEPTS_PER_TURN`] accepts and
//!   [`READS_PER_SERVICE`] reads per connection, so a fast talker waits its
//!   turn like everyone else.
//!
//! Reads take exactly the bytes of the message being read (greeting flags,
//! option header, option data), so nothing a client sends after NBD_OPT_GO
//! or NBD_OPT_STARTTLS is read here: it stays in the socket for the
//! session, or for the TLS handshake (bytes injected in plain text after
//! STARTTLS then break that handshake instead of passing for protected).
//!
//! Invariants: a connection is in `conns`, `admission` and `by_age`, or in
//! none of them; it is registered with epoll exactly while in `conns`; it
//! holds a TLS slot exactly while its stage is [`Stage::Tls`].

use std::cmp::Reverse;
use std::collections::{BTreeSet, HashMap, HashSet};
use std::fs::File;
use std::io;
use std::net::IpAddr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::time::{Duration, Instant};

use crate::admission::{Admission, AdmissionLimits, Crowding, FairQueue, Source, Standing};
use crate::counters::{bump, ServerCounters, Tally};
use crate::handshake::{
    client_flags, option_header, put_server_greeting, Exports, Haggle, Negotiated, Next, Refusal,
    TlsState,
};
use crate::session::{ConnLog, SessionEnd};
use crate::socket::{Blocked, Socket};
use crate::tls::{TlsConfig, TlsMode, TlsSession, TlsStep};
use crate::transport::Transport;
use crate::wire::{OptionHeader, CLIENT_FLAGS_BYTES, MAX_OPTION_BYTES, OPTION_HEADER_BYTES};

/// Accepts per loop turn, so waiting connections are served between bursts.
pub(crate) const ACCEPTS_PER_TURN: usize = 1024;
/// Reads per connection per turn.
pub(crate) const READS_PER_SERVICE: usize = 16;
/// How long the listener rests when accept fails and nothing can be freed.
pub(crate) const ACCEPT_PAUSE: Duration = Duration::from_millis(100);
/// A TLS handshake keeps its slot at least this long, even while others
/// queue: an honest client under load gets time to answer, and a flood of
/// stalling ClientHellos gets at most `max_tls_handshakes` handshakes per
/// this period.
pub(crate) const TLS_SLOT_GRACE: Duration = Duration::from_millis(100);
/// Events taken from epoll at once.
const EVENTS_PER_WAIT: usize = 256;

const TOKEN_LISTENER: u64 = 0;
const TOKEN_WAKE: u64 = 1;
const FIRST_CONNECTION_ID: u64 = 2;

const IN: u32 = libc::EPOLLIN as u32;
const OUT: u32 = libc::EPOLLOUT as u32;

/// The lobby's settings (from `ServerConfig`).
pub(crate) struct LobbyConfig<'a> {
    pub handshake_timeout: Duration,
    pub limits: AdmissionLimits,
    pub max_tls_handshakes: usize,
    pub max_connections: usize,
    pub tls_mode: TlsMode,
    pub tls: Option<&'a TlsConfig>,
}

/// An accepted connection.
pub(crate) struct Accepted {
    pub socket: Socket,
    pub peer: String,
    /// The peer's address; None for a Unix socket.
    pub ip: Option<IpAddr>,
}

/// What the lobby needs from the server.
pub(crate) trait Sessions {
    /// Sessions established now.
    fn established(&self) -> usize;
    /// Whether the server is stopping.
    fn stopping(&self) -> bool;
    /// Takes over a connection that has finished its handshake.
    fn start(&self, transport: Transport, negotiated: Negotiated, log: ConnLog, took: Duration);
}

/// Where connections come from: the listening socket and its accept, and
/// the socket that wakes the loop for shutdown.
pub(crate) struct Doors<'a> {
    pub listener: RawFd,
    pub wake: RawFd,
    pub accept: &'a dyn Fn() -> io::Result<Accepted>,
}

/// What a waiting connection is reading, or doing.
enum Stage {
    Flags,
    Header,
    Data(OptionHeader),
    /// An oversized option's data, this many bytes still to drop.
    Discard(OptionHeader, u64),
    /// Waiting for a TLS slot; the ClientHello waits in the kernel.
    TlsQueued,
    Tls(Box<TlsSession>),
}

/// What happens once the pending output has gone out.
enum Then {
    Read,
    StartTls,
    Transmission(Negotiated),
    Close(SessionEnd),
}

/// A connection in its handshake.
struct Waiting {
    transport: Transport,
    peer: String,
    source: Source,
    accepted: Instant,
    stage: Stage,
    /// The part of the current message received so far.
    frame: Vec<u8>,
    output: Vec<u8>,
    sent: usize,
    then: Then,
    haggle: Haggle,
    client_flags: u32,
    /// Epoll events asked for now.
    interest: u32,
    /// When its TLS handshake got a slot.
    tls_started: Option<Instant>,
    /// Messages completed (a TLS handshake counts as one).
    messages: u64,
    /// The standing and message count last told to the admission.
    reported: (Standing, u64),
    /// An option was refused because the sessions are at their limit.
    told_busy: bool,
    /// ... and that was counted.
    refused_busy: bool,
}

/// What servicing a connection came to.
enum Turn {
    /// Wait for these epoll events.
    Wait(u32),
    /// More may be ready without an event (bytes TLS has buffered, or the
    /// read budget ran out): serve it again next turn.
    Again,
    QueueTls,
    Established(Negotiated),
    Ended(SessionEnd),
}

/// Why a waiting connection was closed.
enum Closing {
    Ended(SessionEnd),
    TimedOut,
    Crowded(Crowding),
    ForFds,
    TlsSlot,
    Stopping,
}

struct Epoll(OwnedFd);

impl Epoll {
    fn new() -> io::Result<Epoll> {
        // SAFETY: plain syscall; a non-negative result is a new descriptor
        // we own.
        let fd = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` is a fresh descriptor nobody else owns.
        Ok(Epoll(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    fn control(&self, op: libc::c_int, fd: RawFd, token: u64, events: u32) -> io::Result<()> {
        let mut event = libc::epoll_event { events, u64: token };
        // SAFETY: valid descriptors and a valid event struct for the call.
        let result = unsafe { libc::epoll_ctl(self.0.as_raw_fd(), op, fd, &mut event) };
        if result < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    fn wait(
        &self,
        events: &mut [libc::epoll_event],
        timeout: Option<Duration>,
    ) -> io::Result<usize> {
        let timeout_ms = match timeout {
            None => -1,
            // Round up, so a deadline is never woken for just before it.
            Some(t) => t.as_micros().div_ceil(1000).min(i32::MAX as u128) as libc::c_int,
        };
        // SAFETY: `events` is a valid, writable array of the length passed.
        let count = unsafe {
            libc::epoll_wait(
                self.0.as_raw_fd(),
                events.as_mut_ptr(),
                events.len() as libc::c_int,
                timeout_ms,
            )
        };
        if count < 0 {
            let error = io::Error::last_os_error();
            if error.kind() == io::ErrorKind::Interrupted {
                return Ok(0);
            }
            return Err(error);
        }
        Ok(count as usize)
    }
}

/// Log lines the lobby writes, each kind rate-limited.
struct Tallies {
    crowded: Tally,
    timed_out: Tally,
    ended: Tally,
    busy: Tally,
    fds: Tally,
    tls_slot: Tally,
}

/// The event loop and everything it owns.
pub(crate) struct Lobby<'a> {
    config: LobbyConfig<'a>,
    export: &'a Exports,
    sessions: &'a dyn Sessions,
    counters: &'a ServerCounters,
    epoll: Epoll,
    conns: HashMap<u64, Waiting>,
    admission: Admission,
    /// Waiting connections by id, which is accept order: the deadline order.
    by_age: BTreeSet<u64>,
    tls_running: HashSet<u64>,
    tls_queue: FairQueue,
    /// Connections to serve again next turn, without waiting for an event.
    again: Vec<u64>,
    next_id: u64,
    /// Kept open to be closed when accept finds no descriptor left.
    reserve: Option<File>,
    /// While set, the listener is out of epoll until then.
    listener_paused_until: Option<Instant>,
    scratch: Vec<u8>,
    tallies: Tallies,
}

impl<'a> Lobby<'a> {
    pub fn new(
        config: LobbyConfig<'a>,
        export: &'a Exports,
        sessions: &'a dyn Sessions,
        counters: &'a ServerCounters,
    ) -> io::Result<Lobby<'a>> {
        assert!(config.max_tls_handshakes >= 1);
        Ok(Lobby {
            admission: Admission::new(config.limits),
            config,
            export,
            sessions,
            counters,
            epoll: Epoll::new()?,
            conns: HashMap::new(),
            by_age: BTreeSet::new(),
            tls_running: HashSet::new(),
            tls_queue: FairQueue::default(),
            again: Vec::new(),
            next_id: FIRST_CONNECTION_ID,
            reserve: open_reserve(),
            listener_paused_until: None,
            scratch: vec![0u8; MAX_OPTION_BYTES as usize + OPTION_HEADER_BYTES],
            tallies: Tallies {
                crowded: Tally::new("handshake budget"),
                timed_out: Tally::new("handshake timeout"),
                ended: Tally::new("handshake ended"),
                busy: Tally::new("too many connections"),
                fds: Tally::new("out of file descriptors"),
                tls_slot: Tally::new("TLS handshake slots"),
            },
        })
    }

    /// Accepts and serves handshakes until the server stops; then drops
    /// every connection still in its handshake.
    pub fn run(&mut self, doors: &Doors<'_>) -> io::Result<()> {
        self.epoll
            .control(libc::EPOLL_CTL_ADD, doors.listener, TOKEN_LISTENER, IN)?;
        self.epoll
            .control(libc::EPOLL_CTL_ADD, doors.wake, TOKEN_WAKE, IN)?;
        let mut events = vec![libc::epoll_event { events: 0, u64: 0 }; EVENTS_PER_WAIT];
        let result = loop {
            if self.sessions.stopping() {
                break Ok(());
            }
            let count = match self.epoll.wait(&mut events, self.next_timeout()) {
                Ok(count) => count,
                Err(error) => break Err(error),
            };
            let mut listener_ready = false;
            // Each connection is served at most once a turn: one left with
            // bytes unread ("again") is also reported by the level-triggered
            // epoll, and serving it twice would let a streaming client take
            // turns from everyone else.
            let mut ready: Vec<(u64, u32)> = self.again.drain(..).map(|id| (id, 0)).collect();
            let mut slot_of: HashMap<u64, usize> = ready
                .iter()
                .enumerate()
                .map(|(slot, &(id, _))| (id, slot))
                .collect();
            for event in &events[..count] {
                let (token, flags) = (event.u64, event.events);
                match token {
                    TOKEN_LISTENER => listener_ready = true,
                    TOKEN_WAKE => {}
                    id => match slot_of.get(&id) {
                        Some(&slot) => ready[slot].1 |= flags,
                        None => {
                            slot_of.insert(id, ready.len());
                            ready.push((id, flags));
                        }
                    },
                }
            }
            if self.sessions.stopping() {
                break Ok(());
            }
            // Waiting connections first: one whose message arrived with a
            // burst of newcomers is then not taken for silent.
            for (id, flags) in ready {
                self.service(id, flags);
            }
            if listener_ready {
                self.accept_some(doors);
            }
            self.expire(Instant::now());
            self.reclaim_tls_slots(Instant::now());
            self.resume_listener(doors);
        };
        let ids: Vec<u64> = self.conns.keys().copied().collect();
        for id in ids {
            self.close(id, Closing::Stopping);
        }
        result
    }

    /// Until the first deadline or the listener's rest ends; zero when a
    /// connection is to be served again at once.
    fn next_timeout(&self) -> Option<Duration> {
        if !self.again.is_empty() {
            return Some(Duration::ZERO);
        }
        let now = Instant::now();
        let deadline = self
            .by_age
            .first()
            .map(|id| self.conns[id].accepted + self.config.handshake_timeout);
        // When a queued TLS handshake may take a stalled one's slot.
        let reclaim = (!self.tls_queue.is_empty()
            && self.tls_running.len() >= self.config.max_tls_handshakes)
            .then(|| {
                self.tls_running
                    .iter()
                    .filter_map(|id| self.conns[id].tls_started)
                    .min()
                    .map(|started| started + TLS_SLOT_GRACE)
            })
            .flatten();
        [deadline, self.listener_paused_until, reclaim]
            .into_iter()
            .flatten()
            .min()
            .map(|at| at.saturating_duration_since(now))
    }

    fn accept_some(&mut self, doors: &Doors<'_>) {
        for _ in 0..ACCEPTS_PER_TURN {
            match (doors.accept)() {
                Ok(accepted) => self.admit(accepted),
                Err(error) if error.kind() == io::ErrorKind::WouldBlock => return,
                Err(error)
                    if matches!(
                        error.kind(),
                        io::ErrorKind::Interrupted | io::ErrorKind::ConnectionAborted
                    ) || carried_over_from_the_network(&error) => {}
                Err(error) if out_of_descriptors(&error) => {
                    bump(&self.counters.accept_exhausted);
                    if !self.free_a_descriptor(doors, &error) {
                        self.pause_listener(doors);
                        return;
                    }
                }
                Err(error) => {
                    self.tallies
                        .fds
                        .note(true, format_args!("accepting a connection failed: {error}"));
                    self.pause_listener(doors);
                    return;
                }
            }
        }
    }

    /// After accept failed for want of descriptors: drops the first waiting
    /// connection in eviction order, or accepts one connection on the
    /// reserve descriptor and closes it. False if neither was possible.
    /// Like [`Lobby::make_room`], it serves a victim once first: on a turn
    /// of many accepts a client accepted early in it may have spoken
    /// without having been read yet.
    fn free_a_descriptor(&mut self, doors: &Doors<'_>, error: &io::Error) -> bool {
        if self.drop_first_waiting() {
            return true;
        }
        if self.reserve.take().is_none() {
            self.tallies.fds.note(
                true,
                format_args!("accept failed ({error}) and no descriptor could be freed"),
            );
            return false;
        }
        let accepted = (doors.accept)();
        if let Ok(accepted) = &accepted {
            bump(&self.counters.dropped_no_fds);
            self.tallies.fds.note(
                true,
                format_args!(
                    "closed a connection from {} at once ({error}); raise the file limit (ulimit -n)",
                    accepted.peer
                ),
            );
        }
        let took_one = accepted.is_ok();
        drop(accepted);
        self.reserve = open_reserve();
        // Only a connection taken off the queue makes progress: otherwise
        // the listener stays readable and the caller must rest it.
        took_one && self.reserve.is_some()
    }

    fn pause_listener(&mut self, doors: &Doors<'_>) {
        if self.listener_paused_until.is_none() {
            let _ = self
                .epoll
                .control(libc::EPOLL_CTL_MOD, doors.listener, TOKEN_LISTENER, 0);
        }
        self.listener_paused_until = Some(Instant::now() + ACCEPT_PAUSE);
    }

    fn resume_listener(&mut self, doors: &Doors<'_>) {
        if self
            .listener_paused_until
            .is_some_and(|until| Instant::now() >= until)
        {
            self.listener_paused_until = None;
            if self.reserve.is_none() {
                self.reserve = open_reserve();
            }
            let _ = self
                .epoll
                .control(libc::EPOLL_CTL_MOD, doors.listener, TOKEN_LISTENER, IN);
        }
    }

    fn admit(&mut self, accepted: Accepted) {
        bump(&self.counters.connections_accepted);
        let source = Source::of(accepted.ip);
        self.make_room(source);
        let transport = match Transport::new(accepted.socket) {
            Ok(transport) => transport,
            Err(error) => {
                bump(&self.counters.handshakes_failed);
                self.tallies.ended.note(
                    false,
                    format_args!("{}: dropped at accept: {error}", accepted.peer),
                );
                return;
            }
        };
        let id = self.next_id;
        self.next_id += 1;
        if let Err(error) = self
            .epoll
            .control(libc::EPOLL_CTL_ADD, transport.raw_fd(), id, IN)
        {
            bump(&self.counters.handshakes_failed);
            self.tallies.ended.note(
                true,
                format_args!("{}: dropped at accept: {error}", accepted.peer),
            );
            return;
        }
        let mut output = Vec::new();
        put_server_greeting(&mut output);
        self.conns.insert(
            id,
            Waiting {
                transport,
                peer: accepted.peer,
                source,
                accepted: Instant::now(),
                stage: Stage::Flags,
                frame: Vec::new(),
                output,
                sent: 0,
                then: Then::Read,
                haggle: Haggle::new(0, TlsState::OFF),
                client_flags: 0,
                interest: IN,
                tls_started: None,
                messages: 0,
                reported: (Standing::Silent, 0),
                told_busy: false,
                refused_busy: false,
            },
        );
        self.admission.admit(id, source);
        self.by_age.insert(id);
        self.set_waiting_gauge();
        self.service(id, 0);
    }

    /// Drops waiting connections until `source` may add one. A victim is
    /// served once first (see [`Lobby::spoke_when_served`]).
    fn make_room(&mut self, source: Source) {
        let mut probed = HashSet::new();
        while let Some((victim, why)) = self.admission.victim_for(source) {
            if probed.insert(victim) && self.spoke_when_served(victim) {
                continue;
            }
            self.close(victim, Closing::Crowded(why));
        }
    }

    /// Drops the first waiting connection in eviction order to free its
    /// descriptor, each candidate served once first. False if none waits.
    fn drop_first_waiting(&mut self) -> bool {
        let mut probed = HashSet::new();
        while let Some(victim) = self.admission.first() {
            if probed.insert(victim) && self.spoke_when_served(victim) {
                continue;
            }
            self.close(victim, Closing::ForFds);
            return true;
        }
        false
    }

    /// Serves a connection about to be dropped once more: true if its next
    /// message had arrived (the loop may be behind on a busy turn), so it
    /// made progress or left, and the choice must be made again.
    fn spoke_when_served(&mut self, id: u64) -> bool {
        let before = self.admission.rank(id);
        self.service(id, 0);
        self.admission.rank(id) != before
    }

    /// Serves one connection as far as it can go now.
    fn service(&mut self, id: u64, flags: u32) {
        let Some(conn) = self.conns.get_mut(&id) else {
            return; // closed earlier this turn
        };
        if matches!(conn.stage, Stage::TlsQueued) {
            // It asked for no events: this is a hangup or an error.
            if flags != 0 {
                self.close(id, Closing::Ended(SessionEnd::ClientClosed));
            }
            return;
        }
        let refusal = if self.sessions.stopping() {
            Some(Refusal::Shutdown)
        } else if self.sessions.established() >= self.config.max_connections {
            Some(Refusal::Busy(format!(
                "the server has too many connections (its limit is {}); try again later",
                self.config.max_connections
            )))
        } else {
            None
        };
        let turn = converse(conn, &mut self.scratch, self.export, &self.config, &refusal);
        if conn.told_busy && !conn.refused_busy {
            conn.refused_busy = true;
            bump(&self.counters.refused_busy);
            let peer = conn.peer.clone();
            self.tallies.busy.note(
                true,
                format_args!(
                    "refused {peer}: {} sessions are established; raise --max-connections if they are expected",
                    self.config.max_connections
                ),
            );
        }
        // A TLS handshake that finished or failed gives its slot back.
        let conn = self.conns.get_mut(&id).expect("still waiting");
        if !matches!(conn.stage, Stage::Tls(_)) && self.tls_running.remove(&id) {
            self.set_tls_gauge();
            self.start_queued_tls();
        }
        match turn {
            Turn::Wait(events) => {
                self.set_interest(id, events);
                self.report_standing(id);
            }
            Turn::Again => {
                self.again.push(id);
                self.report_standing(id);
            }
            Turn::QueueTls => self.queue_tls(id),
            Turn::Established(negotiated) => self.hand_over(id, negotiated),
            Turn::Ended(end) => self.close(id, Closing::Ended(end)),
        }
    }

    fn set_interest(&mut self, id: u64, events: u32) {
        let conn = self.conns.get_mut(&id).expect("waiting");
        if conn.interest != events {
            conn.interest = events;
            let fd = conn.transport.raw_fd();
            if let Err(error) = self.epoll.control(libc::EPOLL_CTL_MOD, fd, id, events) {
                self.close(id, Closing::Ended(SessionEnd::Io(error)));
            }
        }
    }

    fn report_standing(&mut self, id: u64) {
        let Some(conn) = self.conns.get_mut(&id) else {
            return;
        };
        let standing = match conn.stage {
            Stage::TlsQueued => Standing::ServersTurn,
            Stage::Tls(_) => Standing::ClientsTurn,
            _ if conn.messages == 0 => Standing::Silent,
            _ => Standing::ClientsTurn,
        };
        if conn.reported != (standing, conn.messages) {
            conn.reported = (standing, conn.messages);
            self.admission.set_standing(id, standing);
        }
    }

    /// STARTTLS was acknowledged: take a TLS slot, or queue for one.
    fn queue_tls(&mut self, id: u64) {
        let conn = self.conns.get_mut(&id).expect("waiting");
        conn.stage = Stage::TlsQueued;
        let source = conn.source;
        self.set_interest(id, 0);
        if !self.conns.contains_key(&id) {
            return;
        }
        self.report_standing(id);
        self.tls_queue.push(source, id);
        self.start_queued_tls();
        self.reclaim_tls_slots(Instant::now());
    }

    /// While connections queue for a TLS slot and none is free, takes back
    /// the slot of a handshake past [`TLS_SLOT_GRACE`] (see
    /// [`Lobby::tls_slot_to_reclaim`]), once it has been served one last
    /// time (its client's answer may be waiting).
    fn reclaim_tls_slots(&mut self, now: Instant) {
        let mut probed = HashSet::new();
        while !self.tls_queue.is_empty() && self.tls_running.len() >= self.config.max_tls_handshakes
        {
            let Some(victim) = self.tls_slot_to_reclaim(now, &probed) else {
                return;
            };
            probed.insert(victim);
            self.service(victim, 0);
            if self.tls_running.contains(&victim) {
                self.close(victim, Closing::TlsSlot);
            }
        }
    }

    /// The TLS handshake whose slot goes first: of those that have held
    /// theirs for [`TLS_SLOT_GRACE`] (and are not in `skip`), one from the
    /// source holding the most slots, the oldest of them. A source holding
    /// a single slot keeps it while another holds more, even young ones:
    /// a lone honest client from another address never pays for a flood.
    fn tls_slot_to_reclaim(&self, now: Instant, skip: &HashSet<u64>) -> Option<u64> {
        let mut held: HashMap<Source, usize> = HashMap::new();
        let running = || self.tls_running.iter().filter(|id| !skip.contains(*id));
        for id in running() {
            *held.entry(self.conns[id].source).or_default() += 1;
        }
        let most = held.values().copied().max()?;
        running()
            .filter_map(|&id| {
                let conn = &self.conns[&id];
                let started = conn.tls_started?;
                let held = held[&conn.source];
                let eligible = held > 1 || most == 1;
                (eligible && now.duration_since(started) >= TLS_SLOT_GRACE).then_some((
                    Reverse(held),
                    started,
                    id,
                ))
            })
            .min()
            .map(|(_, _, id)| id)
    }

    fn start_queued_tls(&mut self) {
        while self.tls_running.len() < self.config.max_tls_handshakes {
            let Some(id) = self.tls_queue.pop() else {
                return;
            };
            let config = self
                .config
                .tls
                .expect("STARTTLS is only acknowledged with credentials");
            let conn = self.conns.get_mut(&id).expect("queued connections wait");
            match conn.transport.new_tls_session(config) {
                Ok(session) => {
                    conn.stage = Stage::Tls(Box::new(session));
                    conn.tls_started = Some(Instant::now());
                    self.tls_running.insert(id);
                    bump(&self.counters.tls_handshakes_started);
                    self.set_tls_gauge();
                    // Its ClientHello may be waiting already.
                    self.again.push(id);
                    self.report_standing(id);
                }
                Err(error) => self.close(id, Closing::Ended(SessionEnd::Io(error))),
            }
        }
    }

    /// Drops connections whose handshake deadline has passed.
    fn expire(&mut self, now: Instant) {
        while let Some(&id) = self.by_age.first() {
            if self.conns[&id].accepted + self.config.handshake_timeout > now {
                return;
            }
            self.close(id, Closing::TimedOut);
        }
    }

    /// Takes a connection out of every structure of the lobby.
    fn remove(&mut self, id: u64) -> Option<Waiting> {
        let conn = self.conns.remove(&id)?;
        let _ = self
            .epoll
            .control(libc::EPOLL_CTL_DEL, conn.transport.raw_fd(), id, 0);
        assert!(
            self.admission.remove(id),
            "a waiting connection is admitted"
        );
        assert!(self.by_age.remove(&id), "a waiting connection is aged");
        if matches!(conn.stage, Stage::TlsQueued) {
            self.tls_queue.remove(conn.source, id);
        }
        self.set_waiting_gauge();
        if self.tls_running.remove(&id) {
            self.set_tls_gauge();
            self.start_queued_tls();
        }
        Some(conn)
    }

    fn hand_over(&mut self, id: u64, negotiated: Negotiated) {
        let Some(conn) = self.remove(id) else {
            return;
        };
        // The limit was checked when the client asked to start; sessions
        // may have filled while its reply waited to be written.
        if self.sessions.established() >= self.config.max_connections {
            bump(&self.counters.refused_busy);
            self.tallies.busy.note(
                false,
                format_args!(
                    "conn {id} ({}) finished its handshake with every session taken; closed",
                    conn.peer
                ),
            );
            return;
        }
        bump(&self.counters.handshakes_completed);
        let log = ConnLog {
            enabled: true,
            label: format!("conn {id} ({})", conn.peer),
        };
        self.sessions
            .start(conn.transport, negotiated, log, conn.accepted.elapsed());
    }

    fn close(&mut self, id: u64, why: Closing) {
        let Some(conn) = self.remove(id) else {
            return;
        };
        let peer = &conn.peer;
        let counters = self.counters;
        match why {
            Closing::Ended(end) => {
                bump(&counters.handshakes_failed);
                let warn = matches!(end, SessionEnd::Protocol(_) | SessionEnd::Io(_));
                self.tallies.ended.note(
                    warn,
                    format_args!("conn {id} ({peer}) closed during the handshake: {end}"),
                );
            }
            Closing::TimedOut => {
                bump(&counters.handshakes_timed_out);
                self.tallies.timed_out.note(
                    true,
                    format_args!(
                        "dropped conn {id} ({peer}): its handshake took over {:?}",
                        self.config.handshake_timeout
                    ),
                );
            }
            Closing::Crowded(why) => {
                let (counter, limit, flag) = match why {
                    Crowding::Source => (
                        &counters.evicted_per_source,
                        self.config.limits.max_per_source,
                        "--max-handshakes-per-address",
                    ),
                    Crowding::Total => (
                        &counters.evicted_lobby_full,
                        self.config.limits.max_total,
                        "--max-handshakes",
                    ),
                };
                bump(counter);
                self.tallies.crowded.note(
                    true,
                    format_args!(
                        "dropped conn {id} ({peer}) to make room for a newcomer: {limit} handshakes were waiting ({flag})"
                    ),
                );
            }
            Closing::ForFds => {
                bump(&counters.evicted_for_fds);
                self.tallies.fds.note(
                    true,
                    format_args!("dropped conn {id} ({peer}), in its handshake, to accept a newcomer; raise the file limit (ulimit -n)"),
                );
            }
            Closing::TlsSlot => {
                bump(&counters.evicted_tls_slot);
                self.tallies.tls_slot.note(
                    true,
                    format_args!(
                        "dropped conn {id} ({peer}): its TLS handshake stalled while others queued for the {} slots (--max-tls-handshakes)",
                        self.config.max_tls_handshakes
                    ),
                );
            }
            Closing::Stopping => {}
        }
        // Dropping the connection closes its socket.
    }

    fn set_waiting_gauge(&self) {
        self.counters.handshakes_waiting.store(
            self.admission.len() as u64,
            std::sync::atomic::Ordering::Relaxed,
        );
    }

    fn set_tls_gauge(&self) {
        self.counters.tls_handshakes_running.store(
            self.tls_running.len() as u64,
            std::sync::atomic::Ordering::Relaxed,
        );
    }
}

/// Runs one connection's handshake as far as it goes without waiting.
fn converse(
    conn: &mut Waiting,
    scratch: &mut [u8],
    exports: &Exports,
    config: &LobbyConfig<'_>,
    refusal: &Option<Refusal>,
) -> Turn {
    for _ in 0..READS_PER_SERVICE {
        if conn.sent < conn.output.len() {
            match conn.transport.try_write(&conn.output[conn.sent..]) {
                Ok(count) => conn.sent += count,
                Err(error) => return Turn::Ended(error.into()),
            }
            if conn.sent < conn.output.len() {
                return Turn::Wait(OUT);
            }
            conn.output = Vec::new();
            conn.sent = 0;
            match std::mem::replace(&mut conn.then, Then::Read) {
                Then::Read => {}
                Then::StartTls => return Turn::QueueTls,
                Then::Transmission(negotiated) => return Turn::Established(negotiated),
                Then::Close(end) => return Turn::Ended(end),
            }
        }
        let needed = match &mut conn.stage {
            Stage::TlsQueued => return Turn::Wait(0),
            Stage::Tls(session) => {
                match session.handshake() {
                    Ok(TlsStep::Wait(events)) => return Turn::Wait(epoll_events(events)),
                    Ok(TlsStep::Done) => {}
                    Err(error) => {
                        return Turn::Ended(SessionEnd::Protocol(format!(
                            "TLS handshake failed: {error}"
                        )))
                    }
                }
                let Stage::Tls(session) = std::mem::replace(&mut conn.stage, Stage::Header) else {
                    unreachable!("matched above");
                };
                conn.transport.adopt_tls(*session);
                // Nothing negotiated in plain text survives.
                let tls = TlsState {
                    mode: config.tls_mode,
                    active: true,
                };
                conn.haggle = Haggle::new(conn.client_flags, tls);
                conn.messages += 1;
                continue;
            }
            Stage::Flags => CLIENT_FLAGS_BYTES,
            Stage::Header => OPTION_HEADER_BYTES,
            Stage::Data(header) => header.length as usize,
            Stage::Discard(_, left) => (*left).min(scratch.len() as u64) as usize,
        };
        let discarding = matches!(conn.stage, Stage::Discard(..));
        let want = if discarding {
            needed
        } else {
            needed - conn.frame.len()
        };
        let count = match conn.transport.try_read(&mut scratch[..want]) {
            Ok(0) => {
                let between =
                    conn.frame.is_empty() && matches!(conn.stage, Stage::Flags | Stage::Header);
                return Turn::Ended(if between {
                    SessionEnd::ClientClosed
                } else {
                    SessionEnd::Protocol("connection closed in the middle of a message".into())
                });
            }
            Ok(count) => count,
            Err(Blocked::On(events)) => return Turn::Wait(epoll_events(events)),
            Err(Blocked::Failed(error)) => return Turn::Ended(SessionEnd::Io(error)),
        };
        if let Stage::Discard(header, left) = &mut conn.stage {
            *left -= count as u64;
            if *left > 0 {
                continue;
            }
            let header = *header;
            if let Err(end) = answer(conn, exports, header, None, refusal) {
                return Turn::Ended(end);
            }
            continue;
        }
        conn.frame.extend_from_slice(&scratch[..count]);
        if conn.frame.len() < needed {
            continue;
        }
        if let Err(end) = complete(conn, exports, config, refusal) {
            return Turn::Ended(end);
        }
    }
    Turn::Again
}

/// A whole message is in `conn.frame`: act on it.
fn complete(
    conn: &mut Waiting,
    exports: &Exports,
    config: &LobbyConfig<'_>,
    refusal: &Option<Refusal>,
) -> Result<(), SessionEnd> {
    let frame = std::mem::take(&mut conn.frame);
    conn.messages += 1;
    match conn.stage {
        Stage::Flags => {
            let bytes: &[u8; CLIENT_FLAGS_BYTES] = frame[..].try_into().expect("whole flags");
            conn.client_flags = client_flags(bytes)?;
            let tls = TlsState {
                mode: config.tls_mode,
                active: false,
            };
            conn.haggle = Haggle::new(conn.client_flags, tls);
            conn.stage = Stage::Header;
        }
        Stage::Header => {
            let bytes: &[u8; OPTION_HEADER_BYTES] = frame[..].try_into().expect("whole header");
            let header = option_header(bytes)?;
            if header.length > MAX_OPTION_BYTES {
                Haggle::check_oversized(header)?;
                conn.stage = Stage::Discard(header, u64::from(header.length));
            } else if header.length == 0 {
                answer(conn, exports, header, Some(&[]), refusal)?;
            } else {
                conn.stage = Stage::Data(header);
            }
        }
        Stage::Data(header) => answer(conn, exports, header, Some(&frame), refusal)?,
        Stage::Discard(..) | Stage::TlsQueued | Stage::Tls(_) => {
            unreachable!("no frame is gathered in this stage")
        }
    }
    Ok(())
}

/// Answers an option, and says what follows once the answer is sent.
fn answer(
    conn: &mut Waiting,
    exports: &Exports,
    header: OptionHeader,
    data: Option<&[u8]>,
    refusal: &Option<Refusal>,
) -> Result<(), SessionEnd> {
    if data.is_some() && matches!(refusal, Some(Refusal::Busy(_))) {
        conn.told_busy = true;
    }
    let next = conn
        .haggle
        .answer(exports, &mut conn.output, header, data, refusal.clone())?;
    conn.stage = Stage::Header;
    conn.then = match next {
        Next::Continue => Then::Read,
        Next::StartTls => Then::StartTls,
        Next::Transmission(negotiated) => Then::Transmission(negotiated),
        Next::Abort => Then::Close(SessionEnd::ClientAbort),
    };
    Ok(())
}

fn epoll_events(poll_events: libc::c_short) -> u32 {
    let mut events = 0;
    if poll_events & libc::POLLIN != 0 {
        events |= IN;
    }
    if poll_events & libc::POLLOUT != 0 {
        events |= OUT;
    }
    events
}

/// Accept failed for want of descriptors, which dropping one can cure.
/// (ENOMEM and ENOBUFS are a memory shortage: the listener rests instead,
/// and no waiting connection is dropped for them.)
fn out_of_descriptors(error: &io::Error) -> bool {
    matches!(error.raw_os_error(), Some(libc::EMFILE | libc::ENFILE))
}

/// Errors of one pending connection that Linux reports from accept
/// (accept(2): to be treated like EAGAIN, i.e. retried); a firewall's
/// EPERM too. None of them says anything about the listener.
fn carried_over_from_the_network(error: &io::Error) -> bool {
    matches!(
        error.raw_os_error(),
        Some(
            libc::ENETDOWN
                | libc::EPROTO
                | libc::ENOPROTOOPT
                | libc::EHOSTDOWN
                | libc::ENONET
                | libc::EHOSTUNREACH
                | libc::EOPNOTSUPP
                | libc::ENETUNREACH
                | libc::EPERM
        )
    )
}

/// A descriptor held in reserve for when accept finds none.
fn open_reserve() -> Option<File> {
    File::open("/dev/null").ok()
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::net::{TcpListener, TcpStream};

    use super::*;
    use crate::handshake::Export;

    fn os(errno: i32) -> io::Error {
        io::Error::from_raw_os_error(errno)
    }

    struct NoSessions;

    impl Sessions for NoSessions {
        fn established(&self) -> usize {
            0
        }

        fn stopping(&self) -> bool {
            false
        }

        fn start(&self, _: Transport, _: Negotiated, _: ConnLog, _: Duration) {
            panic!("no handshake finishes in these tests");
        }
    }

    /// Waits until the lobby's end of connection `id` has bytes to read.
    fn wait_readable(lobby: &Lobby<'_>, id: u64) {
        let mut poll = libc::pollfd {
            fd: lobby.conns[&id].transport.raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd.
        let ready = unsafe { libc::poll(&mut poll, 1, 10_000) };
        assert_eq!(ready, 1, "the client's flags never arrived");
    }

    /// Out of descriptors, the lobby drops the oldest silent connection;
    /// one whose first message arrived after it was accepted but before the
    /// loop read it (accepted early in a turn of many accepts) has spoken
    /// and is kept, and a silent one newer than it goes instead. Reproduces
    /// a lock-out seen in `tests/hostile.rs` with 256 descriptors.
    #[test]
    fn out_of_descriptors_a_client_that_spoke_unread_is_kept() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let address = listener.local_addr().unwrap();
        let accept = || -> io::Result<Accepted> {
            let (stream, peer) = listener.accept()?;
            Ok(Accepted {
                socket: Socket::Tcp(stream),
                peer: peer.to_string(),
                ip: Some(peer.ip()),
            })
        };
        let doors = Doors {
            listener: listener.as_raw_fd(),
            wake: listener.as_raw_fd(),
            accept: &accept,
        };
        let export = Export {
            name: String::new(),
            description: None,
            size_bytes: 1 << 20,
            read_only: false,
        };
        let counters = ServerCounters::default();
        let config = LobbyConfig {
            handshake_timeout: Duration::from_secs(60),
            limits: AdmissionLimits {
                max_total: 100,
                max_per_source: 100,
            },
            max_tls_handshakes: 1,
            max_connections: 10,
            tls_mode: TlsMode::Off,
            tls: None,
        };
        let exports = Exports::from(export);
        let mut lobby = Lobby::new(config, &exports, &NoSessions, &counters).unwrap();
        let mut clients = Vec::new();
        for _ in 0..3 {
            clients.push(TcpStream::connect(address).unwrap());
            lobby.admit(accept().unwrap());
        }
        let (honest, first_attacker) = (FIRST_CONNECTION_ID, FIRST_CONNECTION_ID + 1);
        let mut greeting = [0u8; 18];
        clients[0].read_exact(&mut greeting).unwrap();
        clients[0].write_all(&3u32.to_be_bytes()).unwrap();
        wait_readable(&lobby, honest);
        assert_eq!(lobby.admission.rank(honest).unwrap().0, Standing::Silent);

        assert!(lobby.free_a_descriptor(&doors, &os(libc::EMFILE)));
        assert!(
            lobby.conns.contains_key(&honest),
            "the client that spoke was dropped"
        );
        assert_eq!(
            lobby.admission.rank(honest).unwrap().0,
            Standing::ClientsTurn
        );
        assert!(!lobby.conns.contains_key(&first_attacker));
        assert_eq!(
            counters
                .evicted_for_fds
                .load(std::sync::atomic::Ordering::Relaxed),
            1
        );
        lobby.admission.check();
    }

    /// Of the TLS handshakes past their grace, one from the source holding
    /// the most slots goes first, the oldest of them; a lone client from
    /// another address, however long past it, stays while the flood holds
    /// more slots, even young ones, and goes only among equals. Slots are
    /// set up by hand: the choice looks only at sources and times.
    #[test]
    fn tls_slots_are_reclaimed_from_the_source_holding_most() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let address = listener.local_addr().unwrap();
        let export = Export {
            name: String::new(),
            description: None,
            size_bytes: 1 << 20,
            read_only: false,
        };
        let counters = ServerCounters::default();
        let config = LobbyConfig {
            handshake_timeout: Duration::from_secs(60),
            limits: AdmissionLimits {
                max_total: 100,
                max_per_source: 100,
            },
            max_tls_handshakes: 4,
            max_connections: 10,
            tls_mode: TlsMode::Off,
            tls: None,
        };
        let exports = Exports::from(export);
        let mut lobby = Lobby::new(config, &exports, &NoSessions, &counters).unwrap();
        let mut clients = Vec::new();
        for _ in 0..4 {
            clients.push(TcpStream::connect(address).unwrap());
            let (stream, peer) = listener.accept().unwrap();
            lobby.admit(Accepted {
                socket: Socket::Tcp(stream),
                peer: peer.to_string(),
                ip: Some(peer.ip()),
            });
        }
        let [honest, flood_a, flood_b, flood_c] = [0, 1, 2, 3].map(|i| FIRST_CONNECTION_ID + i);
        let lone = Source::of(Some("127.0.0.3".parse().unwrap()));
        let flood = Source::of(Some("127.0.0.1".parse().unwrap()));
        let now = Instant::now();
        let grace = TLS_SLOT_GRACE;
        for (id, source, age) in [
            (honest, lone, 10 * grace),
            (flood_a, flood, grace),
            (flood_b, flood, 2 * grace),
            (flood_c, flood, grace / 2),
        ] {
            let conn = lobby.conns.get_mut(&id).unwrap();
            conn.source = source;
            conn.tls_started = Some(now - age);
            lobby.tls_running.insert(id);
        }
        let none = HashSet::new();
        assert_eq!(lobby.tls_slot_to_reclaim(now, &none), Some(flood_b));
        let mut skip = HashSet::from([flood_b]);
        assert_eq!(lobby.tls_slot_to_reclaim(now, &skip), Some(flood_a));
        // The flood's two slots left are within their grace: nothing goes,
        // the lone one least of all.
        lobby.conns.get_mut(&flood_a).unwrap().tls_started = Some(now - grace / 4);
        assert_eq!(lobby.tls_slot_to_reclaim(now, &skip), None);
        // With one slot each, the oldest past its grace goes.
        skip.insert(flood_a);
        assert_eq!(lobby.tls_slot_to_reclaim(now, &skip), Some(honest));
        // Between sources holding as many, the oldest goes.
        lobby.conns.get_mut(&flood_a).unwrap().source = lone;
        assert_eq!(lobby.tls_slot_to_reclaim(now, &none), Some(honest));
        // Nothing goes within its grace.
        assert_eq!(lobby.tls_slot_to_reclaim(now - 10 * grace, &none), None);
        lobby.tls_running.clear();
    }

    /// Only a shortage of descriptors costs a waiting connection; a memory
    /// shortage rests the listener, and a pending connection's own network
    /// error is skipped like EAGAIN (accept(2)).
    #[test]
    fn accept_errors_are_told_apart() {
        for errno in [libc::EMFILE, libc::ENFILE] {
            assert!(out_of_descriptors(&os(errno)), "{errno}");
            assert!(!carried_over_from_the_network(&os(errno)), "{errno}");
        }
        for errno in [libc::ENOMEM, libc::ENOBUFS, libc::EBADF, libc::EINVAL] {
            assert!(!out_of_descriptors(&os(errno)), "{errno}");
            assert!(!carried_over_from_the_network(&os(errno)), "{errno}");
        }
        for errno in [
            libc::ENETDOWN,
            libc::EPROTO,
            libc::EHOSTUNREACH,
            libc::ENETUNREACH,
            libc::EPERM,
        ] {
            assert!(carried_over_from_the_network(&os(errno)), "{errno}");
            assert!(!out_of_descriptors(&os(errno)), "{errno}");
        }
    }
}
