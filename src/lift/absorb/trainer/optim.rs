//! The trainer's optimizers: AdamW on f32 `Var`s (on CUDA one fused step), global grad-norm
//! clipping, and the learning rate of each optimizer step; `Optimizers` pairs the adapter's
//! AdamW with a trainable filter's.

use super::TrainOptions;
use anyhow::Result;
use candle_core::{Tensor, Var};

/// AdamW on f32 `Var`s (decoupled weight decay, bias-corrected moments).
pub struct AdamW {
    vars: Vec<Var>,
    m: Vec<Tensor>,
    v: Vec<Tensor>,
    t: usize,
    opts: TrainOptions,
}

impl AdamW {
    pub fn new(vars: Vec<Var>, opts: &TrainOptions) -> Result<Self> {
        let m = vars.iter().map(|v| v.zeros_like()).collect::<candle_core::Result<Vec<_>>>()?;
        let v = vars.iter().map(|v| v.zeros_like()).collect::<candle_core::Result<Vec<_>>>()?;
        Ok(Self { vars, m, v, t: 0, opts: opts.clone() })
    }

    /// The moments and the step count, to checkpoint.
    pub fn state(&self) -> (&[Tensor], &[Tensor], usize) {
        (&self.m, &self.v, self.t)
    }

    /// Restores [`Self::state`] (same variables, same order).
    pub fn restore(&mut self, m: Vec<Tensor>, v: Vec<Tensor>, t: usize) -> Result<()> {
        anyhow::ensure!(m.len() == self.vars.len() && v.len() == self.vars.len(), "optimizer state of another shape");
        for (i, var) in self.vars.iter().enumerate() {
            anyhow::ensure!(m[i].dims() == var.dims() && v[i].dims() == var.dims(), "optimizer state of another shape");
        }
        (self.m, self.v, self.t) = (m, v, t);
        Ok(())
    }

    /// The moments and step count as named tensors (`{prefix}.{i}.m`, `{prefix}.{i}.v`,
    /// `{prefix}.t`), to write in a checkpoint beside the parameters.
    pub fn named_state(&self, prefix: &str) -> Result<Vec<(String, Tensor)>> {
        let mut out = Vec::with_capacity(2 * self.m.len() + 1);
        for (i, (m, v)) in self.m.iter().zip(&self.v).enumerate() {
            out.push((format!("{prefix}.{i}.m"), m.clone()));
            out.push((format!("{prefix}.{i}.v"), v.clone()));
        }
        let device = self.vars.first().map_or(candle_core::Device::Cpu, |v| v.device().clone());
        out.push((format!("{prefix}.t"), Tensor::new(&[self.t as u32], &device)?));
        Ok(out)
    }

    /// Restores [`Self::named_state`] from `tensors` (taking them out of the map).
    pub fn restore_named(&mut self, prefix: &str, tensors: &mut std::collections::HashMap<String, Tensor>) -> Result<()> {
        let mut take = |k: String| tensors.remove(&k).ok_or_else(|| anyhow::anyhow!("the checkpoint lacks {k}"));
        let t = take(format!("{prefix}.t"))?.to_vec1::<u32>()?[0] as usize;
        let (mut m, mut v) = (Vec::new(), Vec::new());
        for i in 0..self.vars.len() {
            let device = self.vars[i].device();
            m.push(take(format!("{prefix}.{i}.m"))?.to_device(device)?);
            v.push(take(format!("{prefix}.{i}.v"))?.to_device(device)?);
        }
        self.restore(m, v, t)
    }

    /// [`clip`] the gradients to global norm `max_norm` (≤ 0: no clipping), then [`Self::step`].
    /// On CUDA both in two kernel launches (kernels/adamw.cu) where the variables are f32.
    pub fn clip_and_step(&mut self, grads: Vec<Tensor>, max_norm: f64, lr: f64) -> Result<()> {
        #[cfg(feature = "cuda")]
        if self.vars.first().is_some_and(|v| v.device().is_cuda()) && self.vars.iter().all(|v| v.dtype() == candle_core::DType::F32) {
            return self.cuda_step(&grads, max_norm, lr);
        }
        self.step(&clip(grads, max_norm)?, lr)
    }

    #[cfg(feature = "cuda")]
    fn cuda_step(&mut self, grads: &[Tensor], max_norm: f64, lr: f64) -> Result<()> {
        self.t += 1;
        let o = &self.opts;
        let scalars = crate::kernels::cuda::AdamWScalars {
            beta1: o.beta1 as f32,
            beta2: o.beta2 as f32,
            eps: o.eps as f32,
            lr: lr as f32,
            decay: (1.0 - lr * o.weight_decay) as f32,
            bc1: (1.0 - o.beta1.powi(self.t as i32)) as f32,
            bc2: (1.0 - o.beta2.powi(self.t as i32)) as f32,
            max_norm: max_norm as f32,
        };
        let grads = grads.iter().map(|g| g.detach().contiguous()).collect::<candle_core::Result<Vec<_>>>()?;
        let params: Vec<&Tensor> = self.vars.iter().map(|v| v.as_tensor()).collect();
        crate::kernels::cuda::adamw_step(&params, &grads, &self.m, &self.v, scalars, max_norm > 0.0)?;
        Ok(())
    }

