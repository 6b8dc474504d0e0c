//! The runtime on the real default model (SmolLM2-135M-Instruct Q4_1, fetched by
//! `lift-serve fetch-model`, which the README's test command runs first).

use candle_core::{Device, Tensor};
use lift_serve::model::generate::{generate, SamplingParams};
use lift_serve::model::{ChatMessage, KvCache, Logits, Model, NoHooks};
use std::sync::OnceLock;

fn model() -> &'static Model {
    static MODEL: OnceLock<Model> = OnceLock::new();
    MODEL.get_or_init(|| {
        let path = lift_serve::fetch::resolve_model(None).expect("default model (run `lift-serve fetch-model`)");
        Model::load(&path, &Device::Cpu).expect("default model loads")
    })
}

#[test]
fn logits_match_candle_transformers_quantized_llama() {
    let m = model();
    let path = lift_serve::fetch::resolve_model(None).unwrap();
    let mut file = std::fs::File::open(&path).unwrap();
    let content = candle_core::quantized::gguf_file::Content::read(&mut file).unwrap();
    let mut reference =
        candle_transformers::models::quantized_llama::ModelWeights::from_gguf(content, &mut file, &Device::Cpu).unwrap();
    let ids = m.tokenizer.encode("The history of the Roman Empire spans many centuries, and its", false).unwrap();
    let input = Tensor::new(ids.as_slice(), &Device::Cpu).unwrap().unsqueeze(0).unwrap();
    let want = reference.forward(&input, 0).unwrap().squeeze(0).unwrap();
    let scale = want.abs().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap();
    let max_diff = |a: &Tensor, b: &Tensor| (a - b).unwrap().abs().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap();
    let am = |t: &Tensor| t.argmax(0).unwrap().to_scalar::<u32>().unwrap();

    // The decoder itself: with candle's quantized kernels (the reference's arithmetic) for the
    // prompt too, and an f32 KV cache as the reference keeps, the same logits.
    let mut with_candle = Model::load(&path, &Device::Cpu).unwrap();
    with_candle.decoder.use_candle_quantized_kernels();
    with_candle.decoder.cpu_kv_dtype = candle_core::DType::F32;
    let candle_kernels = with_candle.decoder.forward_with_float_threshold(&input, usize::MAX).unwrap().squeeze(0).unwrap();
    let diff = max_diff(&candle_kernels, &want);
    eprintln!("quantized path, candle's kernels: max |diff| = {diff:.3e}, relative {:.3e}", diff / scale);
    assert!(diff / scale <= 1e-3, "relative difference {} > 1e-3", diff / scale);

    // The default f16 KV cache (half the bytes a decode step reads): keys and values rounded to
    // 11 significant bits move the logits by a few percent (2.9e-2 measured), as the int8
    // activations below do; the next token must agree.
    with_candle.decoder.cpu_kv_dtype = candle_core::DType::F16;
    let f16_cache = with_candle.decoder.forward_with_float_threshold(&input, usize::MAX).unwrap().squeeze(0).unwrap();
    let hdiff = max_diff(&f16_cache, &want);
    eprintln!("the same with an f16 KV cache: relative {:.3e}", hdiff / scale);
    assert!(hdiff / scale <= 0.1, "f16 KV cache relative difference {}", hdiff / scale);
    assert_eq!(am(&f16_cache), am(&want));

    // Long prompts go through the dequantized weights (faster there; forced here for this short
    // one): close, and the same next token.
    let float = m.decoder.forward_with_float_threshold(&input, 1).unwrap().squeeze(0).unwrap();
    let fdiff = max_diff(&float, &want);
    eprintln!("float prefill path: max |diff| = {fdiff:.3e}, relative {:.3e}", fdiff / scale);
    // Activation quantization alone moves logits by a few percent; the top token must agree.
    assert!(fdiff / scale <= 0.1, "float path relative difference {}", fdiff / scale);
    assert_eq!(am(&float), am(&want));

    // Our int8 kernel (the default quantized path on CPUs with AVX-512 VNNI or AVX2): as close to the
    // exact-weight logits as the reference bound above allows, and the same next token. (How
    // close compared with candle's kernels, matmul by matmul: the next test.)
    if m.decoder.layers[0].q.is_packed() {
        let ours = m.decoder.forward_with_float_threshold(&input, usize::MAX).unwrap().squeeze(0).unwrap();
        let d_ours = max_diff(&ours, &float);
        eprintln!("int8 kernel vs float: relative {:.3e} (candle's kernels: {:.3e})", d_ours / scale, fdiff / scale);
        assert!(d_ours / scale <= 0.1, "int8 kernel relative difference {}", d_ours / scale);
        assert_eq!(am(&ours), am(&want));
    }
}

