//! Continuous batching on the generation thread: requests join the running batch at any step
//! and leave it as soon as they finish, are cancelled or their client goes away. Every step is
//! one `Decoder::forward_batch` over all running sequences — one token each for those decoding,
//! and a prompt chunk for those still reading their prompt (chunked prefill: at most
//! `prefill_tokens` prompt tokens per step, so a long prompt delays the others' next token by
//! one chunk, not by its whole prompt). Each sequence keeps its own adapter (a document's Gated
//! Memory or LoRA, or none), FltLM hooks, sampling parameters and stop strings.

use crate::model::generate::Sequence;
use crate::model::{Adapter, ForwardHooks, Model};
use anyhow::Result;
use std::sync::Arc;

/// One running request: its sequence, the adapter it answers with and what the caller keeps
/// with it (channels, the document for chunk texts...).
pub struct Entry<'m, H, T> {
    pub seq: Sequence<'m, H>,
    pub adapter: Option<Arc<dyn Adapter>>,
    /// Equal for entries sharing one adapter (0: none), see `SeqInput::adapter_key`.
    pub adapter_key: usize,
    pub data: T,
}

/// The running batch.
pub struct Batch<'m, H, T> {
    entries: Vec<Entry<'m, H, T>>,
    max_seqs: usize,
    prefill_tokens: usize,
}

impl<'m, H: ForwardHooks, T> Batch<'m, H, T> {
    /// At most `max_seqs` sequences at once, at most `prefill_tokens` prompt tokens per step
    /// (at least one prompt chunk whenever a sequence is reading its prompt).
    pub fn new(max_seqs: usize, prefill_tokens: usize) -> Self {
        Self { entries: Vec::new(), max_seqs: max_seqs.max(1), prefill_tokens }
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn has_room(&self) -> bool {
        self.entries.len() < self.max_seqs
    }

    /// Adds a sequence; it takes part from the next step.
    pub fn join(&mut self, entry: Entry<'m, H, T>) {
        self.entries.push(entry);
    }

    /// Cancels the entries for which `gone` holds (their clients left): they leave the batch at
    /// the next step without running.
    pub fn cancel_where(&mut self, gone: impl Fn(&T) -> bool) {
        for e in self.entries.iter_mut().filter(|e| gone(&e.data)) {
            e.seq.cancel();
        }
    }

    /// Removes every entry (after a failed step).
    pub fn drain(&mut self) -> Vec<Entry<'m, H, T>> {
        std::mem::take(&mut self.entries)
    }

    /// Sequences decoding and prompt tokens still to read, for the metrics.
    pub fn load(&self) -> (usize, usize) {
        let decoding = self.entries.iter().filter(|e| !e.seq.in_prefill()).count();
        (decoding, self.entries.iter().map(|e| e.seq.prompt_left()).sum())
    }

    /// Runs one step: every decoding sequence feeds its last token, prompt chunks fill the
    /// step's prompt budget in arrival order. `on_text` streams each entry's new text (false:
    /// its client is gone). Returns the entries that finished, in arrival order.
    pub fn step(
        &mut self,
        model: &Model,
        on_text: &mut dyn FnMut(&mut T, &str) -> bool,
    ) -> Result<Vec<Entry<'m, H, T>>> {
        let mut chosen = Vec::with_capacity(self.entries.len());
        let mut prompt = 0;
        for (i, e) in self.entries.iter().enumerate() {
            if e.seq.is_finished() {
                continue;
            }
            if !e.seq.in_prefill() {
                chosen.push(i);
                continue;
            }
            let chunk = e.seq.pending().len();
            if prompt == 0 || prompt + chunk <= self.prefill_tokens {
                prompt += chunk;
                chosen.push(i);
            }
        }
        if !chosen.is_empty() {
            let logits = {
                let mut inputs: Vec<_> = self
                    .entries
                    .iter_mut()
                    .enumerate()
                    .filter(|(i, _)| chosen.binary_search(i).is_ok())
                    .map(|(_, e)| e.seq.input(e.adapter.as_deref(), e.adapter_key))
                    .collect();
                model.decoder.forward_batch(&mut inputs)?
            };
            for (row, &i) in chosen.iter().enumerate() {
                let e = &mut self.entries[i];
                let data = &mut e.data;
                e.seq.advance(&logits, row, &mut |piece| on_text(data, piece))?;
            }
        }
        let (done, running): (Vec<_>, Vec<_>) = std::mem::take(&mut self.entries).into_iter().partition(|e| e.seq.is_finished());
        self.entries = running;
        Ok(done)
    }
}
