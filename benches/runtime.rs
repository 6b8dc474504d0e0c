//! Runtime benchmark on the default model: f32 matmul FLOP rate (the yardstick), prefill and
//! decode tokens/s, and one adapter training step (forward + backward to a Gated Memory adapter
//! on every layer + AdamW) at 256 and 512 tokens. Prints medians of several runs.
//!
//!   RAYON_NUM_THREADS=2 cargo bench --bench runtime            (BENCH_RUNS=5 by default)
//! Compare with PyTorch eager in the same run: benches/train_vs_torch.sh (alternating rounds)
//! or benches/torch_reference.sh. BENCH_ONLY=train,prefill,… picks parts; BENCH_TRAIN_SEQS=512
//! picks the training-step lengths, BENCH_TRAIN_ROWS=N puts N rows of that length in one batched
//! step. BENCH_DEVICE=cuda and BENCH_MODEL=random-smollm2 (see
//! common/target.rs) run it on a GPU; there the CPU-only parts (the int8 prompt path, the linear
//! and bf16-kernel comparisons) are skipped and every timed call ends with a device sync.

use candle_core::{DType, Tensor};
use candle_nn::optim::{AdamW, Optimizer, ParamsAdamW};
use lift_serve::adapters::GatedMemory;
use lift_serve::kernels::bf16_matmul;
use lift_serve::model::generate::prefill;
use lift_serve::model::{ops, Adapter, KvCache, Logits, Model, NoHooks};
use std::time::Instant;

#[path = "common/decode.rs"]
mod decode;
#[path = "common/target.rs"]
mod target;

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(|a, b| a.total_cmp(b));
    xs[xs.len() / 2]
}

fn time_runs(runs: usize, warmup: usize, mut f: impl FnMut()) -> Vec<f64> {
    for _ in 0..warmup {
        f();
    }
    (0..runs)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .collect()
}

fn tokens(n: usize, vocab: usize) -> Vec<u32> {
    let mut rng = lift_serve::testing::Rng::new(7);
    (0..n).map(|_| ((rng.next_f32() + 1.0) * 0.5 * (vocab as f32 - 300.0)) as u32 + 100).collect()
}

/// Forward FLOPs of a prefill of `t` tokens (matmuls only; logits of the last position only).
fn prefill_flops(m: &Model, t: usize) -> f64 {
    let c = m.config();
    let (h, i, hd) = (c.hidden_size as f64, c.intermediate_size as f64, c.head_dim as f64);
    let (nh, nkv) = (c.num_heads as f64, c.num_kv_heads as f64);
    let per_tok = 2.0 * (h * nh * hd * 2.0 + h * nkv * hd * 2.0 + 3.0 * h * i);
    let attn = 2.0 * 2.0 * nh * hd * (t as f64) * (t as f64 + 1.0) / 2.0; // causal half of QKᵀ and PV
    c.num_layers as f64 * (per_tok * t as f64 + attn) + 2.0 * h * c.vocab_size as f64
}

