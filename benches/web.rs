//! The web page's weight and speed: the server runs in this process on a free port of 127.0.0.1
//! (tiny random model; the page does not depend on the model), then
//! a. the size of each of the page's files as served, raw and gzip-compressed (level 9);
//! b. server time of `GET /` over BENCH_REQUESTS (200) keep-alive requests after a warm-up: median
//!    and p90 of the round trip on the loopback interface;
//! c. page load in headless Chromium over BENCH_LOADS (15) cold loads (a fresh browser profile each:
//!    empty cache) and as many warm ones (the same browser again: revalidated with 304s): medians of
//!    Navigation Timing's responseEnd, domContentLoadedEventEnd and loadEventEnd (ms after
//!    startTime).
//!
//!   cargo bench --bench web
//!
//! Needs Debian's chromium and chromium-driver (scripts/test.sh installs them).

#[path = "../tests/webdriver/mod.rs"]
mod webdriver;

#[path = "common/stats.rs"]
mod stats;
use stats::percentile;
use flate2::{write::GzEncoder, Compression};
use lift_serve::server::{self, ServeConfig};
use serde_json::Value;
use std::io::Write;
use std::time::{Duration, Instant};

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|s| s.parse().ok()).unwrap_or(default)
}


fn gzip_len(bytes: &[u8]) -> usize {
    let mut e = GzEncoder::new(Vec::new(), Compression::best());
    e.write_all(bytes).unwrap();
    e.finish().unwrap().len()
}

const NAV: &str = "const n = performance.getEntriesByType('navigation')[0]; \
    return n && n.loadEventEnd > 0 ? [n.responseEnd - n.startTime, n.domContentLoadedEventEnd - n.startTime, \
    n.loadEventEnd - n.startTime] : null";

/// Loads `url` in `b` and returns Navigation Timing's [responseEnd, domContentLoadedEventEnd, loadEventEnd].
async fn load(b: &webdriver::Browser, url: &str) -> [f64; 3] {
    b.goto(url).await.unwrap();
    let t0 = Instant::now();
    loop {
        let v = b.js(NAV).await;
        if let Some(a) = v.as_array() {
            return [a[0].as_f64().unwrap(), a[1].as_f64().unwrap(), a[2].as_f64().unwrap()];
        }
        assert!(t0.elapsed() < Duration::from_secs(30), "the page did not finish loading");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn print_timings(label: &str, runs: &[[f64; 3]]) {
    let col = |i: usize| runs.iter().map(|r| r[i]).collect::<Vec<_>>();
    println!(
        "  {label:<5} ({} loads): responseEnd {:.1} ms, domContentLoaded {:.1} ms, load {:.1} ms (medians; load p90 {:.1} ms)",
        runs.len(),
        percentile(&col(0), 0.5),
        percentile(&col(1), 0.5),
        percentile(&col(2), 0.5),
        percentile(&col(2), 0.9)
    );
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let requests = env_usize("BENCH_REQUESTS", 200);
    let loads = env_usize("BENCH_LOADS", 15);
    let tmp = tempfile::tempdir().unwrap();
    let model = lift_serve::testing::write_hf(&tmp.path().join("tiny"), &lift_serve::testing::TinySpec::default()).unwrap();
    let mut cfg = ServeConfig::new(model, tmp.path().join("adapters"));
    cfg.runtime = lift_serve::runtime::RuntimeConfig::from_env().unwrap();
    let state = server::build_state(cfg, &candle_core::Device::Cpu).unwrap();
    let running = server::start(state).await.unwrap();
    let base = format!("http://{}", running.addr);
    let http = reqwest::Client::new();

    // a. Size, as served.
    println!("page files (as served; gzip level 9):");
    let (mut raw_total, mut gz_total) = (0, 0);
    for asset in server::web::ASSETS {
        let body = http.get(format!("{base}{}", asset.path)).send().await.unwrap().bytes().await.unwrap();
        assert_eq!(body.len(), asset.body.len());
        let gz = gzip_len(&body);
        println!("  {:<16} {:>7} B raw {:>7} B gzip", asset.path, body.len(), gz);
        raw_total += body.len();
        gz_total += gz;
    }
    println!("  {:<16} {:>7} B raw {:>7} B gzip", "total", raw_total, gz_total);

    // b. Server time of GET /.
    for _ in 0..20 {
        http.get(format!("{base}/")).send().await.unwrap().bytes().await.unwrap();
    }
    let mut times = Vec::with_capacity(requests);
    for _ in 0..requests {
        let t0 = Instant::now();
        let r = http.get(format!("{base}/")).send().await.unwrap();
        assert!(r.status().is_success());
        r.bytes().await.unwrap();
        times.push(t0.elapsed().as_secs_f64() * 1e3);
    }
    println!(
        "GET / ({requests} requests, keep-alive, loopback): median {:.3} ms, p90 {:.3} ms",
        percentile(&times, 0.5),
        percentile(&times, 0.9)
    );

    // c. Page load in headless Chromium.
    let driver = webdriver::Driver::start();
    let (mut cold, mut warm) = (Vec::new(), Vec::new());
    for _ in 0..loads {
        let b = driver.browser(1280, 900).await;
        cold.push(load(&b, &base).await);
        // The same browser again: cached files are revalidated (304).
        b.goto("about:blank").await.unwrap();
        warm.push(load(&b, &base).await);
        let errors: Value = b.js("return document.querySelectorAll('#toasts .toast.error').length").await;
        assert_eq!(errors, 0, "the page showed an error");
        b.close().await;
    }
    println!("page load in headless Chromium (Navigation Timing, ms after startTime):");
    print_timings("cold", &cold);
    print_timings("warm", &warm);
    drop(driver);
    running.shutdown().await;
}
