//! `GET /openapi.json`: the OpenAPI description of the API, generated (utoipa) from the handlers'
//! annotations and the request and response types in `api`, so that it cannot drift from them.

use super::{api, collections, error, openai, routes};
use axum::Json;
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::OpenApi;

#[derive(OpenApi)]
#[openapi(
    info(
        title = "lift-serve",
        description = "Absorbs long documents into per-document adapters (LIFT) and answers questions with them."
    ),
    paths(
        routes::post_document,
        routes::list_documents,
        routes::get_document,
        routes::get_document_text,
        routes::delete_document,
        routes::document_events,
        collections::post_collection,
        collections::list_collections,
        collections::get_collection,
        collections::patch_collection,
        collections::delete_collection,
        routes::ask,
        openai::models,
        openai::chat_completions,
        routes::health,
        routes::metrics,
    ),
    components(schemas(api::DocumentOptions, api::AbsorbEstimate, api::AskToken, api::ChatMessageIn, api::Turn, api::StreamOptions, error::ErrorBody)),
    modifiers(&BearerAuth),
    security(("bearer" = []))
)]
struct ApiDoc;

/// API keys as bearer tokens (required on every route but `/health` when the server has keys).
struct BearerAuth;

impl utoipa::Modify for BearerAuth {
    fn modify(&self, doc: &mut utoipa::openapi::OpenApi) {
        let components = doc.components.get_or_insert_with(Default::default);
        components
            .add_security_scheme("bearer", SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()));
    }
}

pub fn spec() -> utoipa::openapi::OpenApi {
    ApiDoc::openapi()
}

pub async fn serve() -> Json<utoipa::openapi::OpenApi> {
    Json(spec())
}
