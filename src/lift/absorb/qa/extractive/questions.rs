//! Question shapes for one fact: the direct wh-question, "According to the document, …", cloze,
//! typed, in-place and tense variants, and shapes tied to a clause's construction (passive
//! objects, naming, dates, labelled numbers, agents).

use super::entities::{constituent, Entity, Kind};
use super::lexicon::{
    base_form, decap, first_char_upper, is_participle, past_equals_participle, squeeze, verbish, Lexicon, AUXILIARIES,
    CLAUSE_WORDS, COMMON_VERBS, COPULAS, NAMING_VERBS, PREPOSITIONS, PRONOUN_SUBJECTS,
};
use super::sentence::Sent;
use crate::lift::absorb::qa::words::{content_tokens, is_stopword, strip_final};

/// A wh-phrase standing in for an entity ("which year", "how many", "whom", "which company").
fn wh_phrase(s: &Sent, ent: &Entity, subject: bool) -> String {
    match ent.kind {
        Kind::Number => "what number".to_string(),
        Kind::Count { .. } => "how many".to_string(),
        Kind::Year => "which year".to_string(),
        Kind::Date => "what date".to_string(),
        Kind::Time => "what time".to_string(),
        Kind::Person if subject => "who".to_string(),
        Kind::Person => "whom".to_string(),
        Kind::Place => "which place".to_string(),
        Kind::Thing { head: Some(h) } => format!("which {}", s.words[h].lower()),
        Kind::Thing { head: None } => "what".to_string(),
        Kind::Code => "what code".to_string(),
        Kind::Quote | Kind::Phrase => "what".to_string(),
    }
}

/// Type noun for "Which … is X?" questions ("" when there is none).
fn kind_noun(kind: Kind) -> &'static str {
    match kind {
        Kind::Number | Kind::Count { .. } => "number",
        Kind::Year => "year",
        Kind::Date => "date",
        Kind::Time => "time",
        Kind::Person => "person",
        Kind::Place => "place",
        Kind::Thing { .. } | Kind::Quote => "name",
        Kind::Code => "code",
        Kind::Phrase => "",
    }
}

/// Questions for one fact, most direct first: (question, answer).
pub(super) struct Fact {
    pub(super) questions: Vec<(String, String)>,
}

fn question(s: &str) -> String {
    format!("{}?", first_char_upper(&squeeze(strip_final(s))))
}

/// The direct wh-question for an entity, with a typed ("Which year is X?") and an other-tense
/// variant where the sentence's shape gives them.
#[derive(Default)]
pub(super) struct Direct {
    pub(super) question: Option<String>,
    typed: Option<String>,
    tense: Option<String>,
}

/// Determiners that open the noun phrase a name is given to ("a dog named Rex").
const DETERMINERS: &[&str] = &["a", "an", "the", "his", "her", "their", "its", "our", "my", "your"];

/// The direct wh-question for an entity, when the sentence's shape allows one. Shapes are tried in
/// order: the copula or auxiliary, naming, apposition, subject position.
pub(super) fn direct_question(s: &Sent, lex: &Lexicon, ent: &Entity, copula: Option<usize>) -> Direct {
    let mut direct = Direct::default();
    if let Some(c) = copula {
        let Some(found) = copula_question(s, ent, &Copula::new(s, lex, c)) else {
            return Direct::default();
        };
        direct = found;
    }
    if direct.question.is_none() {
        if let Some((question, typed)) = naming_question(s, lex, ent) {
            direct.question = Some(question);
            if typed.is_some() {
                direct.typed = typed;
            }
        }
    }
    if direct.question.is_none() {
        direct.question = apposition_question(s, lex, ent);
    }
    if direct.question.is_none() {
        direct.question = subject_question(s, ent);
    }
    direct
}

/// A sentence's copula or auxiliary ("is", "was", "has", "will", …), as the question rules see it.
struct Copula {
    /// Its word index, and the word lower-cased.
    at: usize,
    word: String,
    /// A form of "be" (not "has", "will", …).
    is_be: bool,
    /// The subject before it, ready to move into a question.
    subject: String,
    /// First word of the predicate, after adverbs ("was *first* opened").
    p0: usize,
    /// The predicate opens with a participle ("was founded", "had learned").
    participle: bool,
}

