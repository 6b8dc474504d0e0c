//! Gated Memory's per-head MLPs and the mix `attn + g·(m − attn)` as one op with a hand-written
//! backward (`kernels/gated_memory.cu` on CUDA). The op's inputs are `q` and `attn`
//! (`[b, heads, t, d]`, f32) and the layer's parameters packed into one flat f32 vector (the
//! adapter's `GatedMemoryLayer::packed`: a differentiable concatenation, so the gradients reach
//! every parameter `Var`).
//!
//! `reference_forward` / `reference_backward` are the plain per-row CPU implementation of exactly
//! what the kernels compute (tested against candle's autograd of the composite in
//! `GatedMemory::mix_attention_composite`, in `adapters::gated_memory`); the CUDA kernels
//! (`tests/cuda.rs`) and the op's fast CPU path (`fast_forward` / `fast_backward`, per-head gemm)
//! are tested against them.

#[cfg(feature = "cuda")]
use super::cuda::CudaInput;
use super::math::{sigmoid_fast, StoredFloat};
use candle_core::{bail, CpuStorage, CustomOp3, Layout, Result, Shape, Storage, Tensor};

/// Shapes of one layer: heads, head_dim, gate hidden size and whether biases exist. The adapter
/// supplies them (`GatedMemoryLayer::kernel_dims`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GmDims {
    pub heads: usize,
    pub d: usize,
    pub s: usize,
    pub bias: bool,
}

impl GmDims {
    /// Elements per head of mem_w1, mem_b1, mem_w2, mem_b2, gate_w1, gate_b1, gate_w2 (the packed
    /// order, which `GatedMemoryLayer::named` follows), whether or not the biases exist.
    pub fn per_head_sizes(&self) -> [usize; 7] {
        let (d, d2, s) = (self.d, 2 * self.d, self.s);
        [d * d2, d2, d2 * d, d, d * s, s, s]
    }

    /// Element offsets of the seven tensors in the packed vector (−1: absent) and its length.
    pub fn offsets(&self) -> ([i64; 7], usize) {
        let sizes = self.per_head_sizes().map(|n| n * self.heads);
        let present = [true, self.bias, true, self.bias, true, self.bias, true];
        let mut off = [-1i64; 7];
        let mut at = 0usize;
        for i in 0..7 {
            if present[i] {
                off[i] = at as i64;
                at += sizes[i];
            }
        }
        (off, at)
    }
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}
fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}
fn silu_grad(x: f32) -> f32 {
    let s = sigmoid(x);
    s * (1.0 + x * (1.0 - s))
}

/// One head's weights as slices of the packed vector (f32, or f16 for decoding).
struct HeadWeights<'a, T = f32> {
    w1: &'a [T],
    b1: Option<&'a [T]>,
    w2: &'a [T],
    b2: Option<&'a [T]>,
    g1: &'a [T],
    c1: Option<&'a [T]>,
    g2: &'a [T],
}

fn head<T>(p: &[T], dims: GmDims, h: usize) -> HeadWeights<'_, T> {
    let (off, _) = dims.offsets();
    let per = dims.per_head_sizes();
    let at = |i: usize| -> Option<&[T]> {
        (off[i] >= 0).then(|| &p[off[i] as usize + h * per[i]..off[i] as usize + (h + 1) * per[i]])
    };
    HeadWeights {
        w1: at(0).unwrap(),
        b1: at(1),
        w2: at(2).unwrap(),
        b2: at(3),
        g1: at(4).unwrap(),
        c1: at(5),
        g2: at(6).unwrap(),
    }
}

/// Per-row forward intermediates: pre-activations of both hidden layers, m and g.
struct RowFwd {
    h1: Vec<f32>,
    gh: Vec<f32>,
    m: Vec<f32>,
    g: f32,
}

fn row_forward(x: &[f32], w: &HeadWeights, dims: GmDims) -> RowFwd {
    let (d, d2, s) = (dims.d, 2 * dims.d, dims.s);
    let mut h1: Vec<f32> = (0..d2).map(|j| w.b1.map_or(0.0, |b| b[j])).collect();
    let mut gh: Vec<f32> = (0..s).map(|c| w.c1.map_or(0.0, |b| b[c])).collect();
    for k in 0..d {
        for j in 0..d2 {
            h1[j] += x[k] * w.w1[k * d2 + j];
        }
        for c in 0..s {
            gh[c] += x[k] * w.g1[k * s + c];
        }
    }
    let mut m: Vec<f32> = (0..d).map(|j| w.b2.map_or(0.0, |b| b[j])).collect();
    for k in 0..d2 {
        let a = silu(h1[k]);
        for j in 0..d {
            m[j] += a * w.w2[k * d + j];
        }
    }
    let z: f32 = (0..s).map(|c| silu(gh[c]) * w.g2[c]).sum();
    RowFwd { h1, gh, m, g: sigmoid(3.0 * (z - 1.0)) }
}

