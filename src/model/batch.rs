//! Continuous batching: [`Decoder::forward_batch`] runs one inference step of many sequences
//! (the frozen base batched, attention and adapters per sequence), and the decode step of its
//! one-token rows: one attention call over all their caches on the CPU, the decode kernels' step
//! tables on CUDA (`cuda_decode_step`, `decode_attention_cuda`).

use super::config::ModelConfig;
use super::hooks::{Adapter, DecodeMix, ForwardHooks, Projection};
use super::kv_cache::{HostElem, KvCache};
use super::llama::{causal_mask, window_cuts, Decoder, DecoderLayer, LayerCtx, Positions};
use super::weights::Linear;
use crate::kernels::decode_attention::DecodeCache;
use candle_core::{DType, Result, Tensor};
use half::f16;

/// One sequence's part of a [`Decoder::forward_batch`] step.
pub struct SeqInput<'s> {
    /// The tokens to append: a prompt chunk, or the one token sampled last.
    pub ids: &'s [u32],
    pub cache: &'s mut KvCache,
    pub adapter: Option<&'s dyn Adapter>,
    /// Equal for sequences that share one adapter (0: none): their deltas run as one matmul.
    pub adapter_key: usize,
    pub hooks: &'s mut dyn ForwardHooks,
}

/// The most rows one adapter-delta matmul takes in a batch. Up to this many rows a float
/// matmul's rows come out exactly as they do in a matmul of two rows (the shape a sequence's
/// delta gets alone, see `Lora::linear_delta`); far beyond it the CPU gemm changes strategy.
pub const SHARED_DELTA_ROWS: usize = 32;

/// How a batch's rows are laid out: `order[j]` is the sequence whose rows are `spans[j]`;
/// `float[i]` says whether sequence `i` goes through the float weights.
struct BatchPlan<'a> {
    order: &'a [usize],
    spans: &'a [std::ops::Range<usize>],
    float: &'a [bool],
}

