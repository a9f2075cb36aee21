//! The PostgreSQL fillfactor case study (issue #13 part 3) end to end:
//! `crates/zdisk-bench/scripts/pg-fillfactor.sh --quick` runs pgbench on
//! ext4 on the real binary (nbdfuse and a loop device) and on a plain
//! `nbdkit file` export, for fillfactors 100, 90, 75 and 50, and this test
//! asserts on the JSON it writes: every run present, real sizes, a database
//! that grows as the fillfactor falls, and the case study's point, that on
//! zdisk the physical bytes after the load barely move while the logical
//! size nearly doubles, where the baseline's grow with it.
//!
//! Only sizes are asserted, and only those taken after the load, which do
//! not depend on the host's speed; TPS is printed, not judged. Without
//! root, /dev/fuse, loop devices, nbdfuse, nbdkit or PostgreSQL the test
//! reports itself ignored, with the reason. It takes about two minutes.

mod support;

use std::path::Path;

use libtest_mimic::{Arguments, Trial};
use serde_json::Value;

use support::*;

const FILLFACTORS: [u64; 4] = [100, 90, 75, 50];

fn main() {
    let args = Arguments::from_args();
    let trials = vec![Trial::ignorable_test(
        "pg_fillfactor_quick_grows_the_database_not_zdisk_physical_bytes",
        pg_fillfactor_quick,
    )];
    libtest_mimic::run(&args, trials).exit();
}

fn script() -> String {
    format!(
        "{}/../zdisk-bench/scripts/pg-fillfactor.sh",
        env!("CARGO_MANIFEST_DIR")
    )
}

fn prerequisites() -> Result<(), String> {
    require_root_fuse_loop()?;
    require_tools(&[
        "nbdfuse",
        "fusermount3",
        "nbdkit",
        "losetup",
        "mkfs.ext4",
        "runuser",
        "/usr/bin/python3",
    ])?;
    let pgbench = std::fs::read_dir("/usr/lib/postgresql")
        .ok()
        .into_iter()
        .flatten()
        .filter_map(Result::ok)
        .any(|version| version.path().join("bin/pgbench").exists());
    if !pgbench {
        return Err(
            "PostgreSQL (pgbench, initdb) is not installed: apt-get install postgresql".into(),
        );
    }
    Ok(())
}

fn number(run: &Value, key: &str) -> Result<f64, Failed> {
    run[key]
        .as_f64()
        .ok_or_else(|| format!("{key} missing or not a number in {run}").into())
}

fn pg_fillfactor_quick() -> TestResult {
    if let Some(skip) = skip_unless(prerequisites()) {
        return skip;
    }
    let scratch = Scratch::new("pg-fillfactor");
    let json = scratch.join("pg.jsonl");
    let zdisk = zdisk_bin();
    let output = run(
        &script(),
        &[
            "--quick",
            "--json",
            json.to_str().expect("UTF-8 path"),
            "--zdisk",
            zdisk.to_str().expect("UTF-8 path"),
            "--dir",
            scratch.path.to_str().expect("UTF-8 path"),
        ],
    )?;
    println!("{}", stdout(&output));
    let runs = read_runs(&json)?;

    for baseline in [false, true] {
        let name = if baseline { "baseline" } else { "zdisk" };
        let mut by_ff = Vec::new();
        for ff in FILLFACTORS {
            let found: Vec<&Value> = runs
                .iter()
                .filter(|r| r["baseline"] == baseline && r["fillfactor"].as_u64() == Some(ff))
                .collect();
            ensure!(found.len() == 1, "{name} FF={ff}: {} runs", found.len());
            let r = found[0];
            for key in ["db_bytes", "mapped_bytes", "physical_bytes", "tps"] {
                ensure!(
                    number(r, key)? > 0.0,
                    "{name} FF={ff}: {key} is not positive"
                );
            }
            by_ff.push(r);
        }
        for pair in by_ff.windows(2) {
            let (higher_ff, lower_ff) = (pair[0], pair[1]);
            for key in ["load_db_bytes", "db_bytes"] {
                ensure!(
                    number(lower_ff, key)? > number(higher_ff, key)?,
                    "{name}: {key} does not grow from FF={} to FF={}",
                    higher_ff["fillfactor"],
                    lower_ff["fillfactor"]
                );
            }
        }
    }

    let value = |baseline: bool, ff: u64, key: &str| -> Result<f64, Failed> {
        let r = runs
            .iter()
            .find(|r| r["baseline"] == baseline && r["fillfactor"].as_u64() == Some(ff))
            .ok_or("run missing")?;
        number(r, key)
    };
    let load = |baseline: bool, ff: u64, key: &str| value(baseline, ff, &format!("load_{key}"));
    let db_growth = load(false, 50, "db_bytes")? / load(false, 100, "db_bytes")?;
    let zdisk_growth = load(false, 50, "physical_bytes")? / load(false, 100, "physical_bytes")?;
    let plain_growth = load(true, 50, "physical_bytes")? / load(true, 100, "physical_bytes")?;
    println!(
        "after the load, FF=50 against FF=100: database {db_growth:.2}x, \
         zdisk physical {zdisk_growth:.2}x, plain export physical {plain_growth:.2}x"
    );
    // After the timed run the sizes also depend on how many transactions
    // each run managed (the WAL it rewrote, the pages it touched): printed.
    println!(
        "after the timed run, FF=50 against FF=100: database {:.2}x, zdisk physical {:.2}x, \
         plain export physical {:.2}x",
        value(false, 50, "db_bytes")? / value(false, 100, "db_bytes")?,
        value(false, 50, "physical_bytes")? / value(false, 100, "physical_bytes")?,
        value(true, 50, "physical_bytes")? / value(true, 100, "physical_bytes")?,
    );
    for ff in FILLFACTORS {
        println!(
            "FF={ff}: TPS zdisk {:.0}, plain export {:.0}",
            value(false, ff, "tps")?,
            value(true, ff, "tps")?
        );
    }
    ensure!(db_growth >= 1.6, "the database grew only {db_growth:.2}x");
    ensure!(
        zdisk_growth <= 1.15,
        "zdisk's physical bytes grew {zdisk_growth:.2}x (limit 1.15x)"
    );
    ensure!(
        plain_growth > zdisk_growth + 0.1,
        "the plain export grew {plain_growth:.2}x, not clearly more than zdisk's {zdisk_growth:.2}x"
    );
    for ff in FILLFACTORS {
        let (packed, plain) = (
            load(false, ff, "physical_bytes")?,
            load(true, ff, "physical_bytes")?,
        );
        ensure!(
            packed < plain / 2.0,
            "FF={ff}: zdisk stores {packed} bytes, the plain export {plain}: pgbench's tables compress far more than 2x"
        );
    }
    Ok(Completion::Completed)
}

fn read_runs(json: &Path) -> Result<Vec<Value>, Failed> {
    let text = std::fs::read_to_string(json).map_err(|e| format!("{}: {e}", json.display()))?;
    let runs = text
        .lines()
        .map(serde_json::from_str)
        .collect::<Result<Vec<Value>, _>>()?;
    ensure!(
        runs.len() == 8,
        "{} runs in {}, not 8",
        runs.len(),
        json.display()
    );
    Ok(runs)
}
