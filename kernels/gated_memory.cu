// Gated Memory (src/adapters/gated_memory.rs) fused into one kernel per direction: for every
// query head h and row (token) r, on the head's pre-RoPE query x = q[r] (d = head_dim),
//   memory  m = W2·SiLU(W1·x + b1) + b2                (d → 2d → d)
//   gate    g = sigmoid(3·(G2·SiLU(G1·x + c1) − 1))     (d → s → 1, s = ⌊√d⌋, no bias on G2)
//   out     = attn + g·(m − attn)
// All in f32. q, attn, out, grads: [B, H, T, d] contiguous. The layer's parameters arrive as one
// flat f32 buffer `p` (the concatenation of the flattened tensors in GatedMemoryLayer::named
// order); `off_*` are their element offsets (a bias offset < 0: no bias). Per head h the weights
// are row-major [in, out] matrices at off + h·in·out.
//
// A block handles TR rows of one head (grid: (ceil(T / TR), B·H)); its rows' activations live in
// shared memory, the weights are read from global memory (coalesced over the output column, L2
// resident: a head's weights are a few tens of KB). The backward recomputes the forward tile and
// adds each block's weight-gradient partial sums to `dp` (zero-initialised) with atomicAdd.
// The CPU reference is src/kernels/gated_memory/reference.rs (`reference_forward` / `reference_backward`).

struct GmParams {
    int d, s, H, T;
    long long off_w1, off_b1, off_w2, off_b2, off_g1, off_c1, off_g2;
};

__device__ __forceinline__ float gm_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ float gm_silu(float x) { return x * gm_sigmoid(x); }
__device__ __forceinline__ float gm_silu_grad(float x) {
    float s = gm_sigmoid(x);
    return s * (1.0f + x * (1.0f - s));
}

// dst[k·n + j] += Σ_r f(a[r·m + k]) · b[r·n + j] over the tile's rows, f = SiLU or identity
// (a weight gradient from pre-activations a and output gradients b), with atomicAdd.
template <bool SILU_A>
__device__ void gm_acc_outer(float* dst, const float* a, const float* b, int rows, int m, int n) {
    for (int i = threadIdx.x; i < m * n; i += blockDim.x) {
        int k = i / n, j = i % n;
        float acc = 0.0f;
        for (int r = 0; r < rows; ++r) {
            float av = a[r * m + k];
            acc += (SILU_A ? gm_silu(av) : av) * b[r * n + j];
        }
        atomicAdd(dst + i, acc);
    }
}

// dst[j] += Σ_r b[r·n + j] (a bias gradient), with atomicAdd.
__device__ void gm_acc_rows(float* dst, const float* b, int rows, int n) {
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        float acc = 0.0f;
        for (int r = 0; r < rows; ++r) acc += b[r * n + j];
        atomicAdd(dst + j, acc);
    }
}

// out[r·n + j] = b[j] + Σ_k x[r·d + k]·w[k·n + j] for the tile's rows (b may be null).
__device__ void gm_affine(const float* x, const float* w, const float* b, int rows, int d, int n, float* out) {
    for (int i = threadIdx.x; i < rows * n; i += blockDim.x) {
        int r = i / n, j = i % n;
        float acc = b ? b[j] : 0.0f;
        for (int k = 0; k < d; ++k) acc += x[r * d + k] * w[k * n + j];
        out[i] = acc;
    }
}

// Loads the tile's x rows and computes the pre-activations of both hidden layers and the gate.
// Shared layout (floats): x[TR*d] | h1[TR*2d] (pre-activation) | gh[TR*s] (pre-activation) | g[TR]
__device__ void gm_tile_forward(const float* __restrict__ p, GmParams P, int h, const float* xbase, int rows,
                                float* x, float* h1, float* gh, float* g) {
    const int d = P.d, d2 = 2 * P.d, s = P.s;
    const int tid = threadIdx.x, nt = blockDim.x;
    for (int i = tid; i < rows * d; i += nt) x[i] = xbase[i];
    __syncthreads();
    gm_affine(x, p + P.off_w1 + (long long)h * d * d2, P.off_b1 >= 0 ? p + P.off_b1 + (long long)h * d2 : nullptr,
              rows, d, d2, h1);
    gm_affine(x, p + P.off_g1 + (long long)h * d * s, P.off_c1 >= 0 ? p + P.off_c1 + (long long)h * s : nullptr,
              rows, d, s, gh);
    __syncthreads();
    const float* g2 = p + P.off_g2 + (long long)h * s;
    for (int r = tid; r < rows; r += nt) {
        float z = 0.0f;
        for (int c = 0; c < s; ++c) z += gm_silu(gh[r * s + c]) * g2[c];
        g[r] = gm_sigmoid(3.0f * (z - 1.0f));
    }
    __syncthreads();
}

