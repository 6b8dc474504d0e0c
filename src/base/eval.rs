//! In-context reading: how well a model (plain, or over a prepared base) answers questions about a
//! document it holds entirely in its window. The documents and questions come from the data
//! builder's eval split (essays, templates and value pools no training example uses), at fixed
//! lengths; every arm answers the same questions through the product's answer path
//! ([`answer`] in `icl` mode: the prepared base's filter when there is one), greedy.
//!
//! Per arm: accuracy (the gold answer occurs in the reply as whole words), the filter's precision
//! and recall at FltLM's `s_i > 0` against the passages holding the supporting facts, and the
//! perplexity of held-out essay text. Arms are compared with the first one question by question
//! (McNemar's exact test on the discordant pairs).

use super::data::{self, BaseExample, BuildOptions};
use crate::corpus::{essays_in, Split};
use crate::corpus::scoring;
use crate::document::Document;
use crate::lift::answer::{answer, Ask, ContextPolicy, Mode};
use crate::model::generate::SamplingParams;
use crate::model::{KvCache, Logits, Model, NoHooks};
use anyhow::Result;
use candle_core::{Tensor, D};
use serde::{Deserialize, Serialize};
use std::path::Path;

/// One question of the reading set.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ReadingItem {
    pub id: String,
    /// The nominal document length (approximate tokens) it was built for.
    pub length: usize,
    pub example: BaseExample,
}

/// `per_length` eval-split examples at each of `lengths` (approximate tokens, ±10%), distinct
/// questions at each length, deterministic for `seed`.
pub fn reading_set(essays_dir: &Path, lengths: &[usize], per_length: usize, seed: u64) -> Result<Vec<ReadingItem>> {
    let mut items = Vec::new();
    for &length in lengths {
        let opts = BuildOptions { min_tokens: length * 9 / 10, max_tokens: length * 11 / 10, ..Default::default() };
        // Another seed per length: each length gets its own facts and questions.
        let examples = data::build_examples_with(essays_dir, Split::Eval, per_length, seed ^ length as u64, &opts)?;
        items.extend(
            examples.into_iter().enumerate().map(|(i, example)| ReadingItem { id: format!("{length}-{i}"), length, example }),
        );
    }
    Ok(items)
}

/// One answered question.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ReadingRecord {
    pub id: String,
    pub length: usize,
    pub kind: String,
    pub document_tokens: usize,
    pub question: String,
    pub answer: String,
    pub prediction: String,
    pub correct: bool,
    pub f1: f64,
    /// Chunks the filter scored relevant (`s_i > 0`) that overlap a supporting passage, all it
    /// scored relevant, and all chunks overlapping a supporting passage (None without a filter).
    pub filter_counts: Option<[usize; 3]>,
}

/// Answers every item with `model` as it is (a prepared base installed or not).
pub fn read(model: &Model, items: &[ReadingItem], on_done: &mut dyn FnMut(usize)) -> Result<Vec<ReadingRecord>> {
    let params = SamplingParams { max_tokens: 24, ..Default::default() };
    let mut out = Vec::with_capacity(items.len());
    for (n, item) in items.iter().enumerate() {
        let ex = &item.example;
        let text = ex.document();
        let doc = Document::encode(model, text.clone())?;
        let ask = Ask { history: &[], question: &ex.question, mode: Mode::Icl, context: Some(ContextPolicy::Full), context_tokens: None };
        let a = answer(model, &doc, None, &ask, &params, &mut |_| true)?;
        let (generation, scores) = (a.generation, a.chunks);
        let filter_counts = if scores.is_empty() {
            None
        } else {
            let spans = ex.passage_spans();
            let positive: Vec<(usize, usize)> = ex
                .positive
                .iter()
                .map(|&i| crate::document::token_span(model, &text, spans[i]))
                .collect::<Result<_>>()?;
            let relevant = |c: &crate::lift::answer::layout::ChunkScore| positive.iter().any(|&(a, b)| c.start < b && a < c.end);
            let kept = scores.iter().filter(|c| c.score > 0.0).count();
            let hits = scores.iter().filter(|c| c.score > 0.0 && relevant(c)).count();
            let gold = scores.iter().filter(|c| relevant(c)).count();
            Some([hits, kept, gold])
        };
        let prediction = generation.text.trim().to_string();
        out.push(ReadingRecord {
            id: item.id.clone(),
            length: item.length,
            kind: ex.kind.clone(),
            document_tokens: doc.len(),
            question: ex.question.clone(),
            answer: ex.answer.clone(),
            correct: scoring::contains(&prediction, &ex.answer) > 0.0,
            f1: scoring::f1(&prediction, &ex.answer),
            prediction,
            filter_counts,
        });
        on_done(n + 1);
    }
    Ok(out)
}

