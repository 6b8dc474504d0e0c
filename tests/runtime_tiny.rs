//! Mechanics of the model runtime on a tiny random model written to disk by the test:
//! loaders agree, the KV cache is exact, the trainable path equals the inference path, and
//! gradients reach adapter parameters only.

use candle_core::quantized::GgmlDType;
use candle_core::{DType, Device, Tensor};
use lift_serve::adapters::GatedMemory;
use lift_serve::model::generate::{generate, SamplingParams};
use lift_serve::model::{ops, ChatMessage, ForwardHooks, KvCache, Logits, Model, NoHooks, Projection};
use lift_serve::testing::{write_gguf, write_hf, TinySpec};

fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    (a - b).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap()
}

/// A tiny model with an f32 KV cache and f32 float matmuls: these tests check that paths agree
/// to float precision; the default f16 cache rounds keys and values, the default bf16 matmuls
/// their inputs (their cost on real text: `tests/runtime_real.rs`; and
/// `kv_cache_decoding_equals_full_recomputation` below runs the f16 cache too).
fn tiny(spec: &TinySpec) -> (tempfile::TempDir, Model) {
    let dir = tempfile::tempdir().unwrap();
    let path = write_hf(&dir.path().join("tiny"), spec).unwrap();
    let mut model = Model::load(&path, &Device::Cpu).unwrap();
    model.decoder.cpu_kv_dtype = DType::F32;
    model.decoder.cpu_float_dtype = DType::F32;
    (dir, model)
}

fn ids(model: &Model, text: &str) -> Vec<u32> {
    model.tokenizer.encode(text, false).unwrap()
}

#[test]
fn hf_and_gguf_loaders_agree() {
    for qkv_bias in [false, true] {
        let spec = TinySpec { qkv_bias, ..Default::default() };
        let (dir, hf) = tiny(&spec);
        let gguf_path = write_gguf(&dir.path().join("tiny.gguf"), &spec, GgmlDType::F32).unwrap();
        let mut gguf = Model::load(&gguf_path, &Device::Cpu).unwrap();
        gguf.decoder.cpu_kv_dtype = DType::F32;
        gguf.decoder.cpu_float_dtype = DType::F32;
        assert_eq!(hf.config().architecture, gguf.config().architecture);
        let toks = ids(&hf, "The quick brown fox jumps over the lazy dog.");
        assert_eq!(toks, ids(&gguf, "The quick brown fox jumps over the lazy dog."));
        let input = Tensor::new(toks.as_slice(), &Device::Cpu).unwrap().unsqueeze(0).unwrap();
        let a = hf.decoder.forward(&input, &mut KvCache::new(2), None, &mut NoHooks, Logits::All).unwrap();
        let b = gguf.decoder.forward(&input, &mut KvCache::new(2), None, &mut NoHooks, Logits::All).unwrap();
        let d = max_abs_diff(&a, &b);
        assert!(d < 1e-4, "qkv_bias={qkv_bias}: GGUF (llama.cpp q/k layout, interleaved RoPE) vs HF logits differ by {d}");
    }
}

#[test]
fn quantized_gguf_stays_close_to_float() {
    let spec = TinySpec::default();
    let (dir, hf) = tiny(&spec);
    let path = write_gguf(&dir.path().join("tiny_q8.gguf"), &spec, GgmlDType::Q8_0).unwrap();
    let q = Model::load(&path, &Device::Cpu).unwrap();
    let toks = ids(&hf, "Quantized weights are close to float weights.");
    let input = Tensor::new(toks.as_slice(), &Device::Cpu).unwrap().unsqueeze(0).unwrap();
    let a = hf.decoder.forward(&input, &mut KvCache::new(2), None, &mut NoHooks, Logits::Last).unwrap();
    let b = q.decoder.forward(&input, &mut KvCache::new(2), None, &mut NoHooks, Logits::Last).unwrap();
    let scale = a.abs().unwrap().max(1).unwrap().squeeze(0).unwrap().to_scalar::<f32>().unwrap();
    let d = max_abs_diff(&a, &b);
    assert!(d < 0.05 * scale, "Q8_0 logits differ by {d} (scale {scale})");
    assert!(d > 0.0, "Q8_0 weights should not be bit-identical to f32");
}

