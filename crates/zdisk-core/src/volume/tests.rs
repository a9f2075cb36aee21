//! Engine tests against a reference model and for space management: random
//! operation sequences checked block by block, a thin volume driven to
//! ENOSPC and back, and the cleaner under sustained overwrites.

use std::sync::Arc;

use rand::rngs::SmallRng;
use rand::{Rng, RngCore, SeedableRng};

use crate::device::BlockDevice;
use crate::media::{Media, MemMedia};
use crate::units::BLOCK_SIZE;
use crate::{CreateOptions, Error, OpenOptions, Volume};

const MIB: u64 = 1 << 20;

fn volume(segment_size: u64, segments: u32, logical: u64) -> (Arc<MemMedia>, Arc<Volume>) {
    let media = Arc::new(MemMedia::with_size(4096, segment_size, segments).unwrap());
    let options = OpenOptions {
        background: false,
        ..OpenOptions::default()
    };
    let volume = Volume::create(
        media.clone() as Arc<dyn Media>,
        CreateOptions::new(logical),
        options,
    )
    .unwrap();
    (media, volume)
}

fn random(rng: &mut SmallRng, len: usize) -> Vec<u8> {
    let mut data = vec![0u8; len];
    rng.fill_bytes(&mut data);
    data
}

#[test]
fn thin_volume_fills_then_trim_gives_space_back() {
    let (_media, volume) = volume(256 * 1024, 252, 256 * MIB);
    let mut rng = SmallRng::seed_from_u64(1);
    let mut written = Vec::new();
    let mut offset = 0;
    loop {
        let data = random(&mut rng, MIB as usize);
        match volume.write(offset, &data, false) {
            Ok(()) => written.push((offset, data)),
            Err(Error::NoSpace { .. }) => break,
            Err(other) => panic!("unexpected error {other}"),
        }
        offset += MIB;
        assert!(offset < 256 * MIB, "never ran out of space");
    }
    let full_at = offset;
    let mut buf = vec![0u8; MIB as usize];
    for (offset, data) in &written {
        volume.read(*offset, &mut buf).unwrap();
        assert_eq!(&buf, data);
    }
    // Trim every other MiB, then the space must come back.
    let mut trimmed = Vec::new();
    let mut kept = Vec::new();
    for (i, (offset, data)) in written.into_iter().enumerate() {
        if i % 2 == 0 {
            volume.trim(offset, MIB, false).unwrap();
            trimmed.push(offset);
        } else {
            kept.push((offset, data));
        }
    }
    volume.flush().unwrap();
    for offset in trimmed.iter().take(trimmed.len() * 3 / 4) {
        let data = random(&mut rng, MIB as usize);
        if let Err(error) = volume.write(*offset, &data, false) {
            let stats = volume.stats();
            panic!(
                "rewrite at {offset} after trimming failed: {error}; full at {full_at}; {:?} {:?}",
                stats.segments_by_state, stats.sealed_utilization_histogram
            );
        }
        kept.push((*offset, data));
    }
    for (offset, data) in &kept {
        volume.read(*offset, &mut buf).unwrap();
        assert_eq!(&buf, data);
    }
    let report = volume.check(true).unwrap();
    assert!(report.is_clean(), "{report:?}");
}
