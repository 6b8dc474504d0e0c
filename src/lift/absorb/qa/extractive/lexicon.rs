//! Word lists and word-level rules of the extractive generator, and the per-document lexicon of
//! proper names.

use super::sentence::{Sent, Word};
use crate::lift::absorb::qa::words::is_stopword;
use crate::lift::absorb::text::Span;
use std::collections::{HashMap, HashSet};

pub(super) const MONTHS: &[&str] = &[
    "january", "february", "march", "april", "may", "june", "july", "august", "september", "october", "november",
    "december", "jan", "feb", "mar", "apr", "jun", "jul", "aug", "sep", "sept", "oct", "nov", "dec",
];
pub(super) const NUMBER_WORDS: &[&str] = &[
    "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve", "thirteen", "fourteen",
    "fifteen", "sixteen", "seventeen", "eighteen", "nineteen", "twenty", "thirty", "forty", "fifty", "sixty",
    "seventy", "eighty", "ninety", "hundred", "thousand", "dozen", "dozens", "hundreds", "thousands", "millions",
];
pub(super) const WEEKDAYS: &[&str] = &["monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday"];
const TITLES: &[&str] = &[
    "mr", "mrs", "ms", "miss", "dr", "prof", "professor", "sir", "dame", "lady", "lord", "king", "queen", "prince",
    "princess", "captain", "capt", "general", "gen", "colonel", "col", "lieutenant", "lt", "sergeant", "sgt", "judge",
    "president", "senator", "governor", "mayor", "father", "mother", "sister", "brother", "uncle", "aunt", "saint",
    "st", "rev", "reverend", "bishop", "detective", "inspector", "officer", "agent", "chief", "director", "doctor",
];
const KINSHIP: &[&str] = &[
    "sister", "brother", "wife", "husband", "son", "daughter", "mother", "father", "friend", "colleague", "uncle",
    "aunt", "cousin", "nephew", "niece", "partner", "grandmother", "grandfather", "mr", "mrs", "ms", "dr",
];
pub(super) const PLACE_HEADS: &[&str] = &[
    "city", "town", "village", "county", "state", "province", "country", "republic", "kingdom", "island", "islands",
    "river", "lake", "sea", "ocean", "mountain", "mountains", "mount", "valley", "bay", "coast", "street", "road",
    "avenue", "square", "park", "bridge", "station", "airport", "harbor", "harbour", "port", "district", "region",
    "hall", "tower", "castle", "palace", "church", "cathedral", "museum", "library", "hotel", "office", "building",
    "house", "center", "centre", "hospital", "forest", "desert", "peninsula", "canal", "gate", "plaza", "market",
];
pub(super) const ORG_HEADS: &[&str] = &[
    "company", "corporation", "corp", "inc", "ltd", "llc", "group", "bank", "university", "college", "school",
    "institute", "academy", "council", "committee", "department", "ministry", "agency", "association", "society",
    "foundation", "party", "club", "team", "army", "navy", "fund", "trust", "press", "times", "journal", "project",
    "program", "programme", "prize", "award", "act", "treaty", "war", "festival", "conference", "union", "league",
];
pub(super) const CONNECTORS: &[&str] =
    &["of", "de", "da", "del", "della", "di", "du", "van", "von", "der", "den", "la", "le", "y", "bin", "al"];
pub(super) const PREPOSITIONS: &[&str] = &[
    "in", "on", "at", "by", "from", "to", "into", "near", "during", "since", "until", "before", "after", "with", "for",
    "of", "about", "across", "through", "toward", "towards", "inside", "outside", "behind", "beside", "under", "over",
    "between", "among", "around", "past", "above", "below", "beneath", "along", "beyond", "opposite", "off", "outside",
    "throughout", "within", "without", "against", "upon", "via", "like", "than",
];
pub(super) const COPULAS: &[&str] = &["is", "are", "was", "were"];
pub(super) const AUXILIARIES: &[&str] =
    &["is", "are", "was", "were", "has", "have", "had", "will", "would", "can", "could"];
