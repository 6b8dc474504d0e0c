//! One BM25 index over the passages of every document in a collection.
//!
//! A collection is asked as one corpus: a passage's score uses the collection's statistics (one
//! document frequency and one IDF per term, one average passage length), not each document's own
//! index with the scores merged afterwards — a word common in one document but rare in the
//! collection still tells that document apart. Each passage keeps its document and its token ids,
//! so that an answer lays out its context without loading any document or adapter.
//!
//! The index is updated in place as documents join and leave (a leaving document's postings are
//! taken out term by term; its passage slots stay empty), so that keeping it current costs what
//! the change touches, not a rebuild. Scoring is [`crate::retrieve`]'s Okapi BM25 on the same
//! terms; the pseudo-relevance feedback step of single documents is not applied here.

use crate::retrieve::{idf, query_terms, saturated, terms};
use std::collections::{HashMap, HashSet};

/// One passage of a member document.
#[derive(Clone, Debug)]
pub struct CollectionPassage {
    pub document_id: String,
    /// Token range in its document.
    pub range: (usize, usize),
    /// The passage's token ids (what an answer shows) and its text (what it reports).
    pub tokens: Vec<u32>,
    pub text: String,
    /// Index terms in the passage.
    len: u32,
}

/// A member document's place in the index.
#[derive(Clone, Debug)]
struct Member {
    title: Option<String>,
    /// Its passages' slots: `first..first + count`.
    first: u32,
    count: u32,
    /// The distinct terms of its passages (what removing it touches).
    terms: Vec<String>,
}

/// A passage the question matched: its slot and BM25 score.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CollectionHit {
    pub passage: u32,
    pub score: f32,
}

#[derive(Default, Debug)]
pub struct CollectionIndex {
    members: HashMap<String, Member>,
    /// Passage slots; a removed document's are None.
    passages: Vec<Option<CollectionPassage>>,
    /// Per term: (passage slot, term frequency).
    postings: HashMap<String, Vec<(u32, u32)>>,
    live: usize,
    total_len: u64,
}

impl CollectionIndex {
    pub fn contains(&self, id: &str) -> bool {
        self.members.contains_key(id)
    }

    pub fn document_ids(&self) -> impl Iterator<Item = &str> {
        self.members.keys().map(String::as_str)
    }

    pub fn documents(&self) -> usize {
        self.members.len()
    }

    /// Live passages.
    pub fn len(&self) -> usize {
        self.live
    }

    pub fn is_empty(&self) -> bool {
        self.live == 0
    }

    pub fn title(&self, id: &str) -> Option<&str> {
        self.members.get(id).and_then(|m| m.title.as_deref())
    }

    pub fn passage(&self, slot: u32) -> Option<&CollectionPassage> {
        self.passages.get(slot as usize).and_then(Option::as_ref)
    }

    /// Adds document `id`: its passages as (token range, token ids, text). A document already in
    /// the index is left as it is (ids are content-addressed: its text cannot have changed).
    pub fn add(&mut self, id: &str, title: Option<String>, passages: Vec<((usize, usize), Vec<u32>, String)>) {
        if self.members.contains_key(id) {
            return;
        }
        let first = self.passages.len() as u32;
        let mut doc_terms = HashSet::new();
        let count = passages.len() as u32;
        for (i, (range, tokens, text)) in passages.into_iter().enumerate() {
            let slot = first + i as u32;
            let words = terms(&text);
            let mut counts: HashMap<String, u32> = HashMap::new();
            for w in &words {
                *counts.entry(w.clone()).or_default() += 1;
            }
            for (w, tf) in counts {
                self.postings.entry(w.clone()).or_default().push((slot, tf));
                doc_terms.insert(w);
            }
            self.total_len += words.len() as u64;
            self.live += 1;
            let p = CollectionPassage { document_id: id.to_string(), range, tokens, text, len: words.len() as u32 };
            self.passages.push(Some(p));
        }
        self.members.insert(id.to_string(), Member { title, first, count, terms: doc_terms.into_iter().collect() });
    }

