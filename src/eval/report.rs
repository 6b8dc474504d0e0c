//! The evaluation report: `results.json` (everything), `results.md` (tables), `heatmap.png`
//! (accuracy by depth × length per method, like LIFT's Figure 5) and `loss.png` (training loss
//! per step of every absorption). Plots use a font bundled in the binary (DejaVu Sans through
//! plotters' `ab_glyph` backend): no system font libraries are needed.

use super::{AnswerRecord, Results};
use anyhow::{Context, Result};
use plotters::coord::ranged1d::SegmentValue;
use plotters::prelude::*;
use plotters::style::FontStyle;
use std::collections::BTreeMap;
use std::fmt::Write;
use std::path::Path;
use std::sync::Once;

pub const RESULTS_FILE: &str = "results.json";
pub const TABLE_FILE: &str = "results.md";
pub const HEATMAP_FILE: &str = "heatmap.png";
pub const LOSS_FILE: &str = "loss.png";
const FONT: &str = "sans-serif";

/// Writes all four files into `dir`.
pub fn write(results: &Results, dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("{}: cannot create", dir.display()))?;
    std::fs::write(dir.join(RESULTS_FILE), serde_json::to_vec_pretty(results)?)?;
    std::fs::write(dir.join(TABLE_FILE), markdown(results))?;
    if !heatmap_cells(results).is_empty() {
        heatmap(results, &dir.join(HEATMAP_FILE))?;
    }
    if results.absorbs.iter().any(|a| !a.step_losses.is_empty()) {
        loss_plot(results, &dir.join(LOSS_FILE))?;
    }
    Ok(())
}

/// Mean of `f` over `rows`, or None when empty.
fn mean<'a>(rows: impl Iterator<Item = &'a AnswerRecord>, f: impl Fn(&AnswerRecord) -> f64) -> (usize, Option<f64>) {
    let v: Vec<f64> = rows.map(f).collect();
    (v.len(), (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64))
}

fn pct(x: Option<f64>) -> String {
    x.map_or("–".into(), |x| format!("{:.0}%", 100.0 * x))
}

fn methods(results: &Results) -> Vec<String> {
    results.config.methods.clone()
}

/// Per method: accuracy (containment), EM and F1 for in-window and out-of-window questions,
/// absorption cost; then accuracy by length × depth per method.
pub fn markdown(results: &Results) -> String {
    let mut s = String::new();
    let n_q: usize = results.documents.iter().map(|d| d.questions.len()).sum();
    let _ = writeln!(
        s,
        "Model `{}`, {} documents, {} questions, answer context {} document tokens{}; {:.0} s in all.\n",
        results.model,
        results.documents.len(),
        n_q,
        results.config.context_tokens.map_or("(what fits)".into(), |c| c.to_string()),
        results.config.server.as_ref().map_or(String::new(), |u| format!(", through the server at {u}")),
        results.seconds
    );
    let _ = writeln!(
        s,
        "| method | questions in / out of window | acc in | acc out | EM in | EM out | F1 in | F1 out | absorb s | train tok/s | adapter bytes |"
    );
    let _ = writeln!(s, "|---|---|---|---|---|---|---|---|---|---|---|");
    for m in methods(results) {
        method_row(&mut s, results, &m);
    }
    let _ = writeln!(
        s,
        "\nacc: the normalised answer occurs in the normalised reply (whole words); EM: normalised exact match; F1: \
         token F1 (SQuAD normalisation). In/out of window: whether the answer's evidence is in the truncated \
         document the `lift`/`icl` prompt holds. absorb s: wall time of the absorption (QA + training)."
    );
    paired_tables(&mut s, results);
    collection_table(&mut s, results);
    absorb_table(&mut s, results);
    reading_table(&mut s, results);
    super::gating::table(&mut s, results);
    super::mask::table(&mut s, results);
    kind_table(&mut s, results);
    form_table(&mut s, results);
    depth_tables(&mut s, results);
    s
}

