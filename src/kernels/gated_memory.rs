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
use super::math::sigmoid_fast;
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

/// A frozen layer's parameters as the batch decode mix reads them: each head's three weight
/// matrices (`w1` `[d, 2d]`, `w2` `[2d, d]`, `g1` `[d, s]`) in int8 with one f32 scale per row —
/// the row one input value multiplies, so `x·W = Σ_k (x_k·s_k)·q_k` — and the biases and `g2` in
/// f32: a quarter of the f32 bytes. At 16 sequences on 16 documents a decode step reads every
/// sequence's adapter (18.3 MB in f32 on the default model's 30 layers).
#[derive(Clone)]
pub struct DecodeWeights {
    dims: GmDims,
    heads: Vec<DecodeHead>,
}

#[derive(Clone)]
struct DecodeHead {
    w1: RowsQ8,
    w2: RowsQ8,
    g1: RowsQ8,
    b1: Option<Vec<f32>>,
    b2: Option<Vec<f32>>,
    c1: Option<Vec<f32>>,
    g2: Vec<f32>,
}

/// A row-major `[k, n]` matrix in int8, each row scaled by its largest magnitude / 127.
#[derive(Clone)]
struct RowsQ8 {
    q: Vec<i8>,
    scale: Vec<f32>,
    n: usize,
}

impl RowsQ8 {
    fn new(w: &[f32], n: usize) -> Self {
        let mut q = Vec::with_capacity(w.len());
        let mut scale = Vec::with_capacity(w.len() / n.max(1));
        for row in w.chunks(n) {
            let amax = row.iter().fold(0f32, |m, v| m.max(v.abs()));
            let s = amax / 127.0;
            let inv = if s > 0.0 { 1.0 / s } else { 0.0 };
            q.extend(row.iter().map(|v| (v * inv).round_ties_even().clamp(-127.0, 127.0) as i8));
            scale.push(s);
        }
        Self { q, scale, n }
    }

    fn bytes(&self) -> usize {
        self.q.len() + 4 * self.scale.len()
    }

    /// `dst = x·W`: rows added in turn, each element's `(x_k·s_k)·q + o` fused, in the same order
    /// with AVX-512 or AVX2 (outputs in registers, a row's bytes widened as they load) as without.
    fn times(&self, dst: &mut [f32], x: &[f32]) {
        let n = self.n;
        assert!(dst.len() == n && self.q.len() >= x.len() * n && self.scale.len() >= x.len(), "a [k, n] product of other shapes");
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: AVX-512F is present; the shapes are asserted above.
            let done = unsafe {
                match n {
                    64 => self.avx512_times::<4>(dst, x),
                    128 => self.avx512_times::<8>(dst, x),
                    16 => self.avx512_times::<1>(dst, x),
                    32 => self.avx512_times::<2>(dst, x),
                    _ => false,
                }
            };
            if done {
                return;
            }
        }
        #[cfg(target_arch = "x86_64")]
        if n % 8 == 0 && avx2_fma() {
            // Passes of at most 64 outputs (8 registers).
            for col in (0..n).step_by(64) {
                // SAFETY: AVX2 and FMA are present; col + (n − col).min(64) ≤ n.
                unsafe {
                    match n - col {
                        8 => self.avx2_times::<1>(dst, x, col),
                        16 => self.avx2_times::<2>(dst, x, col),
                        24 => self.avx2_times::<3>(dst, x, col),
                        32 => self.avx2_times::<4>(dst, x, col),
                        40 => self.avx2_times::<5>(dst, x, col),
                        48 => self.avx2_times::<6>(dst, x, col),
                        56 => self.avx2_times::<7>(dst, x, col),
                        _ => self.avx2_times::<8>(dst, x, col),
                    }
                }
            }
            return;
        }
        dst.fill(0.0);
        for (k, &xv) in x.iter().enumerate() {
            let xs = xv * self.scale[k];
            for (o, &qv) in dst.iter_mut().zip(&self.q[k * n..(k + 1) * n]) {
                *o = xs.mul_add(qv as f32, *o);
            }
        }
    }

    /// # Safety
    /// The CPU has AVX-512F; `dst` is `16·B` values and the matrix has `x.len()` rows of them.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    unsafe fn avx512_times<const B: usize>(&self, dst: &mut [f32], x: &[f32]) -> bool {
        use std::arch::x86_64::*;
        let n = 16 * B;
        if dst.len() != n {
            return false;
        }
        // SAFETY: every load is inside `q` (x.len() rows of n, the caller's contract), every
        // store inside `dst`.
        unsafe {
            let mut acc = [_mm512_setzero_ps(); B];
            for (k, &xv) in x.iter().enumerate() {
                let xs = _mm512_set1_ps(xv * *self.scale.get_unchecked(k));
                let row = self.q.as_ptr().add(k * n);
                for (c, a) in acc.iter_mut().enumerate() {
                    let bytes = _mm_loadu_si128(row.add(16 * c).cast());
                    *a = _mm512_fmadd_ps(xs, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)), *a);
                }
            }
            for (c, a) in acc.iter().enumerate() {
                _mm512_storeu_ps(dst.as_mut_ptr().add(16 * c), *a);
            }
        }
        true
    }

    /// Columns `col..col + 8·C` of `dst = x·W` (C ≤ 8: the outputs in registers), as `times`
    /// adds them: each row's `(x_k·s_k)·q + o` fused, rows in turn.
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA; `col + 8·C ≤ n = dst.len()` and the matrix has `x.len()` rows.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn avx2_times<const C: usize>(&self, dst: &mut [f32], x: &[f32], col: usize) {
        use std::arch::x86_64::*;
        let n = self.n;
        assert!(col + 8 * C <= n && dst.len() == n);
        // SAFETY: every load is inside `q` (x.len() rows of n, the caller's contract), every
        // store inside `dst` (asserted).
        unsafe {
            let mut acc = [_mm256_setzero_ps(); C];
            for (k, &xv) in x.iter().enumerate() {
                let xs = _mm256_set1_ps(xv * *self.scale.get_unchecked(k));
                let row = self.q.as_ptr().add(k * n + col);
                for (c, a) in acc.iter_mut().enumerate() {
                    let bytes = _mm_loadl_epi64(row.add(8 * c).cast());
                    *a = _mm256_fmadd_ps(xs, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), *a);
                }
            }
            for (c, a) in acc.iter().enumerate() {
                _mm256_storeu_ps(dst.as_mut_ptr().add(col + 8 * c), *a);
            }
        }
    }
}

