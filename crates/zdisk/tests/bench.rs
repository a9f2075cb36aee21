//! End-to-end tests of `zdisk bench` through the real binary: every
//! scenario on a small emulated drive in virtual time, with its JSON keys
//! and charts; scenarios on a real image in real time; the threads
//! scenario on a RAM medium (its figures consistent with each other, never
//! its speed); bad arguments; and the chart of `scripts/pg-fillfactor.py`'s
//! results.
//!
//! Figures are asserted only where they are outputs of the drive model
//! (virtual time), never where they would time the host. A missing
//! prerequisite (the chart font) is reported as ignored, with the reason.

mod support;

use std::path::Path;

use libtest_mimic::{Arguments, Trial};
use serde_json::Value;

use support::*;

type TestFn = fn() -> TestResult;

fn main() {
    let args = Arguments::from_args();
    let tests: Vec<(&str, TestFn)> = vec![
        (
            "emulated_drive_runs_every_scenario_with_its_json_keys",
            emulated_scenarios,
        ),
        (
            "a_profile_recycles_at_its_controllers_pace_unless_told_otherwise",
            recycling_defaults,
        ),
        ("charts_are_drawn_as_svg_and_png", charts),
        (
            "the_pg_fillfactor_chart_is_drawn_from_the_scripts_json",
            pg_fillfactor_chart,
        ),
        ("an_image_is_benchmarked_in_real_time", image_scenarios),
        (
            "threads_on_a_ram_medium_reports_lock_figures_that_add_up",
            threads_scenario,
        ),
        (
            "bad_arguments_are_one_line_errors_and_touch_nothing",
            bad_arguments,
        ),
        (
            "bench_never_destroys_an_image_it_did_not_create",
            images_it_did_not_create,
        ),
    ];
    let trials = tests
        .into_iter()
        .map(|(name, test)| Trial::ignorable_test(name, test))
        .collect();
    libtest_mimic::run(&args, trials).exit();
}

/// Runs `zdisk bench` and returns its JSON lines, one object per scenario.
fn bench(args: &[&str], json: &Path) -> Result<Vec<Value>, Failed> {
    let mut all = vec!["bench", "--quiet", "--json", json.to_str().unwrap()];
    all.extend_from_slice(args);
    let output = zdisk(&all);
    ensure!(
        output.status.success(),
        "zdisk {all:?} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let text = std::fs::read_to_string(json)?;
    let objects = text
        .lines()
        .map(serde_json::from_str)
        .collect::<Result<Vec<Value>, _>>()?;
    Ok(objects)
}

fn scenario<'a>(objects: &'a [Value], name: &str) -> Result<&'a Value, Failed> {
    objects
        .iter()
        .find(|o| o["scenario"] == name)
        .ok_or_else(|| format!("no {name} object in {objects:?}").into())
}

fn number(value: &Value, key: &str) -> Result<f64, Failed> {
    value[key]
        .as_f64()
        .ok_or_else(|| format!("{key} is not a number in {value}").into())
}

