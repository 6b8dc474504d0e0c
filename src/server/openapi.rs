//! `GET /openapi.json`: the OpenAPI 3 description of the API.

use axum::Json;
use serde_json::{json, Value};

fn op(summary: &str, body: Option<&str>, responses: &[(&str, &str)]) -> Value {
    let mut o = json!({"summary": summary, "responses": {}});
    for (code, desc) in responses {
        o["responses"][*code] = if code.starts_with('2') {
            json!({"description": desc})
        } else {
            json!({"description": desc, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}})
        };
    }
    if let Some(schema) = body {
        o["requestBody"] = json!({"required": true, "content": {"application/json": {"schema": {"$ref": format!("#/components/schemas/{schema}")}}}});
    }
    o
}

pub fn spec() -> Value {
    let errs = [
        ("400", "invalid request, unreadable body, or prompt past the model's window"),
        ("401", "missing or bad API key"),
        ("408", "body not received in time"),
        ("413", "too large"),
        ("415", "wrong content type"),
        ("422", "unusable"),
        ("429", "queue full"),
        ("503", "shutting down"),
    ];
    let with = |ok: &[(&'static str, &'static str)], extra: &[(&'static str, &'static str)]| -> Vec<(&'static str, &'static str)> {
        ok.iter().chain(extra.iter()).chain(errs.iter()).copied().collect()
    };
    let id_param = json!([{"name": "id", "in": "path", "required": true, "schema": {"type": "string"}}]);
    json!({
        "openapi": "3.0.3",
        "info": {"title": "lift-serve", "version": env!("CARGO_PKG_VERSION"),
                 "description": "Absorbs long documents into per-document adapters (LIFT) and answers questions with them."},
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": {
                "Error": {"type": "object", "properties": {"error": {"type": "object", "properties": {
                    "message": {"type": "string"}, "type": {"type": "string"}, "code": {"type": "string"}, "param": {"type": "string", "nullable": true}}}}},
                "AbsorbOptions": {"type": "object", "properties": {
                    "adapter": {"type": "string", "enum": ["gated_memory", "lora"]}, "window": {"type": "integer"},
                    "stride": {"type": "integer"}, "epochs": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 2},
                    "aux_qa": {"type": "integer"},
                    "filter": {"description": "FltLM context filter: true/false, or {enabled, layer, chunk_tokens, lambda, margin, tau, lr_scale}",
                               "oneOf": [{"type": "boolean"}, {"type": "object"}]},
                    "cdt": {"description": "CDT context denoising: true/false, or {enabled, relative_move} (denoises the document tokens of QA examples)",
                            "oneOf": [{"type": "boolean"}, {"type": "object"}]}}},
                "AskResponse": {"type": "object", "properties": {
                    "answer": {"type": "string"}, "document_id": {"type": "string"}, "mode": {"type": "string"},
                    "usage": {"type": "object"}, "finish_reason": {"type": "string"}, "timings": {"type": "object"},
                    "context": {"type": "object", "description": "present in mode lift for documents absorbed with filter",
                        "properties": {"chunks": {"type": "array", "items": {"type": "object", "properties": {
                            "start": {"type": "integer", "description": "first document token"},
                            "end": {"type": "integer", "description": "document token after the chunk"},
                            "score": {"type": "number", "description": "relevance score s_i"},
                            "mask": {"type": "number", "description": "attention bias min(0, w·s_i + b); 0 keeps the chunk"},
                            "text": {"type": "string"}}}}}}}},
                "DocumentRequest": {"type": "object", "required": ["text"], "properties": {
                    "text": {"type": "string"}, "title": {"type": "string"}, "options": {"$ref": "#/components/schemas/AbsorbOptions"}}},
                "Document": {"type": "object", "properties": {
                    "id": {"type": "string"}, "object": {"type": "string"}, "status": {"type": "string", "enum": ["queued", "training", "ready", "failed", "cancelled"]},
                    "title": {"type": "string", "nullable": true}, "tokens": {"type": "integer"}, "created_at": {"type": "integer"},
                    "ready_at": {"type": "integer", "nullable": true}, "progress": {"type": "object", "nullable": true},
                    "adapter": {"type": "object", "nullable": true}, "error": {"type": "object", "nullable": true}}},
                "AskRequest": {"type": "object", "required": ["document_id", "question"], "properties": {
                    "document_id": {"type": "string"}, "question": {"type": "string"}, "mode": {"type": "string", "enum": ["lift", "icl", "memory"]},
                    "max_tokens": {"type": "integer", "minimum": 1}, "temperature": {"type": "number", "minimum": 0, "maximum": 2}}},
                "ChatCompletionRequest": {"type": "object", "required": ["model", "messages"], "properties": {
                    "model": {"type": "string"}, "messages": {"type": "array", "items": {"type": "object"}},
                    "max_tokens": {"type": "integer"}, "max_completion_tokens": {"type": "integer"}, "temperature": {"type": "number"},
                    "top_p": {"type": "number"}, "stop": {}, "stream": {"type": "boolean"}, "seed": {"type": "integer"}, "n": {"type": "integer"},
                    "stream_options": {"type": "object"},
                    "mode": {"type": "string", "enum": ["lift", "icl", "memory"],
                             "description": "lift-serve extension, for a document model only: as /ask's mode (default lift)"}}}
            }
        },
        "security": [{"bearer": []}],
        "paths": {
            "/documents": {
                "post": op("Absorb a document (JSON or text/plain)", Some("DocumentRequest"), &with(&[("200", "already absorbed or in progress"), ("202", "queued")], &[])),
                "get": op("List this tenant's documents", None, &with(&[("200", "list")], &[]))
            },
            "/documents/{id}": {
                "parameters": id_param.clone(),
                "get": op("One document", None, &with(&[("200", "Document")], &[("404", "unknown document")])),
                "delete": op("Cancel and delete a document", None, &with(&[("204", "deleted")], &[("404", "unknown document")]))
            },
            "/documents/{id}/events": {
                "parameters": id_param,
                "get": op("Server-sent progress events (event: progress, then event: done)", None, &with(&[("200", "text/event-stream")], &[("404", "unknown document")]))
            },
            "/ask": {"post": op("Ask about a ready document", Some("AskRequest"), &with(&[("200", "AskResponse")], &[("404", "unknown document"), ("409", "document not ready")]))},
            "/v1/models": {"get": op("The base model and this tenant's ready documents", None, &with(&[("200", "list")], &[]))},
            "/v1/chat/completions": {"post": op("OpenAI-compatible chat completion (stream: true for SSE)", Some("ChatCompletionRequest"), &with(&[("200", "chat.completion or SSE chunks")], &[("404", "unknown model"), ("409", "document not ready")]))},
            "/health": {"get": {"summary": "Liveness", "security": [], "responses": {"200": {"description": "{\"status\": \"ok\"}"}}}},
            "/metrics": {"get": {"summary": "Prometheus metrics (server-wide: with API keys configured, only the metrics key may read them)",
                "responses": {"200": {"description": "text/plain"}, "401": {"description": "no key"}, "403": {"description": "not the metrics key"},
                              "404": {"description": "API keys configured but no metrics key"}}}},
            "/openapi.json": {"get": {"summary": "This document", "responses": {"200": {"description": "OpenAPI 3"}}}}
        }
    })
}

pub async fn openapi() -> Json<Value> {
    Json(spec())
}
