//! CUDA checks, built only with `--features cuda` and meaningful only on a machine with a GPU:
//! `cargo test --release --features cuda --test cuda`. Every model-side feature has a case here
//! comparing CUDA with the CPU, so the first machine with a GPU checks all of them in one command
//! (README "CUDA" lists them): our kernels against their CPU references (forward and backward),
//! the fused ops, and the tiny model on CUDA (bf16 base, f32 adapters) against the CPU (f32)
//! within bf16 tolerances — inference logits, KV-cache decode, quantized GGUF, Gated Memory and
//! LoRA inference and training steps, packed training rows, the FltLM filter (scores and soft
//! mask), CDT's embedding gradients, the prepared base (LoRA + filter) under a document's Gated
//! Memory while answering and while training, a whole short absorb, and an absorb stopped and
//! resumed from its checkpoint.
//! `scripts/cuda_compile_check.sh` (run by CI) keeps this file compiling without a GPU.
#![cfg(feature = "cuda")]

use candle_core::quantized::GgmlDType;
use candle_core::{DType, Device, Tensor, Var};
use lift_serve::document::Document;
use lift_serve::adapters::{GatedMemory, Lora, LoraConfig, LoraPair};
use lift_serve::base::{BaseShape, PreparedBase};
use lift_serve::kernels::masked_softmax;
use lift_serve::lift::answer::layout::{self, Filter, FilterHooks, FilterOptions, MaskCalibration};
use lift_serve::lift::{absorb, AbsorbOptions};
use lift_serve::model::{ops, Adapter, ForwardHooks, KvCache, Logits, Model, NoHooks, Packing};
use lift_serve::testing::{write_gguf, write_hf, Rng, TinySpec};
use std::collections::BTreeMap;

fn gpu() -> Device {
    Device::new_cuda(0).expect("these tests need a CUDA GPU")
}

fn rand(shape: &[usize], seed: u64, scale: f32) -> Tensor {
    let n = shape.iter().product();
    Tensor::from_vec(Rng::new(seed).vec(n, scale), shape, &Device::Cpu).unwrap()
}

fn max_abs(t: &Tensor) -> f32 {
    t.to_dtype(DType::F32).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap()
}

/// max |a − b| / max |b|, both brought to the CPU in f32.
fn rel_diff(a: &Tensor, b: &Tensor) -> f32 {
    let a = a.to_device(&Device::Cpu).unwrap().to_dtype(DType::F32).unwrap();
    let b = b.to_device(&Device::Cpu).unwrap().to_dtype(DType::F32).unwrap();
    max_abs(&(&a - &b).unwrap()) / max_abs(&b).max(1e-12)
}

#[test]
fn gated_memory_kernel_matches_cpu_reference() {
    let dev = gpu();
    // head_dim 64 (SmolLM2) and 128 (8B models; smaller tiles), with and without biases.
    for (heads, d, bias) in [(3, 64, false), (2, 128, true), (4, 16, true)] {
        let mut cfg = lift_serve::testing::smollm2_135m_config();
        cfg.num_heads = heads;
        cfg.head_dim = d;
        let (b, t) = (2, 37);
        let gm_cpu = GatedMemory::new(&cfg, &[0], bias, 3, &Device::Cpu).unwrap();
        let gm_gpu = GatedMemory::new(&cfg, &[0], bias, 3, &dev).unwrap();
        let q = rand(&[b, heads, t, d], 1, 1.0);
        let a = rand(&[b, heads, t, d], 2, 1.0);
        let w = rand(&[b, heads, t, d], 4, 1.0);
        let run = |gm: &GatedMemory, dev: &Device| {
            let qv = Var::from_tensor(&q.to_device(dev).unwrap()).unwrap();
            let av = Var::from_tensor(&a.to_device(dev).unwrap()).unwrap();
            let out = gm.layers[&0].mix(qv.as_tensor(), av.as_tensor()).unwrap();
            let loss = (&out * w.to_device(dev).unwrap()).unwrap().sum_all().unwrap();
            let g = loss.backward().unwrap();
            let mut grads = vec![g.get(qv.as_tensor()).unwrap().clone(), g.get(av.as_tensor()).unwrap().clone()];
            grads.extend(gm.vars().iter().map(|v| g.get(v.as_tensor()).expect("parameter gradient").clone()));
            (out, grads)
        };
        let (out_c, g_c) = run(&gm_cpu, &Device::Cpu);
        let (out_g, g_g) = run(&gm_gpu, &dev);
        assert!(out_g.device().is_cuda());
        let d_out = rel_diff(&out_g, &out_c);
        assert!(d_out < 1e-4, "forward ({heads}, {d}, {bias}): {d_out}");
        for (i, (x, y)) in g_g.iter().zip(&g_c).enumerate() {
            let dg = rel_diff(x, y);
            assert!(dg < 1e-3, "gradient {i} ({heads}, {d}, {bias}): {dg}");
        }
    }
}

#[test]
fn masked_softmax_kernel_matches_cpu_reference() {
    let dev = gpu();
    for dtype in [DType::F32, DType::BF16] {
        // tq < tk (a KV prefix), tq > tk (queries that see nothing), and a long row.
        for (b, h, tq, tk) in [(2, 3, 5, 9), (1, 2, 6, 4), (1, 1, 3, 700)] {
            let s = rand(&[b, h, tq, tk], 1, 3.0);
            let mut bias = Rng::new(2).vec(b * tk, 1.0);
            bias[1] = f32::NEG_INFINITY;
            let bias = Tensor::from_vec(bias, (b, 1, 1, tk), &Device::Cpu).unwrap();
            let w = rand(&[b, h, tq, tk], 3, 1.0);
            let run = |dev: &Device, dt: DType| {
                let sv = Var::from_tensor(&s.to_device(dev).unwrap().to_dtype(dt).unwrap()).unwrap();
                let bv = Var::from_tensor(&bias.to_device(dev).unwrap().to_dtype(dt).unwrap()).unwrap();
                let p = masked_softmax::masked_softmax(sv.as_tensor(), Some(bv.as_tensor()), 0.3).unwrap();
                let loss = (p.to_dtype(DType::F32).unwrap() * w.to_device(dev).unwrap()).unwrap().sum_all().unwrap();
                let g = loss.backward().unwrap();
                (p, g.get(sv.as_tensor()).unwrap().clone(), g.get(bv.as_tensor()).unwrap().clone())
            };
            let (p_c, ds_c, db_c) = run(&Device::Cpu, DType::F32);
            let (p_g, ds_g, db_g) = run(&dev, dtype);
            let tol = if dtype == DType::F32 { 1e-5 } else { 2e-2 };
            for (name, x, y) in [("P", &p_g, &p_c), ("dS", &ds_g, &ds_c), ("dbias", &db_g, &db_c)] {
                let d = rel_diff(x, y);
                assert!(d < tol, "{name} {dtype:?} {:?}: {d}", (b, h, tq, tk));
            }
            let nan = p_g.to_dtype(DType::F32).unwrap().to_device(&Device::Cpu).unwrap().flatten_all().unwrap();
            assert!(nan.to_vec1::<f32>().unwrap().iter().all(|x| x.is_finite()));
        }
    }
}

