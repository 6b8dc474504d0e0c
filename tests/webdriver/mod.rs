//! Headless Chromium over WebDriver for the page's tests (tests/web.rs) and its bench
//! (benches/web.rs): Debian's `chromium` and `chromium-driver` (scripts/test.sh installs them).
//! A missing browser is a failure, never a skip.

#![allow(dead_code)]

use fantoccini::{Client, ClientBuilder};
use hyper_util::client::legacy::connect::HttpConnector;
use serde_json::{json, Value};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub const CHROMIUM: &str = "/usr/bin/chromium";
pub const CHROMEDRIVER: &str = "/usr/bin/chromedriver";

/// A chromedriver child process on a free local port; killed on drop.
pub struct Driver {
    child: Child,
    pub port: u16,
}

impl Driver {
    pub fn start() -> Driver {
        for bin in [CHROMIUM, CHROMEDRIVER] {
            assert!(
                Path::new(bin).exists(),
                "{bin} is missing: install Debian's chromium and chromium-driver \
                 (apt-get install -y --no-install-recommends chromium chromium-driver; scripts/test.sh does)"
            );
        }
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let child = Command::new(CHROMEDRIVER)
            .arg(format!("--port={port}"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start chromedriver");
        let driver = Driver { child, port };
        let t0 = Instant::now();
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(t0.elapsed() < Duration::from_secs(20), "chromedriver did not listen on port {port} within 20 s");
            std::thread::sleep(Duration::from_millis(50));
        }
        driver
    }

    /// A fresh browser (own profile directory) with a window of `width` x `height` CSS pixels.
    pub async fn browser(&self, width: u32, height: u32) -> Browser {
        let profile = tempfile::tempdir().unwrap();
        let args = vec![
            "--headless=new".to_string(),
            "--no-sandbox".into(),
            "--disable-gpu".into(),
            "--disable-dev-shm-usage".into(),
            "--disable-quic".into(),
            "--no-first-run".into(),
            "--no-default-browser-check".into(),
            "--disable-background-networking".into(),
            "--disable-component-update".into(),
            "--disable-sync".into(),
            "--disable-extensions".into(),
            "--hide-scrollbars".into(),
            "--force-device-scale-factor=1".into(),
            format!("--window-size={width},{height}"),
            format!("--user-data-dir={}", profile.path().display()),
        ];
        let caps: serde_json::Map<String, Value> = serde_json::from_value(json!({
            "browserName": "chrome",
            "goog:chromeOptions": {"binary": CHROMIUM, "args": args},
            // Alerts stay open until the test answers them.
            "unhandledPromptBehavior": "ignore",
        }))
        .unwrap();
        let client = ClientBuilder::new(HttpConnector::new())
            .capabilities(caps)
            .connect(&format!("http://127.0.0.1:{}", self.port))
            .await
            .expect("a WebDriver session in headless Chromium");
        let b = Browser { client, _profile: profile };
        // The window size the flag asks for is the outer size; make the viewport exact.
        b.set_viewport(width, height).await;
        b
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A WebDriver session and its profile directory (removed on drop, after `close`).
pub struct Browser {
    pub client: Client,
    _profile: tempfile::TempDir,
}

impl std::ops::Deref for Browser {
    type Target = Client;
    fn deref(&self) -> &Client {
        &self.client
    }
}

impl Browser {
    /// Resizes the window so that the page's viewport is `width` x `height`.
    pub async fn set_viewport(&self, width: u32, height: u32) {
        self.client.set_window_size(width, height).await.unwrap();
        let inner = self.js("return [window.innerWidth, window.innerHeight]").await;
        let (iw, ih) = (inner[0].as_u64().unwrap() as u32, inner[1].as_u64().unwrap() as u32);
        if (iw, ih) != (width, height) {
            let (w, h) = (2 * width as i64 - iw as i64, 2 * height as i64 - ih as i64);
            self.client.set_window_size(w.max(100) as u32, h.max(100) as u32).await.unwrap();
        }
    }

    /// Runs `script` (a function body; `arguments` are unused) in the page.
    pub async fn js(&self, script: &str) -> Value {
        self.client.execute(script, vec![]).await.unwrap_or_else(|e| panic!("script failed: {e}\n{script}"))
    }

    /// Runs `script` with `args` in the page.
    pub async fn js_args(&self, script: &str, args: Vec<Value>) -> Value {
        self.client.execute(script, args).await.unwrap_or_else(|e| panic!("script failed: {e}\n{script}"))
    }

    /// Polls `script` (returning a JSON value) until `done` holds for its value, within `timeout`.
    pub async fn wait_js(&self, what: &str, timeout: Duration, script: &str, done: impl Fn(&Value) -> bool) -> Value {
        let t0 = Instant::now();
        loop {
            let v = self.js(script).await;
            if done(&v) {
                return v;
            }
            if t0.elapsed() > timeout {
                panic!("timed out after {timeout:?} waiting for {what}; last value: {v}");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Saves a PNG screenshot of the viewport as `dir/<name>.png`.
    pub async fn screenshot_to(&self, dir: &Path, name: &str) -> PathBuf {
        std::fs::create_dir_all(dir).unwrap();
        let png = self.client.screenshot().await.expect("screenshot");
        let path = dir.join(format!("{name}.png"));
        std::fs::write(&path, png).unwrap();
        path
    }

    pub async fn close(self) {
        let Browser { client, _profile } = self;
        let _ = client.close().await;
    }
}
