//! The benchmark and soak scripts of `scripts/` (the repository's top
//! level), each run here in its `--quick` mode against the binary under
//! test, so that none of them rots between the runs that produce the
//! figures in the docs. Each script ends with one JSON object on stdout;
//! the tests read it and assert what holds whatever the host's speed:
//! every run and round present, counts that add up, no verify failure,
//! data read back as written, ratios that are finite. Speeds are printed,
//! never judged. Every script answers `--help`, and every script in the
//! folder must have a test below (a new one without a test fails).
//!
//! Scripts that need root, FUSE and loop devices, PostgreSQL, RocksDB or
//! the one-node Ceph report themselves skipped, with the reason, without
//! them. `kv-vs-rocksdb.py` drives `zdisk kv ycsb`, the subcommand that
//! replaces the separate `zdisk-kv` binary.

mod support;

use std::path::{Path, PathBuf};

use libtest_mimic::{Arguments, Trial};
use serde_json::Value;

use support::ceph::Ceph;
use support::*;

type TestFn = fn() -> TestResult;

/// Every script in `scripts/` and the test that runs it; `harness.py` is
/// the module they share, run by all of them.
const TESTS: &[(&str, &str, TestFn)] = &[
    (
        "closed-queue.py",
        "closed_queue_agrees_with_the_occupancy_formula",
        closed_queue,
    ),
    (
        "dirty-file.py",
        "dirty_file_repeats_the_dirty_test_and_pools_its_rounds",
        dirty_file,
    ),
    (
        "soak.py",
        "soak_hostile_and_honest_clients_with_a_kill_9",
        soak,
    ),
    (
        "map-rss.py",
        "map_rss_measures_both_fills_block_by_block",
        map_rss,
    ),
    (
        "map-cache.py",
        "map_cache_verifies_after_kill_9_and_misses_in_small_caches",
        map_cache,
    ),
    ("ab.py", "ab_compares_two_builds_in_every_scenario", ab),
    (
        "mixed-rw.py",
        "mixed_rw_measures_reads_alone_and_beside_a_writer_on_both_servers",
        mixed_rw,
    ),
    ("peers.py", "peers_against_nbdkit_memory", peers),
    (
        "dedup.py",
        "dedup_writes_both_workloads_and_the_estimate_matches_zdisk",
        dedup,
    ),
    (
        "os-install.py",
        "os_install_reports_media_and_host_bytes",
        os_install,
    ),
    (
        "snapshots.py",
        "snapshots_and_clones_cost_no_more_as_the_volume_grows_and_keep_only_what_changed",
        snapshots,
    ),
    (
        "kv-vs-rocksdb.py",
        "kv_vs_rocksdb_quick_runs_every_engine_and_workload",
        kv_vs_rocksdb,
    ),
    (
        "pg-fillfactor.py",
        "pg_fillfactor_quick_grows_the_database_not_zdisk_physical_bytes",
        pg_fillfactor,
    ),
    (
        "tier-vs-local.py",
        "tier_vs_local_figures_hold_together",
        tier_vs_local,
    ),
];

fn main() {
    let args = Arguments::from_args();
    let mut trials = vec![
        Trial::ignorable_test(
            "every_script_answers_help_and_has_a_test",
            help_and_coverage,
        ),
        Trial::ignorable_test("kv_tables_are_drawn_from_the_case_study_json", kv_tables),
    ];
    trials.extend(
        TESTS
            .iter()
            .map(|&(_, name, test)| Trial::ignorable_test(name, test)),
    );
    libtest_mimic::run(&args, trials).exit();
}

fn scripts_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts")
}

fn repo_file(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(path)
}

fn path_arg(path: &Path) -> &str {
    path.to_str().expect("UTF-8 path")
}

/// Runs `scripts/NAME args...` under Debian's python3 (which has the
/// libnbd bindings); fails with its output if it exits non-zero.
fn script(name: &str, args: &[&str]) -> Result<String, Failed> {
    let path = scripts_dir().join(name);
    let mut all = vec![path_arg(&path)];
    all.extend_from_slice(args);
    let output = run("/usr/bin/python3", &all)?;
    let text = stdout(&output);
    println!("{text}");
    Ok(text)
}

/// `script` with `--zdisk` set to the binary under test.
fn script_zdisk(name: &str, args: &[&str]) -> Result<String, Failed> {
    let zdisk = zdisk_bin();
    let mut all = vec!["--zdisk", path_arg(&zdisk)];
    all.extend_from_slice(args);
    script(name, &all)
}

/// The script's result: the last line of its output that is a JSON object.
fn last_json(text: &str) -> Result<Value, Failed> {
    text.lines()
        .rev()
        .filter(|line| line.starts_with('{'))
        .find_map(|line| serde_json::from_str(line).ok())
        .ok_or_else(|| format!("no JSON object in:\n{text}").into())
}

