//! `--deepspeed ds_config.json` on `compile` and `train`: a DeepSpeed configuration as autotp's
//! own flags. Each key autotp implements becomes the flag that does the same (table in
//! [`translate`]); the flags are added to the command line before it is parsed, so everything
//! downstream sees ordinary flags (and checks them as it checks typed ones). A flag given on the
//! command line too must agree with the file, else the command is refused naming both; keys
//! autotp does not implement are listed in one warning; schedulers other than DeepSpeed's
//! warmup ones and `"auto"` values are refused (they would change the run silently).

use std::ffi::OsString;
use std::path::Path;

use anyhow::{bail, Context, Result};
use serde_json::Value;

/// A flag the file asks for: `--name`, its value (`None` for a switch) and the key it comes from.
#[derive(Debug, PartialEq)]
pub struct Translated {
    pub flag: &'static str,
    pub value: Option<String>,
    pub key: String,
}

/// The flags `config` asks for, and the keys of it autotp does not implement. `run_flags`:
/// the command also runs (`train`), so run flags (`steps_per_print`) apply.
pub fn translate(config: &Value, run_flags: bool) -> Result<(Vec<Translated>, Vec<String>)> {
    let Value::Object(top) = config else { bail!("a DeepSpeed configuration is a JSON object") };
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
) -> Result<()> {
    let section = object(value, "scheduler")?;
    let kind = section.get("type").and_then(Value::as_str).context("scheduler.type is missing")?;
    let schedule = match kind {
        "WarmupLR" => "warmup",
        "WarmupDecayLR" => "warmup-decay",
        "WarmupCosineLR" => "warmup-cosine",
        _ => bail!(
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
) -> Result<()> {
    let section = object(value, "optimizer")?;
    let kind = section.get("type").and_then(Value::as_str).context("optimizer.type is missing")?;
    let params = match section.get("params") {
        Some(p) => object(p, "optimizer.params")?.clone(),
        None => serde_json::Map::new(),
    };
    let name = match kind.to_ascii_lowercase().as_str() {
        "adamw" => "adamw",
        "adam" if params.get("adam_w_mode") != Some(&Value::Bool(false)) => "adamw",
        "sgd" => "sgd",
        _ => bail!("optimizer.type {kind}: autotp trains with AdamW (DeepSpeed's Adam, Adam with adam_w_mode) or SGD"),
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
                let betas = v.as_array().filter(|b| b.len() == 2).with_context(|| format!("{key} is two numbers"))?;
                let texts = betas.iter().map(|b| text(b, &key)).collect::<Result<Vec<_>>>()?;
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
) -> Result<()> {
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

/// `zero_optimization`: the stage, its buckets and thresholds, and the optimizer's offload.
fn zero(
    value: &Value,
    add: &mut impl FnMut(&'static str, Option<String>, &str),
    ignored: &mut Vec<String>,
) -> Result<()> {
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
                        ("device", other) => bail!("{key} {other}: autotp offloads to cpu or nvme"),
                        ("nvme_path", "nvme") => add("--nvme-path", Some(text(ov, &key)?), &key),
                        ("buffer_count", "nvme") => add("--buffer-count", Some(count(ov, &key)?), &key),
                        _ => ignored.push(key),
                    }
                }
            }
            _ => ignored.push(key),
        }
    }
    Ok(())
}

fn object<'a>(value: &'a Value, key: &str) -> Result<&'a serde_json::Map<String, Value>> {
    value.as_object().with_context(|| format!("{key} is a JSON object in DeepSpeed's configuration"))
}

/// A number as the flag takes it (JSON's spelling).
fn text(value: &Value, key: &str) -> Result<String> {
    match value {
        Value::Number(n) => Ok(n.to_string()),
        Value::String(s) if s == "auto" => {
            bail!("{key} is \"auto\", which the Hugging Face Trainer fills in: give the value")
        }
        Value::String(s) => Ok(s.clone()),
        other => bail!("{key} is {other}, not a number"),
    }
}

fn number(value: &Value, key: &str) -> Result<f64> {
    text(value, key)?.parse().with_context(|| format!("{key} is not a number"))
}

/// A whole number (DeepSpeed writes sizes as `5e8`).
fn count(value: &Value, key: &str) -> Result<String> {
    let n = number(value, key)?;
    if !(n >= 0.0 && n.fract() == 0.0) {
        bail!("{key} is {n}, not a whole number");
    }
    Ok(format!("{}", n as u64))
}

/// DeepSpeed's dtype names (`fp32`, `fp16`, `bf16`) as autotp's.
fn dtype(value: &Value, key: &str) -> Result<String> {
    match value.as_str() {
        Some("fp32" | "float32" | "float") => Ok("f32".into()),
        Some("fp16" | "float16" | "half") => Ok("fp16".into()),
        Some("bf16" | "bfloat16") => Ok("bf16".into()),
        _ => bail!("{key} is {value}: one of fp32, fp16, bf16"),
    }
}

/// The command line with `--deepspeed FILE`'s flags added (for `compile` and `train`; any
/// other command line is returned as it is). A flag the command line gives too must have the
/// file's value.
pub fn expand(args: Vec<OsString>) -> Result<Vec<OsString>> {
    let words: Vec<String> = args.iter().map(|a| a.to_string_lossy().into_owned()).collect();
    let command = words.get(1).map(String::as_str);
    if !matches!(command, Some("compile" | "train")) {
        return Ok(args);
    }
    let Some(path) = given(&words, "--deepspeed") else { return Ok(args) };
    let config: Value = {
        let text = std::fs::read_to_string(&path).with_context(|| format!("--deepspeed: cannot read {path}"))?;
        serde_json::from_str(&text).with_context(|| format!("--deepspeed {path} is not JSON"))?
    };
    let (flags, ignored) =
        translate(&config, command == Some("train")).with_context(|| format!("--deepspeed {path}"))?;
    if !ignored.is_empty() {
        tracing::warn!("--deepspeed {path}: autotp does not implement {}; they are ignored", ignored.join(", "));
    }
    let mut expanded = args;
    let mut seen: Vec<&str> = Vec::new();
    for t in &flags {
        if seen.contains(&t.flag) {
            bail!("--deepspeed {path} sets {} twice (the last from {})", t.flag, t.key);
        }
        seen.push(t.flag);
        match &t.value {
            None if words.iter().any(|w| w == t.flag) => {}
            None => expanded.push(t.flag.into()),
            Some(value) => match given(&words, t.flag) {
                // `--flag=V`: a value such as -1 would otherwise read as a flag of its own.
                None => expanded.push(OsString::from(format!("{}={value}", t.flag))),
                Some(on_line) if same(&on_line, value) => {}
                Some(on_line) => bail!(
                    "{} {on_line} on the command line contradicts {} = {value} in {}",
                    t.flag,
                    t.key,
                    Path::new(&path).display()
                ),
            },
        }
    }
    Ok(expanded)
}

/// The value of `flag` on the command line (`--flag V` or `--flag=V`).
fn given(words: &[String], flag: &str) -> Option<String> {
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
        assert!(text(&serde_json::json!("auto"), "train_batch_size").unwrap_err().to_string().contains("\"auto\""));
    }
}
