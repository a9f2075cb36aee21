//! Prints what each built-in profile delivers through the real engine in
//! virtual time, next to the published figures PROFILES.md calibrates
//! against. Run with `cargo run --release -p zdisk-nand --example calibrate
//! [PROFILE...]`.
//!
//! The harness is single-threaded: at queue depth N it keeps N operations
//! outstanding by issuing each new one when the earliest outstanding one
//! completes (virtual time), so figures are identical on any host.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::Arc;

use rand::rngs::SmallRng;
use rand::{Rng, RngCore, SeedableRng};
use zdisk_core::media::Media;
use zdisk_core::meta::MediaKind;
use zdisk_core::{BlockDevice, Codec, CreateOptions, OpenOptions, Volume};
use zdisk_nand::{profile_names, Clock, NandMedia, NandParams};

const MIB: u64 = 1 << 20;

struct Drive {
    media: Arc<NandMedia>,
    volume: Arc<Volume>,
    now_ns: u64,
}

impl Drive {
    fn new(name: &str) -> Drive {
        let params = NandParams::named(name).unwrap();
        let media = Arc::new(NandMedia::new_in_memory(params.clone(), Clock::Virtual).unwrap());
        let profile = &params.profile;
        let create = CreateOptions {
            codec: Codec::parse(&profile.codec).unwrap(),
            media_kind: MediaKind::Nand,
            media_params: params.encode_params(),
            ..CreateOptions::new(profile.logical_size_bytes())
        };
        let options = OpenOptions {
            background: false,
            ..OpenOptions::default()
        };
        let volume = Volume::create(media.clone() as Arc<dyn Media>, create, options).unwrap();
        Drive {
            media,
            volume,
            now_ns: 0,
        }
    }

    /// Runs `count` operations at queue depth `depth`; returns MB/s.
    fn run(
        &mut self,
        depth: usize,
        count: usize,
        bytes_per_op: u64,
        mut op: impl FnMut(&Volume, usize),
    ) -> f64 {
        let start = self.now_ns;
        let mut outstanding: BinaryHeap<Reverse<u64>> = BinaryHeap::new();
        let mut end = start;
        for i in 0..count {
            let issue = if outstanding.len() < depth {
                start
            } else {
                outstanding.pop().unwrap().0
            };
            self.media.begin_op(issue);
            op(&self.volume, i);
            let done = self.media.end_op();
            outstanding.push(Reverse(done));
            end = end.max(done);
            // Background cleaning between operations, at the issue time.
            self.media.set_time(issue);
            while self.volume.maintenance_tick().unwrap() {}
        }
        self.now_ns = end.max(self.media.idle_at_ns());
        // A drive that models no host link can take no time at all (zeros):
        // that reads as infinitely fast.
        (count as u64 * bytes_per_op) as f64 * 1e3 / (end - start) as f64
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let names: Vec<&str> = if args.is_empty() {
        profile_names()
            .iter()
            .copied()
            .filter(|&n| n != "tiny")
            .collect()
    } else {
        args.iter().map(String::as_str).collect()
    };
    let mut rng = SmallRng::seed_from_u64(7);
    let mut random = vec![0u8; 128 * 1024];
    rng.fill_bytes(&mut random);
    let zeros = vec![0u8; 128 * 1024];
    for name in names {
        let params = NandParams::named(name).unwrap();
        let bandwidth = params.profile.bandwidth();
        println!(
            "{name}: program {:.0} MB/s, read {:.0} MB/s, link {}, commands {}",
            bandwidth.program_bytes_per_sec / 1e6,
            bandwidth.read_bytes_per_sec / 1e6,
            bandwidth
                .link_bytes_per_sec
                .map_or("unlimited".into(), |r| format!("{:.0} MB/s", r / 1e6)),
            bandwidth
                .commands_per_sec
                .map_or("unlimited".into(), |r| format!("{:.0}/s", r)),
        );
        let span = 256 * MIB;
        let count = (span / (128 * 1024)) as usize;
        for (label, data, depth) in [
            ("seq write 128K QD1 random data", &random, 1),
            ("seq write 128K QD4 random data", &random, 4),
            ("seq write 128K QD4 zeros", &zeros, 4),
        ] {
            let mut drive = Drive::new(name);
            let mbps = drive.run(depth, count, 128 * 1024, |v, i| {
                v.write(i as u64 * 128 * 1024, data, false).unwrap()
            });
            println!("  {label:<34} {mbps:8.1} MB/s");
            if std::env::var("DEBUG").is_ok() {
                println!("{:#?} now {}", drive.media.stats(), drive.now_ns);
            }
        }
        let mut drive = Drive::new(name);
        drive.run(4, count, 128 * 1024, |v, i| {
            v.write(i as u64 * 128 * 1024, &random, false).unwrap()
        });
        drive.volume.flush().unwrap();
        let mut buf = vec![0u8; 128 * 1024];
        let mbps = drive.run(4, count, 128 * 1024, |v, i| {
            v.read(i as u64 * 128 * 1024, &mut buf).unwrap()
        });
        println!("  {:<34} {mbps:8.1} MB/s", "seq read 128K QD4");
        let mut small = vec![0u8; 4096];
        let mut rng = SmallRng::seed_from_u64(1);
        let mbps = drive.run(1, 4000, 4096, |v, _| {
            let block = rng.gen_range(0..span / 4096);
            v.read(block * 4096, &mut small).unwrap()
        });
        println!("  {:<34} {mbps:8.1} MB/s", "random read 4K QD1");
        let mut page = vec![0u8; 4096];
        let mbps = drive.run(32, 20000, 4096, |v, _| {
            rng.fill_bytes(&mut page);
            let block = rng.gen_range(0..span / 4096);
            v.write(block * 4096, &page, false).unwrap()
        });
        println!(
            "  {:<34} {mbps:8.1} MB/s",
            "random write 4K QD32 random data"
        );
        if params.config.recycle_cap_bytes_per_sec.is_some() {
            // AnandTech's "dirty, then TRIM" test: fill the drive with
            // incompressible data, TRIM it all, write sequentially again.
            let mut dirty = Drive::new(name);
            let logical = dirty.volume.superblock().logical_size_bytes;
            // 80%: the engine keeps segments in reserve, so incompressible
            // data cannot fill every logical byte of a drive with 7% spare.
            let fill = (logical * 80 / 100 / (128 * 1024)) as usize;
            let mut block = vec![0u8; 128 * 1024];
            dirty.run(4, fill, 128 * 1024, |v, i| {
                rng.fill_bytes(&mut block);
                v.write(i as u64 * 128 * 1024, &block, false).unwrap()
            });
            dirty.run(1, 1, 0, |v, _| v.trim(0, logical, false).unwrap());
            let mut fresh = vec![0u8; 128 * 1024];
            // Long enough to use up the free segments left after the fill.
            let mbps = dirty.run(4, fill, 128 * 1024, |v, i| {
                rng.fill_bytes(&mut fresh);
                v.write(i as u64 * 128 * 1024, &fresh, false).unwrap()
            });
            println!("  {:<34} {mbps:8.1} MB/s", "seq write after fill + TRIM");
        }
        let stats = drive.media.stats();
        println!(
            "  programmed {} pages, read {}, erased {} blocks, recycled {} segments",
            stats.pages_programmed, stats.pages_read, stats.blocks_erased, stats.segments_recycled
        );
    }
}
