//! Context distillation on the tiny random model, through `lift::absorb`: the teacher reads each
//! QA example once for the whole run (its targets are cached across epochs), its passes count in
//! the absorb's training tokens, and its distribution changes what the adapter learns. (The
//! loss's gradient against finite differences: `lift::distill`'s unit tests.)

use candle_core::Device;
use lift_serve::document::Document;
use lift_serve::lift::distill::DistillOptions;
use lift_serve::lift::plan::QaLayout;
use lift_serve::lift::{absorb, AbsorbOptions, Absorbed};
use lift_serve::model::Model;
use lift_serve::testing::{write_hf, TinySpec};

fn tiny() -> (tempfile::TempDir, Model) {
    let dir = tempfile::tempdir().unwrap();
    let path = write_hf(&dir.path().join("tiny"), &TinySpec::default()).unwrap();
    let model = Model::load(&path, &Device::Cpu).unwrap();
    (dir, model)
}

fn document(model: &Model) -> Document {
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/harbor_history.txt")).unwrap();
    Document::encode(model, text.chars().take(700).collect::<String>()).unwrap()
}

fn options(distill: Option<DistillOptions>, layout: QaLayout) -> AbsorbOptions {
    let mut o = AbsorbOptions::default();
    o.plan.window = 48;
    o.plan.training_context_tokens = 24;
    o.plan.qa_layout = layout;
    o.qa.use_model = false;
    o.qa.max_pairs = 5;
    o.train.epochs = [0, 3];
    o.train.distill = distill;
    o
}

fn run(model: &Model, doc: &Document, opts: &AbsorbOptions) -> Absorbed {
    absorb(model, doc, None, opts, &mut |_| {}, &|| false).unwrap()
}

fn max_diff(a: &Absorbed, b: &Absorbed) -> f32 {
    lift_serve::testing::max_adapter_diff(&a.bundle, &b.bundle)
}

#[test]
fn the_teacher_reads_each_qa_example_once_and_its_distribution_is_learned() {
    let (_d, model) = tiny();
    let doc = document(&model);
    for layout in [QaLayout::HeadTail, QaLayout::Passages, QaLayout::Recall] {
        let plain = run(&model, &doc, &options(None, layout));
        assert_eq!((plain.report.teacher_passes, plain.report.teacher_tokens), (0, 0));
        let distilled = run(&model, &doc, &options(Some(DistillOptions { weight: 0.5, top_k: 8 }), layout));
        let pairs = distilled.qa.len();
        assert!(pairs >= 2, "{pairs} QA pairs");
        let r = &distilled.report;
        // Three epochs over the segments and QA examples, one teacher pass per QA example.
        let segments = lift_serve::lift::plan::segments(doc.tokens().len(), 48, 18).len();
        assert_eq!(r.examples, 3 * (segments + pairs), "{layout:?}");
        assert_eq!(r.teacher_passes, pairs, "{layout:?}: one pass per example, not per epoch");
        assert!(r.teacher_tokens > 0 && r.tokens > r.teacher_tokens);
        let d = max_diff(&plain, &distilled);
        assert!(d > 1e-5, "{layout:?}: the teacher changed nothing ({d})");
    }
}

#[test]
fn a_selection_trains_the_most_impactful_share_of_the_questions_and_counts_its_passes() {
    let (_d, model) = tiny();
    let doc = document(&model);
    let mut o = options(None, QaLayout::Passages);
    o.qa.max_pairs = 8;
    let all = run(&model, &doc, &o);
    o.plan.qa_select = Some(0.5);
    let selected = run(&model, &doc, &o);
    let pairs = all.qa.len();
    assert!(pairs >= 4, "{pairs} QA pairs");
    let segments = lift_serve::lift::plan::segments(doc.tokens().len(), 48, 18).len();
    assert_eq!(all.report.examples, 3 * (segments + pairs));
    assert_eq!(all.report.selection_passes, 0);
    // Every question read twice (student and teacher), about half of them trained (facts whole).
    let r = &selected.report;
    assert_eq!(r.selection_passes, 2 * pairs);
    let kept = r.examples / 3 - segments;
    assert!(kept >= pairs.div_ceil(2) && kept < pairs, "{kept} of {pairs} questions trained");
    assert!(r.selection_tokens > 0 && r.tokens > r.selection_tokens);
    let json = &selected.manifest.options;
    assert_eq!(json["plan"]["qa_select"], 0.5, "the selection is part of the saved options");
    // The dry run's count follows: half the questions trained, every one read twice.
    let count = |o: &AbsorbOptions| lift_serve::lift::estimate::plan_counts(doc.tokens().len(), pairs, o, false);
    let (with, without) = (count(&o), count(&options(None, QaLayout::Passages)));
    assert_eq!((with.1, without.1), (pairs.div_ceil(2), pairs));
    let row = lift_serve::lift::plan::qa_row_tokens(&o.plan);
    assert_eq!(with.3 + 3 * (pairs - pairs.div_ceil(2)) as u64 * row, without.3 + 2 * pairs as u64 * row);
}

#[test]
fn distillation_options_stay_out_of_the_saved_options_until_used() {
    // Document ids hash the options' JSON: the default (the `paper` recipe) saves neither.
    let plain = serde_json::to_value(AbsorbOptions::default()).unwrap();
    for (part, key) in [("train", "distill"), ("train", "batch_rows"), ("plan", "qa_layout"), ("plan", "qa_select")] {
        assert!(plain[part].get(key).is_none(), "{part}.{key} in {plain}");
    }
    let mut lean = AbsorbOptions::default();
    lift_serve::lift::Recipe::Lean.set(&mut lean);
    let lean = serde_json::to_value(&lean).unwrap();
    assert_eq!((lean["train"]["epochs"].clone(), lean["plan"]["qa_layout"].clone()), (serde_json::json!([1, 2]), serde_json::json!("passages")));
    let o = options(Some(DistillOptions::default()), QaLayout::Passages);
    let json = serde_json::to_value(&o).unwrap();
    assert_eq!(json["plan"]["qa_layout"], "passages");
    assert_eq!(json["train"]["distill"]["top_k"], 16);
    let back: AbsorbOptions = serde_json::from_value(json).unwrap();
    assert_eq!(back.train.distill, o.train.distill);
}
