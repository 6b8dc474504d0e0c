//! The prepared base on the tiny random model (2 layers; the filter reads layer 0 and masks
//! layer 1): `prepare` lowers the loss and resumes from its checkpoint to the same result; a
//! saved base loads to the same logits; a document's Gated Memory trains over the frozen base
//! (gradients reach only the document adapter) and its adapter refuses another base; `ask
//! --document` reads in context without an adapter.

use candle_core::{Device, Tensor};
use lift_serve::adapters::{manifest, GatedMemory};
use lift_serve::base::data::BaseExample;
use lift_serve::base::train::{self, PrepareOptions};
use lift_serve::base::{BaseShape, PreparedBase};
use lift_serve::document::Document;
use lift_serve::lift::answer::{answer, Ask, ContextPolicy, Mode};
use lift_serve::lift::answer::layout::{FilterOptions, FromLayer};
use lift_serve::lift::absorb::plan::{Example, ExampleKind};
use lift_serve::lift::absorb::trainer::{example_loss, RunControl};
use lift_serve::lift::{absorb, AbsorbOptions};
use lift_serve::model::generate::SamplingParams;
use lift_serve::model::{Adapter, KvCache, Logits, Model, NoHooks};
use lift_serve::testing::{write_hf, TinySpec};
use std::cell::Cell;
use std::path::{Path, PathBuf};

const DOC: &str = "Marigold ferries leave the north pier at dawn. The lighthouse keeper, Anselm Varga, \
logs every departure in a green ledger. Passengers pay eleven coins for the crossing to Tern Island. \
The ferry captain, Ilse Moreau, has sailed the route for twenty years. In winter the ferries stop.";

fn tiny() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = write_hf(&dir.path().join("tiny"), &TinySpec::default()).unwrap();
    (dir, path)
}

/// With f32 float matmuls: these tests compare paths (merged vs added deltas, saved vs loaded,
/// resumed vs straight through) to float precision; the default bf16 matmuls round their inputs.
fn load(path: &Path) -> Model {
    let mut m = Model::load(path, &Device::Cpu).unwrap();
    m.decoder.cpu_float_dtype = candle_core::DType::F32;
    m
}

/// Hand-built examples of the data helper's shape: a few passages, the supporting ones marked.
fn examples() -> Vec<BaseExample> {
    let ex = |passages: &[&str], positive: Vec<usize>, q: &str, a: &str| BaseExample {
        passages: passages.iter().map(|p| p.to_string()).collect(),
        positive,
        question: q.into(),
        answer: a.into(),
        kind: "single".into(),
        distractors: vec![],
    };
    vec![
        ex(
            &["The ferry leaves at dawn.", "The keeper is Anselm Varga.", "Tickets cost eleven coins."],
            vec![1],
            "Who is the keeper?",
            "Anselm Varga",
        ),
        ex(
            &["Rain fell all week.", "The captain is Ilse Moreau.", "The pier is north."],
            vec![1],
            "Who is the captain?",
            "Ilse Moreau",
        ),
        ex(
            &["The bakery opens at six.", "Bread costs two coins.", "The baker is Tomas Reyes."],
            vec![2],
            "Who is the baker?",
            "Tomas Reyes",
        ),
        ex(&["The island is Tern Island.", "Gulls nest there."], vec![0], "Which island?", "Tern Island"),
    ]
}

fn options(epochs: usize) -> PrepareOptions {
    PrepareOptions {
        shape: BaseShape { rank: 4, filter: FilterOptions { enabled: true, layer: Some(0), ..Default::default() } },
        epochs,
        lr: 3e-3,
        seed: 7,
        checkpoint_seconds: 1e9,
        ..Default::default()
    }
}

