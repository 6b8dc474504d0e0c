//! Long-document QA built offline from real prose: essays are joined and cut to a target length
//! in tokens, and facts ("needles": numbers, names, places, dates, and confusable near-duplicate
//! pairs) are planted at sentence boundaries at controlled relative depths. Each needle's
//! question is worded differently from the planted sentence, as a user would ask it; paraphrased
//! needles share no content word with their sentence, and two-hop needles need two sentences
//! planted apart (the question names someone only through the first, the answer is in the
//! second).

use crate::corpus::Essay;
use super::{EvalDocument, EvalQuestion};
use crate::lift::absorb::text::split_sentences;
use crate::model::Model;
use anyhow::{bail, Result};
use rand::rngs::StdRng;
use rand::seq::{IndexedRandom, SliceRandom};
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FactKind {
    Number,
    Name,
    Place,
    Date,
    /// Two near-duplicate facts are planted (the other one at another depth); the question asks
    /// for one of them.
    Confusable,
    /// The question shares no content word with the planted sentence (synonyms, other phrasing):
    /// word-matching retrieval has nothing to match.
    Paraphrase,
    /// Two sentences planted apart: the first names a person (the bridge), the second tells the
    /// answer about that person by name only. The question describes the person as the first
    /// sentence does.
    TwoHop,
}

#[derive(Clone, Copy, Debug)]
enum Slot {
    Number,
    SmallNumber,
    Name,
    Place,
    Date,
}

/// A fact: the planted sentence (`{X}` is the answer), its distractor for confusable pairs
/// (`{Y}`, a different value of the same slot), the first hop of a two-hop fact (`{B}`, a
/// person's name, which the answer's sentence also names) and the question.
pub struct Template {
    pub kind: FactKind,
    slot: Slot,
    pub sentence: &'static str,
    pub distractor: Option<&'static str>,
    pub bridge: Option<&'static str>,
    pub question: &'static str,
}

const fn t(kind: FactKind, slot: Slot, sentence: &'static str, question: &'static str) -> Template {
    Template { kind, slot, sentence, distractor: None, bridge: None, question }
}

const fn pair(slot: Slot, sentence: &'static str, distractor: &'static str, question: &'static str) -> Template {
    Template { kind: FactKind::Confusable, slot, sentence, distractor: Some(distractor), bridge: None, question }
}

const fn two_hop(slot: Slot, bridge: &'static str, sentence: &'static str, question: &'static str) -> Template {
    Template { kind: FactKind::TwoHop, slot, sentence, distractor: None, bridge: Some(bridge), question }
}

use FactKind::{Date as D, Name as N, Paraphrase as W, Number as U, Place as P};