#[test]
fn kv_cache_decoding_equals_full_recomputation() {
    let (_dir, mut model) = tiny(&TinySpec::default());
    // f32: the same to float precision. f16: prefill and decode store keys and values computed
    // by different matmuls (one row or many), and a last-bit difference can round to another
    // f16 (a relative step of 2^-11): there the bound is about one f16 step at the logits'
    // scale (~1; 1.1e-4 measured).
    for (kv, bound) in [(DType::F32, 1e-4), (DType::F16, 1e-3)] {
        model.decoder.cpu_kv_dtype = kv;
        for float_rows in [usize::MAX, 1] {
            model.decoder.float_prefill_min_rows = float_rows;
            let toks = ids(&model, "Caching keys and values must not change the result at all.");
            let input = Tensor::new(toks.as_slice(), &Device::Cpu).unwrap().unsqueeze(0).unwrap();
            let full = model.decoder.forward(&input, &mut KvCache::new(2), None, &mut NoHooks, Logits::All).unwrap();
            // Prefill a prefix, then one token at a time (the cache grows past its first capacity).
            let mut cache = KvCache::new(2);
            let split = 7;
            let pre = Tensor::new(&toks[..split], &Device::Cpu).unwrap().unsqueeze(0).unwrap();
            let last = model.decoder.forward(&pre, &mut cache, None, &mut NoHooks, Logits::Last).unwrap();
            let d = max_abs_diff(&last, &full.get(0).unwrap().get(split - 1).unwrap().unsqueeze(0).unwrap());
            assert!(d < bound, "{kv:?} cache: prefill differs by {d}");
            for (i, &t) in toks.iter().enumerate().skip(split) {
                let one = Tensor::new(&[t], &Device::Cpu).unwrap().unsqueeze(0).unwrap();
                let step = model.decoder.forward(&one, &mut cache, None, &mut NoHooks, Logits::Last).unwrap();
                let want = full.get(0).unwrap().get(i).unwrap().unsqueeze(0).unwrap();
                let d = max_abs_diff(&step, &want);
                assert!(d < bound, "{kv:?} cache, step {i}: cached decode differs from full recomputation by {d}");
            }
            assert_eq!(cache.len(), toks.len());
        }
    }
}

#[test]
fn training_path_equals_inference_path() {
    let (_dir, model) = tiny(&TinySpec::default());
    let adapter = GatedMemory::new(model.config(), &[0, 1], false, 3, &Device::Cpu).unwrap();
    let toks = ids(&model, "Both forward paths share one set of weights and must agree.");
    let input = Tensor::new(toks.as_slice(), &Device::Cpu).unwrap().unsqueeze(0).unwrap();
    for with_adapter in [false, true] {
        let inf_adapter = adapter.detached();
        let a: Option<&dyn lift_serve::model::Adapter> = if with_adapter { Some(&inf_adapter) } else { None };
        let infer = model.decoder.forward(&input, &mut KvCache::new(2), a, &mut NoHooks, Logits::All).unwrap();
        let t: Option<&dyn lift_serve::model::Adapter> = if with_adapter { Some(&adapter) } else { None };
        let emb = model.decoder.embed(&input).unwrap();
        let hidden = model.decoder.forward_train(&emb, t, &mut NoHooks).unwrap();
        let train = model.decoder.logits_train(&hidden).unwrap();
        let d = max_abs_diff(&infer, &train);
        assert!(d <= 1e-4, "adapter={with_adapter}: training vs inference logits differ by {d}");
    }
    // The adapter really changes the output (its gate starts near 0.05, not 0).
    let plain = model.decoder.forward(&input, &mut KvCache::new(2), None, &mut NoHooks, Logits::Last).unwrap();
    let det = adapter.detached();
    let adapted = model.decoder.forward(&input, &mut KvCache::new(2), Some(&det), &mut NoHooks, Logits::Last).unwrap();
    assert!(max_abs_diff(&plain, &adapted) > 1e-3);
}

