//! The rule-based extractive generator: for each fact-bearing sentence (numbers, dates,
//! capitalised names, quoted strings, `X is Y` copulas, possessives, `named/called Z`), several
//! differently-worded questions per fact (a direct wh-question, "According to the document, …"
//! with the full sentence as answer, a cloze, a typed or in-place variant, …), plus plain cloze
//! questions used only to reach `min_pairs`.
//!
//! - [`lexicon`]: word lists and the per-document [`lexicon::Lexicon`] of proper names;
//! - [`sentence`]: sentences and words as the rules see them;
//! - [`entities`]: the facts of a sentence (entities);
//! - [`clauses`]: copulas and short clauses rewritten out of long sentences;
//! - [`questions`]: the wordings of one fact.

mod clauses;
mod entities;
mod lexicon;
mod prose;
mod questions;
mod sentence;

use super::words::{content_tokens, is_stopword, normalize_question};
use super::{Candidate, QaOptions, QaPair, QaSource};
use crate::lift::absorb::text::Span;
use clauses::{clauses, copula_split};
use entities::{find_entities, passive_object, predicate_entity, Entity, Kind};
use lexicon::{decap, squeeze, Lexicon};
use questions::{direct_question, make_fact, shaped_questions};
use sentence::{words_of, Sent};
use std::collections::HashSet;

/// Facts taken from one sentence by the extractive generator.
const MAX_FACTS_PER_SENTENCE: usize = 2;

/// Short questions about one clause, each with its short answer: the direct wh-question of every
/// fact the rules find, a stranded-preposition variant ("What was X planked with?"), "When/In what
/// year" for dates reached through "in the spring of 1887", and an active agent question for
/// passives with a named agent ("was founded … by a carpenter named Tobias Wren" → "Who founded
/// the Saltmere Harbor Company?").
fn clause_questions(text: &str, offset: usize, lex: &Lexicon) -> Vec<(String, String)> {
    let words = words_of(text);
    let s = Sent { body: text, offset, words };
    let ws = &s.words;
    let n = ws.len();
    if n < 3 {
        return Vec::new();
    }
    let copula = copula_split(&s);
    let mut ents = find_entities(&s, lex);
    ents.extend(predicate_entity(&s, copula, &ents));
    if let Some(o) = passive_object(&s) {
        if !ents.iter().any(|e| e.w0 < o.w1 && o.w0 < e.w1) {
            ents.push(o);
        }
    }
    let mut out = Vec::new();
    for ent in &ents {
        let answer = text[ent.s..ent.e].to_string();
        out.extend(shaped_questions(&s, lex, ent, copula).into_iter().map(|q| (q, answer.clone())));
        // The general rules after, where the fact opens or closes the clause (so the question
        // stays short).
        if ent.w0 == 0 || ent.w1 == n {
            if let Some(d) = direct_question(&s, lex, ent, copula).question {
                out.push((d, answer.clone()));
            }
        }
    }
    out
}

/// All extractive candidates in document order (before the `max_pairs` cap).
pub(super) fn extractive_candidates(doc: &str, sentences: &[Span], opts: &QaOptions) -> Vec<Candidate> {
    let lex = Lexicon::new(doc, sentences);
    let per_fact = opts.wordings_per_fact.max(1);
    let mut out = Vec::new();
    let mut fact_idx = 0;
    let mut prev_name: Option<String> = None;
    for span in sentences {
        let Some(s) = Sent::new(doc, span) else {
            prev_name = None;
            continue;
        };
        // Real prose's shapes (definitions, conditions, duties) first: their questions are the
        // ones people ask of policies and manuals.
        for wordings in prose::prose_facts(s.body, &lex).into_iter().chain(sentence_facts(&s, &lex, &mut prev_name)) {
            out.extend(fact_candidates(doc, &s, fact_idx, wordings, per_fact));
            fact_idx += 1;
        }
    }
    out
}

