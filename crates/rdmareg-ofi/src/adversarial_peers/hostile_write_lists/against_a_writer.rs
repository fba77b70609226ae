//! Writers under a raw owner: what a real writer sends, and what it
//! makes of the replies.

use rdmareg_core::BackendPut;
use rdmareg_engine::served::Refusal;

use super::super::*;
use crate::protocol::{
    MAX_LIST_ENTRIES, WRITE_LIST_ENTRY_MAX, WRITE_LIST_VERSION, WRITE_RECEIVE_MAX, WRITE_TAG,
    WRITE_VERSION, WriteListRequest, WriteRequest, refusal_tag, write_list_message_len,
};

/// The writer's source registration.
const SRC_LEN: usize = 1 << 20;

/// The source's byte at `offset`.
fn source_byte(offset: usize) -> u8 {
    (offset % 251) as u8 ^ 0x5C
}

/// A put of `len` source bytes from `src` into the raw owner's region at
/// `remote` (offsets).
#[derive(Debug, Clone, Copy)]
struct Put {
    remote: u64,
    src: u64,
    len: u64,
}

/// `count` puts of `len` bytes each, side by side in the source and in
/// the owner's region.
fn side_by_side(count: u64, len: u64) -> Vec<Put> {
    (0..count)
        .map(|i| Put {
            remote: i * len,
            src: i * len,
            len,
        })
        .collect()
}

/// What the owner received of a writer: a write list or a single write.
#[derive(Debug)]
enum Message {
    List(WriteListRequest, Vec<u8>),
    Single(WriteRequest, Vec<u8>),
}

impl HostileOwnerSetup {
    /// A writer engine with a patterned source, putting to a raw owner.
    fn writer(provider: Provider) -> HostileOwnerSetup {
        let source = (0..SRC_LEN).map(source_byte).collect();
        HostileOwnerSetup::with_memory(provider, Memory::holding(source))
    }

    /// Starts one batch of `puts`, each due within `deadline`.
    fn start_puts(
        &self,
        puts: &[Put],
        deadline: Duration,
    ) -> tokio::task::JoinHandle<Vec<Result<(), RdmaError>>> {
        let key = PackedKey::decode(&self.key).expect("the raw owner's key");
        let requests: Vec<BackendPut> = puts
            .iter()
            .map(|put| BackendPut {
                peer: PeerId(1),
                remote_addr: key.base + put.remote,
                packed_key: self.key.clone(),
                local_region_id: self.dst_region.backend_region_id,
                local_offset: put.src,
                len: put.len,
                deadline: Some(deadline),
            })
            .collect();
        let w = self.consumer.backend();
        self.rt.spawn(async move {
            // SAFETY: nothing writes the source until the batch answered.
            unsafe { w.put_batch(requests) }.await
        })
    }

    /// Posing as an owner: waits up to 10 s for one write message.
    fn take_write(&mut self) -> Message {
        let (context, index) = self
            .owner
            .receive(ADDR_UNSPEC, WRITE_TAG, 0, WRITE_RECEIVE_MAX);
        let bytes = match self.owner.wait(context) {
            Some(Ended::Done { len, .. }) => self.owner.buffers[index][..len].to_vec(),
            other => panic!("no write message arrived: {other:?}"),
        };
        match bytes.first() {
            Some(&WRITE_LIST_VERSION) => {
                let (header, payload) = WriteListRequest::decode(&bytes).expect("a write list");
                Message::List(header, payload.to_vec())
            }
            Some(&WRITE_VERSION) => {
                let (header, payload) = WriteRequest::decode(&bytes).expect("a single write");
                Message::Single(header, payload.to_vec())
            }
            other => panic!("a write message of version {other:?}"),
        }
    }

    /// Takes one write list.
    fn take_list(&mut self) -> (WriteListRequest, Vec<u8>) {
        match self.take_write() {
            Message::List(header, payload) => (header, payload),
            other => panic!("a single write, not a list: {other:?}"),
        }
    }

    /// Sends `bytes` to the writer with `tag`.
    fn reply(&mut self, tag: u64, bytes: Vec<u8>) {
        let to = self.to_consumer;
        self.owner.send(to, tag, bytes);
    }