// The block's tile: head, rows, offset of its first row, and its shared-memory activations
// (x, pre-activations h1 and gh, gate g), computed by `gm_tile_forward`. Empty tile: rows <= 0.
struct GmTile {
    int h, rows;
    long long base;
    float *x, *h1, *gh, *g;
};

__device__ GmTile gm_tile(const float* q, const float* p, GmParams P, int TR, float* smem) {
    GmTile t;
    const int bh = blockIdx.y, t0 = blockIdx.x * TR;
    t.h = bh % P.H;
    t.rows = min(TR, P.T - t0);
    t.base = ((long long)bh * P.T + t0) * P.d;
    t.x = smem;
    t.h1 = t.x + TR * P.d;
    t.gh = t.h1 + TR * 2 * P.d;
    t.g = t.gh + TR * P.s;
    if (t.rows > 0) gm_tile_forward(p, P, t.h, q + t.base, t.rows, t.x, t.h1, t.gh, t.g);
    return t;
}

// m_j = b2_j + Σ_k SiLU(h1_k)·W2[k][j] for one row's pre-activations h1.
__device__ float gm_memory(const float* p, GmParams P, int h, const float* h1row, int j) {
    const int d = P.d, d2 = 2 * P.d;
    const float* w2 = p + P.off_w2 + (long long)h * d2 * d;
    float m = P.off_b2 >= 0 ? p[P.off_b2 + (long long)h * d + j] : 0.0f;
    for (int k = 0; k < d2; ++k) m += gm_silu(h1row[k]) * w2[k * d + j];
    return m;
}

// The mix for the block's tile with the layer parameters `p`.
__device__ void gm_fwd_tile(const float* __restrict__ q, const float* __restrict__ attn, const float* __restrict__ p,
                            float* __restrict__ out, GmParams P, int TR) {
    extern __shared__ float smem[];
    const GmTile t = gm_tile(q, p, P, TR, smem);
    if (t.rows <= 0) return;
    const int d = P.d;
    for (int i = threadIdx.x; i < t.rows * d; i += blockDim.x) {
        int r = i / d;
        float m = gm_memory(p, P, t.h, t.h1 + r * 2 * d, i % d);
        float a = attn[t.base + i];
        out[t.base + i] = a + t.g[r] * (m - a);
    }
}

extern "C" __global__ void gated_memory_fwd(const float* __restrict__ q, const float* __restrict__ attn,
                                            const float* __restrict__ p, float* __restrict__ out,
                                            GmParams P, int TR) {
    gm_fwd_tile(q, attn, p, out, P, TR);
}

// The decode step of a continuous batch: row b of q/attn ([B, H, 1, d]) is one sequence's token,
// mixed with its own adapter's layer parameters at address ps[b] (0: no Gated Memory at this
// layer, the attention passes through). One launch for every sequence's adapter.
extern "C" __global__ void gated_memory_fwd_rows(const float* __restrict__ q, const float* __restrict__ attn,
                                                 const long long* __restrict__ ps, float* __restrict__ out,
                                                 GmParams P, int TR) {
    const float* p = reinterpret_cast<const float*>(ps[blockIdx.y / P.H]);
    if (p) {
        gm_fwd_tile(q, attn, p, out, P, TR);
        return;
    }
    const int t0 = blockIdx.x * TR, rows = min(TR, P.T - t0);
    const long long base = ((long long)blockIdx.y * P.T + t0) * P.d;
    for (int i = threadIdx.x; i < rows * P.d; i += blockDim.x) out[base + i] = attn[base + i];
}

