//! The evaluation harness: planted facts are where they should be, exactly once; in/out-of-window
//! labels agree with the prompt `build_prompt` builds; the whole run (in-process and through a
//! real server socket) produces consistent records and a report, on the tiny model. Planting and
//! labelling are checked with the real default model's tokenizer on the real essays (fetched by
//! `lift-serve fetch-data`, which these tests run themselves when the essays are missing).

use candle_core::Device;
use lift_serve::corpus as data;
use lift_serve::eval::{self, needles, report, Backend, EvalDocument, Local, RunConfig};
use lift_serve::document::Document;
use lift_serve::lift::answer::{build_prompt, Ask, ContextPolicy, Mode};
use lift_serve::base::{BaseShape, PreparedBase};
use lift_serve::lift::answer::layout::FilterOptions;
use lift_serve::lift::AbsorbOptions;
use lift_serve::model::Model;
use lift_serve::testing::{write_hf, TinySpec};
use std::sync::OnceLock;

fn real_model() -> &'static Model {
    static MODEL: OnceLock<Model> = OnceLock::new();
    MODEL.get_or_init(|| {
        let path = lift_serve::fetch::resolve_model(None).expect("default model (run `lift-serve fetch-model`)");
        Model::load(&path, &Device::Cpu).expect("default model loads")
    })
}

fn essays() -> &'static [data::Essay] {
    static ESSAYS: OnceLock<Vec<data::Essay>> = OnceLock::new();
    ESSAYS.get_or_init(|| {
        let dir = data::fetch_essays(&data::data_dir()).expect("essays (run `lift-serve fetch-data`)");
        data::load_essays(&dir).unwrap()
    })
}

fn spec(lengths: Vec<usize>, depths: Vec<f64>, per_depth: usize, seed: u64) -> needles::NeedleSpec {
    needles::NeedleSpec { lengths, depths, needles_per_depth: per_depth, docs_per_length: 1, seed }
}

/// Retrieval (`rag`, 256 tokens of a 4K-token document) shows the sentence that holds each
/// planted fact, wherever it is, where the head and tail of the same budget miss most of them;
/// with the shipped prepared base too, whose filter's chunks the passages are, by BM25 (the
/// default) and re-ranked by its filter.
#[test]
fn retrieval_shows_the_planted_fact_in_a_small_context() {
    let plain = real_model();
    let path = lift_serve::fetch::resolve_model(None).unwrap();
    let mut based = Model::load(&path, &Device::Cpu).unwrap();
    lift_serve::base::install_from_arg(&mut based, Some(concat!(env!("CARGO_MANIFEST_DIR"), "/base"))).unwrap();
    let spec = needles::NeedleSpec { docs_per_length: 2, ..spec(vec![4096], vec![0.1, 0.3, 0.5, 0.7, 0.9], 2, 11) };
    let docs = needles::build_set(plain, essays(), &spec).unwrap();
    // Questions that share words with their fact's sentence; those worded apart (paraphrases,
    // two hops) are what word matching cannot find, measured by the eval, not asserted here.
    let worded_apart = |q: &eval::EvalQuestion| matches!(q.kind, Some(needles::FactKind::Paraphrase | needles::FactKind::TwoHop));
    // The default context (BM25's passages), and the filter's re-rank of them (`retrieved`).
    let runs = [("plain", plain, None), ("prepared base", &based, None), ("prepared base, re-ranked", &based, Some(ContextPolicy::Retrieved))];
    for (name, model, policy) in runs {
        let (mut found, mut head_tail, mut total) = (0, 0, 0);
        // Two-hop facts: the question names the first hop's words only; the feedback step follows
        // the person's name from it to the second.
        let (mut both, mut two_hop) = (0, 0);
        for doc in &docs {
            let ids = Document::encode(model, doc.text.clone()).unwrap();
            for q in &doc.questions {
                let ask = |context| Ask { history: &[], question: &q.question, mode: Mode::Rag, context, context_tokens: Some(256) };
                let p = build_prompt(model, &ids, &ask(policy), 32).unwrap();
                let shown = model.tokenizer.decode(&p.tokens).unwrap();
                if q.kind == Some(needles::FactKind::TwoHop) {
                    both += q.evidence.iter().all(|&(s, e)| shown.contains(&doc.text[s..e])) as usize;
                    two_hop += 1;
                }
                if worded_apart(q) {
                    continue;
                }
                let planted = q.planted.as_deref().unwrap();
                assert!(p.context_tokens <= 256, "{name}: {} document tokens in context", p.context_tokens);
                found += shown.contains(planted) as usize;
                let ht = build_prompt(model, &ids, &ask(Some(ContextPolicy::HeadTail)), 32).unwrap();
                head_tail += model.tokenizer.decode(&ht.tokens).unwrap().contains(planted) as usize;
                total += 1;
            }
        }
        eprintln!("{name}: retrieved {found}/{total}, head and tail {head_tail}/{total}; two-hop, both hops {both}/{two_hop}");
        assert!(both * 4 >= two_hop * 3, "{name}: both hops of {both} of {two_hop} two-hop facts shown");
        assert!(found * 10 >= total * 9, "{name}: retrieval showed {found} of {total} planted facts");
        assert!(head_tail * 2 < total, "{name}: the head and tail showed {head_tail} of {total}: the test needs facts out of it");
    }
}

