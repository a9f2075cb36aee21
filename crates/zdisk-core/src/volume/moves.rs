//! What the cleaner does with each live record of a victim.
//!
//! A record holds one block (data) or several (a unit). The cleaner reads a
//! victim's live records outside the state lock and plans, record by
//! record ([`plan_record`]), one of:
//! - **copy** it unchanged (same bytes, same versions, so a copy can never
//!   pass for a newer write), when every block in it is live;
//! - **rewrite** the live blocks of a unit some of whose blocks are dead:
//!   they are decompressed and stored again, each at its own version
//!   (equal versions still mean equal data), as smaller units or single
//!   blocks. A dead block must never travel in a new record: if it died by
//!   a trim, a checkpoint since may know it only as a hole without a
//!   version, and replaying the copy after a crash would bring it back;
//! - **mark damaged** the blocks of a record that fails verification.
//!
//! The cold-data pass plans a victim differently (`cold.rs`, `plan_recompress`):
//! every live block is decompressed, and runs of consecutive blocks, from
//! whichever records they came, are compressed again with the cold codec
//! in units of up to 32 KiB, each block keeping its
//! version; units that pass wrote before are copied as they are.
//!
//! Planning, including any compression, happens outside the lock;
//! [`apply`] then carries the plan out under it. A block that died
//! between the two (a host write or trim meanwhile) makes the plan for its
//! record stale: that record is rewritten again, under the lock, from the
//! blocks still live.

use crate::codec::{compress_whole_blocks, decompress_exact, Codec, CodecId, Effort, RunPiece};
use crate::error::Result;
use crate::map::{kept_apart, key_block, table_key, Location, Slot, TABLE_BASE};
use crate::record::{decode_record, decode_unit, RecordHeader, RecordKey, RecordKind};
use crate::units::{Lba, BLOCK_SIZE};

use super::state::State;

/// A live member of a victim: the key of the entry naming it (its block,
/// or its cell if it is shared), where its record is, its version.
pub(crate) type LiveExtent = (Lba, Location, u64);

/// Consecutive blocks of one record, stored again as a new record.
#[derive(Debug)]
pub(crate) struct Rewritten {
    pub first: Lba,
    pub codec: CodecId,
    /// The compressed (or raw) blocks, without a unit prefix.
    pub data: Vec<u8>,
    pub versions: Vec<u64>,
    /// Where each block lived.
    pub sources: Vec<Location>,
    /// The blocks uncompressed, to rewrite again if some die before the
    /// plan is carried out.
    pub raw: Vec<u8>,
    /// Written by the cold-data pass.
    pub cold: bool,
}

/// What to do with one live record.
#[derive(Debug)]
pub(crate) enum Move {
    Copy {
        from: Location,
        header: RecordHeader,
        payload: Vec<u8>,
        codec: Codec,
    },
    Rewrite(Vec<Rewritten>, Codec),
    /// These blocks' record cannot be read back intact.
    Damaged(Vec<(Lba, Location)>),
}

/// Groups live extents by the record they live in, in record order.
pub(crate) fn by_record(mut live: Vec<LiveExtent>) -> Vec<Vec<LiveExtent>> {
    live.sort_by_key(|&(lba, loc, _)| (loc.record_key(), lba));
    let mut groups: Vec<Vec<LiveExtent>> = Vec::new();
    for extent in live {
        match groups.last_mut() {
            Some(group) if group[0].1.record_key() == extent.1.record_key() => group.push(extent),
            _ => groups.push(vec![extent]),
        }
    }
    groups
}

