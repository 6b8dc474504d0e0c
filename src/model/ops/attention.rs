//! `causal_attention`: causal scaled-dot-product attention with an optional additive (trainable) bias.
//!
//! Two private custom ops, both aware of the causal structure:
//!   P = CausalProbs(q, k [, bias])   softmax(scale·q·kᵀ + bias) with future keys masked
//!   O = CausalPv(P, v)               P·v
//! Queries are processed in blocks of ATTN_BLOCK rows; a block only multiplies against the
//! keys its last row can see, and the key-side gradients (dk, dv) are computed per key block
//! from only the queries that see those keys. For tq = tk = 512 and 128-row blocks this
//! skips ~3/8 of the six gemms' work, and the masked entries are never scaled, exponentiated
//! or stored. All gemms go through candle's CPU gemm (`CpuStorage::matmul`) on strided views.
//! P is the only saved activation (the composite keeps the raw scores, scaled scores, masked
//! scores and P).

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp2, CustomOp3, DType, Device, Layout, Result, Shape, Storage, Tensor};
use rayon::prelude::*;
use super::softmax::softmax_composite;
use super::{fused_f32, with_f32, cpu_tensor, softmax_row_inplace, softmax_bwd_row};

/// Query/key block size for the causal attention kernels.
const ATTN_BLOCK: usize = 128;

/// Number of keys query `i` may attend when `tq` queries are the last of `tk` positions.
#[inline]
fn visible_keys(i: usize, tq: usize, tk: usize) -> usize {
    (tk + i + 1).saturating_sub(tq).min(tk)
}

/// First query that sees key `j` (tq if none does).
#[inline]
fn first_query_seeing(j: usize, tq: usize, tk: usize) -> usize {
    (j + tq).saturating_sub(tk).min(tq)
}

/// `[start, end)` blocks of `ATTN_BLOCK` rows covering `0..n`.
fn blocks(n: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..n)
        .step_by(ATTN_BLOCK)
        .map(move |s| (s, (s + ATTN_BLOCK).min(n)))
}

/// A batch of strided matrices inside a CPU storage: element (b, r, c) lives at
/// `offset + b·bs + r·rs + c·cs`.
#[derive(Clone, Copy)]
struct MatView {
    offset: usize,
    bs: usize,
    rs: usize,
    cs: usize,
}

impl MatView {
    fn rows(offset: usize, bs: usize, rs: usize) -> Self {
        Self {
            offset,
            bs,
            rs,
            cs: 1,
        }
    }
    /// The transpose of a row-major view.
    fn cols(offset: usize, bs: usize, cs: usize) -> Self {
        Self {
            offset,
            bs,
            rs: 1,
            cs,
        }
    }
}

/// Sizes of a batched product: `batch` products of an m×k and a k×n matrix.
#[derive(Clone, Copy)]
struct GemmShape {
    batch: usize,
    m: usize,
    n: usize,
    k: usize,
}

/// out[b] = a[b] (m×k) · b[b] (k×n) for `batch` matrices, returned contiguous
/// (batch, m, n), via candle's CPU gemm. candle does not bounds-check matmul layouts (the
/// gemm reads raw pointers), so the views are checked here.
fn bgemm(a: &CpuStorage, av: MatView, b: &CpuStorage, bv: MatView, shape: GemmShape) -> Result<Vec<f32>> {
    let GemmShape { batch, m, n, k } = shape;
    if batch * m * n == 0 {
        return Ok(vec![]);
    }
    if k == 0 {
        return Ok(vec![0.0; batch * m * n]);
    }
    let fits = |v: &MatView, s: &CpuStorage, rows: usize, cols: usize| -> Result<bool> {
        let last = v.offset + (batch - 1) * v.bs + (rows - 1) * v.rs + (cols - 1) * v.cs;
        Ok(last < s.as_slice::<f32>()?.len())
    };
    if !fits(&av, a, m, k)? || !fits(&bv, b, k, n)? {
        bail!("fused-attention: internal error, gemm view out of bounds");
    }
    let al = Layout::new(
        Shape::from((batch, m, k)),
        vec![av.bs, av.rs, av.cs],
        av.offset,
    );
    let bl = Layout::new(
        Shape::from((batch, k, n)),
        vec![bv.bs, bv.rs, bv.cs],
        bv.offset,
    );
    match a.matmul(b, (batch, m, n, k), &al, &bl)? {
        CpuStorage::F32(v) => Ok(v),
        _ => bail!("fused-attention: expected an f32 gemm result"),
    }
}

