//! TLS through the real binary and real clients, as an operator would set
//! it up: certificates made with GnuTLS's certtool, keys with psktool, and
//! libnbd (nbdinfo, nbdcopy, nbdsh), QEMU and nbd-client connecting over
//! `nbds://` with them.
//!
//! What must hold: data round-trips over TLS with X.509 and with PSK; a
//! wrong key, an unknown user, a missing client certificate under
//! `--tls-verify-peer`, and a plain-text client under `--tls require` are
//! all refused; bad TLS flags are one-line errors before anything starts.
//! Every client a test's name lists is required up front: a missing one
//! makes the whole test a reported skip (under `CI=true`, a failure naming
//! every missing tool), never a pass with that client's check left out.

mod support;

use libtest_mimic::{Arguments, Trial};

use support::*;

type TestFn = fn() -> TestResult;

fn main() {
    let args = Arguments::from_args();
    let tests: Vec<(&str, TestFn)> = vec![
        ("x509_with_nbdinfo_nbdcopy_libnbd_python_and_qemu", x509),
        (
            "client_certificates_verified_for_nbdinfo_and_nbd_client",
            verify_peer,
        ),
        ("psk_per_user_keys_and_refusals_with_nbdinfo_and_qemu", psk),
        ("bad_tls_flags_are_one_line_errors", bad_flags),
    ];
    let trials = tests
        .into_iter()
        .map(|(name, test)| Trial::ignorable_test(name, test))
        .collect();
    libtest_mimic::run(&args, trials).exit();
}

/// GnuTLS's tools, nbdinfo and nbdcopy, plus the `clients` a test names,
/// and libnbd's Python bindings if `python`: every one that is missing.
fn tls_tools(clients: &[&str], python: bool) -> Result<(), String> {
    let mut tools = vec!["certtool", "psktool", "nbdinfo", "nbdcopy"];
    tools.extend_from_slice(clients);
    let reasons: Vec<String> = [
        require_tools(&tools),
        if python { python_has_libnbd() } else { Ok(()) },
    ]
    .into_iter()
    .filter_map(Result::err)
    .collect();
    if reasons.is_empty() {
        Ok(())
    } else {
        Err(reasons.join("; "))
    }
}

/// Starts `zdisk serve` on a fresh image over TCP with `extra` flags.
fn tls_server(scratch: &Scratch, extra: &[&str]) -> Result<(Server, u16), Failed> {
    let image = scratch.join("tls.zdisk");
    let _ = std::fs::remove_file(&image);
    run(
        zdisk_bin().to_str().unwrap(),
        &["create", image.to_str().unwrap(), "--logical", "64M"],
    )?;
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let mut all = vec!["--listen", listen.as_str()];
    all.extend_from_slice(extra);
    Ok((Server::start_tcp(&image, &all)?, port))
}

/// Copies 8 MiB in and out through `uri`; fails unless it round-trips.
fn round_trip(scratch: &Scratch, uri: &str) -> Result<(), Failed> {
    let data = scratch.join("data.bin");
    std::fs::write(&data, pseudo_random(8 << 20, 3))?;
    run("nbdcopy", &[data.to_str().unwrap(), uri])?;
    let back = scratch.join("back.bin");
    run("nbdcopy", &[uri, back.to_str().unwrap()])?;
    ensure!(
        std::fs::read(&back)?[..8 << 20] == std::fs::read(&data)?[..],
        "data read back over TLS differs"
    );
    Ok(())
}

/// `qemu-img info` through QEMU's TLS object `creds` (id `tls0`); it must
/// see the 64 MiB export.
fn qemu_img_info(port: u16, creds: &str) -> Result<(), Failed> {
    let info = run(
        "qemu-img",
        &[
            "info",
            "--object",
            creds,
            "--image-opts",
            &format!("driver=nbd,host=localhost,port={port},tls-creds=tls0"),
        ],
    )?;
    ensure!(
        stdout(&info).contains("67108864"),
        "qemu-img: {}",
        stdout(&info)
    );
    Ok(())
}

