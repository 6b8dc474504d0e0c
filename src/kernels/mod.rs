//! Rust side of the CUDA kernels in `kernels/` (top level): candle custom ops with hand-written
//! backward passes for adapter hot spots. Each op has a plain CPU reference implementation (its
//! CPU path, unit-tested against candle's autograd of the composite it replaces); the CUDA
//! kernels are tested against those references in `tests/cuda.rs` (`--features cuda`, on a GPU).
//! - `gated_memory`: the Gated Memory per-head MLPs and the mix, fused (forward + backward).
//! - `masked_softmax`: causal softmax of scaled attention scores plus the soft-mask bias
//!   (forward + backward), the middle of the trainable attention on CUDA.
//! - `decode_attention`: one query row per sequence over its own KV cache, a whole batch step of
//!   decoding sequences in one parallel loop; on CUDA one launch (`cuda::decode_attention`,
//!   kernels/decode_attention.cu, tested against the CPU through the batched forward).
//! - `bf16_matmul`: the frozen linear layers of the trainable path in bf16 (AVX-512 BF16), f32 sums.
//! - `math`: the vectorisable exp and sigmoid of the CPU paths (here and in `model::ops`).
//!
//! The lowest layer of the crate's numerics: kernels import nothing from `model` or `adapters`
//! (an adapter hands its parameters in packed; `model::ops` and the adapters call in).

pub mod bf16_matmul;
pub mod decode_attention;
pub mod gated_memory;
pub mod masked_softmax;
pub mod quant_matmul;
pub(crate) mod math;

#[cfg(feature = "cuda")]
pub(crate) mod cuda;
