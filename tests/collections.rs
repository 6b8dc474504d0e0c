//! Collections over real HTTP: the tiny random model, real absorbs, a real socket. What is
//! asserted is what retrieval and routing chose (the documents and passages read, whose adapter
//! answered), never the tiny model's text.

mod common;

use common::tiny_server::{assert_error_shape, client, config, env, start, wait_ready};
use common::{get_json, post_json};
use reqwest::{Client, StatusCode};
use serde_json::{json, Value};

const HARBOR: &str = "The harbor of Velmora was built in 1843 by the engineer Ada Quill. \
It has three piers for fishing boats, ferries and cargo. \
The lighthouse keeper, Tomas Brell, painted the tower blue in 1901. \
Every spring the town holds a lantern festival on the east pier.";

const ORCHARD: &str = "The orchard of Brindle grows pears and quinces on the south slope. \
The orchard keeper, Mira Falk, planted the first quince tree in 1877. \
Cider pressed from the orchard is sold at the autumn market. \
Bees from six hives pollinate the blossoms every April.";

const MILL: &str = "The mill at Hollow Creek grinds rye with a wooden water wheel. \
The miller, Otto Vance, rebuilt the sluice gate after the flood of 1912. \
Flour from the mill is carried to the bakeries by a mule cart. \
The millpond freezes in January and the children skate on it.";

async fn post_doc(c: &Client, base: &str, text: &str, title: &str, key: Option<&str>) -> String {
    let (s, d) = post_json(c, &format!("{base}/documents"), json!({"text": text, "title": title}), key).await;
    assert!(s == StatusCode::ACCEPTED || s == StatusCode::OK, "{d}");
    d["id"].as_str().unwrap().to_string()
}

async fn send(c: &Client, method: reqwest::Method, url: &str, body: Option<Value>, key: Option<&str>) -> (StatusCode, Value) {
    let mut r = c.request(method, url);
    if let Some(b) = body {
        r = r.json(&b);
    }
    if let Some(k) = key {
        r = r.bearer_auth(k);
    }
    let resp = r.send().await.unwrap();
    let s = resp.status();
    (s, resp.json().await.unwrap_or(Value::Null))
}

fn ids(v: &Value) -> Vec<String> {
    v["document_ids"].as_array().unwrap().iter().map(|d| d.as_str().unwrap().to_string()).collect()
}