    /// Takes document `id` out: its postings go, its slots become empty. Unknown ids are ignored.
    pub fn remove(&mut self, id: &str) {
        let Some(m) = self.members.remove(id) else { return };
        let slots = m.first..m.first + m.count;
        for term in &m.terms {
            if let Some(list) = self.postings.get_mut(term) {
                list.retain(|(p, _)| !slots.contains(p));
                if list.is_empty() {
                    self.postings.remove(term);
                }
            }
        }
        for s in slots {
            if let Some(p) = self.passages[s as usize].take() {
                self.total_len -= p.len as u64;
                self.live -= 1;
            }
        }
    }

    /// Every passage with a positive score for `query` (texts with weights, as
    /// [`crate::retrieve::PassageIndex::search_weighted`] takes them), best first; ties in slot
    /// order (the order documents joined, then document order).
    pub fn search(&self, query: &[(&str, f32)]) -> Vec<CollectionHit> {
        let n = self.live as f32;
        let avg_len = (self.total_len as f32 / n.max(1.0)).max(1.0);
        let mut scores: HashMap<u32, f32> = HashMap::new();
        for (term, weight) in &query_terms(query) {
            let Some(list) = self.postings.get(term) else { continue };
            let idf = idf(n, list.len() as f32);
            for &(p, tf) in list {
                let len = self.passages[p as usize].as_ref().map_or(0, |x| x.len) as f32;
                *scores.entry(p).or_default() += weight * idf * saturated(tf as f32, len, avg_len);
            }
        }
        let mut hits: Vec<CollectionHit> =
            scores.into_iter().filter(|(_, s)| *s > 0.0).map(|(passage, score)| CollectionHit { passage, score }).collect();
        hits.sort_by(|a, b| b.score.total_cmp(&a.score).then(a.passage.cmp(&b.passage)));
        hits
    }

