//! A raw UCX peer for the tests: a bare UCP context and worker on the test
//! thread that speaks the engine's active messages by hand, recording what
//! it receives, so a test can play a hostile or silent owner or consumer.

#![allow(dead_code)] // Each test binary uses its own subset.

use std::cell::RefCell;
use std::ffi::c_void;
use std::ptr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use rdmareg_ucx::read_list::{
    ListReply, ListRequest, READ_LIST_REPLY_AM_ID, READ_LIST_REQUEST_AM_ID,
};
use rdmareg_ucx::read_protocol::{
    READ_REPLY_AM_ID, READ_REQUEST_AM_ID, WRITE_LIST_REPLY_AM_ID, WRITE_LIST_REQUEST_AM_ID,
    WRITE_REQUEST_AM_ID,
};
use ucx_sys as sys;

use super::raw_context_and_worker;

pub fn is_err(ptr: sys::ucs_status_ptr_t) -> bool {
    (ptr as usize) >= (sys::UCS_ERR_LAST as isize as usize)
}

/// One active message a raw peer received.
#[derive(Debug)]
pub struct Msg {
    pub header: Vec<u8>,
    /// Eager payload, copied.
    pub data: Vec<u8>,
    pub rndv_len: usize,
    /// The held rendezvous descriptor (never received).
    pub desc: *mut c_void,
    pub reply_ep: sys::ucp_ep_h,
}

struct Inbox {
    id: u32,
    msgs: RefCell<Vec<Msg>>,
    /// Keep rendezvous descriptors (UCS_INPROGRESS) instead of dropping them.
    hold_rndv: bool,
}

