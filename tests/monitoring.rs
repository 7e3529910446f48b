//! What people look at during a run: `run --tensorboard DIR`'s TensorBoard event files, read
//! back with autotp's reader, which reads a file TensorBoard's own writer made
//! (tests/fixtures/tensorboard, from make_tensorboard_fixture.py) exactly; and `run --trace`'s
//! Chrome/Perfetto timeline.

use std::path::{Path, PathBuf};

use autotp_train::tensorboard::{read_scalars, Scalar};

use crate::common::{autotp, fixture, scratch, success};

/// The event files under `dir`, in name order.
fn event_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .expect("the TensorBoard directory")
        .map(|entry| entry.expect("a directory entry").path())
        .filter(|path| path.file_name().is_some_and(|n| n.to_string_lossy().starts_with("events.out.tfevents.")))
        .collect();
    files.sort();
    files
}

#[test]
fn tensorboards_own_event_file_reads_back() {
    let scalars = read_scalars(&fixture("tensorboard", "events.out.tfevents.fixture")).expect("the fixture reads");
    let expected: Vec<serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(fixture("tensorboard", "scalars.json")).expect("scalars.json"))
            .expect("JSON");
    let expected: Vec<Scalar> = (expected.iter())
        .map(|s| Scalar {
            tag: s["tag"].as_str().expect("tag").to_string(),
            step: s["step"].as_i64().expect("step"),
            value: s["value"].as_f64().expect("value") as f32,
        })
        .collect();
    assert_eq!(scalars, expected);
    let damaged = scratch("tensorboard-damaged").join("events.out.tfevents.damaged");
    let mut bytes = std::fs::read(fixture("tensorboard", "events.out.tfevents.fixture")).expect("the fixture");
    let last = bytes.len() - 6;
    bytes[last] ^= 1;
    std::fs::write(&damaged, bytes).expect("a scratch file");
    let err = read_scalars(&damaged).expect_err("a damaged record").to_string();
    assert!(err.contains("is damaged (its CRC does not check)"), "{err}");
}

/// Every step's loss, learning rate, gradient norm, throughput and memory, and each
/// validation's loss, as the metrics file has them; a resumed run adds a second file.
#[test]
fn run_writes_each_steps_scalars() {
    let dir = scratch("tensorboard-run");
    let (events, metrics, save) = (dir.join("tb"), dir.join("metrics.jsonl"), dir.join("ckpt"));
    let corpus = fixture("hf_export", "corpus_megatron");
    let run = |steps: &str, extra: &[&str]| {
        let mut args = vec!["--micro-batch", "2"];
        args.extend(["--grad-clip", "1.0", "--data", corpus.to_str().unwrap_or_default(), "--split", "80,20,0"]);
        args.extend(["--steps", steps, "--eval-every", "2", "--tensorboard", events.to_str().unwrap_or_default()]);
        args.extend([
            "--metrics-out",
            metrics.to_str().unwrap_or_default(),
            "--save",
            save.to_str().unwrap_or_default(),
        ]);
        success(crate::common::train_hf_export(&[&args[..], extra].concat()));
    };
    run("4", &[]);
    let files = event_files(&events);
    assert_eq!(files.len(), 1, "{files:?}");
    let scalars = read_scalars(&files[0]).expect("autotp's event file reads");
    let of =
        |tag: &str| -> Vec<(i64, f32)> { scalars.iter().filter(|s| s.tag == tag).map(|s| (s.step, s.value)).collect() };
    let records: Vec<serde_json::Value> = (std::fs::read_to_string(&metrics).expect("metrics").lines())
        .map(|line| serde_json::from_str(line).expect("a JSON line"))
        .collect();
    let from_metrics = |key: &str| -> Vec<(i64, f32)> {
        (records.iter()).filter_map(|r| Some((r["step"].as_i64()?, r.get(key)?.as_f64()? as f32))).collect()
    };
    assert_eq!(of("train/loss"), from_metrics("loss"));
    assert_eq!(of("train/lr"), from_metrics("lr"));
    assert_eq!(of("train/grad_norm"), from_metrics("grad_norm"));
    assert_eq!(of("train/grad_norm").len(), 4);
    assert_eq!(of("validation/loss"), from_metrics("eval_loss"));
    assert_eq!(of("validation/loss").iter().map(|s| s.0).collect::<Vec<_>>(), [2, 4]);
    assert_eq!(of("validation/perplexity"), from_metrics("eval_perplexity"));
    assert_eq!(of("train/tokens_per_second").len(), 4);
    let device = of("memory/device_bytes");
    assert!(device.len() == 4 && device.iter().all(|&(_, bytes)| bytes > 0.0), "{device:?}");
    // The validation step's arena joins the training step's once it has run.
    assert!(device[1].1 > device[0].1, "{device:?}");
    assert!(of("memory/host_rss_bytes").iter().all(|&(_, bytes)| bytes > 0.0));

    run("6", &["--resume", save.to_str().unwrap_or_default()]);
    let files = event_files(&events);
    assert_eq!(files.len(), 2, "a resumed run writes a file of its own: {files:?}");
    let resumed: Vec<Scalar> = files.iter().flat_map(|f| read_scalars(f).expect("reads")).collect();
    let steps: Vec<i64> = resumed.iter().filter(|s| s.tag == "train/loss").map(|s| s.step).collect();
    assert_eq!(steps, [1, 2, 3, 4, 5, 6]);
}

