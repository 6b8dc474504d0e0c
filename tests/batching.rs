//! Continuous batching on a tiny random model (Q8_0 GGUF, written by the test): sequences with
//! different adapters (none, two Gated Memories, one shared by two sequences, a LoRA), prompt
//! lengths (one token to several prefill chunks) and sampling settings, joining a running batch
//! at different steps and leaving it as they finish, produce exactly the tokens and text each
//! produces alone.

use candle_core::quantized::GgmlDType;
use candle_core::{Device, Tensor};
use lift_serve::adapters::lora::{LoraConfig, LoraPair};
use lift_serve::adapters::{GatedMemory, Lora};
use lift_serve::engine::batcher::{Batch, Entry};
use lift_serve::model::generate::{generate, FinishReason, SamplingParams, Sequence, PREFILL_CHUNK};
use lift_serve::model::{Adapter, KvCache, Model, NoHooks, Projection};
use lift_serve::testing::{write_gguf, TinySpec};
use std::collections::BTreeMap;
use std::sync::Arc;

/// The tiny model, with every batch's decoding rows on the quantized path (the exact one; see
/// `float_rows_batch_close_to_alone` for the float path of large batches).
fn tiny_q8() -> (tempfile::TempDir, Model) {
    let dir = tempfile::tempdir().unwrap();
    let path = write_gguf(&dir.path().join("tiny_q8.gguf"), &TinySpec::default(), GgmlDType::Q8_0).unwrap();
    let mut model = Model::load(&path, &Device::Cpu).unwrap();
    model.decoder.float_batch_min_rows = usize::MAX;
    // On CPUs with AVX-512 VNNI or AVX2 the quantized path is our int8 kernel: that is what is checked.
    assert_eq!(model.decoder.layers[0].q.is_packed(), lift_serve::kernels::quant_matmul::available());
    (dir, model)
}

/// Deterministic token ids (xorshift), all below `vocab`.
fn prompt(len: usize, seed: u64, vocab: usize) -> Vec<u32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % vocab as u64) as u32
        })
        .collect()
}

/// A LoRA on every projection of every layer with random (non-zero) `A` and `B`.
fn random_lora(model: &Model, seed: u64) -> Lora {
    let cfg = model.config();
    let lc = LoraConfig { rank: 4, alpha: 8.0, targets: Projection::ALL.to_vec(), layers: Vec::new() };
    let mut s = seed;
    let mut rand = |n: usize| {
        (0..n)
            .map(|_| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((s >> 33) as f32 / (1u64 << 31) as f32 - 0.5) * 0.2
            })
            .collect::<Vec<f32>>()
    };
    let mut layers = BTreeMap::new();
    for l in 0..cfg.num_layers {
        let pairs = Projection::ALL
            .iter()
            .map(|&p| {
                let (i, o) = lift_serve::adapters::lora::projection_dims(cfg, p);
                let a = Tensor::from_vec(rand(i * 4), (i, 4), &Device::Cpu).unwrap();
                let b = Tensor::from_vec(rand(4 * o), (4, o), &Device::Cpu).unwrap();
                (p, LoraPair { a, b })
            })
            .collect();
        layers.insert(l, pairs);
    }
    Lora::from_pairs(cfg, &lc, layers, false).unwrap()
}

struct Case {
    prompt: Vec<u32>,
    params: SamplingParams,
    adapter: Option<Arc<dyn Adapter>>,
    /// Join the batch at this step (if there is room then; else as soon as there is).
    join_at: usize,
}