#[test]
fn causal_attention_on_cuda_matches_cpu() {
    let dev = gpu();
    let (b, h, tq, tk, d) = (1, 4, 7, 11, 32);
    let q = rand(&[b, h, tq, d], 1, 1.0);
    let k = rand(&[b, h, tk, d], 2, 1.0);
    let v = rand(&[b, h, tk, d], 3, 1.0);
    let bias = rand(&[b, 1, 1, tk], 4, 1.0);
    let cpu = ops::causal_attention(&q, &k, &v, 0.2, Some(&bias)).unwrap();
    let to = |t: &Tensor| t.to_device(&dev).unwrap();
    let gpu_out = ops::causal_attention(&to(&q), &to(&k), &to(&v), 0.2, Some(&to(&bias))).unwrap();
    assert!(rel_diff(&gpu_out, &cpu) < 1e-4);
    let bf = |t: &Tensor| to(t).to_dtype(DType::BF16).unwrap();
    let gpu_bf = ops::causal_attention(&bf(&q), &bf(&k), &bf(&v), 0.2, Some(&bf(&bias))).unwrap();
    assert_eq!(gpu_bf.dtype(), DType::BF16);
    assert!(rel_diff(&gpu_bf, &cpu) < 3e-2);
}

/// The CPU side of a comparison: f32 arithmetic throughout, the KV cache and the training
/// matmuls included (the default f16 cache and bf16 training matmuls are measured on the CPU
/// alone, in `tests/runtime_real.rs`, and against the GPU in one case each here).
fn cpu_model(path: &std::path::Path) -> Model {
    let mut m = Model::load(path, &Device::Cpu).unwrap();
    m.decoder.cpu_kv_dtype = DType::F32;
    m.decoder.cpu_float_dtype = DType::F32;
    m
}

fn load_pair(spec: &TinySpec) -> (tempfile::TempDir, Model, Model) {
    let dir = tempfile::tempdir().unwrap();
    let path = write_hf(&dir.path().join("tiny"), spec).unwrap();
    let cpu = cpu_model(&path);
    let gpu = Model::load(&path, &gpu()).unwrap();
    (dir, cpu, gpu)
}

#[test]
fn tiny_model_inference_on_cuda_is_bf16_and_close_to_cpu() {
    let (_dir, cpu, gpu) = load_pair(&TinySpec::default());
    assert_eq!(cpu.decoder.dtype(), DType::F32);
    assert_eq!(gpu.decoder.dtype(), DType::BF16);
    let toks = cpu.tokenizer.encode("The quick brown fox jumps over the lazy dog, twice.", false).unwrap();
    let input = |m: &Model| Tensor::new(toks.as_slice(), m.device()).unwrap().unsqueeze(0).unwrap();
    let a = cpu.decoder.forward(&input(&cpu), &mut KvCache::new(2), None, &mut NoHooks, Logits::All).unwrap();
    let b = gpu.decoder.forward(&input(&gpu), &mut KvCache::new(2), None, &mut NoHooks, Logits::All).unwrap();
    assert_eq!(b.dtype(), DType::F32, "logits come back as f32");
    let d = rel_diff(&b, &a);
    assert!(d < 5e-2, "bf16 CUDA vs f32 CPU logits: {d}");
    // The CPU's default f16 KV cache: as close to the GPU's bf16 pass (which keeps a bf16 cache).
    let mut cpu16 = Model::load(&cpu.info.path, &Device::Cpu).unwrap();
    cpu16.decoder.cpu_kv_dtype = DType::F16;
    let h = cpu16.decoder.forward(&input(&cpu16), &mut KvCache::new(2), None, &mut NoHooks, Logits::All).unwrap();
    let dh = rel_diff(&b, &h);
    assert!(dh < 5e-2, "bf16 CUDA vs CPU with an f16 KV cache: {dh}");
    // Prefill + one-token decode through the KV cache equals the full pass (on the GPU).
    let n = toks.len();
    let mut cache = KvCache::new(2);
    let ids = input(&gpu);
    gpu.decoder.forward(&ids.narrow(1, 0, n - 1).unwrap(), &mut cache, None, &mut NoHooks, Logits::Last).unwrap();
    let last =
        gpu.decoder.forward(&ids.narrow(1, n - 1, 1).unwrap(), &mut cache, None, &mut NoHooks, Logits::Last).unwrap();
    let full = b.narrow(1, n - 1, 1).unwrap().squeeze(1).unwrap();
    assert!(rel_diff(&last, &full) < 5e-2);
}

/// candle's dequantization of GGUF blocks on CUDA against the CPU's, per block type and for the
/// shapes of the tiny model's and SmolLM2's linear layers.
#[test]
fn dequantize_on_cuda_matches_cpu() {
    use candle_core::quantized::QTensor;
    let mut bad = Vec::new();
    for dtype in [GgmlDType::Q8_0, GgmlDType::Q4_1, GgmlDType::Q4_0, GgmlDType::Q4K, GgmlDType::Q6K] {
        for (rows, cols) in [(64, 64), (128, 64), (64, 256), (576, 576), (1536, 576), (256, 256)] {
            if cols % dtype.block_size() != 0 {
                continue;
            }
            let w = rand(&[rows, cols], 5, 1.0);
            let q = QTensor::quantize(&w, dtype).unwrap();
            let cpu = q.dequantize(&Device::Cpu).unwrap();
            let q_gpu = QTensor::quantize(&w.to_device(&gpu()).unwrap(), dtype).unwrap();
            let on_gpu = q_gpu.dequantize(&gpu()).unwrap();
            let d = rel_diff(&on_gpu, &cpu);
            eprintln!("{dtype:?} [{rows}, {cols}]: {d}");
            if d > 1e-5 {
                bad.push(format!("{dtype:?} [{rows}, {cols}]: {d}"));
            }
        }
    }
    assert!(bad.is_empty(), "dequantized on CUDA differs from the CPU: {bad:?}");
}

/// A quantized GGUF on CUDA (quantized layers through their bf16 copies) against the CPU, whose
/// quantized path is our int8 kernel (`kernels::quant_matmul`) where the CPU has AVX-512 VNNI or AVX2:
/// Q8_0 (the default model's LM head) and Q4_1 (its layers).
#[test]
fn quantized_gguf_runs_on_cuda() {
    let spec = TinySpec::default();
    let dir = tempfile::tempdir().unwrap();
    for dtype in [GgmlDType::Q8_0, GgmlDType::Q4_1] {
        let path = write_gguf(&dir.path().join(format!("tiny_{dtype:?}.gguf")), &spec, dtype).unwrap();
        let cpu = cpu_model(&path);
        let gpu = Model::load(&path, &gpu()).unwrap();
        eprintln!("{dtype:?}: CPU int8 kernel: {}", cpu.decoder.layers[0].q.is_packed());
        let toks = cpu.tokenizer.encode("Quantized weights on the GPU.", false).unwrap();
        let input = |m: &Model| Tensor::new(toks.as_slice(), m.device()).unwrap().unsqueeze(0).unwrap();
        // Threshold 1: every matmul through the bf16 float weights; usize::MAX: the inference
        // path, which on CUDA also runs a quantized layer through its float copy.
        for (name, m) in [("cpu", &cpu), ("gpu", &gpu)] {
            let f = m.decoder.forward_with_float_threshold(&input(m), 1).unwrap();
            let q = m.decoder.forward_with_float_threshold(&input(m), usize::MAX).unwrap();
            eprintln!("{dtype:?} {name}: float vs quantized path {}", rel_diff(&f, &q));
        }
        for rows in [1usize, usize::MAX] {
            let a = cpu.decoder.forward_with_float_threshold(&input(&cpu), rows).unwrap();
            let b = gpu.decoder.forward_with_float_threshold(&input(&gpu), rows).unwrap();
            let d = rel_diff(&b, &a);
            assert!(d < 5e-2, "{dtype:?}, threshold {rows}: relative difference {d}");
        }
    }
}