/// `NAME:each` (`answer_each_passage`): each passage the budget would show is read on its own
/// and one answer is kept, whose prompt shows exactly one of those passages.
#[test]
fn reading_each_passage_keeps_an_answer_over_one_of_the_passages_the_budget_shows() {
    let model = real_model();
    let spec = needles::NeedleSpec { docs_per_length: 1, ..spec(vec![1024], vec![0.3, 0.7], 1, 5) };
    let docs = needles::build_set(model, essays(), &spec).unwrap();
    let params = lift_serve::model::generate::SamplingParams { max_tokens: 8, temperature: 0.0, ..Default::default() };
    let mut read = 0;
    for doc in &docs {
        let ids = Document::encode(model, doc.text.clone()).unwrap();
        for q in &doc.questions {
            let ask = Ask { history: &[], question: &q.question, mode: Mode::Rag, context: None, context_tokens: Some(128) };
            let together = build_prompt(model, &ids, &ask, 8).unwrap();
            let a = lift_serve::lift::answer::answer_each_passage(model, &ids, None, &ask, &params).unwrap();
            assert_eq!(a.prompt.shown.len(), 1, "one passage: {:?}", a.prompt.shown);
            let (s, e) = a.prompt.shown[0];
            assert!(e - s <= 32 && a.prompt.context_tokens == e - s, "{:?}", a.prompt.shown);
            assert!(together.shows((s, e)), "{:?} is not among {:?}", (s, e), together.shown);
            assert!(!a.generation.logprobs.is_empty(), "{}", q.question);
            read += 1;
        }
    }
    assert!(read >= 2);
}