fn train(
    model: &Model,
    out: &Path,
    epochs: usize,
    resume: bool,
    stop_after: Option<usize>,
) -> (PreparedBase, train::PrepareReport) {
    let polls = Cell::new(0);
    let cancel = || {
        polls.set(polls.get() + 1);
        stop_after.is_some_and(|k| polls.get() > k)
    };
    let train_set = examples();
    let data = train::TrainingSet { examples: &train_set, hash: "test-data" };
    let control = RunControl { on_progress: &mut |_| {}, cancel: &cancel };
    train::prepare(model, data, &options(epochs), out, resume, control).unwrap()
}

fn logits(model: &Model, tokens: &[u32]) -> Vec<Vec<f32>> {
    logits_with(model, tokens, None)
}

fn logits_with(model: &Model, tokens: &[u32], adapter: Option<&dyn Adapter>) -> Vec<Vec<f32>> {
    let ids = Tensor::new(tokens, &Device::Cpu).unwrap().unsqueeze(0).unwrap();
    let mut cache = KvCache::new(model.config().num_layers);
    let l = model.decoder.forward(&ids, &mut cache, adapter, &mut NoHooks, Logits::All).unwrap();
    l.squeeze(0).unwrap().to_vec2::<f32>().unwrap()
}

/// The largest absolute difference between two tensors of one shape.
fn tensor_diff(a: &Tensor, b: &Tensor) -> f32 {
    (a - b).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap()
}

fn max_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    a.iter().flatten().zip(b.iter().flatten()).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// A document absorb small enough for the tiny model: 32-token windows, three extractive
/// questions, `epochs` as given.
fn small_absorb(epochs: [usize; 2]) -> AbsorbOptions {
    let mut o = AbsorbOptions::default();
    o.plan.window = 32;
    o.plan.training_context_tokens = 1000;
    o.qa.use_model = false;
    o.qa.max_pairs = 3;
    o.train.epochs = epochs;
    o
}

/// A trained, saved prepared base in `dir`.
fn saved_base(model: &Model, dir: &Path, epochs: usize) -> String {
    let (mut base, _) = train(model, dir, epochs, false, None);
    base.save(dir).unwrap().sha256.clone()
}

#[test]
fn a_short_run_lowers_the_loss_and_resume_continues_from_the_checkpoint() {
    let (_d, path) = tiny();
    let model = load(&path);
    let out = tempfile::tempdir().unwrap();
    let (full, report) = train(&model, out.path(), 6, false, None);
    assert_eq!(report.steps, 24);
    let e = &report.epoch_losses;
    assert_eq!(e.len(), 6);
    assert!(e[5] < 0.8 * e[0], "epoch losses {e:?}");
    let f = &report.filter_losses;
    assert!(f[20..].iter().sum::<f64>() < f[..4].iter().sum::<f64>(), "filter losses {f:?}");
    let cdt = report.cdt.as_ref().expect("CDT on by default");
    assert_eq!(cdt.examples, 24);
    let target = options(1).cdt.relative_move;
    assert!((cdt.mean_relative_shift - target).abs() < 0.05 * target, "{cdt:?}");
    // The mask left the zero start (b at least: w only moves while some w·s + b ≤ 0).
    let b = full.filter.b.to_vec1::<f32>().unwrap()[0];
    assert!(b != 0.0, "b {b}");

    // Interrupted after 10 steps (checkpoint written), then resumed: the same 24 steps.
    let out2 = tempfile::tempdir().unwrap();
    let (_, part) = train(&model, out2.path(), 6, false, Some(10));
    assert!(part.stopped && part.steps == 10);
    assert!(out2.path().join("checkpoint/state.json").is_file());
    let (resumed, r2) = train(&model, out2.path(), 6, true, None);
    assert_eq!((r2.steps, r2.steps_this_run), (24, 14));
    for (a, b) in report.step_losses.iter().zip(&r2.step_losses) {
        assert!((a - b).abs() < 1e-4 * a.abs().max(1.0), "step losses differ: {a} vs {b}");
    }
    let (x, y) = (full.named_tensors().unwrap(), resumed.named_tensors().unwrap());
    for (k, t) in &x {
        let d = tensor_diff(t, &y[k]);
        assert!(d < 1e-4, "{k} differs by {d}");
    }
    // A checkpoint made with other options is refused.
    let train_set = examples();
    let data = train::TrainingSet { examples: &train_set, hash: "test-data" };
    let control = RunControl { on_progress: &mut |_| {}, cancel: &|| false };
    let err = train::prepare(&model, data, &options(7), out2.path(), true, control)
        .err()
        .expect("other options refused");
    assert!(err.to_string().contains("other options"), "{err}");
}

