//! The subcommands' implementations, one module a concern; `main.rs` holds the command line's
//! shape (`Cli`, `Command`) and dispatches here. Shared: the model a command runs on
//! (`ModelArgs`), the progress bar, streaming text to stdout.

pub(crate) mod absorb;
pub(crate) mod ask;
pub(crate) mod fetch;
pub(crate) mod generate;
#[cfg(feature = "research")]
pub(crate) mod research;
pub(crate) mod serve;

use anyhow::Result;
use candle_core::Device;
use indicatif::{ProgressBar, ProgressStyle};
use lift_serve::model::Model;
use lift_serve::runtime::RuntimeConfig;
use std::io::Write;
use std::path::PathBuf;

/// `--model PATH` and `--prepared-base PATH|none`: the model a command runs on.
#[derive(clap::Args)]
pub(crate) struct ModelArgs {
    /// Model file (.gguf) or Hugging Face directory; default: the fetched default model.
    #[arg(long, env = "LIFT_MODEL")]
    model: Option<PathBuf>,
    /// Prepared base (directory written by `prepare-base`) under every document adapter, or
    /// `none`; default: `base/` if it holds one (the working directory's, else the checkout's
    /// beside the binary).
    #[arg(long, env = "LIFT_PREPARED_BASE")]
    prepared_base: Option<String>,
}

impl ModelArgs {
    /// Loads the model with its prepared base installed.
    fn load(&self, device: &Device, runtime: &RuntimeConfig) -> Result<Model> {
        let mut m = Model::load_with(&lift_serve::fetch::resolve_model(self.model.as_deref())?, device, runtime)?;
        lift_serve::base::install_from_arg(&mut m, self.prepared_base.as_deref())?;
        Ok(m)
    }
}

fn progress_bar() -> ProgressBar {
    let bar = ProgressBar::new(0);
    bar.set_style(
        ProgressStyle::with_template("{spinner} {msg:<28} [{bar:30}] {pos}/{len} {elapsed_precise} eta {eta}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    bar
}

/// Streams generated text to stdout as it arrives; always continues.
fn print_piece(piece: &str) -> bool {
    let mut stdout = std::io::stdout();
    let _ = stdout.write_all(piece.as_bytes());
    let _ = stdout.flush();
    true
}
