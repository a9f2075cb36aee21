//! The figures zdisk was founded on (issue #13 part 4), pinned within 15%:
//! AnandTech's SF-2500 preview [AT4159] measured a 200 GB Vertex 3 Pro with
//! AS-SSD's incompressible sequential write, and both an SF-1200 and the
//! SF-2500 copying a 6.6 GB H.264 file at QD1, each clean, dirty (every
//! block and the spare area filled) and after TRIM, and the same AS-SSD
//! write on an SF-1200 in all three states. Every drive here runs its
//! profile's defaults, recycling cap included, as `zdisk bench --profile
//! NAME` does without extra flags: a drive named for a controller must
//! behave like it out of the box.
//!
//! Every run is in virtual time, so the figures are outputs of the drive
//! model driven by the real engine, the same on any host: these tests
//! assert on a computation, not on the machine's speed. The drives are
//! scaled down (fewer erase blocks, less data moved) from the runs behind
//! docs/emulation.md; each test prints what it measured beside the
//! published figure.

mod common;

use common::{drive, Recycling};
use serde_json::Value;
use zdisk_bench::drive::NandDrive;
use zdisk_bench::scenarios::{Settings, COPY_SOURCE_MB_S};
use zdisk_bench::{run, BenchConfig, Scenario};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// The band the issue asks for: emulated within 15% of published.
const BAND: f64 = 0.15;

fn bench(drive: &NandDrive, scenario: Scenario, size: u64, source_mb_s: Option<f64>) -> Value {
    let config = BenchConfig {
        scenarios: vec![scenario],
        settings: Settings {
            size_bytes: size,
            patterns: vec![],
            dirty_fill_random: false,
            spares: vec![],
            copy_source_bytes_per_sec: source_mb_s.map(|rate| (rate * 1e6) as u64),
            threads: Vec::new(),
            seconds: 1.0,
            seed: 1,
        },
        json: None,
        plot: None,
        progress: false,
    };
    let mut outcomes = run(drive, &config).unwrap();
    outcomes.pop().unwrap().1.json
}

/// Checks clean, dirty and after-TRIM figures against the published ones.
fn assert_within_band(what: &str, json: &Value, published: [f64; 3]) {
    let keys = ["clean_mb_s", "dirty_mb_s", "after_trim_mb_s"];
    for (key, published) in keys.into_iter().zip(published) {
        let emulated = json[key]
            .as_f64()
            .unwrap_or_else(|| panic!("{key} in {json}"));
        let gap = emulated / published - 1.0;
        println!(
            "{what}, {key}: emulated {emulated:.1} MB/s, published {published:.1} ({:+.1}%)",
            gap * 100.0
        );
        assert!(
            gap.abs() <= BAND,
            "{what}, {key}: emulated {emulated:.1} MB/s is {:+.1}% from the published \
             {published:.1} MB/s",
            gap * 100.0
        );
    }
}

/// AS-SSD incompressible write on the 200 GB Vertex 3 Pro: 229.5 clean,
/// 230.0 dirty, 198.2 after TRIM [AT4159].
#[test]
fn vertex3_pro_200_incompressible_writes_match_the_review() {
    let json = bench(
        &drive("vertex3-pro-200", 2 * GIB, Recycling::ProfileDefault),
        Scenario::Dirty,
        512 * MIB,
        None,
    );
    assert_within_band("vertex3-pro-200 AS-SSD", &json, [229.5, 230.0, 198.2]);
}

/// The 6.6 GB H.264 copy on the SF-2500: 157.5 / 158.2 / 157.8 MB/s [AT4159].
/// The drive writes faster than that in every state, so the figure is the
/// source's (see docs/emulation.md); the test also checks that it is.
#[test]
fn vertex3_pro_200_file_copy_matches_the_review() {
    let drive = drive("vertex3-pro-200", 2 * GIB, Recycling::ProfileDefault);
    let json = bench(
        &drive,
        Scenario::FileCopy,
        512 * MIB,
        Some(COPY_SOURCE_MB_S),
    );
    assert_within_band("vertex3-pro-200 copy", &json, [157.5, 158.2, 157.8]);
    assert_eq!(json["source_mb_s"].as_f64(), Some(COPY_SOURCE_MB_S));

    let unlimited = bench(&drive, Scenario::FileCopy, 512 * MIB, None);
    for key in ["clean_mb_s", "dirty_mb_s", "after_trim_mb_s"] {
        let (paced, own) = (
            json[key].as_f64().unwrap(),
            unlimited[key].as_f64().unwrap(),
        );
        println!("{key}: {paced:.1} MB/s from the source, {own:.1} from RAM");
        assert!(
            own > 1.2 * paced,
            "{key}: the drive alone ({own:.1} MB/s) should be well above the source's pace ({paced:.1})"
        );
    }
}

/// The same copy on the SF-1200: 138.6 / 78.5 / 81.7 MB/s [AT4159], with
/// the profile's default recycling cap.
#[test]
fn sf1200_file_copy_matches_the_review() {
    let json = bench(
        &drive("sf1200", 4 * GIB, Recycling::ProfileDefault),
        Scenario::FileCopy,
        GIB,
        Some(COPY_SOURCE_MB_S),
    );
    assert_within_band("sf1200 copy", &json, [138.6, 78.5, 81.7]);
}

/// AS-SSD's incompressible write on the SF-1200, as `zdisk bench --profile
/// sf1200 --scenario dirty` runs it with no other flag (256 MiB per state
/// on the profile's 4 GiB of NAND): 131.7 clean, 70.3 dirty and 71 after
/// TRIM [AT4159]; TRIM does not bring the speed back.
#[test]
fn sf1200_as_ssd_writes_match_the_review_by_default() {
    let json = bench(
        &drive("sf1200", 4 * GIB, Recycling::ProfileDefault),
        Scenario::Dirty,
        256 * MIB,
        None,
    );
    assert_within_band("sf1200 AS-SSD", &json, [131.7, 70.3, 71.0]);
}

/// A copy from a slow source runs at the source's pace, and a copy from
/// RAM at the drive's: the pacing itself, on the small `tiny` drive.
#[test]
fn a_copy_runs_at_the_slower_of_source_and_drive() {
    let drive = drive("tiny", 8 * MIB, Recycling::ProfileDefault);
    let slow = bench(&drive, Scenario::FileCopy, 2 * MIB, Some(20.0));
    let fast = bench(&drive, Scenario::FileCopy, 2 * MIB, None);
    let (slow_clean, fast_clean) = (
        slow["clean_mb_s"].as_f64().unwrap(),
        fast["clean_mb_s"].as_f64().unwrap(),
    );
    println!("tiny: {slow_clean:.1} MB/s from a 20 MB/s source, {fast_clean:.1} from RAM");
    // The first chunk is read before anything is written, so a short copy
    // runs a little under the source's rate.
    assert!(
        (15.0..=20.0).contains(&slow_clean),
        "from a 20 MB/s source: {slow_clean:.1} MB/s"
    );
    assert!(
        fast_clean > 2.0 * slow_clean,
        "from RAM: {fast_clean:.1} MB/s"
    );
}