fn main() -> anyhow::Result<()> {
    lift_serve::runtime::tune_cpu();
    let runs: usize = std::env::var("BENCH_RUNS").ok().and_then(|s| s.parse().ok()).unwrap_or(5);
    let only = std::env::var("BENCH_ONLY").unwrap_or_default();
    let want = |name: &str| only.is_empty() || only.split(',').any(|o| o == name);
    let dev = target::device()?;
    let on_cpu = dev.is_cpu();
    println!("threads: {}  runs: {runs}  device: {dev:?}", rayon::current_num_threads());

    // Yardstick: a large f32 matmul through the same gemm candle uses everywhere.
    let n = 2048;
    let a = Tensor::randn(0f32, 1.0, (n, n), &dev)?;
    let b = Tensor::randn(0f32, 1.0, (n, n), &dev)?;
    let mm = median(time_runs(runs, 1, || {
        a.matmul(&b).unwrap();
        target::sync(&dev);
    }));
    let mm_gflops = 2.0 * (n as f64).powi(3) / mm / 1e9;
    println!("matmul f32 {n}x{n}x{n}: {:.3} s  {mm_gflops:.1} GFLOP/s", mm);
    if !on_cpu {
        // The model's own dtype on a GPU (bf16 base, tensor cores).
        let (a, b) = (a.to_dtype(DType::BF16)?, b.to_dtype(DType::BF16)?);
        let s = median(time_runs(runs, 1, || {
            a.matmul(&b).unwrap();
            target::sync(&dev);
        }));
        println!("matmul bf16 {n}x{n}x{n}: {s:.4} s  {:.1} GFLOP/s", 2.0 * (n as f64).powi(3) / s / 1e9);
    }

    let target::Target { mut model, label, .. } = target::load(&dev)?;
    println!("model: {label}");
    model.decoder.prepare_float_weights()?;
    let cfg = model.config().clone();
    let layers = cfg.num_layers;

    if want("prefill") {
        for &t in &[512usize, 2048] {
            let toks = tokens(t, cfg.vocab_size);
            for (label, threshold) in [("float", 16usize), ("quantized", usize::MAX)] {
                if label == "quantized" && (t > 512 || !on_cpu) {
                    continue;
                }
                model.decoder.float_prefill_min_rows = threshold;
                // The serving path: `prefill` in chunks of PREFILL_CHUNK tokens.
                let s = median(time_runs(runs.min(3).max(1), 1, || {
                    prefill(&model, &toks, &mut KvCache::new(layers), None, &mut NoHooks).unwrap();
                    target::sync(&dev);
                }));
                let gflops = prefill_flops(&model, t) / s / 1e9;
                println!(
                    "prefill {t:>5} tokens ({label:>9}): {s:.3} s  {:>7.1} tok/s  {gflops:.1} GFLOP/s = {:.0}% of matmul",
                    t as f64 / s,
                    100.0 * gflops / mm_gflops
                );
            }
        }
        // One pass over all 2048 tokens (no chunking), for comparison.
        let ids = Tensor::new(tokens(2048, cfg.vocab_size).as_slice(), &dev)?.unsqueeze(0)?;
        let s = median(time_runs(runs.min(3).max(1), 1, || {
            model.decoder.forward(&ids, &mut KvCache::new(layers), None, &mut NoHooks, Logits::Last).unwrap();
            target::sync(&dev);
        }));
        println!(
            "prefill  2048 tokens (one pass ): {s:.3} s  {:>7.1} tok/s  {:.1} GFLOP/s",
            2048.0 / s,
            prefill_flops(&model, 2048) / s / 1e9
        );
    }

    if want("decode") {
        let prompt = Tensor::new(tokens(128, cfg.vocab_size).as_slice(), &dev)?.unsqueeze(0)?;
        let steps = 64;
        let mut cache = KvCache::new(layers);
        let logits = model.decoder.forward(&prompt, &mut cache, None, &mut NoHooks, Logits::Last)?;
        let s = median(decode::timed_greedy_steps(&model, &mut cache, logits, steps)?);
        println!("decode after 128-token prompt: {:.1} ms/token  {:.1} tok/s (median of {steps})", s * 1e3, 1.0 / s);
    }

    if want("decode_adapter") {
        // Decode with a Gated Memory adapter on every layer (detached, as served) vs without,
        // after the same 512-token prompt; steps alternate between the two so that load on the
        // machine hits both alike.
        let all: Vec<usize> = (0..layers).collect();
        let adapter = GatedMemory::new(&cfg, &all, cfg.attention_bias, 1, &dev)?.detached();
        let prompt = Tensor::new(tokens(512, cfg.vocab_size).as_slice(), &dev)?.unsqueeze(0)?;
        let with: [Option<&dyn Adapter>; 2] = [None, Some(&adapter)];
        let mut state = Vec::new();
        for a in with {
            let mut cache = KvCache::new(layers);
            let logits = model.decoder.forward(&prompt, &mut cache, a, &mut NoHooks, Logits::Last)?;
            state.push((cache, logits, Vec::new()));
        }
        let steps = 48;
        for _ in 0..steps {
            for (a, (cache, logits, times)) in with.iter().zip(state.iter_mut()) {
                let t = Instant::now();
                let next = logits.argmax(1)?.to_vec1::<u32>()?[0];
                let x = Tensor::new(&[next], &dev)?.unsqueeze(0)?;
                *logits = model.decoder.forward(&x, cache, *a, &mut NoHooks, Logits::Last)?;
                times.push(t.elapsed().as_secs_f64());
            }
        }
        // The adapter's own work for one decoded token (all layers), timed alone: small against a
        // whole step, which a loaded machine makes noisy.
        let q = Tensor::randn(0f32, 1.0, (1, cfg.num_heads, 1, cfg.head_dim), &dev)?;
        let attn = Tensor::randn(0f32, 1.0, (1, cfg.num_heads, 1, cfg.head_dim), &dev)?;
        let mix = median(time_runs(200, 5, || {
            for l in 0..layers {
                adapter.mix_attention(l, &q, attn.clone()).unwrap();
            }
            target::sync(&dev);
        }));
        let [base, gm] = [0, 1].map(|i| median(state[i].2.clone()));
        println!(
            "decode after 512-token prompt (median of {steps}): base {:.2} ms/token, with gated memory on {layers} layers {:.2} ms/token ({:+.1}%); \
             the adapter's mix alone {:.0} µs/token ({:.1}% of a base step)",
            base * 1e3,
            gm * 1e3,
            (gm / base - 1.0) * 100.0,
            mix * 1e6,
            100.0 * mix / base
        );
    }

    if want("linear") && on_cpu {
        // The frozen linears of the trainable path at 512 tokens: forward through a transposed
        // view of the [out, in] weight vs through a pre-transposed [in, out] copy (what the CPU
        // path uses), alternating run by run.
        let l0 = &model.decoder.layers[0];
        let shapes =
            [("q", &l0.q), ("k", &l0.k), ("gate", &l0.gate), ("down", &l0.down), ("lm_head", &model.decoder.lm_head)];
        for (name, lin) in shapes {
            let w = lin.float_weight()?;
            let wt = w.t()?.contiguous()?;
            let x = Tensor::randn(0f32, 1.0, (512, lin.in_dim()), &dev)?;
            let (mut view, mut pre) = (Vec::new(), Vec::new());
            for _ in 0..runs.max(5) {
                view.extend(time_runs(1, 1, || {
                    ops::frozen_linear(&x, w).unwrap();
                }));
                pre.extend(time_runs(1, 1, || {
                    ops::frozen_linear_pretransposed(&x, w, &wt).unwrap();
                }));
            }
            let (a, b) = (median(view), median(pre));
            println!(
                "linear {name:>7} 512x{}x{}: transposed view {:.2} ms, pre-transposed {:.2} ms ({:.2}x)",
                lin.in_dim(),
                lin.out_dim(),
                a * 1e3,
                b * 1e3,
                a / b
            );
            if bf16_matmul::available() {
                // The bf16 kernel against the f32 gemm, forward (x·Wᵀ) and backward (g·W) shapes.
                let wv = w.flatten_all()?.to_vec1::<f32>()?;
                let (out, inp) = (lin.out_dim(), lin.in_dim());
                let fwd = bf16_matmul::PackedBf16::pack(&wv, out, inp);
                let bwd = bf16_matmul::PackedBf16::pack_transposed(&wv, out, inp);
                let xv = x.flatten_all()?.to_vec1::<f32>()?;
                let g = Tensor::randn(0f32, 1.0, (512, out), &dev)?;
                let gv = g.flatten_all()?.to_vec1::<f32>()?;
                let (mut f32b, mut bf, mut f32d, mut bfd) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
                for _ in 0..runs.max(5) {
                    bf.extend(time_runs(1, 1, || {
                        fwd.matmul(&xv, 512);
                    }));
                    bfd.extend(time_runs(1, 1, || {
                        bwd.matmul(&gv, 512);
                    }));
                    f32d.extend(time_runs(1, 1, || {
                        g.matmul(w).unwrap();
                    }));
                }
                f32b.push(b);
                let (c, d, e) = (median(bf), median(f32d), median(bfd));
                let gflop = 2.0 * 512.0 * out as f64 * inp as f64 / 1e9;
                println!(
                    "        {name:>7} bf16: forward {:.2} ms ({:.2}x f32, {:.0} GFLOP/s), backward g·W f32 {:.2} ms, bf16 {:.2} ms ({:.2}x)",
                    c * 1e3,
                    b / c,
                    gflop / c,
                    d * 1e3,
                    e * 1e3,
                    d / e
                );
            }
        }
    }

    if want("train") {
        let seqs: Vec<usize> = std::env::var("BENCH_TRAIN_SEQS")
            .ok()
            .map(|s| s.split(',').filter_map(|x| x.trim().parse().ok()).collect())
            .unwrap_or_else(|| vec![256, 512]);
        for &t in &seqs {
            let all: Vec<usize> = (0..layers).collect();
            let adapter = GatedMemory::new(&cfg, &all, false, 1, &dev)?;
            let mut opt = AdamW::new(
                adapter.vars().to_vec(),
                ParamsAdamW { lr: 1e-3, beta1: 0.9, beta2: 0.98, eps: 1e-8, weight_decay: 1e-4 },
            )?;
            // BENCH_TRAIN_ROWS rows of `t` tokens as one batch `[rows, t]` (1: a single row).
            let n_rows: usize = std::env::var("BENCH_TRAIN_ROWS").ok().and_then(|s| s.parse().ok()).unwrap_or(1);
            let toks = tokens(t + n_rows, cfg.vocab_size);
            let rows: Vec<Tensor> = (0..n_rows).map(|r| Tensor::new(&toks[r..r + t], &dev)).collect::<candle_core::Result<_>>()?;
            let input = Tensor::stack(&rows, 0)?;
            let target: Vec<u32> = (0..n_rows).flat_map(|r| toks[r + 1..r + t + 1].to_vec()).collect();
            let target = Tensor::new(target.as_slice(), &dev)?;
            let weights = Tensor::ones(t * n_rows, DType::F32, &dev)?;
            // The step's forward: embeddings, every layer with the adapter, logits, the loss.
            let forward = || {
                let emb = model.decoder.embed(&input).unwrap();
                let h = model.decoder.forward_train(&emb, Some(&adapter), &mut NoHooks).unwrap();
                let logits = model.decoder.logits_train(&h.reshape((n_rows * t, cfg.hidden_size)).unwrap()).unwrap();
                ops::cross_entropy_masked(&logits, &target, &weights).unwrap()
            };
            let mut fwd = Vec::new();
            let mut bwd = Vec::new();
            let steps = time_runs(runs, 1, || {
                let t0 = Instant::now();
                let loss = forward();
                let t1 = Instant::now();
                let grads = loss.backward().unwrap();
                let t2 = Instant::now();
                opt.step(&grads).unwrap();
                target::sync(&dev);
                fwd.push((t1 - t0).as_secs_f64());
                bwd.push((t2 - t1).as_secs_f64());
            });
            let s = median(steps);
            println!(
                "train step {n_rows} × {t:>4} tokens (gated memory, {} params, all {layers} layers): {s:.3} s  {:.0} tok/s  (forward {:.3} s, backward {:.3} s)",
                adapter.num_parameters(),
                (n_rows * t) as f64 / s,
                median(fwd),
                median(bwd)
            );
            if !on_cpu {
                // Where a GPU step goes: each phase timed once when its launches return (host
                // time) and once when its kernels have finished. Launch-bound phases show a
                // host time close to the finished time.
                let mut ph: [Vec<f64>; 5] = Default::default();
                for _ in 0..runs {
                    let t0 = Instant::now();
                    let loss = forward();
                    let t1 = Instant::now();
                    target::sync(&dev);
                    let t2 = Instant::now();
                    let grads = loss.backward().unwrap();
                    let t3 = Instant::now();
                    target::sync(&dev);
                    let t4 = Instant::now();
                    opt.step(&grads).unwrap();
                    target::sync(&dev);
                    let t5 = Instant::now();
                    for (v, d) in ph.iter_mut().zip([t1 - t0, t2 - t0, t3 - t2, t4 - t2, t5 - t4]) {
                        v.push(d.as_secs_f64());
                    }
                }
                let [fl, fd, bl, bd, o] = ph.map(median);
                println!(
                    "  synced phases: forward {fd:.4} s (launches returned at {fl:.4} s), backward {bd:.4} s (launches {bl:.4} s), optimizer (candle-nn AdamW) {o:.4} s"
                );
            }
        }
    }
    Ok(())
}
