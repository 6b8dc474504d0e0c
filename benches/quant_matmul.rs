//! The int8 block-quantized matmul (`kernels::quant_matmul`) against candle's quantized matmul
//! and the f32 gemm over the dequantized weights, on two models' shapes: the default model's
//! (Q4_1 q/o, k/v, gate/up, down; the Q8_0 LM head) at 1, 4, 16 and 256 activation rows, and
//! Qwen2.5-Coder-0.5B Q4_K_M's (Q5_0 q/o, k/v, gate/up; down in Q4_K or Q6_K, half the layers
//! each; the Q8_0 LM head) at 1, 4 and 64. Ours and candle's are timed alternately, call by
//! call, so a noisy machine slows both alike; medians of `BENCH_RUNS` (default 20) calls after a
//! warm-up; GMAC/s counts the multiply-adds done.
//!
//!   RAYON_NUM_THREADS=2 cargo bench --bench quant_matmul
//! `BENCH_SHAPES=smollm` or `=qwen` runs one model's shapes. (`LIFT_CPU_QMATMUL=avx2` runs the
//! AVX2 version on an AVX-512 CPU.)

#[path = "common/stats.rs"]
mod stats;
use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{Device, Module, Tensor};
use lift_serve::kernels::quant_matmul::{BlockFormat, PackedWeights};

use stats::{median_s, percentile};

/// Medians of `runs` calls of `a` and of `b`, called in turn, after a warm-up call of each.
fn medians_alternating(runs: usize, mut a: impl FnMut(), mut b: impl FnMut()) -> (f64, f64) {
    a();
    b();
    let time = |f: &mut dyn FnMut()| {
        let s = std::time::Instant::now();
        f();
        s.elapsed().as_secs_f64()
    };
    let (ta, tb): (Vec<f64>, Vec<f64>) = (0..runs).map(|_| (time(&mut a), time(&mut b))).unzip();
    (percentile(&ta, 0.5), percentile(&tb, 0.5))
}

type Shape = (&'static str, usize, usize, GgmlDType, BlockFormat, &'static [usize]);

const SMOLLM: [Shape; 4] = [
    ("q/o 576×576 Q4_1", 576, 576, GgmlDType::Q4_1, BlockFormat::Q4_1, &[1, 4, 16, 256]),
    ("gate/up 1536×576 Q4_1", 1536, 576, GgmlDType::Q4_1, BlockFormat::Q4_1, &[1, 4, 16, 256]),
    ("down 576×1536 Q4_1", 576, 1536, GgmlDType::Q4_1, BlockFormat::Q4_1, &[1, 4, 16, 256]),
    ("lm head 49152×576 Q8_0", 49152, 576, GgmlDType::Q8_0, BlockFormat::Q8_0, &[1, 4, 16]),
];

const QWEN: [Shape; 6] = [
    ("q/o 896×896 Q5_0", 896, 896, GgmlDType::Q5_0, BlockFormat::Q5_0, &[1, 4, 64]),
    ("k/v 128×896 Q5_0", 128, 896, GgmlDType::Q5_0, BlockFormat::Q5_0, &[1, 4, 64]),
    ("gate/up 4864×896 Q5_0", 4864, 896, GgmlDType::Q5_0, BlockFormat::Q5_0, &[1, 4, 64]),
    ("down 896×4864 Q4_K", 896, 4864, GgmlDType::Q4K, BlockFormat::Q4K, &[1, 4, 64]),
    ("down 896×4864 Q6_K", 896, 4864, GgmlDType::Q6K, BlockFormat::Q6K, &[1, 4, 64]),
    ("lm head 151936×896 Q8_0", 151936, 896, GgmlDType::Q8_0, BlockFormat::Q8_0, &[1, 4]),
];