/// `q`, `attn`: `[b, heads, t, d]` row-major (row r belongs to head `(r / t) % heads`); `p`:
/// packed parameters. Returns the mixed output.
pub fn reference_forward(q: &[f32], attn: &[f32], p: &[f32], dims: GmDims, t: usize) -> Vec<f32> {
    let d = dims.d;
    let mut out = vec![0f32; q.len()];
    for (r, (o, (x, a))) in out.chunks_mut(d).zip(q.chunks(d).zip(attn.chunks(d))).enumerate() {
        let w = head(p, dims, (r / t.max(1)) % dims.heads);
        let f = row_forward(x, &w, dims);
        for j in 0..d {
            o[j] = a[j] + f.g * (f.m[j] - a[j]);
        }
    }
    out
}

/// Backward of `reference_forward` for the output gradient `gout`: `(dq, dattn, dp)`.
pub fn reference_backward(
    q: &[f32],
    attn: &[f32],
    p: &[f32],
    gout: &[f32],
    dims: GmDims,
    t: usize,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (d, d2, s) = (dims.d, 2 * dims.d, dims.s);
    let (off, plen) = dims.offsets();
    let mut dq = vec![0f32; q.len()];
    let mut dattn = vec![0f32; q.len()];
    let mut dp = vec![0f32; plen];
    for r in 0..q.len() / d {
        let h = (r / t.max(1)) % dims.heads;
        let w = head(p, dims, h);
        let (x, a, go) = (&q[r * d..(r + 1) * d], &attn[r * d..(r + 1) * d], &gout[r * d..(r + 1) * d]);
        let f = row_forward(x, &w, dims);
        let mut dgate = 0f32;
        for j in 0..d {
            dattn[r * d + j] = (1.0 - f.g) * go[j];
            dgate += go[j] * (f.m[j] - a[j]);
        }
        let dz = dgate * 3.0 * f.g * (1.0 - f.g);
        let dm: Vec<f32> = go.iter().map(|g| f.g * g).collect();
        let dgh: Vec<f32> = (0..s).map(|c| w.g2[c] * dz * silu_grad(f.gh[c])).collect();
        let dh1: Vec<f32> =
            (0..d2).map(|k| (0..d).map(|j| w.w2[k * d + j] * dm[j]).sum::<f32>() * silu_grad(f.h1[k])).collect();
        for k in 0..d {
            let mut acc = 0f32;
            for j in 0..d2 {
                acc += w.w1[k * d2 + j] * dh1[j];
            }
            for c in 0..s {
                acc += w.g1[k * s + c] * dgh[c];
            }
            dq[r * d + k] = acc;
        }
        let mut add = |i: usize, per: usize, idx: usize, v: f32| {
            dp[off[i] as usize + h * per + idx] += v;
        };
        for k in 0..d {
            for j in 0..d2 {
                add(0, d * d2, k * d2 + j, x[k] * dh1[j]);
            }
            for c in 0..s {
                add(4, d * s, k * s + c, x[k] * dgh[c]);
            }
        }
        for k in 0..d2 {
            let act = silu(f.h1[k]);
            for j in 0..d {
                add(2, d2 * d, k * d + j, act * dm[j]);
            }
        }
        for c in 0..s {
            add(6, s, c, silu(f.gh[c]) * dz);
        }
        if dims.bias {
            for j in 0..d2 {
                add(1, d2, j, dh1[j]);
            }
            for j in 0..d {
                add(3, d, j, dm[j]);
            }
            for c in 0..s {
                add(5, s, c, dgh[c]);
            }
        }
    }
    (dq, dattn, dp)
}

// ---------------------------------------------------------------------------------------
// Fast CPU path: the same arithmetic as the reference, per (batch, head) block of `t` rows, with
// the per-head MLPs as matrix products (gemm) instead of per-row loops; heads run in parallel.
// ---------------------------------------------------------------------------------------

/// A row-major or transposed view of a matrix for `mm`: data with row and column strides.
#[derive(Clone, Copy)]
struct View<'a> {
    data: &'a [f32],
    rs: usize,
    cs: usize,
}

fn rows(data: &[f32], cols: usize) -> View<'_> {
    View { data, rs: cols, cs: 1 }
}