// grads = [dq | dattn | dp] (N = B·H·T·d each for dq and dattn, zero-initialised): dq and dattn
// are written in full, the parameter gradients dp accumulated with atomicAdd.
// Shared layout (floats): x[TR*d] | h1[TR*2d] | gh[TR*s] | g[TR] | go[TR*d] | dm[TR*d]
//                        | dh1[TR*2d] | dgh[TR*s] | dz[TR]
extern "C" __global__ void gated_memory_bwd(const float* __restrict__ q, const float* __restrict__ attn,
                                            const float* __restrict__ p, const float* __restrict__ gout,
                                            float* grads, long long N, GmParams P, int TR) {
    extern __shared__ float smem[];
    const GmTile t = gm_tile(q, p, P, TR, smem);
    if (t.rows <= 0) return;
    float* dq = grads;
    float* dattn = grads + N;
    float* dp = grads + 2 * N;
    const int d = P.d, d2 = 2 * P.d, s = P.s;
    const int tid = threadIdx.x, nt = blockDim.x;
    const int h = t.h, rows = t.rows;
    const long long base = t.base;
    const float *x = t.x, *h1 = t.h1, *gh = t.gh, *g = t.g;
    float* go = t.g + TR;
    float* dm = go + TR * d;
    float* dh1 = dm + TR * d;
    float* dgh = dh1 + TR * d2;
    float* dz = dgh + TR * s;
    const float* w1 = p + P.off_w1 + (long long)h * d * d2;
    const float* w2 = p + P.off_w2 + (long long)h * d2 * d;
    const float* g1 = p + P.off_g1 + (long long)h * d * s;
    const float* g2 = p + P.off_g2 + (long long)h * s;

    // m (recomputed), d_attn = (1 − g)·go, d_m = g·go; dm temporarily holds m − attn.
    for (int i = tid; i < rows * d; i += nt) {
        int r = i / d;
        float m = gm_memory(p, P, h, h1 + r * d2, i % d);
        float gv = gout[base + i];
        go[i] = gv;
        dm[i] = m - attn[base + i];
        dattn[base + i] = (1.0f - g[r]) * gv;
    }
    __syncthreads();
    // dz = (Σ_j go·(m − attn)) · 3·g·(1 − g)
    for (int r = tid; r < rows; r += nt) {
        float acc = 0.0f;
        for (int j = 0; j < d; ++j) acc += go[r * d + j] * dm[r * d + j];
        dz[r] = acc * 3.0f * g[r] * (1.0f - g[r]);
    }
    __syncthreads();
    for (int i = tid; i < rows * d; i += nt) dm[i] = g[i / d] * go[i];
    for (int i = tid; i < rows * s; i += nt) {
        int r = i / s, c = i % s;
        dgh[i] = g2[c] * dz[r] * gm_silu_grad(gh[i]);
    }
    __syncthreads();
    // dh1 = (W2 · dm) ⊙ silu'(h1)
    for (int i = tid; i < rows * d2; i += nt) {
        int r = i / d2, k = i % d2;
        float acc = 0.0f;
        const float* wr = w2 + k * d;
        for (int j = 0; j < d; ++j) acc += wr[j] * dm[r * d + j];
        dh1[i] = acc * gm_silu_grad(h1[i]);
    }
    __syncthreads();
    // dq = W1 · dh1 + G1 · dgh
    for (int i = tid; i < rows * d; i += nt) {
        int r = i / d, k = i % d;
        float acc = 0.0f;
        const float* wr = w1 + k * d2;
        for (int j = 0; j < d2; ++j) acc += wr[j] * dh1[r * d2 + j];
        const float* gr = g1 + k * s;
        for (int c = 0; c < s; ++c) acc += gr[c] * dgh[r * s + c];
        dq[base + i] = acc;
    }
    // Parameter gradients: this tile's sums over its rows.
    const long long hd = (long long)h;
    gm_acc_outer<false>(dp + P.off_w1 + hd * d * d2, x, dh1, rows, d, d2);
    gm_acc_outer<true>(dp + P.off_w2 + hd * d2 * d, h1, dm, rows, d2, d);
    gm_acc_outer<false>(dp + P.off_g1 + hd * d * s, x, dgh, rows, d, s);
    gm_acc_outer<true>(dp + P.off_g2 + hd * s, gh, dz, rows, s, 1);
    if (P.off_b1 >= 0) gm_acc_rows(dp + P.off_b1 + hd * d2, dh1, rows, d2);
    if (P.off_b2 >= 0) gm_acc_rows(dp + P.off_b2 + hd * d, dm, rows, d);
    if (P.off_c1 >= 0) gm_acc_rows(dp + P.off_c1 + hd * s, dgh, rows, s);
}
