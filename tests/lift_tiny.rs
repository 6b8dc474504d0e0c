//! LIFT mechanics on the tiny random model: training examples mask exactly what they should, and
//! an absorbed document is recalled from the adapter alone (memory mode, nothing in context).

use candle_core::{Device, Tensor};
use lift_serve::adapters::{Lora, LoraConfig};
use lift_serve::lift::plan::{segments, ExampleKind, Plan, PlanOptions};
use lift_serve::lift::prompt::{chat_with_context, RECITE_PROMPT};
use lift_serve::lift::qa::{QaPair, QaSource};
use lift_serve::lift::trainer::{train, TrainOptions};
use lift_serve::model::{Adapter, KvCache, Logits, Model, NoHooks};
use lift_serve::testing::{write_hf, TinySpec};

fn tiny() -> (tempfile::TempDir, Model) {
    let dir = tempfile::tempdir().unwrap();
    let path = write_hf(&dir.path().join("tiny"), &TinySpec::default()).unwrap();
    let model = Model::load(&path, &Device::Cpu).unwrap();
    (dir, model)
}

const DOC: &str = "Marigold ferries leave the north pier at dawn. The lighthouse keeper, Anselm Varga, \
logs every departure in a green ledger. Passengers pay eleven coins for the crossing to Tern Island.";

#[test]
fn ct_and_qa_examples_put_the_loss_exactly_on_segment_and_answer_tokens() {
    let (_d, model) = tiny();
    let doc = model.tokenizer.encode(DOC, false).unwrap();
    let opts = PlanOptions { window: 48, stride: None, context_tokens: 32, qa_context_tokens: None };
    let pair = QaPair {
        question: "Who keeps the lighthouse?".into(),
        answer: "Anselm Varga".into(),
        evidence: "The lighthouse keeper, Anselm Varga".into(),
        evidence_span: (47, 82),
        source: QaSource::Extractive,
    };
    let plan = Plan::new(&model, &doc, &[pair], &opts).unwrap();
    assert_eq!(plan.segments, segments(doc.len(), 48, 18));
    let mut rng = Plan::rng(1);
    for i in 0..plan.segments.len() {
        let ex = plan.segment_example(&model, &doc, i, &mut rng).unwrap();
        let seg = plan.segments[i];
        let n = seg.end - seg.start;
        assert_eq!(ex.kind, ExampleKind::Segment(i));
        assert_eq!(ex.target_count(), n, "only the segment's tokens are in the loss");
        let k = ex.tokens.len() - n;
        assert!(ex.target[k..].iter().all(|&t| t) && ex.target[..k].iter().all(|&t| !t));
        assert_eq!(&ex.tokens[k..], &doc[seg.start..seg.end]);
        // The prompt ends with the recite instruction and the assistant turn.
        let prompt = model.tokenizer.decode(&ex.tokens[..k]).unwrap();
        assert!(prompt.contains(RECITE_PROMPT) && prompt.ends_with("<|im_start|>assistant\n"), "{prompt}");
    }
    let qa = &plan.qa[0];
    let answer = model.tokenizer.encode("Anselm Varga", false).unwrap();
    assert_eq!(qa.target_count(), answer.len() + 1, "answer tokens and the end-of-turn token");
    let k = qa.tokens.len() - answer.len() - 1;
    assert_eq!(&qa.tokens[k..k + answer.len()], answer.as_slice());
    assert!(qa.target[k..].iter().all(|&t| t) && qa.target[..k].iter().all(|&t| !t));
    assert_eq!(qa.tokens.last(), model.tokenizer.eos_token_ids().first());
}

/// Greedy continuation of `prompt` for `n` tokens.
fn continue_greedy(model: &Model, adapter: Option<&dyn Adapter>, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut cache = KvCache::new(model.config().num_layers);
    let dev = Device::Cpu;
    let mut logits = model
        .decoder
        .forward(&Tensor::new(prompt, &dev).unwrap().unsqueeze(0).unwrap(), &mut cache, adapter, &mut NoHooks, Logits::Last)
        .unwrap();
    let mut out = Vec::new();
    for _ in 0..n {
        let next = logits.argmax(1).unwrap().to_vec1::<u32>().unwrap()[0];
        out.push(next);
        let x = Tensor::new(&[next], &dev).unwrap().unsqueeze(0).unwrap();
        logits = model.decoder.forward(&x, &mut cache, adapter, &mut NoHooks, Logits::Last).unwrap();
    }
    out
}

fn memorize_and_recite(model: &Model, adapter: &dyn Adapter, vars: &[candle_core::Var], lr: f64, epochs: usize) {
    // Byte-level tokens: two sentences, ~80 tokens, two overlapping segments.
    let text = &DOC[..DOC.find(" Passengers").unwrap()];
    let doc = model.tokenizer.encode(text, false).unwrap();
    // No document context at all: whatever is recalled comes from the adapter.
    let opts = PlanOptions { window: 64, stride: None, context_tokens: 0, qa_context_tokens: None };
    let plan = Plan::new(model, &doc, &[], &opts).unwrap();
    let train_opts = TrainOptions { epochs: [epochs, 0], lr, seed: 3, ..Default::default() };
    let report = train(model, &doc, &plan, adapter, vars, &train_opts, &mut |_| {}, &|| false).unwrap();
    eprintln!("epoch losses: {:?}", report.epoch_losses.iter().step_by(10).collect::<Vec<_>>());
    assert!(report.final_loss < 0.5, "loss after training: {:?}", report.epoch_losses.last());

    // Ask for the passage in the middle of the document: recite prompt + its first 6 tokens.
    let seg = plan.segments[plan.segments.len() / 2];
    let mut prompt = chat_with_context(model, &[], RECITE_PROMPT).unwrap();
    prompt.extend_from_slice(&doc[seg.start..seg.start + 6]);
    let want = &doc[seg.start + 6..seg.start + 30];
    let adapted = continue_greedy(model, Some(adapter), &prompt, want.len());
    let base = continue_greedy(model, None, &prompt, want.len());
    let matches = |got: &[u32]| got.iter().zip(want).filter(|(a, b)| a == b).count();
    eprintln!(
        "adapter: {:?}\nbase: {:?}\nwant: {:?}",
        model.tokenizer.decode(&adapted).unwrap(),
        model.tokenizer.decode(&base).unwrap(),
        model.tokenizer.decode(want).unwrap()
    );
    assert!(matches(&adapted) >= want.len() * 9 / 10, "adapter recalled {}/{}", matches(&adapted), want.len());
    assert!(matches(&base) <= want.len() / 4, "base model recalled {}/{}", matches(&base), want.len());
}

/// LoRA on the tiny model. (Gated Memory plateaus here at a loss of ~1.9: in a 2-layer random
/// model its queries carry too little of the preceding text to tell positions apart; on the real
/// model it recalls out-of-window facts, see the LIFT issue's notes.)
#[test]
fn lora_memory_mode_recites_a_passage_the_base_model_cannot() {
    let (_d, model) = tiny();
    let lora = LoraConfig { rank: 16, alpha: 32.0, ..Default::default() };
    let adapter = Lora::new(model.config(), &lora, 7, &Device::Cpu).unwrap();
    memorize_and_recite(&model, &adapter, adapter.vars(), 2e-3, 100);
}
