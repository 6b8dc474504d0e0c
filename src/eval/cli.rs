//! The `eval` command: its options, the documents built (planted needles in essays or a
//! `--haystack` text) or loaded (JSONL), the run, and the report; merging and pooling runs.

use super::{client, load_jsonl, needles, qa_report, report, run, Local, Results, RunConfig};
use crate::corpus as data;
use crate::lift::answer::Mode;
use crate::lift::AbsorbOptions;
use crate::model::Model;
use anyhow::{bail, Context, Result};
use std::path::PathBuf;

/// `lift-serve eval` options (absorb options come from the shared training flags).
#[derive(clap::Args, Debug)]
pub struct EvalArgs {
    /// Output directory: results.json, results.md, heatmap.png, loss.png.
    #[arg(long, default_value = "eval-results")]
    pub out: PathBuf,
    /// Methods to compare: icl (baseline, no adapter), lift (adapter + truncated document),
    /// memory (adapter only), lift-paper (the paper's recipe).
    #[arg(long, value_delimiter = ',', default_value = "icl,lift,memory")]
    pub methods: Vec<String>,
    /// Document lengths in tokens.
    #[arg(long, value_delimiter = ',', default_value = "1024,2048")]
    pub lengths: Vec<usize>,
    /// Relative depths of the planted facts (0 = start, 1 = end).
    #[arg(long, value_delimiter = ',', default_value = "0,0.5,1")]
    pub depths: Vec<f64>,
    #[arg(long, default_value_t = 2)]
    pub needles_per_depth: usize,
    #[arg(long, default_value_t = 1)]
    pub docs_per_length: usize,
    /// The user's evaluation set (JSONL) instead of planted facts.
    #[arg(long)]
    pub jsonl: Option<PathBuf>,
    /// Directory of essays (default: $LIFT_DATA_DIR/pg-essays, fetched when missing).
    #[arg(long)]
    pub essays: Option<PathBuf>,
    /// Which essays the documents are cut from: `eval` (reported figures) or `validation` (for
    /// tuning options; never the figures reported). The prepared base trained on neither. With
    /// `--jsonl`, the lines of that split (`train` too) when given; without it, every line.
    #[arg(long, value_enum)]
    pub split: Option<EssaySplit>,
    /// A plain-text file to cut the documents from in place of the essays (no split: a text the
    /// prepared base never trained on, e.g. for lengths past the 43K tokens the eval split holds).
    #[arg(long, conflicts_with_all = ["essays", "jsonl"])]
    pub haystack: Option<PathBuf>,
    /// In-context document budget when answering, as `ask --context-tokens` (default: the
    /// training head+tail budget, `--training-context-tokens`). `--ask-context-tokens` is its
    /// older name.
    #[arg(long, alias = "ask-context-tokens")]
    pub context_tokens: Option<usize>,
    /// Most tokens per answer.
    #[arg(long, default_value_t = 32)]
    pub max_tokens: usize,
    /// Evaluate a running lift-serve server through its HTTP API instead of in-process.
    #[arg(long)]
    pub server: Option<String>,
    /// With `--server`: after the documents, ask every question again of one collection of all
    /// the run's documents, in `lift` and `rag` (those of `--methods`): the collection's answers
    /// against the document's, paired, and routing's accuracy (docs/collections.md).
    #[arg(long, requires = "server")]
    pub collection: bool,
    #[arg(long, env = "LIFT_API_KEY")]
    pub api_key: Option<String>,
    /// Only redraw the report (markdown, plots) from OUT/results.json.
    #[arg(long)]
    pub report_only: bool,
    /// Merge the results.json of runs of the same documents with different methods (run apart,
    /// e.g. side by side) into one report in OUT: one table, and each method paired by question
    /// against the first.
    #[arg(long, value_delimiter = ',')]
    pub merge: Vec<PathBuf>,
    /// Pool the results.json of runs over different documents (e.g. a later run with another
    /// `--seed`) into one report in OUT, paired over all their questions (the methods every run
    /// answered).
    #[arg(long, value_delimiter = ',', conflicts_with = "merge")]
    pub pool: Vec<PathBuf>,
    /// How the prepared base's FltLM filter turns scores into its soft mask for this run
    /// (absorbs and answers): `absolute`, `relative[:MARGIN]` or `off` (default: the base's own).
    /// In-process runs only.
    #[arg(long)]
    pub filter_mask: Option<String>,
    /// The calibration absorbs train their adapters under, when it is to differ from the one
    /// answers use (`--filter-mask`, or the base's own). In-process runs only.
    #[arg(long)]
    pub absorb_filter_mask: Option<String>,
    /// Only print the auxiliary QA an absorb would train on for each document (its figures, and
    /// this many pairs of each): no absorb, no answers.
    #[arg(long)]
    pub qa_report: Option<usize>,
    /// No progress bar.
    #[arg(long)]
    pub quiet: bool,
}

