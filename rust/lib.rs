//! sessiongate's Rust core. This file only wires modules: each primitive lives in its own
//! file with its own `register` function and imports only the shared plumbing, never another
//! primitive (docs/architecture.md, "The Rust crate").

use pyo3::prelude::*;

// Plumbing shared by the primitives.
pub mod buffer;
pub mod cached_tokens;
pub mod error;
pub mod gil;
pub mod hash;
pub mod json_scan;
pub mod json_write;
pub mod options;
pub mod types;

// Primitives: one `register` each.
pub mod build_info;
pub mod bytes_sink;
pub mod engine_policy;
pub mod frame;
pub mod front;
pub mod r3;
pub mod relay;
pub mod shard;
pub mod stamp;

// Test hooks: internals exported for the tests only.
pub mod testing;

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    build_info::register(m)?;
    shard::register(m)?;
    frame::register(m)?;
    relay::register(m)?;
    r3::register(m)?;
    stamp::register(m)?;
    bytes_sink::register(m)?;
    front::register(m)?;
    engine_policy::register(m)?;
    testing::register(m)?;
    Ok(())
}