#[test]
fn training_under_the_relative_mask_thresholds_against_the_best_chunk_not_b() {
    use lift_serve::model::filter::MaskCalibration;
    let (_d, path) = tiny();
    let model = load(&path);
    let train_set = examples();
    let run = |with_calibration: bool| {
        let out = tempfile::tempdir().unwrap();
        let data = train::TrainingSet { examples: &train_set, hash: "test-data" };
        let control = RunControl { on_progress: &mut |_| {}, cancel: &|| false };
        let opts = PrepareOptions {
            mask_calibration: MaskCalibration::Relative { margin: 0.0, strength: 1.0 },
            train_with_calibration: with_calibration,
            ..options(4)
        };
        train::prepare(&model, data, &opts, out.path(), false, control).unwrap().0
    };
    let (relative, absolute) = (run(true), run(false));
    // Under the relative mask b is not in the graph: it stays at its zero start, while the
    // absolute mask's training moves it.
    let b = |base: &PreparedBase| base.filter.b.to_vec1::<f32>().unwrap()[0];
    assert_eq!(b(&relative), 0.0);
    assert!(b(&absolute) != 0.0, "b {}", b(&absolute));
    assert_eq!(relative.filter.calibration, MaskCalibration::Relative { margin: 0.0, strength: 1.0 });
    // The mask the LoRA trained under differs, so the LoRA does.
    let (x, y) = (relative.named_tensors().unwrap(), absolute.named_tensors().unwrap());
    let most = x
        .iter()
        .filter(|(k, _)| !k.starts_with("filter."))
        .map(|(k, t)| tensor_diff(t, &y[k]))
        .fold(0.0, f32::max);
    assert!(most > 1e-5, "LoRA unchanged by the mask it trained under: {most}");
}

#[test]
fn a_saved_base_loads_to_the_same_logits_and_changes_the_fingerprint() {
    let (_d, path) = tiny();
    let plain = load(&path);
    let dir = tempfile::tempdir().unwrap();
    let (mut base, _) = train(&plain, dir.path(), 3, false, None);
    let hash = base.save(dir.path()).unwrap().sha256.clone();
    let tokens = plain.encode_document(DOC).unwrap();

    // Installing merges the LoRA into the float weights: the logits of adding its deltas.
    let unmerged = logits_with(&plain, &tokens, Some(&base.lora.detached()));
    let mut a = load(&path);
    base.install(&mut a).unwrap();
    assert!(a.decoder.base_merged);
    let merged = logits(&a, &tokens);
    assert!(max_diff(&merged, &unmerged) < 1e-4, "merged vs delta logits differ by {}", max_diff(&merged, &unmerged));
    let mut b = load(&path);
    PreparedBase::load(dir.path(), &b).unwrap().install(&mut b).unwrap();
    let (la, lb, lp) = (logits(&a, &tokens), logits(&b, &tokens), logits(&plain, &tokens));
    assert_eq!(max_diff(&la, &lb), 0.0, "saved and loaded bases give the same logits");
    assert!(max_diff(&la, &lp) > 1e-3, "the base changes the model: {}", max_diff(&la, &lp));
    assert_eq!(b.info.prepared_base.as_deref(), Some(hash.as_str()));
    assert_ne!(b.info.fingerprint, plain.info.fingerprint);
    assert_eq!(b.info.fingerprint, a.info.fingerprint);

    // A corrupted weights file, and a base for another model, are refused.
    let mut bytes = std::fs::read(dir.path().join("base.safetensors")).unwrap();
    let n = bytes.len();
    bytes[n - 1] ^= 1;
    std::fs::write(dir.path().join("base.safetensors"), &bytes).unwrap();
    let err = PreparedBase::load(dir.path(), &plain).err().expect("corrupt base refused");
    assert!(err.to_string().contains("hash"), "{err}");
    let other = write_hf(&dir.path().join("other"), &TinySpec { seed: 3, ..Default::default() }).unwrap();
    bytes[n - 1] ^= 1;
    std::fs::write(dir.path().join("base.safetensors"), &bytes).unwrap();
    let err = PreparedBase::load(dir.path(), &load(&other)).err().expect("another model refused");
    assert!(err.to_string().contains("trained on base model"), "{err}");
}

