//! Cloning blocks by reference: the destination shares the source's
//! stored contents, and nothing is compressed or written again but a
//! reference record (issue #25; docs/sharing.md).
//!
//! This is how deduplication stores a duplicate, and it is exposed as
//! [`Volume::clone_blocks`] (a copy offload, like a reflink) so that the
//! crash simulator, the fuzzers and the tests drive sharing, overwrites,
//! trims and cleaning of shared data directly.

use crate::error::{Error, Result};
use crate::map::{table_key, Slot};
use crate::record::{record_len_for_payload, RecordKind, RefMember, REF_MEMBERS_MAX};
use crate::units::{Lba, BLOCK_SIZE_U64};

use super::io::RANGE_RECORD_LEN;
use super::space::{Need, Reach, Writer};
use super::state::StreamKind;
use super::Volume;

/// What one source block gives its destination.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Cloned {
    /// Its stored content, by reference.
    Shared(RefMember),
    /// A state a range record sets.
    Range(RecordKind),
}

impl Volume {
    /// Makes blocks `dest..dest+count` hold what `source..source+count`
    /// hold, sharing their stored records: written data is referenced,
    /// not copied (a reference record per run of up to 256 blocks); holes,
    /// zeros and damaged blocks are copied as such. The two ranges must
    /// not overlap. Durable after the next flush, like a write.
    pub fn clone_blocks(&self, source: Lba, dest: Lba, count: u64) -> Result<()> {
        for first in [source, dest] {
            let bytes = |blocks: u64| blocks.saturating_mul(BLOCK_SIZE_U64);
            self.check_access(bytes(first.0), bytes(count), true)?;
        }
        self.note_host_io(true);
        if source.0 < dest.0 + count && dest.0 < source.0 + count {
            return Err(Error::InvalidArgument(format!(
                "cloning {count} blocks from block {source} to block {dest}: the ranges overlap"
            )));
        }
        let mut done = 0;
        while done < count {
            let n = (count - done).min(REF_MEMBERS_MAX as u64);
            self.clone_run(Lba(source.0 + done), Lba(dest.0 + done), n)?;
            done += n;
        }
        Ok(())
    }