fn emulated_scenarios() -> TestResult {
    let scratch = Scratch::new("bench-emulated");
    let json = scratch.join("out.json");
    let objects = bench(
        &[
            "--profile",
            "tiny",
            "--scenario",
            "sweep,dirty,file-copy,flush,qd",
            "--size",
            "1M",
            "--copy-source-mb-s",
            "20",
            "--pattern",
            "zeros",
            "--pattern",
            "random",
            "--pattern",
            "compressible:50",
        ],
        &json,
    )?;
    ensure!(objects.len() == 5, "one object per scenario: {objects:?}");

    // Sweep: one entry per pattern and direction, each with mb_s and iops.
    let sweep = scenario(&objects, "sweep")?;
    let results = sweep["results"].as_array().ok_or("sweep results")?;
    let entry = |pattern: &str, direction: &str| -> Result<&Value, Failed> {
        results
            .iter()
            .find(|r| r["pattern"] == pattern && r["direction"] == direction)
            .ok_or_else(|| format!("no sweep entry {pattern} {direction}").into())
    };
    for pattern in ["zeros", "random", "compressible:50"] {
        for direction in ["seq_write", "rand_write_4k", "seq_read", "rand_read_4k"] {
            let r = entry(pattern, direction)?;
            ensure!(
                number(r, "mb_s")? > 0.0 && number(r, "iops")? > 0.0,
                "{pattern} {direction}: {r}"
            );
        }
    }
    // Zeros take no NAND programs, so they outrun incompressible data, and
    // half-compressible data lies between (the tiny drive's compressor and
    // link are faster than its NAND).
    let seq = |pattern| -> Result<f64, Failed> { number(entry(pattern, "seq_write")?, "mb_s") };
    let (zeros, half, random) = (seq("zeros")?, seq("compressible:50")?, seq("random")?);
    ensure!(
        zeros > half && half > random,
        "sequential writes: zeros {zeros}, compressible:50 {half}, random {random}"
    );
    let random_wa = number(entry("random", "seq_write")?, "write_amplification")?;
    ensure!(
        (1.0..1.1).contains(&random_wa),
        "random data is stored raw: WA {random_wa}"
    );

    // Dirty: the keys scripts rely on.
    let dirty = scenario(&objects, "dirty")?;
    for key in [
        "clean_mb_s",
        "dirty_mb_s",
        "after_trim_mb_s",
        "write_amplification",
    ] {
        ensure!(number(dirty, key)? > 0.0, "dirty {key}: {dirty}");
    }
    // Virtual time needs no baseline: one drive, the states in sequence.
    ensure!(dirty["method"] == "sequential", "dirty method: {dirty}");

    // File copy: the same states, paced by the 20 MB/s source (the tiny
    // drive writes far faster), so no state can beat the source.
    let copy = scenario(&objects, "file-copy")?;
    ensure!(number(copy, "source_mb_s")? == 20.0, "file-copy: {copy}");
    for key in ["clean_mb_s", "dirty_mb_s", "after_trim_mb_s"] {
        let rate = number(copy, key)?;
        ensure!(rate > 10.0 && rate <= 20.0, "file-copy {key}: {copy}");
    }

    // Flush: without PLP every flush pads a page; with PLP nothing is padded.
    let flush = scenario(&objects, "flush")?;
    let runs = flush["results"].as_array().ok_or("flush results")?;
    let with = |plp: bool| -> Result<&Value, Failed> {
        runs.iter()
            .find(|r| r["plp"] == plp)
            .ok_or_else(|| format!("no flush run with plp={plp}").into())
    };
    ensure!(
        number(with(false)?, "padding_bytes")? > 0.0,
        "flush without PLP pads: {flush}"
    );
    ensure!(
        number(with(true)?, "padding_bytes")? == 0.0,
        "flush with PLP pads nothing: {flush}"
    );

    // Queue depths 1 to 32, each with a modelled read figure beside it.
    let qd = scenario(&objects, "qd")?;
    let depths: Vec<u64> = qd["results"]
        .as_array()
        .ok_or("qd results")?
        .iter()
        .filter_map(|r| r["queue_depth"].as_u64())
        .collect();
    ensure!(depths == [1, 2, 4, 8, 16, 32], "queue depths {depths:?}");
    for r in qd["results"].as_array().unwrap() {
        ensure!(
            number(r, "read_iops")? > 0.0 && number(r, "read_iops_model")? > 0.0,
            "qd entry {r}"
        );
    }
    Ok(Completion::Completed)
}

const FONTS: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
];