#[test]
fn batched_sequences_with_different_adapters_match_each_alone() {
    let (_dir, model) = tiny_q8();
    let vocab = model.config().vocab_size;
    let layers: Vec<usize> = (0..model.config().num_layers).collect();
    let gm = |seed| -> Arc<dyn Adapter> {
        Arc::new(GatedMemory::new(model.config(), &layers, false, seed, &Device::Cpu).unwrap().detached())
    };
    let (gm_a, gm_b) = (gm(1), gm(2));
    let lora: Arc<dyn Adapter> = Arc::new(random_lora(&model, 7));
    let greedy = |max_tokens| SamplingParams { max_tokens, ..Default::default() };
    let cases = vec![
        Case { prompt: prompt(40, 1, vocab), params: greedy(24), adapter: Some(gm_a.clone()), join_at: 0 },
        Case { prompt: prompt(5, 2, vocab), params: greedy(6), adapter: None, join_at: 0 },
        // Three prefill chunks: joins while the first two decode.
        Case { prompt: prompt(2 * PREFILL_CHUNK + 37, 3, vocab), params: greedy(10), adapter: Some(gm_b.clone()), join_at: 3 },
        Case { prompt: prompt(17, 4, vocab), params: greedy(30), adapter: Some(lora.clone()), join_at: 3 },
        // Shares the first sequence's adapter (one delta matmul for both).
        Case { prompt: prompt(1, 5, vocab), params: greedy(12), adapter: Some(gm_a.clone()), join_at: 5 },
        Case {
            prompt: prompt(60, 6, vocab),
            params: SamplingParams { max_tokens: 16, temperature: 0.8, top_p: 0.9, seed: 11, ..Default::default() },
            adapter: Some(lora.clone()),
            join_at: 6,
        },
        Case { prompt: prompt(9, 7, vocab), params: greedy(8), adapter: None, join_at: 7 },
    ];

    // Alone: `generate`, the path the CLI and the evaluations use.
    let alone: Vec<(Vec<u32>, String, FinishReason)> = cases
        .iter()
        .map(|c| {
            let mut streamed = String::new();
            let mut cache = KvCache::new(model.config().num_layers);
            let g = generate(&model, &c.prompt, &mut cache, c.adapter.as_deref(), &mut NoHooks, &c.params, &mut |s| {
                streamed.push_str(s);
                true
            })
            .unwrap();
            assert_eq!(streamed, g.text);
            (g.tokens, g.text, g.finish_reason)
        })
        .collect();
    assert!(alone.iter().all(|(t, _, _)| !t.is_empty()), "every case generates something: {alone:?}");

    // Batched: at most 4 at once, so later cases wait for earlier ones to leave.
    let mut batch: Batch<NoHooks, (usize, String)> = Batch::new(4, PREFILL_CHUNK);
    let mut waiting: Vec<usize> = (0..cases.len()).collect();
    let mut done: BTreeMap<usize, (Vec<u32>, String, FinishReason, usize)> = BTreeMap::new();
    let (mut step, mut max_seen, mut mixed_steps) = (0usize, 0usize, 0usize);
    let mut joined_at = vec![0usize; cases.len()];
    while done.len() < cases.len() {
        while batch.has_room() {
            let Some(pos) = waiting.iter().position(|&i| cases[i].join_at <= step) else { break };
            let i = waiting.remove(pos);
            let c = &cases[i];
            let seq = Sequence::new(&model, c.prompt.clone(), KvCache::new(model.config().num_layers), c.params.clone(), NoHooks).unwrap();
            let key = c.adapter.as_ref().map_or(0, |a| Arc::as_ptr(a) as *const () as usize);
            batch.join(Entry { seq, adapter: c.adapter.clone(), adapter_key: key, data: (i, String::new()) });
            joined_at[i] = step;
        }
        let (decoding, prompt_left) = batch.load();
        if decoding > 0 && prompt_left > 0 {
            mixed_steps += 1;
        }
        max_seen = max_seen.max(batch.len());
        for e in batch.step(&model, &mut |d: &mut (usize, String), s: &str| {
            d.1.push_str(s);
            true
        })
        .unwrap()
        {
            let (g, _, _) = e.seq.into_parts();
            assert_eq!(e.data.1, g.text, "streamed text of case {}", e.data.0);
            done.insert(e.data.0, (g.tokens, g.text, g.finish_reason, step));
        }
        step += 1;
        assert!(step < 10_000, "the batch never drained");
    }
    for (i, (tokens, text, finish)) in alone.iter().enumerate() {
        let (bt, btext, bfinish, _) = &done[&i];
        assert_eq!(bt, tokens, "case {i}: batched tokens differ from alone");
        assert_eq!(btext, text, "case {i}");
        assert_eq!(bfinish, finish, "case {i}");
    }
    assert_eq!(max_seen, 4, "the batch filled up");
    assert!(mixed_steps > 0, "some steps mixed prefill chunks with decoding sequences");
    // Leaving mid-batch: the short case finished while the long ones went on, and a later case
    // took its place while others were still decoding.
    assert!(done[&1].3 < done[&0].3, "case 1 left before case 0: {done:?}");
    assert!(joined_at[4] < done[&0].3 && joined_at[4] > joined_at[0], "case 4 joined a running batch");
}

