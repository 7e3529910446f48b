//! A DeepSpeed configuration (`--deepspeed ds_config.json` on `compile` and `train`) as
//! autotp's own flags. Each key autotp implements becomes the flag that does the same (the
//! table is `translate`); [`DeepSpeedConfig::additions`] gives the flags to add to a command
//! line, refusing a flag given there too with another value, and
//! [`CompileFlags::with_deepspeed`] the compile flags a command line and a file give together,
//! so everything downstream sees ordinary flags (and checks them as it checks typed ones). Keys
//! autotp does not implement are listed ([`DeepSpeedConfig::ignored`], one warning in the CLI);
//! schedulers other than DeepSpeed's warmup ones and `"auto"` values are refused (they would
//! change the run silently). Tests: tests/deepspeed.rs.

use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::{CompileError, CompileFlags};

/// Returns the formatted message as the error.
macro_rules! fail {
    ($($arg:tt)*) => {
        return Err(format!($($arg)*))
    };
}

/// A DeepSpeed configuration file read as autotp's flags.
#[derive(Debug)]
pub struct DeepSpeedConfig {
    pub path: PathBuf,
    /// The flags it asks for.
    pub flags: Vec<Translated>,
    /// Its keys autotp does not implement.
    pub ignored: Vec<String>,
}

impl DeepSpeedConfig {
    /// Reads the configuration at `path`. `run_flags`: the command also runs (`train`), so run
    /// flags (`steps_per_print`) apply.
    pub fn read(path: &Path, run_flags: bool) -> Result<DeepSpeedConfig, CompileError> {
        let text = std::fs::read_to_string(path).map_err(|source| CompileError::Io {
            flag: "--deepspeed",
            action: "read",
            path: path.to_path_buf(),
            source,
        })?;
        let refused = |message: String| CompileError::DeepSpeed { path: path.to_path_buf(), message };
        let config: Value = serde_json::from_str(&text).map_err(|e| refused(format!("is not JSON: {e}")))?;
        let (flags, ignored) = translate(&config, run_flags).map_err(refused)?;
        Ok(DeepSpeedConfig { path: path.to_path_buf(), flags, ignored })
    }

    /// The words to add to `command_line` (its words, the command's name first or not) for the
    /// file's flags: those it does not give already. A flag it gives with another value is
    /// refused, naming both.
    pub fn additions(&self, command_line: &[String]) -> Result<Vec<String>, CompileError> {
        let refused = |message: String| CompileError::DeepSpeed { path: self.path.clone(), message };
        let mut added = Vec::new();
        let mut seen: Vec<&str> = Vec::new();
        for t in &self.flags {
            if seen.contains(&t.flag) {
                return Err(refused(format!("sets {} twice (the last from {})", t.flag, t.key)));
            }
            seen.push(t.flag);
            match &t.value {
                None if command_line.iter().any(|w| w == t.flag) => {}
                None => added.push(t.flag.to_string()),
                Some(value) => match given(command_line, t.flag) {
                    // `--flag=V`: a value such as -1 would otherwise read as a flag of its own.
                    None => added.push(format!("{}={value}", t.flag)),
                    Some(on_line) if same(&on_line, value) => {}
                    Some(on_line) => {
                        return Err(refused(format!(
                            "{} {on_line} on the command line contradicts {} = {value} in the file",
                            t.flag, t.key
                        )))
                    }
                },
            }
        }
        Ok(added)
    }
}

impl CompileFlags {
    /// The compile flags that `command_line` (the words after `autotp compile`, as
    /// [`CompileFlags::parse_args`] takes them) and the DeepSpeed configuration at `path` give
    /// together.
    pub fn with_deepspeed(path: &Path, command_line: &[String]) -> Result<CompileFlags, CompileError> {
        let config = DeepSpeedConfig::read(path, false)?;
        let mut words = command_line.to_vec();
        words.extend(config.additions(command_line)?);
        CompileFlags::parse_args(&words)
    }
}

/// A flag the file asks for: `--name`, its value (`None` for a switch) and the key it comes from.
#[derive(Debug, PartialEq)]
pub struct Translated {
    pub flag: &'static str,
    pub value: Option<String>,
    pub key: String,
}

