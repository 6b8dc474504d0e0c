//! Prometheus metrics, rendered by hand (text format 0.0.4).

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Mutex;

#[derive(Default)]
struct Sum {
    count: u64,
    sum: f64,
}

#[derive(Default)]
pub struct Metrics {
    /// (method, route, status) → request count and total seconds.
    requests: Mutex<BTreeMap<(String, String, u16), Sum>>,
    /// outcome → training jobs.
    jobs: Mutex<BTreeMap<String, u64>>,
    train_tokens_per_s: Mutex<f64>,
    ttft: Mutex<Sum>,
    gen_tokens: Mutex<Sum>,
}

fn escape(s: &str) -> String {
    s.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

impl Metrics {
    pub fn request(&self, method: &str, route: &str, status: u16, seconds: f64) {
        if let Ok(mut m) = self.requests.lock() {
            let e = m.entry((method.to_string(), route.to_string(), status)).or_default();
            e.count += 1;
            e.sum += seconds;
        }
    }
    pub fn job(&self, outcome: &str, tokens_per_s: Option<f64>) {
        if let Ok(mut m) = self.jobs.lock() {
            *m.entry(outcome.to_string()).or_default() += 1;
        }
        if let (Some(t), Ok(mut g)) = (tokens_per_s, self.train_tokens_per_s.lock()) {
            *g = t;
        }
    }
    /// One generation: time to first token (prompt) and decode time for `tokens` tokens.
    pub fn generation(&self, ttft_s: f64, tokens: usize, decode_s: f64) {
        if let Ok(mut t) = self.ttft.lock() {
            t.count += 1;
            t.sum += ttft_s;
        }
        if let Ok(mut g) = self.gen_tokens.lock() {
            g.count += tokens as u64;
            g.sum += decode_s;
        }
    }

    pub fn render(&self, gauges: &[(&str, &str, f64)]) -> String {
        let mut out = String::new();
        let _ = writeln!(out, "# HELP lift_http_requests_total HTTP requests by route and status.\n# TYPE lift_http_requests_total counter");
        if let Ok(m) = self.requests.lock() {
            for ((method, route, status), s) in m.iter() {
                let _ = writeln!(out, "lift_http_requests_total{{method=\"{method}\",route=\"{}\",status=\"{status}\"}} {}", escape(route), s.count);
            }
            let _ = writeln!(out, "# HELP lift_http_request_duration_seconds Request latency.\n# TYPE lift_http_request_duration_seconds summary");
            for ((method, route, status), s) in m.iter() {
                let l = format!("method=\"{method}\",route=\"{}\",status=\"{status}\"", escape(route));
                let _ = writeln!(out, "lift_http_request_duration_seconds_sum{{{l}}} {}", s.sum);
                let _ = writeln!(out, "lift_http_request_duration_seconds_count{{{l}}} {}", s.count);
            }
        }
        let _ = writeln!(out, "# HELP lift_training_jobs_total Training jobs by outcome.\n# TYPE lift_training_jobs_total counter");
        if let Ok(m) = self.jobs.lock() {
            for (k, v) in m.iter() {
                let _ = writeln!(out, "lift_training_jobs_total{{outcome=\"{k}\"}} {v}");
            }
        }
        if let Ok(t) = self.train_tokens_per_s.lock() {
            let _ = writeln!(out, "# HELP lift_training_tokens_per_second Training throughput of the last job.\n# TYPE lift_training_tokens_per_second gauge\nlift_training_tokens_per_second {}", *t);
        }
        if let Ok(t) = self.ttft.lock() {
            let _ = writeln!(out, "# HELP lift_generation_time_to_first_token_seconds Prompt processing time.\n# TYPE lift_generation_time_to_first_token_seconds summary");
            let _ = writeln!(out, "lift_generation_time_to_first_token_seconds_sum {}\nlift_generation_time_to_first_token_seconds_count {}", t.sum, t.count);
        }
        if let Ok(g) = self.gen_tokens.lock() {
            let _ = writeln!(out, "# HELP lift_generated_tokens_total Generated tokens.\n# TYPE lift_generated_tokens_total counter\nlift_generated_tokens_total {}", g.count);
            let _ = writeln!(out, "# HELP lift_generation_decode_seconds_total Time spent decoding.\n# TYPE lift_generation_decode_seconds_total counter\nlift_generation_decode_seconds_total {}", g.sum);
            let tps = if g.sum > 0.0 { g.count as f64 / g.sum } else { 0.0 };
            let _ = writeln!(out, "# HELP lift_generation_tokens_per_second Mean decode throughput.\n# TYPE lift_generation_tokens_per_second gauge\nlift_generation_tokens_per_second {tps}");
        }
        for (name, help, v) in gauges {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
        }
        out
    }
}