/// Every template has its own subject, so the needles of one document never collide.
pub const TEMPLATES: &[Template] = &[
    t(
        U,
        Slot::Number,
        "The combination of the archive's old safe was {X}.",
        "What number opens the old safe in the archive?",
    ),
    t(
        U,
        Slot::Number,
        "Exactly {X} crates of oranges were stored in the warehouse on Pier Street.",
        "How many orange crates did the Pier Street warehouse hold?",
    ),
    t(
        U,
        Slot::Number,
        "The night guard at the harbor museum wore badge number {X}.",
        "What was the badge number of the harbor museum's night watchman?",
    ),
    t(
        U,
        Slot::Number,
        "Our patent for the folding kayak was filed as application {X}.",
        "Under which application number was the folding kayak patented?",
    ),
    t(
        N,
        Slot::Name,
        "For eleven years the lighthouse on the northern cape was kept by {X}.",
        "Who looked after the northern cape's lighthouse?",
    ),
    t(
        N,
        Slot::Name,
        "The very first check we received came from an investor named {X}.",
        "Which investor wrote the company's first check?",
    ),
    t(
        N,
        Slot::Name,
        "The blue glass bottles were designed by a chemist called {X}.",
        "Who came up with the design of the blue glass bottles?",
    ),
    t(
        N,
        Slot::Name,
        "The youngest violinist in the orchestra, {X}, learned to play on a borrowed instrument.",
        "What is the name of the orchestra's youngest violin player?",
    ),
    t(
        P,
        Slot::Place,
        "The startup's first office was a room above a bakery in {X}.",
        "In which city did the startup have its first office?",
    ),
    t(
        P,
        Slot::Place,
        "Every summer the chess club traveled to {X} for its annual tournament.",
        "Where did the chess club go for its yearly summer tournament?",
    ),
    t(
        P,
        Slot::Place,
        "The rare maps were eventually sold to a library in {X}.",
        "Which city's library bought the rare maps in the end?",
    ),
    t(
        D,
        Slot::Date,
        "The bridge over the Malden river was opened to traffic on {X}.",
        "When could cars first cross the Malden river bridge?",
    ),
    t(
        D,
        Slot::Date,
        "The founders signed the lease for the workshop on {X}.",
        "On what date was the workshop's lease signed?",
    ),
    t(
        D,
        Slot::Date,
        "The first issue of the Lantern Gazette came off the press on {X}.",
        "When was the Lantern Gazette's first issue printed?",
    ),
    pair(
        Slot::Number,
        "The code for the blue locker in the gym is {X}.",
        "The code for the red locker in the gym is {Y}.",
        "What combination unlocks the blue locker at the gym?",
    ),
    pair(
        Slot::SmallNumber,
        "The evening train to Ashford leaves from platform {X}.",
        "The evening train to Ashby leaves from platform {Y}.",
        "At what platform can I catch the Ashford train in the evening?",
    ),
    pair(
        Slot::Name,
        "The older twin, {X}, moved to the coast after college.",
        "The younger twin, {Y}, stayed on the family farm.",
        "Which of the twins went to live by the coast?",
    ),
    pair(
        Slot::Place,
        "The red prototype was assembled in {X}.",
        "The green prototype was assembled in {Y}.",
        "In which city did they put together the red prototype?",
    ),
    t(
        W,
        Slot::Number,
        "In its first year the ferry carried {X} passengers across the strait.",
        "How many people rode the boat over the channel during its opening twelve months?",
    ),
    t(
        W,
        Slot::Name,
        "The recipe for the famous plum cake was written down by {X}.",
        "Who set out on paper how to bake that well-known fruit dessert?",
    ),
    t(
        W,
        Slot::Place,
        "The orchestra made its final album in {X}.",
        "Where did the musicians record their last LP?",
    ),
    t(
        W,
        Slot::Date,
        "The observatory's telescope first saw starlight on {X}.",
        "When did the astronomers begin using their big lens?",
    ),
    two_hop(
        Slot::Place,
        "The pilot who guided the tall ship into the harbor was {B}.",
        "{B} had grown up in {X}.",
        "In which town did the pilot who brought the tall ship in spend their childhood?",
    ),
    two_hop(
        Slot::Number,
        "The prize for the best pear orchard went to {B}.",
        "{B} kept exactly {X} beehives behind the barn.",
        "How many beehives did the winner of the pear orchard prize keep?",
    ),
    two_hop(
        Slot::Date,
        "The new clock tower was designed by an architect named {B}.",
        "{B} got married on {X}.",
        "When did the architect of the clock tower marry?",
    ),
    two_hop(
        Slot::Name,
        "The stolen painting was recovered by a detective called {B}.",
        "{B} had trained under a mentor named {X}.",
        "Who taught the detective that found the stolen painting?",
    ),
];

pub const FIRST: &[&str] = &[
    "Mirela", "Tobias", "Ingrid", "Oswin", "Priya", "Lucian", "Marisol", "Anselm", "Dagny", "Ferran", "Ilse",
    "Casimir", "Yara", "Bertil", "Noemi", "Evander",
];
pub const LAST: &[&str] = &[
    "Vasquez", "Okafor", "Lindqvist", "Marchetti", "Haldane", "Novak", "Castellanos", "Brightwater", "Szabo", "Quimby",
    "Ferreira", "Abernathy", "Kowalczyk", "Thorne", "Achterberg", "Delacroix",
];
pub const PLACES: &[&str] = &[
    "Trondheim", "Valparaiso", "Ljubljana", "Tallinn", "Bergen", "Tbilisi", "Cusco", "Hobart", "Windhoek", "Galway",
    "Plovdiv", "Timisoara", "Aarhus", "Coimbra", "Salzburg", "Antofagasta",
];
/// Ranges of the numbers and years drawn (public so other data can stay disjoint from the eval's).
pub const NUMBERS: std::ops::Range<i32> = 1000..10000;
pub const SMALL_NUMBERS: std::ops::Range<i32> = 11..100;
pub const YEARS: std::ops::Range<i32> = 1921..2000;
const MONTHS: &[&str] = &[
    "January", "February", "March", "April", "May", "June", "July", "August", "September", "October", "November",
    "December",
];

