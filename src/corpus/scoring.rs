//! Answer scoring, SQuAD-style: answers are normalised (lower case, punctuation and the articles
//! a/an/the removed, whitespace collapsed) and compared by exact match and by token F1, each the
//! best over the accepted answers. `contains` (the normalised answer occurs as a run of whole words
//! in the normalised prediction) is reported beside them: a small chat model tends to answer in a
//! sentence ("The safe opens with 4817."), which exact match scores 0.

use serde::{Deserialize, Serialize};
use std::collections::HashMap;

/// SQuAD's `normalize_answer`: lower case, drop punctuation, drop articles, collapse whitespace.
pub fn normalize(s: &str) -> String {
    let lower = s.to_lowercase();
    let no_punct: String = lower
        .chars()
        .map(|c| {
            if c.is_alphanumeric() || c.is_whitespace() {
                c
            } else if c == '\'' || c == '’' {
                '\0'
            } else {
                ' '
            }
        })
        .filter(|&c| c != '\0')
        .collect();
    no_punct.split_whitespace().filter(|w| !matches!(*w, "a" | "an" | "the")).collect::<Vec<_>>().join(" ")
}

fn tokens(s: &str) -> Vec<String> {
    normalize(s).split_whitespace().map(str::to_string).collect()
}

/// 1.0 when the normalised strings are equal.
pub fn exact_match(prediction: &str, gold: &str) -> f64 {
    f64::from(normalize(prediction) == normalize(gold))
}

/// Token-level F1 between the normalised prediction and answer (bag of words, SQuAD).
pub fn f1(prediction: &str, gold: &str) -> f64 {
    let p = tokens(prediction);
    let g = tokens(gold);
    if p.is_empty() || g.is_empty() {
        return f64::from(p == g);
    }
    let mut counts: HashMap<&str, isize> = HashMap::new();
    for t in &g {
        *counts.entry(t).or_default() += 1;
    }
    let mut common = 0usize;
    for t in &p {
        if let Some(c) = counts.get_mut(t.as_str()) {
            if *c > 0 {
                *c -= 1;
                common += 1;
            }
        }
    }
    if common == 0 {
        return 0.0;
    }
    let precision = common as f64 / p.len() as f64;
    let recall = common as f64 / g.len() as f64;
    2.0 * precision * recall / (precision + recall)
}

/// 1.0 when the normalised answer occurs in the normalised prediction as whole words.
pub fn contains(prediction: &str, gold: &str) -> f64 {
    let p = tokens(prediction);
    let g = tokens(gold);
    if g.is_empty() {
        return 0.0;
    }
    f64::from(p.windows(g.len()).any(|w| w == g.as_slice()))
}

/// The three scores of one prediction, each the best over `answers`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Scores {
    pub em: f64,
    pub f1: f64,
    pub contains: f64,
}

pub fn score(prediction: &str, answers: &[String]) -> Scores {
    let best = |f: fn(&str, &str) -> f64| answers.iter().map(|a| f(prediction, a)).fold(0.0, f64::max);
    Scores { em: best(exact_match), f1: best(f1), contains: best(contains) }
}

/// McNemar's exact test: two-sided binomial p for `b` vs `c` discordant pairs (p = ½).
pub fn mcnemar_exact(b: usize, c: usize) -> f64 {
    let n = b + c;
    if n == 0 {
        return 1.0;
    }
    // P(X ≤ min(b, c)) for X ~ Bin(n, ½), doubled, in logs (n can be a few hundred).
    let ln_choose = |k: usize| -> f64 { (1..=k).map(|i| ((n - k + i) as f64 / i as f64).ln()).sum() };
    let tail: f64 = (0..=b.min(c)).map(|k| (ln_choose(k) - n as f64 * std::f64::consts::LN_2).exp()).sum();
    (2.0 * tail).min(1.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalisation_is_squads() {
        assert_eq!(normalize("The  Eiffel-Tower, in PARIS!"), "eiffel tower in paris");
        assert_eq!(normalize("an apple a day"), "apple day");
        assert_eq!(normalize("Ada's"), "adas");
        assert_eq!(normalize("  "), "");
    }

    #[test]
    fn hand_examples() {
        assert_eq!(exact_match("4817.", "4817"), 1.0);
        assert_eq!(exact_match("The answer is 4817", "4817"), 0.0);
        assert_eq!(contains("The answer is 4817.", "4817"), 1.0);
        assert_eq!(contains("48170", "4817"), 0.0, "whole words only");
        assert_eq!(contains("Mirela Vasquez kept it", "mirela vasquez"), 1.0);
        assert_eq!(contains("Vasquez Mirela", "Mirela Vasquez"), 0.0, "order matters");
        // prediction "mirela ruiz" vs gold "mirela vasquez": 1 common, P = R = 1/2.
        assert!((f1("Mirela Ruiz", "Mirela Vasquez") - 0.5).abs() < 1e-12);
        // "the safe opens with 4817" → [safe, opens, with, 4817]: P = 1/4, R = 1, F1 = 0.4.
        assert!((f1("The safe opens with 4817", "4817") - 0.4).abs() < 1e-12);
        assert_eq!(f1("nothing here", "4817"), 0.0);
        assert_eq!(f1("", ""), 1.0);
        // Repeated words count once per occurrence in the answer.
        assert!((f1("paris paris", "paris") - 2.0 / 3.0).abs() < 1e-12);
        let s = score("It was in Porto.", &["Lisbon".into(), "Porto".into()]);
        assert_eq!((s.em, s.contains), (0.0, 1.0));
        // [it, was, in, porto] vs [porto]: P = 1/4, R = 1, F1 = 0.4.
        assert!((s.f1 - 0.4).abs() < 1e-12, "{s:?}");
    }
}