/// The shipped prepared base's FltLM mask, calibrated against the best chunk (`relative:2`), on
/// the passages answers read (BM25's, the default 128 tokens), on validation-split documents: the
/// chunk that holds a planted fact is left open and the chunks around it (distractors) are
/// masked, where FltLM's absolute threshold, learned in another layout, closes the evidence too
/// (the threshold documents' absorbs still train under: docs/prepared-base.md). Facts whose
/// question shares words with them (the ones BM25 shows); 2 × 15 questions.
#[test]
fn the_relative_mask_leaves_the_evidence_open_and_masks_the_distractors() {
    use lift_serve::lift::answer::answer;
    use lift_serve::lift::answer::layout::MaskCalibration;
    use lift_serve::model::generate::SamplingParams;
    let path = lift_serve::fetch::resolve_model(None).unwrap();
    let mut model = Model::load(&path, &Device::Cpu).unwrap();
    lift_serve::base::install_from_arg(&mut model, Some(concat!(env!("CARGO_MANIFEST_DIR"), "/base"))).unwrap();
    let relative = MaskCalibration::parse("relative:2").unwrap();
    let shipped = model.base_filter().unwrap();
    assert_eq!(shipped.calibration, relative, "the shipped base answers under the relative mask");
    assert_eq!(shipped.for_absorb().calibration, MaskCalibration::Absolute, "and absorbs train under FltLM's");
    let essays = data::essays_in(essays(), data::Split::Validation);
    let spec = needles::NeedleSpec { docs_per_length: 2, ..spec(vec![1024], vec![0.1, 0.3, 0.5, 0.7, 0.9], 3, 5) };
    let docs = needles::build_set(&model, &essays, &spec).unwrap();
    let params = SamplingParams { max_tokens: 1, temperature: 0.0, ..Default::default() };
    // (evidence shown, open, distractors, masked) under a calibration.
    let mut measure = |calibration: MaskCalibration| {
        model.base_filter.as_mut().unwrap().calibration = calibration;
        let mut counts = [0usize; 4];
        for doc in &docs {
            let ids = Document::encode(&model, doc.text.clone()).unwrap();
            for q in doc.questions.iter().filter(|q| !matches!(q.kind, Some(needles::FactKind::Paraphrase | needles::FactKind::TwoHop))) {
                let a = answer(&model, &ids, None, &Ask::new(&q.question, Mode::Rag), &params, &mut |_| true).unwrap();
                let r = eval::mask::measure(q, &a.chunks).expect("the answer's context is scored in chunks");
                counts[0] += usize::from(r.evidence_shown);
                counts[1] += usize::from(r.evidence_open() == Some(true));
                counts[2] += r.distractors;
                counts[3] += r.distractors_masked;
            }
        }
        counts
    };
    let [shown, open, distractors, masked] = measure(relative);
    let [_, open_absolute, _, _] = measure(MaskCalibration::Absolute);
    eprintln!("evidence shown {shown}, open {open} (absolute threshold: {open_absolute}); distractors masked {masked}/{distractors}");
    assert!(shown >= 10, "BM25 shows the evidence of most facts worded like their question: {shown}");
    assert!(open * 5 >= shown * 4, "the evidence is open in at least 80% of the answers that show it: {open}/{shown}");
    assert!(masked * 2 >= distractors, "at least half the distractors are masked: {masked}/{distractors}");
    assert!(open > open_absolute, "the absolute threshold closed more evidence: {open_absolute} open against {open}");
}