/// `--profile sf1200` recycles at the SF-1200's pace with no flag (the
/// drive as named), `--recycle-cap-mb-s 0` turns the cap off, and another
/// rate replaces it; the banner says which. A negative rate is
/// a one-line error.
fn recycling_defaults() -> TestResult {
    let banner = |extra: &[&str]| -> Result<String, Failed> {
        let mut args = vec![
            "bench",
            "--profile",
            "sf1200",
            "--physical",
            "256M",
            "--size",
            "1M",
            "--scenario",
            "flush",
            "--quiet",
        ];
        args.extend_from_slice(extra);
        let output = zdisk(&args);
        let stderr = String::from_utf8_lossy(&output.stderr);
        ensure!(output.status.success(), "zdisk {args:?}: {stderr}");
        let stdout = String::from_utf8_lossy(&output.stdout);
        Ok(stdout.lines().next().unwrap_or_default().to_string())
    };
    let default = banner(&[])?;
    ensure!(
        default.ends_with("recycling capped at 72.5 MB/s)"),
        "by default: {default}"
    );
    let off = banner(&["--recycle-cap-mb-s", "0"])?;
    ensure!(!off.contains("recycling"), "with 0: {off}");
    let other = banner(&["--recycle-cap-mb-s", "90"])?;
    ensure!(
        other.ends_with("recycling capped at 90 MB/s)"),
        "with 90: {other}"
    );
    one_line_error(
        &[
            "bench",
            "--profile",
            "sf1200",
            "--scenario",
            "flush",
            "--recycle-cap-mb-s=-5",
        ],
        "give a rate in MB/s, or 0 for no cap",
    )?;
    Ok(Completion::Completed)
}

fn require_font() -> Result<(), String> {
    if FONTS.iter().any(|f| Path::new(f).exists()) {
        Ok(())
    } else {
        Err("no DejaVu Sans font for chart text (fonts-dejavu-core; .ci/run installs it)".into())
    }
}

fn charts() -> TestResult {
    if let Some(skip) = skip_unless(require_font()) {
        return skip;
    }
    let scratch = Scratch::new("bench-charts");
    for (file, magic) in [("chart.svg", &b"<svg"[..]), ("chart.png", &b"\x89PNG"[..])] {
        let path = scratch.join(file);
        bench(
            &[
                "--profile",
                "tiny",
                "--scenario",
                "sweep,flush",
                "--size",
                "1M",
                "--plot",
                path.to_str().unwrap(),
            ],
            &scratch.join("out.json"),
        )?;
        let bytes = std::fs::read(&path)?;
        ensure!(
            bytes.windows(magic.len()).take(256).any(|w| w == magic),
            "{file} does not look like a chart ({} bytes)",
            bytes.len()
        );
        ensure!(bytes.len() > 1000, "{file} is nearly empty");
    }
    Ok(Completion::Completed)
}

/// `zdisk_bench::plot::pg_fillfactor`, which draws the chart of
/// `scripts/pg-fillfactor.py`'s JSON lines (the script itself needs root and
/// PostgreSQL: `scripts.rs`), in both formats.
fn pg_fillfactor_chart() -> TestResult {
    if let Some(skip) = skip_unless(require_font()) {
        return skip;
    }
    let scratch = Scratch::new("pg-chart");
    let mut runs = Vec::new();
    for (i, ff) in [100u64, 90, 75, 50].into_iter().enumerate() {
        for baseline in [false, true] {
            let db = 1e9 * 100.0 / ff as f64;
            runs.push(serde_json::json!({
                "fillfactor": ff, "baseline": baseline, "scale": 100, "clients": 4,
                "seconds": 180, "db_bytes": db, "mapped_bytes": db + 1e9,
                "physical_bytes": if baseline { db + 1e9 } else { 4e8 + 1e7 * i as f64 },
                "tps": 900.0 + 10.0 * i as f64,
            }));
        }
    }
    for (file, magic) in [("pg.svg", &b"<svg"[..]), ("pg.png", &b"\x89PNG"[..])] {
        let path = scratch.join(file);
        zdisk_bench::plot::pg_fillfactor(&runs, &path)?;
        let bytes = std::fs::read(&path)?;
        ensure!(
            bytes.windows(magic.len()).take(256).any(|w| w == magic),
            "{file} does not look like a chart ({} bytes)",
            bytes.len()
        );
        ensure!(bytes.len() > 1000, "{file} is nearly empty");
    }
    let svg = std::fs::read_to_string(scratch.join("pg.svg"))?;
    for label in ["FF 50", "zdisk: physical", "transactions/s"] {
        ensure!(svg.contains(label), "the SVG chart has no {label:?}");
    }
    Ok(Completion::Completed)
}

