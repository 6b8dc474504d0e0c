//! FltLM / CDT ablation on the default model, in the setup of the out-of-window fact test
//! (`tests/lift_real.rs`: the Kestrel Observatory document, its 5 out-of-window and 2 in-window
//! questions, its absorb options, a 128-token in-context window). For each variant — `lift`,
//! `filter`, `cdt`, `filter+cdt` — it absorbs the document, asks every question in mode `lift`
//! (with the filter when absorbed with one) and prints accuracy in and out of the window, the
//! absorb time, the filter's evidence recall and CDT's critical-token rates. One JSON line per
//! variant goes to stdout after the human-readable lines.
//!
//!   RAYON_NUM_THREADS=2 cargo bench --bench ablation
//!   ABLATION_VARIANTS=lift,filter cargo bench --bench ablation     # a subset
//!   ABLATION_EPOCHS=1,1 ABLATION_MAX_QA=24 cargo bench --bench ablation   # a shorter schedule
//!   ABLATION_OPTIONS='{"layers":[15,16,17]}' cargo bench --bench ablation  # any AbsorbOptions fields
//!
//! Variants run one after another in this process; `ABLATION_ICL=1` also asks the base model.

use candle_core::Device;
use lift_serve::lift::answer::{answer_filtered, Mode};
use lift_serve::lift::filter::{self, Filter};
use lift_serve::lift::qa::{QaPair, QaSource};
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