/// A drawn value: the text planted and the answers accepted for it.
fn draw(slot: Slot, rng: &mut StdRng) -> (String, Vec<String>) {
    match slot {
        Slot::Number => {
            let v = rng.random_range(NUMBERS).to_string();
            (v.clone(), vec![v])
        }
        Slot::SmallNumber => {
            let v = rng.random_range(SMALL_NUMBERS).to_string();
            (v.clone(), vec![v])
        }
        Slot::Name => {
            let v = format!("{} {}", FIRST.choose(rng).unwrap(), LAST.choose(rng).unwrap());
            (v.clone(), vec![v])
        }
        Slot::Place => {
            let v = PLACES.choose(rng).unwrap().to_string();
            (v.clone(), vec![v])
        }
        Slot::Date => {
            let (m, d, y) = (MONTHS.choose(rng).unwrap(), rng.random_range(1..29), rng.random_range(YEARS));
            (format!("{m} {d}, {y}"), vec![format!("{m} {d}, {y}"), format!("{d} {m} {y}")])
        }
    }
}

/// How a set of documents is built.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct NeedleSpec {
    /// Document lengths in tokens of the evaluated model's tokenizer.
    pub lengths: Vec<usize>,
    /// Relative depths (0 = start, 1 = end) at which needles are planted.
    pub depths: Vec<f64>,
    /// Needles (questions) per depth in each document.
    pub needles_per_depth: usize,
    /// Documents per length.
    pub docs_per_length: usize,
    pub seed: u64,
}

impl Default for NeedleSpec {
    fn default() -> Self {
        Self {
            lengths: vec![1024, 2048],
            depths: vec![0.0, 0.5, 1.0],
            needles_per_depth: 2,
            docs_per_length: 1,
            seed: 0,
        }
    }
}

/// Builds every document of `spec` from `essays`, deterministically for `spec.seed`.
pub fn build_set(model: &Model, essays: &[Essay], spec: &NeedleSpec) -> Result<Vec<EvalDocument>> {
    let mut docs = Vec::new();
    for (li, &len) in spec.lengths.iter().enumerate() {
        for k in 0..spec.docs_per_length {
            let seed = spec.seed.wrapping_mul(1_000_003).wrapping_add((li * 1000 + k) as u64);
            let mut doc = build_document(model, essays, len, &spec.depths, spec.needles_per_depth, seed)?;
            doc.id = format!("len{len}-{k}");
            docs.push(doc);
        }
    }
    Ok(docs)
}

/// What a planted sentence is to its question.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Role {
    /// It holds the answer.
    Answer,
    /// A near-duplicate that does not answer (confusable pairs).
    Distractor,
    /// The first hop of a two-hop fact: needed evidence without the answer.
    Bridge,
}

/// One planted sentence: which needle it belongs to and what it is to the question.
struct Plant {
    text: String,
    depth: f64,
    needle: usize,
    role: Role,
}

/// Byte offsets of each token of `text` (the tokenizer's own offsets).
pub fn token_offsets(model: &Model, text: &str) -> Result<Vec<(usize, usize)>> {
    let enc = model.tokenizer.inner().encode(text, false).map_err(|e| anyhow::anyhow!("tokenization failed: {e}"))?;
    Ok(enc.get_offsets().to_vec())
}

/// Token range `[a, b)` covering bytes `[start, end)` of the text whose token offsets are given.
pub fn token_span(offsets: &[(usize, usize)], start: usize, end: usize) -> (usize, usize) {
    let a = offsets.iter().position(|o| o.1 > start).unwrap_or(offsets.len());
    let b = offsets.iter().rposition(|o| o.0 < end).map_or(a, |i| i + 1);
    (a, b.max(a))
}

