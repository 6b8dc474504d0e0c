//! The web page (`GET /`) end to end in a real browser: headless Chromium driven over WebDriver
//! (chromedriver), against the server in-process on a real socket. Screenshots of each step go to
//! target/web-screenshots/. Needs Debian's chromium and chromium-driver (scripts/test.sh installs
//! them); without them the tests fail.
//!
//! Run: `cargo test --release --test web -- --test-threads=1 --nocapture`

mod webdriver;

use fantoccini::Locator;
use lift_serve::server::{self, Running, ServeConfig};
use lift_serve::testing::{write_hf, TinySpec};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::time::Duration;
use webdriver::{Browser, Driver};

const TINY_DOC: &str = "The harbor of Velmora was built in 1843 by the engineer Ada Quill. \
It has three piers: the north pier for fishing boats, the east pier for ferries and the south pier for cargo. \
The lighthouse keeper, Tomas Brell, painted the tower blue in 1901.";

fn shots() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("target/web-screenshots")
}

async fn shot(b: &Browser, name: &str) {
    let p = b.screenshot_to(&shots(), name).await;
    eprintln!("screenshot: {}", p.display());
}

async fn start(c: ServeConfig) -> (Running, String) {
    let state = server::build_state(c, &candle_core::Device::Cpu).unwrap();
    let running = server::start(state).await.unwrap();
    let base = format!("http://{}", running.addr);
    (running, base)
}

fn write_options(dir: &Path, window: usize, context: usize) -> PathBuf {
    let p = dir.join("absorb.json");
    let o = json!({"plan": {"window": window, "context_tokens": context}, "train": {"epochs": [1, 1]},
                   "qa": {"use_model": false, "max_pairs": 4, "min_pairs": 2}});
    std::fs::write(&p, o.to_string()).unwrap();
    p
}

fn http() -> reqwest::Client {
    reqwest::Client::builder().timeout(Duration::from_secs(300)).build().unwrap()
}

/// The page's error toasts: [[code, message], …].
async fn toasts(b: &Browser) -> Vec<(String, String)> {
    let v = b
        .js("return [...document.querySelectorAll('#toasts .toast.error')].map(t => [t.dataset.code || '', t.querySelector('.toast-msg').textContent])")
        .await;
    v.as_array().unwrap().iter().map(|p| (p[0].as_str().unwrap().to_string(), p[1].as_str().unwrap().to_string())).collect()
}

async fn assert_no_error_toasts(b: &Browser, ctx: &str) {
    let t = toasts(b).await;
    assert!(t.is_empty(), "{ctx}: the page shows errors: {t:?}");
}

async fn click(b: &Browser, css: &str) {
    b.find(Locator::Css(css)).await.unwrap_or_else(|e| panic!("{css}: {e}")).click().await.unwrap_or_else(|e| panic!("click {css}: {e}"));
}

async fn type_into(b: &Browser, css: &str, text: &str) {
    let e = b.find(Locator::Css(css)).await.unwrap_or_else(|e| panic!("{css}: {e}"));
    e.clear().await.unwrap();
    e.send_keys(text).await.unwrap();
}

/// The selected document's status as the page shows it.
async fn page_status(b: &Browser) -> String {
    b.js("return document.getElementById('doc-status').dataset.status").await.as_str().unwrap_or("").to_string()
}

/// Waits until the page's list has loaded (its empty note or a row shows).
async fn wait_list_loaded(b: &Browser) {
    b.wait_js("the document list", Duration::from_secs(20),
        "return !document.getElementById('doc-empty').hidden || document.querySelectorAll('#doc-list li').length > 0",
        |v| v == &json!(true)).await;
}

/// Asks through the page (question box, ask button) and waits until every answer column is done;
/// returns {mode: answer text}.
async fn ask_on_page(b: &Browser, question: &str, modes: &[&str], timeout: Duration) -> serde_json::Map<String, Value> {
    type_into(b, "#question", question).await;
    b.wait_js("the ask button enabled", Duration::from_secs(10), "return !document.getElementById('ask-button').disabled", |v| v == &json!(true)).await;
    click(b, "#ask-button").await;
    let script = format!(
        "return {modes:?}.map(m => {{ const c = document.getElementById('answer-' + m); return c ? c.dataset.state : 'missing'; }})"
    );
    let states = b
        .wait_js(&format!("answers in {modes:?}"), timeout, &script, |v| {
            v.as_array().unwrap().iter().all(|s| s == "done" || s == "error")
        })
        .await;
    assert!(states.as_array().unwrap().iter().all(|s| s == "done"), "answer states {states}; toasts: {:?}", toasts(b).await);
    let mut out = serde_json::Map::new();
    for m in modes {
        let t = b.js(&format!("return document.getElementById('answer-{m}-text').textContent")).await;
        out.insert(m.to_string(), t);
    }
    out
}