#[test]
fn document_gated_memory_trains_over_the_frozen_base_and_only_it_gets_gradients() {
    let (_d, path) = tiny();
    let plain = load(&path);
    let dir = tempfile::tempdir().unwrap();
    saved_base(&plain, dir.path(), 3);
    let mut model = load(&path);
    let base = PreparedBase::load(dir.path(), &model).unwrap().install(&mut model).unwrap();

    let tokens = model.encode_document(DOC).unwrap();
    let example = Example { kind: ExampleKind::Segment(0), target: vec![true; tokens.len()], tokens, packing: None };
    // Gated Memory on the upper layer only: layer 0 runs on the frozen path, which must apply the
    // base too (it does when the loss equals the one with every layer trainable).
    let cfg = model.config();
    let gm = GatedMemory::new(cfg, &[1], cfg.attention_bias, 1, &Device::Cpu).unwrap();
    let loss = example_loss(&model, &gm, &example).unwrap();
    let all_trainable = FromLayer { inner: &gm, first: 0 };
    let loss_all = example_loss(&model, &all_trainable, &example).unwrap().to_scalar::<f32>().unwrap();
    let l = loss.to_scalar::<f32>().unwrap();
    assert!((l - loss_all).abs() < 1e-4, "frozen path {l} vs trainable path {loss_all}");
    let plain_loss = example_loss(&plain, &gm, &example).unwrap().to_scalar::<f32>().unwrap();
    assert!((l - plain_loss).abs() > 1e-4, "the base is active while training: {l} vs {plain_loss}");

    let grads = loss.backward().unwrap();
    for v in gm.vars() {
        let g = grads.get(v.as_tensor()).expect("document adapter gets gradient");
        assert!(g.abs().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap() > 0.0);
    }
    // The tensors the decoder adds (the installed LoRA shares them) are no parameters: no
    // optimizer can reach them (candle still computes the gradient of every matmul operand).
    for (layer, proj, pair) in base.lora.pairs() {
        assert!(!pair.a.is_variable() && !pair.b.is_variable(), "base LoRA {layer}.{proj:?} is trainable");
    }
    assert!(base.filter.vars().is_empty() && !base.filter.w.is_variable());
}