impl Decoder {
    /// One inference step of many sequences at once (continuous batching): each appends its
    /// `ids` after what its own cache holds, with its own adapter and hooks. The frozen base
    /// runs batched — one matmul per projection for all decoding rows, which is what makes
    /// serving many users cheaper than serving them in turn: decode reads every weight once per
    /// step instead of once per user. Attention and the adapter's mix run per sequence (each has
    /// its own cache and memory). Returns each sequence's last-position logits `[n, vocab]` (f32),
    /// in the order given.
    ///
    /// A sequence gets exactly the arithmetic it gets alone: rows that would go through the
    /// quantized weights alone (fewer than `float_prefill_min_rows`) share one quantized matmul
    /// (row-independent), a prompt chunk gets its own float matmul, and an adapter's linear
    /// deltas run over at most [`SHARED_DELTA_ROWS`] rows of the sequences that share it.
    pub fn forward_batch(&self, seqs: &mut [SeqInput]) -> Result<Tensor> {
        if seqs.is_empty() || seqs.iter().any(|s| s.ids.is_empty()) {
            candle_core::bail!("a batch needs at least one sequence and one token per sequence");
        }
        let n = seqs.len();
        let float: Vec<bool> = seqs.iter().map(|s| s.ids.len() >= self.float_prefill_min_rows).collect();
        // Rows laid out with the quantized-path sequences first, grouped by adapter.
        let mut order: Vec<usize> = (0..n).collect();
        // Decoding rows first (one attention call for all, see `decode_attention`), then
        // short prompt chunks, both on the quantized path; prompt chunks on the float path last.
        order.sort_by_key(|&i| (float[i], seqs[i].ids.len() > 1, seqs[i].adapter_key));
        let decoding = if self.batched_decode_attention() {
            order.iter().take_while(|&&i| seqs[i].ids.len() == 1).count()
        } else {
            0
        };
        let mut spans = Vec::with_capacity(n);
        let mut rows = 0;
        for &i in &order {
            spans.push(rows..rows + seqs[i].ids.len());
            rows += seqs[i].ids.len();
        }
        let ids: Vec<u32> = order.iter().flat_map(|&i| seqs[i].ids.iter().copied()).collect();
        let mut x = self.embed(&Tensor::new(ids.as_slice(), &self.device)?.unsqueeze(0)?)?;
        // RoPE rows and masks of the sequences attended one by one (decoding rows take theirs in
        // `decode_attention`).
        let mut tables = Vec::with_capacity(n - decoding);
        for &i in &order[decoding..] {
            let (start, t) = (seqs[i].cache.len(), seqs[i].ids.len());
            let (cos, sin) = self.rope_slice(start, t)?;
            let mask = causal_mask(t, start, self.config.sliding_window, &self.device)?;
            tables.push((start, cos, sin, mask.map(|m| m.to_dtype(self.dtype)).transpose()?));
        }
        let plan = BatchPlan { order: &order, spans: &spans, float: &float };
        let step = self.decode_step(seqs, &order[..decoding])?;
        let eps = self.config.rms_norm_eps as f32;
        for (li, layer) in self.layers.iter().enumerate() {
            let h = self.inference_norm(&x, &layer.attn_norm, eps)?;
            let mut qkv = self.batch_linears(li, layer, &[Projection::Q, Projection::K, Projection::V], &h, &plan, seqs)?;
            let (v, k, q) = (qkv.pop(), qkv.pop(), qkv.pop());
            let (Some(q), Some(k), Some(v)) = (q, k, v) else { candle_core::bail!("three projections asked, fewer made") };
            let mut parts = Vec::with_capacity(n);
            if decoding > 0 {
                parts.push(self.decode_attention(li, seqs, &order[..decoding], [&q, &k, &v], &step)?);
            }
            for (j, &i) in order.iter().enumerate().skip(decoding) {
                let r = &spans[j];
                let rows = |a: &Tensor| a.narrow(1, r.start, r.len());
                let (start, cos, sin, mask) = &tables[j - decoding];
                let causal_only = !window_cuts(self.config.sliding_window, start + r.len());
                let positions = Positions { cos, sin, mask: mask.as_ref(), causal_only };
                let s = &mut seqs[i];
                let qkv = [&rows(&q)?, &rows(&k)?, &rows(&v)?];
                parts.push(self.attend(li, s.adapter, *start, qkv, positions, Some(&mut *s.cache), &mut *s.hooks)?);
            }
            let attn = if parts.len() == 1 { parts.remove(0) } else { Tensor::cat(&parts, 1)? };
            x = (x + self.batch_linear(li, layer, Projection::O, &attn, &plan, seqs)?)?;
            let h = self.inference_norm(&x, &layer.ffn_norm, eps)?;
            let mut gate_up = self.batch_linears(li, layer, &[Projection::Gate, Projection::Up], &h, &plan, seqs)?;
            let (Some(up), Some(gate)) = (gate_up.pop(), gate_up.pop()) else { candle_core::bail!("two projections asked, fewer made") };
            // The training path's fused SwiGLU (one pass, a vectorised exp), not candle's silu
            // then mul (a libm exp per element, two passes: 2.1 of 22.6 ms of a 16-row step).
            let act = super::ops::silu_mul(&gate, &up)?;
            x = (x + self.batch_linear(li, layer, Projection::Down, &act, &plan, seqs)?)?;
            for (j, &i) in order.iter().enumerate() {
                seqs[i].hooks.after_layer(li, &x.narrow(1, spans[j].start, spans[j].len())?)?;
            }
        }
        for s in seqs.iter_mut() {
            s.cache.commit(s.ids.len());
        }
        // Each sequence's last row, back in the caller's order.
        let mut last = vec![0u32; n];
        for (j, &i) in order.iter().enumerate() {
            last[i] = (spans[j].end - 1) as u32;
        }
        let x = x.squeeze(0)?.index_select(&Tensor::new(last.as_slice(), &self.device)?, 0)?;
        let x = self.inference_norm(&x, &self.norm, eps)?;
        let logits = if n >= self.float_batch_min_rows { self.lm_head.forward_float(&x, self.float_in_bf16())? } else { self.lm_head.forward(&x)? };
        logits.to_dtype(DType::F32)
    }

