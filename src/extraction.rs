//! Extraction isolated from the serving process. An upload's text is made by a child process of
//! the same binary (`lift-serve extract-worker`, hidden): the upload on its stdin, one JSON
//! [`WorkerReply`] on its stdout. The child runs under OS limits on its address space and CPU
//! time, a wall-clock deadline (killed on expiry) and the format budgets of
//! [`crate::formats::Limits`]; whatever a parser does there (panic, abort, stack overflow,
//! runaway memory) ends that child, never the server. A semaphore bounds how many run at once.

use crate::formats::{self, Extracted, Format, Limits, Source};
use crate::metrics::Metrics;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The worker's answer: the text, title and source, or the refusal.
#[derive(Debug, Serialize, Deserialize)]
pub struct WorkerReply {
    #[serde(default)]
    pub text: Option<String>,
    #[serde(default)]
    pub title: Option<String>,
    #[serde(default)]
    pub source: Option<Source>,
    #[serde(default)]
    pub error: Option<WorkerError>,
    /// The format the worker read the upload as, when it got that far.
    #[serde(default)]
    pub format: Option<Format>,
    /// The worker's peak resident memory.
    #[serde(default)]
    pub peak_rss_bytes: u64,
}

#[derive(Debug, Serialize, Deserialize)]
pub struct WorkerError {
    pub status: u16,
    pub code: String,
    pub message: String,
}

/// `lift-serve extract-worker`: reads the upload from stdin (at most `limits.max_input_bytes`
/// and one byte more), extracts it in this process and writes the reply to stdout.
pub fn run_worker(filename: Option<&str>, media_type: Option<&str>, limits: &Limits) -> anyhow::Result<()> {
    use std::io::{Read, Write};
    let mut bytes = Vec::new();
    std::io::stdin().lock().take(limits.max_input_bytes.saturating_add(1)).read_to_end(&mut bytes)?;
    let reply = match formats::extract_with(&bytes, filename, media_type, limits) {
        Ok(e) => WorkerReply {
            format: Some(e.source.format),
            text: Some(e.text),
            title: e.title,
            source: Some(e.source),
            error: None,
            peak_rss_bytes: peak_rss_bytes(),
        },
        Err(e) => WorkerReply {
            text: None,
            title: None,
            source: None,
            format: formats::format_of(&bytes, filename, media_type),
            error: Some(WorkerError { status: e.status(), code: e.code().to_string(), message: e.to_string() }),
            peak_rss_bytes: peak_rss_bytes(),
        },
    };
    let mut out = std::io::stdout().lock();
    serde_json::to_writer(&mut out, &reply)?;
    out.flush()?;
    Ok(())
}

/// This process's peak resident memory (getrusage), in bytes.
fn peak_rss_bytes() -> u64 {
    // SAFETY: getrusage only writes the struct it is given.
    unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        if libc::getrusage(libc::RUSAGE_SELF, &mut usage) == 0 {
            (usage.ru_maxrss.max(0) as u64) * 1024
        } else {
            0
        }
    }
}

/// How uploads are extracted.
#[derive(Clone, Debug)]
pub struct WorkerConfig {
    /// The `lift-serve` binary to run as the worker.
    pub program: PathBuf,
    pub limits: Limits,
    /// Wall-clock limit of one extraction (the CPU-time limit is one second more); also the
    /// longest wait for a free worker.
    pub timeout: Duration,
    /// Address-space limit of a worker (RLIMIT_AS).
    pub memory_bytes: u64,
    /// Extractions running at once.
    pub concurrency: usize,
}

/// A refused or failed extraction, in the API's terms.
#[derive(Debug)]
pub enum Failure {
    /// The client's upload (4xx), or no worker free in time (429).
    Refused { status: u16, code: &'static str, message: String },
    /// Ours: the worker could not be started or answered nonsense.
    Internal(String),
}

/// Runs extraction workers, at most `concurrency` at once.
pub struct Extractor {
    cfg: WorkerConfig,
    permits: Arc<tokio::sync::Semaphore>,
    metrics: Arc<Metrics>,
}

/// The API code of a worker's refusal (codes are static in the API's error type).
fn known_code(code: &str) -> &'static str {
    const CODES: &[&str] = &[
        "unsupported_format",
        "invalid_utf8",
        "encrypted_pdf",
        "unreadable_pdf",
        "encrypted_document",
        "unreadable_document",
        "no_text",
        "document_too_large",
        "document_too_complex",
        "decompression_limit",
    ];
    CODES.iter().find(|c| **c == code).copied().unwrap_or("document_too_complex")
}