/// Every JSON object line of the output, in order.
fn json_lines(text: &str) -> Vec<Value> {
    text.lines()
        .filter(|line| line.starts_with('{'))
        .filter_map(|line| serde_json::from_str(line).ok())
        .collect()
}

fn number(value: &Value, key: &str) -> Result<f64, Failed> {
    value[key]
        .as_f64()
        .ok_or_else(|| format!("{key} missing or not a number in {value}").into())
}

fn positive(value: &Value, key: &str) -> Result<f64, Failed> {
    let n = number(value, key)?;
    ensure!(
        n.is_finite() && n > 0.0,
        "{key} is {n}, not a positive number, in {value}"
    );
    Ok(n)
}

fn requires_python() -> Result<(), String> {
    require_tools(&["/usr/bin/python3"])
}

fn help_and_coverage() -> TestResult {
    if let Some(skip) = skip_unless(requires_python()) {
        return skip;
    }
    let mut found: Vec<String> = std::fs::read_dir(scripts_dir())
        .map_err(|e| format!("scripts/: {e}"))?
        .filter_map(Result::ok)
        .map(|entry| entry.file_name().to_string_lossy().into_owned())
        .filter(|name| name.ends_with(".py") && name != "harness.py")
        .collect();
    found.sort();
    let mut tested: Vec<String> = TESTS.iter().map(|(name, _, _)| name.to_string()).collect();
    tested.sort();
    ensure!(
        found == tested,
        "scripts/ holds {found:?}, the tests cover {tested:?}"
    );
    for name in &found {
        let help = script(name, &["--help"])?;
        ensure!(
            help.starts_with("usage:") && help.lines().count() > 5,
            "{name} --help prints no usage:\n{help}"
        );
        ensure!(
            help.contains("--quick"),
            "{name} --help does not mention --quick"
        );
        let text = std::fs::read_to_string(scripts_dir().join(name)).map_err(|e| e.to_string())?;
        ensure!(
            text.starts_with("#!/usr/bin/python3\n"),
            "{name} does not start with #!/usr/bin/python3"
        );
    }
    Ok(Completion::Completed)
}

fn closed_queue() -> TestResult {
    if let Some(skip) = skip_unless(requires_python()) {
        return skip;
    }
    let result = last_json(&script("closed-queue.py", &["--quick"])?)?;
    let depths = result["depths"].as_array().ok_or("no depths")?;
    ensure!(depths.len() == 6, "{} depths: {result}", depths.len());
    // At QD1 reads are serial: exactly one per 40 us.
    let qd1 = number(&depths[0], "iops")?;
    ensure!((qd1 - 25_000.0).abs() < 1.0, "QD1 gives {qd1} IOPS");
    // A closed queue waits on busy planes, so it stays just below the
    // occupancy estimate (docs/emulation.md: 1.4% at QD32), never above.
    for depth in depths {
        let (simulated, formula) = (number(depth, "iops")?, number(depth, "occupancy_iops")?);
        ensure!(
            simulated <= formula * 1.005 && simulated >= formula * 0.95,
            "QD {}: {simulated} IOPS against the formula's {formula}",
            depth["qd"]
        );
    }
    Ok(Completion::Completed)
}

fn dirty_file() -> TestResult {
    if let Some(skip) = skip_unless(requires_python()) {
        return skip;
    }
    let scratch = Scratch::new("script-dirty");
    let result = last_json(&script_zdisk(
        "dirty-file.py",
        &["--quick", "--dir", path_arg(&scratch.path)],
    )?)?;
    let runs = result["runs"].as_array().ok_or("no runs")?;
    ensure!(runs.len() == 2, "{} runs: {result}", runs.len());
    for run in runs {
        positive(run, "clean_mb_s")?;
        positive(run, "dirty_percent_of_clean")?;
        // The dirty state must really be dirty: the cleaner ran and wrote.
        ensure!(
            number(run, "segments_cleaned")? > 0.0,
            "nothing was cleaned: {run}"
        );
        ensure!(
            number(run, "write_amplification")? > number(run, "clean_write_amplification")?,
            "dirty writes amplify no more than clean ones: {run}"
        );
    }
    positive(&result, "pooled_dirty_percent_of_clean")?;
    positive(&result, "pooled_after_trim_percent_of_clean")?;
    Ok(Completion::Completed)
}

