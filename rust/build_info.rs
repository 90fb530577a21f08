//! What this Rust core is: its version and what it was built for and how (set by
//! `build.rs`), so an operator can tell which build answered.

use pyo3::prelude::*;
use pyo3::types::PyDict;

/// `{"version", "target", "profile", "rustc"}` of this build of the core.
#[pyfunction]
fn build_info(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let info = PyDict::new(py);
    info.set_item("version", env!("CARGO_PKG_VERSION"))?;
    info.set_item("target", env!("SESSIONGATE_BUILD_TARGET"))?;
    info.set_item("profile", env!("SESSIONGATE_BUILD_PROFILE"))?;
    info.set_item("rustc", env!("SESSIONGATE_BUILD_RUSTC"))?;
    Ok(info)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(build_info, m)?)?;
    Ok(())
}