/// Plans what to do with the record `bytes` (as read from where `live`,
/// its live blocks, say it is; `None` if it could not be read), of
/// segment incarnation `seq32`. Rewrites compress with `codec`.
pub(crate) fn plan_record(
    key: &RecordKey,
    seq32: u32,
    bytes: Option<&[u8]>,
    live: &[LiveExtent],
    codec: Codec,
) -> Move {
    debug_assert!(!live.is_empty(), "a record with no live block");
    let damaged = || Move::Damaged(live.iter().map(|&(lba, loc, _)| (lba, loc)).collect());
    let Some((header, payload)) = bytes.and_then(|b| decode_record(b, key, Some(seq32)).ok())
    else {
        return damaged();
    };
    let from = live[0].1;
    let copy = || Move::Copy {
        from,
        header,
        payload: payload.to_vec(),
        codec,
    };
    // A member a snapshot keeps is never copied unchanged: the copy would
    // name the volume's (or clone's) block, and a replay that no longer
    // finds the kept entry (its snapshot deleted meanwhile) could take it
    // for a write of that block after a trim whose version the checkpoint
    // forgot. It is rewritten naming its key in the snapshot's space
    // instead. A member in the key space the record names is its own.
    let kept = any_kept(&header, live);
    match header.kind {
        RecordKind::Data => {
            let (key, _, version) = live[0];
            if live.len() != 1 || !names_member(key, &header, 0, version) {
                return damaged();
            }
            if !kept {
                return copy();
            }
            match decompress_unit(&header, payload, 1) {
                Some(block) => Move::Rewrite(
                    rewrite_live(&block, &[header.version], live, codec, false),
                    codec,
                ),
                None => damaged(),
            }
        }
        RecordKind::Unit => {
            let Ok(unit) = decode_unit(&header, payload) else {
                return damaged();
            };
            let matches = live.iter().all(|&(key, loc, version)| {
                let member = loc.member as usize;
                loc.members as usize == unit.count()
                    && unit.versions[member] == version
                    && names_member(key, &header, member, version)
            });
            if !matches {
                return damaged();
            }
            if live.len() == unit.count() && !kept {
                return copy();
            }
            match decompress_unit(&header, unit.data, unit.count()) {
                Some(blocks) => Move::Rewrite(
                    rewrite_live(&blocks, &unit.versions, live, codec, false),
                    codec,
                ),
                None => damaged(),
            }
        }
        _ => damaged(),
    }
}

/// True if a snapshot keeps one of `live`, members of the record
/// `header`: its entry is in another key space than the one the record
/// names (a member in that space is its own; a cell is no kept entry).
fn any_kept(header: &RecordHeader, live: &[LiveExtent]) -> bool {
    live.iter()
        .any(|&(key, _, _)| kept_apart(header.lba, key.0))
}

/// True if the entry at `key` may name member `member` (at `version`) of
/// the record `header`: the member's own block, or its cell.
fn names_member(key: Lba, header: &RecordHeader, member: usize, version: u64) -> bool {
    if key == table_key(version) || key.0.checked_sub(header.lba) == Some(member as u64) {
        return true;
    }
    // An entry a snapshot keeps names its block in its own key space; the
    // record names it in the volume's, or in the space it was kept in
    // when the cleaner rewrote it.
    key.0 < TABLE_BASE
        && header.lba < TABLE_BASE
        && key_block(key.0).checked_sub(key_block(header.lba)) == Some(member as u64)
}

/// The cells of the members of the data or unit record `header`, were
/// they shared (none for a record that names cells itself): the map
/// ranges moving it touches besides its blocks.
pub(crate) fn member_cells(header: &RecordHeader, payload: &[u8]) -> Vec<(Lba, u64)> {
    if header.lba >= TABLE_BASE {
        return Vec::new();
    }
    match header.kind {
        RecordKind::Data => vec![(table_key(header.version), 1)],
        RecordKind::Unit => decode_unit(header, payload)
            .map(|unit| unit.versions.iter().map(|&v| (table_key(v), 1)).collect())
            .unwrap_or_default(),
        _ => Vec::new(),
    }
}

/// A planned rewrite back into its blocks, each with its extent.
pub(super) fn split_raw(record: &Rewritten) -> Vec<(LiveExtent, Vec<u8>)> {
    (0..record.versions.len())
        .map(|i| {
            let extent = (
                Lba(record.first.0 + i as u64),
                record.sources[i],
                record.versions[i],
            );
            (
                extent,
                record.raw[i * BLOCK_SIZE..(i + 1) * BLOCK_SIZE].to_vec(),
            )
        })
        .collect()
}

/// A unit's blocks, decompressed; `None` if they do not decompress.
pub(super) fn decompress_unit(header: &RecordHeader, data: &[u8], count: usize) -> Option<Vec<u8>> {
    let id = header.codec_id()?;
    let mut blocks = vec![0u8; count * BLOCK_SIZE];
    decompress_exact(id, data, &mut blocks).ok()?;
    Some(blocks)
}

