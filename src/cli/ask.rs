//! `ask`: a question about an absorbed adapter directory, a document read in context only, or a
//! directory asked as one collection; answered by the one answer function, streamed to stdout.

use super::{print_piece, ModelArgs};
use anyhow::{Context, Result};
use candle_core::Device;
use lift_serve::document::Document;
use lift_serve::lift::answer::gate::{answer_gated, choose, AnswerSource};
use lift_serve::lift::answer::{answer, Ask, ContextPolicy, Mode};
use lift_serve::model::generate::{generate, SamplingParams};
use lift_serve::model::{ChatMessage, KvCache, Model, NoHooks};
use lift_serve::runtime::RuntimeConfig;
use lift_serve::store;
use std::path::PathBuf;

#[derive(clap::Args)]
pub(crate) struct AskArgs {
    /// Adapter directory written by `absorb`.
    #[arg(long, required_unless_present_any = ["document", "collection"], conflicts_with_all = ["document", "collection"])]
    adapter: Option<PathBuf>,
    /// A document (text, Markdown, HTML or PDF file) to read in context, without absorbing it.
    #[arg(long, conflicts_with = "collection")]
    document: Option<PathBuf>,
    /// A directory asked as one collection (as the server's `collection_id`): each entry an
    /// adapter directory written by `absorb` or a document file. One BM25 ranking over all their
    /// passages; `lift` (the default when it holds an adapter) answers with the adapter of the
    /// best passage's document, `rag` with none.
    #[arg(long)]
    collection: Option<PathBuf>,
    #[arg(long)]
    question: String,
    /// A JSON file with the conversation before the question, oldest first (as `/ask`'s
    /// `history`): `[{"role": "user", "content": "Tell me about the museum."}, {"role":
    /// "assistant", "content": "..."}]`. The earlier questions help choose the passages, and the
    /// turns precede the question in the prompt.
    #[arg(long)]
    history: Option<PathBuf>,
    /// Default: lift with --adapter, icl with --document (rag reads its retrieved passages).
    #[arg(long, value_enum)]
    mode: Option<Mode>,
    /// Which document text the prompt shows: the best BM25 passage and the passages its names
    /// link to (linked, the default; icl: head_tail), the passages BM25 ranks best (bm25), the
    /// same re-ranked by the prepared base's filter (retrieved), the head and tail (the LIFT
    /// paper's truncation), or what fits the window.
    #[arg(long, value_enum)]
    context: Option<ContextPolicy>,
    /// In-context document budget (default 128; with --context full, what fits the model's
    /// window). Small budgets emulate a short-context model.
    #[arg(long)]
    context_tokens: Option<usize>,
    /// Answer `lift` with the adapter's answer always, not the surer of it and the passages'
    /// (self-gating, as the server answers; the two are generated one after the other, and the
    /// answer is printed once chosen).
    #[arg(long)]
    no_self_gating: bool,
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    #[arg(long, default_value_t = 0.0)]
    temperature: f64,
    #[command(flatten)]
    model: ModelArgs,
}

impl AskArgs {
    /// `ask`: an absorbed adapter directory (loaded as the server loads it), or a plain text file
    /// read in context only; answered by the one answer function, streamed to stdout.
    pub(crate) fn run(&self, device: &Device, runtime: &RuntimeConfig) -> Result<()> {
        let model = self.model.load(device, runtime)?;
        if let Some(dir) = &self.collection {
            return self.ask_collection(&model, dir);
        }
        let (loaded, document, mode) = match (&self.adapter, &self.document) {
            (Some(dir), _) => {
                let loaded = store::load_dir(dir, &model)?;
                (Some(loaded.bundle), loaded.document, self.mode.unwrap_or(Mode::Lift))
            }
            (None, Some(file)) => {
                let mode = self.mode.unwrap_or(Mode::Icl);
                anyhow::ensure!(
                    !mode.uses_adapter(),
                    "--document reads the document in context only (mode icl or rag); mode {mode:?} needs an adapter: \
                     `lift-serve absorb` it, then ask with --adapter"
                );
                let text = lift_serve::formats::read_file(file)?.text;
                (None, std::sync::Arc::new(Document::encode(&model, text)?), mode)
            }
            (None, None) => anyhow::bail!("ask needs --adapter DIR or --document FILE"),
        };
        anyhow::ensure!(!document.is_empty(), "the document is empty");
        let params =
            SamplingParams { max_tokens: self.max_tokens, temperature: self.temperature, ..Default::default() };
        let history = self.history()?;
        let ask = Ask { question: &self.question, history: &history, mode, context: self.context, context_tokens: self.context_tokens };
        let adapter = loaded.as_ref().map(|b| &b.adapter as &dyn lift_serve::model::Adapter);
        let gated = mode == Mode::Lift && adapter.is_some() && !self.no_self_gating;
        let (a, answered_by) = if gated {
            let (a, by) = answer_gated(&model, &document, adapter, &ask, &params)?;
            print_piece(&a.generation.text);
            (a, by)
        } else {
            (answer(&model, &document, adapter, &ask, &params, &mut print_piece)?, None)
        };
        println!();
        for c in &a.chunks {
            tracing::info!(
                start = c.start,
                end = c.end,
                score = c.score,
                mask = c.mask,
                relevant = c.relevant(),
                "filter chunk"
            );
        }
        tracing::info!(
            mode = ?mode,
            answered_by = ?answered_by,
            prompt_tokens = a.prompt.tokens.len(),
            document_tokens_in_context = a.prompt.context_tokens,
            document_tokens = document.len(),
            completion_tokens = a.generation.tokens.len(),
            "done"
        );
        Ok(())
    }
}

