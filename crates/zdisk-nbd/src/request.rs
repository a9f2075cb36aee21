//! Request checking: what a transmission-phase request means, and whether
//! the session allows it, before the device sees it.
//!
//! [`validate`] is pure (no I/O, no device calls), so every error rule of
//! the specification is unit-tested on its own below. A request it refuses
//! still gets exactly one error reply from the caller, and a refused
//! NBD_CMD_WRITE has its payload read and dropped first.

use std::sync::Arc;

use zdisk_core::BlockDevice;

use crate::wire::*;

/// The negotiated parameters a request is checked and executed against.
pub(crate) struct Session {
    pub device: Arc<dyn BlockDevice>,
    pub size_bytes: u64,
    pub read_only: bool,
    pub structured_replies: bool,
    pub base_allocation_id: Option<u32>,
    pub compression_id: Option<u32>,
    /// 512 if the client agreed to NBD_INFO_BLOCK_SIZE, else 1 (any byte).
    pub min_block_bytes: u64,
}

/// A request that passed [`validate`]; ranges are known to lie in the export.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Command {
    Read {
        offset: u64,
        length: u32,
    },
    Write {
        offset: u64,
        length: u32,
        fua: bool,
    },
    Flush,
    Trim {
        offset: u64,
        length: u32,
        fua: bool,
    },
    Cache {
        offset: u64,
        length: u32,
    },
    WriteZeroes {
        offset: u64,
        length: u32,
        may_punch: bool,
        fua: bool,
    },
    BlockStatus {
        offset: u64,
        length: u32,
        req_one: bool,
    },
    Disconnect,
}

impl Command {
    /// Bytes of buffer this command holds while in flight (payload or read data).
    pub fn buffer_bytes(&self) -> usize {
        match *self {
            Command::Read { length, .. } | Command::Write { length, .. } => length as usize,
            _ => 0,
        }
    }
}

impl std::fmt::Display for Command {
    /// The form used in log lines, e.g. `NBD_CMD_READ at 4096+512`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (name, range) = match *self {
            Command::Read { offset, length } => ("NBD_CMD_READ", Some((offset, length))),
            Command::Write { offset, length, .. } => ("NBD_CMD_WRITE", Some((offset, length))),
            Command::Flush => ("NBD_CMD_FLUSH", None),
            Command::Trim { offset, length, .. } => ("NBD_CMD_TRIM", Some((offset, length))),
            Command::Cache { offset, length } => ("NBD_CMD_CACHE", Some((offset, length))),
            Command::WriteZeroes { offset, length, .. } => {
                ("NBD_CMD_WRITE_ZEROES", Some((offset, length)))
            }
            Command::BlockStatus { offset, length, .. } => {
                ("NBD_CMD_BLOCK_STATUS", Some((offset, length)))
            }
            Command::Disconnect => ("NBD_CMD_DISC", None),
        };
        match range {
            Some((offset, length)) => write!(f, "{name} at {offset}+{length}"),
            None => write!(f, "{name}"),
        }
    }
}

/// Why a request was refused before reaching the device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Rejection {
    pub errno: u32,
    pub message: String,
}

fn reject(errno: u32, message: impl Into<String>) -> Rejection {
    Rejection {
        errno,
        message: message.into(),
    }
}

fn command_name(command: u16) -> &'static str {
    match command {
        NBD_CMD_READ => "NBD_CMD_READ",
        NBD_CMD_WRITE => "NBD_CMD_WRITE",
        NBD_CMD_DISC => "NBD_CMD_DISC",
        NBD_CMD_FLUSH => "NBD_CMD_FLUSH",
        NBD_CMD_TRIM => "NBD_CMD_TRIM",
        NBD_CMD_CACHE => "NBD_CMD_CACHE",
        NBD_CMD_WRITE_ZEROES => "NBD_CMD_WRITE_ZEROES",
        NBD_CMD_BLOCK_STATUS => "NBD_CMD_BLOCK_STATUS",
        _ => "unknown command",
    }
}