    /// Live passage slots in slot order (what fills a context when nothing matched).
    pub fn slots(&self) -> impl Iterator<Item = u32> + '_ {
        self.passages.iter().enumerate().filter(|(_, p)| p.is_some()).map(|(i, _)| i as u32)
    }

    /// Bytes the index holds, roughly: passages' tokens, postings, terms and ids.
    pub fn bytes(&self) -> usize {
        let passages: usize =
            self.passages.iter().flatten().map(|p| p.tokens.len() * 4 + p.text.len() + p.document_id.len() + 88).sum::<usize>() + self.passages.len() * 8;
        let postings: usize = self.postings.iter().map(|(t, l)| t.len() + 48 + l.capacity() * 8).sum();
        let members: usize = self.members.iter().map(|(k, m)| k.len() + 64 + m.terms.iter().map(|t| t.len() + 24).sum::<usize>()).sum();
        passages + postings + members
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::retrieve::PassageIndex;

    fn passages(texts: &[&str]) -> Vec<((usize, usize), Vec<u32>, String)> {
        let mut at = 0;
        texts
            .iter()
            .map(|t| {
                let n = t.split_whitespace().count();
                let r = (at, at + n);
                at += n;
                (r, (r.0 as u32..r.1 as u32).collect(), t.to_string())
            })
            .collect()
    }

    const HARBOR: &[&str] = &[
        "The harbor of Velmora was built in 1843 by the engineer Ada Quill.",
        "The lighthouse keeper painted the tower blue in 1901.",
        "Every spring the town holds a lantern festival on the east pier.",
    ];
    const ORCHARD: &[&str] = &[
        "The orchard of Brindle grows pears and quinces on the south slope.",
        "The orchard keeper, Mira Falk, planted the first quince tree in 1877.",
        "Cider from the orchard is sold at the autumn market.",
    ];

    /// With one document the collection's ranking is that document's own BM25 (no feedback).
    #[test]
    fn one_document_ranks_as_its_own_index() {
        let mut c = CollectionIndex::default();
        c.add("doc_a", None, passages(HARBOR));
        let p = passages(HARBOR);
        let single = PassageIndex::from_texts(p.iter().map(|x| x.0).collect(), &p.iter().map(|x| x.2.clone()).collect::<Vec<_>>());
        for q in ["Who built the harbor?", "What colour is the tower painted?", "When is the lantern festival held?"] {
            let mine: Vec<(usize, f32)> = c.search(&[(q, 1.0)]).iter().map(|h| (h.passage as usize, h.score)).collect();
            let theirs: Vec<(usize, f32)> = single.search_weighted(&[(q, 1.0)]).iter().map(|h| (h.passage, h.score)).collect();
            assert_eq!(mine.len(), theirs.len(), "{q}");
            for (a, b) in mine.iter().zip(&theirs) {
                assert_eq!(a.0, b.0, "{q}");
                assert!((a.1 - b.1).abs() < 1e-5, "{q}: {a:?} {b:?}");
            }
        }
    }

    #[test]
    fn the_right_document_ranks_first_and_statistics_are_collection_wide() {
        let mut c = CollectionIndex::default();
        c.add("doc_h", Some("Harbor".into()), passages(HARBOR));
        c.add("doc_o", Some("Orchard".into()), passages(ORCHARD));
        assert_eq!((c.documents(), c.len()), (2, 6));
        let top = |c: &CollectionIndex, q: &str| c.search(&[(q, 1.0)]).first().map(|h| c.passage(h.passage).unwrap().document_id.clone());
        assert_eq!(top(&c, "Who planted the first quince tree?").as_deref(), Some("doc_o"));
        assert_eq!(top(&c, "Who built the harbor of Velmora?").as_deref(), Some("doc_h"));
        // Leaving: the document's passages are never found again and the statistics shrink.
        c.remove("doc_o");
        assert_eq!((c.documents(), c.len()), (1, 3));
        assert!(c.search(&[("quince orchard cider", 1.0)]).is_empty());
        let keeper = c.search(&[("keeper", 1.0)]);
        assert_eq!(keeper.len(), 1);
        assert_eq!(c.passage(keeper[0].passage).unwrap().document_id, "doc_h");
        assert!(c.title("doc_h") == Some("Harbor") && c.title("doc_o").is_none());
        // Joining again works, in new slots.
        c.add("doc_o", None, passages(ORCHARD));
        assert_eq!(top(&c, "Who planted the first quince tree?").as_deref(), Some("doc_o"));
        assert_eq!(c.slots().count(), 6);
        assert!(c.bytes() > 0);
    }

    /// One IDF over all the collection's passages: a word in every passage of one document and in
    /// one of another scores low in both (per-document indexes would score it high in the second).
    #[test]
    fn idf_is_the_collections() {
        // Passages of three terms each: the length normalisation is 1, a score is the IDF.
        let mut c = CollectionIndex::default();
        c.add("doc_a", None, passages(&["river mill stone", "river bank grass", "river boat oar"]));
        c.add("doc_b", None, passages(&["river fish net"]));
        let score = |c: &CollectionIndex, q: &str, doc: &str| {
            let hits = c.search(&[(q, 1.0)]);
            hits.iter().find(|h| c.passage(h.passage).unwrap().document_id == doc).map(|h| h.score)
        };
        let close = |a: Option<f32>, b: f32| a.is_some_and(|a| (a - b).abs() < 1e-5);
        assert!(close(score(&c, "river", "doc_b"), idf(4.0, 4.0)), "{:?}", score(&c, "river", "doc_b"));
        assert!(close(score(&c, "fish", "doc_b"), idf(4.0, 1.0)));
        c.remove("doc_a");
        assert!(close(score(&c, "river", "doc_b"), idf(1.0, 1.0)), "the statistics follow the members");
    }
}
