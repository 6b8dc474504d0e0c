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
