//! Writes the committed seed corpora under `fuzz/corpus/<target>/`: a few
//! valid inputs per fuzz target, produced by the real encoders so they stay
//! in step with the formats. Re-run after a format change:
//!
//! ```text
//! cargo run --manifest-path fuzz/Cargo.toml --example write_seeds
//! ```
//!
//! Existing files of the same name are overwritten; other files are left.

#[allow(dead_code)] // only the encoder is used here
#[path = "../../crates/rdmareg-cli/src/bootstrap.rs"]
mod bootstrap;

#[path = "../../crates/rdmareg-ucx/tests/packed_key_model/mod.rs"]
mod packed_key_model;

#[path = "../../crates/rdmareg-ucx/tests/worker_address_model/mod.rs"]
mod worker_address_model;

use std::collections::BTreeSet;
use std::path::Path;

use bootstrap::{Message, OfferedRange, Tally};
use bytes::{Bytes, BytesMut};
use packed_key_model::{format, full_key, real_keys};
use rdmareg_core::{Descriptor, MAX_PACKED_KEY_LEN};
use rdmareg_ucx::packed_key::validate_packed_key;
use rdmareg_ucx::{EngineAddress, ProcessIdentity};

fn main() -> std::io::Result<()> {
    let corpus = Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus");
    let keys = distinct_real_keys();

    let mut written = 0;
    for (target, seeds) in [
        ("descriptor_decode", descriptor_seeds(&keys)),
        ("packed_key_validate", packed_key_seeds(&keys)),
        ("ofi_packed_key", ofi_packed_key_seeds()),
        ("worker_address", worker_address_seeds()),
        ("read_protocol", read_protocol_seeds()),
        ("ofi_read_protocol", ofi_read_protocol_seeds()),
        ("bootstrap_message", bootstrap_seeds(&keys)),
        ("notice_message", notice_seeds()),
        ("lease_release", lease_seeds()),
    ] {
        let dir = corpus.join(target);
        std::fs::create_dir_all(&dir)?;
        for (name, bytes) in seeds {
            std::fs::write(dir.join(name), bytes)?;
            written += 1;
        }
    }
    eprintln!("wrote {written} seeds under {}", corpus.display());
    Ok(())
}

/// The fixture's keys without repeats (most settings pack the same 9 bytes),
/// each named after the first setting that produced it.
fn distinct_real_keys() -> Vec<(String, Vec<u8>)> {
    let mut seen = BTreeSet::new();
    real_keys()
        .into_iter()
        .filter(|key| seen.insert(key.bytes.clone()))
        .map(|key| (key.label.replace(['/', '.'], "_"), key.bytes))
        .collect()
}

fn descriptor(backend: &str, addr: u64, len: u64, generation: u64, key: &[u8]) -> Descriptor {
    Descriptor::new(backend, addr, len, generation, Bytes::copy_from_slice(key))
        .expect("seed descriptor is valid")
}

/// A key, a request and replies of each status, as the engine encodes them.
fn read_protocol_seeds() -> Vec<(String, Vec<u8>)> {
    use rdmareg_core::Access;
    use rdmareg_ucx::read_protocol::{
        ReadReply, ReadRequest, Refusal, ReplyStatus, SameHostKey, ServedKey,
    };
    let key = ServedKey {
        region_id: 42,
        capability: [0x5A; 16],
    };
    let request = ReadRequest {
        request_id: 7,
        key,
        address: 0x7f00_0000_1000,
        length: 4096,
    };
    let served = ReadReply {
        request_id: 7,
        status: ReplyStatus::Served,
        length: 4096,
    };
    let refused = ReadReply {
        request_id: 7,
        status: ReplyStatus::Refused(Refusal::OutOfRange),
        length: 0,
    };
    let same_host = |access| {
        SameHostKey {
            served: key,
            region_addr: 0x7f00_0000_0000,
            region_len: 1 << 20,
            release_slot: 3,
            access,
            ucx_key: vec![0; 9],
        }
        .encode()
        .expect("a UCX key of 9 bytes encodes")
    };
    vec![
        ("key".into(), key.encode().to_vec()),
        ("lease_key".into(), key.encode_lease().to_vec()),
        ("same_host_key".into(), same_host(Access::Read)),
        ("writable_same_host_key".into(), same_host(Access::ReadWrite)),
        ("request".into(), request.encode().to_vec()),
        ("reply_served".into(), served.encode().to_vec()),
        ("reply_refused".into(), refused.encode().to_vec()),
    ]
}