fn soak() -> TestResult {
    if let Some(skip) = skip_unless(python_has_libnbd().and(require_tools(&["fio"]))) {
        return skip;
    }
    let scratch = Scratch::new("script-soak");
    let summary = last_json(&script_zdisk(
        "soak.py",
        &["--quick", "--dir", path_arg(&scratch.path)],
    )?)?;
    ensure!(summary["verify_failures"] == 0, "soak: {summary}");
    ensure!(summary["honest_rounds_failed"] == 0, "soak: {summary}");
    ensure!(
        summary["honest_rounds"].as_u64() >= Some(6),
        "honest clients barely ran: {summary}"
    );
    ensure!(summary["kill9_restarts"] == 1, "soak: {summary}");
    ensure!(
        summary["hostile_connections"].as_u64() >= Some(6),
        "the hostile clients never got their reads in: {summary}"
    );
    ensure!(
        summary["idle_connections_opened"].as_u64() >= Some(40),
        "the idle connections were not all opened: {summary}"
    );
    // 49 clients at most, under the server's 128 connections: every
    // handshake with the server up must succeed.
    ensure!(
        summary["refused_connections"] == 0,
        "handshakes refused: {summary}"
    );
    ensure!(
        summary["exit_status"] == 0,
        "the final stop was not clean: {summary}"
    );
    let rss = summary["max_rss_bytes"].as_u64().unwrap_or(u64::MAX);
    ensure!(rss < 1 << 30, "RSS reached {rss} bytes: {summary}");
    Ok(Completion::Completed)
}

fn map_rss() -> TestResult {
    if let Some(skip) = skip_unless(requires_python().and(require_tools(&["fio"]))) {
        return skip;
    }
    let scratch = Scratch::new("script-map-rss");
    let fills = json_lines(&script_zdisk(
        "map-rss.py",
        &["--quick", "--dir", path_arg(&scratch.path)],
    )?);
    ensure!(fills.len() == 2, "{} fills, not 2", fills.len());
    for (fill, want_blocks) in fills.iter().zip([16_000.0, 16_384.0]) {
        // 64 MiB of 4 KiB blocks; random writes may hit a block twice.
        let blocks = number(fill, "mapped_blocks")?;
        ensure!(
            blocks >= want_blocks && blocks <= 16_384.0,
            "{blocks} blocks mapped: {fill}"
        );
        // The map's own count stays in the tens of bytes per block (24 at
        // most by design, docs/ARCHITECTURE.md); RSS is only printed.
        let map = positive(fill, "map_bytes_per_block")?;
        ensure!(map < 24.0, "{map} map bytes per block: {fill}");
        ensure!(
            fill["rss_by_part_bytes"].as_array().map(Vec::len) == Some(5),
            "not five RSS readings: {fill}"
        );
    }
    Ok(Completion::Completed)
}

fn map_cache() -> TestResult {
    if let Some(skip) = skip_unless(requires_python().and(require_tools(&["fio"]))) {
        return skip;
    }
    let scratch = Scratch::new("script-map-cache");
    let result = last_json(&script_zdisk(
        "map-cache.py",
        &["--quick", "--dir", path_arg(&scratch.path)],
    )?)?;
    ensure!(
        result["verified_blocks"] == 16384 && result["fill_mapped_blocks"] == 16384,
        "not every block written and verified after kill -9: {result}"
    );
    let reads = &result["reads"];
    for percent in ["100", "25", "5"] {
        let run = &reads[percent][0];
        positive(run, "iops")?;
        let ratio = positive(run, "ratio")?;
        ensure!(
            percent != "100" || ratio == 1.0,
            "the full cache is not its own reference: {run}"
        );
    }
    ensure!(
        reads["100"][0]["misses"] == 0,
        "misses with the whole map cached: {result}"
    );
    ensure!(
        reads["5"][0]["misses"].as_u64() > Some(0),
        "no miss with 5% of the map cached: {result}"
    );
    Ok(Completion::Completed)
}

fn ab() -> TestResult {
    if let Some(skip) =
        skip_unless(requires_python().and(require_tools(&["fio", "nbdcopy", "nbdkit"])))
    {
        return skip;
    }
    let zdisk = zdisk_bin();
    let bin = path_arg(&zdisk);
    let scenarios: &[(&str, &[&str], &[&str])] = &[
        ("seq-read", &["--nbdkit"], &["mb_s", "server_cpu_s_per_gb"]),
        ("rand-read", &[], &["mb_s", "iops"]),
        ("write", &["--nbdkit"], &["mb_s", "stored_bytes"]),
        ("map-read", &[], &["iops"]),
        (
            "idle-space",
            &["--rounds", "1"],
            &["stored_bytes", "idle_physical_used_bytes"],
        ),
    ];
    for &(name, extra, figures) in scenarios {
        let scratch = Scratch::new("script-ab");
        let mut args = vec![
            "--a",
            bin,
            "--b",
            bin,
            "--scenario",
            name,
            "--quick",
            "--dir",
            path_arg(&scratch.path),
        ];
        args.extend_from_slice(extra);
        let result = last_json(&script("ab.py", &args)?)?;
        let rounds = result["rounds"].as_array().ok_or("no rounds")?;
        let want = if extra.contains(&"--rounds") { 1 } else { 2 };
        ensure!(rounds.len() == want, "{name}: {} rounds", rounds.len());
        for figure in figures {
            for side in ["A", "B"] {
                for round in rounds {
                    positive(&round[side], figure)?;
                }
            }
            // The same binary on both sides: the ratio exists and is finite.
            positive(&result["b_over_a"][figure], "median")?;
        }
        if extra.contains(&"--nbdkit") {
            positive(&result["over_nbdkit"]["A"], "mb_s")?;
        }
    }
    Ok(Completion::Completed)
}

