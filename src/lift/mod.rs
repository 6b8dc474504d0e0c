//! LIFT (seeds/001_18569741511b14ae.txt): absorb a long document into a per-document adapter.
//! document → sentences → plan (segments with contextualized training, auxiliary QA) → train →
//! adapter; and answering with it.

pub mod qa;
pub mod text;
