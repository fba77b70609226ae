//! The linked libfabric lists the providers the engine is tested over, with
//! the capabilities it needs: RMA reads on reliable datagram endpoints.

use std::ffi::{CStr, CString};
use std::ptr;

use rdmareg_ofi_sys as ffi;

/// `fi_getinfo` over RDM endpoints with RMA reads, optionally restricted to
/// one provider name; answers every `(provider, domain)` it lists.
fn rma_rdm_providers(provider: Option<&str>) -> Vec<(String, String)> {
    // SAFETY: fi_dupinfo(NULL) allocates a zeroed fi_info with its attribute
    // structs, as fi_allocinfo does; checked non-null below.
    let hints = unsafe { ffi::fi_dupinfo(ptr::null()) };
    assert!(!hints.is_null(), "fi_dupinfo(NULL) allocates hints");
    // SAFETY: `hints` and its attribute pointers come from fi_dupinfo and are
    // valid until fi_freeinfo; the provider name is strdup'ed because
    // fi_freeinfo frees it with free().
    unsafe {
        (*hints).caps = u64::from(ffi::FI_RMA | ffi::FI_READ | ffi::FI_REMOTE_READ);
        (*(*hints).ep_attr).type_ = ffi::FI_EP_RDM;
        (*(*hints).domain_attr).mr_mode = (ffi::FI_MR_LOCAL
            | ffi::FI_MR_VIRT_ADDR
            | ffi::FI_MR_ALLOCATED
            | ffi::FI_MR_PROV_KEY
            | ffi::FI_MR_ENDPOINT) as i32;
        if let Some(name) = provider {
            let name = CString::new(name).unwrap();
            (*(*hints).fabric_attr).prov_name = libc::strdup(name.as_ptr());
        }
    }
    let mut info: *mut ffi::fi_info = ptr::null_mut();
    // SAFETY: valid hints, an out-pointer to fill; node and service are null
    // (local addresses).
    let rc = unsafe {
        ffi::fi_getinfo(
            ffi::fi_version_of(1, 17),
            ptr::null(),
            ptr::null(),
            0,
            hints,
            &mut info,
        )
    };
    let mut found = Vec::new();
    let mut cursor = info;
    while !cursor.is_null() {
        // SAFETY: every entry of the list fi_getinfo returned is valid until
        // fi_freeinfo; the names are NUL-terminated C strings.
        unsafe {
            let prov = CStr::from_ptr((*(*cursor).fabric_attr).prov_name);
            let domain = CStr::from_ptr((*(*cursor).domain_attr).name);
            assert_ne!((*cursor).caps & u64::from(ffi::FI_RMA), 0);
            found.push((
                prov.to_string_lossy().into_owned(),
                domain.to_string_lossy().into_owned(),
            ));
            cursor = (*cursor).next;
        }
    }
    // SAFETY: both lists came from libfabric and are freed once.
    unsafe {
        if !info.is_null() {
            ffi::fi_freeinfo(info);
        }
        ffi::fi_freeinfo(hints);
    }
    if provider.is_some() {
        assert!(rc == 0 || found.is_empty(), "fi_getinfo answered {rc}");
    }
    found
}

#[test]
fn the_linked_libfabric_is_at_least_the_minimum_version() {
    // SAFETY: fi_version takes nothing and returns the runtime version.
    let version = unsafe { ffi::fi_version() };
    assert!(
        version >= ffi::fi_version_of(1, 17),
        "libfabric {}.{} is linked",
        version >> 16,
        version & 0xFFFF
    );
}

#[test]
fn tcp_with_ofi_rxm_serves_rma_reads_on_rdm_endpoints_over_loopback() {
    let found = rma_rdm_providers(Some("tcp"));
    assert!(
        found
            .iter()
            .any(|(prov, domain)| prov == "tcp;ofi_rxm" && domain == "lo"),
        "tcp;ofi_rxm on lo is not listed: {found:?}"
    );
}

#[test]
fn shm_serves_rma_reads_on_rdm_endpoints() {
    let found = rma_rdm_providers(Some("shm"));
    assert!(
        found.iter().any(|(prov, _)| prov == "shm"),
        "shm is not listed: {found:?}"
    );
}
