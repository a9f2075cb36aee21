//! Replies: running a checked request on the device and encoding its
//! answer, and the one mapping from engine errors to NBD errno values.
//!
//! Every function here returns a complete reply buffer; sending it is the
//! connection's business (`transmission.rs`), so a reply is always written
//! whole or not at all.

use zdisk_core::{Error, ExtentState};

use crate::buffers::Buffers;
use crate::request::{Command, Session};
use crate::session::ConnLog;
use crate::wire::*;

/// The NBD error value for an engine error. This is the only place engine
/// errors meet protocol errno values.
pub(crate) fn errno_for(error: &Error) -> u32 {
    match error {
        Error::ReadOnly => NBD_EPERM,
        Error::OutOfRange { .. } | Error::InvalidArgument(_) => NBD_EINVAL,
        Error::NoSpace { .. } => NBD_ENOSPC,
        Error::ShutDown => NBD_ESHUTDOWN,
        // Io, ChecksumMismatch, DamagedBlock, and anything added later.
        _ => NBD_EIO,
    }
}

/// The base:allocation flags for an extent state.
pub(crate) fn allocation_flags(state: ExtentState) -> u32 {
    match state {
        ExtentState::Hole => NBD_STATE_HOLE | NBD_STATE_ZERO,
        ExtentState::Zero => NBD_STATE_ZERO,
        ExtentState::Data => 0,
    }
}

pub(crate) fn error_reply(session: &Session, cookie: u64, errno: u32, message: &str) -> Vec<u8> {
    let mut out = Vec::new();
    if session.structured_replies {
        put_chunk_error(&mut out, cookie, errno, message);
    } else {
        put_simple_reply(&mut out, errno, cookie);
    }
    out
}

fn ok_reply(cookie: u64) -> Vec<u8> {
    // A simple reply is allowed for any successful non-READ command, with or
    // without structured replies, and is the shortest.
    let mut out = Vec::with_capacity(SIMPLE_REPLY_BYTES);
    put_simple_reply(&mut out, 0, cookie);
    out
}

/// Runs a validated command on the device and returns the complete reply.
/// Device errors are logged here, with the request they failed.
pub(crate) fn execute(
    session: &Session,
    log: &ConnLog,
    buffers: &Buffers,
    cookie: u64,
    command: Command,
    payload: &[u8],
) -> Vec<u8> {
    let device = &*session.device;
    let result = match command {
        Command::Read { offset, length } => {
            return read_reply(session, log, buffers, cookie, offset, length)
        }
        Command::BlockStatus {
            offset,
            length,
            req_one,
        } => return block_status_reply(session, log, cookie, offset, length, req_one),
        Command::Disconnect => unreachable!("NBD_CMD_DISC is handled by the reader"),
        Command::Write { length: 0, .. }
        | Command::Trim { length: 0, .. }
        | Command::Cache { length: 0, .. }
        | Command::WriteZeroes { length: 0, .. } => Ok(()),
        Command::Write { offset, fua, .. } => device.write(offset, payload, fua),
        Command::Flush => device.flush(),
        Command::Trim {
            offset,
            length,
            fua,
        } => device.trim(offset, u64::from(length), fua),
        Command::Cache { offset, length } => device.cache(offset, u64::from(length)),
        Command::WriteZeroes {
            offset,
            length,
            may_punch,
            fua,
        } => device.write_zeroes(offset, u64::from(length), may_punch, fua),
    };
    match result {
        Ok(()) => ok_reply(cookie),
        Err(error) => device_error_reply(session, log, cookie, command, &error),
    }
}

fn device_error_reply(
    session: &Session,
    log: &ConnLog,
    cookie: u64,
    command: Command,
    error: &Error,
) -> Vec<u8> {
    log.line(format_args!("device error on {command}: {error}"));
    error_reply(session, cookie, errno_for(error), &error.to_string())
}

fn read_reply(
    session: &Session,
    log: &ConnLog,
    buffers: &Buffers,
    cookie: u64,
    offset: u64,
    length: u32,
) -> Vec<u8> {
    let header_bytes = if session.structured_replies {
        CHUNK_HEADER_BYTES + 8
    } else {
        SIMPLE_REPLY_BYTES
    };
    if length == 0 {
        let mut out = Vec::new();
        if session.structured_replies {
            // OFFSET_DATA must carry at least one byte.
            put_chunk_none(&mut out, cookie);
        } else {
            put_simple_reply(&mut out, 0, cookie);
        }
        return out;
    }
    // Header and data share one buffer so the reply is a single write.
    let mut header = Vec::with_capacity(header_bytes);
    if session.structured_replies {
        put_offset_data_header(&mut header, cookie, offset, length);
    } else {
        put_simple_reply(&mut header, 0, cookie);
    }
    debug_assert_eq!(header.len(), header_bytes);
    let mut out = buffers.take(header_bytes + length as usize);
    out[..header_bytes].copy_from_slice(&header);
    // The device fills all of it or fails (then the reply is replaced).
    match session.device.read(offset, &mut out[header_bytes..]) {
        Ok(()) => out,
        Err(error) => device_error_reply(
            session,
            log,
            cookie,
            Command::Read { offset, length },
            &error,
        ),
    }
}