#[test]
fn an_adapter_trained_over_one_base_refuses_another_and_answers_with_the_base_filter() {
    let (_d, path) = tiny();
    let plain = load(&path);
    let (d1, d2) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let h1 = saved_base(&plain, d1.path(), 2);
    let h2 = saved_base(&plain, d2.path(), 3);
    assert_ne!(h1, h2);
    let over = |dir: &Path| {
        let mut m = load(&path);
        let installed = PreparedBase::load(dir, &m).unwrap().install(&mut m).unwrap();
        (m, installed)
    };
    let (m1, base1) = over(d1.path());
    let o = small_absorb([1, 3]);
    let document = Document::encode(&m1, DOC).unwrap();
    let a = absorb(&m1, &document, None, &o, &mut |_| {}, &|| false).unwrap();
    let e = &a.report.epoch_losses;
    assert!(e.last().unwrap() < &e[0], "the document adapter trains over the base: {e:?}");
    // Nothing of the frozen base filter (which laid out and masked the QA examples:
    // tests/filter_tiny.rs) is saved with the document.
    assert!(a.bundle.extras.is_empty());
    assert_eq!(a.manifest.base_model.prepared_base.as_deref(), Some(h1.as_str()));

    let adir = tempfile::tempdir().unwrap();
    let adapter_dir = adir.path().join("doc");
    manifest::save(&adapter_dir, &a.bundle, &a.manifest, &[]).unwrap();
    manifest::load(&adapter_dir, &m1).unwrap();
    let err = manifest::load(&adapter_dir, &over(d2.path()).0).err().expect("another base refused");
    assert!(format!("{err:#}").contains(&format!("trained over prepared base '{h1}'")), "{err:#}");
    let err = manifest::load(&adapter_dir, &plain).err().expect("no base refused");
    assert!(format!("{err:#}").contains("loaded model has prepared base none"), "{err:#}");
    // Absorbing left the frozen base exactly as loaded.
    let fresh = PreparedBase::load(d1.path(), &plain).unwrap().named_tensors().unwrap();
    for (k, t) in base1.named_tensors().unwrap() {
        assert_eq!(
            t.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            fresh[&k].flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            "{k}"
        );
    }

    // Answering reads the document through the base filter, with and without the adapter.
    let params = SamplingParams { max_tokens: 3, ..Default::default() };
    for (mode, adapter) in [(Mode::Icl, None), (Mode::Lift, Some(&a.bundle.adapter as &dyn Adapter))] {
        let ask = Ask { history: &[], question: "Who keeps the lighthouse?", mode, context: Some(ContextPolicy::Full), context_tokens: None };
        let chunks = answer(&m1, &document, adapter, &ask, &params, &mut |_| true).unwrap().chunks;
        assert!(chunks.len() >= 2, "{mode:?}: {} chunks", chunks.len());
    }
    let ask = Ask { history: &[], question: "Who keeps the lighthouse?", mode: Mode::Icl, context: Some(ContextPolicy::Full), context_tokens: None };
    let chunks = answer(&plain, &document, None, &ask, &params, &mut |_| true).unwrap().chunks;
    assert!(chunks.is_empty(), "no filter without a prepared base");

    // Retrieval over a document longer than the window (byte-level tokens: 2,048 positions) with
    // a budget past it: the re-rank's candidates and the answer's passages stay within the window.
    let long = Document::encode(&m1, DOC.repeat(20)).unwrap();
    assert!(long.len() > 2 * 2048, "{}", long.len());
    let ask = Ask { history: &[], question: "Who keeps the lighthouse?", mode: Mode::Rag, context: Some(ContextPolicy::Retrieved), context_tokens: Some(1 << 20) };
    let a = answer(&m1, &long, None, &ask, &params, &mut |_| true).unwrap();
    assert!(a.prompt.tokens.len() + params.max_tokens <= 2048, "{}", a.prompt.tokens.len());
    assert!(a.prompt.context_tokens > 1000 && !a.chunks.is_empty(), "{} document tokens", a.prompt.context_tokens);
}

/// A base may answer under one mask calibration and have documents' absorbs train under another
/// (`absorb_mask`): the absorb's QA rows are masked as under that calibration alone, and the
/// answers keep theirs.
#[test]
fn an_absorb_trains_under_the_bases_absorb_mask_and_answers_keep_theirs() {
    use lift_serve::lift::answer::layout::MaskCalibration;
    let (_d, path) = tiny();
    let plain = load(&path);
    let dir = tempfile::tempdir().unwrap();
    saved_base(&plain, dir.path(), 2);
    let relative = MaskCalibration::parse("relative:2").unwrap();
    // The two calibrations stored with the base, read back from its files.
    let mut base = PreparedBase::load(dir.path(), &plain).unwrap();
    base.filter.calibration = relative;
    base.filter.absorb_mask = Some(MaskCalibration::Absolute);
    base.save(dir.path()).unwrap();
    let mut model = load(&path);
    PreparedBase::load(dir.path(), &model).unwrap().install(&mut model).unwrap();
    let filter = model.base_filter().unwrap();
    assert_eq!((filter.calibration, filter.absorb_mask), (relative, Some(MaskCalibration::Absolute)));
    assert_eq!(filter.for_absorb().calibration, MaskCalibration::Absolute);

    let o = small_absorb([0, 2]);
    let document = Document::encode(&model, DOC).unwrap();
    let mut losses = |calibration: MaskCalibration, absorb_mask: Option<MaskCalibration>| {
        let f = model.base_filter.as_mut().unwrap();
        (f.calibration, f.absorb_mask) = (calibration, absorb_mask);
        absorb(&model, &document, None, &o, &mut |_| {}, &|| false).unwrap().report.step_losses
    };
    let split = losses(relative, Some(MaskCalibration::Absolute));
    let absolute = losses(MaskCalibration::Absolute, None);
    let relative_only = losses(relative, None);
    assert_eq!(split, absolute, "the absorb trains under the absorb mask");
    assert_ne!(split, relative_only, "the answers' calibration would mask the rows otherwise");
}