fn main() -> anyhow::Result<()> {
    let isa = lift_serve::runtime::RuntimeConfig::from_env()?.quant_matmul_isa().ok_or_else(|| {
        anyhow::anyhow!("the kernel does not run: LIFT_CPU_QMATMUL=candle, or a CPU with neither AVX-512 VNNI nor AVX2")
    })?;
    let runs: usize = std::env::var("BENCH_RUNS").ok().and_then(|s| s.parse().ok()).unwrap_or(20);
    let which = std::env::var("BENCH_SHAPES").unwrap_or_default();
    let dev = Device::Cpu;
    println!("threads: {}  runs: {runs}  kernel: {isa:?}", rayon::current_num_threads());
    println!("| weight | rows | ours ms | candle quantized ms | f32 gemm ms | ours GMAC/s | vs candle | vs f32 |");
    println!("|---|---|---|---|---|---|---|---|");
    let mut shapes: Vec<Shape> = Vec::new();
    if which != "qwen" {
        shapes.extend(SMOLLM);
    }
    if which != "smollm" {
        shapes.extend(QWEN);
    }
    for (name, out, inp, gg, fmt, row_counts) in shapes {
        let w = Tensor::randn(0f32, 0.05, (out, inp), &dev)?;
        let q = QTensor::quantize(&w, gg)?;
        let packed = PackedWeights::pack(fmt, &q.data()?, out, inp).map_err(anyhow::Error::msg)?.run_on(isa);
        let candle = QMatMul::from_qtensor(q)?;
        let wf = candle.dequantize_f16()?.to_dtype(candle_core::DType::F32)?.t()?.contiguous()?;
        for &n in row_counts {
            let x = Tensor::randn(0f32, 1.0, (n, inp), &dev)?;
            let xv = x.flatten_all()?.to_vec1::<f32>()?;
            let (ours, theirs) = medians_alternating(
                runs,
                || {
                    std::hint::black_box(packed.matmul(&xv, n));
                },
                || {
                    std::hint::black_box(candle.forward(&x).unwrap());
                },
            );
            let float = median_s(runs, || {
                std::hint::black_box(x.matmul(&wf).unwrap());
            });
            let gmac = (n * out * inp) as f64 / ours / 1e9;
            println!(
                "| {name} | {n} | {:.3} | {:.3} | {:.3} | {gmac:.1} | {:.2}× | {:.2}× |",
                ours * 1e3,
                theirs * 1e3,
                float * 1e3,
                theirs / ours,
                float / ours
            );
        }
    }
    if which == "qwen" {
        return Ok(());
    }
    // Weights streamed from memory as in a decode step: one call on each of 30 layers' gate
    // matrices in turn (58 MB of Q4_1 in all, past the caches).
    println!();
    println!("| 30 gate/up 1536×576 Q4_1 matrices in turn | rows | ours ms per matrix | GMAC/s | GB/s of weights |");
    println!("|---|---|---|---|---|");
    let layers: Vec<PackedWeights> = (0..30)
        .map(|_| -> anyhow::Result<PackedWeights> {
            let w = Tensor::randn(0f32, 0.05, (1536, 576), &dev)?;
            let q = QTensor::quantize(&w, GgmlDType::Q4_1)?;
            Ok(PackedWeights::pack(BlockFormat::Q4_1, &q.data()?, 1536, 576).map_err(anyhow::Error::msg)?.run_on(isa))
        })
        .collect::<anyhow::Result<_>>()?;
    for n in [1usize, 4, 16] {
        let x: Vec<f32> = Tensor::randn(0f32, 1.0, (n, 576), &dev)?.flatten_all()?.to_vec1()?;
        let t = median_s(runs, || {
            for l in &layers {
                std::hint::black_box(l.matmul(&x, n));
            }
        }) / layers.len() as f64;
        let bytes = 1536.0 * 576.0 * 20.0 / 32.0;
        println!("| | {n} | {:.3} | {:.1} | {:.1} |", t * 1e3, (n * 1536 * 576) as f64 / t / 1e9, bytes / t / 1e9);
    }
    Ok(())
}
