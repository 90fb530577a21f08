//! sessiongate's Rust core. This file only wires modules; each primitive
//! lives in its own file with its own `register` function.

use pyo3::prelude::*;

pub mod buffer;
pub mod build_info;
pub mod bytes_sink;
pub mod engine_policy;
pub mod frame;
pub mod front;
pub mod json_scan;
pub mod r3;
pub mod relay;
pub mod shard;
pub mod stamp;

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
    Ok(())
}
