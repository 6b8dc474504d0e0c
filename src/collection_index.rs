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
//!
//! A question is ranked over **windows of two adjacent passages** of one document
//! ([`CollectionIndex::rank`]), not over single passages: a passage ends where its sentence
//! budget does, so a fact can be cut in two, the name it is about in one passage and the words
//! the question shares with it in the next; either half alone then loses to another document's
//! whole look-alike sentence. A window holds the fact whole. The passages are still what is
//! shown: a window's passages that match the question, its better one first.

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
    /// The next slot is this document's next passage (they form a window).
    joins_next: bool,
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
        let starts: Vec<usize> = passages.iter().map(|p| p.0 .0).collect();
        for (i, (range, tokens, text)) in passages.into_iter().enumerate() {
            let joins_next = starts.get(i + 1) == Some(&range.1);
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
            let p = CollectionPassage { document_id: id.to_string(), range, tokens, text, len: words.len() as u32, joins_next };
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

    /// The passages to read for `query`, best first, each with the score it was ranked by: the
    /// windows of two adjacent passages of a document (a passage with no neighbour is a window
    /// alone) scored by BM25 as one text (the passages' term counts and lengths summed, against
    /// twice the average passage length), and every passage alone, each unit's BM25 scaled by its
    /// coverage of the query (the share of the query's IDF mass among the terms it holds), best
    /// first; each unit gives its passages that match the query, the better one first, those not
    /// given already. Ties in slot order.
    pub fn rank(&self, query: &[(&str, f32)]) -> Vec<CollectionHit> {
        let n = self.live as f32;
        let avg_len = (self.total_len as f32 / n.max(1.0)).max(1.0);
        let avg_window = 2.0 * avg_len;
        let joins = |s: u32| self.passage(s).is_some_and(|p| p.joins_next);
        // The window starting at slot `s`: s and s + 1, or s alone when it has no neighbour.
        let starts_window = |s: u32| joins(s) || (s == 0 || !joins(s - 1));
        let len = |s: u32| self.passage(s).map_or(0, |p| p.len);
        let window_len = |s: u32| len(s) + if joins(s) { len(s + 1) } else { 0 };
        // Per unit: (BM25, the query's IDF mass it holds); the query's whole IDF mass.
        let mut windows: HashMap<u32, (f32, f32)> = HashMap::new();
        let mut own: HashMap<u32, (f32, f32)> = HashMap::new();
        let mut mass = 0.0;
        for (term, weight) in &query_terms(query) {
            let Some(list) = self.postings.get(term) else { continue };
            let idf = idf(n, list.len() as f32);
            mass += weight * idf;
            let mut tfs: HashMap<u32, u32> = HashMap::new();
            for &(p, tf) in list {
                let o = own.entry(p).or_default();
                o.0 += weight * idf * saturated(tf as f32, len(p) as f32, avg_len);
                o.1 += weight * idf;
                if starts_window(p) {
                    *tfs.entry(p).or_default() += tf;
                }
                if p > 0 && joins(p - 1) {
                    *tfs.entry(p - 1).or_default() += tf;
                }
            }
            for (w, tf) in tfs {
                let u = windows.entry(w).or_default();
                u.0 += weight * idf * saturated(tf as f32, window_len(w) as f32, avg_window);
                u.1 += weight * idf;
            }
        }
        // Coverage (Lucene's classic `coord` factor, weighted by IDF): BM25 adds terms up, so a
        // short unit holding every query term but one rare one (another document's look-alike
        // fact: same template words, another person with the same first or last name) outscored
        // the longer unit holding the whole fact, its length normalisation on 6–7 template words
        // outweighing the one missing name. Scaled by the share of the query's IDF mass it holds,
        // the look-alike loses that name's share (about a fifth) of its score.
        let covered = |(bm25, held): (f32, f32)| bm25 * held / mass;
        // Units: every window, and every passage alone (a whole fact in one passage is not
        // diluted by its neighbour's words). (first slot, passages, score)
        let mut units: Vec<(u32, u32, f32)> = windows
            .into_iter()
            .filter(|(_, u)| u.0 > 0.0)
            .map(|(w, u)| (w, if joins(w) { 2 } else { 1 }, covered(u)))
            .collect();
        units.extend(own.iter().filter(|(_, u)| u.0 > 0.0).map(|(&p, &u)| (p, 1, covered(u))));
        // A passage's own BM25 (how the passages a unit gives are ordered).
        let own: HashMap<u32, f32> = own.into_iter().map(|(p, (s, _))| (p, s)).collect();
        units.sort_by(|a, b| b.2.total_cmp(&a.2).then(a.0.cmp(&b.0)).then(a.1.cmp(&b.1)));
        let mut given = HashSet::new();
        let mut out = Vec::new();
        for (w, count, score) in units {
            let mut members: Vec<(u32, f32)> =
                (w..w + count).filter_map(|s| own.get(&s).map(|o| (s, *o))).collect();
            members.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            for (s, _) in members {
                if given.insert(s) {
                    out.push(CollectionHit { passage: s, score });
                }
            }
        }
        out
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

    /// A fact cut by a passage boundary (the name in one passage, the rest in the next) is found
    /// whole by its window, where single passages rank another document's look-alike first.
    #[test]
    fn a_fact_cut_in_two_is_ranked_by_its_window() {
        let mut c = CollectionIndex::default();
        c.add("doc_cut", None, passages(&["the old mill stood by a river where Ilse Marwood", "has locker code 4417 at the north gate", "ducks swim in the pond"]));
        c.add("doc_like", None, passages(&["Ilse Brand has locker code 5120 in the hall", "the hall has a red door"]));
        c.add("doc_other", None, passages(&["Tom Marwood sells bread", "Ilse Kerr walks a dog", "a locker code opens the shed"]));
        let q = [("What is Ilse Marwood's locker code?", 1.0)];
        let doc = |c: &CollectionIndex, hits: &[CollectionHit]| c.passage(hits[0].passage).unwrap().document_id.clone();
        assert_eq!(doc(&c, &c.search(&q)), "doc_like", "single passages: the look-alike wins (what windows fix)");
        let ranked = c.rank(&q);
        assert_eq!(doc(&c, &ranked), "doc_cut");
        // Both halves of the fact, the better first, under the window's score; no passage twice.
        let slots: Vec<u32> = ranked.iter().map(|h| h.passage).collect();
        assert_eq!(&slots[..2], &[0, 1], "{ranked:?}");
        assert_eq!(ranked[0].score, ranked[1].score);
        assert!(ranked.windows(2).all(|w| w[0].score >= w[1].score));
        let mut unique = slots.clone();
        unique.sort();
        unique.dedup();
        assert_eq!(unique.len(), slots.len());
        // Passages that match nothing are not given (the pond, the red door).
        assert!(!slots.contains(&2) && !slots.contains(&4), "{slots:?}");
        // Windows never join two documents: the look-alike's last passage and the next document's
        // first are apart, and a removed document's slots are never ranked.
        c.remove("doc_cut");
        let after = c.rank(&q);
        assert!(!after.is_empty() && after.iter().all(|h| c.passage(h.passage).is_some_and(|p| p.document_id != "doc_cut")));
    }

    /// A look-alike fact in another document (the same template, another person with the same
    /// first name) held in a short window outscores, by BM25 alone, the right fact cut between two
    /// passages of a longer window (the length normalisation on the shared template words
    /// outweighs the missing last name: 8.64 against 7.96 here without coverage, as in the
    /// collections bench's misses); scaled by coverage of the query's IDF mass (7.16 against
    /// 7.96), the window with every query term ranks first.
    #[test]
    fn a_short_look_alike_loses_to_the_unit_with_every_query_term() {
        let mut c = CollectionIndex::default();
        let cut = "The committee argued about budgets, rents, schedules, minutes and repairs through the long winter meeting, while Ilse Marwood parks a green";
        c.add("doc_right", None, passages(&[cut, "bicycle in bay 4417 of the station garage.", "Nothing else happened that winter."]));
        c.add("doc_like", None, passages(&["Ilse Brand parks a green bicycle in bay 5120 of the station garage.", "The hall has a red door."]));
        c.add("doc_b", None, passages(&["Tobias Crane parks a green bicycle in bay 7001 of the station garage.", "The bakery opens early."]));
        c.add("doc_c", None, passages(&["Oswin Hale parks a green bicycle in bay 2290 of the station garage.", "Tom Marwood sells bread near the market."]));
        c.add("doc_d", None, passages(&["A red door opens onto the yard.", "Boats rest in the harbour at night.", "Ilse Kerr walks a dog.", "The shop is shut on Sundays.", "Cats sleep in the sun."]));
        let q = [("In which bay of the station garage does Ilse Marwood park the green bicycle?", 1.0)];
        let doc = |hits: &[CollectionHit]| c.passage(hits[0].passage).unwrap().document_id.clone();
        assert_eq!(doc(&c.search(&q)), "doc_like", "single passages: the look-alike wins");
        let ranked = c.rank(&q);
        assert_eq!(doc(&ranked), "doc_right", "{ranked:?}");
        // Both halves of the fact first, under their window's score (coverage 1: its BM25).
        let slots: Vec<u32> = ranked.iter().map(|h| h.passage).collect();
        assert_eq!(&slots[..2], &[1, 0], "{ranked:?}");
        assert!((ranked[0].score - 7.96).abs() < 0.01, "{ranked:?}");
        let like = ranked.iter().find(|h| h.passage == 3).unwrap();
        assert!((like.score - 7.16).abs() < 0.01, "{ranked:?}");
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
