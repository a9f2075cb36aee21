//! Shared contents: blocks that name a record member other blocks name
//! too (issue #25; docs/sharing.md, "indirect on share").
//!
//! A block's content becomes shared when a reference record (kind 7) makes
//! another block name it. Its owner's direct entry (`Slot::Data`) then
//! becomes a shared entry (`Slot::Shared { content }`, content = the
//! version it was written at), the shared table's cell at
//! `table_key(content)` takes the location, and the new block gets a
//! shared entry too. From then on the cell is the member's only direct
//! referrer: the cleaner and the cold-data pass move the member by
//! updating the cell (its key is in the segment's summary), never a
//! block's entry, so moving data never un-shares it.
//!
//! Invariants (checked by `check.rs`):
//! - a record member is named by exactly one data entry: its block's, or
//!   its cell's; its bytes count once in live bytes either way;
//! - every shared entry names a content whose cell exists (data, or
//!   damaged once its record failed verification);
//! - `SharedCounts` holds, for every cell, the number of shared entries
//!   naming it (at least one); the cell goes with its last reference, and
//!   its record share dies then.
//!
//! The counts are not stored: recovery derives them from the map
//! (`recovery.rs`), so they cannot drift from it.

use std::collections::HashMap;

use crate::error::{Error, Result};
use crate::map::{table_key, Slot, TABLE_BASE};
use crate::record::{encode_ref, RecordKind, RefMember, REF_NO_OWNER};
use crate::units::Lba;

use super::{State, StreamKind};

/// References to each shared content (its cell's key less `TABLE_BASE`).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct SharedCounts {
    counts: HashMap<u64, u32>,
    /// Shared entries in all: the sum of the counts.
    references: u64,
}

impl SharedCounts {
    /// Notes one more shared entry naming `content`.
    pub(crate) fn add(&mut self, content: u64) {
        *self.counts.entry(content).or_insert(0) += 1;
        self.references += 1;
    }

    /// Notes a shared entry naming `content` gone; true if it was the last.
    pub(crate) fn remove(&mut self, content: u64) -> bool {
        let count = self
            .counts
            .get_mut(&content)
            .unwrap_or_else(|| panic!("content {content} has no references to drop"));
        *count -= 1;
        self.references -= 1;
        if *count == 0 {
            self.counts.remove(&content);
            return true;
        }
        false
    }

    /// References to `content` (0 if it is not shared).
    pub(crate) fn count(&self, content: u64) -> u32 {
        self.counts.get(&content).copied().unwrap_or(0)
    }

    /// Every content with its count.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (u64, u32)> + '_ {
        self.counts
            .iter()
            .map(|(&content, &count)| (content, count))
    }

    /// Contents shared (cells in the table).
    pub(crate) fn contents(&self) -> u64 {
        self.counts.len() as u64
    }

    /// Shared entries in the map.
    pub(crate) fn references(&self) -> u64 {
        self.references
    }

    /// Heap bytes of the counts, by hashbrown's layout (a control byte per
    /// bucket, buckets a power of two at least 8/7 of the capacity).
    pub(crate) fn heap_bytes(&self) -> u64 {
        match self.counts.capacity() {
            0 => 0,
            capacity => {
                let buckets = (capacity * 8 / 7).next_power_of_two() as u64;
                buckets * (1 + size_of::<(u64, u32)>() as u64)
            }
        }
    }
}

/// What a block found by the dedup index does ([`State::dedup_member`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Dedup {
    /// The block holds that content already: nothing to write.
    Held,
    /// Share it; the stored bytes its member takes.
    Share(RefMember, u64),
    /// It is no longer stored: write the block's data.
    Gone,
}

impl State {
    pub(crate) fn shared(&self) -> &SharedCounts {
        &self.shared
    }