/// The flags `config` asks for, and the keys of it autotp does not implement. `run_flags`:
/// the command also runs (`train`), so run flags (`steps_per_print`) apply.
fn translate(config: &Value, run_flags: bool) -> Result<(Vec<Translated>, Vec<String>), String> {
    let Value::Object(top) = config else { fail!("a DeepSpeed configuration is a JSON object") };
    let mut flags = Vec::new();
    let mut ignored = Vec::new();
    let mut add = |flag: &'static str, value: Option<String>, key: &str| {
        flags.push(Translated { flag, value, key: key.to_string() })
    };
    for (key, value) in top {
        match key.as_str() {
            "train_batch_size" => add("--global-batch", Some(count(value, key)?), key),
            "train_micro_batch_size_per_gpu" => add("--micro-batch", Some(count(value, key)?), key),
            "gradient_accumulation_steps" => add("--grad-accum", Some(count(value, key)?), key),
            "gradient_clipping" => {
                if number(value, key)? > 0.0 {
                    add("--grad-clip", Some(text(value, key)?), key)
                }
            }
            "communication_data_type" => add("--comm-dtype", Some(dtype(value, key)?), key),
            // DeepSpeed-Ulysses: each sequence split over these ranks, attention's heads over them
            // all-to-all.
            "sequence_parallel_size" => {
                add("--cp", Some(count(value, key)?), key);
                add("--cp-comm-type", Some("a2a".into()), key);
            }
            "steps_per_print" if run_flags => add("--log-every", Some(count(value, key)?), key),
            "optimizer" => optimizer(value, &mut add, &mut ignored)?,
            "scheduler" => scheduler(value, &mut add, &mut ignored)?,
            "fp16" | "bf16" => {
                let section = object(value, key)?;
                if section.get("enabled").is_some_and(|e| e == &Value::Bool(true)) {
                    add("--precision", Some(key.to_string()), &format!("{key}.enabled"));
                    if key == "fp16" {
                        fp16(section, &mut add, &mut ignored)?;
                    } else {
                        ignored.extend(section.keys().filter(|k| *k != "enabled").map(|k| format!("{key}.{k}")));
                    }
                }
            }
            "data_types" => {
                for (k, v) in object(value, key)? {
                    match k.as_str() {
                        "grad_accum_dtype" => add("--grad-accum-dtype", Some(dtype(v, k)?), &format!("{key}.{k}")),
                        _ => ignored.push(format!("{key}.{k}")),
                    }
                }
            }
            "zero_optimization" => zero(value, &mut add, &mut ignored)?,
            "activation_checkpointing" => {
                // DeepSpeed checkpoints what the model's code asks for (Megatron: every layer);
                // autotp recomputes every layer from its input.
                add("--recompute", Some("full".into()), key);
                ignored.extend(object(value, key)?.keys().map(|k| format!("{key}.{k}")));
            }
            "tensor_parallel" => {
                for (k, v) in object(value, key)? {
                    match k.as_str() {
                        "autotp_size" => add("--tp", Some(count(v, k)?), &format!("{key}.{k}")),
                        _ => ignored.push(format!("{key}.{k}")),
                    }
                }
            }
            "pipeline" => {
                for (k, v) in object(value, key)? {
                    match (k.as_str(), v) {
                        ("stages", Value::Number(_)) => add("--pp", Some(count(v, k)?), &format!("{key}.{k}")),
                        _ => ignored.push(format!("{key}.{k}")),
                    }
                }
            }
            _ => ignored.push(key.clone()),
        }
    }
    // A scheduler's warmup_max_lr is the learning rate DeepSpeed trains at, not the optimizer's.
    if flags.iter().any(|t| t.flag == "--lr" && t.key.starts_with("scheduler.")) {
        flags.retain(|t| t.flag != "--lr" || t.key.starts_with("scheduler."));
    }
    Ok((flags, ignored))
}

