//! Integration tests of the registry over the loopback backend, grouped by
//! the behaviour they pin down.

mod admission;
mod adversarial_lending;
mod bounded_waits;
mod budget;
mod common;
mod describe;
mod destinations;
mod latch;
mod leases;
mod lists;
mod metrics;
mod model;
mod notices;
mod pool;
mod rollbacks;
mod shutdown;
mod stress;
mod transfer;
mod write_attacks;
mod writes;
