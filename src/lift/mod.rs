//! LIFT ("LIFT: Improving Long Context Understanding of Large Language Models through Long Input
//! Fine-Tuning", Mao et al.): absorb a long document into a per-document adapter.
//! document (tokenized once: [`crate::document::Document`]) → auxiliary QA → plan (segments with
//! contextualized training, QA examples) → train → adapter bundle + manifest; and answering with
//! it ([`answer::answer`]).

pub mod absorb;
pub mod answer;
pub mod options;
pub mod pricing;

pub use absorb::{absorb, absorb_resumable, AbsorbEvent, AbsorbStage, Absorbed, AdapterSnapshot};
pub use absorb::cancelled::Cancelled;
pub use options::{AbsorbOptions, OptionError, OptionOverlay};