    /// Whether `forward_batch` attends its decoding rows all at once (`decode_attention`): on the
    /// CPU in f32, and on CUDA in bf16 where the kernel serves the model's head shape.
    fn batched_decode_attention(&self) -> bool {
        #[cfg(feature = "cuda")]
        if self.device.is_cuda() {
            let c = &self.config;
            return self.dtype == DType::BF16
                && c.sliding_window.is_none()
                && crate::kernels::cuda::decode_attention_fits(c.num_heads, c.num_kv_heads, c.head_dim);
        }
        self.device.is_cpu() && self.dtype == DType::F32
    }

    /// The RoPE rows (`[n, 1, d/2]` cos and sin) of the decoding rows, each at its own position.
    fn decode_rope_rows(&self, seqs: &[SeqInput], which: &[usize]) -> Result<(Tensor, Tensor)> {
        let n = which.len();
        let positions: Vec<u32> = which.iter().map(|&i| seqs[i].cache.len() as u32).collect();
        let positions = Tensor::new(positions.as_slice(), &self.device)?;
        let half = self.cos.dim(1)?;
        let cos = self.cos.index_select(&positions, 0)?.reshape((n, 1, half))?;
        let sin = self.sin.index_select(&positions, 0)?.reshape((n, 1, half))?;
        Ok((cos, sin))
    }

