//! What long absorbing work (QA generation, training) returns when its `cancel` callback stopped it.

/// Returned (inside `anyhow::Error`) when a `cancel` callback stopped long work (QA generation,
/// training); the field names the work.
#[derive(Debug, thiserror::Error)]
#[error("{0} cancelled")]
pub struct Cancelled(pub &'static str);
