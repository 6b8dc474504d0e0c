//! LIFT on the real default model (SmolLM2-135M-Instruct Q4_1): the out-of-window fact test of
//! the LIFT issue. A ~1,500-token document with five facts in its middle, where the truncated
//! context cannot show them, is absorbed with a short CPU schedule; then each question, worded
//! differently from the sentence that holds its answer, is asked in `lift` mode (adapter + head
//! and tail of the document) and in `icl` mode (the same context without the adapter). The model
//! runs over the shipped prepared base (`base/`), as `serve`, `absorb` and `ask` do by default:
//! its filter lays out and masks the QA training examples and every answer's context.
//! (`benches/lift_base.rs` runs the same test over the plain model beside it.)
//!
//! Run alone: `cargo test --release --test lift_real -- --nocapture`.

use candle_core::Device;
use lift_serve::document::Document;
use lift_serve::lift::answer::{answer, build_prompt, Ask, ContextPolicy, Mode};
use lift_serve::lift::{absorb, AbsorbOptions};
use lift_serve::model::generate::SamplingParams;
use lift_serve::model::{Adapter, Model};
use std::time::Instant;

include!("fixtures/kestrel_questions.rs");

/// Document token range of `evidence` (by characters → tokens of the prefix).
fn token_span(model: &Model, evidence: &str) -> (usize, usize) {
    let at = DOC.find(evidence).unwrap_or_else(|| panic!("{evidence:?} is in the document"));
    let before = model.tokenizer.encode(&DOC[..at], false).unwrap().len();
    let through = model.tokenizer.encode(&DOC[..at + evidence.len()], false).unwrap().len();
    (before, through)
}

fn ask(model: &Model, doc: &Document, adapter: &dyn Adapter, q: &Question, mode: Mode) -> (bool, String) {
    let params = SamplingParams { max_tokens: MAX_TOKENS, ..Default::default() };
    let ask = Ask { history: &[], question: q.question, mode, context: Some(ContextPolicy::Full), context_tokens: Some(CONTEXT_TOKENS) };
    let out = answer(model, doc, Some(adapter), &ask, &params, &mut |_| true).unwrap().generation;
    let reply = out.text.trim().to_string();
    let lower = reply.to_lowercase();
    (q.answers.iter().any(|a| lower.contains(&a.to_lowercase())), reply)
}

/// About 6 minutes on an idle 2-core machine (absorb ~320 s), the longest test of the suite.
#[test]
fn out_of_window_facts_are_recalled_in_lift_mode() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
    let path = lift_serve::fetch::resolve_model(None).expect("default model (run `lift-serve fetch-model`)");
    // `LIFT_CPU_FLOAT_DTYPE=f32` runs it in f32, as the commands would (docs/absorb-speed.md).
    let runtime = lift_serve::runtime::RuntimeConfig::from_env().expect("LIFT_* runtime variables");
    let mut model = Model::load_with(&path, &Device::Cpu, &runtime).expect("default model loads");
    let base = concat!(env!("CARGO_MANIFEST_DIR"), "/base");
    lift_serve::base::install_from_arg(&mut model, Some(base)).expect("the shipped prepared base installs");
    assert!(model.base_filter().is_some());

    let t0 = Instant::now();
    let doc = &Document::encode(&model, DOC).expect("tokenizes");
    let absorbed = absorb(&model, doc, Some("Kestrel Valley Observatory"), &options(), &mut |_| {}, &|| false)
        .expect("absorb");
    let adapter: &dyn Adapter = &absorbed.bundle.adapter;
    eprintln!(
        "absorbed {} tokens in {:.0} s: {} QA pairs, {} steps, final loss {:.3}",
        doc.len(),
        t0.elapsed().as_secs_f64(),
        absorbed.qa.len(),
        absorbed.report.steps,
        absorbed.report.final_loss
    );
    assert!((1300..=1800).contains(&doc.len()), "a ~1,500-token document: {}", doc.len());

    // Where the window is: the prompt `icl` and `lift` build for a question.
    let icl = Ask { history: &[], question: OUT_OF_WINDOW[0].question, mode: Mode::Icl, context: Some(ContextPolicy::Full), context_tokens: Some(CONTEXT_TOKENS) };
    let prompt = build_prompt(&model, doc, &icl, MAX_TOKENS).unwrap();
    let shown = |(a, b): (usize, usize)| prompt.shown.iter().any(|&(s, e)| a < e && s < b);
    for q in OUT_OF_WINDOW {
        assert!(!shown(token_span(&model, q.evidence)), "{:?} must be outside the context window", q.evidence);
    }
    for q in IN_WINDOW {
        let (a, b) = token_span(&model, q.evidence);
        assert!(prompt.shows((a, b)), "{:?} must be inside the context window", q.evidence);
    }

    let mut table = Vec::new();
    let mut score = |qs: &[Question], label: &str| -> (usize, usize) {
        let (mut lift, mut icl) = (0, 0);
        for q in qs {
            let (l_ok, l_reply) = ask(&model, doc, adapter, q, Mode::Lift);
            let (i_ok, i_reply) = ask(&model, doc, adapter, q, Mode::Icl);
            lift += l_ok as usize;
            icl += i_ok as usize;
            table.push(format!("{label} | {} | lift {} {l_reply:?} | icl {} {i_reply:?}", q.question, l_ok, i_ok));
        }
        (lift, icl)
    };
    let (oow_lift, oow_icl) = score(OUT_OF_WINDOW, "out");
    let (in_lift, in_icl) = score(IN_WINDOW, "in");
    for row in &table {
        eprintln!("{row}");
    }
    eprintln!(
        "out of window: lift {oow_lift}/{n}, icl {oow_icl}/{n}; in window: lift {in_lift}/{m}, icl {in_icl}/{m}",
        n = OUT_OF_WINDOW.len(),
        m = IN_WINDOW.len()
    );
    assert!(oow_lift >= 3, "lift recalls at least 3 of 5 out-of-window facts: {oow_lift}");
    assert!(oow_icl <= 1, "the base model cannot see them: {oow_icl}");
    assert!(in_lift >= in_icl, "in-window facts still answered with the adapter: lift {in_lift}, icl {in_icl}");
}