/// Each method after the first, paired by question against the first: how many questions both,
/// only one or neither answered (out of and in the window), and the training steps and absorb
/// time it took, per document and in all.
fn paired_tables(s: &mut String, results: &Results) {
    let ms = methods(results);
    let Some((first, others)) = ms.split_first() else { return };
    if others.is_empty() {
        return;
    }
    let answer = |m: &str, doc: &str, q: &str| {
        results.answers.iter().find(|a| a.method == m && a.document == doc && a.question == q).map(|a| a.scores.contains > 0.0)
    };
    let absorb = |m: &str, doc: &str| results.absorbs.iter().find(|a| a.document == doc && a.methods.iter().any(|x| x == m));
    let _ = writeln!(s, "\nPaired by question against `{first}` (both right / only this method / only `{first}` / neither; McNemar's exact two-sided p over all questions):\n");
    let _ = writeln!(s, "| method | out of window | in window | steps (share of `{first}`'s) | absorb s | per document: steps | McNemar p |");
    let _ = writeln!(s, "|---|---|---|---|---|---|---|");
    for m in others {
        let mut cells = [[0usize; 4]; 2];
        for a in results.answers.iter().filter(|a| a.method == *first) {
            let (Some(base), Some(this)) = (answer(first, &a.document, &a.question), answer(m, &a.document, &a.question)) else {
                continue;
            };
            let w = usize::from(a.in_window == Some(true));
            cells[w][match (base, this) {
                (true, true) => 0,
                (false, true) => 1,
                (true, false) => 2,
                (false, false) => 3,
            }] += 1;
        }
        let (mut steps, mut base_steps, mut secs, mut per_doc) = (0, 0, 0.0, Vec::new());
        for d in &results.documents {
            if let (Some(a), Some(b)) = (absorb(m, &d.id), absorb(first, &d.id)) {
                steps += a.steps;
                base_steps += b.steps;
                secs += a.seconds;
                per_doc.push(format!("{} {}/{}", d.id, a.steps, b.steps));
            }
        }
        let share = if base_steps > 0 { format!("{steps} ({:.0}%)", 100.0 * steps as f64 / base_steps as f64) } else { "–".into() };
        let fmt = |c: [usize; 4]| format!("{} / {} / {} / {}", c[0], c[1], c[2], c[3]);
        let p = crate::corpus::scoring::mcnemar_exact(cells[0][1] + cells[1][1], cells[0][2] + cells[1][2]);
        let _ = writeln!(s, "| {m} | {} | {} | {share} | {secs:.0} | {} | {p:.3} |", fmt(cells[0]), fmt(cells[1]), per_doc.join(", "));
    }
}

