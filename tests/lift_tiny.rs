//! LIFT mechanics on the tiny random model: training examples mask exactly what they should, and
//! an absorbed document is recalled from the adapter alone (memory mode, nothing in context).

use candle_core::{Device, Tensor};
use lift_serve::adapters::{GatedMemory, Lora, LoraConfig};
use lift_serve::lift::absorb::plan::{segments, ExampleKind, Plan, PlanOptions};
use lift_serve::lift::answer::prompt::{chat_with_context, RECITE_PROMPT};
use lift_serve::lift::absorb::qa::{QaPair, QaSource};
use lift_serve::lift::absorb::trainer::{example_loss, train, RunControl, TrainInputs, TrainOptions};
use lift_serve::model::{Adapter, KvCache, Logits, Model, NoHooks};
use lift_serve::testing::{write_hf, TinySpec};

/// With f32 float matmuls: packed rows are compared with their sequences alone to float
/// precision, and bf16 rounding turns last-bit differences between those paths into steps of
/// 2^-8 (the default bf16 matmuls are measured on the real model, `tests/runtime_real.rs`).
fn tiny() -> (tempfile::TempDir, Model) {
    let dir = tempfile::tempdir().unwrap();
    let path = write_hf(&dir.path().join("tiny"), &TinySpec::default()).unwrap();
    let mut model = Model::load(&path, &Device::Cpu).unwrap();
    model.decoder.cpu_float_dtype = candle_core::DType::F32;
    (dir, model)
}

const DOC: &str = "Marigold ferries leave the north pier at dawn. The lighthouse keeper, Anselm Varga, \
logs every departure in a green ledger. Passengers pay eleven coins for the crossing to Tern Island.";

