//! Training data for the prepared base, built offline from the shipped essays and kept apart from
//! every evaluation set.
//!
//! The shape follows FltLM ("FltLM: An Integrated Long-Context Large Language Model for Effective
//! Context Filtering and Understanding", §5.1): long-context QA where the supporting text sits among
//! distractors. Here one long context is essay prose with facts planted at sentence boundaries,
//! cut into sentence-aligned passages; each example has 1–2 supporting facts (their passages are
//! the positives) and 2–4 confusable distractor facts (the same kind of value about another
//! subject) in other passages. Kinds:
//! - `single`: one fact; the distractors use other templates of the same value kind;
//! - `confusable`: one fact; a distractor is the same template about another person;
//! - `two-hop`: fact A names a person ("Ana's landlord is Ivo"), fact B gives that person's
//!   attribute ("Ivo grew up in Graz"); the question goes through A ("Where did Ana's landlord
//!   grow up?"); the distractors include the same chain for another person and the attribute of
//!   the question's own subject.
//!
//! Kept apart from evaluation, three ways:
//! - **Essays**, split by essay name ([`crate::corpus::split_of`], a salted sha256 of the name):
//!   about 70% train, 10% validation, 20% eval; `lift-serve eval` draws only from the eval split.
//! - **Templates**: none shared with the eval's needles (checked against `eval::needles` by
//!   `tests/splits.rs`), and
//!   the train templates are disjoint from the held-out ones used by validation and eval.
//! - **Values**: names, places, years and number ranges disjoint from the eval's pools, and the
//!   train pools disjoint from the held-out pools. Every value is also absent from the essay text
//!   of its document, so only the planted sentence carries it.
//!
//! Lengths are counted in approximate tokens, [`approx_tokens`]: 5 tokens per 4 words, so the data
//! needs no tokenizer (on these documents the default model's tokenizer gives 0.95–1.17 real tokens
//! per approximate one, mean 1.0; `approx_tokens_track_the_default_tokenizer`).

use crate::corpus::{essays_in, load_essays, Essay, Split};
use crate::lift::absorb::text::split_sentences;
use anyhow::{bail, ensure, Result};
use rand::rngs::StdRng;
use rand::seq::{IndexedRandom, SliceRandom};
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::path::Path;

/// One long-context QA example.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BaseExample {
    /// Sentence-aligned chunks of one long context, in order (the context is their join with " ").
    pub passages: Vec<String>,
    /// Indices of the passages holding the supporting facts (never empty, ascending).
    pub positive: Vec<usize>,
    pub question: String,
    pub answer: String,
    /// `single`, `confusable` or `two-hop`.
    pub kind: String,
    /// Indices of the passages holding distractor facts (ascending). Derived from the build, not
    /// part of the data's hash: a truncated training view uses it to keep confusable facts in.
    #[serde(skip)]
    pub distractors: Vec<usize>,
}

impl BaseExample {
    /// The long context: the passages joined by single spaces.
    pub fn document(&self) -> String {
        self.passages.join(" ")
    }

    /// Byte range `[start, end)` of each passage in [`Self::document`] (evidence spans for
    /// chunk labels).
    pub fn passage_spans(&self) -> Vec<(usize, usize)> {
        let mut at = 0;
        self.passages
            .iter()
            .map(|p| {
                let span = (at, at + p.len());
                at = span.1 + 1;
                span
            })
            .collect()
    }
}

/// How examples are built.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BuildOptions {
    /// Document length bounds in approximate tokens ([`approx_tokens`]); each document's target
    /// is drawn uniformly between them.
    pub min_tokens: usize,
    pub max_tokens: usize,
    /// Most approximate tokens per passage (a longer single sentence is a passage of its own).
    /// The default matches the filter's chunk size at answer time (`FilterOptions::chunk_tokens`,
    /// 32), so the filter is trained on chunks of the size it will score.
    pub passage_tokens: usize,
    /// Share of two-hop examples, and of confusable ones; the rest are single.
    pub two_hop_fraction: f64,
    pub confusable_fraction: f64,
    /// Distractor facts per example (inclusive range).
    pub min_distractors: usize,
    pub max_distractors: usize,
}

impl Default for BuildOptions {
    fn default() -> Self {
        Self {
            min_tokens: 512,
            max_tokens: 2048,
            passage_tokens: 32,
            two_hop_fraction: 0.3,
            confusable_fraction: 0.35,
            min_distractors: 2,
            max_distractors: 4,
        }
    }
}

/// Approximate token count of `text`: 5 tokens per 4 whitespace-separated words, rounded up.
pub fn approx_tokens(text: &str) -> usize {
    words_to_tokens(text.split_whitespace().count())
}

fn words_to_tokens(words: usize) -> usize {
    (words * 5).div_ceil(4)
}

/// `count` examples from the essays of `split` in `essays_dir`, deterministic for `seed`, with the
/// default [`BuildOptions`].
pub fn build_examples(essays_dir: &Path, split: Split, count: usize, seed: u64) -> Result<Vec<BaseExample>> {
    build_examples_with(essays_dir, split, count, seed, &BuildOptions::default())
}

/// [`build_examples`] with explicit options. Example `i` depends only on (`seed`, `split`, `i`,
/// options), so a longer run extends a shorter one.
pub fn build_examples_with(
    essays_dir: &Path,
    split: Split,
    count: usize,
    seed: u64,
    opts: &BuildOptions,
) -> Result<Vec<BaseExample>> {
    let essays = essays_in(&load_essays(essays_dir)?, split);
    let source = Source::new(&essays, split)?;
    (0..count).map(|i| build_one(&source, opts, example_seed(seed, split, i)).map(|b| b.example)).collect()
}

/// sha256 (hex) over the canonical serialisation of `examples`: their JSON, fields in declaration
/// order, examples in order (no maps, so the bytes are unique).
pub fn data_hash(examples: &[BaseExample]) -> String {
    let bytes = serde_json::to_vec(examples).expect("examples serialise");
    hex::encode(Sha256::digest(&bytes))
}

