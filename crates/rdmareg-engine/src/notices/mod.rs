//! Notices in the engine kit: the rules and formats of
//! [`rdmareg_backend::notices`], which every backend shares, plus what only
//! a progress-thread driver needs: the [`gate`] that holds a notice until
//! the reads it accompanies completed on the driver's own completion path,
//! and [`draw_sender`].

pub mod gate;
#[cfg(test)]
mod sim;

pub use gate::{Attached, Finished, NoticeGate};
pub use rdmareg_backend::notices::{
    MAX_NOTICE_BYTES, NoticeBoard, NoticeDrop, NoticeFormatError, NoticeInbox, NoticeLimits,
    NoticeMessage, NoticeSource, NoticeStream, ReceivedNotice, board, inbox, wire,
};

use rdmareg_core::{NoticeSender, RdmaError};

/// A new engine's sender number, from the OS's random source, so two
/// engines (or one restarted) never share one.
///
/// # Errors
/// [`RdmaError::Backend`] when the OS gives no random bytes.
pub fn draw_sender() -> Result<NoticeSender, RdmaError> {
    let mut bytes = [0u8; 8];
    getrandom::fill(&mut bytes).map_err(|err| {
        RdmaError::backend(format!(
            "cannot draw a notice sender number from the OS: {err}"
        ))
    })?;
    Ok(NoticeSender(u64::from_le_bytes(bytes)))
}