#[test]
fn ct_and_qa_examples_put_the_loss_exactly_on_segment_and_answer_tokens() {
    let (_d, model) = tiny();
    let doc = model.tokenizer.encode(DOC, false).unwrap();
    let opts = PlanOptions { window: 48, training_context_tokens: 32, ..Default::default() };
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

fn pair(question: &str, answer: &str) -> QaPair {
    QaPair {
        question: question.into(),
        answer: answer.into(),
        evidence: answer.into(),
        evidence_span: (0, 0),
        source: QaSource::Extractive,
    }
}

/// Four questions about `DOC`.
fn ferry_pairs() -> Vec<QaPair> {
    vec![
        pair("Who keeps the lighthouse?", "Anselm Varga"),
        pair("Where do the ferries leave from?", "the north pier"),
        pair("What does a crossing cost?", "eleven coins"),
        pair("What colour is the ledger?", "green"),
    ]
}

#[test]
fn a_packed_qa_row_has_the_mean_loss_and_gradients_of_its_questions() {
    let (_d, model) = tiny();
    let doc = model.tokenizer.encode(DOC, false).unwrap();
    let pairs = ferry_pairs()[..3].to_vec();
    let opts = |qa_pack| PlanOptions { window: 48, training_context_tokens: 32, qa_pack, ..Default::default() };
    let single = Plan::new(&model, &doc, &pairs, &opts(1)).unwrap();
    let packed = Plan::new(&model, &doc, &pairs, &opts(3)).unwrap();
    assert_eq!((single.qa.len(), packed.qa.len()), (3, 1));
    let row = &packed.qa[0];
    let p = row.packing.as_ref().expect("three questions share one row");
    assert_eq!(p.len(), row.tokens.len());
    let targets: usize = single.qa.iter().map(|e| e.target_count()).sum();
    assert_eq!(row.target_count(), targets, "every answer token is still in the loss");
    let separate: usize = single.qa.iter().map(|e| e.tokens.len()).sum();
    let prefix = p.sequence().iter().take_while(|&&s| s == 0).count();
    assert!(prefix > 32, "the shared prefix holds the document context ({prefix} tokens)");
    assert_eq!(row.tokens.len(), separate - 2 * prefix, "the prefix is stored once instead of three times");

    assert_packed_row_is_the_mean(&model, row, &single.qa);

    // Contextualized training: two segments behind one context (the same head/tail split).
    let plan = Plan::new(&model, &doc, &[], &PlanOptions { segment_pack: 2, ..opts(1) }).unwrap();
    let row = plan.segments_example(&model, &doc, &[0, 2], &mut Plan::rng(9)).unwrap();
    let singles: Vec<_> =
        [0, 2].iter().map(|&i| plan.segment_example(&model, &doc, i, &mut Plan::rng(9)).unwrap()).collect();
    assert_eq!(row.target_count(), singles.iter().map(|e| e.target_count()).sum::<usize>());
    assert_packed_row_is_the_mean(&model, &row, &singles);
}

/// A packed row's loss and adapter gradients are the mean of its sequences' as separate examples.
fn assert_packed_row_is_the_mean(
    model: &Model,
    row: &lift_serve::lift::absorb::plan::Example,
    singles: &[lift_serve::lift::absorb::plan::Example],
) {
    let k = singles.len() as f64;
    // Layer 0 adapted (everything on the graph) and layer 1 only (layer 0 on the inference path).
    for layers in [vec![0, 1], vec![1]] {
        let gm = GatedMemory::new(model.config(), &layers, false, 5, &Device::Cpu).unwrap();
        let packed_loss = example_loss(model, &gm, row).unwrap();
        let packed_grads = packed_loss.backward().unwrap();
        let losses: Vec<Tensor> = singles.iter().map(|e| example_loss(model, &gm, e).unwrap()).collect();
        let mean = (Tensor::stack(&losses, 0).unwrap().sum_all().unwrap() / k).unwrap();
        let mean_grads = mean.backward().unwrap();
        let (a, b) = (packed_loss.to_scalar::<f32>().unwrap(), mean.to_scalar::<f32>().unwrap());
        assert!((a - b).abs() <= 1e-5 * b.abs().max(1.0), "layers {layers:?}: packed loss {a} vs mean {b}");
        for v in gm.vars() {
            let gp = packed_grads.get(v.as_tensor()).unwrap();
            let gs = mean_grads.get(v.as_tensor()).unwrap();
            let scale = gs.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
            let diff = (gp - gs).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
            assert!(scale > 0.0, "layers {layers:?}: a parameter got no gradient");
            assert!(diff <= 1e-4 * scale, "layers {layers:?}: gradient differs by {diff} (scale {scale})");
        }
    }
}

#[test]
fn batched_rows_train_the_adapter_the_rows_one_by_one_train() {
    let (_d, model) = tiny();
    let doc = model.tokenizer.encode(DOC, false).unwrap();
    let pairs = ferry_pairs();
    let opts = PlanOptions { window: 48, training_context_tokens: 32, ..Default::default() };
    let plan = Plan::new(&model, &doc, &pairs, &opts).unwrap();
    assert!(plan.segments.len() >= 2 && plan.qa.len() == 4);
    // Three rows a step, segments and questions mixed, rows of several lengths.
    let train_once = |batch_rows: Option<f64>| {
        let gm = GatedMemory::new(model.config(), &[0, 1], false, 7, &Device::Cpu).unwrap();
        let train_opts = TrainOptions { epochs: [1, 2], accumulation: 3, batch_rows, seed: 5, ..Default::default() };
        let inputs = TrainInputs { doc: &doc, plan: &plan, adapter: &gm, vars: gm.vars() };
        let report = train(&model, inputs, &train_opts, RunControl { on_progress: &mut |_| {}, cancel: &|| false }).unwrap();
        let params: Vec<Tensor> = gm.vars().iter().map(|v| v.as_tensor().detach()).collect();
        (report, params)
    };
    // Every row of a step in one forward, whatever its padding.
    let (batched, p_batched) = train_once(Some(10.0));
    let (single, p_single) = train_once(None);
    assert_eq!((batched.steps, batched.tokens), (single.steps, single.tokens));
    assert!(batched.steps >= 4, "{} steps", batched.steps);
    for (i, (a, b)) in batched.step_losses.iter().zip(&single.step_losses).enumerate() {
        assert!((a - b).abs() <= 1e-4 * b.abs().max(1.0), "step {i}: loss {a} batched, {b} one by one");
    }
    let init = GatedMemory::new(model.config(), &[0, 1], false, 7, &Device::Cpu).unwrap();
    for ((a, b), v0) in p_batched.iter().zip(&p_single).zip(init.vars()) {
        let max = |t: Tensor| t.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        let moved = max((b - v0.as_tensor()).unwrap());
        let diff = max((a - b).unwrap());
        assert!(moved > 0.0, "training moved every parameter");
        assert!(diff <= 1e-3 * moved, "batched and one-by-one adapters differ by {diff} (training moved {moved})");
    }
}

/// Greedy continuation of `prompt` for `n` tokens.
fn continue_greedy(model: &Model, adapter: Option<&dyn Adapter>, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut cache = KvCache::new(model.config().num_layers);
    let dev = Device::Cpu;
    let mut logits = model
        .decoder
        .forward(
            &Tensor::new(prompt, &dev).unwrap().unsqueeze(0).unwrap(),
            &mut cache,
            adapter,
            &mut NoHooks,
            Logits::Last,
        )
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
    let opts = PlanOptions { window: 64, training_context_tokens: 0, ..Default::default() };
    let plan = Plan::new(model, &doc, &[], &opts).unwrap();
    let train_opts = TrainOptions { epochs: [epochs, 0], lr, seed: 3, ..Default::default() };
    let inputs = TrainInputs { doc: &doc, plan: &plan, adapter, vars };
    let report = train(model, inputs, &train_opts, RunControl { on_progress: &mut |_| {}, cancel: &|| false }).unwrap();
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

/// Absorb until learned (issue 21) on the tiny model: held-aside probe questions are measured as
/// training goes; once their loss stops improving the run stops — well before the fixed
/// schedule's end, never before the step floor — and the manifest records the probe curve. The
/// fixed schedule (no `until_learned`) runs every planned step.
#[test]
fn absorbing_until_learned_stops_once_the_probes_are_learned_and_never_before_the_floor() {
    use lift_serve::document::Document;
    use lift_serve::lift::absorb::trainer::UntilLearned;
    use lift_serve::lift::{absorb, AbsorbOptions};
    let (_d, model) = tiny();
    let text =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/harbor_history.txt")).unwrap();
    let text: String = text.chars().take(1200).collect();
    let document = Document::encode(&model, text).unwrap();
    let run_with = |epochs: [usize; 2], rule: Option<UntilLearned>| {
        let mut o = AbsorbOptions::default();
        o.plan.window = 64;
        o.plan.training_context_tokens = 32;
        o.qa.use_model = false;
        o.qa.max_pairs = 12;
        o.train.epochs = epochs;
        o.lr = Some(5e-3);
        o.train.until_learned = rule;
        let mut probe_events = 0;
        let a = absorb(
            &model,
            &document,
            None,
            &o,
            &mut |e| {
                if let lift_serve::lift::AbsorbEvent::Train(p) = e {
                    probe_events += p.probe_loss.is_some() as usize;
                }
            },
            &|| false,
        )
        .unwrap();
        (a, probe_events)
    };
    let run = |rule: Option<UntilLearned>| run_with([0, 12], rule);
    let (fixed, _) = run(None);
    let planned = fixed.report.planned_steps;
    assert_eq!(fixed.report.steps, planned, "the fixed schedule runs every step");
    assert!(fixed.report.probe_curve.is_empty() && !fixed.report.stopped_early);

    // No step budget here (`max_share` 1): the plateau alone decides; a probe round every 4 steps,
    // at the constant rate (the decay planned for the budget is checked below).
    let rule = UntilLearned {
        decay: false,
        probe_every: 4,
        probe_rounds: usize::MAX,
        min_steps: 24,
        patience: 2,
        min_delta: 0.01,
        max_share: 1.0,
        ..Default::default()
    };
    let (learned, probe_events) = run(Some(rule.clone()));
    let r = &learned.report;
    let curve: Vec<f64> = r.probe_curve.iter().map(|&(_, l)| l).collect();
    eprintln!(
        "until learned: {} of {} steps (fixed: {planned}); probe curve {:?}",
        r.steps, r.planned_steps, r.probe_curve
    );
    assert!(
        r.stopped_early && r.steps < planned,
        "stops before the ceiling: {} of {planned} steps, probes {curve:?}",
        r.steps
    );
    assert!(r.steps >= rule.min_steps, "never before the floor: {} steps", r.steps);
    // The plateau (at or after the floor) starts the cool-down; the run stops at its end.
    let from = r.cooldown_from.expect("the probes plateaued");
    assert!(from >= rule.min_steps && from % rule.probe_every == 0, "cool-down from step {from}");
    assert_eq!(r.steps, from + (from as f64 * rule.cooldown).round() as usize, "stops when the cool-down ends");
    assert_eq!(learned.manifest.training["cooldown_from"], from);
    assert_eq!(learned.manifest.training["cooldown_cause"], "plateau");
    // The ceiling is the fixed schedule over the pairs left to train on.
    let probes = learned.manifest.training["probe_pairs"].as_u64().unwrap() as usize;
    assert_eq!(r.planned_steps, planned - 12 * probes);
    assert!(curve.len() >= 3 && probe_events > 0, "{curve:?}");
    let best = curve.iter().copied().fold(f64::INFINITY, f64::min);
    assert!(best < curve[0], "the probes were learned before the stop: {curve:?}");
    let figures = &learned.manifest.training;
    assert!(probes >= 2, "{figures}");
    assert_eq!(figures["probe_curve"].as_array().unwrap().len(), curve.len());
    assert_eq!(figures["planned_steps"], r.planned_steps);

    // A floor above where the probes plateau holds the run until the floor (nothing skipped, so
    // that the epochs reach it).
    let floor = planned * 3 / 4;
    let (held, _) = run(Some(UntilLearned { min_steps: floor, patience: 1, learned_loss: 0.0, ..rule.clone() }));
    assert!(held.report.steps >= floor, "{} steps, floor {floor}", held.report.steps);

    // A first stage of segments alone, longer than the patience: the plateau is counted from the
    // QA stage's start, never through the first stage.
    let (staged, _) = run_with([8, 12], Some(UntilLearned { min_steps: 0, ..rule.clone() }));
    let (segments_only, _) = run_with([8, 0], None);
    let first_stage = segments_only.report.steps;
    assert!(first_stage >= (rule.patience + 1) * rule.probe_every, "{first_stage} steps of segments alone");
    let from = staged.report.cooldown_from.unwrap_or(usize::MAX);
    assert!(
        from >= first_stage + rule.patience * rule.probe_every,
        "cool-down from step {from}, first stage {first_stage} steps"
    );

    // Probes that never plateau (an unreachable patience) meet the step budget: the cool-down
    // starts when it would otherwise end past `max_share` of the fixed schedule, and the run ends
    // exactly there — the floor still holding when it lies above.
    let never = UntilLearned { patience: usize::MAX, min_steps: 0, max_share: 0.5, ..rule.clone() };
    let (budget, _) = run(Some(never.clone()));
    let (b, ceiling) = (&budget.report, (0.5 * budget.report.planned_steps as f64).round() as usize);
    assert_eq!(b.steps, ceiling, "stops at the budget: {} of {} planned", b.steps, b.planned_steps);
    assert_eq!(b.cooldown_cause, Some(lift_serve::lift::absorb::trainer::CooldownCause::Budget));
    let from = b.cooldown_from.unwrap();
    assert!(
        from < ceiling && from + (from as f64 * never.cooldown).round() as usize >= ceiling,
        "cool-down from step {from}"
    );
    assert!(
        from + ((from - 1) as f64 * never.cooldown).round() as usize - 1 < ceiling,
        "not a step later than needed: {from}"
    );
    let (floored, _) = run(Some(UntilLearned { min_steps: planned * 3 / 4, ..never.clone() }));
    assert!(floored.report.steps >= planned * 3 / 4, "the floor over the budget: {} steps", floored.report.steps);

    // The schedule planned for the budget (`decay`): the rate falls from the last stage's first
    // step to zero at the ceiling, where the run ends; a first stage of segments runs at the full
    // rate before it. Steps differ from the constant rate's as soon as the decay begins.
    let decaying = UntilLearned { decay: true, ..never.clone() };
    let (decayed, _) = run_with([8, 12], Some(decaying.clone()));
    let (constant, _) = run_with([8, 12], Some(never.clone()));
    let d = &decayed.report;
    assert_eq!(d.steps, (0.5 * d.planned_steps as f64).round() as usize, "ends at the ceiling");
    assert_eq!(d.cooldown_from, Some(first_stage + 1), "decays from the last stage's first step");
    assert_eq!(d.cooldown_cause, Some(lift_serve::lift::absorb::trainer::CooldownCause::Budget));
    assert_eq!(
        d.step_losses[..first_stage + 2],
        constant.report.step_losses[..first_stage + 2],
        "the same run up to the decay"
    );
    assert_ne!(d.step_losses[first_stage + 2..d.steps], constant.report.step_losses[first_stage + 2..d.steps]);
    // With the decay a plateau still ends the run early, over its own cool-down.
    let (plateaued, _) = run(Some(UntilLearned { decay: true, ..rule.clone() }));
    let p = &plateaued.report;
    let from = p.cooldown_from.unwrap();
    assert_eq!(p.cooldown_cause, Some(lift_serve::lift::absorb::trainer::CooldownCause::Plateau), "{:?}", p.probe_curve);
    assert!(p.steps < planned && from >= rule.min_steps, "{} of {planned} steps, cool-down from {from}", p.steps);
    assert_eq!(p.steps, from + (from as f64 * rule.cooldown).round() as usize, "stops when the cool-down ends");
}

/// Absorbing until learned spends steps where the document is not yet known (issue 21): an
/// example learned at its last visit is skipped and revisited every `revisit_every` epochs. With a
/// threshold every example passes at once and `revisit_every` 2, epochs alternate between all
/// examples and none, so the run trains exactly: the first epoch's segments, then segments and QA
/// pairs in every other epoch — counted against fixed runs of the same plan.
#[test]
fn absorbing_until_learned_skips_learned_examples_and_revisits_them() {
    use lift_serve::document::Document;
    use lift_serve::lift::absorb::trainer::UntilLearned;
    use lift_serve::lift::{absorb, AbsorbOptions};
    let (_d, model) = tiny();
    let text =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/harbor_history.txt")).unwrap();
    let text: String = text.chars().take(900).collect();
    let document = Document::encode(&model, text).unwrap();
    let rule = UntilLearned { min_steps: usize::MAX, learned_loss: 1e9, revisit_every: 2, ..Default::default() };
    let run = |epochs: [usize; 2], rule: Option<UntilLearned>| {
        let mut o = AbsorbOptions::default();
        o.plan.window = 64;
        o.plan.training_context_tokens = 32;
        o.qa.use_model = false;
        o.qa.max_pairs = 12;
        o.train.epochs = epochs;
        o.train.until_learned = rule;
        absorb(&model, &document, None, &o, &mut |_| {}, &|| false).unwrap()
    };
    // The same plan (and the same probes held aside) with nothing skipped: one epoch of segments,
    // then one of segments + QA pairs.
    let no_skip = UntilLearned { learned_loss: 0.0, ..rule.clone() };
    let segments = run([1, 0], Some(no_skip.clone())).report.examples;
    let both = run([0, 1], Some(no_skip.clone())).report.examples;
    let qa = both - segments;
    assert!(segments >= 2 && qa >= 2, "{segments} segments, {qa} QA pairs");
    let full = run([2, 4], Some(no_skip));
    assert_eq!(full.report.examples, 2 * segments + 4 * both, "learned_loss 0 trains every example");
    assert_eq!(full.report.skipped_examples, 0);

    let focused = run([2, 4], Some(rule));
    // Epochs 1..6: all segments; none; segments + QA; none; segments + QA; none.
    assert_eq!(focused.report.examples, segments + 2 * both, "{:?}", focused.report);
    assert_eq!(focused.report.skipped_examples, (2 * segments + 4 * both) - (segments + 2 * both));
    assert_eq!(focused.manifest.training["skipped_examples"], focused.report.skipped_examples);
    assert!(!focused.report.stopped_early, "the probe rule never fired (min_steps is out of reach)");
}

/// The absorb-rate calibration trains real optimizer steps of the options it is given, past its
/// warm-up, and times them (the server's estimates use the rate until an absorb finishes).
#[test]
fn the_absorb_rate_calibration_times_real_steps_past_its_warm_up() {
    let (_d, model) = tiny();
    let mut o = lift_serve::lift::AbsorbOptions::default();
    o.plan.window = 48;
    o.plan.training_context_tokens = 32;
    o.budget_seconds = Some(1.0);
    let c = lift_serve::lift::pricing::calibrate(&model, &o).unwrap();
    assert!(c.steps >= 4, "{c:?}");
    assert!(c.seconds > 0.0 && c.seconds_per_token.is_finite() && c.seconds_per_token > 0.0, "{c:?}");
    // Each timed step is a real row of tens of tokens at least: the rate is per token, not per step.
    assert!(c.seconds_per_token * 16.0 < c.seconds / c.steps as f64, "{c:?}");
}
