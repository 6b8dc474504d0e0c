//! Entities: the facts of a sentence a question can ask for (numbers, dates, times, names, quoted
//! strings, codes, short predicates and passive objects).

use super::lexicon::{
    is_code, is_contraction, is_day, is_participle, is_time, is_title, is_year, verbish, Lexicon, CLAUSE_WORDS,
    CONNECTORS, COPULAS, MONTHS, NUMBER_WORDS, ORG_HEADS, PLACE_HEADS, PREPOSITIONS, WEEKDAYS,
};
use super::sentence::Sent;
use crate::lift::absorb::qa::words::is_stopword;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Kind {
    Number,
    /// A number followed by the noun it counts ("42 rooms"); `noun` is that word's index.
    Count {
        noun: usize,
    },
    Year,
    Date,
    Time,
    Person,
    Place,
    /// A name of something else; `head` is the index of a generic head noun ("Company") if any.
    Thing {
        head: Option<usize>,
    },
    Quote,
    /// An identifier mixing letters and digits ("LKN-7", "A4").
    Code,
    /// A short descriptive predicate ("a small fishing town").
    Phrase,
}

#[derive(Clone, Debug)]
pub(super) struct Entity {
    /// Byte range in the body (the answer text).
    pub(super) s: usize,
    pub(super) e: usize,
    /// Word range `[w0, w1)`.
    pub(super) w0: usize,
    pub(super) w1: usize,
    pub(super) kind: Kind,
    /// Preposition word right before the entity.
    pub(super) prep: Option<usize>,
}

/// Finds numbers, dates, times, names and quoted strings in a sentence.
pub(super) fn find_entities(s: &Sent, lex: &Lexicon) -> Vec<Entity> {
    let mut finder = Finder { s, used: bracketed(s), out: Vec::new() };
    // Each step skips words an earlier one took.
    finder.quotes();
    finder.dates();
    finder.numbers();
    finder.names(lex);
    let mut out = finder.out;
    out.sort_by_key(|e| e.w0);
    out
}

/// Per word, whether it sits inside brackets (citations, asides, equation numbers): such words are
/// not asked about.
fn bracketed(s: &Sent) -> Vec<bool> {
    let mut depth = 0i32;
    let mut inside = vec![false; s.body.len() + 1];
    for (i, c) in s.body.char_indices() {
        match c {
            '(' | '[' => depth += 1,
            ')' | ']' => depth = (depth - 1).max(0),
            _ => {}
        }
        inside[i] = depth > 0;
    }
    s.words.iter().map(|w| inside[w.core.0]).collect()
}

/// Verbs that follow a person's name more often than any other.
const PERSON_VERBS: &[&str] =
    &["said", "says", "told", "asked", "wrote", "replied", "explained", "founded", "married", "died"];

/// The entities of one sentence found so far, and which words are taken.
struct Finder<'s, 'a> {
    s: &'s Sent<'a>,
    used: Vec<bool>,
    out: Vec<Entity>,
}

impl Finder<'_, '_> {
    /// The preposition word right before word `i`.
    fn prep_before(&self, i: usize) -> Option<usize> {
        let ws = &self.s.words;
        (i > 0 && PREPOSITIONS.contains(&ws[i - 1].lower().as_str()) && !self.s.breaks_after(i - 1)).then(|| i - 1)
    }

    /// Takes words `[w0, w1)` as an entity, unless one of them is taken already.
    fn push(&mut self, w0: usize, w1: usize, kind: Kind) {
        if w0 >= w1 || self.used[w0..w1].iter().any(|&u| u) {
            return;
        }
        self.used[w0..w1].iter_mut().for_each(|u| *u = true);
        let ws = &self.s.words;
        let ent = Entity { s: ws[w0].core.0, e: ws[w1 - 1].core.1, w0, w1, kind, prep: self.prep_before(w0) };
        self.out.push(ent);
    }

