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

    // Same arithmetic as the reference: quantized matmuls for the prompt too.
    let quantized = m.decoder.forward_with_float_threshold(&input, usize::MAX).unwrap().squeeze(0).unwrap();
    let scale = want.abs().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap();
    let diff = (&quantized - &want).unwrap().abs().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap();
    eprintln!("quantized path: max |diff| = {diff:.3e}, relative {:.3e}", diff / scale);
    assert!(diff / scale <= 1e-3, "relative difference {} > 1e-3", diff / scale);

    // Our default prefill uses the dequantized weights (faster for long prompts): close, and the
    // same next token.
    let float = m.decoder.forward(&input, &mut KvCache::new(m.config().num_layers), None, &mut NoHooks, Logits::Last)
        .unwrap()
        .squeeze(0)
        .unwrap();
    let fdiff = (&float - &want).unwrap().abs().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap();
    eprintln!("float prefill path: max |diff| = {fdiff:.3e}, relative {:.3e}", fdiff / scale);
    // Activation quantization alone moves logits by a few percent; the top token must agree.
    assert!(fdiff / scale <= 0.1, "float path relative difference {}", fdiff / scale);
    let am = |t: &Tensor| t.argmax(0).unwrap().to_scalar::<u32>().unwrap();
    assert_eq!(am(&float), am(&want));
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
    use lift_serve::lift::answer::{answer, chunk_scores, prepare, Ask, Mode};
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
            let ask = Ask { question: q, mode: *mode, context_tokens: Some(*ctx) };
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
                let ask = Ask { question: q, mode: *mode, context_tokens: Some(*ctx) };
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