#[test]
fn planted_facts_occur_exactly_once_at_the_requested_depth() {
    let model = real_model();
    let depths = vec![0.0, 0.25, 0.5, 0.75, 1.0];
    let docs = needles::build_set(model, essays(), &spec(vec![1024, 4096], depths.clone(), 2, 7)).unwrap();
    assert_eq!(docs.len(), 2);
    for doc in &docs {
        let target = doc.target_tokens.unwrap();
        let ids = model.tokenizer.encode(&doc.text, false).unwrap();
        assert_eq!(ids.len(), doc.tokens);
        assert!(
            doc.tokens.abs_diff(target) <= target / 20,
            "{}: {} tokens for a target of {target}",
            doc.id,
            doc.tokens
        );
        assert_eq!(doc.questions.len(), 10);
        let mut kinds = std::collections::HashSet::new();
        for q in &doc.questions {
            let planted = q.planted.as_deref().unwrap();
            kinds.insert(q.kind.unwrap());
            assert_eq!(doc.text.matches(planted).count(), 1, "{planted}");
            // The answer value appears once (the distractor has a different value).
            let value = q.answers[0].to_lowercase();
            assert_eq!(doc.text.to_lowercase().matches(&value).count(), 1, "{value} in {}", doc.id);
            if let Some(d) = &q.distractor {
                assert_eq!(doc.text.matches(d.as_str()).count(), 1);
                assert!(!d.to_lowercase().contains(&value));
                let (a, _) = q.distractor_tokens.unwrap();
                let (b, _) = q.evidence_tokens[0];
                assert!(a.abs_diff(b) as f64 >= 0.2 * doc.tokens as f64, "distractor too close to the answer");
            }
            // A two-hop fact: its first hop planted apart, naming the person the answer's
            // sentence names, and needed with it.
            assert_eq!(q.needs_all_evidence, q.evidence.len() == 2);
            if q.needs_all_evidence {
                let bridge = &doc.text[q.evidence[1].0..q.evidence[1].1];
                let person = bridge.trim_end_matches('.').split(' ').rev().take(2).collect::<Vec<_>>();
                assert!(person.iter().all(|w| planted.contains(w)), "{bridge:?} / {planted:?}");
                assert!(!bridge.to_lowercase().contains(&value), "the first hop holds no answer");
                let (a, _) = q.evidence_tokens[1];
                let (b, _) = q.evidence_tokens[0];
                assert!(a.abs_diff(b) as f64 >= 0.2 * doc.tokens as f64, "the two hops are too close");
            }
            // The byte span is the sentence; its token span decodes to it.
            let (s, e) = q.evidence[0];
            assert_eq!(&doc.text[s..e], planted);
            let (a, b) = q.evidence_tokens[0];
            let decoded = model.tokenizer.decode(&ids[a..b]).unwrap();
            assert_eq!(decoded.trim(), planted);
            // Depth: where the sentence starts, relative to the document's tokens.
            let depth = q.depth.unwrap();
            let actual = a as f64 / doc.tokens as f64;
            assert_eq!(q.actual_depth, Some(actual));
            assert!((actual - depth).abs() <= 0.06, "{}: asked depth {depth}, got {actual:.3}", doc.id);
            assert!(depths.contains(&depth));
            // Worded differently from the planted sentence.
            assert!(!planted.contains(&q.question) && q.question.ends_with('?'));
        }
        assert!(kinds.len() >= 4, "fact kinds are mixed: {kinds:?}");
        for kind in [needles::FactKind::Paraphrase, needles::FactKind::TwoHop] {
            assert_eq!(doc.questions.iter().filter(|q| q.kind == Some(kind)).count(), 2, "{kind:?} in {}", doc.id);
        }
        // Depth 0 starts the document, depth 1 ends it.
        assert!(doc.questions.iter().any(|q| q.evidence_tokens[0].0 == 0));
        assert!(doc.questions.iter().any(|q| q.evidence_tokens[0].1 == doc.tokens));
    }
    // Deterministic with the seed, different with another.
    let again = needles::build_set(model, essays(), &spec(vec![1024], vec![0.0, 0.25, 0.5, 0.75, 1.0], 2, 7)).unwrap();
    assert_eq!(again[0].text, docs[0].text);
    let other = needles::build_set(model, essays(), &spec(vec![1024], vec![0.0, 0.25, 0.5, 0.75, 1.0], 2, 8)).unwrap();
    assert_ne!(other[0].text, docs[0].text);
}

