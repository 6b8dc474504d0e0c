//! Rust side of the CUDA kernels in `kernels/` (top level): candle custom ops with hand-written
//! backward passes for adapter hot spots. Each op has a plain CPU reference implementation (its
//! CPU path, unit-tested against candle's autograd of the composite it replaces); the CUDA
//! kernels are tested against those references in `tests/cuda.rs` (`--features cuda`, on a GPU).
//! - `gated_memory`: the Gated Memory per-head MLPs and the mix, fused (forward + backward).
//! - `masked_softmax`: causal softmax of scaled attention scores plus the soft-mask bias
//!   (forward + backward), the middle of the trainable attention on CUDA.

pub mod gated_memory;
pub mod masked_softmax;

#[cfg(feature = "cuda")]
mod cuda;
