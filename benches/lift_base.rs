//! LIFT over a prepared base vs over the plain model, in the setup of the out-of-window fact test
//! (`tests/lift_real.rs`: the Kestrel Observatory document, its 5 out-of-window and 2 in-window
//! questions, its absorb options, a 128-token in-context window). For each base (`none`, or a
//! prepared base's directory) it loads the default model with that base, absorbs the document,
//! asks every question in mode `lift` (through the base's filter when it has one) and prints
//! accuracy in and out of the window, the absorb time and, with a filter, its recall of the
//! evidence chunks. One JSON line per base goes to stdout after the human-readable lines.
//!
//!   RAYON_NUM_THREADS=2 cargo bench --bench lift_base                 # none, then base/
//!   LIFT_BASES=none,target/arms/lora cargo bench --bench lift_base    # any bases
//!   LIFT_EPOCHS=1,1 LIFT_MAX_QA=24 cargo bench --bench lift_base      # a shorter schedule
//!   LIFT_OPTIONS='{"layers":[15,16,17]}' cargo bench --bench lift_base   # any AbsorbOptions fields
//!   LIFT_ICL=1 cargo bench --bench lift_base                          # also asks without an adapter
//!
//! Bases run one after another in this process, with the same options and seed.

use candle_core::Device;
use lift_serve::document::Document;
use lift_serve::lift::answer::{answer, Ask, ContextPolicy, Mode};
use lift_serve::lift::absorb::qa_examples;
use lift_serve::lift::absorb::qa::{QaPair, QaSource};
use lift_serve::lift::{absorb, AbsorbEvent, AbsorbOptions};
use lift_serve::model::generate::SamplingParams;
use lift_serve::model::{Adapter, Model};
use std::time::Instant;

include!("../tests/fixtures/kestrel_questions.rs");

/// A test question as a QA pair with its evidence located in the document (filter recall).
fn as_pair(q: &Question) -> QaPair {
    let at = DOC.find(q.evidence).expect("evidence is in the document");
    QaPair {
        question: q.question.into(),
        answer: q.answers[0].into(),
        evidence: q.evidence.into(),
        evidence_span: (at, at + q.evidence.len()),
        source: QaSource::Extractive,
    }
}

fn ask(model: &Model, doc: &Document, adapter: Option<&dyn Adapter>, q: &Question, mode: Mode) -> (bool, String) {
    let params = SamplingParams { max_tokens: MAX_TOKENS, ..Default::default() };
    let ask = Ask { history: &[], question: q.question, mode, context: Some(ContextPolicy::Full), context_tokens: Some(CONTEXT_TOKENS) };
    let out = answer(model, doc, adapter, &ask, &params, &mut |_| true).unwrap().generation;
    let reply = out.text.trim().to_string();
    let lower = reply.to_lowercase();
    (q.answers.iter().any(|a| lower.contains(&a.to_lowercase())), reply)
}

/// Overwrites the fields of `base` that `patch` names, recursing into objects.
fn merge(base: &mut serde_json::Value, patch: serde_json::Value) {
    match (base, patch) {
        (serde_json::Value::Object(b), serde_json::Value::Object(p)) => {
            for (k, v) in p {
                merge(b.entry(k).or_insert(serde_json::Value::Null), v);
            }
        }
        (b, p) => *b = p,
    }
}

/// The test's absorb options with the environment's overrides (the same for every base).
fn absorb_options() -> anyhow::Result<AbsorbOptions> {
    let mut o: AbsorbOptions = options();
    if let Ok(e) = std::env::var("LIFT_EPOCHS") {
        let e: Vec<usize> = e.split(',').map(|x| x.trim().parse()).collect::<Result<_, _>>()?;
        anyhow::ensure!(e.len() == 2, "LIFT_EPOCHS=segment_only,with_qa");
        o.train.epochs = [e[0], e[1]];
    }
    if let Ok(n) = std::env::var("LIFT_MAX_QA") {
        o.qa.max_pairs = n.parse()?;
    }
    if let Ok(patch) = std::env::var("LIFT_OPTIONS") {
        let mut json = serde_json::to_value(&o)?;
        merge(&mut json, serde_json::from_str(&patch)?);
        o = serde_json::from_value(json)?;
    }
    Ok(o)
}

