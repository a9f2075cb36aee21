//! What zdisk saves and where, seen from outside: `zdisk estimate`'s
//! prediction against what a real server stores after nbdcopy copies the
//! same file in, its prediction of 4 KiB deduplication on a file whose
//! content repeats, the `zdisk:compression` metadata context as nbdinfo
//! shows it, and `zdisk map` of a served image and of one at rest.
//!
//! The input mixes real files (a tar of /usr), zeros and random data. Each
//! test runs the real binary and real clients in a scratch directory; a
//! missing client makes the test report itself ignored with the reason.

mod support;

use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};

use libtest_mimic::{Arguments, Trial};

use support::*;

fn main() {
    let args = Arguments::from_args();
    let trials = vec![
        Trial::ignorable_test(
            "estimate_is_within_3_percent_of_what_nbdcopy_stores",
            estimate_matches_stored,
        ),
        Trial::ignorable_test(
            "estimate_reads_stdin_samples_and_refuses_bad_input",
            estimate_inputs,
        ),
        Trial::ignorable_test(
            "estimate_predicts_dedup_of_a_chunk_repeated_four_times",
            estimate_dedup,
        ),
        Trial::ignorable_test(
            "estimate_reads_a_block_device_and_leaves_it_as_it_was",
            estimate_block_device,
        ),
        Trial::ignorable_test(
            "nbdinfo_map_of_zdisk_compression_shows_zero_raw_and_compressed",
            nbdinfo_compression_map,
        ),
        Trial::ignorable_test(
            "zdisk_map_summarises_and_draws_a_served_and_a_resting_image",
            zdisk_map,
        ),
        Trial::ignorable_test(
            "nbdinfo_and_zdisk_map_show_blocks_that_share_their_content",
            shared_in_maps,
        ),
    ];
    libtest_mimic::run(&args, trials).exit();
}

/// Writes `path`: pieces of a /usr tar, zeros and random data, in turn,
/// about `tar_bytes` of tar, a quarter as much of zeros and of random.
fn mixed_input(path: &Path, tar_bytes: u64) -> Result<u64, Failed> {
    let tar = path.with_extension("tar");
    let script = format!(
        "tar cf - --one-file-system /usr 2>/dev/null | head -c {tar_bytes} > {}",
        tar.display()
    );
    run("sh", &["-c", &script])?;
    let tar_data = std::fs::read(&tar).map_err(|e| e.to_string())?;
    let _ = std::fs::remove_file(&tar);
    ensure!(
        tar_data.len() as u64 > tar_bytes / 2,
        "only {} bytes of /usr could be archived",
        tar_data.len()
    );
    let mut out = std::fs::File::create(path).map_err(|e| e.to_string())?;
    let pieces = 4;
    let piece = tar_data.len().div_ceil(pieces);
    // Odd sizes, so that pieces do not fall on unit windows.
    let side = piece / 4 + 1234;
    for (index, tar_piece) in tar_data.chunks(piece).enumerate() {
        out.write_all(tar_piece).map_err(|e| e.to_string())?;
        out.write_all(&vec![0u8; side]).map_err(|e| e.to_string())?;
        out.write_all(&pseudo_random(side, index as u64 + 1))
            .map_err(|e| e.to_string())?;
    }
    // Whole blocks: nbdcopy sends the server's minimum block size.
    let written = tar_data.len() + pieces * 2 * side;
    let tail = written.next_multiple_of(4096) - written;
    out.write_all(&vec![b't'; tail])
        .map_err(|e| e.to_string())?;
    drop(out);
    Ok(std::fs::metadata(path).map_err(|e| e.to_string())?.len())
}