/// The members `live` of a unit (decompressed as `blocks`, at
/// `versions`), in runs of consecutive keys, each compressed again: runs
/// of blocks, and runs of cells (consecutive versions), which the new
/// record names as its blocks.
fn rewrite_live(
    blocks: &[u8],
    versions: &[u64],
    live: &[LiveExtent],
    codec: Codec,
    cold: bool,
) -> Vec<Rewritten> {
    let mut sorted = live.to_vec();
    sorted.sort_by_key(|&(key, _, _)| key.0);
    let mut out = Vec::new();
    for run in consecutive_runs(&sorted) {
        let mut bytes = Vec::with_capacity(run.len() * BLOCK_SIZE);
        for &(_, loc, _) in run {
            let member = loc.member as usize;
            bytes.extend_from_slice(&blocks[member * BLOCK_SIZE..(member + 1) * BLOCK_SIZE]);
        }
        let run_versions: Vec<u64> = run
            .iter()
            .map(|&(_, loc, _)| versions[loc.member as usize])
            .collect();
        out.extend(compress_run(&bytes, run, &run_versions, codec, cold));
    }
    out
}

/// Splits `extents` (sorted by key) into runs of consecutive keys.
fn consecutive_runs(extents: &[LiveExtent]) -> Vec<&[LiveExtent]> {
    let mut runs = Vec::new();
    let mut start = 0;
    for end in 1..=extents.len() {
        if end == extents.len() || extents[end].0 .0 != extents[end - 1].0 .0 + 1 {
            runs.push(&extents[start..end]);
            start = end;
        }
    }
    runs
}

/// Compresses a run of consecutive blocks `bytes` (their extents `run`, at
/// `versions`) into one unit, or, if it does not compress, into one record
/// per block.
pub(crate) fn compress_run(
    bytes: &[u8],
    run: &[LiveExtent],
    versions: &[u64],
    codec: Codec,
    cold: bool,
) -> Vec<Rewritten> {
    debug_assert_eq!(bytes.len(), run.len() * BLOCK_SIZE);
    let mut rewritten = Vec::new();
    let mut scratch = Vec::new();
    compress_whole_blocks(
        codec,
        Effort::Full,
        bytes,
        &mut scratch,
        |piece| match piece {
            RunPiece::Unit { codec: id, data } => rewritten.push(Rewritten {
                first: run[0].0,
                codec: id,
                data: data.to_vec(),
                versions: versions.to_vec(),
                sources: run.iter().map(|&(_, loc, _)| loc).collect(),
                raw: bytes.to_vec(),
                cold,
            }),
            RunPiece::Block {
                index,
                codec: id,
                data,
            } => rewritten.push(Rewritten {
                first: run[index].0,
                codec: id,
                data: data.to_vec(),
                versions: vec![versions[index]],
                sources: vec![run[index].1],
                raw: bytes[index * BLOCK_SIZE..(index + 1) * BLOCK_SIZE].to_vec(),
                cold,
            }),
        },
    );
    rewritten
}

/// Carries out `moves` under the state lock. Returns the blocks moved.
/// The blocks `moves` change, whose map leaves must be in RAM first.
pub(crate) fn moves_ranges(moves: &[Move]) -> Vec<(Lba, u64)> {
    let mut ranges = Vec::new();
    for planned in moves {
        match planned {
            Move::Copy {
                header, payload, ..
            } => {
                let blocks = match header.kind {
                    RecordKind::Unit => payload.first().copied().unwrap_or(1) as u64,
                    _ => 1,
                };
                ranges.push((Lba(header.lba), blocks.max(1)));
                ranges.extend(member_cells(header, payload));
            }
            Move::Rewrite(records, _) => {
                ranges.extend(
                    records
                        .iter()
                        .map(|r| (r.first, r.versions.len().max(1) as u64)),
                );
            }
            Move::Damaged(blocks) => ranges.extend(blocks.iter().map(|&(lba, _)| (lba, 1))),
        }
    }
    ranges
}

