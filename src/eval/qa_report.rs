//! `lift-serve eval --qa-report N`: the auxiliary QA an absorb would train on, per document of
//! the run, measured on its own (no training, no answers): pairs, distinct answers, the largest
//! share one answer takes, the cloze share, short answers, and how many of the set's own questions'
//! answers some pair trains; then `N` pairs of each document, spread over it.

use super::EvalDocument;
use crate::lift::absorb::qa::{extractive_qa, qa_shares, QaOptions};
use crate::corpus::scoring::normalize;
use std::fmt::Write;

/// The report as markdown: one row per document, then the sample pairs.
pub fn report(docs: &[EvalDocument], opts: &QaOptions, sample: usize) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "| document | tokens | pairs | distinct answers | top answer share | cloze share | short answers | set's answers trained |");
    let _ = writeln!(s, "|---|---|---|---|---|---|---|---|");
    let mut samples = String::new();
    for d in docs {
        let pairs = extractive_qa(&d.text, &opts.for_document(d.tokens));
        let sh = qa_shares(&pairs);
        // A question of the set whose answer is some pair's answer: what the adapter could
        // have learned to say.
        let trained: std::collections::HashSet<String> = pairs.iter().map(|p| normalize(&p.answer)).collect();
        let covered = d.questions.iter().filter(|q| q.answers.iter().any(|a| trained.contains(&normalize(a)))).count();
        let pct = |x: f64| format!("{:.0}%", 100.0 * x);
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} | {} | {} | {covered}/{} |",
            d.id,
            d.tokens,
            sh.pairs,
            sh.distinct_answers,
            pct(sh.top_answer_share),
            pct(sh.cloze_share),
            pct(sh.short_answer_share),
            d.questions.len()
        );
        if sample > 0 && !pairs.is_empty() {
            let _ = writeln!(samples, "\n{} ({} of {} pairs):\n", d.id, sample.min(pairs.len()), pairs.len());
            let k = sample.min(pairs.len());
            for i in 0..k {
                let p = &pairs[(2 * i + 1) * pairs.len() / (2 * k)];
                let _ = writeln!(samples, "- {} → {}", one_line(&p.question), one_line(&p.answer));
            }
        }
    }
    s.push_str(&samples);
    s
}

fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}
