//! The server's commands: `serve` (the HTTP server), `import` (an adapter directory made by
//! `absorb --out` into a server's store) and the hidden `extract-worker` the server runs.

use super::ModelArgs;
use anyhow::Result;
use lift_serve::runtime::RuntimeConfig;
use std::path::PathBuf;

/// `serve`: the HTTP server on the device named, with the command line's runtime flags.
pub(crate) fn serve(mut config: lift_serve::server::ServeConfig, device: &str, runtime: RuntimeConfig) -> Result<()> {
    let device = lift_serve::runtime::device(device)?;
    config.runtime = runtime;
    lift_serve::server::serve(config, &device)
}

/// `import`: adds the adapter directory to the store as a ready document; prints its id.
pub(crate) fn import(
    dir: PathBuf,
    adapters_dir: PathBuf,
    api_key: Option<String>,
    title: Option<String>,
    model: ModelArgs,
    device: &str,
    runtime: &RuntimeConfig,
) -> Result<()> {
    let model = model.load(&lift_serve::runtime::device(device)?, runtime)?;
    let store = lift_serve::store::Store::open(&adapters_dir, 0)?;
    let owner = api_key.as_deref().map(lift_serve::server::tenant_of);
    let rec = store.import(&dir, &model, owner, title)?;
    eprintln!("{} is document {} in {} ({} tokens)", dir.display(), rec.id, adapters_dir.display(), rec.tokens);
    println!("{}", rec.id);
    Ok(())
}

/// `extract-worker`: one upload's text from stdin to stdout as JSON, under the budgets given.
pub(crate) fn extract_worker(filename: Option<String>, media_type: Option<String>, limits: Option<String>) -> Result<()> {
    let limits = match limits {
        Some(l) => serde_json::from_str(&l)?,
        None => lift_serve::formats::Limits::default(),
    };
    lift_serve::extraction::run_worker(filename.as_deref(), media_type.as_deref(), &limits)
}