impl Copula {
    fn new(s: &Sent, lex: &Lexicon, c: usize) -> Self {
        let ws = &s.words;
        let n = ws.len();
        let word = ws[c].lower();
        let p0 = s.predicate_start(c);
        Self {
            at: c,
            is_be: COPULAS.contains(&word.as_str()),
            word,
            subject: decap(&s.phrase(0, c), lex),
            p0,
            participle: p0 < n && is_participle(ws[p0].text),
        }
    }
}

/// Questions through the copula: "X is Y" → "What is X?"; "X was founded in 1998 by Y" → "When was
/// X founded by Y?"; a possessive subject → "Whose …?". `None` when the sentence allows no direct
/// question at all (a possession other than a count: "X has a garden").
fn copula_question(s: &Sent, ent: &Entity, cop: &Copula) -> Option<Direct> {
    let ws = &s.words;
    let n = ws.len();
    let c = cop.at;
    let p0 = cop.p0;
    let det = |i: usize| matches!(ws[i].lower().as_str(), "the" | "a" | "an");
    let pred_start = ent.w0 == p0 || (ent.w0 == p0 + 1 && (ent.prep == Some(p0) || det(p0)));
    // "X is Y, a …": the appositive does not belong in the question.
    let apposed = ent.w1 < n && s.body[ent.e..].starts_with(',');
    let mut direct = Direct::default();
    if cop.is_be && pred_start && (ent.w1 == n || apposed) && !cop.participle {
        direct = predicate_questions(s, ent, cop);
    } else if ent.w0 > c && (!cop.is_be || cop.participle) {
        if let Some(cs) = constituent(s, ent) {
            let possession = matches!(cop.word.as_str(), "has" | "have" | "had") && !cop.participle;
            if possession && !matches!(ent.kind, Kind::Count { .. }) {
                return None;
            }
            direct.question = object_question(s, ent, cop, cs);
        }
    }
    // Possessive subject: "Anna's favourite colour is green." → Whose favourite colour is green?
    if ent.w0 == 0 && ent.w1 < c && s.is_possessive(ent.w1 - 1) {
        direct.question = Some(question(&format!("Whose {}", s.text(ent.w1, n))));
    }
    Some(direct)
}

/// "X is Y": What/Who/When/Where is X? (typed: "Which year is X?"; other tense: "What was X?").
fn predicate_questions(s: &Sent, ent: &Entity, cop: &Copula) -> Direct {
    let prep_word = ent.prep.map(|p| s.words[p].lower());
    let (word, subject) = (&cop.word, &cop.subject);
    let wh = match ent.kind {
        Kind::Person => "Who",
        Kind::Year | Kind::Date | Kind::Time => "When",
        Kind::Place => "Where",
        _ if ent.prep == Some(cop.p0) && matches!(prep_word.as_deref(), Some("in" | "at" | "near" | "on")) => "Where",
        _ => "What",
    };
    let noun = kind_noun(ent.kind);
    let typed = if noun.is_empty() || ent.prep == Some(cop.p0) {
        format!("What does the document say {subject} {word}?")
    } else {
        format!("Which {noun} {word} {subject}?")
    };
    let other = match word.as_str() {
        "is" => "was",
        "was" => "is",
        "are" => "were",
        _ => "are",
    };
    Direct {
        question: Some(format!("{wh} {word} {subject}?")),
        typed: Some(typed),
        tense: Some(format!("{wh} {other} {subject}?")),
    }
}

