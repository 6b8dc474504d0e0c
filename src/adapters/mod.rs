//! Per-document adapters over the frozen base model.

pub mod gated_memory;

pub use gated_memory::GatedMemory;
