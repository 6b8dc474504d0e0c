//! Questions people ask of real prose: policies, manuals, specifications, how-tos. Their facts
//! are less often names and numbers than definitions, conditions and duties, so the rules here
//! read those sentence shapes:
//!
//! - a definition (`X means Y`, `X refers to Y`, `X stands for Y`, `Long Name (LN)`): "What does X
//!   mean?";
//! - a condition (`If C, M.` / `M if C.`): "What happens if C?" and "Under what condition must
//!   S do V?";
//! - a duty or permission (`S must / should / may / can V`): "Who must V?" or "What must V?";
//! - a purpose (`X is used to Y`): "What is X used for?";
//! - a default (`X defaults to Y`, `the default for X is Y`): "What does X default to?".
//!
//! Every answer is a short span of the sentence (a few words, cut at the first clause break),
//! never the sentence itself.

use super::lexicon::{decap, first_char_upper, squeeze, Lexicon};
use crate::lift::absorb::qa::words::{is_stopword, strip_final};

/// Longest answer, in words, the rules give.
const MAX_ANSWER_WORDS: usize = 8;
/// Longest condition, and longest main clause a condition question repeats, in words.
const MAX_CONDITION_WORDS: usize = 14;
const MAX_CLAUSE_WORDS: usize = 14;

const MODALS: &[&str] = &["must", "should", "may", "shall", "can", "cannot", "will", "might", "need"];
/// Auxiliaries a condition question can move in front of its subject.
const AUXILIARIES: &[&str] =
    &["must", "should", "may", "shall", "can", "cannot", "will", "might", "is", "are", "was", "were"];
/// Subjects too vague to ask about without the sentence before.
const VAGUE: &[&str] = &["it", "they", "this", "that", "these", "those", "he", "she", "which", "there", "one", "each", "such"];
/// Words that open a clause, not a noun phrase.
const CLAUSE_OPENERS: &[&str] = &[
    "if", "when", "unless", "whenever", "once", "while", "although", "because", "since", "but", "and", "or", "so", "as",
    "however", "then", "also", "in", "on", "at", "for", "to", "with", "by", "from", "of", "after", "before", "during",
    "note", "see", "otherwise", "thus", "hence", "therefore", "where", "how", "what", "why", "who",
];
/// Nouns that make a subject an agent ("Who must …?" rather than "What must …?").
const AGENTS: &[&str] = &[
    "maintainer", "maintainers", "developer", "developers", "user", "users", "administrator", "administrators",
    "leader", "secretary", "committee", "chair", "member", "members", "author", "authors", "owner", "owners", "person",
    "people", "you", "delegate", "delegates", "sponsor", "sponsors", "submitter", "reporter", "team", "manager",
    "client", "server", "caller", "programmer", "programmers", "editor", "reviewer",
];

/// A sentence's words as it reads (whitespace folded), with the trailing punctuation of the last.
struct Words {
    w: Vec<String>,
}

impl Words {
    fn new(body: &str) -> Self {
        let text = squeeze(body);
        Self { w: strip_final(&text).split(' ').filter(|w| !w.is_empty()).map(str::to_string).collect() }
    }
    fn lower(&self, i: usize) -> String {
        self.w.get(i).map_or(String::new(), |w| w.trim_matches(|c: char| !c.is_alphanumeric()).to_lowercase())
    }
    fn join(&self, a: usize, b: usize) -> String {
        self.w[a..b.min(self.w.len())].join(" ")
    }
    /// The first word at or after `from` that ends a clause (`,`, `;`, `:`), exclusive end.
    fn clause_end(&self, from: usize) -> usize {
        (from..self.w.len()).find(|&i| self.w[i].ends_with([',', ';', ':'])).map_or(self.w.len(), |i| i + 1)
    }
}

/// Words `from..` up to the first clause break, as an answer: 1 to `max` words with something
/// besides stopwords, brackets balanced.
fn short_answer(ws: &Words, from: usize, max: usize) -> Option<String> {
    let end = ws.clause_end(from);
    if end <= from || end - from > max {
        return None;
    }
    let a = strip_final(&ws.join(from, end)).trim_start_matches(['"', '“', '\'', '(']).to_string();
    let a = a.trim_end_matches(['"', '”', '\'']).to_string();
    let meaningful = a.split_whitespace().any(|w| !is_stopword(w.trim_matches(|c: char| !c.is_alphanumeric())));
    (meaningful && balanced(&a)).then_some(a)
}