    /// Block `lba`'s content as a new reference may share it: a direct
    /// entry's version with the block as owner (the reference makes it
    /// shared), or a shared entry's content. `None` for a block without
    /// readable data. The block's leaf (and, if shared, its cell's) must
    /// be in RAM.
    pub(crate) fn content_of(&self, lba: Lba) -> Option<RefMember> {
        let entry = self.map.get(lba);
        match entry.slot() {
            Slot::Data(_) => Some(RefMember {
                content: entry.version(),
                owner: lba.0,
            }),
            Slot::Shared { content } => {
                matches!(self.map.get(table_key(content)).slot(), Slot::Data(_)).then_some(
                    RefMember {
                        content,
                        owner: REF_NO_OWNER,
                    },
                )
            }
            _ => None,
        }
    }

    /// What block `target` may do with content version `content`, which
    /// the dedup index says block `owner` was written with: nothing, if
    /// the target holds that content already; share it, if it is still
    /// stored (in its cell, or directly in its owner); or store its data
    /// after all, if it is gone (the index is advisory) or its leaves are
    /// not in RAM. With a share, the stored bytes its record member takes.
    /// The target's leaf must be in RAM.
    pub(crate) fn dedup_member(&self, target: Lba, content: u64, owner: u64) -> Dedup {
        // A leaf not in RAM cannot be read here (no I/O under the lock):
        // the block is then stored, as if its content were gone.
        let cell = table_key(content);
        let owner_resident = owner >= self.logical_blocks || self.map.is_resident(Lba(owner), 1);
        if !self.map.is_resident(cell, 1) || !owner_resident {
            return Dedup::Gone;
        }
        let held = self.map.get(target);
        match held.slot() {
            Slot::Data(_) if held.version() == content => return Dedup::Held,
            Slot::Shared { content: c } if c == content => return Dedup::Held,
            _ => {}
        }
        if let Slot::Data(loc) = self.map.get(cell).slot() {
            return Dedup::Share(
                RefMember {
                    content,
                    owner: REF_NO_OWNER,
                },
                loc.share(),
            );
        }
        if owner < self.logical_blocks {
            let entry = self.map.get(Lba(owner));
            if let (Slot::Data(loc), true) = (entry.slot(), entry.version() == content) {
                return Dedup::Share(RefMember { content, owner }, loc.share());
            }
        }
        Dedup::Gone
    }

    /// Counts blocks dedup shared instead of storing, and the stored bytes
    /// they did not take.
    pub(crate) fn note_deduplicated(&mut self, blocks: u64, saved_bytes: u64) {
        self.counters.dedup_blocks += blocks;
        self.counters.dedup_saved_bytes += saved_bytes;
    }

    /// Counts a dedup index chapter appended to the log.
    pub(crate) fn note_chapter_written(&mut self, bytes: u64) {
        self.counters.dedup_index_write_bytes += bytes;
    }

    /// The key of the entry that names the member at `version` of the
    /// record whose header names block `lba`: its cell, if the member is
    /// shared, else its block (a record the cleaner rewrote from shared
    /// members names their cells itself). The cell's leaf must be in RAM.
    ///
    /// With snapshots, the entry may be one a snapshot keeps: the volume's
    /// block is looked at first, then each snapshot's space (their leaves
    /// must be in RAM too: `State::member_keys` reads them in).
    pub(crate) fn member_key(&self, lba: u64, version: u64) -> Lba {
        if lba >= TABLE_BASE {
            return Lba(lba);
        }
        let cell = table_key(version);
        if !self.map.get(cell).is_hole() {
            return cell;
        }
        // A record rewritten from a kept entry names its key in a
        // snapshot's space; the entry may be back in the volume since (a
        // replay that lost what made it kept), whatever snapshots remain.
        if self.snapshots.is_empty() && lba < crate::map::SPACE_BLOCKS {
            return Lba(lba);
        }
        self.member_candidates(lba)
            .find(|&key| {
                let entry = self.map.get(key);
                matches!(entry.slot(), Slot::Data(_)) && entry.version() == version
            })
            .unwrap_or(Lba(lba))
    }