/// Checks a request against the protocol and the session, in this order:
/// command type, flags, flush fields, metadata context, read-only, payload
/// limit, zero-length block status, range, alignment. Pure, so the error
/// table can be unit-tested without sockets.
pub(crate) fn validate(header: &RequestHeader, session: &Session) -> Result<Command, Rejection> {
    let command = header.command;
    let name = command_name(command);
    // FUA is valid on every command (the specification says servers must
    // accept it, ignoring it where nothing is written).
    let allowed_flags = match command {
        NBD_CMD_DISC => return Ok(Command::Disconnect),
        NBD_CMD_READ if session.structured_replies => NBD_CMD_FLAG_FUA | NBD_CMD_FLAG_DF,
        NBD_CMD_READ | NBD_CMD_WRITE | NBD_CMD_FLUSH | NBD_CMD_TRIM | NBD_CMD_CACHE => {
            NBD_CMD_FLAG_FUA
        }
        NBD_CMD_WRITE_ZEROES => NBD_CMD_FLAG_FUA | NBD_CMD_FLAG_NO_HOLE | NBD_CMD_FLAG_FAST_ZERO,
        NBD_CMD_BLOCK_STATUS => NBD_CMD_FLAG_FUA | NBD_CMD_FLAG_REQ_ONE,
        _ => return Err(reject(NBD_EINVAL, format!("unknown command {command}"))),
    };
    let bad_flags = header.flags & !allowed_flags;
    if bad_flags != 0 {
        return Err(reject(
            NBD_EINVAL,
            format!("command flags {bad_flags:#x} are not valid for {name}"),
        ));
    }
    let fua = header.flags & NBD_CMD_FLAG_FUA != 0;
    let offset = header.offset;
    let length = header.length;

    if command == NBD_CMD_FLUSH {
        if offset != 0 || length != 0 {
            return Err(reject(
                NBD_EINVAL,
                "NBD_CMD_FLUSH must have zero offset and length",
            ));
        }
        return Ok(Command::Flush);
    }
    if command == NBD_CMD_BLOCK_STATUS
        && session.base_allocation_id.is_none()
        && session.compression_id.is_none()
    {
        return Err(reject(
            NBD_EINVAL,
            "NBD_CMD_BLOCK_STATUS without a metadata context selected",
        ));
    }
    let writes = matches!(command, NBD_CMD_WRITE | NBD_CMD_TRIM | NBD_CMD_WRITE_ZEROES);
    if writes && session.read_only {
        return Err(reject(NBD_EPERM, format!("{name} on a read-only export")));
    }
    if matches!(command, NBD_CMD_READ | NBD_CMD_WRITE) && length > MAX_PAYLOAD_BYTES {
        return Err(reject(
            NBD_EINVAL,
            format!(
                "{name} of {length} bytes exceeds the {MAX_PAYLOAD_BYTES}-byte maximum payload"
            ),
        ));
    }
    if command == NBD_CMD_BLOCK_STATUS && length == 0 {
        return Err(reject(NBD_EINVAL, "NBD_CMD_BLOCK_STATUS of zero length"));
    }
    let Some(end) = offset.checked_add(u64::from(length)) else {
        return Err(reject(
            NBD_EINVAL,
            format!("offset {offset} + length {length} overflows"),
        ));
    };
    if end > session.size_bytes {
        let errno = if matches!(command, NBD_CMD_WRITE | NBD_CMD_WRITE_ZEROES) {
            NBD_ENOSPC
        } else {
            NBD_EINVAL
        };
        return Err(reject(
            errno,
            format!(
                "{name} at offset {offset} + length {length} is past the end of the {}-byte export",
                session.size_bytes
            ),
        ));
    }
    let block = session.min_block_bytes;
    // A request that runs exactly to the end of an export whose size is not
    // a multiple of the block may have a short length; otherwise the last
    // bytes would be unreachable.
    if !offset.is_multiple_of(block)
        || (u64::from(length) % block != 0 && end != session.size_bytes)
    {
        return Err(reject(
            NBD_EINVAL,
            format!("{name} at offset {offset}, length {length} is not aligned to the agreed {block}-byte block size"),
        ));
    }

    Ok(match command {
        NBD_CMD_READ => Command::Read { offset, length },
        NBD_CMD_WRITE => Command::Write {
            offset,
            length,
            fua,
        },
        NBD_CMD_TRIM => Command::Trim {
            offset,
            length,
            fua,
        },
        NBD_CMD_CACHE => Command::Cache { offset, length },
        NBD_CMD_WRITE_ZEROES => Command::WriteZeroes {
            offset,
            length,
            // FAST_ZERO needs no special path: zeroing is metadata-only on
            // zdisk, so it is never slower than the equivalent write.
            may_punch: header.flags & NBD_CMD_FLAG_NO_HOLE == 0,
            fua,
        },
        NBD_CMD_BLOCK_STATUS => Command::BlockStatus {
            offset,
            length,
            req_one: header.flags & NBD_CMD_FLAG_REQ_ONE != 0,
        },
        _ => unreachable!("command {command} was checked above"),
    })
}

