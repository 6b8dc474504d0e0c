//! The HTTP API's types: request bodies as clients send them (typed, unknown fields refused, every
//! error naming the field), their validation — once, into what the service takes — and the
//! response bodies. The OpenAPI document (`openapi.rs`) is generated from these types.
//!
//! By concern: reading a body, path parameters and file uploads (`body.rs`), `POST /documents`
//! (`documents.rs`), `POST /ask` (`ask.rs`), OpenAI's chat completions and models (`chat.rs`).

mod ask;
mod body;
mod chat;
mod documents;

pub use super::document_options::DocumentOptions;
pub use ask::*;
pub use body::*;
pub use chat::*;
pub use documents::*;
use serde::Serialize;
use utoipa::ToSchema;

// ---------- lists ----------

#[derive(Debug, Serialize, ToSchema)]
pub struct List<T: ToSchema> {
    /// Always "list".
    pub object: &'static str,
    pub data: Vec<T>,
}

impl<T: ToSchema> List<T> {
    pub fn new(data: Vec<T>) -> Self {
        Self { object: "list", data }
    }
}

#[derive(Debug, Serialize, ToSchema)]
pub struct Health {
    /// "ok"; "degraded" (still 200) while the process's resident memory is above the configured
    /// budget (`--memory-budget-bytes`); with 503 "shutting_down" or (replicas)
    /// "database_unavailable".
    pub status: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// Why the replica is unavailable, or why it is degraded.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lift::AbsorbOptions;
    use crate::server::error::ApiError;
    use axum::http::HeaderMap;
    use serde::de::DeserializeOwned;

    /// The request bodies' fuzz target (`fuzz/fuzz_targets/request_bodies.rs`) needs the whole
    /// crate built with instrumentation, too long for CI; this runs its reader on 20,000 seeded
    /// mutations of real bodies instead (byte flips, cuts, splices, repeats, deep nesting): every
    /// one ends in a typed request or a 4xx in the API's shape, never a panic.
    #[test]
    fn mutated_request_bodies_end_in_a_request_or_a_4xx() {
        let seeds: Vec<Vec<u8>> = [
            r#"{"text": "The harbor was built in 1843.", "title": "Velmora", "options": {"window": 128, "epochs": [1, 2], "aux_qa": 8}, "dry_run": true}"#,
            r#"{"document_id": "doc_0123456789abcdef0123456789abcdef", "question": "Who built it?", "mode": "rag", "context": "bm25", "context_tokens": 64, "max_tokens": 8, "stream": true, "include_context": true}"#,
            r#"{"document_id": "doc_0123456789abcdef0123456789abcdef", "question": "When did it open?", "history": [{"role": "user", "content": "Tell me about the museum."}, {"role": "assistant", "content": "It shows tools."}]}"#,
            r#"{"model": "doc_0123456789abcdef0123456789abcdef", "messages": [{"role": "user", "content": "Hi"}], "stream": false, "temperature": 0.5, "mode": "lift"}"#,
            r#"{"text": "a", "text": "b"}"#,
        ]
        .iter()
        .map(|s| s.as_bytes().to_vec())
        .collect();
        let mut rng = crate::testing::Rng::new(7);
        let mut pick = |n: usize| ((rng.next_f32() + 1.0) / 2.0 * n as f32) as usize % n.max(1);
        let headers = HeaderMap::new();
        let mut refused = 0;
        for i in 0..20_000 {
            let mut b = seeds[i % seeds.len()].clone();
            for _ in 0..1 + pick(4) {
                let at = pick(b.len() + 1);
                match pick(6) {
                    0 if !b.is_empty() => {
                        let (i, bit) = (at.min(b.len() - 1), pick(8));
                        b[i] ^= 1 << bit;
                    }
                    1 => b.truncate(at),
                    2 => b.insert(at, [b'{', b'}', b'[', b']', b'"', b':', b',', b'0', b'e', b'-', b'\\', b'u', 0xff, b' ', b'n', b't'][pick(16)]),
                    3 => {
                        let other = &seeds[pick(seeds.len())];
                        let from = pick(other.len());
                        let _ = b.splice(at..at, other[from..].iter().copied().take(pick(40)));
                    }
                    4 => drop(b.splice(at..at, std::iter::repeat_n(b'[', 200 + pick(5000)))),
                    _ if at < b.len() => {
                        let piece = b[at..(at + pick(30)).min(b.len())].to_vec();
                        let _ = b.splice(at..at, piece.repeat(1 + pick(4)));
                    }
                    _ => {}
                }
            }
            let results = [
                json_body::<PostDocument>(&headers, &b, Body::Document).err(),
                json_body::<AskRequest>(&headers, &b, Body::Ask).err(),
                json_body::<ChatRequest>(&headers, &b, Body::Chat).err(),
            ];
            for e in results.into_iter().flatten() {
                assert!(e.status.is_client_error() && !e.code.is_empty(), "{e} for {:?}", String::from_utf8_lossy(&b));
                refused += 1;
            }
            if let Ok(text) = std::str::from_utf8(&b) {
                let _ = parse_unique(text);
            }
        }
        assert!(refused > 20_000, "the mutations were mostly refused ({refused})");
    }