/// Create, read, list, change, delete; every refusal in the error shape and changing nothing;
/// a document deleted leaves its collections; asking an empty collection is 409.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn collection_crud_and_refusals() {
    let e = env();
    let mut cfg = config(&e, &[]);
    cfg.max_collection_documents = 2;
    let (running, base) = start(cfg).await;
    let c = client();
    let h = post_doc(&c, &base, HARBOR, "Harbor", None).await;
    let o = post_doc(&c, &base, ORCHARD, "Orchard", None).await;
    let m = post_doc(&c, &base, MILL, "Mill", None).await;

    let (s, col) = post_json(&c, &format!("{base}/collections"), json!({"title": "Towns", "document_ids": [h]}), None).await;
    assert_eq!(s, StatusCode::CREATED, "{col}");
    let id = col["id"].as_str().unwrap().to_string();
    assert!(id.starts_with("col_") && id.len() == 36, "{id}");
    assert_eq!((col["object"].as_str(), col["title"].as_str()), (Some("collection"), Some("Towns")));
    assert_eq!(ids(&col), [h.clone()]);
    let url = format!("{base}/collections/{id}");

    // Refusals: nothing changes.
    let unknown = format!("doc_{}", "ab".repeat(16));
    let (s, v) = send(&c, reqwest::Method::PATCH, &url, Some(json!({"add": [o, unknown]})), None).await;
    assert_eq!(s, StatusCode::NOT_FOUND, "{v}");
    assert_error_shape(&v, "document_not_found", "unknown document");
    assert!(v["error"]["message"].as_str().unwrap().contains(&unknown), "names the id: {v}");
    let (s, v) = send(&c, reqwest::Method::PATCH, &url, Some(json!({"add": [o, m]})), None).await;
    assert_eq!((s, v["error"]["param"].as_str()), (StatusCode::PAYLOAD_TOO_LARGE, Some("add")), "{v}");
    assert_error_shape(&v, "collection_too_large", "over the limit");
    let (s, v) = send(&c, reqwest::Method::PATCH, &url, Some(json!({"remove": [o]})), None).await;
    assert_eq!(s, StatusCode::NOT_FOUND, "{v}");
    assert_error_shape(&v, "document_not_found", "not a member");
    let (s, v) = send(&c, reqwest::Method::PATCH, &url, Some(json!({"colour": "red"})), None).await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    assert_error_shape(&v, "unknown_field", "unknown field");
    let (s, v) = post_json(&c, &format!("{base}/collections"), json!({"document_ids": [h, o, m]}), None).await;
    assert_eq!(s, StatusCode::PAYLOAD_TOO_LARGE, "{v}");
    let (s, v) = post_json(&c, &format!("{base}/collections"), json!({"document_ids": "doc_x"}), None).await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    let (_, v) = get_json(&c, &url, None).await;
    assert_eq!((ids(&v), v["title"].as_str()), (vec![h.clone()], Some("Towns")), "refusals changed nothing");
    let (_, list) = get_json(&c, &format!("{base}/collections"), None).await;
    assert_eq!(list["data"].as_array().unwrap().len(), 1, "a refused POST made nothing: {list}");

    // Changes.
    let (s, v) = send(&c, reqwest::Method::PATCH, &url, Some(json!({"title": "Places", "add": [o]})), None).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!((ids(&v), v["title"].as_str()), (vec![h.clone(), o.clone()], Some("Places")));
    let (s, v) = send(&c, reqwest::Method::PATCH, &url, Some(json!({"remove": [h], "add": [m]})), None).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(ids(&v), [o.clone(), m.clone()]);

    // A document posted into a full collection is refused before it is queued; one with room joins.
    let (s, v) = post_json(&c, &format!("{base}/documents"), json!({"text": "The bridge opened in 1920.", "collection": id}), None).await;
    assert_eq!(s, StatusCode::PAYLOAD_TOO_LARGE, "{v}");
    assert_eq!(v["error"]["param"], "collection", "{v}");
    let (_, docs) = get_json(&c, &format!("{base}/documents"), None).await;
    assert_eq!(docs["data"].as_array().unwrap().len(), 3, "nothing was queued: {docs}");
    let (s, v) = post_json(&c, &format!("{base}/documents"), json!({"text": "x", "collection": format!("col_{}", "0".repeat(32))}), None).await;
    assert_eq!(s, StatusCode::NOT_FOUND, "{v}");
    assert_error_shape(&v, "collection_not_found", "unknown collection");
    send(&c, reqwest::Method::PATCH, &url, Some(json!({"remove": [m]})), None).await;
    let (s, d) = post_json(&c, &format!("{base}/documents"), json!({"text": HARBOR, "title": "Harbor", "collection": id}), None).await;
    assert_eq!((s, d["id"].as_str()), (StatusCode::OK, Some(h.as_str())), "{d}");
    let (_, v) = get_json(&c, &url, None).await;
    assert_eq!(ids(&v), [o.clone(), h.clone()], "the posted document joined");

    // Listed as a model.
    let (_, models) = get_json(&c, &format!("{base}/v1/models"), None).await;
    let card = models["data"].as_array().unwrap().iter().find(|x| x["id"] == id.as_str()).cloned();
    assert_eq!(card.map(|c| c["title"].clone()), Some(json!("Places")), "{models}");

    // Deleting its documents leaves it empty: asking it is 409.
    for d in [&o, &h] {
        let (s, _) = send(&c, reqwest::Method::DELETE, &format!("{base}/documents/{d}"), None, None).await;
        assert_eq!(s, StatusCode::NO_CONTENT);
    }
    let (_, v) = get_json(&c, &url, None).await;
    assert!(ids(&v).is_empty(), "{v}");
    let (s, v) = post_json(&c, &format!("{base}/ask"), json!({"collection_id": id, "question": "Who built the harbor?"}), None).await;
    assert_eq!(s, StatusCode::CONFLICT, "{v}");
    assert_error_shape(&v, "collection_empty", "empty collection");

    // It outlives a restart (files registry), then goes.
    running.shutdown().await;
    let (running, base) = start(config(&e, &[])).await;
    let url = format!("{base}/collections/{id}");
    let (s, v) = get_json(&c, &url, None).await;
    assert_eq!((s, v["title"].as_str()), (StatusCode::OK, Some("Places")), "{v}");
    let (s, _) = send(&c, reqwest::Method::DELETE, &url, None, None).await;
    assert_eq!(s, StatusCode::NO_CONTENT);
    let (s, v) = get_json(&c, &url, None).await;
    assert_eq!(s, StatusCode::NOT_FOUND, "{v}");
    assert_error_shape(&v, "collection_not_found", "deleted");
    let (s, v) = get_json(&c, &format!("{base}/collections/doc_{}", "0".repeat(32)), None).await;
    assert_eq!(s, StatusCode::NOT_FOUND, "a document id is no collection: {v}");
    running.shutdown().await;
}

