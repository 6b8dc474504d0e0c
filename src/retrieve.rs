//! Query-aware context: which of a document's passages an answer shows.
//!
//! The passages are the document's sentence-aligned chunks of at most `chunk_tokens` tokens —
//! the same pieces the prepared base's FltLM filter scores ("FltLM: An Integrated Long-Context
//! Large Language Model for Effective Context Filtering and Understanding", §4.1) — so a
//! retrieved passage is one filter chunk in the answer's prompt. First stage: BM25 over the
//! passages' words (Robertson & Zaragoza's Okapi weighting, k1 = 1.2, b = 0.75), searched twice:
//! the second time with the best passage's linking words added (pseudo-relevance feedback), so a
//! fact reached through another fact is found too. The chosen
//! passages fill the in-context budget in document order. The index is a pure function of the
//! document's token ids (stored with every adapter and moved with it between replicas), built
//! once per loaded document ([`crate::document::Document::passages`]).

use std::collections::{HashMap, HashSet};

/// Okapi BM25's term-frequency saturation and length normalisation.
const K1: f32 = 1.2;
const B: f32 = 0.75;

/// The words of `text` written with a capital letter where a sentence does not start: after a
/// word that ends no sentence. The text's first word starts a sentence (passages start at one).
fn capitalised_mid_sentence(text: &str) -> impl Iterator<Item = &str> {
    let words: Vec<&str> = text.split_whitespace().collect();
    (1..words.len()).filter_map(move |i| {
        let (before, word) = (words[i - 1], words[i]);
        let ends = before.trim_end_matches(['"', '\'', ')', '\u{201d}', '\u{2019}']).ends_with(['.', '!', '?', ':']);
        let first = word.trim_start_matches(|c: char| !c.is_alphanumeric()).chars().next();
        (!ends && first.is_some_and(char::is_uppercase)).then_some(word)
    })
}

/// How much a word the feedback adds counts against a word of the question itself.
pub const FEEDBACK_WEIGHT: f32 = 0.5;
/// At most this many words are added by the feedback.
pub const FEEDBACK_TERMS: usize = 3;

/// Words too common to say which passage a question is about.
const STOPWORDS: &[&str] = &[
    "a", "about", "after", "all", "s", "t", "also", "an", "and", "any", "are", "as", "at", "be", "been", "before", "but", "by",
    "can", "could", "did", "do", "does", "for", "from", "had", "has", "have", "he", "her", "his", "how", "i", "if",
    "in", "into", "is", "it", "its", "me", "my", "no", "not", "of", "on", "or", "our", "she", "so", "than", "that",
    "the", "their", "them", "then", "there", "these", "they", "this", "those", "to", "was", "we", "were", "what",
    "when", "where", "which", "who", "whom", "whose", "why", "will", "with", "would", "you", "your",
];

/// The index terms of `text`: lower-cased alphanumeric words, stop words dropped, a plural or
/// possessive `s` removed (so "lanterns" finds "lantern"), numbers kept whole.
pub fn terms(text: &str) -> Vec<String> {
    text.split(|c: char| !c.is_alphanumeric())
        .filter(|w| !w.is_empty())
        .map(|w| w.to_lowercase())
        .filter(|w| !STOPWORDS.contains(&w.as_str()))
        .map(|w| stem(&w).to_string())
        .collect()
}

fn stem(w: &str) -> &str {
    let n = w.len();
    if n > 3 && w.ends_with('s') && !w.ends_with("ss") && !w.ends_with("us") && !w.ends_with("is") {
        if w.ends_with("ies") && n > 4 {
            return &w[..n - 3];
        }
        return &w[..n - 1];
    }
    w
}

/// A query's terms (texts with weights), each at the largest weight of the texts it is in, in a
/// fixed order so that the float sums (and so the ties) do not depend on hashing.
pub fn query_terms(query: &[(&str, f32)]) -> Vec<(String, f32)> {
    let mut weights: HashMap<String, f32> = HashMap::new();
    for &(text, weight) in query.iter().filter(|(_, w)| *w > 0.0) {
        for term in terms(text) {
            let w = weights.entry(term).or_insert(0.0);
            *w = w.max(weight);
        }
    }
    let mut query: Vec<(String, f32)> = weights.into_iter().collect();
    query.sort_by(|a, b| a.0.cmp(&b.0));
    query
}