#[test]
fn ask_with_a_document_reads_it_in_context_and_refuses_adapter_modes() {
    let (d, path) = tiny();
    let doc = d.path().join("doc.txt");
    std::fs::write(&doc, DOC).unwrap();
    let run = |mode: &str| {
        std::process::Command::new(env!("CARGO_BIN_EXE_lift-serve"))
            .args(["ask", "--prepared-base", "none", "--max-tokens", "4", "--question", "Who keeps the lighthouse?"])
            .arg("--model")
            .arg(&path)
            .arg("--document")
            .arg(&doc)
            .args(if mode.is_empty() { vec![] } else { vec!["--mode", mode] })
            .output()
            .unwrap()
    };
    for mode in ["", "icl"] {
        let out = run(mode);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "mode '{mode}': {err}");
        assert!(err.contains("Icl") && err.contains("document_tokens_in_context"), "{err}");
    }
    for mode in ["lift", "memory"] {
        let out = run(mode);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "mode {mode} must be refused");
        assert!(err.contains("needs an adapter"), "{err}");
    }
}

/// `ask --collection DIR`: one ranking over an absorbed adapter directory and two plain files;
/// each question is routed to the document holding its answer, answered with that adapter in
/// `lift` when it has one (`rag` otherwise, and always with `--mode rag`); other modes are refused.
#[test]
fn ask_a_collection_routes_to_the_document_holding_the_answer() {
    let (d, path) = tiny();
    let col = d.path().join("library");
    std::fs::create_dir_all(&col).unwrap();
    let harbor = d.path().join("harbor.txt");
    std::fs::write(&harbor, DOC).unwrap();
    std::fs::write(
        col.join("orchard.txt"),
        "The orchard of Brindle grows pears and quinces on the south slope. The orchard keeper, Mira Falk, \
         planted the first quince tree in 1877. Cider from the orchard is sold at the autumn market.",
    )
    .unwrap();
    std::fs::write(
        col.join("mill.txt"),
        "The watermill on the Senn grinds rye for three villages. Its wheel was rebuilt in oak by the \
         carpenter Oskar Lind after the flood. The miller rings a brass bell when the flour is ready.",
    )
    .unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_lift-serve"))
        .args(["absorb", "--prepared-base", "none", "--window", "32", "--training-context-tokens", "16", "--epochs", "1,1"])
        .args(["--aux-qa", "2", "--model"])
        .arg(&path)
        .arg(&harbor)
        .arg("-o")
        .arg(col.join("harbor"))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let ask = |question: &str, mode: Option<&str>| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_lift-serve"))
            .args(["ask", "--prepared-base", "none", "--max-tokens", "4", "--question", question])
            .arg("--model")
            .arg(&path)
            .arg("--collection")
            .arg(&col)
            .args(mode.map(|m| vec!["--mode", m]).unwrap_or_default())
            .output()
            .unwrap();
        (out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    let ferry = "Who is the captain of the Marigold ferries?";
    for (question, mode, says) in [
        (ferry, None, "[lift answered: harbor]"),
        ("Who planted the first quince tree in the orchard?", None, "[rag answered: orchard.txt]"),
        ("Who rebuilt the wheel of the watermill?", Some("lift"), "[rag answered: mill.txt]"),
        (ferry, Some("rag"), "[rag answered: harbor]"),
    ] {
        let (ok, err) = ask(question, mode);
        assert!(ok && err.contains(says), "{question} ({mode:?}): {err}");
        assert!(err.contains("routed_to") && err.contains("passage read"), "{err}");
    }
    let (ok, err) = ask(ferry, Some("icl"));
    assert!(!ok && err.contains("lift or rag"), "{err}");

    // `ask --adapter` self-gates as the server does: the answer is the adapter's own (as with
    // `--no-self-gating`) or the passages' (as `--mode rag` answers), and it says which.
    let single = |extra: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_lift-serve"))
            .args(["ask", "--prepared-base", "none", "--max-tokens", "4", "--question", ferry, "--model"])
            .arg(&path)
            .arg("--adapter")
            .arg(col.join("harbor"))
            .args(extra)
            .output()
            .unwrap();
        // The log's fields, without its colours.
        let err: String = String::from_utf8_lossy(&out.stderr).split('\x1b').map(|p| p.split_once('m').filter(|_| p.starts_with('[')).map_or(p, |(_, rest)| rest)).collect();
        assert!(out.status.success(), "{extra:?}: {err}");
        (String::from_utf8_lossy(&out.stdout).trim().to_string(), err)
    };
    let (gated, err) = single(&[]);
    let (adapter_only, adapter_err) = single(&["--no-self-gating"]);
    let (passages, _) = single(&["--mode", "rag"]);
    assert!(adapter_err.contains("answered_by=None"), "{adapter_err}");
    if err.contains("answered_by=Some(Passages)") {
        assert_eq!(gated, passages, "{err}");
    } else {
        assert!(err.contains("answered_by=Some(Adapter)"), "{err}");
        assert_eq!(gated, adapter_only, "{err}");
    }
}

