//! zdisk-nand: an emulated NAND flash drive with a timing model, so that
//! zdisk's engine (an FTL) runs as an emulated SSD — a SandForce SF-1200,
//! a ScaleFlux CSD 2000, a plain TLC drive, FEMU's default — either in
//! real time (served over NBD, clients see the drive's speed) or in
//! virtual time (benchmarks finish in seconds and give identical figures
//! on any host).
//!
//! [`NandMedia`] implements [`zdisk_core::media::Media`]. A [`Profile`]
//! describes the drive (named ones: [`profile_names`]); [`NandParams`]
//! adds the per-image configuration and has a byte encoding for the
//! superblock's `media_params`. docs/emulation.md gives every figure's
//! source and compares the emulated drives with published measurements.
//!
//! # Mapping
//!
//! The array has `channels × dies_per_channel × planes_per_die` planes
//! ("units"), each with `blocks_per_plane` erase blocks of
//! `pages_per_block` pages. A zdisk segment is a superblock: block `b` of
//! every plane, so there are `blocks_per_plane` segments of
//! `units × pages_per_block` pages. Segment page `p` lives on unit
//! `u = p % units`, page `p / units` of that unit's block `b`; unit `u` is
//! channel `u % C`, die `(u / C) % D`, plane `u / (C·D)`. Consecutive
//! pages of a sequential write therefore go to different channels first,
//! then different dies, then planes.
//!
//! Flash rules are checked per block, and the segment's pages in order as
//! a whole; breaking one is an engine bug and panics with a message naming
//! the page: a block is erased before it is programmed, its pages are
//! programmed in order, each once. A new drive's blocks are erased (reads
//! know it) but, as the `Media` contract says, the engine must still erase
//! a segment before writing it. After an image is reopened every block
//! must be erased again before it is programmed (write pointers are not
//! persisted), as `FileMedia` also demands.
//!
//! The two metadata slots are not in the NAND array: they stand for the
//! controller's own NOR/firmware area. Writing one costs no array time,
//! but a `sync` waits one program time after it (without PLP).
//!
//! # Timing model
//!
//! Each plane keeps a busy-until time: its reads, programs and erases run
//! in the order they are issued. The shared transfer resources — each
//! channel bus, the controller's command processor, the host link and the
//! compression engine — keep a calendar of booked intervals instead: a
//! transfer takes the earliest idle gap long enough, at or after the
//! moment its data is ready, so a die whose page is ready does not queue
//! behind a transfer booked for later (a controller serves whichever die
//! is ready). Bookings that end before the oldest operation still in
//! progress are forgotten.
//!
//! - **Program** (`write_pages`), per page, once admitted to the write
//!   buffer at time `a`: the channel carries the page from
//!   `max(a, channel free)` for `page_size / channel_rate`; the plane
//!   programs from `max(transfer end, plane free)` for `t_prog`.
//! - **Write buffer admission**: the controller buffers
//!   `write_buffer_pages` pages. A page occupies the buffer from its
//!   admission until its program completes. When the buffer is full, the
//!   next page is admitted when the earliest outstanding program finishes.
//!   `write_pages` returns once its last page is admitted; the programs
//!   themselves proceed in the background. With a buffer of 0 pages
//!   (FEMU's model) `write_pages` returns when its programs complete.
//! - **Read**, per page touched (`read_batch` issues every range of a
//!   batch at the same time, as a controller dispatches a command's page
//!   reads to all dies at once; the batch completes with its slowest
//!   page): a page still in the write buffer (its
//!   program not finished) or staged under PLP is served from controller
//!   RAM at no cost, and so is a page the controller's block table knows
//!   is erased (not programmed since its block's erase, or on a drive
//!   created in this run) — like an FTL answering an unmapped LBA.
//!   Otherwise the plane reads from `max(t, plane free)` for `t_read`,
//!   then the channel carries the *requested bytes* of that page (a
//!   column read, not the whole page). The read returns when its last
//!   transfer ends. After an image is reopened, blocks not yet erased in
//!   this run are unknown, so reading them costs array reads.
//! - **Erase** of a segment: every plane erases its block in parallel for
//!   `t_erase`, after whatever it was doing. The caller does not wait;
//!   programs of the fresh segment queue behind the erase.
//! - **Host transfer** (`host_transfer(dir, bytes)`, once per host
//!   command): the controller spends `command_overhead` (serialised over
//!   all commands), then the link carries `bytes`. For writes on a drive
//!   with a compressor, the compressor streams alongside the link: it
//!   starts with the link transfer (or when it is free) and finishes no
//!   earlier than the link, after `bytes / compress_rate`. The command
//!   continues when the last of these ends.
//! - **Sync**: waits until every program, erase and metadata write issued
//!   so far has finished. With power-loss protection the buffer is
//!   non-volatile and `sync` returns at once.
//! - **PLP staging** (`stage_partial_page`): the partial page goes to the
//!   protected buffer — no program, no array time, not counted as a NAND
//!   write. Reads of it return the staged bytes (0xFF beyond them) until
//!   `write_pages` programs the page; erasing the segment drops it.
//! - **Recycling cap** (SandForce's lazy recycling): `segment_recycled`
//!   occupies the recycling engine for `segment_bytes / cap` — a whole
//!   segment's worth whether or not it held live data — starting when the
//!   engine is free, and *the calling operation waits until it is done*.
//!   `recycling_ready()` is false while the engine is busy. So background
//!   cleaning (which checks `recycling_ready` first) runs at most at the
//!   cap, and a host write that has to clean in the foreground is
//!   throttled to the cap, which is how a drive with no free blocks left
//!   falls to its recycling rate.
//!
//! Approximations, deliberately: the planes of a die are independent (a
//! multi-plane program is modelled as concurrent single-plane programs,
//! without the same-page-address restriction); a plane's page register
//! queues without limit (the write buffer bounds what is in flight);
//! dies on a channel share only the bus; no program/erase suspend (a read
//! waits behind a queued program on its plane); no ECC, read retry or
//! die-level power limits; TLC programs cost one `t_prog` per page.
//!
//! # Timing
//!
//! - [`Timing::Real`](zdisk_core::clock::Timing::Real): each call computes its completion from the monotonic
//!   clock and sleeps until then, outside the model lock; many threads may
//!   call at once (NBD workers). The host file's own `fdatasync` overlaps
//!   the modelled sync wait. Sleeping adds the host's wake-up latency
//!   (a few microseconds; the caller thread's timer slack is set to 1 us).
//! - [`Timing::Virtual`](zdisk_core::clock::Timing::Virtual): nothing sleeps. A single-threaded harness
//!   brackets each host operation: `begin_op(issue_ns)`, calls into the
//!   engine, `end_op()` returns the completion. Inside, every call starts
//!   at the operation's cursor and moves it to when the operation may
//!   continue. Calls outside an operation (opening the volume, background
//!   cleaning between operations) start at the time given to
//!   [`NandMedia::set_time`] and occupy resources without waiting.
//!   Operations should be issued in non-decreasing issue time; several may
//!   overlap (a queue depth above one) because each only takes resources
//!   from their busy-until times.
//!
//! # Counters and calibration
//!
//! [`NandMedia::stats`] returns [`NandStats`]: pages programmed and read,
//! reads served from buffers or known-erased pages, blocks erased,
//! staged pages and bytes, erase-count minimum, maximum and mean, and the
//! busy time of every resource and the time callers waited on each.
//! `zdisk bench --profile NAME` measures what the real engine achieves on
//! a profile in virtual time; docs/emulation.md compares those figures
//! with the published ones.
//!
//! # Storage
//!
//! Pages live in RAM (sparse: a segment's memory is taken when it is
//! first programmed and freed by its erase) or in a sparse image file
//! (layout in `store.rs`: header with magic "ZDISKNAND" and the encoded
//! parameters, the metadata slots, per-block erase counts, one staging
//! slot per segment, then the pages, stored complemented so that holes
//! read as erased flash). Never-programmed and erased pages read 0xFF.

mod media;
mod model;
mod profile;
mod store;

pub use media::NandMedia;
pub use model::{NandStats, PageAddress};
pub use profile::{
    profile, profile_names, Bandwidth, CellType, NandConfig, NandParams, Profile,
    META_SLOT_SIZE_BYTES, MIN_BLOCKS_PER_PLANE,
};
pub use store::{is_nand_image, IMAGE_MAGIC, IMAGE_VERSION};