/// A single read request, a list request, and gathered replies (the reply
/// parser reads the input's first byte as the entry count).
/// Notices alone, and streams of them as `notice_message` reads its input:
/// a control byte (top two bits: 0 close, 1 pop, else send; low two bits:
/// the connection), then for a send a length byte and the message.
fn notice_seeds() -> Vec<(String, Vec<u8>)> {
    use rdmareg_engine::notices::wire::encode;
    let notice = |sequence, bytes: &[u8]| encode(7, sequence, bytes).expect("within the bound");
    let send = |connection: u8, message: Vec<u8>| {
        let mut out = vec![0x80 | connection, message.len() as u8];
        out.extend(message);
        out
    };
    const POP: u8 = 0x40;
    const CLOSE_0: u8 = 0x00;
    let stream = [
        send(0, notice(1, b"a")),
        send(1, notice(1, b"b")),
        send(0, notice(1, b"a")),
        vec![POP],
        send(0, notice(3, b"c")),
        vec![CLOSE_0],
        send(0, notice(1, b"d")),
        vec![POP, POP, POP],
    ]
    .concat();
    let mut flood: Vec<u8> = (1..12).flat_map(|n| send(2, notice(n, &[b'x'; 8]))).collect();
    flood.extend([POP; 4]);
    vec![
        ("one_notice".into(), notice(1, b"done")),
        ("empty_notice".into(), notice(7, b"")),
        ("stream".into(), stream),
        ("flood".into(), flood),
    ]
}

/// A release alone, and streams of lease events as `lease_release` reads
/// its input: a control byte (top three bits: 0 make, 1 time, 2-3
/// release with a second byte naming the lease, else read).
fn lease_seeds() -> Vec<(String, Vec<u8>)> {
    use rdmareg_engine::notices::wire::encode_release;
    const MAKE_TWO_READERS_4MS: u8 = 0x0D;
    const TIME_2MS: u8 = 0x22;
    const TIME_5MS: u8 = 0x25;
    const READ_0: u8 = 0xE0;
    let release = |reader: u8, lease: u8| vec![0x40 | reader, lease];
    let stream = [
        vec![MAKE_TWO_READERS_4MS, READ_0],
        release(0, 0),
        release(0, 0),
        vec![READ_0],
        release(1, 0),
        vec![READ_0, TIME_2MS],
        release(2, 0x80),
        vec![MAKE_TWO_READERS_4MS, TIME_5MS, 0xE1],
    ]
    .concat();
    vec![
        ("one_release".into(), encode_release(7, 1, 3, &[9; 16])),
        ("stream".into(), stream),
    ]
}

fn ofi_read_protocol_seeds() -> Vec<(String, Vec<u8>)> {
    use rdmareg_ofi::protocol::{ListEntry, ListRequest, ReadRequest, Refusal, refusal_code};
    let reply_to = b"fi_sockaddr_in://127.0.0.1:40000\0".to_vec();
    let single = ReadRequest {
        request_id: 7,
        region_id: 42,
        capability: [0x5A; 16],
        address: 0x7f00_0000_1000,
        length: 4096,
        reply_to: reply_to.clone(),
    };
    let list = ListRequest {
        request_id: 8,
        entries: (0..4)
            .map(|i| ListEntry {
                region_id: 42,
                capability: [0x5A; 16],
                address: 0x7f00_0000_1000 + 64 * i,
                length: 8,
            })
            .collect(),
        reply_to,
    };
    // Three entries asked for (count byte 2), of 1 + the next byte each:
    // statuses served, refused, served, then their bytes.
    let mut gathered = vec![2u8, 0, refusal_code(Refusal::OutOfRange), 0];
    gathered.extend(std::iter::repeat_n(0xAB, 2));
    vec![
        ("request".into(), single.encode()),
        ("list".into(), list.encode()),
        ("gathered_reply".into(), gathered),
    ]
}

