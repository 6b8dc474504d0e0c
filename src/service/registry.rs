//! Where the documents' records and the job queue live: one trait, [`Registry`], and its two
//! implementations, [`Records`](super::records::Records) (this process's memory, written through
//! to files beside the adapters: the default) and [`Shared`](super::postgres::Shared) (PostgreSQL,
//! shared by replicas). The service holds one as `Arc<dyn Registry>`; a new backend implements
//! the trait (and gets a constructor in [`Service::open`](super::Service::open)).
//!
//! The async methods return boxed futures (no `async fn` in a `dyn` trait on stable Rust, and no
//! extra dependency for it).

use super::{DocumentView, Health, ServiceError, Submitted};
use crate::document::Document;
use crate::engine::Engine;
use crate::lift::AbsorbOptions;
use crate::store::blobs::BlobRef;
use crate::store::{JobRecord, Status};
use futures_util::future::BoxFuture;
use std::collections::HashMap;
use std::sync::Arc;

/// What [`Registry::stats`] counts for `/metrics`.
#[derive(Default)]
pub(crate) struct RegistryStats {
    /// Documents by status (empty when they cannot be counted).
    pub documents: HashMap<Status, usize>,
    /// Training jobs waiting, when the registry holds the queue (None: the engine's own count).
    pub waiting: Option<usize>,
    pub blob_puts: u64,
    pub blob_fetches: u64,
}

/// The documents' records and the job queue, as the service uses them. Ids reaching it are
/// well-formed (the service checks their shape); an id unknown or another owner's is
/// [`ServiceError::UnknownDocument`].
pub(crate) trait Registry: Send + Sync {
    /// Whether this process answers questions (a training-only replica does not).
    fn answers(&self) -> bool;

    /// The registry's health (`/health`, once the service is not shutting down).
    fn health(&self) -> BoxFuture<'_, Health>;

    fn is_shutting_down(&self) -> bool;

    /// Stops taking work: the running training job stops (to be trained again later) and so do
    /// queued ones when their turn comes.
    fn begin_shutdown(&self);

    /// Records the job `rec` of the tokenized `document` and queues it (the engine trains it
    /// here, or a trainer replica claims it), or answers the document already queued, training or
    /// ready under its id (a failed, cancelled or damaged one is queued again under its id). `max_waiting` bounds the jobs waiting for a trainer. A refused request
    /// writes nothing; a queued document is answerable at once (the store's live documents).
    fn submit<'a>(
        &'a self,
        engine: &'a Engine,
        rec: JobRecord,
        document: Arc<Document>,
        options: AbsorbOptions,
        max_waiting: usize,
    ) -> BoxFuture<'a, Result<Submitted, ServiceError>>;

    /// The document `id` as `owner` sees it and, with shared blobs, the archive of its adapter.
    fn document<'a>(&'a self, owner: Option<&'a str>, id: &'a str) -> BoxFuture<'a, Result<(DocumentView, Option<BlobRef>), ServiceError>>;

    /// `owner`'s documents in posting order.
    fn documents<'a>(&'a self, owner: Option<&'a str>) -> BoxFuture<'a, Result<Vec<DocumentView>, ServiceError>>;

    /// Those of `ids` that are `owner`'s documents (a collection's members: one lookup of the
    /// members, not of every document the tenant has), in no particular order.
    fn documents_among<'a>(
        &'a self,
        owner: Option<&'a str>,
        ids: &'a [String],
    ) -> BoxFuture<'a, Result<Vec<DocumentView>, ServiceError>>;

    /// Updates of the document's view, for event streams (closed when the document is deleted).
    fn watch<'a>(
        self: Arc<Self>,
        owner: Option<&'a str>,
        id: &'a str,
    ) -> BoxFuture<'a, Result<tokio::sync::watch::Receiver<DocumentView>, ServiceError>>;

    /// Stops the document's job if it runs and removes its record, adapter and text.
    fn delete<'a>(&'a self, owner: Option<&'a str>, id: &'a str) -> BoxFuture<'a, Result<(), ServiceError>>;

    /// The kept text of a document without a saved adapter (to answer from its passages), or
    /// None.
    fn kept_text<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<Option<String>, ServiceError>>;

    /// The ready document `id`'s adapter was found damaged: its status becomes `damaged`, with
    /// the way back in its error (a document in any other status is left as it is: a re-post
    /// may already have queued it again).
    fn mark_damaged<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<(), ServiceError>>;

    /// Counts for `/metrics`.
    fn stats(&self) -> BoxFuture<'_, RegistryStats>;

    /// A question named the document (after a base upgrade, documents are absorbed again in
    /// the order they were last asked).
    fn asked(&self, _id: &str) {}
}
