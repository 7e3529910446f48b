//! What the cost model knows of a device ([`Device`]): the GPUs' figures from their data
//! sheets, the CPU's fitted to `benches/plan.sh`'s measured steps.

/// What the cost model knows of a device.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Device {
    pub name: String,
    /// Dense GEMM FLOP/s a training step reaches (f32 on cpu, 16-bit tensor cores on GPUs).
    pub gemm_flops: f64,
    /// The output rows at which a GEMM runs at half that rate (a GEMM of `m` rows runs at
    /// `m / (m + gemm_half_rows)` of it).
    pub gemm_half_rows: f64,
    /// Bytes per second other kernels stream.
    pub memory_bandwidth: f64,
    /// Bytes per second per device inside a node, and between nodes.
    pub node_link: f64,
    pub network: f64,
    /// Seconds each collective or message costs besides its bytes.
    pub latency: f64,
    /// Seconds each instruction costs besides its work (a kernel launch; on CPU ranks the
    /// dispatch to the thread pool and its synchronisation).
    pub instruction_seconds: f64,
    /// Cores the ranks share (cpu); 0: each rank has its own device.
    pub shared_cores: usize,
    /// Bytes per second each way between a device and its host (0: the host is the device).
    pub host_link: f64,
    /// Bytes per second an offloaded optimizer step streams through host memory, per device.
    pub host_update_bandwidth: f64,
}

impl Device {
    pub fn named(name: &str) -> Device {
        let gpu = |gemm: f64, hbm: f64| Device {
            name: name.to_string(),
            // About half of the dense bf16 peak (989 TFLOP/s): what large training GEMMs reach.
            gemm_flops: gemm,
            gemm_half_rows: 128.0,
            memory_bandwidth: hbm,
            // NVLink 4: 450 GB/s each way; InfiniBand NDR: 400 Gb/s per GPU.
            node_link: 450e9,
            network: 50e9,
            latency: 10e-6,
            instruction_seconds: 4e-6,
            shared_cores: 0,
            // PCIe 5 x16 (64 GB/s each way) at 80%; a two-socket host's DDR5 (about 600 GB/s)
            // shared by 8 devices, at half of it for the step's streams.
            host_link: 64e9 * 0.8,
            host_update_bandwidth: 600e9 / 8.0 * 0.5,
        };
        match name {
            "h100" => gpu(500e12, 3.35e12 * 0.8),
            "h200" => gpu(500e12, 4.8e12 * 0.8),
            _ => {
                let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
                Device {
                    name: "cpu".into(),
                    // Per core: AVX-512 f32 GEMMs, and what elementwise kernels stream (from
                    // cache, mostly). Fitted to benches/plan.sh's measured steps.
                    gemm_flops: 200e9 * cores as f64,
                    gemm_half_rows: 64.0,
                    memory_bandwidth: 20e9 * cores as f64,
                    node_link: 20e9,
                    network: 20e9,
                    latency: 20e-6,
                    instruction_seconds: 3e-6,
                    shared_cores: cores,
                    host_link: 0.0,
                    host_update_bandwidth: 20e9 * cores as f64,
                }
            }
        }
    }
}
