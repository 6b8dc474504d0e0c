//! Sentence splitting (filled in by the QA work).
