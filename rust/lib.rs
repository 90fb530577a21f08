//! sessiongate's Rust core. This file only wires modules; each primitive
//! lives in its own file with its own `register` function.

use pyo3::prelude::*;

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
