//! The integration tests of `rdmareg-ofi`, as one test binary: each module
//! is a group of tests of one behaviour, named by it. One binary links the
//! libfabric engine once instead of once per group; the two-process tests
//! with their own `main` stay a binary of their own
//! (`tests/two_processes.rs`).

#[path = "../common/mod.rs"]
mod common;

mod adversarial_peers;
mod conformance_shm;
mod conformance_tcp;
mod leases_on_the_one_sided_path;
mod notices_on_the_one_sided_path;
mod open_files;
mod owner_served;
mod packed_key_props;
mod peers;
mod provider_facts;
mod refusal_codes;
mod shm_region_names;
mod stalled_connection_reset;
mod termination_signals;
mod write_lists;
mod writes;