fn estimate_json(args: &[&str]) -> Result<Vec<serde_json::Value>, Failed> {
    let mut all = vec!["estimate", "--json"];
    all.extend_from_slice(args);
    let output = zdisk(&all);
    ensure!(
        output.status.success(),
        "zdisk {all:?} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    stdout(&output)
        .lines()
        .map(|line| serde_json::from_str(line).map_err(|e| format!("{e}: {line}").into()))
        .collect()
}

fn field(value: &serde_json::Value, name: &str) -> Result<u64, Failed> {
    value[name]
        .as_u64()
        .ok_or_else(|| format!("no {name} in {value}").into())
}

fn estimate_matches_stored() -> TestResult {
    if let Some(skip) = skip_unless(require_tools(&["nbdcopy", "tar", "curl"])) {
        return skip;
    }
    let dir = Scratch::new("estimate");
    let input = dir.join("mixed.img");
    let len = mixed_input(&input, 160 << 20)?;
    let input_path = input.to_str().unwrap();
    for codec in ["lz4", "zstd"] {
        let predictions = estimate_json(&["--codec", codec, input_path])?;
        ensure!(
            predictions.len() == 1,
            "one object per codec: {predictions:?}"
        );
        let prediction = &predictions[0];
        let predicted = field(prediction, "physical_bytes")?;
        let zero_bytes = field(prediction, "zero_bytes")?;
        let raw_bytes = field(prediction, "incompressible_bytes")?;
        ensure!(
            field(prediction, "logical_bytes")? == len.div_ceil(4096) * 4096,
            "logical bytes: {prediction}"
        );
        // The zeros and the random data are seen for what they are.
        ensure!(
            zero_bytes >= len / 8 && raw_bytes >= len / 8,
            "{codec}: zeros {zero_bytes}, incompressible {raw_bytes} of {len}"
        );
        ensure!(
            prediction["compress_mb_s_per_core"].as_f64().unwrap_or(0.0) > 1.0,
            "{codec}: no speed in {prediction}"
        );

        let image = dir.join(&format!("{codec}.zdisk"));
        let output = zdisk(&[
            "create",
            image.to_str().unwrap(),
            "--logical",
            "1G",
            "--physical",
            "1G",
            "--codec",
            codec,
            // The estimate's figure without dedup is what is compared
            // (dedup.py compares the one with dedup).
            "--dedup",
            "off",
        ]);
        ensure!(
            output.status.success(),
            "create: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        let metrics = format!("127.0.0.1:{}", free_port());
        let mut server = Server::start(
            &image,
            &dir.join("sock"),
            &["--metrics", &metrics, "--recompress", "off"],
        )?;
        run("nbdcopy", &[input_path, &server.uri()])?;
        let stats = server.stats()?;
        server.stop()?;
        let physical_used = field(&stats, "physical_used_bytes")?;
        let stored = field(&stats, "stored_bytes")?;
        let error_used = predicted as f64 / physical_used as f64 - 1.0;
        let error_stored = predicted as f64 / stored as f64 - 1.0;
        println!(
            "{codec}: {len} bytes in; estimate {predicted}, physical_used_bytes {physical_used} \
             ({:+.2}%), stored_bytes {stored} ({:+.2}%)",
            100.0 * error_used,
            100.0 * error_stored
        );
        ensure!(
            error_used.abs() <= 0.03,
            "{codec}: estimate {predicted} vs physical_used_bytes {physical_used}"
        );
        ensure!(
            error_stored.abs() <= 0.005,
            "{codec}: estimate {predicted} vs stored_bytes {stored}"
        );
        let _ = std::fs::remove_file(&image);
    }
    Ok(Completion::Completed)
}

fn estimate_inputs() -> TestResult {
    let dir = Scratch::new("estimate-inputs");
    let input = dir.join("input.bin");
    let mut data = pseudo_random(3 << 20, 7);
    data.extend(std::iter::repeat_n(b'z', 5 << 20));
    data.extend(vec![0u8; (2 << 20) + 100]);
    std::fs::write(&input, &data).map_err(|e| e.to_string())?;
    let from_file = estimate_json(&["--codec", "lz4", input.to_str().unwrap()])?;

    // The same bytes through a pipe give the same figures.
    let mut child = Command::new(zdisk_bin())
        .args(["estimate", "--json", "--codec", "lz4", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| e.to_string())?;
    let mut stdin = child.stdin.take().expect("piped stdin");
    let feeder = std::thread::spawn(move || stdin.write_all(&data));
    let output = child.wait_with_output().map_err(|e| e.to_string())?;
    feeder.join().expect("feeder").map_err(|e| e.to_string())?;
    ensure!(
        output.status.success(),
        "estimate -: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let from_pipe: serde_json::Value =
        serde_json::from_str(stdout(&output).trim()).map_err(|e| e.to_string())?;
    for name in [
        "logical_bytes",
        "physical_bytes",
        "zero_bytes",
        "incompressible_bytes",
    ] {
        ensure!(
            field(&from_pipe, name)? == field(&from_file[0], name)?,
            "{name}: pipe {from_pipe} vs file {}",
            from_file[0]
        );
    }
    // A named pipe, as `<(...)` gives, is read as a stream.
    let fifo = dir.join("fifo");
    run("mkfifo", &[fifo.to_str().unwrap()])?;
    let writer = {
        let (input, fifo) = (input.clone(), fifo.clone());
        std::thread::spawn(move || std::fs::copy(&input, &fifo))
    };
    let from_fifo = estimate_json(&["--codec", "lz4", fifo.to_str().unwrap()])?;
    writer
        .join()
        .expect("fifo writer")
        .map_err(|e| e.to_string())?;
    ensure!(
        field(&from_fifo[0], "physical_bytes")? == field(&from_file[0], "physical_bytes")?,
        "fifo {} vs file {}",
        from_fifo[0],
        from_file[0]
    );
    ensure!(
        field(&from_file[0], "incompressible_bytes")? == 3 << 20,
        "random data: {}",
        from_file[0]
    );
    ensure!(
        field(&from_file[0], "zero_bytes")? == (2 << 20) + 4096,
        "zeros (the partial last block is padded with zeros): {}",
        from_file[0]
    );

    // A sample of a fifth compresses a fifth and scales up.
    let sampled = estimate_json(&["--sample", "20", "--codec", "lz4", input.to_str().unwrap()])?;
    ensure!(
        field(&sampled[0], "sampled_bytes")? == 2 << 20,
        "a fifth of ten 1 MiB pieces: {}",
        sampled[0]
    );
    ensure!(
        field(&sampled[0], "logical_bytes")? == field(&from_file[0], "logical_bytes")?,
        "{}",
        sampled[0]
    );

    // A unit size as serve takes it: lz4 blocks compressed alone.
    let alone = estimate_json(&[
        "--unit-max",
        "4K",
        "--codec",
        "lz4",
        input.to_str().unwrap(),
    ])?;
    ensure!(
        field(&alone[0], "unit_bytes")? == 4096 && field(&from_file[0], "unit_bytes")? == 8192,
        "units: {} vs {}",
        alone[0],
        from_file[0]
    );

    // Several codecs: one object each, ranked smallest first.
    let all = estimate_json(&[input.to_str().unwrap()])?;
    ensure!(all.len() == 4, "four default codecs: {all:?}");
    let sizes: Vec<u64> = all
        .iter()
        .map(|p| field(p, "physical_bytes"))
        .collect::<Result<_, _>>()?;
    ensure!(sizes.windows(2).all(|w| w[0] <= w[1]), "ranked: {sizes:?}");

    // The table, for people.
    let table = stdout(&run(
        zdisk_bin().to_str().unwrap(),
        &["estimate", "--codec", "zstd", input.to_str().unwrap()],
    )?);
    ensure!(
        table.contains("zstd:1") && table.contains("smallest: zstd:1"),
        "{table}"
    );

    one_line_error(&["estimate", dir.path.to_str().unwrap()], "is a directory")?;
    one_line_error(
        &["estimate", dir.join("missing").to_str().unwrap()],
        "cannot open",
    )?;
    one_line_error(
        &["estimate", "--sample", "0", input.to_str().unwrap()],
        "--sample",
    )?;
    one_line_error(
        &["estimate", "--codec", "brotli", input.to_str().unwrap()],
        "unknown codec",
    )?;
    Ok(Completion::Completed)
}

/// One random 1 MiB chunk written four times: dedup keeps the first copy
/// and a reference record for each other (the 1 MiB writes line up with
/// the copies), so it saves three quarters, which compression cannot.
fn estimate_dedup() -> TestResult {
    let dir = Scratch::new("estimate-dedup");
    let input = dir.join("repeated.bin");
    let chunk = pseudo_random(1 << 20, 25);
    std::fs::write(&input, chunk.repeat(4)).map_err(|e| e.to_string())?;
    let path = input.to_str().unwrap();
    let predictions = estimate_json(&["--codec", "zstd", path])?;
    let prediction = &predictions[0];
    let dedup = &prediction["dedup"];
    ensure!(
        field(dedup, "distinct_blocks")? == 256 && field(dedup, "duplicate_blocks")? == 768,
        "{prediction}"
    );
    ensure!(field(dedup, "sample_shift")? == 0, "{prediction}");
    ensure!(
        field(dedup, "ref_records")? == 3,
        "one per copy: {prediction}"
    );
    let without = field(prediction, "physical_bytes")?;
    let with = field(dedup, "physical_bytes")?;
    // The first copy as without dedup (random: stored raw), and three
    // reference records of 256 blocks: 48 bytes and 16 per block each.
    ensure!(
        without % 4 == 0 && with == without / 4 + 3 * (48 + 16 * 256),
        "without {without}, with {with}"
    );
    ensure!(
        field(dedup, "saved_bytes")? == without - with,
        "{prediction}"
    );
    let savings = dedup["savings_percent"].as_f64().unwrap_or(0.0);
    ensure!(
        (74.0..=75.0).contains(&savings),
        "about 75% saved: {prediction}"
    );
    ensure!(
        prediction["savings_percent"].as_f64().unwrap_or(1.0) <= 0.0,
        "random data does not compress: {prediction}"
    );

    let off = estimate_json(&["--dedup", "off", "--codec", "zstd", path])?;
    ensure!(off[0].get("dedup").is_none(), "--dedup off: {}", off[0]);
    ensure!(
        field(&off[0], "physical_bytes")? == without,
        "{} vs {prediction}",
        off[0]
    );

    let table = stdout(&run(
        zdisk_bin().to_str().unwrap(),
        &["estimate", "--codec", "zstd", path],
    )?);
    ensure!(
        table.contains("without dedup:")
            && table.contains("with dedup (4 KiB blocks; every block's fingerprint kept)")
            && table.contains("256 distinct and 768 duplicate"),
        "{table}"
    );
    // A budget too small for 256 fingerprints samples them, and says so.
    let sampled = stdout(&run(
        zdisk_bin().to_str().unwrap(),
        &["estimate", "--codec", "lz4", "--dedup-memory", "1K", path],
    )?);
    ensure!(sampled.contains("sampled 1/2^"), "{sampled}");
    let plain = stdout(&run(
        zdisk_bin().to_str().unwrap(),
        &["estimate", "--codec", "lz4", "--dedup", "off", path],
    )?);
    ensure!(!plain.contains("with dedup"), "{plain}");
    one_line_error(&["estimate", "--dedup", "maybe", path], "--dedup")?;
    one_line_error(&["estimate", "--dedup-memory", "lots", path], "lots")?;
    Ok(Completion::Completed)
}

fn estimate_block_device() -> TestResult {
    if let Some(skip) =
        skip_unless(require_tools(&["losetup"]).and_then(|_| require_root_fuse_loop()))
    {
        return skip;
    }
    let dir = Scratch::new("estimate-device");
    let backing = dir.join("backing.raw");
    let mut data = pseudo_random(2 << 20, 11);
    data.extend(std::iter::repeat_n(b'q', 6 << 20));
    std::fs::write(&backing, &data).map_err(|e| e.to_string())?;
    let device = stdout(&run(
        "losetup",
        &["-f", "--show", "--read-only", backing.to_str().unwrap()],
    )?)
    .trim()
    .to_string();
    struct Detach(String);
    impl Drop for Detach {
        fn drop(&mut self) {
            let _ = Command::new("losetup").args(["-d", &self.0]).status();
        }
    }
    let _detach = Detach(device.clone());
    let from_device = estimate_json(&["--codec", "zstd", &device])?;
    let from_file = estimate_json(&["--codec", "zstd", backing.to_str().unwrap()])?;
    for name in ["logical_bytes", "physical_bytes", "incompressible_bytes"] {
        ensure!(
            field(&from_device[0], name)? == field(&from_file[0], name)?,
            "{name}: device {} vs file {}",
            from_device[0],
            from_file[0]
        );
    }
    ensure!(
        field(&from_device[0], "logical_bytes")? == 8 << 20,
        "the device's size: {}",
        from_device[0]
    );
    let after = std::fs::read(&backing).map_err(|e| e.to_string())?;
    ensure!(after == data, "the device's data changed");
    Ok(Completion::Completed)
}

/// (offset, length, status) rows of `nbdinfo --map=CONTEXT`.
fn nbdinfo_map(context: &str, uri: &str) -> Result<Vec<(u64, u64, u32)>, Failed> {
    let map = stdout(&run("nbdinfo", &[&format!("--map={context}"), uri])?);
    let rows: Vec<(u64, u64, u32)> = map
        .lines()
        .filter_map(|line| {
            let mut parts = line.split_whitespace();
            Some((
                parts.next()?.parse().ok()?,
                parts.next()?.parse().ok()?,
                parts.next()?.parse().ok()?,
            ))
        })
        .collect();
    ensure!(!rows.is_empty(), "nbdinfo --map={context} printed {map:?}");
    Ok(rows)
}

fn nbdinfo_compression_map() -> TestResult {
    if let Some(skip) = skip_unless(require_tools(&["nbdinfo", "nbdcopy", "qemu-io"])) {
        return skip;
    }
    let dir = Scratch::new("compression-map");
    let image = dir.join("map.zdisk");
    let output = zdisk(&[
        "create",
        image.to_str().unwrap(),
        "--logical",
        "64M",
        "--codec",
        "zstd",
        // Its text repeats, which dedup would share (bit 13): this test
        // is about the other bits.
        "--dedup",
        "off",
    ]);
    ensure!(
        output.status.success(),
        "create: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    // [text 1M][random 1M][text 1M], then zeros and a trimmed hole.
    let mut data: Vec<u8> = b"zdisk:compression says how each extent is stored. "
        .iter()
        .cycle()
        .take(1 << 20)
        .copied()
        .collect();
    data.extend(pseudo_random(1 << 20, 3));
    data.extend_from_within(..1 << 20);
    let input = dir.join("input.bin");
    std::fs::write(&input, &data).map_err(|e| e.to_string())?;
    let server = Server::start(&image, &dir.join("sock"), &["--recompress", "off"])?;
    let uri = server.uri();
    run("nbdcopy", &[input.to_str().unwrap(), &uri])?;
    let qemu = run(
        "qemu-io",
        &[
            "-f",
            "raw",
            &uri,
            "-c",
            "write -z 4M 1M",
            "-c",
            "discard 2M 512k",
        ],
    )?;
    ensure!(
        !stdout(&qemu).contains("failed"),
        "qemu-io: {}",
        stdout(&qemu)
    );

    let rows = nbdinfo_map("zdisk:compression", &uri)?;
    let covered: u64 = rows.iter().map(|r| r.1).sum();
    ensure!(
        covered == 64 << 20,
        "the map covers {covered} bytes: {rows:?}"
    );
    // What covers each byte range, by kind (bits 0-3).
    let kind_at = |offset: u64| {
        rows.iter()
            .find(|(start, length, _)| *start <= offset && offset < start + length)
            .map(|row| row.2)
    };
    let kind = |status: u32| status & 0xf;
    let codec = |status: u32| status >> 4 & 0xf;
    let size_class = |status: u32| status >> 8 & 0xf;
    for offset in (0..1 << 20).step_by(64 << 10) {
        let status = kind_at(offset).ok_or("no row")?;
        ensure!(
            kind(status) == 3 && codec(status) == 2 && status & (1 << 12) != 0,
            "text at {offset} should be zstd units: {status:#x}"
        );
        ensure!(size_class(status) <= 1, "text is small: {status:#x}");
    }
    for offset in ((1 << 20)..(2 << 20)).step_by(64 << 10) {
        let status = kind_at(offset).ok_or("no row")?;
        ensure!(
            kind(status) == 2 && size_class(status) == 15,
            "random data at {offset} should be raw: {status:#x}"
        );
    }
    ensure!(kind_at(2 << 20) == Some(0), "trimmed: {rows:?}");
    ensure!(
        kind(kind_at((5 << 19) + 4096).ok_or("no row")?) == 3,
        "{rows:?}"
    );
    ensure!(kind_at(4 << 20) == Some(1), "zeroed: {rows:?}");
    ensure!(kind_at((4 << 20) + (1 << 20) - 1) == Some(1), "{rows:?}");
    ensure!(kind_at(6 << 20) == Some(0), "never written: {rows:?}");

    // base:allocation still answers as before, beside it.
    let base = nbdinfo_map("base:allocation", &uri)?;
    ensure!(
        base.first() == Some(&(0, 2 << 20, 0)),
        "base:allocation: {base:?}"
    );
    Ok(Completion::Completed)
}

fn zdisk_map() -> TestResult {
    if let Some(skip) = skip_unless(require_tools(&[
        "nbdinfo",
        "nbdcopy",
        "qemu-io",
        // The picture's text (fonts-dejavu-core).
        "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    ])) {
        return skip;
    }
    let dir = Scratch::new("zdisk-map");
    let image = dir.join("map.zdisk");
    let output = zdisk(&["create", image.to_str().unwrap(), "--logical", "64M"]);
    ensure!(
        output.status.success(),
        "create: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    // [text 8M][random 8M][text 8M]; then zeros at 24M and a trimmed hole at 4M.
    let text: Vec<u8> = b"zdisk map draws where the space goes; "
        .iter()
        .cycle()
        .take(8 << 20)
        .copied()
        .collect();
    let mut data = text.clone();
    data.extend(pseudo_random(8 << 20, 5));
    data.extend(&text);
    let input = dir.join("input.bin");
    std::fs::write(&input, &data).map_err(|e| e.to_string())?;
    let mut server = Server::start(&image, &dir.join("sock"), &["--recompress", "off"])?;
    let uri = server.uri();
    run("nbdcopy", &[input.to_str().unwrap(), &uri])?;
    run(
        "qemu-io",
        &[
            "-f",
            "raw",
            &uri,
            "-c",
            "write -z 24M 8M",
            "-c",
            "discard 4M 2M",
        ],
    )?;
    let png = dir.join("map.png");
    let served = stdout(&run(
        zdisk_bin().to_str().unwrap(),
        &["map", &uri, "--png", png.to_str().unwrap()],
    )?);
    println!("{served}");
    // The picture is a PNG of the drawn size.
    let bytes = std::fs::read(&png).map_err(|e| e.to_string())?;
    ensure!(
        bytes.starts_with(b"\x89PNG\r\n\x1a\n") && bytes.len() > 2000,
        "not a PNG: {} bytes",
        bytes.len()
    );
    let width = u32::from_be_bytes(bytes[16..20].try_into().unwrap());
    ensure!(width == 1000, "width {width}");
    ensure!(
        served.contains("64 MiB logical, 22 MiB written (8 MiB raw, 14 MiB compressed: lz4 14 MiB), 8 MiB zeros, 34 MiB holes"),
        "{served}"
    );
    // Regions of 4 MiB: text, half hole, random, zeros, unwritten.
    let region = |start: &str| {
        served
            .lines()
            .find(|line| line.starts_with(&format!("{start}..")))
            .map(|line| {
                line.split_whitespace()
                    .map(str::to_string)
                    .collect::<Vec<_>>()
            })
    };
    let columns = |start: &str| region(start).ok_or(format!("no region {start}: {served}"));
    ensure!(
        columns("0")?[3] == "100.0%",
        "text is 4:1+: {:?}",
        columns("0")?
    );
    ensure!(
        columns("4M")?[1] == "50.0%",
        "half trimmed: {:?}",
        columns("4M")?
    );
    ensure!(
        columns("8M")?[7] == "100.0%",
        "random is raw: {:?}",
        columns("8M")?
    );
    ensure!(
        columns("24M")?[2] == "100.0%",
        "zeros: {:?}",
        columns("24M")?
    );
    ensure!(
        columns("32M")?[1] == "100.0%",
        "unwritten: {:?}",
        columns("32M")?
    );

    // Served, the image is locked: the error says to ask the server.
    one_line_error(&["map", image.to_str().unwrap()], "zdisk map nbd://")?;
    one_line_error(
        &["map", &uri, "--png", dir.join("map.gif").to_str().unwrap()],
        "must end in .png",
    )?;
    server.stop()?;

    // At rest, the image gives the same map as its server did.
    let at_rest = stdout(&run(
        zdisk_bin().to_str().unwrap(),
        &["map", image.to_str().unwrap()],
    )?);
    // The same but for the name at the start and the picture's line.
    let body = |text: &str| {
        text.split_once(": ").map(|(_, rest)| {
            rest.lines()
                .filter(|line| !line.starts_with("picture:"))
                .collect::<Vec<_>>()
                .join("\n")
        })
    };
    ensure!(
        body(&at_rest) == body(&served),
        "at rest:\n{at_rest}\nserved:\n{served}"
    );
    one_line_error(
        &["map", dir.join("missing.zdisk").to_str().unwrap()],
        "does not exist",
    )?;
    Ok(Completion::Completed)
}

/// Deduplication through a real client: qemu-io writes the same 1 MiB of
/// distinct blocks at 0 and at 8 MiB, and at 16 MiB shifted by one block;
/// the copies are shared, not stored again (`zdisk stats`), and show the
/// shared bit (13) in `nbdinfo --map=zdisk:compression`, source and copies
/// alike, and `zdisk map` counts them. An image made with `--dedup off`
/// stores every copy.
fn shared_in_maps() -> TestResult {
    if let Some(skip) = skip_unless(require_tools(&["nbdinfo", "qemu-io"])) {
        return skip;
    }
    let dir = Scratch::new("shared-map");
    // 256 distinct, compressible blocks.
    let source = dir.join("source.bin");
    let text: Vec<u8> = (0..256)
        .flat_map(|block| {
            format!("block {block:>4} is stored once and named three times. ")
                .into_bytes()
                .into_iter()
                .cycle()
                .take(4096)
        })
        .collect();
    std::fs::write(&source, &text).map_err(|e| e.to_string())?;
    let source = source.to_str().ok_or("UTF-8 path")?.to_string();
    let mut stored = Vec::new();
    for dedup in ["on", "off"] {
        let image = dir.join(&format!("shared-{dedup}.zdisk"));
        let image_text = image.to_str().ok_or("UTF-8 path")?;
        let output = zdisk(&["create", image_text, "--logical", "64M", "--dedup", dedup]);
        ensure!(
            output.status.success(),
            "create: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        let mut server = Server::start(&image, &dir.join("sock"), &[])?;
        let uri = server.uri();
        let mut args = vec!["-f", "raw", uri.as_str()];
        let writes = [
            format!("write -q -s {source} 0 1M"),
            format!("write -q -s {source} 8M 1M"),
            format!("write -q -s {source} 16388K 1M"),
        ];
        for write in &writes {
            args.extend(["-c", write.as_str()]);
        }
        let output = run("qemu-io", &args)?;
        ensure!(output.status.success(), "qemu-io: {output:?}");
        let stats = zdisk(&["stats", image_text, "--json"]);
        let stats: serde_json::Value = serde_json::from_slice(&stats.stdout)
            .map_err(|e| format!("zdisk stats --json: {e}"))?;
        stored.push(stats["stored_bytes"].as_u64().ok_or("no stored_bytes")?);
        if dedup == "off" {
            ensure!(stats["shared_blocks"] == 0, "{stats}");
            server.stop()?;
            continue;
        }
        ensure!(
            stats["dedup"] == "on"
                && stats["shared_blocks"] == 768
                && stats["distinct_blocks"] == 256
                && stats["dedup_found"] == 512
                && stats["counters"]["dedup_blocks"] == 512,
            "{stats}"
        );
        let rows = nbdinfo_map("zdisk:compression", &uri)?;
        let status_at = |offset: u64| {
            rows.iter()
                .find(|(start, length, _)| *start <= offset && offset < start + length)
                .map(|row| row.2)
        };
        for offset in [0, 512 << 10, 8 << 20, (9 << 20) - 4096, 16388 << 10] {
            let status = status_at(offset).ok_or("no row")?;
            ensure!(
                status & 0xf == 3 && status & (1 << 13) != 0,
                "block at {offset} should be compressed and shared: {status:#x} in {rows:?}"
            );
        }
        let status = status_at(4 << 20).ok_or("no row")?;
        ensure!(status == 0, "never written: {status:#x}");
        server.stop()?;
        let resting = zdisk(&["map", image_text]);
        let text = String::from_utf8_lossy(&resting.stdout);
        ensure!(
            resting.status.success() && text.contains("shared: 3 MiB of that shares"),
            "zdisk map: {text} {}",
            String::from_utf8_lossy(&resting.stderr)
        );
    }
    ensure!(
        stored[0] * 2 < stored[1],
        "with dedup {} stored bytes, without {}",
        stored[0],
        stored[1]
    );
    Ok(Completion::Completed)
}
