//! What a missing prerequisite does to a test (`support::skip_unless`):
//! outside CI a visible skip (the trial reports itself ignored, with the
//! reason); under `CI=true` a failure naming what is missing, unless
//! `ZDISK_CI_ALLOW_SKIP` lists it by a whole word of the reason; a broken
//! check (not "absent") a failure everywhere. The decisions are checked on
//! `support::skip_decision`, which `skip_unless` applies with this
//! process's environment, so the trials need no environment of their own.

mod support;

use libtest_mimic::{Arguments, Trial};

use support::*;

type TestFn = fn() -> TestResult;

fn main() {
    let args = Arguments::from_args();
    let tests: Vec<(&str, TestFn)> = vec![
        ("outside_ci_a_missing_tool_is_a_visible_skip", outside_ci),
        (
            "under_ci_a_missing_tool_fails_with_its_reason",
            under_ci_fails,
        ),
        ("under_ci_an_allowed_skip_still_skips", allowlist),
        ("a_broken_check_fails_everywhere", broken),
        ("require_tools_names_every_missing_tool", every_missing_tool),
    ];
    let trials = tests
        .into_iter()
        .map(|(name, test)| Trial::test(name, move || test().map(|_| ())))
        .collect();
    libtest_mimic::run(&args, trials).exit();
}

/// What an outcome says, for failure messages (libtest-mimic's types
/// have no `Debug`).
fn describe(outcome: &TestResult) -> String {
    match outcome {
        Ok(Completion::Completed) => "completed".into(),
        Ok(Completion::Ignored { reason }) => format!("ignored ({reason:?})"),
        Err(failed) => format!("failed ({:?})", failed.message()),
    }
}

fn words(list: &str) -> Vec<String> {
    list.split(',').map(str::to_string).collect()
}

fn outside_ci() -> TestResult {
    let reason = "qemu-img is not installed (run .ci/run)".to_string();
    let outcome = skip_decision(Unmet::Missing(reason.clone()), false, &[]);
    ensure!(
        matches!(&outcome, Ok(Completion::Ignored { reason: Some(r) }) if *r == reason),
        "outside CI: {}",
        describe(&outcome)
    );
    Ok(Completion::Completed)
}

fn under_ci_fails() -> TestResult {
    let outcome = skip_decision(
        Unmet::Missing("qemu-img, nbdinfo are not installed".into()),
        true,
        &words("fuse,loop"),
    );
    let Err(failed) = outcome else {
        return Err(format!("under CI a missing tool passed: {}", describe(&outcome)).into());
    };
    let message = failed.message().unwrap_or("");
    ensure!(
        message.contains("qemu-img, nbdinfo are not installed") && message.contains("CI=true"),
        "the failure does not say what is missing: {message}"
    );
    Ok(Completion::Completed)
}

fn allowlist() -> TestResult {
    let allowed = words("fuse,loop");
    for (reason, skips) in [
        ("needs /dev/fuse", true),
        ("needs loop devices (/dev/loop-control)", true),
        ("qemu-img is not installed", false),
        ("nbdfuse is not installed", false),
        ("needs root (for losetup and mount)", false),
    ] {
        let outcome = skip_decision(Unmet::Missing(reason.into()), true, &allowed);
        ensure!(
            matches!(outcome, Ok(Completion::Ignored { .. })) == skips,
            "{reason:?} with fuse,loop allowed: {}",
            describe(&outcome)
        );
    }
    ensure!(
        skip_allowed("qemu-img is not installed", &words("qemu-img")),
        "a tool's name allows its skip"
    );
    ensure!(
        !skip_allowed("qemu-img is not installed", &words("qemu")),
        "part of a word allows nothing"
    );
    ensure!(
        !skip_allowed("anything", &[]),
        "an empty allowlist allows nothing"
    );
    Ok(Completion::Completed)
}

fn broken() -> TestResult {
    for ci in [false, true] {
        let outcome = skip_decision(
            Unmet::Broken("ceph.sh check failed (exit status: 1)".into()),
            ci,
            &words("ceph"),
        );
        ensure!(
            outcome.is_err(),
            "a broken check passed (CI {ci}): {}",
            describe(&outcome)
        );
    }
    Ok(Completion::Completed)
}

fn every_missing_tool() -> TestResult {
    let Err(reason) = require_tools(&["sh", "zdisk-no-such-tool-a", "zdisk-no-such-tool-b"]) else {
        return Err("two absent tools were found".into());
    };
    ensure!(
        reason.contains("zdisk-no-such-tool-a, zdisk-no-such-tool-b are not installed"),
        "{reason}"
    );
    ensure!(!reason.contains("sh,"), "sh is installed: {reason}");
    ensure!(require_tools(&["sh"]).is_ok(), "sh is installed everywhere");
    Ok(Completion::Completed)
}
