//! Smoke checks of the conformance kit over pure shared memory with peer
//! error handling off (`Transport::SharedMemoryNoErrorHandling`).

use crate::common;

use rdmareg_backend::conformance::{self, BackendPair, block_on};
use rdmareg_ucx::Transport;

fn run(check: impl AsyncFnOnce(&BackendPair)) {
    block_on(async {
        let pair = common::backend_pair(Transport::SharedMemoryNoErrorHandling);
        check(&pair).await;
        pair.teardown().await;
    });
}

#[test]
fn get_moves_the_right_bytes() {
    run(conformance::get_moves_the_right_bytes);
}

#[test]
fn get_outside_the_local_mapping_is_out_of_range() {
    run(conformance::get_outside_the_local_mapping_is_out_of_range);
}

#[test]
fn malformed_keys_are_invalid_key() {
    run(conformance::malformed_keys_are_invalid_key);
}

#[test]
fn cancelled_map_leaves_no_registration() {
    run(conformance::cancelled_map_leaves_no_registration);
}

#[test]
fn unmap_twice_returns_ok_and_counts_once() {
    run(conformance::unmap_twice_returns_ok_and_counts_once);
}

#[test]
fn unmapping_destination_refuses_new_gets_and_waits_for_the_one_in_flight() {
    run(conformance::unmapping_destination_refuses_new_gets_and_waits_for_the_one_in_flight);
}