    /// The `n` decoding rows' heads (`[n, heads, 1, d]` each) and RoPE by `decode_rope_rows`.
    fn decode_rows(&self, n: usize, [q, k, v]: [&Tensor; 3], (cos, sin): (&Tensor, &Tensor)) -> Result<DecodeRows> {
        let cfg = &self.config;
        let (nh, nkv, hd) = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim);
        let heads = |x: &Tensor, h: usize| -> Result<Tensor> {
            x.narrow(1, 0, n)?.reshape((n, 1, h, hd))?.transpose(1, 2)?.contiguous()
        };
        let (q, k, v) = (heads(q, nh)?, heads(k, nkv)?, heads(v, nkv)?);
        let rope = if self.rope_interleaved { candle_nn::rotary_emb::rope_i } else { candle_nn::rotary_emb::rope };
        let (q_rot, k_rot) = (rope(&q, cos, sin)?, rope(&k, cos, sin)?);
        Ok(DecodeRows { q, v, q_rot, k_rot })
    }

    /// Attention of the decoding sequences `which` (one row each, rows `0..which.len()` of the
    /// batch's projections `q`, `k`, `v` `[1, rows, _]`) on the CPU (on CUDA: `decode_attention_cuda`): RoPE for all at once, each
    /// key and value appended to its sequence's cache, then one `decode_attention` call over all
    /// caches, then each adapter's mix. Returns `[1, which.len(), heads·d]`.
    fn decode_attention(
        &self,
        li: usize,
        seqs: &mut [SeqInput],
        which: &[usize],
        [q, k, v]: [&Tensor; 3],
        step: &DecodeStep,
    ) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if let Some(cuda) = &step.cuda {
            return self.decode_attention_cuda(li, seqs, which, [q, k, v], cuda);
        }
        let _ = step;
        let cfg = &self.config;
        let (nh, hd, n) = (cfg.num_heads, cfg.head_dim, which.len());
        let (cos, sin) = self.decode_rope_rows(seqs, which)?;
        let DecodeRows { q, v, q_rot, k_rot } = self.decode_rows(n, [q, k, v], (&cos, &sin))?;
        let (kr, vr) = (k_rot.flatten_all()?.to_vec1::<f32>()?, v.flatten_all()?.to_vec1::<f32>()?);
        let qv = q_rot.flatten_all()?.to_vec1::<f32>()?;
        let mut out = match self.cpu_kv_dtype {
            DType::F16 => decode_step::<f16>(li, cfg, seqs, which, &qv, &kr, &vr)?,
            _ => decode_step::<f32>(li, cfg, seqs, which, &qv, &kr, &vr)?,
        };
        // Each adapter's mix: frozen Gated Memory layers all in one parallel pass, anything
        // else through its own `mix_attention`.
        let mixes: Vec<DecodeMix> =
            which.iter().map(|&i| seqs[i].adapter.map_or(DecodeMix::Identity, |a| a.decode_mix(li))).collect();
        if mixes.iter().any(|m| !matches!(m, DecodeMix::Identity)) {
            let q_pre = q.flatten_all()?.to_vec1::<f32>()?;
            let rows: Vec<_> = mixes
                .iter()
                .enumerate()
                .filter_map(|(j, mix)| match mix {
                    DecodeMix::GatedMemory(weights) => Some((j, *weights)),
                    _ => None,
                })
                .collect();
            crate::kernels::gated_memory::mix_decode_rows(&q_pre, &mut out, &rows);
            let row = nh * hd;
            for (j, (&i, mix)) in which.iter().zip(&mixes).enumerate() {
                if let (DecodeMix::Opaque | DecodeMix::GatedMemoryPacked(..), Some(ad)) = (mix, seqs[i].adapter) {
                    let a = Tensor::from_slice(&out[j * row..(j + 1) * row], (1, nh, 1, hd), &self.device)?;
                    let mixed = ad.mix_attention(li, &q.narrow(0, j, 1)?, a)?;
                    out[j * row..(j + 1) * row].copy_from_slice(&mixed.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?);
                }
            }
        }
        Tensor::from_vec(out, (1, n, nh * hd), &self.device)
    }

    /// What the decode rows of a batch step share across layers (on CUDA; nothing elsewhere).
    fn decode_step(&self, seqs: &mut [SeqInput], which: &[usize]) -> Result<DecodeStep> {
        #[cfg(feature = "cuda")]
        if self.device.is_cuda() && !which.is_empty() {
            return Ok(DecodeStep { cuda: Some(self.cuda_decode_step(seqs, which)?) });
        }
        let _ = (seqs, which);
        Ok(DecodeStep::default())
    }

    /// The CUDA decode step's tables, made once for all layers (one host-to-device copy each
    /// instead of several per layer): RoPE rows, every layer's cache buffers (grown first, so
    /// that the kernel appends in place), keys and capacities, and the Gated Memory layers.
    #[cfg(feature = "cuda")]
    fn cuda_decode_step(&self, seqs: &mut [SeqInput], which: &[usize]) -> Result<CudaDecodeStep> {
        use crate::kernels::cuda::addresses;
        let cfg = &self.config;
        let (nkv, hd, n, layers) = (cfg.num_kv_heads, cfg.head_dim, which.len(), cfg.num_layers);
        let rope = self.decode_rope_rows(seqs, which)?;
        let like = Tensor::zeros((1, nkv, 1, hd), self.dtype, &self.device)?;
        let (mut kv, mut counts, mut buffers) = (vec![0i64; layers * 2 * n], vec![0u32; 2 * n], Vec::new());
        for (j, &i) in which.iter().enumerate() {
            let cache = &mut *seqs[i].cache;
            counts[j] = (cache.len() + 1) as u32;
            for li in 0..layers {
                let (ck, cv, capacity) = cache.device_slot(li, &like)?;
                if ck.dims4()? != (1, nkv, capacity, hd) || ck.dtype() != DType::BF16 || cv.dims() != ck.dims() {
                    candle_core::bail!("layer {li}'s cache {:?} {:?} is not bf16 [1, {nkv}, capacity, {hd}]", ck.dtype(), ck.dims());
                }
                let a = addresses(&[Some(&ck), Some(&cv)])?;
                (kv[(2 * li) * n + j], kv[(2 * li + 1) * n + j]) = (a[0], a[1]);
                counts[n + j] = capacity as u32;
                buffers.extend([ck, cv]);
            }
        }
        let mut gm_params = vec![0i64; layers * n];
        let mut gm = Vec::with_capacity(layers);
        for li in 0..layers {
            let mixes: Vec<DecodeMix> =
                which.iter().map(|&i| seqs[i].adapter.map_or(DecodeMix::Identity, |a| a.decode_mix(li))).collect();
            let dims = mixes.iter().find_map(|m| if let DecodeMix::GatedMemoryPacked(_, d) = m { Some(*d) } else { None });
            let params: Vec<Option<&Tensor>> = mixes
                .iter()
                .map(|m| match m {
                    DecodeMix::GatedMemoryPacked(p, d) if Some(*d) == dims => Some(*p),
                    _ => None,
                })
                .collect();
            // Rows whose mix only `mix_attention` can do.
            let own = mixes.iter().zip(&params).map(|(m, p)| p.is_none() && !matches!(m, DecodeMix::Identity)).collect();
            gm_params[li * n..(li + 1) * n].copy_from_slice(&addresses(&params)?);
            gm.push(LayerMix { dims, own });
        }
        Ok(CudaDecodeStep {
            rope,
            caches: Tensor::new(kv.as_slice(), &self.device)?.reshape((layers, 2, n))?,
            counts: Tensor::new(counts.as_slice(), &self.device)?.reshape((2, n))?,
            gm_params: Tensor::new(gm_params.as_slice(), &self.device)?.reshape((layers, n))?,
            gm,
            _buffers: buffers,
        })
    }

    /// `decode_attention` on CUDA: one kernel launch appends every row's key and value to its
    /// cache and attends (kernels/decode_attention.cu), one mixes every frozen Gated Memory;
    /// other mixes once per run of rows sharing an adapter.
    #[cfg(feature = "cuda")]
    fn decode_attention_cuda(
        &self,
        li: usize,
        seqs: &mut [SeqInput],
        which: &[usize],
        [q, k, v]: [&Tensor; 3],
        step: &CudaDecodeStep,
    ) -> Result<Tensor> {
        use crate::kernels::cuda::{addresses, decode_attention, gated_memory_fwd_rows};
        let cfg = &self.config;
        let (nh, nkv, hd, n) = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, which.len());
        let DecodeRows { q, v, q_rot, k_rot } = self.decode_rows(n, [q, k, v], (&step.rope.0, &step.rope.1))?;
        let mut biases = Vec::with_capacity(n);
        for &i in which {
            let start = seqs[i].cache.len();
            biases.push(match seqs[i].hooks.attention_bias(li, start, 1, start + 1)? {
                Some(b) if b.elem_count() == start + 1 => Some(b.to_device(&self.device)?.to_dtype(DType::F32)?.flatten_all()?.contiguous()?),
                Some(b) => candle_core::bail!("a decode attention bias of shape {:?} for {} keys", b.dims(), start + 1),
                None => None,
            });
        }
        let bias_table = if biases.iter().any(Option::is_some) {
            let refs: Vec<Option<&Tensor>> = biases.iter().map(Option::as_ref).collect();
            Some(Tensor::new(addresses(&refs)?.as_slice(), &self.device)?)
        } else {
            None
        };
        let (q3, k3, v3) = (q_rot.reshape((n, nh, hd))?, k_rot.reshape((n, nkv, hd))?, v.reshape((n, nkv, hd))?);
        let mut attn = decode_attention(&q3, &k3, &v3, &step.caches.get(li)?, &step.counts, bias_table.as_ref())?.reshape((n, nh, 1, hd))?;
        let mix = &step.gm[li];
        if let Some(dims) = mix.dims {
            let (qf, af) = (q.to_dtype(DType::F32)?, attn.to_dtype(DType::F32)?);
            attn = gated_memory_fwd_rows(&qf, &af, &step.gm_params.get(li)?, dims)?.to_dtype(self.dtype)?;
        }
        // Any other mix through `mix_attention`, once per run of rows sharing an adapter (rows are
        // grouped by adapter: `forward_batch`'s order).
        let mut pieces = Vec::new();
        let mut j = 0;
        while j < n {
            let first = &seqs[which[j]];
            let (key, adapter, own) = (first.adapter_key, first.adapter, mix.own[j]);
            let mut e = j + 1;
            while e < n && seqs[which[e]].adapter_key == key && seqs[which[e]].adapter.is_some() == adapter.is_some() && mix.own[e] == own {
                e += 1;
            }
            let rows = attn.narrow(0, j, e - j)?;
            pieces.push(match adapter {
                Some(a) if own => a.mix_attention(li, &q.narrow(0, j, e - j)?, rows)?,
                _ => rows,
            });
            j = e;
        }
        let attn = if pieces.len() == 1 { pieces.remove(0) } else { Tensor::cat(&pieces, 0)? };
        attn.reshape((1, n, nh * hd))
    }

    /// Projection `p` of every row of a batch (`x` `[1, rows, in]`, laid out by `plan`): one
    /// quantized matmul for all quantized-path rows, one float matmul per prompt chunk; then the
    /// base adapter's and each sequence's adapter deltas, as `LayerCtx::linear` adds them alone.
    fn batch_linear(
        &self,
        li: usize,
        layer: &DecoderLayer,
        p: Projection,
        x: &Tensor,
        plan: &BatchPlan,
        seqs: &[SeqInput],
    ) -> Result<Tensor> {
        Ok(self.batch_linears(li, layer, &[p], x, plan, seqs)?.remove(0))
    }

    /// `batch_linear` of several projections of one input (q, k, v; gate, up): their
    /// quantized-path products in one pass of the int8 kernel (`weights::forward_group`).
    fn batch_linears(
        &self,
        li: usize,
        layer: &DecoderLayer,
        ps: &[Projection],
        x: &Tensor,
        plan: &BatchPlan,
        seqs: &[SeqInput],
    ) -> Result<Vec<Tensor>> {
        let quantized = plan.float.iter().filter(|f| !**f).count();
        let mut pieces: Vec<Vec<Tensor>> = ps.iter().map(|_| Vec::new()).collect();
        if quantized > 0 {
            let rows = plan.spans[quantized - 1].end;
            let xq = x.narrow(1, 0, rows)?;
            let float = rows >= self.float_batch_min_rows;
            let lins: Vec<&Linear> = ps.iter().map(|&p| layer.linear(p)).collect();
            let ys = if float {
                lins.iter().map(|l| l.forward_float(&xq, self.float_in_bf16())).collect::<Result<Vec<_>>>()?
            } else {
                super::weights::forward_group(&lins, &xq)?
            };
            // Runs of sequences sharing one adapter (the layout groups them), ≤ SHARED_DELTA_ROWS.
            let mut runs = Vec::new();
            let mut adapters = Vec::new();
            let mut j = 0;
            while j < quantized {
                let s = &seqs[plan.order[j]];
                let mut end = j + 1;
                while end < quantized
                    && seqs[plan.order[end]].adapter_key == s.adapter_key
                    && plan.spans[end].end - plan.spans[j].start <= SHARED_DELTA_ROWS
                {
                    end += 1;
                }
                runs.push(plan.spans[j].start..plan.spans[end - 1].end);
                adapters.push(s.adapter);
                j = end;
            }
            for ((&p, mut y), out) in ps.iter().zip(ys).zip(pieces.iter_mut()) {
                if let Some(base) = self.unmerged_base(float) {
                    let base_runs: Vec<_> =
                        (0..rows).step_by(SHARED_DELTA_ROWS).map(|r| r..(r + SHARED_DELTA_ROWS).min(rows)).collect();
                    y = add_run_deltas(&y, &xq, &base_runs, |_| Some(base), li, p)?;
                }
                out.push(add_run_deltas(&y, &xq, &runs, |k| adapters[k], li, p)?);
            }
        }
        for j in quantized..plan.order.len() {
            let r = &plan.spans[j];
            let s = &seqs[plan.order[j]];
            let ctx = LayerCtx { li, adapter: s.adapter, base: self.unmerged_base(true), float: true, bf16: self.float_in_bf16(), start: 0 };
            let xj = x.narrow(1, r.start, r.len())?;
            for (&p, out) in ps.iter().zip(pieces.iter_mut()) {
                out.push(ctx.linear(layer, p, &xj)?);
            }
        }
        pieces.into_iter().map(|mut v| if v.len() == 1 { Ok(v.remove(0)) } else { Tensor::cat(&v, 1) }).collect()
    }
}

