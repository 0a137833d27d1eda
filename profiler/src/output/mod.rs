//! Writers, one module per format. Each takes a `W: Write` and never opens
//! files itself; [`files`] places the results on disk.
pub mod files;
pub mod flamegraph;
pub mod folded;
pub mod heap_v2;