pub(super) const PRONOUN_SUBJECTS: &[&str] = &[
    "it", "this", "that", "there", "he", "she", "they", "these", "those", "we", "i", "you", "here", "which", "who",
    "what", "one", "all", "some", "each", "both",
];
pub(super) const NAMING_VERBS: &[&str] = &["named", "called", "titled", "entitled", "nicknamed", "dubbed", "known"];
const IRREGULAR_PARTICIPLES: &[&str] = &[
    "born", "held", "built", "made", "known", "given", "taken", "written", "found", "seen", "sold", "paid", "kept",
    "left", "sent", "told", "begun", "chosen", "done", "drawn", "driven", "fallen", "grown", "hidden", "led", "lost",
    "meant", "met", "put", "read", "set", "shown", "shut", "spent", "stolen", "struck", "thrown", "understood", "won",
    "worn", "bought", "brought", "caught", "taught", "thought", "sung", "run", "hung", "laid", "lit", "sold", "cast",
    "sworn", "torn", "woven", "frozen", "spoken", "broken", "forgotten", "risen", "beaten", "bitten", "eaten",
    "ridden", "shaken", "sunk", "drunk", "rung", "dug", "fed", "bred", "bent", "lent", "dealt", "swept", "bound",
];
pub(super) const ADVERBS: &[&str] = &[
    "first", "later", "originally", "also", "once", "still", "then", "now", "formally", "officially", "finally",
    "recently",
];
pub(super) const CLAUSE_WORDS: &[&str] =
    &["and", "or", "but", "who", "which", "that", "when", "where", "while", "because", "although", "so"];
pub(super) const COMMON_VERBS: &[&str] = &[
    "met", "saw", "gave", "became", "won", "led", "left", "wrote", "made", "took", "got", "sold", "bought", "found",
    "built", "told", "said", "went", "came", "ran", "paid", "kept", "held", "sent", "lost", "began", "chose", "drew",
    "drove", "ate", "fell", "flew", "grew", "hid", "knew", "meant", "put", "read", "set", "showed", "spent", "stole",
    "struck", "threw", "understood", "wore", "brought", "caught", "taught", "thought", "sang", "hung", "laid", "lit",
    "joined", "moved", "lives", "lived", "works", "worked", "owns", "owned", "runs", "leads", "holds", "keeps",
    "visited", "married", "remains", "remained", "contains", "contained", "includes", "included", "cost", "costs",
];

pub(super) fn is_participle(w: &str) -> bool {
    let l = w.to_lowercase();
    (l.len() > 4 && l.ends_with("ed")) || IRREGULAR_PARTICIPLES.contains(&l.as_str())
}

/// Letters and digits mixed, other than ordinals and decades ("2nd", "1990s").
pub(super) fn is_code(w: &str) -> bool {
    let digits = w.trim_end_matches(|c: char| c.is_ascii_alphabetic());
    let suffix = &w[digits.len()..];
    let ordinal = digits.chars().all(|c| c.is_ascii_digit()) && matches!(suffix, "st" | "nd" | "rd" | "th" | "s");
    w.chars().any(|c| c.is_alphabetic()) && !ordinal
}

pub(super) fn is_year(w: &str) -> bool {
    let t = w.strip_suffix('s').unwrap_or(w);
    t.len() == 4 && t.chars().all(|c| c.is_ascii_digit()) && (1000..=2199).contains(&t.parse::<u32>().unwrap_or(0))
}

pub(super) fn is_day(w: &str) -> bool {
    let t = w.trim_end_matches(|c: char| c.is_alphabetic());
    !t.is_empty()
        && t.len() <= 2
        && t.chars().all(|c| c.is_ascii_digit())
        && (1..=31).contains(&t.parse::<u32>().unwrap_or(0))
}

pub(super) fn is_time(w: &str) -> bool {
    let mut parts = w.split(':');
    matches!((parts.next(), parts.next()), (Some(h), Some(m)) if !h.is_empty() && h.len() <= 2 && m.len() == 2
        && h.chars().all(|c| c.is_ascii_digit()) && m.chars().all(|c| c.is_ascii_digit()))
}