fn example_seed(seed: u64, split: Split, index: usize) -> u64 {
    let tag = match split {
        Split::Train => 0x7472_6169_6e00_0000u64,
        Split::Validation => 0x7661_6c69_6400_0000,
        Split::Eval => 0x6576_616c_0000_0000,
    };
    // splitmix64 finaliser: nearby (seed, index) pairs give unrelated streams.
    let mut z = seed ^ tag ^ (index as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

// ---------------------------------------------------------------------------------------------
// Templates and value pools

/// The kind of value a fact carries; distractors carry the same kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Value {
    Person,
    Place,
    Date,
    Quantity,
    Code,
    Colour,
    Object,
}

/// A fact about a person `{S}` with value `{V}`, and the question a user would ask for `{V}`.
/// `{S}` in the question is the person's name, or for two-hop questions a description through
/// another fact ([`Template::role`]).
struct Template {
    value: Value,
    sentence: &'static str,
    question: &'static str,
    /// Person-valued facts only: the value described through the subject ("{S}'s landlord"),
    /// the first hop of two-hop questions.
    role: Option<&'static str>,
}

const fn t(value: Value, sentence: &'static str, question: &'static str) -> Template {
    Template { value, sentence, question, role: None }
}

const fn who(sentence: &'static str, question: &'static str, role: &'static str) -> Template {
    Template { value: Value::Person, sentence, question, role: Some(role) }
}

use Value::{Code, Colour, Date, Object, Place, Quantity};

const TRAIN_TEMPLATES: &[Template] = &[
    t(Place, "{S} spent a childhood in a narrow house on the outskirts of {V}.", "Where did {S} grow up?"),
    t(Place, "Last spring {S} opened a bicycle repair shop in {V}.", "Where does {S} fix bikes for a living?"),
    t(Place, "The wedding of {S} took place at a vineyard near {V}.", "Where did {S} get married?"),
    t(Date, "{S} was born on {V}, during a heavy snowstorm.", "What is {S}'s date of birth?"),
    t(Date, "The deed to the old mill was signed by {S} on {V}.", "When did {S} become the owner of the mill?"),
    t(Date, "{S} first sailed across the channel on {V}.", "On what day did {S} make that first sea crossing?"),
    t(Quantity, "{S} keeps a flock of {V} sheep on the hillside.", "How many sheep does {S} have?"),
    t(Quantity, "{S} has collected {V} vinyl records over the years.", "How big is {S}'s record collection?"),
    t(Quantity, "The garden that {S} tends has {V} rose bushes in it.", "How many roses grow in {S}'s garden?"),
    t(
        Code,
        "The alarm at {S}'s studio is disarmed with the code {V}.",
        "What do I punch in to switch off the alarm in {S}'s studio?",
    ),
    t(Code, "{S} registered the fishing boat under the number {V}.", "What's the registration of {S}'s boat?"),
    t(Code, "The wifi password in {S}'s cabin is {V}.", "How do I get online at {S}'s cabin?"),
    t(Colour, "{S} painted the front door {V} last autumn.", "What colour is {S}'s front door?"),
    t(Colour, "{S} always wears a {V} scarf to the market.", "Which colour is the scarf {S} has on when shopping?"),
    t(Colour, "The canoe that {S} built by hand was painted {V}.", "What colour did {S} choose for the canoe?"),
    t(Object, "{S} keeps a {V} on the desk by the window.", "What sits on {S}'s desk?"),
    t(Object, "{S} left a {V} on the night train to the coast.", "What did {S} forget on the train?"),
    t(Object, "For the school fair {S} donated a {V}.", "What did {S} give to the fair?"),
    who("{S} rents the upstairs flat from a landlord named {V}.", "Who is {S}'s landlord?", "{S}'s landlord"),
    who("{S} took cello lessons for years from a teacher called {V}.", "Who taught {S} music?", "{S}'s cello teacher"),
    who("The closest neighbour of {S} is {V}.", "Who lives next door to {S}?", "{S}'s neighbour"),
];

/// Held-out templates: validation and eval.
const HELDOUT_TEMPLATES: &[Template] = &[
    t(Place, "{S} moved to {V} to work at the harbour.", "Which town does {S} live in now?"),
    t(Place, "{S} studied architecture at a college in {V}.", "Where did {S} go to university?"),
    t(Date, "{S} retired from the fire brigade on {V}.", "When did {S} stop working as a firefighter?"),
    t(
        Date,
        "The bakery owned by {S} first opened its doors on {V}.",
        "Since what date has {S}'s bakery been in business?",
    ),
    t(Quantity, "{S}'s orchard contains {V} pear trees.", "How many pear trees grow on {S}'s land?"),
    t(Quantity, "{S} owns a library of {V} cookbooks.", "How many cookbooks does {S} have?"),
    t(Code, "The storage unit rented by {S} has the padlock code {V}.", "How do I open {S}'s storage unit?"),
    t(Code, "The parcel sent by {S} carries the tracking number {V}.", "How can I track {S}'s parcel?"),
    t(Colour, "{S} drives an old {V} pickup truck.", "What colour is {S}'s truck?"),
    t(Colour, "The umbrella {S} carries is a bright {V}.", "Which colour is {S}'s umbrella?"),
    t(Object, "In the attic {S} found a {V} wrapped in newspaper.", "What turned up in {S}'s attic?"),
    t(Object, "{S} won a {V} in the village raffle.", "What was {S}'s prize in the raffle?"),
    who("{S} hired an accountant named {V} last year.", "Who does {S}'s accounts?", "{S}'s accountant"),
    who(
        "The oldest friend {S} has from school is {V}.",
        "Who has known {S} since their school days?",
        "{S}'s oldest school friend",
    ),
];

/// What the examples of `split` are written from: every template text (facts, questions, roles),
/// every pool word, and the number ranges (quantities, years). `tests/splits.rs` checks that none
/// of it meets the eval's needles.
pub struct Vocabulary {
    pub texts: Vec<&'static str>,
    pub words: Vec<&'static str>,
    pub quantities: std::ops::RangeInclusive<u32>,
    pub years: std::ops::RangeInclusive<u32>,
}

pub fn vocabulary(split: Split) -> Vocabulary {
    let pools = pools_for(split);
    Vocabulary {
        texts: templates_for(split).iter().flat_map(|t| [t.sentence, t.question].into_iter().chain(t.role)).collect(),
        words: [pools.first, pools.last, pools.places, pools.colours, pools.objects].concat(),
        quantities: pools.quantities.clone(),
        years: pools.years.clone(),
    }
}

/// Value pools of one side (train or held-out); all disjoint from the eval's and each other's.
struct Pools {
    first: &'static [&'static str],
    last: &'static [&'static str],
    places: &'static [&'static str],
    colours: &'static [&'static str],
    objects: &'static [&'static str],
    /// Letters of codes (`LL-ddL`).
    code_letters: &'static [u8],
    quantities: std::ops::RangeInclusive<u32>,
    years: std::ops::RangeInclusive<u32>,
}

