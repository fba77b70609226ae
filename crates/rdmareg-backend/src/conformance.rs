//! Conformance kit (in progress).
