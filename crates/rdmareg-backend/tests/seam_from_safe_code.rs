//! The seam as safe code sees it: `RdmaBackend::map` takes an address and a
//! length, `get` names its destination by region id, and both are safe
//! methods. Whatever the registry does on top, safe code calling the seam
//! directly must not make a backend write memory that safe code owns.

mod common;

use std::time::Duration;

use rdmareg_backend::{BackendGet, RdmaBackend};

use common::{OWNER, pair};

/// A `Vec` is mapped through the consumer's backend and a GET lands in it:
/// the backend writes bytes the `Vec` owns while safe code can hold `&mut`
/// to them. A sound seam makes this take `unsafe`, so with safe code only
/// the `Vec` must keep its bytes.
#[tokio::test]
#[ignore = "known defect: RdmaBackend::map and ::get are safe methods, so safe code can register memory it does not own and have a backend write it; the fix is making the seam's map/get/get_batch `unsafe fn` (every backend, the kit and their tests follow)"]
async fn safe_code_cannot_make_a_backend_write_into_a_vec_it_owns() {
    let (_fabric, owner, consumer) = pair();
    let source = vec![0xABu8; 4096];
    let mut target = vec![0u8; 4096];
    let s = owner
        .map(source.as_ptr() as usize, source.len())
        .await
        .expect("map of the source");
    let d = consumer.map(target.as_ptr() as usize, target.len()).await;
    let landed = match &d {
        Ok(d) => consumer
            .get(BackendGet {
                peer: OWNER,
                remote_addr: source.as_ptr() as u64,
                packed_key: s.packed_key.clone(),
                local_region_id: d.backend_region_id,
                local_offset: 0,
                len: 4096,
                deadline: Some(Duration::from_secs(5)),
            })
            .await
            .is_ok(),
        Err(_) => false,
    };
    // Safe code writes its own Vec: legal whatever the backend holds.
    target[0] = 1;
    let foreign = target[1..].iter().filter(|&&b| b != 0).count();
    if let Ok(d) = &d {
        assert_eq!(consumer.unmap(d.backend_region_id).await, Ok(()));
    }
    assert_eq!(owner.unmap(s.backend_region_id).await, Ok(()));
    assert!(
        !landed && foreign == 0,
        "a backend wrote {foreign} bytes of a Vec owned by safe code (get landed: {landed})"
    );
}
