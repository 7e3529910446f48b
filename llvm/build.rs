//! Hashes this crate's sources into `AUTOTP_CODEGEN_HASH`, part of every kernel's cache key, so
//! objects cached by an older code generator are never reused by a newer one.

use std::hash::Hasher;

fn main() {
    let mut files = Vec::new();
    sources(std::path::Path::new("src"), &mut files);
    files.sort();
    // FNV-1a over the file names and contents: a build script should not need a crypto crate.
    let mut hash = Fnv(0xcbf2_9ce4_8422_2325);
    for file in &files {
        println!("cargo:rerun-if-changed={}", file.display());
        hash.write(file.to_string_lossy().as_bytes());
        hash.write(&std::fs::read(file).expect("source readable"));
    }
    println!("cargo:rustc-env=AUTOTP_CODEGEN_HASH={:016x}", hash.finish());
}

/// Every file under `dir`, its subdirectories' included.
fn sources(dir: &std::path::Path, files: &mut Vec<std::path::PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("src exists").flatten() {
        let path = entry.path();
        if path.is_dir() {
            sources(&path, files);
        } else {
            files.push(path);
        }
    }
}

struct Fnv(u64);

impl Hasher for Fnv {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ b as u64).wrapping_mul(0x0100_0000_01b3);
        }
    }
}