    /// Points blocks `first..` at the contents `members` (from
    /// [`State::content_of`], under this same lock), under a new version
    /// each, and logs it in a reference record; the entries they replace
    /// are dropped. Keeps `floor` free segments if a new one must be
    /// opened.
    pub(crate) fn apply_ref(
        &mut self,
        first: Lba,
        members: &[RefMember],
        floor: u64,
    ) -> Result<()> {
        let count = members.len() as u64;
        assert!(
            first.0 + count <= self.logical_blocks,
            "reference {first}+{count} beyond the volume"
        );
        self.load_map(first, count)?;
        for member in members {
            self.load_map(table_key(member.content), 1)?;
            if member.owner != REF_NO_OWNER {
                self.load_map(Lba(member.owner), 1)?;
            }
            if !self.can_share(member) {
                return Err(Error::InvalidArgument(format!(
                    "content version {} (of block {}) is no longer stored",
                    member.content, member.owner
                )));
            }
        }
        let version = self.space.take_version();
        for _ in 1..count {
            self.space.take_version();
        }
        let payload = encode_ref(members);
        self.append_metadata(
            StreamKind::Host,
            RecordKind::Ref,
            first,
            version,
            &payload,
            floor,
        )?;
        // Owners become shared before any block changes, so a block that
        // is both an owner and a target is shared first.
        for member in members {
            self.make_shared(member);
        }
        // Every new reference counts before any replaced entry lets go of
        // its content: a target whose old content another member shares
        // (its own owner, made shared just above) must not take that
        // content's cell with it.
        let mut replaced = Vec::with_capacity(members.len());
        for (i, member) in members.iter().enumerate() {
            let lba = Lba(first.0 + i as u64);
            let old = self.map.set(
                lba,
                Slot::Shared {
                    content: member.content,
                },
                version + i as u64,
            );
            self.shared.add(member.content);
            replaced.push((lba, old));
        }
        for (lba, old) in replaced {
            self.release_entry(lba, old)?;
        }
        Ok(())
    }

    /// True if `member`'s content is still stored: its cell holds it, or
    /// its owner does directly.
    fn can_share(&self, member: &RefMember) -> bool {
        if matches!(
            self.map.get(table_key(member.content)).slot(),
            Slot::Data(_)
        ) {
            return true;
        }
        member.owner != REF_NO_OWNER && {
            let entry = self.map.get(Lba(member.owner));
            matches!(entry.slot(), Slot::Data(_)) && entry.version() == member.content
        }
    }

    /// Moves `member`'s content from its owner's direct entry to its cell,
    /// unless the cell already holds it. Live bytes do not change: the
    /// member's share moves from one entry to the other.
    fn make_shared(&mut self, member: &RefMember) {
        let cell = table_key(member.content);
        if !self.map.get(cell).is_hole() {
            return;
        }
        let owner = Lba(member.owner);
        let entry = self.map.get(owner);
        let Slot::Data(loc) = entry.slot() else {
            panic!("owner {owner} of content {} holds no data", member.content);
        };
        debug_assert_eq!(entry.version(), member.content);
        self.map.set(cell, Slot::Data(loc), member.content);
        self.map.set(
            owner,
            Slot::Shared {
                content: member.content,
            },
            member.content,
        );
        self.shared.add(member.content);
        // The cleaner finds the member through the cell from now on.
        self.space.add_member(loc.segment, cell.0);
    }

    /// What happens to the entry a block had before it changed: a record
    /// share dies, or a shared content loses a reference.
    pub(super) fn drop_slot(&mut self, slot: Slot) -> Result<()> {
        match slot {
            Slot::Data(loc) => self.space.kill(loc.segment, loc.share()),
            Slot::Shared { content } => self.release_shared(content)?,
            Slot::Hole | Slot::Zero | Slot::Damaged => {}
        }
        Ok(())
    }

    /// Drops one reference to `content`; with the last, its cell goes and
    /// the member's share dies.
    pub(super) fn release_shared(&mut self, content: u64) -> Result<()> {
        if !self.shared.remove(content) {
            return Ok(());
        }
        let cell = table_key(content);
        self.load_map(cell, 1)?;
        let old = self.map.set(cell, Slot::Hole, 0);
        if let Slot::Data(loc) = old.slot() {
            self.space.kill(loc.segment, loc.share());
        }
        Ok(())
    }
}
