//! Loopback backend (in progress).