/// Brackets and quotes of `s` close what they open.
pub(super) fn balanced(s: &str) -> bool {
    let count = |c: char| s.matches(c).count();
    count('(') == count(')') && count('[') == count(']') && count('"') % 2 == 0 && count('“') == count('”')
}

/// The subject `0..end`: 1 to 6 words, a noun phrase (not a clause opener, not a pronoun alone).
fn subject(ws: &Words, end: usize) -> Option<String> {
    if end == 0 || end > 6 {
        return None;
    }
    let first = ws.lower(0);
    if CLAUSE_OPENERS.contains(&first.as_str()) || (end == 1 && VAGUE.contains(&first.as_str())) || VAGUE.contains(&first.as_str()) {
        return None;
    }
    if ws.w[..end].iter().any(|w| w.ends_with([',', ';', ':'])) {
        return None;
    }
    let s = ws.join(0, end);
    balanced(&s).then_some(s)
}

fn is_agent(subject: &str) -> bool {
    subject.split_whitespace().any(|w| AGENTS.contains(&w.trim_matches(|c: char| !c.is_alphanumeric()).to_lowercase().as_str()))
}

/// The real-prose facts of one sentence, each as its wordings (question, short answer), most
/// direct first.
pub(super) fn prose_facts(body: &str, lex: &Lexicon) -> Vec<Vec<(String, String)>> {
    let ws = Words::new(body);
    if ws.w.len() < 4 {
        return Vec::new();
    }
    let mut facts = Vec::new();
    facts.extend(definition(&ws, lex));
    facts.extend(acronyms(&ws));
    facts.extend(condition(&ws, lex));
    facts.extend(duty(&ws, lex));
    facts.extend(purpose(&ws, lex));
    facts.extend(default_value(&ws, lex));
    facts.retain(|f: &Vec<(String, String)>| !f.is_empty());
    facts
}

/// `X means / refers to / stands for / denotes / is defined as Y`.
fn definition(ws: &Words, lex: &Lexicon) -> Option<Vec<(String, String)>> {
    let (at, len, verb) = (1..ws.w.len().min(7)).find_map(|i| {
        let two = format!("{} {}", ws.lower(i), ws.lower(i + 1));
        let three = format!("{two} {}", ws.lower(i + 2));
        match ws.lower(i).as_str() {
            "means" | "denotes" => Some((i, 1, "mean")),
            _ if two == "refers to" => Some((i, 2, "mean")),
            _ if two == "stands for" => Some((i, 2, "stand for")),
            _ if three == "is defined as" => Some((i, 3, "mean")),
            _ => None,
        }
    })?;
    let mut subj = subject(ws, at)?;
    // "The term X means": ask about X.
    for lead in ["The term ", "the term ", "The word ", "The phrase "] {
        if let Some(rest) = subj.strip_prefix(lead) {
            subj = rest.to_string();
        }
    }
    let answer = short_answer(ws, at + len, MAX_ANSWER_WORDS)?;
    let term = decap(&subj, lex);
    Some(vec![
        (format!("What does {term} {verb}?"), answer.clone()),
        (format!("According to the document, what does {term} {verb}?"), answer),
    ])
}

/// `Long Name (LN)`: what the acronym stands for.
fn acronyms(ws: &Words) -> Vec<Vec<(String, String)>> {
    let mut out = Vec::new();
    for (i, w) in ws.w.iter().enumerate() {
        let core = w.trim_end_matches([',', '.', ';', ':']);
        let Some(acr) = core.strip_prefix('(').and_then(|c| c.strip_suffix(')')) else { continue };
        let letters: Vec<char> = acr.chars().filter(|c| c.is_alphabetic()).collect();
        if letters.len() < 2 || letters.len() > 6 || !acr.chars().all(|c| c.is_ascii_uppercase() || c.is_ascii_digit()) {
            continue;
        }
        // The words before it whose initials spell the acronym (small words between allowed).
        let mut k = letters.len();
        let mut j = i;
        while j > 0 && k > 0 {
            j -= 1;
            let first = ws.w[j].chars().next().unwrap_or(' ');
            if first.to_ascii_uppercase() == letters[k - 1] {
                k -= 1;
            } else if !matches!(ws.lower(j).as_str(), "of" | "and" | "for" | "the" | "to") {
                break;
            }
        }
        if k == 0 {
            let long = ws.join(j, i).trim_matches(|c: char| !c.is_alphanumeric()).to_string();
            out.push(vec![(format!("What does {acr} stand for?"), long)]);
        }
    }
    out
}