const TRAIN_POOLS: Pools = Pools {
    first: &[
        "Anneliese", "Bartosz", "Cordelia", "Desmond", "Elowen", "Florian", "Gwendolyn", "Hamish", "Isolde", "Jasper",
        "Leopold", "Margit", "Niamh", "Octavia", "Radomir", "Saoirse",
    ],
    last: &[
        "Ashcombe", "Bellweather", "Czerny", "Draycott", "Eskildsen", "Fairbairn", "Gallagher", "Holmqvist", "Iversen",
        "Jablonski", "Kettering", "Lockhart", "Moravec", "Nightingale", "Oyelaran", "Pemberton",
    ],
    places: &[
        "Lucerne", "Porto", "Gdansk", "Kaunas", "Uppsala", "Tartu", "Bruges", "Graz", "Trieste", "Bologna", "Dunedin",
        "Halifax", "Missoula", "Tucson", "Leipzig", "Nantes",
    ],
    colours: &[
        "crimson", "teal", "ochre", "lilac", "periwinkle", "turquoise", "amber", "saffron", "cerulean", "vermilion",
        "chartreuse", "burgundy",
    ],
    objects: &[
        "brass telescope",
        "porcelain teapot",
        "leather satchel",
        "wooden chess set",
        "silver pocket watch",
        "cast iron kettle",
        "glass paperweight",
        "wind-up gramophone",
        "stuffed owl",
        "copper lantern",
        "bamboo flute",
        "marble bust",
    ],
    code_letters: b"ABCDEFGHJKLM",
    quantities: 101..=499,
    years: 1801..=1859,
};

const HELDOUT_POOLS: Pools = Pools {
    first: &[
        "Aurelio", "Beatrix", "Cosmin", "Delphine", "Emrys", "Fenella", "Gideon", "Hesper", "Ignatius", "Jolanta",
        "Killian", "Lorcan", "Maelle", "Nikolai", "Ottilie", "Perpetua",
    ],
    last: &[
        "Blackwood", "Cavendish", "Dunmore", "Everhart", "Fitzroy", "Greenhalgh", "Hargreaves", "Ingleby", "Jaramillo",
        "Lindgren", "Mortimer", "Nakashima", "Ostrowski", "Penhaligon", "Rutherford", "Quarrie",
    ],
    places: &[
        "Arequipa", "Mendoza", "Brno", "Kotor", "Izmir", "Tangier", "Mysore", "Hakodate", "Ballarat", "Nanaimo",
        "Moncton", "Flagstaff", "Duluth", "Sapporo", "Cebu", "Rotorua",
    ],
    colours: &[
        "scarlet", "olive", "magenta", "beige", "indigo", "lavender", "mustard", "charcoal", "coral", "mauve",
        "tangerine", "emerald",
    ],
    objects: &[
        "tin soldier",
        "velvet hatbox",
        "ship in a bottle",
        "carved walking stick",
        "nautical compass",
        "ceramic frog",
        "barometer",
        "snow globe",
        "music box",
        "rocking horse",
        "jade figurine",
        "patchwork quilt",
    ],
    code_letters: b"NPQRSTVWXYZ",
    quantities: 501..=999,
    years: 1861..=1919,
};

const MONTHS: &[&str] = &[
    "January", "February", "March", "April", "May", "June", "July", "August", "September", "October", "November",
    "December",
];

fn templates_for(split: Split) -> &'static [Template] {
    match split {
        Split::Train => TRAIN_TEMPLATES,
        Split::Validation | Split::Eval => HELDOUT_TEMPLATES,
    }
}

fn pools_for(split: Split) -> &'static Pools {
    match split {
        Split::Train => &TRAIN_POOLS,
        Split::Validation | Split::Eval => &HELDOUT_POOLS,
    }
}

impl Pools {
    fn person(&self, rng: &mut StdRng) -> String {
        format!("{} {}", self.first.choose(rng).unwrap(), self.last.choose(rng).unwrap())
    }

