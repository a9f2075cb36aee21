//! Who may wait in the handshake lobby, and who is dropped when it is full.
//!
//! Connections that have not finished their handshake are kept apart from
//! established sessions (which `--max-connections` bounds): they have a
//! budget of their own, in total and per source address, and when a new
//! connection arrives at a full budget, one already waiting makes room.
//! The newcomer is always admitted: it is the connection most likely to be
//! an honest client that just arrived, and an attacker cannot hold a place
//! by arriving early, only by arriving often.
//!
//! The victim is chosen by [`Standing`], then by age within it:
//! 1. the oldest *silent* connection (it has not completed one message:
//!    idle sockets and one-byte-at-a-time drips stay silent);
//! 2. else the one that has owed the server its next message the longest
//!    (a client stalling between options, or in a TLS handshake);
//! 3. else the oldest waiting for the server (queued for a TLS slot).
//!
//! So an honest client behind an attacker's address (NAT) gets in: once it
//! has spoken, every silent connection from that address goes before it.
//!
//! A source is an IPv4 address, or an IPv6 /64 (one host's usual share).
//! Unix-socket peers are local users: they share the total budget only.
//!
//! Invariants (checked by [`Admission::check`] in tests): every entry is in
//! the global order and in its source's order, exactly once; a source's
//! order is never kept empty; no source holds more than its cap after
//! [`Admission::admit`] returns.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::net::IpAddr;

/// Where a connection comes from, for the per-source cap.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Source {
    /// An IPv4 address, or an IPv6 address masked to its /64.
    Ip(IpAddr),
    /// A Unix-socket peer: not capped per source.
    Local,
}

impl Source {
    pub fn of(ip: Option<IpAddr>) -> Source {
        match ip {
            None => Source::Local,
            Some(IpAddr::V4(v4)) => Source::Ip(IpAddr::V4(v4)),
            Some(IpAddr::V6(v6)) => match v6.to_ipv4_mapped() {
                Some(v4) => Source::Ip(IpAddr::V4(v4)),
                None => {
                    let prefix = u128::from(v6) & !((1u128 << 64) - 1);
                    Source::Ip(IpAddr::V6(prefix.into()))
                }
            },
        }
    }
}

/// How far a waiting connection has got; lower goes first when room is needed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Standing {
    /// Has not completed a message yet.
    Silent,
    /// The client owes the next message.
    ClientsTurn,
    /// Waiting for the server (a TLS handshake slot).
    ServersTurn,
}

/// Eviction order: standing, then the stamp of when it took that standing,
/// then the connection id.
type Key = (Standing, u64, u64);

/// Why a connection was dropped to make room.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Crowding {
    /// Its source had `max_per_source` connections waiting.
    Source,
    /// The lobby had `max_total` connections waiting.
    Total,
}

/// The lobby's budget.
#[derive(Debug, Clone, Copy)]
pub(crate) struct AdmissionLimits {
    pub max_total: usize,
    pub max_per_source: usize,
}

#[derive(Debug)]
struct Entry {
    source: Source,
    key: Key,
}

/// The waiting connections, ordered for eviction.
#[derive(Debug)]
pub(crate) struct Admission {
    limits: AdmissionLimits,
    entries: HashMap<u64, Entry>,
    order: BTreeSet<Key>,
    by_source: HashMap<Source, BTreeSet<Key>>,
    /// Stamps standings, so that "oldest" means "took it first".
    clock: u64,
}

