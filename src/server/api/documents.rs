//! `POST /documents`: the JSON body, a document's text and title checked, and the answers (the
//! Document posted with its absorb estimate, or the estimate alone for a dry run).

use super::{missing, DocumentOptions};
use crate::server::error::{ApiError, ApiResult};
use crate::formats::Source;
use crate::lift::AbsorbOptions;
use crate::service::NewDocument;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

// ---------- POST /documents ----------

/// `POST /documents` with a JSON body (a `text/plain` body is the text alone).
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PostDocument {
    /// The document, UTF-8 text.
    pub text: Option<String>,
    pub title: Option<String>,
    pub options: Option<DocumentOptions>,
    /// A collection (`col_…`) the document joins once posted.
    pub collection: Option<String>,
    /// true: answer what absorbing would cost (planned steps, training tokens, estimated time)
    /// and the options' warnings, without storing or queueing anything.
    pub dry_run: Option<bool>,
}

/// Longest title, in characters.
pub const MAX_TITLE_CHARS: usize = 1000;

impl PostDocument {
    /// The document and whether this is a dry run.
    pub fn validate(self, defaults: &AbsorbOptions, num_layers: usize, max_window: usize) -> ApiResult<(NewDocument, bool)> {
        let text = self.text.ok_or_else(|| missing("text"))?;
        let options = self.options.unwrap_or_default().apply(defaults, num_layers, max_window)?;
        let source = Source::as_sent(&text, "application/json");
        Ok((document(text, self.title, options, source)?, self.dry_run.unwrap_or(false)))
    }
}

/// A document's text and title checked.
pub fn document(text: String, title: Option<String>, options: AbsorbOptions, source: Source) -> ApiResult<NewDocument> {
    if text.trim().is_empty() {
        return Err(ApiError::unprocessable("empty_document", "the document text is empty").param("text"));
    }
    if let Some(n) = title.as_ref().map(|t| t.chars().count()).filter(|&n| n > MAX_TITLE_CHARS) {
        return Err(ApiError::bad_request(
            "invalid_title",
            format!("'title' has {n} characters; the limit is {MAX_TITLE_CHARS}"),
        )
        .param("title"));
    }
    Ok(NewDocument { text, title, options, source })
}

/// `POST /documents` with `dry_run`: what absorbing would cost; nothing is stored.
#[derive(Debug, Serialize, ToSchema)]
pub struct AbsorbEstimate {
    /// Always "absorb_estimate".
    pub object: &'static str,
    /// The document's tokens.
    pub tokens: usize,
    /// The effective absorb options.
    #[schema(value_type = Object)]
    pub options: serde_json::Value,
    pub estimate: crate::lift::pricing::Estimate,
    pub warnings: Vec<crate::lift::pricing::OptionWarning>,
}

/// `POST /documents`' answer: the Document, with what its absorb is estimated to cost and the
/// options' warnings.
#[derive(Debug, Serialize, ToSchema)]
pub struct PostedDocument {
    #[serde(flatten)]
    pub document: crate::service::DocumentView,
    pub estimate: crate::lift::pricing::Estimate,
    pub warnings: Vec<crate::lift::pricing::OptionWarning>,
}