/// The fused CPU ops of the default path (RMSNorm, SwiGLU, the block-causal prompt attention)
/// against candle's ops (`reference_ops`), everything else exact (float weights in f32, an f32
/// KV cache), over a 40-token prompt in two chunks, the second attending the first's cache:
/// the same logits up to f32 rounding. (With 8-bit activations a ~1e-6 change can move a logit
/// by a few percent, which is why the comparison with candle-transformers above runs on
/// candle's ops.)
#[test]
fn fused_prompt_ops_match_candles_ops() {
    let path = lift_serve::fetch::resolve_model(None).unwrap();
    let mut m = Model::load(&path, &Device::Cpu).unwrap();
    m.decoder.cpu_kv_dtype = candle_core::DType::F32;
    m.decoder.cpu_float_dtype = candle_core::DType::F32;
    m.decoder.float_prefill_min_rows = 1;
    let text = "The history of the Roman Empire spans many centuries, and its legacy shaped law, language, \
                roads and cities across Europe, North Africa and the Near East for a thousand years after.";
    let ids = m.tokenizer.encode(text, false).unwrap();
    assert!(ids.len() >= 32, "{} tokens", ids.len());
    let run = |m: &Model| -> Tensor {
        let mut cache = KvCache::new(m.config().num_layers);
        let split = 17;
        let chunk = |a: usize, b: usize| Tensor::new(&ids[a..b], &Device::Cpu).unwrap().unsqueeze(0).unwrap();
        m.decoder.forward(&chunk(0, split), &mut cache, None, &mut NoHooks, Logits::Last).unwrap();
        m.decoder.forward(&chunk(split, ids.len()), &mut cache, None, &mut NoHooks, Logits::All).unwrap().squeeze(0).unwrap()
    };
    let fused = run(&m);
    m.decoder.reference_ops = true;
    let reference = run(&m);
    let scale = reference.abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap();
    let diff = (&fused - &reference).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap();
    eprintln!("fused vs candle's ops, {} tokens: max |diff| = {diff:.3e}, relative {:.3e}", ids.len(), diff / scale);
    assert!(diff / scale <= 1e-4, "fused ops moved the logits by {} (relative)", diff / scale);
}

/// Our int8 kernel against candle's quantized matmul on the real weights of three layers and
/// the LM head: the error of each against the exact product with the dequantized weights, as an
/// RMS over all outputs of 8 deterministic activation rows. Both quantize activations to 8 bits
/// per block of 32; ours keeps the block scales in f32 (candle: f16), so it must not be worse.
#[test]
fn int8_kernel_is_as_accurate_as_candles_quantized_matmul() {
    let m = model();
    if !m.decoder.layers[0].q.is_packed() {
        eprintln!("this CPU does not run the int8 kernel (AVX-512 VNNI or AVX2): nothing to compare");
        return;
    }
    let path = lift_serve::fetch::resolve_model(None).unwrap();
    let mut reference = Model::load(&path, &Device::Cpu).unwrap();
    reference.decoder.use_candle_quantized_kernels();
    let rms = |a: &Tensor, b: &Tensor| (a - b).unwrap().sqr().unwrap().mean_all().unwrap().to_scalar::<f32>().unwrap().sqrt();
    let (mut ours_sq, mut candle_sq) = (0f64, 0f64);
    let mut pairs = Vec::new();
    for li in [0usize, 15, 29] {
        let (a, b) = (&m.decoder.layers[li], &reference.decoder.layers[li]);
        for (x, y) in [(&a.q, &b.q), (&a.k, &b.k), (&a.v, &b.v), (&a.o, &b.o), (&a.gate, &b.gate), (&a.up, &b.up), (&a.down, &b.down)] {
            pairs.push((format!("layer {li}"), x, y));
        }
    }
    pairs.push(("lm head".to_string(), &m.decoder.lm_head, &reference.decoder.lm_head));
    for (name, ours, theirs) in pairs {
        let n = ours.in_dim();
        let x: Vec<f32> = (0..8 * n).map(|i| ((i as f32 * 0.37).sin() * 2.0 + (i as f32 * 0.011).cos()) * 0.5).collect();
        let x = Tensor::from_vec(x, (8, n), &Device::Cpu).unwrap();
        let exact = ours.forward_float(&x, false).unwrap();
        let (e_ours, e_candle) = (rms(&ours.forward(&x).unwrap(), &exact), rms(&theirs.forward(&x).unwrap(), &exact));
        assert!(e_ours <= 1.1 * e_candle, "{name} [{}, {n}]: RMS error {e_ours:.3e} vs candle's {e_candle:.3e}", ours.out_dim());
        ours_sq += (e_ours as f64).powi(2);
        candle_sq += (e_candle as f64).powi(2);
    }
    eprintln!("RMS error over 22 matmuls: int8 kernel {:.4e}, candle {:.4e}", ours_sq.sqrt(), candle_sq.sqrt());
    assert!(ours_sq <= candle_sq, "int8 kernel {:.4e} vs candle {:.4e}", ours_sq.sqrt(), candle_sq.sqrt());
}