impl Extractor {
    pub fn new(cfg: WorkerConfig, metrics: Arc<Metrics>) -> Self {
        let permits = Arc::new(tokio::sync::Semaphore::new(cfg.concurrency.max(1)));
        Self { cfg, permits, metrics }
    }

    pub fn config(&self) -> &WorkerConfig {
        &self.cfg
    }

    /// The text of an upload, made by a worker process.
    pub async fn extract(&self, bytes: bytes::Bytes, filename: Option<String>, media_type: Option<String>) -> Result<Extracted, Failure> {
        let t0 = Instant::now();
        let (result, format, rss) = self.run(bytes, filename, media_type).await;
        let refused = match &result {
            Err(Failure::Refused { code, .. }) => Some(*code),
            _ => None,
        };
        let format = format.map_or("unknown".to_string(), |f| format!("{f:?}").to_ascii_lowercase());
        self.metrics.extraction(&format, t0.elapsed().as_secs_f64(), rss, refused);
        if let Err(Failure::Refused { code, message, .. }) = &result {
            tracing::info!(code, message = %message, "extraction refused");
        }
        result
    }

    async fn run(&self, bytes: bytes::Bytes, filename: Option<String>, media_type: Option<String>) -> (Result<Extracted, Failure>, Option<Format>, Option<u64>) {
        use std::os::unix::process::ExitStatusExt;
        use tokio::io::AsyncWriteExt;
        let cfg = &self.cfg;
        let secs = cfg.timeout.as_secs_f64();
        let permit = match tokio::time::timeout(cfg.timeout, self.permits.clone().acquire_owned()).await {
            Ok(Ok(p)) => p,
            _ => {
                let message = format!("all {} extraction workers stayed busy for {secs} s; retry later", cfg.concurrency);
                return (Err(Failure::Refused { status: 429, code: "queue_full", message }), None, None);
            }
        };
        // Refused before a process is started: the worker would read no more than this.
        if bytes.len() as u64 > cfg.limits.max_input_bytes {
            let e = formats::ExtractError::TooLarge {
                what: filename.as_deref().map_or("the body".into(), |f| format!("'{f}'")),
                limit: "size in bytes",
                value: bytes.len() as u64,
                max: cfg.limits.max_input_bytes,
            };
            return (Err(Failure::Refused { status: e.status(), code: e.code(), message: e.to_string() }), None, None);
        }
        let limits = match serde_json::to_string(&cfg.limits) {
            Ok(l) => l,
            Err(e) => return (Err(Failure::Internal(format!("extraction limits: {e}"))), None, None),
        };
        let mut cmd = tokio::process::Command::new(&cfg.program);
        cmd.arg("extract-worker").arg(format!("--limits={limits}"));
        if let Some(f) = &filename {
            cmd.arg(format!("--filename={f}"));
        }
        if let Some(m) = &media_type {
            cmd.arg(format!("--media-type={m}"));
        }
        cmd.env("RAYON_NUM_THREADS", "1")
            .env("RUST_LOG", "warn")
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true);
        let (memory, cpu) = (cfg.memory_bytes, cfg.timeout.as_secs() + 1);
        // SAFETY: only async-signal-safe calls (setrlimit) between fork and exec.
        unsafe {
            cmd.pre_exec(move || {
                for (resource, value) in [(libc::RLIMIT_AS, memory), (libc::RLIMIT_CPU, cpu), (libc::RLIMIT_CORE, 0)] {
                    let lim = libc::rlimit { rlim_cur: value as libc::rlim_t, rlim_max: value as libc::rlim_t };
                    if libc::setrlimit(resource, &lim) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                Ok(())
            });
        }
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                return (
                    Err(Failure::Internal(format!("cannot start the extraction worker {}: {e}", cfg.program.display()))),
                    None,
                    None,
                )
            }
        };
        let stdin = child.stdin.take();
        let feed = async move {
            if let Some(mut s) = stdin {
                // A worker that stops reading early (refused, crashed) closes the pipe: not an error here.
                let _ = s.write_all(&bytes).await;
            }
        };
        let run = async { tokio::join!(feed, child.wait_with_output()).1 };
        let output = match tokio::time::timeout(cfg.timeout, run).await {
            Ok(Ok(o)) => o,
            Ok(Err(e)) => return (Err(Failure::Internal(format!("the extraction worker: {e}"))), None, None),
            // Dropping the child kills it.
            Err(_) => return (Err(too_complex("extraction time", format!("passed the limit of {secs} s"))), None, None),
        };
        drop(permit);
        if output.status.success() {
            let reply: WorkerReply = match serde_json::from_slice(&output.stdout) {
                Ok(r) => r,
                Err(e) => return (Err(Failure::Internal(format!("the extraction worker's reply: {e}"))), None, None),
            };
            let rss = Some(reply.peak_rss_bytes).filter(|&b| b > 0);
            let format = reply.format;
            let result = match (reply.error, reply.text, reply.source) {
                (Some(e), _, _) => Err(Failure::Refused {
                    status: if (400..500).contains(&e.status) { e.status } else { 422 },
                    code: known_code(&e.code),
                    message: e.message,
                }),
                (None, Some(text), Some(source)) => Ok(Extracted { text, title: reply.title, source }),
                _ => Err(Failure::Internal("the extraction worker's reply has neither text nor error".into())),
            };
            return (result, format, rss);
        }
        // The worker died: say which budget it ran into, as far as its end tells.
        let stderr = String::from_utf8_lossy(&output.stderr);
        let mib = cfg.memory_bytes >> 20;
        let failure = match output.status.signal() {
            _ if stderr.contains("overflowed its stack") => too_complex("nesting depth", "overflowed the extractor's stack".into()),
            _ if stderr.contains("memory allocation") || stderr.contains("capacity overflow") => {
                too_complex("extraction memory", format!("passed the limit of {mib} MiB"))
            }
            Some(libc::SIGXCPU) | Some(libc::SIGKILL) => too_complex("extraction CPU time", format!("passed the limit of {cpu} s")),
            Some(sig) => too_complex("extraction", format!("ended the extractor (signal {sig})")),
            None => {
                tracing::warn!(status = %output.status, stderr = %stderr.chars().take(2000).collect::<String>(), "extraction worker failed");
                too_complex("extraction", format!("ended the extractor ({})", output.status))
            }
        };
        (Err(failure), None, None)
    }
}

