//! CUDA checks, built only with `--features cuda` and meaningful only on a machine with a GPU:
//! `cargo test --release --features cuda --test cuda`. Kernels against their CPU references
//! (forward and backward), and the tiny model on CUDA (bf16 base, f32 adapter) against the CPU
//! (f32) within bf16 tolerances: inference logits, KV-cache decode, and a Gated Memory training
//! step's loss and gradients.
#![cfg(feature = "cuda")]

use candle_core::quantized::GgmlDType;
use candle_core::{DType, Device, Tensor, Var};
use lift_serve::adapters::GatedMemory;
use lift_serve::kernels::{gated_memory, masked_softmax};
use lift_serve::model::{ops, Adapter, KvCache, Logits, Model, NoHooks};
use lift_serve::testing::{write_gguf, write_hf, Rng, TinySpec};

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
            let out = gated_memory::mix(&gm.layers[&0], qv.as_tensor(), av.as_tensor()).unwrap();
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

fn load_pair(spec: &TinySpec) -> (tempfile::TempDir, Model, Model) {
    let dir = tempfile::tempdir().unwrap();
    let path = write_hf(&dir.path().join("tiny"), spec).unwrap();
    let cpu = Model::load(&path, &Device::Cpu).unwrap();
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

#[test]
fn quantized_gguf_runs_on_cuda() {
    let spec = TinySpec::default();
    let dir = tempfile::tempdir().unwrap();
    let path = write_gguf(&dir.path().join("tiny_q8.gguf"), &spec, GgmlDType::Q8_0).unwrap();
    let cpu = Model::load(&path, &Device::Cpu).unwrap();
    let gpu = Model::load(&path, &gpu()).unwrap();
    let toks = cpu.tokenizer.encode("Quantized weights on the GPU.", false).unwrap();
    let input = |m: &Model| Tensor::new(toks.as_slice(), m.device()).unwrap().unsqueeze(0).unwrap();
    // Threshold 1: every matmul through the bf16 float weights; usize::MAX: through the quantized
    // kernels (in f32, cast at the layer).
    for rows in [1usize, usize::MAX] {
        let a = cpu.decoder.forward_with_float_threshold(&input(&cpu), rows).unwrap();
        let b = gpu.decoder.forward_with_float_threshold(&input(&gpu), rows).unwrap();
        assert!(rel_diff(&b, &a) < 5e-2, "threshold {rows}");
    }
}

#[test]
fn gated_memory_training_step_on_cuda_matches_cpu() {
    let spec = TinySpec::default();
    let (_dir, cpu, gpu) = load_pair(&spec);
    let cfg = cpu.config().clone();
    let toks = cpu.tokenizer.encode("Adapters learn the document; the base model stays frozen.", false).unwrap();
    let n = toks.len();
    let step = |m: &Model| {
        let dev = m.device();
        let gm = GatedMemory::new(&cfg, &[0, 1], false, 11, dev).unwrap();
        let ids = Tensor::new(&toks[..n - 1], dev).unwrap().unsqueeze(0).unwrap();
        let targets = Tensor::new(&toks[1..], dev).unwrap();
        let emb = m.decoder.embed(&ids).unwrap();
        let hidden =
            m.decoder.forward_train(&emb, Some(&gm as &dyn Adapter), &mut NoHooks).unwrap().squeeze(0).unwrap();
        let logits = m.decoder.logits_train(&hidden).unwrap();
        assert_eq!(logits.dtype(), DType::F32);
        let weights = Tensor::ones(n - 1, DType::F32, dev).unwrap();
        let loss = ops::cross_entropy_masked(&logits, &targets, &weights).unwrap();
        let grads = loss.backward().unwrap();
        let g: Vec<Tensor> =
            gm.vars().iter().map(|v| grads.get(v.as_tensor()).expect("adapter gradient").clone()).collect();
        for v in gm.vars() {
            assert_eq!(v.dtype(), DType::F32, "adapter parameters stay f32");
        }
        (loss.to_scalar::<f32>().unwrap(), g)
    };
    let (l_cpu, g_cpu) = step(&cpu);
    let (l_gpu, g_gpu) = step(&gpu);
    assert!((l_cpu - l_gpu).abs() < 2e-2 * l_cpu.abs().max(1.0), "loss {l_cpu} vs {l_gpu}");
    for (i, (a, b)) in g_gpu.iter().zip(&g_cpu).enumerate() {
        let d = rel_diff(a, b);
        assert!(d < 0.1, "gradient {i}: {d}");
        assert!(max_abs(b) > 0.0, "gradient {i} is zero on the CPU");
    }
}