    /// Quoted strings of one to ten words (the answer is the text inside the quotes).
    fn quotes(&mut self) {
        let s = self.s;
        let ws = &s.words;
        for (open, close) in [('"', '"'), ('“', '”')] {
            let mut from = 0;
            while let Some(a) = s.body[from..].find(open).map(|p| p + from) {
                let inner_start = a + open.len_utf8();
                let Some(b) = s.body[inner_start..].find(close).map(|p| p + inner_start) else {
                    break;
                };
                let inner = s.body[inner_start..b].trim_end_matches([',', '.']);
                let count = inner.split_whitespace().count();
                let w0 = ws.iter().position(|w| w.raw.0 <= inner_start && inner_start < w.raw.1.max(w.raw.0 + 1));
                let w1 = ws.iter().rposition(|w| w.raw.0 < b);
                if let (Some(w0), Some(w1)) = (w0, w1) {
                    if (1..=10).contains(&count)
                        && w0 <= w1
                        && !self.used[w0..=w1].iter().any(|&u| u)
                        && !inner.trim().is_empty()
                    {
                        self.used[w0..=w1].iter_mut().for_each(|u| *u = true);
                        let start =
                            inner_start + (s.body[inner_start..].len() - s.body[inner_start..].trim_start().len());
                        let prep = self.prep_before(w0);
                        self.out.push(Entity {
                            s: start,
                            e: inner_start + inner.trim_end().len(),
                            w0,
                            w1: w1 + 1,
                            kind: Kind::Quote,
                            prep,
                        });
                    }
                }
                from = b + close.len_utf8();
            }
        }
    }

    /// Dates: "March 3, 1999", "3 March 1999", "March 1999", "March 3"; weekdays.
    fn dates(&mut self) {
        let s = self.s;
        let ws = &s.words;
        let n = ws.len();
        let mut i = 0;
        while i < n {
            let l = ws[i].lower();
            let month = MONTHS.contains(&l.trim_end_matches('.')) && ws[i].capitalised();
            if month {
                let mut w0 = i;
                let mut w1 = i + 1;
                if i > 0 && is_day(ws[i - 1].text) && !s.breaks_after(i - 1) {
                    w0 = i - 1;
                }
                if w1 < n && is_day(ws[w1].text) && !s.breaks_after(i) {
                    w1 += 1;
                }
                if w1 < n
                    && is_year(ws[w1].text)
                    && (!s.breaks_after(w1 - 1) || s.body[ws[w1 - 1].raw.0..ws[w1 - 1].raw.1].ends_with(','))
                {
                    w1 += 1;
                }
                // "May" alone is a verb more often than not.
                if w1 - w0 > 1 || (l != "may" && l != "march") {
                    self.push(w0, w1, Kind::Date);
                }
                i = w1;
                continue;
            }
            if WEEKDAYS.contains(&l.as_str()) && ws[i].capitalised() {
                self.push(i, i + 1, Kind::Date);
            }
            i += 1;
        }
    }

    /// Numbers, years, times, codes; spelled-out numbers when they count something ("four people").
    fn numbers(&mut self) {
        let s = self.s;
        let ws = &s.words;
        let n = ws.len();
        for i in 0..n {
            if !self.used[i] && NUMBER_WORDS.contains(&ws[i].lower().as_str()) && i + 1 < n && !s.breaks_after(i) {
                let next = &ws[i + 1];
                if next.starts_lower() && next.text.chars().all(char::is_alphabetic) && !is_stopword(next.text) {
                    self.push(i, i + 1, Kind::Count { noun: i + 1 });
                }
                continue;
            }
            if self.used[i] || !ws[i].has_digit() {
                continue;
            }
            let t = ws[i].text;
            if is_time(t) {
                let w1 = if i + 1 < n
                    && matches!(ws[i + 1].lower().as_str(), "a.m." | "p.m." | "a.m" | "p.m" | "am" | "pm")
                {
                    i + 2
                } else {
                    i + 1
                };
                self.push(i, w1, Kind::Time);
            } else if i + 1 < n
                && matches!(ws[i + 1].lower().as_str(), "a.m." | "p.m." | "a.m" | "p.m" | "am" | "pm" | "o'clock")
            {
                self.push(i, i + 2, Kind::Time);
            } else if is_year(t) {
                self.push(i, i + 1, Kind::Year);
            } else if is_code(t) {
                self.push(i, i + 1, Kind::Code);
            } else {
                self.quantity(i);
            }
        }
    }

    /// A plain number at word `i` with its multiplier or unit ("2.5 million", "40 per cent"),
    /// counting the noun after it when there is one ("42 rooms").
    fn quantity(&mut self, i: usize) {
        let s = self.s;
        let ws = &s.words;
        let n = ws.len();
        let mut w1 = i + 1;
        if w1 < n
            && matches!(
                ws[w1].lower().as_str(),
                "hundred" | "thousand" | "million" | "billion" | "trillion" | "percent" | "per"
            )
        {
            w1 += if ws[w1].lower() == "per" && w1 + 1 < n { 2 } else { 1 };
        }
        let counted = w1 < n
            && !s.breaks_after(w1 - 1)
            && ws[w1].starts_lower()
            && ws[w1].text.chars().all(char::is_alphabetic)
            && !is_stopword(ws[w1].text)
            && !ws[i].text.contains(['%', '$', '£', '€']);
        let kind = if counted { Kind::Count { noun: w1 } } else { Kind::Number };
        self.push(i, w1, kind);
    }