/// One training step of the tiny model on `m`'s device: next-token loss over `toks` (through
/// `packing` when given) and the gradients of `vars`.
fn train_step(
    m: &Model,
    toks: &[u32],
    adapter: Option<&dyn Adapter>,
    packing: Option<&Packing>,
    hooks: &mut dyn ForwardHooks,
    vars: &[Var],
) -> (f32, Vec<Tensor>) {
    let dev = m.device();
    let n = toks.len();
    let ids = Tensor::new(&toks[..n - 1], dev).unwrap().unsqueeze(0).unwrap();
    let targets = Tensor::new(&toks[1..], dev).unwrap();
    let emb = m.decoder.embed(&ids).unwrap();
    let packing = packing.map(|p| p.truncated(n - 1));
    let hidden = m.decoder.forward_train_packed(&emb, packing.as_ref(), adapter, hooks).unwrap().squeeze(0).unwrap();
    let logits = m.decoder.logits_train(&hidden).unwrap();
    assert_eq!(logits.dtype(), DType::F32);
    let weights = Tensor::ones(n - 1, DType::F32, dev).unwrap();
    let loss = ops::cross_entropy_masked(&logits, &targets, &weights).unwrap();
    let grads = loss.backward().unwrap();
    for v in vars {
        assert_eq!(v.dtype(), DType::F32, "adapter parameters stay f32");
    }
    let g = vars.iter().map(|v| grads.get(v.as_tensor()).expect("adapter gradient").clone()).collect();
    (loss.to_scalar::<f32>().unwrap(), g)
}

/// Loss within 2% and every gradient within 10% (bf16 base on CUDA vs f32 on the CPU); at least
/// one gradient is non-zero, so the comparison is not between two zeros.
fn assert_steps_close(what: &str, cpu: &(f32, Vec<Tensor>), gpu: &(f32, Vec<Tensor>)) {
    let ((l_cpu, g_cpu), (l_gpu, g_gpu)) = (cpu, gpu);
    assert!((l_cpu - l_gpu).abs() < 2e-2 * l_cpu.abs().max(1.0), "{what}: loss {l_cpu} vs {l_gpu}");
    assert_eq!(g_cpu.len(), g_gpu.len());
    for (i, (a, b)) in g_gpu.iter().zip(g_cpu).enumerate() {
        assert!(a.device().is_cuda(), "{what}: gradient {i} left the GPU");
        let d = rel_diff(a, b);
        assert!(d < 0.1, "{what}: gradient {i}: {d}");
    }
    assert!(g_cpu.iter().any(|g| max_abs(g) > 0.0), "{what}: every gradient is zero on the CPU");
}

fn tokens(m: &Model, text: &str) -> Vec<u32> {
    m.tokenizer.encode(text, false).unwrap()
}

#[test]
fn gated_memory_training_step_on_cuda_matches_cpu() {
    let (_dir, cpu, gpu) = load_pair(&TinySpec::default());
    let cfg = cpu.config().clone();
    let toks = tokens(&cpu, "Adapters learn the document; the base model stays frozen.");
    let step = |m: &Model| {
        let gm = GatedMemory::new(&cfg, &[0, 1], false, 11, m.device()).unwrap();
        train_step(m, &toks, Some(&gm as &dyn Adapter), None, &mut NoHooks, gm.vars())
    };
    let (c, g) = (step(&cpu), step(&gpu));
    assert!(g_all_nonzero(&c.1), "every Gated Memory parameter gets a gradient on the CPU");
    assert_steps_close("gated memory", &c, &g);
    // The CPU's default bf16 training matmuls (where the CPU has AVX-512 BF16): as close.
    let mut cpu_bf16 = Model::load(&cpu.info.path, &Device::Cpu).unwrap();
    cpu_bf16.decoder.cpu_float_dtype = DType::BF16;
    assert_steps_close("gated memory, bf16 matmuls on the CPU", &step(&cpu_bf16), &g);
}

fn g_all_nonzero(g: &[Tensor]) -> bool {
    g.iter().all(|t| max_abs(t) > 0.0)
}

/// A LoRA on every projection of every layer with non-zero `B` (a fresh one has `B = 0`, which
/// would leave `A` without gradient and the forward unchanged), identical on both devices.
fn lora_on(m: &Model, seed: u64, trainable: bool) -> Lora {
    let cfg = m.config();
    let lc = LoraConfig { rank: 4, alpha: 8.0, ..Default::default() };
    let fresh = Lora::new(cfg, &lc, seed, &Device::Cpu).unwrap();
    let mut layers: BTreeMap<usize, Vec<_>> = BTreeMap::new();
    for (i, (l, p, pair)) in fresh.pairs().enumerate() {
        let b = rand(pair.b.dims(), seed + 100 + i as u64, 0.05);
        let pair = LoraPair { a: pair.a.to_device(m.device()).unwrap(), b: b.to_device(m.device()).unwrap() };
        layers.entry(l).or_default().push((p, pair));
    }
    Lora::from_pairs(cfg, &lc, layers, trainable).unwrap()
}

#[test]
fn lora_inference_and_training_step_on_cuda_match_cpu() {
    let (_dir, cpu, gpu) = load_pair(&TinySpec::default());
    let toks = tokens(&cpu, "A low-rank update on every projection, over a frozen bf16 base.");
    // Inference: logits with the (detached) LoRA active, prefill + decode through the KV cache.
    let logits = |m: &Model| {
        let lora = lora_on(m, 3, false);
        let ids = Tensor::new(toks.as_slice(), m.device()).unwrap().unsqueeze(0).unwrap();
        let mut cache = KvCache::new(m.config().num_layers);
        let n = toks.len();
        m.decoder.forward(&ids.narrow(1, 0, n - 1).unwrap(), &mut cache, Some(&lora), &mut NoHooks, Logits::Last).unwrap();
        m.decoder.forward(&ids.narrow(1, n - 1, 1).unwrap(), &mut cache, Some(&lora), &mut NoHooks, Logits::Last).unwrap()
    };
    let d = rel_diff(&logits(&gpu), &logits(&cpu));
    assert!(d < 5e-2, "LoRA decode logits: {d}");
    let step = |m: &Model| {
        let lora = lora_on(m, 3, true);
        train_step(m, &toks, Some(&lora as &dyn Adapter), None, &mut NoHooks, lora.vars())
    };
    let (c, g) = (step(&cpu), step(&gpu));
    assert!(g_all_nonzero(&c.1), "every LoRA factor gets a gradient on the CPU");
    assert_steps_close("lora", &c, &g);
}

#[test]
fn gated_memory_decode_with_kv_cache_on_cuda_matches_cpu() {
    let (_dir, cpu, gpu) = load_pair(&TinySpec::default());
    let cfg = cpu.config().clone();
    let toks = tokens(&cpu, "The memory answers from the adapter while the cache holds the prompt.");
    let run = |m: &Model| {
        let gm = GatedMemory::new(&cfg, &[0, 1], false, 5, m.device()).unwrap().detached();
        let ids = Tensor::new(toks.as_slice(), m.device()).unwrap().unsqueeze(0).unwrap();
        let n = toks.len();
        let full = m.decoder.forward(&ids, &mut KvCache::new(2), Some(&gm), &mut NoHooks, Logits::All).unwrap();
        let mut cache = KvCache::new(2);
        m.decoder.forward(&ids.narrow(1, 0, n - 2).unwrap(), &mut cache, Some(&gm), &mut NoHooks, Logits::Last).unwrap();
        m.decoder.forward(&ids.narrow(1, n - 2, 1).unwrap(), &mut cache, Some(&gm), &mut NoHooks, Logits::Last).unwrap();
        let last =
            m.decoder.forward(&ids.narrow(1, n - 1, 1).unwrap(), &mut cache, Some(&gm), &mut NoHooks, Logits::Last).unwrap();
        (full, last)
    };
    let (full_c, last_c) = run(&cpu);
    let (full_g, last_g) = run(&gpu);
    assert!(rel_diff(&full_g, &full_c) < 5e-2, "prefill logits with the adapter");
    assert!(rel_diff(&last_g, &last_c) < 5e-2, "decode logits with the adapter");
}

