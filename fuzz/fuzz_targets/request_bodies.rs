//! The JSON request bodies (`POST /documents`, `/ask`, `/v1/chat/completions`) through the
//! server's one body reader: any bytes end in a typed request or an API error, never a panic.
#![no_main]
use libfuzzer_sys::fuzz_target;
use lift_serve::server::api::{json_body, parse_unique, AskRequest, Body, ChatRequest, PostDocument};

fuzz_target!(|data: &[u8]| {
    let headers = axum::http::HeaderMap::new();
    let _ = json_body::<PostDocument>(&headers, data, Body::Document);
    let _ = json_body::<AskRequest>(&headers, data, Body::Ask);
    let _ = json_body::<ChatRequest>(&headers, data, Body::Chat);
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = parse_unique(text);
    }
});
