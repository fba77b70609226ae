//! The engine kit: what every progress-thread backend of rdmareg shares.
//!
//! A backend such as `rdmareg-ucx` or `rdmareg-ofi` runs one progress thread
//! that owns every transport handle. Around that thread both need the same
//! machinery, and it lives here once; a driver (the transport-specific
//! crate) creates and progresses the transport's objects and turns their
//! completions into answers.
//!
//! This crate never calls UCX or libfabric.

#![deny(unsafe_op_in_unsafe_fn)]
