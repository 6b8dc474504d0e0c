//! Figures the bench binaries print (shared through `#[path]`).

/// Nearest-rank percentile (`p` in [0, 1]); NaN for no samples.
pub fn percentile(xs: &[f64], p: f64) -> f64 {
    let mut v = xs.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    if v.is_empty() {
        return f64::NAN;
    }
    let rank = ((p * v.len() as f64).ceil() as usize).clamp(1, v.len());
    v[rank - 1]
}

/// Median seconds of `runs` calls of `f`, after one warm-up call.
#[allow(dead_code)] // not every bench that includes this file times calls
pub fn median_s(runs: usize, mut f: impl FnMut()) -> f64 {
    f();
    let t: Vec<f64> = (0..runs)
        .map(|_| {
            let s = std::time::Instant::now();
            f();
            s.elapsed().as_secs_f64()
        })
        .collect();
    percentile(&t, 0.5)
}