/// The CPU decode step of `which` (one row each): each sequence's new key and value rows
/// (`kr`, `vr` `[n, kv_heads, d]`, after RoPE) stored in its cache buffers of element type `T`,
/// its hooks' bias asked for, then one `decode_attention` over all caches for the queries `qv`
/// (`[n, heads, d]`). Returns `[n, heads, d]`.
fn decode_step<T: HostElem>(
    li: usize,
    cfg: &ModelConfig,
    seqs: &mut [SeqInput],
    which: &[usize],
    qv: &[f32],
    kr: &[f32],
    vr: &[f32],
) -> Result<Vec<f32>> {
    let (nh, nkv, hd) = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim);
    let row = nkv * hd;
    let mut biases = Vec::with_capacity(which.len());
    for (j, &i) in which.iter().enumerate() {
        let s = &mut seqs[i];
        let start = s.cache.len();
        s.cache.append_row::<T>(li, &kr[j * row..(j + 1) * row], &vr[j * row..(j + 1) * row], nkv, hd)?;
        let bias = s.hooks.attention_bias(li, start, 1, start + 1)?;
        biases.push(match bias {
            Some(b) if b.elem_count() == start + 1 => Some(b.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?),
            Some(b) => candle_core::bail!("a decode attention bias of shape {:?} for {} keys", b.dims(), start + 1),
            None => None,
        });
    }
    let mut caches = Vec::with_capacity(which.len());
    for (j, &i) in which.iter().enumerate() {
        let (k, v, capacity) = seqs[i].cache.host_buffers::<T>(li)?;
        caches.push(DecodeCache { k, v, capacity, len: seqs[i].cache.len() + 1, bias: biases[j].as_deref() });
    }
    Ok(crate::kernels::decode_attention::decode_attention(qv, &caches, nh, nkv, hd, 1.0 / (hd as f32).sqrt()))
}

