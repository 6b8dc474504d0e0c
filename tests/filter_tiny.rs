//! FltLM and CDT mechanics on the tiny random model (2 layers: the filter reads layer 0 and masks
//! layer 1): the soft mask changes exactly the logits it should, w = b = 0 is the unfiltered
//! model, the inference path (prefill in pieces, KV cache) agrees with one trainable pass, the
//! filter is differentiable, and a document's absorb over a prepared base trains its QA in the
//! base filter's layout, under its frozen mask.

use candle_core::{Device, Tensor};
use lift_serve::document::Document;
use lift_serve::base::{BaseShape, PreparedBase};
use lift_serve::lift::absorb::qa_examples;
use lift_serve::lift::answer::layout::{self, Filter, FilterHooks, FilterOptions};
use lift_serve::lift::absorb::qa::{QaPair, QaSource};
use lift_serve::lift::{absorb, AbsorbOptions};
use lift_serve::model::{ForwardHooks, KvCache, Logits, Model, NoHooks};
use lift_serve::testing::{write_hf, Rng, TinySpec};

const DOC: &str = "Marigold ferries leave the north pier at dawn. The lighthouse keeper, Anselm Varga, \
logs every departure in a green ledger. Passengers pay eleven coins for the crossing to Tern Island. \
The ferry captain, Ilse Moreau, has sailed the route for twenty years. In winter the ferries stop.";

/// With f32 float matmuls: these tests compare paths (incremental inference against one
/// trainable pass) to float precision; the default bf16 matmuls round their inputs.
fn tiny() -> (tempfile::TempDir, Model) {
    let dir = tempfile::tempdir().unwrap();
    let path = write_hf(&dir.path().join("tiny"), &TinySpec::default()).unwrap();
    let mut model = Model::load(&path, &Device::Cpu).unwrap();
    model.decoder.cpu_float_dtype = candle_core::DType::F32;
    (dir, model)
}

/// A filter on layer 0 with a random score head and the given soft-mask `w`, `b`.
fn filter(model: &Model, w: f32, b: f32) -> Filter {
    let opts = FilterOptions { enabled: true, layer: Some(0), chunk_tokens: 24, ..Default::default() };
    let mut f = Filter::new(model.config(), &opts, &Device::Cpu).unwrap().detached();
    let h = model.config().hidden_size;
    f.head_w = Tensor::from_vec(Rng::new(5).vec(h, 1.0), h, &Device::Cpu).unwrap();
    f.w = Tensor::new(&[w], &Device::Cpu).unwrap();
    f.b = Tensor::new(&[b], &Device::Cpu).unwrap();
    f
}

fn prompt(model: &Model, budget: usize) -> layout::FilterPrompt {
    let doc = model.tokenizer.encode(DOC, false).unwrap();
    let ends = layout::breaks(model, &doc).unwrap();
    layout::build_prompt(model, &doc, &ends, "Who keeps the lighthouse?", budget, 24).unwrap()
}

/// The median chunk score of the random head on `p` (so that `b = −median` masks about half).
fn median_score(model: &Model, p: &layout::FilterPrompt) -> f32 {
    let f = filter(model, 0.0, 0.0);
    let mut s: Vec<f32> = layout::score_prompt(model, None, &f, p).unwrap().iter().map(|c| c.score).collect();
    s.sort_by(f32::total_cmp);
    let m = s[s.len() / 2];
    assert!(s[0] < m, "scores differ between chunks: {s:?}");
    m
}

fn all_logits(model: &Model, tokens: &[u32], hooks: &mut dyn ForwardHooks) -> Vec<Vec<f32>> {
    let ids = Tensor::new(tokens, &Device::Cpu).unwrap().unsqueeze(0).unwrap();
    let mut cache = KvCache::new(model.config().num_layers);
    let l = model.decoder.forward(&ids, &mut cache, None, hooks, Logits::All).unwrap();
    l.squeeze(0).unwrap().to_vec2::<f32>().unwrap()
}

