//! Adapter blobs for replicas that share one store (`--adapter-store URL`): every ready adapter
//! directory is packed into one archive, written once under the SHA-256 of its bytes, and checked
//! against that hash whenever a replica fetches it into its local cache.
//!
//! The store is reached through the `object_store` crate, so one URL picks the backend:
//! `file:///shared/adapters` (a local or network filesystem), `s3://bucket/prefix`,
//! `gs://bucket/prefix`, `az://container/prefix`. Credentials come from the usual environment
//! variables of each cloud (`AWS_ACCESS_KEY_ID`, `GOOGLE_SERVICE_ACCOUNT`, `AZURE_STORAGE_…`).

use anyhow::{bail, Context, Result};
use bytes::Bytes;
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStore, PutMode, PutOptions, PutPayload};
use sha2::{Digest, Sha256};
use std::io::{Read, Write};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// The folder of absorb checkpoints under the store's prefix.
const CHECKPOINTS: &str = "checkpoints";

/// Where one adapter's archive lies and the hash its bytes must have.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlobRef {
    /// Hex SHA-256 of the archive; also its name in the store.
    pub sha256: String,
}

impl BlobRef {
    fn object_name(&self) -> String {
        format!("{}.zip", self.sha256)
    }
}

#[derive(Default)]
pub struct BlobStats {
    /// Archives written (a put of an archive already there does not count).
    pub puts: AtomicU64,
    /// Archives fetched into the local cache (and verified).
    pub fetches: AtomicU64,
}

pub struct Blobs {
    store: Arc<dyn ObjectStore>,
    prefix: ObjectPath,
    url: String,
    /// The runtime that drives the store's futures when called from the engine's threads.
    runtime: tokio::runtime::Handle,
    pub stats: BlobStats,
}

impl Blobs {
    /// Opens the store named by `url` (needs a tokio runtime: called from within one, or from a
    /// blocking task of one). A `file://` directory is created when missing.
    pub fn open(url: &str) -> Result<Self> {
        let runtime = tokio::runtime::Handle::try_current().context("the adapter store needs a tokio runtime")?;
        let parsed = url::Url::parse(url).with_context(|| format!("--adapter-store {url}: not a URL"))?;
        if parsed.scheme() == "file" {
            let dir = parsed.to_file_path().map_err(|()| anyhow::anyhow!("--adapter-store {url}: not a local path"))?;
            std::fs::create_dir_all(&dir).with_context(|| format!("{}: cannot create the adapter store", dir.display()))?;
        }
        // The builders read their settings (keys, region, endpoint) from options named like the
        // environment variables, lower-cased.
        let env = std::env::vars().map(|(k, v)| (k.to_ascii_lowercase(), v));
        let (store, prefix) =
            object_store::parse_url_opts(&parsed, env).with_context(|| format!("--adapter-store {url}: cannot open"))?;
        Ok(Self { store: Arc::from(store), prefix, url: url.to_string(), runtime, stats: BlobStats::default() })
    }

    pub fn url(&self) -> &str {
        &self.url
    }

    fn path(&self, blob: &BlobRef) -> ObjectPath {
        self.prefix.child(blob.object_name())
    }

    /// Writes `archive` under its hash unless it is already there (content-addressed: the same
    /// bytes twice are one object). Create-only where the backend supports it, so that two
    /// replicas racing on one archive never overwrite each other.
    pub async fn put(&self, archive: Bytes) -> Result<BlobRef> {
        let blob = BlobRef { sha256: hex::encode(Sha256::digest(&archive)) };
        let path = self.path(&blob);
        if self.store.head(&path).await.is_ok() {
            return Ok(blob);
        }
        let opts = PutOptions { mode: PutMode::Create, ..Default::default() };
        match self.store.put_opts(&path, PutPayload::from_bytes(archive.clone()), opts).await {
            Ok(_) => {}
            Err(object_store::Error::AlreadyExists { .. }) => return Ok(blob),
            Err(object_store::Error::NotImplemented) => {
                self.store.put(&path, PutPayload::from_bytes(archive)).await.with_context(|| format!("{path}: cannot write"))?;
            }
            Err(e) => return Err(e).with_context(|| format!("{path}: cannot write")),
        }
        self.stats.puts.fetch_add(1, Ordering::Relaxed);
        Ok(blob)
    }