/// `If C, M.` (also when, whenever, once, unless) and `M if C.`.
fn condition(ws: &Words, lex: &Lexicon) -> Option<Vec<(String, String)>> {
    let first = ws.lower(0);
    let (cond, main_from, main_to, word) = if matches!(first.as_str(), "if" | "when" | "whenever" | "once" | "unless") {
        // The condition ends at its comma, or before "then".
        let end = (1..ws.w.len()).find(|&i| ws.w[i].ends_with(',') || (ws.lower(i) == "then" && i > 2))?;
        if ws.lower(end) == "then" {
            (ws.join(1, end), end + 1, ws.w.len(), first)
        } else {
            (ws.join(1, end + 1), end + 1, ws.w.len(), first)
        }
    } else {
        // Not "even if" / "only if": the condition's meaning is in the word before.
        let at = (3..ws.w.len().saturating_sub(2))
            .find(|&i| ws.lower(i) == "if" && !ws.w[i - 1].ends_with(',') && !matches!(ws.lower(i - 1).as_str(), "even" | "only" | "as"))?;
        (ws.join(at + 1, ws.w.len()), 0, at, "if".to_string())
    };
    // The condition ends at its first `;` (what follows is another statement).
    let cond = strip_final(cond.split(';').next().unwrap_or("")).to_string();
    let n_cond = cond.split_whitespace().count();
    if !(2..=MAX_CONDITION_WORDS).contains(&n_cond) || !balanced(&cond) {
        return None;
    }
    // The main clause up to its first break ("…is repeated, many times if necessary").
    let main = Words { w: ws.w[main_from..main_to].to_vec() };
    let main = Words { w: main.w[..main.clause_end(0)].to_vec() };
    let main_text = strip_final(&main.join(0, main.w.len())).to_string();
    let n_main = main.w.len();
    let mut out = Vec::new();
    // "Under what condition must S V?": the main clause's subject and auxiliary swapped.
    if let Some(aux) = (1..n_main.min(7)).find(|&i| AUXILIARIES.contains(&main.lower(i).as_str())) {
        let subj = subject(&main, aux);
        let rest = strip_final(&main.join(aux + 1, n_main)).to_string();
        let rest_words = rest.split_whitespace().count();
        if let (Some(subj), true) = (subj, (1..=MAX_CLAUSE_WORDS).contains(&rest_words) && word != "unless") {
            let aux_word = main.lower(aux);
            let q = format!("Under what condition {aux_word} {} {rest}?", decap(&subj, lex));
            out.push((q, cond.clone()));
        }
    }
    // "What happens if C?": the main clause as the answer, when it is short.
    if word != "unless" && main_from > 0 && (3..=MAX_ANSWER_WORDS + 2).contains(&n_main) && balanced(&main_text) {
        let subj_ok = !VAGUE.contains(&main.lower(0).as_str()) || n_main > 4;
        if subj_ok {
            out.push((format!("What happens {word} {}?", decap(&cond, lex)), main_text));
        }
    }
    (!out.is_empty()).then_some(out)
}

/// `S must / should / may / can / will V`: who (or what) must V.
fn duty(ws: &Words, lex: &Lexicon) -> Option<Vec<(String, String)>> {
    let m = (1..ws.w.len().min(7)).find(|&i| MODALS.contains(&ws.lower(i).as_str()))?;
    let subj = subject(ws, m)?;
    let modal = if ws.lower(m + 1) == "not" { format!("{} not", ws.lower(m)) } else { ws.lower(m) };
    let from = m + modal.split(' ').count();
    let vp = strip_final(&ws.join(from, ws.w.len())).to_string();
    let n = vp.split_whitespace().count();
    if !(2..=MAX_CLAUSE_WORDS + 2).contains(&n) || !balanced(&vp) || subj.split_whitespace().count() > MAX_ANSWER_WORDS {
        return None;
    }
    let wh = if is_agent(&subj) || lex.proper.contains(subj.trim_start_matches("The ").split(' ').next().unwrap_or("")) {
        "Who"
    } else {
        "What"
    };
    let answer = subj.trim_start_matches(['"', '“', '(']).to_string();
    let mut out = vec![(first_char_upper(&format!("{wh} {modal} {vp}?")), answer)];
    // "What must S do?" when what is to be done is short.
    if (2..=MAX_ANSWER_WORDS).contains(&n) && !modal.ends_with("not") {
        out.push((format!("What {modal} {} do?", decap(&subj, lex)), vp));
    }
    Some(out)
}