/// An entity after the verb, asked through the auxiliary: "X was founded in 1998 by Y" → "When was
/// X founded by Y?" / "By whom was X founded in 1998?"; "X has 42 rooms" → "How many rooms does X
/// have?". `cs` is the entity's first word as a phrase (see [`constituent`]).
fn object_question(s: &Sent, ent: &Entity, cop: &Copula, cs: usize) -> Option<String> {
    let ws = &s.words;
    let n = ws.len();
    let c = cop.at;
    let prep_word = ent.prep.map(|p| ws[p].lower());
    let with_prep = matches!(ent.prep, Some(p) if p + 1 == cs && p > c);
    let a = if with_prep { cs - 1 } else { cs };
    let b = match ent.kind {
        Kind::Count { noun } if noun == ent.w1 && noun < n => noun + 1,
        _ => ent.w1,
    };
    let wh = match (ent.kind, prep_word.as_deref()) {
        (Kind::Person, Some("by")) if with_prep => "By whom".to_string(),
        (Kind::Year | Kind::Date | Kind::Time, Some("in" | "on" | "at" | "during")) if with_prep => "When".to_string(),
        (Kind::Place, Some("in" | "at" | "near")) if with_prep => "Where".to_string(),
        (Kind::Place, Some("from")) if with_prep => "From where".to_string(),
        (Kind::Place, Some(p)) if with_prep => format!("{} which place", first_char_upper(p)),
        (Kind::Count { noun }, _) if !with_prep => format!("How many {}", ws[noun].lower()),
        (Kind::Person, Some(p)) if with_prep => format!("{} whom", first_char_upper(p)),
        (_, Some(p)) if with_prep => format!("{} what", first_char_upper(p)),
        (Kind::Person, _) => "Who".to_string(),
        _ => "What".to_string(),
    };
    // An appositive after the entity (", a retired sea captain") is dropped.
    let after = if b < n && !s.body[ws[ent.w1 - 1].core.1..ws[b].raw.0].contains(',') { s.text(b, n) } else { "" };
    let rest = squeeze(strip_final(&format!("{} {}", s.text(c + 1, a), after)));
    let (aux, tail) = match cop.word.as_str() {
        "has" | "have" | "had" if !cop.participle => (
            if cop.word == "had" {
                "did"
            } else if cop.word == "has" {
                "does"
            } else {
                "do"
            }
            .to_string(),
            format!("have {rest}"),
        ),
        _ => (cop.word.clone(), rest),
    };
    let subject = &cop.subject;
    (!tail.trim().is_empty() || cop.is_be).then(|| question(&format!("{wh} {aux} {subject} {tail}")))
}

/// Naming: "a dog named Rex" → "What is the name of the dog?" (typed: "What was the dog called?");
/// "The ship was called the Aurora." → "What was the ship called?".
fn naming_question(s: &Sent, lex: &Lexicon, ent: &Entity) -> Option<(String, Option<String>)> {
    let ws = &s.words;
    if ent.w0 < 1 {
        return None;
    }
    let prep_word = ent.prep.map(|p| ws[p].lower());
    let mut v = ent.w0 - 1;
    if v >= 1 && ws[v].lower() == "the" {
        v -= 1;
    }
    let verb = ws[v].lower();
    if !NAMING_VERBS.contains(&verb.as_str()) || (verb == "known" && prep_word.as_deref() != Some("as")) {
        return None;
    }
    let det = (v.saturating_sub(5)..v).rev().find(|&d| DETERMINERS.contains(&ws[d].lower().as_str()));
    if v >= 1 && COPULAS.contains(&ws[v - 1].lower().as_str()) && v >= 2 {
        let subject = decap(&s.phrase(0, v - 1), lex);
        Some((question(&format!("What {} {} {}", ws[v - 1].lower(), subject, verb)), None))
    } else if let Some(d) = det.filter(|&d| d + 1 < v) {
        let np = s.phrase(d + 1, v);
        Some((question(&format!("What is the name of the {np}")), Some(question(&format!("What was the {np} called")))))
    } else {
        None
    }
}