#[test]
fn packed_training_row_on_cuda_matches_cpu() {
    let (_dir, cpu, gpu) = load_pair(&TinySpec::default());
    let cfg = cpu.config().clone();
    let prefix = tokens(&cpu, "Shared context: the ferry leaves at dawn and returns at dusk.");
    let a = tokens(&cpu, " When does it leave? At dawn.");
    let b = tokens(&cpu, " When does it return? At dusk.");
    let row: Vec<u32> = prefix.iter().chain(&a).chain(&b).copied().collect();
    let packing = Packing::new(prefix.len(), &[a.len(), b.len()]);
    let step = |m: &Model| {
        let gm = GatedMemory::new(&cfg, &[0, 1], false, 7, m.device()).unwrap();
        train_step(m, &row, Some(&gm as &dyn Adapter), Some(&packing), &mut NoHooks, gm.vars())
    };
    assert_steps_close("packed row", &step(&cpu), &step(&gpu));
}

/// A filter reading layer 0 of the tiny model (masking layer 1) with a random score head and a
/// mask that is active (w = 1, b = 0.3): identical parameters on both devices.
fn filter_on(m: &Model) -> Filter {
    let opts = FilterOptions { enabled: true, layer: Some(0), chunk_tokens: 12, ..Default::default() };
    let dev = m.device();
    let mut f = Filter::new(m.config(), &opts, dev).unwrap().detached();
    let h = m.config().hidden_size;
    f.head_w = rand(&[h], 9, 1.0).to_device(dev).unwrap();
    f.w = Tensor::new(&[1f32], dev).unwrap();
    f.b = Tensor::new(&[0.3f32], dev).unwrap();
    f
}

const FILTER_DOC: &str = "Marigold ferries leave the north pier at dawn. The keeper, Anselm Varga, logs every \
departure in a green ledger. Passengers pay eleven coins for the crossing. In winter the ferries stop.";

#[test]
fn filter_scores_and_soft_mask_on_cuda_match_cpu() {
    let (_dir, cpu, gpu) = load_pair(&TinySpec::default());
    let doc = tokens(&cpu, FILTER_DOC);
    let ends = layout::breaks(&cpu, &doc).unwrap();
    let p = layout::build_prompt(&cpu, &doc, &ends, "Who logs the departures?", 200, 12).unwrap();
    assert!(p.chunks.len() >= 3);
    // FltLM's absolute threshold and the calibration relative to the best chunk.
    for calibration in [MaskCalibration::Absolute, MaskCalibration::Relative { margin: 0.5, strength: 2.0 }] {
        let run = |m: &Model| {
            let mut f = filter_on(m);
            f.calibration = calibration;
            let scores = layout::score_prompt(m, None, &f, &p).unwrap();
            let ids = Tensor::new(p.tokens.as_slice(), m.device()).unwrap().unsqueeze(0).unwrap();
            let mut hooks = FilterHooks::new(&f, &p.chunks, m.config().num_layers);
            let logits = m.decoder.forward(&ids, &mut KvCache::new(2), None, &mut hooks, Logits::All).unwrap();
            (scores, logits)
        };
        let (s_c, l_c) = run(&cpu);
        let (s_g, l_g) = run(&gpu);
        assert_eq!(s_c.len(), s_g.len());
        for (a, b) in s_c.iter().zip(&s_g) {
            assert!((a.score - b.score).abs() < 5e-2 * a.score.abs().max(1.0), "{calibration:?}: score {} vs {}", a.score, b.score);
            assert!((a.mask - b.mask).abs() < 5e-2 * a.mask.abs().max(1.0), "{calibration:?}: mask {} vs {}", a.mask, b.mask);
        }
        assert!(s_c.iter().any(|c| c.mask < -0.1), "{calibration:?}: the test filter masks something: {s_c:?}");
        assert!(rel_diff(&l_g, &l_c) < 5e-2, "{calibration:?}: logits under the soft mask");
    }
}

#[test]
fn filter_training_gradients_on_cuda_match_cpu() {
    let (_dir, cpu, gpu) = load_pair(&TinySpec::default());
    let doc = tokens(&cpu, FILTER_DOC);
    let ends = layout::breaks(&cpu, &doc).unwrap();
    let p = layout::build_prompt(&cpu, &doc, &ends, "Who logs the departures?", 200, 12).unwrap();
    let positive: Vec<bool> = (0..p.chunks.len()).map(|i| i == 1).collect();
    let step = |m: &Model| {
        let dev = m.device();
        let opts = FilterOptions { enabled: true, layer: Some(0), chunk_tokens: 12, ..Default::default() };
        let f = Filter::new(m.config(), &opts, dev).unwrap();
        // Random head, active mask: set the Vars' values (their tensors are shared with `f`).
        let h = m.config().hidden_size;
        f.vars()[0].set(&rand(&[h], 9, 1.0).to_device(dev).unwrap()).unwrap();
        f.vars()[2].set(&Tensor::new(&[1f32], dev).unwrap()).unwrap();
        f.vars()[3].set(&Tensor::new(&[0.3f32], dev).unwrap()).unwrap();
        let ids = Tensor::new(p.tokens.as_slice(), dev).unwrap().unsqueeze(0).unwrap();
        let emb = m.decoder.embed(&ids).unwrap();
        let mut hooks = FilterHooks::new(&f, &p.chunks, m.config().num_layers);
        let hidden = m.decoder.forward_train(&emb, None, &mut hooks).unwrap().squeeze(0).unwrap();
        let n = p.tokens.len();
        let logits = m.decoder.logits_train(&hidden.narrow(0, 0, n - 1).unwrap()).unwrap();
        let targets = Tensor::new(&p.tokens[1..], dev).unwrap();
        let lm = ops::cross_entropy_masked(&logits, &targets, &Tensor::ones(n - 1, DType::F32, dev).unwrap()).unwrap();
        let fl = layout::filter_loss(&hooks.scores().unwrap(), &positive, 1.0, &f.log_tau).unwrap();
        let loss = (lm + (fl * 0.5).unwrap()).unwrap();
        let grads = loss.backward().unwrap();
        let g: Vec<Tensor> = f
            .vars()
            .iter()
            .enumerate()
            .map(|(i, v)| {
                let g = grads.get(v.as_tensor());
                g.unwrap_or_else(|| panic!("no gradient for filter parameter {i} {:?} on {:?}", v.shape(), m.device())).clone()
            })
            .collect();
        (loss.to_scalar::<f32>().unwrap(), g)
    };
    assert_steps_close("filter", &step(&cpu), &step(&gpu));
}