/// `eval --collection`: each mode asked of the run's collection against the same mode asked of
/// the question's document, paired, and how often routing chose the question's document.
fn collection_table(s: &mut String, results: &Results) {
    let prefix = super::client::COLLECTION_PREFIX;
    let asked: Vec<&String> = results.config.methods.iter().filter(|m| m.starts_with(prefix)).collect();
    if asked.is_empty() {
        return;
    }
    let right = |m: &str, doc: &str, q: &str| {
        results.answers.iter().find(|a| a.method == m && a.document == doc && a.question == q).map(|a| a.scores.contains > 0.0)
    };
    let _ = writeln!(s, "
Asked as one collection of the run's documents, against the same mode asked of the question's document \
        (both right / only the collection / only the document / neither; McNemar's exact two-sided p); routing: the \
        document whose passage ranked first (whose adapter answers in `lift`) is the question's:\n");
    let _ = writeln!(s, "| mode | right of the document | right of the collection | paired | McNemar p | routing |");
    let _ = writeln!(s, "|---|---|---|---|---|---|");
    for m in asked {
        let own = &m[prefix.len()..];
        let rows: Vec<&AnswerRecord> = results.answers.iter().filter(|a| a.method == *m).collect();
        let mut cells = [0usize; 4];
        for a in &rows {
            let (Some(doc), Some(col)) = (right(own, &a.document, &a.question), right(m, &a.document, &a.question)) else { continue };
            cells[match (doc, col) {
                (true, true) => 0,
                (false, true) => 1,
                (true, false) => 2,
                (false, false) => 3,
            }] += 1;
        }
        let n: usize = cells.iter().sum();
        let routed = rows.iter().filter(|a| a.routed_right == Some(true)).count();
        let p = crate::corpus::scoring::mcnemar_exact(cells[1], cells[2]);
        let _ = writeln!(
            s,
            "| {own} | {} of {n} | {} of {n} | {} / {} / {} / {} | {p:.3} | {routed} of {} ({}) |",
            cells[0] + cells[2],
            cells[0] + cells[1],
            cells[0],
            cells[1],
            cells[2],
            cells[3],
            rows.len(),
            pct((!rows.is_empty()).then(|| routed as f64 / rows.len() as f64))
        );
    }
}

/// Each absorb's price said before it ran against what it took: the estimate's seconds and the
/// wall time, the steps trained of those planned, and whether the time budget stopped it.
fn absorb_table(s: &mut String, results: &Results) {
    let said: Vec<_> = results.absorbs.iter().filter(|a| a.estimated_seconds.is_some()).collect();
    if said.is_empty() {
        return;
    }
    let _ = writeln!(s, "\nAbsorbs: the estimate said before each ran against its wall time\n");
    let _ = writeln!(s, "| document | document tokens | training tokens (estimated) | steps / planned | estimate s | measured s | estimate / measured | stopped by the budget |");
    let _ = writeln!(s, "|---|---|---|---|---|---|---|---|");
    for a in said {
        let tokens = results.documents.iter().find(|d| d.id == a.document).map_or("–".into(), |d| d.tokens.to_string());
        let est = a.estimated_seconds.unwrap_or(f64::NAN);
        let planned = a.planned_steps.map_or("–".into(), |p| p.to_string());
        let _ = writeln!(
            s,
            "| {} | {tokens} | {} | {} / {planned} | {est:.0} | {:.0} | {:.2} | {} |",
            a.document,
            a.estimated_tokens.map_or("–".into(), |t| t.to_string()),
            a.steps,
            a.seconds,
            est / a.seconds,
            if a.out_of_time { "yes" } else { "no" }
        );
    }
}

/// Method `m`'s row of the summary table.
fn method_row(s: &mut String, results: &Results, m: &str) {
    let rows = |w: bool| results.answers.iter().filter(move |a| a.method == m && a.in_window == Some(w));
    let (n_in, acc_in) = mean(rows(true), |a| a.scores.contains);
    let (n_out, acc_out) = mean(rows(false), |a| a.scores.contains);
    let (_, em_in) = mean(rows(true), |a| a.scores.em);
    let (_, em_out) = mean(rows(false), |a| a.scores.em);
    let (_, f1_in) = mean(rows(true), |a| a.scores.f1);
    let (_, f1_out) = mean(rows(false), |a| a.scores.f1);
    let abs: Vec<_> = results.absorbs.iter().filter(|a| a.methods.iter().any(|x| x == m)).collect();
    let avg = |f: &dyn Fn(&super::AbsorbRecord) -> Option<f64>| {
        let v: Vec<f64> = abs.iter().filter_map(|a| f(a)).collect();
        (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
    };
    let secs = avg(&|a| Some(a.seconds)).map_or("–".into(), |x| format!("{x:.0}"));
    let tps = avg(&|a| a.tokens_per_s).map_or("–".into(), |x| format!("{x:.0}"));
    let bytes = avg(&|a| Some(a.adapter_bytes as f64)).map_or("–".into(), |x| format!("{x:.0}"));
    let no_label = results.answers.iter().filter(|a| a.method == m && a.in_window.is_none()).count();
    let extra = if no_label > 0 { format!(" (+{no_label} unlabelled)") } else { String::new() };
    let _ = writeln!(
        s,
        "| {m} | {n_in} / {n_out}{extra} | {} | {} | {} | {} | {} | {} | {secs} | {tps} | {bytes} |",
        pct(acc_in),
        pct(acc_out),
        pct(em_in),
        pct(em_out),
        f1_in.map_or("–".into(), |x| format!("{x:.2}")),
        f1_out.map_or("–".into(), |x| format!("{x:.2}")),
    );
}

/// Per method: whether each answer's context held the question's evidence (whatever chose the
/// passages, with or without a filter) and how often it was right then and otherwise; and the
/// answers one document got repeated: the replies given to two or more of its questions, and the
/// reply strings given to more than two of them with some wrong (a reader that answers with the
/// document's most frequent term, not what was asked).
fn reading_table(s: &mut String, results: &Results) {
    let ms = methods(results);
    if ms.is_empty() || results.answers.is_empty() {
        return;
    }
    let _ = writeln!(
        s,
        "\nReading: the evidence in the answer's context, accuracy with and without it; repeated replies (one \
         normalised reply to several questions of a document: the questions that share one, and the replies given \
         to more than two questions with some wrong):\n"
    );
    let _ = writeln!(s, "| method | evidence in context | right, evidence in context | right, evidence not in context | questions sharing a reply | replies repeated > 2 with a wrong one |");
    let _ = writeln!(s, "|---|---|---|---|---|---|");
    let frac = |k: usize, n: usize| if n == 0 { "–".to_string() } else { format!("{k}/{n} ({:.0}%)", 100.0 * k as f64 / n as f64) };
    for m in ms {
        let rows: Vec<&AnswerRecord> = results.answers.iter().filter(|a| a.method == m).collect();
        let labelled: Vec<&&AnswerRecord> = rows.iter().filter(|a| a.evidence_in_context.is_some()).collect();
        let shown: Vec<&&&AnswerRecord> = labelled.iter().filter(|a| a.evidence_in_context == Some(true)).collect();
        let hidden: Vec<&&&AnswerRecord> = labelled.iter().filter(|a| a.evidence_in_context == Some(false)).collect();
        let right = |v: &[&&&AnswerRecord]| v.iter().filter(|a| a.scores.contains > 0.0).count();
        let (sharing, bad) = repeated_replies(&rows);
        let _ = writeln!(
            s,
            "| {m} | {} | {} | {} | {} | {bad} |",
            frac(shown.len(), labelled.len()),
            frac(right(&shown), shown.len()),
            frac(right(&hidden), hidden.len()),
            frac(sharing, rows.len()),
        );
    }
}

/// Of one method's answers: how many questions share their normalised reply with another
/// question of the same document, and how many reply strings were given to more than two
/// questions of one document with at least one of them wrong.
pub fn repeated_replies(rows: &[&AnswerRecord]) -> (usize, usize) {
    let mut by_reply: BTreeMap<(&str, String), Vec<bool>> = BTreeMap::new();
    for a in rows {
        let reply = crate::corpus::scoring::normalize(&a.prediction);
        if !reply.is_empty() {
            by_reply.entry((a.document.as_str(), reply)).or_default().push(a.scores.contains > 0.0);
        }
    }
    let sharing = by_reply.values().filter(|v| v.len() >= 2).map(Vec::len).sum();
    let bad = by_reply.values().filter(|v| v.len() > 2 && v.iter().any(|r| !r)).count();
    (sharing, bad)
}

/// Right answers by the question's form (a user set's `kind`: who, what, how_many, ...), one row
/// per method; nothing when no question gives one.
fn form_table(s: &mut String, results: &Results) {
    let mut forms: Vec<&str> = results.answers.iter().filter_map(|a| a.form.as_deref()).collect();
    forms.sort();
    forms.dedup();
    if forms.is_empty() {
        return;
    }
    let _ = writeln!(s, "\nBy question form (right / questions):\n");
    let _ = writeln!(s, "| method | {} |", forms.join(" | "));
    let _ = writeln!(s, "|---|{}", "---|".repeat(forms.len()));
    for m in methods(results) {
        let cells: Vec<String> = forms
            .iter()
            .map(|f| {
                let rows: Vec<_> = results.answers.iter().filter(|a| a.method == m && a.form.as_deref() == Some(*f)).collect();
                format!("{}/{}", rows.iter().filter(|a| a.scores.contains > 0.0).count(), rows.len())
            })
            .collect();
        let _ = writeln!(s, "| {m} | {} |", cells.join(" | "));
    }
}

/// Right answers by question kind (columns, as `right/questions`, out of window first), one row
/// per method; nothing without planted questions.
fn kind_table(s: &mut String, results: &Results) {
    let mut kinds: Vec<_> = results.answers.iter().filter_map(|a| a.kind).collect();
    kinds.sort();
    kinds.dedup();
    if kinds.is_empty() {
        return;
    }
    let name = |k: &super::needles::FactKind| serde_json::to_value(k).ok().and_then(|v| v.as_str().map(str::to_string)).unwrap_or_default();
    let _ = writeln!(s, "\nBy question kind (right / questions: out of window, in window):\n");
    let _ = writeln!(s, "| method | {} |", kinds.iter().map(name).collect::<Vec<_>>().join(" | "));
    let _ = writeln!(s, "|---|{}", "---|".repeat(kinds.len()));
    for m in methods(results) {
        let cells: Vec<String> = kinds
            .iter()
            .map(|k| {
                let count = |w: bool| {
                    let rows: Vec<_> = results.answers.iter().filter(|a| a.method == m && a.kind == Some(*k) && a.in_window == Some(w)).collect();
                    format!("{}/{}", rows.iter().filter(|a| a.scores.contains > 0.5).count(), rows.len())
                };
                format!("{}, {}", count(false), count(true))
            })
            .collect();
        let _ = writeln!(s, "| {m} | {} |", cells.join(" | "));
    }
}

/// Accuracy by document length (rows) and needle depth (columns), one table per method; nothing
/// without planted questions.
fn depth_tables(s: &mut String, results: &Results) {
    let cells = heatmap_cells(results);
    if cells.is_empty() {
        return;
    }
    let (lengths, depths) = axes(&cells);
    let _ = writeln!(s, "\nAccuracy by document length (rows, tokens) and needle depth (columns):\n");
    for m in methods(results) {
        let _ = write!(s, "| {m} |");
        for d in &depths {
            let _ = write!(s, " {d} |");
        }
        let _ = writeln!(s);
        let _ = writeln!(s, "|---|{}", "---|".repeat(depths.len()));
        for l in &lengths {
            let _ = write!(s, "| {l} |");
            for d in &depths {
                match cells.get(&(m.clone(), *l, d.clone())) {
                    Some(&(ok, n)) => {
                        let _ = write!(s, " {ok}/{n} |");
                    }
                    None => {
                        let _ = write!(s, " – |");
                    }
                }
            }
            let _ = writeln!(s);
        }
        let _ = writeln!(s);
    }
}

/// (method, length, depth label) → (correct, questions), for planted questions.
type Cells = BTreeMap<(String, usize, String), (usize, usize)>;

fn heatmap_cells(results: &Results) -> Cells {
    let mut cells = Cells::new();
    for a in &results.answers {
        if let (Some(l), Some(d)) = (a.target_tokens, a.depth) {
            let e = cells.entry((a.method.clone(), l, format!("{d}"))).or_default();
            e.0 += usize::from(a.scores.contains > 0.5);
            e.1 += 1;
        }
    }
    cells
}

fn axes(cells: &Cells) -> (Vec<usize>, Vec<String>) {
    let mut lengths: Vec<usize> = cells.keys().map(|k| k.1).collect();
    lengths.sort_unstable();
    lengths.dedup();
    let mut depths: Vec<String> = cells.keys().map(|k| k.2.clone()).collect();
    depths.sort_by(|a, b| a.parse::<f64>().unwrap_or(0.0).total_cmp(&b.parse::<f64>().unwrap_or(0.0)));
    depths.dedup();
    (lengths, depths)
}

fn register_font() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        plotters::style::register_font(FONT, FontStyle::Normal, dejavu::sans::regular())
            .unwrap_or_else(|_| panic!("bundled font is valid"));
    });
}