#[test]
fn layout_chunks_the_window_with_markers_and_the_question_twice() {
    let (_d, model) = tiny();
    let doc = model.tokenizer.encode(DOC, false).unwrap();
    let p = prompt(&model, 120);
    assert!(p.chunks.len() >= 5, "{} chunks", p.chunks.len());
    let marker = layout::marker_token(&model).unwrap();
    for c in &p.chunks {
        assert!(c.end - c.start <= 24 && c.end - c.start == c.doc_end - c.doc_start);
        assert_eq!(&p.tokens[c.start..c.end], &doc[c.doc_start..c.doc_end], "chunk tokens are the document's");
        assert_eq!(p.tokens[c.marker()], marker);
        assert!(c.doc_end <= p.head_end || c.doc_start >= p.tail_start, "chunks never straddle the elision");
    }
    let shown: usize = p.chunks.iter().map(|c| c.doc_end - c.doc_start).sum();
    assert_eq!(shown, p.head_end + (doc.len() - p.tail_start), "every in-window token is in a chunk");
    let text = model.tokenizer.decode(&p.tokens).unwrap();
    assert_eq!(text.matches("Who keeps the lighthouse?").count(), 2, "question before and after: {text}");
    // Labels from an evidence span: exactly the overlapping chunks.
    let c = p.chunks[1];
    let labels = p.labels((c.doc_start + 1, c.doc_start + 2));
    assert_eq!(labels.iter().filter(|&&l| l).count(), 1);
    assert!(labels[1]);
}

#[test]
fn soft_mask_changes_exactly_the_logits_after_a_masked_chunk_and_zero_w_b_is_the_plain_model() {
    let (_d, model) = tiny();
    let p = prompt(&model, 120);
    let plain = all_logits(&model, &p.tokens, &mut NoHooks);
    let n_layers = model.config().num_layers;

    // w = b = 0: no bias anywhere, bit-identical logits.
    let f0 = filter(&model, 0.0, 0.0);
    let mut hooks = FilterHooks::new(&f0, &p.chunks, n_layers);
    assert_eq!(all_logits(&model, &p.tokens, &mut hooks), plain);
    assert!(hooks.report().unwrap().iter().all(|c| c.mask == 0.0));

    // b = −4, w = 0: every chunk masked by −4 for the positions from its marker on.
    let f = filter(&model, 0.0, -4.0);
    let mut hooks = FilterHooks::new(&f, &p.chunks, n_layers);
    let masked = all_logits(&model, &p.tokens, &mut hooks);
    let first_marker = p.chunks[0].marker();
    for (i, (a, b)) in masked.iter().zip(&plain).enumerate() {
        let diff = a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
        if i < first_marker {
            assert_eq!(diff, 0.0, "position {i} precedes every marker: unchanged");
        } else {
            assert!(diff > 1e-4, "position {i} attends a masked chunk: changed ({diff})");
        }
    }
    assert!(hooks.report().unwrap().iter().all(|c| (c.mask + 4.0).abs() < 1e-6));

    // w = 1, b = −median score: only the lower-scoring chunks are masked; positions up to the
    // first masked chunk's marker are unchanged.
    let f = filter(&model, 1.0, -median_score(&model, &p));
    let mut hooks = FilterHooks::new(&f, &p.chunks, n_layers);
    let scored = all_logits(&model, &p.tokens, &mut hooks);
    let report = hooks.report().unwrap();
    let first_masked = report.iter().position(|c| c.mask < 0.0).expect("a random head masks some chunk");
    let m = p.chunks[first_masked].marker();
    assert!(scored[..m] == plain[..m], "nothing changes before the first masked chunk's marker");
    assert!(scored[m] != plain[m]);
}