/// A document of about `target_tokens` tokens: essays from a seeded starting point, with
/// `needles_per_depth` needles at each of `depths`.
pub fn build_document(
    model: &Model,
    essays: &[Essay],
    target_tokens: usize,
    depths: &[f64],
    needles_per_depth: usize,
    seed: u64,
) -> Result<EvalDocument> {
    anyhow::ensure!(!essays.is_empty(), "no essays");
    anyhow::ensure!(depths.iter().all(|d| (0.0..=1.0).contains(d)), "depths must lie in [0, 1]");
    let n_needles = depths.len() * needles_per_depth;
    if n_needles > TEMPLATES.len() {
        bail!("{n_needles} needles per document, but only {} distinct facts exist", TEMPLATES.len());
    }
    let mut rng = StdRng::seed_from_u64(seed);
    let (source, names) = haystack_source(essays, target_tokens, &mut rng);
    let chosen = choose_templates(n_needles, &mut rng);
    let mut values = FreshValues { lower_source: source.to_lowercase(), used: Vec::new() };
    let mut questions = Vec::new();
    let mut plants = Vec::new();
    for (n, &ti) in chosen.iter().enumerate() {
        let depth = depths[n / needles_per_depth];
        let (question, needle_plants) = plant_needle(&TEMPLATES[ti], n, depth, &mut values, &mut rng)?;
        questions.push(question);
        plants.extend(needle_plants);
    }
    let hay = cut_haystack(model, &source, &plants, target_tokens)?;
    let inserts = insertion_points(model, hay, &plants)?;
    let (text, spans) = assemble(hay, &plants, &inserts);
    let n_tokens = record_evidence(model, &text, &plants, &spans, &mut questions)?;
    // Questions in document order, ids stable.
    questions.sort_by_key(|q| q.evidence[0].0);
    for (i, q) in questions.iter_mut().enumerate() {
        q.id = format!("q{i}");
    }
    Ok(EvalDocument {
        id: String::new(),
        source: names.join("+"),
        target_tokens: Some(target_tokens),
        tokens: n_tokens,
        text,
        questions,
    })
}

/// Haystack source: essays in order from a random one, comfortably longer than needed. Returns
/// the text and the essays' names.
fn haystack_source(essays: &[Essay], target_tokens: usize, rng: &mut StdRng) -> (String, Vec<String>) {
    let first = rng.random_range(0..essays.len());
    let mut source = String::new();
    let mut names = Vec::new();
    let mut i = first;
    while source.len() < target_tokens * 6 + 2000 {
        if !source.is_empty() {
            source.push_str("\n\n");
        }
        source.push_str(&essays[i].text);
        names.push(essays[i].name.clone());
        i = (i + 1) % essays.len();
        if i == first {
            break;
        }
    }
    (source, names)
}

/// `n_needles` distinct templates, kinds interleaved, in a seeded order.
fn choose_templates(n_needles: usize, rng: &mut StdRng) -> Vec<usize> {
    let mut order: Vec<usize> = (0..TEMPLATES.len()).collect();
    order.shuffle(rng);
    // The questions worded apart from their evidence first, so ten needles hold two of each.
    let kinds = [
        FactKind::Paraphrase,
        FactKind::TwoHop,
        FactKind::Number,
        FactKind::Name,
        FactKind::Place,
        FactKind::Date,
        FactKind::Confusable,
    ];
    let mut chosen = Vec::new();
    'outer: while chosen.len() < n_needles {
        for kind in kinds {
            if let Some(pos) = order.iter().position(|&t| TEMPLATES[t].kind == kind) {
                chosen.push(order.remove(pos));
                if chosen.len() == n_needles {
                    break 'outer;
                }
            }
        }
    }
    chosen.shuffle(rng);
    chosen
}

/// Values distinct from each other and absent from the source text.
struct FreshValues {
    lower_source: String,
    /// Values drawn so far, lower-cased.
    used: Vec<String>,
}

impl FreshValues {
    fn draw(&mut self, slot: Slot, rng: &mut StdRng) -> Result<(String, Vec<String>)> {
        for _ in 0..10_000 {
            let (v, answers) = draw(slot, rng);
            let l = v.to_lowercase();
            let clash = self.used.iter().any(|u| u.contains(&l) || l.contains(u.as_str()));
            if !clash && !self.lower_source.contains(&l) {
                self.used.push(l);
                return Ok((v, answers));
            }
        }
        bail!("cannot draw a {slot:?} that occurs nowhere in the text")
    }
}