/// The facts of one sentence, each as its wordings (question, answer), most direct first.
/// `prev_name` (the previous sentence's last name, for a possessive pronoun opening this one)
/// becomes this sentence's last name.
fn sentence_facts(s: &Sent, lex: &Lexicon, prev_name: &mut Option<String>) -> Vec<Vec<(String, String)>> {
    let mut by_answer = clause_questions_by_answer(s, lex, prev_name.as_deref());
    let copula = copula_split(s);
    let mut ents = find_entities(s, lex);
    *prev_name = last_name(s, &ents);
    ents.extend(predicate_entity(s, copula, &ents));
    ents.sort_by_key(|e| priority(s, copula, e));
    let mut facts: Vec<Vec<(String, String)>> = Vec::new();
    for ent in &ents {
        if facts.len() >= MAX_FACTS_PER_SENTENCE {
            break;
        }
        let Some(fact) = make_fact(s, lex, ent, copula) else {
            continue;
        };
        let answer = &s.body[ent.s..ent.e];
        let short = match by_answer.iter().position(|(a, _)| a == answer) {
            Some(i) => by_answer.remove(i).1,
            None => Vec::new(),
        };
        facts.push(interleave(short, answer, fact.questions));
    }
    // Facts only the clauses found (common nouns, predicates of coordinated clauses).
    let full = squeeze(s.body.trim());
    for (answer, qs) in by_answer.into_iter().take(MAX_FACTS_PER_SENTENCE) {
        let mut wordings = vec![(qs[0].clone(), answer.clone())];
        wordings.push((format!("According to the document, {}", decap(&qs[0], lex)), full.clone()));
        wordings.extend(qs[1..].iter().map(|q| (q.clone(), answer.clone())));
        facts.push(wordings);
    }
    facts
}

/// Short questions from the sentence's clauses, grouped by answer (in order); answers must be
/// verbatim in the sentence.
fn clause_questions_by_answer(s: &Sent, lex: &Lexicon, prev_name: Option<&str>) -> Vec<(String, Vec<String>)> {
    let mut by_answer: Vec<(String, Vec<String>)> = Vec::new();
    for clause in clauses(s, lex, prev_name) {
        for (q, a) in clause_questions(&clause, s.offset, lex) {
            if !s.body.contains(a.as_str()) || content_tokens(&a).is_empty() {
                continue;
            }
            match by_answer.iter_mut().find(|(x, _)| *x == a) {
                Some((_, qs)) => qs.push(q),
                None => by_answer.push((a, vec![q])),
            }
        }
    }
    by_answer
}

/// The sentence's last name of a person, place or thing (with its "the").
fn last_name(s: &Sent, ents: &[Entity]) -> Option<String> {
    let names = ents.iter().filter(|e| matches!(e.kind, Kind::Person | Kind::Place | Kind::Thing { .. }));
    let e = names.max_by_key(|e| e.w0)?;
    let the = e.w0 > 0 && s.words[e.w0 - 1].lower() == "the";
    let start = if the { s.words[e.w0 - 1].core.0 } else { e.s };
    Some(s.body[start..e.e].to_string())
}

/// Which entities become facts first: predicates of copulas and naming, numbers/dates, then names
/// (then by position).
fn priority(s: &Sent, copula: Option<usize>, e: &Entity) -> (usize, usize) {
    let pred = copula.is_some_and(|c| e.w0 > c && e.w1 == s.words.len());
    let p = match e.kind {
        _ if pred => 0,
        Kind::Number | Kind::Count { .. } | Kind::Year | Kind::Date | Kind::Time | Kind::Code => 1,
        Kind::Person | Kind::Quote => 2,
        Kind::Place | Kind::Thing { .. } => 3,
        Kind::Phrase => 4,
    };
    (p, e.w0)
}

/// A fact's wordings with its clause questions leading (short, the way people ask), each followed
/// by one of the sentence's wordings, then the rest of those.
fn interleave(short: Vec<String>, answer: &str, sentence_wordings: Vec<(String, String)>) -> Vec<(String, String)> {
    let mut wordings: Vec<(String, String)> = Vec::new();
    let mut rest = sentence_wordings.into_iter();
    for q in short {
        wordings.push((q, answer.to_string()));
        wordings.extend(rest.next());
    }
    wordings.extend(rest);
    wordings
}

/// Candidates for one fact: its first `per_fact` distinct wordings, ranked in order, with the whole
/// sentence as evidence.
fn fact_candidates(
    doc: &str,
    s: &Sent,
    fact: usize,
    wordings: Vec<(String, String)>,
    per_fact: usize,
) -> Vec<Candidate> {
    let ev = (s.offset, s.offset + s.body.len());
    let mut seen = HashSet::new();
    let mut out = Vec::new();
    for (q, a) in wordings {
        if out.len() >= per_fact {
            break;
        }
        if !seen.insert(normalize_question(&q)) {
            continue;
        }
        out.push(Candidate {
            rank: out.len(),
            fact,
            pair: QaPair {
                // One line each, as a reader writes them (the text may be hard-wrapped).
                question: squeeze(&q),
                answer: squeeze(&a),
                evidence: doc[ev.0..ev.1].to_string(),
                evidence_span: ev,
                source: QaSource::Extractive,
            },
        });
    }
    out
}

