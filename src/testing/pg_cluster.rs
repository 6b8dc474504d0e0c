//! Throwaway PostgreSQL clusters (`scripts/pg_cluster.sh`) for the replica tests and benches.

use anyhow::Result;
use std::path::Path;

/// A throwaway PostgreSQL cluster for tests and benches (`scripts/pg_cluster.sh`: the
/// distribution's PostgreSQL, a temporary directory, a free port on 127.0.0.1), destroyed when
/// dropped.
pub struct PgCluster {
    dir: tempfile::TempDir,
    /// `postgres://postgres@127.0.0.1:<port>/lift`
    pub url: String,
}

impl PgCluster {
    pub fn start() -> Result<Self> {
        let dir = tempfile::Builder::new().prefix("lift-pg-").tempdir()?;
        let url = pg_cluster("start", dir.path())?;
        Ok(Self { dir, url })
    }

    /// Stops the server (`fast`: clients are disconnected); [`PgCluster::restart`] brings it back
    /// on the same port with the same data.
    pub fn stop(&self) -> Result<()> {
        pg_cluster("stop", self.dir.path()).map(drop)
    }

    pub fn restart(&self) -> Result<()> {
        let url = pg_cluster("start", self.dir.path())?;
        anyhow::ensure!(url == self.url, "the cluster came back at {url}, not {}", self.url);
        Ok(())
    }
}

impl Drop for PgCluster {
    fn drop(&mut self) {
        if let Err(e) = pg_cluster("destroy", self.dir.path()) {
            eprintln!("cannot destroy the test cluster: {e:#}");
        }
    }
}

fn pg_cluster(command: &str, dir: &Path) -> Result<String> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/pg_cluster.sh");
    let out = std::process::Command::new(&script).arg(command).arg(dir).output()?;
    anyhow::ensure!(
        out.status.success(),
        "{} {command}: {}\n{}",
        script.display(),
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}