/// `lift-serve absorb` reads the formats the server takes: a PDF made here is absorbed from its
/// text layer, titled by its metadata, and its manifest says how the text was made; a locked PDF
/// is refused with the reason.
#[test]
fn absorb_reads_a_pdf_and_refuses_a_locked_one() {
    use lift_serve::testing::{write_pdf, PdfPages};
    let (d, path) = tiny();
    let pdf = d.path().join("harbor.pdf");
    std::fs::write(&pdf, write_pdf(PdfPages::Text(&[DOC, "The bell rings at noon."]), "Harbor notes", None).unwrap()).unwrap();
    let locked = d.path().join("locked.pdf");
    std::fs::write(&locked, write_pdf(PdfPages::Text(&[DOC]), "Locked", Some("pw")).unwrap()).unwrap();
    let absorb = |file: &Path, out: &Path| {
        std::process::Command::new(env!("CARGO_BIN_EXE_lift-serve"))
            .args(["absorb", "--prepared-base", "none", "--window", "32", "--training-context-tokens", "16", "--epochs", "1,1"])
            .args(["--aux-qa", "2", "--model"])
            .arg(&path)
            .arg(file)
            .arg("-o")
            .arg(out)
            .output()
            .unwrap()
    };
    let out_dir = d.path().join("adapter");
    let out = absorb(&pdf, &out_dir);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out_dir.join("manifest.json")).unwrap()).unwrap();
    let doc = &manifest["document"];
    assert_eq!(doc["title"], "Harbor notes", "{doc}");
    assert_eq!((doc["source"]["format"].as_str(), doc["source"]["pages"].as_u64()), (Some("pdf"), Some(2)), "{doc}");
    assert_eq!(doc["source"]["filename"], "harbor.pdf");
    let text = lift_serve::formats::read_file(&pdf).unwrap().text;
    assert!(text.contains("lighthouse") && text.contains("noon"), "{text}");
    let out = absorb(&locked, &d.path().join("locked"));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("encrypted with a password"), "{err}");
    assert!(!d.path().join("locked").exists(), "nothing written for a refused file");
}

