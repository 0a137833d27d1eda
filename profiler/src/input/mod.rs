//! Readers of existing profiles, one module per format.
pub mod heap_v2;
