//! The worker pool that executes requests for every connection.
//!
//! The engine compresses on the calling thread, so request execution, not
//! socket reading, is where the CPU goes; a fixed pool shared by all
//! connections lets one client at a deep queue keep every core busy while
//! capping the number of threads however many clients connect.
//!
//! Jobs wait in two lanes ([`Lane`]). General workers take a quick job
//! (a read) before a bulk one (a write); read workers take only quick
//! jobs. So a read never queues behind writes, and never waits for a
//! worker while a writer keeps all the general ones compressing.
//!
//! Invariants: a job is run exactly once; jobs queued before
//! [`WorkerPool::shut_down`] still run before the workers exit; a panicking
//! job does not take its worker down (jobs catch device panics themselves,
//! this is the backstop).

use std::collections::VecDeque;
use std::io;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::{self, JoinHandle};

use crate::transmission::{Dispatch, Job, Lane};

#[derive(Default)]
struct Queue {
    quick: VecDeque<Job>,
    bulk: VecDeque<Job>,
    closed: bool,
    /// Read workers waiting for a job, and how many of them were woken and
    /// have not yet run: a quick job wakes a read worker that is not
    /// already on its way to another job, else a general worker (one
    /// wake-up per job, not two).
    idle_readers: usize,
    readers_woken: usize,
    /// General workers waiting for a job. One woken for a write may take
    /// a read queued meanwhile (quick first); it then passes the wake-up
    /// on, or the write would wait for that read to finish.
    idle_general: usize,
}

#[derive(Default)]
struct Shared {
    queue: Mutex<Queue>,
    /// Any job queued: general workers wait on this.
    job_ready: Condvar,
    /// A quick job queued: read workers wait on this.
    quick_ready: Condvar,
}

/// Which jobs a worker takes.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Role {
    General,
    Reads,
}

fn lock(shared: &Shared) -> MutexGuard<'_, Queue> {
    shared
        .queue
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// A fixed set of threads taking jobs from one queue.
pub(crate) struct WorkerPool {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
}

/// A cloneable handle that submits jobs to a [`WorkerPool`].
#[derive(Clone)]
pub(crate) struct PoolHandle {
    shared: Arc<Shared>,
}

impl WorkerPool {
    /// `thread_count` general workers and `read_threads` that serve only
    /// quick jobs.
    pub fn new(thread_count: usize, read_threads: usize) -> io::Result<Self> {
        assert!(thread_count > 0, "a pool needs at least one thread");
        let shared = Arc::new(Shared::default());
        let mut pool = WorkerPool {
            shared,
            threads: Vec::with_capacity(thread_count),
        };
        let roles = (0..thread_count)
            .map(|index| (Role::General, format!("nbd-worker-{index}")))
            .chain((0..read_threads).map(|index| (Role::Reads, format!("nbd-reader-{index}"))));
        for (role, name) in roles {
            let shared = Arc::clone(&pool.shared);
            let spawned = thread::Builder::new()
                .name(name)
                .spawn(move || work(&shared, role));
            match spawned {
                Ok(handle) => pool.threads.push(handle),
                Err(error) => {
                    pool.shut_down();
                    return Err(error);
                }
            }
        }
        Ok(pool)
    }

    pub fn handle(&self) -> PoolHandle {
        PoolHandle {
            shared: Arc::clone(&self.shared),
        }
    }

    /// Lets the workers finish the queued jobs, then joins them.
    pub fn shut_down(&mut self) {
        lock(&self.shared).closed = true;
        self.shared.job_ready.notify_all();
        self.shared.quick_ready.notify_all();
        for handle in self.threads.drain(..) {
            // Jobs never unwind out of work(), so a join error cannot happen;
            // if it somehow did there is nothing left to clean up.
            let _ = handle.join();
        }
    }
}

impl Drop for WorkerPool {
    fn drop(&mut self) {
        self.shut_down();
    }
}

impl Dispatch for PoolHandle {
    fn dispatch(&self, job: Job, lane: Lane) {
        let mut queue = lock(&self.shared);
        assert!(!queue.closed, "job submitted to a pool that was shut down");
        match lane {
            Lane::Quick => queue.quick.push_back(job),
            Lane::Bulk => queue.bulk.push_back(job),
        }
        let reader_waits = lane == Lane::Quick && queue.idle_readers > queue.readers_woken;
        if reader_waits {
            queue.readers_woken += 1;
        }
        drop(queue);
        if reader_waits {
            self.shared.quick_ready.notify_one();
        } else {
            self.shared.job_ready.notify_one();
        }
    }
}