    /// Takes `count` write messages and answers each as an honest owner
    /// would: every entry of a list, and every single write, written.
    fn serve_honestly(&mut self, count: usize) -> Vec<Message> {
        let messages: Vec<Message> = (0..count).map(|_| self.take_write()).collect();
        for message in &messages {
            match message {
                Message::List(header, _) => {
                    self.reply(header.request_id, vec![0; header.entries.len()])
                }
                Message::Single(header, _) => {
                    self.reply(header.request_id, header.length.to_le_bytes().to_vec())
                }
            }
        }
        messages
    }

    /// The list entries and payload `puts` must travel as.
    fn expected_list(&self, puts: &[Put]) -> (Vec<ListEntry>, Vec<u8>) {
        let key = PackedKey::decode(&self.key).expect("the raw owner's key");
        let entries = puts
            .iter()
            .map(|put| ListEntry {
                region_id: key.region_id,
                capability: key.capability,
                address: key.base + put.remote,
                length: put.len,
            })
            .collect();
        (entries, source_bytes(puts))
    }
}

/// The source bytes of `puts`, back to back.
fn source_bytes(puts: &[Put]) -> Vec<u8> {
    puts.iter()
        .flat_map(|put| (put.src..put.src + put.len).map(|at| source_byte(at as usize)))
        .collect()
}

/// A batch of six puts of 1 B to 64 KiB, to scattered places of one
/// owner in no order of address, arrives as one version-4 message on the
/// write tag: its entries are exactly the puts, in the batch's order, its
/// payload exactly their source bytes back to back, and its reply address
/// the writer's. A second batch with a put one byte over 64 KiB among
/// three small ones sends that one alone, as a single write of its own
/// bytes, and the small ones as one list. Answered honestly, every put
/// reports `Ok`.
fn small_puts_travel_as_one_list(provider: Provider) {
    let mut setup = HostileOwnerSetup::writer(provider.clone());
    let deadline = Duration::from_secs(10);
    let puts = [
        Put {
            remote: 0x8_0000,
            src: 3,
            len: 1,
        },
        Put {
            remote: 0x100,
            src: 1000,
            len: 100,
        },
        Put {
            remote: 0x4_0000,
            src: 77,
            len: 4096,
        },
        Put {
            remote: 0x2_0000,
            src: 5000,
            len: 16385,
        },
        Put {
            remote: 0x6_0000,
            src: 200_000,
            len: WRITE_LIST_ENTRY_MAX,
        },
        Put {
            remote: 0,
            src: 999,
            len: 7,
        },
    ];
    let task = setup.start_puts(&puts, deadline);
    let messages = setup.serve_honestly(1);
    let first = setup.answers(task);
    let (entries, payload) = setup.expected_list(&puts);
    let writer_address = setup.consumer.fabric_address().to_vec();
    let [Message::List(header, sent)] = &messages[..] else {
        panic!("{provider:?}: not one list: {messages:?}");
    };
    assert_eq!(header.entries, entries, "{provider:?}: the entries");
    assert!(
        sent == &payload,
        "{provider:?}: the payload is the puts' bytes"
    );
    assert_eq!(header.reply_to, writer_address);
    assert_eq!(first, vec![Ok(()); puts.len()]);
    let large = Put {
        remote: 0x1000,
        src: 10,
        len: WRITE_LIST_ENTRY_MAX + 1,
    };
    let small = [
        Put {
            remote: 0,
            src: 0,
            len: 8,
        },
        Put {
            remote: 0x3_0000,
            src: 20,
            len: 300,
        },
        Put {
            remote: 0x5_0000,
            src: 30,
            len: WRITE_LIST_ENTRY_MAX,
        },
    ];
    let mixed = [small[0], large, small[1], small[2]];
    let task = setup.start_puts(&mixed, deadline);
    let messages = setup.serve_honestly(2);
    let second = setup.answers(task);
    let (entries, payload) = setup.expected_list(&small);
    let (large_entry, large_bytes) = setup.expected_list(&[large]);
    setup.finish();
    let (mut lists, mut singles) = (Vec::new(), Vec::new());
    for message in messages {
        match message {
            Message::List(header, payload) => lists.push((header.entries, payload)),
            Message::Single(header, payload) => singles.push((header, payload)),
        }
    }
    assert_eq!(lists.len(), 1, "{provider:?}: one list");
    assert_eq!(lists[0].0, entries, "{provider:?}: the small puts' entries");
    assert!(lists[0].1 == payload, "{provider:?}: the small puts' bytes");
    assert_eq!(singles.len(), 1, "{provider:?}: the large put alone");
    let (header, bytes) = &singles[0];
    assert_eq!(
        (header.address, header.length),
        (large_entry[0].address, large.len)
    );
    assert!(bytes == &large_bytes, "{provider:?}: the large put's bytes");
    assert_eq!(second, vec![Ok(()); mixed.len()]);
}