fn block_status_reply(
    session: &Session,
    log: &ConnLog,
    cookie: u64,
    offset: u64,
    length: u32,
    req_one: bool,
) -> Vec<u8> {
    let command = Command::BlockStatus {
        offset,
        length,
        req_one,
    };
    let max_descriptors = if req_one { 1 } else { MAX_BLOCK_STATUS_EXTENTS };
    // One chunk per selected context, the last one marked done.
    let mut chunks: Vec<(u32, Vec<Descriptor>)> = Vec::new();
    if let Some(context_id) = session.base_allocation_id {
        let extents = match session
            .device
            .block_status(offset, u64::from(length), max_descriptors)
        {
            Ok(extents) => extents,
            Err(error) => return device_error_reply(session, log, cookie, command, &error),
        };
        let flags = extents
            .iter()
            .map(|e| (e.length_bytes, allocation_flags(e.state)));
        chunks.push((context_id, merge_extents(flags, length, max_descriptors)));
    }
    if let Some(context_id) = session.compression_id {
        let extents = match session
            .device
            .stored_status(offset, u64::from(length), max_descriptors)
        {
            Ok(extents) => extents,
            Err(error) => return device_error_reply(session, log, cookie, command, &error),
        };
        let flags = extents
            .iter()
            .map(|e| (e.length_bytes, compression_status(e.stored)));
        chunks.push((context_id, merge_extents(flags, length, max_descriptors)));
    }
    assert!(
        !chunks.is_empty(),
        "validate() refuses block status without a context"
    );
    let mut out = Vec::new();
    if chunks.iter().any(|(_, descriptors)| descriptors.is_empty()) {
        log.line(format_args!(
            "device error on {command}: the device described no extents"
        ));
        put_chunk_error(
            &mut out,
            cookie,
            NBD_EIO,
            "the device described no extents for this range",
        );
        return out;
    }
    let last = chunks.len() - 1;
    for (index, (context_id, descriptors)) in chunks.iter().enumerate() {
        put_block_status_chunk(&mut out, cookie, *context_id, descriptors, index == last);
    }
    out
}

/// Turns device extents (length, status flags) into wire descriptors: clipped so they cover at
/// most `length` bytes (which also makes every descriptor fit 32 bits and
/// keeps REQ_ONE replies within the request), zero-length runs dropped,
/// neighbours with equal flags merged, at most `max_descriptors` kept.
pub(crate) fn merge_extents(
    extents: impl Iterator<Item = (u64, u32)>,
    length: u32,
    max_descriptors: usize,
) -> Vec<Descriptor> {
    let mut remaining = u64::from(length);
    let mut descriptors: Vec<Descriptor> = Vec::new();
    for (extent_bytes, flags) in extents {
        let run_bytes = extent_bytes.min(remaining);
        if run_bytes == 0 {
            if remaining == 0 {
                break;
            }
            continue;
        }
        // run_bytes <= remaining <= length, a u32.
        let run_bytes = run_bytes as u32;
        let count = descriptors.len();
        match descriptors.last_mut() {
            Some(last) if last.flags == flags => last.length_bytes += run_bytes,
            _ if count == max_descriptors => break,
            _ => descriptors.push(Descriptor {
                length_bytes: run_bytes,
                flags,
            }),
        }
        remaining -= u64::from(run_bytes);
    }
    descriptors
}

#[cfg(test)]
mod tests {
    //! Errno mapping and extent merging.

    use super::*;
    use std::io;

    #[test]
    fn engine_errors_map_to_protocol_errnos() {
        assert_eq!(errno_for(&Error::ReadOnly), NBD_EPERM);
        assert_eq!(
            errno_for(&Error::OutOfRange {
                offset: 1,
                length: 2,
                size: 3
            }),
            NBD_EINVAL
        );
        assert_eq!(errno_for(&Error::InvalidArgument("x".into())), NBD_EINVAL);
        assert_eq!(
            errno_for(&Error::NoSpace {
                free_segments: 0,
                reserved_segments: 2
            }),
            NBD_ENOSPC
        );
        assert_eq!(errno_for(&Error::ShutDown), NBD_ESHUTDOWN);
        assert_eq!(
            errno_for(&Error::io("reading", io::Error::other("x"))),
            NBD_EIO
        );
        assert_eq!(
            errno_for(&Error::ChecksumMismatch {
                lba: 0,
                segment: 0,
                offset: 0,
                expected: 0,
                actual: 1
            }),
            NBD_EIO
        );
        assert_eq!(errno_for(&Error::CorruptImage("x".into())), NBD_EIO);
    }

    #[test]
    fn extents_are_clipped_merged_and_capped() {
        let hole = allocation_flags(ExtentState::Hole);
        let zero = allocation_flags(ExtentState::Zero);
        let data = allocation_flags(ExtentState::Data);
        let merged = merge_extents(
            [(100, hole), (50, hole), (10, zero), (5, data), (1000, data)].into_iter(),
            200,
            10,
        );
        assert_eq!(
            merged,
            vec![
                Descriptor {
                    length_bytes: 150,
                    flags: NBD_STATE_HOLE | NBD_STATE_ZERO
                },
                Descriptor {
                    length_bytes: 10,
                    flags: NBD_STATE_ZERO
                },
                Descriptor {
                    length_bytes: 40,
                    flags: 0
                },
            ]
        );
        // REQ_ONE: one descriptor, never longer than the request.
        let one = merge_extents([(1 << 40, data)].into_iter(), 4096, 1);
        assert_eq!(
            one,
            vec![Descriptor {
                length_bytes: 4096,
                flags: 0
            }]
        );
        let capped = merge_extents(
            [(1, hole), (1, data), (1, hole), (1, data)].into_iter(),
            4,
            2,
        );
        assert_eq!(capped.len(), 2);
        assert!(merge_extents([(0, data)].into_iter(), 4, 2).is_empty());
    }
}
