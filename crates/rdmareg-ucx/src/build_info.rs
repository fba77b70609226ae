//! What the linked UCX was built with, and the process's open-file limits.
//!
//! [`components`] lists the transport components and the memory domains
//! each finds here (what `ucx_info -d` lists first): a service proves its
//! UCX can drive InfiniBand or RoCE when `ib` and `rdmacm` are listed (with
//! no memory domain when no NIC is present). [`raise_open_file_limit`] runs
//! as every engine starts.

use std::ffi::CStr;
use std::os::raw::c_char;

use rdmareg_core::RdmaError;
use ucx_sys::uct;

use crate::status::check;

pub use rdmareg_engine::open_files::{
    OpenFileLimit, OpenFileLimitRaise, open_file_limit, raise_open_file_limit,
};

/// One UCT component: a transport family built into (or loaded by) UCX.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Component {
    /// The component's name (`tcp`, `self`, `sysv`, `posix`, `cma`, `ib`,
    /// `rdmacm`, …).
    pub name: String,
    /// The memory domains it found on this machine (`mlx5_0` for an mlx5
    /// NIC; empty for `ib` on a machine without one).
    pub memory_domains: Vec<String>,
}

/// Whether the linked UCX is the static build of `rdmareg-ucx-sys`'s
/// `vendored` feature.
pub fn vendored() -> bool {
    ucx_sys::VENDORED
}

/// The version string of the linked UCX library.
pub fn version() -> String {
    // SAFETY: ucp_get_version_string takes nothing and returns a pointer to a
    // static NUL-terminated string.
    let text = unsafe { ucx_sys::ucp_get_version_string() };
    if text.is_null() {
        return String::new();
    }
    // SAFETY: non-null, NUL-terminated and static, per the function above.
    unsafe { CStr::from_ptr(text) }
        .to_string_lossy()
        .into_owned()
}

/// The UCT components of the linked UCX, each with the memory domains it
/// finds on this machine.
///
/// # Errors
///
/// [`RdmaError::Backend`] with UCX's status text when UCX cannot list them.
pub fn components() -> Result<Vec<Component>, RdmaError> {
    let mut list: *mut uct::uct_component_h = std::ptr::null_mut();
    let mut count: std::os::raw::c_uint = 0;
    // SAFETY: both out-pointers are valid for a write; on success UCX hands
    // us a list of `count` handles that we release below.
    let status = unsafe { uct::uct_query_components(&mut list, &mut count) };
    check(status, "uct_query_components")?;
    let handles: Vec<uct::uct_component_h> = if list.is_null() {
        Vec::new()
    } else {
        // SAFETY: UCX returned `count` initialised handles at `list`, which
        // stays valid until uct_release_component_list below.
        unsafe { std::slice::from_raw_parts(list, count as usize) }.to_vec()
    };
    let result = handles.into_iter().map(query).collect();
    if !list.is_null() {
        // SAFETY: `list` came from uct_query_components and is released once;
        // the handles copied out are not used after this (they name static
        // components, but we keep none).
        unsafe { uct::uct_release_component_list(list) };
    }
    result
}

fn query(handle: uct::uct_component_h) -> Result<Component, RdmaError> {
    // SAFETY: all-zero is a valid uct_component_attr_t (integers, arrays
    // and a null pointer).
    let mut attr: uct::uct_component_attr_t = unsafe { std::mem::zeroed() };
    attr.field_mask =
        uct::UCT_COMPONENT_ATTR_FIELD_NAME | uct::UCT_COMPONENT_ATTR_FIELD_MD_RESOURCE_COUNT;
    // SAFETY: `handle` is a live component from uct_query_components and
    // `attr` is valid for writes; only the fields in the mask are written.
    let status = unsafe { uct::uct_component_query(handle, &mut attr) };
    check(status, "uct_component_query")?;
    let name = c_name(&attr.name);
    let mut domains = vec![
        uct::uct_md_resource_desc_t {
            md_name: [0; uct::UCT_MD_NAME_MAX]
        };
        attr.md_resource_count as usize
    ];
    if !domains.is_empty() {
        attr.field_mask = uct::UCT_COMPONENT_ATTR_FIELD_MD_RESOURCES;
        attr.md_resources = domains.as_mut_ptr();
        // SAFETY: `md_resources` points to room for exactly the count UCX
        // reported for this component a moment ago; the component's device
        // list is fixed after UCX's initialisation.
        let status = unsafe { uct::uct_component_query(handle, &mut attr) };
        check(status, "uct_component_query(md_resources)")?;
    }
    Ok(Component {
        name,
        memory_domains: domains.iter().map(|d| c_name(&d.md_name)).collect(),
    })
}

/// A fixed-size C name: up to its first NUL, or the whole array.
fn c_name(raw: &[c_char]) -> String {
    let bytes: Vec<u8> = raw
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names() -> Vec<String> {
        components()
            .expect("UCX lists its components")
            .into_iter()
            .map(|c| c.name)
            .collect()
    }

    #[test]
    fn every_ucx_build_lists_the_tcp_and_self_components() {
        let names = names();
        assert!(names.iter().any(|n| n == "tcp"), "{names:?}");
        assert!(names.iter().any(|n| n == "self"), "{names:?}");
    }

    #[test]
    fn the_self_component_finds_its_memory_domain() {
        let all = components().unwrap();
        let own = all.iter().find(|c| c.name == "self").unwrap();
        assert_eq!(own.memory_domains, vec!["self".to_string()], "{all:?}");
    }

    #[test]
    fn the_version_string_is_the_pinned_release_or_newer() {
        let version = version();
        let mut parts = version.split('.').map(|p| p.parse::<u32>().unwrap_or(0));
        let major_minor = (parts.next().unwrap_or(0), parts.next().unwrap_or(0));
        assert!(major_minor >= (1, 22), "{version}");
    }

    #[test]
    fn the_open_file_limit_reads_a_soft_limit_within_the_hard_one() {
        let limit = open_file_limit().unwrap();
        assert!(limit.soft > 0 && limit.soft <= limit.hard, "{limit:?}");
    }

    #[test]
    fn a_name_without_a_nul_is_read_whole() {
        let raw = [b'a' as c_char; 4];
        assert_eq!(c_name(&raw), "aaaa");
        let short = [b'i' as c_char, b'b' as c_char, 0, b'x' as c_char];
        assert_eq!(c_name(&short), "ib");
    }

    /// The `vendored` build was configured with verbs, mlx5 and rdmacm; its
    /// components are linked in statically, so they must all be listed
    /// (with no memory domain when the machine has no NIC).
    #[cfg(ucx_vendored)]
    #[test]
    fn the_vendored_build_carries_the_ib_rdmacm_and_cma_components() {
        assert!(vendored());
        let names = names();
        for wanted in ["ib", "rdmacm", "cma", "tcp", "posix", "sysv", "self"] {
            assert!(
                names.iter().any(|n| n == wanted),
                "{wanted} missing from {names:?}"
            );
        }
    }
}
