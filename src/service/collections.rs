//! Collections: a tenant's named sets of its documents, asked as one library
//! (`collection_ask`). A collection's record lists its documents in the order they joined; it
//! lives beside the documents' records — files under the adapters directory by default
//! ([`super::collection_files`]), PostgreSQL with replicas ([`super::collection_pg`]) — behind one
//! trait, [`CollectionRegistry`].
//!
//! The service checks every change before the registry applies it: the documents must be the
//! caller's (an unknown or another tenant's id is `UnknownDocument`, as for documents), and the
//! registry refuses a change that would pass `--max-collection-documents` as a whole, writing
//! nothing. Deleting a document takes it out of its collections.

use super::{known_shape, Service, ServiceError};
use futures_util::future::BoxFuture;
use serde::{Deserialize, Serialize};
use std::collections::HashSet;

/// A collection as stored.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct CollectionRecord {
    pub id: String,
    pub owner: Option<String>,
    pub title: Option<String>,
    /// Member documents in the order they joined.
    pub document_ids: Vec<String>,
    pub created_at: u64,
    pub updated_at: u64,
}

/// The API's Collection object.
#[derive(Clone, Debug, Serialize, PartialEq, utoipa::ToSchema)]
pub struct CollectionView {
    pub id: String,
    /// Always "collection".
    pub object: &'static str,
    pub title: Option<String>,
    pub document_ids: Vec<String>,
    pub created_at: u64,
    pub updated_at: u64,
}

impl CollectionRecord {
    pub fn view(&self) -> CollectionView {
        CollectionView {
            id: self.id.clone(),
            object: "collection",
            title: self.title.clone(),
            document_ids: self.document_ids.clone(),
            created_at: self.created_at,
            updated_at: self.updated_at,
        }
    }
}

/// A change to a collection (`PATCH`): a new title, documents joining and leaving.
#[derive(Clone, Debug, Default)]
pub struct CollectionChange {
    pub title: Option<String>,
    pub add: Vec<String>,
    pub remove: Vec<String>,
}

impl CollectionChange {
    /// Applies the change to `members` (leaving first): a document to remove must be a member,
    /// one already a member is not added twice, and the result must hold at most `max`.
    pub fn apply(&self, collection: &str, members: &mut Vec<String>, max: usize) -> Result<(), ServiceError> {
        for id in &self.remove {
            let at = members.iter().position(|m| m == id).ok_or_else(|| ServiceError::NotInCollection {
                document: id.clone(),
                collection: collection.to_string(),
            })?;
            members.remove(at);
        }
        for id in &self.add {
            if !members.contains(id) {
                members.push(id.clone());
            }
        }
        if members.len() > max {
            return Err(ServiceError::CollectionTooLarge { documents: members.len(), limit: max });
        }
        Ok(())
    }
}

/// Where collections are kept. Ids reaching it are well-formed; an id unknown or another owner's
/// is [`ServiceError::UnknownCollection`].
pub(crate) trait CollectionRegistry: Send + Sync {
    fn create(&self, rec: CollectionRecord) -> BoxFuture<'_, Result<(), ServiceError>>;

    fn collection<'a>(&'a self, owner: Option<&'a str>, id: &'a str) -> BoxFuture<'a, Result<CollectionRecord, ServiceError>>;

    /// `owner`'s collections in the order they were made.
    fn collections<'a>(&'a self, owner: Option<&'a str>) -> BoxFuture<'a, Result<Vec<CollectionRecord>, ServiceError>>;

    /// Applies `change` atomically ([`CollectionChange::apply`]); a refused change writes nothing.
    fn change<'a>(
        &'a self,
        owner: Option<&'a str>,
        id: &'a str,
        change: &'a CollectionChange,
        max: usize,
    ) -> BoxFuture<'a, Result<CollectionRecord, ServiceError>>;

    fn delete<'a>(&'a self, owner: Option<&'a str>, id: &'a str) -> BoxFuture<'a, Result<(), ServiceError>>;

    /// The document `id` was deleted: it leaves every collection.
    fn forget_document<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<(), ServiceError>>;
}

/// `col_` and 32 lowercase hex digits: unlike a document id, so that a chat completion's `model`
/// tells them apart.
pub fn valid_collection_id(id: &str) -> bool {
    id.len() == 36 && id.starts_with("col_") && id[4..].bytes().all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
}

