//! The absorb options a `POST /documents` may set ([`DocumentOptions`], made by the one
//! declaration of the flat options in `lift::options`: its `Http` lines), laid over the server's
//! defaults by that one overlay and checked against their bounds.

use super::error::{ApiError, ApiResult};
pub use crate::lift::options::DocumentOptions;
use crate::lift::options::removed_why;
use crate::lift::{AbsorbOptions, OptionError};

impl DocumentOptions {
    /// `defaults` with these options applied, checked against their bounds.
    pub fn apply(self, defaults: &AbsorbOptions, num_layers: usize, max_window: usize) -> ApiResult<AbsorbOptions> {
        let base = "is no longer a per-document option: FltLM's filter and CDT are part of the server's prepared \
                    base, active for every document (the server's --prepared-base chooses it)";
        let removed =
            [("filter", &self.filter), ("cdt", &self.cdt), ("distill", &self.distill), ("qa_select", &self.qa_select)];
        if let Some((name, _)) = removed.into_iter().find(|(_, v)| v.is_some()) {
            // The measured and removed options say why as the command line does.
            let why = removed_why(name).unwrap_or_else(|| base.to_string());
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