#[test]
fn window_labels_agree_with_the_prompt_build_prompt_builds() {
    let model = real_model();
    let docs =
        needles::build_set(model, essays(), &spec(vec![2048], vec![0.0, 0.02, 0.3, 0.5, 0.98, 1.0], 1, 3)).unwrap();
    let doc = &docs[0];
    let ids = Document::from_tokens(doc.text.clone(), model.tokenizer.encode(&doc.text, false).unwrap());
    let (mut ins, mut outs) = (0, 0);
    for budget in [Some(64), Some(128), Some(300), None] {
        for q in &doc.questions {
            let prompt = build_prompt(model, &ids, &Ask { history: &[], question: &q.question, mode: Mode::Lift, context: Some(ContextPolicy::Full), context_tokens: budget }, 32).unwrap();
            let label = eval::in_window(&prompt, q).unwrap();
            // Independent check: is the planted sentence's text (and a two-hop fact's first hop)
            // in the decoded prompt?
            let shown = model.tokenizer.decode(&prompt.tokens).unwrap();
            let planted = q.planted.as_deref().unwrap();
            let hops_shown = q.evidence.iter().all(|&(s, e)| shown.contains(&doc.text[s..e]));
            assert_eq!(label, hops_shown, "budget {budget:?}, {planted:?}: label {label}");
            // icl builds the same context; memory none.
            let icl = build_prompt(model, &ids, &Ask { history: &[], question: &q.question, mode: Mode::Icl, context: Some(ContextPolicy::Full), context_tokens: budget }, 32).unwrap();
            assert_eq!(icl.tokens, prompt.tokens);
            let mem = build_prompt(model, &ids, &Ask { history: &[], question: &q.question, mode: Mode::Memory, context: Some(ContextPolicy::Full), context_tokens: budget }, 32).unwrap();
            assert!(!model.tokenizer.decode(&mem.tokens).unwrap().contains(planted));
            if label {
                ins += 1;
            } else {
                outs += 1;
            }
        }
    }
    assert!(ins >= 6 && outs >= 6, "both labels occur: {ins} in, {outs} out");
}

fn tiny() -> (tempfile::TempDir, std::path::PathBuf, Model) {
    let dir = tempfile::tempdir().unwrap();
    let path = write_hf(&dir.path().join("tiny"), &TinySpec::default()).unwrap();
    let model = Model::load(&path, &Device::Cpu).unwrap();
    (dir, path, model)
}

fn tiny_options() -> AbsorbOptions {
    serde_json::from_value(serde_json::json!({
        "plan": {"window": 128, "context_tokens": 200},
        "train": {"epochs": [1, 1]},
        "qa": {"use_model": false, "max_pairs": 4, "min_pairs": 2}
    }))
    .unwrap()
}

fn tiny_docs(model: &Model) -> Vec<EvalDocument> {
    needles::build_set(model, essays(), &spec(vec![500, 700], vec![0.0, 0.5, 1.0], 1, 1)).unwrap()
}

fn config(methods: &[&str], server: Option<String>) -> RunConfig {
    RunConfig {
        methods: methods.iter().map(|m| m.to_string()).collect(),
        context_tokens: Some(200),
        max_tokens: 6,
        absorb: tiny_options(),
        needles: None,
        jsonl: None,
        server,
        filter_mask: None,
    }
}

fn check_results(results: &eval::Results, docs: usize, questions: usize) {
    assert_eq!(results.answers.len(), questions * 4);
    // lift and memory share one adapter per document; icl and rag need none.
    assert_eq!(results.absorbs.len(), docs);
    for a in &results.absorbs {
        assert_eq!(a.methods, vec!["lift".to_string(), "memory".to_string()]);
        assert!(a.steps > 0 && a.adapter_bytes > 0 && a.parameters > 0);
        assert_eq!(a.step_losses.len(), a.steps, "one loss per optimizer step");
        assert!(a.step_losses.iter().all(|l| l.is_finite() && *l > 0.0), "{:?}", a.step_losses);
    }
    for a in &results.answers {
        let s = lift_serve::corpus::scoring::score(
            &a.prediction,
            &results
                .documents
                .iter()
                .find(|d| d.id == a.document)
                .unwrap()
                .questions
                .iter()
                .find(|q| q.id == a.question)
                .unwrap()
                .answers,
        );
        assert_eq!(s, a.scores);
        assert!(a.in_window.is_some());
    }
    // Prompt lengths: memory has no document, lift and rag the same (retrieved) context.
    let get = |doc: &str, q: &str, m: &str| {
        results.answers.iter().find(|a| a.document == doc && a.question == q && a.method == m).unwrap().prompt_tokens
    };
    let a = &results.answers[0];
    assert_eq!(get(&a.document, &a.question, "lift"), get(&a.document, &a.question, "rag"));
    assert!(get(&a.document, &a.question, "memory") + 40 < get(&a.document, &a.question, "icl"));
}