#[cfg(test)]
mod tests {
    //! The request validation table, without sockets: each error rule from
    //! the specification (and the project brief) is checked on its own, with
    //! a valid neighbour that must pass.

    use super::*;
    use crate::testing::RamDevice;

    const SIZE: u64 = 1 << 20;

    fn session(structured: bool, context: bool, aligned: bool, read_only: bool) -> Session {
        Session {
            device: Arc::new(RamDevice::new(SIZE)),
            size_bytes: SIZE,
            read_only,
            structured_replies: structured,
            base_allocation_id: context.then_some(BASE_ALLOCATION_ID),
            compression_id: None,
            min_block_bytes: if aligned { 512 } else { 1 },
        }
    }

    fn header(command: u16, flags: u16, offset: u64, length: u32) -> RequestHeader {
        RequestHeader {
            flags,
            command,
            cookie: 1,
            offset,
            length,
        }
    }

    fn errno(result: Result<Command, Rejection>) -> u32 {
        match result {
            Ok(command) => panic!("expected a rejection, got {command:?}"),
            Err(rejection) => rejection.errno,
        }
    }

    #[test]
    fn unknown_commands_and_flags_are_einval() {
        let s = session(true, true, true, false);
        assert_eq!(errno(validate(&header(9, 0, 0, 512), &s)), NBD_EINVAL);
        assert_eq!(
            errno(validate(&header(NBD_CMD_RESIZE, 0, 0, 0), &s)),
            NBD_EINVAL
        );
        assert_eq!(
            errno(validate(
                &header(NBD_CMD_WRITE, NBD_CMD_FLAG_NO_HOLE, 0, 512),
                &s
            )),
            NBD_EINVAL
        );
        assert_eq!(
            errno(validate(&header(NBD_CMD_READ, 1 << 15, 0, 512), &s)),
            NBD_EINVAL
        );
        // FUA is accepted everywhere, DF on structured reads only.
        for command in [
            NBD_CMD_READ,
            NBD_CMD_WRITE,
            NBD_CMD_TRIM,
            NBD_CMD_CACHE,
            NBD_CMD_WRITE_ZEROES,
            NBD_CMD_BLOCK_STATUS,
        ] {
            assert!(validate(&header(command, NBD_CMD_FLAG_FUA, 0, 512), &s).is_ok());
        }
        assert!(validate(&header(NBD_CMD_FLUSH, NBD_CMD_FLAG_FUA, 0, 0), &s).is_ok());
        assert!(validate(&header(NBD_CMD_READ, NBD_CMD_FLAG_DF, 0, 512), &s).is_ok());
        let simple = session(false, false, true, false);
        assert_eq!(
            errno(validate(
                &header(NBD_CMD_READ, NBD_CMD_FLAG_DF, 0, 512),
                &simple
            )),
            NBD_EINVAL
        );
    }

    #[test]
    fn ranges_past_the_end() {
        let s = session(true, true, false, false);
        assert_eq!(
            errno(validate(&header(NBD_CMD_READ, 0, SIZE - 1, 2), &s)),
            NBD_EINVAL
        );
        assert_eq!(
            errno(validate(&header(NBD_CMD_WRITE, 0, SIZE - 1, 2), &s)),
            NBD_ENOSPC
        );
        assert_eq!(
            errno(validate(&header(NBD_CMD_WRITE_ZEROES, 0, SIZE, 1), &s)),
            NBD_ENOSPC
        );
        assert_eq!(
            errno(validate(&header(NBD_CMD_TRIM, 0, SIZE, 1), &s)),
            NBD_EINVAL
        );
        assert_eq!(
            errno(validate(&header(NBD_CMD_CACHE, 0, SIZE, 1), &s)),
            NBD_EINVAL
        );
        assert_eq!(
            errno(validate(&header(NBD_CMD_BLOCK_STATUS, 0, SIZE, 1), &s)),
            NBD_EINVAL
        );
        assert_eq!(
            errno(validate(&header(NBD_CMD_WRITE, 0, u64::MAX, 1), &s)),
            NBD_EINVAL,
            "overflow is EINVAL even for writes"
        );
        assert!(validate(&header(NBD_CMD_READ, 0, SIZE - 1, 1), &s).is_ok());
        assert!(validate(&header(NBD_CMD_READ, 0, SIZE, 0), &s).is_ok());
    }