/// What the decoding rows of one `forward_batch` step share across its layers.
#[derive(Default)]
struct DecodeStep {
    #[cfg(feature = "cuda")]
    cuda: Option<CudaDecodeStep>,
}

/// The CUDA decode kernels' inputs for one step, all layers (`Decoder::cuda_decode_step`).
#[cfg(feature = "cuda")]
struct CudaDecodeStep {
    /// RoPE rows of the decoding rows (`[n, 1, d/2]` cos, sin).
    rope: (Tensor, Tensor),
    /// i64 `[layers, 2, n]`: addresses of each row's key and value buffers per layer.
    caches: Tensor,
    /// u32 `[2, n]`: each row's keys after this step's append, and its cache capacity.
    counts: Tensor,
    /// i64 `[layers, n]`: addresses of each row's frozen Gated Memory parameters (0: none).
    gm_params: Tensor,
    gm: Vec<LayerMix>,
    /// The buffers the address tables point into, kept alive for the step.
    _buffers: Vec<Tensor>,
}

/// The Gated Memory mix of one layer of a CUDA decode step.
#[cfg(feature = "cuda")]
struct LayerMix {
    /// Shapes of the layers mixed in one launch (`gm_params`); `None`: no such layer.
    dims: Option<crate::kernels::gated_memory::GmDims>,
    /// Rows whose adapter's mix only its `mix_attention` can do.
    own: Vec<bool>,
}