/// Apposition: "The nearest town, Longyearbyen, is …" → "What is the name of the nearest town?".
fn apposition_question(s: &Sent, lex: &Lexicon, ent: &Entity) -> Option<String> {
    let ws = &s.words;
    let n = ws.len();
    if !matches!(ent.kind, Kind::Person | Kind::Place | Kind::Thing { .. }) || ent.w0 < 2 {
        return None;
    }
    let before_comma = s.body[..ws[ent.w0].raw.0].trim_end().ends_with(',');
    let after_comma = ent.w1 == n || s.body[ent.e..].starts_with(',');
    let det = (ent.w0.saturating_sub(6)..ent.w0 - 1).rev().find(|&d| DETERMINERS.contains(&ws[d].lower().as_str()));
    let (true, true, Some(d)) = (before_comma, after_comma, det) else {
        return None;
    };
    let np = s.phrase(d, ent.w0);
    let fits = !np.contains(',')
        && (d == 0
            || s.body[..ws[d].raw.0].trim_end().ends_with(',')
            || PREPOSITIONS.contains(&ws[d - 1].lower().as_str())
            || verbish(&ws[d - 1]));
    fits.then(|| question(&format!("What is the name of {}", decap(&np, lex))))
}

/// Subject position: "Maria Santos founded the company." → "Who founded the company?" (also after
/// an introductory phrase: "In 1998, Maria Santos founded …" → "In 1998, who founded …").
fn subject_question(s: &Sent, ent: &Entity) -> Option<String> {
    let ws = &s.words;
    let n = ws.len();
    let cs = constituent(s, ent)?;
    let intro = cs == 0 || s.body[..s.words[cs].raw.0].trim_end().ends_with(',');
    let verb_next = ent.w1 < n && ws[ent.w1].starts_lower() && !s.breaks_after(ent.w1 - 1);
    if !(intro && verb_next) {
        return None;
    }
    let (wh, rest_from) = match ent.kind {
        Kind::Thing { head: Some(h) } => (format!("which {}", ws[h].lower()), ent.w1),
        Kind::Count { noun } if noun == ent.w1 => (format!("how many {}", ws[noun].lower()), noun + 1),
        Kind::Person => ("who".to_string(), ent.w1),
        _ => ("what".to_string(), ent.w1),
    };
    (rest_from < n).then(|| {
        let prefix = &s.body[..ws[cs].raw.0];
        question(&format!("{prefix}{wh} {}", s.text(rest_from, n)))
    })
}

/// The sentence with the entity replaced in place by a wh-phrase ("The hotel has how many rooms?",
/// "Maria Santos founded the company in which year?"); an introductory "In 1998," moves to the end.
fn in_situ_question(s: &Sent, ent: &Entity) -> Option<String> {
    let ws = &s.words;
    let cs = constituent(s, ent)?;
    if s.body[..ws[cs].raw.0].trim_end().ends_with(',') && s.body[ent.e..].starts_with(',') {
        return None; // an appositive
    }
    let with_prep = matches!(ent.prep, Some(p) if p + 1 == cs);
    let a = if with_prep { cs - 1 } else { cs };
    let intro = a == 0 || s.body[..ws[a].raw.0].trim_end().ends_with(',');
    let subject = intro && !with_prep && ent.w1 < ws.len() && ws[ent.w1].starts_lower();
    let wh = wh_phrase(s, ent, subject || (a == 0 && !with_prep));
    let wh = if with_prep { format!("{} {wh}", ws[a].lower()) } else { wh };
    let (mut start, mut end) = if a == cs && cs == ent.w0 { (ent.s, ent.e) } else { (ws[a].core.0, ent.e) };
    // A quoted name is replaced with its quotes.
    for (o, c) in [('"', '"'), ('“', '”')] {
        if s.body[..start].ends_with(o) && s.body[end..].starts_with(c) {
            start -= o.len_utf8();
            end += c.len_utf8();
        }
    }
    let after = &s.body[end..];
    if a == 0 && with_prep && after.starts_with(',') {
        // "In 1998, X did Y." → "X did Y in which year?"
        let rest = first_char_upper(strip_final(after[1..].trim()));
        return Some(question(&format!("{rest} {wh}")));
    }
    let q = format!("{}{}{}", &s.body[..start], wh, after);
    Some(question(&q))
}

