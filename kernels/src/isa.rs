//! The x86-64 instruction-set level that autotp's own CPU code runs at: the JIT's target
//! (`autotp-llvm`), the bf16 dot-product GEMMs ([`crate::matmul_bf16`]) and the AVX2 optimizer
//! step ([`crate::optim`]) all ask [`IsaLevel::active`] before they use an instruction.
//!
//! By default that is the host's level. `AUTOTP_CPU_ISA=x86-64-v3` (or `x86-64`) lowers it, so an
//! AVX-512 machine computes exactly what an AVX2-only one does with autotp's own kernels (the
//! generated kernels' vector width, and with it their summation order, follows the level); the
//! test suite runs its kernel and training tests at both levels where the host has both. A level
//! above the host's is refused: autotp never runs an instruction the CPU lacks.
//!
//! Not covered: the `gemm` crate picks its f32/f64 micro-kernels by std's own feature detection,
//! which a process cannot lower; its AVX-512 and FMA kernels agree to f32 rounding.

use std::sync::OnceLock;

/// The environment variable that lowers the level (see the module docs).
pub const ISA_VARIABLE: &str = "AUTOTP_CPU_ISA";

/// An x86-64 micro-architecture level (the psABI's names), lowest first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum IsaLevel {
    /// `x86-64`: SSE2, 4 f32 lanes.
    Baseline,
    /// `x86-64-v3`: AVX2 and FMA, 8 f32 lanes.
    V3,
    /// `x86-64-v4`: AVX-512 (F, BW, DQ, VL, CD), 16 f32 lanes.
    V4,
}

/// Why the requested level cannot be used.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum IsaError {
    #[error("{ISA_VARIABLE}={value}: not a level (expected host, x86-64, x86-64-v3 or x86-64-v4)")]
    Unknown { value: String },
    #[error(
        "{ISA_VARIABLE}={requested}: this CPU's level is {host}, and autotp never runs instructions the CPU lacks"
    )]
    AboveHost { requested: &'static str, host: &'static str },
}

impl IsaLevel {
    pub const ALL: [IsaLevel; 3] = [IsaLevel::Baseline, IsaLevel::V3, IsaLevel::V4];

    /// The psABI name, which is also LLVM's CPU name for the level.
    pub fn name(self) -> &'static str {
        match self {
            IsaLevel::Baseline => "x86-64",
            IsaLevel::V3 => "x86-64-v3",
            IsaLevel::V4 => "x86-64-v4",
        }
    }

    /// f32 lanes of the level's widest vectors.
    pub fn f32_lanes(self) -> u32 {
        match self {
            IsaLevel::Baseline => 4,
            IsaLevel::V3 => 8,
            IsaLevel::V4 => 16,
        }
    }

    /// The level this CPU supports (checked once).
    pub fn host() -> IsaLevel {
        static HOST: OnceLock<IsaLevel> = OnceLock::new();
        *HOST.get_or_init(detect_host)
    }

    /// The level `AUTOTP_CPU_ISA` asks for, or the host's without it (checked once).
    pub fn configured() -> Result<IsaLevel, IsaError> {
        static CONFIGURED: OnceLock<Result<IsaLevel, IsaError>> = OnceLock::new();
        CONFIGURED
            .get_or_init(|| Self::parse_request(std::env::var(ISA_VARIABLE).ok().as_deref(), Self::host()))
            .clone()
    }

    /// The level to run at: [`IsaLevel::configured`], or the host's when the variable is
    /// invalid (the CLI and the JIT refuse an invalid one before anything runs, with
    /// [`IsaLevel::configured`]'s error).
    pub fn active() -> IsaLevel {
        Self::configured().unwrap_or_else(|_| Self::host())
    }

    /// The level `request` (the variable's value, if set) names on a host of level `host`.
    pub fn parse_request(request: Option<&str>, host: IsaLevel) -> Result<IsaLevel, IsaError> {
        let Some(value) = request.map(str::trim).filter(|v| !v.is_empty()) else { return Ok(host) };
        if value == "host" {
            return Ok(host);
        }
        let level = Self::ALL
            .into_iter()
            .find(|l| l.name() == value)
            .ok_or_else(|| IsaError::Unknown { value: value.to_string() })?;
        if level > host {
            return Err(IsaError::AboveHost { requested: level.name(), host: host.name() });
        }
        Ok(level)
    }
}

#[cfg(target_arch = "x86_64")]
fn detect_host() -> IsaLevel {
    use std::arch::is_x86_feature_detected as has;
    if has!("avx512f") && has!("avx512bw") && has!("avx512dq") && has!("avx512vl") && has!("avx512cd") {
        IsaLevel::V4
    } else if has!("avx2") && has!("fma") && has!("bmi1") && has!("bmi2") && has!("f16c") && has!("lzcnt") {
        IsaLevel::V3
    } else {
        IsaLevel::Baseline
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn detect_host() -> IsaLevel {
    IsaLevel::Baseline
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_at_or_below_the_host_are_granted() {
        assert_eq!(IsaLevel::parse_request(None, IsaLevel::V4), Ok(IsaLevel::V4));
        assert_eq!(IsaLevel::parse_request(Some("host"), IsaLevel::V3), Ok(IsaLevel::V3));
        assert_eq!(IsaLevel::parse_request(Some(" x86-64-v3 "), IsaLevel::V4), Ok(IsaLevel::V3));
        assert_eq!(IsaLevel::parse_request(Some("x86-64"), IsaLevel::V3), Ok(IsaLevel::Baseline));
    }

    #[test]
    fn unknown_and_higher_levels_are_refused() {
        assert_eq!(
            IsaLevel::parse_request(Some("avx2"), IsaLevel::V4),
            Err(IsaError::Unknown { value: "avx2".into() })
        );
        let error = IsaLevel::parse_request(Some("x86-64-v4"), IsaLevel::V3).unwrap_err();
        assert_eq!(
            error.to_string(),
            "AUTOTP_CPU_ISA=x86-64-v4: this CPU's level is x86-64-v3, and autotp never runs instructions the CPU lacks"
        );
    }
}