/// `X is used to / for Y`.
fn purpose(ws: &Words, lex: &Lexicon) -> Option<Vec<(String, String)>> {
    let at = (1..ws.w.len().min(7)).find(|&i| matches!(ws.lower(i).as_str(), "is" | "are") && ws.lower(i + 1) == "used" && matches!(ws.lower(i + 2).as_str(), "to" | "for"))?;
    let subj = subject(ws, at)?;
    let answer = short_answer(ws, at + 2, MAX_ANSWER_WORDS)?;
    Some(vec![(format!("What {} {} used for?", ws.lower(at), decap(&subj, lex)), answer)])
}

/// `X defaults to Y`, `The default (value) (for|of) X is Y`.
fn default_value(ws: &Words, lex: &Lexicon) -> Option<Vec<(String, String)>> {
    if let Some(at) = (1..ws.w.len().min(7)).find(|&i| matches!(ws.lower(i).as_str(), "defaults" | "default") && ws.lower(i + 1) == "to") {
        let subj = subject(ws, at)?;
        let answer = short_answer(ws, at + 2, 6)?;
        return Some(vec![(format!("What does {} default to?", decap(&subj, lex)), answer)]);
    }
    if ws.lower(0) == "the" && ws.lower(1) == "default" {
        let is = (2..ws.w.len().min(9)).find(|&i| ws.lower(i) == "is")?;
        let of = (2..is).find(|&i| matches!(ws.lower(i).as_str(), "for" | "of"))?;
        let topic = ws.join(of + 1, is);
        let answer = short_answer(ws, is + 1, 6)?;
        return Some(vec![(format!("What is the default {} {topic}?", ws.lower(of)), answer)]);
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lift::absorb::text::Span;

    fn facts(s: &str) -> Vec<(String, String)> {
        let lex = Lexicon::new(s, &[Span::new(0, s.len())]);
        prose_facts(s, &lex).into_iter().flatten().collect()
    }

    fn has(pairs: &[(String, String)], q: &str, a: &str) -> bool {
        pairs.iter().any(|(x, y)| x == q && y == a)
    }

    #[test]
    fn the_shapes_of_real_prose_give_wh_questions_with_short_answers() {
        let p = facts("If the Technical Committee cannot agree, the Chair may cast a deciding vote.");
        assert!(has(&p, "Under what condition may the Chair cast a deciding vote?", "the Technical Committee cannot agree"), "{p:#?}");
        assert!(has(&p, "What happens if the Technical Committee cannot agree?", "the Chair may cast a deciding vote"), "{p:#?}");
        let p = facts("Old log files are removed if the maxage option is set.");
        assert!(has(&p, "Under what condition are old log files removed?", "the maxage option is set"), "{p:#?}");
        let p = facts("The maintainer must upload the package within\n   ten days of the release.");
        assert!(has(&p, "Who must upload the package within ten days of the release?", "The maintainer"), "{p:#?}");
        let p = facts("A copyright file must be included in every binary package.");
        assert!(has(&p, "What must be included in every binary package?", "A copyright file"), "{p:#?}");
        let p = facts("The term \"orphaned\" means that no one maintains the package, and it may be adopted.");
        assert!(has(&p, "What does \"orphaned\" mean?", "that no one maintains the package"), "{p:#?}");
        let p = facts("Bugs are tracked in the Bug Tracking System (BTS) of the project.");
        assert!(has(&p, "What does BTS stand for?", "Bug Tracking System"), "{p:#?}");
        let p = facts("The rotate directive is used to set how many old logs are kept.");
        assert!(has(&p, "What is the rotate directive used for?", "to set how many old logs are kept"), "{p:#?}");
        let p = facts("The default value for maxage is zero days.");
        assert!(has(&p, "What is the default for maxage?", "zero days"), "{p:#?}");
        // Answers are short spans, never the whole sentence.
        for s in ["If a vote is canceled later than 13 days after the proposal, the vote starts 24 hours after the time of cancellation.", "It may be that nobody knows."] {
            for (q, a) in facts(s) {
                assert!(a.split_whitespace().count() <= MAX_CONDITION_WORDS && a.len() < s.len() / 2 + 40, "{q} => {a}");
            }
        }
        // Vague subjects and clause openers are not asked about.
        assert!(facts("It must be noted that this is rare.").is_empty());
        assert!(facts("In practice, the tool should be run daily.").iter().all(|(_, a)| !a.starts_with("In practice")));
    }
}
