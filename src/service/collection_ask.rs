//! Asking a collection: one BM25 ranking over all its documents' passages
//! ([`CollectionIndex`]), the best passages shown whatever their document (each document's under
//! its title), and, in `lift`, the adapter of the document holding the best passage (routing) —
//! when that document is absorbed; otherwise the answer is `rag`.
//!
//! The index of a collection is built on its first question and kept (one per collection, in
//! memory): each question brings it in line with the collection's record — documents that
//! joined are read in (their text and token ids, never their adapters), those that left are
//! taken out — so that a change made on another replica is seen too. Only the routed document's
//! adapter is loaded, through the store's cache.

use super::collections::collection_shape;
use super::{PendingGeneration, Pieces, Question, Service, ServiceError};
use crate::collection_index::CollectionIndex;
use crate::document::Document;
use crate::engine::Prompt;
use crate::lift::answer::{min_prompt_tokens, passage_tokens, retrieval_query, Ask, Mode, DEFAULT_CONTEXT_TOKENS};
use crate::model::generate::SamplingParams;
use crate::model::{ChatMessage, Model};
use crate::service::DocumentView;
use crate::store::Status;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// The collections' indexes, by collection id.
#[derive(Default)]
pub(super) struct Indexes(Mutex<HashMap<String, Arc<tokio::sync::Mutex<CollectionIndex>>>>);

/// A passage an answer read.
#[derive(Clone, Debug)]
pub struct ReadPassage {
    pub document_id: String,
    pub title: Option<String>,
    /// Token range in its document.
    pub start: usize,
    pub end: usize,
    /// The BM25 score it was ranked by: its window's in the collection's ranking (0 when nothing
    /// matched and it filled the room).
    pub score: f32,
    pub text: String,
}

/// What a collection's answer read and who answered.
#[derive(Clone, Debug)]
pub struct CollectionRead {
    pub collection_id: String,
    /// The document whose passage ranked first.
    pub document_id: String,
    /// The mode answered in (`lift` becomes `rag` when the routed document is not absorbed).
    pub mode: Mode,
    /// The document whose adapter answered (None in `rag`).
    pub answered_by: Option<String>,
    /// In rank order.
    pub passages: Vec<ReadPassage>,
}

/// Figures of one collection's index (benches, `/metrics`-style reports).
#[derive(Clone, Copy, Debug)]
pub struct IndexFigures {
    pub documents: usize,
    pub passages: usize,
    pub bytes: usize,
}

impl Service {
    /// The cached index of collection `id`, created empty on first use.
    fn index_of(&self, id: &str) -> Result<Arc<tokio::sync::Mutex<CollectionIndex>>, ServiceError> {
        let mut map = self.indexes.0.lock().map_err(ServiceError::poisoned)?;
        Ok(map.entry(id.to_string()).or_default().clone())
    }

    /// Drops a deleted collection's index.
    pub(super) fn forget_index(&self, id: &str) {
        if let Ok(mut map) = self.indexes.0.lock() {
            map.remove(id);
        }
    }

    /// The passages of member `id` as the index takes them: (token range, token ids, text).
    async fn member_passages(
        &self,
        owner: Option<&str>,
        id: &str,
        view: &DocumentView,
    ) -> Result<Vec<((usize, usize), Vec<u32>, String)>, ServiceError> {
        let model = self.engine.model.clone();
        // A view from a listing carries no blob reference: a ready document's is looked up.
        let blob = if view.status == Status::Ready { self.lookup(owner, id).await?.1 } else { None };
        let document = self.readable_document(id, view, blob).await?;
        tokio::task::spawn_blocking(move || index_passages(&model, &document))
            .await
            .map_err(ServiceError::internal)?
            .map_err(ServiceError::internal)
    }

    /// Brings the index of `members` (the collection's documents that exist, with their views)
    /// in line: documents that left are taken out, those that joined read in (one that cannot be
    /// read is left out of this answer, and tried again at the next).
    async fn sync_index(
        &self,
        owner: Option<&str>,
        index: &mut CollectionIndex,
        members: &[(&String, &DocumentView)],
    ) -> Result<(), ServiceError> {
        let gone: Vec<String> = index.document_ids().filter(|d| !members.iter().any(|(m, _)| m.as_str() == *d)).map(str::to_string).collect();
        for d in gone {
            index.remove(&d);
        }
        let joined: Vec<_> = members.iter().filter(|(id, _)| !index.contains(id)).collect();
        for (id, view) in joined {
            match self.member_passages(owner, id, view).await {
                Ok(p) => index.add(id, view.title.clone(), p),
                Err(e @ ServiceError::Unavailable(_)) => return Err(e),
                Err(e) => tracing::warn!(id = %id, error = %e, "a collection's document cannot be read: left out of its answers"),
            }
        }
        Ok(())
    }