/// BM25's IDF of a term found in `df` of `n` passages.
pub fn idf(n: f32, df: f32) -> f32 {
    (1.0 + (n - df + 0.5) / (df + 0.5)).ln()
}

/// BM25's saturated term frequency in a passage of `len` terms (average `avg_len`).
pub fn saturated(tf: f32, len: f32, avg_len: f32) -> f32 {
    let norm = K1 * (1.0 - B + B * len / avg_len);
    tf * (K1 + 1.0) / (tf + norm)
}

/// The passages of a document and a BM25 index over their words.
#[derive(Clone, Debug)]
pub struct PassageIndex {
    /// Document token ranges, in order, covering the document.
    pub passages: Vec<(usize, usize)>,
    /// Per term: (passage, term frequency).
    postings: HashMap<String, Vec<(u32, u32)>>,
    /// Index terms per passage.
    lengths: Vec<u32>,
    avg_len: f32,
    /// Terms written capitalised somewhere other than at a sentence's start: names.
    names: HashSet<String>,
}

/// A passage the question matched, with its BM25 score.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct Hit {
    pub passage: usize,
    pub score: f32,
}

impl PassageIndex {
    /// The index of passages whose texts are `texts` (one per range).
    pub fn from_texts(passages: Vec<(usize, usize)>, texts: &[String]) -> Self {
        let mut postings: HashMap<String, Vec<(u32, u32)>> = HashMap::new();
        let mut lengths = Vec::with_capacity(texts.len());
        let mut names = HashSet::new();
        for (i, text) in texts.iter().enumerate() {
            names.extend(capitalised_mid_sentence(text).flat_map(terms));
            let words = terms(text);
            lengths.push(words.len() as u32);
            let mut counts: HashMap<String, u32> = HashMap::new();
            for w in words {
                *counts.entry(w).or_default() += 1;
            }
            for (w, tf) in counts {
                postings.entry(w).or_default().push((i as u32, tf));
            }
        }
        let avg_len = lengths.iter().map(|&l| l as f32).sum::<f32>() / lengths.len().max(1) as f32;
        Self { passages, postings, lengths, avg_len: avg_len.max(1.0), names }
    }

    pub fn len(&self) -> usize {
        self.passages.len()
    }

    pub fn is_empty(&self) -> bool {
        self.passages.is_empty()
    }

    /// Every passage with a positive BM25 score for `question`, best first (ties: document
    /// order), as answers rank them: with the feedback of
    /// [`search_with_feedback`](Self::search_with_feedback).
    pub fn search(&self, question: &str) -> Vec<Hit> {
        self.search_with_feedback(&[(question, 1.0)])
    }

    /// [`search`](Self::search) for a query made of several texts, each with a weight: a term's
    /// BM25 contribution is scaled by the largest weight of the texts it is in. A conversation
    /// asks this way (the question at full weight, earlier questions lower), so that a follow-up
    /// whose own words do not name its topic ("When did it open?") still finds the passages of
    /// the topic asked about before, while a word of the question itself outweighs them.
    pub fn search_weighted(&self, query: &[(&str, f32)]) -> Vec<Hit> {
        let n = self.passages.len() as f32;
        let mut scores = vec![0f32; self.passages.len()];
        for (term, weight) in &query_terms(query) {
            let Some(list) = self.postings.get(term) else { continue };
            let idf = idf(n, list.len() as f32);
            for &(p, tf) in list {
                scores[p as usize] += weight * idf * saturated(tf as f32, self.lengths[p as usize] as f32, self.avg_len);
            }
        }
        let mut hits: Vec<Hit> =
            scores.into_iter().enumerate().filter(|(_, s)| *s > 0.0).map(|(passage, score)| Hit { passage, score }).collect();
        hits.sort_by(|a, b| b.score.total_cmp(&a.score).then(a.passage.cmp(&b.passage)));
        hits
    }