/// The transpose of a row-major matrix with `cols` columns.
fn transposed(data: &[f32], cols: usize) -> View<'_> {
    View { data, rs: 1, cs: cols }
}

/// `dst[m×n] (row-major) = (acc ? dst : 0) + a[m×k] · b[k×n]`, single-threaded (the caller
/// parallelises over heads).
fn mm(dst: &mut [f32], m: usize, n: usize, k: usize, a: View, b: View, acc: bool) {
    assert!(dst.len() >= m * n);
    assert!(m == 0 || k == 0 || a.data.len() > (m - 1) * a.rs + (k - 1) * a.cs);
    assert!(n == 0 || k == 0 || b.data.len() > (k - 1) * b.rs + (n - 1) * b.cs);
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !acc {
            dst[..m * n].fill(0.0);
        }
        return;
    }
    // One row against row-major `b` (a decoding token's memory and gate): rows of `b` added in
    // turn, which vectorises; gemm's setup costs more than these ~8K multiply-adds.
    if m == 1 && b.cs == 1 {
        let dst = &mut dst[..n];
        if !acc {
            dst.fill(0.0);
        }
        for kk in 0..k {
            let av = a.data[kk * a.cs];
            for (o, bv) in dst.iter_mut().zip(&b.data[kk * b.rs..kk * b.rs + n]) {
                *o = av.mul_add(*bv, *o);
            }
        }
        return;
    }
    // SAFETY: the asserts above keep every index gemm touches inside the three slices.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            n as isize,
            acc,
            a.data.as_ptr(),
            a.cs as isize,
            a.rs as isize,
            b.data.as_ptr(),
            b.cs as isize,
            b.rs as isize,
            1.0f32,
            1.0f32,
            false,
            false,
            false,
            gemm::Parallelism::None,
        )
    }
}

fn add_bias(y: &mut [f32], bias: Option<&[f32]>) {
    if let Some(b) = bias {
        for row in y.chunks_mut(b.len()) {
            row.iter_mut().zip(b).for_each(|(v, b)| *v += b);
        }
    }
}

fn col_sums(x: &[f32], cols: usize, into: &mut [f32]) {
    for row in x.chunks(cols) {
        into.iter_mut().zip(row).for_each(|(s, v)| *s += v);
    }
}

/// One block's forward intermediates: pre-activations `a1` `[t, 2d]` and `ag` `[t, s]`, their
/// sigmoids, `z1 = silu(a1)`, the memory read `m` `[t, d]` and the gate `g` `[t]`. Each
/// sigmoid is computed once: silu(a) = a·σ(a), silu'(a) = σ(a)·(1 + a·(1 − σ(a))).
struct BlockFwd {
    a1: Vec<f32>,
    s1: Vec<f32>,
    z1: Vec<f32>,
    ag: Vec<f32>,
    sg: Vec<f32>,
    m: Vec<f32>,
    g: Vec<f32>,
}

fn block_forward(x: &[f32], w: &HeadWeights, dims: GmDims, t: usize) -> BlockFwd {
    let (d, d2, s) = (dims.d, 2 * dims.d, dims.s);
    let mut a1 = vec![0f32; t * d2];
    mm(&mut a1, t, d2, d, rows(x, d), rows(w.w1, d2), false);
    add_bias(&mut a1, w.b1);
    let s1: Vec<f32> = a1.iter().map(|&v| sigmoid_fast(v)).collect();
    let z1: Vec<f32> = a1.iter().zip(&s1).map(|(&v, &sv)| v * sv).collect();
    let mut m = vec![0f32; t * d];
    mm(&mut m, t, d, d2, rows(&z1, d2), rows(w.w2, d), false);
    add_bias(&mut m, w.b2);
    let mut ag = vec![0f32; t * s];
    mm(&mut ag, t, s, d, rows(x, d), rows(w.g1, s), false);
    add_bias(&mut ag, w.c1);
    let sg: Vec<f32> = ag.iter().map(|&v| sigmoid_fast(v)).collect();
    let g = ag
        .chunks(s)
        .zip(sg.chunks(s))
        .map(|(a, sv)| {
            let z: f32 = (0..s).map(|c| a[c] * sv[c] * w.g2[c]).sum();
            sigmoid_fast(3.0 * (z - 1.0))
        })
        .collect();
    BlockFwd { a1, s1, z1, ag, sg, m, g }
}