#[test]
fn greedy_chat_answer_knows_the_capital_of_france() {
    let m = model();
    let prompt = m
        .encode_chat(&[
            ChatMessage { role: "system".into(), content: "You are a helpful assistant.".into() },
            ChatMessage { role: "user".into(), content: "What is the capital of France?".into() },
        ])
        .unwrap();
    let params = SamplingParams { max_tokens: 40, ..Default::default() };
    let out = generate(m, &prompt, &mut KvCache::new(m.config().num_layers), None, &mut NoHooks, &params, &mut |_| true)
        .unwrap();
    eprintln!("answer: {}", out.text);
    assert!(out.text.contains("Paris"), "answer was: {}", out.text);
}

#[test]
fn gguf_tokenizer_round_trips_and_matches_known_ids() {
    let t = &model().tokenizer;
    for text in [
        "Hello, world!",
        "  leading spaces and\ttabs\nnew lines\n\n",
        "Numbers 1234567 and 3.14159; symbols @#$%^&*()",
        "Ünïcödé — naïve café, 日本語のテキスト, emoji 🚀🎉",
    ] {
        let ids = t.encode(text, false).unwrap();
        assert_eq!(t.decode(&ids).unwrap(), text);
    }
    // Special tokens of the chat template are single ids.
    assert_eq!(t.encode("<|im_start|>", false).unwrap(), vec![1]);
    assert_eq!(t.encode("<|im_end|>", false).unwrap(), vec![2]);
    assert!(t.eos_token_ids().contains(&2));
}