fn descriptor_seeds(keys: &[(String, Vec<u8>)]) -> Vec<(String, Vec<u8>)> {
    let host_key = &keys[0].1;
    let mut seeds = Vec::new();
    for (label, key) in keys {
        let d = descriptor("ucx", 0x7f3a_2000_0000, 1 << 20, 1, key);
        seeds.push((format!("ucx_{label}"), d.encode().to_vec()));
    }
    let loopback = descriptor("loopback", 0x1000, 4096, 42, &7u64.to_le_bytes());
    seeds.push(("loopback_page".into(), loopback.encode().to_vec()));
    let largest = descriptor(
        "ucx",
        1,
        u64::MAX - 1,
        u64::MAX,
        &[0xA5; MAX_PACKED_KEY_LEN],
    );
    seeds.push(("largest_key_and_range".into(), largest.encode().to_vec()));

    // Two descriptors back to back, as several travel in one message.
    let mut pair = BytesMut::new();
    loopback.encode_into(&mut pair);
    descriptor("ucx", 0x5000, 10, 2, host_key).encode_into(&mut pair);
    seeds.push(("two_concatenated".into(), pair.to_vec()));

    // A descriptor followed by a slice request (offset, length).
    let mut sliced = descriptor("ucx", 0x10_0000, 65536, 3, host_key)
        .encode()
        .to_vec();
    sliced.extend_from_slice(&4096u64.to_le_bytes());
    sliced.extend_from_slice(&8192u64.to_le_bytes());
    seeds.push(("with_slice_request".into(), sliced));
    seeds
}

fn packed_key_seeds(keys: &[(String, Vec<u8>)]) -> Vec<(String, Vec<u8>)> {
    let mut seeds: Vec<_> = keys
        .iter()
        .map(|(label, key)| (format!("real_{label}"), key.clone()))
        .collect();
    seeds.push(("every_section".into(), full_key()));
    for (name, key) in &seeds {
        assert_eq!(validate_packed_key(&format(), key), Ok(()), "{name}");
    }
    seeds
}

/// libfabric keys as `rdmareg_ofi` writes them: owner-served over tcp (a
/// `sockaddr_in` owner) and shm (a string owner), a one-sided key with
/// virtual addresses, and a served key followed by two probe ranges.
fn ofi_packed_key_seeds() -> Vec<(String, Vec<u8>)> {
    use rdmareg_ofi::key::PackedKey;
    let mut sockaddr = vec![0u8; 16];
    // AF_INET (2), in the host's order as `sockaddr_in` stores it.
    sockaddr[..2].copy_from_slice(&2u16.to_ne_bytes());
    sockaddr[2..4].copy_from_slice(&40_000u16.to_be_bytes());
    sockaddr[4..8].copy_from_slice(&[127, 0, 0, 1]);
    let key = |owner_served: bool, virt_addr: bool, mr_key: u64, owner: &[u8]| PackedKey {
        owner_served,
        virt_addr,
        region_id: 7,
        capability: [0x3C; 16],
        mr_key,
        base: 0x7f00_0000_0000,
        len: 1 << 20,
        owner: Bytes::copy_from_slice(owner),
    };
    let tcp = key(true, false, 0, &sockaddr).encode().to_vec();
    let shm = key(true, false, 0, b"fi_shm://4242:0:1\0\0\0").encode().to_vec();
    let one_sided = key(false, true, 0x1234, &sockaddr).encode().to_vec();
    for (name, bytes) in [("tcp", &tcp), ("shm", &shm), ("one_sided", &one_sided)] {
        let decoded = PackedKey::decode(&Bytes::copy_from_slice(bytes)).expect(name);
        assert_eq!(decoded.encode().to_vec(), *bytes, "{name}");
    }
    let mut probed = tcp.clone();
    for (addr, len) in [(0x7f00_0000_0000u64 + 4096, 4096u64), (0x7f00_0010_0000 - 1, 2)] {
        probed.extend_from_slice(&addr.to_le_bytes());
        probed.extend_from_slice(&len.to_le_bytes());
    }
    vec![
        ("served_tcp".into(), tcp),
        ("served_shm".into(), shm),
        ("one_sided_virt".into(), one_sided),
        ("served_tcp_with_probes".into(), probed),
    ]
}

/// One real address per transport setting and address format (workers of
/// one context differ only in their UUID), plus both full layouts.
fn worker_address_seeds() -> Vec<(String, Vec<u8>)> {
    let mut seen = BTreeSet::new();
    let mut seeds: Vec<_> = worker_address_model::real_addresses()
        .into_iter()
        .filter(|address| address.label.ends_with("/w1"))
        .filter(|address| seen.insert(address.bytes.clone()))
        .map(|address| {
            let label = address.label.trim_end_matches("/w1").replace('/', "_");
            (format!("real_{label}"), address.bytes)
        })
        .collect();
    for version in [
        worker_address_model::Version::V1,
        worker_address_model::Version::V2,
    ] {
        seeds.push((
            format!("every_section_{version:?}").to_lowercase(),
            worker_address_model::full_spec(version).build(),
        ));
    }
    for (name, address) in &seeds {
        assert_eq!(
            worker_address_model::format().validate(address),
            Ok(()),
            "{name}"
        );
    }
    seeds.extend(engine_address_seeds(&seeds[0].1));
    seeds
}