/// Fast equivalent of [`reference_forward`].
pub fn fast_forward(q: &[f32], attn: &[f32], p: &[f32], dims: GmDims, t: usize) -> Vec<f32> {
    use rayon::prelude::*;
    let bs = t * dims.d;
    let mut out = vec![0f32; q.len()];
    if bs == 0 {
        return out;
    }
    let block = |(i, o): (usize, &mut [f32])| {
        o.copy_from_slice(&attn[i * bs..(i + 1) * bs]);
        mix_block(&q[i * bs..(i + 1) * bs], o, p, dims, i % dims.heads, t);
    };
    // A decoding row (t = 1) is ~20 µs of work for all heads: handing it to the thread pool
    // (and waiting on its latch) costs more than that, once per sequence and layer in a batch.
    if q.len() / dims.d < PARALLEL_ROWS {
        out.chunks_mut(bs).enumerate().for_each(block);
    } else {
        out.par_chunks_mut(bs).enumerate().for_each(block);
    }
    out
}

/// One (batch, head) block of `t` rows in place: `attn ← attn + g·(m − attn)` for the head's
/// pre-RoPE queries `q` (`[t, d]`), with `packed` the layer's parameters. `fast_forward` runs
/// it per block; a batch decode step runs it for every sequence's heads in one parallel pass
/// (`t` = 1), the same arithmetic as that sequence gets alone.
pub fn mix_block(q: &[f32], attn: &mut [f32], packed: &[f32], dims: GmDims, head_index: usize, t: usize) {
    let w = head(packed, dims, head_index);
    let f = block_forward(q, &w, dims, t);
    for (r, (a, m)) in attn.chunks_mut(dims.d).zip(f.m.chunks(dims.d)).enumerate() {
        let g = f.g[r];
        for j in 0..dims.d {
            a[j] = a[j] + g * (m[j] - a[j]);
        }
    }
}

/// `dst = x·W` for one row `x` (`k` values) and a row-major `[k, n]` `W` stored as `T`: rows
/// of `W` added in turn, each element's `x·w + o` fused (the arithmetic of `mm`'s one-row
/// path). With AVX-512 and `n` a multiple of 16 up to 128, the outputs stay in registers and
/// each row is converted as it is loaded; the same operations per element, in the same order.
fn row_times<T: StoredFloat>(dst: &mut [f32], x: &[f32], w: &[T]) {
    let n = dst.len();
    assert!(w.len() >= x.len() * n, "a weight matrix smaller than [k, n]");
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: AVX-512F is present; `w` holds `x.len()` rows of `n` (asserted).
        let done = unsafe {
            match n {
                64 => avx512_row_times::<T, 4>(dst, x, w),
                128 => avx512_row_times::<T, 8>(dst, x, w),
                16 => avx512_row_times::<T, 1>(dst, x, w),
                32 => avx512_row_times::<T, 2>(dst, x, w),
                _ => false,
            }
        };
        if done {
            return;
        }
    }
    dst.fill(0.0);
    let mut buf = vec![0f32; n];
    for (kk, &xv) in x.iter().enumerate() {
        T::to_f32s(&w[kk * n..(kk + 1) * n], &mut buf);
        for (o, wv) in dst.iter_mut().zip(&buf) {
            *o = xv.mul_add(*wv, *o);
        }
    }
}

/// [`row_times`] for `n = 16·B`.
///
/// # Safety
/// The CPU has AVX-512F; `w` holds `x.len()` rows of `dst.len()` values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn avx512_row_times<T: StoredFloat, const B: usize>(dst: &mut [f32], x: &[f32], w: &[T]) -> bool {
    use std::arch::x86_64::*;
    let n = 16 * B;
    if dst.len() != n {
        return false;
    }
    // SAFETY: every row read is inside `w` (the caller's contract), every store inside `dst`.
    unsafe {
        let mut acc = [_mm512_setzero_ps(); B];
        for (kk, &xv) in x.iter().enumerate() {
            let xb = _mm512_set1_ps(xv);
            let row = w.as_ptr().add(kk * n);
            for (c, a) in acc.iter_mut().enumerate() {
                *a = _mm512_fmadd_ps(xb, T::load16(row.add(16 * c)), *a);
            }
        }
        for (c, a) in acc.iter().enumerate() {
            _mm512_storeu_ps(dst.as_mut_ptr().add(16 * c), *a);
        }
    }
    true
}

fn add_bias_stored<T: StoredFloat>(y: &mut [f32], bias: Option<&[T]>, buf: &mut [f32]) {
    if let Some(b) = bias {
        let bf = &mut buf[..b.len()];
        T::to_f32s(b, bf);
        add_bias(y, Some(bf));
    }
}