    /// Whether word `j` is free and capitalised like a name (not "I", a month, a weekday or a
    /// shouted contraction).
    fn capitalised(&self, j: usize) -> bool {
        let w = &self.s.words[j];
        !self.used[j]
            && w.capitalised()
            && w.text.chars().any(char::is_alphabetic)
            && w.text != "I"
            && !is_contraction(w.text)
            && !MONTHS.contains(&w.lower().as_str())
            && !WEEKDAYS.contains(&w.lower().as_str())
    }

    /// Capitalised names: runs of capitalised words, with connectors inside ("Bank of England").
    /// A single capitalised word opening the sentence is a name only if the document capitalises
    /// it elsewhere too.
    fn names(&mut self, lex: &Lexicon) {
        let s = self.s;
        let ws = &s.words;
        let n = ws.len();
        let mut i = 0;
        while i < n {
            if !self.capitalised(i) || (is_stopword(ws[i].text) && !is_title(ws[i].text)) {
                i += 1;
                continue;
            }
            let mut j = i + 1;
            while j < n && !s.breaks_after(j - 1) && !s.is_possessive(j - 1) && ws[j].raw.0 == ws[j].core.0 {
                if self.capitalised(j) && !is_stopword(ws[j].text) {
                    j += 1;
                } else if CONNECTORS.contains(&ws[j].lower().as_str())
                    && j + 1 < n
                    && self.capitalised(j + 1)
                    && !s.breaks_after(j)
                {
                    j += 2;
                } else {
                    break;
                }
            }
            let w0 = i;
            let single = j - w0 == 1;
            let at_start = w0 == 0 || s.body[..ws[w0].raw.0].trim_end().ends_with([':', '"', '“', '(']);
            let only_title = (w0..j).all(|k| is_title(ws[k].text));
            let known = lex.proper.contains(ws[w0].text) || s.is_possessive(w0) || !single;
            if !(only_title || (at_start && single && !known)) {
                let kind = self.name_kind(lex, w0, j);
                self.push(w0, j, kind);
            }
            i = j;
        }
    }

    /// What the name in words `[w0, w1)` names: by its head noun ("… Company", "… Street"), a
    /// title, the preposition before it, or how it is written and what follows it.
    fn name_kind(&self, lex: &Lexicon, w0: usize, w1: usize) -> Kind {
        let ws = &self.s.words;
        let single = w1 - w0 == 1;
        let titled = is_title(ws[w0].text) || (w0 > 0 && is_title(ws[w0 - 1].text));
        let lowers: Vec<String> = (w0..w1).map(|k| ws[k].lower()).collect();
        let has = |list: &[&str]| lowers.iter().rposition(|l| list.contains(&l.as_str()));
        let prep = self.prep_before(w0).map(|p| ws[p].lower());
        let the_before = w0 > 0 && ws[w0 - 1].lower() == "the";
        if let Some(h) = has(ORG_HEADS) {
            Kind::Thing { head: Some(w0 + h) }
        } else if let Some(h) = has(PLACE_HEADS) {
            if matches!(prep.as_deref(), Some("in" | "at" | "from" | "to" | "near" | "into")) {
                Kind::Place
            } else {
                Kind::Thing { head: Some(w0 + h) }
            }
        } else if titled {
            Kind::Person
        } else if matches!(prep.as_deref(), Some("in" | "at" | "from" | "to" | "near" | "into" | "across" | "through"))
            && !(single && ws[w0].text.chars().all(|c| !c.is_lowercase()))
        {
            Kind::Place
        } else if !the_before
            && ((!single && w1 - w0 <= 3 && !lowers.iter().any(|l| CONNECTORS.contains(&l.as_str())))
                || ws.get(w1).is_some_and(|w| PERSON_VERBS.contains(&w.lower().as_str()))
                || (w0..w1).all(|k| lex.person_like.contains(ws[k].text)))
        {
            Kind::Person
        } else {
            Kind::Thing { head: None }
        }
    }
}

