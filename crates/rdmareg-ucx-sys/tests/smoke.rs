//! Smoke tests of the bindings against the UCX they link: the library loads
//! (through the run path, with no `LD_LIBRARY_PATH`), reports the version the
//! headers declare, and the declared structs and constants drive a real
//! context, worker, registration and GET over `UCX_TLS=tcp` on loopback.
//!
//! UCX is configured through `ucp_config_modify`, never the process
//! environment, so the tests cannot disturb each other.

use std::ffi::{CStr, CString, c_void};
use std::ptr;
use std::time::{Duration, Instant};

use ucx_sys::*;

/// Fails the test with UCX's own words unless `status` is `UCS_OK`.
fn expect_ok(status: ucs_status_t, what: &str) {
    assert_eq!(status, UCS_OK, "{what}: {}", status_string(status));
}

fn status_string(status: ucs_status_t) -> String {
    // SAFETY: `ucs_status_string` accepts any status value and returns a
    // pointer to a static NUL-terminated string.
    let text = unsafe { CStr::from_ptr(ucs_status_string(status)) };
    text.to_string_lossy().into_owned()
}

fn linked_version() -> (u32, u32, u32) {
    let (mut major, mut minor, mut release) = (0, 0, 0);
    // SAFETY: the three out-pointers are valid, distinct `c_uint` locals.
    unsafe { ucp_get_version(&mut major, &mut minor, &mut release) };
    (major, minor, release)
}

/// A configuration read from UCX defaults and the environment, released on drop.
struct Config(*mut ucp_config_t);

impl Config {
    fn read() -> Config {
        let mut config = ptr::null_mut();
        // SAFETY: null prefix and file name ask for the defaults; `config`
        // is a valid out-pointer.
        expect_ok(
            unsafe { ucp_config_read(ptr::null(), ptr::null(), &mut config) },
            "ucp_config_read",
        );
        Config(config)
    }

    fn set(&self, name: &str, value: &str) -> ucs_status_t {
        let (name, value) = (CString::new(name).unwrap(), CString::new(value).unwrap());
        // SAFETY: `self.0` is a live configuration; both strings are
        // NUL-terminated and outlive the call, which copies them.
        unsafe { ucp_config_modify(self.0, name.as_ptr(), value.as_ptr()) }
    }
}

impl Drop for Config {
    fn drop(&mut self) {
        // SAFETY: `self.0` came from `ucp_config_read` and is released once.
        unsafe { ucp_config_release(self.0) };
    }
}

/// A context and one single-threaded worker over tcp on loopback, with
/// memory hooks and the registration cache off; destroyed on drop.
struct Node {
    context: ucp_context_h,
    worker: ucp_worker_h,
}

impl Node {
    fn over_tcp() -> Node {
        let config = Config::read();
        for (name, value) in [
            ("TLS", "tcp"),
            ("NET_DEVICES", "lo"),
            ("MEM_EVENTS", "n"),
            ("RCACHE_ENABLE", "n"),
        ] {
            expect_ok(
                config.set(name, value),
                &format!("ucp_config_modify {name}={value}"),
            );
        }
        let params = ucp_params_t {
            field_mask: UCP_PARAM_FIELD_FEATURES as u64,
            features: (UCP_FEATURE_RMA | UCP_FEATURE_WAKEUP) as u64,
            ..Default::default()
        };
        let mut context = ptr::null_mut();
        // SAFETY: `params` is initialised, `config` is live for the call and
        // `context` is a valid out-pointer.
        expect_ok(
            unsafe { ucp_init(&params, config.0, &mut context) },
            "ucp_init",
        );

        let worker_params = ucp_worker_params_t {
            field_mask: UCP_WORKER_PARAM_FIELD_THREAD_MODE as u64,
            thread_mode: UCS_THREAD_MODE_SINGLE,
            ..Default::default()
        };
        let mut worker = ptr::null_mut();
        // SAFETY: `context` was just created; `worker_params` is initialised
        // and `worker` is a valid out-pointer.
        let status = unsafe { ucp_worker_create(context, &worker_params, &mut worker) };
        if status != UCS_OK {
            // SAFETY: `context` is live and owns nothing yet.
            unsafe { ucp_cleanup(context) };
        }
        expect_ok(status, "ucp_worker_create");
        Node { context, worker }
    }

