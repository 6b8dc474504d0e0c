//! LIFT ("LIFT: Improving Long Context Understanding of Large Language Models through Long Input
//! Fine-Tuning", Mao et al.): absorb a long document into a per-document adapter, and answer with
//! it. Three rooms, over one schema of absorb options ([`options`], which all three read):
//! - [`absorb`](mod@absorb): what makes an adapter. Document (tokenized once:
//!   [`crate::document::Document`]) → auxiliary QA → plan (segments with contextualized training,
//!   QA examples) → train → adapter bundle + manifest, resumable from a checkpoint.
//! - [`answer`]: what answers. The prompt (the document's passages or its head and tail, in
//!   FltLM's chunk layout under the prepared base's filter) and the one answer function,
//!   [`answer::answer`].
//! - [`pricing`]: what an absorb costs, said before it runs:
//!   [`pricing::estimate`](fn@pricing::estimate).

pub mod absorb;
pub mod answer;
pub mod options;
pub mod pricing;

pub use absorb::cancelled::Cancelled;
pub use absorb::{absorb, absorb_resumable, AbsorbEvent, AbsorbStage, Absorbed};
pub use options::{AbsorbOptions, OptionError, OptionOverlay};
