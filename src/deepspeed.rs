//! `--deepspeed ds_config.json` on `compile` and `train`: the configuration's flags
//! ([`autotp_compiler::deepspeed`], which holds the table and every refusal) added to the command
//! line before clap parses it, with one warning listing the keys autotp does not implement.

use std::ffi::OsString;
use std::path::Path;

use anyhow::Result;
use autotp_compiler::deepspeed::{given, DeepSpeedConfig};

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
    let config = DeepSpeedConfig::read(Path::new(&path), command == Some("train"))?;
    if !config.ignored.is_empty() {
        tracing::warn!("--deepspeed {path}: autotp does not implement {}; they are ignored", config.ignored.join(", "));
    }
    let mut expanded = args;
    expanded.extend(config.additions(&words)?.into_iter().map(OsString::from));
    Ok(expanded)
}