fn image_scenarios() -> TestResult {
    let scratch = Scratch::new("bench-image");
    let image = scratch.join("bench.zdisk");
    let objects = bench(
        &[
            "--image",
            image.to_str().unwrap(),
            "--scenario",
            "sweep,flush,dirty,file-copy",
            "--size",
            "2M",
            "--logical",
            "64M",
            "--physical",
            "80M",
            "--pattern",
            "random",
        ],
        &scratch.join("out.json"),
    )?;
    let sweep = scenario(&objects, "sweep")?;
    for r in sweep["results"].as_array().ok_or("sweep results")? {
        if r.get("mb_s").is_some() {
            ensure!(number(r, "mb_s")? > 0.0, "real-time entry {r}");
        }
    }
    // A 4 KiB file image pads nothing: its page is the block.
    let flush = scenario(&objects, "flush")?;
    ensure!(
        flush["results"].as_array().is_some_and(|r| !r.is_empty()),
        "flush results: {flush}"
    );
    // Dirty, in real time: three images measured in interleaved rounds
    // (2 MiB: two rounds of 1 MiB), the two baselines removed afterwards.
    let dirty = scenario(&objects, "dirty")?;
    ensure!(dirty["method"] == "interleaved", "dirty method: {dirty}");
    ensure!(dirty["rounds"] == 2, "dirty rounds: {dirty}");
    for state in ["clean", "dirty", "after_trim"] {
        let seconds = dirty["round_seconds"][state]
            .as_array()
            .ok_or_else(|| format!("round_seconds.{state}: {dirty}"))?;
        ensure!(
            seconds.len() == 2 && seconds.iter().all(|s| s.as_f64() > Some(0.0)),
            "round_seconds.{state}: {dirty}"
        );
    }
    for key in ["dirty_percent_of_clean", "after_trim_percent_of_clean"] {
        ensure!(number(dirty, key)? > 0.0, "dirty {key}: {dirty}");
        let per_round = &dirty[format!("{key}_per_round")];
        ensure!(
            number(per_round, "min")? <= number(per_round, "median")?
                && number(per_round, "median")? <= number(per_round, "max")?,
            "{key}_per_round: {dirty}"
        );
    }
    // File copy, in real time: paced by the default 160 MB/s source, so
    // however fast the host, no state beats the source.
    let copy = scenario(&objects, "file-copy")?;
    for key in ["clean_mb_s", "dirty_mb_s", "after_trim_mb_s"] {
        let rate = number(copy, key)?;
        ensure!(rate > 0.0 && rate <= 160.0, "file-copy {key}: {copy}");
    }
    ensure!(
        image.exists(),
        "the named image is left, dirty, for inspection"
    );
    for sibling in ["bench.clean.zdisk", "bench.trimmed.zdisk"] {
        ensure!(
            !scratch.join(sibling).exists(),
            "baseline image {sibling} was left behind"
        );
    }
    Ok(Completion::Completed)
}