#[test]
fn incremental_inference_matches_one_trainable_pass_and_gradients_reach_the_filter() {
    let (_d, model) = tiny();
    let p = prompt(&model, 120);
    let n_layers = model.config().num_layers;
    let f = filter(&model, 1.0, -median_score(&model, &p));
    // Inference in three pieces (as chunked prefill + decode steps do).
    let mut hooks = FilterHooks::new(&f, &p.chunks, n_layers);
    let mut cache = KvCache::new(n_layers);
    let cut = [p.chunks[1].start + 3, p.tokens.len() - 1];
    let mut last = None;
    for (a, b) in [(0, cut[0]), (cut[0], cut[1]), (cut[1], p.tokens.len())] {
        let ids = Tensor::new(&p.tokens[a..b], &Device::Cpu).unwrap().unsqueeze(0).unwrap();
        last = Some(model.decoder.forward(&ids, &mut cache, None, &mut hooks, Logits::Last).unwrap());
    }
    let inc_scores = hooks.report().unwrap();
    let inc = last.unwrap().squeeze(0).unwrap().to_vec1::<f32>().unwrap();

    // One trainable pass with trainable filter parameters.
    let opts = FilterOptions { enabled: true, layer: Some(0), chunk_tokens: 24, ..Default::default() };
    let tf = Filter::new(model.config(), &opts, &Device::Cpu).unwrap();
    tf.vars()[0].set(&f.head_w).unwrap();
    tf.vars()[2].set(&f.w).unwrap();
    tf.vars()[3].set(&f.b).unwrap();
    let mut hooks = FilterHooks::new(&tf, &p.chunks, n_layers);
    let ids = Tensor::new(p.tokens.as_slice(), &Device::Cpu).unwrap().unsqueeze(0).unwrap();
    // Trainable embeddings (as in CDT's first pass) put every layer on the differentiable path.
    let emb = candle_core::Var::from_tensor(&model.decoder.embed(&ids).unwrap()).unwrap();
    let hidden = model.decoder.forward_train(emb.as_tensor(), None, &mut hooks).unwrap();
    let n = p.tokens.len();
    let logits = model.decoder.logits_train(&hidden.squeeze(0).unwrap().narrow(0, n - 1, 1).unwrap()).unwrap();
    let one = logits.squeeze(0).unwrap().to_vec1::<f32>().unwrap();
    let max_diff = inc.iter().zip(&one).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    assert!(max_diff < 2e-3, "incremental vs one pass: {max_diff}");
    for (a, b) in inc_scores.iter().zip(hooks.report().unwrap()) {
        assert!((a.score - b.score).abs() < 1e-3 && (a.mask - b.mask).abs() < 1e-3, "{a:?} vs {b:?}");
    }
    assert!(inc_scores.iter().any(|c| c.mask < 0.0), "the test masks something");

    // Gradients reach the head (through the scores), w and b (through the soft mask).
    let s = hooks.scores().unwrap();
    let positive: Vec<bool> = (0..p.chunks.len()).map(|i| i == 1).collect();
    let flt = layout::filter_loss(&s, &positive, 1.0, &tf.log_tau).unwrap();
    let loss = (logits.sum_all().unwrap() + flt).unwrap();
    let grads = loss.backward().unwrap();
    for (i, name) in ["head_w", "head_b", "w", "b", "log_tau"].iter().enumerate() {
        let g = grads.get(tf.vars()[i].as_tensor()).unwrap_or_else(|| panic!("no gradient for {name}"));
        let norm = g.sqr().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap();
        assert!(norm > 0.0, "zero gradient for {name}");
    }
}

/// With no adapter and plain embeddings (nothing else trainable), a trainable filter's hooks still
/// put the layers its mask reaches in the graph: the LM loss alone gives w and b a gradient (the
/// decoder used to run every layer frozen then, found by tests/cuda.rs on the first GPU run).
#[test]
fn a_trainable_filter_alone_gets_gradients_through_its_mask() {
    let (_d, model) = tiny();
    let p = prompt(&model, 120);
    let f = filter(&model, 1.0, -median_score(&model, &p));
    let opts = FilterOptions { enabled: true, layer: Some(0), chunk_tokens: 24, ..Default::default() };
    let tf = Filter::new(model.config(), &opts, &Device::Cpu).unwrap();
    tf.vars()[0].set(&f.head_w).unwrap();
    tf.vars()[2].set(&f.w).unwrap();
    tf.vars()[3].set(&f.b).unwrap();
    let mut hooks = FilterHooks::new(&tf, &p.chunks, model.config().num_layers);
    let ids = Tensor::new(p.tokens.as_slice(), &Device::Cpu).unwrap().unsqueeze(0).unwrap();
    let emb = model.decoder.embed(&ids).unwrap();
    assert!(!emb.track_op());
    let hidden = model.decoder.forward_train(&emb, None, &mut hooks).unwrap();
    let grads = model.decoder.logits_train(&hidden.squeeze(0).unwrap()).unwrap().sum_all().unwrap().backward().unwrap();
    for (i, name) in [(0, "head_w"), (2, "w"), (3, "b")] {
        let g = grads.get(tf.vars()[i].as_tensor()).unwrap_or_else(|| panic!("no gradient for {name}"));
        assert!(g.sqr().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap() > 0.0, "zero gradient for {name}");
    }
    // A frozen copy trains nothing: the same pass keeps its layers off the graph.
    let frozen = tf.detached();
    let mut hooks = FilterHooks::new(&frozen, &p.chunks, model.config().num_layers);
    assert!(!model.decoder.forward_train(&emb, None, &mut hooks).unwrap().track_op());
}

