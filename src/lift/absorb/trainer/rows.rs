//! Several training rows of one optimizer step as one batched forward/backward.
//!
//! The rows are right-padded to the longest and stacked `[rows, t, hidden]`, so each projection
//! of each layer is one matmul over all of them instead of one per row: a GPU step is bound by its
//! kernel launches, not its rows (on 2 CPU cores the gemms are as efficient at one row as at four,
//! so there it gains nothing: docs/absorb-speed.md "Batched rows").
//! The padding follows each row's last token, so under causal attention no real position sees it,
//! and only real positions reach the loss: every row's loss (and so the step's gradient) is the
//! one it gets alone, up to float summation order.

use super::loss::{loss_of_logits, prepare, FrozenCache};
use super::FilterTraining;
use crate::lift::absorb::qa_examples::FilterExample;
use crate::lift::answer::layout::{Filter, FilterHooks};
use crate::lift::absorb::plan::Example;
use crate::model::{Adapter, Model, NoHooks, RowHooks};
use anyhow::{ensure, Result};
use candle_core::Tensor;

/// One row of a batched step.
pub(crate) struct Row<'e> {
    pub example: &'e Example,
    /// Its layout under the prepared base's frozen filter (QA rows over a prepared base).
    pub filter: Option<&'e FilterExample>,
    /// Its key in the frozen-layer cache, for rows that are the same tokens every epoch.
    pub cache_key: Option<usize>,
}

/// Whether an example can share a batched forward: no packing (its mask is its own), and a
/// filter that only masks (a trainable one adds its own loss on its own scores).
pub(crate) fn batchable(example: &Example, filter: Option<&FilterTraining>) -> bool {
    example.packing.is_none() && filter.is_none_or(|f| f.is_frozen())
}

/// A step's rows of `lens` tokens cut into groups to batch: by length, each group as long as its
/// padding to its longest row stays within `max_padding` of its tokens (`TrainOptions::batch_rows`),
/// so a segment twice a question's length does not double the questions' cost where a padded
/// position costs what a real one does. Indices into `lens`.
pub(crate) fn groups(lens: &[usize], max_padding: f64) -> Vec<Vec<usize>> {
    let mut order: Vec<usize> = (0..lens.len()).collect();
    order.sort_by_key(|&i| lens[i]);
    let mut out: Vec<Vec<usize>> = Vec::new();
    let mut tokens = 0;
    for i in order {
        // Sorted: row i is the group's longest.
        let fits = out.last().is_some_and(|g| {
            let padded = (g.len() + 1) * lens[i];
            padded as f64 <= (1.0 + max_padding) * (tokens + lens[i]) as f64
        });
        if fits {
            out.last_mut().expect("a group").push(i);
            tokens += lens[i];
        } else {
            out.push(vec![i]);
            tokens = lens[i];
        }
    }
    out
}

/// Each row's loss, as `training_loss` gives it for the row alone, from one forward over all.
pub(crate) fn row_losses(
    model: &Model,
    adapter: &dyn Adapter,
    rows: &[&Row],
    filter: Option<&Filter>,
    frozen: &mut FrozenCache,
) -> Result<Vec<Tensor>> {
    ensure!(!rows.is_empty(), "a batched step needs rows");
    ensure!(rows.iter().all(|r| r.example.packing.is_none()), "packed rows are trained one by one");
    let prepared = rows.iter().map(|r| prepare(model, r.example)).collect::<Result<Vec<_>>>()?;
    let embs = prepared.iter().map(|p| model.decoder.embed(&p.input)).collect::<candle_core::Result<Vec<_>>>()?;
    // The layers below the adapter, and below the filter's score layer for masked rows, are
    // frozen: they run on the inference kernels (cached for rows that repeat).
    let mut first = model.decoder.first_trainable_layer(&embs[0], Some(adapter));
    if let (Some(f), true) = (filter, rows.iter().any(|r| r.filter.is_some())) {
        first = first.min(f.layer);
    }
    let t = prepared.iter().map(|p| p.input.dim(1)).collect::<candle_core::Result<Vec<_>>>()?;
    let t_max = t.iter().copied().max().unwrap_or(0);
    let mut streams = Vec::with_capacity(rows.len());
    for ((row, emb), &t_row) in rows.iter().zip(&embs).zip(&t) {
        let h = match row.cache_key {
            Some(key) => frozen.stream(model, key, emb, first, None)?,
            None => model.decoder.forward_frozen(emb, first, None, &mut NoHooks)?,
        };
        streams.push(match t_max - t_row {
            0 => h,
            pad => Tensor::cat(&[&h, &Tensor::zeros((1, pad, h.dim(2)?), h.dtype(), h.device())?], 1)?,
        });
    }
    let h = Tensor::cat(&streams, 0)?;
    let layers = model.config().num_layers;
    let mut hooks = RowHooks {
        rows: rows
            .iter()
            .map(|r| filter.zip(r.filter).map(|(f, fx)| FilterHooks::new(f, &fx.chunks, layers)))
            .collect(),
    };
    let hidden = model.decoder.forward_train_from(&h, first, None, Some(adapter), &mut hooks)?;
    // One vocabulary projection over every row's target positions, then each row's loss.
    let (n, t_all, d) = hidden.dims3()?;
    let at: Vec<u32> = prepared
        .iter()
        .enumerate()
        .flat_map(|(i, p)| p.positions.iter().map(move |&q| (i * t_all) as u32 + q))
        .collect();
    let at = Tensor::new(at.as_slice(), hidden.device())?;
    let logits = model.decoder.logits_train(&hidden.reshape((n * t_all, d))?.index_select(&at, 0)?)?;
    let mut offset = 0;
    let mut losses = Vec::with_capacity(rows.len());
    for p in &prepared {
        let k = p.positions.len();
        losses.push(loss_of_logits(&logits.narrow(0, offset, k)?, p)?);
        offset += k;
    }
    Ok(losses)
}

#[cfg(test)]
mod tests {
    use super::groups;

    #[test]
    fn rows_of_like_length_share_a_forward_and_a_long_one_goes_alone() {
        // Three questions and a segment twice their length.
        assert_eq!(groups(&[180, 400, 170, 190], 0.25), vec![vec![2, 0, 3], vec![1]]);
        // Equal rows: one group; no padding allowed: only equal lengths share one.
        assert_eq!(groups(&[100; 4], 0.0), vec![vec![0, 1, 2, 3]]);
        assert_eq!(groups(&[100, 101], 0.0), vec![vec![0], vec![1]]);
        // Any padding allowed: everything in one forward.
        assert_eq!(groups(&[10, 400, 30], f64::INFINITY).len(), 1);
        assert!(groups(&[], 0.25).is_empty());
    }
}