/// Runs a client that must fail; returns its stderr.
fn refused(program: &str, args: &[&str]) -> Result<String, Failed> {
    let output = std::process::Command::new(program).args(args).output()?;
    ensure!(
        !output.status.success(),
        "{program} {args:?} succeeded but should have been refused"
    );
    Ok(String::from_utf8_lossy(&output.stderr).into_owned())
}

/// A fresh PKI and a server requiring TLS with its certificates.
fn pki_server(name: &str, verify_peer: bool) -> Result<(Scratch, Server, u16), Failed> {
    let scratch = Scratch::new(name);
    make_pki(&scratch.path)?;
    let server_dir = scratch.join("server");
    let mut flags = vec![
        "--tls",
        "require",
        "--tls-certificates",
        server_dir.to_str().unwrap(),
    ];
    if verify_peer {
        flags.push("--tls-verify-peer");
    }
    let (server, port) = tls_server(&scratch, &flags)?;
    Ok((scratch, server, port))
}

fn x509() -> TestResult {
    if let Some(skip) = skip_unless(tls_tools(&["qemu-img"], true)) {
        return skip;
    }
    let (scratch, server, port) = pki_server("tls-x509", false)?;
    let client_dir = scratch.join("client-nocert");
    let uri = format!(
        "nbds://localhost:{port}/?tls-certificates={}",
        client_dir.display()
    );
    let size = run("nbdinfo", &["--size", &uri])?;
    ensure!(
        stdout(&size).trim() == "67108864",
        "nbdinfo: {}",
        stdout(&size)
    );
    round_trip(&scratch, &uri)?;
    // libnbd's Python bindings (nbdsh's engine), over the same URI.
    let script = "import nbd, sys\nh = nbd.NBD()\nh.set_uri_allow_local_file(True)\nh.connect_uri(sys.argv[1])\nassert h.get_size() == 64 << 20\nh.pwrite(b'tls!' * 1024, 4096)\nh.flush()\nassert h.pread(4096, 4096) == b'tls!' * 1024\nprint(h.get_protocol())\n";
    python(script, &[&uri])?;
    // A plain-text client is refused under require, and says why.
    let plain = refused("nbdinfo", &[&format!("nbd://localhost:{port}/")])?;
    ensure!(
        plain.contains("TLS") || plain.contains("not supported"),
        "plain client: {plain}"
    );
    qemu_img_info(
        port,
        &format!(
            "tls-creds-x509,id=tls0,endpoint=client,dir={}",
            client_dir.display()
        ),
    )?;
    let log = server.log();
    ensure!(log.contains("TLS: TLSv1"), "no TLS session logged:\n{log}");
    Ok(Completion::Completed)
}

fn verify_peer() -> TestResult {
    if let Some(skip) = skip_unless(tls_tools(&["nbd-client"], false)) {
        return skip;
    }
    let (scratch, server, port) = pki_server("tls-verify", true)?;
    let with_cert = format!(
        "nbds://localhost:{port}/?tls-certificates={}",
        scratch.join("client").display()
    );
    run("nbdinfo", &["--size", &with_cert])?;
    let without = format!(
        "nbds://localhost:{port}/?tls-certificates={}",
        scratch.join("client-nocert").display()
    );
    refused("nbdinfo", &["--size", &without])?;
    // nbd-client's TLS needs no kernel module in list mode.
    let client = scratch.join("client");
    let list = run(
        "nbd-client",
        &[
            "-certfile",
            client.join("client-cert.pem").to_str().unwrap(),
            "-keyfile",
            client.join("client-key.pem").to_str().unwrap(),
            "-cacertfile",
            client.join("ca-cert.pem").to_str().unwrap(),
            "-tlshostname",
            "localhost",
            "-l",
            "localhost",
            &port.to_string(),
        ],
    )?;
    ensure!(
        stdout(&list).contains("zdisk"),
        "nbd-client -l: {}",
        stdout(&list)
    );
    let log = server.log();
    ensure!(
        log.contains("client certificate") && log.contains("client.example.com"),
        "the verified client is not logged:\n{log}"
    );
    ensure!(
        log.contains("TLS handshake failed"),
        "the refusal is not logged:\n{log}"
    );
    Ok(Completion::Completed)
}

