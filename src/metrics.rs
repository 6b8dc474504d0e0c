//! Prometheus metrics (prometheus-client, OpenMetrics text). Counters and histograms are updated
//! where things happen (the HTTP layer counts requests, the service jobs and generations); the
//! gauges are read from the service when scraped. One registry per server, so that servers in one
//! process (tests) do not share counts.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    method: String,
    route: String,
    status: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    outcome: String,
}

type FloatGauge = Gauge<f64, AtomicU64>;

/// Gauges read from the service at scrape time.
pub struct Snapshot {
    pub training_waiting: usize,
    pub training_running: usize,
    pub generation_waiting: usize,
    pub generation_running: usize,
    pub cache_hits: u64,
    pub cache_misses: u64,
    pub cache_evictions: u64,
    pub cache_resident_bytes: u64,
    pub documents_queued: usize,
    pub documents_training: usize,
    pub documents_ready: usize,
    pub documents_failed: usize,
    pub resident_memory_bytes: u64,
    /// Replicas sharing an adapter store: archives written and fetched by this replica.
    pub blob_puts: u64,
    pub blob_fetches: u64,
    /// KV cache tokens held by admitted generations, and the budget.
    pub kv_tokens_held: usize,
    pub kv_tokens_budget: usize,
}

struct Gauges {
    training_waiting: Gauge,
    training_running: Gauge,
    generation_waiting: Gauge,
    generation_running: Gauge,
    cache_hits: Gauge,
    cache_misses: Gauge,
    cache_evictions: Gauge,
    cache_resident_bytes: Gauge,
    documents_queued: Gauge,
    documents_training: Gauge,
    documents_ready: Gauge,
    documents_failed: Gauge,
    resident_memory_bytes: Gauge,
    blob_puts: Gauge,
    blob_fetches: Gauge,
    kv_tokens_held: Gauge,
    kv_tokens_budget: Gauge,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FinishLabels {
    /// `stop`, `length`, or `cancelled` (the client went away).
    finish: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    /// The refusal's error code (`document_too_complex`, `decompression_limit`, ...).
    reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FormatLabels {
    /// `text`, `markdown`, `html`, `pdf`, `docx`, `odt`, `epub`, or `unknown` (the worker died before saying).
    format: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ClaimLabels {
    /// `fresh`: never claimed before; `stolen`: its lease had expired (its replica died).
    how: String,
}

pub struct Metrics {
    registry: Registry,
    requests: Family<RequestLabels, Counter>,
    request_seconds: Family<RequestLabels, Histogram, fn() -> Histogram>,
    jobs: Family<OutcomeLabels, Counter>,
    train_tokens_per_s: FloatGauge,
    time_to_first_token: Histogram,
    generated_tokens: Counter,
    decode_seconds: Counter<f64, AtomicU64>,
    generation_tokens_per_s: FloatGauge,
    generations: Family<FinishLabels, Counter>,
    batch_sizes: Histogram,
    gauges: Gauges,
    claims: Family<ClaimLabels, Counter>,
    lease_renewals: Counter,
    leases_lost: Counter,
    extractions_refused: Family<ReasonLabels, Counter>,
    extraction_seconds: Family<FormatLabels, Histogram, fn() -> Histogram>,
    extraction_peak_rss: Family<FormatLabels, Histogram, fn() -> Histogram>,
}

fn rss_histogram() -> Histogram {
    // 16 MiB to 4 GiB.
    Histogram::new(exponential_buckets((16u64 << 20) as f64, 2.0, 9))
}

fn latency_histogram() -> Histogram {
    // 1 ms to ~65 s.
    Histogram::new(exponential_buckets(0.001, 2.0, 17))
}

impl Default for Metrics {
    fn default() -> Self {
        let mut r = Registry::default();
        let requests = Family::<RequestLabels, Counter>::default();
        r.register("lift_http_requests", "HTTP requests by route and status", requests.clone());
        let request_seconds = Family::new_with_constructor(latency_histogram as fn() -> Histogram);
        r.register("lift_http_request_duration_seconds", "Request latency", request_seconds.clone());
        let jobs = Family::<OutcomeLabels, Counter>::default();
        r.register("lift_training_jobs", "Training jobs by outcome", jobs.clone());
        let train_tokens_per_s = FloatGauge::default();
        r.register("lift_training_tokens_per_second", "Training throughput of the last job", train_tokens_per_s.clone());
        let time_to_first_token = latency_histogram();
        r.register("lift_generation_time_to_first_token_seconds", "Prompt processing time", time_to_first_token.clone());
        let generated_tokens = Counter::default();
        r.register("lift_generated_tokens", "Generated tokens", generated_tokens.clone());
        let decode_seconds = Counter::<f64, AtomicU64>::default();
        r.register("lift_generation_decode_seconds", "Time spent decoding", decode_seconds.clone());
        let generation_tokens_per_s = FloatGauge::default();
        r.register("lift_generation_tokens_per_second", "Mean decode throughput", generation_tokens_per_s.clone());
        let generations = Family::<FinishLabels, Counter>::default();
        r.register("lift_generations", "Generations by how they finished", generations.clone());
        let batch_sizes = Histogram::new(exponential_buckets(1.0, 2.0, 8));
        r.register("lift_generation_batch_size", "Sequences in each generation step", batch_sizes.clone());
        let mut gauge = |name: &str, help: &str| {
            let g = Gauge::default();
            r.register(name, help, g.clone());
            g
        };
        let gauges = Gauges {
            training_waiting: gauge("lift_training_queue_depth", "Training jobs waiting"),
            training_running: gauge("lift_training_running", "Training jobs running"),
            generation_waiting: gauge("lift_generation_queue_depth", "Generation requests waiting"),
            generation_running: gauge("lift_generation_running", "Generation requests running"),
            cache_hits: gauge("lift_adapter_cache_hits", "Adapter cache hits (total)"),
            cache_misses: gauge("lift_adapter_cache_misses", "Adapter cache misses (total)"),
            cache_evictions: gauge("lift_adapter_cache_evictions", "Adapters evicted for size (total)"),
            cache_resident_bytes: gauge(
                "lift_adapter_cache_resident_bytes",
                "Bytes of adapters (with their documents) in memory",
            ),
            documents_queued: gauge("lift_documents_queued", "Documents queued"),
            documents_training: gauge("lift_documents_training", "Documents training"),
            documents_ready: gauge("lift_documents_ready", "Documents ready"),
            documents_failed: gauge("lift_documents_failed", "Documents failed"),
            resident_memory_bytes: gauge("process_resident_memory_bytes", "Resident memory of the server process"),
            blob_puts: gauge("lift_blob_puts", "Adapter archives this replica wrote to the shared store (total)"),
            blob_fetches: gauge("lift_blob_fetches", "Adapter archives this replica fetched and verified (total)"),
            kv_tokens_held: gauge("lift_kv_cache_tokens_held", "KV cache tokens held by admitted generations"),
            kv_tokens_budget: gauge("lift_kv_cache_tokens_budget", "KV cache tokens the generations may hold"),
        };
        let claims = Family::<ClaimLabels, Counter>::default();
        r.register("lift_jobs_claimed", "Training jobs this replica claimed from the shared queue", claims.clone());
        let lease_renewals = Counter::default();
        r.register("lift_lease_renewals", "Job leases this replica renewed", lease_renewals.clone());
        let leases_lost = Counter::default();
        r.register("lift_leases_lost", "Jobs this replica stopped because another replica took them over", leases_lost.clone());
        let extractions_refused = Family::<ReasonLabels, Counter>::default();
        r.register("lift_extractions_refused", "Uploads whose extraction was refused, by reason", extractions_refused.clone());
        let extraction_seconds = Family::new_with_constructor(latency_histogram as fn() -> Histogram);
        r.register("lift_extraction_duration_seconds", "Time to extract an upload's text, by format", extraction_seconds.clone());
        let extraction_peak_rss = Family::new_with_constructor(rss_histogram as fn() -> Histogram);
        r.register("lift_extraction_peak_rss_bytes", "Peak resident memory of the extraction worker, by format", extraction_peak_rss.clone());
        Self {
            registry: r,
            extractions_refused,
            extraction_seconds,
            extraction_peak_rss,
            requests,
            request_seconds,
            jobs,
            train_tokens_per_s,
            time_to_first_token,
            generated_tokens,
            decode_seconds,
            generation_tokens_per_s,
            generations,
            batch_sizes,
            gauges,
            claims,
            lease_renewals,
            leases_lost,
        }
    }
}

fn count(n: impl TryInto<i64>) -> i64 {
    n.try_into().unwrap_or(i64::MAX)
}

impl Metrics {
    pub fn request(&self, method: &str, route: &str, status: u16, seconds: f64) {
        let labels = RequestLabels { method: method.to_string(), route: route.to_string(), status };
        self.requests.get_or_create(&labels).inc();
        self.request_seconds.get_or_create(&labels).observe(seconds);
    }

    /// A training job ended with `outcome`; `tokens_per_s` when it trained to the end.
    pub fn job(&self, outcome: &str, tokens_per_s: Option<f64>) {
        self.jobs.get_or_create(&OutcomeLabels { outcome: outcome.to_string() }).inc();
        if let Some(t) = tokens_per_s {
            self.train_tokens_per_s.set(t);
        }
    }

    /// One generation: how it finished, time to first token (prompt) and decode time for
    /// `tokens` tokens.
    pub fn generation(&self, finish: &str, ttft_s: f64, tokens: usize, decode_s: f64) {
        self.generations.get_or_create(&FinishLabels { finish: finish.to_string() }).inc();
        self.time_to_first_token.observe(ttft_s);
        self.generated_tokens.inc_by(tokens as u64);
        self.decode_seconds.inc_by(decode_s);
    }

    /// A generation step ran `sequences` side by side.
    pub fn batch_step(&self, sequences: usize) {
        self.batch_sizes.observe(sequences as f64);
    }

    /// A job claimed from the shared queue; `stolen` when another replica's lease had expired.
    pub fn job_claimed(&self, stolen: bool) {
        let how = if stolen { "stolen" } else { "fresh" };
        self.claims.get_or_create(&ClaimLabels { how: how.to_string() }).inc();
    }

    pub fn lease_renewed(&self) {
        self.lease_renewals.inc();
    }

    pub fn lease_lost(&self) {
        self.leases_lost.inc();
    }

    /// One extraction: its format (`unknown` when the worker died first), time, the worker's
    /// peak resident memory when it reported it, and the refusal's code if it was refused.
    pub fn extraction(&self, format: &str, seconds: f64, peak_rss_bytes: Option<u64>, refused: Option<&str>) {
        let labels = FormatLabels { format: format.to_string() };
        self.extraction_seconds.get_or_create(&labels).observe(seconds);
        if let Some(b) = peak_rss_bytes {
            self.extraction_peak_rss.get_or_create(&labels).observe(b as f64);
        }
        if let Some(reason) = refused {
            self.extractions_refused.get_or_create(&ReasonLabels { reason: reason.to_string() }).inc();
        }
    }

    /// The OpenMetrics text with the gauges set from `s`.
    pub fn render(&self, s: &Snapshot) -> String {
        let g = &self.gauges;
        for (gauge, v) in [
            (&g.training_waiting, count(s.training_waiting)),
            (&g.training_running, count(s.training_running)),
            (&g.generation_waiting, count(s.generation_waiting)),
            (&g.generation_running, count(s.generation_running)),
            (&g.cache_hits, count(s.cache_hits)),
            (&g.cache_misses, count(s.cache_misses)),
            (&g.cache_evictions, count(s.cache_evictions)),
            (&g.cache_resident_bytes, count(s.cache_resident_bytes)),
            (&g.documents_queued, count(s.documents_queued)),
            (&g.documents_training, count(s.documents_training)),
            (&g.documents_ready, count(s.documents_ready)),
            (&g.documents_failed, count(s.documents_failed)),
            (&g.resident_memory_bytes, count(s.resident_memory_bytes)),
            (&g.blob_puts, count(s.blob_puts)),
            (&g.blob_fetches, count(s.blob_fetches)),
            (&g.kv_tokens_held, count(s.kv_tokens_held)),
            (&g.kv_tokens_budget, count(s.kv_tokens_budget)),
        ] {
            gauge.set(v);
        }
        let (tokens, seconds) = (self.generated_tokens.get(), self.decode_seconds.get());
        self.generation_tokens_per_s.set(if seconds > 0.0 { tokens as f64 / seconds } else { 0.0 });
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

/// The content type of [`Metrics::render`]'s text.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_counters_histograms_and_gauges() {
        let m = Metrics::default();
        m.request("GET", "/health", 200, 0.002);
        m.job("ready", Some(150.0));
        m.generation("stop", 0.1, 5, 0.5);
        let snapshot = Snapshot {
            training_waiting: 1,
            training_running: 0,
            generation_waiting: 0,
            generation_running: 1,
            cache_hits: 2,
            cache_misses: 1,
            cache_evictions: 0,
            cache_resident_bytes: 4096,
            documents_queued: 0,
            documents_training: 0,
            documents_ready: 1,
            documents_failed: 0,
            resident_memory_bytes: 1 << 20,
            blob_puts: 0,
            blob_fetches: 3,
            kv_tokens_held: 700,
            kv_tokens_budget: 9000,
        };
        m.job_claimed(true);
        m.batch_step(3);
        let text = m.render(&snapshot);
        for line in [
            "lift_http_requests_total{method=\"GET\",route=\"/health\",status=\"200\"} 1",
            "lift_training_jobs_total{outcome=\"ready\"} 1",
            "lift_generated_tokens_total 5",
            "lift_generations_total{finish=\"stop\"} 1",
            "lift_generation_time_to_first_token_seconds_count 1",
            "lift_generation_tokens_per_second 10.0",
            "lift_training_queue_depth 1",
            "lift_adapter_cache_misses 1",
            "lift_blob_fetches 3",
            "lift_kv_cache_tokens_held 700",
            "lift_generation_batch_size_count 1",
            "lift_jobs_claimed_total{how=\"stolen\"} 1",
            "# EOF",
        ] {
            assert!(text.lines().any(|l| l == line), "missing '{line}' in\n{text}");
        }
    }
}