fn plot_err<E: std::fmt::Debug>(e: E) -> anyhow::Error {
    anyhow::anyhow!("plotting failed: {e:?}")
}

/// Red (0) → yellow → green (1).
fn ramp(x: f64) -> RGBColor {
    let x = x.clamp(0.0, 1.0);
    let (r, g) =
        if x < 0.5 { (230.0, 60.0 + 340.0 * x) } else { (230.0 - 360.0 * (x - 0.5), 230.0 - 40.0 * (x - 0.5)) };
    RGBColor(r as u8, g as u8, 70)
}

/// Accuracy by depth (x) × length (y), one panel per method.
pub fn heatmap(results: &Results, path: &Path) -> Result<()> {
    register_font();
    let cells = heatmap_cells(results);
    let (lengths, depths) = axes(&cells);
    let methods = methods(results);
    let (nd, nl) = (depths.len() as i32, lengths.len() as i32);
    let panel_w = 120 + 90 * depths.len() as u32;
    let root =
        BitMapBackend::new(path, (panel_w * methods.len() as u32, 130 + 70 * lengths.len() as u32)).into_drawing_area();
    root.fill(&WHITE).map_err(plot_err)?;
    for (panel, m) in root.split_evenly((1, methods.len())).iter().zip(&methods) {
        let mut chart = ChartBuilder::on(panel)
            .caption(m, (FONT, 22))
            .margin(10)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d((0..nd - 1).into_segmented(), (0..nl - 1).into_segmented())
            .map_err(plot_err)?;
        let depth_label = |v: &SegmentValue<i32>| match v {
            SegmentValue::CenterOf(i) => depths.get(*i as usize).cloned().unwrap_or_default(),
            _ => String::new(),
        };
        let length_label = |v: &SegmentValue<i32>| match v {
            SegmentValue::CenterOf(i) => lengths.get(*i as usize).map(|l| l.to_string()).unwrap_or_default(),
            _ => String::new(),
        };
        chart
            .configure_mesh()
            .disable_mesh()
            .x_desc("depth")
            .y_desc("tokens")
            .x_label_formatter(&depth_label)
            .y_label_formatter(&length_label)
            .label_style((FONT, 14))
            .axis_desc_style((FONT, 14))
            .draw()
            .map_err(plot_err)?;
        for (yi, l) in lengths.iter().enumerate() {
            for (xi, d) in depths.iter().enumerate() {
                let (x, y) = (xi as i32, yi as i32);
                let rect = [
                    (SegmentValue::Exact(x), SegmentValue::Exact(y)),
                    (SegmentValue::Exact(x + 1), SegmentValue::Exact(y + 1)),
                ];
                let (color, text) = match cells.get(&(m.clone(), *l, d.clone())) {
                    Some(&(ok, n)) => (ramp(ok as f64 / n as f64), format!("{ok}/{n}")),
                    None => (RGBColor(220, 220, 220), "–".into()),
                };
                chart.draw_series(std::iter::once(Rectangle::new(rect.clone(), color.filled()))).map_err(plot_err)?;
                chart.draw_series(std::iter::once(Rectangle::new(rect, WHITE.stroke_width(2)))).map_err(plot_err)?;
                let style = TextStyle::from((FONT, 16).into_font()).pos(plotters::style::text_anchor::Pos::new(
                    plotters::style::text_anchor::HPos::Center,
                    plotters::style::text_anchor::VPos::Center,
                ));
                chart
                    .draw_series(std::iter::once(Text::new(
                        text,
                        (SegmentValue::CenterOf(x), SegmentValue::CenterOf(y)),
                        style,
                    )))
                    .map_err(plot_err)?;
            }
        }
    }
    root.present().map_err(plot_err)?;
    Ok(())
}