#[test]
fn cdt_embedding_gradients_and_critical_tokens_on_cuda_match_cpu() {
    let (_dir, cpu, gpu) = load_pair(&TinySpec::default());
    let toks = tokens(&cpu, "Context denoising moves the embeddings of the tokens that do not matter.");
    let n = toks.len();
    // CDT's pass 1: the gradient of the loss with respect to the input embeddings.
    let pass1 = |m: &Model| {
        let dev = m.device();
        let ids = Tensor::new(&toks[..n - 1], dev).unwrap().unsqueeze(0).unwrap();
        let emb = Var::from_tensor(&m.decoder.embed(&ids).unwrap().to_dtype(DType::F32).unwrap()).unwrap();
        let x = emb.as_tensor().to_dtype(m.decoder.dtype()).unwrap();
        let hidden = m.decoder.forward_train(&x, None, &mut NoHooks).unwrap().squeeze(0).unwrap();
        let logits = m.decoder.logits_train(&hidden).unwrap();
        let targets = Tensor::new(&toks[1..], dev).unwrap();
        let loss = ops::cross_entropy_masked(&logits, &targets, &Tensor::ones(n - 1, DType::F32, dev).unwrap()).unwrap();
        let grads = loss.backward().unwrap();
        grads.get(emb.as_tensor()).expect("embedding gradient").squeeze(0).unwrap()
    };
    let (g_c, g_g) = (pass1(&cpu), pass1(&gpu));
    assert!(max_abs(&g_c) > 0.0);
    assert!(rel_diff(&g_g, &g_c) < 0.1, "embedding gradients");
    let (crit_c, norms_c) = lift_serve::base::cdt::critical_tokens(&g_c).unwrap();
    let (crit_g, norms_g) = lift_serve::base::cdt::critical_tokens(&g_g).unwrap();
    // Critical = norm ≥ mean: tokens near the mean may flip under bf16, the clear ones may not.
    let mean = norms_c.iter().sum::<f32>() / norms_c.len() as f32;
    for (i, (a, b)) in crit_c.iter().zip(&crit_g).enumerate() {
        if (norms_c[i] - mean).abs() > 0.1 * mean {
            assert_eq!(a, b, "token {i}: norm {} (CUDA {}) vs mean {mean}", norms_c[i], norms_g[i]);
        }
    }
}

#[test]
fn fused_ops_on_cuda_match_cpu() {
    let dev = gpu();
    let grad_of = |x: &Var, y: &Tensor, seed: u64| {
        let w = rand(y.dims(), seed, 1.0).to_device(y.device()).unwrap();
        let loss = (y.to_dtype(DType::F32).unwrap() * w).unwrap().sum_all().unwrap();
        loss.backward().unwrap().get(x.as_tensor()).expect("input gradient").clone()
    };
    let both = |name: &str, f: &dyn Fn(&Tensor) -> Tensor, x: &Tensor, tol: f32| {
        let xc = Var::from_tensor(x).unwrap();
        let xg = Var::from_tensor(&x.to_device(&dev).unwrap()).unwrap();
        let (yc, yg) = (f(xc.as_tensor()), f(xg.as_tensor()));
        assert!(yg.device().is_cuda(), "{name} left the GPU");
        let d = rel_diff(&yg, &yc);
        assert!(d < tol, "{name} forward: {d}");
        let d = rel_diff(&grad_of(&xg, &yg, 77), &grad_of(&xc, &yc, 77));
        assert!(d < tol, "{name} dx: {d}");
    };
    let (b, h, t, d) = (2, 3, 9, 16);
    let x4 = rand(&[b, h, t, d], 1, 1.0);
    let angles: Vec<f32> = (0..(t + 3) * d / 2).map(|i| (i as f32 * 0.37).sin()).collect();
    let ang = Tensor::from_vec(angles, (t + 3, d / 2), &Device::Cpu).unwrap();
    let (cos, sin) = (ang.cos().unwrap(), ang.sin().unwrap());
    let on = |t: &Tensor, like: &Tensor| t.to_device(like.device()).unwrap();
    both("rope", &|x| ops::rope(x, &on(&cos, x), &on(&sin, x)).unwrap(), &x4, 1e-4);
    both("rope_interleaved", &|x| ops::rope_interleaved(x, &on(&cos, x), &on(&sin, x)).unwrap(), &x4, 1e-4);
    let x2 = rand(&[11, 40], 2, 2.0);
    let wn = rand(&[40], 3, 1.0);
    both("rms_norm", &|x| ops::rms_norm(x, &on(&wn, x), 1e-5).unwrap(), &x2, 1e-4);
    both("softmax_last_dim", &|x| ops::softmax_last_dim(x).unwrap(), &x2, 1e-4);
    let up = rand(&[11, 40], 4, 1.0);
    both("silu_mul", &|x| ops::silu_mul(x, &on(&up, x)).unwrap(), &x2, 1e-4);
    let wl = rand(&[24, 40], 5, 0.2);
    both("frozen_linear", &|x| ops::frozen_linear(x, &on(&wl, x)).unwrap(), &x2, 1e-4);
    both(
        "frozen_linear bf16",
        &|x| ops::frozen_linear(&x.to_dtype(DType::BF16).unwrap(), &on(&wl, x).to_dtype(DType::BF16).unwrap()).unwrap(),
        &x2,
        3e-2,
    );
    let targets = Tensor::new(&[3u32, 0, 39, 7, 7, 1, 2, 30, 5, 6, 8], &Device::Cpu).unwrap();
    let weights = Tensor::new(&[1f32, 1., 0., 1., 1., 1., 0., 1., 1., 1., 1.], &Device::Cpu).unwrap();
    let ce = |x: &Tensor| ops::cross_entropy_masked(x, &on(&targets, x), &on(&weights, x)).unwrap().unsqueeze(0).unwrap();
    both("cross_entropy_masked", &ce, &x2, 1e-4);
}

/// A short absorb's options: windows of 32 tokens, one epoch each, 2–4 extractive QA pairs.
fn short_absorb_options() -> AbsorbOptions {
    let mut opts = AbsorbOptions::default();
    opts.plan.window = 32;
    opts.plan.training_context_tokens = 16;
    opts.train.epochs = [1, 1];
    opts.qa.use_model = false;
    opts.qa.max_pairs = 4;
    opts.qa.min_pairs = 2;
    opts
}

const SHORT_ABSORB_TEXT: &str = "The harbor of Velmora was built in 1843 by the engineer Ada Quill. It has three piers. \
The lighthouse keeper, Tomas Brell, painted the tower blue in 1901. The harbor master keeps a brass bell.";

#[test]
fn short_absorb_on_cuda_follows_the_cpu() {
    // The whole LIFT pipeline (plan, extractive QA, contextualized training, QA training) on the
    // GPU: same plan and QA pairs, and a first-step loss close to the CPU's.
    let (_dir, cpu, gpu) = load_pair(&TinySpec::default());
    let opts = short_absorb_options();
    let text = SHORT_ABSORB_TEXT;
    let run = |m: &Model| absorb(m, &Document::encode(m, text).unwrap(), None, &opts, &mut |_| {}, &|| false).unwrap();
    let (c, g) = (run(&cpu), run(&gpu));
    assert_eq!(c.report.steps, g.report.steps, "same plan on both devices");
    assert_eq!(c.qa.len(), g.qa.len(), "same QA pairs on both devices");
    let (lc, lg) = (c.report.step_losses[0], g.report.step_losses[0]);
    assert!((lc - lg).abs() < 5e-2 * lc.abs().max(1.0), "first-step loss {lc} vs {lg}");
    assert!(g.report.step_losses.iter().all(|l| l.is_finite()), "CUDA losses are finite");
    for (name, t) in g.bundle.named_tensors() {
        assert_eq!(t.dtype(), DType::F32, "{name}: adapters stay f32");
    }
}

