//! The hooks: 32 bits of a sampled fingerprint's tag naming the chapter
//! that holds it, 8 bytes each.
//!
//! Two sorted vectors, neither with a fragment twice: `base`, allocated to
//! its length, and `recent`, a small one new hooks go into, merged into
//! `base` when it reaches its limit (`4 * sqrt(base)`, at least 256). An
//! insertion moves at most `recent`'s length; a merge, amortised over
//! the hooks that filled `recent`, moves about `sqrt(base) / 4` per hook.
//! When one fragment names two chapters (the same fingerprint stored
//! twice, or two fingerprints sharing the 32 bits), the higher chapter
//! number, the newer chapter, wins.
//!
//! A merge briefly holds the old and the new `base`; [`Hooks::ram_bytes`]
//! counts what is held between calls.

use std::mem::size_of;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Hook {
    pub fragment: u32,
    pub chapter: u32,
}

const RECENT_MIN: usize = 256;

fn recent_limit(base_len: usize) -> usize {
    (4 * base_len.isqrt()).max(RECENT_MIN)
}

pub(super) struct Hooks {
    base: Vec<Hook>,
    recent: Vec<Hook>,
}

impl Hooks {
    pub fn new() -> Hooks {
        Hooks {
            base: Vec::new(),
            recent: Vec::with_capacity(recent_limit(0)),
        }
    }

    /// Bytes held: both vectors' capacity.
    pub fn ram_bytes(&self) -> u64 {
        ((self.base.capacity() + self.recent.capacity()) * size_of::<Hook>()) as u64
    }

    /// RAM of an empty set of hooks.
    pub fn empty_ram_bytes() -> u64 {
        (recent_limit(0) * size_of::<Hook>()) as u64
    }

    /// Hooks held (a fragment in both vectors counts twice until merged).
    pub fn len(&self) -> usize {
        self.base.len() + self.recent.len()
    }

    /// True if every hook passes `test`.
    pub fn all(&self, test: impl Fn(&Hook) -> bool) -> bool {
        self.base.iter().chain(&self.recent).all(test)
    }

    /// The newest chapter this fragment names.
    pub fn get(&self, fragment: u32) -> Option<u32> {
        let find = |hooks: &[Hook]| {
            hooks
                .binary_search_by_key(&fragment, |hook| hook.fragment)
                .ok()
                .map(|at| hooks[at].chapter)
        };
        match (find(&self.base), find(&self.recent)) {
            (Some(old), Some(new)) => Some(old.max(new)),
            (old, new) => old.or(new),
        }
    }

    pub fn insert(&mut self, fragment: u32, chapter: u32) {
        match self
            .recent
            .binary_search_by_key(&fragment, |hook| hook.fragment)
        {
            Ok(at) => self.recent[at].chapter = self.recent[at].chapter.max(chapter),
            Err(at) => self.recent.insert(at, Hook { fragment, chapter }),
        }
        if self.recent.len() >= recent_limit(self.base.len()) {
            self.merge();
        }
    }

    /// Keeps only the hooks `keep` accepts, and gives the room back.
    pub fn retain(&mut self, keep: impl Fn(&Hook) -> bool) {
        self.base.retain(&keep);
        self.base.shrink_to_fit();
        self.recent.retain(&keep);
        self.fit_recent();
    }

    /// Drops the hooks of the oldest chapter named; false if none is left.
    pub fn drop_oldest_chapter(&mut self) -> bool {
        let oldest = self
            .base
            .iter()
            .chain(self.recent.iter())
            .map(|hook| hook.chapter)
            .min();
        match oldest {
            Some(oldest) => {
                self.retain(|hook| hook.chapter != oldest);
                true
            }
            None => false,
        }
    }

    fn merge(&mut self) {
        let mut merged = Vec::with_capacity(self.base.len() + self.recent.len());
        let mut old = self.base.iter().peekable();
        let mut new = self.recent.iter().peekable();
        while let (Some(a), Some(b)) = (old.peek(), new.peek()) {
            match a.fragment.cmp(&b.fragment) {
                std::cmp::Ordering::Less => merged.push(*old.next().expect("peeked")),
                std::cmp::Ordering::Greater => merged.push(*new.next().expect("peeked")),
                std::cmp::Ordering::Equal => {
                    merged.push(Hook {
                        fragment: a.fragment,
                        chapter: a.chapter.max(b.chapter),
                    });
                    old.next();
                    new.next();
                }
            }
        }
        merged.extend(old);
        merged.extend(new);
        merged.shrink_to_fit();
        debug_assert!(merged.windows(2).all(|w| w[0].fragment < w[1].fragment));
        self.base = merged;
        self.recent = Vec::with_capacity(recent_limit(self.base.len()));
    }

    /// `recent` back to its limit's capacity, merged if it holds as many.
    fn fit_recent(&mut self) {
        let limit = recent_limit(self.base.len());
        if self.recent.len() >= limit {
            self.merge();
        } else if self.recent.capacity() != limit {
            let mut fitted = Vec::with_capacity(limit);
            fitted.extend_from_slice(&self.recent);
            self.recent = fitted;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hooks_survive_merges_and_the_newest_chapter_wins() {
        let mut hooks = Hooks::new();
        // Fragments spread over u32 by an odd multiplier; 5,000 of them
        // force several merges.
        let fragment = |i: u32| i.wrapping_mul(0x9e37_79b9);
        (0..5_000).for_each(|i| hooks.insert(fragment(i), i / 10));
        assert_eq!(hooks.len(), 5_000);
        (0..5_000).for_each(|i| assert_eq!(hooks.get(fragment(i)), Some(i / 10), "hook {i}"));
        // An older chapter never replaces a newer one, a newer one does.
        hooks.insert(fragment(7), 0);
        assert_eq!(hooks.get(fragment(7)), Some(0));
        hooks.insert(fragment(4_999), 1);
        assert_eq!(hooks.get(fragment(4_999)), Some(499));
        hooks.insert(fragment(4_999), 9_999);
        assert_eq!(hooks.get(fragment(4_999)), Some(9_999));
        assert_eq!(hooks.get(fragment(5_000)), None);
    }

    #[test]
    fn retain_and_dropping_the_oldest_chapter_give_room_back() {
        let mut hooks = Hooks::new();
        (0..4_000u32).for_each(|i| hooks.insert(i * 2, i / 100));
        let before = hooks.ram_bytes();
        hooks.retain(|hook| hook.fragment % 4 == 0);
        assert_eq!(hooks.len(), 2_000);
        assert!(
            hooks.ram_bytes() < before,
            "{} < {before}",
            hooks.ram_bytes()
        );
        assert_eq!(hooks.get(8), Some(0));
        assert_eq!(hooks.get(6), None);
        assert!(hooks.drop_oldest_chapter());
        assert_eq!(hooks.get(8), None, "chapter 0 dropped");
        assert_eq!(hooks.get(400), Some(2));
        hooks.retain(|_| false);
        assert!(!hooks.drop_oldest_chapter());
        assert_eq!(hooks.ram_bytes(), Hooks::empty_ram_bytes());
    }
}