    /// Progresses the worker until `request` completes, returning its status.
    fn wait(&self, request: ucs_status_ptr_t, what: &str) -> ucs_status_t {
        if !UCS_PTR_IS_PTR(request) {
            return UCS_PTR_STATUS(request);
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            // SAFETY: `self.worker` is live and used only by this thread.
            unsafe { ucp_worker_progress(self.worker) };
            // SAFETY: `request` is a live request not yet freed.
            let status = unsafe { ucp_request_check_status(request) };
            if status != UCS_INPROGRESS {
                // SAFETY: the request completed and is freed exactly once.
                unsafe { ucp_request_free(request) };
                return status;
            }
            assert!(Instant::now() < deadline, "{what} did not complete in 10 s");
        }
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        // SAFETY: both handles are live; everything created on the worker
        // was released by the test before the node is dropped.
        unsafe {
            ucp_worker_destroy(self.worker);
            ucp_cleanup(self.context);
        }
    }
}

mod version {
    use super::*;

    #[test]
    fn the_linked_library_is_the_version_the_build_found() {
        let (major, minor, _) = linked_version();
        assert_eq!(format!("{major}.{minor}"), ucx_sys::install::API_VERSION);
        assert!(
            (major, minor) >= (1, 22),
            "UCX {major}.{minor} is older than 1.22"
        );
    }

    #[test]
    fn the_linked_library_is_at_least_the_api_the_bindings_were_generated_from() {
        let (major, minor, _) = linked_version();
        assert_eq!(major, UCP_API_MAJOR);
        assert!(
            minor >= UCP_API_MINOR,
            "UCX {major}.{minor} is older than the bindings' API"
        );
    }

    #[test]
    fn the_version_string_matches_the_numeric_version() {
        let (major, minor, release) = linked_version();
        // SAFETY: returns a pointer to a static NUL-terminated string.
        let text = unsafe { CStr::from_ptr(ucp_get_version_string()) };
        assert_eq!(text.to_str().unwrap(), format!("{major}.{minor}.{release}"));
    }

    // The vendored static build makes no tools.
    #[cfg(not(ucx_vendored))]
    #[test]
    fn ucx_info_run_through_install_reports_the_same_library() {
        let (major, minor, release) = linked_version();
        let output = ucx_sys::install::tool_command("ucx_info")
            .arg("-v")
            .output()
            .unwrap();
        assert!(output.status.success(), "ucx_info -v failed: {output:?}");
        let stdout = String::from_utf8_lossy(&output.stdout);
        let expected = format!("Library version: {major}.{minor}.{release}");
        assert!(stdout.contains(&expected), "{expected:?} not in {stdout}");
    }
}

mod config {
    use super::*;

    #[test]
    fn the_settings_the_engine_uses_are_accepted_by_name_without_prefix() {
        let config = Config::read();
        for (name, value) in [
            ("TLS", "tcp"),
            ("NET_DEVICES", "lo"),
            ("MEM_EVENTS", "n"),
            ("RCACHE_ENABLE", "n"),
        ] {
            expect_ok(config.set(name, value), &format!("{name}={value}"));
        }
    }

    #[test]
    fn an_unknown_setting_is_refused_with_an_error_status() {
        let config = Config::read();
        let status = config.set("NO_SUCH_SETTING", "1");
        assert!(UCS_STATUS_IS_ERR(status), "status {status}");
        assert!(!status_string(status).is_empty());
    }
}

mod lifecycle {
    use super::*;

    #[test]
    fn a_tcp_context_and_worker_are_created_queried_and_destroyed() {
        let node = Node::over_tcp();

        let mut attr = ucp_worker_attr_t {
            field_mask: UCP_WORKER_ATTR_FIELD_THREAD_MODE as u64,
            ..Default::default()
        };
        // SAFETY: the worker is live; `attr` is initialised with its mask.
        expect_ok(
            unsafe { ucp_worker_query(node.worker, &mut attr) },
            "ucp_worker_query",
        );
        assert_eq!(attr.thread_mode, UCS_THREAD_MODE_SINGLE);

        let mut address = ptr::null_mut();
        let mut length = 0;
        // SAFETY: the worker is live; both out-pointers are valid locals.
        expect_ok(
            unsafe { ucp_worker_get_address(node.worker, &mut address, &mut length) },
            "ucp_worker_get_address",
        );
        assert!(!address.is_null() && length > 0);
        // SAFETY: `address` came from `ucp_worker_get_address` on this worker.
        unsafe { ucp_worker_release_address(node.worker, address) };
    }

    #[test]
    fn a_signalled_worker_has_an_event_fd_and_refuses_to_arm_until_progressed() {
        let node = Node::over_tcp();
        let mut fd = -1;
        // SAFETY: the worker is live and the context has the wake-up feature.
        expect_ok(
            unsafe { ucp_worker_get_efd(node.worker, &mut fd) },
            "ucp_worker_get_efd",
        );
        assert!(fd >= 0);
        // SAFETY: the worker is live.
        expect_ok(
            unsafe { ucp_worker_signal(node.worker) },
            "ucp_worker_signal",
        );
        // A pending signal means the worker must not go to sleep: arming
        // answers busy until the event is progressed away.
        // SAFETY: the worker is live.
        let armed = unsafe { ucp_worker_arm(node.worker) };
        assert_eq!(
            armed,
            UCS_ERR_BUSY,
            "arm after signal: {}",
            status_string(armed)
        );
    }
}