/// Continuous batching on the real model over the shipped prepared base (its LoRA added on the
/// quantized decode path, its FltLM filter scoring and masking each in-context chunk): answers
/// about one document with different adapters (none, two Gated Memories) and a plain chat,
/// joining at different steps, give the tokens, text and chunk scores each gives alone.
#[test]
fn batched_answers_over_the_prepared_base_match_each_alone() {
    use lift_serve::adapters::GatedMemory;
    use lift_serve::document::Document;
    use lift_serve::engine::batcher::{Batch, Entry};
    use lift_serve::lift::answer::{answer, chunk_scores, prepare, Ask, ContextPolicy, Mode};
    use lift_serve::model::generate::{Sequence, PREFILL_CHUNK};
    use lift_serve::model::Adapter;
    use std::sync::Arc;

    let path = lift_serve::fetch::resolve_model(None).unwrap();
    let mut m = Model::load(&path, &Device::Cpu).unwrap();
    let base_dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("base");
    lift_serve::base::PreparedBase::load(&base_dir, &m).unwrap().install(&mut m).unwrap();
    assert!(m.base_filter().is_some());
    let text = std::fs::read_to_string(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/harbor_history.txt")).unwrap();
    let doc = Document::encode(&m, text).unwrap();
    let layers: Vec<usize> = (15..m.config().num_layers).collect();
    let gm = |seed| -> Arc<dyn Adapter> { Arc::new(GatedMemory::new(m.config(), &layers, false, seed, &Device::Cpu).unwrap().detached()) };
    let params = SamplingParams { max_tokens: 12, ..Default::default() };
    // (question, mode, adapter, join at step, context budget)
    let cases: Vec<(&str, Mode, Option<Arc<dyn Adapter>>, usize, usize)> = vec![
        ("Who built the harbor?", Mode::Icl, None, 0, 300),
        ("When was the lighthouse built?", Mode::Lift, Some(gm(1)), 0, 600),
        ("What is the harbor known for?", Mode::Lift, Some(gm(2)), 2, 200),
    ];
    let alone: Vec<_> = cases
        .iter()
        .map(|(q, mode, a, _, ctx)| {
            let ask = Ask { history: &[], question: q, mode: *mode, context: Some(ContextPolicy::Full), context_tokens: Some(*ctx) };
            let out = answer(&m, &doc, a.as_deref(), &ask, &params, &mut |_| true).unwrap();
            (out.generation.tokens, out.generation.text, out.chunks)
        })
        .collect();
    let chat = m.encode_chat(&[ChatMessage { role: "user".into(), content: "Name a color.".into() }]).unwrap();
    let chat_alone =
        generate(&m, &chat, &mut KvCache::new(m.config().num_layers), None, &mut NoHooks, &params, &mut |_| true).unwrap().tokens;

    let mut batch = Batch::new(8, PREFILL_CHUNK);
    let mut done = std::collections::BTreeMap::new();
    let mut step = 0;
    while done.len() < cases.len() + 1 {
        for (i, (q, mode, a, join, ctx)) in cases.iter().enumerate() {
            if *join == step {
                let ask = Ask { history: &[], question: q, mode: *mode, context: Some(ContextPolicy::Full), context_tokens: Some(*ctx) };
                let (_, seq) = prepare(&m, &doc, &ask, &params).unwrap();
                let key = a.as_ref().map_or(0, |a| Arc::as_ptr(a) as *const () as usize);
                batch.join(Entry { seq, adapter: a.clone(), adapter_key: key, data: i });
            }
        }
        if step == 1 {
            let seq = Sequence::new(&m, chat.clone(), KvCache::new(m.config().num_layers), params.clone(), None).unwrap();
            batch.join(Entry { seq, adapter: None, adapter_key: 0, data: cases.len() });
        }
        for e in batch.step(&m, &mut |_: &mut usize, _: &str| true).unwrap() {
            let (g, _, hooks) = e.seq.into_parts();
            done.insert(e.data, (g.tokens, g.text, chunk_scores(&hooks).unwrap()));
        }
        step += 1;
        assert!(step < 1000);
    }
    for (i, want) in alone.iter().enumerate() {
        assert!(!want.2.is_empty(), "case {i} is scored by the filter");
        assert_eq!(&done[&i], want, "case {i}: batched differs from alone");
    }
    assert_eq!(done[&cases.len()].0, chat_alone, "the plain chat");
}

/// The f16 KV cache against an f32 one on real text: the next-token loss over both fixture
/// documents (2,000-odd tokens), fed in 128-token chunks so that every chunk attends to keys
/// and values read back from the cache, costs at most 0.5% more with f16; so do bf16 matmuls
/// in the prompt chunks against f32 ones.
#[test]
fn an_f16_kv_cache_costs_little_next_token_loss() {
    let path = lift_serve::fetch::resolve_model(None).unwrap();
    let mut m = Model::load(&path, &Device::Cpu).unwrap();
    let mut loss = |dtype: candle_core::DType, float: candle_core::DType| -> f64 {
        m.decoder.cpu_kv_dtype = dtype;
        m.decoder.cpu_float_dtype = float;
        let (mut nll, mut count) = (0f64, 0usize);
        for name in ["harbor_history.txt", "kestrel_observatory.txt"] {
            let text = std::fs::read_to_string(format!("{}/tests/fixtures/{name}", env!("CARGO_MANIFEST_DIR"))).unwrap();
            let ids = m.tokenizer.encode(&text, false).unwrap();
            let mut cache = KvCache::new(m.config().num_layers);
            for start in (0..ids.len() - 1).step_by(128) {
                let chunk = &ids[start..(start + 128).min(ids.len() - 1)];
                let input = Tensor::new(chunk, &Device::Cpu).unwrap().unsqueeze(0).unwrap();
                let logits = m.decoder.forward(&input, &mut cache, None, &mut NoHooks, lift_serve::model::Logits::All).unwrap();
                let logp = candle_nn::ops::log_softmax(&logits.squeeze(0).unwrap(), 1).unwrap();
                let target = Tensor::new(&ids[start + 1..start + 1 + chunk.len()], &Device::Cpu).unwrap().unsqueeze(1).unwrap();
                nll -= logp.gather(&target, 1).unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap() as f64;
                count += chunk.len();
            }
        }
        nll / count as f64
    };
    use candle_core::DType::{BF16, F16, F32};
    let (f32_loss, f16_loss) = (loss(F32, F32), loss(F16, F32));
    eprintln!("next-token loss: f32 cache {f32_loss:.4} nats, f16 cache {f16_loss:.4} ({:+.3}%)", 100.0 * (f16_loss / f32_loss - 1.0));
    assert!(f16_loss <= f32_loss * 1.005, "f16 cache {f16_loss} vs f32 {f32_loss} nats");
    // The 128-token chunks take the float path: its bf16 matmuls (the default where the CPU
    // runs them) against f32, both over the f16 cache, under the same bound.
    if lift_serve::kernels::bf16_matmul::available() {
        let bf16_loss = loss(F16, BF16);
        eprintln!("bf16 prefill matmuls: {bf16_loss:.4} nats ({:+.3}% vs f32 matmuls)", 100.0 * (bf16_loss / f16_loss - 1.0));
        assert!(bf16_loss <= f16_loss * 1.005, "bf16 matmuls {bf16_loss} vs f32 {f16_loss} nats");
    }
}

/// The trainable path's bf16 matmuls (the CPU default where AVX-512 BF16 runs) against f32 on
/// real text: a Gated Memory adapter on every layer, from the same start, trained 6 AdamW steps
/// on one 128-token window of a fixture. The first step's loss and gradients stay close, and
/// the loss the run reaches is as low.
#[test]
fn bf16_training_matmuls_follow_f32_training() {
    use candle_core::DType;
    use candle_nn::optim::{AdamW, Optimizer, ParamsAdamW};
    use lift_serve::adapters::GatedMemory;
    use lift_serve::model::ops;
    if !lift_serve::kernels::bf16_matmul::available() {
        eprintln!("skipped: this CPU has no AVX-512 BF16 (training stays f32)");
        return;
    }
    let path = lift_serve::fetch::resolve_model(None).unwrap();
    let mut m = Model::load(&path, &Device::Cpu).unwrap();
    let text = std::fs::read_to_string(format!("{}/tests/fixtures/kestrel_observatory.txt", env!("CARGO_MANIFEST_DIR"))).unwrap();
    let ids = m.tokenizer.encode(&text, false).unwrap();
    let window = &ids[200..329];
    let input = Tensor::new(&window[..128], &Device::Cpu).unwrap().unsqueeze(0).unwrap();
    let target = Tensor::new(&window[1..], &Device::Cpu).unwrap();
    let weights = Tensor::ones(128, DType::F32, &Device::Cpu).unwrap();
    let mut run = |dtype: DType| -> (Vec<f32>, Vec<Tensor>) {
        m.decoder.cpu_float_dtype = dtype;
        let cfg = m.config().clone();
        let all: Vec<usize> = (0..cfg.num_layers).collect();
        let gm = GatedMemory::new(&cfg, &all, false, 5, &Device::Cpu).unwrap();
        let params = ParamsAdamW { lr: 1e-3, beta1: 0.9, beta2: 0.98, eps: 1e-8, weight_decay: 1e-4 };
        let mut opt = AdamW::new(gm.vars().to_vec(), params).unwrap();
        let (mut losses, mut first_grads) = (Vec::new(), Vec::new());
        for step in 0..7 {
            let emb = m.decoder.embed(&input).unwrap();
            let h = m.decoder.forward_train(&emb, Some(&gm), &mut NoHooks).unwrap();
            let logits = m.decoder.logits_train(&h.squeeze(0).unwrap()).unwrap();
            let loss = ops::cross_entropy_masked(&logits, &target, &weights).unwrap();
            losses.push(loss.to_scalar::<f32>().unwrap());
            if step == 6 {
                break;
            }
            let grads = loss.backward().unwrap();
            if step == 0 {
                first_grads = gm.vars().iter().map(|v| grads.get(v.as_tensor()).unwrap().clone()).collect();
            }
            opt.step(&grads).unwrap();
        }
        (losses, first_grads)
    };
    let (l32, g32) = run(DType::F32);
    let (l16, g16) = run(DType::BF16);
    let norm = |t: &Tensor| t.sqr().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap().sqrt();
    let (mut diff, mut size) = (0f32, 0f32);
    for (a, b) in g16.iter().zip(&g32) {
        diff += norm(&(a - b).unwrap()).powi(2);
        size += norm(b).powi(2);
    }
    let grad_rel = (diff / size).sqrt();
    eprintln!("losses f32 {l32:?}\nlosses bf16 {l16:?}\nfirst step's gradients: relative difference {grad_rel:.4}");
    assert!(size > 0.0, "the adapter gets a gradient");
    assert!((l16[0] - l32[0]).abs() <= 2e-3 * l32[0], "first loss: bf16 {} vs f32 {}", l16[0], l32[0]);
    assert!(grad_rel < 0.05, "first step's gradients differ by {grad_rel} (relative)");
    assert!(l32[6] < l32[0] * 0.9, "f32 training learns ({} → {})", l32[0], l32[6]);
    assert!(l16[6] <= l32[6] * 1.02, "after 6 steps: bf16 {} vs f32 {}", l16[6], l32[6]);
}

/// The FltLM chunks (and the passages answers retrieve) of a sentence longer than a chunk are
/// cut between words, never inside a word or a number: the real tokenizer splits "212" into
/// digit tokens, and "21|2 kilograms" was a chunk boundary before word breaks were kept.
#[test]
fn chunks_of_a_long_sentence_end_between_words() {
    use lift_serve::document::{chunk_ranges, Document};
    let m = model();
    let text = "The crate that the porters of the eastern warehouse carried up the hill on the morning of \
                the fourteenth weighed 212 kilograms, held 3,417 copper fittings and 96 lanterns, and cost \
                the guild 18,250 silver marks, which the treasurer Marguerite Oyelaran-Castellanos paid \
                in three instalments of 6,083 marks each over the following eleven months; ";
    let doc = Document::encode(m, text.repeat(3)).unwrap();
    let breaks = doc.breaks(m).unwrap();
    let words: std::collections::HashSet<&str> = text.split(|c: char| c.is_whitespace()).collect();
    let mut cuts = 0;
    for max in [7, 12, 24] {
        for (a, b) in chunk_ranges(breaks, 0, doc.len(), max) {
            assert!(b - a <= max);
            if b == doc.len() {
                continue;
            }
            // The last word of the chunk is a whole word of the text.
            let piece = m.tokenizer.decode(&doc.tokens()[a..b]).unwrap();
            let last = piece.split_whitespace().last().unwrap_or("");
            assert!(words.contains(last), "max {max}: chunk ends inside a word: {piece:?}");
            cuts += 1;
        }
    }
    assert!(cuts > 20, "the sentences were cut {cuts} times");
    // Without the word breaks (a cut every `max` tokens) the same text is cut inside words.
    use lift_serve::document::Break;
    let sentence_only: Vec<Break> = breaks.iter().map(|&b| if b == Break::Word { Break::Inside } else { b }).collect();
    let inside = chunk_ranges(&sentence_only, 0, doc.len(), 12).into_iter().filter(|&(a, b)| {
        let piece = m.tokenizer.decode(&doc.tokens()[a..b]).unwrap();
        b < doc.len() && !words.contains(piece.split_whitespace().last().unwrap_or(""))
    });
    assert!(inside.count() > 0, "the check above would not have seen a cut inside a word");
}