#[test]
fn local_backend_absorbs_and_answers_through_the_prepared_bases_filter() {
    let (_d, path, plain) = tiny();
    let mut model = Model::load(&path, &Device::Cpu).unwrap();
    let shape = BaseShape { rank: 4, filter: FilterOptions { enabled: true, layer: Some(0), ..Default::default() } };
    let mut base = PreparedBase::new(&model, &shape, 1).unwrap();
    base.save(&path.with_file_name("base")).unwrap();
    base.install(&mut model).unwrap();
    let doc = tiny_docs(&model).remove(0);
    let mut o = tiny_options();
    o.train.epochs = [0, 1];
    let tokens = Document::encode(&model, doc.text.clone()).unwrap();
    let q = &doc.questions[0].question;
    let q_len = model.tokenizer.encode(q, false).unwrap().len();
    let head_tail = |q, mode| Ask { context: Some(ContextPolicy::HeadTail), context_tokens: Some(200), ..Ask::new(q, mode) };
    let mut lens = Vec::new();
    for m in [&plain, &model] {
        let mut local = Local::new(m, 4);
        let (_, handle) = local.absorb(&doc, &tokens, &o, &mut |_, _, _| {}).unwrap();
        let lift_len = local.ask(&doc, &tokens, Some(handle), &head_tail(q, Mode::Lift), false).unwrap().prompt_tokens;
        let icl_len = local.ask(&doc, &tokens, None, &head_tail(q, Mode::Icl), false).unwrap().prompt_tokens;
        lens.push((lift_len, icl_len));
    }
    // Without a base, `lift` has exactly the `icl` prompt; the base's filter layout repeats the
    // question after the document and adds a marker per chunk, in both modes.
    let [(plain_lift, plain_icl), (base_lift, base_icl)] = lens[..] else { unreachable!() };
    assert_eq!(plain_lift, plain_icl);
    assert_eq!(base_lift, base_icl);
    assert!(base_lift >= plain_lift + q_len, "with the base's filter: {base_lift} tokens, without {plain_lift}");

    // The whole run over the base: questions are labelled by the prompt the answers use (the
    // run stops on any prompt that differs from the labelled one).
    let cfg = config(&["icl", "lift", "memory", "rag"], None);
    let mut backend = Local::new(&model, cfg.max_tokens);
    let results = eval::run(&model, &mut backend, vec![doc.clone()], &cfg, false, &mut |_| Ok(())).unwrap();
    check_results(&results, 1, doc.questions.len());
    let a = results.answers.iter().find(|a| a.method == "icl").unwrap();
    assert_eq!(a.prompt_tokens, base_icl, "{a:?}");
}

#[test]
fn eval_runs_every_method_and_writes_the_report_on_the_tiny_model() {
    let (_d, _p, model) = tiny();
    let docs = tiny_docs(&model);
    let n_q: usize = docs.iter().map(|d| d.questions.len()).sum();
    assert_eq!(n_q, 6);
    let cfg = config(&["icl", "lift", "memory", "rag"], None);
    let mut backend = Local::new(&model, cfg.max_tokens);
    let mut partial = Vec::new();
    let results = eval::run(&model, &mut backend, docs, &cfg, false, &mut |r| {
        partial.push((r.documents.len(), r.answers.len()));
        Ok(())
    })
    .unwrap();
    assert_eq!(partial, vec![(1, 12), (2, 24)], "results after each document");
    check_results(&results, 2, n_q);
    // Both labels occur with a 200-token window on 500–700-token documents.
    assert!(results.answers.iter().any(|a| a.in_window == Some(true)));
    assert!(results.answers.iter().any(|a| a.in_window == Some(false)));

    let out = tempfile::tempdir().unwrap();
    report::write(&results, out.path()).unwrap();
    let md = std::fs::read_to_string(out.path().join(report::TABLE_FILE)).unwrap();
    for m in ["| icl |", "| lift |", "| memory |", "| 500 |", "| 700 |"] {
        assert!(md.contains(m), "{m} in\n{md}");
    }
    for png in [report::HEATMAP_FILE, report::LOSS_FILE] {
        let bytes = std::fs::read(out.path().join(png)).unwrap();
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "{png} is a PNG");
        assert!(bytes.len() > 2000, "{png}: {} bytes", bytes.len());
    }
    // The JSON round-trips and redraws the same table.
    let back: eval::Results =
        serde_json::from_slice(&std::fs::read(out.path().join(report::RESULTS_FILE)).unwrap()).unwrap();
    assert_eq!(report::markdown(&back), md);
}

