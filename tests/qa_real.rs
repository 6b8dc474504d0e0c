//! Auxiliary QA on the real default model (SmolLM2-135M-Instruct Q4_1, fetched by
//! `lift-serve fetch-model`): the model writes pairs with the paper's prompt, the extractive
//! generator completes them, every pair's evidence is verbatim in the document.

use candle_core::Device;
use lift_serve::lift::absorb::qa::{count_by_source, generate_qa_with_stats, normalize_question, QaOptions, QaSource};
use lift_serve::model::Model;
use std::collections::HashSet;
use std::time::Instant;

const DOC: &str = "The Nordvik Research Station stands on a cliff above the Barents Sea. \
It was built in 1962 by the Norwegian Polar Institute. \
The station's first leader was Ingrid Halvorsen, a glaciologist from Tromsø. \
Today the station employs 23 scientists during the summer season. \
In winter only four people stay there. \
The supply ship Polarlys arrives every second Tuesday. \
The main laboratory measures ice thickness with radar. \
In 1988, a storm destroyed the old weather mast. \
A new mast was installed in 1990 by engineers from Bergen. \
The station's dog is called \"Bamse\". \
Its radio call sign is LKN-7. \
The nearest town, Longyearbyen, is 140 kilometres to the south. \
Researchers at the station discovered a new species of lichen in 2011. \
The lichen was named after Ingrid Halvorsen. \
Every August the station hosts an open day for students. \
The current director is Mikkel Strand.";

#[test]
fn generate_qa_on_the_default_model() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
    let path = lift_serve::fetch::resolve_model(None).expect("default model (run `lift-serve fetch-model`)");
    let model = Model::load(&path, &Device::Cpu).expect("default model loads");
    let opts = QaOptions { max_new_tokens: 64, retries: 2, ..Default::default() };
    let t0 = Instant::now();
    let mut last = None;
    let (pairs, stats) =
        generate_qa_with_stats(&model, DOC, &opts, &mut |p| last = Some((p.done, p.total, p.valid)), &|| false)
            .expect("generation runs");
    let secs = t0.elapsed().as_secs_f64();
    for p in &pairs {
        eprintln!("[{:?}] {}  =>  {}   (evidence {:?})", p.source, p.question, p.answer, p.evidence_span);
    }
    let model_n = pairs.iter().filter(|p| p.source == QaSource::Model).count();
    let extractive_n = pairs.len() - model_n;
    eprintln!("stats: {}", serde_json::to_string(&stats).unwrap());
    eprintln!("by source: {:?}", count_by_source(&pairs));
    eprintln!(
        "QA pairs: {} total, {model_n} from the model ({} windows, {} attempts, {} tokens), {extractive_n} extractive; {secs:.1} s",
        pairs.len(),
        stats.windows,
        stats.attempts,
        stats.generated_tokens
    );
    assert_eq!(last.map(|l| (l.0, l.1)), Some((stats.windows, stats.windows)));
    assert!(pairs.len() >= opts.min_pairs, "{} pairs < min_pairs {}", pairs.len(), opts.min_pairs);
    assert!(pairs.len() <= opts.max_pairs);
    for p in &pairs {
        let (s, e) = p.evidence_span;
        assert_eq!(&DOC[s..e], p.evidence, "evidence not verbatim at its span: {p:?}");
        assert!(!p.question.trim().is_empty() && !p.answer.trim().is_empty());
    }
    let qs: HashSet<String> = pairs.iter().map(|p| normalize_question(&p.question)).collect();
    assert_eq!(qs.len(), pairs.len(), "duplicate questions");
    // Facts at the start, middle and end of the document are asked about.
    let asked = |needle: &str| pairs.iter().any(|p| p.answer.contains(needle) && p.answer != p.evidence);
    assert!(asked("1962") && asked("LKN-7") && asked("Mikkel Strand"));
}
