//! Deterministic scenarios of the served-read protocol: an owner and a
//! consumer driven in memory by [`Pair`], with an explicit clock, against
//! hostile peers that inject bytes of their own choosing. Each scenario
//! pins, on the state machines alone, a promise an end-to-end adversarial
//! test of the UCX or libfabric engine states.
//!
//! # Which end-to-end tests each scenario replaces or backs
//!
//! End-to-end tests are named `file::test`, from
//! `crates/rdmareg-ucx/tests/ucx/` and, marked *ofi*,
//! `crates/rdmareg-ofi/src/adversarial_peers/`. *Replaces* names the
//! end-to-end tests the scenario took the place of: they asserted nothing
//! beyond the scenario but what other tests kept end to end still show
//! (the transport path they took, the counts they read). *Kept* names the
//! end-to-end tests of the same promise that stay, each *(part)* with what
//! only the real transport shows.
//!
//! For reads in pieces (chunks) a scenario pins each chunk's rules.
//! Cutting a read into chunks (`progress::chunks`) and joining their
//! results into one (`ChunkResults`, `progress::results`) are the UCX
//! driver's, each unit-tested there; the chunk tests kept end to end race
//! them with the real transport.
//!
//! | scenario | replaces | kept |
//! |---|---|---|
//! | `hostile_replies::a_third_peer_cannot_answer_a_read`, `only_the_owners_refusal_ends_a_read` | `adversarial_replies::a_third_peer_cannot_answer_a_read_sent_to_another_owner` | |
//! | `hostile_replies::a_spoofed_rendezvous_cannot_outlive_the_deadline` | `adversarial_replies::a_spoofed_rendezvous_cannot_hold_a_read_past_its_deadline` | |
//! | `hostile_replies::another_owner_cannot_answer_a_read_sent_elsewhere` | | `adversarial_replies::an_owner_cannot_answer_a_read_sent_to_another_owner` (part: the endpoint a reply came in on is the driver's reading of UCX's `reply_ep`) |
//! | `hostile_replies::a_reply_of_the_wrong_length_lands_nothing`, `malformed_and_late_replies_land_nothing` | | `adversarial_replies::a_hostile_owner_sending_malformed_replies_lands_nothing` (part: an owner gone mid-rendezvous, and nothing left registered); *ofi* `hostile_owners::a_hostile_owners_single_replies_get_typed_answers_and_never_land_after_them_over_{tcp,shm}` (part: the libfabric reply travels in a tag, into a posted receive) |
//! | `hostile_replies::busy_or_unknown_refusals_answer_typed_at_once` | `adversarial_replies::a_busy_or_unknown_refusal_reaches_the_caller_as_a_typed_error` (the error each refusal maps to is unit-tested in the UCX driver's `read_protocol`) | |
//! | `hostile_replies::a_replayed_reply_lands_nothing_after_the_answer`, `a_second_reply_cannot_race_the_first` | `adversarial_replies::a_replayed_reply_lands_nothing_once_its_read_was_answered` | |
//! | `hostile_replies::the_owner_stalling_its_rendezvous_is_timed_out` | `adversarial_replies::the_real_owner_stalling_its_rendezvous_is_timed_out` | *ofi* `hostile_owners::a_read_whose_owner_stalls_mid_reply_still_answers_at_its_deadline` (part) |
//! | `hostile_requests::bad_requests_get_refusals_and_no_bytes` | | `adversarial_replies::a_hostile_consumer_sending_bad_requests_gets_refusals_only` (part: requests without the reply flag or as a rendezvous payload are UCX's) |
//! | `hostile_requests::garbage_lists_are_dropped_and_hostile_entries_refused` | | *ofi* `hostile_consumers::garbage_frames_and_hostile_list_entries_get_typed_answers_and_the_owner_keeps_serving` (part: the scenario sends the UCX format; the libfabric driver's frames and their decoding are its own) |
//! | `hostile_requests::a_last_piece_past_the_end_is_refused_alone` | `reads_in_pieces_adversarial::a_read_whose_last_piece_runs_one_byte_past_the_registration_answers_out_of_range` | |
//! | `hostile_requests::a_forged_key_read_in_pieces_lands_nothing` | `reads_in_pieces_adversarial::a_forged_key_read_in_pieces_lands_not_one_byte` | |
//! | `hostile_requests::a_repeated_request_holds_a_lease_per_reply` | none: a duplicated request, as the simulator sends them | |
//! | `hostile_requests::a_request_in_a_bystanders_name_holds_no_lease` | | *ofi* `hostile_consumers::an_unmap_answers_even_when_a_request_named_a_bystander_as_its_reply_address`, `a_known_peer_naming_a_bystander_as_its_reply_address_is_refused_and_holds_no_lease` (part: the sender check is the driver's) |
//! | `hostile_requests::requests_from_a_failed_endpoint_are_dropped`, `floods::a_consumer_holds_at_most_its_bound_of_replies` | | `adversarial_replies::one_consumer_cannot_hold_an_unbounded_number_of_served_replies_open` (part: the resident set), `counts_are_released_when_the_consumers_endpoint_dies` (part: with and without UCX's peer error handling) |
//! | `floods::reads_past_the_bound_answer_busy_and_pass_retried` | `adversarial_replies::reads_beyond_an_owners_bound_are_answered_busy_and_succeed_when_retried`, `the_bound_frees_up_once_the_consumer_takes_its_replies` | |
//! | `floods::an_honest_deep_batch_is_never_refused` | | `adversarial_replies::an_honest_deep_batch_is_never_refused` (part: how the driver cuts and gathers the deepest batch a consumer posts); `reads_in_pieces_adversarial::many_concurrent_reads_in_pieces_land_exactly_and_release_everything` (part) |
//! | `floods::list_entries_count_against_the_bound` | `adversarial_replies::gathered_entries_count_against_the_connections_bound` | |
//! | `floods::a_flood_from_one_peer_does_not_starve_another` | | *ofi* `hostile_consumers::a_request_flood_from_one_peer_does_not_starve_another_consumer` (part: up to the default bound of 4096 refusals waiting in libfabric's send queue for a live peer that never receives them) |
//! | `floods::made_up_reply_addresses_are_forgotten_once_ended` | | *ofi* `hostile_consumers::made_up_reply_addresses_do_not_lock_later_consumers_out_of_an_owner` (part: the address table is the driver's) |
//! | `floods::others_at_their_bound_do_not_make_a_consumer_busy` | | *ofi* `hostile_consumers::a_consumer_is_still_served_lists_while_other_addresses_hold_the_owners_total` (part: the total is the driver's) |
//! | `floods::busy_pieces_answer_transient_and_land_nothing_later` | `reads_in_pieces_adversarial::under_a_small_bound_busy_reads_in_pieces_answer_a_transient_error_and_land_nothing_later` | |
//! | `lists::replayed_list_replies_change_no_byte` | `adversarial_gathered::replayed_list_and_single_replies_after_the_answer_change_no_destination_byte` | |
//! | `lists::an_entry_named_twice_lands_once_from_the_first`, `hostile_replies::a_second_reply_cannot_race_the_first` | `adversarial_gathered::a_list_reply_naming_one_read_twice_lands_it_once_and_keeps_the_others_in_place`; `list_replies_from_a_hostile_owner::an_entry_answered_again_in_a_later_reply_of_the_same_list_lands_once_from_the_first` | |
//! | `lists::another_peer_answering_a_lists_ids_lands_nothing` | | `adversarial_gathered::another_peer_answering_a_lists_request_ids_lands_nothing` (part: the endpoint UCX names for a reply another peer sends with the reply flag) |
//! | `lists::strangers_in_a_list_reply_land_nothing` | `list_replies_from_a_hostile_owner::entries_naming_ids_never_asked_land_nothing_and_shift_no_real_entry` | |
//! | `lists::entries_of_the_wrong_length_fail_alone` | | `list_replies_from_a_hostile_owner::entries_carrying_the_wrong_byte_count_fail_alone_and_neighbours_land_in_place` (part: a reply whose entries outgrow its payload, and the walk through a payload to each entry's place, whatever the verdicts before it, are the driver's) |
//! | `lists::pieces_under_each_others_ids_stay_inside_their_read` | `list_pieces_from_a_hostile_owner::pieces_answered_under_each_others_ids_land_only_inside_their_own_entry` | |
//! | `lists::pieces_out_of_order_land_once_from_the_first` | `list_pieces_from_a_hostile_owner::pieces_answered_twice_out_of_order_and_among_strangers_land_once_in_place` | |
//! | `lists::refused_or_missized_pieces_fail_only_their_own` | `list_pieces_from_a_hostile_owner::refused_or_missized_pieces_fail_only_their_own_read` | `reads_in_pieces_adversarial::a_batch_mixing_pieced_small_and_failing_entries_answers_each_on_its_own` (part) |
//! | `lists::crossed_reply_formats_land_only_with_the_reads_length` | `adversarial_gathered::replies_crossed_between_single_and_list_formats_land_only_with_the_reads_own_length` | |
//! | `owner_lists::a_maximal_hostile_list_is_judged_entry_by_entry` | `adversarial_gathered::an_owner_refuses_each_hostile_entry_of_a_maximal_list_on_its_own` | |
//! | `owner_lists::a_list_is_cut_by_its_payload_only` | `list_replies_to_raw_consumers::a_list_is_cut_by_its_payload_only_whatever_the_mix_of_entry_sizes` | |
//! | `owner_lists::bad_entries_among_good_ones_are_refused_alone` | `list_replies_to_raw_consumers::a_list_mixing_stale_forged_empty_and_live_entries_refuses_each_bad_one_on_its_own` | |
//! | `owner_lists::a_full_list_is_answered_in_headers_that_fit` | | `adversarial_list_bounds::an_owner_with_small_transport_segments_answers_a_full_list_in_replies_that_fit` (part: the header bound comes from UCX's worker, and a header past it crashes UCX) |
//! | `deadlines::nothing_lands_after_a_deadline_answer` | | `answers_after_release::nothing_lands_after_a_deadline_answer` (part: over the same-host and shared-memory lanes too, and a 64 MiB rendezvous receive over tcp) |
//! | `deadlines::a_deadline_between_pieces_lets_no_piece_land_after` | | `reads_in_pieces_adversarial::a_deadline_passing_between_pieces_lets_no_piece_land_after_the_answer` (part: a piece's deadline closes the endpoint under its siblings), `a_batch_of_pieced_entries_past_short_deadlines_lets_nothing_land_after_its_answer` (part) |
//! | `deadlines::unanswered_second_pieces_time_out_and_land_nothing_later` | `list_pieces_from_a_hostile_owner::an_owner_answering_only_first_pieces_gets_no_entry_answered_ok` | |
//! | `deadlines::a_list_member_past_its_deadline_keeps_its_bytes` | `adversarial_gathered::a_list_member_past_its_deadline_keeps_its_bytes_when_the_list_reply_comes_late` | *ofi* `hostile_owners::a_late_or_abandoned_gathered_list_never_lands_after_its_answer_over_{tcp,shm}` (part: the late half) |
//! | `deadlines::late_list_replies_land_only_the_live_entries` | `list_replies_from_a_hostile_owner::replies_after_some_entries_of_the_list_timed_out_land_only_the_live_ones` | |
//! | `deadlines::a_stalled_rendezvous_to_a_list_entry_answers_after_release` | | `adversarial_gathered::a_gathered_read_answered_by_a_stalled_rendezvous_is_answered_only_after_ucx_lets_go` (part: stopping a UCX rendezvous receive by closing its endpoint, for single reads too) |
//! | `deadlines::a_posted_receive_past_its_deadline_answers_on_release` | | *ofi* `resend_attacks::reads_whose_deadline_passes_while_their_resend_is_pending_answer_by_it_and_nothing_lands_after` (part) |
//! | `shutdown_and_unmap::a_consumer_shut_down_mid_read_answers_after_release` | | `answers_after_release::nothing_lands_after_the_consumer_shuts_down_mid_read` (part: three lanes); `reads_in_pieces_adversarial::nothing_lands_after_the_consumer_shuts_down_mid_read_in_pieces` (part: a shutdown racing pieces in flight, and nothing left registered) |
//! | `shutdown_and_unmap::an_owner_lost_mid_list_answers_every_entry` | | `answers_after_release::nothing_lands_after_the_owner_goes_away_mid_read` (part: three lanes); `adversarial_gathered::an_owner_lost_mid_list_answers_every_entry_and_leaves_nothing_registered`, `a_list_to_a_vanished_owner_answers_every_read_and_leaves_nothing_registered` (part: how UCX fails the endpoint of a peer gone or never there, and nothing left registered) |
//! | `shutdown_and_unmap::a_shutdown_between_the_replies_of_a_list` | `list_replies_from_a_hostile_owner::a_consumer_shut_down_between_the_replies_of_a_list_answers_the_rest_shutting_down`; `list_pieces_from_a_hostile_owner::a_consumer_shut_down_between_the_pieces_of_its_reads_answers_them_shutting_down`; `adversarial_gathered::a_consumer_shut_down_with_a_list_in_flight_answers_every_read_and_lands_nothing_after` | *ofi* `hostile_owners::a_late_or_abandoned_gathered_list_never_lands_after_its_answer_over_{tcp,shm}` (part: the abandoned half) |
//! | `shutdown_and_unmap::an_unmap_waits_for_a_reply_the_consumer_holds` | `adversarial_replies::an_unmap_waits_for_a_reply_a_live_consumer_holds_and_answers_once_it_is_released` (a held UCX rendezvous reply holding the region stays shown by `a_freed_described_buffer_is_not_reused_while_a_consumer_holds_its_reply`) | |
//! | `shutdown_and_unmap::a_held_reply_cannot_stall_the_owners_teardown` | | `adversarial_replies::a_consumer_holding_a_reply_open_cannot_stall_the_owners_teardown`; `adversarial_gathered::an_owner_shut_down_with_gathered_replies_stuck_finishes_and_leaves_nothing_registered` (part: the teardown timeout and destroying a worker with sends pending, a rendezvous held or eager replies stuck in tcp's queue, and nothing left registered) |
//! | `shutdown_and_unmap::vanished_consumers_release_every_count` | | `list_replies_to_raw_consumers::raw_consumers_vanishing_mid_list_leave_the_owner_serving_and_unmappable`, `a_consumer_process_killed_mid_list_leaves_the_owner_serving_and_unmappable` (part); `adversarial_replies::a_vanished_consumer_without_error_handling_releases_its_lease` (part) |
//! | `shutdown_and_unmap::unread_replies_hold_the_unmap_until_the_reader_goes` | | `adversarial_gathered::replies_a_consumer_never_reads_hold_the_unmap_until_that_consumer_is_gone` (part: eager replies UCX has not finished, stuck in tcp's queue, still read the region) |
//! | `shutdown_and_unmap::an_unmap_mid_read_in_pieces_waits_for_the_pieces_sent` | | `reads_in_pieces_adversarial::an_owners_unmap_mid_read_in_pieces_confirms_only_after_its_replies_finished` (part: UCX reads no source byte after its sends completed), `nothing_lands_after_the_owner_shuts_down_mid_read_in_pieces` (part: a shutdown racing pieces in flight, and nothing left registered) |
//! | `shutdown_and_unmap::a_shutdown_with_receives_pending_answers_on_release` | | *ofi* `resend_attacks::shutting_a_consumer_down_while_its_resends_are_pending_answers_every_read_and_nothing_lands_after` (part) |
//! | `shutdown_and_unmap::a_lost_owner_with_a_request_unsent_answers_on_release` | | *ofi* `resend_attacks::an_owner_shut_down_around_the_failed_send_and_its_resend_gives_typed_errors_by_the_deadline` (part) |
//!
//! # What stays end to end
//!
//! - What UCX does: `adversarial_list_bounds::a_consumer_with_small_transport_segments_lands_a_full_batch_of_small_reads`
//!   (a header past UCX's fragment buffer), `adversarial_gathered::a_list_reply_sent_by_rendezvous_lands_nothing_and_answers_every_entry`
//!   (eager or rendezvous is UCX's delivery), `list_replies_to_raw_consumers::an_owner_whose_operator_shapes_ucx_protocols_answers_a_maximal_list_whole_and_it_lands`,
//!   the three `reads_in_pieces_adversarial::under_an_operators_rendezvous_threshold_*`,
//!   `adversarial_replies::a_freed_described_buffer_is_not_reused_while_a_consumer_holds_its_reply`
//!   (the registry's pool), and all of `shared_batches_adversarial` (same-host copy plans).
//! - What the UCX driver decides, not the engine: cutting a read into pieces and joining their
//!   answers (`reads_in_pieces_adversarial::odd_lengths_at_odd_offsets_land_exactly_and_touch_no_byte_outside_their_range`,
//!   `reads_are_counted_in_pieces_only_over_tcp_only_endpoints`,
//!   `a_lone_read_in_pieces_is_not_refused_as_busy_by_a_bound_below_its_piece_count`,
//!   `dropping_reads_in_pieces_mid_flight_leaks_nothing_and_lands_nothing_after_the_unmap`), and
//!   dropping a malformed list reply whole while the true one still lands
//!   (`adversarial_gathered::malformed_list_replies_are_dropped_whole_and_the_true_reply_still_lands`;
//!   the decoding itself is [`wire::decode_list_reply`]'s).
//! - What libfabric and the libfabric driver do: the provider's truncation and the driver's scratch
//!   receives (`hostile_owners::overlong_replies_of_a_hostile_owner_leave_the_consumer_no_memory_behind`,
//!   `an_owner_that_never_answers_cannot_make_its_consumer_hoard_scratch_memory`), the liveness probe
//!   and connection resets (`the_probe_spares_a_stalled_owner_and_finds_a_dead_one`,
//!   `after_a_stalled_connection_is_reset_the_same_owner_is_read_again_and_others_were_never_disturbed`),
//!   the ask-again loop (`an_owner_that_keeps_answering_ask_again_gets_a_typed_answer_and_no_endless_asking`),
//!   the sender check and the address vector (`hostile_consumers::a_forged_reply_address_cannot_feed_another_consumers_read_over_{tcp,shm}`,
//!   `one_consumer_naming_its_address_three_ways_is_still_bounded_as_one`,
//!   `gathered_replies_to_many_reply_addresses_do_not_grow_the_owner_without_bound`,
//!   both `a_flood_of_made_up_reply_addresses_does_not_fail_a_consumer_reading_meanwhile_*`,
//!   both `a_peer_cannot_pass_for_a_bystander_*`, both `consumers_the_owner_forgets_while_connected_*`),
//!   and the resend on a closed connection (`resend_attacks::many_concurrent_reads_to_a_forgotten_owner_*`,
//!   `unmapping_the_destination_while_resends_are_pending_*`, `reads_whose_resends_land_on_connections_closed_again_*`,
//!   `reads_from_an_owner_that_keeps_closing_their_connection_*`).

mod pair;

use super::owner::{ListLimits, OwnerConfig, Read, Refusal};
use super::wire;
use pair::*;

mod deadlines;
mod floods;
mod hostile_replies;
mod hostile_requests;
mod lists;
mod owner_lists;
mod shutdown_and_unmap;