#[test]
fn small_puts_travel_as_one_write_list_over_tcp() {
    small_puts_travel_as_one_list(Provider::Tcp);
}

#[test]
fn small_puts_travel_as_one_write_list_over_shm() {
    small_puts_travel_as_one_list(Provider::Shm);
}

/// A list keeps to its bounds: a batch of 70 puts of 8 bytes goes as a
/// list of 64 entries and one of 6; a batch of five puts of 64 KiB as a
/// list of four (256 KiB) and a single write; a batch of 64 puts of 4 KiB
/// (256 KiB) as a list of as many as fit one write receive with their
/// header (63 over tcp) and the rest. Every message's entries are puts of
/// the batch, in its order, each once, and every put reports `Ok`.
#[test]
fn write_lists_keep_to_their_entry_byte_and_receive_bounds() {
    let mut setup = HostileOwnerSetup::writer(Provider::Tcp);
    let deadline = Duration::from_secs(10);
    let address_len = setup.consumer.fabric_address().len();
    let fit = (1..=MAX_LIST_ENTRIES)
        .take_while(|&n| {
            write_list_message_len(n, address_len, n as u64 * 4096) <= WRITE_RECEIVE_MAX as u64
        })
        .count();
    let rest = match MAX_LIST_ENTRIES - fit {
        1 => "single".to_string(),
        n => format!("list of {n}"),
    };
    let mut shapes = Vec::new();
    let mut answers = Vec::new();
    for (puts, messages) in [
        (side_by_side(70, 8), 2),
        (side_by_side(5, WRITE_LIST_ENTRY_MAX), 2),
        (side_by_side(MAX_LIST_ENTRIES as u64, 4096), 2),
    ] {
        let task = setup.start_puts(&puts, deadline);
        let mut taken = setup.serve_honestly(messages);
        answers.push(setup.answers(task));
        // Lists first, longest first.
        taken.sort_by_key(|message| match message {
            Message::List(header, _) => std::cmp::Reverse(header.entries.len()),
            Message::Single(..) => std::cmp::Reverse(0),
        });
        let (expected, _) = setup.expected_list(&puts);
        let mut next = 0;
        let mut shape = Vec::new();
        for message in taken {
            let (entries, payload) = match message {
                Message::List(header, payload) => {
                    shape.push(format!("list of {}", header.entries.len()));
                    (header.entries, payload)
                }
                Message::Single(header, payload) => {
                    shape.push("single".to_string());
                    let entry = ListEntry {
                        region_id: header.region_id,
                        capability: header.capability,
                        address: header.address,
                        length: header.length,
                    };
                    (vec![entry], payload)
                }
            };
            assert_eq!(entries, expected[next..next + entries.len()]);
            assert!(payload == source_bytes(&puts[next..next + entries.len()]));
            next += entries.len();
        }
        assert_eq!(next, puts.len(), "every put sent once");
        shapes.push(shape);
    }
    setup.finish();
    assert!(
        fit < MAX_LIST_ENTRIES,
        "64 puts of 4 KiB do not fit one list"
    );
    assert_eq!(
        shapes,
        [
            vec!["list of 64".to_string(), "list of 6".to_string()],
            vec!["list of 4".to_string(), "single".to_string()],
            vec![format!("list of {fit}"), rest],
        ]
    );
    assert_eq!(answers[0], vec![Ok(()); 70]);
    assert_eq!(answers[1], vec![Ok(()); 5]);
    assert_eq!(answers[2], vec![Ok(()); MAX_LIST_ENTRIES]);
}