    fn parse<T: DeserializeOwned>(body: serde_json::Value, kind: Body) -> ApiError {
        json_body::<T>(&HeaderMap::new(), body.to_string().as_bytes(), kind).err().expect("refused")
    }

    #[test]
    fn field_errors_name_the_field_by_its_path() {
        let e = parse::<PostDocument>(serde_json::json!({"text": "x", "options": {"colour": "red"}}), Body::Document);
        assert_eq!((e.code, e.param.as_deref()), ("unknown_option", Some("options.colour")), "{e}");
        let e = parse::<PostDocument>(serde_json::json!({"text": "x", "options": {"window": "big"}}), Body::Document);
        assert_eq!((e.code, e.param.as_deref()), ("invalid_option", Some("options.window")), "{e}");
        assert!(e.message.contains("'options.window'") && e.message.contains("invalid type"), "{e}");
        let e = parse::<PostDocument>(serde_json::json!({"text": 5}), Body::Document);
        assert_eq!((e.code, e.param.as_deref()), ("invalid_type", Some("text")), "{e}");
        let e = parse::<AskRequest>(serde_json::json!({"document_id": "d", "question": "q", "colour": 1}), Body::Ask);
        assert_eq!((e.code, e.param.as_deref()), ("unknown_field", Some("colour")), "{e}");
        let e = parse::<AskRequest>(serde_json::json!({"question": "q", "mode": "psychic"}), Body::Ask);
        assert_eq!((e.code, e.param.as_deref()), ("invalid_mode", Some("mode")), "{e}");
        let body = serde_json::json!({"model": "m", "messages": [{"role": "wizard", "content": "x"}]});
        let e = parse::<ChatRequest>(body, Body::Chat);
        assert_eq!((e.code, e.param.as_deref()), ("invalid_messages", Some("messages[0].role")), "{e}");
    }

    #[test]
    fn history_is_checked_turn_by_turn() {
        let ask = |history: serde_json::Value| serde_json::json!({"document_id": "d", "question": "When did it open?", "history": history});
        for (history, param) in [
            (serde_json::json!("Tell me about the museum"), "history"),
            (serde_json::json!([{"role": "system", "content": "x"}]), "history[0].role"),
            (serde_json::json!([{"role": "user", "content": 5}]), "history[0].content"),
            (serde_json::json!([{"role": "user", "content": "x", "name": "n"}]), "history[0].name"),
            (serde_json::json!([{"role": "user", "content": "x"}, {"content": "x"}]), "history[1]"),
        ] {
            let e = parse::<AskRequest>(ask(history.clone()), Body::Ask);
            assert_eq!((e.code, e.param.as_deref()), ("invalid_history", Some(param)), "{history}: {e}");
        }
        let limits = GenerationLimits { max_question_chars: 60, max_tokens_limit: 8, default_max_tokens: 8 };
        let valid = |history: serde_json::Value| {
            json_body::<AskRequest>(&HeaderMap::new(), ask(history).to_string().as_bytes(), Body::Ask).unwrap().validate(&limits)
        };
        let turns = serde_json::json!([{"role": "user", "content": "Tell me about the museum."}, {"role": "assistant", "content": "Tools."}]);
        let (q, ..) = valid(turns).unwrap();
        let got: Vec<(&str, &str)> = q.history.iter().map(|m| (m.role.as_str(), m.content.as_str())).collect();
        assert_eq!(got, [("user", "Tell me about the museum."), ("assistant", "Tools.")]);
        // The question (17 characters) and the turns share the question limit (60).
        let e = valid(serde_json::json!([{"role": "user", "content": "x".repeat(44)}])).err().unwrap();
        assert_eq!((e.status.as_u16(), e.code, e.param.as_deref()), (400, "history_too_long", Some("history")), "{e}");
        assert!(valid(serde_json::json!([{"role": "user", "content": "x".repeat(43)}])).is_ok());
        let many: Vec<_> = (0..=MAX_HISTORY_TURNS).map(|_| serde_json::json!({"role": "user", "content": ""})).collect();
        let e = valid(serde_json::json!(many)).err().unwrap();
        assert_eq!((e.code, e.param.as_deref()), ("invalid_history", Some("history")), "{e}");
        // Without a history the question is on its own, as before.
        assert!(valid(serde_json::Value::Null).unwrap().0.history.is_empty());
    }

    #[test]
    fn option_bounds_name_the_limit_and_the_value() {
        let o = DocumentOptions { window: Some(8), ..Default::default() };
        let e = o.apply(&AbsorbOptions::default(), 30, 2048).err().expect("refused");
        assert_eq!((e.code, e.param.as_deref()), ("invalid_option", Some("options.window")));
        assert!(e.message.contains("32") && e.message.contains("2048") && e.message.contains("got 8"), "{e}");
        let o = DocumentOptions { epochs: Some([0, 0]), ..Default::default() };
        let e = o.apply(&AbsorbOptions::default(), 30, 2048).err().expect("refused");
        assert_eq!(e.param.as_deref(), Some("options.epochs"));
        let o = DocumentOptions { aux_qa: Some(5), window: Some(64), stride: Some(64), ..Default::default() };
        let a = o.apply(&AbsorbOptions::default(), 30, 2048).unwrap();
        assert_eq!((a.qa.max_pairs, a.plan.window, a.plan.stride()), (5, 64, 64));
    }
}