/// One gemm result per row block: rows `[start, end)` of every batch entry, `width`
/// columns, stored contiguous (batch, end − start, width).
struct RowBlock {
    start: usize,
    width: usize,
    data: Vec<f32>,
}

/// Scatters per-block gemm results into a zeroed contiguous (batch, t, w) buffer, one
/// rayon task per row. Row `r` copies `row_width(r)` ≤ block width columns, multiplied by
/// `mul`. Blocks are `ATTN_BLOCK` rows, so block index = r / ATTN_BLOCK.
fn assemble(
    batch: usize,
    t: usize,
    w: usize,
    blocks: &[Option<RowBlock>],
    mul: f32,
    row_width: impl Fn(usize) -> usize + Sync,
) -> Vec<f32> {
    let mut out = vec![0f32; batch * t * w];
    out.par_chunks_mut(w.max(1))
        .enumerate()
        .for_each(|(idx, row)| {
            let (bi, r) = (idx / t, idx % t);
            if let Some(Some(blk)) = blocks.get(r / ATTN_BLOCK) {
                let rows = blk.data.len() / (batch * blk.width).max(1);
                let src = (bi * rows + (r - blk.start)) * blk.width;
                let n = row_width(r).min(blk.width);
                for (o, &s) in row[..n].iter_mut().zip(&blk.data[src..src + n]) {
                    *o = s * mul;
                }
            }
        });
    out
}

/// Runs `f` on the CPU storage and layout of a tensor.
fn with_cpu<R>(
    t: &Tensor,
    op: &'static str,
    f: impl FnOnce(&CpuStorage, &Layout) -> Result<R>,
) -> Result<R> {
    let (storage, layout) = t.storage_and_layout();
    match &*storage {
        Storage::Cpu(s) => f(s, layout),
        _ => bail!("{op}: expected a cpu tensor"),
    }
}

/// `P = softmax(scale·q·kᵀ + bias)` over q [b,h,tq,d], k [b,h,tk,d] (contiguous) with
/// future keys masked, and an optional bias given as a (possibly stride-0 broadcast)
/// [b,h,tq,tk] view. Entries of P beyond a row's visible keys are exactly 0.
struct CausalProbs {
    scale: f32,
}

