//! The worker pool that executes requests for every connection.
//!
//! The engine compresses on the calling thread, so request execution, not
//! socket reading, is where the CPU goes; a fixed pool shared by all
//! connections lets one client at a deep queue keep every core busy while
//! capping the number of threads however many clients connect.
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

use crate::transmission::{Dispatch, Job};

#[derive(Default)]
struct Queue {
    jobs: VecDeque<Job>,
    closed: bool,
}

#[derive(Default)]
struct Shared {
    queue: Mutex<Queue>,
    job_ready: Condvar,
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
    pub fn new(thread_count: usize) -> io::Result<Self> {
        assert!(thread_count > 0, "a pool needs at least one thread");
        let shared = Arc::new(Shared::default());
        let mut pool = WorkerPool {
            shared,
            threads: Vec::with_capacity(thread_count),
        };
        for index in 0..thread_count {
            let shared = Arc::clone(&pool.shared);
            let spawned = thread::Builder::new()
                .name(format!("nbd-worker-{index}"))
                .spawn(move || work(&shared));
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
    fn dispatch(&self, job: Job) {
        let mut queue = lock(&self.shared);
        assert!(!queue.closed, "job submitted to a pool that was shut down");
        queue.jobs.push_back(job);
        drop(queue);
        self.shared.job_ready.notify_one();
    }
}

fn work(shared: &Shared) {
    loop {
        let mut queue = lock(shared);
        let job = loop {
            if let Some(job) = queue.jobs.pop_front() {
                break job;
            }
            if queue.closed {
                return;
            }
            queue = shared
                .job_ready
                .wait(queue)
                .unwrap_or_else(|poisoned| poisoned.into_inner());
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
        let mut pool = WorkerPool::new(2).unwrap();
        let handle = pool.handle();
        // Two jobs that can only finish together prove two threads run them.
        let barrier = Arc::new(Barrier::new(2));
        let done = Arc::new(AtomicUsize::new(0));
        for _ in 0..2 {
            let barrier = Arc::clone(&barrier);
            let done = Arc::clone(&done);
            handle.dispatch(Box::new(move || {
                barrier.wait();
                done.fetch_add(1, Ordering::SeqCst);
            }));
        }
        for _ in 0..100 {
            let done = Arc::clone(&done);
            handle.dispatch(Box::new(move || {
                done.fetch_add(1, Ordering::SeqCst);
            }));
        }
        handle.dispatch(Box::new(|| panic!("a job that panics")));
        pool.shut_down();
        assert_eq!(done.load(Ordering::SeqCst), 102);
    }
}