    #[test]
    fn lengths_and_special_fields() {
        let s = session(true, true, false, false);
        let too_big = MAX_PAYLOAD_BYTES + 1;
        let big = session_with_size(u64::from(too_big) * 2);
        assert_eq!(
            errno(validate(&header(NBD_CMD_READ, 0, 0, too_big), &big)),
            NBD_EINVAL
        );
        assert_eq!(
            errno(validate(&header(NBD_CMD_WRITE, 0, 0, too_big), &big)),
            NBD_EINVAL
        );
        assert!(validate(&header(NBD_CMD_TRIM, 0, 0, too_big), &big).is_ok());
        assert!(validate(&header(NBD_CMD_WRITE, 0, 0, MAX_PAYLOAD_BYTES), &big).is_ok());
        assert_eq!(
            errno(validate(&header(NBD_CMD_BLOCK_STATUS, 0, 0, 0), &s)),
            NBD_EINVAL
        );
        assert!(validate(&header(NBD_CMD_WRITE, 0, 0, 0), &s).is_ok());
        assert_eq!(
            errno(validate(&header(NBD_CMD_FLUSH, 0, 1, 0), &s)),
            NBD_EINVAL
        );
        assert_eq!(
            errno(validate(&header(NBD_CMD_FLUSH, 0, 0, 1), &s)),
            NBD_EINVAL
        );
        let no_context = session(true, false, false, false);
        assert_eq!(
            errno(validate(
                &header(NBD_CMD_BLOCK_STATUS, 0, 0, 512),
                &no_context
            )),
            NBD_EINVAL
        );
        assert_eq!(
            validate(&header(NBD_CMD_DISC, 0xffff, 7, 7), &s),
            Ok(Command::Disconnect)
        );
    }

    fn session_with_size(size_bytes: u64) -> Session {
        Session {
            size_bytes,
            ..session(true, true, false, false)
        }
    }

    #[test]
    fn alignment_only_when_agreed() {
        let aligned = session(true, true, true, false);
        let any = session(true, true, false, false);
        for (offset, length) in [(1, 512), (512, 1), (100, 100)] {
            for command in [
                NBD_CMD_READ,
                NBD_CMD_WRITE,
                NBD_CMD_TRIM,
                NBD_CMD_WRITE_ZEROES,
            ] {
                assert_eq!(
                    errno(validate(&header(command, 0, offset, length), &aligned)),
                    NBD_EINVAL
                );
                assert!(validate(&header(command, 0, offset, length), &any).is_ok());
            }
        }
        // The unaligned tail of an unaligned export stays reachable.
        let odd = Session {
            size_bytes: 1000,
            ..session(true, true, true, false)
        };
        assert!(validate(&header(NBD_CMD_READ, 0, 512, 488), &odd).is_ok());
        assert_eq!(
            errno(validate(&header(NBD_CMD_READ, 0, 0, 488), &odd)),
            NBD_EINVAL
        );
    }

    #[test]
    fn read_only_refuses_write_types_with_eperm() {
        let s = session(true, true, true, true);
        for command in [NBD_CMD_WRITE, NBD_CMD_TRIM, NBD_CMD_WRITE_ZEROES] {
            assert_eq!(errno(validate(&header(command, 0, 0, 512), &s)), NBD_EPERM);
        }
        for command in [NBD_CMD_READ, NBD_CMD_CACHE, NBD_CMD_BLOCK_STATUS] {
            assert!(validate(&header(command, 0, 0, 512), &s).is_ok());
        }
        assert!(validate(&header(NBD_CMD_FLUSH, 0, 0, 0), &s).is_ok());
    }

    #[test]
    fn write_zeroes_flags_map_to_device_arguments() {
        let s = session(true, true, true, false);
        let flags = NBD_CMD_FLAG_NO_HOLE | NBD_CMD_FLAG_FAST_ZERO | NBD_CMD_FLAG_FUA;
        assert_eq!(
            validate(&header(NBD_CMD_WRITE_ZEROES, flags, 512, 1024), &s),
            Ok(Command::WriteZeroes {
                offset: 512,
                length: 1024,
                may_punch: false,
                fua: true
            })
        );
    }
}