/// One head of one decoding row in place, `attn ← attn + g·(m − attn)` for the head's pre-RoPE
/// query `q`, from the layer's packed parameters stored as `T`: with f32, bit for bit
/// `mix_block` at `t` = 1; the batch decode step passes f16 copies (half the bytes; at 16
/// sequences on 16 documents a step reads every sequence's adapter). `scratch` is reused
/// between calls.
pub fn mix_row<T: StoredFloat>(q: &[f32], attn: &mut [f32], packed: &[T], dims: GmDims, head_index: usize, scratch: &mut Vec<f32>) {
    let w = head(packed, dims, head_index);
    let (d, d2, s) = (dims.d, 2 * dims.d, dims.s);
    scratch.resize(2 * d2 + d + 2 * s + d2, 0.0);
    let (a1, rest) = scratch.split_at_mut(d2);
    let (z1, rest) = rest.split_at_mut(d2);
    let (m, rest) = rest.split_at_mut(d);
    let (ag, rest) = rest.split_at_mut(s);
    let (g2, buf) = rest.split_at_mut(s);
    row_times(a1, q, w.w1);
    add_bias_stored(a1, w.b1, buf);
    for (z, &v) in z1.iter_mut().zip(a1.iter()) {
        *z = v * sigmoid_fast(v);
    }
    row_times(m, z1, w.w2);
    add_bias_stored(m, w.b2, buf);
    row_times(ag, q, w.g1);
    add_bias_stored(ag, w.c1, buf);
    T::to_f32s(w.g2, g2);
    let z: f32 = (0..s).map(|c| ag[c] * sigmoid_fast(ag[c]) * g2[c]).sum();
    let g = sigmoid_fast(3.0 * (z - 1.0));
    for (a, mj) in attn.iter_mut().zip(m.iter()) {
        *a = *a + g * (mj - *a);
    }
}

/// The Gated Memory mixes of a batch decode step, in place, in one pass of candle's CPU thread
/// pool over (sequence, head): `attn` and `q` (pre-RoPE) are `[n, heads, d]`, one row per
/// decoding sequence; `rows` lists the sequences to mix with their layer's packed parameters
/// and shapes. One call per sequence instead ran each mix on the calling thread in turn while
/// the pool's other workers waited.
pub fn mix_decode_rows<T: StoredFloat>(q: &[f32], attn: &mut [f32], rows: &[(usize, &[T], GmDims)]) {
    let Some(&(_, _, first)) = rows.first() else { return };
    let (heads, d) = (first.heads, first.d);
    let ptr = SharedRows(attn.as_mut_ptr());
    let len = attn.len();
    let run = |range: std::ops::Range<usize>| {
        let ptr = &ptr;
        let mut scratch = Vec::new();
        for unit in range {
            let (&(row, packed, dims), h) = (&rows[unit / heads], unit % heads);
            let at = (row * heads + h) * d;
            assert!(at + d <= len && dims.heads == heads && dims.d == d, "a mix row outside the batch");
            // SAFETY: unit (row, h) alone touches these d values (rows are distinct sequences).
            let a = unsafe { std::slice::from_raw_parts_mut(ptr.0.add(at), d) };
            mix_row(&q[at..at + d], a, packed, dims, h, &mut scratch);
        }
    };
    if rows.len() < 2 {
        run(0..rows.len() * heads);
    } else {
        candle_core::utils::barrier_pool().execute_chunked(rows.len() * heads, run);
    }
}

struct SharedRows(*mut f32);
// SAFETY: the units writing through it touch disjoint rows (see `mix_decode_rows`).
unsafe impl Sync for SharedRows {}
unsafe impl Send for SharedRows {}

/// Query rows (all heads) from which `fast_forward` runs its blocks in parallel.
const PARALLEL_ROWS: usize = 32;