fn main() -> anyhow::Result<()> {
    let path = lift_serve::fetch::resolve_model(None)?;
    let bases = std::env::var("LIFT_BASES").unwrap_or_else(|_| "none,base".into());
    let o = absorb_options()?;
    let runtime = lift_serve::runtime::RuntimeConfig::from_env()?;
    let mut lines = Vec::new();
    for name in bases.split(',').map(str::trim).filter(|v| !v.is_empty()) {
        let mut model = Model::load_with(&path, &Device::Cpu, &runtime)?;
        lift_serve::base::install_from_arg(&mut model, Some(name))?;
        let t0 = Instant::now();
        let mut on_event = |e: AbsorbEvent| {
            if let AbsorbEvent::Train(p) = e {
                if p.step % 25 == 0 {
                    eprintln!("[{name}] step {}/{} loss {:.3} ({:.0} s)", p.step, p.steps, p.loss, t0.elapsed().as_secs_f64());
                }
            }
        };
        let doc = &Document::encode(&model, DOC)?;
        let a = absorb(&model, doc, Some("Kestrel Valley Observatory"), &o, &mut on_event, &|| false)?;
        let absorb_s = t0.elapsed().as_secs_f64();
        let adapter: &dyn Adapter = &a.bundle.adapter;
        let score = |qs: &[Question], label: &str, mode: Mode| -> usize {
            let mut ok = 0;
            for q in qs {
                let (hit, reply) = ask(&model, doc, (mode == Mode::Lift).then_some(adapter), q, mode);
                ok += hit as usize;
                eprintln!("[{name}] {mode:?} {label} {} {:?}: {reply:?}", if hit { "ok  " } else { "miss" }, q.question);
            }
            ok
        };
        let oow = score(OUT_OF_WINDOW, "out", Mode::Lift);
        let inw = score(IN_WINDOW, "in ", Mode::Lift);
        let mut line = serde_json::json!({
            "base": name, "out_of_window": oow, "out_of_window_total": OUT_OF_WINDOW.len(),
            "in_window": inw, "in_window_total": IN_WINDOW.len(), "absorb_s": absorb_s,
            "epochs": o.train.epochs, "max_qa": o.qa.max_pairs, "layers": o.layers,
            "steps": a.report.steps, "tokens": a.report.tokens, "final_loss": a.report.final_loss,
            "qa_pairs": a.qa.len(),
        });
        if std::env::var("LIFT_ICL").is_ok_and(|v| v == "1") {
            line["icl_out_of_window"] = serde_json::json!(score(OUT_OF_WINDOW, "out", Mode::Icl));
            line["icl_in_window"] = serde_json::json!(score(IN_WINDOW, "in ", Mode::Icl));
        }
        if let Some(f) = model.base_filter() {
            let tests: Vec<QaPair> = IN_WINDOW.iter().map(as_pair).collect();
            let test = qa_examples::evaluate(&model, Some(adapter), f, doc, &tests, CONTEXT_TOKENS)?;
            eprintln!("[{name}] filter on the in-window questions: {test:?}");
            line["filter_test"] = serde_json::to_value(&test)?;
        }
        eprintln!(
            "[{name}] out of window {oow}/{}, in window {inw}/{}, absorb {absorb_s:.0} s ({} steps, {} tokens)",
            OUT_OF_WINDOW.len(),
            IN_WINDOW.len(),
            a.report.steps,
            a.report.tokens
        );
        println!("{line}");
        lines.push(line);
    }
    eprintln!("\n| base | out of window | in window | absorb s | steps | train tokens |");
    eprintln!("|---|---|---|---|---|---|");
    for l in &lines {
        eprintln!(
            "| {} | {}/{} | {}/{} | {:.0} | {} | {} |",
            l["base"].as_str().unwrap_or("?"),
            l["out_of_window"],
            l["out_of_window_total"],
            l["in_window"],
            l["in_window_total"],
            l["absorb_s"].as_f64().unwrap_or(f64::NAN),
            l["steps"],
            l["tokens"]
        );
    }
    Ok(())
}
