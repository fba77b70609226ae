//! How a PUT is cut into writes on the wire: over an endpoint whose active
//! messages go over tcp (tcp alone, or beside cma), a PUT longer than
//! 256 KiB and at most 4 MiB goes in chunks of 60 KiB, each arriving in one
//! tcp fragment; shorter and longer PUTs, and PUTs of a writer whose
//! operator set UCX's tcp segment sizes, go in chunks of at most 1 MiB.
//!
//! What these hold the writer to, seen by a raw owner: the chunks cover
//! the PUT exactly once, in order, each at its place in the target and
//! carrying the source bytes of that place, and the PUT answers `Ok` once
//! every chunk was acknowledged. (That chunked PUTs land exactly through
//! real owners: `tests/tests/registry/writes.rs`.)

use crate::common;

use common::raw_put::{RAW_KEY, RAW_TARGET, RawPut, ReceivedWrite};
use common::write_lists::*;
use common::*;
use rdmareg_backend::RdmaBackend;
use rdmareg_core::Access;
use rdmareg_ucx::{Transport, UcxConfig, UcxEngine};

const KIB: usize = 1024;
const MIB: usize = 1024 * KIB;
/// The chunk a PUT is cut in over tcp: one fragment of 64 KiB segments.
const FRAGMENT_CHUNK: usize = 60 * KIB;
/// The chunk of every other PUT.
const WHOLE_CHUNK: usize = MIB;

/// A writer engine of `config` puts `len` bytes to a raw owner, which
/// takes every write that arrives and acknowledges it; returns the writes
/// in arrival order and the PUT's source. The PUT must answer `Ok`.
fn put_to_a_raw_owner(config: UcxConfig, len: usize) -> (Vec<ReceivedWrite>, Vec<u8>) {
    let mut put = RawPut::start(config, len, None);
    for received in &put.received {
        let write = &received.write;
        assert_eq!((write.region, write.capability), RAW_KEY);
    }
    (0..put.received.len()).for_each(|index| put.acknowledge(index));
    let answers = put.answers();
    assert_eq!(answers, [Ok(())], "the PUT answers once every chunk did");
    let source = put.source();
    let received = std::mem::take(&mut put.received);
    put.finish();
    (received, source)
}

/// Checks `received` covers the PUT of `source` exactly once, in order,
/// each write at most `longest` bytes and carrying the source bytes of
/// its place; returns the writes' lengths.
fn assert_covers(received: &[ReceivedWrite], source: &[u8], longest: usize) -> Vec<usize> {
    let mut next = 0;
    let mut lens = Vec::new();
    for (i, got) in received.iter().enumerate() {
        assert_eq!(
            got.write.address,
            RAW_TARGET + next as u64,
            "write {i}: its place"
        );
        let len = got.payload.len();
        assert!(len > 0 && len <= longest, "write {i}: {len} B");
        assert_eq!(
            differences(&got.payload, &source[next..next + len]),
            None,
            "write {i}: the source's bytes at its place"
        );
        next += len;
        lens.push(len);
    }
    assert_eq!(next, source.len(), "nothing left out, nothing twice");
    lens
}

/// A 1 MiB PUT over tcp arrives as seventeen writes of 60 KiB and one of
/// the remaining 4 KiB, each within one fragment, in order.
#[test]
fn a_1_mib_put_over_tcp_goes_in_fragment_sized_chunks() {
    let (received, source) = put_to_a_raw_owner(config(Transport::Tcp), MIB);
    let lens = assert_covers(&received, &source, FRAGMENT_CHUNK);
    assert_eq!(lens.len(), 18, "{lens:?}");
    assert!(lens[..17].iter().all(|&len| len == FRAGMENT_CHUNK));
    assert_eq!(lens[17], 4 * KIB);
}