/// One quick round on zdisk, a baseline (the same binary) and nbdkit:
/// every figure present and positive, the percentiles in order, the
/// writer's figure only where it ran, and the ratios those of the figures.
fn mixed_rw() -> TestResult {
    if let Some(skip) =
        skip_unless(requires_python().and(require_tools(&["fio", "nbdcopy", "nbdkit"])))
    {
        return skip;
    }
    let zdisk = zdisk_bin();
    let scratch = Scratch::new("script-mixed-rw");
    let result = last_json(&script_zdisk(
        "mixed-rw.py",
        &[
            "--quick",
            "--baseline",
            path_arg(&zdisk),
            "--serve-flags",
            "--recompress off",
            "--dir",
            path_arg(&scratch.path),
        ],
    )?)?;
    let rounds = result["rounds"].as_array().ok_or("no rounds")?;
    ensure!(rounds.len() == 1, "{} rounds: {result}", rounds.len());
    let round = &rounds[0];
    for server in ["zdisk", "baseline", "nbdkit"] {
        for phase in ["reads", "mixed"] {
            let figures = &round[server][phase];
            positive(figures, "read_iops")?;
            let (p50, p99, p999) = (
                positive(figures, "read_p50_us")?,
                positive(figures, "read_p99_us")?,
                positive(figures, "read_p99_9_us")?,
            );
            ensure!(
                p50 <= p99 && p99 <= p999,
                "{server} {phase}: percentiles out of order: {figures}"
            );
            ensure!(
                (phase == "mixed") == figures.get("write_mb_s").is_some(),
                "{server} {phase}: the writer's figure where it did not run, or missing: {figures}"
            );
        }
        positive(&round[server]["mixed"], "write_mb_s")?;
    }
    for (name, bottom) in [("zdisk/nbdkit", "nbdkit"), ("zdisk/baseline", "baseline")] {
        let ratios = &result["ratios"][name]["rounds"][0];
        let iops = positive(ratios, "mixed_iops")?;
        let want = number(&round["zdisk"]["mixed"], "read_iops")?
            / number(&round[bottom]["mixed"], "read_iops")?;
        ensure!(
            (iops - want).abs() < 1e-9 * want,
            "{name} mixed IOPS ratio {iops}, the figures give {want}"
        );
        for key in ["reads_iops", "reads_p99", "mixed_p99", "write_mb_s"] {
            positive(ratios, key)?;
            positive(&result["ratios"][name]["median"], key)?;
        }
    }
    Ok(Completion::Completed)
}

/// Every peer the script compares takes part, btrfs included: the test
/// needs its tools and root (a loop mount), or reports itself skipped
/// (under CI, failed) rather than drop the btrfs row.
fn peers() -> TestResult {
    if let Some(skip) = skip_unless(
        requires_python()
            .and(require_tools(&[
                "fio",
                "nbdcopy",
                "nbdkit",
                "mkfs.btrfs",
                "compsize",
            ]))
            .and(require_root_fuse_loop()),
    ) {
        return skip;
    }
    let scratch = Scratch::new("script-peers");
    let args = vec!["--quick", "--dir", path_arg(&scratch.path)];
    let rows = json_lines(&script_zdisk("peers.py", &args)?);
    ensure!(rows.len() == 4, "{} peers: {rows:?}", rows.len());
    // At full effort every block is compressed; the adaptive row may
    // have stored most of the copy raw for the idle pass (deferred).
    let zdisk = rows
        .iter()
        .find(|r| r["peer"] == "zdisk lz4/full")
        .ok_or("no zdisk lz4/full row")?;
    for row in &rows {
        for key in ["write_mb_s", "seq_read_mb_s", "randread_4k_mb_s"] {
            positive(row, key)?;
        }
    }
    // /usr's files compress: fewer bytes stored than the corpus holds.
    let stored = positive(zdisk, "stored_bytes")?;
    ensure!(
        stored < number(zdisk, "corpus_bytes")?,
        "zdisk stored {stored} bytes of a {} byte corpus",
        zdisk["corpus_bytes"]
    );
    ensure!(positive(zdisk, "ratio")? > 1.0, "no compression: {zdisk}");
    // Media bytes per host byte: compression keeps them under 1 at full
    // effort; a raw (deferred) block costs its 32-byte header more.
    let media = positive(zdisk, "media_per_host")?;
    ensure!(media < 1.0, "{media} media bytes per host byte: {zdisk}");
    let adaptive = rows
        .iter()
        .find(|r| r["peer"] == "zdisk lz4")
        .ok_or("no zdisk lz4 row")?;
    let media = positive(adaptive, "media_per_host")?;
    ensure!(
        media < 1.05,
        "{media} media bytes per host byte: {adaptive}"
    );
    ensure!(
        number(zdisk, "fast_bytes")? == 0.0,
        "--write-effort full wrote fast: {zdisk}"
    );
    Ok(Completion::Completed)
}

