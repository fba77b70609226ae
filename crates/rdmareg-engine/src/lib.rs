//! The engine kit: what every progress-thread backend of rdmareg shares.
//!
//! A backend such as `rdmareg-ucx` or `rdmareg-ofi` runs one progress thread
//! that owns every transport handle. Around that thread both need the same
//! machinery, and it lives here once:
//!
//! - [`command`]: what submitters ask of the thread, and how the thread
//!   hands each command to the driver;
//! - [`lanes`]: the bounded ring and the unbounded control lane commands
//!   travel on, and the submit future that waits for room;
//! - [`doorbell`]: how a submitter wakes the thread, and only when it sleeps;
//! - [`progress_loop`]: the thread's loop of commands, transport turns,
//!   spinning and parking;
//! - [`lifecycle`]: teardown begun, registrations held, what teardown left;
//! - [`open_files`]: the open-file limit every engine raises as it starts;
//! - [`front`]: the `RdmaBackend` methods over those commands, with their
//!   cancellation rules, and [`backend`]: the driver's `RdmaBackend` over
//!   its front;
//! - [`thread`]: starting the thread, and joining it within a deadline;
//! - [`results`]: a batch's results as its entries finish;
//! - [`deadlines`]: reads' deadlines, earliest first;
//! - [`served`]: the served-read protocol as state machines with no I/O and
//!   no clock, checked by seeded simulators: the owner side (admission,
//!   read leases, unmaps that wait for them) and the consumer side (which
//!   reply may write a destination, completes a read only after release);
//!   and served writes (access, holds while the bytes are received, the
//!   writer that answers only once its send ended);
//! - [`notices`]: small messages a reader sends an owner after its reads,
//!   the reader's gate that holds them until the reads completed and the
//!   owner's bounded queue.
//!
//! A driver (the transport's crate) creates and progresses the transport's
//! objects, and turns their completions into results for the callers. This
//! crate never calls UCX or libfabric.

#![deny(unsafe_op_in_unsafe_fn)]

pub mod backend;
pub mod command;
pub mod deadlines;
pub mod doorbell;
pub mod front;
pub mod lanes;
pub mod lifecycle;
pub mod notices;
pub mod open_files;
pub mod progress_loop;
pub mod results;
pub mod served;
#[cfg(test)]
mod sim_support;
pub mod thread;