impl CausalProbs {
    fn fwd(
        &self,
        qs: &CpuStorage,
        ql: &Layout,
        ks: &CpuStorage,
        kl: &Layout,
        bias: Option<(&CpuStorage, &Layout)>,
    ) -> Result<(CpuStorage, Shape)> {
        let (b, h, tq, d) = ql.shape().dims4()?;
        let (_, _, tk, _) = kl.shape().dims4()?;
        if !ql.is_contiguous() || !kl.is_contiguous() {
            bail!("fused-attention: q and k must be contiguous");
        }
        let bh = b * h;
        // Raw scores per query block, only against the keys the block can see.
        let mut scores = Vec::new();
        for (i0, i1) in blocks(tq) {
            let lim = visible_keys(i1 - 1, tq, tk);
            let data = bgemm(
                qs,
                MatView::rows(ql.start_offset() + i0 * d, tq * d, d),
                ks,
                MatView::cols(kl.start_offset(), tk * d, d),
                GemmShape { batch: bh, m: i1 - i0, n: lim, k: d },
            )?;
            scores.push(RowBlock {
                start: i0,
                width: lim,
                data,
            });
        }
        let bias = match bias {
            Some((s, l)) => Some((s.as_slice::<f32>()?, l.stride().to_vec(), l.start_offset())),
            None => None,
        };
        let scale = self.scale;
        let mut p = vec![0f32; bh * tq * tk];
        p.par_chunks_mut(tk).enumerate().for_each(|(idx, row)| {
            let (bhi, i) = (idx / tq, idx % tq);
            let lim = visible_keys(i, tq, tk);
            let blk = &scores[i / ATTN_BLOCK];
            let src =
                (bhi * (blk.data.len() / (bh * blk.width).max(1)) + i - blk.start) * blk.width;
            let (vis, src) = (&mut row[..lim], &blk.data[src..src + lim]);
            match &bias {
                None => {
                    for (v, &s) in vis.iter_mut().zip(src) {
                        *v = s * scale;
                    }
                }
                Some((data, st, off)) => {
                    let base = off + (bhi / h) * st[0] + (bhi % h) * st[1] + i * st[2];
                    if st[3] == 1 {
                        let bias = &data[base..base + lim];
                        for ((v, &s), &bb) in vis.iter_mut().zip(src).zip(bias) {
                            *v = s * scale + bb;
                        }
                    } else {
                        for (j, (v, &s)) in vis.iter_mut().zip(src).enumerate() {
                            *v = s * scale + data[base + j * st[3]];
                        }
                    }
                }
            }
            softmax_row_inplace(vis);
        });
        Ok((CpuStorage::F32(p), Shape::from((b, h, tq, tk))))
    }

    /// dS = P ⊙ (dP − Σ dP⊙P) on visible entries (dP beyond them is ignored);
    /// dq = scale·dS·k per query block, dk = scale·dSᵀ·q per key block (only the queries
    /// that see the block), dbias = dS (candle's broadcast backward sums it to the bias's
    /// own shape).
    fn bwd_impl(
        &self,
        q: &Tensor,
        k: &Tensor,
        bias_wants_grad: bool,
        p: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (want_q, want_k) = (q.track_op(), k.track_op());
        if !want_q && !want_k && !bias_wants_grad {
            return Ok((None, None, None));
        }
        let (b, h, tq, d) = q.dims4()?;
        let dims = AttnDims { bh: b * h, tq, tk: k.dim(2)?, d };
        let grad = grad.contiguous()?;
        let ds = CpuStorage::F32(causal_softmax_bwd(p, &grad, dims)?);
        let dq = if want_q { Some(cpu_tensor(causal_dq(&ds, k, dims, self.scale)?, q.shape())?) } else { None };
        let dk = if want_k { Some(cpu_tensor(causal_dk(&ds, q, dims, self.scale)?, k.shape())?) } else { None };
        let dbias = if bias_wants_grad {
            match ds {
                CpuStorage::F32(ds) => Some(cpu_tensor(ds, p.shape())?),
                _ => None,
            }
        } else {
            None
        };
        Ok((dq, dk, dbias))
    }
}

/// Sizes of a causal attention: batch × heads, queries, keys and head dim.
#[derive(Clone, Copy)]
struct AttnDims {
    bh: usize,
    tq: usize,
    tk: usize,
    d: usize,
}

/// The attention ops' name in errors.
const FUSED_ATTENTION: &str = "fused-attention";

/// dS = P ⊙ (dP − Σ dP⊙P) on each row's visible entries (zero beyond them), `[bh, tq, tk]`.
fn causal_softmax_bwd(p: &Tensor, grad: &Tensor, dims: AttnDims) -> Result<Vec<f32>> {
    let AttnDims { tq, tk, .. } = dims;
    with_f32(p, FUSED_ATTENTION, |p| {
        with_f32(grad, FUSED_ATTENTION, |g| {
            let mut ds = vec![0f32; p.len()];
            ds.par_chunks_mut(tk).zip(p.par_chunks(tk).zip(g.par_chunks(tk))).enumerate().for_each(
                |(idx, (ds, (p, g)))| {
                    let lim = visible_keys(idx % tq, tq, tk);
                    softmax_bwd_row(&p[..lim], &g[..lim], &mut ds[..lim]);
                },
            );
            Ok(ds)
        })
    })
}

