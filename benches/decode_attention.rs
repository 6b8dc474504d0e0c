//! Decode attention (`kernels::decode_attention`) on every instruction path the CPU has, in one
//! run: the default model's layer shape (9 query heads over 3 KV heads of 64), an f16 cache,
//! 1 and 16 sequences of 64, 256 and 1,024 cached tokens. Medians of `BENCH_RUNS` (default 50)
//! calls, one call being one layer of one decode step (the decoder makes 30 a step).
//!
//!   RAYON_NUM_THREADS=2 cargo bench --bench decode_attention

#[path = "common/stats.rs"]
mod stats;
use half::f16;
use lift_serve::kernels::decode_attention::{decode_attention_on, simd, DecodeCache, Simd};

use stats::median_s;

fn main() {
    lift_serve::runtime::tune_cpu();
    let runs: usize = std::env::var("BENCH_RUNS").ok().and_then(|s| s.parse().ok()).unwrap_or(50);
    let (heads, kv_heads, d) = (9usize, 3usize, 64usize);
    let best = simd();
    let paths: Vec<Simd> = match best {
        Simd::Avx512 => vec![Simd::Scalar, Simd::Avx2, Simd::Avx512],
        Simd::Avx2 => vec![Simd::Scalar, Simd::Avx2],
        Simd::Scalar => vec![Simd::Scalar],
    };
    println!("threads: {}  runs: {runs}  best path: {best:?}", rayon::current_num_threads());
    println!("| sequences | cached tokens | {} | best vs scalar | GB/s of cache read (best) |", paths.iter().map(|p| format!("{p:?} µs")).collect::<Vec<_>>().join(" | "));
    println!("|---|---|{}---|---|", "---|".repeat(paths.len()));
    // A cheap deterministic fill: the values do not matter to the speed.
    let fill = |n: usize, seed: usize| -> Vec<f16> { (0..n).map(|i| f16::from_f32((((i * 7919 + seed * 104_729) % 2001) as f32 - 1000.0) / 1000.0)).collect() };
    for n in [1usize, 16] {
        for len in [64usize, 256, 1024] {
            let cap = len;
            let ks: Vec<Vec<f16>> = (0..n).map(|i| fill(kv_heads * cap * d, 2 * i)).collect();
            let vs: Vec<Vec<f16>> = (0..n).map(|i| fill(kv_heads * cap * d, 2 * i + 1)).collect();
            let caches: Vec<DecodeCache<f16>> = (0..n).map(|i| DecodeCache { k: &ks[i], v: &vs[i], capacity: cap, len, bias: None }).collect();
            let q: Vec<f32> = fill(n * heads * d, 99).iter().map(|x| x.to_f32()).collect();
            let times: Vec<f64> = paths
                .iter()
                .map(|&p| median_s(runs, || { std::hint::black_box(decode_attention_on(p, &q, &caches, heads, kv_heads, d, 0.125)); }))
                .collect();
            let bytes = (n * 2 * kv_heads * len * d * 2) as f64;
            let best_t = *times.last().unwrap_or(&f64::NAN);
            println!(
                "| {n} | {len} | {} | {:.2}× | {:.1} |",
                times.iter().map(|t| format!("{:.1}", t * 1e6)).collect::<Vec<_>>().join(" | "),
                times[0] / best_t,
                bytes / best_t / 1e9
            );
        }
    }
}