/// Snapshot cost on a 64 MiB volume and on a 1 TiB one with 1 GiB mapped,
/// then three snapshots over the two-image layout with 5% of its blocks
/// rewritten after each. Bytes are judged; times are only printed.
fn snapshots() -> TestResult {
    if let Some(skip) = skip_unless(
        requires_python()
            .and(require_tools(&[
                "nbdcopy",
                "nbdkit",
                "fio",
                "mkfs.ext4",
                "mkfs.btrfs",
                "compsize",
                "qemu-img",
                "qemu-io",
            ]))
            .and(require_root_fuse_loop()),
    ) {
        return skip;
    }
    let scratch = Scratch::new("script-snapshots");
    let output = script_zdisk(
        "snapshots.py",
        &["--quick", "--dir", path_arg(&scratch.path)],
    )?;
    print!("{output}");
    let rows = json_lines(&output);
    // Taking a snapshot writes a record and a flush, whatever the size.
    for volume in ["small", "large"] {
        let row = rows
            .iter()
            .find(|r| r["part"] == "cost" && r["volume"] == volume)
            .ok_or_else(|| format!("no cost row for {volume}"))?;
        let mapped = positive(row, "mapped_bytes")?;
        // Snapshots, then clones of the first: each a record and a flush.
        for key in ["takes", "clones"] {
            let takes = row[key].as_array().ok_or("no takes")?;
            ensure!(takes.len() == 5, "{key}: {row}");
            for take in takes {
                positive(take, "seconds")?;
                let written = positive(take, "media_write_bytes")?;
                ensure!(
                    written <= 64.0 * 1024.0 && number(take, "metadata_growth_bytes")? <= 1048576.0,
                    "{volume} ({mapped} bytes mapped): one of the {key} wrote {take}"
                );
            }
        }
    }
    let row = |system: &str| {
        rows.iter()
            .find(|r| r["part"] == "series" && r["system"] == system)
            .ok_or_else(|| Failed::from(format!("no series row for {system}")))
    };
    for system in ["zdisk lz4", "zdisk zstd"] {
        let zdisk = row(system)?;
        let stored = positive(zdisk, "stored_with_metadata_bytes")?;
        ensure!(
            stored <= positive(zdisk, "target_bytes")?,
            "{system}: stored {stored} over the target: {zdisk}"
        );
        ensure!(
            stored > positive(zdisk, "first_stored_bytes")?,
            "{system}: the snapshots kept nothing: {zdisk}"
        );
        positive(zdisk, "snapshot_kept_bytes")?;
        positive(zdisk, "snapshot_read_iops")?;
        positive(zdisk, "volume_read_iops")?;
        // Deleting every snapshot and compacting leaves what the volume
        // alone stores: no more than a fresh copy of it, within 1%.
        let left = positive(zdisk, "after_delete_stored_bytes")?;
        let fresh = positive(zdisk, "fresh_copy_stored_bytes")?;
        ensure!(
            left <= 1.01 * fresh && left < stored,
            "{system}: {left} stored after deleting every snapshot, {fresh} in a fresh copy"
        );
    }
    for system in ["btrfs compress-force=zstd:1", "qcow2 internal snapshots"] {
        let peer = row(system)?;
        ensure!(
            positive(peer, "stored_bytes")? > positive(peer, "first_stored_bytes")?,
            "{system}: {peer}"
        );
    }
    // Ten clones (three here) of one snapshot, each with its own blocks
    // rewritten: one image plus what the clones wrote, within the target.
    let clones = |system: &str| {
        rows.iter()
            .find(|r| r["part"] == "clones" && r["system"] == system)
            .ok_or_else(|| Failed::from(format!("no clones row for {system}")))
    };
    for system in ["zdisk lz4", "zdisk zstd"] {
        let zdisk = clones(system)?;
        let stored = positive(zdisk, "stored_with_metadata_bytes")?;
        ensure!(
            stored <= positive(zdisk, "target_bytes")?,
            "{system}: clones stored {stored} over the target: {zdisk}"
        );
        positive(zdisk, "clone_bytes")?;
        positive(zdisk, "clone_read_iops")?;
        // Deleting every clone and the snapshot and compacting gives back
        // what the clones wrote: the volume's own, as before them.
        let left = positive(zdisk, "after_delete_stored_bytes")?;
        let before = positive(zdisk, "first_stored_bytes")?;
        ensure!(
            left <= 1.01 * before && left < stored,
            "{system}: {left} stored after deleting every clone, {before} before them"
        );
    }
    for system in ["btrfs compress-force=zstd:1", "qcow2 backing files"] {
        let peer = clones(system)?;
        ensure!(
            positive(peer, "stored_bytes")? > positive(peer, "first_stored_bytes")?,
            "{system}: {peer}"
        );
    }
    Ok(Completion::Completed)
}