pub(super) fn make_fact(s: &Sent, lex: &Lexicon, ent: &Entity, copula: Option<usize>) -> Option<Fact> {
    let answer = s.body[ent.s..ent.e].to_string();
    if answer.trim().is_empty() || content_tokens(&answer).is_empty() {
        return None;
    }
    let full = squeeze(s.body.trim());
    let cloze_text = squeeze(&format!("{}___{}", &s.body[..ent.s], &s.body[ent.e..]));
    let cloze = format!("Complete the sentence from the document: {cloze_text}");
    let Direct { question: direct, typed, tense } = direct_question(s, lex, ent, copula);
    let in_situ = in_situ_question(s, ent);
    let direct = direct.or_else(|| in_situ.clone());
    let mut questions = Vec::new();
    match &direct {
        Some(d) => {
            questions.push((d.clone(), answer.clone()));
            questions.push((format!("According to the document, {}", decap(d, lex)), full.clone()));
            questions.push((cloze, answer.clone()));
        }
        None => {
            questions.push((cloze, answer.clone()));
            questions.push((format!("Which sentence of the document mentions {answer}?"), full.clone()));
        }
    }
    let mut alts: Vec<String> = Vec::new();
    alts.extend(typed);
    if in_situ != direct {
        alts.extend(in_situ);
    }
    alts.extend(tense);
    if let Some(d) = &direct {
        alts.push(format!("{}, according to the document?", strip_final(d)));
        alts.push(format!("Answer briefly: {d}"));
    }
    for alt in alts {
        questions.push((alt, answer.clone()));
    }
    questions.push((format!("Fill in the blank with the exact words from the document: {cloze_text}"), answer.clone()));
    if matches!(ent.kind, Kind::Person | Kind::Place | Kind::Thing { .. }) {
        questions.push((format!("What does the document say about {answer}?"), full.clone()));
    }
    if let Some(d) = &direct {
        questions.push((format!("Quote the sentence of the document that answers: {d}"), full));
    }
    Some(Fact { questions })
}

/// "In 1903 the company bought a second slipway" / "The company bought … in 1903" → "When did the
/// company buy a second slipway?" (and "In what year …" for a year).
fn active_date_questions(s: &Sent, ent: &Entity) -> Vec<String> {
    let ws = &s.words;
    let n = ws.len();
    let Some(p) = ent.prep.filter(|&p| matches!(ws[p].lower().as_str(), "in" | "on" | "during")) else {
        return Vec::new();
    };
    // The clause without the date's phrase.
    let keep: Vec<usize> = (0..n).filter(|&i| i < p || i >= ent.w1).collect();
    let pos_of_verb = keep.iter().position(|&i| {
        let w = &ws[i];
        w.starts_lower()
            && !AUXILIARIES.contains(&w.lower().as_str())
            && (COMMON_VERBS.contains(&w.lower().as_str()) || w.lower().ends_with("ed"))
    });
    let Some(vpos) = pos_of_verb else {
        return Vec::new();
    };
    let v = keep[vpos];
    let subj: Vec<usize> = keep[..vpos].to_vec();
    if subj.is_empty() || subj.len() > 8 || subj.iter().any(|&i| AUXILIARIES.contains(&ws[i].lower().as_str())) {
        return Vec::new();
    }
    let first = ws[subj[0]].lower();
    if PRONOUN_SUBJECTS.contains(&first.as_str()) && subj.len() == 1 || PREPOSITIONS.contains(&first.as_str()) {
        return Vec::new();
    }
    let Some(base) = base_form(ws[v].text) else {
        return Vec::new();
    };
    let mut obj = Vec::new();
    for &i in &keep[vpos + 1..] {
        if CLAUSE_WORDS.contains(&ws[i].lower().as_str()) {
            break;
        }
        obj.push(i);
        if s.breaks_after(i) {
            break;
        }
    }
    let words =
        |ix: &[usize]| ix.iter().map(|&i| strip_final(&s.body[ws[i].raw.0..ws[i].raw.1])).collect::<Vec<_>>().join(" ");
    let subject = words(&subj);
    let subject = match subject.split_once(' ') {
        Some((f, rest)) if !ws[subj[0]].capitalised() || is_stopword(f) => {
            format!("{} {rest}", f.to_lowercase())
        }
        _ => subject,
    };
    let tail = words(&obj);
    let mut out = vec![question(&format!("When did {subject} {base} {tail}"))];
    if ent.kind == Kind::Year {
        out.push(question(&format!("In what year did {subject} {base} {tail}")));
    }
    out
}

