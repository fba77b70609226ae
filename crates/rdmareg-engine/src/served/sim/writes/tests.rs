//! The simulator of served writes over many seeds, and the defects it
//! finds.

use super::*;
use crate::sim_support::seeds;

fn caught(defects: Defects, writer_defects: writer::Defects, limit: u64) -> Violation {
    let found = (0..limit)
        .find_map(|seed| run_with(seed, defects, writer_defects).err())
        .unwrap_or_else(|| panic!("{defects:?} {writer_defects:?} not caught in {limit} seeds"));
    eprintln!(
        "{defects:?} {writer_defects:?}: caught at seed {} step {}: {}",
        found.seed, found.step, found.message
    );
    found
}

/// The owner and writers as built keep every invariant over the seeds
/// of `seeds()`, and the seeds exercise what they claim: writes
/// received and refused, access denied, unmaps that waited, failed
/// receives, answers of both kinds; write lists answered after their
/// receives (several entries accepted in some), answered at once,
/// dropped, left unanswered on a failed connection, with entries `Ok`,
/// refused and failed, and list writes completed `Ok` by their writer;
/// lists answered in several replies, both ways, some of those answered
/// at once dropped past the refusal bound, and lists whose places took
/// their connection past its bound.
#[test]
fn every_write_seed_keeps_every_invariant() {
    let seeds = seeds();
    let count = seeds.end - seeds.start;
    let mut total = Stats::default();
    for seed in seeds.clone() {
        match run_with(seed, Defects::default(), writer::Defects::default()) {
            Ok(stats) => total.add(stats),
            Err(v) => panic!(
                "seed {} step {}: {}\n{}",
                v.seed,
                v.step,
                v.message,
                replay(v.seed, Defects::default(), writer::Defects::default())
            ),
        }
    }
    if count == 1 {
        eprintln!(
            "{}",
            replay(seeds.start, Defects::default(), writer::Defects::default())
        );
    }
    eprintln!("write seeds {seeds:?}: {total:?}");
    if count < 1_000 {
        return;
    }
    assert!(total.received > count && total.refused > count, "{total:?}");
    assert!(total.access_denied > count / 10, "{total:?}");
    assert!(
        total.answered_ok > count && total.answered_err > count,
        "{total:?}"
    );
    assert!(total.unmaps_waited > count / 20, "{total:?}");
    assert!(total.receives_failed > count / 10, "{total:?}");
    assert!(
        total.dropped > 0 && total.bytes_written > count,
        "{total:?}"
    );
    assert!(
        total.listed_bytes > count && total.incomplete_logs > count / 50,
        "{total:?}"
    );
    assert!(
        total.lists_answered > count / 2 && total.wide_lists > count / 10,
        "{total:?}"
    );
    assert!(
        total.lists_refused > count / 2
            && total.lists_dropped > count / 20
            && total.lists_unanswered > count / 50,
        "{total:?}"
    );
    assert!(
        total.list_entries_ok > count
            && total.list_entries_refused > count
            && total.list_entries_failed > count / 4
            && total.list_writes_ok > count / 2,
        "{total:?}"
    );
    assert!(
        total.lists_in_parts > count / 20
            && total.lists_refused_in_parts > count / 10
            && total.list_parts_dropped > count / 10
            && total.lists_past_bound > count / 40,
        "{total:?}"
    );
}

/// A seed replays exactly, a write list's failure too.
#[test]
fn a_write_seed_replays_exactly() {
    for defects in [
        Defects {
            unmap_ignores_receives: true,
            ..Defects::default()
        },
        Defects {
            answer_list_before_last_receive: true,
            ..Defects::default()
        },
    ] {
        let first = caught(defects, writer::Defects::default(), 100);
        assert_eq!(
            run_with(first.seed, defects, writer::Defects::default()).err(),
            Some(first)
        );
    }
    let stats = |s: Stats| (s.writes, s.received, s.refused, s.bytes_written);
    let clean = || run_with(7, Defects::default(), writer::Defects::default()).unwrap();
    assert_eq!(stats(clean()), stats(clean()));
}

/// Accepting writes into registrations made for reading is caught
/// within 20 seeds: a write the model refuses as access denied.
#[test]
fn the_simulator_finds_writes_to_read_only_memory() {
    let defects = Defects {
        write_access_unchecked: true,
        ..Defects::default()
    };
    let found = caught(defects, writer::Defects::default(), 20);
    assert!(found.message.contains("AccessDenied"), "{found:?}");
}

/// Taking no hold for a write's receive — an unmap that finishes while
/// bytes are still received into the region — is caught within 20
/// seeds (invariant 3, or a byte written after the unmap).
#[test]
fn the_simulator_finds_an_unmap_that_ignores_receives() {
    let defects = Defects {
        unmap_ignores_receives: true,
        ..Defects::default()
    };
    let found = caught(defects, writer::Defects::default(), 20);
    assert!(
        found.message.contains("still received")
            || found.message.contains("in no live registration"),
        "{found:?}"
    );
}

/// Acknowledging a write at its acceptance, before its bytes are in,
/// is caught within 20 seeds: an `Ok` for bytes never received whole.
#[test]
fn the_simulator_finds_an_acknowledgement_before_the_receive() {
    let defects = Defects {
        acknowledge_before_receive: true,
        ..Defects::default()
    };
    let found = caught(defects, writer::Defects::default(), 20);
    assert!(found.message.contains("never received whole"), "{found:?}");
}

/// Listing a write whose receive failed in the log of written ranges
/// is caught within 20 seeds (invariant 8).
#[test]
fn the_simulator_finds_failed_writes_listed() {
    let defects = Defects {
        failed_receives_listed: true,
        ..Defects::default()
    };
    let found = caught(defects, writer::Defects::default(), 20);
    assert!(found.message.contains("lists byte"), "{found:?}");
}

/// A writer answering on the owner's reply while the transport may
/// still read the source is caught within 20 seeds (invariant 5).
#[test]
fn the_simulator_finds_an_answer_before_the_send_ended() {
    let writer_defects = writer::Defects {
        answer_before_send_ended: true,
    };
    let found = caught(Defects::default(), writer_defects, 20);
    assert!(found.message.contains("before its send ended"), "{found:?}");
}

/// Answering a write list when its first receive ended, while others
/// still run, is caught within 20 seeds: its answer comes before its last
/// receive ended.
#[test]
fn the_simulator_finds_a_list_answered_too_early() {
    let defects = Defects {
        answer_list_before_last_receive: true,
        ..Defects::default()
    };
    let found = caught(defects, writer::Defects::default(), 20);
    assert!(
        found.message.contains("before its last receive ended"),
        "{found:?}"
    );
}

/// Sending a write list's replies last part first is caught within 20
/// seeds: a reply that is not the next part in entry order.
#[test]
fn the_simulator_finds_list_replies_out_of_order() {
    let defects = Defects {
        list_replies_out_of_order: true,
        ..Defects::default()
    };
    let found = caught(defects, writer::Defects::default(), 20);
    assert!(found.message.contains("got reply 1 of"), "{found:?}");
}