/// "DON'T", "can't", "We'll" (not "O'Hara").
pub(super) fn is_contraction(w: &str) -> bool {
    let l = w.to_lowercase().replace('’', "'");
    l.contains('\'')
        && (["n't", "'ll", "'re", "'ve", "'d", "'m"].iter().any(|s| l.ends_with(s))
            || !w.chars().any(char::is_lowercase))
}

pub(super) fn is_title(w: &str) -> bool {
    TITLES.contains(&w.to_lowercase().trim_end_matches('.'))
}

/// Whether word `w` looks like a verb (so a phrase may start or end next to it).
pub(super) fn verbish(w: &Word) -> bool {
    let l = w.lower();
    w.starts_lower() && (AUXILIARIES.contains(&l.as_str()) || is_participle(&l) || COMMON_VERBS.contains(&l.as_str()))
}

/// Regular past participles that are also the simple past ("founded", "designed"), so an agent
/// question can be worded actively: "was founded by X" → "Who founded …?".
pub(super) fn past_equals_participle(w: &str) -> bool {
    let l = w.to_lowercase();
    (l.len() > 4 && l.ends_with("ed"))
        || ["built", "made", "held", "found", "sold", "paid", "kept", "led", "bought", "brought", "taught", "won"]
            .contains(&l.as_str())
}

/// Base form of a past-tense verb ("bought" → "buy", "hired" → "hire", "stopped" → "stop"), for
/// "When did X buy …?"; `None` when the word does not look like a simple past.
pub(super) fn base_form(past: &str) -> Option<String> {
    const IRREGULAR: &[(&str, &str)] = &[
        ("bought", "buy"),
        ("built", "build"),
        ("began", "begin"),
        ("sold", "sell"),
        ("made", "make"),
        ("took", "take"),
        ("gave", "give"),
        ("wrote", "write"),
        ("found", "find"),
        ("became", "become"),
        ("won", "win"),
        ("led", "lead"),
        ("left", "leave"),
        ("held", "hold"),
        ("kept", "keep"),
        ("paid", "pay"),
        ("sent", "send"),
        ("met", "meet"),
        ("brought", "bring"),
        ("came", "come"),
        ("went", "go"),
        ("got", "get"),
        ("saw", "see"),
        ("told", "tell"),
        ("said", "say"),
        ("lost", "lose"),
        ("spent", "spend"),
        ("grew", "grow"),
        ("drew", "draw"),
        ("ran", "run"),
        ("rose", "rise"),
        ("fell", "fall"),
        ("knew", "know"),
        ("chose", "choose"),
        ("taught", "teach"),
        ("caught", "catch"),
        ("sank", "sink"),
        ("set", "set"),
        ("put", "put"),
        ("hit", "hit"),
        ("moved", "move"),
        ("opened", "open"),
        ("closed", "close"),
        ("joined", "join"),
    ];
    let l = past.to_lowercase();
    if let Some((_, base)) = IRREGULAR.iter().find(|(p, _)| *p == l) {
        return Some(base.to_string());
    }
    let stem = l.strip_suffix("ed").filter(|s| s.len() >= 3)?;
    let b = stem.as_bytes();
    let last = b[b.len() - 1];
    let vowel = |c: u8| b"aeiou".contains(&c);
    Some(if let Some(s) = stem.strip_suffix('i') {
        format!("{s}y") // carried → carry
    } else if b.len() >= 3 && last == b[b.len() - 2] && b"bdgmnpt".contains(&last) {
        stem[..stem.len() - 1].to_string() // stopped → stop
    } else if b"vcuz".contains(&last)
        || (vowel(b[b.len() - 2])
            && !vowel(b[b.len().saturating_sub(3)])
            && b"rst".contains(&last)
            && b[b.len() - 2] != b'e')
    {
        format!("{stem}e") // survived, introduced, argued, hired, based, located
    } else {
        stem.to_string() // opened, employed, launched
    })
}

/// The text with its first letter upper-cased.
pub(super) fn first_char_upper(s: &str) -> String {
    let mut c = s.chars();
    match c.next() {
        Some(f) => f.to_uppercase().chain(c).collect(),
        None => String::new(),
    }
}