#[test]
fn absorb_over_a_prepared_base_trains_qa_in_its_filter_layout_and_leaves_the_filter_frozen() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_hf(&dir.path().join("tiny"), &TinySpec::default()).unwrap();
    let plain = Model::load(&path, &Device::Cpu).unwrap();
    let mut model = Model::load(&path, &Device::Cpu).unwrap();
    let shape = BaseShape { rank: 4, filter: FilterOptions { enabled: true, layer: Some(0), chunk_tokens: 24, ..Default::default() } };
    let mut base = PreparedBase::new(&model, &shape, 3).unwrap();
    base.filter = filter(&model, 1.0, -0.5); // a scoring head and a mask that acts
    base.save(&dir.path().join("base")).unwrap();
    base.install(&mut model).unwrap();
    let head = |m: &Model| m.base_filter().unwrap().head_w.to_vec1::<f32>().unwrap();
    let before = head(&model);

    let mut o = AbsorbOptions::default();
    o.plan.window = 32;
    o.plan.training_context_tokens = 1000; // the whole document is in the window: every evidence has a chunk
    o.qa.use_model = false;
    o.qa.max_pairs = 4;
    o.train.epochs = [0, 2];
    let document = Document::encode(&model, DOC).unwrap();
    let a = absorb(&model, &document, None, &o, &mut |_| {}, &|| false).unwrap();
    let p = absorb(&plain, &Document::encode(&plain, DOC).unwrap(), None, &o, &mut |_| {}, &|| false).unwrap();
    assert!(!a.qa.is_empty());
    assert_eq!((a.report.steps, a.qa.len()), (p.report.steps, p.qa.len()), "the same plan");
    // Each QA example repeats its question after the chunks and adds a marker per chunk.
    let q_tokens: usize = a.qa.iter().map(|q| model.tokenizer.encode(&q.question, false).unwrap().len()).sum();
    assert!(a.report.tokens >= p.report.tokens + 2 * q_tokens, "{} vs {} tokens", a.report.tokens, p.report.tokens);
    // The base's filter is frozen and not saved with the document's adapter.
    assert_eq!(head(&model), before);
    assert!(a.bundle.extras.is_empty());
    let f = model.base_filter().unwrap().clone();
    // Recall on the training pairs runs and counts every pair whose evidence is in a chunk.
    let e = qa_examples::evaluate(&model, Some(&a.bundle.adapter), &f, &document, &a.qa, 1000).unwrap();
    assert_eq!(e.questions, a.qa.len());
    assert!(e.evidence_chunks >= e.questions);

    // A pair whose evidence lies outside the window labels no chunk positive.
    let doc = document.tokens();
    let pair = QaPair {
        question: "How long has the captain sailed?".into(),
        answer: "twenty years".into(),
        evidence: "has sailed the route for twenty years".into(),
        evidence_span: (DOC.find("has sailed").unwrap(), DOC.find("has sailed").unwrap() + 37),
        source: QaSource::Extractive,
    };
    assert_eq!(&DOC[pair.evidence_span.0..pair.evidence_span.1], pair.evidence);
    let span = qa_examples::evidence_tokens(&model, DOC, &pair).unwrap();
    let ends = layout::breaks(&model, doc).unwrap();
    let small = layout::build_prompt(&model, doc, &ends, &pair.question, 40, 24).unwrap();
    assert!(span.0 >= small.head_end && span.1 <= small.tail_start, "evidence out of a 40-token window");
    assert!(small.labels(span).iter().all(|&l| !l));
}
