//! Descriptor leases on the one-sided read path (`fi_read`): a lease key is
//! owner-served there too, so the owner's engine, which posts its request
//! receives with its first lease, judges every read under it and refuses
//! it once the lease ended. The conformance kit's four lease checks run
//! here over tcp and shm; the rest of the kit does not hold on this path
//! (`rdmareg_ofi::ReadPath::OneSided`).

use crate::common;

use rdmareg_backend::conformance::{self, BackendPair};
use rdmareg_ofi::{Provider, ReadPath};

async fn tcp_pair() -> BackendPair {
    common::backend_pair_on(Provider::Tcp, ReadPath::OneSided)
}

async fn shm_pair() -> BackendPair {
    common::backend_pair_on(Provider::Shm, ReadPath::OneSided)
}

/// One test per lease check and provider, as `conformance_tests!` makes
/// them.
macro_rules! lease_checks {
    ($($name:ident: $factory:ident, $check:ident;)*) => {
        $(
            #[test]
            fn $name() {
                conformance::block_on(async {
                    let pair = $factory().await;
                    conformance::$check(&pair).await;
                    pair.teardown().await;
                });
            }
        )*
    };
}

lease_checks! {
    over_tcp_a_lease_serves_reads_until_its_expiry:
        tcp_pair, a_lease_serves_reads_until_its_expiry;
    over_tcp_a_lease_ends_when_its_reader_released_it:
        tcp_pair, a_lease_ends_when_its_reader_released_it;
    over_tcp_a_release_counts_once_and_only_for_its_lease:
        tcp_pair, a_release_counts_once_and_only_for_its_lease;
    over_tcp_leases_of_bad_terms_or_unmapped_regions_are_refused:
        tcp_pair, leases_of_bad_terms_or_unmapped_regions_are_refused;
    over_shm_a_lease_serves_reads_until_its_expiry:
        shm_pair, a_lease_serves_reads_until_its_expiry;
    over_shm_a_lease_ends_when_its_reader_released_it:
        shm_pair, a_lease_ends_when_its_reader_released_it;
    over_shm_a_release_counts_once_and_only_for_its_lease:
        shm_pair, a_release_counts_once_and_only_for_its_lease;
    over_shm_leases_of_bad_terms_or_unmapped_regions_are_refused:
        shm_pair, leases_of_bad_terms_or_unmapped_regions_are_refused;
}