fn ask(model: &Model, doc: &[u32], adapter: Option<&dyn Adapter>, filter: Option<&Filter>, q: &Question, mode: Mode) -> (bool, String) {
    let params = SamplingParams { max_tokens: MAX_TOKENS, ..Default::default() };
    let (_, out, _) =
        answer_filtered(model, doc, adapter, filter, q.question, mode, Some(CONTEXT_TOKENS), &params, &mut |_| true).unwrap();
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

fn main() -> anyhow::Result<()> {
    let path = lift_serve::fetch::resolve_model(None)?;
    let model = Model::load(&path, &Device::Cpu)?;
    let variants = std::env::var("ABLATION_VARIANTS").unwrap_or_else(|_| "lift,filter,cdt,filter+cdt".into());
    let mut lines = Vec::new();
    for variant in variants.split(',').map(str::trim).filter(|v| !v.is_empty()) {
        let mut o: AbsorbOptions = options();
        // A shorter schedule for a loaded machine (the same for every variant).
        if let Ok(e) = std::env::var("ABLATION_EPOCHS") {
            let e: Vec<usize> = e.split(',').map(|x| x.trim().parse()).collect::<Result<_, _>>()?;
            anyhow::ensure!(e.len() == 2, "ABLATION_EPOCHS=segment_only,with_qa");
            o.train.epochs = [e[0], e[1]];
        }
        if let Ok(n) = std::env::var("ABLATION_MAX_QA") {
            o.qa.max_pairs = n.parse()?;
        }
        if let Ok(patch) = std::env::var("ABLATION_OPTIONS") {
            let mut json = serde_json::to_value(&o)?;
            merge(&mut json, serde_json::from_str(&patch)?);
            o = serde_json::from_value(json)?;
        }
        o.filter.enabled = variant.contains("filter");
        o.cdt.enabled = variant.contains("cdt");
        anyhow::ensure!(variant == "lift" || o.filter.enabled || o.cdt.enabled, "unknown variant {variant}");
        let t0 = Instant::now();
        let mut on_event = |e: AbsorbEvent| {
            if let AbsorbEvent::Train(p) = e {
                if p.step % 25 == 0 {
                    eprintln!("[{variant}] step {}/{} loss {:.3} ({:.0} s)", p.step, p.steps, p.loss, t0.elapsed().as_secs_f64());
                }
            }
        };
        let a = absorb(&model, DOC, Some("Kestrel Valley Observatory"), &o, &mut on_event, &|| false)?;
        let absorb_s = t0.elapsed().as_secs_f64();
        let doc = &a.doc_tokens;
        let adapter: &dyn Adapter = &a.bundle.adapter;
        let f = Filter::from_extras(&a.bundle.extras, model.config())?;
        let score = |qs: &[Question], label: &str| -> usize {
            let mut ok = 0;
            for q in qs {
                let (hit, reply) = ask(&model, doc, Some(adapter), f.as_ref(), q, Mode::Lift);
                ok += hit as usize;
                eprintln!("[{variant}] {label} {} {:?}: {reply:?}", if hit { "ok  " } else { "miss" }, q.question);
            }
            ok
        };
        let oow = score(OUT_OF_WINDOW, "out");
        let inw = score(IN_WINDOW, "in ");
        let mut line = serde_json::json!({
            "variant": variant, "out_of_window": oow, "out_of_window_total": OUT_OF_WINDOW.len(),
            "in_window": inw, "in_window_total": IN_WINDOW.len(), "absorb_s": absorb_s,
            "epochs": o.train.epochs, "max_qa": o.qa.max_pairs, "layers": o.layers,
            "steps": a.report.steps, "final_loss": a.report.final_loss, "qa_pairs": a.qa.len(),
        });
        if let Some(f) = &f {
            let aux = filter::evaluate(&model, Some(adapter), f, DOC, doc, &a.qa, CONTEXT_TOKENS)?;
            let tests: Vec<QaPair> = IN_WINDOW.iter().map(as_pair).collect();
            let test = filter::evaluate(&model, Some(adapter), f, DOC, doc, &tests, CONTEXT_TOKENS)?;
            eprintln!("[{variant}] filter recall on aux QA: {aux:?}\n[{variant}] filter recall on the in-window questions: {test:?}");
            eprintln!("[{variant}] filter losses per stage-2 epoch: {:?}", a.report.filter_epoch_losses);
            line["filter_aux"] = serde_json::to_value(&aux)?;
            line["filter_test"] = serde_json::to_value(&test)?;
            line["filter_epoch_losses"] = serde_json::to_value(&a.report.filter_epoch_losses)?;
        }
        if let Some(c) = &a.report.cdt {
            eprintln!(
                "[{variant}] cdt: {}/{} tokens critical ({:.3}); QA context {:.3}, evidence {:.3} ({} evidence tokens); mean move {:.2e}, pass-2/pass-1 loss {:.4}",
                c.critical,
                c.tokens,
                c.critical as f64 / c.tokens.max(1) as f64,
                c.context_rate(),
                c.evidence_rate(),
                c.evidence_tokens,
                c.mean_relative_shift,
                c.mean_loss_ratio
            );
            line["cdt"] = serde_json::to_value(c)?;
            line["cdt_relative_move"] = serde_json::json!(o.cdt.relative_move);
        }
        eprintln!(
            "[{variant}] out of window {oow}/{}, in window {inw}/{}, absorb {absorb_s:.0} s ({} steps)",
            OUT_OF_WINDOW.len(),
            IN_WINDOW.len(),
            a.report.steps
        );
        println!("{line}");
        lines.push(line);
    }
    if std::env::var("ABLATION_ICL").is_ok_and(|v| v == "1") {
        let doc = model.tokenizer.encode(DOC, false)?;
        let oow = OUT_OF_WINDOW.iter().filter(|q| ask(&model, &doc, None, None, q, Mode::Icl).0).count();
        let inw = IN_WINDOW.iter().filter(|q| ask(&model, &doc, None, None, q, Mode::Icl).0).count();
        println!("{}", serde_json::json!({"variant": "icl", "out_of_window": oow, "in_window": inw}));
    }
    eprintln!("\n| variant | out of window | in window | absorb s | steps |");
    eprintln!("|---|---|---|---|---|");
    for l in &lines {
        eprintln!(
            "| {} | {}/{} | {}/{} | {:.0} | {} |",
            l["variant"].as_str().unwrap_or("?"),
            l["out_of_window"],
            l["out_of_window_total"],
            l["in_window"],
            l["in_window_total"],
            l["absorb_s"].as_f64().unwrap_or(f64::NAN),
            l["steps"]
        );
    }
    Ok(())
}
