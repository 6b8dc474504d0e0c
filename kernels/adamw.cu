// AdamW over all of an adapter's parameter tensors at once, with global-norm gradient clipping
// (the trainer's `AdamW` and `clip` in src/lift/trainer.rs, which stay the CPU path and the
// reference). An adapter has a few hundred small tensors (7 per Gated Memory layer); as candle
// ops each took ~15 launches per optimizer step, and the clip's norm a host sync per tensor:
// thousands of launches, launch-bound on a GPU. Here: one launch sums the gradients' squares,
// one updates every tensor, reading the norm on the device (no sync).
//
// Tensor j's parameters, gradient and moments are at the addresses in the tables (f32,
// contiguous, sizes[j] elements); a block row (blockIdx.y) per tensor, blocks striding over it.

struct AdamWScalars {
    float beta1, beta2, eps, lr, decay, bc1, bc2, max_norm;  // decay = 1 - lr * weight_decay
};

extern "C" __global__ void adamw_sum_squares(const long long* __restrict__ grads, const long long* __restrict__ sizes,
                                             float* __restrict__ out) {
    const float* g = reinterpret_cast<const float*>(grads[blockIdx.y]);
    const long long n = sizes[blockIdx.y];
    float acc = 0.0f;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        acc += g[i] * g[i];
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if ((threadIdx.x & 31) == 0) atomicAdd(out, acc);
}

// `sumsq` null: no clipping. Else the gradients are scaled by max_norm / (norm + 1e-6) when their
// global norm is finite and above max_norm, as `clip` does.
extern "C" __global__ void adamw_update(const long long* __restrict__ params, const long long* __restrict__ grads,
                                        const long long* __restrict__ ms, const long long* __restrict__ vs,
                                        const long long* __restrict__ sizes, const float* __restrict__ sumsq,
                                        AdamWScalars a) {
    float scale = 1.0f;
    if (sumsq) {
        const float norm = sqrtf(*sumsq);
        if (isfinite(norm) && norm > a.max_norm) scale = a.max_norm / (norm + 1e-6f);
    }
    const int j = blockIdx.y;
    float* p = reinterpret_cast<float*>(params[j]);
    const float* g = reinterpret_cast<const float*>(grads[j]);
    float* m = reinterpret_cast<float*>(ms[j]);
    float* v = reinterpret_cast<float*>(vs[j]);
    const long long n = sizes[j];
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const float gi = g[i] * scale;
        const float mi = m[i] * a.beta1 + gi * (1.0f - a.beta1);
        const float vi = v[i] * a.beta2 + gi * gi * (1.0f - a.beta2);
        const float update = (mi / a.bc1) / (sqrtf(vi / a.bc2) + a.eps);
        p[i] = p[i] * a.decay - update * a.lr;
        m[i] = mi;
        v[i] = vi;
    }
}
