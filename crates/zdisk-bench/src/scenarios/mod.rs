//! The benchmark scenarios, one file each. Each builds fresh drives, runs
//! workloads and returns a JSON object (with stable keys scripts can rely
//! on) plus rows for the printed table; `common.rs` holds what they share.

mod common;
mod dirty;
mod file_copy;
mod flush;
mod qd;
mod restart;
mod sparse_wal;
mod sweep;
mod threads;
mod wa;

pub use common::{Outcome, Settings};
pub use dirty::{dirty, DIRTY_SIBLINGS};
pub use file_copy::{file_copy, COPY_CHUNK_BYTES, COPY_SOURCE_MB_S};
pub use flush::flush;
pub use qd::queue_depths;
pub use restart::restart;
pub use sparse_wal::{layout_model_reduction, sparse_wal, COMMIT_SIZES, GROUP_COMMITS};
pub use sweep::sweep;
pub use threads::{default_thread_counts, threads};
pub use wa::{greedy_theory, write_amplification};