#[test]
fn gradients_reach_adapter_parameters_and_nothing_else() {
    let (_dir, model) = tiny(&TinySpec::default());
    // Adapt only layer 1: layer 0 runs without a graph.
    let adapter = GatedMemory::new(model.config(), &[1], false, 5, &Device::Cpu).unwrap();
    let toks = ids(&model, "Gradients flow to the adapter only.");
    let input = Tensor::new(&toks[..toks.len() - 1], &Device::Cpu).unwrap().unsqueeze(0).unwrap();
    let target = Tensor::new(&toks[1..], &Device::Cpu).unwrap();
    let emb = model.decoder.embed(&input).unwrap();
    let hidden = model.decoder.forward_train(&emb, Some(&adapter), &mut NoHooks).unwrap();
    let logits = model.decoder.logits_train(&hidden.squeeze(0).unwrap()).unwrap();
    let w = Tensor::ones(target.dims1().unwrap(), DType::F32, &Device::Cpu).unwrap();
    let loss = ops::cross_entropy_masked(&logits, &target, &w).unwrap();
    let grads = loss.backward().unwrap();
    assert_eq!(adapter.vars().len(), 4);
    for v in adapter.vars() {
        let g = grads.get(v.as_tensor()).expect("every adapter parameter gets a gradient");
        let n = g.sqr().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap();
        assert!(n > 0.0 && n.is_finite(), "gradient norm² {n}");
    }
    let d = &model.decoder;
    let mut frozen: Vec<&Tensor> = vec![&d.embed, &d.norm, d.lm_head.float_weight().unwrap()];
    for l in &d.layers {
        frozen.push(&l.attn_norm);
        frozen.push(&l.ffn_norm);
        for p in Projection::ALL {
            let lin = match p {
                Projection::Q => &l.q,
                Projection::K => &l.k,
                Projection::V => &l.v,
                Projection::O => &l.o,
                Projection::Gate => &l.gate,
                Projection::Up => &l.up,
                Projection::Down => &l.down,
            };
            frozen.push(lin.float_weight().unwrap());
        }
    }
    for t in frozen {
        assert!(grads.get(t).is_none(), "a frozen weight received a gradient");
    }
    assert!(grads.get(&emb).is_none(), "input embeddings are not trainable here");
}

#[test]
fn input_embeddings_are_replaceable_and_differentiable() {
    // CDT needs d(loss)/d(embeddings): make the embeddings a Var and check the gradient arrives.
    let (_dir, model) = tiny(&TinySpec::default());
    let toks = ids(&model, "embedding gradients");
    let input = Tensor::new(toks.as_slice(), &Device::Cpu).unwrap().unsqueeze(0).unwrap();
    let emb = candle_core::Var::from_tensor(&model.decoder.embed(&input).unwrap()).unwrap();
    let hidden = model.decoder.forward_train(emb.as_tensor(), None, &mut NoHooks).unwrap();
    let loss = model.decoder.logits_train(&hidden).unwrap().sqr().unwrap().mean_all().unwrap();
    let grads = loss.backward().unwrap();
    let g = grads.get(emb.as_tensor()).expect("embedding gradient");
    assert_eq!(g.dims(), emb.dims());
    assert!(g.abs().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap() > 0.0);
}

/// Masks one key position in every layer above `from_layer`.
struct MaskKey {
    key: usize,
    from_layer: usize,
    value: f32,
}
impl ForwardHooks for MaskKey {
    fn attention_bias(&self, layer: usize, _q_start: usize, q_len: usize, k_len: usize) -> candle_core::Result<Option<Tensor>> {
        if layer < self.from_layer {
            return Ok(None);
        }
        let data: Vec<f32> = (0..q_len * k_len).map(|i| if i % k_len == self.key { self.value } else { 0.0 }).collect();
        Ok(Some(Tensor::from_vec(data, (1, 1, q_len, k_len), &Device::Cpu)?))
    }
}

#[test]
fn attention_bias_hook_changes_exactly_what_it_should() {
    let (_dir, model) = tiny(&TinySpec::default());
    let toks = ids(&model, "abcdefghij");
    let input = Tensor::new(toks.as_slice(), &Device::Cpu).unwrap().unsqueeze(0).unwrap();
    let run = |hooks: &mut dyn ForwardHooks| {
        model.decoder.forward(&input, &mut KvCache::new(2), None, hooks, Logits::All).unwrap()
    };
    let base = run(&mut NoHooks);
    let zero = run(&mut MaskKey { key: 3, from_layer: 0, value: 0.0 });
    assert!(max_abs_diff(&base, &zero) < 1e-6, "a zero bias must not change anything");
    let masked = run(&mut MaskKey { key: 3, from_layer: 0, value: -1e4 });
    // Positions before the masked key cannot see it: unchanged. Positions from it on: changed.
    let before = max_abs_diff(&base.narrow(1, 0, 3).unwrap(), &masked.narrow(1, 0, 3).unwrap());
    let after = max_abs_diff(&base.narrow(1, 4, 6).unwrap(), &masked.narrow(1, 4, 6).unwrap());
    assert!(before < 1e-6, "positions before the masked key changed by {before}");
    assert!(after > 1e-4, "positions after the masked key did not change");
    // Same bias on the trainable path gives the same logits.
    let emb = model.decoder.embed(&input).unwrap();
    let h = model.decoder.forward_train(&emb, None, &mut MaskKey { key: 3, from_layer: 1, value: -1e4 }).unwrap();
    let train = model.decoder.logits_train(&h).unwrap();
    let infer = run(&mut MaskKey { key: 3, from_layer: 1, value: -1e4 });
    assert!(max_abs_diff(&train, &infer) < 1e-4);
}