pub(super) fn collection_shape(id: &str) -> Result<(), ServiceError> {
    if valid_collection_id(id) { Ok(()) } else { Err(ServiceError::UnknownCollection(id.to_string())) }
}

/// A fresh id (not content-addressed: two collections of the same documents are two).
fn new_collection_id(owner: Option<&str>) -> String {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    h.update(crate::store::now_nanos_hex());
    h.update(crate::store::next_seq().to_le_bytes());
    h.update(std::process::id().to_le_bytes());
    h.update(owner.unwrap_or(""));
    format!("col_{}", hex::encode(&h.finalize()[..16]))
}

impl Service {
    /// The ids of `ids` that are not `owner`'s documents (unknown or another tenant's), checked
    /// before anything is written: the first one is the error.
    async fn check_documents(&self, owner: Option<&str>, ids: &[String]) -> Result<(), ServiceError> {
        if ids.is_empty() {
            return Ok(());
        }
        let known: HashSet<String> = self.registry.documents_among(owner, ids).await?.into_iter().map(|d| d.id).collect();
        match ids.iter().find(|id| known_shape(id).is_err() || !known.contains(*id)) {
            Some(id) => Err(ServiceError::UnknownDocument(id.clone())),
            None => Ok(()),
        }
    }

    pub async fn create_collection(
        &self,
        owner: Option<String>,
        title: Option<String>,
        document_ids: Vec<String>,
    ) -> Result<CollectionView, ServiceError> {
        let mut members = Vec::new();
        let change = CollectionChange { title: None, add: document_ids, remove: Vec::new() };
        self.check_documents(owner.as_deref(), &change.add).await?;
        let id = new_collection_id(owner.as_deref());
        change.apply(&id, &mut members, self.cfg.max_collection_documents)?;
        let now = crate::store::now();
        let rec = CollectionRecord { id, owner, title, document_ids: members, created_at: now, updated_at: now };
        self.collections.create(rec.clone()).await?;
        tracing::info!(id = rec.id, documents = rec.document_ids.len(), "collection created");
        Ok(rec.view())
    }

    pub async fn collection(&self, owner: Option<&str>, id: &str) -> Result<CollectionView, ServiceError> {
        collection_shape(id)?;
        Ok(self.collections.collection(owner, id).await?.view())
    }

    pub async fn collections(&self, owner: Option<&str>) -> Result<Vec<CollectionView>, ServiceError> {
        Ok(self.collections.collections(owner).await?.iter().map(CollectionRecord::view).collect())
    }

    /// Renames the collection and adds and removes documents in one step.
    pub async fn change_collection(&self, owner: Option<&str>, id: &str, change: CollectionChange) -> Result<CollectionView, ServiceError> {
        collection_shape(id)?;
        // An unknown collection is named before its documents.
        self.collections.collection(owner, id).await?;
        self.check_documents(owner, &change.add).await?;
        let rec = self.collections.change(owner, id, &change, self.cfg.max_collection_documents).await?;
        Ok(rec.view())
    }

    pub async fn delete_collection(&self, owner: Option<&str>, id: &str) -> Result<(), ServiceError> {
        collection_shape(id)?;
        self.collections.delete(owner, id).await?;
        self.forget_index(id);
        tracing::info!(id, "collection deleted");
        Ok(())
    }

    /// Checks that document posts may join collection `id` (it exists, is `owner`'s, and has
    /// room for one more), before the document is queued.
    pub async fn check_joinable(&self, owner: Option<&str>, id: &str) -> Result<(), ServiceError> {
        collection_shape(id)?;
        let rec = self.collections.collection(owner, id).await?;
        let limit = self.cfg.max_collection_documents;
        if rec.document_ids.len() >= limit {
            return Err(ServiceError::CollectionTooLarge { documents: rec.document_ids.len() + 1, limit });
        }
        Ok(())
    }

    /// Adds a just-posted document to collection `id`.
    pub async fn join_collection(&self, owner: Option<&str>, id: &str, document: &str) -> Result<CollectionView, ServiceError> {
        let change = CollectionChange { title: None, add: vec![document.to_string()], remove: Vec::new() };
        Ok(self.collections.change(owner, id, &change, self.cfg.max_collection_documents).await?.view())
    }
}
