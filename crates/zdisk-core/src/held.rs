//! Which engine locks the current thread holds, so that debug builds can
//! prove no medium call is made under one.
//!
//! A reader must never wait while another thread does I/O under a lock it
//! needs: that is how reads used to collapse behind a streaming writer.
//! Every lock a host read takes marks itself here while held ([`Held`]);
//! [`media::LockChecked`](crate::media::LockChecked) wraps a volume's
//! medium in debug builds and panics on any medium I/O made while a mark
//! is set, so the tests, the crash simulator and the fuzzers fail on the
//! first violation. Release builds compile all of it away, unless built
//! with `--cfg zdisk_lock_checks` (RUSTFLAGS): .ci/test builds the release
//! tests so, so they check too.

#[cfg(any(debug_assertions, zdisk_lock_checks))]
use std::cell::Cell;

#[cfg(any(debug_assertions, zdisk_lock_checks))]
thread_local! {
    /// The names of the marked locks this thread holds, innermost last.
    static HELD: Cell<[Option<&'static str>; 4]> = const { Cell::new([None; 4]) };
}

/// A mark that the current thread holds the lock named `name`, for as
/// long as the mark lives. Zero-sized and free in release builds without
/// `zdisk_lock_checks`.
#[must_use = "the mark lasts as long as the value"]
pub struct Held {
    #[cfg(any(debug_assertions, zdisk_lock_checks))]
    name: &'static str,
}

impl Held {
    /// Marks `name` as held by this thread.
    #[inline]
    pub fn mark(name: &'static str) -> Held {
        #[cfg(any(debug_assertions, zdisk_lock_checks))]
        HELD.with(|held| {
            let mut names = held.get();
            let free = names
                .iter()
                .position(Option::is_none)
                .expect("at most four marked locks are held at once");
            names[free] = Some(name);
            held.set(names);
        });
        let _ = name;
        Held {
            #[cfg(any(debug_assertions, zdisk_lock_checks))]
            name,
        }
    }
}

impl Drop for Held {
    #[inline]
    fn drop(&mut self) {
        #[cfg(any(debug_assertions, zdisk_lock_checks))]
        HELD.with(|held| {
            let mut names = held.get();
            let at = names
                .iter()
                .rposition(|n| *n == Some(self.name))
                .expect("a mark is dropped by the thread that set it");
            names[at] = None;
            held.set(names);
        });
    }
}

/// The marked lock this thread holds, if any (always `None` in release
/// builds without `zdisk_lock_checks`).
#[inline]
pub fn held_lock() -> Option<&'static str> {
    #[cfg(any(debug_assertions, zdisk_lock_checks))]
    {
        HELD.with(|held| held.get().iter().rev().flatten().next().copied())
    }
    #[cfg(not(any(debug_assertions, zdisk_lock_checks)))]
    {
        None
    }
}

/// Panics in checked builds if this thread holds a marked lock: `what` (a
/// medium call) must not run under it.
#[inline]
#[track_caller]
pub fn assert_none_held(what: &str) {
    if let Some(lock) = held_lock() {
        panic!("{what} while holding the {lock} lock: medium I/O must not run under it");
    }
}

#[cfg(all(test, any(debug_assertions, zdisk_lock_checks)))]
mod tests {
    use super::*;

    #[test]
    fn marks_nest_and_lift_in_any_order() {
        assert_eq!(held_lock(), None);
        let outer = Held::mark("state");
        let inner = Held::mark("tier");
        assert_eq!(held_lock(), Some("tier"));
        drop(outer);
        assert_eq!(held_lock(), Some("tier"));
        drop(inner);
        assert_eq!(held_lock(), None);
        assert_none_held("a read");
    }

    #[test]
    #[should_panic(expected = "a medium read while holding the state lock")]
    fn a_medium_call_under_a_marked_lock_panics() {
        let _held = Held::mark("state");
        assert_none_held("a medium read");
    }
}