/// Two thread counts of reads and of writes, briefly: every figure there,
/// the derived ones (speed-up, operation time, hold share, Amdahl ceiling)
/// those the counts give, and the summary line the runs' figures.
fn threads_scenario() -> TestResult {
    let scratch = Scratch::new("bench-threads");
    let objects = bench(
        &[
            "--memory",
            "--scenario",
            "threads",
            "--threads",
            "1,2",
            "--seconds",
            "0.3",
            "--size",
            "8M",
            "--logical",
            "64M",
            "--physical",
            "128M",
        ],
        &scratch.join("out.json"),
    )?;
    ensure!(
        objects.len() == 5,
        "{} JSON lines: {objects:?}",
        objects.len()
    );
    let find = |op: &str, threads: u64| -> Result<&Value, Failed> {
        objects
            .iter()
            .find(|o| o["op"] == op && o["threads"].as_u64() == Some(threads))
            .ok_or_else(|| format!("no {op} x{threads} line in {objects:?}").into())
    };
    for op in ["read", "write"] {
        let one_ops_s = number(find(op, 1)?, "ops_per_s")?;
        for threads in [1u64, 2] {
            let line = find(op, threads)?;
            ensure!(line["scenario"] == "threads", "{line}");
            let ops = number(line, "ops")?;
            let seconds = number(line, "seconds")?;
            ensure!(ops > 0.0 && seconds >= 0.3, "{line}");
            let ops_s = number(line, "ops_per_s")?;
            ensure!(
                (ops_s - ops / seconds).abs() <= 1e-6 * ops_s,
                "ops/s: {line}"
            );
            let speedup = number(line, "speedup")?;
            ensure!(
                (speedup - ops_s / one_ops_s).abs() <= 1e-9 * speedup,
                "speed-up against one thread: {line}"
            );
            let op_ns = number(line, "op_ns")?;
            ensure!(
                (op_ns * ops - threads as f64 * seconds * 1e9).abs() <= 1e-6 * op_ns * ops,
                "thread time per op: {line}"
            );
            ensure!(
                number(line, "lock_acquisitions_per_op")? >= 0.0
                    && number(line, "lock_wait_ns_per_op")? >= 0.0,
                "{line}"
            );
            let hold = number(line, "lock_hold_ns_per_op")?;
            let share = number(line, "lock_share")?;
            ensure!((share - hold / op_ns).abs() <= 1e-9, "hold share: {line}");
            // One lock, held by one thread at a time: at most the run's
            // wall time, shared among the threads.
            ensure!(
                (0.0..=1.0 / threads as f64 + 0.01).contains(&share),
                "hold share {share}: {line}"
            );
            if share > 0.0 {
                let ceiling = number(line, "amdahl_ceiling")?;
                ensure!(
                    (ceiling * share - 1.0).abs() < 1e-9,
                    "ceiling {ceiling} is not 1 / {share}"
                );
            } else {
                ensure!(line["amdahl_ceiling"].is_null(), "{line}");
            }
        }
    }
    let last = objects
        .iter()
        .find(|o| o.get("summary").is_some())
        .ok_or("no summary line")?;
    ensure!(
        number(last, "cpus")? >= 1.0 && number(last, "region_bytes")? == (8 << 20) as f64,
        "summary line {last}"
    );
    let summary = &last["summary"];
    for op in ["read", "write"] {
        ensure!(
            summary[format!("{op}_speedup_1_to_2")] == find(op, 2)?["speedup"]
                && summary[format!("{op}_amdahl_ceiling_1_thread")]
                    == find(op, 1)?["amdahl_ceiling"],
            "summary {summary} against the runs"
        );
    }
    Ok(Completion::Completed)
}

fn bad_arguments() -> TestResult {
    let scratch = Scratch::new("bench-bad");
    let precious = scratch.join("precious.txt");
    std::fs::write(&precious, b"not a zdisk image")?;
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["--scenario", "sweep"], "--profile"),
        (
            vec!["--profile", "tiny", "--scenario", "threads"],
            "give --memory or --image",
        ),
        (
            vec!["--memory", "--scenario", "threads", "--threads", "0"],
            "--threads",
        ),
        (
            vec!["--memory", "--profile", "tiny", "--scenario", "threads"],
            "cannot be used with",
        ),
        (
            vec!["--profile", "no-such-drive", "--scenario", "sweep"],
            "no-such-drive",
        ),
        (
            vec!["--profile", "tiny", "--scenario", "nonsense"],
            "nonsense",
        ),
        (
            vec![
                "--profile",
                "tiny",
                "--scenario",
                "sweep",
                "--pattern",
                "compressible:150",
            ],
            "compressible",
        ),
        (
            vec![
                "--profile",
                "tiny",
                "--scenario",
                "file-copy",
                "--copy-source-mb-s=-5",
            ],
            "copy-source",
        ),
        (
            vec!["--image", precious.to_str().unwrap(), "--scenario", "sweep"],
            "already exists",
        ),
        (
            vec![
                "--image",
                precious.to_str().unwrap(),
                "--scenario",
                "sweep",
                "--force",
            ],
            "not a zdisk image",
        ),
    ];
    for (args, expected) in cases {
        let mut all = vec!["bench", "--quiet"];
        all.extend_from_slice(&args);
        let output = zdisk(&all);
        let stderr = String::from_utf8_lossy(&output.stderr);
        ensure!(!output.status.success(), "zdisk {all:?} succeeded");
        ensure!(
            stderr.contains(expected),
            "zdisk {all:?}: expected {expected:?} in {stderr:?}"
        );
        ensure!(
            !stderr.contains("panicked"),
            "zdisk {all:?} panicked: {stderr}"
        );
    }
    ensure!(
        std::fs::read(&precious)? == b"not a zdisk image",
        "a file that is not an image was touched"
    );
    Ok(Completion::Completed)
}

