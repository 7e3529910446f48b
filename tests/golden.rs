//! Golden IR tests: each `tests/golden/*.ir` file holds
//!
//! ```text
//! # passes: recognize dce
//! graph "..." { ... }        <- input
//! # expect:
//! graph "..." { ... }        <- expected output of the passes
//! ```
//!
//! The runner parses and verifies the input, runs the passes, and compares the printed result
//! with the expectation (a mismatch prints both; `AUTOTP_BLESS=1` rewrites the expectation).
//! It also runs input and output through the reference evaluator on random data: a pass must
//! preserve what the graph computes.

use std::path::Path;

use autotp_passes::{dce::Dce, recognize::Recognize, Pass, PassManager};

use crate::common::{max_abs_diff, random_feed, repo};

fn pass_by_name(name: &str) -> Box<dyn Pass> {
    match name {
        "dce" => Box::new(Dce),
        "recognize" => Box::new(Recognize),
        other => panic!("unknown pass '{other}' in a golden file"),
    }
}

fn check(path: &Path) -> Result<(), String> {
    let text = std::fs::read_to_string(path).unwrap();
    let passes_line =
        text.lines().next().and_then(|l| l.strip_prefix("# passes:")).ok_or("first line must be '# passes: ...'")?;
    let (input, expected) = text.split_once("# expect:\n").ok_or("missing '# expect:' line")?;
    let input_graph = autotp_ir::text::parse(input).map_err(|e| format!("input: {e}"))?;
    autotp_ir::verify(&input_graph).map_err(|e| format!("input: {e}"))?;
    let manager = PassManager::new(passes_line.split_whitespace().map(pass_by_name).collect());
    let mut output = input_graph.clone();
    manager.run(&mut output).map_err(|e| e.to_string())?;
    let printed = autotp_ir::text::print(&output);
    if printed != expected {
        if std::env::var_os("AUTOTP_BLESS").is_some() {
            std::fs::write(path, format!("{input}# expect:\n{printed}")).unwrap();
        } else {
            return Err(format!("output differs from the expectation.\n--- expected\n{expected}--- got\n{printed}(AUTOTP_BLESS=1 rewrites it)"));
        }
    }
    let reparsed = autotp_ir::text::parse(&printed).map_err(|e| format!("output does not parse: {e}"))?;
    if reparsed != output {
        return Err("parse(print(output)) != output".into());
    }
    let (inputs, params) = random_feed(&input_graph, 7);
    let before = autotp_ir::eval::eval_graph(&input_graph, &params, &inputs).map_err(|e| e.to_string())?;
    let after = autotp_ir::eval::eval_graph(&output, &params, &inputs).map_err(|e| e.to_string())?;
    for ((name, _), (b, a)) in input_graph.outputs().iter().zip(before.iter().zip(&after)) {
        let (diff, scale) = max_abs_diff(a, b);
        if diff > 1e-5 * scale.max(1.0) {
            return Err(format!("output '{name}' changed by {diff} (scale {scale})"));
        }
    }
    Ok(())
}

#[test]
fn golden_files() {
    let dir = repo().join("tests/golden");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "ir"))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no golden files in {}", dir.display());
    let failures: Vec<String> =
        files.iter().filter_map(|f| check(f).err().map(|e| format!("{}: {e}", f.display()))).collect();
    assert!(
        failures.is_empty(),
        "{} of {} golden files failed:\n{}",
        failures.len(),
        files.len(),
        failures.join("\n\n")
    );
}
