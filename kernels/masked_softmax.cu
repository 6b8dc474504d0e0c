// Causal attention probabilities with an additive (soft-mask) bias, one pass each way:
//   forward   P = softmax(scale·S + bias) over keys j ≤ i + (Tk − Tq), other keys 0
//   backward  dX = P ⊙ (dP − Σ_j P·dP)   (gradient of the pre-softmax logits scale·S + bias;
//             the caller scales it for S and reduces it to the bias's own shape)
// S, P, dP, dX: [B, H, Tq, Tk] contiguous. The bias (the FltLM soft mask `min(0, w·s + b)` per
// key, or any tensor broadcastable to [B, H, Tq, Tk]) is read through four element strides, 0 on
// broadcast dims; bias == nullptr: none. A row with no visible key (or only −inf logits) gives
// P = 0 and dX = 0, never NaN, as the CPU op in src/model/ops.rs.
// One block per row; math in f32 whatever the storage type (f32 or bf16).
// The CPU reference is src/kernels/masked_softmax.rs.
#include <cuda_bf16.h>

__device__ __forceinline__ float ms_load(const float* p, long long i) { return p[i]; }
__device__ __forceinline__ float ms_load(const __nv_bfloat16* p, long long i) { return __bfloat162float(p[i]); }
__device__ __forceinline__ void ms_store(float* p, long long i, float v) { p[i] = v; }
__device__ __forceinline__ void ms_store(__nv_bfloat16* p, long long i, float v) { p[i] = __float2bfloat16(v); }

// Block-wide reduction (max or sum) of one value per thread; blockDim.x a multiple of 32, ≤ 1024.
template <bool MAX>
__device__ float ms_block_reduce(float v, float* shared) {
    for (int o = 16; o > 0; o >>= 1) {
        float other = __shfl_xor_sync(0xffffffff, v, o);
        v = MAX ? fmaxf(v, other) : v + other;
    }
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nw = blockDim.x / 32;
    __syncthreads();
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    v = lane < nw ? shared[lane] : (MAX ? -INFINITY : 0.0f);
    for (int o = 16; o > 0; o >>= 1) {
        float other = __shfl_xor_sync(0xffffffff, v, o);
        v = MAX ? fmaxf(v, other) : v + other;
    }
    return v;
}

template <typename T>
__device__ void ms_fwd(const T* __restrict__ S, const T* __restrict__ bias, long long bs0, long long bs1,
                       long long bs2, long long bs3, T* __restrict__ P, int H, int Tq, int Tk, float scale) {
    __shared__ float red[32];
    const long long row = blockIdx.x;
    const int i = row % Tq;
    const int bh = row / Tq, b = bh / H, h = bh % H;
    const int visible = min(Tk, max(0, i + (Tk - Tq) + 1));
    const T* s = S + row * Tk;
    T* out = P + row * Tk;
    const long long bb = b * bs0 + h * bs1 + (long long)i * bs2;
    float mx = -INFINITY;
    for (int j = threadIdx.x; j < visible; j += blockDim.x) {
        float x = scale * ms_load(s, j) + (bias ? ms_load(bias, bb + j * bs3) : 0.0f);
        mx = fmaxf(mx, x);
    }
    mx = ms_block_reduce<true>(mx, red);
    float sum = 0.0f;
    if (mx != -INFINITY) {
        for (int j = threadIdx.x; j < visible; j += blockDim.x) {
            float x = scale * ms_load(s, j) + (bias ? ms_load(bias, bb + j * bs3) : 0.0f);
            sum += expf(x - mx);
        }
    }
    sum = ms_block_reduce<false>(sum, red);
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
    for (int j = threadIdx.x; j < Tk; j += blockDim.x) {
        float v = 0.0f;
        if (j < visible && mx != -INFINITY) {
            float x = scale * ms_load(s, j) + (bias ? ms_load(bias, bb + j * bs3) : 0.0f);
            v = expf(x - mx) * inv;
        }
        ms_store(out, j, v);
    }
}

template <typename T>
__device__ void ms_bwd(const T* __restrict__ P, const T* __restrict__ dP, T* __restrict__ dX, int Tk) {
    __shared__ float red[32];
    const long long row = blockIdx.x;
    const T* p = P + row * Tk;
    const T* g = dP + row * Tk;
    T* dx = dX + row * Tk;
    float dot = 0.0f;
    for (int j = threadIdx.x; j < Tk; j += blockDim.x) dot += ms_load(p, j) * ms_load(g, j);
    dot = ms_block_reduce<false>(dot, red);
    for (int j = threadIdx.x; j < Tk; j += blockDim.x) {
        float pj = ms_load(p, j);
        ms_store(dx, j, pj * (ms_load(g, j) - dot));
    }
}

#define MS_KERNELS(T, SUFFIX)                                                                          \
    extern "C" __global__ void masked_softmax_fwd_##SUFFIX(                                            \
        const T* S, const T* bias, long long bs0, long long bs1, long long bs2, long long bs3, T* P,   \
        int H, int Tq, int Tk, float scale) {                                                           \
        ms_fwd<T>(S, bias, bs0, bs1, bs2, bs3, P, H, Tq, Tk, scale);                                   \
    }                                                                                                  \
    extern "C" __global__ void masked_softmax_bwd_##SUFFIX(const T* P, const T* dP, T* dX, int Tk) {   \
        ms_bwd<T>(P, dP, dX, Tk);                                                                      \
    }

MS_KERNELS(float, f32)
MS_KERNELS(__nv_bfloat16, bf16)