#[test]
fn jsonl_questions_are_labelled_from_answer_occurrences() {
    let (_d, _p, model) = tiny();
    let filler = "The committee met again and discussed the weather at length. ".repeat(8);
    let doc = format!(
        "The vault code is 5521. {filler}The ferry captain was Orla Brandt. {filler}The bell weighs nine tons."
    );
    let line = serde_json::json!({"document": doc, "questions": [
        {"question": "What opens the vault?", "answers": ["5521"]},
        {"question": "Who steered the ferry?", "answers": ["Orla Brandt"], "evidence": "The ferry captain was Orla Brandt."},
        {"question": "How heavy is the bell?", "answers": ["nine tons", "9 tons"]},
        {"question": "What colour is the door?", "answers": ["green"]}
    ]});
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("set.jsonl");
    std::fs::write(&path, format!("{line}\n\n")).unwrap();
    let docs = eval::load_jsonl(&model, &path, None).unwrap();
    assert_eq!(docs.len(), 1);
    let d = &docs[0];
    assert_eq!(d.tokens, model.tokenizer.encode(&d.text, false).unwrap().len());
    let ids = Document::from_tokens(d.text.clone(), model.tokenizer.encode(&d.text, false).unwrap());
    let labels: Vec<Option<bool>> = d
        .questions
        .iter()
        .map(|q| {
            eval::in_window(
                &build_prompt(&model, &ids, &Ask { history: &[], question: &q.question, mode: Mode::Lift, context: Some(ContextPolicy::Full), context_tokens: Some(48) }, 8).unwrap(),
                q,
            )
        })
        .collect();
    assert_eq!(labels, vec![Some(true), Some(false), Some(true), None]);
    assert_eq!(
        &d.text[d.questions[1].evidence[0].0..d.questions[1].evidence[0].1],
        "The ferry captain was Orla Brandt."
    );
    // A split asked of a set without split fields is refused, not answered with every line.
    assert!(eval::load_jsonl(&model, &path, Some("eval")).is_err());
    // Lines by split, with each question's form.
    let q = |form: &str| serde_json::json!({"question": "What opens the vault?", "answers": ["5521"], "kind": form});
    let lines = [("a", "train", "what"), ("b", "eval", "how_many"), ("c", "eval", "who")]
        .map(|(id, split, form)| serde_json::json!({"id": id, "split": split, "document": doc, "questions": [q(form)]}).to_string());
    std::fs::write(&path, lines.join("\n")).unwrap();
    let evals = eval::load_jsonl(&model, &path, Some("eval")).unwrap();
    assert_eq!(evals.iter().map(|d| d.id.as_str()).collect::<Vec<_>>(), ["b", "c"]);
    assert_eq!(evals[1].questions[0].form.as_deref(), Some("who"));
    assert_eq!(eval::load_jsonl(&model, &path, None).unwrap().len(), 3);
    assert!(format!("{:#}", eval::load_jsonl(&model, &path, Some("validation")).unwrap_err()).contains("split validation"));
    // A bad line is an error naming the line.
    std::fs::write(&path, "{\"document\": \"x\"}\n").unwrap();
    let err = format!("{:#}", eval::load_jsonl(&model, &path, None).unwrap_err());
    assert!(err.contains(":1"), "{err}");
}