    fn draw(&self, value: Value, rng: &mut StdRng) -> String {
        match value {
            Value::Person => self.person(rng),
            Value::Place => self.places.choose(rng).unwrap().to_string(),
            Value::Date => {
                let (d, m, y) =
                    (rng.random_range(1..=28), MONTHS.choose(rng).unwrap(), rng.random_range(self.years.clone()));
                format!("{d} {m} {y}")
            }
            Value::Quantity => rng.random_range(self.quantities.clone()).to_string(),
            Value::Code => {
                let mut letter = || *self.code_letters.choose(rng).unwrap() as char;
                let (a, b, c) = (letter(), letter(), letter());
                format!("{a}{b}-{}{c}", rng.random_range(10..100))
            }
            Value::Colour => self.colours.choose(rng).unwrap().to_string(),
            Value::Object => self.objects.choose(rng).unwrap().to_string(),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Building

/// The essay sentences of one split, in order (essays one after another).
struct Source {
    split: Split,
    sentences: Vec<String>,
    /// Index of the first sentence of each essay.
    essay_starts: Vec<usize>,
    /// Lower-cased text of every sentence, for "is this value already in the prose" checks.
    lower: Vec<String>,
    /// Words per sentence.
    words: Vec<usize>,
}

impl Source {
    fn new(essays: &[Essay], split: Split) -> Result<Self> {
        ensure!(!essays.is_empty(), "no essays in the {split:?} split");
        let mut sentences = Vec::new();
        let mut essay_starts = Vec::new();
        for e in essays {
            essay_starts.push(sentences.len());
            sentences.extend(split_sentences(&e.text).iter().map(|s| s.text(&e.text).to_string()));
        }
        let lower = sentences.iter().map(|s| s.to_lowercase()).collect();
        let words = sentences.iter().map(|s| s.split_whitespace().count()).collect();
        Ok(Self { split, sentences, essay_starts, lower, words })
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Role {
    /// Carries the answer (or, for two-hop, the first hop).
    Support,
    Distractor,
}

/// A planted fact, kept beside the example for the tests.
#[derive(Clone, Debug)]
#[cfg_attr(not(test), allow(dead_code))]
struct Planted {
    text: String,
    role: Role,
    template: usize,
    subject: String,
    value: String,
    /// Passage index once assembled.
    passage: usize,
}

#[cfg_attr(not(test), allow(dead_code))]
struct Built {
    example: BaseExample,
    facts: Vec<Planted>,
    /// Source sentence indices used, in order.
    sentences: Vec<usize>,
}

/// A fact before its value is drawn.
struct Plan {
    role: Role,
    template: usize,
    /// Person index (0 is the question's subject).
    subject: usize,
    value: Slot,
}

/// A value: a fresh draw, or a person of the example (two-hop chains).
#[derive(Clone, Copy)]
enum Slot {
    Fresh,
    Person(usize),
}

fn build_one(source: &Source, opts: &BuildOptions, seed: u64) -> Result<Built> {
    ensure!(opts.min_tokens <= opts.max_tokens && opts.passage_tokens > 0, "bad length options: {opts:?}");
    ensure!(opts.min_distractors <= opts.max_distractors, "bad distractor counts: {opts:?}");
    let mut rng = StdRng::seed_from_u64(seed);
    for _ in 0..100 {
        if let Some(b) = try_build(source, opts, &mut rng)? {
            return Ok(b);
        }
    }
    bail!("no example fits {opts:?} in the {:?} essays after 100 tries", source.split)
}

/// One attempt; `None` when the drawn values or lengths do not fit (the caller draws again).
/// Draws, in this order: the kind, the facts' templates, the prose, the values, the fact gaps.
fn try_build(source: &Source, opts: &BuildOptions, rng: &mut StdRng) -> Result<Option<Built>> {
    let templates = templates_for(source.split);
    let (kind, n_distractors) = draw_kind(opts, rng);
    let facts_plan = plan_facts(templates, kind, n_distractors, rng);
    let plans = &facts_plan.plans;
    let fact_words: usize = plans.iter().map(|p| templates[p.template].sentence.split_whitespace().count() + 2).sum();
    let used_sentences = draw_prose(source, opts, fact_words, rng)?;
    let mut values = ValueDraw {
        pools: pools_for(source.split),
        prose_lower: used_sentences.iter().map(|&i| source.lower[i].as_str()).collect(),
        taken: Vec::new(),
    };
    let Some((persons, mut facts)) = values.facts(templates, plans, rng) else { return Ok(None) };
    let answer = facts[if kind == "two-hop" { 1 } else { 0 }].value.clone();
    let subject = match facts_plan.question_subject {
        Some(role) => role.replace("{S}", &persons[0]),
        None => persons[0].clone(),
    };
    let question = templates[facts_plan.question_template].question.replace("{S}", &subject);
    let Some(passages) = plant_and_pack(source, &used_sentences, &mut facts, opts, rng) else { return Ok(None) };

    let total = words_to_tokens(passages.iter().map(|p| p.split_whitespace().count()).sum());
    if !(opts.min_tokens..=opts.max_tokens).contains(&total) {
        return Ok(None);
    }
    let mut positive: Vec<usize> = facts.iter().filter(|f| f.role == Role::Support).map(|f| f.passage).collect();
    positive.sort_unstable();
    positive.dedup();
    let mut distractors: Vec<usize> =
        facts.iter().filter(|f| f.role == Role::Distractor).map(|f| f.passage).filter(|p| !positive.contains(p)).collect();
    distractors.sort_unstable();
    distractors.dedup();
    let example = BaseExample { passages, positive, question, answer, kind: kind.to_string(), distractors };
    Ok(Some(Built { example, facts, sentences: used_sentences }))
}

/// The example's kind and its number of distractors (drawn first).
fn draw_kind(opts: &BuildOptions, rng: &mut StdRng) -> (&'static str, usize) {
    let n_distractors = rng.random_range(opts.min_distractors..=opts.max_distractors);
    let r: f64 = rng.random();
    let kind = if r < opts.two_hop_fraction {
        "two-hop"
    } else if r < opts.two_hop_fraction + opts.confusable_fraction {
        "confusable"
    } else {
        "single"
    };
    (kind, n_distractors)
}

/// The facts of an example before their values, and how its question is asked.
struct FactsPlan {
    plans: Vec<Plan>,
    question_template: usize,
    /// Two-hop: the subject described through the first hop ("{S}'s landlord").
    question_subject: Option<&'static str>,
}

/// Facts: persons are numbered (0 is the question's subject), values drawn later.
fn plan_facts(templates: &[Template], kind: &str, n_distractors: usize, rng: &mut StdRng) -> FactsPlan {
    let pick = |rng: &mut StdRng, f: &dyn Fn(&Template) -> bool| -> usize {
        let ok: Vec<usize> = (0..templates.len()).filter(|&i| f(&templates[i])).collect();
        *ok.choose(rng).expect("every value kind has templates")
    };
    let mut plans = Vec::new();
    let fact = |role, template, subject, value| Plan { role, template, subject, value };
    match kind {
        "two-hop" => {
            let bridge = pick(rng, &|t| t.role.is_some());
            let attr = pick(rng, &|t| t.role.is_none());
            // Person 1 is the bridge entity; 2 and 3 a look-alike chain; 0's own attribute too.
            plans.push(fact(Role::Support, bridge, 0, Slot::Person(1)));
            plans.push(fact(Role::Support, attr, 1, Slot::Fresh));
            plans.push(fact(Role::Distractor, bridge, 2, Slot::Person(3)));
            plans.push(fact(Role::Distractor, attr, 3, Slot::Fresh));
            plans.push(fact(Role::Distractor, attr, 0, Slot::Fresh));
            let value = templates[attr].value;
            for k in 3..n_distractors.max(3) {
                let other = pick(rng, &|t| t.value == value);
                plans.push(fact(Role::Distractor, other, 1 + k, Slot::Fresh));
            }
            let role = templates[bridge].role.expect("bridge templates have a role");
            FactsPlan { plans, question_template: attr, question_subject: Some(role) }
        }
        _ => {
            let main = pick(rng, &|_| true);
            let value = templates[main].value;
            plans.push(fact(Role::Support, main, 0, Slot::Fresh));
            for k in 0..n_distractors {
                let same = kind == "confusable" && k == 0;
                let tpl =
                    if same { main } else { pick(rng, &|t| t.value == value && !std::ptr::eq(t, &templates[main])) };
                plans.push(fact(Role::Distractor, tpl, 1 + k, Slot::Fresh));
            }
            FactsPlan { plans, question_template: main, question_subject: None }
        }
    }
}

/// Prose: consecutive sentences from a random point, wrapping over the split's essays, until the
/// document (with `fact_words` words of facts) reaches a drawn target length.
fn draw_prose(source: &Source, opts: &BuildOptions, fact_words: usize, rng: &mut StdRng) -> Result<Vec<usize>> {
    let target = rng.random_range(opts.min_tokens..=opts.max_tokens);
    let n = source.sentences.len();
    let start = if rng.random_bool(0.5) { *source.essay_starts.choose(rng).unwrap() } else { rng.random_range(0..n) };
    let mut used_sentences = Vec::new();
    let mut words = fact_words;
    let mut i = start;
    while words_to_tokens(words) < target {
        if words_to_tokens(words + source.words[i]) <= opts.max_tokens {
            used_sentences.push(i);
            words += source.words[i];
        }
        i = (i + 1) % n;
        if i == start {
            // Every sentence tried once: near the upper bound none may fit exactly.
            if words_to_tokens(words) >= opts.min_tokens {
                break;
            }
            bail!("the {:?} essays cannot make a document of {target} tokens", source.split);
        }
    }
    Ok(used_sentences)
}

/// Values for the facts: persons distinct, every value absent from the prose and from the other
/// values.
struct ValueDraw<'a> {
    pools: &'static Pools,
    /// The document's prose sentences, lower-cased.
    prose_lower: Vec<&'a str>,
    /// Values drawn so far, lower-cased.
    taken: Vec<String>,
}

impl ValueDraw<'_> {
    /// A value of kind `value` that clashes with nothing, or `None` after 200 draws.
    fn fresh(&mut self, rng: &mut StdRng, value: Value) -> Option<String> {
        for _ in 0..200 {
            let v = self.pools.draw(value, rng);
            let l = v.to_lowercase();
            let clash = self.taken.iter().any(|u| u.contains(&l) || l.contains(u.as_str()));
            if !clash && !self.prose_lower.iter().any(|s| s.contains(&l)) {
                self.taken.push(l);
                return Some(v);
            }
        }
        None
    }

    /// The persons (index 0 the question's subject), then each planned fact with its values
    /// drawn and its sentence written (passage still 0); `None` when a draw fails.
    fn facts(
        &mut self,
        templates: &[Template],
        plans: &[Plan],
        rng: &mut StdRng,
    ) -> Option<(Vec<String>, Vec<Planted>)> {
        let n_persons = plans.iter().map(|p| match p.value {
            Slot::Person(v) => p.subject.max(v) + 1,
            Slot::Fresh => p.subject + 1,
        });
        let mut persons = Vec::new();
        for _ in 0..n_persons.max().unwrap_or(0) {
            persons.push(self.fresh(rng, Value::Person)?);
        }
        let mut facts = Vec::new();
        for p in plans {
            let tpl = &templates[p.template];
            let s = p.subject;
            let value = match p.value {
                Slot::Person(v) => persons[v].clone(),
                Slot::Fresh => self.fresh(rng, tpl.value)?,
            };
            let text = tpl.sentence.replace("{S}", &persons[s]).replace("{V}", &value);
            facts.push(Planted {
                text,
                role: p.role,
                template: p.template,
                subject: persons[s].clone(),
                value,
                passage: 0,
            });
        }
        Some((persons, facts))
    }
}

/// Plants the facts at distinct sentence gaps of the prose, then packs sentences into passages
/// of at most `passage_tokens`, one fact at most each; records each fact's passage. `None` when
/// there are fewer gaps than facts.
fn plant_and_pack(
    source: &Source,
    used_sentences: &[usize],
    facts: &mut [Planted],
    opts: &BuildOptions,
    rng: &mut StdRng,
) -> Option<Vec<String>> {
    let mut gaps: Vec<usize> = (0..=used_sentences.len()).collect();
    gaps.shuffle(rng);
    let mut at: Vec<(usize, usize)> = gaps.into_iter().take(facts.len()).zip(0..facts.len()).collect();
    if at.len() < facts.len() {
        return None;
    }
    at.sort();
    let mut units: Vec<(&str, Option<usize>)> = Vec::new();
    let mut next = at.iter().peekable();
    for (k, &si) in used_sentences.iter().enumerate() {
        while let Some(&(_, f)) = next.next_if(|(g, _)| *g == k) {
            units.push((&facts[f].text, Some(f)));
        }
        units.push((&source.sentences[si], None));
    }
    for &(_, f) in next {
        units.push((&facts[f].text, Some(f)));
    }
    let mut passages: Vec<String> = Vec::new();
    let (mut cur, mut cur_words, mut cur_fact) = (Vec::<&str>::new(), 0usize, false);
    let mut fact_passage = vec![0usize; facts.len()];
    for (text, f) in units {
        let w = text.split_whitespace().count();
        let full = words_to_tokens(cur_words + w) > opts.passage_tokens || (cur_fact && f.is_some());
        if !cur.is_empty() && full {
            passages.push(cur.join(" "));
            (cur, cur_words, cur_fact) = (Vec::new(), 0, false);
        }
        if let Some(f) = f {
            fact_passage[f] = passages.len();
            cur_fact = true;
        }
        cur.push(text);
        cur_words += w;
    }
    passages.push(cur.join(" "));
    for (f, p) in facts.iter_mut().zip(fact_passage) {
        f.passage = p;
    }
    Some(passages)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::corpus::scoring::normalize;
    use crate::corpus::{data_dir, fetch_essays};
    use std::collections::HashSet;

    fn essays_dir() -> std::path::PathBuf {
        fetch_essays(&data_dir()).expect("essays (run `lift-serve fetch-data`)")
    }

    fn essays() -> Vec<Essay> {
        load_essays(&essays_dir()).unwrap()
    }

    /// Examples with their planted facts, as [`build_examples_with`] builds them.
    fn built(split: Split, count: usize, seed: u64) -> Vec<Built> {
        let source = Source::new(&essays_in(&essays(), split), split).unwrap();
        let opts = BuildOptions::default();
        (0..count).map(|i| build_one(&source, &opts, example_seed(seed, split, i)).unwrap()).collect()
    }

    /// Word 3-grams of a template text, placeholders dropped.
    fn trigrams(s: &str) -> HashSet<String> {
        let w: Vec<String> =
            normalize(&s.replace("{S}", " ").replace("{V}", " ").replace("{X}", " ").replace("{Y}", " ").replace("{B}", " "))
                .split_whitespace()
                .map(str::to_string)
                .collect();
        w.windows(3).map(|g| g.join(" ")).collect()
    }

    fn pool_words(p: &Pools) -> Vec<&'static str> {
        [p.first, p.last, p.places, p.colours, p.objects].concat()
    }

    #[test]
    fn deterministic_for_a_seed_and_prefix_stable() {
        let dir = essays_dir();
        let a = build_examples(&dir, Split::Train, 12, 7).unwrap();
        let b = build_examples(&dir, Split::Train, 12, 7).unwrap();
        assert_eq!(a, b);
        assert_eq!(data_hash(&a), data_hash(&b));
        let c = build_examples(&dir, Split::Train, 12, 8).unwrap();
        assert_ne!(data_hash(&a), data_hash(&c), "another seed gives other data");
        let short = build_examples(&dir, Split::Train, 5, 7).unwrap();
        assert_eq!(short[..], a[..5], "a longer run extends a shorter one");
        assert_ne!(data_hash(&short), data_hash(&a));
        let v = build_examples(&dir, Split::Validation, 12, 7).unwrap();
        assert_ne!(v, a);
    }

    #[test]
    fn passage_spans_index_the_document() {
        for b in built(Split::Validation, 5, 4) {
            let (doc, spans) = (b.example.document(), b.example.passage_spans());
            assert_eq!(spans.len(), b.example.passages.len());
            for (p, &(s, e)) in b.example.passages.iter().zip(&spans) {
                assert_eq!(&doc[s..e], p);
            }
            assert_eq!(spans.last().unwrap().1, doc.len());
        }
    }

    #[test]
    fn data_hash_is_sha256_of_the_json() {
        let ex = BaseExample {
            passages: vec!["A b.".into()],
            positive: vec![0],
            question: "Q?".into(),
            answer: "b".into(),
            kind: "single".into(),
            distractors: vec![],
        };
        let json = r#"[{"passages":["A b."],"positive":[0],"question":"Q?","answer":"b","kind":"single"}]"#;
        assert_eq!(data_hash(std::slice::from_ref(&ex)), hex::encode(Sha256::digest(json.as_bytes())));
        let mut other = ex.clone();
        other.answer = "c".into();
        assert_ne!(data_hash(&[ex]), data_hash(&[other]));
    }

    #[test]
    fn splits_are_disjoint_by_essay_and_examples_use_only_their_split() {
        let all = essays();
        let parts: Vec<Vec<Essay>> =
            [Split::Train, Split::Validation, Split::Eval].iter().map(|&s| essays_in(&all, s)).collect();
        let names: Vec<HashSet<String>> = parts.iter().map(|p| p.iter().map(|e| e.name.clone()).collect()).collect();
        assert_eq!(names.iter().map(HashSet::len).sum::<usize>(), all.len(), "every essay in exactly one split");
        for i in 0..3 {
            assert!(names[i].len() >= 3, "split {i} has {} essays", names[i].len());
            for j in i + 1..3 {
                assert!(names[i].is_disjoint(&names[j]));
            }
        }
        println!(
            "essays per split (train, validation, eval): {:?}",
            names.iter().map(HashSet::len).collect::<Vec<_>>()
        );
        // The prose of every example is whole sentences of its own split's essays, found in no
        // other split's, and nothing else besides the planted facts.
        for (k, split) in [Split::Train, Split::Validation, Split::Eval].into_iter().enumerate() {
            let source = Source::new(&parts[k], split).unwrap();
            for i in 0..15 {
                let b = build_one(&source, &BuildOptions::default(), example_seed(3, split, i)).unwrap();
                let doc = b.example.document();
                let words = |s: &str| s.split_whitespace().count();
                let prose: Vec<&str> = b.sentences.iter().map(|&i| source.sentences[i].as_str()).collect();
                let planted: usize = b.facts.iter().map(|f| words(&f.text)).sum();
                assert_eq!(words(&doc), planted + prose.iter().map(|s| words(s)).sum::<usize>());
                for s in prose {
                    assert!(doc.contains(s));
                    assert!(parts[k].iter().any(|e| e.text.contains(s)), "{split:?}: {s:?} not from its essays");
                    if s.len() > 80 {
                        for (j, other) in parts.iter().enumerate().filter(|(j, _)| *j != k) {
                            assert!(!other.iter().any(|e| e.text.contains(s)), "{split:?}: {s:?} found in split {j}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn templates_and_values_are_disjoint_across_splits() {
        let sentences = |ts: &[Template]| -> HashSet<String> { ts.iter().flat_map(|t| trigrams(t.sentence)).collect() };
        let (ts, hs) = (sentences(TRAIN_TEMPLATES), sentences(HELDOUT_TEMPLATES));
        assert!(ts.is_disjoint(&hs), "train and held-out facts share {:?}", ts.intersection(&hs).collect::<Vec<_>>());
        let questions: HashSet<String> = TRAIN_TEMPLATES.iter().map(|t| normalize(t.question)).collect();
        assert!(HELDOUT_TEMPLATES.iter().all(|t| !questions.contains(&normalize(t.question))));
        let (tp, hp) = (pool_words(&TRAIN_POOLS), pool_words(&HELDOUT_POOLS));
        let tp: HashSet<&str> = tp.into_iter().collect();
        assert!(hp.iter().all(|w| !tp.contains(w)), "train and held-out pools overlap");
        assert!(TRAIN_POOLS.code_letters.iter().all(|c| !HELDOUT_POOLS.code_letters.contains(c)));
        assert!(TRAIN_POOLS.quantities.end() < HELDOUT_POOLS.quantities.start());
        assert!(TRAIN_POOLS.years.end() < HELDOUT_POOLS.years.start());
    }

    #[test]
    fn pool_values_never_occur_in_the_essays() {
        let text = essays().iter().map(|e| e.text.to_lowercase()).collect::<Vec<_>>().join("\n");
        let words: HashSet<&str> = text.split(|c: char| !c.is_alphanumeric()).collect();
        for p in [&TRAIN_POOLS, &HELDOUT_POOLS] {
            for w in [p.first, p.last, p.places, p.colours].concat() {
                assert!(!words.contains(w.to_lowercase().as_str()), "{w} occurs in the essays");
            }
            for o in p.objects {
                assert!(!text.contains(o), "{o} occurs in the essays");
            }
        }
    }

    #[test]
    fn questions_are_worded_as_users_ask() {
        let stop: HashSet<&str> =
            ["of", "in", "on", "to", "is", "was", "what", "which", "who", "where", "when", "s"].into_iter().collect();
        for tpl in TRAIN_TEMPLATES.iter().chain(HELDOUT_TEMPLATES) {
            let words = |s: &str| -> HashSet<String> {
                normalize(&s.replace("{S}", " ").replace("{V}", " "))
                    .split_whitespace()
                    .filter(|w| !stop.contains(w))
                    .map(str::to_string)
                    .collect()
            };
            let (s, q) = (words(tpl.sentence), words(tpl.question));
            let jaccard = s.intersection(&q).count() as f64 / s.union(&q).count() as f64;
            assert!(jaccard < 0.5, "{:?} / {:?}: word overlap {jaccard:.2}", tpl.sentence, tpl.question);
            assert!(tpl.sentence.contains("{S}") && tpl.sentence.contains("{V}") && tpl.question.contains("{S}"));
            assert!(!tpl.question.contains("{V}"));
            assert_eq!(tpl.role.is_some(), tpl.value == Value::Person);
        }
        // Every value kind has at least two templates on each side (distractors from other templates).
        for ts in [TRAIN_TEMPLATES, HELDOUT_TEMPLATES] {
            for v in [Value::Person, Place, Date, Quantity, Code, Colour, Object] {
                assert!(ts.iter().filter(|t| t.value == v).count() >= 2, "{v:?}");
            }
        }
    }

    #[test]
    fn positives_hold_the_answer_and_distractors_do_not() {
        for split in [Split::Train, Split::Validation, Split::Eval] {
            let templates = templates_for(split);
            for b in built(split, 120, 11) {
                let ex = &b.example;
                let lower: Vec<String> = ex.passages.iter().map(|p| p.to_lowercase()).collect();
                let answer = ex.answer.to_lowercase();
                assert!(!ex.positive.is_empty());
                assert!(
                    ex.positive.windows(2).all(|w| w[0] < w[1]) && *ex.positive.last().unwrap() < ex.passages.len()
                );
                let holding: Vec<usize> = (0..lower.len()).filter(|&i| lower[i].contains(&answer)).collect();
                assert_eq!(holding.len(), 1, "{ex:#?}: answer in passages {holding:?}");
                assert!(ex.positive.contains(&holding[0]));
                assert!(!ex.question.to_lowercase().contains(&answer));
                let supports: Vec<&Planted> = b.facts.iter().filter(|f| f.role == Role::Support).collect();
                let distractors: Vec<&Planted> = b.facts.iter().filter(|f| f.role == Role::Distractor).collect();
                // Each fact in its own passage; distractor passages are not positives.
                let mut seen: Vec<usize> = b.facts.iter().map(|f| f.passage).collect();
                seen.sort_unstable();
                seen.dedup();
                assert_eq!(seen.len(), b.facts.len());
                for f in &b.facts {
                    assert!(ex.passages[f.passage].contains(&f.text));
                }
                assert!(distractors.iter().all(|d| !ex.positive.contains(&d.passage)));
                assert!(distractors.len() >= 2);
                let mut distractor_passages: Vec<usize> = distractors.iter().map(|d| d.passage).collect();
                distractor_passages.sort_unstable();
                assert_eq!(ex.distractors, distractor_passages, "the example's distractor passages");
                match ex.kind.as_str() {
                    "two-hop" => {
                        // The chain: question subject -> bridge person (named in neither the
                        // question) -> answer, in the two positive passages.
                        assert_eq!(ex.positive.len(), 2);
                        let (hop1, hop2) = (supports[0], supports[1]);
                        let bridge = &hop1.value;
                        assert_eq!(&hop2.subject, bridge);
                        assert!(ex.question.contains(&hop1.subject) && !ex.question.contains(bridge.as_str()));
                        assert!(lower[hop1.passage].contains(&bridge.to_lowercase()));
                        assert!(lower[hop2.passage].contains(&bridge.to_lowercase()) && hop2.passage == holding[0]);
                        assert!(lower[hop1.passage].contains(&hop1.subject.to_lowercase()));
                        let bridge_l = bridge.to_lowercase();
                        assert!(ex
                            .passages
                            .iter()
                            .enumerate()
                            .all(|(i, p)| ex.positive.contains(&i) || !p.to_lowercase().contains(&bridge_l)));
                        // A look-alike chain and the subject's own attribute are among the distractors.
                        assert!(distractors.iter().any(|d| d.template == hop1.template && d.subject != hop1.subject));
                        assert!(distractors.iter().any(|d| d.template == hop2.template && d.subject == hop1.subject));
                    }
                    kind => {
                        assert_eq!(ex.positive.len(), 1, "{kind}");
                        let s = supports[0];
                        assert!(ex.question.contains(&s.subject));
                        let value = templates[s.template].value;
                        for d in &distractors {
                            assert_eq!(templates[d.template].value, value, "distractors carry the same kind of value");
                            assert_ne!(d.subject, s.subject, "about another person");
                            assert!(!ex.passages[d.passage].contains(&s.subject));
                        }
                        let same = distractors.iter().any(|d| d.template == s.template);
                        if kind == "confusable" {
                            assert!(same, "a confusable example repeats its template for another person");
                        } else {
                            assert_eq!(kind, "single");
                            assert!(!same);
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn lengths_within_bounds_and_passages_sentence_aligned() {
        let opts = BuildOptions::default();
        let source = Source::new(&essays_in(&essays(), Split::Train), Split::Train).unwrap();
        let mut totals = Vec::new();
        for i in 0..100 {
            let b = build_one(&source, &opts, example_seed(5, Split::Train, i)).unwrap();
            let ex = &b.example;
            let total = approx_tokens(&ex.document());
            assert!((opts.min_tokens..=opts.max_tokens).contains(&total), "{total} tokens");
            totals.push(total);
            // Every prose sentence lies whole inside one passage.
            for &si in &b.sentences {
                assert!(
                    ex.passages.iter().any(|p| p.contains(&source.sentences[si])),
                    "{:?} was cut",
                    source.sentences[si]
                );
            }
            // A passage is over budget only when it is one sentence alone.
            for p in &ex.passages {
                let alone =
                    b.sentences.iter().any(|&si| source.sentences[si] == *p) || b.facts.iter().any(|f| f.text == *p);
                assert!(approx_tokens(p) <= opts.passage_tokens || alone, "{} tokens: {p:?}", approx_tokens(p));
            }
        }
        totals.sort_unstable();
        println!(
            "document tokens: min {} median {} max {}",
            totals[0],
            totals[totals.len() / 2],
            totals[totals.len() - 1]
        );
        assert!(totals[0] < 800 && totals[totals.len() - 1] > 1700, "lengths spread over 512..2048: {totals:?}");
    }

    /// The word-based estimate against the default model's real tokenizer.
    #[test]
    fn approx_tokens_track_the_default_tokenizer() {
        let tok = crate::model::tokenizer::TextTokenizer::from_gguf_file(&crate::fetch::default_model_path())
            .expect("default model (run `lift-serve fetch-model`)");
        let mut ratios = Vec::new();
        for split in [Split::Train, Split::Eval] {
            for ex in build_examples(&essays_dir(), split, 40, 2).unwrap() {
                let doc = ex.document();
                let real = tok.encode(&doc, false).unwrap().len();
                ratios.push(real as f64 / approx_tokens(&doc) as f64);
            }
        }
        ratios.sort_by(f64::total_cmp);
        let mean = ratios.iter().sum::<f64>() / ratios.len() as f64;
        println!("real / approximate tokens: min {:.3} mean {mean:.3} max {:.3}", ratios[0], ratios[ratios.len() - 1]);
        assert!((0.9..=1.1).contains(&mean), "mean ratio {mean:.3}");
    }

    #[test]
    fn all_kinds_present_with_two_hop() {
        let dir = essays_dir();
        let examples = build_examples(&dir, Split::Train, 200, 1).unwrap();
        let count = |k: &str| examples.iter().filter(|e| e.kind == k).count();
        let (two, conf, single) = (count("two-hop"), count("confusable"), count("single"));
        println!("two-hop {two}, confusable {conf}, single {single}");
        assert_eq!(two + conf + single, 200);
        assert!((40..=80).contains(&two) && conf >= 40 && single >= 40);
        // Every template appears, and every value kind is the answer somewhere.
        let eval = build_examples(&dir, Split::Eval, 200, 1).unwrap();
        for (ts, exs) in [(TRAIN_TEMPLATES, &examples), (HELDOUT_TEMPLATES, &eval)] {
            for t in ts {
                let prefix = t.sentence.split("{").next().unwrap();
                let suffix = t.sentence.rsplit("}").next().unwrap();
                assert!(
                    exs.iter().any(|e| e.passages.iter().any(|p| p.contains(prefix) && p.contains(suffix))),
                    "{}",
                    t.sentence
                );
            }
        }
    }

    /// `cargo test --release --lib base::data::tests::show_examples -- --nocapture` prints three.
    #[test]
    fn show_examples() {
        let dir = essays_dir();
        let examples = build_examples(&dir, Split::Train, 3, 0).unwrap();
        for (i, ex) in examples.iter().enumerate() {
            println!(
                "=== example {i}: {} ({} passages, ~{} tokens)",
                ex.kind,
                ex.passages.len(),
                approx_tokens(&ex.document())
            );
            println!("Q: {}\nA: {}", ex.question, ex.answer);
            for (k, p) in ex.passages.iter().enumerate() {
                let mark = if ex.positive.contains(&k) { "+" } else { " " };
                println!("{mark}[{k:2}] {p}");
            }
        }
        println!("data hash: {}", data_hash(&examples));
        assert_eq!(examples.len(), 3);
    }
}
