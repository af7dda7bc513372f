//! ONNX Runtime, loaded at run time, and execution provider selection.
//!
//! The binary links no ONNX Runtime: `libonnxruntime` is dlopen'ed once per
//! process, so one build serves CPU gateways (the CPU wheel's library), GPU
//! servers and Jetson (JetPack's GPU build with the CUDA and TensorRT EPs).
//!
//! Search order for the library (first one that exists is used; an explicit
//! choice that fails is an error, never silently replaced):
//! 1. the config's `[runtime] onnxruntime` path (or `--onnxruntime`),
//! 2. `$ORT_DYLIB_PATH`,
//! 3. `lib/` beside the binary, then `../lib/outpost/` (the .deb layout),
//! 4. the system's library path (`libonnxruntime.so` through the dynamic loader).
//!
//! Provider selection: each model tries the configured providers in order in
//! a fresh session builder; the first that registers *and* commits serves it.
//! Every skipped provider is logged with the runtime's own reason.
//!
//! Rooms: `runtime.rs` finds and loads the library; `providers.rs` holds the
//! session options and registers execution providers on a builder;
//! `session.rs` is a loaded model's session and its runs; `hot_loop.rs`
//! the benchmark's unbound loop over prepared values.

mod hot_loop;
mod providers;
mod runtime;
mod session;

pub use hot_loop::HotLoop;
pub use providers::*;
pub use runtime::*;
pub use session::*;