    /// [`search_weighted`](Self::search_weighted), then once more with the query widened by the
    /// names in the best passage that occur in a few other passages too (pseudo-relevance
    /// feedback, at [`FEEDBACK_WEIGHT`]). A question that names something only through another
    /// fact ("the architect of the clock tower") finds that fact first; the name the fact gives ("…designed
    /// by Ilse Thorne") then finds the passages about the name ("Ilse Thorne got married on …"),
    /// which share no word with the question.
    pub fn search_with_feedback(&self, query: &[(&str, f32)]) -> Vec<Hit> {
        let first = self.search_weighted(query);
        let Some(&top) = first.first() else { return first };
        let linking = self.linking_terms(query, top.passage);
        if linking.is_empty() {
            return first;
        }
        let widened = linking.join(" ");
        let mut query = query.to_vec();
        query.push((&widened, FEEDBACK_WEIGHT));
        self.search_weighted(&query)
    }

    /// The passage BM25 ranks first, then only the passages that hold one of the names linking
    /// it to a few others (the feedback step's, ranked by its widened search): the second hop of
    /// a fact named through another, and nothing else. Measured on real prose (docs/real-text.md):
    /// the small reader answers one passage far better than four, and the other passages of a
    /// fixed budget are where its wrong answers come from.
    pub fn search_linked(&self, query: &[(&str, f32)]) -> Vec<Hit> {
        let first = self.search_weighted(query);
        let Some(&top) = first.first() else { return first };
        let linking = self.linking_terms(query, top.passage);
        let linked: std::collections::HashSet<usize> =
            linking.iter().flat_map(|t| self.postings.get(*t).into_iter().flatten().map(|&(p, _)| p as usize)).collect();
        let mut out = vec![top];
        if !linking.is_empty() {
            let widened = linking.join(" ");
            let mut query = query.to_vec();
            query.push((&widened, FEEDBACK_WEIGHT));
            out.extend(self.search_weighted(&query).into_iter().filter(|h| h.passage != top.passage && linked.contains(&h.passage)));
        }
        out
    }

    /// The names in passage `top` that link it to a few others (found in 2 to 3 passages, not
    /// asked already), rarest first, at most [`FEEDBACK_TERMS`].
    fn linking_terms(&self, query: &[(&str, f32)], top: usize) -> Vec<&str> {
        let asked: Vec<String> = query.iter().flat_map(|(t, _)| terms(t)).collect();
        let n = self.passages.len();
        // The names in the top passage found in 2 to 3 passages: the words that link it to a few
        // others, rarest first, at most FEEDBACK_TERMS of them. (Common words found in a few
        // passages, "vessel" or "two", link nothing: they pulled unrelated passages up.)
        let mut linking: Vec<(&str, usize)> = self
            .postings
            .iter()
            .filter(|(term, list)| {
                (2..=3.max(n / 50)).contains(&list.len())
                    && self.names.contains(*term)
                    && list.iter().any(|&(p, _)| p as usize == top)
                    && !asked.contains(term)
            })
            .map(|(term, list)| (term.as_str(), list.len()))
            .collect();
        linking.sort_by(|a, b| a.1.cmp(&b.1).then(a.0.cmp(b.0)));
        linking.into_iter().take(FEEDBACK_TERMS).map(|(t, _)| t).collect()
    }

    /// The passages to show for a ranking (`ranked`, best first): as many as fit `budget`
    /// tokens, taken in rank order (a passage that does not fit is skipped for a smaller one
    /// after it), returned in document order. When the ranking leaves room, the document's
    /// first passages fill it (what head-and-tail truncation would have shown first).
    pub fn select(&self, ranked: &[usize], budget: usize) -> Vec<usize> {
        self.select_excluding(ranked, budget, &[])
    }

