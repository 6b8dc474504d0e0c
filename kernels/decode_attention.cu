// Decode attention of a continuous batch on CUDA, the GPU twin of src/kernels/decode_attention.rs:
// every sequence brings one new token and has its own KV cache (`[kv_heads, capacity, d]` bf16
// buffers of its own, any length), and one launch per layer appends each new key and value to its
// cache and attends every sequence's query heads over its keys. Before it, the batch paid a dozen
// launches per sequence and layer (RoPE, two cache writes, scores, softmax, values, copies):
// launch-bound, 78 ms per 16-row step on an H200 against 10 ms for one row.
//
// A block per (sequence, KV head) serves the G = heads / kv_heads query heads that share the KV
// head (grouped-query attention), so each key and value row is read once for all G. Its warps take
// the keys in turn (key t to warp t mod W); a lane holds dimensions e·32 + lane (e < 4: d <= 128;
// coalesced rows). Softmax online in f32 (running maximum, sum and weighted values per
// warp and head), the warps' partial results combined through shared memory at the end. The new
// key and value are read from their inputs, not from the cache the block writes them to, so no
// block waits on another. An additive per-key bias (f32, FltLM's soft mask) is optional per
// sequence; a key whose score is -inf weighs nothing.

#include <cuda_bf16.h>

#define DA_WARPS 8
#define DA_MAXG 8  // query heads per KV head
#define DA_MAXE 4  // dimensions per lane: d <= 128

extern "C" __global__ void decode_attention_bf16(
    const __nv_bfloat16* __restrict__ q,     // [n, H, d], after RoPE
    const __nv_bfloat16* __restrict__ knew,  // [n, KV, d], after RoPE
    const __nv_bfloat16* __restrict__ vnew,  // [n, KV, d]
    const long long* __restrict__ kcache,    // [n] addresses of [KV, cap, d] bf16
    const long long* __restrict__ vcache,
    const long long* __restrict__ bias,      // [n] addresses of f32 [len] or 0; null: none
    const int* __restrict__ lens,            // [n] keys, the new one included
    const int* __restrict__ caps,            // [n] cache capacities (positions)
    __nv_bfloat16* __restrict__ out,         // [n, H, d]
    int H, int KV, int d, float scale) {
    __shared__ float s_acc[DA_WARPS][DA_MAXG][DA_MAXE * 32];
    __shared__ float s_m[DA_WARPS][DA_MAXG];
    __shared__ float s_l[DA_WARPS][DA_MAXG];

    const int seq = blockIdx.x / KV, g = blockIdx.x % KV, G = H / KV;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int len = lens[seq];
    const long long cap = caps[seq];
    __nv_bfloat16* kc = reinterpret_cast<__nv_bfloat16*>(kcache[seq]) + (long long)g * cap * d;
    __nv_bfloat16* vc = reinterpret_cast<__nv_bfloat16*>(vcache[seq]) + (long long)g * cap * d;
    const __nv_bfloat16* kn = knew + ((long long)seq * KV + g) * d;
    const __nv_bfloat16* vn = vnew + ((long long)seq * KV + g) * d;
    const float* b = bias ? reinterpret_cast<const float*>(bias[seq]) : nullptr;

    // The cache append: position len - 1.
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        kc[(long long)(len - 1) * d + i] = kn[i];
        vc[(long long)(len - 1) * d + i] = vn[i];
    }

    float qr[DA_MAXG][DA_MAXE], acc[DA_MAXG][DA_MAXE], m[DA_MAXG], l[DA_MAXG];
#pragma unroll
    for (int h = 0; h < DA_MAXG; ++h) {
        m[h] = -INFINITY;
        l[h] = 0.0f;
#pragma unroll
        for (int e = 0; e < DA_MAXE; ++e) {
            acc[h][e] = 0.0f;
            qr[h][e] = (h < G && e * 32 + lane < d) ? __bfloat162float(q[((long long)seq * H + g * G + h) * d + e * 32 + lane]) : 0.0f;
        }
    }

    for (int t = warp; t < len; t += DA_WARPS) {
        const __nv_bfloat16* kr = t == len - 1 ? kn : kc + (long long)t * d;
        const __nv_bfloat16* vr = t == len - 1 ? vn : vc + (long long)t * d;
        float kv[DA_MAXE], vv[DA_MAXE];
#pragma unroll
        for (int e = 0; e < DA_MAXE; ++e) {
            const bool in = e * 32 + lane < d;
            kv[e] = in ? __bfloat162float(kr[e * 32 + lane]) : 0.0f;
            vv[e] = in ? __bfloat162float(vr[e * 32 + lane]) : 0.0f;
        }
        const float bt = b ? b[t] : 0.0f;
#pragma unroll
        for (int h = 0; h < DA_MAXG; ++h) {
            if (h >= G) break;
            float s = 0.0f;
#pragma unroll
            for (int e = 0; e < DA_MAXE; ++e) s += qr[h][e] * kv[e];
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
            s = s * scale + bt;
            if (s == -INFINITY) continue;
            const float mn = fmaxf(m[h], s);
            const float corr = __expf(m[h] - mn);  // 0 while m is -inf
            const float p = __expf(s - mn);
            l[h] = l[h] * corr + p;
#pragma unroll
            for (int e = 0; e < DA_MAXE; ++e) acc[h][e] = acc[h][e] * corr + p * vv[e];
            m[h] = mn;
        }
    }

#pragma unroll
    for (int h = 0; h < DA_MAXG; ++h) {
        if (h >= G) break;
        if (lane == 0) {
            s_m[warp][h] = m[h];
            s_l[warp][h] = l[h];
        }
#pragma unroll
        for (int e = 0; e < DA_MAXE; ++e)
            if (e * 32 + lane < d) s_acc[warp][h][e * 32 + lane] = acc[h][e];
    }
    __syncthreads();

    for (int i = threadIdx.x; i < G * d; i += blockDim.x) {
        const int h = i / d, j = i % d;
        float mx = -INFINITY;
        for (int w = 0; w < DA_WARPS; ++w) mx = fmaxf(mx, s_m[w][h]);
        float sum = 0.0f, o = 0.0f;
        if (mx != -INFINITY) {
            for (int w = 0; w < DA_WARPS; ++w) {
                if (s_m[w][h] == -INFINITY) continue;
                const float c = __expf(s_m[w][h] - mx);
                sum += s_l[w][h] * c;
                o += s_acc[w][h][j] * c;
            }
        }
        out[((long long)seq * H + g * G + h) * d + j] = __float2bfloat16(sum > 0.0f ? o / sum : 0.0f);
    }
}
