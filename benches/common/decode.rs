//! A timed greedy decode loop, shared by the benches that report batch-1 decode speed.

use candle_core::Tensor;
use lift_serve::model::{KvCache, Logits, Model, NoHooks};
use std::time::Instant;

/// `steps` greedy steps after a prompt whose last logits are `logits` (`[1, vocab]`) and whose
/// keys and values are in `cache`; returns each step's time in seconds (argmax + one forward).
pub fn timed_greedy_steps(model: &Model, cache: &mut KvCache, mut logits: Tensor, steps: usize) -> anyhow::Result<Vec<f64>> {
    let dev = model.decoder.device().clone();
    let mut times = Vec::with_capacity(steps);
    for _ in 0..steps {
        let t = Instant::now();
        let next = logits.argmax(1)?.to_vec1::<u32>()?[0];
        let x = Tensor::new(&[next], &dev)?.unsqueeze(0)?;
        logits = model.decoder.forward(&x, cache, None, &mut NoHooks, Logits::Last)?;
        times.push(t.elapsed().as_secs_f64());
    }
    Ok(times)
}