fn dedup() -> TestResult {
    if let Some(skip) = skip_unless(
        requires_python()
            .and(require_tools(&[
                "nbdcopy",
                "nbdkit",
                "mkfs.ext4",
                "mkfs.btrfs",
                "compsize",
                "duperemove",
            ]))
            .and(require_root_fuse_loop()),
    ) {
        return skip;
    }
    let scratch = Scratch::new("script-dedup");
    let rows = json_lines(&script_zdisk(
        "dedup.py",
        &["--quick", "--dir", path_arg(&scratch.path)],
    )?);
    for workload in ["two-image", "copies"] {
        let row = |configuration: &str| {
            rows.iter()
                .find(|r| r["workload"] == workload && r["configuration"] == configuration)
                .ok_or_else(|| Failed::from(format!("{workload}: no {configuration} row")))
        };
        let zdisk = row("zdisk zstd (dedup off)")?;
        positive(zdisk, "write_mb_s")?;
        let stored = positive(zdisk, "stored_bytes")?;
        ensure!(
            number(zdisk, "stored_with_metadata_bytes")? > stored,
            "{zdisk}"
        );
        // The estimate's prediction is the write path's own figure: only
        // the records of zero runs (nbdcopy sends zeroing requests) differ.
        let without = positive(row("zdisk estimate zstd, without dedup")?, "stored_bytes")?;
        ensure!(
            (without / stored - 1.0).abs() < 0.01,
            "{workload}: estimate {without}, zdisk stored {stored}"
        );
        let with = positive(row("zdisk estimate zstd, with dedup")?, "stored_bytes")?;
        ensure!(
            with < without,
            "{workload}: with dedup {with}, without {without}"
        );
        let btrfs = positive(row("btrfs compress-force=zstd:1")?, "stored_bytes")?;
        let duperemove = row("btrfs + duperemove -dr -b 4096")?;
        ensure!(
            positive(duperemove, "stored_bytes")? <= btrfs,
            "{workload}: duperemove grew btrfs: {duperemove}"
        );
        positive(duperemove, "duperemove_seconds")?;
        // The engine's dedup: within 10% of the estimate's prediction with
        // dedup (the index may miss a little, and zeroing runs differ), a
        // high share of the duplicates found, and far below dedup off.
        let on = row("zdisk zstd (dedup on)")?;
        let stored_on = positive(on, "stored_bytes")?;
        ensure!(
            stored_on < stored && (stored_on / with - 1.0).abs() < 0.1,
            "{workload}: dedup on stored {stored_on}, off {stored}, estimate {with}"
        );
        ensure!(number(on, "found_share")? >= 0.9, "{workload}: {on}");
        positive(on, "dedup_index_bytes")?;
        ensure!(
            number(row("zdisk lz4 (dedup on)")?, "stored_bytes")?
                < number(row("zdisk lz4 (dedup off)")?, "stored_bytes")?,
            "{workload}: lz4 with dedup stores no less"
        );
    }
    // The rates: each configuration wrote unique data, then its duplicate;
    // with dedup on, the duplicate was found.
    for configuration in ["zdisk lz4 (dedup on)", "zdisk zstd (dedup on)"] {
        let rate = rows
            .iter()
            .find(|r| r["workload"] == "rates" && r["configuration"] == configuration)
            .ok_or_else(|| format!("no rates row for {configuration}"))?;
        positive(rate, "unique_mb_s")?;
        positive(rate, "duplicate_mb_s")?;
        positive(rate, "unique_vs_dedup_off")?;
        ensure!(
            number(rate, "dedup_found")? >= (16384.0 * 0.9),
            "{configuration}: {rate}"
        );
    }
    // Two copies of one image, 1% of each overwritten: dedup keeps about half.
    let copies = rows
        .iter()
        .find(|r| {
            r["workload"] == "copies" && r["configuration"] == "zdisk estimate zstd, with dedup"
        })
        .ok_or("no copies estimate")?;
    let without = rows
        .iter()
        .find(|r| {
            r["workload"] == "copies" && r["configuration"] == "zdisk estimate zstd, without dedup"
        })
        .ok_or("no copies estimate")?;
    ensure!(
        number(copies, "stored_bytes")? < 0.6 * number(without, "stored_bytes")?,
        "{copies} against {without}"
    );
    Ok(Completion::Completed)
}

fn os_install() -> TestResult {
    if let Some(skip) = skip_unless(
        require_root_fuse_loop()
            .and(requires_python())
            .and(require_tools(&["nbdfuse", "fusermount3", "mkfs.ext4"])),
    ) {
        return skip;
    }
    let scratch = Scratch::new("script-os-install");
    let result = last_json(&script_zdisk(
        "os-install.py",
        &["--quick", "--dir", path_arg(&scratch.path)],
    )?)?;
    let host = positive(&result, "host_write_bytes")?;
    let tree = positive(&result, "tree_bytes")?;
    ensure!(
        host >= tree,
        "ext4 wrote {host} bytes for a {tree} byte tree"
    );
    // Documentation text compresses, so the drive programs fewer bytes
    // than the host sent it.
    let per_host = positive(&result, "media_per_host")?;
    ensure!(per_host < 1.0, "media / host = {per_host}: {result}");
    ensure!(
        positive(&result, "compression_ratio")? > 1.0,
        "no compression: {result}"
    );
    Ok(Completion::Completed)
}