/// Fast equivalent of [`reference_backward`]: `(dq, dattn, dp)`.
pub fn fast_backward(
    q: &[f32],
    attn: &[f32],
    p: &[f32],
    gout: &[f32],
    dims: GmDims,
    t: usize,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    use rayon::prelude::*;
    let (off, plen) = dims.offsets();
    let bs = t * dims.d;
    let mut dq = vec![0f32; q.len()];
    let mut dattn = vec![0f32; q.len()];
    let mut dp = vec![0f32; plen];
    if bs == 0 {
        return (dq, dattn, dp);
    }
    // Rows `[b, heads, t, d]` as (batch, head) blocks of `t·d` values: block `i` is head
    // `i % heads`. Each block's forward intermediates are recomputed here, not kept from the
    // forward (cheap next to the products below, and no memory held between the passes).
    let n_blocks = q.len() / bs;
    let per = dims.per_head_sizes();
    // Per head: its blocks' dq/dattn and its parameter gradients (in `named` order, as packed).
    let per_head: Vec<(Vec<(usize, Vec<f32>, Vec<f32>)>, [Vec<f32>; 7])> = (0..dims.heads)
        .into_par_iter()
        .map(|h| {
            let w = head(p, dims, h);
            let mut gw: [Vec<f32>; 7] = per.map(|n| vec![0f32; n]);
            let mut outs = Vec::new();
            for i in (h..n_blocks).step_by(dims.heads) {
                let r = i * bs..(i + 1) * bs;
                let block = BlockRows { x: &q[r.clone()], a: &attn[r.clone()], go: &gout[r] };
                let (dx, da) = block_backward(block, &w, dims, t, &mut gw);
                outs.push((i, dx, da));
            }
            (outs, gw)
        })
        .collect();
    for (h, (outs, gw)) in per_head.into_iter().enumerate() {
        for (i, dx, da) in outs {
            dq[i * bs..(i + 1) * bs].copy_from_slice(&dx);
            dattn[i * bs..(i + 1) * bs].copy_from_slice(&da);
        }
        for k in 0..7 {
            if off[k] >= 0 {
                let at = off[k] as usize + h * per[k];
                dp[at..at + per[k]].copy_from_slice(&gw[k]);
            }
        }
    }
    (dq, dattn, dp)
}

/// One (batch, head) block of `t` rows: its `q` rows `x`, `attn` rows `a` and output gradient
/// `go`.
struct BlockRows<'a> {
    x: &'a [f32],
    a: &'a [f32],
    go: &'a [f32],
}

/// One block's backward: returns its `(dq, dattn)` rows and adds its parameter gradients to the
/// head's `gw` (per tensor, in packed order).
fn block_backward(
    block: BlockRows,
    w: &HeadWeights,
    dims: GmDims,
    t: usize,
    gw: &mut [Vec<f32>; 7],
) -> (Vec<f32>, Vec<f32>) {
    let BlockRows { x, a, go } = block;
    let (d, d2, s) = (dims.d, 2 * dims.d, dims.s);
    let bs = t * d;
    let f = block_forward(x, w, dims, t);
    let mut da = vec![0f32; bs];
    let mut dm = vec![0f32; bs];
    // d(gate logit) per row: Σ_j go·(m − a) · 3g(1 − g).
    let mut dz = vec![0f32; t];
    for row in 0..t {
        let g = f.g[row];
        let mut dgate = 0f32;
        for j in row * d..(row + 1) * d {
            da[j] = (1.0 - g) * go[j];
            dm[j] = g * go[j];
            dgate += go[j] * (f.m[j] - a[j]);
        }
        dz[row] = dgate * 3.0 * g * (1.0 - g);
    }
    // Memory MLP.
    mm(&mut gw[2], d2, d, t, transposed(&f.z1, d2), rows(&dm, d), true);
    col_sums(&dm, d, &mut gw[3]);
    let mut da1 = vec![0f32; t * d2];
    mm(&mut da1, t, d2, d, rows(&dm, d), transposed(w.w2, d), false);
    for ((g, &a), &sv) in da1.iter_mut().zip(&f.a1).zip(&f.s1) {
        *g *= sv * (1.0 + a * (1.0 - sv));
    }
    mm(&mut gw[0], d, d2, t, transposed(x, d), rows(&da1, d2), true);
    col_sums(&da1, d2, &mut gw[1]);
    let mut dx = vec![0f32; bs];
    mm(&mut dx, t, d, d2, rows(&da1, d2), transposed(w.w1, d2), false);
    // Gate MLP.
    let mut dag = vec![0f32; t * s];
    for row in 0..t {
        for c in 0..s {
            let (av, sv) = (f.ag[row * s + c], f.sg[row * s + c]);
            gw[6][c] += av * sv * dz[row];
            dag[row * s + c] = w.g2[c] * dz[row] * sv * (1.0 + av * (1.0 - sv));
        }
    }
    mm(&mut gw[4], d, s, t, transposed(x, d), rows(&dag, s), true);
    col_sums(&dag, s, &mut gw[5]);
    mm(&mut dx, t, d, s, rows(&dag, s), transposed(w.g1, s), true);
    (dx, da)
}

fn cpu_f32<'a>(s: &'a CpuStorage, l: &Layout) -> Result<&'a [f32]> {
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&s.as_slice::<f32>()?[a..b]),
        None => bail!("gated-memory: expected contiguous f32 input"),
    }
}

/// Forward op: (q, attn, packed params) → mixed output.
struct GatedMemoryMix {
    dims: GmDims,
}