unsafe extern "C" fn on_am(
    arg: *mut c_void,
    header: *const c_void,
    header_length: usize,
    data: *mut c_void,
    length: usize,
    param: *const sys::ucp_am_recv_param_t,
) -> sys::ucs_status_t {
    // SAFETY: `arg` is the boxed `Inbox` registered with this handler; it lives as long as the `Raw` whose worker calls it.
    let inbox = unsafe { &*arg.cast::<Inbox>() };
    // SAFETY: UCX passes a valid parameter record for the call's duration.
    let param = unsafe { &*param };
    let header = if header.is_null() || header_length == 0 {
        Vec::new()
    } else {
        // SAFETY: UCX passes `header_length` readable bytes for the call's duration.
        unsafe { std::slice::from_raw_parts(header.cast::<u8>(), header_length) }.to_vec()
    };
    let rndv = param.recv_attr & u64::from(sys::UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
    let reply_ep = if param.recv_attr & u64::from(sys::UCP_AM_RECV_ATTR_FIELD_REPLY_EP) != 0 {
        param.reply_ep
    } else {
        ptr::null_mut()
    };
    let mut msg = Msg {
        header,
        data: Vec::new(),
        rndv_len: 0,
        desc: ptr::null_mut(),
        reply_ep,
    };
    let mut status = sys::UCS_OK;
    if rndv {
        msg.rndv_len = length;
        if inbox.hold_rndv {
            msg.desc = data;
            status = sys::UCS_INPROGRESS;
        }
    } else if !data.is_null() && length > 0 {
        // SAFETY: eager data: UCX passes `length` readable bytes for the call's duration.
        msg.data = unsafe { std::slice::from_raw_parts(data.cast::<u8>(), length) }.to_vec();
    }
    inbox.msgs.borrow_mut().push(msg);
    status
}

/// A bare UCP context + worker on the test thread, speaking the engine's
/// active messages by hand.
pub struct Raw {
    context: sys::ucp_context_h,
    worker: sys::ucp_worker_h,
    eps: RefCell<Vec<sys::ucp_ep_h>>,
    /// Boxed: UCX holds each inbox's address as its handler argument, so it
    /// must not move when the vector grows.
    #[allow(clippy::vec_box)]
    inboxes: Vec<Box<Inbox>>,
}

impl Raw {
    pub fn new(hold_rndv: bool) -> Raw {
        let (context, worker) = raw_context_and_worker("tcp", sys::UCP_FEATURE_AM);
        let mut raw = Raw {
            context,
            worker,
            eps: RefCell::new(Vec::new()),
            inboxes: Vec::new(),
        };
        for id in [
            READ_REQUEST_AM_ID,
            READ_REPLY_AM_ID,
            READ_LIST_REQUEST_AM_ID,
            READ_LIST_REPLY_AM_ID,
            WRITE_REQUEST_AM_ID,
            WRITE_LIST_REQUEST_AM_ID,
            WRITE_LIST_REPLY_AM_ID,
        ] {
            let inbox = Box::new(Inbox {
                id,
                msgs: RefCell::new(Vec::new()),
                hold_rndv,
            });
            let params = sys::ucp_am_handler_param_t {
                field_mask: u64::from(
                    sys::UCP_AM_HANDLER_PARAM_FIELD_ID
                        | sys::UCP_AM_HANDLER_PARAM_FIELD_CB
                        | sys::UCP_AM_HANDLER_PARAM_FIELD_ARG,
                ),
                id,
                cb: Some(on_am),
                arg: (&*inbox as *const Inbox).cast_mut().cast(),
                ..Default::default()
            };
            // SAFETY: a UCX call on this test thread with live handles owned by this `Raw` or peer (released only when it is dropped) and valid in/out pointers.
            let status = unsafe { sys::ucp_worker_set_am_recv_handler(worker, &params) };
            assert_eq!(status, sys::UCS_OK);
            raw.inboxes.push(inbox);
        }
        raw
    }

    pub fn address(&self) -> Bytes {
        let mut addr: *mut sys::ucp_address_t = ptr::null_mut();
        let mut len: usize = 0;
        // SAFETY: a UCX call on this test thread with live handles owned by this `Raw` or peer (released only when it is dropped) and valid in/out pointers.
        let status = unsafe { sys::ucp_worker_get_address(self.worker, &mut addr, &mut len) };
        assert_eq!(status, sys::UCS_OK);
        let bytes =
            // SAFETY: a UCX call on this test thread with live handles owned by this `Raw` or peer (released only when it is dropped) and valid in/out pointers.
            Bytes::copy_from_slice(unsafe { std::slice::from_raw_parts(addr.cast::<u8>(), len) });
        // SAFETY: a UCX call on this test thread with live handles owned by this `Raw` or peer (released only when it is dropped) and valid in/out pointers.
        unsafe { sys::ucp_worker_release_address(self.worker, addr) };
        bytes
    }

    pub fn connect(&self, address: &[u8]) -> sys::ucp_ep_h {
        self.connect_mode(address, true)
    }

    pub fn connect_mode(&self, address: &[u8], peer_errors: bool) -> sys::ucp_ep_h {
        let ep_params = sys::ucp_ep_params_t {
            field_mask: u64::from(
                sys::UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | sys::UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE,
            ),
            address: address.as_ptr().cast(),
            err_mode: if peer_errors {
                sys::UCP_ERR_HANDLING_MODE_PEER
            } else {
                sys::UCP_ERR_HANDLING_MODE_NONE
            },
            ..Default::default()
        };
        let mut ep: sys::ucp_ep_h = ptr::null_mut();
        // SAFETY: a UCX call on this test thread with live handles owned by this `Raw` or peer (released only when it is dropped) and valid in/out pointers.
        let status = unsafe { sys::ucp_ep_create(self.worker, &ep_params, &mut ep) };
        assert_eq!(status, sys::UCS_OK, "raw endpoint");
        if peer_errors {
            self.eps.borrow_mut().push(ep);
        }
        ep
    }

    pub fn progress_for(&self, d: Duration) {
        let start = Instant::now();
        while start.elapsed() < d {
            // SAFETY: a UCX call on this test thread with live handles owned by this `Raw` or peer (released only when it is dropped) and valid in/out pointers.
            unsafe { sys::ucp_worker_progress(self.worker) };
            std::thread::sleep(Duration::from_micros(100));
        }
    }

    pub fn progress_until(&self, d: Duration, mut done: impl FnMut(&Raw) -> bool) -> bool {
        let start = Instant::now();
        while start.elapsed() < d {
            // SAFETY: a UCX call on this test thread with live handles owned by this `Raw` or peer (released only when it is dropped) and valid in/out pointers.
            unsafe { sys::ucp_worker_progress(self.worker) };
            if done(self) {
                return true;
            }
            std::thread::sleep(Duration::from_micros(100));
        }
        false
    }

    /// Sends an active message; returns the request (or null/err status).
    pub fn send(
        &self,
        ep: sys::ucp_ep_h,
        id: u32,
        header: &[u8],
        payload: &[u8],
        flags: u32,
    ) -> sys::ucs_status_ptr_t {
        let param = sys::ucp_request_param_t {
            op_attr_mask: sys::UCP_OP_ATTR_FIELD_FLAGS,
            flags: flags | sys::UCP_AM_SEND_FLAG_COPY_HEADER,
            ..Default::default()
        };
        // SAFETY: a UCX call on this test thread with live handles owned by this `Raw` or peer (released only when it is dropped) and valid in/out pointers.
        unsafe {
            sys::ucp_am_send_nbx(
                ep,
                id,
                header.as_ptr().cast(),
                header.len(),
                payload.as_ptr().cast(),
                payload.len(),
                &param,
            )
        }
    }

    /// Sends and progresses until the send completed.
    /// Connects to the engine at `owner_address` and sends it `request`
    /// as a list request that asks for replies; returns the endpoint.
    pub fn ask_list(&self, owner_address: &[u8], request: &ListRequest) -> sys::ucp_ep_h {
        let ep = self.connect(owner_address);
        self.send_wait(
            ep,
            READ_LIST_REQUEST_AM_ID,
            &request.encode().expect("a list within its bounds"),
            &[],
            sys::UCP_AM_SEND_FLAG_REPLY,
        );
        ep
    }

    /// The entries answered by every list reply received so far (a reply
    /// whose header does not decode answers none).
    pub fn list_entries_answered(&self) -> usize {
        self.messages(READ_LIST_REPLY_AM_ID)
            .iter()
            .filter_map(|m| ListReply::decode(&m.header).ok())
            .map(|reply| reply.entries.len())
            .sum()
    }

    pub fn send_wait(&self, ep: sys::ucp_ep_h, id: u32, header: &[u8], payload: &[u8], flags: u32) {
        let req = self.send(ep, id, header, payload, flags);
        if req.is_null() || is_err(req) {
            return;
        }
        // SAFETY: a UCX call on this test thread with live handles owned by this `Raw` or peer (released only when it is dropped) and valid in/out pointers.
        let done = self.progress_until(Duration::from_secs(5), |_| unsafe {
            sys::ucp_request_check_status(req.cast()) != sys::UCS_INPROGRESS
        });
        assert!(done, "raw send did not complete");
        // SAFETY: a UCX call on this test thread with live handles owned by this `Raw` or peer (released only when it is dropped) and valid in/out pointers.
        unsafe { sys::ucp_request_free(req.cast()) };
    }

    /// Lets go of every rendezvous reply this peer holds (the senders'
    /// sends end); returns how many.
    pub fn release_held(&self) -> usize {
        let mut released = 0;
        for inbox in &self.inboxes {
            for m in inbox.msgs.borrow_mut().iter_mut() {
                if !m.desc.is_null() {
                    // SAFETY: a rendezvous descriptor UCX handed this
                    // worker's handler (kept with UCS_INPROGRESS), released
                    // once: it is cleared right after, so `Drop` does not
                    // release it again.
                    unsafe { sys::ucp_am_data_release(self.worker, m.desc) };
                    m.desc = ptr::null_mut();
                    released += 1;
                }
            }
        }
        released
    }

    pub fn messages(&self, id: u32) -> std::cell::Ref<'_, Vec<Msg>> {
        self.inboxes
            .iter()
            .find(|i| i.id == id)
            .unwrap()
            .msgs
            .borrow()
    }
}

impl Drop for Raw {
    fn drop(&mut self) {
        let param = sys::ucp_request_param_t {
            op_attr_mask: sys::UCP_OP_ATTR_FIELD_FLAGS,
            flags: sys::UCP_EP_CLOSE_FLAG_FORCE,
            ..Default::default()
        };
        // SAFETY: a UCX call on this test thread with live handles owned by this `Raw` or peer (released only when it is dropped) and valid in/out pointers.
        unsafe {
            for inbox in &self.inboxes {
                for m in inbox.msgs.borrow().iter() {
                    if !m.desc.is_null() {
                        sys::ucp_am_data_release(self.worker, m.desc);
                    }
                }
            }
            for ep in self.eps.borrow().iter() {
                let close = sys::ucp_ep_close_nbx(*ep, &param);
                if !close.is_null() && !is_err(close) {
                    let start = Instant::now();
                    while sys::ucp_request_check_status(close.cast()) == sys::UCS_INPROGRESS
                        && start.elapsed() < Duration::from_secs(2)
                    {
                        sys::ucp_worker_progress(self.worker);
                    }
                    sys::ucp_request_free(close.cast());
                }
            }
            sys::ucp_worker_destroy(self.worker);
            sys::ucp_cleanup(self.context);
        }
    }
}
