//! The rdmareg command-line tool.
fn main() {}