fn psk() -> TestResult {
    if let Some(skip) = skip_unless(tls_tools(&["qemu-img"], false)) {
        return skip;
    }
    let scratch = Scratch::new("tls-psk");
    let keys = scratch.join("keys.psk");
    let other = scratch.join("other.psk");
    for (file, user) in [(&keys, "alice"), (&keys, "bob"), (&other, "alice")] {
        run("psktool", &["-u", user, "-p", file.to_str().unwrap()])?;
    }
    let (server, port) = tls_server(
        &scratch,
        &["--tls", "require", "--tls-psk", keys.to_str().unwrap()],
    )?;
    for user in ["alice", "bob"] {
        let uri = format!(
            "nbds://{user}@localhost:{port}/?tls-psk-file={}",
            keys.display()
        );
        let size = run("nbdinfo", &["--size", &uri])?;
        ensure!(
            stdout(&size).trim() == "67108864",
            "{user}: {}",
            stdout(&size)
        );
    }
    round_trip(
        &scratch,
        &format!(
            "nbds://alice@localhost:{port}/?tls-psk-file={}",
            keys.display()
        ),
    )?;
    // alice's key from another file is wrong; carol is nobody.
    refused(
        "nbdinfo",
        &[&format!(
            "nbds://alice@localhost:{port}/?tls-psk-file={}",
            other.display()
        )],
    )?;
    std::fs::write(
        scratch.join("carol.psk"),
        "carol:00112233445566778899aabbccddeeff\n",
    )?;
    refused(
        "nbdinfo",
        &[&format!(
            "nbds://carol@localhost:{port}/?tls-psk-file={}",
            scratch.join("carol.psk").display()
        )],
    )?;
    refused("nbdinfo", &[&format!("nbd://localhost:{port}/")])?;
    // QEMU reads DIR/keys.psk.
    qemu_img_info(
        port,
        &format!(
            "tls-creds-psk,id=tls0,endpoint=client,dir={},username=bob",
            scratch.path.display()
        ),
    )?;
    let log = server.log();
    for expected in [
        "PSK user \"alice\"",
        "PSK user \"bob\"",
        "TLS handshake failed",
    ] {
        ensure!(
            log.contains(expected),
            "{expected:?} not in the log:\n{log}"
        );
    }
    Ok(Completion::Completed)
}

fn bad_flags() -> TestResult {
    let scratch = Scratch::new("tls-flags");
    let image = scratch.join("flags.zdisk");
    let missing = scratch.join("nothing-here");
    let bad_psk = scratch.join("bad.psk");
    std::fs::write(&bad_psk, "alice:not-hex\n")?;
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["--tls", "require"], "needs credentials"),
        (vec!["--tls", "maybe"], "unknown TLS mode"),
        (
            vec!["--tls-certificates", missing.to_str().unwrap()],
            "ca-cert.pem is missing",
        ),
        (
            vec!["--tls-psk", bad_psk.to_str().unwrap()],
            "not hexadecimal",
        ),
        (vec!["--tls-psk", missing.to_str().unwrap()], "cannot read"),
        (
            vec!["--tls", "off", "--tls-psk", bad_psk.to_str().unwrap()],
            "contradicts",
        ),
        (vec!["--tls-verify-peer"], "needs --tls-certificates"),
        (vec!["--max-connections", "0"], "positive"),
        (vec!["--reply-timeout=0"], "seconds"),
    ];
    for (extra, expected) in cases {
        let mut all = vec!["serve", image.to_str().unwrap(), "--listen", "127.0.0.1:0"];
        all.extend_from_slice(&extra);
        one_line_error(&all, expected)?;
        ensure!(
            !image.exists(),
            "serve {extra:?} created the image before failing"
        );
    }
    Ok(Completion::Completed)
}
