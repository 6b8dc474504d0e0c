//! Long absorbs on the tiny random model: an absorb stopped at any step and continued from its
//! checkpoint ends with the adapter an uninterrupted run makes; a checkpoint of another run is
//! refused with the reason (the same through real server processes killed with SIGKILL:
//! `tests/server.rs` and `tests/replicas.rs`); a time budget stops training at it.

use candle_core::Device;
use lift_serve::document::Document;
use lift_serve::lift::absorb::checkpoint::{Checkpoint, DamagedCheckpoint, Resumable};
use lift_serve::lift::{absorb, absorb_resumable, AbsorbEvent, AbsorbOptions, AbsorbStage, Absorbed, Cancelled};
use lift_serve::model::Model;
use lift_serve::testing::{write_hf, TinySpec};
use std::cell::Cell;
use std::time::Duration;

fn tiny() -> (tempfile::TempDir, Model) {
    let dir = tempfile::tempdir().unwrap();
    let path = write_hf(&dir.path().join("tiny"), &TinySpec::default()).unwrap();
    let model = Model::load(&path, &Device::Cpu).unwrap();
    (dir, model)
}

type Mem = lift_serve::testing::MemoryCheckpoint;

fn document(model: &Model) -> Document {
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/harbor_history.txt")).unwrap();
    Document::encode(model, text.chars().take(700).collect::<String>()).unwrap()
}

fn options(epochs: [usize; 2]) -> AbsorbOptions {
    let mut o = AbsorbOptions::default();
    o.plan.window = 48;
    o.plan.training_context_tokens = 24;
    o.qa.use_model = false;
    o.qa.max_pairs = 6;
    o.train.epochs = epochs;
    o
}

/// The absorb with a checkpoint after every step, stopped (cancelled) once `stop_after` steps are
/// done (None: run to the end); the stages it went through.
fn run(
    model: &Model,
    doc: &Document,
    opts: &AbsorbOptions,
    store: &Mem,
    stop_after: Option<usize>,
) -> (anyhow::Result<Absorbed>, Vec<AbsorbStage>) {
    let steps = Cell::new(0);
    let mut stages = Vec::new();
    let on_event = &mut |e: AbsorbEvent| match e {
        AbsorbEvent::Train(p) => steps.set(p.step),
        AbsorbEvent::Stage(s) => stages.push(s),
        _ => {}
    };
    let cancel = || stop_after.is_some_and(|n| steps.get() >= n);
    let resumable = Resumable { store: Box::new(store.clone()), interval: Duration::ZERO };
    (absorb_resumable(model, doc, None, opts, on_event, &cancel, Some(resumable)), stages)
}

fn max_diff(a: &Absorbed, b: &Absorbed) -> f32 {
    lift_serve::testing::max_adapter_diff(&a.bundle, &b.bundle)
}

#[test]
fn a_stopped_absorb_resumes_from_its_checkpoint_to_the_adapter_of_an_uninterrupted_run() {
    let (_d, model) = tiny();
    let doc = document(&model);
    let opts = options([2, 2]);
    let mut epoch_ends = Vec::new();
    let on_event = &mut |e: AbsorbEvent| {
        if let AbsorbEvent::Train(p) = e {
            if p.epoch_end {
                epoch_ends.push(p.step);
            }
        }
    };
    let whole = absorb(&model, &doc, None, &opts, on_event, &|| false).unwrap();
    let steps = whole.report.steps;
    assert_eq!(epoch_ends.len(), 4);
    assert!(epoch_ends[0] >= 4 && steps >= 12, "a plan long enough to stop mid-epoch: {epoch_ends:?}");
    // Part-way through the first epoch, at its end, where the segment stage ends, and part-way
    // through the last epoch.
    for stop in [2, epoch_ends[0], epoch_ends[1], steps - 3] {
        let store = Mem::default();
        let (stopped, _) = run(&model, &doc, &opts, &store, Some(stop));
        let err = stopped.err().expect("the run was stopped");
        assert!(err.downcast_ref::<Cancelled>().is_some(), "{err:#}");
        let ckpt = Checkpoint::decode(store.0.borrow().as_ref().expect("a checkpoint was written"), &Device::Cpu).unwrap();
        assert_eq!(ckpt.train.cursor.step, stop, "a checkpoint after every step: the last one is where it stopped");
        assert_eq!(ckpt.qa.len(), whole.qa.len(), "the checkpoint keeps the QA pairs");

        let (resumed, stages) = run(&model, &doc, &opts, &store, None);
        let resumed = resumed.unwrap();
        assert!(!stages.contains(&AbsorbStage::GeneratingQa), "the QA pairs come from the checkpoint: {stages:?}");
        assert_eq!(resumed.report.steps, steps);
        assert_eq!(resumed.manifest.training["resumed_from_step"], stop);
        assert_eq!(resumed.report.step_losses.len(), steps);
        assert_eq!(resumed.report.epoch_losses.len(), whole.report.epoch_losses.len());
        for (i, (a, b)) in resumed.report.step_losses.iter().zip(&whole.report.step_losses).enumerate() {
            assert!((a - b).abs() < 1e-4, "stop {stop}: step {i}'s loss {a} vs {b} uninterrupted");
        }
        let d = max_diff(&resumed, &whole);
        assert!(d < 1e-5, "stop {stop}: the resumed adapter differs from the uninterrupted one by {d}");
    }
    // Without the checkpoint the stopped run's steps are lost: a fresh run (control) starts at 0.
    let (fresh, _) = run(&model, &doc, &opts, &Mem::default(), None);
    assert!(fresh.unwrap().manifest.training.get("resumed_from_step").is_none());
}

