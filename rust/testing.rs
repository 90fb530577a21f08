//! The core's test hooks: internals exported only so that the tests can reach them (the
//! Rust halves of twin tests, the JSON scanner's verdict). They are registered here and
//! nowhere else, and listed under "Test hooks" in `python/sessiongate/_core.pyi`; the
//! gateway itself never calls them. Each stays beside what it exposes, `pub(crate)`.

use pyo3::prelude::*;

use crate::front::bulk::front_bulk_pauses;
use crate::front::failure::{
    connect_failed_text, connect_timed_out, front_retry_target, transport_error_text, url_hostname,
};
use crate::front::reliability::{front_backoff_ms, PyBreaker, PyHealthCounter};
use crate::front::siblings::{front_sibling_warmup, front_siblings_roles};
use crate::front::{front_forwarded_headers, front_route};
use crate::relay::json_reject;
use crate::stamp::reserved_header_names;

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(json_reject, m)?)?;
    m.add_function(wrap_pyfunction!(reserved_header_names, m)?)?;
    m.add_function(wrap_pyfunction!(front_route, m)?)?;
    m.add_function(wrap_pyfunction!(front_forwarded_headers, m)?)?;
    m.add_function(wrap_pyfunction!(front_backoff_ms, m)?)?;
    m.add_class::<PyBreaker>()?;
    m.add_class::<PyHealthCounter>()?;
    m.add_function(wrap_pyfunction!(transport_error_text, m)?)?;
    m.add_function(wrap_pyfunction!(connect_failed_text, m)?)?;
    m.add_function(wrap_pyfunction!(connect_timed_out, m)?)?;
    m.add_function(wrap_pyfunction!(url_hostname, m)?)?;
    m.add_function(wrap_pyfunction!(front_retry_target, m)?)?;
    m.add_function(wrap_pyfunction!(front_bulk_pauses, m)?)?;
    m.add_function(wrap_pyfunction!(front_sibling_warmup, m)?)?;
    m.add_function(wrap_pyfunction!(front_siblings_roles, m)?)?;
    Ok(())
}