mod get {
    use super::*;

    #[test]
    fn a_get_reads_a_registered_buffer_through_a_packed_and_unpacked_key() {
        let node = Node::over_tcp();
        let source: Vec<u8> = (0..4096u32).map(|i| (i * 7 + 3) as u8).collect();
        let mut destination = vec![0u8; 256];

        let map_params = ucp_mem_map_params_t {
            field_mask: (UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH) as u64,
            address: source.as_ptr().cast_mut().cast(),
            length: source.len(),
            ..Default::default()
        };
        let mut memh = ptr::null_mut();
        // SAFETY: `source` stays allocated and unmodified until the unmap
        // below; the parameters name exactly its bytes.
        expect_ok(
            unsafe { ucp_mem_map(node.context, &map_params, &mut memh) },
            "ucp_mem_map",
        );

        let mut mem_attr = ucp_mem_attr_t {
            field_mask: (UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH) as u64,
            ..Default::default()
        };
        // SAFETY: `memh` is live; `mem_attr` is initialised with its mask.
        expect_ok(
            unsafe { ucp_mem_query(memh, &mut mem_attr) },
            "ucp_mem_query",
        );
        assert_eq!(
            mem_attr.address.cast_const(),
            source.as_ptr().cast::<c_void>()
        );
        assert!(mem_attr.length >= source.len());

        let mut packed = ptr::null_mut();
        let mut packed_len = 0;
        // SAFETY: context and `memh` are live; out-pointers are valid locals.
        expect_ok(
            unsafe { ucp_rkey_pack(node.context, memh, &mut packed, &mut packed_len) },
            "ucp_rkey_pack",
        );
        assert!(packed_len > 0);

        let mut address = ptr::null_mut();
        let mut address_len = 0;
        // SAFETY: the worker is live; out-pointers are valid locals.
        expect_ok(
            unsafe { ucp_worker_get_address(node.worker, &mut address, &mut address_len) },
            "ucp_worker_get_address",
        );
        let ep_params = ucp_ep_params_t {
            field_mask: UCP_EP_PARAM_FIELD_REMOTE_ADDRESS as u64,
            address,
            ..Default::default()
        };
        let mut ep = ptr::null_mut();
        // SAFETY: the worker is live and `address` is its own packed address.
        expect_ok(
            unsafe { ucp_ep_create(node.worker, &ep_params, &mut ep) },
            "ucp_ep_create",
        );
        // SAFETY: the endpoint copied what it needs; `address` came from this worker.
        unsafe { ucp_worker_release_address(node.worker, address) };

        let mut rkey = ptr::null_mut();
        // SAFETY: `packed` holds `packed_len` bytes made by `ucp_rkey_pack`
        // in this process, so it is a well-formed key.
        expect_ok(
            unsafe { ucp_ep_rkey_unpack(ep, packed, &mut rkey) },
            "ucp_ep_rkey_unpack",
        );
        // SAFETY: `packed` came from `ucp_rkey_pack` and is released once.
        unsafe { ucp_rkey_buffer_release(packed) };

        let offset = 1000;
        let get_params = ucp_request_param_t::default();
        // SAFETY: `destination` has room for the 256 bytes requested and is
        // not touched until the request completes; the remote range lies in
        // the registered `source`.
        let request = unsafe {
            ucp_get_nbx(
                ep,
                destination.as_mut_ptr().cast(),
                destination.len(),
                source.as_ptr().add(offset) as u64,
                rkey,
                &get_params,
            )
        };
        expect_ok(node.wait(request, "ucp_get_nbx"), "ucp_get_nbx");
        assert_eq!(destination, source[offset..offset + destination.len()]);

        // SAFETY: `rkey` was unpacked on `ep`, which is still open.
        unsafe { ucp_rkey_destroy(rkey) };
        // A flushing close (no FORCE flag: forcing needs peer error handling).
        let close_params = ucp_request_param_t::default();
        // SAFETY: `ep` is live and closed once; nothing uses it afterwards.
        let closing = unsafe { ucp_ep_close_nbx(ep, &close_params) };
        expect_ok(node.wait(closing, "ucp_ep_close_nbx"), "ucp_ep_close_nbx");
        // SAFETY: no transfer uses `memh` any more; it is unmapped once.
        expect_ok(
            unsafe { ucp_mem_unmap(node.context, memh) },
            "ucp_mem_unmap",
        );
    }
}