fn work(shared: &Shared, role: Role) {
    let ready = match role {
        Role::General => &shared.job_ready,
        Role::Reads => &shared.quick_ready,
    };
    loop {
        let mut queue = lock(shared);
        let job = loop {
            let next = match role {
                Role::General => queue.quick.pop_front().or_else(|| queue.bulk.pop_front()),
                Role::Reads => queue.quick.pop_front(),
            };
            if let Some(job) = next {
                let unclaimed = !queue.bulk.is_empty() || queue.quick.len() > queue.readers_woken;
                if role == Role::General && unclaimed && queue.idle_general > 0 {
                    shared.job_ready.notify_one();
                }
                break job;
            }
            if queue.closed {
                return;
            }
            match role {
                Role::Reads => queue.idle_readers += 1,
                Role::General => queue.idle_general += 1,
            }
            queue = ready
                .wait(queue)
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            match role {
                Role::Reads => {
                    queue.idle_readers -= 1;
                    queue.readers_woken = queue.readers_woken.saturating_sub(1);
                }
                Role::General => queue.idle_general -= 1,
            }
        };
        drop(queue);
        if catch_unwind(AssertUnwindSafe(job)).is_err() {
            log::error!(target: "zdisk_nbd", "a worker job panicked; the worker carries on");
        }
    }
}

#[cfg(test)]
mod tests {
    //! Every submitted job runs once, on several threads at once, and
    //! shutdown drains the queue rather than dropping work.

    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Barrier;

    #[test]
    fn runs_every_job_concurrently_and_drains_on_shutdown() {
        let mut pool = WorkerPool::new(2, 1).unwrap();
        let handle = pool.handle();
        // Two jobs that can only finish together prove two threads run them.
        let barrier = Arc::new(Barrier::new(2));
        let done = Arc::new(AtomicUsize::new(0));
        for _ in 0..2 {
            let barrier = Arc::clone(&barrier);
            let done = Arc::clone(&done);
            handle.dispatch(
                Box::new(move || {
                    barrier.wait();
                    done.fetch_add(1, Ordering::SeqCst);
                }),
                Lane::Bulk,
            );
        }
        for _ in 0..100 {
            let done = Arc::clone(&done);
            handle.dispatch(
                Box::new(move || {
                    done.fetch_add(1, Ordering::SeqCst);
                }),
                Lane::Quick,
            );
        }
        handle.dispatch(Box::new(|| panic!("a job that panics")), Lane::Bulk);
        pool.shut_down();
        assert_eq!(done.load(Ordering::SeqCst), 102);
    }

    #[test]
    fn a_read_is_served_while_every_general_worker_is_busy() {
        let mut pool = WorkerPool::new(2, 1).unwrap();
        let handle = pool.handle();
        let (release, released) = std::sync::mpsc::channel::<()>();
        let released = Arc::new(Mutex::new(released));
        let started = Arc::new(Barrier::new(3));
        // Two writes that hold both general workers until the read is done,
        // and a third queued behind them.
        for index in 0..3 {
            let released = Arc::clone(&released);
            let started = Arc::clone(&started);
            handle.dispatch(
                Box::new(move || {
                    // The first two run at once, one on each general worker.
                    if index < 2 {
                        started.wait();
                    }
                    let _ = released.lock().unwrap().recv();
                }),
                Lane::Bulk,
            );
        }
        started.wait();
        let (served, read_done) = std::sync::mpsc::channel();
        handle.dispatch(
            Box::new(move || {
                let name = thread::current().name().map(String::from);
                served.send(name).unwrap();
            }),
            Lane::Quick,
        );
        let worker = read_done.recv().unwrap().unwrap_or_default();
        assert!(worker.starts_with("nbd-reader"), "served by {worker}");
        for _ in 0..3 {
            release.send(()).unwrap();
        }
        pool.shut_down();
    }

    /// A general worker woken for a write may take a read queued just
    /// after it (quick jobs first); the write must then wake another idle
    /// worker, not wait for the read to finish. Each read here waits for
    /// its write to start. A race, so tried many times.
    #[test]
    fn a_write_is_not_stranded_when_its_worker_takes_a_read() {
        let mut pool = WorkerPool::new(2, 1).unwrap();
        let handle = pool.handle();
        let (done, finished) = std::sync::mpsc::channel();
        for round in 0..2000 {
            let (started, write_started) = std::sync::mpsc::channel();
            handle.dispatch(Box::new(move || started.send(()).unwrap()), Lane::Bulk);
            let done = done.clone();
            handle.dispatch(
                Box::new(move || {
                    let waited = write_started.recv_timeout(std::time::Duration::from_secs(10));
                    done.send(waited.is_ok()).unwrap();
                }),
                Lane::Quick,
            );
            assert!(
                finished.recv().unwrap(),
                "round {round}: the write never started while the read waited for it"
            );
        }
        pool.shut_down();
    }
}