/// Another tenant's collection is 404 everywhere, and its documents cannot be put in one's own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn collections_belong_to_their_tenant() {
    let e = env();
    let (running, base) = start(config(&e, &["key-a", "key-b"])).await;
    let c = client();
    let (a, b) = (Some("key-a"), Some("key-b"));
    let ha = post_doc(&c, &base, HARBOR, "Harbor", a).await;
    let ob = post_doc(&c, &base, ORCHARD, "Orchard", b).await;
    let (s, col) = post_json(&c, &format!("{base}/collections"), json!({"document_ids": [ha]}), a).await;
    assert_eq!(s, StatusCode::CREATED, "{col}");
    let id = col["id"].as_str().unwrap().to_string();
    let url = format!("{base}/collections/{id}");

    let (s, v) = get_json(&c, &url, b).await;
    assert_eq!(s, StatusCode::NOT_FOUND, "{v}");
    assert_error_shape(&v, "collection_not_found", "foreign get");
    let (s, v) = send(&c, reqwest::Method::PATCH, &url, Some(json!({"add": [ob]})), b).await;
    assert_eq!(s, StatusCode::NOT_FOUND, "{v}");
    let (s, _) = send(&c, reqwest::Method::DELETE, &url, None, b).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    let (s, v) = post_json(&c, &format!("{base}/ask"), json!({"collection_id": id, "question": "Who built the harbor?", "mode": "rag"}), b).await;
    assert_eq!(s, StatusCode::NOT_FOUND, "{v}");
    let chat = json!({"model": id, "messages": [{"role": "user", "content": "Who built the harbor?"}]});
    let (s, v) = post_json(&c, &format!("{base}/v1/chat/completions"), chat, b).await;
    assert_eq!((s, v["error"]["code"].as_str()), (StatusCode::NOT_FOUND, Some("model_not_found")), "{v}");
    let (_, list) = get_json(&c, &format!("{base}/collections"), b).await;
    assert!(list["data"].as_array().unwrap().is_empty(), "{list}");
    let (_, models) = get_json(&c, &format!("{base}/v1/models"), b).await;
    assert!(!models.to_string().contains(&id), "{models}");

    // A's collection with B's document: 404 naming it, nothing added.
    let (s, v) = send(&c, reqwest::Method::PATCH, &url, Some(json!({"add": [ob]})), a).await;
    assert_eq!(s, StatusCode::NOT_FOUND, "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains(&ob), "{v}");
    let (s, v) = post_json(&c, &format!("{base}/collections"), json!({"document_ids": [ob]}), a).await;
    assert_eq!(s, StatusCode::NOT_FOUND, "{v}");
    let (_, v) = get_json(&c, &url, a).await;
    assert_eq!(ids(&v), [ha]);
    running.shutdown().await;
}