/// dq = scale·dS·k.
fn causal_dq(ds: &CpuStorage, k: &Tensor, dims: AttnDims, scale: f32) -> Result<Vec<f32>> {
    with_cpu(k, FUSED_ATTENTION, |ks, kl| causal_times((ds, 0), (ks, kl.start_offset()), dims, scale))
}

/// dk = scale·dSᵀ·q.
fn causal_dk(ds: &CpuStorage, q: &Tensor, dims: AttnDims, scale: f32) -> Result<Vec<f32>> {
    with_cpu(q, FUSED_ATTENTION, |qs, ql| causal_transposed_times((ds, 0), (qs, ql.start_offset()), dims, scale))
}

/// `mul·A·B` for causal A `[bh, tq, tk]` (zero beyond each row's visible keys) and B
/// `[bh, tk, d]`, per query block against only the keys it sees: `[bh, tq, d]`. Each operand
/// is a contiguous storage and the offset it starts at. (`P·v` and `dq`.)
fn causal_times(a: (&CpuStorage, usize), b: (&CpuStorage, usize), dims: AttnDims, mul: f32) -> Result<Vec<f32>> {
    let AttnDims { bh, tq, tk, d } = dims;
    let blks = blocks(tq)
        .map(|(i0, i1)| {
            let lim = visible_keys(i1 - 1, tq, tk);
            let data = bgemm(
                a.0,
                MatView::rows(a.1 + i0 * tk, tq * tk, tk),
                b.0,
                MatView::rows(b.1, tk * d, d),
                GemmShape { batch: bh, m: i1 - i0, n: d, k: lim },
            )?;
            Ok(Some(RowBlock { start: i0, width: d, data }))
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(assemble(bh, tq, d, &blks, mul, |_| d))
}

/// `mul·Aᵀ·B` for causal A `[bh, tq, tk]` and B `[bh, tq, d]`, per key block over only the
/// queries that see it: `[bh, tk, d]`. Operands as in [`causal_times`]. (`dv` and `dk`.)
fn causal_transposed_times(
    a: (&CpuStorage, usize),
    b: (&CpuStorage, usize),
    dims: AttnDims,
    mul: f32,
) -> Result<Vec<f32>> {
    let AttnDims { bh, tq, tk, d } = dims;
    let blks = blocks(tk)
        .map(|(j0, j1)| {
            let first = first_query_seeing(j0, tq, tk);
            if first >= tq {
                return Ok(None);
            }
            let data = bgemm(
                a.0,
                MatView::cols(a.1 + first * tk + j0, tq * tk, tk),
                b.0,
                MatView::rows(b.1 + first * d, tq * d, d),
                GemmShape { batch: bh, m: j1 - j0, n: d, k: tq - first },
            )?;
            Ok(Some(RowBlock { start: j0, width: d, data }))
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(assemble(bh, tk, d, &blks, mul, |_| d))
}

impl CustomOp2 for CausalProbs {
    fn name(&self) -> &'static str {
        "fused-attention-probs"
    }

    fn cpu_fwd(
        &self,
        qs: &CpuStorage,
        ql: &Layout,
        ks: &CpuStorage,
        kl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        self.fwd(qs, ql, ks, kl, None)
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (dq, dk, _) = self.bwd_impl(q, k, false, res, grad)?;
        Ok((dq, dk))
    }
}

impl CustomOp3 for CausalProbs {
    fn name(&self) -> &'static str {
        "fused-attention-probs-bias"
    }

    fn cpu_fwd(
        &self,
        qs: &CpuStorage,
        ql: &Layout,
        ks: &CpuStorage,
        kl: &Layout,
        bs: &CpuStorage,
        bl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        self.fwd(qs, ql, ks, kl, Some((bs, bl)))
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        bias: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        self.bwd_impl(q, k, bias.track_op(), res, grad)
    }
}

/// `O = P·v` for causal P [b,h,tq,tk] (as produced by `CausalProbs`: zero beyond each
/// row's visible keys, contiguous) and contiguous v [b,h,tk,d]. Only the visible part of
/// P is multiplied. Backward: dP = dO·vᵀ on visible entries only (CausalProbs ignores the
/// rest), dv = Pᵀ·dO per key block over the queries that see it.
struct CausalPv;

impl CustomOp2 for CausalPv {
    fn name(&self) -> &'static str {
        "fused-attention-pv"
    }

    fn cpu_fwd(
        &self,
        ps: &CpuStorage,
        pl: &Layout,
        vs: &CpuStorage,
        vl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (b, h, tq, tk) = pl.shape().dims4()?;
        let d = vl.dim(3)?;
        if !pl.is_contiguous() || !vl.is_contiguous() {
            bail!("fused-attention: P and v must be contiguous");
        }
        let dims = AttnDims { bh: b * h, tq, tk, d };
        let out = causal_times((ps, pl.start_offset()), (vs, vl.start_offset()), dims, 1.0)?;
        Ok((CpuStorage::F32(out), Shape::from((b, h, tq, d))))
    }

    fn bwd(
        &self,
        p: &Tensor,
        v: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (b, h, tq, tk) = p.dims4()?;
        let d = v.dim(3)?;
        let bh = b * h;
        let grad = grad.contiguous()?;
        let (dp, dv) = with_cpu(&grad, FUSED_ATTENTION, |gs, gl| {
            with_cpu(p, FUSED_ATTENTION, |ps, pl| {
                with_cpu(v, FUSED_ATTENTION, |vs, vl| {
                    let dp = if p.track_op() {
                        let blks = blocks(tq)
                            .map(|(i0, i1)| {
                                let lim = visible_keys(i1 - 1, tq, tk);
                                let data = bgemm(
                                    gs,
                                    MatView::rows(gl.start_offset() + i0 * d, tq * d, d),
                                    vs,
                                    MatView::cols(vl.start_offset(), tk * d, d),
                                    GemmShape { batch: bh, m: i1 - i0, n: lim, k: d },
                                )?;
                                Ok(Some(RowBlock {
                                    start: i0,
                                    width: lim,
                                    data,
                                }))
                            })
                            .collect::<Result<Vec<_>>>()?;
                        let dp = assemble(bh, tq, tk, &blks, 1.0, |i| visible_keys(i, tq, tk));
                        Some(cpu_tensor(dp, p.shape())?)
                    } else {
                        None
                    };
                    let dv = if v.track_op() {
                        let dims = AttnDims { bh, tq, tk, d };
                        let dv = causal_transposed_times((ps, pl.start_offset()), (gs, gl.start_offset()), dims, 1.0)?;
                        Some(cpu_tensor(dv, v.shape())?)
                    } else {
                        None
                    };
                    Ok((dp, dv))
                })
            })
        })?;
        Ok((dp, dv))
    }
}

/// Additive causal mask [tq, tk]: 0 where key j is visible to query i, -inf elsewhere.
pub(super) fn causal_mask(tq: usize, tk: usize, dtype: DType, device: &Device) -> Result<Tensor> {
    let mask: Vec<f32> = (0..tq)
        .flat_map(|i| {
            let lim = visible_keys(i, tq, tk);
            (0..tk).map(move |j| if j < lim { 0.0 } else { f32::NEG_INFINITY })
        })
        .collect();
    Tensor::from_vec(mask, (tq, tk), device)?.to_dtype(dtype)
}

fn causal_attention_composite(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    bias: Option<&Tensor>,
) -> Result<Tensor> {
    let (_, _, tq, _) = q.dims4()?;
    let (_, _, tk, _) = k.dims4()?;
    let scores = (q.contiguous()?.matmul(&k.contiguous()?.t()?)? * scale)?;
    let scores = scores.broadcast_add(&causal_mask(tq, tk, scores.dtype(), q.device())?)?;
    let scores = match bias {
        Some(bias) => scores.broadcast_add(bias)?,
        None => scores,
    };
    softmax_composite(&scores)?.matmul(&v.contiguous()?)
}

/// Causal scaled-dot-product attention with an optional additive (trainable) bias.
///
/// `q` `[b, h, tq, d]`, `k`/`v` `[b, h, tk, d]` (KV heads already repeated for GQA).
/// Query `i` sits at absolute position `tk − tq + i` and attends keys `0..=tk − tq + i`;
/// if `tq > tk` the first `tq − tk` queries see no key and output zeros (zero gradient).
/// `bias` is broadcastable to `[b, h, tq, tk]` and is added after scaling; its gradient
/// flows (summed back to its own shape by candle's broadcast backward). Gradients flow to
/// q, k, v and bias.
///
/// CPU/f32: two fused custom ops (see `CausalProbs` / `CausalPv`): block-causal gemms that
/// skip fully masked key ranges, one rayon pass for scale + bias + mask + softmax, only P
/// saved for the backward, one pass for the softmax backward. Otherwise the composite
/// (matmul, mask, bias, softmax, matmul).
pub fn causal_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    bias: Option<&Tensor>,
) -> Result<Tensor> {
    let (b, h, tq, d) = q.dims4()?;
    let (kb, kh, tk, kd) = k.dims4()?;
    if (kb, kh, kd) != (b, h, d) || v.dims4()? != (b, h, tk, d) {
        bail!(
            "causal_attention: q {:?}, k {:?}, v {:?} disagree",
            q.shape(),
            k.shape(),
            v.shape()
        );
    }
    let mut all = vec![q, k, v];
    all.extend(bias);
    #[cfg(feature = "cuda")]
    if q.device().is_cuda() && matches!(q.dtype(), DType::F32 | DType::BF16) && tq > 0 && tk > 0 && d > 0 {
        // cuBLAS q·kᵀ, the fused masked softmax kernel (kernels/masked_softmax.cu), cuBLAS P·v.
        let scores = q.contiguous()?.matmul(&k.contiguous()?.t()?)?;
        let probs = crate::kernels::masked_softmax::masked_softmax(&scores, bias, scale)?;
        return probs.matmul(&v.contiguous()?);
    }
    if !fused_f32(&all) || tq == 0 || tk == 0 || d == 0 {
        return causal_attention_composite(q, k, v, scale, bias);
    }
    let op = CausalProbs {
        scale: scale as f32,
    };
    let (q, k) = (q.contiguous()?, k.contiguous()?);
    let probs = match bias {
        None => q.apply_op2(&k, op)?,
        Some(bias) => q.apply_op3(&k, &bias.broadcast_as((b, h, tq, tk))?, op)?,
    };
    probs.apply_op2(&v.contiguous()?, CausalPv)
}

