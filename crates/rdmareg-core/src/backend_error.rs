//! [`BackendError`]: what [`RdmaError::Backend`](crate::RdmaError::Backend)
//! carries: a short message callers match on, and the error it came from as
//! `source()`, kept out of the message so a chain prints each cause once.

use std::error::Error;
use std::fmt;
use std::sync::Arc;

/// A backend's failure: its message and, when known, the underlying error.
///
/// Equality compares messages only (sources have none). The message derefs
/// to `&str`.
#[derive(Clone)]
pub struct BackendError {
    message: String,
    source: Option<Arc<dyn Error + Send + Sync + 'static>>,
}

impl BackendError {
    /// A failure known only by its message.
    pub fn new(message: impl Into<String>) -> BackendError {
        BackendError {
            message: message.into(),
            source: None,
        }
    }

    /// A failure caused by `source`, with a message saying what failed.
    pub fn caused_by(
        message: impl Into<String>,
        source: impl Error + Send + Sync + 'static,
    ) -> BackendError {
        BackendError {
            message: message.into(),
            source: Some(Arc::new(source)),
        }
    }

    /// The message.
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl fmt::Debug for BackendError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut debug = f.debug_struct("BackendError");
        debug.field("message", &self.message);
        if let Some(source) = &self.source {
            debug.field("source", source);
        }
        debug.finish()
    }
}

impl fmt::Display for BackendError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rdma backend: {}", self.message)
    }
}

impl Error for BackendError {
    fn source(&self) -> Option<&(dyn Error + 'static)> {
        self.source
            .as_deref()
            .map(|source| source as &(dyn Error + 'static))
    }
}

impl std::ops::Deref for BackendError {
    type Target = str;

    fn deref(&self) -> &str {
        &self.message
    }
}

impl PartialEq for BackendError {
    fn eq(&self, other: &BackendError) -> bool {
        self.message == other.message
    }
}

impl Eq for BackendError {}

impl PartialEq<str> for BackendError {
    fn eq(&self, other: &str) -> bool {
        self.message == other
    }
}

impl PartialEq<&str> for BackendError {
    fn eq(&self, other: &&str) -> bool {
        self.message == *other
    }
}

impl From<String> for BackendError {
    fn from(message: String) -> BackendError {
        BackendError::new(message)
    }
}

impl From<&str> for BackendError {
    fn from(message: &str) -> BackendError {
        BackendError::new(message)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_source_is_reachable_and_not_in_the_message() {
        let io = std::io::Error::other("out of memory");
        let error = BackendError::caused_by("mapping the release table", io);
        assert_eq!(error.to_string(), "rdma backend: mapping the release table");
        let source = error.source().expect("a source");
        assert!(source.downcast_ref::<std::io::Error>().is_some());
    }

    #[test]
    fn equality_compares_messages_only() {
        let with = BackendError::caused_by("x", std::io::Error::other("a"));
        assert_eq!(with, BackendError::new("x"));
        assert_ne!(with, BackendError::new("y"));
        assert!(with == "x");
    }

    #[test]
    fn a_message_only_failure_has_no_source() {
        assert!(BackendError::new("x").source().is_none());
    }
}
