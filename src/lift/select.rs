//! Which auxiliary questions to train on: LongRecipe's impactful-token analysis ("LongRecipe:
//! Recipe for Efficient Long Context Generalization in Large Language Models", §4.1) turned to a
//! document's questions (`plan.qa_select`).
//!
//! LongRecipe compares the logits of a model that reads the long context with those of one that
//! does not, and trains on the sentences holding the tokens that change most. Here the reader is
//! context distillation's teacher (the frozen model with the prepared base, the question's evidence
//! shown first: `answer::evidence_prompt`) and the other is the student as training lays the
//! question out (the plan's layout, no document adapter yet). A question's impact is how much
//! reading its evidence lowers the answer's cross-entropy: a question the student already answers,
//! or the teacher cannot, teaches the adapter little. Facts are kept or dropped whole (a fact's
//! wordings share its evidence span), the most impactful first, until the share asked for is kept.
//! Both passes run once per question, without a graph; they count in the absorb's tokens.

use super::distill::answer_logits;
use super::plan::{Example, TeacherRow};
use super::qa::QaPair;
use crate::model::filter::Chunk;
use crate::model::{ops, Model};
use anyhow::{ensure, Result};
use candle_core::{DType, Tensor};
use std::collections::HashMap;

/// The questions kept, by index into the pairs, ascending, and the passes run to choose them.
#[derive(Clone, Debug)]
pub struct Selection {
    pub kept: Vec<usize>,
    pub passes: usize,
    pub tokens: usize,
}

/// The answer's mean cross-entropy in `example` under the frozen model, its filter masking
/// `chunks`.
fn answer_loss(model: &Model, example: &Example, chunks: &[Chunk]) -> Result<f64> {
    let logits = answer_logits(model, example, chunks)?;
    let n = example.tokens.len();
    let targets: Vec<u32> = (1..n).filter(|&i| example.target[i]).map(|i| example.tokens[i]).collect();
    let dev = logits.device();
    let weights = Tensor::ones(targets.len(), DType::F32, dev)?;
    let loss = ops::cross_entropy_masked(&logits, &Tensor::new(targets.as_slice(), dev)?, &weights)?;
    Ok(loss.to_scalar::<f32>()? as f64)
}

/// Keeps about `keep` (0–1] of `pairs`, the facts whose evidence most lowers their answers'
/// loss first. `student[i]`: pair i's training row and its filter chunks; `teacher[i]`: the same
/// answer with the evidence shown.
pub fn impactful(
    model: &Model,
    pairs: &[QaPair],
    student: &[(&Example, &[Chunk])],
    teacher: &[TeacherRow],
    keep: f64,
    cancel: &dyn Fn() -> bool,
) -> Result<Selection> {
    ensure!(keep > 0.0 && keep <= 1.0, "qa_select must be in (0, 1], not {keep}");
    ensure!(student.len() == pairs.len() && teacher.len() == pairs.len(), "one student and one teacher row per question");
    let mut impact = Vec::with_capacity(pairs.len());
    let mut tokens = 0;
    for ((example, chunks), row) in student.iter().zip(teacher) {
        if cancel() {
            return Err(super::Cancelled("selecting the questions").into());
        }
        ensure!(example.target_count() == row.example.target_count(), "the teacher's answer is not the student's");
        impact.push(answer_loss(model, example, chunks)? - answer_loss(model, &row.example, &row.chunks)?);
        tokens += example.tokens.len() + row.example.tokens.len();
    }
    let kept = keep_facts(pairs, &impact, keep);
    Ok(Selection { kept, passes: 2 * pairs.len(), tokens })
}

/// The indices of the facts (pairs grouped by evidence span) kept, the most impactful fact (its
/// best wording's impact) first, until at least `keep` of the pairs are in; ascending.
fn keep_facts(pairs: &[QaPair], impact: &[f64], keep: f64) -> Vec<usize> {
    let mut facts: HashMap<(usize, usize), Vec<usize>> = HashMap::new();
    for (i, p) in pairs.iter().enumerate() {
        facts.entry(p.evidence_span).or_default().push(i);
    }
    let best = |f: &Vec<usize>| f.iter().map(|&i| impact[i]).fold(f64::NEG_INFINITY, f64::max);
    let mut facts: Vec<Vec<usize>> = facts.into_values().collect();
    // Most impactful first; equal ones in document order (their first pair's index).
    facts.sort_by(|a, b| best(b).total_cmp(&best(a)).then(a[0].cmp(&b[0])));
    let want = (keep * pairs.len() as f64).ceil() as usize;
    let mut kept = Vec::new();
    for f in facts {
        if kept.len() >= want {
            break;
        }
        kept.extend(f);
    }
    kept.sort_unstable();
    kept
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lift::qa::QaSource;

    fn pair(span: (usize, usize)) -> QaPair {
        QaPair { question: "q".into(), answer: "a".into(), evidence: "e".into(), evidence_span: span, source: QaSource::Extractive }
    }

    #[test]
    fn facts_are_kept_whole_the_most_impactful_first() {
        // Three facts: A (pairs 0, 3), B (1, 4), C (2).
        let pairs = [pair((0, 5)), pair((6, 9)), pair((10, 12)), pair((0, 5)), pair((6, 9))];
        let impact = [0.1, 2.0, 1.0, 0.2, -0.5];
        // B's best wording (2.0) leads, then C (1.0), then A (0.2).
        assert_eq!(keep_facts(&pairs, &impact, 0.4), vec![1, 4]);
        assert_eq!(keep_facts(&pairs, &impact, 0.5), vec![1, 2, 4]);
        assert_eq!(keep_facts(&pairs, &impact, 0.61), vec![0, 1, 2, 3, 4]);
        assert_eq!(keep_facts(&pairs, &impact, 1.0), vec![0, 1, 2, 3, 4]);
    }
}