    /// One update with `grads[i]` for `vars[i]` at learning rate `lr`.
    pub fn step(&mut self, grads: &[Tensor], lr: f64) -> Result<()> {
        self.t += 1;
        let o = &self.opts;
        let bc1 = 1.0 - o.beta1.powi(self.t as i32);
        let bc2 = 1.0 - o.beta2.powi(self.t as i32);
        for i in 0..self.vars.len() {
            // Gradients of a product with a `Var` carry an autograd graph back to that step's
            // activations; optimizer state built from them would chain every step's graph.
            let g = &grads[i].detach();
            let m = ((&self.m[i] * o.beta1)? + (g * (1.0 - o.beta1))?)?;
            let v = ((&self.v[i] * o.beta2)? + (g.sqr()? * (1.0 - o.beta2))?)?;
            let update = ((&m / bc1)? / ((&v / bc2)?.sqrt()? + o.eps)?)?;
            let var = &self.vars[i];
            let decayed = (var.as_tensor().detach() * (1.0 - lr * o.weight_decay))?;
            var.set(&(decayed - (update * lr)?)?)?;
            self.m[i] = m.detach();
            self.v[i] = v.detach();
        }
        Ok(())
    }
}

/// The adapter's optimizer and a trainable filter's, each clipped on its own.
pub(super) struct Optimizers {
    adapter: AdamW,
    filter: AdamW,
    n_adapter_vars: usize,
    filter_lr_scale: f64,
}

impl Optimizers {
    pub(super) fn new(adapter_vars: &[Var], filter_vars: &[Var], filter_lr_scale: f64, opts: &TrainOptions) -> Result<Self> {
        Ok(Self {
            adapter: AdamW::new(adapter_vars.to_vec(), opts)?,
            filter: AdamW::new(filter_vars.to_vec(), opts)?,
            n_adapter_vars: adapter_vars.len(),
            filter_lr_scale,
        })
    }

    /// Optimizer step `step` with `grads` (the adapter's, then the filter's), the learning rate
    /// scaled by `lr_scale`.
    pub(super) fn step(&mut self, mut grads: Vec<Tensor>, opts: &TrainOptions, step: usize, lr_scale: f64) -> Result<()> {
        let filter_grads = grads.split_off(self.n_adapter_vars.min(grads.len()));
        let lr = current_lr(opts, step) * lr_scale;
        self.adapter.clip_and_step(grads, opts.max_grad_norm, lr)?;
        if !filter_grads.is_empty() {
            self.filter.clip_and_step(filter_grads, opts.max_grad_norm, lr * self.filter_lr_scale)?;
        }
        Ok(())
    }
}

impl Optimizers {
    /// Both optimizers' state as named tensors (`optimizer.adapter.*`, `optimizer.filter.*`).
    pub(super) fn named_state(&self) -> Result<Vec<(String, Tensor)>> {
        let mut out = self.adapter.named_state("optimizer.adapter")?;
        out.extend(self.filter.named_state("optimizer.filter")?);
        Ok(out)
    }

    /// Restores [`Self::named_state`].
    pub(super) fn restore_named(&mut self, tensors: &mut std::collections::HashMap<String, Tensor>) -> Result<()> {
        self.adapter.restore_named("optimizer.adapter", tensors)?;
        self.filter.restore_named("optimizer.filter", tensors)
    }
}

/// The learning rate of optimizer step `step` (linear warm-up, then constant).
fn current_lr(opts: &TrainOptions, step: usize) -> f64 {
    if opts.warmup_steps > 0 && step < opts.warmup_steps {
        opts.lr * (step + 1) as f64 / opts.warmup_steps as f64
    } else {
        opts.lr
    }
}

/// Scales gradients so their global L2 norm is at most `max_norm`.
pub(crate) fn clip(grads: Vec<Tensor>, max_norm: f64) -> Result<Vec<Tensor>> {
    if max_norm <= 0.0 || grads.is_empty() {
        return Ok(grads);
    }
    let mut sq = 0f64;
    for g in &grads {
        sq += g.sqr()?.sum_all()?.to_scalar::<f32>()? as f64;
    }
    let norm = sq.sqrt();
    if norm <= max_norm || !norm.is_finite() {
        return Ok(grads);
    }
    let s = max_norm / (norm + 1e-6);
    Ok(grads.iter().map(|g| g * s).collect::<candle_core::Result<_>>()?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn adamw_matches_hand_computed_update() {
        // One step on f(x) = x² from x = 1: grad 2, m̂ = 2, v̂ = 4, update = 1 (bias-corrected).
        let x = Var::new(&[1.0f32], &Device::Cpu).unwrap();
        let opts = TrainOptions { weight_decay: 0.1, ..Default::default() };
        let mut opt = AdamW::new(vec![x.clone()], &opts).unwrap();
        let g = Tensor::new(&[2.0f32], &Device::Cpu).unwrap();
        opt.step(&[g], 0.01).unwrap();
        let got = x.as_tensor().to_vec1::<f32>().unwrap()[0];
        let want = 1.0 * (1.0 - 0.01 * 0.1) - 0.01 * 2.0 / (4f32.sqrt() + 1e-8);
        assert!((got - want).abs() < 1e-6, "{got} vs {want}");
    }

    #[test]
    fn clipping_bounds_the_global_norm() {
        let a = Tensor::new(&[3.0f32, 0.0], &Device::Cpu).unwrap();
        let b = Tensor::new(&[4.0f32], &Device::Cpu).unwrap();
        let c = clip(vec![a, b], 1.0).unwrap();
        let n: f32 = c.iter().map(|t| t.sqr().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap()).sum();
        assert!((n.sqrt() - 1.0).abs() < 1e-4);
        let small = clip(vec![Tensor::new(&[0.1f32], &Device::Cpu).unwrap()], 1.0).unwrap();
        assert_eq!(small[0].to_vec1::<f32>().unwrap(), vec![0.1]);
    }
}
