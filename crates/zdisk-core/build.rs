//! Tells the crate's tests the optimisation level they were built with, so
//! that the crash simulator runs its full 2000 seeds in every optimised
//! build (release, and the `ci` profile with debug assertions on) and only
//! 40 in an unoptimised debug build.

fn main() {
    let level = std::env::var("OPT_LEVEL").unwrap_or_else(|_| "0".to_string());
    println!("cargo:rustc-env=ZDISK_OPT_LEVEL={level}");
    println!("cargo:rerun-if-changed=build.rs");
}