/// Sets the prepared base's mask calibration for the run (`--filter-mask`).
pub fn apply_filter_mask(model: &mut Model, args: &EvalArgs) -> Result<()> {
    use crate::model::filter::MaskCalibration;
    if args.filter_mask.is_none() && args.absorb_filter_mask.is_none() {
        return Ok(());
    }
    anyhow::ensure!(args.server.is_none(), "--filter-mask and --absorb-filter-mask set this process's model: not with --server");
    let filter = model.base_filter.as_mut().context("--filter-mask, --absorb-filter-mask: the model has no prepared base with a filter")?;
    if let Some(name) = &args.filter_mask {
        filter.calibration = MaskCalibration::parse(name)?;
    }
    if let Some(name) = &args.absorb_filter_mask {
        filter.absorb_mask = Some(MaskCalibration::parse(name)?);
    }
    Ok(())
}

/// The split `eval` takes its documents from (essays, or a JSONL set's `split` field).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum EssaySplit {
    Eval,
    Validation,
    /// JSONL sets only: the essays' train split is the prepared base's.
    Train,
}

impl EssaySplit {
    pub fn name(self) -> &'static str {
        match self {
            EssaySplit::Eval => "eval",
            EssaySplit::Validation => "validation",
            EssaySplit::Train => "train",
        }
    }
}

/// The `eval` command: build or load the documents, run, write the report.
pub fn run_cli(model: &Model, absorb: AbsorbOptions, seed: u64, args: &EvalArgs) -> Result<()> {
    if !args.merge.is_empty() || !args.pool.is_empty() {
        let runs = args
            .merge
            .iter()
            .chain(&args.pool)
            .map(|p| {
                let r: Results = serde_json::from_slice(&std::fs::read(p).with_context(|| format!("{}: cannot read", p.display()))?)?;
                // A run's label: the name of the directory its results.json is in.
                let dir = p.parent().and_then(|d| d.file_name()).map_or_else(|| p.display().to_string(), |d| d.to_string_lossy().into_owned());
                Ok((dir, r))
            })
            .collect::<Result<Vec<(String, Results)>>>()?;
        let combined = if args.pool.is_empty() { Results::merge(runs)? } else { Results::pool(runs)? };
        report::write(&combined, &args.out)?;
        print!("{}", report::markdown(&combined));
        return Ok(());
    }
    if args.report_only {
        let results: Results = serde_json::from_slice(&std::fs::read(args.out.join(report::RESULTS_FILE))?)?;
        return report::write(&results, &args.out);
    }
    let (docs, spec) = match &args.jsonl {
        Some(path) => (load_jsonl(model, path, args.split.map(EssaySplit::name))?, None),
        None => {
            let essays = haystack_essays(args)?;
            let spec = needles::NeedleSpec {
                lengths: args.lengths.clone(),
                depths: args.depths.clone(),
                needles_per_depth: args.needles_per_depth,
                docs_per_length: args.docs_per_length,
                seed,
            };
            (needles::build_set(model, &essays, &spec)?, Some(spec))
        }
    };
    if let Some(sample) = args.qa_report {
        print!("{}", qa_report::report(&docs, &absorb.qa, sample));
        return Ok(());
    }
    let cfg = RunConfig {
        methods: args.methods.clone(),
        context_tokens: Some(args.context_tokens.unwrap_or(absorb.plan.training_context_tokens)),
        max_tokens: args.max_tokens,
        absorb,
        needles: spec,
        jsonl: args.jsonl.clone(),
        server: args.server.clone(),
        filter_mask: model.base_filter().map(|f| f.mask_name()),
    };
    let collection_modes: Vec<Mode> =
        [Mode::Lift, Mode::Rag].into_iter().filter(|m| args.methods.iter().any(|x| x == m.name())).collect();
    anyhow::ensure!(!args.collection || !collection_modes.is_empty(), "--collection asks in lift and rag: --methods holds neither");
    let results = match &args.server {
        Some(url) => {
            let mut backend = client::Server::new(url, args.api_key.clone(), cfg.max_tokens)?;
            let mut results =
                run(model, &mut backend, docs, &cfg, !args.quiet, &mut |partial| report::write(partial, &args.out))?;
            if args.collection {
                let asked = backend.ask_collection(&results.documents, &collection_modes)?;
                results.config.methods.extend(collection_modes.iter().map(|m| format!("{}{}", client::COLLECTION_PREFIX, m.name())));
                results.answers.extend(asked);
            }
            results
        }
        None => {
            let mut backend = Local::new(model, cfg.max_tokens);
            run(model, &mut backend, docs, &cfg, !args.quiet, &mut |partial| report::write(partial, &args.out))?
        }
    };
    report::write(&results, &args.out)?;
    print!("{}", report::markdown(&results));
    Ok(())
}

