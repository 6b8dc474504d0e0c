//! The built-in web page (`GET /`): one HTML file, its script and its style sheet, embedded in
//! the binary at build time (no toolchain beyond cargo). Served without a key: the page holds no
//! data; it asks for the tenant key itself and sends it with every API call.

use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use sha2::{Digest, Sha256};
use std::sync::OnceLock;

/// One embedded file.
pub struct Asset {
    pub path: &'static str,
    pub content_type: &'static str,
    pub body: &'static str,
}

/// Every file of the page, by the path it is served under.
pub const ASSETS: &[Asset] = &[
    Asset { path: "/", content_type: "text/html; charset=utf-8", body: include_str!("web/index.html") },
    Asset { path: "/ui/app.js", content_type: "text/javascript; charset=utf-8", body: include_str!("web/app.js") },
    Asset { path: "/ui/style.css", content_type: "text/css; charset=utf-8", body: include_str!("web/style.css") },
    Asset { path: "/ui/icon.svg", content_type: "image/svg+xml", body: include_str!("web/icon.svg") },
];

/// Whether `path` is one of the page's files (served without a key).
pub fn is_page(path: &str) -> bool {
    ASSETS.iter().any(|a| a.path == path)
}

/// An asset as served: its strong ETag and, when smaller, its gzip encoding (with its own tag).
struct Prepared {
    etag: String,
    gzip: Option<(Vec<u8>, String)>,
}

/// Every asset's [`Prepared`] form, computed once (the page is ~50 KB raw, ~16 KB gzipped).
fn prepared() -> &'static [Prepared] {
    static PREPARED: OnceLock<Vec<Prepared>> = OnceLock::new();
    PREPARED.get_or_init(|| {
        ASSETS
            .iter()
            .map(|a| {
                let tag = hex::encode(&Sha256::digest(a.body)[..12]);
                let gzip = gzip(a.body.as_bytes()).filter(|z| z.len() < a.body.len()).map(|z| (z, format!("\"{tag}-gz\"")));
                Prepared { etag: format!("\"{tag}\""), gzip }
            })
            .collect()
    })
}

fn gzip(bytes: &[u8]) -> Option<Vec<u8>> {
    use std::io::Write;
    let mut z = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
    z.write_all(bytes).ok()?;
    z.finish().ok()
}

/// Whether the client takes gzip (`Accept-Encoding`, a `q=0` refusal honoured).
fn accepts_gzip(headers: &HeaderMap) -> bool {
    let Some(v) = headers.get(header::ACCEPT_ENCODING).and_then(|v| v.to_str().ok()) else { return false };
    v.split(',').any(|item| {
        let mut parts = item.split(';').map(str::trim);
        let coding = parts.next().unwrap_or("");
        let q = parts.find_map(|p| p.strip_prefix("q=")).and_then(|q| q.trim().parse::<f32>().ok()).unwrap_or(1.0);
        (coding.eq_ignore_ascii_case("gzip") || coding == "*") && q > 0.0
    })
}

fn serve(path: &str, headers: &HeaderMap) -> Response {
    let Some(i) = ASSETS.iter().position(|a| a.path == path) else {
        return super::error::ApiError::not_found("route_not_found", "no such route").into_response();
    };
    let (asset, prepared) = (&ASSETS[i], &prepared()[i]);
    let gzip = prepared.gzip.as_ref().filter(|_| accepts_gzip(headers));
    let etag = gzip.map_or(&prepared.etag, |(_, tag)| tag);
    let cached = headers
        .get(header::IF_NONE_MATCH)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.split(',').any(|t| t.trim() == etag || t.trim() == "*"));
    let mut resp = match (cached, gzip) {
        (true, _) => StatusCode::NOT_MODIFIED.into_response(),
        (false, Some((body, _))) => body.clone().into_response(),
        (false, None) => asset.body.into_response(),
    };
    let h = resp.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(asset.content_type));
    if gzip.is_some() {
        h.insert(header::CONTENT_ENCODING, HeaderValue::from_static("gzip"));
    }
    h.insert(header::VARY, HeaderValue::from_static("accept-encoding"));
    if let Ok(tag) = HeaderValue::from_str(etag) {
        h.insert(header::ETAG, tag);
    }
    // Revalidated on every load (cheap: 304), so a new binary's page is never mixed with an old one's.
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    h.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    // Document text and answers are shown as text, never as markup; the policy backs that up.
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; object-src 'none'; \
             frame-ancestors 'none'; base-uri 'none'",
        ),
    );
    resp
}

/// `GET /`.
pub async fn index(headers: HeaderMap) -> Response {
    serve("/", &headers)
}

/// `GET /ui/{file}`.
pub async fn asset(super::api::PathParam(file): super::api::PathParam, headers: HeaderMap) -> Response {
    serve(&format!("/ui/{file}"), &headers)
}