#[test]
fn absorbing_until_learned_on_cuda_probes_like_the_cpu() {
    // Absorb until learned (issue 21) on the GPU: the same probe pairs held aside, probes at the
    // same steps, the first probe loss (before training has diverged) close to the CPU's, and the
    // stop rule's floor and ceiling held.
    let (_dir, cpu, gpu) = load_pair(&TinySpec::default());
    let mut opts = AbsorbOptions::default();
    opts.plan.window = 32;
    opts.plan.training_context_tokens = 16;
    opts.train.epochs = [0, 6];
    opts.qa.use_model = false;
    opts.qa.max_pairs = 8;
    opts.qa.min_pairs = 4;
    opts.train.until_learned = Some(lift_serve::lift::absorb::trainer::UntilLearned {
        probe_every: 1,
        min_steps: 10,
        patience: 2,
        ..Default::default()
    });
    let text = "The harbor of Velmora was built in 1843 by the engineer Ada Quill. It has three piers. \
The lighthouse keeper, Tomas Brell, painted the tower blue in 1901. The harbor master keeps a brass bell. \
Every spring the town holds a lantern festival on the east pier. The ferry to Tern Island leaves at dawn.";
    let run = |m: &Model| absorb(m, &Document::encode(m, text).unwrap(), None, &opts, &mut |_| {}, &|| false).unwrap();
    let (c, g) = (run(&cpu), run(&gpu));
    assert_eq!(c.manifest.training["probe_pairs"], g.manifest.training["probe_pairs"], "same probes held aside");
    assert!(c.manifest.training["probe_pairs"].as_u64().unwrap() >= 2);
    assert_eq!(c.report.planned_steps, g.report.planned_steps);
    let (pc, pg) = (c.report.probe_curve[0], g.report.probe_curve[0]);
    assert_eq!(pc.0, pg.0, "probes at the same steps");
    assert!((pc.1 - pg.1).abs() < 5e-2 * pc.1.abs().max(1.0), "first probe loss {} vs {}", pc.1, pg.1);
    for r in [&c.report, &g.report] {
        assert!(r.steps >= 10 && r.steps <= r.planned_steps, "floor and ceiling: {} of {}", r.steps, r.planned_steps);
        assert!(r.probe_curve.iter().all(|(_, l)| l.is_finite()));
    }
}

#[test]
fn prepared_base_under_a_document_adapter_on_cuda_matches_cpu() {
    // A prepared base saved once (non-zero LoRA B, an active filter), loaded and installed on
    // each device: answering (base LoRA + filter mask + document Gated Memory, prefill and
    // decode) and a document-adapter training step over the frozen base agree with the CPU.
    let dir = tempfile::tempdir().unwrap();
    let path = write_hf(&dir.path().join("tiny"), &TinySpec::default()).unwrap();
    let plain = Model::load(&path, &Device::Cpu).unwrap();
    let filter_opts = FilterOptions { enabled: true, layer: Some(0), chunk_tokens: 12, ..Default::default() };
    let mut base = PreparedBase::new(&plain, &BaseShape { rank: 4, filter: filter_opts }, 3).unwrap();
    {
        let (lora, filter) = base.vars();
        for (i, v) in lora.iter().enumerate().filter(|(i, _)| i % 2 == 1) {
            v.set(&rand(v.dims(), 200 + i as u64, 0.05)).unwrap();
        }
        filter[0].set(&rand(filter[0].dims(), 9, 1.0)).unwrap();
        filter[2].set(&Tensor::new(&[1f32], &Device::Cpu).unwrap()).unwrap();
        filter[3].set(&Tensor::new(&[0.3f32], &Device::Cpu).unwrap()).unwrap();
    }
    let base_dir = dir.path().join("base");
    base.save(&base_dir).unwrap();
    let with_base = |dev: &Device| {
        let mut m = Model::load(&path, dev).unwrap();
        m.decoder.cpu_kv_dtype = DType::F32;
        PreparedBase::load(&base_dir, &m).unwrap().install(&mut m).unwrap();
        m
    };
    let (cpu, gpu) = (with_base(&Device::Cpu), with_base(&gpu()));
    assert_eq!(cpu.info.fingerprint, gpu.info.fingerprint, "the base's hash is in both fingerprints");
    assert_ne!(cpu.info.fingerprint, plain.info.fingerprint);

    let doc = tokens(&cpu, FILTER_DOC);
    let ends = layout::breaks(&cpu, &doc).unwrap();
    let p = layout::build_prompt(&cpu, &doc, &ends, "Who logs the departures?", 200, 12).unwrap();
    let cfg = cpu.config().clone();
    let answer = |m: &Model| {
        let f = m.base_filter().expect("the installed base has a filter");
        let gm = GatedMemory::new(&cfg, &[1], false, 5, m.device()).unwrap().detached();
        let ids = Tensor::new(p.tokens.as_slice(), m.device()).unwrap().unsqueeze(0).unwrap();
        let n = p.tokens.len();
        let mut hooks = FilterHooks::new(f, &p.chunks, cfg.num_layers);
        let mut cache = KvCache::new(cfg.num_layers);
        let prefill =
            m.decoder.forward(&ids.narrow(1, 0, n - 1).unwrap(), &mut cache, Some(&gm), &mut hooks, Logits::All).unwrap();
        let last =
            m.decoder.forward(&ids.narrow(1, n - 1, 1).unwrap(), &mut cache, Some(&gm), &mut hooks, Logits::Last).unwrap();
        (prefill, last, hooks.report().unwrap())
    };
    let (pre_c, last_c, rep_c) = answer(&cpu);
    let (pre_g, last_g, rep_g) = answer(&gpu);
    assert!(rel_diff(&pre_g, &pre_c) < 5e-2, "prefill logits over the prepared base");
    assert!(rel_diff(&last_g, &last_c) < 5e-2, "decode logits over the prepared base");
    assert!(rep_c.iter().any(|c| c.mask < -0.1), "the base's filter masks something: {rep_c:?}");
    for (a, b) in rep_c.iter().zip(&rep_g) {
        assert!((a.score - b.score).abs() < 5e-2 * a.score.abs().max(1.0), "score {} vs {}", a.score, b.score);
    }

    let toks = tokens(&cpu, "The document adapter trains over the frozen prepared base.");
    let step = |m: &Model| {
        let gm = GatedMemory::new(&cfg, &[1], false, 11, m.device()).unwrap();
        train_step(m, &toks, Some(&gm as &dyn Adapter), None, &mut NoHooks, gm.vars())
    };
    assert_steps_close("gated memory over the prepared base", &step(&cpu), &step(&gpu));
}

/// The prepared base over a quantized file: its LoRA is merged into the float copies, and the
/// CPU's quantized inference path (which the merge does not reach) adds it per token. CUDA runs
/// a quantized layer through the merged float copy, so it must not add it again: it did, and the
/// real model's GPU answers stopped early ("August 26, 1960" → "August 26"). The base's own effect
/// on the logits is asserted to be well above the tolerance, so applying it twice would fail here.
#[test]
fn prepared_base_over_a_quantized_file_on_cuda_matches_cpu() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_gguf(&dir.path().join("tiny_q8.gguf"), &TinySpec::default(), GgmlDType::Q8_0).unwrap();
    let plain = cpu_model(&path);
    let mut base = PreparedBase::new(&plain, &BaseShape { rank: 4, filter: FilterOptions::default() }, 3).unwrap();
    for (i, v) in base.vars().0.iter().enumerate().filter(|(i, _)| i % 2 == 1) {
        v.set(&rand(v.dims(), 300 + i as u64, 0.05)).unwrap();
    }
    let base_dir = dir.path().join("base");
    base.save(&base_dir).unwrap();
    let with_base = |mut m: Model| {
        PreparedBase::load(&base_dir, &m).unwrap().install(&mut m).unwrap();
        m
    };
    let (cpu, gpu) = (with_base(cpu_model(&path)), with_base(Model::load(&path, &gpu()).unwrap()));
    let toks = tokens(&cpu, "The prepared base answers over quantized weights, one token at a time.");
    // Prefill, then decode rows one at a time: the quantized inference path on both devices.
    let decode = |m: &Model| {
        let ids = Tensor::new(toks.as_slice(), m.device()).unwrap().unsqueeze(0).unwrap();
        let n = toks.len();
        let mut cache = KvCache::new(m.config().num_layers);
        m.decoder.forward(&ids.narrow(1, 0, n - 3).unwrap(), &mut cache, None, &mut NoHooks, Logits::Last).unwrap();
        (n - 3..n)
            .map(|i| {
                m.decoder.forward(&ids.narrow(1, i, 1).unwrap(), &mut cache, None, &mut NoHooks, Logits::Last).unwrap()
            })
            .collect::<Vec<_>>()
    };
    let (c, g, p) = (decode(&cpu), decode(&gpu), decode(&plain));
    // On an H200 with the fix: GPU vs CPU 0.006, the base's effect 0.07 (row 0).
    let tol = 2e-2;
    for (i, ((c, g), p)) in c.iter().zip(&g).zip(&p).enumerate() {
        let (d, effect) = (rel_diff(g, c), rel_diff(c, p));
        eprintln!("decode row {i}: GPU vs CPU {d}, the base's effect on the CPU {effect}");
        assert!(effect > 2.0 * tol, "row {i}: the base changes the logits too little ({effect}) for this check to see it twice");
        assert!(d < tol, "row {i}: decode logits over the prepared base on a quantized file: GPU vs CPU {d}");
    }
}

