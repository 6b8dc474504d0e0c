//! The plain per-row CPU implementation of exactly what the kernels compute: the reference the
//! fast CPU path and the CUDA kernels are tested against.

use super::{head, GmDims, HeadWeights};

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
