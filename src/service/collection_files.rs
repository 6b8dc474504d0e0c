//! Collections in this process's memory, written through to one JSON file each under
//! `<adapters>/collections/` (atomic writes): the default [`CollectionRegistry`].

use super::collections::{CollectionChange, CollectionRecord, CollectionRegistry};
use super::ServiceError;
use anyhow::Context;
use futures_util::future::BoxFuture;
use futures_util::FutureExt;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

pub struct FileCollections {
    dir: PathBuf,
    /// The lock is held while a record is written, so that two changes cannot interleave.
    records: Mutex<HashMap<String, CollectionRecord>>,
}

impl FileCollections {
    /// Reads the collections under `adapters_dir` (an unreadable file is skipped with a warning).
    pub fn open(adapters_dir: &Path) -> anyhow::Result<Self> {
        let dir = adapters_dir.join("collections");
        let mut records = HashMap::new();
        // Made when the first collection is written: a store without collections holds no folder.
        let entries = match std::fs::read_dir(&dir) {
            Ok(entries) => entries.collect::<Vec<_>>(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(e) => return Err(e).with_context(|| format!("{}: cannot read", dir.display())),
        };
        for entry in entries {
            let path = entry?.path();
            if path.extension().is_none_or(|e| e != "json") {
                continue;
            }
            match std::fs::read(&path).map_err(anyhow::Error::from).and_then(|b| Ok(serde_json::from_slice::<CollectionRecord>(&b)?)) {
                Ok(r) if super::collections::valid_collection_id(&r.id) => {
                    records.insert(r.id.clone(), r);
                }
                Ok(_) => tracing::warn!(path = %path.display(), "collection record with a malformed id skipped"),
                Err(e) => tracing::warn!(path = %path.display(), error = %e, "unreadable collection record skipped"),
            }
        }
        tracing::info!(collections = records.len(), "collections opened");
        Ok(Self { dir, records: Mutex::new(records) })
    }

    fn path(&self, id: &str) -> PathBuf {
        self.dir.join(format!("{id}.json"))
    }

    fn write(&self, rec: &CollectionRecord) -> Result<(), ServiceError> {
        let bytes = serde_json::to_vec_pretty(rec).map_err(ServiceError::internal)?;
        std::fs::create_dir_all(&self.dir)
            .map_err(|e| ServiceError::internal(format!("{}: cannot create: {e}", self.dir.display())))?;
        crate::store::write_atomic(&self.path(&rec.id), &bytes)
            .map_err(|e| ServiceError::internal(format!("cannot write the collection record: {e:#}")))
    }

    fn with_mine<T>(
        &self,
        owner: Option<&str>,
        id: &str,
        f: impl FnOnce(&mut HashMap<String, CollectionRecord>) -> Result<T, ServiceError>,
    ) -> Result<T, ServiceError> {
        let mut records = self.records.lock().map_err(ServiceError::poisoned)?;
        match records.get(id) {
            Some(r) if r.owner.as_deref() == owner => f(&mut records),
            _ => Err(ServiceError::UnknownCollection(id.to_string())),
        }
    }
}

impl CollectionRegistry for FileCollections {
    fn create(&self, rec: CollectionRecord) -> BoxFuture<'_, Result<(), ServiceError>> {
        async move {
            let mut records = self.records.lock().map_err(ServiceError::poisoned)?;
            self.write(&rec)?;
            records.insert(rec.id.clone(), rec);
            Ok(())
        }
        .boxed()
    }

    fn collection<'a>(&'a self, owner: Option<&'a str>, id: &'a str) -> BoxFuture<'a, Result<CollectionRecord, ServiceError>> {
        async move { self.with_mine(owner, id, |r| Ok(r[id].clone())) }.boxed()
    }

    fn collections<'a>(&'a self, owner: Option<&'a str>) -> BoxFuture<'a, Result<Vec<CollectionRecord>, ServiceError>> {
        async move {
            let records = self.records.lock().map_err(ServiceError::poisoned)?;
            let mut list: Vec<CollectionRecord> = records.values().filter(|r| r.owner.as_deref() == owner).cloned().collect();
            list.sort_by(|a, b| (a.created_at, &a.id).cmp(&(b.created_at, &b.id)));
            Ok(list)
        }
        .boxed()
    }

    fn change<'a>(
        &'a self,
        owner: Option<&'a str>,
        id: &'a str,
        change: &'a CollectionChange,
        max: usize,
    ) -> BoxFuture<'a, Result<CollectionRecord, ServiceError>> {
        async move {
            self.with_mine(owner, id, |records| {
                let mut rec = records[id].clone();
                change.apply(id, &mut rec.document_ids, max)?;
                if let Some(t) = &change.title {
                    rec.title = Some(t.clone());
                }
                rec.updated_at = crate::store::now();
                self.write(&rec)?;
                records.insert(id.to_string(), rec.clone());
                Ok(rec)
            })
        }
        .boxed()
    }

    fn delete<'a>(&'a self, owner: Option<&'a str>, id: &'a str) -> BoxFuture<'a, Result<(), ServiceError>> {
        async move {
            self.with_mine(owner, id, |records| {
                if let Err(e) = std::fs::remove_file(self.path(id)) {
                    if e.kind() != std::io::ErrorKind::NotFound {
                        return Err(ServiceError::internal(format!("cannot remove the collection record: {e}")));
                    }
                }
                records.remove(id);
                Ok(())
            })
        }
        .boxed()
    }

    fn forget_document<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<(), ServiceError>> {
        async move {
            let mut records = self.records.lock().map_err(ServiceError::poisoned)?;
            for rec in records.values_mut().filter(|r| r.document_ids.iter().any(|d| d == id)) {
                let mut changed = rec.clone();
                changed.document_ids.retain(|d| d != id);
                changed.updated_at = crate::store::now();
                self.write(&changed)?;
                *rec = changed;
            }
            Ok(())
        }
        .boxed()
    }
}