/// Continuous batching (`Decoder::forward_batch`) on CUDA: a batch mixing a prompt chunk and
/// decoding rows with different adapters (Gated Memory, LoRA, none) gives each sequence the
/// logits the CPU gives it, and each sequence's batched logits stay close to its logits alone
/// on the GPU (bf16 matmuls there are not row-independent, so not bit-exact).
#[test]
fn batched_forward_with_mixed_adapters_on_cuda_matches_cpu() {
    use lift_serve::model::SeqInput;
    let (_dir, cpu, gpu) = load_pair(&TinySpec::default());
    let cfg = cpu.config().clone();
    let prompts = [tokens(&cpu, "A prompt still being read by the batch, long enough for the float path."), tokens(&cpu, "Decoding"), tokens(&cpu, "Also decoding here")];
    let run = |m: &Model| {
        let gm: Box<dyn Adapter> = Box::new(GatedMemory::new(&cfg, &[0, 1], false, 5, m.device()).unwrap().detached());
        let lora: Box<dyn Adapter> = Box::new(lora_on(m, 3, false));
        let adapters = [Some(gm.as_ref()), Some(lora.as_ref()), None];
        let mut caches: Vec<KvCache> = (0..3).map(|_| KvCache::new(2)).collect();
        let mut hooks = [NoHooks, NoHooks, NoHooks];
        // Sequences 1 and 2 read all but their last token first; 0 joins with its whole prompt.
        let mut alone = Vec::new();
        for i in 1..3 {
            let p = &prompts[i];
            let ids = Tensor::new(&p[..p.len() - 1], m.device()).unwrap().unsqueeze(0).unwrap();
            m.decoder.forward(&ids, &mut caches[i], adapters[i], &mut NoHooks, Logits::Last).unwrap();
            let mut c = caches[i].fork().unwrap();
            let last = Tensor::new(&p[p.len() - 1..], m.device()).unwrap().unsqueeze(0).unwrap();
            alone.push(m.decoder.forward(&last, &mut c, adapters[i], &mut NoHooks, Logits::Last).unwrap());
        }
        let ids: Vec<&[u32]> = vec![&prompts[0], &prompts[1][prompts[1].len() - 1..], &prompts[2][prompts[2].len() - 1..]];
        let mut inputs: Vec<SeqInput> = caches
            .iter_mut()
            .zip(hooks.iter_mut())
            .enumerate()
            .map(|(i, (cache, h))| SeqInput { ids: ids[i], cache, adapter: adapters[i], adapter_key: i + 1, hooks: h })
            .collect();
        let batched = m.decoder.forward_batch(&mut inputs).unwrap();
        (batched, alone)
    };
    let (bc, ac) = run(&cpu);
    let (bg, ag) = run(&gpu);
    assert!(bg.device().is_cuda());
    for i in 0..3 {
        let d = rel_diff(&bg.get(i).unwrap(), &bc.get(i).unwrap());
        assert!(d < 5e-2, "sequence {i}: batched logits CUDA vs CPU {d}");
    }
    for (k, i) in (1..3).enumerate() {
        assert!(rel_diff(&bc.get(i).unwrap(), &ac[k].squeeze(0).unwrap()) < 1e-5, "CPU: batched = alone for sequence {i}");
        let d = rel_diff(&bg.get(i).unwrap(), &ag[k].squeeze(0).unwrap());
        assert!(d < 5e-2, "CUDA: sequence {i} batched vs alone {d}");
    }
}

/// The CUDA decode kernel (kernels/decode_attention.cu) through `forward_batch`: four sequences
/// with caches of 3 to 300 tokens (one grows its buffers mid-run), head dims 16, 64 (SmolLM2's,
/// 3 query heads per KV head) and 128, an additive key bias on one sequence, against the CPU's
/// batched decode step by step (both fed the CPU's greedy tokens, so that they stay on one path).
#[test]
fn batched_decode_attention_on_cuda_matches_cpu() {
    use lift_serve::model::SeqInput;
    struct KeyBias(Device);
    impl ForwardHooks for KeyBias {
        fn attention_bias(&self, layer: usize, _start: usize, q_len: usize, k_len: usize) -> candle_core::Result<Option<Tensor>> {
            if q_len != 1 {
                return Ok(None);
            }
            let b: Vec<f32> = (0..k_len).map(|k| if (k + layer) % 4 == 0 { -3.0 } else if k % 7 == 0 { 0.5 } else { 0.0 }).collect();
            Ok(Some(Tensor::from_vec(b, k_len, &self.0)?))
        }
    }
    for (hidden, heads, kv_heads) in [(64, 4, 2), (192, 3, 1), (256, 2, 1)] {
        let spec = TinySpec { hidden, heads, kv_heads, ..Default::default() };
        let (_dir, cpu, gpu) = load_pair(&spec);
        let text = tokens(&cpu, &"Every sequence keeps its own cache, and the batch reads them all. ".repeat(6));
        let lens = [3usize, 40, 130, 300];
        assert!(text.len() > 310);
        let prefill = |m: &Model| -> Vec<KvCache> {
            lens.iter()
                .map(|&n| {
                    let mut c = KvCache::new(spec.layers);
                    let ids = Tensor::new(&text[..n], m.device()).unwrap().unsqueeze(0).unwrap();
                    m.decoder.forward(&ids, &mut c, None, &mut NoHooks, Logits::Last).unwrap();
                    c
                })
                .collect()
        };
        let step = |m: &Model, caches: &mut [KvCache], next: &[u32]| -> Tensor {
            let mut hooks: Vec<Option<KeyBias>> = (0..caches.len()).map(|i| (i == 2).then(|| KeyBias(m.device().clone()))).collect();
            let ids: Vec<[u32; 1]> = next.iter().map(|&t| [t]).collect();
            let mut inputs: Vec<SeqInput> = caches
                .iter_mut()
                .zip(hooks.iter_mut())
                .zip(&ids)
                .map(|((cache, h), ids)| SeqInput { ids, cache, adapter: None, adapter_key: 0, hooks: h })
                .collect();
            m.decoder.forward_batch(&mut inputs).unwrap()
        };
        let (mut on_cpu, mut on_gpu) = (prefill(&cpu), prefill(&gpu));
        let mut next: Vec<u32> = lens.iter().map(|&n| text[n]).collect();
        for s in 0..6 {
            let (lc, lg) = (step(&cpu, &mut on_cpu, &next), step(&gpu, &mut on_gpu, &next));
            assert!(lg.device().is_cuda());
            for i in 0..lens.len() {
                let d = rel_diff(&lg.get(i).unwrap(), &lc.get(i).unwrap());
                assert!(d < 5e-2, "head dim {}, step {s}, sequence {i} ({} keys): CUDA vs CPU {d}", hidden / heads, lens[i] + s + 1);
            }
            next = lc.argmax(1).unwrap().to_vec1::<u32>().unwrap();
        }
    }
}

