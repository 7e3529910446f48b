//! The kernel and training tests at a second instruction-set level: on a host above x86-64-v3
//! (AVX-512), this binary runs them again as a child process with `AUTOTP_CPU_ISA=x86-64-v3`,
//! so the generated kernels use 8 lanes as on an AVX2-only machine (and the bf16 GEMMs widen to
//! f32 as there). A green run on one CPU is then a green run on the other.

use autotp_kernels::isa::{IsaLevel, ISA_VARIABLE};

/// The test modules whose results depend on the level: generated kernels, training (every step
/// runs them), mixed precision (bf16 GEMMs), fused attention (its generated passes) and this
/// module's check of the JIT's target.
const LEVEL_DEPENDENT: [&str; 5] = ["kernels::", "train::", "precision::", "isa::", "attention::"];

/// Inside the child: the JIT's vectors are the requested level's.
#[test]
fn the_jit_targets_the_active_level() {
    let level = IsaLevel::configured().expect("AUTOTP_CPU_ISA names a level this CPU has");
    assert!(level <= IsaLevel::host());
    assert_eq!(autotp_llvm::cpu::vector_width().unwrap(), level.f32_lanes());
    if std::env::var_os(ISA_VARIABLE).is_none() {
        assert_eq!(level, IsaLevel::host());
    }
}

/// A level the CLI cannot use is refused with one line naming the variable: an unknown one on
/// every host, and a level above the host's where there is one (not on an AVX-512 host).
#[test]
fn a_level_the_cpu_cannot_run_is_refused_by_the_cli() {
    let refused = |level: &str| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_autotp"))
            .args(["import", "missing.onnx"])
            .env(ISA_VARIABLE, level)
            .output()
            .unwrap();
        crate::common::failure(out)
    };
    let stderr = refused("avx2");
    assert!(stderr.contains(&format!("{ISA_VARIABLE}=avx2: not a level")), "{stderr}");
    match IsaLevel::ALL.into_iter().find(|&l| l > IsaLevel::host()) {
        Some(above) => {
            let stderr = refused(above.name());
            assert!(stderr.contains(&format!("{ISA_VARIABLE}={}: this CPU's level is", above.name())), "{stderr}");
        }
        None => {
            println!("this CPU is at the highest level autotp knows ({}): nothing above it", IsaLevel::host().name())
        }
    }
}

#[test]
fn kernel_and_training_tests_pass_at_x86_64_v3() {
    if std::env::var_os(ISA_VARIABLE).is_some() {
        println!("{ISA_VARIABLE} is set: this is the run at that level (or the user's choice)");
        return;
    }
    if IsaLevel::host() <= IsaLevel::V3 {
        println!("this CPU is at {}: the whole suite already runs at x86-64-v3 or below", IsaLevel::host().name());
        return;
    }
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(LEVEL_DEPENDENT)
        .env(ISA_VARIABLE, IsaLevel::V3.name())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let summary = stdout.lines().filter(|l| l.starts_with("test result:")).collect::<Vec<_>>().join("\n");
    assert!(out.status.success(), "at x86-64-v3:\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    println!("at x86-64-v3: {summary}");
}
