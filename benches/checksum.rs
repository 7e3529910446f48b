//! Benchmark: verifying a checkpoint's CRC-32C checksums (`TensorFile::verify`, what `run` does
//! as it loads a plan and as it resumes) against reading the same bytes without them (what
//! `--no-verify` leaves: one pass over the mapped file, summing its words so that the read is
//! not optimized away), in alternating rounds on one file of 2 GiB in the page cache, and the
//! file read from the disk once (`O_DIRECT`, 8 MiB reads) for the disk's own speed. Prints
//! GiB/s of each and the ratio of verify to the plain read.
//!
//!     cargo bench --bench checksum [-- DIR]     (the file is written in DIR, default the temp dir)

use std::collections::BTreeMap;
use std::io::Read;
use std::os::unix::fs::OpenOptionsExt;
use std::time::Instant;

use autotp_kernels::DType;
use autotp_program::tensor_file::{self, TensorFile, TensorRef};

const TENSORS: usize = 16;
const TENSOR_BYTES: usize = 128 << 20;
const ROUNDS: usize = 5;

fn gib_per_second(bytes: usize, seconds: f64) -> f64 {
    bytes as f64 / seconds / (1u64 << 30) as f64
}

fn main() {
    // cargo bench passes `--bench`; the first other argument names the directory.
    let dir = std::env::args()
        .skip(1)
        .find(|a| !a.starts_with("--"))
        .map_or_else(std::env::temp_dir, std::path::PathBuf::from);
    let path = dir.join(format!("autotp-checksum-bench-{}.safetensors", std::process::id()));
    let data: Vec<u8> = (0..TENSOR_BYTES).map(|i| (i.wrapping_mul(2654435761) >> 13) as u8).collect();
    let tensors: Vec<TensorRef> = (0..TENSORS)
        .map(|i| TensorRef { name: format!("t{i}"), dtype: DType::F32, shape: vec![TENSOR_BYTES / 4], bytes: &data })
        .collect();
    tensor_file::write(&path, &tensors, BTreeMap::new()).expect("the file is written");
    let total = TENSORS * TENSOR_BYTES;

    let mut direct = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(&path);
    let disk = match direct.as_mut() {
        Ok(file) => {
            let layout = std::alloc::Layout::from_size_align(8 << 20, 4096).expect("layout");
            // SAFETY: the buffer is allocated with the layout above and freed with it below.
            let buffer = unsafe { std::slice::from_raw_parts_mut(std::alloc::alloc(layout), 8 << 20) };
            let start = Instant::now();
            let mut read = 0;
            while let Ok(n) = file.read(buffer) {
                if n == 0 {
                    break;
                }
                read += n;
            }
            let seconds = start.elapsed().as_secs_f64();
            // SAFETY: allocated above with this layout.
            unsafe { std::alloc::dealloc(buffer.as_mut_ptr(), layout) };
            Some(gib_per_second(read, seconds))
        }
        Err(_) => None,
    };

    let (mut verify, mut plain) = (Vec::new(), Vec::new());
    for _ in 0..ROUNDS {
        let start = Instant::now();
        let file = TensorFile::open(&path).expect("the file opens");
        file.verify().expect("the checksums hold");
        verify.push(gib_per_second(total, start.elapsed().as_secs_f64()));

        let start = Instant::now();
        let file = TensorFile::open(&path).expect("the file opens");
        let mut sum = 0u64;
        for name in (0..TENSORS).map(|i| format!("t{i}")) {
            let bytes = file.get(&name).expect("the tensor").bytes;
            sum = bytes.chunks_exact(8).fold(sum, |s, w| s.wrapping_add(u64::from_le_bytes(w.try_into().expect("8"))));
        }
        std::hint::black_box(sum);
        plain.push(gib_per_second(total, start.elapsed().as_secs_f64()));
    }
    let _ = std::fs::remove_file(&path);
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (verify, plain) = (median(&mut verify), median(&mut plain));
    println!("checkpoint checksums: {} GiB in one file, {ROUNDS} rounds alternating, medians", total >> 30);
    println!("| read | GiB/s |");
    println!("|---|---|");
    match disk {
        Some(disk) => println!("| from the disk (O_DIRECT, 8 MiB reads) | {disk:.2} |"),
        None => println!("| from the disk | (O_DIRECT refused here) |"),
    }
    println!("| page cache, verified (CRC-32C of every tensor) | {verify:.2} |");
    println!("| page cache, not verified (--no-verify: one pass) | {plain:.2} |");
    println!("verify / plain read: {:.2}", verify / plain);
}
