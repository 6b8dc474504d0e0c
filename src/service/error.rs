//! What the service refuses or fails with. Each variant carries the numbers a client needs (the
//! limit and the value given); `server::error` maps them to HTTP once.

use crate::engine::EngineError;
use crate::store::Status;

#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    /// Unknown, or another tenant's.
    #[error("no document '{0}'")]
    UnknownDocument(String),
    /// Unknown, or another tenant's.
    #[error("no collection '{0}'")]
    UnknownCollection(String),
    /// Asking a collection without documents (409; its last one may have been deleted).
    #[error("collection {0} has no documents; add some (PATCH with 'add') before asking it")]
    CollectionEmpty(String),
    /// More documents than `--max-collection-documents` (413).
    #[error("the collection would hold {documents} documents; the limit is {limit}")]
    CollectionTooLarge { documents: usize, limit: usize },
    /// A document to remove from a collection is not in it (404).
    #[error("document '{document}' is not in collection '{collection}'")]
    NotInCollection { document: String, collection: String },
    #[error("document {id} is {}, not ready", status.name())]
    NotReady { id: String, status: Status },
    /// `memory` mode before the document has an adapter (409).
    #[error("document {0} has no adapter yet: mode memory answers with the adapter alone; ask in mode lift or rag")]
    NoAdapter(String),
    #[error("the document could not be tokenized: {0}")]
    Untokenizable(String),
    #[error("the document has {tokens} tokens; the limit is {limit}")]
    DocumentTooLarge { tokens: usize, limit: usize },
    #[error(
        "these options plan about {planned} training tokens for this document of {tokens} tokens; the server's limit is \
         {limit} (fewer epochs or aux_qa, or a larger stride, plan less)"
    )]
    TrainingTooLarge { planned: u64, tokens: usize, limit: u64 },
    #[error(
        "the prompt has {prompt_tokens} tokens; with max_tokens {max_tokens} it exceeds the model's window of {window} tokens"
    )]
    ContextLength { prompt_tokens: usize, max_tokens: usize, window: usize },
    /// The prompt outgrew the window while it was built (after the up-front check).
    #[error("the prompt has {prompt_tokens} tokens; the model's window is {window}")]
    PromptTooLong { prompt_tokens: usize, window: usize },
    #[error("the server's queue is full; retry later")]
    QueueFull,
    /// The KV cache budget of the requests being answered is full (429).
    #[error("{0}; retry later")]
    MemoryFull(String),
    #[error("the server is shutting down")]
    ShuttingDown,
    /// Replicas: the shared database cannot be reached (503; retry).
    #[error("{0}")]
    Unavailable(String),
    /// A training-only replica (`--role trainer`) was asked a question (503: ask another replica).
    #[error("this replica only trains (--role trainer); ask a replica that serves")]
    NotServing,
    /// The document's adapter was absorbed over another base model or prepared base than the
    /// one this server runs (409): absorb it again, or serve it over its own base.
    #[error(
        "this document was absorbed over another base than the one this server runs ({0}); absorb it again, or serve \
         it with the base it was absorbed over"
    )]
    WrongBase(String),
    /// The document's adapter no longer matches the hash it was saved with (409): posting its
    /// text again with the same options absorbs it again under the same id.
    #[error("{}", crate::store::damaged_message(.0))]
    AdapterDamaged(String),
    /// A server-side failure; the detail is for the log only.
    #[error("internal error: {0}")]
    Internal(String),
}

impl ServiceError {
    pub fn internal(detail: impl std::fmt::Display) -> Self {
        ServiceError::Internal(detail.to_string())
    }

    pub(super) fn poisoned<T>(_: T) -> Self {
        ServiceError::Internal("state lock poisoned".into())
    }
}

impl From<EngineError> for ServiceError {
    fn from(e: EngineError) -> Self {
        match e {
            EngineError::QueueFull => ServiceError::QueueFull,
            EngineError::Closed => ServiceError::ShuttingDown,
            EngineError::UnknownDocument(id) => ServiceError::UnknownDocument(id),
            EngineError::NoAdapter(id) => ServiceError::NoAdapter(id),
            EngineError::ContextLength(c) => ServiceError::PromptTooLong { prompt_tokens: c.prompt, window: c.window },
            EngineError::MemoryFull { .. } => ServiceError::MemoryFull(e.to_string()),
            EngineError::WrongBase(detail) => ServiceError::WrongBase(detail),
            // Named by the generation that knows its document (`PendingGeneration::wait`).
            EngineError::Damaged(detail) => ServiceError::Internal(detail),
            EngineError::Failed(detail) => ServiceError::Internal(detail),
        }
    }
}