    /// The figures of collection `id`'s index, brought up to date (as a question would).
    pub async fn collection_index_figures(&self, owner: Option<&str>, id: &str) -> Result<IndexFigures, ServiceError> {
        collection_shape(id)?;
        let rec = self.collections.collection(owner, id).await?;
        let docs: HashMap<String, DocumentView> =
            self.registry.documents_among(owner, &rec.document_ids).await?.into_iter().map(|d| (d.id.clone(), d)).collect();
        let members: Vec<(&String, &DocumentView)> = rec.document_ids.iter().filter_map(|d| docs.get_key_value(d)).collect();
        let index = self.index_of(id)?;
        let mut index = index.lock().await;
        self.sync_index(owner, &mut index, &members).await?;
        Ok(IndexFigures { documents: index.documents(), passages: index.len(), bytes: index.bytes() })
    }

    /// Queues an answer to `q` asked of the collection `q.document_id` (modes `lift` and `rag`;
    /// the HTTP layer refuses the others), and says what it read and who answers.
    pub async fn ask_collection(
        &self,
        owner: Option<&str>,
        q: Question,
        params: SamplingParams,
        pieces: Option<Pieces>,
    ) -> Result<(PendingGeneration, CollectionRead), ServiceError> {
        self.check_serves()?;
        let collection_id = q.document_id.clone();
        collection_shape(&collection_id)?;
        let rec = self.collections.collection(owner, &collection_id).await?;
        let empty = || ServiceError::CollectionEmpty(collection_id.clone());
        if rec.document_ids.is_empty() {
            return Err(empty());
        }
        let model = self.engine.model.clone();
        let question_tokens = model.tokenizer.encode(&q.question, false).map_err(ServiceError::internal)?.len();
        self.check_fits(min_prompt_tokens(question_tokens, false), params.max_tokens)?;
        let docs: HashMap<String, DocumentView> =
            self.registry.documents_among(owner, &rec.document_ids).await?.into_iter().map(|d| (d.id.clone(), d)).collect();
        let members: Vec<(&String, &DocumentView)> = rec.document_ids.iter().filter_map(|d| docs.get_key_value(d)).collect();

        let context_tokens = q.context_tokens.or(self.cfg.context_tokens);
        let ask = Ask { question: &q.question, history: &q.history, mode: q.mode, context: None, context_tokens };
        // A collection's passages are ranked (bm25): the budget always has a size.
        let budget = ask.requested_budget().unwrap_or(DEFAULT_CONTEXT_TOKENS);
        let chosen = {
            let index = self.index_of(&collection_id)?;
            let mut index = index.lock().await;
            self.sync_index(owner, &mut index, &members).await?;
            choose(&index, &retrieval_query(&ask), budget)
        };
        let top = chosen.first().ok_or_else(empty)?.document_id.clone();
        let routed = match q.mode {
            Mode::Lift if docs.get(&top).is_some_and(|d| d.status == Status::Ready) => Some(self.lookup(owner, &top).await?.1),
            _ => None,
        };
        let mode = if routed.is_some() { Mode::Lift } else { Mode::Rag };
        let (history, question, max_tokens) = (q.history.clone(), q.question.clone(), params.max_tokens);
        let shown = chosen.clone();
        let tokens = tokio::task::spawn_blocking(move || collection_prompt(&model, &history, &shown, &question, max_tokens))
            .await
            .map_err(ServiceError::internal)?
            .map_err(ServiceError::internal)??;
        let answered_by = routed.as_ref().map(|_| top.clone());
        // Self-gated in `lift` as a document's answer is: a second sequence without the adapter.
        let gate = self.cfg.self_gating && routed.is_some();
        let kv_tokens = (tokens.len() + params.max_tokens) * if gate { 2 } else { 1 };
        let prompt = Prompt::Collection { tokens, adapter: routed.map(|blob| (top.clone(), blob)), mode, gate };
        let mut pending = self.generate(prompt, params, kv_tokens, pieces)?;
        if let Some(id) = &answered_by {
            pending.document = Some((id.clone(), self.registry.clone()));
        }
        let passages = chosen.into_iter().map(|c| c.read).collect();
        Ok((pending, CollectionRead { collection_id, document_id: top, mode, answered_by, passages }))
    }
}

/// The passages of `document` as a [`CollectionIndex`] takes them: (token range, token ids, text),
/// the document's own passages (the FltLM chunk size, or 32 tokens).
pub fn index_passages(model: &Model, document: &Document) -> anyhow::Result<Vec<((usize, usize), Vec<u32>, String)>> {
    let index = document.passages(model, passage_tokens(model))?;
    let ids = document.tokens();
    index.passages.iter().map(|&(a, b)| Ok(((a, b), ids[a..b].to_vec(), model.tokenizer.decode(&ids[a..b])?))).collect()
}