/// The entity as a whole phrase: start word (including a determiner before it) when the entity
/// can be replaced or moved without breaking the sentence; `None` when it sits inside a larger
/// noun phrase ("the Lisbon office").
pub(super) fn constituent(s: &Sent, ent: &Entity) -> Option<usize> {
    let ws = &s.words;
    let n = ws.len();
    let mut cs = ent.w0;
    if cs > 0 && matches!(ws[cs - 1].lower().as_str(), "the" | "a" | "an") && !s.breaks_after(cs - 1) {
        cs -= 1;
    }
    let numeric = matches!(ent.kind, Kind::Number | Kind::Count { .. } | Kind::Year | Kind::Code);
    // A label's number ("Table 9", "Room 12") is part of a name.
    let prev = ent.w0.checked_sub(1).map(|p| &ws[p]);
    if numeric && prev.is_some_and(|p| p.capitalised() && !is_stopword(p.text) && !s.breaks_after(ent.w0 - 1)) {
        return None;
    }
    let start_ok = cs == 0
        || (numeric && cs == ent.w0)
        || s.body[..ws[cs].raw.0].trim_end().ends_with([',', ':', ';', '(', '—', '"', '“'])
        || PREPOSITIONS.contains(&ws[cs - 1].lower().as_str())
        || verbish(&ws[cs - 1]);
    let intro = cs == 0 || s.body[..ws[cs].raw.0].trim_end().ends_with(',');
    let end_ok = ent.w1 == n
        || s.breaks_after(ent.w1 - 1)
        || (intro && ws[ent.w1].starts_lower())
        || matches!(ent.kind, Kind::Count { .. })
        || PREPOSITIONS.contains(&ws[ent.w1].lower().as_str())
        || CLAUSE_WORDS.contains(&ws[ent.w1].lower().as_str())
        || verbish(&ws[ent.w1]);
    (start_ok && end_ok).then_some(cs)
}

/// Extra entity for a passive clause: the noun phrase after the participle's first preposition
/// ("her hull was planked with larch from …" → "larch"), ended at the next preposition, comma or
/// clause word; common nouns are facts too.
pub(super) fn passive_object(s: &Sent) -> Option<Entity> {
    let ws = &s.words;
    let n = ws.len();
    let c = ws.iter().position(|w| COPULAS.contains(&w.lower().as_str()))?;
    let p = s.predicate_start(c);
    if p + 2 >= n || !is_participle(ws[p].text) || !ws[p].starts_lower() {
        return None;
    }
    let prep = p + 1;
    if !["with", "from", "of", "for", "on", "into", "in"].contains(&ws[prep].lower().as_str()) || s.breaks_after(p) {
        return None;
    }
    let mut w0 = prep + 1;
    if w0 < n && matches!(ws[w0].lower().as_str(), "a" | "an" | "the") {
        w0 += 1;
    }
    let mut w1 = w0;
    while w1 < n
        && !PREPOSITIONS.contains(&ws[w1].lower().as_str())
        && !CLAUSE_WORDS.contains(&ws[w1].lower().as_str())
        && !verbish(&ws[w1])
        && !ws[w1].has_digit()
    {
        w1 += 1;
        if s.breaks_after(w1 - 1) {
            break;
        }
    }
    if w1 < n && (ws[w1].lower() == "of" || ws[w1].has_digit()) {
        return None; // "in the spring of 1887": the noun is only a frame
    }
    let idiom = w1 == w0 + 1
        && ["part", "turn", "fact", "general", "particular", "time", "order", "place", "use"]
            .contains(&ws[w0].lower().as_str());
    if w1 == w0 || w1 - w0 > 5 || idiom || (w0..w1).any(|i| ws[i].capitalised()) {
        return None;
    }
    Some(Entity { s: ws[w0].core.0, e: ws[w1 - 1].core.1, w0, w1, kind: Kind::Phrase, prep: Some(prep) })
}

/// The predicate of a short copula is a fact in itself ("The museum is a former prison"), when
/// no other entity sits in it.
pub(super) fn predicate_entity(s: &Sent, copula: Option<usize>, ents: &[Entity]) -> Option<Entity> {
    let c = copula?;
    let n = s.words.len();
    let p0 = s.predicate_start(c);
    if p0 >= n {
        return None; // the copula ends the sentence ("That is what it is."): no predicate
    }
    let pred_words = n - p0;
    let passive = is_participle(s.words[p0].text)
        && s.words.get(p0 + 1).is_none_or(|w| PREPOSITIONS.contains(&w.lower().as_str()) || s.breaks_after(p0));
    let fits = COPULAS.contains(&s.words[c].lower().as_str())
        && (1..=10).contains(&pred_words)
        && !passive
        && !ents.iter().any(|e| e.w0 >= p0);
    fits.then(|| Entity {
        s: s.words[p0].core.0,
        e: s.words[n - 1].core.1,
        w0: p0,
        w1: n,
        kind: Kind::Phrase,
        prep: None,
    })
}