    /// [`select`](Self::select) without the fill: only passages of `ranked` (the `linked`
    /// policy). A question BM25 finds nothing for ("What is this about?") still reads the
    /// document's first passages, as under `select`: an empty context answers nothing.
    pub fn select_ranked(&self, ranked: &[usize], budget: usize) -> Vec<usize> {
        if ranked.is_empty() {
            return self.select(ranked, budget);
        }
        let mut chosen = vec![false; self.passages.len()];
        let mut used = 0;
        for &p in ranked {
            let (a, b) = self.passages[p];
            if !chosen[p] && used + (b - a) <= budget {
                chosen[p] = true;
                used += b - a;
            }
        }
        (0..self.passages.len()).filter(|&p| chosen[p]).collect()
    }

    /// [`select`](Self::select) never choosing a passage of `excluded` (a training row that
    /// hides a fact's evidence).
    pub fn select_excluding(&self, ranked: &[usize], budget: usize, excluded: &[usize]) -> Vec<usize> {
        let mut chosen = vec![false; self.passages.len()];
        let mut used = 0;
        let fill = ranked.iter().copied().chain(0..self.passages.len());
        for p in fill {
            if chosen[p] || excluded.contains(&p) {
                continue;
            }
            let (a, b) = self.passages[p];
            if used + (b - a) <= budget {
                chosen[p] = true;
                used += b - a;
            }
        }
        (0..self.passages.len()).filter(|&p| chosen[p]).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn index(texts: &[&str]) -> PassageIndex {
        let mut at = 0;
        let ranges = texts
            .iter()
            .map(|t| {
                let r = (at, at + t.split_whitespace().count());
                at = r.1;
                r
            })
            .collect();
        PassageIndex::from_texts(ranges, &texts.iter().map(|t| t.to_string()).collect::<Vec<_>>())
    }

    #[test]
    fn names_are_the_words_capitalised_mid_sentence() {
        let text = "The yard was run by Ingrid Solberg. Later, \"Oskar\" took over. Then the Grey Petrel sailed!";
        assert_eq!(capitalised_mid_sentence(text).collect::<Vec<_>>(), ["Ingrid", "Solberg.", "\"Oskar\"", "Grey", "Petrel"]);
    }

    #[test]
    fn terms_drop_stopwords_and_plurals() {
        assert_eq!(terms("What colour are the Lanterns of Vell's harbour?"), ["colour", "lantern", "vell", "harbour"]);
        assert_eq!(terms("the 2012 class, glass and bus"), ["2012", "class", "glass", "bus"]);
    }

    #[test]
    fn the_passage_with_the_rare_words_ranks_first() {
        let idx = index(&[
            "The town sits on a river and the river floods in spring.",
            "The lighthouse keeper of Port Vell paints the lanterns green every autumn.",
            "Every town has a keeper of records and a keeper of keys.",
            "The river town trades wool and grain with the coast.",
        ]);
        let hits = idx.search("What colour does the Port Vell keeper paint the lanterns?");
        assert_eq!(hits[0].passage, 1, "{hits:?}");
        assert!(hits.iter().all(|h| h.score > 0.0));
        assert!(idx.search("zebra quantum").is_empty());
    }

    /// A fact named through another (the architect, then what the text says of her by name),
    /// beside passages that share the question's other words.
    fn two_hop_town() -> PassageIndex {
        index(&[
            "The new clock tower was designed by an architect named Ilse Thorne.",
            "The market square fills with stalls of cheese and wool on Saturdays.",
            "Ilse Thorne got married on April 8, 1949.",
            "The tower of the old church was struck by lightning twice.",
            "Marriage records of the parish were kept in the vestry.",
        ])
    }

    #[test]
    fn feedback_follows_a_name_from_the_best_passage_to_the_fact_about_it() {
        let idx = two_hop_town();
        let question = [("When did the architect of the clock tower marry?", 1.0)];
        // Word matching alone: the first hop, then passages sharing "tower"; the fact about
        // the architect shares no word with the question.
        let plain = idx.search_weighted(&question);
        assert_eq!(plain[0].passage, 0, "{plain:?}");
        assert!(plain.iter().all(|h| h.passage != 2), "{plain:?}");
        // With the first hop's linking words (the name, in two passages), the second hop joins
        // the best three, after the first hop.
        let widened = idx.search_with_feedback(&question);
        assert_eq!(widened[0].passage, 0, "{widened:?}");
        assert!(widened.iter().take(3).any(|h| h.passage == 2), "{widened:?}");
        // A question whose best passage links to nothing is ranked as before.
        let q = [("What is sold in the market square?", 1.0)];
        assert_eq!(idx.search_with_feedback(&q), idx.search_weighted(&q));
        // Nor do common words found in a few passages ("tower" and "the old" here).
        let q = [("Which old church was struck by lightning?", 1.0)];
        assert_eq!(idx.search_with_feedback(&q), idx.search_weighted(&q));
    }

    #[test]
    fn linked_search_keeps_the_best_passage_and_its_second_hop_only() {
        let idx = two_hop_town();
        // Two hops: the best passage, then the one its name links to; not "tower" or "marry".
        let hits: Vec<usize> = idx.search_linked(&[("When did the architect of the clock tower marry?", 1.0)]).iter().map(|h| h.passage).collect();
        assert_eq!(hits, vec![0, 2]);
        assert_eq!(idx.select_ranked(&hits, 1000), vec![0, 2], "nothing fills the budget");
        assert_eq!(idx.select(&hits, 1000).len(), 5, "where `select` fills it");
        // One fact: the best passage alone, though others share the question's words.
        let hits: Vec<usize> = idx.search_linked(&[("Which old church tower was struck by lightning?", 1.0)]).iter().map(|h| h.passage).collect();
        assert_eq!(hits, vec![3]);
        assert!(idx.search_linked(&[("zebra quantum", 1.0)]).is_empty());
        // Nothing found: the document's first passages, not an empty context.
        assert_eq!(idx.select_ranked(&[], 40), idx.select(&[], 40));
        assert!(!idx.select_ranked(&[], 40).is_empty());
    }

    #[test]
    fn earlier_questions_find_the_topic_of_a_follow_up_at_a_lower_weight() {
        let idx = index(&[
            "The school opened near the chapel in the first year of the town.",
            "A small museum opened beside the slipway, with tools and photographs.",
            "The bakery sold bread to the crews before dawn.",
        ]);
        // The follow-up alone cannot tell the school from the museum: both opened, in passages
        // of the same length.
        let alone = idx.search("When was it opened?");
        assert_eq!(alone.len(), 2, "{alone:?}");
        assert_eq!(alone[0].score, alone[1].score, "{alone:?}");
        // The earlier question names the topic, either way round.
        for (earlier, topic) in [("Tell me about the museum.", 1), ("Tell me about the school.", 0)] {
            let s = idx.search_weighted(&[("When was it opened?", 1.0), (earlier, 0.5)]);
            assert_eq!(s[0].passage, topic, "{earlier}: {s:?}");
            assert!(s[0].score > alone[0].score, "{s:?}");
        }
        // A word of the question itself outweighs an earlier question's word.
        let s = idx.search_weighted(&[("Who sold bread?", 1.0), ("Tell me about the school.", 0.5)]);
        assert_eq!(s[0].passage, 2, "{s:?}");
        // One text at weight 1 is `search`; a weight of 0 adds nothing.
        assert_eq!(idx.search_weighted(&[("museum", 1.0), ("school", 0.0)]), idx.search("museum"));
    }

    #[test]
    fn selection_fills_the_budget_in_document_order() {
        let idx = index(&["a b c d", "e f g", "h i j k l", "m n", "o p q"]);
        // Ranked 3, 1: 2 + 3 tokens, then the head fills what is left (passage 0: 4 tokens).
        assert_eq!(idx.select(&[3, 1], 9), vec![0, 1, 3]);
        // Passage 2 (5 tokens) does not fit after 3 and 1; passage 4 (3) does.
        assert_eq!(idx.select(&[3, 1, 2, 4], 8), vec![1, 3, 4]);
        assert_eq!(idx.select(&[], 100), vec![0, 1, 2, 3, 4]);
        assert!(idx.select(&[2], 1).is_empty());
    }
}