/// Engine-address envelopes around a real UCP address, in each form a peer
/// may send: bare serving address, with a direct lane, with a process
/// identity naming a thread (version 3), and the older identities without
/// the thread (version 2) and without the token (version 1).
fn engine_address_seeds(address: &[u8]) -> Vec<(String, Vec<u8>)> {
    let address = Bytes::copy_from_slice(address);
    let serving_only = EngineAddress {
        serving: address.clone(),
        direct: None,
        process: None,
        release_table: None,
    };
    let with_direct = EngineAddress {
        direct: Some(address.clone()),
        ..serving_only.clone()
    };
    let with_process = EngineAddress {
        process: Some(ProcessIdentity {
            pid: 4242,
            pid_namespace: 0xEFFF_FFFC,
            boot_id: [0x5B; 16],
            token_addr: 0x7F00_0000_1000,
            token: [0xA7; 16],
            thread: Some(4243),
        }),
        ..with_direct.clone()
    };
    let encode = |envelope: &EngineAddress| envelope.encode().expect("encodes").to_vec();
    let version_three = encode(&with_process);
    // Version 2 carried the identity without the thread id.
    let mut version_two = version_three[..version_three.len() - 4].to_vec();
    version_two[2] = 2;
    // Version 1 carried it without the token's address and bytes either.
    let mut version_one = version_two[..version_two.len() - 24].to_vec();
    version_one[2] = 1;
    let seeds = vec![
        ("envelope_serving_only".to_string(), encode(&serving_only)),
        ("envelope_direct".to_string(), encode(&with_direct)),
        ("envelope_process_v3".to_string(), version_three),
        ("envelope_process_v2".to_string(), version_two),
        ("envelope_process_v1".to_string(), version_one),
    ];
    for (name, bytes) in &seeds {
        assert!(EngineAddress::decode(bytes).is_ok(), "{name}");
    }
    seeds
}

fn bootstrap_seeds(keys: &[(String, Vec<u8>)]) -> Vec<(String, Vec<u8>)> {
    let ranges = keys
        .iter()
        .enumerate()
        .map(|(i, (_, key))| OfferedRange {
            descriptor: descriptor("ucx", 0x7f3a_2000_0000, 4096, i as u64, key),
            crc32: 0xCBF4_3926,
        })
        .collect();
    let messages = [
        (
            "offer",
            Message::Offer {
                worker_address: Bytes::from_static(&[0x5A; 48]),
                ranges,
            },
        ),
        (
            "offer_empty",
            Message::Offer {
                worker_address: Bytes::from_static(&[0x5A; 48]),
                ranges: Vec::new(),
            },
        ),
        (
            "done_verified",
            Message::Done {
                verified: true,
                tally: Tally {
                    read: 16,
                    verified: 16,
                },
            },
        ),
        (
            "done_failed",
            Message::Done {
                verified: false,
                tally: Tally {
                    read: 3,
                    verified: 2,
                },
            },
        ),
        (
            "alive",
            Message::Alive {
                tally: Tally {
                    read: 5,
                    verified: 5,
                },
            },
        ),
        (
            "owner_shut_down_clean",
            Message::OwnerShutDown {
                live_registrations: Some(0),
            },
        ),
        (
            "owner_shut_down_unknown",
            Message::OwnerShutDown {
                live_registrations: None,
            },
        ),
    ];
    let mut seeds: Vec<(String, Vec<u8>)> = messages
        .into_iter()
        .map(|(name, message)| {
            // Seeds are frame bodies: the target fuzzes the decoder, which
            // runs after the length prefix was read.
            let frame = message.encode().expect(name);
            let body = frame[4..].to_vec();
            assert_eq!(Message::decode(&body).expect(name), message);
            (name.to_owned(), body)
        })
        .collect();
    // An offer as a service writes it, with names for labels and one
    // region unlabelled (the CLI refuses it: its labels are checksums).
    let named = rdmareg::Offer::new(
        Bytes::from_static(&[0x5A; 48]),
        keys.iter().enumerate().map(|(i, (name, key))| {
            let descriptor = descriptor("ucx", 0x7f3a_2000_0000, 4096, i as u64, key);
            rdmareg::OfferedRegion::new(if i == 0 { String::new() } else { name.clone() }, descriptor)
        }),
    );
    let frame = named.encode().expect("offer_named");
    let body = frame[4..].to_vec();
    assert_eq!(rdmareg::Offer::decode(&body).expect("offer_named"), named);
    seeds.push(("offer_named".to_owned(), body));
    seeds
}