fn kv_tables() -> TestResult {
    if let Some(skip) = skip_unless(requires_python()) {
        return skip;
    }
    let json = repo_file("docs/case-studies/kv-vs-rocksdb-5m.json");
    let text = script("kv-vs-rocksdb.py", &["--tables", path_arg(&json)])?;
    for row in [
        "| workload | kv ops/s | rocksdb-lz4 ops/s | rocksdb-none ops/s | kv ÷ rocksdb-lz4 |",
        "| C | 50 928 | 8 667 |",
        "| load (per pair) |",
        "| A, B, C, F, D together (per update or insert) |",
    ] {
        ensure!(text.contains(row), "no {row:?} in:\n{text}");
    }
    Ok(Completion::Completed)
}

fn rocksdb_installed() -> Result<(), String> {
    [
        "/usr/lib/x86_64-linux-gnu",
        "/usr/lib/aarch64-linux-gnu",
        "/usr/lib",
    ]
    .iter()
    .filter_map(|dir| std::fs::read_dir(dir).ok())
    .flatten()
    .filter_map(Result::ok)
    .any(|entry| {
        entry
            .file_name()
            .to_string_lossy()
            .starts_with("librocksdb.so")
    })
    .then_some(())
    .ok_or_else(|| "RocksDB's library is not installed (apt-get install rocksdb-tools)".into())
}

fn kv_vs_rocksdb() -> TestResult {
    if let Some(skip) = skip_unless(
        require_root_fuse_loop()
            .and(requires_python())
            .and(require_tools(&[
                "nbdfuse",
                "fusermount3",
                "mkfs.ext4",
                "fstrim",
            ]))
            .and(rocksdb_installed()),
    ) {
        return skip;
    }
    let scratch = Scratch::new("script-kv");
    let json = scratch.join("kv.jsonl");
    let text = script_zdisk(
        "kv-vs-rocksdb.py",
        &[
            "--quick",
            "--records",
            "20000",
            "--seconds",
            "1",
            "--json",
            path_arg(&json),
            "--dir",
            path_arg(&scratch.join("work")),
        ],
    )?;
    let rows: Vec<Value> = std::fs::read_to_string(&json)
        .map_err(|e| format!("{}: {e}", json.display()))?
        .lines()
        .map(serde_json::from_str)
        .collect::<Result<_, _>>()?;
    for engine in ["kv", "rocksdb-lz4", "rocksdb-none"] {
        for workload in ["load", "A", "B", "C", "F", "D"] {
            let row = rows
                .iter()
                .find(|r| r["engine"] == engine && r["workload"] == workload)
                .ok_or_else(|| format!("no {engine} {workload} row in {}", json.display()))?;
            positive(row, "ops_per_s")?;
            positive(row, "stored_bytes")?;
            positive(row, "mapped_bytes")?;
        }
    }
    ensure!(rows.len() == 18, "{} rows, not 18", rows.len());
    ensure!(
        text.contains("| C |") && text.contains("| load (per pair) |"),
        "the tables are missing:\n{text}"
    );
    Ok(Completion::Completed)
}

const FILLFACTORS: [u64; 4] = [100, 90, 75, 50];