#[test]
fn generation_is_deterministic_and_respects_limits() {
    let (_dir, model) = tiny(&TinySpec::default());
    let msgs = [ChatMessage { role: "user".into(), content: "hello".into() }];
    let prompt = model.encode_chat(&msgs).unwrap();
    let run = |p: &SamplingParams| {
        let mut out = String::new();
        let g = generate(&model, &prompt, &mut KvCache::new(2), None, &mut NoHooks, p, &mut |s| {
            out.push_str(s);
            true
        })
        .unwrap();
        assert_eq!(out, g.text, "streamed pieces concatenate to the final text");
        g
    };
    let greedy = SamplingParams { max_tokens: 12, ..Default::default() };
    let a = run(&greedy);
    let b = run(&greedy);
    assert_eq!(a.tokens, b.tokens);
    assert!(a.tokens.len() <= 12);
    // Each generated token carries its log-probability: the first is the log-softmax of the
    // prompt's last logits at that token, the greedy pick the likeliest of all.
    assert_eq!(a.logprobs.len(), a.tokens.len());
    assert!(a.logprobs.iter().all(|l| l.is_finite() && *l <= 0.0), "{:?}", a.logprobs);
    if let Some(&first) = a.tokens.first() {
        let last = lift_serve::model::generate::prefill(&model, &prompt, &mut KvCache::new(2), None, &mut NoHooks).unwrap();
        let row = last.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let want = lift_serve::model::generate::log_prob(&row, first);
        assert!((a.logprobs[0] - want).abs() < 1e-4, "{} against {want}", a.logprobs[0]);
        assert!((0..row.len() as u32).all(|i| lift_serve::model::generate::log_prob(&row, i) <= want + 1e-6));
        assert!(a.mean_logprob().unwrap() <= 0.0);
    }
    let sampled = SamplingParams { max_tokens: 12, temperature: 1.0, seed: 9, ..Default::default() };
    assert_eq!(run(&sampled).tokens, run(&sampled).tokens);
    // A stop string cuts the text and never appears in it.
    if a.text.chars().count() > 4 {
        let stop: String = a.text.chars().skip(3).take(2).collect();
        let s = run(&SamplingParams { max_tokens: 12, stop: vec![stop.clone()], ..Default::default() });
        assert!(!s.text.contains(&stop));
        assert!(a.text.starts_with(&s.text));
    }
}

#[test]
fn bad_model_files_give_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let spec = TinySpec::default();
    // Truncated GGUF.
    let path = write_gguf(&dir.path().join("t.gguf"), &spec, GgmlDType::Q8_0).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    let cut = dir.path().join("truncated.gguf");
    std::fs::write(&cut, &bytes[..bytes.len() * 2 / 3]).unwrap();
    let err = format!("{:#}", Model::load(&cut, &Device::Cpu).err().expect("truncated file must fail"));
    assert!(err.contains("truncated.gguf") && err.contains("truncated"), "{err}");
    // Not a GGUF at all.
    let junk = dir.path().join("junk.gguf");
    std::fs::write(&junk, b"definitely not a model").unwrap();
    let err = format!("{:#}", Model::load(&junk, &Device::Cpu).err().unwrap());
    assert!(err.contains("junk.gguf") && err.contains("GGUF"), "{err}");
    // Unknown architecture.
    let hf = write_hf(&dir.path().join("m"), &spec).unwrap();
    let cfg_path = hf.join("config.json");
    let cfg = std::fs::read_to_string(&cfg_path).unwrap().replace("LlamaForCausalLM", "MambaForCausalLM");
    std::fs::write(&cfg_path, cfg).unwrap();
    let err = format!("{:#}", Model::load(&hf, &Device::Cpu).err().unwrap());
    assert!(err.contains("config.json") && err.contains("unknown architecture"), "{err}");
    // Missing tokenizer.
    let hf = write_hf(&dir.path().join("m2"), &spec).unwrap();
    std::fs::remove_file(hf.join("tokenizer.json")).unwrap();
    let err = format!("{:#}", Model::load(&hf, &Device::Cpu).err().unwrap());
    assert!(err.contains("tokenizer.json"), "{err}");
    // Corrupt safetensors.
    let hf = write_hf(&dir.path().join("m3"), &spec).unwrap();
    let st = hf.join("model.safetensors");
    let b = std::fs::read(&st).unwrap();
    std::fs::write(&st, &b[..b.len() / 2]).unwrap();
    let err = format!("{:#}", Model::load(&hf, &Device::Cpu).err().unwrap());
    assert!(err.contains("model.safetensors"), "{err}");
    // Missing path.
    let err = format!("{:#}", Model::load(&dir.path().join("nope.gguf"), &Device::Cpu).err().unwrap());
    assert!(err.contains("nope.gguf") && err.contains("not found"), "{err}");
}