/// Issue 18's flow on the real default model: upload a file through the page, watch it absorb
/// (status, progress, loss curve), ask in lift mode (the streamed answer is the server's answer),
/// then compare lift / icl / memory side by side.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_model_upload_absorb_ask_compare() {
    let model = lift_serve::fetch::resolve_model(None).expect("default model (run `lift-serve fetch-model`)");
    let tmp = tempfile::tempdir().unwrap();
    let mut cfg = ServeConfig::new(model, tmp.path().join("adapters"));
    cfg.absorb_options = Some(write_options(tmp.path(), 64, 64));
    // The repository's prepared base belongs to the default model; with it answers in lift mode
    // report their context chunks with FltLM scores, which the page highlights.
    let prepared = Path::new(env!("CARGO_MANIFEST_DIR")).join("base");
    if prepared.join("manifest.json").exists() {
        cfg.prepared_base = Some(prepared.display().to_string());
    }
    let (running, base) = start(cfg).await;

    // The document: the first ~700 bytes of the fixture, as a .txt file.
    let text = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/harbor_history.txt")).unwrap();
    let mut cut = 700;
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    let doc_text = &text[..cut];
    let doc_path = tmp.path().join("harbor_history.txt");
    std::fs::write(&doc_path, doc_text).unwrap();

    let driver = Driver::start();
    let b = driver.browser(1280, 900).await;
    b.goto(&base).await.unwrap();
    assert_eq!(b.title().await.unwrap(), "lift-serve");
    wait_list_loaded(&b).await;
    shot(&b, "01-empty").await;

    // The file goes through the file input (multipart/form-data: file, title).
    let input = b.find(Locator::Css("#file-input")).await.unwrap();
    input.send_keys(&doc_path.display().to_string()).await.unwrap();
    let shown = b.js("return document.getElementById('drop-text').textContent").await;
    assert!(shown.as_str().unwrap().contains("harbor_history.txt"), "the drop zone names the file: {shown}");
    type_into(&b, "#doc-title", "Harbor history").await;
    shot(&b, "02-chosen").await;
    click(&b, "#submit-doc").await;

    // Absorption, watched through the page only.
    let mut training_shot = false;
    let t0 = std::time::Instant::now();
    loop {
        let v = b
            .js("const c = document.getElementById('loss-canvas'); return [document.getElementById('doc-status').dataset.status, Number(c.dataset.points), Number(document.getElementById('progress').dataset.value)]")
            .await;
        let (status, points) = (v[0].as_str().unwrap().to_string(), v[1].as_u64().unwrap());
        if status == "ready" {
            break;
        }
        assert!(status != "failed" && status != "cancelled", "absorption ended {status}; toasts: {:?}", toasts(&b).await);
        if !training_shot && points >= 2 {
            shot(&b, "03-training").await;
            training_shot = true;
        }
        assert!(t0.elapsed() < Duration::from_secs(300), "not ready after 5 min (page says {v})");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    eprintln!("ready after {:.1} s", t0.elapsed().as_secs_f64());
    let points = b.js("return Number(document.getElementById('loss-canvas').dataset.points)").await.as_u64().unwrap();
    assert!(points >= 1, "the page plotted no loss point");
    let figures = b
        .js("return [...document.querySelectorAll('#figures .fig')].map(f => f.dataset.testid + '=' + f.querySelector('dd').textContent)")
        .await;
    let figures: Vec<String> = serde_json::from_value(figures).unwrap();
    assert!(figures.iter().any(|f| f.starts_with("adapter-kind=")), "the adapter's figures show: {figures:?}");
    for f in ["adapter-bytes=", "source-format=text", "source-filename=harbor_history.txt", "training-steps=", "training-final_loss="] {
        assert!(figures.iter().any(|x| x.starts_with(f)), "{f}: {figures:?}");
    }
    assert_eq!(b.js("return document.getElementById('progress').dataset.value").await, json!("100"));
    assert_no_error_toasts(&b, "after absorbing").await;
    eprintln!("loss points plotted: {points}; figures: {figures:?}");
    shot(&b, "04-ready").await;

    // The page's document is the server's.
    let list: Value = http().get(format!("{base}/documents")).send().await.unwrap().json().await.unwrap();
    let doc = &list["data"][0];
    assert_eq!(doc["status"], "ready");
    assert_eq!(doc["title"], "Harbor history");
    let id = doc["id"].as_str().unwrap().to_string();
    let row = b.js("return [...document.querySelectorAll('#doc-list li')].map(li => [li.dataset.id, li.dataset.status])").await;
    assert_eq!(row, json!([[id, "ready"]]));

    // Lift mode, streamed into the page; the same question without streaming gives the same text.
    let question = "Who founded the Saltmere Harbor Company?";
    let max_tokens = 24;
    type_into(&b, "#max-tokens", &max_tokens.to_string()).await;
    let answers = ask_on_page(&b, question, &["lift"], Duration::from_secs(180)).await;
    let page_lift = answers["lift"].as_str().unwrap().to_string();
    assert!(!page_lift.trim().is_empty(), "empty answer on the page");
    let direct: Value = http()
        .post(format!("{base}/ask"))
        .json(&json!({"document_id": id, "question": question, "mode": "lift", "max_tokens": max_tokens, "temperature": 0}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(page_lift, direct["answer"].as_str().unwrap(), "the page shows the server's answer ({direct})");
    let pieces = b.js("return Number(document.getElementById('answer-lift').dataset.pieces)").await;
    assert!(pieces.as_u64().unwrap() >= 2, "the answer arrived in pieces (token events): {pieces}");
    let meta = b.js("return document.querySelector('#answer-lift .ameta').textContent").await;
    assert!(meta.as_str().unwrap().contains("answer tok"), "timings and tokens show: {meta}");
    if direct["context"]["chunks"].as_array().is_some_and(|c| !c.is_empty()) {
        let n = b.js("return document.querySelectorAll('#answer-lift [data-testid=chunk]').length").await;
        assert_eq!(n.as_u64().unwrap() as usize, direct["context"]["chunks"].as_array().unwrap().len(), "context passages");
    }
    eprintln!("lift answer: {page_lift:?}");
    b.js("document.getElementById('answer-lift').scrollIntoView({block: 'center'})").await;
    shot(&b, "05-answer-lift").await;

    // Compare: three columns side by side.
    click(&b, "label.compare > span").await;
    let answers = ask_on_page(&b, question, &["lift", "icl", "memory"], Duration::from_secs(300)).await;
    assert_eq!(answers["lift"].as_str().unwrap(), page_lift, "greedy: the same lift answer again");
    let xs = b
        .js("return ['lift','icl','memory'].map(m => document.getElementById('answer-' + m).getBoundingClientRect().left)")
        .await;
    let xs: Vec<f64> = serde_json::from_value(xs).unwrap();
    assert!(xs[0] < xs[1] && xs[1] < xs[2], "three columns side by side: {xs:?}");
    for m in ["icl", "memory"] {
        eprintln!("{m} answer: {:?}", answers[m]);
    }
    assert_no_error_toasts(&b, "after comparing").await;
    b.js("document.getElementById('chat-panel').scrollIntoView()").await;
    shot(&b, "06-compare").await;

    b.close().await;
    running.shutdown().await;
}

/// Keys, errors, deletion and the narrow layout, on the tiny random model.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tiny_model_key_errors_delete_narrow() {
    let tmp = tempfile::tempdir().unwrap();
    let model = write_hf(&tmp.path().join("tiny"), &TinySpec::default()).unwrap();
    let mut cfg = ServeConfig::new(model, tmp.path().join("adapters"));
    cfg.absorb_options = Some(write_options(tmp.path(), 32, 16));
    cfg.api_keys = vec!["key-a".into()];
    cfg.max_tokens_limit = 64;
    cfg.default_max_tokens = 8;
    let (running, base) = start(cfg).await;

    let driver = Driver::start();
    let b = driver.browser(1280, 900).await;
    b.goto(&base).await.unwrap();

    // No key: the list answers 401 and the page asks for the key.
    b.wait_js("the key prompt", Duration::from_secs(20), "return !document.getElementById('auth-prompt').hidden", |v| v == &json!(true))
        .await;
    let prompt = b.js("return document.getElementById('auth-prompt').textContent").await;
    assert!(prompt.as_str().unwrap().contains("API key"), "{prompt}");
    shot(&b, "10-key-prompt").await;

    // A wrong key: asked again.
    type_into(&b, "#key-input", "wrong").await;
    click(&b, "#key-save").await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    b.wait_js("the key prompt again", Duration::from_secs(10), "return !document.getElementById('auth-prompt').hidden", |v| v == &json!(true))
        .await;

    // The right key: the list loads and the key is kept in the browser.
    type_into(&b, "#key-input", "key-a").await;
    click(&b, "#key-save").await;
    b.wait_js("the prompt gone", Duration::from_secs(10), "return document.getElementById('auth-prompt').hidden", |v| v == &json!(true))
        .await;
    wait_list_loaded(&b).await;
    assert_eq!(b.js("return localStorage.getItem('lift-serve.key')").await, json!("key-a"));

    // An API error shows on the page: an empty paste is 422 empty_document.
    click(&b, "#tab-paste").await;
    type_into(&b, "#paste-text", "   ").await;
    click(&b, "#submit-doc").await;
    let t = b
        .wait_js("the empty_document error", Duration::from_secs(10),
            "return [...document.querySelectorAll('#toasts .toast.error')].map(t => [t.dataset.code, t.querySelector('.toast-msg').textContent])",
            |v| v.as_array().is_some_and(|a| !a.is_empty()))
        .await;
    assert_eq!(t[0][0], "empty_document", "{t}");
    assert!(t[0][1].as_str().unwrap().contains("empty"), "the server's message shows: {t}");
    tokio::time::sleep(Duration::from_millis(400)).await; // the toast's entry animation
    let shown = b.find(Locator::Css("#toasts .toast.error")).await.unwrap();
    assert!(shown.is_displayed().await.unwrap(), "the error is visible");
    shot(&b, "11-error").await;
    b.js("document.querySelectorAll('#toasts .toast').forEach(t => t.remove())").await;

    {
        // An unsupported file type is refused by the server, and the page says so.
        let bad = tmp.path().join("image.png");
        std::fs::write(&bad, [0x89u8, b'P', b'N', b'G', 0, 1, 2, 3]).unwrap();
        click(&b, "#tab-file").await;
        b.find(Locator::Css("#file-input")).await.unwrap().send_keys(&bad.display().to_string()).await.unwrap();
        click(&b, "#submit-doc").await;
        let t = b
            .wait_js("the unsupported-file error", Duration::from_secs(10),
                "return [...document.querySelectorAll('#toasts .toast.error')].map(t => t.dataset.code)",
                |v| v.as_array().is_some_and(|a| !a.is_empty()))
            .await;
        assert_eq!(t, json!(["unsupported_format"]), "the server's refusal shows");
        tokio::time::sleep(Duration::from_millis(400)).await;
        shot(&b, "12-unsupported-file").await;
        b.js("document.querySelectorAll('#toasts .toast').forEach(t => t.remove())").await;
    }

    // A file dropped on the drop zone is the one to upload (a synthetic drop event).
    let dropped = b
        .js("const dt = new DataTransfer(); dt.items.add(new File(['dropped text'], 'dropped.md', {type: 'text/markdown'})); \
             document.getElementById('drop-zone').dispatchEvent(new DragEvent('drop', {dataTransfer: dt, bubbles: true, cancelable: true})); \
             return document.getElementById('drop-text').textContent")
        .await;
    assert!(dropped.as_str().unwrap().starts_with("dropped.md"), "{dropped}");

    // A document through the paste box, absorbed (tiny model: seconds).
    click(&b, "#tab-paste").await;
    b.js_args("document.getElementById('paste-text').value = arguments[0]", vec![json!(TINY_DOC)]).await;
    type_into(&b, "#doc-title", "Velmora").await;
    // The schedule chosen in the absorb options reaches the document's options.
    b.js("document.getElementById('opt-schedule').value = 'until_learned'").await;
    click(&b, "#submit-doc").await;
    b.wait_js("ready", Duration::from_secs(120), "return document.getElementById('doc-status').dataset.status", |v| {
        v == "ready" || v == "failed"
    })
    .await;
    assert_eq!(page_status(&b).await, "ready");
    let http = http();
    let list: Value = http.get(format!("{base}/documents")).bearer_auth("key-a").send().await.unwrap().json().await.unwrap();
    let id = list["data"][0]["id"].as_str().unwrap().to_string();
    assert!(list["data"][0]["options"]["train"]["until_learned"].is_object(), "{list}");
    // A streamed answer on the tiny model (random weights: any text).
    let answers = ask_on_page(&b, "Who built the harbor?", &["lift"], Duration::from_secs(60)).await;
    assert!(answers.contains_key("lift"));
    assert_no_error_toasts(&b, "after asking").await;
    // Context passages are highlighted by relevance (the tiny model has no FltLM filter, so the
    // page's own renderer is fed chunks shaped like an answer's `context.chunks`).
    let bg = b
        .js("const box = renderChunks([{start: 0, end: 8, score: 2.0, mask: 0.9, text: 'very relevant '}, \
                                       {start: 8, end: 16, score: 0.5, mask: 0.6, text: 'a little relevant '}, \
                                       {start: 16, end: 24, score: -1.0, mask: 0.1, text: 'not relevant'}], true); \
             document.getElementById('answer-lift').append(box); \
             return [...box.querySelectorAll('.chunk')].map(c => [getComputedStyle(c).backgroundColor, c.title])")
        .await;
    let alpha = |i: usize| -> f64 {
        let s = bg[i][0].as_str().unwrap();
        let parts: Vec<&str> = s.trim_end_matches(')').split(',').collect();
        if parts.len() == 4 { parts[3].trim().parse().unwrap() } else if s.starts_with("rgb(") { 1.0 } else { 0.0 }
    };
    assert!(alpha(0) > alpha(1) && alpha(1) > 0.0 && alpha(2) == 0.0, "highlight follows the score: {bg}");
    assert!(bg[0][1].as_str().unwrap().contains("mask 0.900"), "the mask shows in the tooltip: {bg}");
    b.js("document.querySelector('#answer-lift .chunks').scrollIntoView({block: 'center'})").await;
    shot(&b, "13-tiny-chunks").await;
    b.js("window.scrollTo(0, 0)").await;

    // Delete: dismissing the confirmation keeps the document; accepting removes it.
    let row = format!("#doc-list li[data-id='{id}'] [data-testid=delete]");
    click(&b, &row).await;
    assert!(b.get_alert_text().await.unwrap().contains("Delete"));
    b.dismiss_alert().await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(b.js("return document.querySelectorAll('#doc-list li').length").await, json!(1));
    click(&b, &row).await;
    b.accept_alert().await.unwrap();
    b.wait_js("the row gone", Duration::from_secs(10), "return document.querySelectorAll('#doc-list li').length", |v| v == &json!(0))
        .await;
    let list: Value = http.get(format!("{base}/documents")).bearer_auth("key-a").send().await.unwrap().json().await.unwrap();
    assert_eq!(list["data"], json!([]), "deleted on the server too");
    assert_eq!(page_status(&b).await, "", "the selection is cleared");
    assert_no_error_toasts(&b, "after deleting").await;
    shot(&b, "14-deleted").await;

    // Narrow screen: one column (the chat panel sits under the list, at the same x), no sideways scroll.
    b.set_viewport(400, 860).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let v = b
        .js("const r = id => document.getElementById(id).getBoundingClientRect(); \
             return [r('list-panel').left, r('chat-panel').left, r('list-panel').bottom, r('chat-panel').top, \
                     document.documentElement.scrollWidth, window.innerWidth]")
        .await;
    let v: Vec<f64> = serde_json::from_value(v).unwrap();
    assert_eq!(v[5], 400.0, "viewport width");
    assert_eq!(v[0], v[1], "one column: list and chat at the same x ({v:?})");
    assert!(v[3] > v[2], "the chat panel is below the list ({v:?})");
    assert!(v[4] <= 400.0, "no horizontal overflow ({v:?})");
    shot(&b, "15-narrow").await;
    b.js("document.getElementById('chat-panel').scrollIntoView()").await;
    shot(&b, "16-narrow-chat").await;

    b.close().await;
    running.shutdown().await;
}
