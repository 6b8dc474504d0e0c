//! Follow-up questions as chat turns, on the real default model (SmolLM2-135M-Instruct Q4_1) and
//! a real document (tests/fixtures/harbor_history.txt): a follow-up whose own words do not name
//! its topic reads the passages of the topic asked about before when the conversation is given,
//! and the prompt carries the earlier turns as chat turns, leaving out the oldest where the
//! window is short, never the passages or the question. Plain and over the shipped prepared base
//! (whose filter re-ranks the passages and lays them out in chunks).
//!
//! Run alone: `cargo test --release --test conversation -- --nocapture`.

use candle_core::Device;
use lift_serve::document::Document;
use lift_serve::lift::answer::{build_prompt, Ask, AnswerPrompt, ContextPolicy, Mode};
use lift_serve::model::{ChatMessage, Model};

const DOC: &str = include_str!("fixtures/harbor_history.txt");

fn models() -> Vec<(&'static str, Model)> {
    let path = lift_serve::fetch::resolve_model(None).expect("default model (run `lift-serve fetch-model`)");
    let plain = Model::load(&path, &Device::Cpu).unwrap();
    let mut based = Model::load(&path, &Device::Cpu).unwrap();
    lift_serve::base::install_from_arg(&mut based, Some(concat!(env!("CARGO_MANIFEST_DIR"), "/base"))).unwrap();
    assert!(based.base_filter().is_some(), "the shipped prepared base has a filter");
    vec![("plain", plain), ("prepared base", based)]
}

/// The document text a prompt shows.
fn shown(model: &Model, doc: &Document, p: &AnswerPrompt) -> String {
    p.shown.iter().map(|&(a, b)| model.tokenizer.decode(&doc.tokens()[a..b]).unwrap()).collect::<Vec<_>>().join(" | ")
}

fn ask<'a>(question: &'a str, history: &'a [ChatMessage], mode: Mode) -> Ask<'a> {
    // Two passages' worth: the follow-up's topic must be chosen, it cannot all be shown.
    Ask { question, history, mode, context: Some(ContextPolicy::Retrieved), context_tokens: Some(64) }
}

#[test]
fn a_follow_up_reads_the_passages_of_the_topic_it_follows() {
    for (name, model) in models() {
        let doc = Document::encode(&model, DOC.to_string()).unwrap();
        let history = [
            ChatMessage::new("user", "Tell me about the museum."),
            ChatMessage::new("assistant", "It displays tools, photographs and half-models of the boats."),
        ];
        // "When did it open?" names no topic (and "open" is in no passage: the text says "opened").
        for mode in [Mode::Rag, Mode::Lift] {
            let alone = build_prompt(&model, &doc, &ask("When did it open?", &[], mode), 32).unwrap();
            let alone_text = shown(&model, &doc, &alone);
            assert!(!alone_text.contains("museum"), "{name}: the follow-up alone finds no museum: {alone_text}");
            let follow = build_prompt(&model, &doc, &ask("When did it open?", &history, mode), 32).unwrap();
            let text = shown(&model, &doc, &follow);
            assert!(text.contains("A small museum opened beside the slipway"), "{name} {mode:?}: {text}");
            assert!(follow.context_tokens <= 64, "{name}: the same budget: {}", follow.context_tokens);
            // The earlier turns are chat turns before the question's own turn, in order.
            let prompt = model.tokenizer.decode(&follow.tokens).unwrap();
            let at = |s: &str| prompt.find(s).unwrap_or_else(|| panic!("{name}: {s:?} in {prompt}"));
            assert!(at("Tell me about the museum.") < at("half-models of the boats") && at("half-models") < at("When did it open?"));
            assert!(prompt.matches("<|im_start|>user").count() == 2 && prompt.matches("<|im_start|>assistant").count() == 2, "{prompt}");
            // The passages sit in the last user turn: the filter's chunks point at them there.
            for c in &follow.chunks {
                assert_eq!(&follow.tokens[c.start..c.end], &doc.tokens()[c.doc_start..c.doc_end], "{name}");
            }
        }
        // A question that names its own topic keeps it over the earlier topic.
        let own = build_prompt(&model, &doc, &ask("Who was the chief designer of the Grey Petrel?", &history, Mode::Rag), 32).unwrap();
        let text = shown(&model, &doc, &own);
        assert!(text.contains("Ingrid Solberg"), "{name}: {text}");
        // `memory` shows no document, but carries the conversation.
        let memory = Ask { question: "When did it open?", history: &history, mode: Mode::Memory, context: None, context_tokens: None };
        let p = build_prompt(&model, &doc, &memory, 32).unwrap();
        assert!(p.shown.is_empty() && model.tokenizer.decode(&p.tokens).unwrap().contains("Tell me about the museum."), "{name}");
    }
}

#[test]
fn the_oldest_turns_give_way_when_the_window_is_short() {
    let (_, model) = models().into_iter().next().unwrap();
    let window = model.config().max_position_embeddings;
    let doc = Document::encode(&model, DOC.to_string()).unwrap();
    // Twelve exchanges, each answer the whole document (~1,100 tokens): more than the window holds.
    let mut history = Vec::new();
    for i in 0..12 {
        history.push(ChatMessage::new("user", format!("Question number {i} about the museum?")));
        history.push(ChatMessage::new("assistant", DOC));
    }
    let max_tokens = 256;
    let alone = build_prompt(&model, &doc, &ask("When did it open?", &history[..2], Mode::Rag), max_tokens).unwrap();
    let p = build_prompt(&model, &doc, &ask("When did it open?", &history, Mode::Rag), max_tokens).unwrap();
    assert!(p.tokens.len() + max_tokens <= window, "{} prompt tokens", p.tokens.len());
    assert!(p.tokens.len() + max_tokens > window - 1500, "the window is filled with turns: {} prompt tokens", p.tokens.len());
    let prompt = model.tokenizer.decode(&p.tokens).unwrap();
    assert!(!prompt.contains("Question number 0 "), "the oldest turn is left out first");
    assert!(prompt.contains("Question number 11 "), "the newest turn is kept");
    // Whole exchanges are left out: the first turn kept is a question.
    let kept: Vec<usize> = (0..12).filter(|i| prompt.contains(&format!("Question number {i} "))).collect();
    assert!(kept.windows(2).all(|w| w[1] == w[0] + 1) && kept.len() >= 2, "{kept:?}");
    assert_eq!(prompt.matches("<|im_start|>assistant").count(), kept.len() + 1, "each kept question with its answer");
    // The passages and the question stay whole: the same passages as with a short conversation.
    assert_eq!(p.shown, alone.shown);
    assert!(prompt.trim_end().ends_with("When did it open?<|im_end|>\n<|im_start|>assistant"), "{}", &prompt[prompt.len() - 200..]);
}