#[cfg(test)]
mod tests {
    use super::*;
    use super::super::tests::{rand_t, var, assert_close, loss_of, grad, FWD_TOL, BWD_TOL};

    fn attn_ref(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64, bias: Option<&Tensor>) -> Tensor {
        causal_attention_composite(q, k, v, scale, bias).unwrap()
    }

    // Fused attention vs the composite for tq == tk and tq < tk (KV prefix), with no bias
    // and with biases of several broadcast shapes; gradients of q, k, v and bias.
    #[test]
    fn causal_attention_matches_composite() {
        let (b, h, d) = (2, 3, 16);
        let scale = 1.0 / (d as f64).sqrt();
        // 300/200/330 exercise several ATTN_BLOCK row and key blocks.
        for (tq, tk) in [(6, 6), (4, 9), (1, 5), (300, 300), (200, 330)] {
            let bias_shapes: Vec<Option<Vec<usize>>> = vec![
                None,
                Some(vec![tq, tk]),
                Some(vec![1, h, 1, tk]),
                Some(vec![b, h, tq, tk]),
                Some(vec![b, 1, tq, 1]),
            ];
            for (bi, bshape) in bias_shapes.into_iter().enumerate() {
                let seed = (tq * 100 + bi * 10) as u32;
                let q = var((b, h, tq, d), seed + 1, 2.0);
                let k = var((b, h, tk, d), seed + 2, 2.0);
                let v = var((b, h, tk, d), seed + 3, 1.0);
                let bias = bshape.map(|s| var(s, seed + 4, 1.0));
                let bt = bias.as_ref().map(|b| b.as_tensor());
                let what = format!("attn tq={tq} tk={tk} bias#{bi}");
                let y = causal_attention(q.as_tensor(), k.as_tensor(), v.as_tensor(), scale, bt)
                    .unwrap();
                let y_ref = attn_ref(q.as_tensor(), k.as_tensor(), v.as_tensor(), scale, bt);
                assert_close(&y, &y_ref, FWD_TOL, &format!("{what} fwd"));
                let g = loss_of(&y, 7).backward().unwrap();
                let g_ref = loss_of(&y_ref, 7).backward().unwrap();
                for (n, t) in [("q", &q), ("k", &k), ("v", &v)] {
                    assert_close(
                        &grad(&g, t),
                        &grad(&g_ref, t),
                        BWD_TOL,
                        &format!("{what} d{n}"),
                    );
                }
                if let Some(bias) = &bias {
                    let gb = grad(&g, bias);
                    assert_eq!(gb.dims(), bias.dims());
                    assert_close(&gb, &grad(&g_ref, bias), BWD_TOL, &format!("{what} dbias"));
                }
            }
        }
    }