/// Questions shaped by the clause's construction (passive object, naming predicate, dates, labelled
/// numbers, agents) for one fact.
pub(super) fn shaped_questions(s: &Sent, lex: &Lexicon, ent: &Entity, copula: Option<usize>) -> Vec<String> {
    let ws = &s.words;
    let n = ws.len();
    let subject = copula.map(|c| decap(&s.phrase(0, c), lex));
    let mut out = Vec::new();
    if copula.is_none() && matches!(ent.kind, Kind::Year | Kind::Date) {
        out.extend(active_date_questions(s, ent));
    }
    let (Some(c), Some(subj)) = (copula, subject.as_ref()) else {
        return out;
    };
    let cop = ws[c].lower();
    let part = (c + 1 < n && is_participle(ws[c + 1].text) && ws[c + 1].starts_lower()).then(|| ws[c + 1].lower());
    // The participle's object: "What was X planked with?" / "With what was X planked?"
    if let (Kind::Phrase, Some(p), Some(part)) = (ent.kind, ent.prep, part.as_ref()) {
        let pw = ws[p].lower();
        out.push(format!("What {cop} {subj} {part} {pw}?"));
        out.push(format!("{} what {cop} {subj} {part}?", first_char_upper(&pw)));
        return out;
    }
    // Copula with a naming predicate: "X was a quiet woman named Y" → "Who was X?".
    if part.is_none() && ent.w1 == n && ent.w0 >= 2 && NAMING_VERBS.contains(&ws[ent.w0 - 1].lower().as_str()) {
        let wh = if ent.kind == Kind::Person { "Who" } else { "What" };
        out.push(format!("{wh} {cop} {subj}?"));
    }
    // A counted predicate: "the rent of the cottage was 40 shillings" → "How many shillings was …?"
    if let (None, Kind::Count { noun }) = (&part, ent.kind) {
        if ent.w0 == c + 1 && noun + 1 == n {
            out.push(format!("How many {} {cop} {subj}?", ws[noun].lower()));
        }
    }
    let Some(part) = part else { return out };
    // Dates: "founded in the spring of 1887" → "When was X founded?" / "In what year …?".
    if matches!(ent.kind, Kind::Year | Kind::Date) && ent.w0 > c + 1 {
        let in_pp = (c + 2..ent.w0).any(|i| matches!(ws[i].lower().as_str(), "in" | "on" | "during"));
        if in_pp {
            out.push(format!("When {cop} {subj} {part}?"));
            if ent.kind == Kind::Year {
                out.push(format!("In what year {cop} {subj} {part}?"));
            }
        }
    }
    // A labelled number: "stamped with the number 4862" → "What number was X stamped with?"
    if matches!(ent.kind, Kind::Number | Kind::Code) && ent.w0 >= c + 4 {
        let label = &ws[ent.w0 - 1];
        let prep = c + 2;
        let np_ok = (prep + 1..ent.w0 - 1).all(|i| matches!(ws[i].lower().as_str(), "the" | "a" | "an"));
        if PREPOSITIONS.contains(&ws[prep].lower().as_str())
            && np_ok
            && label.starts_lower()
            && !is_stopword(label.text)
        {
            let (pw, noun) = (ws[prep].lower(), label.lower());
            out.push(format!("What {noun} {cop} {subj} {part} {pw}?"));
            out.push(format!("What {cop} {subj} {part} {pw}?"));
        }
    }
    // Agent: "founded … by (a carpenter named) Tobias Wren" → "Who founded X?".
    if ent.kind == Kind::Person {
        let by = (c + 2..ent.w0).rev().find(|&i| ws[i].lower() == "by");
        let named_or_direct =
            by.is_some_and(|b| b + 1 == ent.w0 || NAMING_VERBS.contains(&ws[ent.w0 - 1].lower().as_str()));
        if named_or_direct {
            if past_equals_participle(&part) {
                out.push(format!("Who {part} {subj}?"));
            }
            out.push(format!("By whom {cop} {subj} {part}?"));
        }
    }
    out
}
