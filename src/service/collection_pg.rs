//! Collections in the replicas' PostgreSQL database (migration 3: `collections` and
//! `collection_documents`), so that a collection made on one replica is asked on any. A member
//! row references its document with `ON DELETE CASCADE`: deleting a document takes it out of its
//! collections in the same statement, on every replica.

use super::collections::{CollectionChange, CollectionRecord, CollectionRegistry};
use super::postgres::{db_error, timed, Shared};
use super::ServiceError;
use futures_util::future::BoxFuture;
use futures_util::FutureExt;

fn to_u64(n: i64) -> u64 {
    n.max(0) as u64
}

fn to_i64(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

const MEMBERS: &str =
    "SELECT collection_id, document_id FROM collection_documents WHERE collection_id = ANY($1) ORDER BY position, document_id";

fn ids(rows: &[tokio_postgres::Row]) -> Vec<String> {
    rows.iter().map(|r| r.get(0)).collect()
}

/// The collection rows (`COLUMNS`) with their member rows (`MEMBERS`).
fn assemble(rows: &[tokio_postgres::Row], members: &[tokio_postgres::Row]) -> Vec<CollectionRecord> {
    rows.iter()
        .map(|r| {
            let id: String = r.get(0);
            let document_ids = members.iter().filter(|m| m.get::<_, String>(0) == id).map(|m| m.get(1)).collect();
            CollectionRecord {
                id,
                owner: r.get(1),
                title: r.get(2),
                document_ids,
                created_at: to_u64(r.get(3)),
                updated_at: to_u64(r.get(4)),
            }
        })
        .collect()
}

const COLUMNS: &str = "id, owner, title, created_at, updated_at";

/// A member row whose document is gone (deleted meanwhile) fails its foreign key.
fn member_error(e: tokio_postgres::Error, adding: &[String]) -> ServiceError {
    match e.as_db_error() {
        Some(db) if db.code() == &tokio_postgres::error::SqlState::FOREIGN_KEY_VIOLATION => {
            let id = adding.iter().find(|id| db.detail().is_some_and(|d| d.contains(id.as_str()))).or(adding.first());
            ServiceError::UnknownDocument(id.cloned().unwrap_or_default())
        }
        _ => db_error(e),
    }
}

impl CollectionRegistry for Shared {
    fn create(&self, rec: CollectionRecord) -> BoxFuture<'_, Result<(), ServiceError>> {
        async move {
            let mut c = self.client().await?;
            timed(async {
                let tx = c.transaction().await.map_err(db_error)?;
                tx.execute(
                    "INSERT INTO collections (id, owner, title, created_at, updated_at) VALUES ($1, $2, $3, $4, $5)",
                    &[&rec.id, &rec.owner, &rec.title, &to_i64(rec.created_at), &to_i64(rec.updated_at)],
                )
                .await
                .map_err(db_error)?;
                for (i, doc) in rec.document_ids.iter().enumerate() {
                    tx.execute(
                        "INSERT INTO collection_documents (collection_id, document_id, position) VALUES ($1, $2, $3)",
                        &[&rec.id, doc, &(i as i64)],
                    )
                    .await
                    .map_err(|e| member_error(e, &rec.document_ids))?;
                }
                tx.commit().await.map_err(db_error)
            })
            .await
        }
        .boxed()
    }

    fn collection<'a>(&'a self, owner: Option<&'a str>, id: &'a str) -> BoxFuture<'a, Result<CollectionRecord, ServiceError>> {
        async move {
            let c = self.client().await?;
            timed(async {
                let sql = format!("SELECT {COLUMNS} FROM collections WHERE id = $1 AND owner IS NOT DISTINCT FROM $2");
                let rows = c.query(&sql, &[&id, &owner]).await.map_err(db_error)?;
                let members = c.query(MEMBERS, &[&ids(&rows)]).await.map_err(db_error)?;
                assemble(&rows, &members).pop().ok_or_else(|| ServiceError::UnknownCollection(id.to_string()))
            })
            .await
        }
        .boxed()
    }

    fn collections<'a>(&'a self, owner: Option<&'a str>) -> BoxFuture<'a, Result<Vec<CollectionRecord>, ServiceError>> {
        async move {
            let c = self.client().await?;
            timed(async {
                let sql = format!("SELECT {COLUMNS} FROM collections WHERE owner IS NOT DISTINCT FROM $1 ORDER BY created_at, id");
                let rows = c.query(&sql, &[&owner]).await.map_err(db_error)?;
                let members = c.query(MEMBERS, &[&ids(&rows)]).await.map_err(db_error)?;
                Ok(assemble(&rows, &members))
            })
            .await
        }
        .boxed()
    }

    /// In one transaction, the collection's row locked: concurrent changes on other replicas
    /// wait, so that the limit holds for their sum.
    fn change<'a>(
        &'a self,
        owner: Option<&'a str>,
        id: &'a str,
        change: &'a CollectionChange,
        max: usize,
    ) -> BoxFuture<'a, Result<CollectionRecord, ServiceError>> {
        async move {
            let mut c = self.client().await?;
            timed(async {
                let tx = c.transaction().await.map_err(db_error)?;
                let sql = format!("SELECT {COLUMNS} FROM collections WHERE id = $1 AND owner IS NOT DISTINCT FROM $2 FOR UPDATE");
                let rows = tx.query(&sql, &[&id, &owner]).await.map_err(db_error)?;
                let members = tx.query(MEMBERS, &[&ids(&rows)]).await.map_err(db_error)?;
                let mut rec = assemble(&rows, &members).pop().ok_or_else(|| ServiceError::UnknownCollection(id.to_string()))?;
                let before = rec.document_ids.clone();
                change.apply(id, &mut rec.document_ids, max)?;
                if let Some(t) = &change.title {
                    rec.title = Some(t.clone());
                }
                rec.updated_at = crate::store::now();
                for gone in before.iter().filter(|d| !rec.document_ids.contains(d)) {
                    tx.execute("DELETE FROM collection_documents WHERE collection_id = $1 AND document_id = $2", &[&id, gone])
                        .await
                        .map_err(db_error)?;
                }
                let added: Vec<String> = rec.document_ids.iter().filter(|d| !before.contains(d)).cloned().collect();
                for doc in &added {
                    tx.execute(
                        "INSERT INTO collection_documents (collection_id, document_id, position)
                         VALUES ($1, $2, (SELECT coalesce(max(position), -1) + 1 FROM collection_documents WHERE collection_id = $1))",
                        &[&id, doc],
                    )
                    .await
                    .map_err(|e| member_error(e, &added))?;
                }
                tx.execute("UPDATE collections SET title = $2, updated_at = $3 WHERE id = $1", &[&id, &rec.title, &to_i64(rec.updated_at)])
                    .await
                    .map_err(db_error)?;
                tx.commit().await.map_err(db_error)?;
                Ok(rec)
            })
            .await
        }
        .boxed()
    }

    fn delete<'a>(&'a self, owner: Option<&'a str>, id: &'a str) -> BoxFuture<'a, Result<(), ServiceError>> {
        async move {
            let c = self.client().await?;
            let n = timed(async {
                c.execute("DELETE FROM collections WHERE id = $1 AND owner IS NOT DISTINCT FROM $2", &[&id, &owner])
                    .await
                    .map_err(db_error)
            })
            .await?;
            if n == 0 {
                return Err(ServiceError::UnknownCollection(id.to_string()));
            }
            Ok(())
        }
        .boxed()
    }

    /// The foreign key's cascade already took the document out.
    fn forget_document<'a>(&'a self, _id: &'a str) -> BoxFuture<'a, Result<(), ServiceError>> {
        futures_util::future::ready(Ok(())).boxed()
    }
}