/// `scheduler {type, params}`: WarmupLR, WarmupDecayLR or WarmupCosineLR as `--lr-schedule
/// warmup|warmup-decay|warmup-cosine` and their parameters.
fn scheduler(
    value: &Value,
    add: &mut impl FnMut(&'static str, Option<String>, &str),
    ignored: &mut Vec<String>,
) -> Result<(), String> {
    let section = object(value, "scheduler")?;
    let kind = section.get("type").and_then(Value::as_str).ok_or_else(|| "scheduler.type is missing".to_string())?;
    let schedule = match kind {
        "WarmupLR" => "warmup",
        "WarmupDecayLR" => "warmup-decay",
        "WarmupCosineLR" => "warmup-cosine",
        _ => fail!(
            "scheduler.type {kind}: autotp follows WarmupLR, WarmupDecayLR and WarmupCosineLR (or give --lr-schedule \
             constant|cosine)"
        ),
    };
    add("--lr-schedule", Some(schedule.into()), "scheduler.type");
    let params = match section.get("params") {
        Some(p) => object(p, "scheduler.params")?.clone(),
        None => serde_json::Map::new(),
    };
    for (k, v) in &params {
        let key = format!("scheduler.params.{k}");
        match (k.as_str(), schedule) {
            ("warmup_num_steps", _) => add("--warmup-steps", Some(count(v, &key)?), &key),
            ("warmup_type", _) => add("--warmup-type", Some(text(v, &key)?), &key),
            ("total_num_steps", "warmup-decay" | "warmup-cosine") => {
                add("--lr-decay-steps", Some(count(v, &key)?), &key)
            }
            ("warmup_min_lr", "warmup" | "warmup-decay") => add("--warmup-min-lr", Some(text(v, &key)?), &key),
            ("warmup_max_lr", "warmup" | "warmup-decay") => add("--lr", Some(text(v, &key)?), &key),
            ("warmup_min_ratio", "warmup-cosine") => add("--warmup-min-ratio", Some(text(v, &key)?), &key),
            ("cos_min_ratio", "warmup-cosine") => add("--cos-min-ratio", Some(text(v, &key)?), &key),
            _ => ignored.push(key),
        }
    }
    Ok(())
}

/// `optimizer {type, params}`: AdamW (DeepSpeed's `Adam` is AdamW unless `adam_w_mode` is
/// false) or SGD with their hyperparameters.
fn optimizer(
    value: &Value,
    add: &mut impl FnMut(&'static str, Option<String>, &str),
    ignored: &mut Vec<String>,
) -> Result<(), String> {
    let section = object(value, "optimizer")?;
    let kind = section.get("type").and_then(Value::as_str).ok_or_else(|| "optimizer.type is missing".to_string())?;
    let params = match section.get("params") {
        Some(p) => object(p, "optimizer.params")?.clone(),
        None => serde_json::Map::new(),
    };
    let name = match kind.to_ascii_lowercase().as_str() {
        "adamw" => "adamw",
        "adam" if params.get("adam_w_mode") != Some(&Value::Bool(false)) => "adamw",
        "sgd" => "sgd",
        _ => fail!("optimizer.type {kind}: autotp trains with AdamW (DeepSpeed's Adam, Adam with adam_w_mode) or SGD"),
    };
    add("--optimizer", Some(name.into()), "optimizer.type");
    for (k, v) in &params {
        let key = format!("optimizer.params.{k}");
        match k.as_str() {
            "lr" => add("--lr", Some(text(v, &key)?), &key),
            "eps" => add("--eps", Some(text(v, &key)?), &key),
            "weight_decay" => add("--weight-decay", Some(text(v, &key)?), &key),
            "momentum" => add("--momentum", Some(text(v, &key)?), &key),
            "nesterov" if v == &Value::Bool(true) => add("--nesterov", None, &key),
            "betas" => {
                let betas = v.as_array().filter(|b| b.len() == 2).ok_or_else(|| format!("{key} is two numbers"))?;
                let texts = betas.iter().map(|b| text(b, &key)).collect::<Result<Vec<_>, _>>()?;
                add("--betas", Some(texts.join(",")), &key)
            }
            "adam_w_mode" | "torch_adam" | "nesterov" => {}
            _ => ignored.push(key),
        }
    }
    Ok(())
}

/// `fp16`'s loss scaling keys (DeepSpeed's names are autotp's).
fn fp16(
    section: &serde_json::Map<String, Value>,
    add: &mut impl FnMut(&'static str, Option<String>, &str),
    ignored: &mut Vec<String>,
) -> Result<(), String> {
    for (k, v) in section {
        let key = format!("fp16.{k}");
        match k.as_str() {
            "enabled" => {}
            "loss_scale" => add("--loss-scale", Some(text(v, &key)?), &key),
            "initial_scale_power" => add("--initial-scale-power", Some(count(v, &key)?), &key),
            "loss_scale_window" => add("--loss-scale-window", Some(count(v, &key)?), &key),
            "hysteresis" => add("--hysteresis", Some(count(v, &key)?), &key),
            "min_loss_scale" => add("--min-loss-scale", Some(text(v, &key)?), &key),
            "consecutive_hysteresis" if v == &Value::Bool(true) => add("--consecutive-hysteresis", None, &key),
            "consecutive_hysteresis" => {}
            _ => ignored.push(key),
        }
    }
    Ok(())
}

/// `zero_optimization`: the stage, its buckets and thresholds, and the optimizer's and the
/// parameters' offload.
fn zero(
    value: &Value,
    add: &mut impl FnMut(&'static str, Option<String>, &str),
    ignored: &mut Vec<String>,
) -> Result<(), String> {
    let section = object(value, "zero_optimization")?;
    let offload =
        section.get("offload_optimizer").map(|o| object(o, "zero_optimization.offload_optimizer")).transpose()?;
    let device = offload.and_then(|o| o.get("device")).and_then(Value::as_str).unwrap_or("none");
    for (k, v) in section {
        let key = format!("zero_optimization.{k}");
        match k.as_str() {
            "stage" => add("--zero", Some(count(v, &key)?), &key),
            "reduce_bucket_size" => add("--reduce-bucket-size", Some(count(v, &key)?), &key),
            "stage3_prefetch_bucket_size" => add("--prefetch-bucket-size", Some(count(v, &key)?), &key),
            "stage3_max_live_parameters" => add("--max-live-params", Some(count(v, &key)?), &key),
            "stage3_param_persistence_threshold" => add("--param-persistence-threshold", Some(count(v, &key)?), &key),
            "sub_group_size" if device == "nvme" => add("--sub-group-size", Some(count(v, &key)?), &key),
            "offload_optimizer" => {
                for (o, ov) in offload.into_iter().flatten() {
                    let key = format!("{key}.{o}");
                    match (o.as_str(), device) {
                        ("device", "cpu" | "nvme") => add("--offload-optimizer", Some(device.into()), &key),
                        ("device", "none") => {}
                        ("device", other) => fail!("{key} {other}: autotp offloads to cpu or nvme"),
                        ("nvme_path", "nvme") => add("--nvme-path", Some(text(ov, &key)?), &key),
                        ("buffer_count", "nvme") => add("--buffer-count", Some(count(ov, &key)?), &key),
                        _ => ignored.push(key),
                    }
                }
            }
            "offload_param" => {
                let param = object(v, &key)?;
                let device = param.get("device").and_then(Value::as_str).unwrap_or("none");
                for (o, ov) in param {
                    let key = format!("{key}.{o}");
                    match (o.as_str(), device) {
                        ("device", "cpu" | "nvme") => add("--offload-param", Some(device.into()), &key),
                        ("device", "none") => {}
                        ("device", _) => fail!("{key} {ov}: autotp offloads parameters to cpu or nvme"),
                        ("nvme_path", "nvme") => add("--nvme-path", Some(text(ov, &key)?), &key),
                        ("buffer_count", "nvme") => add("--buffer-count", Some(count(ov, &key)?), &key),
                        ("buffer_size", "nvme") => add("--buffer-size", Some(count(ov, &key)?), &key),
                        ("max_in_cpu", "nvme") => add("--max-in-cpu", Some(count(ov, &key)?), &key),
                        _ => ignored.push(key),
                    }
                }
            }
            _ => ignored.push(key),
        }
    }
    Ok(())
}

fn object<'a>(value: &'a Value, key: &str) -> Result<&'a serde_json::Map<String, Value>, String> {
    value.as_object().ok_or_else(|| format!("{key} is a JSON object in DeepSpeed's configuration"))
}

/// A number as the flag takes it (JSON's spelling).
fn text(value: &Value, key: &str) -> Result<String, String> {
    match value {
        Value::Number(n) => Ok(n.to_string()),
        Value::String(s) if s == "auto" => {
            fail!("{key} is \"auto\", which the Hugging Face Trainer fills in: give the value")
        }
        Value::String(s) => Ok(s.clone()),
        other => fail!("{key} is {other}, not a number"),
    }
}

fn number(value: &Value, key: &str) -> Result<f64, String> {
    text(value, key)?.parse().map_err(|_| format!("{key} is not a number"))
}

/// A whole number (DeepSpeed writes sizes as `5e8`).
fn count(value: &Value, key: &str) -> Result<String, String> {
    let n = number(value, key)?;
    if !(n >= 0.0 && n.fract() == 0.0) {
        fail!("{key} is {n}, not a whole number");
    }
    Ok(format!("{}", n as u64))
}

/// DeepSpeed's dtype names (`fp32`, `fp16`, `bf16`) as autotp's.
fn dtype(value: &Value, key: &str) -> Result<String, String> {
    match value.as_str() {
        Some("fp32" | "float32" | "float") => Ok("f32".into()),
        Some("fp16" | "float16" | "half") => Ok("fp16".into()),
        Some("bf16" | "bfloat16") => Ok("bf16".into()),
        _ => fail!("{key} is {value}: one of fp32, fp16, bf16"),
    }
}

/// The value of `flag` on the command line (`--flag V` or `--flag=V`).
pub fn given(words: &[String], flag: &str) -> Option<String> {
    words.iter().enumerate().find_map(|(i, w)| match w.strip_prefix(flag) {
        Some("") => words.get(i + 1).cloned(),
        Some(rest) => rest.strip_prefix('=').map(str::to_string),
        None => None,
    })
}

/// Two spellings of one value: equal as numbers where both are.
fn same(a: &str, b: &str) -> bool {
    match (a.parse::<f64>(), b.parse::<f64>()) {
        (Ok(x), Ok(y)) => x == y,
        _ => a == b,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_written_as_floats_are_counts() {
        assert_eq!(count(&serde_json::json!(5e8), "k").unwrap(), "500000000");
        assert!(count(&serde_json::json!(1.5), "k").is_err());
        assert!(text(&serde_json::json!("auto"), "train_batch_size").unwrap_err().contains("\"auto\""));
    }

    /// A configuration's keys become the compile flags that do the same; a flag the command line
    /// gives too must agree with the file.
    #[test]
    fn a_deepspeed_config_gives_compile_flags() {
        let scratch = tempfile::tempdir().unwrap();
        let path = scratch.path().join("ds_config.json");
        let config = serde_json::json!({
            "train_micro_batch_size_per_gpu": 4,
            "gradient_accumulation_steps": 2,
            "sequence_parallel_size": 2,
            "zero_optimization": {"stage": 2, "reduce_bucket_size": 5e8},
            "bf16": {"enabled": true},
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95]}},
            "wall_clock_breakdown": false
        });
        std::fs::write(&path, config.to_string()).unwrap();
        let line = |extra: &[&str]| -> Vec<String> {
            ["model.onnx", "--seq-len", "32"].iter().chain(extra).map(|w| w.to_string()).collect()
        };
        let flags = CompileFlags::with_deepspeed(&path, &line(&["--dp", "2"])).unwrap();
        assert_eq!((flags.micro_batch, flags.grad_accum, flags.zero, flags.dp, flags.cp), (4, Some(2), 2, 2, 2));
        assert_eq!(flags.reduce_bucket_size, Some(500_000_000));
        assert_eq!((flags.lr, flags.betas.as_str()), (3e-4, "0.9,0.95"));
        assert_eq!(DeepSpeedConfig::read(&path, false).unwrap().ignored, ["wall_clock_breakdown"]);
        let Err(refused) = CompileFlags::with_deepspeed(&path, &line(&["--zero", "3"])) else {
            panic!("--zero 3 against stage 2 compiled")
        };
        let refused = refused.to_string();
        assert!(refused.contains("--zero 3 on the command line contradicts zero_optimization.stage = 2"), "{refused}");
    }
}