/// Three documents, two absorbed and one held in the training queue: each question reads the
/// passage of the document that holds its answer; `lift` answers with that document's adapter
/// when it is absorbed, as `rag` when it is not; the chat completion of the collection model
/// says the same; other modes and policies are refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_collection_question_reads_the_right_document_and_routes_to_its_adapter() {
    let e = env();
    let (running, base) = start(config(&e, &[])).await;
    let c = client();
    let h = post_doc(&c, &base, HARBOR, "Harbor", None).await;
    let o = post_doc(&c, &base, ORCHARD, "Orchard", None).await;
    wait_ready(&c, &base, &h, None).await;
    wait_ready(&c, &base, &o, None).await;
    // The mill stays queued while training is held.
    let (hold, held) = std::sync::mpsc::channel::<()>();
    running.state.service.engine.hold_training(held).unwrap();
    let m = post_doc(&c, &base, MILL, "Mill", None).await;
    let (s, col) = post_json(&c, &format!("{base}/collections"), json!({"title": "Towns", "document_ids": [h, o, m]}), None).await;
    assert_eq!(s, StatusCode::CREATED, "{col}");
    let id = col["id"].as_str().unwrap().to_string();

    let ask = |q: &str, mode: &str| json!({"collection_id": id, "question": q, "mode": mode, "max_tokens": 4, "include_context": true});
    for (q, want, fact) in [
        ("Who planted the first quince tree in the orchard?", &o, "quince"),
        ("Who painted the lighthouse tower blue?", &h, "blue"),
        ("Who rebuilt the sluice gate of the mill?", &m, "sluice"),
    ] {
        let (s, a) = post_json(&c, &format!("{base}/ask"), ask(q, "lift"), None).await;
        assert_eq!(s, 200, "{a}");
        assert_eq!(a["document_id"], want.as_str(), "{q}: {a}");
        let passages = a["collection"]["passages"].as_array().unwrap();
        assert_eq!(passages[0]["document_id"], want.as_str(), "{q}: best passage: {a}");
        let chunks = a["context"]["chunks"].as_array().unwrap();
        let best = chunks.iter().find(|ch| ch["document_id"] == want.as_str()).expect("the document's passage in context");
        assert!(best["text"].as_str().unwrap().contains(fact), "{q}: {best}");
        assert_eq!(a["collection"]["id"], id.as_str());
        let titles: Vec<&str> = a["collection"]["documents"].as_array().unwrap().iter().filter_map(|d| d["title"].as_str()).collect();
        assert!(!titles.is_empty(), "{a}");
        if want == &m {
            // Not absorbed: answered from the passages, no adapter.
            assert_eq!((a["mode"].as_str(), &a["adapter"]), (Some("rag"), &Value::Null), "{a}");
        } else {
            assert_eq!(a["mode"], "lift", "{a}");
            assert_eq!(a["adapter"]["document_id"], want.as_str(), "routed to the document's adapter: {a}");
            assert!(a["adapter"]["step"].as_u64().unwrap() > 0, "{a}");
        }
        // `rag` reads the same passages, with no adapter.
        let (s, r) = post_json(&c, &format!("{base}/ask"), ask(q, "rag"), None).await;
        assert_eq!(s, 200, "{r}");
        assert_eq!((r["document_id"].as_str(), r["mode"].as_str(), &r["adapter"]), (Some(want.as_str()), Some("rag"), &Value::Null), "{r}");
        assert_eq!(r["collection"]["passages"], a["collection"]["passages"], "{q}");
        // Self-gated as a document's answer: the adapter's, or exactly the passages' own.
        match (want == &m, a["answered_by"].as_str()) {
            (true, by) => assert_eq!(by, None, "{a}"),
            (false, Some("passages")) => assert_eq!(a["answer"], r["answer"], "{q}: {a} / {r}"),
            (false, by) => assert_eq!(by, Some("adapter"), "{a}"),
        }
    }

    // The collection as a chat model: the same routing in the extension.
    let chat = json!({"model": id, "messages": [{"role": "user", "content": "Who planted the first quince tree in the orchard?"}],
                      "max_tokens": 3, "include_context": true});
    let (s, r) = post_json(&c, &format!("{base}/v1/chat/completions"), chat, None).await;
    assert_eq!(s, 200, "{r}");
    assert_eq!((r["lift"]["document_id"].as_str(), r["lift"]["adapter"]["document_id"].as_str()), (Some(o.as_str()), Some(o.as_str())), "{r}");
    assert!(r["lift"]["context"]["chunks"].as_array().unwrap().iter().all(|ch| ch["document_id"].is_string()), "{r}");

    // Only lift and rag, only bm25; both fields at once is refused.
    for (body, code, param) in [
        (json!({"collection_id": id, "question": "q", "mode": "icl"}), "unsupported_mode", "mode"),
        (json!({"collection_id": id, "question": "q", "mode": "memory"}), "unsupported_mode", "mode"),
        (json!({"collection_id": id, "question": "q", "context": "head_tail"}), "unsupported_context", "context"),
        (json!({"collection_id": id, "document_id": h, "question": "q"}), "conflicting_fields", "collection_id"),
    ] {
        let (s, v) = post_json(&c, &format!("{base}/ask"), body.clone(), None).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{body}: {v}");
        assert_error_shape(&v, code, &body.to_string());
        assert_eq!(v["error"]["param"], param, "{v}");
        if code == "unsupported_mode" {
            let msg = v["error"]["message"].as_str().unwrap();
            assert!(msg.contains("lift") && msg.contains("rag"), "names what is supported: {v}");
        }
    }
    let (s, v) = post_json(&c, &format!("{base}/ask"), json!({"collection_id": format!("col_{}", "1".repeat(32)), "question": "q"}), None).await;
    assert_eq!((s, v["error"]["param"].as_str()), (StatusCode::NOT_FOUND, Some("collection_id")), "{v}");
    drop(hold);
    running.shutdown().await;
}
