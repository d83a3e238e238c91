//! The object tier's error type: what failed at start (configuration, the runtime, the start-up
//! listing). Per-chunk failures during jobs are failed keys in completions, counted in stats.

/// What a caller can branch on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ObjErrorKind {
    /// A bad configuration value; fix the configuration.
    Config,
    /// The object store answered with an error or not in time; may succeed later.
    Transient,
    /// The process could not start the tier's threads.
    Fatal,
}

/// Why the object tier could not start.
#[derive(Debug, thiserror::Error)]
pub enum ObjError {
    /// A bad configuration value.
    #[error("object tier configuration: {what}")]
    Config {
        /// What was wrong.
        what: String,
    },
    /// The tier's async runtime did not start.
    #[error("object tier runtime: {0}")]
    Runtime(#[source] std::io::Error),
    /// A request to the object store failed.
    #[error("object store {op} of {path}: {source}")]
    Store {
        /// The operation (`list`, `put`, ...).
        op: &'static str,
        /// The object or prefix.
        path: String,
        /// object_store's error.
        #[source]
        source: object_store::Error,
    },
    /// A request to the object store missed its deadline.
    #[error("object store {op} of {path}: no answer within {deadline_ms} ms")]
    Timeout {
        /// The operation.
        op: &'static str,
        /// The object or prefix.
        path: String,
        /// The deadline.
        deadline_ms: u64,
    },
}

impl ObjError {
    /// The error's kind.
    pub fn kind(&self) -> ObjErrorKind {
        match self {
            ObjError::Config { .. } => ObjErrorKind::Config,
            ObjError::Runtime(_) => ObjErrorKind::Fatal,
            ObjError::Store { .. } | ObjError::Timeout { .. } => ObjErrorKind::Transient,
        }
    }
}