#[test]
fn a_checkpoint_of_other_options_or_another_document_is_refused_with_the_reason() {
    let (_d, model) = tiny();
    let doc = document(&model);
    let store = Mem::default();
    let (stopped, _) = run(&model, &doc, &options([2, 2]), &store, Some(3));
    assert!(stopped.is_err());
    // Other options: the run starts from step 0 and says why.
    let other = options([1, 2]);
    let (r, stages) = run(&model, &doc, &other, &store, None);
    let r = r.unwrap();
    assert!(stages.contains(&AbsorbStage::GeneratingQa));
    assert!(r.manifest.training.get("resumed_from_step").is_none());
    let why = r.manifest.training["resume_refused"].as_str().unwrap().to_string();
    assert!(why.contains("other absorb options"), "{why}");
    let plain = absorb(&model, &doc, None, &other, &mut |_| {}, &|| false).unwrap();
    assert!(max_diff(&r, &plain) < 1e-5, "the refused checkpoint left no trace in the adapter");

    // Another document under the same options.
    let store = Mem::default();
    let (_, _) = run(&model, &doc, &other, &store, Some(3));
    let shorter = Document::encode(&model, doc.text.chars().take(500).collect::<String>()).unwrap();
    let (r, _) = run(&model, &shorter, &other, &store, None);
    let why = r.unwrap().manifest.training["resume_refused"].as_str().unwrap().to_string();
    assert!(why.contains("another document"), "{why}");

    // Bytes that are not a checkpoint.
    *store.0.borrow_mut() = Some(b"not a checkpoint".to_vec());
    let (r, _) = run(&model, &doc, &other, &store, None);
    assert!(r.unwrap().manifest.training["resume_refused"].as_str().is_some());
}

/// A checkpoint cut short or with one byte changed fails its content hash: it is dropped with
/// the reason and the absorb starts over, ending with the adapter of a run that never stopped.
#[test]
fn a_damaged_checkpoint_is_dropped_and_its_absorb_starts_over() {
    let (_d, model) = tiny();
    let doc = document(&model);
    let opts = options([1, 2]);
    let plain = absorb(&model, &doc, None, &opts, &mut |_| {}, &|| false).unwrap();
    let store = Mem::default();
    let (stopped, _) = run(&model, &doc, &opts, &store, Some(3));
    assert!(stopped.is_err());
    let good = store.0.borrow().clone().expect("a checkpoint was written");
    assert_eq!(Checkpoint::decode(&good, &Device::Cpu).unwrap().train.cursor.step, 3, "an intact checkpoint reads");
    // The last byte is a tensor's: without the hash it would resume from a changed parameter.
    let mut changed = good.clone();
    *changed.last_mut().unwrap() ^= 0x01;
    for (what, bytes) in [("cut short", good[..good.len() - 100].to_vec()), ("one byte changed", changed)] {
        let err = Checkpoint::decode(&bytes, &Device::Cpu).err().unwrap_or_else(|| panic!("{what}: read as intact"));
        assert!(err.downcast_ref::<DamagedCheckpoint>().is_some(), "{what}: {err:#}");
        *store.0.borrow_mut() = Some(bytes);
        let (r, stages) = run(&model, &doc, &opts, &store, None);
        let r = r.unwrap();
        assert!(stages.contains(&AbsorbStage::GeneratingQa), "{what}: the absorb started over: {stages:?}");
        assert!(r.manifest.training.get("resumed_from_step").is_none(), "{what}");
        let why = r.manifest.training["resume_refused"].as_str().unwrap();
        assert!(why.contains("damaged"), "{what}: {why}");
        let d = max_diff(&r, &plain);
        assert!(d < 1e-5, "{what}: the adapter differs from an uninterrupted run's by {d}");
    }
}