/// Perplexity of `model` on the first `tokens` tokens of each eval-split essay (plain language
/// modelling, no document layout: what a prepared base must not spoil).
pub fn perplexity(model: &Model, essays_dir: &Path, tokens: usize) -> Result<f64> {
    let essays = essays_in(&crate::corpus::load_essays(essays_dir)?, Split::Eval);
    let (mut nll, mut count) = (0.0f64, 0usize);
    for essay in &essays {
        let mut ids = model.encode_document(&essay.text)?;
        ids.truncate(tokens + 1);
        if ids.len() < 2 {
            continue;
        }
        let input = Tensor::new(&ids[..ids.len() - 1], model.device())?.unsqueeze(0)?;
        let mut cache = KvCache::new(model.config().num_layers);
        let logits = model.decoder.forward(&input, &mut cache, None, &mut NoHooks, Logits::All)?.squeeze(0)?;
        let logp = candle_nn::ops::log_softmax(&logits.to_dtype(candle_core::DType::F32)?, D::Minus1)?;
        let target = Tensor::new(&ids[1..], model.device())?.unsqueeze(1)?;
        nll -= logp.gather(&target, 1)?.sum_all()?.to_scalar::<f32>()? as f64;
        count += ids.len() - 1;
    }
    anyhow::ensure!(count > 0, "no eval essays to measure perplexity on");
    Ok((nll / count as f64).exp())
}

/// `<arm>.meta.json`: which prepared base answered (`none` or its hash) and its perplexity.
#[derive(Serialize, Deserialize)]
struct ArmMeta {
    base: String,
    perplexity: f64,
}

/// Records the base and perplexity beside an arm's answers, so a later run can reuse them.
pub fn write_meta(dir: &Path, arm: &str, base: &str, perplexity: f64) -> Result<()> {
    let meta = ArmMeta { base: base.to_string(), perplexity };
    std::fs::write(dir.join(format!("{arm}.meta.json")), serde_json::to_vec_pretty(&meta)?)?;
    Ok(())
}

/// An earlier run's answers for `arm` when they came from the same base (`none` or its hash) on
/// exactly these questions (ids, questions and answers in order); None otherwise.
pub fn reuse(dir: &Path, arm: &str, base: &str, items: &[ReadingItem]) -> Result<Option<(Vec<ReadingRecord>, f64)>> {
    let (Ok(meta), Ok(lines)) = (
        std::fs::read(dir.join(format!("{arm}.meta.json"))),
        std::fs::read_to_string(dir.join(format!("{arm}.jsonl"))),
    ) else {
        return Ok(None);
    };
    let Ok(meta) = serde_json::from_slice::<ArmMeta>(&meta) else { return Ok(None) };
    let records: Vec<ReadingRecord> =
        match lines.lines().filter(|l| !l.trim().is_empty()).map(serde_json::from_str).collect() {
            Ok(r) => r,
            Err(_) => return Ok(None),
        };
    let same = meta.base == base
        && records.len() == items.len()
        && records.iter().zip(items).all(|(r, i)| {
            r.id == i.id && r.question == i.example.question && r.answer == i.example.answer
        });
    Ok(same.then_some((records, meta.perplexity)))
}

/// One arm's figures.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ArmSummary {
    pub arm: String,
    pub questions: usize,
    pub accuracy: f64,
    /// Accuracy per nominal length, ascending.
    pub by_length: Vec<(usize, f64)>,
    pub filter_precision: Option<f64>,
    pub filter_recall: Option<f64>,
    pub perplexity: f64,
    /// Against the first arm, question by question: (this right / that wrong, the reverse), the
    /// accuracy difference in points and McNemar's exact two-sided p.
    pub vs_first: Option<Paired>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Paired {
    pub versus: String,
    pub only_this: usize,
    pub only_that: usize,
    pub points: f64,
    pub p_value: f64,
}

