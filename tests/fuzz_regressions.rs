//! The fuzz targets' bodies (`fuzz/src/lib.rs`, run under libFuzzer by `scripts/fuzz.sh`) on
//! their committed corpora and on every input a fuzzer once crashed them with
//! (`fuzz/regressions/TARGET/`, each named after what it broke): none may panic.

use std::path::Path;

use crate::common::repo;

#[path = "../fuzz/src/lib.rs"]
#[allow(dead_code)]
mod harness;

/// Runs `body` on every file of `dir` (none when it does not exist); the number run.
fn run_all(target: &str, body: fn(&[u8]), dir: &Path) -> usize {
    let Ok(entries) = std::fs::read_dir(dir) else { return 0 };
    let mut files: Vec<_> = entries.map(|e| e.unwrap().path()).filter(|p| p.is_file()).collect();
    files.sort();
    for file in &files {
        let data = std::fs::read(file).unwrap();
        if std::panic::catch_unwind(|| body(&data)).is_err() {
            panic!("fuzz target {target} panics on {}", file.display());
        }
    }
    files.len()
}

#[test]
fn fuzz_regressions_and_corpora_do_not_panic() {
    let fuzz = repo().join("fuzz");
    let mut regressions = 0;
    for (target, body) in harness::TARGETS {
        let corpus = run_all(target, body, &fuzz.join("corpus").join(target));
        let found = run_all(target, body, &fuzz.join("regressions").join(target));
        println!("{target}: {corpus} corpus inputs, {found} regression inputs");
        regressions += found;
    }
    assert!(regressions > 0, "fuzz/regressions holds the inputs that crashed a target once");
    // The golden IR files, as the IR text target's seeds: each prints and parses back.
    let golden = run_all("ir_text", harness::ir_text, &repo().join("tests/golden"));
    assert!(golden > 50, "{golden} golden files");
}
