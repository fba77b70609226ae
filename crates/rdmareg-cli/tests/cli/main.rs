//! The integration tests of the `rdmareg` command, as one test binary: each
//! module runs the built command as a user would, for one subcommand.

mod bench;
mod demo;
mod discovery;
mod ucx_log;
