//! The fast CPU path: the same arithmetic as the reference, per (batch, head) block of `t` rows,
//! with the per-head MLPs as matrix products (gemm) instead of per-row loops; heads run in
//! parallel. Forward recomputed in the backward, each sigmoid computed once.

use super::{head, GmDims, HeadWeights};
use crate::kernels::math::sigmoid_fast;

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

pub(super) fn add_bias(y: &mut [f32], bias: Option<&[f32]>) {
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

/// Fast equivalent of [`reference_forward`](super::reference_forward).
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

/// Query rows (all heads) from which `fast_forward` runs its blocks in parallel.
const PARALLEL_ROWS: usize = 32;

/// Fast equivalent of [`reference_backward`](super::reference_backward): `(dq, dattn, dp)`.
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