    /// [`Volume::clone_blocks`] of at most `REF_MEMBERS_MAX` blocks, under
    /// one hold of the lock.
    fn clone_run(&self, source: Lba, dest: Lba, count: u64) -> Result<()> {
        let ref_bytes = record_len_for_payload(4 + 16 * count as usize);
        let bytes = ref_bytes + RANGE_RECORD_LEN * count;
        // The source blocks' and the destination's leaves in RAM, and the
        // cells the source's contents take once shared: read without the
        // lock, until the source holds still.
        let mut ranges = vec![(source, count), (dest, count)];
        let (mut state, floor) = loop {
            let (state, floor) = self.make_room_resident(Reach::All, &ranges, |state| Need {
                writer: Writer::Host { blocks: count },
                segments: state.segments_needed(StreamKind::Host, bytes),
                versions: count,
                bytes,
            })?;
            let mut cells = Vec::new();
            state.map().for_each_in(source, count, |_, entry| {
                if let Slot::Data(_) = entry.slot() {
                    let cell = table_key(entry.version());
                    if !state.map().is_resident(cell, 1) {
                        cells.push((cell, 1));
                    }
                }
            });
            if cells.is_empty() {
                break (state, floor);
            }
            drop(state);
            ranges.extend(cells);
        };
        let cloned: Vec<Cloned> = (0..count)
            .map(|i| {
                let lba = Lba(source.0 + i);
                match state.content_of(lba) {
                    Some(member) => Cloned::Shared(member),
                    None => Cloned::Range(match state.map().get(lba).slot() {
                        Slot::Zero => RecordKind::Zero,
                        Slot::Hole => RecordKind::Trim,
                        _ => RecordKind::Damaged,
                    }),
                }
            })
            .collect();
        // Runs of alike blocks: one record each.
        let mut start = 0;
        while start < cloned.len() {
            let mut end = start + 1;
            let same = |a: &Cloned, b: &Cloned| match (a, b) {
                (Cloned::Shared(_), Cloned::Shared(_)) => true,
                (Cloned::Range(a), Cloned::Range(b)) => a == b,
                _ => false,
            };
            while end < cloned.len() && same(&cloned[start], &cloned[end]) {
                end += 1;
            }
            let first = Lba(dest.0 + start as u64);
            match cloned[start] {
                Cloned::Shared(_) => {
                    let members: Vec<RefMember> = cloned[start..end]
                        .iter()
                        .map(|c| match c {
                            Cloned::Shared(member) => *member,
                            Cloned::Range(_) => unreachable!("a run of shared blocks"),
                        })
                        .collect();
                    state.apply_ref(first, &members, floor)?;
                }
                Cloned::Range(kind) => {
                    state.apply_range(kind, first, (end - start) as u64, floor)?;
                }
            }
            start = end;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    //! Cloning by reference against a byte model: the destination reads
    //! as the source did, nothing is stored twice, references go with
    //! overwrites and trims, the cleaner moves shared records without
    //! un-sharing them, and all of it survives a restart and a crash.

    use std::sync::Arc;

    use rand::rngs::SmallRng;
    use rand::{Rng, SeedableRng};

    use crate::device::BlockDevice;
    use crate::map::{table_key, Slot};
    use crate::media::{CrashConfig, Media, MemMedia};
    use crate::units::{Lba, BLOCK_SIZE, BLOCK_SIZE_U64};
    use crate::{CreateOptions, Error, OpenOptions, Volume};

    const BLOCKS: u64 = 512;

    fn options(map_cache_bytes: Option<u64>) -> OpenOptions {
        OpenOptions {
            background: false,
            map_cache_bytes,
            ..OpenOptions::default()
        }
    }

    fn volume(map_cache_bytes: Option<u64>) -> (Arc<MemMedia>, Arc<Volume>) {
        let media = Arc::new(MemMedia::with_size(4096, 64 * 1024, 256).unwrap());
        let volume = Volume::create(
            media.clone() as Arc<dyn Media>,
            CreateOptions::new(BLOCKS * BLOCK_SIZE_U64),
            options(map_cache_bytes),
        )
        .unwrap();
        (media, volume)
    }

    /// A compressible block unlike any other (`seed` says which).
    fn block(seed: u64) -> Vec<u8> {
        let text = format!("block {seed:>12} of a test of sharing; ");
        text.bytes().cycle().take(BLOCK_SIZE).collect()
    }

    fn write(volume: &Volume, model: &mut [Vec<u8>], lba: u64, seed: u64) {
        let data = block(seed);
        volume.write(lba * BLOCK_SIZE_U64, &data, false).unwrap();
        model[lba as usize] = data;
    }

    fn check_all(volume: &Volume, model: &[Vec<u8>]) {
        let mut buf = vec![0u8; BLOCK_SIZE];
        for (lba, want) in model.iter().enumerate() {
            volume.read(lba as u64 * BLOCK_SIZE_U64, &mut buf).unwrap();
            assert!(buf == *want, "block {lba} reads wrong");
        }
        let report = volume.check(true).unwrap();
        assert!(report.is_clean(), "{report:?}");
    }

    /// Cleans every segment with a quarter of garbage or more.
    fn clean_all(volume: &Volume) {
        for _ in 0..256 {
            if !volume.clean_one(16 * 1024).unwrap() {
                return;
            }
        }
        panic!("the cleaner never ran out of victims");
    }

    fn slot(volume: &Volume, lba: u64) -> Slot {
        let state = volume.lock_resident(Lba(lba), 1).unwrap();
        state.map().get(Lba(lba)).slot()
    }

    #[test]
    fn cloned_blocks_read_back_and_store_nothing_again() {
        let (_media, volume) = volume(None);
        let mut model = vec![vec![0u8; BLOCK_SIZE]; BLOCKS as usize];
        for lba in 0..64 {
            write(&volume, &mut model, lba, lba);
        }
        volume
            .trim(10 * BLOCK_SIZE_U64, 2 * BLOCK_SIZE_U64, false)
            .unwrap();
        model[10] = vec![0u8; BLOCK_SIZE];
        model[11] = vec![0u8; BLOCK_SIZE];
        let before = volume.stats();
        volume.clone_blocks(Lba(0), Lba(100), 64).unwrap();
        for lba in 0..64 {
            model[100 + lba] = model[lba].clone();
        }
        let after = volume.stats();
        assert_eq!(
            after.stored_bytes, before.stored_bytes,
            "nothing stored again"
        );
        assert_eq!(after.mapped_bytes, before.mapped_bytes * 2);
        {
            let state = volume.lock();
            // Blocks 10 and 11 are holes: 62 contents, each named twice.
            assert_eq!(state.shared().contents(), 62);
            assert_eq!(state.shared().references(), 124);
        }
        assert!(matches!(slot(&volume, 0), Slot::Shared { content } if content > 0));
        assert_eq!(slot(&volume, 0), slot(&volume, 100));
        check_all(&volume, &model);
        // A second clone of shared blocks adds references only.
        volume.clone_blocks(Lba(100), Lba(300), 64).unwrap();
        for lba in 0..64 {
            model[300 + lba] = model[lba].clone();
        }
        assert_eq!(volume.stats().stored_bytes, before.stored_bytes);
        assert_eq!(volume.lock().shared().references(), 186);
        check_all(&volume, &model);
        // Bad requests change nothing.
        let overlap = volume.clone_blocks(Lba(0), Lba(10), 20).unwrap_err();
        assert!(overlap.to_string().contains("overlap"), "{overlap}");
        assert!(matches!(
            volume.clone_blocks(Lba(0), Lba(BLOCKS - 10), 20),
            Err(Error::OutOfRange { .. })
        ));
        check_all(&volume, &model);
    }

    #[test]
    fn references_go_with_overwrites_and_trims_and_the_last_frees_the_record() {
        let (_media, volume) = volume(None);
        let mut model = vec![vec![0u8; BLOCK_SIZE]; BLOCKS as usize];
        for lba in 0..32 {
            write(&volume, &mut model, lba, lba);
        }
        let stored = volume.stats().stored_bytes;
        volume.clone_blocks(Lba(0), Lba(200), 32).unwrap();
        volume.clone_blocks(Lba(0), Lba(300), 32).unwrap();
        for lba in 0..32 {
            model[200 + lba] = model[lba].clone();
            model[300 + lba] = model[lba].clone();
        }
        // The owners change: the contents stay for the clones.
        for lba in 0..32 {
            write(&volume, &mut model, lba, 1000 + lba);
        }
        volume
            .trim(200 * BLOCK_SIZE_U64, 32 * BLOCK_SIZE_U64, false)
            .unwrap();
        volume
            .write_zeroes(300 * BLOCK_SIZE_U64, 16 * BLOCK_SIZE_U64, false, false)
            .unwrap();
        for lba in 0..32 {
            model[200 + lba] = vec![0u8; BLOCK_SIZE];
        }
        for lba in 0..16 {
            model[300 + lba] = vec![0u8; BLOCK_SIZE];
        }
        assert_eq!(volume.lock().shared().contents(), 16);
        check_all(&volume, &model);
        // The last references go: so do the contents.
        for lba in 316..332 {
            write(&volume, &mut model, lba, 2000 + lba);
        }
        assert_eq!(volume.lock().shared().contents(), 0);
        assert_eq!(volume.lock().shared().references(), 0);
        let state = volume.lock();
        let live: u64 = state
            .space()
            .table()
            .iter()
            .map(|(_, info)| info.live_bytes)
            .sum();
        assert_eq!(live, state.map().block_counts().stored_bytes);
        drop(state);
        assert!(volume.stats().stored_bytes >= stored);
        check_all(&volume, &model);
    }

    /// Random writes, clones, trims and cleaning, checked against the
    /// model throughout, then after a clean restart and after a crash that
    /// keeps everything flushed: on a map cache of 0 (every leaf and cell
    /// paged out at each release of the lock) and with the map in RAM.
    #[test]
    fn sharing_survives_cleaning_restarts_and_crashes() {
        for cache in [Some(0), None] {
            let (media, volume) = volume(cache);
            let mut rng = SmallRng::seed_from_u64(7);
            let mut model = vec![vec![0u8; BLOCK_SIZE]; BLOCKS as usize];
            let mut seed = 0;
            for round in 0..400 {
                match rng.gen_range(0..10) {
                    0..=4 => {
                        let lba = rng.gen_range(0..BLOCKS);
                        seed += 1;
                        write(&volume, &mut model, lba, seed % 97);
                    }
                    5..=7 => {
                        let count = rng.gen_range(1..40);
                        let source = rng.gen_range(0..BLOCKS - count);
                        let dest = rng.gen_range(0..BLOCKS - count);
                        if source < dest + count && dest < source + count {
                            continue;
                        }
                        volume.clone_blocks(Lba(source), Lba(dest), count).unwrap();
                        for i in 0..count {
                            model[(dest + i) as usize] = model[(source + i) as usize].clone();
                        }
                    }
                    8 => {
                        let lba = rng.gen_range(0..BLOCKS - 8);
                        volume
                            .trim(lba * BLOCK_SIZE_U64, 8 * BLOCK_SIZE_U64, false)
                            .unwrap();
                        for i in 0..8 {
                            model[(lba + i) as usize] = vec![0u8; BLOCK_SIZE];
                        }
                    }
                    _ => clean_all(&volume),
                }
                if round % 50 == 49 {
                    volume.checkpoint().unwrap();
                    check_all(&volume, &model);
                }
            }
            assert!(
                volume.lock().shared().contents() > 0,
                "something stays shared"
            );
            volume.flush().unwrap();
            // Everything cleaned: shared records moved, still shared.
            // Seal the segments holding shared records, and give them
            // garbage: incompressible blocks, written twice.
            for _ in 0..2 {
                for lba in 480..BLOCKS {
                    let mut data = vec![0u8; BLOCK_SIZE];
                    rng.fill(&mut data[..]);
                    volume.write(lba * BLOCK_SIZE_U64, &data, false).unwrap();
                    model[lba as usize] = data;
                }
            }
            let shared_before = volume.lock().shared().clone();
            let cells = |volume: &Volume| {
                let mut cells: Vec<(u64, Slot)> = shared_before
                    .iter()
                    .map(|(content, _)| (content, slot(volume, table_key(content).0)))
                    .collect();
                cells.sort_by_key(|&(content, _)| content);
                cells
            };
            let placed = cells(&volume);
            clean_all(&volume);
            assert_eq!(*volume.lock().shared(), shared_before, "cleaning un-shared");
            let moved = placed
                .iter()
                .zip(cells(&volume))
                .filter(|(before, after)| before.1 != after.1)
                .count();
            assert!(moved > 0, "the cleaner moved no shared record");
            check_all(&volume, &model);
            volume.close().unwrap();
            let media = Arc::new(media.reopen());
            let volume = Volume::open(media.clone() as Arc<dyn Media>, options(cache)).unwrap();
            assert_eq!(
                *volume.lock().shared(),
                shared_before,
                "counts after a restart"
            );
            check_all(&volume, &model);
            // More sharing, flushed, then a crash that loses nothing flushed.
            volume.clone_blocks(Lba(0), Lba(256), 128).unwrap();
            for i in 0..128 {
                model[256 + i] = model[i].clone();
            }
            volume.flush().unwrap();
            let crashed = media.crash(
                &mut rng,
                CrashConfig {
                    keep_probability: 0.0,
                    tear: true,
                    flip_bit: false,
                },
            );
            let volume = Volume::open(Arc::new(crashed) as Arc<dyn Media>, options(cache)).unwrap();
            check_all(&volume, &model);
            let written = (0..128)
                .find(|&i| model[i] != vec![0u8; BLOCK_SIZE])
                .expect("a block with data") as u64;
            let cell = {
                let Slot::Shared { content } = slot(&volume, 256 + written) else {
                    panic!("block {} is not shared after the crash", 256 + written);
                };
                table_key(content)
            };
            assert!(matches!(slot(&volume, cell.0), Slot::Data(_)));
        }
    }

    #[test]
    fn damage_in_a_shared_record_is_reported_for_every_block_sharing_it() {
        let (media, volume) = volume(None);
        let mut model = vec![vec![0u8; BLOCK_SIZE]; BLOCKS as usize];
        write(&volume, &mut model, 5, 5);
        write(&volume, &mut model, 6, 6);
        for dest in [50, 60, 70] {
            volume.clone_blocks(Lba(5), Lba(dest), 1).unwrap();
        }
        volume.flush().unwrap();
        let Slot::Shared { content } = slot(&volume, 5) else {
            panic!("block 5 is not shared");
        };
        let Slot::Data(loc) = slot(&volume, table_key(content).0) else {
            panic!("no cell");
        };
        media.corrupt(loc.segment, loc.offset as usize + 40, 3);
        let report = volume.check(true).unwrap();
        assert_eq!(report.damaged_blocks, vec![5, 50, 60, 70], "{report:?}");
        let mut buf = vec![0u8; BLOCK_SIZE];
        for lba in [5u64, 50, 60, 70] {
            assert!(
                volume.read(lba * BLOCK_SIZE_U64, &mut buf).is_err(),
                "block {lba}"
            );
        }
        volume.read(6 * BLOCK_SIZE_U64, &mut buf).unwrap();
        assert_eq!(buf, model[6]);
        // Repair drops every block sharing it, and the content with them.
        let repaired = volume.repair().unwrap();
        assert_eq!(repaired.repaired_blocks, vec![5, 50, 60, 70]);
        assert_eq!(volume.lock().shared().contents(), 0);
        for lba in [5usize, 50, 60, 70] {
            model[lba] = vec![0u8; BLOCK_SIZE];
        }
        check_all(&volume, &model);
    }
}