impl Admission {
    pub fn new(limits: AdmissionLimits) -> Admission {
        assert!(limits.max_total >= 1, "the lobby must hold a connection");
        assert!(limits.max_per_source >= 1, "a source must get a place");
        Admission {
            limits,
            entries: HashMap::new(),
            order: BTreeSet::new(),
            by_source: HashMap::new(),
            clock: 0,
        }
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    #[cfg(test)]
    pub fn standing(&self, id: u64) -> Option<Standing> {
        self.rank(id).map(|(standing, _)| standing)
    }

    /// A connection's standing and when it took it: lower goes first.
    pub fn rank(&self, id: u64) -> Option<(Standing, u64)> {
        self.entries
            .get(&id)
            .map(|entry| (entry.key.0, entry.key.1))
    }

    /// The connection to drop before `source` may add one, if it is at its
    /// cap or the lobby is full; the caller drops it (see
    /// [`Admission::remove`]) and asks again until this says None.
    pub fn victim_for(&self, source: Source) -> Option<(u64, Crowding)> {
        if source != Source::Local {
            if let Some(keys) = self.by_source.get(&source) {
                if keys.len() >= self.limits.max_per_source {
                    let key = keys.first().expect("a source's order is never empty");
                    return Some((key.2, Crowding::Source));
                }
            }
        }
        if self.entries.len() >= self.limits.max_total {
            let key = self.order.first().expect("a full lobby has an oldest");
            return Some((key.2, Crowding::Total));
        }
        None
    }

    /// The first connection in eviction order, for when something else
    /// needs room (a file descriptor, when the process has none left).
    pub fn first(&self) -> Option<u64> {
        self.order.first().map(|key| key.2)
    }

    /// Admits `id` as silent. The caller has made room (see
    /// [`Admission::victim_for`]).
    pub fn admit(&mut self, id: u64, source: Source) {
        assert!(
            self.victim_for(source).is_none(),
            "admitted without room being made"
        );
        let key = (Standing::Silent, self.tick(), id);
        let previous = self.entries.insert(id, Entry { source, key });
        assert!(previous.is_none(), "connection {id} admitted twice");
        self.order.insert(key);
        self.by_source.entry(source).or_default().insert(key);
    }

    /// Records a connection's new standing, stamped now. Re-stamping the
    /// same standing counts as progress (a message completed).
    pub fn set_standing(&mut self, id: u64, standing: Standing) {
        let stamp = self.tick();
        let entry = self
            .entries
            .get_mut(&id)
            .expect("standing of an admitted connection");
        let old = entry.key;
        entry.key = (standing, stamp, id);
        let new = entry.key;
        let source = entry.source;
        assert!(self.order.remove(&old), "entry missing from the order");
        self.order.insert(new);
        let keys = self.by_source.get_mut(&source).expect("source order");
        assert!(keys.remove(&old), "entry missing from its source's order");
        keys.insert(new);
    }

    /// Forgets a connection (done, dropped or evicted). False if unknown.
    pub fn remove(&mut self, id: u64) -> bool {
        let Some(entry) = self.entries.remove(&id) else {
            return false;
        };
        assert!(
            self.order.remove(&entry.key),
            "entry missing from the order"
        );
        let keys = self.by_source.get_mut(&entry.source).expect("source order");
        assert!(
            keys.remove(&entry.key),
            "entry missing from its source's order"
        );
        if keys.is_empty() {
            self.by_source.remove(&entry.source);
        }
        true
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// Checks the invariants of the module documentation.
    #[cfg(test)]
    pub fn check(&self) {
        assert_eq!(self.order.len(), self.entries.len());
        let sum: usize = self.by_source.values().map(BTreeSet::len).sum();
        assert_eq!(sum, self.entries.len());
        for (id, entry) in &self.entries {
            assert_eq!(entry.key.2, *id);
            assert!(self.order.contains(&entry.key));
            assert!(self.by_source[&entry.source].contains(&entry.key));
        }
        for (source, keys) in &self.by_source {
            assert!(!keys.is_empty());
            if *source != Source::Local {
                assert!(keys.len() <= self.limits.max_per_source);
            }
        }
        assert!(self.entries.len() <= self.limits.max_total);
    }
}

/// Waiting connections served in turn by source: each source in the queue
/// gets the next free place in rotation, so one address flooding the queue
/// delays another address's connection by at most one place per flooding
/// source. Used for TLS handshake slots.
#[derive(Debug, Default)]
pub(crate) struct FairQueue {
    by_source: HashMap<Source, VecDeque<u64>>,
    rotation: VecDeque<Source>,
    len: usize,
}

impl FairQueue {
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn push(&mut self, source: Source, id: u64) {
        let queue = self.by_source.entry(source).or_default();
        if queue.is_empty() {
            self.rotation.push_back(source);
        }
        queue.push_back(id);
        self.len += 1;
    }

    /// The next connection: the oldest of the source whose turn it is.
    pub fn pop(&mut self) -> Option<u64> {
        let source = self.rotation.pop_front()?;
        let queue = self
            .by_source
            .get_mut(&source)
            .expect("a rotating source has a queue");
        let id = queue
            .pop_front()
            .expect("a rotating source's queue is not empty");
        if queue.is_empty() {
            self.by_source.remove(&source);
        } else {
            self.rotation.push_back(source);
        }
        self.len -= 1;
        Some(id)
    }

    /// Takes a connection out of the queue (it left); false if not queued.
    /// Linear in its source's queue, which the per-source cap keeps short.
    pub fn remove(&mut self, source: Source, id: u64) -> bool {
        let Some(queue) = self.by_source.get_mut(&source) else {
            return false;
        };
        let Some(at) = queue.iter().position(|queued| *queued == id) else {
            return false;
        };
        queue.remove(at);
        self.len -= 1;
        if queue.is_empty() {
            self.by_source.remove(&source);
            self.rotation.retain(|s| *s != source);
        }
        true
    }
}

#[cfg(test)]
mod tests {
    //! The eviction policy against the attacks it is for: silent floods,
    //! one address crowding out another, an honest client behind a
    //! flooding address, and a TLS queue shared fairly.

    use super::*;
    use std::net::Ipv4Addr;

    fn ip(last: u8) -> Source {
        Source::of(Some(IpAddr::V4(Ipv4Addr::new(127, 0, 0, last))))
    }

    /// Admits like the lobby does: drop victims until there is room.
    fn arrive(a: &mut Admission, id: u64, source: Source) -> Vec<(u64, Crowding)> {
        let mut dropped = Vec::new();
        while let Some((victim, why)) = a.victim_for(source) {
            assert!(a.remove(victim));
            dropped.push((victim, why));
        }
        a.admit(id, source);
        a.check();
        dropped
    }

    fn limits(max_total: usize, max_per_source: usize) -> AdmissionLimits {
        AdmissionLimits {
            max_total,
            max_per_source,
        }
    }

    #[test]
    fn a_full_lobby_drops_its_oldest_silent_connection() {
        let mut a = Admission::new(limits(3, 10));
        for id in 1..=3 {
            assert!(arrive(&mut a, id, ip(id as u8)).is_empty());
        }
        // 1 has spoken: 2 is now the oldest silent one.
        a.set_standing(1, Standing::ClientsTurn);
        assert_eq!(arrive(&mut a, 4, ip(9)), vec![(2, Crowding::Total)]);
        assert_eq!(arrive(&mut a, 5, ip(9)), vec![(3, Crowding::Total)]);
        assert_eq!(arrive(&mut a, 6, ip(9)), vec![(4, Crowding::Total)]);
        assert_eq!(a.len(), 3);
        assert_eq!(a.standing(1), Some(Standing::ClientsTurn));
    }

    #[test]
    fn a_crowded_source_pays_for_itself() {
        let mut a = Admission::new(limits(100, 4));
        for id in 1..=4 {
            arrive(&mut a, id, ip(1));
        }
        arrive(&mut a, 5000, ip(2));
        // A flood from .1 only ever evicts .1's connections.
        for id in 5..1000 {
            let dropped = arrive(&mut a, id, ip(1));
            assert_eq!(dropped, vec![(id - 4, Crowding::Source)]);
        }
        assert_eq!(a.standing(5000), Some(Standing::Silent));
        assert_eq!(a.len(), 5);
    }

    #[test]
    fn an_honest_client_behind_a_flooding_address_gets_in() {
        let mut a = Admission::new(limits(1000, 8));
        for id in 1..=8 {
            arrive(&mut a, id, ip(1));
        }
        // The honest client arrives (evicting the oldest silent one) and
        // speaks; the flood continues from the same address.
        assert_eq!(arrive(&mut a, 50, ip(1)), vec![(1, Crowding::Source)]);
        a.set_standing(50, Standing::ClientsTurn);
        for id in 100..10_000 {
            let dropped = arrive(&mut a, id, ip(1));
            assert_eq!(dropped.len(), 1);
            assert_ne!(dropped[0].0, 50, "the honest client was dropped");
        }
        // Progress after progress, it stays while silent ones come and go.
        a.set_standing(50, Standing::ServersTurn);
        arrive(&mut a, 20_000, ip(1));
        a.set_standing(50, Standing::ClientsTurn);
        arrive(&mut a, 20_001, ip(1));
        assert_eq!(a.standing(50), Some(Standing::ClientsTurn));
    }

    #[test]
    fn the_longest_stalled_talker_goes_when_nobody_is_silent() {
        let mut a = Admission::new(limits(3, 3));
        for id in 1..=3 {
            arrive(&mut a, id, ip(1));
        }
        a.set_standing(2, Standing::ClientsTurn); // stalled since then
        a.set_standing(1, Standing::ServersTurn); // queued for TLS
        a.set_standing(3, Standing::ClientsTurn); // just answered
        a.set_standing(3, Standing::ClientsTurn);
        assert_eq!(arrive(&mut a, 4, ip(1)), vec![(2, Crowding::Source)]);
        // 4 is silent and goes next; then 3, the remaining talker; the
        // connection waiting for the server goes last.
        assert_eq!(a.first(), Some(4));
        assert!(a.remove(4));
        assert_eq!(a.first(), Some(3));
        assert!(a.remove(3));
        assert_eq!(a.first(), Some(1));
        assert!(a.remove(1));
        assert_eq!(a.first(), None);
        assert!(!a.remove(1));
        a.check();
    }

    #[test]
    fn unix_socket_peers_share_only_the_total() {
        let mut a = Admission::new(limits(5, 1));
        for id in 1..=5 {
            assert!(arrive(&mut a, id, Source::Local).is_empty());
        }
        assert_eq!(arrive(&mut a, 6, Source::Local), vec![(1, Crowding::Total)]);
    }

    #[test]
    fn ipv6_sources_are_grouped_by_64_bit_prefix() {
        let near = |tail: u16| {
            Source::of(Some(IpAddr::V6(
                [0x2001, 0xdb8, 0, 1, 0, 0, 0, tail].into(),
            )))
        };
        let far = Source::of(Some(IpAddr::V6([0x2001, 0xdb8, 0, 2, 0, 0, 0, 1].into())));
        assert_eq!(near(1), near(0xffff));
        assert_ne!(near(1), far);
        let mapped = Source::of(Some("::ffff:127.0.0.1".parse().unwrap()));
        assert_eq!(mapped, ip(1));
    }

    #[test]
    fn the_tls_queue_takes_sources_in_turn() {
        let mut q = FairQueue::default();
        for id in 1..=100 {
            q.push(ip(1), id);
        }
        q.push(ip(3), 500);
        q.push(ip(2), 600);
        q.push(ip(2), 601);
        assert_eq!(q.pop(), Some(1));
        assert_eq!(q.pop(), Some(500));
        assert_eq!(q.pop(), Some(600));
        assert_eq!(q.pop(), Some(2));
        assert!(q.remove(ip(2), 601));
        assert!(!q.remove(ip(2), 601));
        assert_eq!(q.pop(), Some(3));
        assert_eq!(q.pop(), Some(4));
        assert!(q.remove(ip(1), 50));
        assert_eq!(q.len(), 95);
        let rest: Vec<u64> = std::iter::from_fn(|| q.pop()).collect();
        assert_eq!(rest.len(), 95);
        assert!(!rest.contains(&50));
        assert_eq!(q.len(), 0);
    }
}