/// The figures of each arm (`records` in the same question order for every arm).
pub fn summarize(arms: &[(String, Vec<ReadingRecord>, f64)]) -> Vec<ArmSummary> {
    let first = arms.first();
    arms.iter()
        .map(|(name, recs, ppl)| {
            let acc = |rs: &[&ReadingRecord]| rs.iter().filter(|r| r.correct).count() as f64 / rs.len().max(1) as f64;
            let all: Vec<&ReadingRecord> = recs.iter().collect();
            let mut lengths: Vec<usize> = recs.iter().map(|r| r.length).collect();
            lengths.sort_unstable();
            lengths.dedup();
            let by_length = lengths
                .iter()
                .map(|&l| (l, acc(&recs.iter().filter(|r| r.length == l).collect::<Vec<_>>())))
                .collect();
            let counts: Vec<[usize; 3]> = recs.iter().filter_map(|r| r.filter_counts).collect();
            let (hits, kept, gold) =
                counts.iter().fold((0, 0, 0), |(h, k, g), c| (h + c[0], k + c[1], g + c[2]));
            let ratio = |a: usize, b: usize| (!counts.is_empty() && b > 0).then(|| a as f64 / b as f64);
            let vs_first = first.filter(|(f, _, _)| f != name).map(|(f, other, _)| {
                let pairs = recs.iter().zip(other);
                let only_this = pairs.clone().filter(|(a, b)| a.correct && !b.correct).count();
                let only_that = pairs.filter(|(a, b)| !a.correct && b.correct).count();
                Paired {
                    versus: f.clone(),
                    only_this,
                    only_that,
                    points: 100.0 * (only_this as f64 - only_that as f64) / recs.len().max(1) as f64,
                    p_value: scoring::mcnemar_exact(only_this, only_that),
                }
            });
            ArmSummary {
                arm: name.clone(),
                questions: recs.len(),
                accuracy: acc(&all),
                by_length,
                filter_precision: ratio(hits, kept),
                filter_recall: ratio(hits, gold),
                perplexity: *ppl,
                vs_first,
            }
        })
        .collect()
}

/// A markdown table of the summaries.
pub fn markdown(summaries: &[ArmSummary]) -> String {
    let pct = |x: Option<f64>| x.map_or("–".to_string(), |v| format!("{:.1}%", 100.0 * v));
    let mut s = String::from("| arm | questions | accuracy | by length | filter P / R (s>0) | perplexity | vs first (+/−, points, p) |\n|---|---|---|---|---|---|---|\n");
    for a in summaries {
        let lengths: Vec<String> = a.by_length.iter().map(|(l, v)| format!("{l}: {:.1}%", 100.0 * v)).collect();
        let paired = a.vs_first.as_ref().map_or("–".to_string(), |p| {
            format!("+{} / −{}, {:+.1}, p = {:.3}", p.only_this, p.only_that, p.points, p.p_value)
        });
        s.push_str(&format!(
            "| {} | {} | {:.1}% | {} | {} / {} | {:.2} | {} |\n",
            a.arm,
            a.questions,
            100.0 * a.accuracy,
            lengths.join(", "),
            pct(a.filter_precision),
            pct(a.filter_recall),
            a.perplexity,
            paired
        ));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mcnemar_matches_the_binomial_tail() {
        assert_eq!(scoring::mcnemar_exact(0, 0), 1.0);
        // 0 of 5 discordant pairs the other way: 2 · (1/32).
        assert!((scoring::mcnemar_exact(5, 0) - 0.0625).abs() < 1e-12);
        // 1 vs 9: 2 · (1 + 10) / 1024.
        assert!((scoring::mcnemar_exact(9, 1) - 22.0 / 1024.0).abs() < 1e-12);
        assert_eq!(scoring::mcnemar_exact(4, 4), 1.0);
        // Large n stays finite: 60 vs 140 is far beyond chance.
        let p = scoring::mcnemar_exact(140, 60);
        assert!(p > 0.0 && p < 1e-7, "{p}");
    }
}