    // q/k/v as transposed views of [b, t, h, d] tensors (the usual projection layout), and a
    // constant (non-Var) bias.
    #[test]
    fn causal_attention_non_contiguous_inputs() {
        let (b, h, t, d) = (2, 2, 5, 8);
        let qs = var((b, t, h, d), 1, 1.0);
        let ks = var((b, t, h, d), 2, 1.0);
        let vs = var((b, t, h, d), 3, 1.0);
        let q = qs.as_tensor().transpose(1, 2).unwrap();
        let k = ks.as_tensor().transpose(1, 2).unwrap();
        let v = vs.as_tensor().transpose(1, 2).unwrap();
        let bias = rand_t((t, t), 4, 0.5);
        let y = causal_attention(&q, &k, &v, 0.3, Some(&bias)).unwrap();
        let y_ref = attn_ref(&q, &k, &v, 0.3, Some(&bias));
        assert_close(&y, &y_ref, FWD_TOL, "attn fwd (transposed)");
        let g = loss_of(&y, 5).backward().unwrap();
        let g_ref = loss_of(&y_ref, 5).backward().unwrap();
        for (n, t) in [("q", &qs), ("k", &ks), ("v", &vs)] {
            assert_close(
                &grad(&g, t),
                &grad(&g_ref, t),
                BWD_TOL,
                &format!("attn d{n} (transposed)"),
            );
        }
        assert!(g.get(&bias).is_none());
    }

    // tq > tk: the leading queries see no key; fused gives zeros and finite gradients.
    #[test]
    fn causal_attention_queries_without_keys() {
        let q = var((1, 1, 4, 4), 1, 1.0);
        let k = var((1, 1, 2, 4), 2, 1.0);
        let v = var((1, 1, 2, 4), 3, 1.0);
        let y = causal_attention(q.as_tensor(), k.as_tensor(), v.as_tensor(), 0.5, None).unwrap();
        let yv = y.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert!(yv[..8].iter().all(|&v| v == 0.0));
        let y_ref = attn_ref(q.as_tensor(), k.as_tensor(), v.as_tensor(), 0.5, None);
        assert_close(&y, &y_ref, FWD_TOL, "attn fwd (tq > tk)");
        let g = loss_of(&y, 4).backward().unwrap();
        let g_ref = loss_of(&y_ref, 4).backward().unwrap();
        for (n, t) in [("q", &q), ("k", &k), ("v", &v)] {
            assert_close(
                &grad(&g, t),
                &grad(&g_ref, t),
                BWD_TOL,
                &format!("attn d{n} (tq > tk)"),
            );
        }
    }
}