/// Backward op: (q, packed params, output gradient) with `attn` held → `[dq | dattn | dp]` flat.
struct GatedMemoryMixBwd {
    dims: GmDims,
    attn: Tensor,
}

impl CustomOp3 for GatedMemoryMix {
    fn name(&self) -> &'static str {
        "gated-memory-mix"
    }

    fn cpu_fwd(
        &self,
        qs: &CpuStorage,
        ql: &Layout,
        a_s: &CpuStorage,
        al: &Layout,
        ps: &CpuStorage,
        pl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (_, _, t, _) = ql.shape().dims4()?;
        let out = fast_forward(cpu_f32(qs, ql)?, cpu_f32(a_s, al)?, cpu_f32(ps, pl)?, self.dims, t);
        Ok((CpuStorage::F32(out), ql.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        qs: &candle_core::CudaStorage,
        ql: &Layout,
        a_s: &candle_core::CudaStorage,
        al: &Layout,
        ps: &candle_core::CudaStorage,
        pl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (q, attn, params) = (CudaInput::of(qs, ql), CudaInput::of(a_s, al), CudaInput::of(ps, pl));
        let out = super::cuda::gated_memory_fwd(q, attn, params, self.dims)?;
        Ok((out, ql.shape().clone()))
    }

    fn bwd(
        &self,
        q: &Tensor,
        attn: &Tensor,
        p: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let n = q.elem_count();
        let op = GatedMemoryMixBwd { dims: self.dims, attn: attn.detach() };
        let all = q.detach().apply_op3_no_bwd(&p.detach(), &grad.contiguous()?, &op)?;
        let dq = all.narrow(0, 0, n)?.reshape(q.shape())?;
        let dattn = all.narrow(0, n, n)?.reshape(q.shape())?;
        let dp = all.narrow(0, 2 * n, p.elem_count())?;
        Ok((Some(dq), Some(dattn), Some(dp)))
    }
}

impl CustomOp3 for GatedMemoryMixBwd {
    fn name(&self) -> &'static str {
        "gated-memory-mix-bwd"
    }

    fn cpu_fwd(
        &self,
        qs: &CpuStorage,
        ql: &Layout,
        ps: &CpuStorage,
        pl: &Layout,
        gs: &CpuStorage,
        gl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (_, _, t, _) = ql.shape().dims4()?;
        let (storage, al) = self.attn.storage_and_layout();
        let Storage::Cpu(a_s) = &*storage else { bail!("gated-memory-mix-bwd: attn not on the cpu") };
        let (dq, dattn, dp) =
            fast_backward(cpu_f32(qs, ql)?, cpu_f32(a_s, al)?, cpu_f32(ps, pl)?, cpu_f32(gs, gl)?, self.dims, t);
        let mut all = dq;
        all.extend(dattn);
        all.extend(dp);
        let len = all.len();
        Ok((CpuStorage::F32(all), Shape::from(len)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        qs: &candle_core::CudaStorage,
        ql: &Layout,
        ps: &candle_core::CudaStorage,
        pl: &Layout,
        gs: &candle_core::CudaStorage,
        gl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (storage, al) = self.attn.storage_and_layout();
        let Storage::Cuda(a_s) = &*storage else { bail!("gated-memory-mix-bwd: attn not on the gpu") };
        let (q, attn) = (CudaInput::of(qs, ql), CudaInput::of(a_s, al));
        let (params, grad) = (CudaInput::of(ps, pl), CudaInput::of(gs, gl));
        let (out, len) = super::cuda::gated_memory_bwd(q, attn, params, grad, self.dims)?;
        Ok((out, Shape::from(len)))
    }
}

/// `attn + g·(m − attn)` for `q`, `attn` `[b, heads, t, d]` (f32) through the fused op, for a
/// layer of shape `dims` whose parameters are `packed` (flat, in the packed order; a
/// differentiable concatenation, so the gradients reach every parameter), with gradients to `q`,
/// `attn` and `packed`.
pub fn mix(q: &Tensor, attn: &Tensor, packed: &Tensor, dims: GmDims) -> Result<Tensor> {
    let (_, h, _, d) = q.dims4()?;
    if (h, d) != (dims.heads, dims.d) || attn.dims() != q.dims() {
        bail!("gated-memory-mix: q {:?} / attn {:?} do not fit the layer {dims:?}", q.shape(), attn.shape());
    }
    q.contiguous()?.apply_op3(&attn.contiguous()?, packed, GatedMemoryMix { dims })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::Rng;
    use candle_core::Device;

    fn rand(shape: (usize, usize, usize, usize), seed: u64) -> Tensor {
        let n = shape.0 * shape.1 * shape.2 * shape.3;
        Tensor::from_vec(Rng::new(seed).vec(n, 1.0), shape, &Device::Cpu).unwrap()
    }

    /// The packed parameters of a freshly initialised layer (the values `GatedMemory::new` draws
    /// for `seed`: per tensor in packed order, kaiming-uniform with bound 1/√fan_in).
    fn packed_layer(dims: GmDims, seed: u64) -> Vec<f32> {
        let (d, s) = (dims.d, dims.s);
        let fan_in = [d, d, 2 * d, 2 * d, d, d, s];
        let present = [true, dims.bias, true, dims.bias, true, dims.bias, true];
        let mut rng = Rng::new(seed);
        let mut p = Vec::new();
        for ((n, fan_in), present) in dims.per_head_sizes().into_iter().zip(fan_in).zip(present) {
            if present {
                p.extend(rng.vec(dims.heads * n, 1.0 / (fan_in as f32).sqrt()));
            }
        }
        p
    }

    // The decode mix: one row's heads from f32 parameters bit for bit the fast path's block at
    // t = 1; from f16 copies close to it; a batch of rows in one pool pass bit for bit each row
    // alone. Head size 64 (the default model's, two chunks of `row_times`), with and without
    // biases.
    #[test]
    fn decode_rows_match_the_block_path() {
        for bias in [false, true] {
            let dims = GmDims { heads: 3, d: 64, s: 8, bias };
            let p = packed_layer(dims, 5);
            let half: Vec<half::f16> = p.iter().map(|&v| half::f16::from_f32(v)).collect();
            let n = 4;
            let data = |seed| rand((n, 3, 1, 64), seed).flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let (q, a) = (data(31), data(32));
            let mut want = a.clone();
            for (i, (qb, ab)) in q.chunks(64).zip(want.chunks_mut(64)).enumerate() {
                mix_block(qb, ab, &p, dims, i % 3, 1);
            }
            let mut single = a.clone();
            let mut scratch = Vec::new();
            for (i, (qb, ab)) in q.chunks(64).zip(single.chunks_mut(64)).enumerate() {
                mix_row(qb, ab, &p, dims, i % 3, &mut scratch);
            }
            assert_eq!(single, want, "bias {bias}: f32 row path vs block path");
            let mut halves = a.clone();
            let rows: Vec<(usize, &[half::f16], GmDims)> = (0..n).map(|r| (r, &half[..], dims)).collect();
            mix_decode_rows(&q, &mut halves, &rows);
            let scale = want.iter().fold(1f32, |m, v| m.max(v.abs()));
            let diff = halves.iter().zip(&want).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
            // Weights rounded to 2^-11 relative; the output moves far less (1.8e-5 measured).
            assert!(diff / scale < 1e-3 && diff > 0.0, "bias {bias}: f16 weights moved the mix by {diff}");
            for r in 0..n {
                let mut alone = a.clone();
                mix_decode_rows(&q, &mut alone, &[(r, &half[..], dims)]);
                assert_eq!(alone[r * 192..(r + 1) * 192], halves[r * 192..(r + 1) * 192], "bias {bias}: row {r}");
            }
        }
    }

    // The fast CPU path (gemm per head) equals the per-row reference, forward and backward, with
    // and without biases, for batch 2 and a `t` that is not a multiple of any block size.
    #[test]
    fn fast_path_matches_reference() {
        for bias in [false, true] {
            let dims = GmDims { heads: 3, d: 16, s: 4, bias };
            let p = packed_layer(dims, 11);
            assert_eq!(p.len(), dims.offsets().1);
            let t = 7;
            let data = |seed| rand((2, 3, t, 16), seed).flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let (q, a, go) = (data(21), data(22), data(23));
            let close = |x: &[f32], y: &[f32], what: &str| {
                let scale = y.iter().fold(1f32, |m, v| m.max(v.abs()));
                let diff = x.iter().zip(y).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
                assert!(x.len() == y.len() && diff / scale < 1e-5, "{what} (bias {bias}): {diff}");
            };
            close(&fast_forward(&q, &a, &p, dims, t), &reference_forward(&q, &a, &p, dims, t), "forward");
            let fast = fast_backward(&q, &a, &p, &go, dims, t);
            let slow = reference_backward(&q, &a, &p, &go, dims, t);
            close(&fast.0, &slow.0, "dq");
            close(&fast.1, &slow.1, "dattn");
            close(&fast.2, &slow.2, "dp");
        }
    }
}