/// A decode step's rows as `Decoder::decode_rows` lays them out: query and value heads, and the
/// query and key heads after RoPE (`[n, heads, 1, d]`).
struct DecodeRows {
    q: Tensor,
    v: Tensor,
    q_rot: Tensor,
    k_rot: Tensor,
}

/// `y` with `adapter(k)`'s linear delta added to the rows `runs[k]` (`[1, rows, _]`); `y` itself
/// when no run has a delta.
fn add_run_deltas<'a>(
    y: &Tensor,
    x: &Tensor,
    runs: &[std::ops::Range<usize>],
    adapter: impl Fn(usize) -> Option<&'a dyn Adapter>,
    li: usize,
    p: Projection,
) -> Result<Tensor> {
    let mut deltas = Vec::with_capacity(runs.len());
    for (k, r) in runs.iter().enumerate() {
        let d = match adapter(k) {
            Some(a) => a.linear_delta(li, p, &x.narrow(1, r.start, r.len())?)?,
            None => None,
        };
        deltas.push(d);
    }
    if deltas.iter().all(Option::is_none) {
        return Ok(y.clone());
    }
    let pieces = runs
        .iter()
        .zip(deltas)
        .map(|(r, d)| {
            let yr = y.narrow(1, r.start, r.len())?;
            match d {
                Some(d) => yr + d,
                None => Ok(yr),
            }
        })
        .collect::<Result<Vec<_>>>()?;
    Tensor::cat(&pieces, 1)
}
