//! The integration tests of `rdmareg-ucx`, as one test binary: each module
//! is a group of tests of one behaviour, named by it. One binary links the
//! UCX engine once instead of once per group.
//!
//! Tests that play a role in a second process start this binary again
//! filtered to their own full name (`module::test`, see
//! [`common::child_process::test_path`]); the two-process tests with their
//! own `main` stay a binary of their own (`tests/two_processes.rs`).

#[path = "../common/mod.rs"]
mod common;
#[path = "../packed_key_model/mod.rs"]
mod packed_key_model;
#[path = "../worker_address_model/mod.rs"]
mod worker_address_model;

mod adversarial_gathered;
mod adversarial_list_bounds;
mod adversarial_replies;
mod answers_after_release;
mod batches;
mod caller_copies;
mod caller_copies_adversarial;
mod chunked_put_attacks;
mod conformance_same_host;
mod conformance_tcp;
mod direct_write_attacks;
mod fd_exhaustion;
mod gathered_reads;
mod hostile_fragment_offsets;
mod leases_from_hostile_readers;
mod list_pieces_from_a_real_owner;
mod list_replies_from_a_hostile_owner;
mod list_replies_from_a_real_owner;
mod list_replies_to_raw_consumers;
mod notices_from_hostile_readers;
mod owner_served_reads;
mod packed_key_malformed;
mod packed_key_props;
mod packed_key_real;
mod peer_churn;
mod progress_cpus;
mod raw_peer;
mod raw_uct_peers;
mod read_list_props;
mod reads_around_the_rendezvous_threshold;
mod reads_in_pieces;
mod reads_in_pieces_adversarial;
mod same_host_direct_reads;
mod same_host_direct_writes;
mod shared_batches;
mod shared_batches_adversarial;
mod shared_memory_segments;
mod shared_memory_smoke;
mod staged_write_attacks;
mod tcp_flush_not_refused;
mod tcp_owner_loss;
mod tcp_refused_connects;
mod teardown;
mod two_engines;
mod typed_errors;
mod unmaps_of_served_destinations;
mod worker_address_engine;
mod worker_address_malformed;
mod worker_address_props;
mod worker_address_real;
mod write_chunks;
mod write_list_lifecycle;
mod write_list_replies_from_a_hostile_owner;
mod write_lists;
mod write_lists_from_hostile_writers;
mod writes_from_hostile_writers;