/// A question asked of `index` outside the service (`lift-serve ask --collection`): the
/// server's ranking, context and prompt (`budget` context tokens, room for `max_tokens`). The
/// prompt's tokens and the passages read, best first (the first one's document is the routed one).
pub fn prompt_over(
    model: &Model,
    index: &CollectionIndex,
    ask: &Ask,
    budget: usize,
    max_tokens: usize,
) -> anyhow::Result<(Vec<u32>, Vec<ReadPassage>)> {
    let chosen = choose(index, &retrieval_query(ask), budget);
    anyhow::ensure!(!chosen.is_empty(), "the collection has no passages");
    let tokens = collection_prompt(model, ask.history, &chosen, ask.question, max_tokens)?.map_err(|e| anyhow::anyhow!("{e}"))?;
    Ok((tokens, chosen.into_iter().map(|c| c.read).collect()))
}

/// A chosen passage: what is shown (its tokens) and reported.
#[derive(Clone)]
struct Chosen {
    document_id: String,
    label: String,
    tokens: Vec<u32>,
    read: ReadPassage,
}

/// The passages to show, best first: taken in the order of [`CollectionIndex::rank`] (windows of
/// adjacent passages) while they fit `budget` tokens (a passage that does not fit is skipped for
/// a smaller one after it; the best is always shown). When nothing matched, the passages in the
/// order the documents joined fill the room.
fn choose(index: &CollectionIndex, query: &[(&str, f32)], budget: usize) -> Vec<Chosen> {
    let hits = index.rank(query);
    let ranked: Vec<(u32, f32)> = if hits.is_empty() {
        index.slots().map(|s| (s, 0.0)).collect()
    } else {
        hits.iter().map(|h| (h.passage, h.score)).collect()
    };
    let mut used = 0;
    let mut out = Vec::new();
    for (slot, score) in ranked {
        let Some(p) = index.passage(slot) else { continue };
        let n = p.tokens.len();
        if !out.is_empty() && used + n > budget {
            continue;
        }
        used += n;
        let title = index.title(&p.document_id).map(str::to_string);
        let label = title.clone().unwrap_or_else(|| p.document_id.clone());
        let read = ReadPassage {
            document_id: p.document_id.clone(),
            title,
            start: p.range.0,
            end: p.range.1,
            score,
            text: p.text.clone(),
        };
        out.push(Chosen { document_id: p.document_id.clone(), label, tokens: p.tokens.clone(), read });
    }
    out
}

/// The context: each document's chosen passages under its title (`[Title]`), the documents in
/// the order of their best passage, a document's passages in document order (joined by the
/// elision marker where they do not follow each other), then the question. The oldest turns of
/// the conversation, then the lowest-ranked passages, are left out until `max_tokens` of answer
/// fit the window. Fills each chosen passage's text.
fn collection_prompt(
    model: &Model,
    history: &[ChatMessage],
    chosen: &[Chosen],
    question: &str,
    max_tokens: usize,
) -> anyhow::Result<Result<Vec<u32>, ServiceError>> {
    let window = model.config().max_position_embeddings;
    let elision = crate::lift::answer::prompt::elision_tokens(model)?;
    let turns: Vec<ChatMessage> = history.iter().filter(|t| t.role == "user" || t.role == "assistant").cloned().collect();
    let (mut shown, mut from) = (chosen.len(), 0);
    loop {
        let ctx = context_tokens(model, &chosen[..shown], &elision)?;
        let tokens = crate::lift::answer::prompt::chat_after_turns(model, &turns[from..], &ctx, question)?.0;
        if tokens.len() + max_tokens <= window {
            return Ok(Ok(tokens));
        }
        if from < turns.len() {
            from += 1;
        } else if shown > 1 {
            shown -= 1;
        } else {
            return Ok(Err(ServiceError::ContextLength { prompt_tokens: tokens.len(), max_tokens, window }));
        }
    }
}

/// The context tokens of `chosen` laid out as [`collection_prompt`] says.
fn context_tokens(model: &Model, chosen: &[Chosen], elision: &[u32]) -> anyhow::Result<Vec<u32>> {
    let mut order: Vec<&str> = Vec::new();
    for c in chosen {
        if !order.contains(&c.document_id.as_str()) {
            order.push(&c.document_id);
        }
    }
    let mut ctx = Vec::new();
    for (i, doc) in order.iter().enumerate() {
        let mut mine: Vec<&Chosen> = chosen.iter().filter(|c| c.document_id == *doc).collect();
        mine.sort_by_key(|c| c.read.start);
        let sep = if i == 0 { "" } else { "\n\n" };
        ctx.extend(model.tokenizer.encode_plain(&format!("{sep}[{}]\n", mine[0].label))?);
        for (j, c) in mine.iter().enumerate() {
            if j > 0 && mine[j - 1].read.end != c.read.start {
                ctx.extend_from_slice(elision);
            }
            ctx.extend_from_slice(&c.tokens);
        }
    }
    Ok(ctx)
}