/// The trainer's AdamW with global-norm clipping on CUDA (kernels/adamw.cu: two launches for all
/// tensors) against its CPU path (candle ops, `clip`): parameters and both moments after steps
/// whose gradients are clipped (norm far above the bound) and not (small ones), with weight
/// decay, over tensors of several sizes (one larger than a block row's 32 × 256 elements).
#[test]
fn fused_adamw_with_clipping_on_cuda_matches_cpu() {
    use lift_serve::lift::absorb::trainer::{AdamW, TrainOptions};
    let shapes: [&[usize]; 4] = [&[9, 64, 128], &[9, 128], &[9, 8], &[300, 301]];
    let opts = TrainOptions { weight_decay: 0.01, max_grad_norm: 1.0, ..Default::default() };
    let run = |dev: &Device| {
        let vars: Vec<Var> =
            shapes.iter().enumerate().map(|(i, s)| Var::from_tensor(&rand(s, 10 + i as u64, 0.2).to_device(dev).unwrap()).unwrap()).collect();
        let mut opt = AdamW::new(vars.clone(), &opts).unwrap();
        for (step, scale) in [(0u64, 5.0f32), (1, 1e-3), (2, 3.0)] {
            let grads: Vec<Tensor> =
                shapes.iter().enumerate().map(|(i, s)| rand(s, 100 * step + i as u64, scale).to_device(dev).unwrap()).collect();
            opt.clip_and_step(grads, opts.max_grad_norm, 1e-3).unwrap();
        }
        let (m, v, t) = opt.state();
        assert_eq!(t, 3);
        (vars.iter().map(|x| x.as_tensor().clone()).collect::<Vec<_>>(), m.to_vec(), v.to_vec())
    };
    let (pc, mc, vc) = run(&Device::Cpu);
    let (pg, mg, vg) = run(&gpu());
    assert!(pg[0].device().is_cuda());
    for i in 0..shapes.len() {
        for (what, a, b) in [("parameters", &pg[i], &pc[i]), ("first moment", &mg[i], &mc[i]), ("second moment", &vg[i], &vc[i])] {
            let d = rel_diff(a, b);
            assert!(d < 1e-4, "tensor {i} {:?}: {what} CUDA vs CPU {d}", shapes[i]);
        }
    }
}

#[test]
fn an_absorb_stopped_and_resumed_on_cuda_ends_as_an_uninterrupted_one() {
    // A checkpoint holds the adapter and AdamW's moments (which the fused CUDA AdamW updates in
    // place): written from the GPU, read back onto it, the run goes on as if it had never
    // stopped; and the CPU plans the same steps.
    use lift_serve::lift::absorb::checkpoint::Resumable;
    use lift_serve::lift::{absorb_resumable, AbsorbEvent};
    use lift_serve::testing::MemoryCheckpoint as Mem;
    use std::cell::Cell;

    let (_dir, cpu, gpu) = load_pair(&TinySpec::default());
    let mut opts = short_absorb_options();
    opts.train.epochs = [2, 2];
    let text = SHORT_ABSORB_TEXT;
    let run = |m: &Model, store: Option<&Mem>, stop: Option<usize>| {
        let document = Document::encode(m, text).unwrap();
        let steps = Cell::new(0);
        let on_event = &mut |e: AbsorbEvent| {
            if let AbsorbEvent::Train(p) = e {
                steps.set(p.step);
            }
        };
        let cancel = || stop.is_some_and(|n| steps.get() >= n);
        let resumable = store.map(|s| Resumable { store: Box::new(s.clone()), interval: std::time::Duration::ZERO });
        absorb_resumable(m, &document, None, &opts, on_event, &cancel, resumable)
    };
    let whole = run(&gpu, None, None).unwrap();
    let store = Mem::default();
    assert!(run(&gpu, Some(&store), Some(3)).is_err(), "the first run was stopped");
    let resumed = run(&gpu, Some(&store), None).unwrap();
    assert_eq!(resumed.manifest.training["resumed_from_step"], 3);
    assert_eq!(resumed.report.steps, whole.report.steps);
    for ((name, a), (_, b)) in resumed.bundle.named_tensors().iter().zip(whole.bundle.named_tensors().iter()) {
        let d = rel_diff(a, b);
        assert!(d < 1e-3, "{name}: the resumed adapter differs from the uninterrupted one by {d} (relative)");
    }
    assert_eq!(run(&cpu, None, None).unwrap().report.steps, whole.report.steps, "the CPU plans the same steps");
}

#[test]
fn batched_training_rows_on_cuda_match_cpu_and_the_rows_one_by_one() {
    use lift_serve::lift::absorb::plan::{Plan, PlanOptions};
    use lift_serve::lift::absorb::qa::{QaPair, QaSource};
    use lift_serve::lift::absorb::trainer::{train, RunControl, TrainInputs, TrainOptions};
    let (_dir, cpu, gpu) = load_pair(&TinySpec::default());
    let pair = |question: &str, answer: &str| QaPair {
        question: question.into(),
        answer: answer.into(),
        evidence: answer.into(),
        evidence_span: (0, 0),
        source: QaSource::Extractive,
    };
    let pairs = [pair("Who built the harbor?", "Ada Quill"), pair("How many piers?", "three"), pair("Who keeps the light?", "Tomas Brell")];
    // Three rows a step, segments and questions of several lengths in one batched forward.
    let run = |m: &Model, batch_rows: Option<f64>| {
        let doc = tokens(m, SHORT_ABSORB_TEXT);
        let plan = Plan::new(m, &doc, &pairs, &PlanOptions { window: 32, training_context_tokens: 16, ..Default::default() }).unwrap();
        let gm = GatedMemory::new(m.config(), &[0, 1], false, 3, m.device()).unwrap();
        let opts = TrainOptions { epochs: [1, 1], accumulation: 3, batch_rows, seed: 2, ..Default::default() };
        let inputs = TrainInputs { doc: &doc, plan: &plan, adapter: &gm, vars: gm.vars() };
        let report = train(m, inputs, &opts, RunControl { on_progress: &mut |_| {}, cancel: &|| false }).unwrap();
        let params: Vec<Tensor> = gm.vars().iter().map(|v| v.as_tensor().detach()).collect();
        (report.step_losses, params)
    };
    let (c, g, g1) = (run(&cpu, Some(10.0)), run(&gpu, Some(10.0)), run(&gpu, None));
    assert!(c.0.len() >= 3, "{} steps", c.0.len());
    for (what, other) in [("CPU", &c), ("one by one on CUDA", &g1)] {
        let (lc, lg) = (other.0[0], g.0[0]);
        assert!((lc - lg).abs() < 2e-2 * lc.abs().max(1.0), "first-step loss batched on CUDA {lg} vs {what} {lc}");
        for (i, (a, b)) in g.1.iter().zip(&other.1).enumerate() {
            assert!(a.device().is_cuda(), "parameter {i} left the GPU");
            let d = rel_diff(a, b);
            assert!(d < 0.1, "parameter {i} after training, batched on CUDA vs {what}: {d}");
        }
    }
}
