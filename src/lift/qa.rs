//! Auxiliary QA generation (filled in by the QA work).
