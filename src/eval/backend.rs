//! Where absorbing and answering happen: the `Backend` trait and its in-process implementation
//! (`Local`; a running server's is `client::Server`).

use super::{AbsorbRecord, EvalDocument};
use crate::document::Document;
use crate::lift::answer::{answer, answer_each_passage, Ask};
use crate::lift::{self, AbsorbEvent, AbsorbOptions};
use crate::model::filter::ChunkScore;
use crate::model::generate::SamplingParams;
use crate::model::Model;
use anyhow::Result;
use std::time::Instant;

/// An answer as a backend gives it: the reply, the prompt's length in tokens, and each
/// in-context chunk's FltLM score and mask (empty without a base filter).
pub struct Asked {
    pub text: String,
    pub prompt_tokens: usize,
    pub chunks: Vec<ChunkScore>,
    pub logprobs: Vec<f32>,
}

/// Where absorbing and answering happen: in this process, or on a server ([`client::Server`]).
pub trait Backend {
    /// Absorbs `doc` with `opts`; returns the record and a handle for [`Backend::ask`].
    fn absorb(
        &mut self,
        doc: &EvalDocument,
        document: &Document,
        opts: &AbsorbOptions,
        on_step: &mut dyn FnMut(usize, usize, f64),
    ) -> Result<(AbsorbRecord, usize)>;
    /// Answers `ask` greedily (with adapter `handle`, if any); `each_passage`: each passage read
    /// on its own, the likeliest answer kept.
    fn ask(&mut self, doc: &EvalDocument, document: &Document, handle: Option<usize>, ask: &Ask, each_passage: bool) -> Result<Asked>;
    /// Forgets the adapters of the current document.
    fn release(&mut self) {}
}

/// In-process backend: [`lift::absorb`] and [`answer`] on a loaded model.
pub struct Local<'a> {
    pub model: &'a Model,
    pub max_tokens: usize,
    adapters: Vec<lift::Absorbed>,
    /// This run's absorb rate, as a server keeps its own: a few steps timed before the first
    /// absorb ([`lift::pricing::calibrate`]) until an absorb has finished.
    rate: lift::pricing::AbsorbRate,
    calibrated: bool,
}

impl<'a> Local<'a> {
    pub fn new(model: &'a Model, max_tokens: usize) -> Self {
        Self { model, max_tokens, adapters: Vec::new(), rate: Default::default(), calibrated: false }
    }
}

impl Backend for Local<'_> {
    fn absorb(
        &mut self,
        doc: &EvalDocument,
        document: &Document,
        opts: &AbsorbOptions,
        on_step: &mut dyn FnMut(usize, usize, f64),
    ) -> Result<(AbsorbRecord, usize)> {
        if !std::mem::replace(&mut self.calibrated, true) {
            self.rate.set_calibrated(lift::pricing::calibrated_rate(self.model, opts));
        }
        let t0 = Instant::now();
        // The price a server would say, and the options it would train: fitted to their time
        // budget (as asked without one).
        let cost = lift::pricing::estimate(self.model, document, opts, &self.rate);
        let opts = &cost.options;
        let absorbed = lift::absorb(
            self.model,
            document,
            Some(&doc.id),
            opts,
            &mut |e| {
                if let AbsorbEvent::Train(p) = e {
                    on_step(p.step, p.steps, p.loss);
                }
            },
            &|| false,
        )?;
        let r = &absorbed.report;
        let seconds = t0.elapsed().as_secs_f64();
        self.rate.record_absorb(self.model, document.len(), absorbed.qa.len(), opts, r.steps_this_run(), seconds);
        let rec = AbsorbRecord {
            document: doc.id.clone(),
            methods: Vec::new(),
            seconds,
            estimated_seconds: Some(cost.estimate.seconds),
            estimated_tokens: Some(cost.estimate.training_tokens),
            out_of_time: r.out_of_time,
            train_seconds: Some(r.seconds),
            tokens_per_s: Some(r.tokens_per_s),
            steps: r.steps,
            qa_pairs: Some(absorbed.qa.len()),
            parameters: absorbed.manifest.parameters,
            adapter_bytes: absorbed.manifest.bytes,
            step_losses: r.step_losses.clone(),
            epoch_losses: r.epoch_losses.clone(),
            final_loss: Some(r.final_loss),
            probe_curve: r.probe_curve.clone(),
            planned_steps: Some(r.planned_steps),
        };
        self.adapters.push(absorbed);
        Ok((rec, self.adapters.len() - 1))
    }

    fn ask(&mut self, _doc: &EvalDocument, document: &Document, handle: Option<usize>, ask: &Ask, each_passage: bool) -> Result<Asked> {
        let bundle = handle.map(|h| &self.adapters[h].bundle);
        let adapter = bundle.map(|b| &b.adapter as &dyn crate::model::Adapter);
        let params = SamplingParams { max_tokens: self.max_tokens, temperature: 0.0, ..Default::default() };
        let a = if each_passage {
            answer_each_passage(self.model, document, adapter, ask, &params)?
        } else {
            answer(self.model, document, adapter, ask, &params, &mut |_| true)?
        };
        Ok(Asked { text: a.generation.text, prompt_tokens: a.prompt.tokens.len(), chunks: a.chunks, logprobs: a.generation.logprobs })
    }

    fn release(&mut self) {
        self.adapters.clear();
    }
}