/// An absorb until learned stopped anywhere (before the first probe, between probes, inside the
/// cool-down) resumes to the run that never stopped: the same probe curve, skips, cool-down and
/// adapter. The rule is scaled down to the tiny plan so that it probes often, skips learned
/// examples and cools down after a plateau well before the fixed schedule ends.
#[test]
fn an_interrupted_absorb_until_learned_resumes_to_the_adapter_of_an_uninterrupted_run() {
    let (_d, model) = tiny();
    let doc = document(&model);
    let mut opts = options([1, 4]);
    opts.qa.max_pairs = 12;
    opts.train.until_learned = Some(lift_serve::lift::absorb::trainer::UntilLearned {
        probe_every: 2,
        probe_rounds: 64,
        min_steps: 6,
        patience: 1,
        min_delta: 0.5,
        max_share: 0.9,
        learned_loss: 14.3,
        revisit_every: 2,
        ..Default::default()
    });
    let whole = absorb(&model, &doc, None, &opts, &mut |_| {}, &|| false).unwrap();
    let r = &whole.report;
    let cooldown_from = r.cooldown_from.expect("the probes plateau and the run cools down");
    assert!(r.stopped_early && r.steps < r.planned_steps, "the rule ends the run: {} of {}", r.steps, r.planned_steps);
    assert!(r.probe_curve.len() >= 3, "probes between the stops: {:?}", r.probe_curve);
    assert!(r.skipped_examples > 0, "learned examples are skipped (the visits matter on resume)");
    assert!(cooldown_from + 1 < r.steps, "a stop inside the cool-down: from {cooldown_from} to {}", r.steps);
    for stop in [1, r.probe_curve[1].0 + 1, cooldown_from + 1] {
        let store = Mem::default();
        let (stopped, _) = run(&model, &doc, &opts, &store, Some(stop));
        assert!(stopped.is_err(), "stop {stop}: the run was stopped");
        let ckpt = Checkpoint::decode(store.0.borrow().as_ref().expect("a checkpoint was written"), &Device::Cpu).unwrap();
        assert_eq!(ckpt.train.cursor.step, stop);
        assert!(ckpt.train.cursor.until_learned.is_some(), "stop {stop}: the rule's state is checkpointed");
        let (resumed, _) = run(&model, &doc, &opts, &store, None);
        let resumed = resumed.unwrap();
        assert_eq!(resumed.manifest.training["resumed_from_step"], stop);
        let (a, b) = (&resumed.report, &whole.report);
        assert_eq!((a.steps, a.cooldown_from, a.skipped_examples), (b.steps, b.cooldown_from, b.skipped_examples), "stop {stop}");
        assert_eq!(a.probe_curve.len(), b.probe_curve.len(), "stop {stop}: {:?} vs {:?}", a.probe_curve, b.probe_curve);
        for ((sa, la), (sb, lb)) in a.probe_curve.iter().zip(&b.probe_curve) {
            assert!(sa == sb && (la - lb).abs() < 1e-4, "stop {stop}: probe at {sa} {la} vs at {sb} {lb}");
        }
        let d = max_diff(&resumed, &whole);
        assert!(d < 1e-5, "stop {stop}: the resumed adapter differs from the uninterrupted one by {d}");
    }
}

#[test]
fn training_stops_at_the_time_budget_and_keeps_what_it_learned() {
    let (_d, model) = tiny();
    let doc = document(&model);
    let mut opts = options([40, 40]);
    let unbounded_steps = {
        let o = &opts;
        let pairs = lift_serve::lift::pricing::qa_pairs_planned(&doc.text, doc.len(), o);
        lift_serve::lift::pricing::plan_counts(doc.len(), pairs, o, false).2
    };
    opts.budget_seconds = Some(1.0);
    let t0 = std::time::Instant::now();
    let a = absorb(&model, &doc, None, &opts, &mut |_| {}, &|| false).unwrap();
    let took = t0.elapsed().as_secs_f64();
    assert!(a.report.out_of_time && a.report.stopped_early, "{:?}", a.report);
    assert_eq!(a.manifest.training["out_of_time"], true);
    assert!(a.report.steps >= 1 && a.report.steps < unbounded_steps, "{} of {unbounded_steps} steps", a.report.steps);
    assert_eq!(a.report.planned_steps, unbounded_steps);
    // One step past the deadline at most: the tiny model's steps are milliseconds.
    assert!(took < 1.0 + 1.0, "the absorb took {took} s for a budget of 1 s");
}
