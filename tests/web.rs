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

/// The page's cost line as [planned steps, [warning codes]].
const COST_JS: &str =
    "return [document.getElementById('cost').dataset.steps, [...document.querySelectorAll('#cost-warnings li')].map(l => l.dataset.code)]";

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

/// Clicks `css` after scrolling it to the middle of the view (the chat's composer is sticky at
/// the bottom and would take a click meant for what it covers).
async fn click_centered(b: &Browser, css: &str) {
    b.js_args("document.querySelector(arguments[0]).scrollIntoView({block: 'center'})", vec![json!(css)]).await;
    click(b, css).await;
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

/// Asks through the page (question box, ask button) and waits until every answer of the new turn
/// is done; returns {mode: answer text}.
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

/// Who answered the newest turn's `mode` answer, as the page shows it: [text, mode, adapter].
async fn answered_by(b: &Browser, mode: &str) -> (String, String, String) {
    let v = b
        .js(&format!("const e = document.querySelector('#answer-{mode} [data-testid=answered-by]'); \
                      return e ? [e.textContent, e.dataset.mode, e.dataset.adapter] : ['', '', '']"))
        .await;
    let s = |i: usize| v[i].as_str().unwrap().to_string();
    (s(0), s(1), s(2))
}

/// Holds the engine's training thread until the returned sender is dropped (a document posted
/// meanwhile stays queued: asked before any adapter exists, deterministically).
async fn hold_training(running: &Running) -> std::sync::mpsc::Sender<()> {
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let engine = &running.state.service.engine;
    engine.hold_training(rx).unwrap();
    for _ in 0..500 {
        if engine.train_queue() == (0, 1) {
            return tx;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("the training thread never picked the holding task up");
}

async fn ask_direct(base: &str, body: Value) -> Value {
    let r = http().post(format!("{base}/ask")).json(&body).send().await.unwrap();
    assert_eq!(r.status(), 200);
    r.json().await.unwrap()
}

/// The page as a document chat on the real default model: the cost said before absorbing (a dry
/// run as the file is chosen, with the server's warnings), answers from the first second (before
/// any adapter: passages only), a follow-up in the same thread while the document absorbs, the
/// absorbed adapter's answer once ready (the same text the API gives), the passages it read on
/// demand, the four ways side by side, and the document deleted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_model_document_chat() {
    let model = lift_serve::fetch::resolve_model(None).expect("default model (run `lift-serve fetch-model`)");
    let tmp = tempfile::tempdir().unwrap();
    let mut cfg = ServeConfig::new(model, tmp.path().join("adapters"));
    // Tiny options (epochs [1, 1], 4 QA pairs): seconds of training, and the page must warn.
    cfg.absorb_options = Some(write_options(tmp.path(), 128, 64));
    // The repository's prepared base belongs to the default model; with it the passages read come
    // with the FltLM filter's scores, which the page highlights.
    let prepared = Path::new(env!("CARGO_MANIFEST_DIR")).join("base");
    if prepared.join("manifest.json").exists() {
        cfg.prepared_base = Some(prepared.display().to_string());
    }
    let (running, base) = start(cfg).await;
    let t_start = std::time::Instant::now();

    // The document: the first ~700 bytes of the fixture, as a .txt file.
    let text = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/harbor_history.txt")).unwrap();
    let mut cut = 700;
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    let doc_path = tmp.path().join("harbor_history.txt");
    std::fs::write(&doc_path, &text[..cut]).unwrap();

    let driver = Driver::start();
    let b = driver.browser(1280, 900).await;
    b.goto(&base).await.unwrap();
    assert_eq!(b.title().await.unwrap(), "lift-serve");
    wait_list_loaded(&b).await;
    // The bodies the page posts to /ask, to see what a follow-up sends.
    b.js("window.askBodies = []; const f = window.fetch; \
          window.fetch = (url, init) => { if (url === '/ask') window.askBodies.push(JSON.parse(init.body)); return f(url, init); }; \
          return null")
        .await;

    // Choosing the file asks the server what absorbing it costs (a dry run: nothing stored).
    b.find(Locator::Css("#file-input")).await.unwrap().send_keys(&doc_path.display().to_string()).await.unwrap();
    type_into(&b, "#doc-title", "Harbor history").await;
    let steps = b
        .wait_js("the cost", Duration::from_secs(30), "return document.getElementById('cost').dataset.steps || ''", |v| v != "")
        .await;
    let steps: u64 = steps.as_str().unwrap().parse().unwrap();
    let cost = b.js("return document.getElementById('cost-text').textContent").await;
    assert!(cost.as_str().unwrap().contains(&format!("{steps} training steps")) && cost.as_str().unwrap().contains("timed when the server started"), "{cost}");
    let warned = b.js("return [...document.querySelectorAll('#cost-warnings li')].map(l => l.dataset.code)").await;
    assert!(warned.as_array().unwrap().contains(&json!("few_epochs")), "the tiny options are flagged: {warned}");
    let list: Value = http().get(format!("{base}/documents")).send().await.unwrap().json().await.unwrap();
    assert_eq!(list["data"], json!([]), "a dry run stores nothing");
    shot(&b, "01-cost").await;

    // Posted while the training thread is held: asked before any adapter exists.
    let hold = hold_training(&running).await;
    click(&b, "#submit-doc").await;
    b.wait_js("queued", Duration::from_secs(30), "return document.getElementById('doc-status').dataset.status", |v| v == "queued").await;
    let list: Value = http().get(format!("{base}/documents")).send().await.unwrap().json().await.unwrap();
    let id = list["data"][0]["id"].as_str().unwrap().to_string();
    let eta = b.js("return document.getElementById('stat-eta').textContent").await;
    assert!(eta.as_str().unwrap().contains("estimate"), "the server's estimate counts down before training: {eta}");
    let max_tokens = 24;
    type_into(&b, "#max-tokens", &max_tokens.to_string()).await;
    let q1 = "Who founded the Saltmere Harbor Company?";
    let a1 = ask_on_page(&b, q1, &["lift"], Duration::from_secs(120)).await;
    let (by, mode, adapter) = answered_by(&b, "lift").await;
    assert_eq!((mode.as_str(), adapter.as_str()), ("rag", "none"), "no adapter yet: passages only ({by})");
    assert_eq!(by, "Passages only · no adapter yet", "asked before the adapter exists");
    let direct = ask_direct(&base, json!({"document_id": id, "question": q1, "max_tokens": max_tokens, "temperature": 0})).await;
    assert_eq!(a1["lift"], direct["answer"], "the page shows the server's answer ({direct})");
    assert!(direct.get("context").is_none(), "no passages unless asked: {direct}");
    let pieces = b.js("return Number(document.getElementById('answer-lift').dataset.pieces)").await;
    assert!(pieces.as_u64().unwrap() >= 2, "the answer arrived in pieces (token events): {pieces}");
    shot(&b, "02-before-adapter").await;
    drop(hold);

    // A follow-up in the same thread while it absorbs.
    b.wait_js("absorbing", Duration::from_secs(60), "return document.getElementById('doc-status').dataset.status", |v| v == "training" || v == "ready")
        .await;
    ask_on_page(&b, "When was the harbor built?", &["lift"], Duration::from_secs(120)).await;
    let (by, _, _) = answered_by(&b, "lift").await;
    assert!(!by.is_empty(), "the follow-up says who answered it");
    // The follow-up is sent with the conversation so far, as chat turns.
    let sent = b.js("return window.askBodies[window.askBodies.length - 1]").await;
    assert_eq!(sent["question"], "When was the harbor built?", "{sent}");
    assert_eq!(sent["history"], json!([{"role": "user", "content": q1}, {"role": "assistant", "content": a1["lift"].as_str().unwrap().trim()}]), "{sent}");
    let turns = b.js("return [...document.querySelectorAll('#thread .turn [data-testid=question]')].map(q => q.textContent)").await;
    assert_eq!(turns, json!([q1, "When was the harbor built?"]), "one thread, in order");
    shot(&b, "03-follow-up").await;

    // Absorbed: the adapter answers, the figures and the strip agree on the final loss.
    let t0 = std::time::Instant::now();
    b.wait_js("ready", Duration::from_secs(120), "return document.getElementById('doc-status').dataset.status", |v| v == "ready" || v == "failed")
        .await;
    assert_eq!(page_status(&b).await, "ready", "toasts: {:?}", toasts(&b).await);
    eprintln!("absorbed {:.1} s after the hold ended", t0.elapsed().as_secs_f64());
    let doc: Value = http().get(format!("{base}/documents/{id}")).send().await.unwrap().json().await.unwrap();
    assert_eq!(doc["training"]["planned_steps"].as_u64(), Some(steps), "the cost said the steps the trainer planned: {doc}");
    click_centered(&b, "#details > summary").await;
    let losses = b
        .js("return [document.getElementById('stat-loss').textContent, \
                     document.querySelector('[data-testid=training-final_loss] dd').textContent]")
        .await;
    assert_eq!(losses[0], losses[1], "one final loss: {losses}");
    assert_eq!(b.js("return document.getElementById('progress').dataset.value").await, json!("100"));
    // The loss strip draws every step of the absorb, not only the steps the events brought.
    let points = b.js("return document.getElementById('loss-canvas').dataset.points").await;
    assert_eq!(points, json!(doc["training"]["steps"].as_u64().unwrap().to_string()), "{doc}");
    click_centered(&b, "#details > summary").await;
    let q3 = "Who founded the Saltmere Harbor Company?";
    let a3 = ask_on_page(&b, q3, &["lift"], Duration::from_secs(120)).await;
    let (by, mode, adapter) = answered_by(&b, "lift").await;
    assert_eq!((mode.as_str(), adapter.as_str()), ("lift", "final"), "{by}");
    assert!(by.starts_with("Absorbed + passages · absorbed adapter"), "{by}");
    let sent = b.js("return window.askBodies[window.askBodies.length - 1]").await;
    let history = sent["history"].clone();
    assert_eq!(history.as_array().map(|h| h.len()), Some(4), "two questions and their answers before: {sent}");
    let direct = ask_direct(
        &base,
        json!({"document_id": id, "question": q3, "history": history, "max_tokens": max_tokens, "temperature": 0, "include_context": true}),
    )
    .await;
    assert_eq!(a3["lift"], direct["answer"], "{direct}");
    // Self-gating: the page says so when the passages' own answer was kept.
    assert_eq!(by.contains("the passages’ own answer"), direct["answered_by"] == "passages", "{by} / {direct}");
    // The passages it read: asked for when opened.
    click_centered(&b, "#answer-lift [data-testid=passages] > summary").await;
    b.wait_js("the passages", Duration::from_secs(60), "return document.querySelector('#answer-lift [data-testid=passages]').dataset.loaded", |v| v == "done")
        .await;
    let shown = b.js("return document.querySelectorAll('#answer-lift [data-testid=chunk]').length").await.as_u64().unwrap() as usize;
    let chunks = direct["context"]["chunks"].as_array().map_or(0, |c| c.len());
    assert_eq!(shown, chunks, "the passages the API reports ({direct})");
    b.js("document.querySelector('#answer-lift').scrollIntoView({block: 'center'})").await;
    shot(&b, "04-absorbed-answer").await;

    // Compare: no single mode highlighted, four answers side by side under their plain names.
    click(&b, "#compare").await;
    let pressed = b.js("return document.querySelectorAll('.modes .mode[aria-pressed=true]').length").await;
    assert_eq!(pressed, json!(0), "comparing highlights no single mode");
    let all = ["lift", "rag", "memory", "icl"];
    ask_on_page(&b, "What did the company build first?", &all, Duration::from_secs(240)).await;
    let xs = b.js("return ['lift','rag','memory','icl'].map(m => document.getElementById('answer-' + m).getBoundingClientRect().left)").await;
    let xs: Vec<f64> = serde_json::from_value(xs).unwrap();
    assert!(xs.windows(2).all(|w| w[0] < w[1]), "four columns side by side: {xs:?}");
    let names = b.js("return [...document.querySelectorAll('#thread .turn:last-child .who')].map(w => w.textContent)").await;
    assert_eq!(names, json!(["Absorbed + passages", "Passages only", "Absorbed only", "Head and tail only"]));
    let (by, _, _) = answered_by(&b, "rag").await;
    assert_eq!(by, "Passages only · base model, no adapter", "asked without the adapter, not waiting for it");
    assert_no_error_toasts(&b, "after comparing").await;
    b.js("document.querySelector('#thread .turn:last-child').scrollIntoView({block: 'end'})").await;
    shot(&b, "05-compare").await;

    // Deleted: gone from the list, the conversation and the server.
    click_centered(&b, &format!("#doc-list li[data-id='{id}'] [data-testid=delete]")).await;
    b.accept_alert().await.unwrap();
    b.wait_js("the row gone", Duration::from_secs(10), "return document.querySelectorAll('#doc-list li').length", |v| v == &json!(0)).await;
    assert_eq!(b.js("return document.querySelectorAll('#thread .turn').length").await, json!(0));
    let list: Value = http().get(format!("{base}/documents")).send().await.unwrap().json().await.unwrap();
    assert_eq!(list["data"], json!([]));
    shot(&b, "06-deleted").await;
    eprintln!("the whole flow: {:.1} s", t_start.elapsed().as_secs_f64());

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
    shot(&b, "09-key-prompt").await;

    // A wrong key: said to be refused (not "saved"), not kept, and the key asked for again.
    type_into(&b, "#key-input", "wrong").await;
    click(&b, "#key-save").await;
    b.wait_js("the key refused", Duration::from_secs(10), "return document.getElementById('auth-prompt').dataset.reason", |v| v == "refused")
        .await;
    let prompt = b.js("return document.getElementById('auth-prompt').textContent").await;
    assert!(prompt.as_str().unwrap().contains("This key was refused"), "{prompt}");
    assert!(!b.js("return document.getElementById('auth-prompt').hidden").await.as_bool().unwrap());
    assert_eq!(b.js("return localStorage.getItem('lift-serve.key')").await, json!(null), "a refused key is not kept");
    let infos = b.js("return [...document.querySelectorAll('#toasts .toast')].map(t => t.textContent)").await;
    assert!(!infos.to_string().contains("saved") && !infos.to_string().contains("accepted"), "{infos}");
    assert_eq!(b.js("return document.activeElement.id").await, json!("key-input"), "the key field has the focus");
    shot(&b, "10-key-refused").await;

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

    // A document through the paste box: its cost follows the options as they change.
    click(&b, "#tab-paste").await;
    b.js_args("document.getElementById('paste-text').value = arguments[0]", vec![json!(TINY_DOC)]).await;
    type_into(&b, "#doc-title", "Velmora").await;
    click(&b, "#advanced > summary").await;
    type_into(&b, "#opt-epochs-seg", "1").await;
    type_into(&b, "#opt-epochs-qa", "1").await;
    let few = b
        .wait_js("the cost of epochs [1, 1]", Duration::from_secs(10), "return document.getElementById('cost').dataset.steps || ''", |v| v != "")
        .await;
    tokio::time::sleep(Duration::from_millis(800)).await;
    let c1 = b.js(COST_JS).await;
    assert!(c1[1].as_array().unwrap().contains(&json!("few_epochs")), "{c1} {few}");
    type_into(&b, "#opt-epochs-seg", "2").await;
    type_into(&b, "#opt-epochs-qa", "3").await;
    let c2 = b
        .wait_js("the cost of epochs [2, 3]", Duration::from_secs(10),
            COST_JS,
            |v| !v[1].as_array().unwrap().contains(&json!("few_epochs")))
        .await;
    let steps = |c: &Value| c[0].as_str().unwrap().parse::<u64>().unwrap();
    assert!(steps(&c2) > steps(&c1), "more epochs, more steps: {c1} → {c2}");
    // The schedule chosen in the absorb options reaches the document's options (and is flagged).
    b.js("const s = document.getElementById('opt-schedule'); s.value = 'until_learned'; s.dispatchEvent(new Event('change'))").await;
    b.wait_js("the until_learned warning", Duration::from_secs(10),
        "return [...document.querySelectorAll('#cost-warnings li')].map(l => l.dataset.code)",
        |v| v.as_array().unwrap().contains(&json!("until_learned")))
        .await;
    shot(&b, "11-cost-warnings").await;
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
    assert_eq!(list["data"][0]["options"]["train"]["epochs"], json!([2, 3]), "{list}");
    // A streamed answer on the tiny model (random weights: any text), said to be the adapter's.
    let answers = ask_on_page(&b, "Who built the harbor?", &["lift"], Duration::from_secs(60)).await;
    assert!(answers.contains_key("lift"));
    // Absorbed until learned, it stopped before its planned steps: still the final adapter.
    assert_eq!(answered_by(&b, "lift").await.2, "final");
    assert_no_error_toasts(&b, "after asking").await;
    // Passages are highlighted by relevance (the tiny model has no FltLM filter, so the page's
    // own renderer is fed chunks shaped like an answer's `context.chunks`).
    let bg = b
        .js("const box = renderChunks([{start: 0, end: 8, score: 2.0, mask: 0.9, text: 'very relevant '}, \
                                       {start: 8, end: 16, score: 0.5, mask: 0.6, text: 'a little relevant '}, \
                                       {start: 16, end: 24, score: -1.0, mask: 0.1, text: 'not relevant'}]); \
             box.classList.add('chunks'); document.getElementById('answer-lift').append(box); \
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

/// Several files dropped at once make one collection, which the page shows as one chat; an
/// answer names its sources (the documents read, whose adapter answered).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tiny_model_collection_chat() {
    let tmp = tempfile::tempdir().unwrap();
    let model = write_hf(&tmp.path().join("tiny"), &TinySpec::default()).unwrap();
    let mut cfg = ServeConfig::new(model, tmp.path().join("adapters"));
    cfg.absorb_options = Some(write_options(tmp.path(), 32, 16));
    cfg.max_tokens_limit = 64;
    cfg.default_max_tokens = 8;
    let (running, base) = start(cfg).await;
    let driver = Driver::start();
    let b = driver.browser(1280, 900).await;
    b.goto(&base).await.unwrap();
    wait_list_loaded(&b).await;

    let orchard = "The orchard of Brindle grows pears and quinces. The orchard keeper, Mira Falk, planted the first quince tree in 1877.";
    b.js_args(
        "const dt = new DataTransfer(); \
         dt.items.add(new File([arguments[0]], 'Harbor.md', {type: 'text/markdown'})); \
         dt.items.add(new File([arguments[1]], 'Orchard.md', {type: 'text/markdown'})); \
         document.getElementById('drop-zone').dispatchEvent(new DragEvent('drop', {dataTransfer: dt, bubbles: true, cancelable: true}));",
        vec![json!(TINY_DOC), json!(orchard)],
    )
    .await;
    let text = b.js("return document.getElementById('drop-text').textContent").await;
    assert!(text.as_str().unwrap().contains("2 files"), "{text}");
    click(&b, "#submit-doc").await;
    b.wait_js("the collection selected", Duration::from_secs(30), "return document.getElementById('doc-status').dataset.status", |v| v == "collection")
        .await;
    let rows = b.js("return document.querySelectorAll('[data-testid=collection-row]').length").await;
    assert_eq!(rows, json!(1));
    assert_no_error_toasts(&b, "collection made").await;

    let answers = ask_on_page(&b, "Who planted the first quince tree?", &["lift"], Duration::from_secs(60)).await;
    assert!(answers.contains_key("lift"));
    let sources = b
        .js("const s = document.querySelector('#answer-lift [data-testid=sources]'); return s ? [s.textContent, s.dataset.documents] : null")
        .await;
    assert!(sources[0].as_str().unwrap().contains("Orchard"), "names its sources: {sources}");
    let (_, cols) = {
        let r = http().get(format!("{base}/collections")).send().await.unwrap();
        (r.status(), r.json::<Value>().await.unwrap())
    };
    let members: Vec<&str> = cols["data"][0]["document_ids"].as_array().unwrap().iter().map(|d| d.as_str().unwrap()).collect();
    assert_eq!(members.len(), 2, "{cols}");
    let read = sources[1].as_str().unwrap();
    assert!(read.split(' ').all(|d| members.contains(&d)) && !read.is_empty(), "{sources} {cols}");
    shot(&b, "20-collection-chat").await;

    // A passage read opens in its document: the document's whole text, the passage marked.
    b.js("document.querySelector('#answer-lift [data-testid=passages] summary').click()").await;
    b.wait_js("passages loaded", Duration::from_secs(30),
        "return document.querySelectorAll('#answer-lift [data-testid=chunk]').length", |v| v.as_u64().unwrap_or(0) > 0).await;
    let chunk = b
        .js("const c = [...document.querySelectorAll('#answer-lift [data-testid=chunk]')].find((c) => c.textContent.includes('quince')); \
             c.click(); return [c.dataset.document, c.textContent]")
        .await;
    b.wait_js("the passage view open", Duration::from_secs(10),
        "const m = document.querySelector('[data-testid=passage-mark]'); return document.getElementById('passage-view').open && m ? m.textContent : null",
        |v| v.is_string()).await;
    let view = b
        .js("return [document.getElementById('passage-title').textContent, document.querySelector('[data-testid=passage-mark]').textContent, \
             document.getElementById('passage-text').textContent]")
        .await;
    assert!(view[0].as_str().unwrap().contains("Orchard"), "titled with its document: {view}");
    let mark = view[1].as_str().unwrap();
    assert!(!mark.trim().is_empty() && chunk[1].as_str().unwrap().contains(mark.trim()), "the passage clicked is marked: {view} {chunk}");
    assert_eq!(view[2].as_str().unwrap().trim(), orchard, "the whole document is shown: {view}");
    assert!(members.contains(&chunk[0].as_str().unwrap()), "{chunk}");
    assert_no_error_toasts(&b, "passage opened").await;
    shot(&b, "21-collection-passage-opened").await;
    b.js("document.getElementById('passage-close').click()").await;
    let open = b.js("return document.getElementById('passage-view').open").await;
    assert_eq!(open, json!(false));
    running.shutdown().await;
}