/// Bench recreates its image for every scenario, so it must refuse what it
/// did not make: a served (locked) image even with --force, an existing
/// image or sibling without --force; and it names the files it creates.
fn images_it_did_not_create() -> TestResult {
    if let Some(skip) = skip_unless(require_tools(&["nbdcopy"])) {
        return skip;
    }
    let scratch = Scratch::new("bench-foreign");
    let served = scratch.join("served.zdisk");
    run(
        zdisk_bin().to_str().unwrap(),
        &["create", served.to_str().unwrap(), "--logical", "64M"],
    )?;
    let server = Server::start(&served, &scratch.join("s.sock"), &[])?;
    let data = scratch.join("data.bin");
    std::fs::write(&data, pseudo_random(4 << 20, 7))?;
    run("nbdcopy", &[data.to_str().unwrap(), &server.uri()])?;
    let args = |image: &Path, force: bool| {
        let mut all = vec![
            "bench".to_string(),
            "--quiet".into(),
            "--image".into(),
            image.to_str().unwrap().into(),
            "--scenario".into(),
            "dirty".into(),
            "--size".into(),
            "2M".into(),
            "--logical".into(),
            "64M".into(),
            "--physical".into(),
            "80M".into(),
        ];
        if force {
            all.push("--force".into());
        }
        all
    };
    for force in [false, true] {
        let all = args(&served, force);
        let output = zdisk(&all.iter().map(String::as_str).collect::<Vec<_>>());
        let stderr = String::from_utf8_lossy(&output.stderr);
        ensure!(!output.status.success(), "bench on a served image ran");
        let expected = if force { "in use" } else { "already exists" };
        ensure!(stderr.contains(expected), "bench said {stderr:?}");
    }
    let back = scratch.join("back.bin");
    run("nbdcopy", &[&server.uri(), back.to_str().unwrap()])?;
    ensure!(
        std::fs::read(&back)?[..4 << 20] == std::fs::read(&data)?[..],
        "the served image's data changed"
    );
    drop(server);

    // A sibling the user never named, left from before, is not deleted.
    let fresh = scratch.join("fresh.zdisk");
    let sibling = scratch.join("fresh.clean.zdisk");
    std::fs::write(&sibling, b"somebody's file")?;
    let all = args(&fresh, false);
    let output = zdisk(&all.iter().map(String::as_str).collect::<Vec<_>>());
    ensure!(!output.status.success(), "bench replaced a foreign sibling");
    ensure!(
        std::fs::read(&sibling)? == b"somebody's file",
        "the sibling was touched"
    );
    ensure!(!fresh.exists(), "a refused run created its image anyway");
    std::fs::remove_file(&sibling)?;

    // A fresh path: created, named in the output, siblings removed after.
    let output = zdisk(&all.iter().map(String::as_str).collect::<Vec<_>>());
    let stdout = String::from_utf8_lossy(&output.stdout);
    ensure!(
        output.status.success(),
        "bench failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    for name in ["fresh.zdisk", "fresh.clean.zdisk", "fresh.trimmed.zdisk"] {
        ensure!(
            stdout.contains(&format!("creating image {}", scratch.join(name).display())),
            "{name} not named in {stdout}"
        );
    }
    ensure!(
        stdout.contains(&format!("left {}", fresh.display())),
        "the image left behind is not named: {stdout}"
    );
    ensure!(!sibling.exists(), "the run's own sibling was left behind");
    // Run again on what it left: that needs --force now.
    let output = zdisk(&all.iter().map(String::as_str).collect::<Vec<_>>());
    ensure!(
        !output.status.success(),
        "bench replaced an earlier run's image"
    );
    let all = args(&fresh, true);
    let output = zdisk(&all.iter().map(String::as_str).collect::<Vec<_>>());
    ensure!(
        output.status.success(),
        "bench --force on its old image failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(Completion::Completed)
}