#[test]
fn interleaved_rope_matches_candle_and_is_differentiable() {
    let dev = Device::Cpu;
    let mut rng = lift_serve::testing::Rng::new(11);
    let (b, h, t, d) = (1, 3, 5, 8);
    let x = Tensor::from_vec(rng.vec(b * h * t * d, 1.0), (b, h, t, d), &dev).unwrap();
    let cos = Tensor::from_vec(rng.vec(t * d / 2, 1.0), (t, d / 2), &dev).unwrap();
    let sin = Tensor::from_vec(rng.vec(t * d / 2, 1.0), (t, d / 2), &dev).unwrap();
    let want = candle_nn::rotary_emb::rope_i(&x, &cos, &sin).unwrap();
    let got = ops::rope_interleaved(&x, &cos, &sin).unwrap();
    assert!(max_abs_diff(&want, &got) < 1e-6);
    // Gradient against the slow (composite, differentiable) interleaved RoPE.
    let xv = candle_core::Var::from_tensor(&x).unwrap();
    let r = Tensor::from_vec(rng.vec(b * h * t * d, 1.0), (b, h, t, d), &dev).unwrap();
    let g1 = (ops::rope_interleaved(xv.as_tensor(), &cos, &sin).unwrap() * &r).unwrap().sum_all().unwrap().backward().unwrap();
    let g2 = (candle_nn::rotary_emb::rope_i_slow(xv.as_tensor(), &cos, &sin).unwrap() * &r).unwrap().sum_all().unwrap().backward().unwrap();
    assert!(max_abs_diff(g1.get(xv.as_tensor()).unwrap(), g2.get(xv.as_tensor()).unwrap()) < 1e-5);
}

#[test]
fn a_batch_of_sequences_equals_separate_runs() {
    let (_dir, model) = tiny(&TinySpec::default());
    let a = ids(&model, "first sequence of text");
    let b = ids(&model, "other sequence, same l");
    assert_eq!(a.len(), b.len());
    let one = |t: &[u32]| {
        let x = Tensor::new(t, &Device::Cpu).unwrap().unsqueeze(0).unwrap();
        model.decoder.forward(&x, &mut KvCache::new(2), None, &mut NoHooks, Logits::All).unwrap()
    };
    let row = |t: &[u32]| Tensor::new(t, &Device::Cpu).unwrap();
    let batch = Tensor::stack(&[row(&a), row(&b)], 0).unwrap();
    let mut cache = KvCache::new(2);
    let both = model.decoder.forward(&batch, &mut cache, None, &mut NoHooks, Logits::All).unwrap();
    assert!(max_abs_diff(&both.get(0).unwrap().unsqueeze(0).unwrap(), &one(&a)) < 1e-4);
    assert!(max_abs_diff(&both.get(1).unwrap().unsqueeze(0).unwrap(), &one(&b)) < 1e-4);
    // Batched decode step on the shared cache.
    let next = Tensor::new(&[[5u32], [7u32]], &Device::Cpu).unwrap();
    let step = model.decoder.forward(&next, &mut cache, None, &mut NoHooks, Logits::Last).unwrap();
    let mut a2 = a.clone();
    a2.push(5);
    let want = one(&a2).get(0).unwrap().get(a2.len() - 1).unwrap();
    assert!(max_abs_diff(&step.get(0).unwrap(), &want) < 1e-4);
}