/// `--trace` of a pp 2 x dp 2 ZeRO-3 run: valid Trace Event Format JSON with a process per rank
/// (named with its stage) and a thread per stream; GEMMs, generated kernels, all-gathers,
/// pipeline sends and receives and the optimizer in their lanes; each rank's compute lane one
/// span after another; the same lanes from ranks run as MPI processes.
#[test]
fn run_writes_a_chrome_trace_of_each_rank_and_stream() {
    let dir = scratch("trace");
    let model = fixture("hf_export", "model.onnx");
    let corpus = fixture("hf_export", "corpus_megatron");
    let plan = dir.join("plan.atp");
    let layout = ["--micro-batch", "1", "--pp", "2", "--dp", "2", "--zero", "3", "--grad-accum", "2"];
    let compile = [&["compile", model.to_str().unwrap_or_default(), "--seq-len", "16"][..], &layout];
    success(autotp(&[&compile.concat()[..], &["-o", plan.to_str().unwrap_or_default()]].concat()));
    let trace = |name: &str, extra: &[&str]| -> Vec<serde_json::Value> {
        let path = dir.join(name);
        let args = ["run", plan.to_str().unwrap_or_default(), "--data", corpus.to_str().unwrap_or_default()];
        let stderr = String::from_utf8_lossy(
            &autotp(&[&args[..], &["--steps", "4", "--trace", path.to_str().unwrap_or_default()], extra].concat())
                .stderr,
        )
        .into_owned();
        assert!(stderr.contains("(steps 2-3)"), "{stderr}");
        let json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).expect("the trace")).expect("the trace is JSON");
        json["traceEvents"].as_array().expect("traceEvents").clone()
    };
    for (name, extra) in [("threads.json", &[][..]), ("processes.json", &["--launch", "4"][..])] {
        let events = trace(name, extra);
        let names: Vec<&str> = (events.iter())
            .filter(|e| e["name"] == "process_name")
            .filter_map(|e| e["args"]["name"].as_str())
            .collect();
        assert_eq!(names, ["rank 0 (stage 0)", "rank 1 (stage 0)", "rank 2 (stage 1)", "rank 3 (stage 1)"], "{name}");
        let spans: Vec<&serde_json::Value> = events.iter().filter(|e| e["ph"] == "X").collect();
        for span in &spans {
            let (ts, dur) = (span["ts"].as_f64().expect("ts"), span["dur"].as_f64().expect("dur"));
            assert!(ts >= 0.0 && dur >= 0.0 && span["pid"].as_u64().expect("pid") < 4, "{span}");
        }
        let in_lane = |category: &str, lane: u64| spans.iter().any(|s| s["cat"] == category && s["tid"] == lane);
        assert!(in_lane("gemm", 0) && in_lane("generated", 0) && in_lane("optimizer", 0), "{name}");
        assert!(in_lane("collective", 1) && in_lane("wait", 0), "{name}: ZeRO-3's all-gathers and their waits");
        // Sends go out on the peer stream; a receive blocks the compute stream until it arrives.
        assert!(in_lane("send", 2) && in_lane("recv", 0), "{name}: the pipeline's messages");
        for rank in 0..4u64 {
            let mut compute: Vec<(f64, f64)> = (spans.iter())
                .filter(|s| s["pid"] == rank && s["tid"] == 0)
                .map(|s| (s["ts"].as_f64().unwrap_or(0.0), s["dur"].as_f64().unwrap_or(0.0)))
                .collect();
            compute.sort_by(|a, b| a.0.total_cmp(&b.0));
            // Chrome traces carry microseconds as decimals: allow their rounding.
            assert!(
                compute.windows(2).all(|w| w[0].0 + w[0].1 <= w[1].0 + 1e-3),
                "{name}: rank {rank}'s compute spans overlap"
            );
        }
    }
    let past = autotp(&[
        "run",
        plan.to_str().unwrap_or_default(),
        "--data",
        corpus.to_str().unwrap_or_default(),
        "--steps",
        "4",
        "--trace",
        dir.join("past.json").to_str().unwrap_or_default(),
        "--trace-steps",
        "5-6",
    ]);
    let err = crate::common::failure(past);
    assert!(err.contains("--trace-steps 5-6: this run trains steps 1-4"), "{err}");
}
