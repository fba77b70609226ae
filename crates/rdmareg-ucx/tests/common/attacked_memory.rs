//! What a raw peer's attack on an owner engine aims at: a registered
//! [`pattern`] buffer and one of the same bytes the owner never
//! registered, both of which must still hold those bytes afterwards; and
//! how such a test ends: the owner still serves its real consumer, then
//! both engines shut down with nothing registered.

#![allow(dead_code)] // Each test binary uses its own subset.

use rdmareg_core::BackendRegion;
use rdmareg_ucx::{Transport, UcxEngine};

use super::{OWNER, PageBuf, SeamForTestMemory, describe, get_request, map, pattern};

/// The memory of an owner engine an attack aims at.
///
/// The buffers live as long as this value, which ends only after both
/// engines shut down
/// ([`AttackedMemory::assert_owner_still_serves_then_shut_down`]), so the
/// registered one outlives its registration.
pub struct AttackedMemory {
    /// Mapped by the owner as [`AttackedMemory::region`].
    pub registered: PageBuf,
    /// Never mapped.
    pub unregistered: PageBuf,
    pub region: BackendRegion,
    /// What both buffers hold, and must still hold after the attack.
    pub want: Vec<u8>,
}

impl AttackedMemory {
    /// Two buffers of `len` [`pattern`] bytes, the first mapped on `owner`.
    pub async fn map_on(owner: &UcxEngine, len: usize) -> AttackedMemory {
        let ob = owner.backend();
        let registered = PageBuf::filled(len, pattern);
        let unregistered = PageBuf::filled(len, pattern);
        let region = map(&ob, &registered).await;
        let want = PageBuf::filled(len, pattern).snapshot();
        AttackedMemory {
            registered,
            unregistered,
            region,
            want,
        }
    }

    /// The end of an attack test: `consumer` (whose peer [`OWNER`] is
    /// `owner`) still reads the registered buffer and gets
    /// [`AttackedMemory::want`]; then both engines shut down and the owner holds
    /// no registration.
    pub async fn assert_owner_still_serves_then_shut_down(
        self,
        owner: UcxEngine,
        consumer: UcxEngine,
        transport: &Transport,
    ) {
        let cb = consumer.backend();
        let dst = PageBuf::zeroed(self.registered.len());
        let dst_region = map(&cb, &dst).await;
        let request = get_request(
            OWNER,
            &describe(&self.registered, &self.region),
            &dst_region,
            0,
            None,
        );
        assert_eq!(
            cb.get_into_test_memory(request).await,
            Ok(()),
            "{transport:?}"
        );
        assert!(
            dst.snapshot() == self.want,
            "{transport:?}: the read's bytes differ"
        );
        consumer.shutdown().await;
        owner.shutdown().await;
        assert_eq!(owner.live_registrations(), Some(0));
    }
}