impl AskArgs {
    fn history(&self) -> Result<Vec<ChatMessage>> {
        let Some(path) = &self.history else { return Ok(Vec::new()) };
        let text = std::fs::read_to_string(path).with_context(|| format!("{}: cannot read", path.display()))?;
        let turns: Vec<ChatMessage> =
            serde_json::from_str(&text).with_context(|| format!("{}: not a JSON array of {{role, content}} turns", path.display()))?;
        if let Some(t) = turns.iter().find(|t| t.role != "user" && t.role != "assistant") {
            anyhow::bail!("{}: a turn's role is 'user' or 'assistant' (got '{}')", path.display(), t.role);
        }
        Ok(turns)
    }

    /// `ask --collection DIR`: the server's collection index, ranking, prompt and routing over
    /// the directory's entries (adapter directories by their saved text and token ids, files
    /// read as `--document` reads them); only the routed document's adapter is used.
    fn ask_collection(&self, model: &Model, dir: &std::path::Path) -> Result<()> {
        use lift_serve::collection_index::CollectionIndex;
        let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
            .with_context(|| format!("{}: cannot read the collection directory", dir.display()))?
            .map(|e| e.map(|e| e.path()))
            .collect::<std::io::Result<_>>()?;
        entries.retain(|p| !p.file_name().is_some_and(|n| n.to_string_lossy().starts_with('.')));
        entries.sort();
        let mut index = CollectionIndex::default();
        let mut adapters = std::collections::HashMap::new();
        for path in &entries {
            let name = path.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_default();
            let document = if path.is_dir() {
                let loaded = store::load_dir(path, model).with_context(|| format!("{}: not an adapter directory", path.display()))?;
                adapters.insert(name.clone(), path.clone());
                loaded.document
            } else {
                std::sync::Arc::new(Document::encode(model, lift_serve::formats::read_file(path)?.text)?)
            };
            if document.is_empty() {
                tracing::warn!(entry = %path.display(), "an empty document: left out");
                continue;
            }
            index.add(&name, Some(name.clone()), lift_serve::service::index_passages(model, &document)?);
        }
        anyhow::ensure!(!index.is_empty(), "{}: no documents (adapter directories or files) in it", dir.display());
        let mode = self.mode.unwrap_or(if adapters.is_empty() { Mode::Rag } else { Mode::Lift });
        anyhow::ensure!(matches!(mode, Mode::Lift | Mode::Rag), "a collection is asked in mode lift or rag (got {mode:?})");
        anyhow::ensure!(
            matches!(self.context, None | Some(ContextPolicy::Bm25)),
            "a collection's context is its BM25 ranking (--context bm25)"
        );
        let history = self.history()?;
        let ask = Ask { question: &self.question, history: &history, mode, context: None, context_tokens: None };
        let budget = self.context_tokens.unwrap_or(lift_serve::lift::answer::DEFAULT_CONTEXT_TOKENS);
        let (tokens, read) = lift_serve::service::prompt_over(model, &index, &ask, budget, self.max_tokens)?;
        let top = read[0].document_id.clone();
        let routed = match (mode, adapters.get(&top)) {
            (Mode::Lift, Some(path)) => Some(store::load_dir(path, model)?.bundle),
            _ => None,
        };
        for p in &read {
            tracing::info!(document = %p.document_id, start = p.start, end = p.end, score = p.score, "passage read");
        }
        tracing::info!(
            routed_to = %top,
            adapter = routed.is_some(),
            documents = index.documents(),
            passages = index.len(),
            prompt_tokens = tokens.len(),
            "collection question"
        );
        let params = SamplingParams { max_tokens: self.max_tokens, temperature: self.temperature, ..Default::default() };
        let adapter = routed.as_ref().map(|b| &b.adapter as &dyn lift_serve::model::Adapter);
        let run = |adapter, on_text: &mut dyn FnMut(&str) -> bool| {
            generate(model, &tokens, &mut KvCache::new(model.config().num_layers), adapter, &mut NoHooks, &params, on_text)
        };
        // Self-gated as a document's answer is (`answer_gated`): the adapter's answer, or the
        // passages' own where it is the surer.
        let by = match adapter.filter(|_| !self.no_self_gating) {
            Some(adapter) => {
                let (with, without) = (run(Some(adapter), &mut |_| true)?, run(None, &mut |_| true)?);
                let by = choose(with.mean_logprob(), without.mean_logprob());
                print_piece(if by == AnswerSource::Adapter { &with.text } else { &without.text });
                format!(" (answered by: {by:?})")
            }
            None => {
                run(adapter, &mut print_piece)?;
                String::new()
            }
        };
        println!();
        eprintln!("[{} answered: {top}]{by}", if routed.is_some() { "lift" } else { "rag" });
        Ok(())
    }
}
