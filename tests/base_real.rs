//! `prepare-base` on the real default model: a few steps on examples of the data helper's shape
//! (essay passages with one planted fact), timed. Ignored by default (about a minute on 2 cores):
//! `cargo test --release --test base_real -- --ignored --nocapture`.

use candle_core::Device;
use lift_serve::base::data::BaseExample;
use lift_serve::base::train::{self, PrepareOptions};
use lift_serve::lift::absorb::trainer::RunControl;
use lift_serve::model::Model;

/// `count` passages of three essay sentences each, with `fact` inserted as passage `at`.
fn example(essay: &str, skip: usize, count: usize, at: usize, fact: &str, q: &str, a: &str) -> BaseExample {
    let sentences: Vec<&str> = essay.split(". ").filter(|s| s.len() > 20).skip(skip).collect();
    let mut passages: Vec<String> = sentences.chunks(3).take(count).map(|c| format!("{}.", c.join(". "))).collect();
    passages.insert(at, fact.to_string());
    BaseExample { passages, positive: vec![at], question: q.into(), answer: a.into(), kind: "single".into(), distractors: vec![] }
}

#[test]
#[ignore]
fn prepare_base_steps_on_the_default_model() {
    // As `lift-serve prepare-base` runs: without it glibc returns each step's activations to the
    // OS and the kernel spends ~22% of the step clearing fresh pages (perf).
    lift_serve::runtime::tune_allocator();
    let model = Model::load(&lift_serve::fetch::resolve_model(None).unwrap(), &Device::Cpu).unwrap();
    let dir = lift_serve::corpus::data_dir().join("pg-essays");
    let essay = std::fs::read_to_string(dir.join("apple.txt")).unwrap().replace('\n', " ");
    let examples = vec![
        example(
            &essay,
            0,
            12,
            3,
            "The archive's night keeper is Mirela Vasquez.",
            "Who keeps the archive at night?",
            "Mirela Vasquez",
        ),
        example(
            &essay,
            40,
            12,
            9,
            "The ferry to Tern Island costs eleven coins.",
            "How much is the ferry to Tern Island?",
            "eleven coins",
        ),
    ];
    let opts = PrepareOptions { epochs: 2, checkpoint_seconds: 1e9, ..Default::default() };
    let out = tempfile::tempdir().unwrap();
    let tokens: Vec<usize> = examples
        .iter()
        .enumerate()
        .map(|(i, e)| train::filter_example(&model, e, i).unwrap().0.example.tokens.len())
        .collect();
    let data = train::TrainingSet { examples: &examples, hash: "real-test" };
    let control = RunControl { on_progress: &mut |_| {}, cancel: &|| false };
    let (base, report) = train::prepare(&model, data, &opts, out.path(), false, control).unwrap();
    let per_step = report.seconds / report.steps as f64;
    let cdt = report.cdt.as_ref().unwrap();
    eprintln!(
        "tokens per example {tokens:?}; {} steps in {:.1} s ({per_step:.1} s/step); losses {:?}; filter losses {:?}; \
         cdt move {:.2e} (target {:.0e}), pass-2/pass-1 loss {:.5}; mask w {:?} b {:?}",
        report.steps,
        report.seconds,
        report.step_losses,
        report.filter_losses,
        cdt.mean_relative_shift,
        opts.cdt.relative_move,
        cdt.mean_loss_ratio,
        base.filter.w.to_vec1::<f32>().unwrap(),
        base.filter.b.to_vec1::<f32>().unwrap()
    );
    assert_eq!(report.steps, 4);
    assert!(report.step_losses.iter().all(|l| l.is_finite()));
    assert!((cdt.mean_relative_shift - opts.cdt.relative_move).abs() < 0.05 * opts.cdt.relative_move);
}
