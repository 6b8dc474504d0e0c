//! The schema: versioned migrations, applied in order when a replica starts (under an advisory
//! lock, so that replicas starting together apply each once).

use super::{db_error, timed, Shared};
use crate::service::ServiceError;
use std::sync::atomic::Ordering;

/// Versioned schema migrations, applied in order at start (under an advisory lock, so that
/// replicas starting together apply each once). Never edit one that shipped: add the next.
const MIGRATIONS: &[(i32, &str)] = &[
    (
        1,
    "CREATE TABLE documents (
        id text PRIMARY KEY,
        owner text,
        title text,
        status text NOT NULL,
        tokens bigint NOT NULL,
        created_at bigint NOT NULL,
        seq bigint NOT NULL,
        ready_at bigint,
        error text,
        adapter jsonb,
        options jsonb NOT NULL,
        source jsonb,
        training jsonb,
        progress jsonb,
        blob_sha256 text,
        updated_at timestamptz NOT NULL DEFAULT now()
    );
    CREATE INDEX documents_by_owner ON documents (owner, seq, id);
    CREATE TABLE jobs (
        id text PRIMARY KEY REFERENCES documents (id) ON DELETE CASCADE,
        text text NOT NULL,
        seq bigint NOT NULL,
        replica text,
        lease_until timestamptz,
        attempts integer NOT NULL DEFAULT 0,
        claimed_at timestamptz
    );
    CREATE INDEX jobs_in_order ON jobs (seq, id);",
    ),
    // The options as asked, which ids are made of (`JobRecord::requested`); NULL in rows written
    // before: their id is of `options`.
    (2, "ALTER TABLE documents ADD COLUMN requested jsonb;"),
    // Collections (`collection_pg`): a member row goes with its document (ON DELETE CASCADE).
    (
        3,
        "CREATE TABLE collections (
        id text PRIMARY KEY,
        owner text,
        title text,
        created_at bigint NOT NULL,
        updated_at bigint NOT NULL
    );
    CREATE INDEX collections_by_owner ON collections (owner, created_at, id);
    CREATE TABLE collection_documents (
        collection_id text NOT NULL REFERENCES collections (id) ON DELETE CASCADE,
        document_id text NOT NULL REFERENCES documents (id) ON DELETE CASCADE,
        position bigint NOT NULL,
        PRIMARY KEY (collection_id, document_id)
    );
    CREATE INDEX collection_documents_by_document ON collection_documents (document_id);",
    ),
    // A new base under stored documents (`rebase.rs`): the base each published adapter was made
    // over (NULL in rows published before: read from the archive's manifest once), the base a
    // document is being absorbed again from, when it was last asked, and the base a job must be
    // trained over (NULL: any; a document's id is made with its base, so a trainer over another
    // one must leave the job).
    (
        4,
        "ALTER TABLE documents ADD COLUMN base text, ADD COLUMN base_name text, ADD COLUMN reabsorbing_from text,
        ADD COLUMN last_asked_at bigint;
    ALTER TABLE jobs ADD COLUMN base text;",
    ),
];

impl Shared {
    /// Applies the migrations this database lacks.
    pub(super) async fn migrate(&self) -> Result<(), ServiceError> {
        let mut c = self.client().await?;
        timed(async {
            let tx = c.transaction().await.map_err(db_error)?;
            // One replica at a time (released at commit); the key is arbitrary but fixed.
            tx.execute("SELECT pg_advisory_xact_lock(7150432117)", &[]).await.map_err(db_error)?;
            tx.batch_execute("CREATE TABLE IF NOT EXISTS lift_schema (version integer PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())")
                .await
                .map_err(db_error)?;
            let row = tx.query_one("SELECT coalesce(max(version), 0) FROM lift_schema", &[]).await.map_err(db_error)?;
            let have: i32 = row.get(0);
            for (version, sql) in MIGRATIONS.iter().filter(|(v, _)| *v > have) {
                tx.batch_execute(sql).await.map_err(db_error)?;
                tx.execute("INSERT INTO lift_schema (version) VALUES ($1)", &[version]).await.map_err(db_error)?;
                tracing::info!(version, "database migration applied");
            }
            tx.commit().await.map_err(db_error)
        })
        .await?;
        self.migrated.store(true, Ordering::SeqCst);
        Ok(())
    }
}