/// The cut's bounds: a PUT of just over 256 KiB is cut, one of 256 KiB is
/// not; one of 4 MiB is cut, one just over goes in 1 MiB chunks.
#[test]
fn only_puts_over_256_kib_up_to_4_mib_are_cut_by_fragment() {
    for (len, cut) in [
        (256 * KIB, false),
        (256 * KIB + 1, true),
        (4 * MIB, true),
        (4 * MIB + 1, false),
    ] {
        let (received, source) = put_to_a_raw_owner(config(Transport::Tcp), len);
        let longest = if cut { FRAGMENT_CHUNK } else { WHOLE_CHUNK };
        let lens = assert_covers(&received, &source, longest);
        assert_eq!(lens.len(), len.div_ceil(longest), "{len} B: {lens:?}");
    }
}

/// A writer whose operator set UCX's tcp segment size keeps its PUTs in
/// 1 MiB chunks: the fragment size the cut is made for is not its own.
#[test]
fn a_writer_with_its_own_segment_size_keeps_whole_chunks() {
    let shaped = config(Transport::Tcp).with_ucx_setting("TCP_TX_SEG_SIZE", "32K");
    let (received, source) = put_to_a_raw_owner(shaped, MIB);
    let lens = assert_covers(&received, &source, WHOLE_CHUNK);
    assert_eq!(lens, [MIB]);
}

/// A writer engine of `transport` puts `len` bytes into a registration of
/// an owner engine of the same transport, at odd offsets of both, with
/// the owner's served key (so the PUT goes through the owner on every
/// transport); returns how many of its PUTs the writer cut into fragment
/// chunks. The PUT must answer `Ok`, its bytes land exactly where it was
/// aimed and nowhere else.
fn put_to_a_real_owner(transport: Transport, len: usize) -> u64 {
    init_tracing();
    let rt = runtime();
    let owner = UcxEngine::start(config(transport.clone())).expect("owner starts");
    let writer = UcxEngine::start(config(transport)).expect("writer starts");
    writer.add_peer(OWNER, owner.worker_address()).unwrap();
    let (ob, wb) = (owner.backend(), writer.backend());
    let target = PageBuf::zeroed(len + 2 * 4096);
    let part = rt.block_on(map_part(&ob, &target, 0, len + 2 * 4096, Access::Write));
    let src = PageBuf::filled(len + 7, pattern);
    let src_region = rt.block_on(map(&wb, &src));
    let at = 4096 + 11;
    let put = put_of(
        OWNER,
        &src_region,
        7,
        part.start + at as u64,
        &part.packed,
        len,
    );
    let answers = rt.block_on(put_batch(&wb, vec![put]));
    assert_eq!(answers, [Ok(())]);
    let (got, source) = (target.snapshot(), src.snapshot());
    let mut want = vec![0u8; got.len()];
    want[at..at + len].copy_from_slice(&source[7..7 + len]);
    assert_eq!(
        differences(&got, &want),
        None,
        "the bytes where aimed, only there"
    );
    let cut = writer.puts_sent_in_chunks();
    assert_eq!(rt.block_on(wb.unmap(src_region.backend_region_id)), Ok(()));
    assert_eq!(rt.block_on(ob.unmap(part.id)), Ok(()));
    rt.block_on(writer.shutdown());
    rt.block_on(owner.shutdown());
    cut
}

/// Between two engines on the same host, whose endpoints pair tcp with
/// cma (which carries no active messages), a served 1 MiB PUT is cut as
/// over tcp and lands exactly; so does one over tcp.
#[test]
fn served_puts_between_engines_are_cut_on_both_transports() {
    for transport in [Transport::Tcp, Transport::SameHost] {
        let cut = put_to_a_real_owner(transport.clone(), MIB + 3);
        assert_eq!(cut, 1, "{transport:?}");
    }
}

/// A served PUT of 256 KiB is not cut, and lands exactly.
#[test]
fn a_256_kib_served_put_is_not_cut() {
    assert_eq!(put_to_a_real_owner(Transport::Tcp, 256 * KIB), 0);
}