/// Whether the CPU has AVX2 and FMA (checked once).
#[cfg(target_arch = "x86_64")]
fn avx2_fma() -> bool {
    static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HAS.get_or_init(|| is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"))
}

impl DecodeWeights {
    /// From a layer's packed f32 parameters (`GatedMemoryLayer::packed`).
    pub fn new(packed: &[f32], dims: GmDims) -> Self {
        let (d, d2, s) = (dims.d, 2 * dims.d, dims.s);
        let heads = (0..dims.heads)
            .map(|h| {
                let w = head(packed, dims, h);
                DecodeHead {
                    w1: RowsQ8::new(w.w1, d2),
                    w2: RowsQ8::new(w.w2, d),
                    g1: RowsQ8::new(w.g1, s),
                    b1: w.b1.map(<[f32]>::to_vec),
                    b2: w.b2.map(<[f32]>::to_vec),
                    c1: w.c1.map(<[f32]>::to_vec),
                    g2: w.g2.to_vec(),
                }
            })
            .collect();
        Self { dims, heads }
    }

    /// Bytes held (what a decode step reads for this layer).
    pub fn bytes(&self) -> usize {
        let small = |v: &Option<Vec<f32>>| v.as_ref().map_or(0, |v| 4 * v.len());
        self.heads
            .iter()
            .map(|h| h.w1.bytes() + h.w2.bytes() + h.g1.bytes() + small(&h.b1) + small(&h.b2) + small(&h.c1) + 4 * h.g2.len())
            .sum()
    }

    /// One head of one decoding row in place, `attn ← attn + g·(m − attn)` for the head's
    /// pre-RoPE query `q` — `mix_block` at `t` = 1 with these weights. `scratch` is reused
    /// between calls.
    pub fn mix_row(&self, q: &[f32], attn: &mut [f32], head_index: usize, scratch: &mut Vec<f32>) {
        let w = &self.heads[head_index];
        let (d, d2, s) = (self.dims.d, 2 * self.dims.d, self.dims.s);
        scratch.resize(2 * d2 + d + s, 0.0);
        let (a1, rest) = scratch.split_at_mut(d2);
        let (z1, rest) = rest.split_at_mut(d2);
        let (m, ag) = rest.split_at_mut(d);
        w.w1.times(a1, q);
        add_bias(a1, w.b1.as_deref());
        for (z, &v) in z1.iter_mut().zip(a1.iter()) {
            *z = v * sigmoid_fast(v);
        }
        w.w2.times(m, z1);
        add_bias(m, w.b2.as_deref());
        w.g1.times(ag, q);
        add_bias(ag, w.c1.as_deref());
        let z: f32 = (0..s).map(|c| ag[c] * sigmoid_fast(ag[c]) * w.g2[c]).sum();
        let g = sigmoid_fast(3.0 * (z - 1.0));
        for (a, mj) in attn.iter_mut().zip(m.iter()) {
            *a = *a + g * (mj - *a);
        }
    }
}

/// The Gated Memory mixes of a batch decode step, in place, in one pass of candle's CPU thread
/// pool over (sequence, head): `attn` and `q` (pre-RoPE) are `[n, heads, d]`, one row per
/// decoding sequence; `rows` lists the sequences to mix with their layer's decode weights. One
/// call per sequence instead ran each mix on the calling thread in turn while the pool's other
/// workers waited. A row's arithmetic does not depend on the others.
pub fn mix_decode_rows(q: &[f32], attn: &mut [f32], rows: &[(usize, &DecodeWeights)]) {
    let Some(&(_, first)) = rows.first() else { return };
    let (heads, d) = (first.dims.heads, first.dims.d);
    let ptr = SharedRows(attn.as_mut_ptr());
    let len = attn.len();
    let run = |range: std::ops::Range<usize>| {
        let ptr = &ptr;
        let mut scratch = Vec::new();
        for unit in range {
            let (&(row, weights), h) = (&rows[unit / heads], unit % heads);
            let at = (row * heads + h) * d;
            assert!(at + d <= len && weights.dims.heads == heads && weights.dims.d == d, "a mix row outside the batch");
            // SAFETY: unit (row, h) alone touches these d values (rows are distinct sequences).
            let a = unsafe { std::slice::from_raw_parts_mut(ptr.0.add(at), d) };
            weights.mix_row(&q[at..at + d], a, h, &mut scratch);
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

    // The decode mix from int8 weights (per-row scales): close to the fast path's block at t = 1
    // with the f32 weights; a batch of rows in one pool pass bit for bit each row alone; the
    // AVX-512 product bit for bit the plain loop. Head size 64 (the default model's), with and
    // without biases.
    #[test]
    fn decode_rows_match_the_block_path() {
        for bias in [false, true] {
            let dims = GmDims { heads: 3, d: 64, s: 8, bias };
            let p = packed_layer(dims, 5);
            let weights = DecodeWeights::new(&p, dims);
            assert!(weights.bytes() * 3 < p.len() * 4, "int8 weights are not smaller: {}", weights.bytes());
            let n = 4;
            let data = |seed| rand((n, 3, 1, 64), seed).flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let (q, a) = (data(31), data(32));
            let mut want = a.clone();
            for (i, (qb, ab)) in q.chunks(64).zip(want.chunks_mut(64)).enumerate() {
                mix_block(qb, ab, &p, dims, i % 3, 1);
            }
            let mut got = a.clone();
            let rows: Vec<(usize, &DecodeWeights)> = (0..n).map(|r| (r, &weights)).collect();
            mix_decode_rows(&q, &mut got, &rows);
            // The mixed output against the exact one: within 1% of the mix's own change
            // g·(m − attn) (0.18% measured).
            let scale = want.iter().fold(1f32, |m, v| m.max(v.abs()));
            let diff = got.iter().zip(&want).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
            let moved = want.iter().zip(&a).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
            assert!(diff > 0.0 && diff < 0.01 * moved, "bias {bias}: int8 weights moved the mix by {diff} (the mix itself {moved}, scale {scale})");
            for r in 0..n {
                let mut alone = a.clone();
                mix_decode_rows(&q, &mut alone, &[(r, &weights)]);
                assert_eq!(alone[r * 192..(r + 1) * 192], got[r * 192..(r + 1) * 192], "bias {bias}: row {r}");
            }
            // The vector products (whichever path the CPU runs) against the plain loop, bit for
            // bit: w1 (128 outputs: two passes of AVX2's registers), w2 (64), g1 (8).
            let z: Vec<f32> = q.iter().chain(&a).take(128).copied().collect();
            let head = &weights.heads[1];
            for (m, x) in [(&head.w1, &q[..64]), (&head.w2, &z[..]), (&head.g1, &q[..64])] {
                let mut fast = vec![0f32; m.n];
                m.times(&mut fast, x);
                let mut plain = vec![0f32; m.n];
                for (k, &xv) in x.iter().enumerate() {
                    let xs = xv * m.scale[k];
                    for (o, &qv) in plain.iter_mut().zip(&m.q[k * m.n..(k + 1) * m.n]) {
                        *o = xs.mul_add(qv as f32, *o);
                    }
                }
                assert_eq!(fast, plain, "a product of {} outputs", m.n);
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