/// Whether an extractive pair reads as a question a person would ask: one line ending in `?` (or a
/// cloze), at least four words, not ending on a dangling auxiliary ("Together, what may?"), no
/// question word inside a section reference ("see §what number"), an answer with its brackets
/// closed that the question does not already give away.
pub(super) fn well_formed(question: &str, answer: &str) -> bool {
    const DANGLING: &[&str] = &[
        "may", "can", "must", "should", "will", "is", "are", "was", "were", "does", "do", "did", "has", "have", "the", "a",
        "of", "to", "which", "that", "and", "or", "even", "its", "their",
    ];
    let q = question.trim();
    let words: Vec<&str> = q.split_whitespace().collect();
    let Some(last) = words.last() else { return false };
    let cloze = is_cloze(q);
    let last = last.trim_end_matches('?').to_lowercase();
    let (answer_words, question_words) = (content_tokens(answer), content_tokens(q));
    let given_away = !cloze && !answer_words.is_empty() && answer_words.iter().all(|w| question_words.contains(w));
    (q.ends_with('?') || cloze)
        && !q.contains('\n')
        && words.len() >= 4
        && !DANGLING.contains(&last.as_str())
        && !q.contains("§what")
        && !q.contains("§ what")
        && prose::balanced(answer)
        && answer.chars().any(char::is_alphanumeric)
        && !given_away
}

/// A fill-in-the-blank wording (the cloze share of a document's pairs is capped).
pub(crate) fn is_cloze(question: &str) -> bool {
    question.contains("___")
}

/// Plain cloze questions over any sentence of six words or more (used only to reach `min_pairs`).
pub(super) fn fallback_candidates(doc: &str, sentences: &[Span]) -> Vec<Candidate> {
    let mut out = Vec::new();
    for (i, span) in sentences.iter().enumerate() {
        let text = span.text(doc);
        let words = words_of(text);
        if words.len() < 6 {
            continue;
        }
        // The last content word, blanked.
        let Some(k) = words
            .iter()
            .rposition(|w| w.text.len() >= 3 && !is_stopword(w.text) && w.text.chars().all(char::is_alphanumeric))
        else {
            continue;
        };
        let w = &words[k];
        let cloze = squeeze(&format!("{}___{}", &text[..w.core.0], &text[w.core.1..]));
        let pair = |q: String, a: String, rank| Candidate {
            rank,
            fact: i,
            pair: QaPair {
                question: q,
                answer: a,
                evidence: text.to_string(),
                evidence_span: (span.start, span.end),
                source: QaSource::Extractive,
            },
        };
        // Recitation before blanks: the cloze share of the pairs is capped.
        let half = words.len() / 2;
        let head = squeeze(&text[..words[half - 1].raw.1]);
        let tail = squeeze(&text[words[half].raw.0..]);
        out.push(pair(format!("Continue this sentence from the document: {head} ..."), tail, 0));
        out.push(pair(format!("Complete the sentence from the document: {cloze}"), w.text.to_string(), 1));
    }
    out
}

#[cfg(test)]
mod tests {
    use crate::lift::absorb::qa::tests::{assert_verbatim, PARAGRAPH};
    use super::is_cloze;
    use crate::lift::absorb::qa::{extractive_qa, normalize_question, QaOptions, QaPair, QaSource};
    use std::collections::{HashMap, HashSet};

    fn opts() -> QaOptions {
        QaOptions { max_pairs: 1000, ..Default::default() }
    }

    fn extract(doc: &str, opts: &QaOptions) -> Vec<QaPair> {
        extractive_qa(doc, opts)
    }