const SMOOTH: usize = 10;

/// Mean of the last `k` values (fewer at the start) at each position.
fn running_mean(v: &[f64], k: usize) -> Vec<f64> {
    (0..v.len())
        .map(|i| v[i.saturating_sub(k - 1)..=i].iter().sum::<f64>() / (i + 1 - i.saturating_sub(k - 1)) as f64)
        .collect()
}

/// Training loss per optimizer step, one line per absorption; absorbing until learned, the loss of
/// the held-aside probe questions as dots joined by a thin line, in the same colour.
pub fn loss_plot(results: &Results, path: &Path) -> Result<()> {
    register_font();
    let series: Vec<_> = results.absorbs.iter().filter(|a| !a.step_losses.is_empty()).collect();
    let max_steps = series.iter().map(|a| a.step_losses.len()).max().unwrap_or(1);
    let max_loss =
        series.iter().flat_map(|a| a.step_losses.iter().copied()).filter(|x| x.is_finite()).fold(0.0, f64::max);
    let root = BitMapBackend::new(path, (900, 500)).into_drawing_area();
    root.fill(&WHITE).map_err(plot_err)?;
    let mut chart = ChartBuilder::on(&root)
        .caption("training loss per step", (FONT, 22))
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(55)
        .build_cartesian_2d(0f64..max_steps as f64, 0f64..(max_loss * 1.05).max(0.1))
        .map_err(plot_err)?;
    chart
        .configure_mesh()
        .x_desc("step")
        .y_desc("loss")
        .x_label_formatter(&|x| format!("{x:.0}"))
        .label_style((FONT, 14))
        .axis_desc_style((FONT, 14))
        .draw()
        .map_err(plot_err)?;
    for (i, a) in series.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        let label = format!("{} ({}), mean of {SMOOTH} steps", a.document, a.methods.join(", "));
        // Raw per-step losses (segments and QA examples alternate) faint, their running mean bold.
        chart
            .draw_series(LineSeries::new(
                a.step_losses.iter().enumerate().map(|(s, &l)| ((s + 1) as f64, l)),
                color.mix(0.25).stroke_width(1),
            ))
            .map_err(plot_err)?;
        chart
            .draw_series(LineSeries::new(
                running_mean(&a.step_losses, SMOOTH).into_iter().enumerate().map(|(s, l)| ((s + 1) as f64, l)),
                color.stroke_width(2),
            ))
            .map_err(plot_err)?
            .label(label)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
        if !a.probe_curve.is_empty() {
            let probes = || a.probe_curve.iter().map(|&(s, l)| (s as f64, l.min(max_loss * 1.05)));
            chart.draw_series(LineSeries::new(probes(), color.stroke_width(1))).map_err(plot_err)?;
            chart
                .draw_series(probes().map(|p| Circle::new(p, 4, color.filled())))
                .map_err(plot_err)?
                .label(format!("{}: probe loss (held-aside questions)", a.document))
                .legend(move |(x, y)| Circle::new((x + 10, y), 4, color.filled()));
        }
    }
    chart
        .configure_series_labels()
        .label_font((FONT, 14))
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(plot_err)?;
    root.present().map_err(plot_err)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::{AbsorbRecord, Results, RunConfig};

    fn config(methods: Vec<String>) -> RunConfig {
        RunConfig { methods, context_tokens: None, max_tokens: 8, absorb: Default::default(), needles: None, jsonl: None, server: None, filter_mask: None }
    }

    #[test]
    fn each_absorb_says_its_estimate_against_its_wall_time() {
        let timed = AbsorbRecord {
            document: "long".into(),
            methods: vec!["lift".into()],
            seconds: 600.0,
            steps: 90,
            planned_steps: Some(120),
            estimated_seconds: Some(450.0),
            estimated_tokens: Some(30_000),
            out_of_time: true,
            ..Default::default()
        };
        let results = |absorbs: Vec<AbsorbRecord>| Results {
            model: "tiny".into(),
            config: config(vec!["lift".into()]),
            documents: Vec::new(),
            absorbs,
            answers: Vec::new(),
            seconds: 0.0,
        };
        let md = super::markdown(&results(vec![timed.clone()]));
        assert!(md.contains("| long | – | 30000 | 90 / 120 | 450 | 600 | 0.75 | yes |"), "{md}");
        // Records without an estimate (older runs, merged reports) get no table.
        let older = AbsorbRecord { estimated_seconds: None, ..timed };
        assert!(!super::markdown(&results(vec![older])).contains("Absorbs: the estimate"));
    }

    #[test]
    fn the_loss_plot_draws_the_probe_curve_when_there_is_one() {
        let dir = tempfile::tempdir().unwrap();
        let absorb = AbsorbRecord {
            document: "essay".into(),
            methods: vec!["lift".into()],
            step_losses: (0..64).map(|s| 3.0 / (1.0 + s as f64)).collect(),
            ..Default::default()
        };
        let results = |absorb: AbsorbRecord| Results {
            model: "tiny".into(),
            config: config(vec!["lift".into()]),
            documents: Vec::new(),
            absorbs: vec![absorb],
            answers: Vec::new(),
            seconds: 0.0,
        };
        let (plain, probed) = (dir.path().join("plain.png"), dir.path().join("probed.png"));
        super::loss_plot(&results(absorb.clone()), &plain).unwrap();
        let with_probes = AbsorbRecord { probe_curve: vec![(16, 2.5), (32, 1.5), (48, 1.4)], planned_steps: Some(96), ..absorb };
        super::loss_plot(&results(with_probes), &probed).unwrap();
        let (a, b) = (std::fs::read(&plain).unwrap(), std::fs::read(&probed).unwrap());
        assert!(a.starts_with(b"\x89PNG") && b.starts_with(b"\x89PNG"));
        assert_ne!(a, b, "the probe curve is drawn");
    }

    /// Two runs of one document with different methods merge into one report, and the second
    /// method is paired by question against the first.
    #[test]
    fn merged_runs_are_paired_by_question() {
        use super::super::needles::FactKind;
        use super::super::{AnswerRecord, EvalDocument};
        let doc = EvalDocument {
            id: "len1024-0".into(),
            source: "essays".into(),
            target_tokens: Some(1024),
            tokens: 1024,
            text: "text".into(),
            questions: Vec::new(),
        };
        // Question k right for `fixed` when k < 3, for `learned` when k is odd; k < 4 out of window.
        let run = |m: &str, steps: usize, right: fn(usize) -> bool| Results {
            model: "tiny".into(),
            config: config(vec![m.into()]),
            documents: vec![doc.clone()],
            absorbs: vec![AbsorbRecord { document: doc.id.clone(), methods: vec![m.into()], steps, ..Default::default() }],
            answers: (0..6)
                .map(|k| AnswerRecord {
                    document: doc.id.clone(),
                    question: format!("q{k}"),
                    method: m.into(),
                    prediction: String::new(),
                    scores: crate::corpus::scoring::Scores { contains: f64::from(u8::from(right(k))), ..Default::default() },
                    in_window: Some(k >= 4),
                    depth: None,
                    kind: Some(if k % 2 == 0 { FactKind::Paraphrase } else { FactKind::TwoHop }),
                    target_tokens: None,
                    document_tokens: 1024,
                    prompt_tokens: 0,
                    seconds: 0.0,
                    evidence_in_context: None,
                    form: None,
                    mask: None,
                    logprobs: Vec::new(),
                    routed_right: None,
                })
                .collect(),
            seconds: 1.0,
        };
        let merged =
            Results::merge(vec![("a".into(), run("fixed", 400, |k| k < 3)), ("b".into(), run("learned", 100, |k| k % 2 == 1))])
                .unwrap();
        assert_eq!(merged.config.methods, vec!["fixed", "learned"]);
        let md = super::markdown(&merged);
        // Out of window q0..q3: both q1; only learned q3; only fixed q0, q2; neither none. In
        // window q4, q5: only learned q5; neither q4.
        assert!(md.contains("| learned | 1 / 1 / 2 / 0 | 0 / 1 / 0 / 1 | 100 (25%) |"), "{md}");
        // By kind: paraphrase q0, q2 out, q4 in; two-hop q1, q3 out, q5 in.
        assert!(md.contains("| method | paraphrase | two_hop |"), "{md}");
        assert!(md.contains("| fixed | 2/2, 0/1 | 1/2, 0/1 |"), "{md}");
        assert!(md.contains("| learned | 0/2, 0/1 | 2/2, 1/1 |"), "{md}");
        // The same method in two runs: the second is labelled by its run.
        let twice = Results::merge(vec![("a".into(), run("fixed", 400, |k| k < 3)), ("b".into(), run("fixed", 100, |k| k % 2 == 1))])
            .unwrap();
        assert_eq!(twice.config.methods, vec!["fixed", "fixed@b"]);
        assert!(super::markdown(&twice).contains("| fixed@b | 1 / 1 / 2 / 0 | 0 / 1 / 0 / 1 | 100 (25%) |"));
    }

    /// Runs of the same methods over different documents pool into one report: every question
    /// counts once, a document id used by both runs is renamed, the same document twice is refused.
    #[test]
    fn pooled_runs_count_every_question_once() {
        use super::super::{AnswerRecord, EvalDocument};
        let run = |text: &str, right: bool| {
            let doc = EvalDocument {
                id: "len1024-0".into(),
                source: "essays".into(),
                target_tokens: Some(1024),
                tokens: 1024,
                text: text.into(),
                questions: Vec::new(),
            };
            let answers = ["rag", "lift"]
                .iter()
                .map(|m| AnswerRecord {
                    document: doc.id.clone(),
                    question: "q0".into(),
                    method: (*m).into(),
                    prediction: String::new(),
                    scores: crate::corpus::scoring::Scores { contains: f64::from(u8::from(right || *m == "lift")), ..Default::default() },
                    in_window: Some(false),
                    depth: None,
                    kind: None,
                    target_tokens: None,
                    document_tokens: 1024,
                    prompt_tokens: 0,
                    seconds: 0.0,
                    evidence_in_context: None,
                    form: None,
                    mask: None,
                    logprobs: Vec::new(),
                    routed_right: None,
                })
                .collect();
            Results {
                model: "tiny".into(),
                config: config(vec!["rag".into(), "lift".into()]),
                documents: vec![doc.clone()],
                absorbs: vec![AbsorbRecord { document: doc.id.clone(), methods: vec!["lift".into()], steps: 10, ..Default::default() }],
                answers,
                seconds: 1.0,
            }
        };
        let pooled = Results::pool(vec![("a".into(), run("one", true)), ("b".into(), run("two", false))]).unwrap();
        assert_eq!(pooled.documents.iter().map(|d| d.id.as_str()).collect::<Vec<_>>(), ["len1024-0", "b/len1024-0"]);
        assert_eq!(pooled.answers.iter().filter(|a| a.document == "b/len1024-0").count(), 2);
        assert_eq!(pooled.absorbs[1].document, "b/len1024-0");
        // Out of window: both right on the first document, only `lift` on the second.
        assert!(super::markdown(&pooled).contains("| lift | 1 / 1 / 0 / 0 | 0 / 0 / 0 / 0 |"), "{}", super::markdown(&pooled));
        assert!(Results::pool(vec![("a".into(), run("one", true)), ("b".into(), run("one", true))]).is_err());
        // Only the methods every run answered are kept.
        let mut other = run("three", true);
        other.config.methods = vec!["rag".into()];
        other.answers.retain(|a| a.method == "rag");
        let common = Results::pool(vec![("a".into(), run("one", true)), ("c".into(), other)]).unwrap();
        assert_eq!(common.config.methods, ["rag"]);
        assert!(common.answers.iter().all(|a| a.method == "rag") && common.answers.len() == 2);
        assert!(common.absorbs.is_empty(), "`lift`'s absorb went with it");
    }

    /// The reading table counts answers by whether their context showed the evidence, and the
    /// replies a document got repeatedly (a right reply given three times is not held against it).
    #[test]
    fn the_reading_table_counts_evidence_in_context_and_repeated_replies() {
        use super::super::AnswerRecord;
        let rec = |doc: &str, q: usize, reply: &str, right: bool, shown: Option<bool>| AnswerRecord {
            document: doc.into(),
            question: format!("q{q}"),
            method: "rag".into(),
            prediction: reply.into(),
            scores: crate::corpus::scoring::Scores { contains: f64::from(u8::from(right)), ..Default::default() },
            in_window: None,
            depth: None,
            kind: None,
            target_tokens: None,
            document_tokens: 100,
            prompt_tokens: 0,
            seconds: 0.0,
            evidence_in_context: shown,
            form: Some(if q % 2 == 0 { "who".into() } else { "when".into() }),
            mask: None,
            logprobs: Vec::new(),
            routed_right: None,
        };
        let answers = vec![
            // Document a: "the License" three times with two wrong; "1999" once.
            rec("a", 0, "The License.", false, Some(true)),
            rec("a", 1, "the license", false, Some(false)),
            rec("a", 2, "The License", true, Some(true)),
            rec("a", 3, "1999", true, Some(true)),
            // Document b: "Anna" three times, all right; the same reply as in a does not count.
            rec("b", 0, "Anna", true, Some(true)),
            rec("b", 1, "Anna", true, None),
            rec("b", 2, "Anna", true, Some(false)),
            rec("b", 3, "1999", false, Some(false)),
        ];
        let refs: Vec<&AnswerRecord> = answers.iter().collect();
        assert_eq!(super::repeated_replies(&refs), (6, 1));
        let results =
            Results { model: "tiny".into(), config: config(vec!["rag".into()]), documents: Vec::new(), absorbs: Vec::new(), answers, seconds: 1.0 };
        let md = super::markdown(&results);
        // In context: a0 a2 a3 b0 (4 of 7 labelled), right a2 a3 b0; not in context a1 b2 b3, right b2.
        assert!(md.contains("| rag | 4/7 (57%) | 3/4 (75%) | 1/3 (33%) | 6/8 (75%) | 1 |"), "{md}");
        assert!(md.contains("| method | when | who |") && md.contains("| rag | 2/4 | 3/4 |"), "{md}");
    }

    #[test]
    fn running_mean_of_the_last_k() {
        assert_eq!(super::running_mean(&[2.0, 4.0, 6.0, 8.0], 2), vec![2.0, 3.0, 5.0, 7.0]);
        assert_eq!(super::running_mean(&[1.0], 10), vec![1.0]);
    }
}
