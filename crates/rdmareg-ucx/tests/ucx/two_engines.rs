//! Two engines in one process: an owner registers memory and describes it,
//! a consumer GETs it through the descriptor, over each transport.

use crate::common;

use common::*;
use rdmareg_backend::RdmaBackend;
use rdmareg_core::Descriptor;
use rdmareg_ucx::Transport;

/// Maps a source of `src_len` bytes on the owner and a destination of
/// `dst_len` on the consumer, GETs `[src_off, src_off + len)` to `dst_off`
/// through an encoded-then-decoded descriptor, and checks every byte of the
/// destination.
async fn get_and_verify(
    transport: Transport,
    src_len: usize,
    src_off: usize,
    dst_len: usize,
    dst_off: usize,
    len: usize,
) {
    let (owner, consumer) = engines(transport);
    let (ob, cb) = (owner.backend(), consumer.backend());
    let src = PageBuf::filled(src_len, pattern);
    let dst = PageBuf::zeroed(dst_len);
    let src_region = map(&ob, &src).await;
    let dst_region = map(&cb, &dst).await;

    let wire = describe(&src, &src_region).encode();
    let received = Descriptor::decode(&wire).expect("descriptor decodes");
    let part = received.slice(src_off as u64, len as u64).expect("slice");
    let request = get_request(OWNER, &part, &dst_region, dst_off as u64, None);
    assert_eq!(cb.get_into_test_memory(request).await, Ok(()));

    let got = dst.snapshot();
    let want = src.snapshot();
    assert!(
        got[..dst_off].iter().all(|&b| b == 0),
        "bytes before the destination range untouched"
    );
    assert!(
        got[dst_off + len..].iter().all(|&b| b == 0),
        "bytes after the destination range untouched"
    );
    assert!(
        got[dst_off..dst_off + len] == want[src_off..src_off + len],
        "copied bytes match the source"
    );

    assert_eq!(cb.unmap(dst_region.backend_region_id).await, Ok(()));
    assert_eq!(ob.unmap(src_region.backend_region_id).await, Ok(()));
    assert_eq!(consumer.live_registrations(), Some(0));
    assert_eq!(owner.live_registrations(), Some(0));
    consumer.shutdown().await;
    owner.shutdown().await;
}

const KIB: usize = 1024;
const MIB: usize = 1024 * 1024;

macro_rules! sizes_over {
    ($module:ident, $transport:expr) => {
        mod $module {
            use super::*;

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn one_byte_arrives() {
                get_and_verify($transport, 4 * KIB, 0, 4 * KIB, 0, 1).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn unaligned_offsets_on_both_sides_arrive() {
                get_and_verify($transport, 8 * KIB, 13, 8 * KIB, 4095, 3001).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn four_kib_arrive() {
                get_and_verify($transport, 4 * KIB, 0, 4 * KIB, 0, 4 * KIB).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn one_mib_arrives() {
                get_and_verify($transport, MIB, 0, MIB, 0, MIB).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn sixty_four_mib_arrive() {
                get_and_verify($transport, 64 * MIB, 0, 64 * MIB, 0, 64 * MIB).await;
            }
        }
    };
}

sizes_over!(over_tcp, Transport::Tcp);
sizes_over!(over_same_host, Transport::SameHost);
sizes_over!(
    over_shared_memory_without_error_handling,
    Transport::SharedMemoryNoErrorHandling
);