/// Whitespace runs folded to one space, none before punctuation.
pub(super) fn squeeze(s: &str) -> String {
    let joined = s.split_whitespace().collect::<Vec<_>>().join(" ");
    joined.replace(" ,", ",").replace(" .", ".").replace(" ;", ";").replace(" :", ":").replace(" ?", "?")
}

/// Lower-cases the first letter of a noun phrase moved into the middle of a question, unless it
/// starts with a name or acronym.
pub(super) fn decap(phrase: &str, lex: &Lexicon) -> String {
    let first = phrase.split_whitespace().next().unwrap_or("");
    let possessive = first.ends_with("'s") || first.ends_with("’s");
    let core = first.trim_end_matches("'s").trim_end_matches("’s").trim_matches(|c: char| !c.is_alphanumeric());
    let acronym = core.chars().count() > 1 && core.chars().all(|c| !c.is_lowercase());
    let next_capitalised =
        phrase.split_whitespace().nth(1).is_some_and(|w| w.chars().next().is_some_and(char::is_uppercase));
    let inner_caps = core.chars().skip(1).any(char::is_uppercase);
    let name = lex.proper.contains(core) || acronym || inner_caps || is_title(core) || possessive || next_capitalised;
    if is_stopword(core) || !name {
        let mut c = phrase.chars();
        match c.next() {
            Some(f) => f.to_lowercase().chain(c).collect(),
            None => String::new(),
        }
    } else {
        phrase.to_string()
    }
}

/// Per-document knowledge used by the rules: capitalised words seen in mid-sentence (so a
/// sentence-initial capitalised word is a name only if it is also capitalised elsewhere).
pub(super) struct Lexicon {
    pub(super) proper: HashSet<String>,
    /// Words seen in two-word capitalised names or after a kinship word ("Thomas Reed", "his
    /// sister Margaret"): alone later, they still name a person.
    pub(super) person_like: HashSet<String>,
}

impl Lexicon {
    /// Words capitalised in mid-sentence more often than they appear in lower case, counted
    /// over prose sentences only (title-case headings would make every word a name).
    pub(super) fn new(doc: &str, sentences: &[Span]) -> Self {
        let mut capitalised: HashMap<&str, usize> = HashMap::new();
        let mut lower: HashMap<String, usize> = HashMap::new();
        let mut person_like = HashSet::new();
        let head = |w: &str| {
            let l = w.to_lowercase();
            ORG_HEADS.contains(&l.as_str()) || PLACE_HEADS.contains(&l.as_str()) || is_stopword(&l) || is_title(&l)
        };
        for span in sentences {
            let Some(s) = Sent::new(doc, span) else {
                continue;
            };
            for (i, w) in s.words.iter().enumerate() {
                if w.capitalised() && !head(w.text) && w.text.chars().any(char::is_lowercase) {
                    let prev = i.checked_sub(1).map(|p| s.words[p].lower());
                    if prev.as_deref().is_some_and(|p| KINSHIP.contains(&p.trim_end_matches('.'))) {
                        person_like.insert(w.text.to_string());
                    }
                    if let Some(next) = s.words.get(i + 1) {
                        let pair = next.capitalised()
                            && !head(next.text)
                            && next.text.chars().any(char::is_lowercase)
                            && !s.breaks_after(i)
                            && prev.as_deref() != Some("the")
                            && s.words.get(i + 2).is_none_or(|w3| !w3.capitalised());
                        if pair {
                            person_like.insert(w.text.to_string());
                            person_like.insert(next.text.to_string());
                        }
                    }
                }
                if w.starts_lower() {
                    *lower.entry(w.text.to_string()).or_default() += 1;
                    continue;
                }
                if i == 0 || !w.capitalised() || is_stopword(w.text) {
                    continue;
                }
                let prev = &s.words[i - 1];
                let prev_raw = &s.body[prev.raw.0..prev.raw.1];
                if !prev_raw.ends_with(['.', ':', '!', '?', '"', '“']) {
                    *capitalised.entry(w.text).or_default() += 1;
                }
            }
        }
        let proper = capitalised
            .into_iter()
            .filter(|(w, n)| *n > lower.get(&w.to_lowercase()).copied().unwrap_or(0))
            .map(|(w, _)| w.to_string())
            .collect();
        Self { proper, person_like }
    }
}