fn pg_prerequisites() -> Result<(), String> {
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

/// pgbench at fillfactors 100, 90, 75 and 50 on ext4 on zdisk and on a
/// plain `nbdkit file` export: only sizes taken after the load are
/// asserted (they do not depend on the host's speed) — the database grows
/// as the fillfactor falls, zdisk's physical bytes barely move, the plain
/// export's grow with the database. About two minutes.
fn pg_fillfactor() -> TestResult {
    if let Some(skip) = skip_unless(pg_prerequisites()) {
        return skip;
    }
    let scratch = Scratch::new("script-pg");
    let json = scratch.join("pg.jsonl");
    script_zdisk(
        "pg-fillfactor.py",
        &[
            "--quick",
            "--json",
            path_arg(&json),
            "--dir",
            path_arg(&scratch.path),
        ],
    )?;
    // Its teardown leaves no mount behind (a stale ext4 or FUSE mount once
    // kept the baseline's nbdkit waiting 300 s on its connection).
    let mounts = std::fs::read_to_string("/proc/self/mounts")
        .map_err(|e| format!("/proc/self/mounts: {e}"))?;
    let left: Vec<&str> = mounts
        .lines()
        .filter(|line| line.contains(path_arg(&scratch.path)))
        .collect();
    ensure!(left.is_empty(), "mounts left behind: {left:?}");
    let text = std::fs::read_to_string(&json).map_err(|e| format!("{}: {e}", json.display()))?;
    let runs = text
        .lines()
        .map(serde_json::from_str)
        .collect::<Result<Vec<Value>, _>>()?;
    ensure!(runs.len() == 8, "{} runs, not 8", runs.len());
    let find = |baseline: bool, ff: u64| -> Result<&Value, Failed> {
        runs.iter()
            .find(|r| r["baseline"] == baseline && r["fillfactor"].as_u64() == Some(ff))
            .ok_or_else(|| format!("no run for baseline={baseline} FF={ff}").into())
    };
    for baseline in [false, true] {
        for ff in FILLFACTORS {
            let r = find(baseline, ff)?;
            for key in ["db_bytes", "mapped_bytes", "physical_bytes", "tps"] {
                positive(r, key)?;
            }
            if !baseline {
                // What zdisk wrote for the timed run.
                positive(r, "run_media_write_bytes")?;
                positive(r, "run_flushes")?;
            }
        }
        for pair in FILLFACTORS.windows(2) {
            for key in ["load_db_bytes", "db_bytes"] {
                let (higher_ff, lower_ff) = (find(baseline, pair[0])?, find(baseline, pair[1])?);
                ensure!(
                    number(lower_ff, key)? > number(higher_ff, key)?,
                    "baseline={baseline}: {key} does not grow from FF={} to FF={}",
                    pair[0],
                    pair[1]
                );
            }
        }
    }
    let load = |baseline: bool, ff: u64, key: &str| -> Result<f64, Failed> {
        number(find(baseline, ff)?, &format!("load_{key}"))
    };
    let db_growth = load(false, 50, "db_bytes")? / load(false, 100, "db_bytes")?;
    let zdisk_growth = load(false, 50, "physical_bytes")? / load(false, 100, "physical_bytes")?;
    let plain_growth = load(true, 50, "physical_bytes")? / load(true, 100, "physical_bytes")?;
    println!(
        "after the load, FF=50 against FF=100: database {db_growth:.2}x, \
         zdisk physical {zdisk_growth:.2}x, plain export physical {plain_growth:.2}x"
    );
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

/// 16 MiB of text (hexadecimal numbers, a few per block repeating):
/// compressible, to about two thirds, so that more than the 8 MiB cache is
/// stored and the cold read must fetch.
fn text_corpus() -> Vec<u8> {
    let mut out = Vec::with_capacity(16 << 20);
    for block in 0..4096u64 {
        let mut text = format!("block {block} ");
        while text.len() < 4096 {
            let word = (block * 2_654_435_761 + text.len() as u64) % 4093;
            text.push_str(&format!("{word:x} "));
        }
        out.extend_from_slice(&text.as_bytes()[..4096]);
    }
    out
}

fn tier_vs_local() -> TestResult {
    if let Some(skip) = skip_unless(Ceph::unavailable()) {
        return skip;
    }
    if let Some(skip) = skip_unless(require_tools(&["nbdcopy", "curl", "/usr/bin/python3"])) {
        return skip;
    }
    let scratch = Scratch::new("script-tier");
    let corpus = scratch.join("corpus.txt");
    std::fs::write(&corpus, text_corpus()).map_err(|e| e.to_string())?;
    let json = scratch.join("figures.json");
    let text = script_zdisk(
        "tier-vs-local.py",
        &[
            "--quick",
            "--dir",
            path_arg(&scratch.join("work")),
            "--corpus",
            path_arg(&corpus),
            "--cache",
            "8M",
            "--json",
            path_arg(&json),
        ],
    )?;
    ensure!(
        text.contains("cold read MB/s") && text.contains("per byte written"),
        "the table is missing:\n{text}"
    );
    let figures: Value = serde_json::from_slice(&std::fs::read(&json).map_err(|e| e.to_string())?)
        .map_err(|e| format!("bad JSON from the script: {e}"))?;
    let round = &figures["rounds"][0];
    ensure!(
        number(round, "corpus_bytes")? == (16 << 20) as f64,
        "corpus_bytes: {round}"
    );
    // The text compresses: fewer bytes are stored and uploaded than written,
    // and what is stored goes up about once.
    let per_written = positive(round, "uploaded_per_written_byte")?;
    let per_stored = positive(round, "uploaded_per_stored_byte")?;
    ensure!(
        per_written < 1.0,
        "uploaded per byte written {per_written}: {round}"
    );
    ensure!(
        (0.9..1.5).contains(&per_stored),
        "uploaded per byte stored {per_stored}: {round}"
    );
    positive(round, "tier_evicted_bytes")?;
    positive(round, "tier_cold_fetched_bytes")?;
    positive(round, "restore_fetched_bytes")?;
    for key in [
        "write_ratio",
        "cold_read_ratio",
        "restore_ratio",
        "restore_seconds",
    ] {
        positive(round, key)?;
    }
    ensure!(
        figures["median"]["cold_read_ratio"] == round["cold_read_ratio"],
        "one round's median is not that round's figure: {figures}"
    );
    Ok(Completion::Completed)
}