/// A prepared base found by default (`base/` in the working directory) that was trained on
/// another model is skipped with a warning, so a model the user brings runs without one; named
/// explicitly (`--prepared-base`, `LIFT_PREPARED_BASE`) it stays an error. The CLI (every
/// command loads through the same arguments) in a directory whose `base/` belongs to another
/// tiny model, then the server over the repository's own `base/` (the default model's).
#[test]
fn a_default_prepared_base_of_another_model_is_skipped_an_explicit_one_refused() {
    let d = tempfile::tempdir().unwrap();
    let ours = write_hf(&d.path().join("ours"), &TinySpec::default()).unwrap();
    let theirs = write_hf(&d.path().join("theirs"), &TinySpec { seed: 7, ..TinySpec::default() }).unwrap();
    let work = d.path().join("work");
    std::fs::create_dir_all(&work).unwrap();
    let shape = BaseShape { rank: 2, filter: FilterOptions { enabled: true, layer: Some(0), ..Default::default() } };
    PreparedBase::new(&load(&theirs), &shape, 5).unwrap().save(&work.join("base")).unwrap();

    let generate = |model: &Path, extra: &[&str], env: Option<&str>| {
        let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_lift-serve"));
        c.current_dir(&work).env_remove("LIFT_PREPARED_BASE").args(["generate", "--max-tokens", "2"]).arg("--model").arg(model);
        c.args(extra).arg("Who keeps the lighthouse?");
        if let Some(v) = env {
            c.env("LIFT_PREPARED_BASE", v);
        }
        let out = c.output().unwrap();
        (out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    // Found by default, another model's: a warning, and the plain model answers.
    let (ok, err) = generate(&ours, &[], None);
    assert!(ok, "{err}");
    assert!(err.contains("trained on another model") && !err.contains("prepared base installed"), "{err}");
    // Named, on the command line or in the environment: refused with both fingerprints.
    for (extra, env) in [(&["--prepared-base", "base"][..], None), (&[][..], Some("base"))] {
        let (ok, err) = generate(&ours, extra, env);
        assert!(!ok, "an explicit base of another model must be refused");
        assert!(err.contains("prepared base was trained on base model"), "{err}");
    }
    // Its own model, found by default: installed.
    let (ok, err) = generate(&theirs, &[], None);
    assert!(ok && err.contains("prepared base installed"), "{err}");
    // `none`: no base, no warning.
    let (ok, err) = generate(&ours, &["--prepared-base", "none"], None);
    assert!(ok && !err.contains("trained on another model"), "{err}");

    // The library call, both ways, and the server: with no prepared base configured it finds the
    // repository's `base/` (the default model's) and starts over the tiny model without it.
    let mut m = load(&ours);
    assert!(!lift_serve::base::install_dir(&mut m, &work.join("base"), false).unwrap());
    assert!(m.info.prepared_base.is_none() && m.base_filter().is_none());
    assert!(lift_serve::base::install_dir(&mut m, &work.join("base"), true).is_err());
    let shipped = Path::new(env!("CARGO_MANIFEST_DIR")).join("base");
    if shipped.join("manifest.json").is_file() {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        rt.block_on(async {
            let mut cfg = lift_serve::server::ServeConfig::new(ours.clone(), d.path().join("adapters"));
            cfg.prepared_base = None;
            let state = lift_serve::server::build_state(cfg, &Device::Cpu).expect("starts without the other model's base");
            assert!(state.service.model().info.prepared_base.is_none());
        });
        let mut cfg = lift_serve::server::ServeConfig::new(ours.clone(), d.path().join("adapters2"));
        cfg.prepared_base = Some(shipped.to_string_lossy().into_owned());
        let err = rt.block_on(async { lift_serve::server::build_state(cfg, &Device::Cpu).err() }).expect("explicit: refused");
        assert!(format!("{err:#}").contains("prepared base was trained on base model"), "{err:#}");
    }
}