#[test]
fn a_cancelled_sequence_leaves_at_the_next_step() {
    let (_dir, model) = tiny_q8();
    let vocab = model.config().vocab_size;
    let params = SamplingParams { max_tokens: 50, ..Default::default() };
    // Prompts whose answers stream text (a random model may repeat a token that decodes to no
    // text of its own).
    let streams = |seed: u64| {
        let mut cache = KvCache::new(2);
        let g = generate(&model, &prompt(8, seed, vocab), &mut cache, None, &mut NoHooks, &params, &mut |_| true).unwrap();
        !g.text.is_empty()
    };
    let seeds: Vec<u64> = (0..64).filter(|&s| streams(s)).take(2).collect();
    assert_eq!(seeds.len(), 2, "two prompts with text among 64");
    let mut batch: Batch<NoHooks, usize> = Batch::new(2, PREFILL_CHUNK);
    for (i, &seed) in seeds.iter().enumerate() {
        let seq = Sequence::new(&model, prompt(8, seed, vocab), KvCache::new(2), params.clone(), NoHooks).unwrap();
        batch.join(Entry { seq, adapter: None, adapter_key: 0, data: i });
    }
    let mut on_text = |_: &mut usize, _: &str| true;
    assert!(batch.step(&model, &mut on_text).unwrap().is_empty());
    assert!(!batch.has_room());
    batch.cancel_where(|&i| i == 1);
    let left = batch.step(&model, &mut on_text).unwrap();
    assert_eq!(left.len(), 1);
    assert_eq!(left[0].data, 1);
    let (g, _, _) = left.into_iter().next().unwrap().seq.into_parts();
    assert_eq!(g.finish_reason, FinishReason::Cancelled);
    assert!(g.tokens.len() <= 1, "it stopped at once: {:?}", g.tokens);
    assert!(batch.has_room() && batch.len() == 1);
    // A client that goes away while its text streams (on_text false) leaves too.
    let mut gone = |_: &mut usize, _: &str| false;
    let mut left = Vec::new();
    while left.is_empty() {
        left.extend(batch.step(&model, &mut gone).unwrap());
    }
    let (g, _, _) = left.remove(0).seq.into_parts();
    assert_eq!(g.finish_reason, FinishReason::Cancelled, "{:?}", g.tokens);
    assert!(batch.is_empty());
}

/// At `float_batch_min_rows` decoding rows and more, a step runs them through the float weights
/// in one gemm (the quantized kernels cost the same per row batched or not): each sequence's
/// logits stay within quantization rounding of its logits alone, and below the threshold the
/// step is exact.
#[test]
fn float_rows_batch_close_to_alone() {
    let (_dir, mut model) = tiny_q8();
    let vocab = model.config().vocab_size;
    let n = 8;
    let prompts: Vec<Vec<u32>> = (0..n).map(|i| prompt(10 + 3 * i, 100 + i as u64, vocab)).collect();
    let step = |model: &Model, rows: usize| -> (Vec<Tensor>, Tensor) {
        let mut caches: Vec<KvCache> = (0..rows).map(|_| KvCache::new(2)).collect();
        let mut alone = Vec::new();
        for (p, c) in prompts.iter().zip(caches.iter_mut()) {
            let head = &p[..p.len() - 1];
            let mut h = NoHooks;
            model.decoder.forward_batch(&mut [lift_serve::model::SeqInput { ids: head, cache: c, adapter: None, adapter_key: 0, hooks: &mut h }]).unwrap();
            let mut fork = c.fork().unwrap();
            let last = &p[p.len() - 1..];
            let mut h = NoHooks;
            alone.push(model.decoder.forward_batch(&mut [lift_serve::model::SeqInput { ids: last, cache: &mut fork, adapter: None, adapter_key: 0, hooks: &mut h }]).unwrap());
        }
        let mut hooks: Vec<NoHooks> = (0..rows).map(|_| NoHooks).collect();
        let mut inputs: Vec<lift_serve::model::SeqInput> = caches
            .iter_mut()
            .zip(hooks.iter_mut())
            .zip(&prompts)
            .map(|((cache, hooks), p)| lift_serve::model::SeqInput { ids: &p[p.len() - 1..], cache, adapter: None, adapter_key: 0, hooks })
            .collect();
        (alone, model.decoder.forward_batch(&mut inputs).unwrap())
    };
    let diff = |a: &Tensor, b: &Tensor| (a - b).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap();
    model.decoder.float_batch_min_rows = 4;
    let (alone, batched) = step(&model, 3);
    for (i, a) in alone.iter().enumerate() {
        assert_eq!(diff(&batched.get(i).unwrap(), &a.squeeze(0).unwrap()), 0.0, "below the threshold: exact");
    }
    let (alone, batched) = step(&model, n);
    let mut largest = 0f32;
    for (i, a) in alone.iter().enumerate() {
        let a = a.squeeze(0).unwrap();
        let scale = a.abs().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap();
        largest = largest.max(diff(&batched.get(i).unwrap(), &a) / scale);
    }
    assert!(largest > 0.0, "the float path is another arithmetic");
    assert!(largest < 0.05, "float batch vs quantized alone: relative {largest}");
}