#[test]
fn eval_through_a_real_server_socket_measures_the_serving_path() {
    let (tmp, model_path, model) = tiny();
    let options = tmp.path().join("absorb.json");
    std::fs::write(&options, serde_json::to_string(&tiny_options()).unwrap()).unwrap();
    let mut c = lift_serve::server::ServeConfig::new(model_path, tmp.path().join("adapters"));
    c.absorb_options = Some(options);
    c.port = 0;
    c.context_tokens = Some(200);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let running = rt.block_on(async {
        let state = lift_serve::server::build_state(c, &Device::Cpu).unwrap();
        lift_serve::server::start(state).await.unwrap()
    });
    let url = format!("http://{}", running.addr);
    let docs = tiny_docs(&model);
    let n_q: usize = docs.iter().map(|d| d.questions.len()).sum();
    let cfg = config(&["icl", "lift", "memory", "rag"], Some(url.clone()));
    let mut backend = eval::client::Server::new(&url, None, cfg.max_tokens).unwrap();
    let results = eval::run(&model, &mut backend, docs.clone(), &cfg, false, &mut |_| Ok(())).unwrap();
    check_results(&results, 2, n_q);

    // Asked again as one collection of both documents (`eval --collection`): every question in
    // `lift` and `rag`, routed by the collection's passages to the document that holds its fact.
    let asked = backend.ask_collection(&results.documents, &[Mode::Lift, Mode::Rag]).unwrap();
    assert_eq!(asked.len(), n_q * 2);
    let routed = asked.iter().filter(|a| a.routed_right == Some(true)).count();
    assert!(routed * 5 >= asked.len() * 4, "routing chose the question's document in {routed} of {}", asked.len());
    let mut with = results.clone();
    with.config.methods.extend(["collection:lift".to_string(), "collection:rag".to_string()]);
    with.answers.extend(asked);
    let md = eval::report::markdown(&with);
    let table = md.split("Asked as one collection").nth(1).unwrap_or_else(|| panic!("no collection table: {md}"));
    for mode in ["lift", "rag"] {
        let row = table.lines().find(|l| l.starts_with(&format!("| {mode} |"))).unwrap_or_else(|| panic!("no {mode} row: {table}"));
        let method = format!("collection:{mode}");
        let routed_here = with.answers.iter().filter(|a| a.method == method && a.routed_right == Some(true)).count();
        assert!(row.contains(&format!("| {routed_here} of {n_q} (")), "{row}");
    }

    // The same documents in-process give the same greedy answers (same options and seed).
    let mut local = Local::new(&model, cfg.max_tokens);
    let here =
        eval::run(&model, &mut local, docs.clone(), &config(&["icl", "lift", "memory", "rag"], None), false, &mut |_| Ok(()))
            .unwrap();
    for (a, b) in results.answers.iter().zip(&here.answers) {
        assert_eq!((&a.document, &a.question, &a.method), (&b.document, &b.question, &b.method));
        assert_eq!(a.prediction, b.prediction, "{} {} {}", a.document, a.question, a.method);
    }

    // The run's budget and each method's own (`lift:bm25:64`) travel with the question: the
    // server answers with them, not with its default, and the prompts are the ones labelled.
    // (Under `bm25`, which fills the budget; the default `linked` shows what it links, often
    // less than either budget.)
    let other = config(&["icl", "lift:bm25", "lift:bm25:64"], Some(url.clone()));
    let other = RunConfig { context_tokens: Some(180), ..other };
    let mut backend = eval::client::Server::new(&url, None, other.max_tokens).unwrap();
    let r = eval::run(&model, &mut backend, docs, &other, false, &mut |_| Ok(())).unwrap();
    let tokens = |m: &str| r.answers.iter().filter(|a| a.method == m).map(|a| a.prompt_tokens).collect::<Vec<_>>();
    for (at_180, at_64) in tokens("lift:bm25").iter().zip(tokens("lift:bm25:64")) {
        assert!(at_64 < *at_180, "lift:64 prompt {at_64} tokens, lift at 180: {at_180}");
    }
    rt.block_on(running.shutdown());
}