pub(crate) fn apply(state: &mut State, moves: Vec<Move>) -> Result<u64> {
    let mut moved = 0;
    for plan in moves {
        match plan {
            Move::Copy {
                from,
                header,
                payload,
                codec,
            } => {
                if state.relocate(from, header, &payload)? {
                    moved += super::state::record_versions(&header, &payload).len() as u64;
                } else if let Some((versions, blocks)) = members(&header, &payload) {
                    // Some of its blocks died since the plan, or a snapshot
                    // taken since keeps one (`State::relocate` copies no
                    // kept member): what is still live goes as a rewrite.
                    let keys = state.member_keys(header.lba, &versions)?;
                    let still = still_live(state, &keys, &versions, |member| {
                        from.with_member_of(member as u8, versions.len() as u8)
                    });
                    if !still.is_empty() {
                        let records = rewrite_live(&blocks, &versions, &still, codec, false);
                        moved += apply_rewrites(state, records, codec)?;
                    }
                }
            }
            Move::Rewrite(records, codec) => moved += apply_rewrites(state, records, codec)?,
            Move::Damaged(blocks) => {
                for (lba, loc) in blocks {
                    state.load_map(lba, 1)?;
                    if state.map().get(lba).slot() == Slot::Data(loc) {
                        state.mark_damaged(lba)?;
                    }
                }
            }
        }
    }
    Ok(moved)
}

/// The versions and decompressed blocks of the data or unit record
/// `header` (which passed its checksum), or `None` if it does not
/// decompress.
fn members(header: &RecordHeader, payload: &[u8]) -> Option<(Vec<u64>, Vec<u8>)> {
    match header.kind {
        RecordKind::Data => Some((vec![header.version], decompress_unit(header, payload, 1)?)),
        RecordKind::Unit => {
            let unit =
                decode_unit(header, payload).expect("a unit that passed its checksum decodes");
            let blocks = decompress_unit(header, unit.data, unit.count())?;
            Some((unit.versions, blocks))
        }
        _ => None,
    }
}

/// Appends planned rewrites; one whose blocks did not all stay live is
/// compressed again from what did.
fn apply_rewrites(state: &mut State, records: Vec<Rewritten>, codec: Codec) -> Result<u64> {
    let mut moved = 0;
    for record in records {
        let appended = state.relocate_rewritten(
            record.first,
            record.codec as u8,
            &record.data,
            &record.versions,
            &record.sources,
            record.cold,
        )?;
        if appended {
            moved += record.versions.len() as u64;
            continue;
        }
        // Its keys are consecutive (blocks, or cells), unless a snapshot's
        // kept entry moved since.
        let keys = state.rewritten_keys(record.first, &record.versions);
        let still = still_live(state, &keys, &record.versions, |i| record.sources[i]);
        if still.is_empty() {
            continue;
        }
        // `raw` holds the record's blocks in order: as member i of a unit.
        let as_members: Vec<LiveExtent> = still
            .iter()
            .map(|&(key, loc, version)| {
                let i = keys
                    .iter()
                    .position(|&k| k == key)
                    .expect("a key of the record") as u8;
                (
                    key,
                    loc.with_member_of(i, record.versions.len() as u8),
                    version,
                )
            })
            .collect();
        let again = rewrite_live(
            &record.raw,
            &record.versions,
            &as_members,
            codec,
            record.cold,
        );
        for redo in again {
            let ok = state.relocate_rewritten(
                redo.first,
                redo.codec as u8,
                &redo.data,
                &redo.versions,
                &redo.sources,
                redo.cold,
            )?;
            debug_assert!(ok, "blocks checked live under this very lock");
            moved += redo.versions.len() as u64;
        }
    }
    Ok(moved)
}

/// The members whose entries (at `keys[i]`) still name `source(i)` at
/// `versions[i]`.
fn still_live(
    state: &State,
    keys: &[Lba],
    versions: &[u64],
    source: impl Fn(usize) -> Location,
) -> Vec<LiveExtent> {
    (0..versions.len())
        .filter_map(|i| {
            let entry = state.map().get(keys[i]);
            (entry.slot() == Slot::Data(source(i)) && entry.version() == versions[i]).then_some((
                keys[i],
                source(i),
                versions[i],
            ))
        })
        .collect()
}