/// Attack: a raw owner answers a writer's lists of three puts wrongly: a
/// reply a byte short and a byte long (of zeros), a refusal tag on the
/// list's id with no bytes and with a zero per entry, statuses of codes
/// this build does not know, known refusal codes, a reply to another id
/// and then none, and no reply at all. Every put answers: `Ok` only where
/// a reply of one status byte per entry, on the list's id, said 0 for it;
/// a reply not of that length fails every entry (its outcome unknown); a
/// refusal tag (an owner answers a list only with status bytes) fails
/// every entry, its outcome unknown, whatever bytes it carries; unknown codes
/// fail typed; without a reply each put fails by its deadline, with
/// `Timeout`, and the late reply changes nothing. Between the cases the
/// writer still puts.
fn hostile_list_replies(provider: Provider) {
    use crate::protocol::BUSY_TEXT;
    let mut setup = HostileOwnerSetup::writer(provider.clone());
    let puts = side_by_side(3, 8);
    let long = Duration::from_secs(10);
    let short = Duration::from_millis(300);
    let refused = |refusal: Refusal, bytes: Vec<u8>| {
        move |id: u64| vec![(refusal_tag(id, refusal), bytes.clone())]
    };
    let statuses = |bytes: Vec<u8>| move |id: u64| vec![(id, bytes.clone())];
    #[allow(clippy::type_complexity)]
    let cases: Vec<(&str, Duration, Box<dyn Fn(u64) -> Vec<(u64, Vec<u8>)>>)> = vec![
        ("a byte short", long, Box::new(statuses(vec![0, 0]))),
        (
            "a refusal tag",
            long,
            Box::new(refused(Refusal::OutOfRange, vec![])),
        ),
        (
            "a refusal tag with zeros",
            long,
            Box::new(refused(Refusal::AccessDenied, vec![0; 3])),
        ),
        ("unknown codes", long, Box::new(statuses(vec![0, 200, 11]))),
        ("known codes", long, Box::new(statuses(vec![9, 4, 5]))),
        (
            "another id's reply",
            short,
            Box::new(|id: u64| vec![(id ^ 0x5555, vec![0; 3])]),
        ),
        ("no reply", short, Box::new(|_| Vec::new())),
        ("an honest reply", long, Box::new(statuses(vec![0; 3]))),
        // Last: over `tcp;ofi_rxm` the provider closes the writer's
        // connection under a truncated reply, and its next send to this
        // owner fails (`FI_ENOTCONN`; `docs/ofi.md`, "Known defects").
        ("a byte long", long, Box::new(statuses(vec![0; 4]))),
    ];
    let mut outcomes = Vec::new();
    for (what, deadline, answer) in &cases {
        let task = setup.start_puts(&puts, *deadline);
        let (header, _) = setup.take_list();
        for (tag, bytes) in answer(header.request_id) {
            setup.reply(tag, bytes);
        }
        outcomes.push((*what, setup.answers(task)));
        // A late reply, or a second one: it must change nothing.
        setup.reply(header.request_id, vec![0; 3]);
    }
    setup.owner.progress_for(Duration::from_millis(50));
    setup.finish();
    let unknown = |result: &Result<(), RdmaError>, needle: &str| matches!(result, Err(RdmaError::Backend(text)) if text.contains(needle));
    for (what, results) in &outcomes {
        let expected_oks = match *what {
            "unknown codes" => 1,
            "an honest reply" => 3,
            _ => 0,
        };
        let oks = results.iter().filter(|result| result.is_ok()).count();
        assert_eq!(oks, expected_oks, "{provider:?}, {what}: {results:?}");
    }
    let outcome = |what: &str| &outcomes.iter().find(|(w, _)| *w == what).unwrap().1;
    for what in [
        "a byte short",
        "a byte long",
        "a refusal tag",
        "a refusal tag with zeros",
    ] {
        assert!(
            outcome(what)
                .iter()
                .all(|r| unknown(r, "outcome is unknown")),
            "{provider:?}, {what}: {:?}",
            outcome(what)
        );
    }
    for what in ["a refusal tag", "a refusal tag with zeros"] {
        assert!(
            outcome(what).iter().all(|r| unknown(r, "refusal tag")),
            "{provider:?}, {what}: {:?}",
            outcome(what)
        );
    }
    let codes = outcome("unknown codes");
    assert_eq!(codes[0], Ok(()));
    assert!(unknown(&codes[1], "code 200"), "{codes:?}");
    assert!(unknown(&codes[2], "code 11"), "{codes:?}");
    assert_eq!(
        outcome("known codes"),
        &vec![
            Err(RdmaError::AccessDenied { operation: "write" }),
            Err(RdmaError::RegionNotFound),
            Err(RdmaError::backend(BUSY_TEXT)),
        ]
    );
    for what in ["another id's reply", "no reply"] {
        assert_eq!(outcome(what), &vec![Err(RdmaError::Timeout); 3], "{what}");
    }
}