    /// Reads an archive and checks its bytes against the hash it is named by.
    pub async fn get(&self, blob: &BlobRef) -> Result<Bytes> {
        let path = self.path(blob);
        let bytes = self.store.get(&path).await.with_context(|| format!("{path}: cannot read"))?.bytes().await?;
        let sha = hex::encode(Sha256::digest(&bytes));
        if sha != blob.sha256 {
            bail!(crate::adapters::manifest::AdapterDamaged(format!("{path}: the archive is corrupt (its SHA-256 is {sha})")));
        }
        self.stats.fetches.fetch_add(1, Ordering::Relaxed);
        Ok(bytes)
    }

    pub async fn delete(&self, blob: &BlobRef) -> Result<()> {
        match self.store.delete(&self.path(blob)).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// Archives in the store (tests and operations); checkpoints are not archives.
    pub async fn list(&self) -> Result<Vec<String>> {
        use futures_util::TryStreamExt;
        let metas: Vec<_> = self.store.list(Some(&self.prefix)).try_collect().await?;
        let checkpoints = self.prefix.child(CHECKPOINTS);
        Ok(metas
            .into_iter()
            .filter(|m| !m.location.prefix_matches(&checkpoints))
            .filter_map(|m| m.location.filename().map(str::to_string))
            .collect())
    }

    /// Where the absorb of `id` keeps its checkpoint: one object, replaced by each new one (a
    /// put is atomic in every backend). Any replica that takes the job over reads it.
    fn checkpoint_path(&self, id: &str) -> ObjectPath {
        self.prefix.child(CHECKPOINTS).child(format!("{id}.safetensors"))
    }

    pub async fn put_checkpoint(&self, id: &str, bytes: Bytes) -> Result<()> {
        let path = self.checkpoint_path(id);
        self.store.put(&path, PutPayload::from_bytes(bytes)).await.with_context(|| format!("{path}: cannot write"))?;
        Ok(())
    }

    /// The checkpoint of `id`, if there is one.
    pub async fn get_checkpoint(&self, id: &str) -> Result<Option<Bytes>> {
        let path = self.checkpoint_path(id);
        match self.store.get(&path).await {
            Ok(r) => Ok(Some(r.bytes().await.with_context(|| format!("{path}: cannot read"))?)),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(e).with_context(|| format!("{path}: cannot read")),
        }
    }

    pub async fn delete_checkpoint(&self, id: &str) -> Result<()> {
        match self.store.delete(&self.checkpoint_path(id)).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// Runs one of the store's futures from a thread outside the runtime (the engine's threads,
    /// blocking tasks).
    pub fn block_on<T>(&self, f: impl std::future::Future<Output = T>) -> T {
        self.runtime.block_on(f)
    }
}

/// Packs the files of an adapter directory into one archive, byte-for-byte reproducible (names
/// in order, no timestamps, stored uncompressed: the adapter's floats do not compress).
pub fn pack(dir: &Path) -> Result<Vec<u8>> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .with_context(|| format!("{}: cannot list", dir.display()))?
        .filter_map(|e| e.ok())
        .filter(|e| e.path().is_file())
        .map(|e| e.file_name().to_string_lossy().to_string())
        .collect();
    names.sort();
    let mut zip = zip::ZipWriter::new(std::io::Cursor::new(Vec::new()));
    let opts = zip::write::SimpleFileOptions::default()
        .compression_method(zip::CompressionMethod::Stored)
        .last_modified_time(zip::DateTime::default())
        .large_file(true);
    for name in names {
        let bytes = std::fs::read(dir.join(&name)).with_context(|| format!("{}: cannot read {name}", dir.display()))?;
        zip.start_file(name.as_str(), opts)?;
        zip.write_all(&bytes)?;
    }
    Ok(zip.finish()?.into_inner())
}

/// Unpacks an archive into `dir`, atomically: a staging directory beside it, then a rename (a
/// directory already there is replaced). Only plain names are accepted.
pub fn unpack(archive: &[u8], dir: &Path) -> Result<()> {
    let parent = dir.parent().context("an adapter directory needs a parent")?;
    let name = dir.file_name().context("an adapter directory needs a name")?.to_string_lossy().to_string();
    let staging = parent.join(format!(".{name}.tmp-fetch-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&staging);
    std::fs::create_dir_all(&staging).with_context(|| format!("{}: cannot create", staging.display()))?;
    let result = (|| -> Result<()> {
        let mut zip = zip::ZipArchive::new(std::io::Cursor::new(archive)).context("not an adapter archive")?;
        for i in 0..zip.len() {
            let mut file = zip.by_index(i)?;
            let file_name = file.name()?.to_string();
            if file_name.is_empty() || file_name.contains(['/', '\\']) || file_name.starts_with('.') {
                bail!("adapter archive: unexpected entry '{file_name}'");
            }
            let mut bytes = Vec::with_capacity(file.size() as usize);
            file.read_to_end(&mut bytes)?;
            std::fs::write(staging.join(&file_name), &bytes)?;
        }
        if dir.exists() {
            std::fs::remove_dir_all(dir).with_context(|| format!("{}: cannot replace", dir.display()))?;
        }
        std::fs::rename(&staging, dir).with_context(|| format!("{}: cannot publish", dir.display()))?;
        Ok(())
    })();
    if result.is_err() {
        let _ = std::fs::remove_dir_all(&staging);
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn archives_are_reproducible_and_round_trip() {
        let tmp = tempfile::tempdir().unwrap();
        let a = tmp.path().join("a");
        std::fs::create_dir(&a).unwrap();
        std::fs::write(a.join("manifest.json"), b"{}").unwrap();
        std::fs::write(a.join("adapter.safetensors"), vec![7u8; 1000]).unwrap();
        let first = pack(&a).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(20));
        std::fs::write(a.join("manifest.json"), b"{}").unwrap(); // new mtime, same bytes
        assert_eq!(first, pack(&a).unwrap(), "the same files pack to the same bytes");
        let b = tmp.path().join("b");
        unpack(&first, &b).unwrap();
        assert_eq!(std::fs::read(b.join("adapter.safetensors")).unwrap(), vec![7u8; 1000]);
        assert_eq!(pack(&b).unwrap(), first);
    }

    #[tokio::test]
    async fn a_file_store_writes_once_and_refuses_a_corrupt_archive() {
        let tmp = tempfile::tempdir().unwrap();
        let url = url::Url::from_directory_path(tmp.path().join("blobs")).unwrap().to_string();
        let blobs = Blobs::open(&url).unwrap();
        let blob = blobs.put(Bytes::from_static(b"archive")).await.unwrap();
        assert_eq!(blobs.put(Bytes::from_static(b"archive")).await.unwrap(), blob);
        assert_eq!(blobs.stats.puts.load(Ordering::Relaxed), 1, "the second put of the same bytes writes nothing");
        assert_eq!(blobs.get(&blob).await.unwrap(), Bytes::from_static(b"archive"));
        std::fs::write(tmp.path().join("blobs").join(format!("{}.zip", blob.sha256)), b"tampered").unwrap();
        let err = blobs.get(&blob).await.unwrap_err();
        assert!(format!("{err:#}").contains("corrupt"), "{err:#}");
        blobs.delete(&blob).await.unwrap();
        assert!(blobs.list().await.unwrap().is_empty());
    }
}
