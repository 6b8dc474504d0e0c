//! `absorb`: a document file into an adapter directory, with a progress bar and a resumable
//! checkpoint; the absorb options on the command line (`TrainArgs`, shared with `eval`).

use super::{progress_bar, ModelArgs};
use anyhow::{Context, Result};
use candle_core::Device;
use indicatif::ProgressBar;
use lift_serve::document::Document;
use lift_serve::lift::{self, AbsorbEvent, AbsorbOptions};
use lift_serve::runtime::RuntimeConfig;
use lift_serve::store;
use std::path::PathBuf;

#[derive(clap::Args)]
pub(crate) struct AbsorbArgs {
    /// The document: a text, Markdown, HTML or PDF file (told by its name, else its contents).
    file: PathBuf,
    /// Output adapter directory (created; an existing adapter there is replaced atomically).
    /// While it trains, a checkpoint beside it (`<output>.checkpoint.safetensors`) lets a run of
    /// the same command that was stopped continue where it was.
    #[arg(short, long)]
    output: PathBuf,
    /// Seconds between checkpoints (0: none).
    #[arg(long, default_value_t = lift::absorb::checkpoint::DEFAULT_INTERVAL.as_secs_f64())]
    checkpoint_secs: f64,
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    train: TrainArgs,
    /// The training budget's older name, refused with its new one: `--context-tokens` is the
    /// answering budget everywhere else.
    #[arg(long = "context-tokens", hide = true)]
    old_context_tokens: Option<usize>,
}

/// Absorption options on the command line: an options file, the flat options laid over it (their
/// flags come from the one declaration, `lift::OptionOverlay`), and the title.
#[derive(clap::Args)]
pub(crate) struct TrainArgs {
    /// JSON file with AbsorbOptions (flags below override it).
    #[arg(long)]
    options: Option<PathBuf>,
    #[command(flatten)]
    pub(super) overlay: lift::OptionOverlay,
    /// The removed options' flags, refused with why and what to use instead.
    #[command(flatten)]
    _removed: lift::options::RemovedFlags,
    #[arg(long)]
    title: Option<String>,
}

impl TrainArgs {
    /// The options file (or the defaults) with these flags laid over it by the one overlay every
    /// path uses ([`lift::OptionOverlay`]), checked against the same bounds as the server's.
    pub(super) fn options(&self, num_layers: usize) -> Result<AbsorbOptions> {
        let base = match &self.options {
            Some(p) => AbsorbOptions::from_file(p)?,
            None => AbsorbOptions::default(),
        };
        let o = self.overlay.apply(&base);
        // The window is the model's (checked by the caller).
        o.validate(num_layers, usize::MAX)?;
        Ok(o)
    }
}

impl AbsorbArgs {
    /// `absorb`: trains the adapter with a progress bar and writes the adapter directory.
    pub(crate) fn run(&self, device: &Device, runtime: &RuntimeConfig) -> Result<()> {
        anyhow::ensure!(
            self.old_context_tokens.is_none(),
            "absorb: --context-tokens is now --training-context-tokens (the head+tail tokens before each training \
             segment and question); --context-tokens is the answering budget of `ask` and `serve`"
        );
        let file = &self.file;
        let extracted = lift_serve::formats::read_file(file)?;
        let model = self.model.load(device, runtime)?;
        let opts = self.train.options(model.config().num_layers)?;
        let window = model.config().max_position_embeddings;
        anyhow::ensure!(
            opts.plan.window <= window,
            "--window {} exceeds the model's window of {window}",
            opts.plan.window
        );
        let source = extracted.source;
        tracing::info!(format = ?source.format, characters = source.characters, pages = ?source.pages, "document read");
        let document = Document::encode(&model, extracted.text)?;
        let title = self.train.title.clone().or(extracted.title).or_else(|| source.filename.clone());
        // A budget is fitted at this machine's rate, timed on a few steps (else the prior).
        let opts = match opts.budget_seconds {
            None => opts,
            Some(budget) => {
                let rate = lift::pricing::AbsorbRate::default();
                rate.set_calibrated(lift::pricing::calibrated_rate(&model, &opts));
                let cost = lift::pricing::estimate(&model, &document, &opts, &rate);
                match cost.warnings.iter().find(|w| w.param == "options.budget_seconds") {
                    Some(w) => eprintln!("{}", w.message),
                    None => eprintln!("the options fit the budget of {budget:.0} s (estimated {:.0} s)", cost.estimate.seconds),
                }
                cost.options
            }
        };
        let bar = progress_bar();
        let mut name = self.output.file_name().context("--output names no directory")?.to_os_string();
        name.push(".checkpoint.safetensors");
        let checkpoint = self.output.with_file_name(name);
        let resumable = (self.checkpoint_secs > 0.0).then(|| lift::absorb::checkpoint::Resumable {
            store: Box::new(lift::absorb::checkpoint::FileCheckpoint(checkpoint.clone())),
            interval: std::time::Duration::from_secs_f64(self.checkpoint_secs),
        });
        if let Some(parent) = checkpoint.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent).with_context(|| format!("{}: cannot create", parent.display()))?;
        }
        let on_event = &mut |e: AbsorbEvent| show_absorb(&bar, e);
        let mut absorbed = lift::absorb_resumable(&model, &document, title.as_deref(), &opts, on_event, &|| false, resumable)?;
        absorbed.manifest.document.source = Some(source);
        bar.finish_and_clear();
        let (qa_pairs, r) = (absorbed.qa.len(), absorbed.report.clone());
        let saved = store::save_dir(&self.output, absorbed.into_new_adapter(std::sync::Arc::new(document))?)?;
        if let Err(e) = std::fs::remove_file(&checkpoint) {
            anyhow::ensure!(e.kind() == std::io::ErrorKind::NotFound, "{}: cannot remove the checkpoint: {e}", checkpoint.display());
        }
        println!(
            "absorbed {} tokens into {} ({} parameters, {} bytes): {} QA pairs, {} steps in {:.1} s ({:.0} tok/s), final loss {:.3}",
            saved.document.len(),
            self.output.display(),
            saved.manifest.parameters,
            saved.manifest.bytes,
            qa_pairs,
            r.steps,
            r.seconds,
            r.tokens_per_s,
            r.final_loss
        );
        Ok(())
    }
}

/// An absorption's progress on the bar (or, without a terminal, in the log every 5%).
fn show_absorb(bar: &ProgressBar, event: AbsorbEvent) {
    match event {
        AbsorbEvent::Stage(stage) => {
            bar.set_position(0);
            bar.set_message(format!("{stage:?}"));
        }
        AbsorbEvent::Qa(p) => {
            bar.set_length(p.total as u64);
            bar.set_position(p.done as u64);
            bar.set_message(format!("QA ({} valid)", p.valid));
        }
        AbsorbEvent::Snapshot(_) => {}
        AbsorbEvent::Train(p) => {
            bar.set_length(p.steps as u64);
            bar.set_position(p.step as u64);
            let resumed = p.resumed_from.map(|s| format!(" (resumed from step {s})")).unwrap_or_default();
            bar.set_message(format!("epoch {}/{} loss {:.3} {:.0} tok/s{resumed}", p.epoch, p.epochs, p.loss, p.tokens_per_s));
            if bar.is_hidden() && (p.step * 20 / p.steps.max(1)) != ((p.step.saturating_sub(1)) * 20 / p.steps.max(1)) {
                tracing::info!(step = p.step, steps = p.steps, epoch = p.epoch, loss = p.loss, "training");
            }
        }
    }
}