/// Needle `n` from `tpl` at `depth`: its question (evidence still empty) and its planted
/// sentences, the answer-bearing one and any distractor (at least a quarter of the document
/// away).
fn plant_needle(
    tpl: &Template,
    n: usize,
    depth: f64,
    values: &mut FreshValues,
    rng: &mut StdRng,
) -> Result<(EvalQuestion, Vec<Plant>)> {
    let (value, answers) = values.draw(tpl.slot, rng)?;
    let mut sentence = tpl.sentence.replace("{X}", &value);
    // At least a quarter of the document away from the answer.
    let elsewhere = |rng: &mut StdRng| loop {
        let x: f64 = rng.random_range(0.0..=1.0);
        if (x - depth).abs() >= 0.25 {
            break x;
        }
    };
    let mut plants = Vec::new();
    let mut distractor = None;
    if let Some(d) = tpl.distractor {
        let (other, _) = values.draw(tpl.slot, rng)?;
        let text = d.replace("{Y}", &other);
        plants.push(Plant { text: text.clone(), depth: elsewhere(rng), needle: n, role: Role::Distractor });
        distractor = Some(text);
    }
    if let Some(b) = tpl.bridge {
        let (person, _) = values.draw(Slot::Name, rng)?;
        sentence = sentence.replace("{B}", &person);
        plants.push(Plant { text: b.replace("{B}", &person), depth: elsewhere(rng), needle: n, role: Role::Bridge });
    }
    plants.insert(0, Plant { text: sentence.clone(), depth, needle: n, role: Role::Answer });
    let question = EvalQuestion {
        id: String::new(),
        question: tpl.question.to_string(),
        answers,
        kind: Some(tpl.kind),
        depth: Some(depth),
        planted: Some(sentence),
        distractor,
        needs_all_evidence: tpl.bridge.is_some(),
        evidence: Vec::new(),
        ..Default::default()
    };
    Ok((question, plants))
}

/// The source cut at a sentence start so the finished document has about `target_tokens`
/// tokens.
fn cut_haystack<'s>(model: &Model, source: &'s str, plants: &[Plant], target_tokens: usize) -> Result<&'s str> {
    let planted_tokens: usize = plants
        .iter()
        .map(|p| model.tokenizer.encode(&format!(" {}", p.text), false).map(|t| t.len()))
        .sum::<Result<usize>>()?;
    let keep = target_tokens.saturating_sub(planted_tokens).max(1);
    let offsets = token_offsets(model, source)?;
    let cut_byte = offsets.get(keep).map_or(source.len(), |o| o.0);
    let starts: Vec<usize> = split_sentences(source).iter().map(|s| s.start).collect();
    let cut = starts.iter().copied().filter(|&s| s <= cut_byte && s > 0).max().unwrap_or(cut_byte);
    Ok(source[..cut].trim_end())
}

/// Where each plant goes: the sentence start (or either end) of `hay` nearest its depth in
/// tokens, as `(byte, plant)` in byte order.
fn insertion_points(model: &Model, hay: &str, plants: &[Plant]) -> Result<Vec<(usize, usize)>> {
    let hay_offsets = token_offsets(model, hay)?;
    let n_hay = hay_offsets.len();
    let mut points: Vec<(usize, usize)> =
        split_sentences(hay).iter().map(|s| (s.start, token_span(&hay_offsets, s.start, s.start + 1).0)).collect();
    points.insert(0, (0, 0));
    points.push((hay.len(), n_hay));
    points.dedup_by_key(|p| p.0);
    let mut inserts: Vec<(usize, usize)> = plants
        .iter()
        .enumerate()
        .map(|(k, p)| {
            let target = p.depth * n_hay as f64;
            let best = points
                .iter()
                .min_by(|a, b| (a.1 as f64 - target).abs().total_cmp(&(b.1 as f64 - target).abs()))
                .unwrap();
            (best.0, k)
        })
        .collect();
    inserts.sort();
    Ok(inserts)
}

