//! The part of UCT's API (`uct/api/uct.h`) that lists the transport
//! components a UCX build carries and the memory domains each one finds on
//! this machine — what `ucx_info -d` starts from. Written by hand (the
//! generated bindings cover `ucp.h` only); the layouts are 1.22's, checked
//! by the size assertions below.
//!
//! A component is in the list when its code is in the process: built into
//! the static library (the `vendored` feature), or a module the shared
//! library loaded from its `ucx/` directory. A component with no memory
//! domain is built but found no device (`ib` on a machine without an
//! InfiniBand or RoCE NIC).

use std::os::raw::{c_char, c_uint};

use crate::ucs_status_t;

/// `UCT_COMPONENT_NAME_MAX`.
pub const UCT_COMPONENT_NAME_MAX: usize = 16;
/// `UCT_MD_NAME_MAX`.
pub const UCT_MD_NAME_MAX: usize = 16;

/// `UCT_COMPONENT_ATTR_FIELD_NAME`.
pub const UCT_COMPONENT_ATTR_FIELD_NAME: u64 = 1 << 0;
/// `UCT_COMPONENT_ATTR_FIELD_MD_RESOURCE_COUNT`.
pub const UCT_COMPONENT_ATTR_FIELD_MD_RESOURCE_COUNT: u64 = 1 << 1;
/// `UCT_COMPONENT_ATTR_FIELD_MD_RESOURCES`.
pub const UCT_COMPONENT_ATTR_FIELD_MD_RESOURCES: u64 = 1 << 2;

/// `uct_component_h`: an opaque component handle.
#[repr(C)]
pub struct uct_component {
    _opaque: [u8; 0],
}

/// `uct_component_h`.
pub type uct_component_h = *mut uct_component;

/// `uct_md_resource_desc_t`: one memory domain a component found.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct uct_md_resource_desc_t {
    /// The memory domain's name, NUL-terminated.
    pub md_name: [c_char; UCT_MD_NAME_MAX],
}

/// `uct_component_attr_t`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct uct_component_attr_t {
    /// Which fields to fill (`UCT_COMPONENT_ATTR_FIELD_*`).
    pub field_mask: u64,
    /// The component's name, NUL-terminated.
    pub name: [c_char; UCT_COMPONENT_NAME_MAX],
    /// How many memory domains the component found.
    pub md_resource_count: c_uint,
    /// Caller-allocated room for `md_resource_count` entries.
    pub md_resources: *mut uct_md_resource_desc_t,
    /// `UCT_COMPONENT_FLAG_*`.
    pub flags: u64,
}

const _: () = assert!(std::mem::size_of::<uct_md_resource_desc_t>() == 16);
const _: () = assert!(std::mem::size_of::<uct_component_attr_t>() == 48);
const _: () = assert!(std::mem::offset_of!(uct_component_attr_t, md_resources) == 32);

unsafe extern "C" {
    /// Lists the components; release the list with
    /// [`uct_release_component_list`].
    pub fn uct_query_components(
        components_p: *mut *mut uct_component_h,
        num_components_p: *mut c_uint,
    ) -> ucs_status_t;

    /// Releases a list from [`uct_query_components`].
    pub fn uct_release_component_list(components: *mut uct_component_h);

    /// Fills the fields of `component_attr` its `field_mask` asks for.
    pub fn uct_component_query(
        component: uct_component_h,
        component_attr: *mut uct_component_attr_t,
    ) -> ucs_status_t;
}
