//! zdisk-kv runs on any NBD export or block device, so it must not pull in
//! the engine, the NBD server or OpenSSL (issue #21): its NBD client comes
//! from `zdisk-nbd-wire`. Guarded by asking cargo itself: `cargo tree -p
//! zdisk-kv` (normal and build dependencies: what the library and the
//! binary link) must list zdisk-nbd-wire and none of zdisk-core,
//! zdisk-nbd, openssl or openssl-sys.

use std::process::Command;

#[test]
fn depends_on_neither_the_engine_nor_the_server_nor_openssl() {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_string());
    let manifest = concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml");
    let output = Command::new(cargo)
        .args([
            "tree",
            "--offline",
            "--prefix",
            "none",
            "--edges",
            "normal,build",
        ])
        .args(["--manifest-path", manifest, "--package", "zdisk-kv"])
        .output()
        .expect("run cargo tree");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "cargo tree failed: {stderr}");
    let tree = String::from_utf8(output.stdout).expect("UTF-8 from cargo tree");
    let packages: Vec<&str> = tree
        .lines()
        .filter_map(|line| line.split_whitespace().next())
        .collect();
    assert!(
        packages.contains(&"zdisk-nbd-wire"),
        "the NBD client's crate is missing:\n{tree}"
    );
    for forbidden in ["zdisk-core", "zdisk-nbd", "openssl", "openssl-sys"] {
        assert!(
            !packages.contains(&forbidden),
            "zdisk-kv depends on {forbidden}:\n{tree}"
        );
    }
}
