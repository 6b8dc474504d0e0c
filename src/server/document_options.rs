//! The absorb options a `POST /documents` may set (the API's subset of [`OptionOverlay`]'s names),
//! laid over the server's defaults by that one overlay and checked against their bounds.

use super::error::{ApiError, ApiResult};
use crate::adapters::AdapterKind;
use crate::lift::{AbsorbOptions, OptionError, OptionOverlay};
use serde::Deserialize;
use utoipa::ToSchema;

/// Absorb options a request may set; the others are the server's `--absorb-options`.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct DocumentOptions {
    /// A named recipe laid over the server's defaults before the options below: `paper` (the
    /// default: 3 + 5 epochs, the questions behind the document's head and tail) or `lean` (about
    /// a seventh of its training: 1 + 2 epochs, the questions on their own passages).
    #[schema(value_type = Option<String>, example = "lean")]
    pub recipe: Option<crate::lift::Recipe>,
    #[schema(value_type = Option<String>, example = "gated_memory")]
    pub adapter: Option<AdapterKind>,
    /// Tokens per training segment.
    pub window: Option<usize>,
    /// Tokens between segment starts (at most `window`).
    pub stride: Option<usize>,
    /// [segment-only epochs, segment + QA epochs].
    pub epochs: Option<[usize; 2]>,
    /// Most auxiliary QA pairs, a fixed cap (default: at most 64 per 1,000 document tokens, and
    /// never under 256).
    pub aux_qa: Option<usize>,
    /// Absorb until learned: stop once held-aside probe questions stop improving (`epochs` is then
    /// the ceiling); false: the fixed schedule. Default: the server's options.
    pub until_learned: Option<bool>,
    /// Seconds the absorb may take: the plan is fitted to it at the server's measured rate (fewer
    /// epochs, no segment overlap, fewer QA pairs, said in `warnings`) and training stops at it.
    /// Default: the server's `--absorb-budget`, else none.
    pub budget_seconds: Option<f64>,
    /// Removed: FltLM's filter belongs to the server's prepared base (400 `removed_option`).
    #[schema(value_type = Option<Object>)]
    pub filter: Option<serde_json::Value>,
    /// Removed: CDT belongs to the server's prepared base (400 `removed_option`).
    #[schema(value_type = Option<Object>)]
    pub cdt: Option<serde_json::Value>,
    /// Removed: context distillation was measured and rejected (400 `removed_option`).
    #[schema(value_type = Option<Object>)]
    pub distill: Option<serde_json::Value>,
    /// Removed: training on a selected share of the questions was measured and rejected (400
    /// `removed_option`).
    #[schema(value_type = Option<Object>)]
    pub qa_select: Option<serde_json::Value>,
}

impl DocumentOptions {
    /// `defaults` with these options applied, checked against their bounds.
    pub fn apply(self, defaults: &AbsorbOptions, num_layers: usize, max_window: usize) -> ApiResult<AbsorbOptions> {
        let base = "is no longer a per-document option: FltLM's filter and CDT are part of the server's prepared \
                    base, active for every document (the server's --prepared-base chooses it)";
        let measured = "was measured and removed (docs/recipe-search.md): the `recipe` option chooses between \
                        the schedules kept, `paper` (the default) and `lean`";
        let removed = [("filter", &self.filter, base), ("cdt", &self.cdt, base), ("distill", &self.distill, measured),
            ("qa_select", &self.qa_select, measured)];
        if let Some((name, _, why)) = removed.into_iter().find(|(_, v, _)| v.is_some()) {
            return Err(ApiError::bad_request("removed_option", format!("'options.{name}' {why}")).param(&format!("options.{name}")));
        }
        let o = self.overlay().apply(defaults);
        o.validate(num_layers, max_window).map_err(invalid_option)?;
        Ok(o)
    }

    /// The settings given, by the names every path uses.
    fn overlay(&self) -> OptionOverlay {
        OptionOverlay {
            recipe: self.recipe,
            adapter: self.adapter,
            window: self.window,
            stride: self.stride,
            epochs: self.epochs,
            aux_qa: self.aux_qa,
            until_learned: self.until_learned,
            budget_seconds: self.budget_seconds,
            ..Default::default()
        }
    }
}

fn invalid_option(e: OptionError) -> ApiError {
    ApiError::bad_request("invalid_option", e.to_string()).param(&format!("options.{}", e.option()))
}
