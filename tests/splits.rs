//! The prepared base never trains on what the eval asks: none of the base's templates (train or
//! held-out) shares a word 3-gram with the eval's needles, and none of its values is an eval value.
//! Here, not in either module: `base` and `eval` do not import each other.

use lift_serve::base::data::{vocabulary, Vocabulary};
use lift_serve::corpus::scoring::normalize;
use lift_serve::corpus::Split;
use lift_serve::eval::needles;
use std::collections::HashSet;

/// Word 3-grams of a template text, placeholders dropped.
fn trigrams(s: &str) -> HashSet<String> {
    let mut text = s.to_string();
    for slot in ["{S}", "{V}", "{X}", "{Y}", "{B}"] {
        text = text.replace(slot, " ");
    }
    let w: Vec<String> = normalize(&text).split_whitespace().map(str::to_string).collect();
    w.windows(3).map(|g| g.join(" ")).collect()
}

#[test]
fn the_base_trains_on_no_template_or_value_of_the_eval() {
    let eval_texts =
        needles::TEMPLATES.iter().flat_map(|t| [t.sentence, t.question].into_iter().chain(t.distractor).chain(t.bridge));
    let eval: HashSet<String> = eval_texts.flat_map(trigrams).collect();
    let eval_pool: HashSet<String> =
        [needles::FIRST, needles::LAST, needles::PLACES].concat().iter().map(|s| s.to_lowercase()).collect();
    for (name, split) in [("train", Split::Train), ("held-out", Split::Validation)] {
        let Vocabulary { texts, words, quantities, years } = vocabulary(split);
        let ours: HashSet<String> = texts.iter().flat_map(|s| trigrams(s)).collect();
        assert!(ours.is_disjoint(&eval), "{name} shares {:?} with eval", ours.intersection(&eval).collect::<Vec<_>>());
        for w in &words {
            assert!(!eval_pool.contains(&w.to_lowercase()), "{name}: {w} is an eval value");
        }
        // Numbers: quantities have 3 digits, the eval's 2 or 4; years on either side of the eval's.
        let (q0, q1) = (*quantities.start() as i32, *quantities.end() as i32);
        for r in [needles::NUMBERS, needles::SMALL_NUMBERS] {
            assert!(q1 < r.start || q0 >= r.end, "{name}: quantities {q0}..={q1} meet the eval's {r:?}");
        }
        let (y0, y1) = (*years.start() as i32, *years.end() as i32);
        assert!(y1 < needles::YEARS.start || y0 >= needles::YEARS.end, "{name}: years {y0}..={y1}");
    }
}