    fn find<'a>(pairs: &'a [QaPair], q: &str) -> Option<&'a QaPair> {
        pairs.iter().find(|p| p.question == q)
    }

    #[test]
    fn a_copula_with_nothing_after_it_has_no_predicate_fact() {
        // From a real essay: the predicate's words after "were about" are none (a number), and the
        // predicate was read past the sentence's last word.
        let doc = "I left Yahoo in 1999, so I don't know exactly how many users they have now, but the last I heard \
                   there were about 20,000. The harbor master is Ilse Moreau.";
        let pairs = extract(doc, &opts());
        assert_verbatim(doc, &pairs);
        assert!(pairs.iter().any(|p| p.answer == "Ilse Moreau"), "{pairs:#?}");
    }

    #[test]
    fn extractive_wordings_short_and_full_answers() {
        let pairs = extract(PARAGRAPH, &opts());
        assert_verbatim(PARAGRAPH, &pairs);
        let sentence = "The vault code at the Lisbon office is 4417.";
        let about: Vec<&QaPair> = pairs.iter().filter(|p| p.evidence == sentence).collect();
        assert!(about.len() >= 4, "several wordings per fact: {about:#?}");
        assert_eq!(find(&pairs, "What is the vault code at the Lisbon office?").unwrap().answer, "4417");
        assert_eq!(
            find(&pairs, "According to the document, what is the vault code at the Lisbon office?").unwrap().answer,
            sentence
        );
        assert_eq!(
            find(&pairs, "Complete the sentence from the document: The vault code at the Lisbon office is ___.")
                .unwrap()
                .answer,
            "4417"
        );
        assert_eq!(find(&pairs, "Which number is the vault code at the Lisbon office?").unwrap().answer, "4417");
        // Names, dates, places, counts, possessives, naming.
        assert_eq!(find(&pairs, "By whom was the museum founded?").unwrap().answer, "Elena Marsh");
        assert_eq!(find(&pairs, "Who was its first director?").unwrap().answer, "Tomas Berg");
        assert_eq!(find(&pairs, "A fire damaged the east wing on what date?").unwrap().answer, "March 3, 1999");
        assert_eq!(find(&pairs, "How many books does the library have about navigation?").unwrap().answer, "12,000");
        assert_eq!(find(&pairs, "Whose favourite exhibit is the brass telescope?").unwrap().answer, "Anna");
        assert_eq!(find(&pairs, "What is the museum's oldest ship model called?").unwrap().answer, "Morning Star");
        assert_eq!(find(&pairs, "In 2005, who became the chief curator?").unwrap().answer, "Maria Santos");
        assert_eq!(
            find(&pairs, "From where can visitors reach the museum in ten minutes?").unwrap().answer,
            "Central Station"
        );
        // Every fact has short answers and a full-sentence answer.
        let full = pairs.iter().filter(|p| p.answer == p.evidence).count();
        let short = pairs.iter().filter(|p| p.answer.len() < p.evidence.len() / 2).count();
        assert!(full >= 8 && short >= 20, "full {full}, short {short}");
        // No repeated questions; all extractive.
        let qs: HashSet<String> = pairs.iter().map(|p| normalize_question(&p.question)).collect();
        assert_eq!(qs.len(), pairs.len());
        assert!(pairs.iter().all(|p| p.source == QaSource::Extractive));
    }

    #[test]
    fn clause_questions_are_short_and_natural() {
        let doc = "The museum's oldest bell, cast in 1742 after a long winter, still rings at noon. \
                   The keeper's cottage stood beside the Marsh Hall. Her roof was covered with slate from the \
                   northern quarries, and the rent of the cottage was 40 shillings. In 1903 the society bought \
                   a printing press. The chief engineer in those years was a patient man named Arvid Holm, who \
                   had trained in Glasgow. The library was founded by a teacher named Ruth Ellery. The safe was \
                   opened with the code 5531. The favourite dish of the crew was salted cod with potatoes.";
        let o = QaOptions { max_pairs: 1000, wordings_per_fact: 12, ..Default::default() };
        let pairs = extract(doc, &o);
        assert_verbatim(doc, &pairs);
        for (q, a) in [
            ("When was the museum's oldest bell cast?", "1742"),
            ("In what year was the museum's oldest bell cast?", "1742"),
            ("What was the Marsh Hall's roof covered with?", "slate"),
            ("How many shillings was the rent of the cottage?", "40"),
            ("When did the society buy a printing press?", "1903"),
            ("Who was the chief engineer in those years?", "Arvid Holm"),
            ("Who had trained in Glasgow?", "Arvid Holm"),
            ("Who founded the library?", "Ruth Ellery"),
            ("What code was the safe opened with?", "5531"),
            ("What was the favourite dish of the crew?", "salted cod with potatoes"),
        ] {
            let p = find(&pairs, q).unwrap_or_else(|| {
                panic!("missing {q:?} in {:#?}", pairs.iter().map(|p| &p.question).collect::<Vec<_>>())
            });
            assert_eq!(p.answer, a, "{q}");
            // The evidence is the whole sentence the answer came from.
            assert!(p.evidence.contains(a) && p.evidence.ends_with('.'), "{p:?}");
        }
    }

    #[test]
    fn extractive_is_deterministic_and_covers_the_whole_text() {
        let o = QaOptions { max_pairs: 1000, wordings_per_fact: 4, ..Default::default() };
        let a = extract(PARAGRAPH, &o);
        let b = extract(PARAGRAPH, &o);
        assert_eq!(serde_json::to_string(&a).unwrap(), serde_json::to_string(&b).unwrap());
        let has = |needle: &str| a.iter().any(|p| p.answer.contains(needle) && p.answer != p.evidence);
        assert!(has("1987") && has("4417") && has("March 3, 1999") && has("Central Station"));
        // Wordings per fact are capped.
        let mut per: HashMap<(usize, String), usize> = HashMap::new();
        for p in &a {
            if p.answer != p.evidence {
                *per.entry((p.evidence_span.0, p.answer.clone())).or_default() += 1;
            }
        }
        assert!(per.values().all(|&n| n <= 4));

        // A tight cap keeps the start, middle and end covered.
        let small = QaOptions { max_pairs: 8, min_pairs: 0, ..Default::default() };
        let few = extract(PARAGRAPH, &small);
        assert_eq!(few.len(), 8);
        assert_verbatim(PARAGRAPH, &few);
        let third = PARAGRAPH.len() / 3;
        assert!(few.iter().any(|p| p.evidence_span.0 < third));
        assert!(few.iter().any(|p| p.evidence_span.0 >= third && p.evidence_span.0 < 2 * third));
        assert!(few.iter().any(|p| p.evidence_span.0 >= 2 * third));
    }

    #[test]
    fn extractive_fills_min_pairs_without_facts() {
        let doc = "the old cat slept under the warm kitchen stove all afternoon.\n\n\
                   a gentle rain kept falling on the quiet garden outside.\n\n\
                   nobody in the house wanted to go out into the cold wet evening.";
        let o = QaOptions { min_pairs: 5, ..Default::default() };
        let pairs = extract(doc, &o);
        // The floor is not filled with blanks: recitation pairs, and cloze within its share.
        assert!(pairs.len() >= 3, "{pairs:#?}");
        let cloze = pairs.iter().filter(|p| is_cloze(&p.question)).count();
        assert!(cloze * 4 <= pairs.len(), "{cloze} cloze of {}: {pairs:#?}", pairs.len());
        assert_verbatim(doc, &pairs);
        assert!(extract("", &o).is_empty());
    }

    #[test]
    fn sentence_spans_feed_extractive_evidence() {
        let doc = "# Notes\n\n- The gate code is 9021.\n- Dr. Ruth Klein runs the lab.\n\nShe joined in 2019.";
        let pairs = extract(doc, &opts());
        assert_verbatim(doc, &pairs);
        assert!(pairs.iter().any(|p| p.answer == "9021" && p.evidence == "The gate code is 9021."));
        assert!(pairs.iter().any(|p| p.answer.contains("Ruth Klein")));
        assert!(pairs.iter().any(|p| p.answer == "2019"));
        assert!(!pairs.iter().any(|p| p.evidence.contains("Notes")));
    }

    #[test]
    fn random_text_never_breaks_the_rules() {
        // Pseudo-random "documents" of words, numbers, names, punctuation, quotes and non-ASCII.
        let pieces = [
            "the", "museum", "Anna", "Berg's", "is", "was", "in", "1987", "3.14", "4,200", "LKN-7", "Dr.", "U.S.",
            "\"Star\"", "“Moon”", "(see", "p.", "12)", "Zürich", "日本", "😀", "e.g.", "March", "3,", "named",
            "called", ",", ".", "!", "?", "...", "\n", "\n\n", "- ", "# ", "1. ", "'s", "—", "$x$", "{", "}", "has",
            "42", "rooms", "by", "Maria", "Santos", "at", "7:30", "p.m.", "Tuesday",
        ];
        let mut state = 0x2545_F491_4F6C_DD1Du64;
        for _ in 0..200 {
            let mut doc = String::new();
            for _ in 0..60 {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                doc.push_str(pieces[(state % pieces.len() as u64) as usize]);
                if !state.is_multiple_of(3) {
                    doc.push(' ');
                }
            }
            let pairs = extractive_qa(&doc, &QaOptions { min_pairs: 3, ..Default::default() });
            assert_verbatim(&doc, &pairs);
            let qs: HashSet<String> = pairs.iter().map(|p| normalize_question(&p.question)).collect();
            assert_eq!(qs.len(), pairs.len());
        }
    }

    /// Development aid: `QA_DOC=path cargo test --release --lib print_extractive -- --ignored --nocapture`.
    #[test]
    #[ignore]
    fn print_extractive() {
        let doc = std::env::var("QA_DOC")
            .map(|p| std::fs::read_to_string(p).unwrap())
            .unwrap_or_else(|_| PARAGRAPH.to_string());
        let o = QaOptions { max_pairs: 100_000, ..Default::default() };
        for p in extract(&doc, &o) {
            eprintln!("{}  =>  {}", p.question, p.answer);
        }
    }
}