#[test]
fn hostile_list_replies_report_ok_only_for_status_0_over_tcp() {
    hostile_list_replies(Provider::Tcp);
}

#[test]
fn hostile_list_replies_report_ok_only_for_status_0_over_shm() {
    hostile_list_replies(Provider::Shm);
}

/// An unmap of a writer's source waits for a write list from it in
/// flight: the list's message is the engine's own copy, but each put holds
/// its source until it completes. Once the owner answers, every put
/// reports `Ok` and the unmap answers `Ok`, after the batch.
fn source_unmap_waits_for_a_list(provider: Provider) {
    let mut setup = HostileOwnerSetup::writer(provider.clone());
    let puts = side_by_side(4, 1024);
    let task = setup.start_puts(&puts, Duration::from_secs(10));
    let (header, _) = setup.take_list();
    let unmap = {
        let (w, id) = (setup.consumer.backend(), setup.dst_region.backend_region_id);
        setup.rt.spawn(async move { w.unmap(id).await })
    };
    setup.owner.progress_for(Duration::from_millis(300));
    let waited = !unmap.is_finished() && !task.is_finished();
    setup.reply(header.request_id, vec![0; puts.len()]);
    let results = setup.answers(task);
    let unmapped = setup.rt.block_on(async {
        tokio::time::timeout(Duration::from_secs(5), unmap)
            .await
            .map(|joined| joined.expect("the unmap task"))
    });
    setup.finish();
    assert!(
        waited,
        "{provider:?}: the unmap answered with the list in flight"
    );
    assert_eq!(results, vec![Ok(()); puts.len()]);
    assert_eq!(unmapped, Ok(Ok(())), "{provider:?}: the unmap answered");
}

#[test]
fn unmapping_the_source_waits_for_a_list_in_flight_over_tcp() {
    source_unmap_waits_for_a_list(Provider::Tcp);
}

#[test]
fn unmapping_the_source_waits_for_a_list_in_flight_over_shm() {
    source_unmap_waits_for_a_list(Provider::Shm);
}

/// A writer engine shut down with a write list in flight (its owner never
/// answers) answers every put of it `ShuttingDown` once its teardown
/// timeout passed, and releases its source; the owner's reply after that
/// changes nothing.
fn shutdown_answers_a_list_in_flight(provider: Provider) {
    let mut setup = HostileOwnerSetup::writer(provider.clone());
    let puts = side_by_side(5, 100);
    let task = setup.start_puts(&puts, Duration::from_secs(10));
    let (header, _) = setup.take_list();
    setup.consumer.shutdown_blocking();
    let results = setup.answers(task);
    let HostileOwnerSetup {
        mut owner,
        to_consumer,
        consumer,
        dst,
        ..
    } = setup;
    // The writer's endpoint is gone: the provider may refuse the reply.
    owner.try_send(to_consumer, header.request_id, vec![0; puts.len()]);
    let live = consumer.live_registrations();
    drop(owner);
    dst.free_after(live == 0);
    assert_eq!(
        results,
        vec![Err(RdmaError::ShuttingDown); puts.len()],
        "{provider:?}"
    );
    assert_eq!(live, 0);
}

#[test]
fn shutdown_answers_a_write_list_in_flight_over_tcp() {
    shutdown_answers_a_list_in_flight(Provider::Tcp);
}

#[test]
fn shutdown_answers_a_write_list_in_flight_over_shm() {
    shutdown_answers_a_list_in_flight(Provider::Shm);
}
