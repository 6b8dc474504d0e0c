//! The absorb options a `POST /documents` may set ([`DocumentOptions`], made by the one
//! declaration of the flat options in `lift::options`: its `Http` lines), laid over the server's
//! defaults by that one overlay and checked against their bounds.

use super::error::{ApiError, ApiResult};
pub use crate::lift::options::DocumentOptions;
use crate::lift::{AbsorbOptions, OptionError};

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
}

fn invalid_option(e: OptionError) -> ApiError {
    ApiError::bad_request("invalid_option", e.to_string()).param(&format!("options.{}", e.option()))
}
