//! lift-serve: test-time adaptation on long documents (LIFT with Gated Memory, FltLM, CDT) on candle.
//!
//! Data flows one way: document → plan → train → store → serve. This crate is the library behind
//! the `lift-serve` binary (CLI and HTTP server): `server` (HTTP) → `service` (documents and jobs)
//! → `engine` (model work on its threads) → `lift` (absorb, answer) and `store` (adapters on disk)
//! → `adapters`, `model`, `kernels`. Research code (`eval`, the prepared base's training and
//! reading evaluation in `base`) is compiled with the `research` feature only; `corpus` holds the
//! texts both read.

pub mod adapters;
pub mod base;
pub mod collection_index;
pub mod corpus;
pub mod document;
pub mod engine;
#[cfg(feature = "research")]
pub mod eval;
pub mod extraction;
pub mod fetch;
pub mod formats;
pub mod kernels;
pub mod lift;
pub mod metrics;
pub mod retrieve;
pub mod model;
pub mod runtime;
pub mod server;
pub mod service;
pub mod store;
/// Test support, not in the shipped library: the unit tests and the `testing` feature (which
/// the integration tests and benches turn on) compile it.
#[cfg(any(test, feature = "testing"))]
pub mod testing;