fn too_complex(what: &str, how: String) -> Failure {
    Failure::Refused {
        status: 422,
        code: "document_too_complex",
        message: format!("the upload is too complex to read: its {what} {how}"),
    }
}

/// The `lift-serve` binary to run as the extraction worker: `configured`, else this process's
/// own executable when it is `lift-serve`, else a `lift-serve` beside it or one directory up
/// (a test harness in `target/<profile>/deps` runs the binary of its build).
pub fn worker_program(configured: Option<&std::path::Path>) -> anyhow::Result<PathBuf> {
    if let Some(p) = configured {
        return Ok(p.to_path_buf());
    }
    let exe = std::env::current_exe()?;
    let name = format!("lift-serve{}", std::env::consts::EXE_SUFFIX);
    if exe.file_name().is_some_and(|f| f == name.as_str()) {
        return Ok(exe);
    }
    let dir = exe.parent().map(std::path::Path::to_path_buf).unwrap_or_default();
    for candidate in [dir.join(&name), dir.join("..").join(&name)] {
        if candidate.is_file() {
            return Ok(candidate);
        }
    }
    anyhow::bail!(
        "{} is not lift-serve and no lift-serve binary is beside it: give --extract-worker (the lift-serve binary that extracts uploads)",
        exe.display()
    )
}