/// The texts the needle documents are cut from: the `--haystack` file, else the essays of the
/// prepared base's Eval (or Validation) split, which the base never trained on.
fn haystack_essays(args: &EvalArgs) -> Result<Vec<crate::corpus::Essay>> {
    if let Some(path) = &args.haystack {
        let raw = std::fs::read_to_string(path).with_context(|| format!("{}: cannot read", path.display()))?;
        let name = path.file_stem().map_or("haystack".into(), |n| n.to_string_lossy().to_string());
        return Ok(vec![crate::corpus::Essay { name, text: haystack_text(&raw) }]);
    }
    let dir = match &args.essays {
        Some(d) => d.clone(),
        None => data::fetch_essays(&data::data_dir())?,
    };
    let split = match args.split.unwrap_or(EssaySplit::Eval) {
        EssaySplit::Eval => crate::corpus::Split::Eval,
        EssaySplit::Validation => crate::corpus::Split::Validation,
        EssaySplit::Train => bail!("--split train: the train essays are the prepared base's training text, not an evaluation"),
    };
    Ok(crate::corpus::essays_in(&data::load_essays(&dir)?, split))
}

/// A `--haystack` text as needles can be planted in: its paragraphs that hold no digit. A planted
/// number must be the only one in the document (`needles` redraws values the text contains), and
/// a reference text (a glossary, a manual) holds every number from 11 to 99 somewhere.
fn haystack_text(raw: &str) -> String {
    let mut kept = String::new();
    let mut paragraph = String::new();
    // Paragraphs end at a blank line (one of whitespace only).
    for line in raw.lines().chain(std::iter::once("")) {
        if !line.trim().is_empty() {
            paragraph.push_str(line);
            paragraph.push('\n');
            continue;
        }
        if !paragraph.is_empty() && !paragraph.bytes().any(|b| b.is_ascii_digit()) {
            kept.push_str(&paragraph);
            kept.push('\n');
        }
        paragraph.clear();
    }
    crate::corpus::normalize_essay(&kept)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_haystack_keeps_the_paragraphs_without_digits() {
        let raw = "The first paragraph\nwraps here.\n   \nVersion 4.4.7 of it.\n\nThe last one stays.";
        let text = haystack_text(raw);
        assert!(text.contains("The first paragraph wraps here."), "{text}");
        assert!(text.contains("The last one stays."), "{text}");
        assert!(!text.contains("Version"), "{text}");
    }
}