/// The document: `hay` with the plants inserted, and each planted sentence's byte span.
fn assemble(hay: &str, plants: &[Plant], inserts: &[(usize, usize)]) -> (String, Vec<(usize, usize)>) {
    let mut text = String::with_capacity(hay.len() + 2048);
    let mut spans = vec![(0usize, 0usize); plants.len()];
    let mut at = 0;
    for &(pos, k) in inserts {
        text.push_str(&hay[at..pos]);
        at = pos;
        if pos == hay.len() {
            text.push(' ');
        }
        let s = text.len();
        text.push_str(&plants[k].text);
        spans[k] = (s, text.len());
        if pos < hay.len() {
            text.push(' ');
        }
    }
    text.push_str(&hay[at..]);
    (text, spans)
}

/// Records each question's evidence (byte and token spans, actual depth) and its distractor's
/// tokens in the finished `text`; returns the document's length in tokens.
fn record_evidence(
    model: &Model,
    text: &str,
    plants: &[Plant],
    spans: &[(usize, usize)],
    questions: &mut [EvalQuestion],
) -> Result<usize> {
    let doc_offsets = token_offsets(model, text)?;
    let n_tokens = doc_offsets.len();
    for (k, p) in plants.iter().enumerate() {
        let q = &mut questions[p.needle];
        let tokens = token_span(&doc_offsets, spans[k].0, spans[k].1);
        match p.role {
            // The answer's sentence first: questions are ordered by it.
            Role::Answer => {
                q.evidence.insert(0, spans[k]);
                q.evidence_tokens.insert(0, tokens);
                q.actual_depth = Some(tokens.0 as f64 / n_tokens as f64);
            }
            Role::Bridge => {
                q.evidence.push(spans[k]);
                q.evidence_tokens.push(tokens);
            }
            Role::Distractor => q.distractor_tokens = Some(tokens),
        }
    }
    Ok(n_tokens)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::corpus::scoring::normalize;
    use std::collections::HashSet;

    #[test]
    fn questions_are_worded_differently_from_the_planted_sentence() {
        let stop: HashSet<&str> =
            ["of", "in", "was", "is", "on", "for", "to", "from", "which", "what", "who", "when", "where"]
                .into_iter()
                .collect();
        for tpl in TEMPLATES {
            let words = |s: &str| -> HashSet<String> {
                normalize(&s.replace("{X}", ""))
                    .split_whitespace()
                    .filter(|w| !stop.contains(w))
                    .map(str::to_string)
                    .collect()
            };
            let (s, q) = (words(&tpl.sentence.replace("{B}", "")), words(tpl.question));
            let jaccard = s.intersection(&q).count() as f64 / s.union(&q).count() as f64;
            assert!(jaccard < 0.5, "{:?} / {:?}: word overlap {jaccard:.2}", tpl.sentence, tpl.question);
            // A paraphrase shares no content word (nor a word's first five letters: no stem).
            let stems = |w: &HashSet<String>| -> HashSet<String> { w.iter().map(|w| w.chars().take(5).collect()).collect() };
            if tpl.kind == FactKind::Paraphrase {
                let function = ["the", "a", "an", "its", "their", "did", "how", "many", "on", "by", "that", "what"];
                let content = |w: &HashSet<String>| -> HashSet<String> { w.iter().filter(|w| !function.contains(&w.as_str())).cloned().collect() };
                let shared: Vec<_> = stems(&content(&s)).intersection(&stems(&content(&q))).cloned().collect();
                assert!(shared.is_empty(), "{:?} / {:?} share {shared:?}", tpl.sentence, tpl.question);
            }
            // A two-hop question describes the person as the first hop does, and shares no word
            // with the answer's sentence but the thing asked about.
            if let Some(bridge) = tpl.bridge {
                assert!(bridge.contains("{B}") && tpl.sentence.contains("{B}") && !bridge.contains("{X}"));
                let b = words(&bridge.replace("{B}", ""));
                assert!(b.intersection(&q).count() >= 2, "{bridge:?} / {:?}", tpl.question);
            }
            assert!(!normalize(tpl.sentence).contains(&normalize(tpl.question)));
            assert!(tpl.sentence.contains("{X}") && tpl.distractor.is_none_or(|d| d.contains("{Y}")));
        }
    }

    #[test]
    fn token_span_covers_the_bytes() {
        let offsets = [(0, 3), (3, 7), (7, 8), (8, 12)];
        assert_eq!(token_span(&offsets, 3, 8), (1, 3));
        assert_eq!(token_span(&offsets, 4, 5), (1, 2));
        assert_eq!(token_span(&offsets, 0, 12), (0, 4));
    }
}
