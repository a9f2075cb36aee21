//! The emulator's acceptance figures, checked on scaled-down drives.
//!
//! Every run here is in virtual time: the figures are outputs of the
//! drive model driven by the real engine, identical on any host and under
//! any load, so asserting on them is asserting on a computation, not
//! timing the machine. Each test prints what it measured. The full-size
//! runs behind docs/emulation.md use the same scenarios through
//! `zdisk bench --profile ...`.

mod common;

use common::{drive, Recycling};
use serde_json::Value;
use zdisk_bench::drive::NandDrive;
use zdisk_bench::pattern::Pattern;
use zdisk_bench::scenarios::Settings;
use zdisk_bench::{run, BenchConfig, Scenario};

const MIB: u64 = 1 << 20;

fn bench(drive: &NandDrive, scenario: Scenario, size: u64, patterns: Vec<Pattern>) -> Value {
    let config = BenchConfig {
        scenarios: vec![scenario],
        settings: Settings {
            size_bytes: size,
            patterns,
            dirty_fill_random: false,
            spares: vec![],
            copy_source_bytes_per_sec: None,
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

fn number(value: &Value, key: &str) -> f64 {
    value[key]
        .as_f64()
        .unwrap_or_else(|| panic!("{key} in {value}"))
}

/// FEMU's default timing: 4 KiB random reads at QD1 and QD32 within 5% of
/// what the parameters imply (`Profile::random_read_iops_model`).
#[test]
fn femu_default_random_reads_match_the_analytic_model() {
    let json = bench(
        &drive("femu-default", 2 << 30, Recycling::ProfileDefault),
        Scenario::QueueDepth,
        256 * MIB,
        vec![],
    );
    for row in json["results"].as_array().unwrap() {
        let qd = row["queue_depth"].as_u64().unwrap();
        let (measured, model) = (number(row, "read_iops"), number(row, "read_iops_model"));
        let error = measured / model - 1.0;
        println!(
            "QD{qd}: {measured:.0} IOPS, model {model:.0} ({:+.1}%)",
            error * 100.0
        );
        if qd == 1 || qd == 32 {
            assert!(error.abs() <= 0.05, "QD{qd}: {measured:.0} vs {model:.0}");
        }
    }
}

/// 4 KiB writes, each flushed, on 16 KiB pages: every flush programs a
/// padded page (write amplification about 4); with PLP, no padding.
#[test]
fn flushes_on_16k_pages_cost_a_page_each_without_plp_and_nothing_with_it() {
    let json = bench(
        &drive("plain-tlc", 1 << 30, Recycling::ProfileDefault),
        Scenario::Flush,
        16 * MIB,
        vec![],
    );
    assert_eq!(number(&json, "page_size_bytes"), 16384.0);
    let results = json["results"].as_array().unwrap();
    for row in results {
        println!("{row}");
    }
    let without = results.iter().find(|r| r["plp"] == false).unwrap();
    let with = results.iter().find(|r| r["plp"] == true).unwrap();
    let wa = number(without, "write_amplification");
    assert!((3.9..=4.1).contains(&wa), "WA without PLP {wa}");
    assert_eq!(number(with, "padding_bytes"), 0.0);
    assert!(number(with, "write_amplification") < 1.05);
}

/// An SF-1200 writes zeros at the link's speed and incompressible data at
/// the flash's: zeros at least twice as fast.
#[test]
fn sf1200_writes_zeros_far_faster_than_random_data() {
    let json = bench(
        &drive("sf1200", 2 << 30, Recycling::ProfileDefault),
        Scenario::Sweep,
        128 * MIB,
        vec![Pattern::Zeros, Pattern::Random],
    );
    let seq_write = |pattern: &str| {
        json["results"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["pattern"] == pattern && r["direction"] == "seq_write")
            .map(|r| number(r, "mb_s"))
            .unwrap()
    };
    let (zeros, random) = (seq_write("zeros"), seq_write("random"));
    println!("sequential writes: zeros {zeros:.1} MB/s, random {random:.1} MB/s");
    assert!(
        zeros >= 2.0 * random,
        "zeros {zeros:.1}, random {random:.1}"
    );
}

/// The SF-1200 dirty-drive test. zdisk's own cleaner keeps a filled drive
/// at 90% of its clean speed and a trimmed one at 98%; a capped recycling
/// engine imitating SandForce's stays well below both.
#[test]
fn sf1200_dirty_drive_with_zdisk_gc_and_with_a_recycling_cap() {
    let own = bench(
        &drive("sf1200", 2 << 30, Recycling::Uncapped),
        Scenario::Dirty,
        512 * MIB,
        vec![],
    );
    let (clean, dirty, trimmed) = (
        number(&own, "clean_mb_s"),
        number(&own, "dirty_mb_s"),
        number(&own, "after_trim_mb_s"),
    );
    println!("zdisk GC: clean {clean:.1}, dirty {dirty:.1}, after TRIM {trimmed:.1} MB/s");
    assert!(
        dirty >= 0.90 * clean,
        "dirty {dirty:.1} of clean {clean:.1}"
    );
    assert!(
        trimmed >= 0.98 * clean,
        "after TRIM {trimmed:.1} of clean {clean:.1}"
    );

    let capped = bench(
        &drive("sf1200", 2 << 30, Recycling::CapMbS(70)),
        Scenario::Dirty,
        512 * MIB,
        vec![],
    );
    let (capped_dirty, capped_trimmed) = (
        number(&capped, "dirty_mb_s"),
        number(&capped, "after_trim_mb_s"),
    );
    println!(
        "recycling capped at 70 MB/s: dirty {capped_dirty:.1}, after TRIM {capped_trimmed:.1} MB/s"
    );
    assert!(capped_dirty < 0.75 * clean && capped_trimmed < 0.75 * clean);
}
