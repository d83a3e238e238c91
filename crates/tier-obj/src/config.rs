//! The object tier's configuration: where objects live (the backend and the key prefix), the
//! namespace that separates KV layouts, and the limits (jobs and requests in flight, deadlines,
//! the multipart threshold).

use std::sync::Arc;
use std::time::Duration;

use object_store::aws::AmazonS3Builder;
use object_store::azure::MicrosoftAzureBuilder;
use object_store::gcp::GoogleCloudStorageBuilder;
use object_store::local::LocalFileSystem;
use object_store::memory::InMemory;
use object_store::ObjectStore;

use crate::error::ObjError;
use crate::record::FORMAT_VERSION;

/// The identity of the KV layout whose chunks a namespace holds (offload-core's): its object
/// prefix is [`namespace_hash`] of it.
pub use offload_core::NamespaceId;

/// The hash that names a namespace's object prefix (stable across builds and machines).
pub fn namespace_hash(ns: &NamespaceId) -> u64 {
    ns.hash_with("kvtier-obj", FORMAT_VERSION)
}

/// An S3-compatible bucket. Fields left `None` come from the usual `AWS_*` environment variables
/// (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`, `AWS_REGION`,
/// `AWS_ENDPOINT`, `AWS_BUCKET`, ...), as object_store's `AmazonS3Builder::from_env` reads them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct S3Config {
    /// The bucket (must exist).
    pub bucket: Option<String>,
    /// The endpoint URL for S3-compatible servers (MinIO, moto, ...); `None` for AWS itself.
    pub endpoint: Option<String>,
    /// The region (`us-east-1` when neither this nor the environment names one).
    pub region: Option<String>,
    /// The access key id.
    pub access_key_id: Option<String>,
    /// The secret access key.
    pub secret_access_key: Option<String>,
    /// A session token for temporary credentials.
    pub session_token: Option<String>,
    /// Allow plain `http://` endpoints (local servers); otherwise only HTTPS.
    pub allow_http: bool,
}

/// A Google Cloud Storage bucket. Credentials come only from the environment, as object_store's
/// `GoogleCloudStorageBuilder::from_env` reads them (`GOOGLE_SERVICE_ACCOUNT` or
/// `GOOGLE_SERVICE_ACCOUNT_KEY`, else application default credentials or the instance's
/// metadata server); `None` fields too (`GOOGLE_BUCKET`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GcsConfig {
    /// The bucket (must exist).
    pub bucket: Option<String>,
}

/// An Azure Blob Storage container. The account and its credentials come only from the
/// environment, as object_store's `MicrosoftAzureBuilder::from_env` reads them
/// (`AZURE_STORAGE_ACCOUNT_NAME`, `AZURE_STORAGE_ACCOUNT_KEY`, a SAS token, a service
/// principal, managed identity, ...); `None` fields too (`AZURE_CONTAINER_NAME`,
/// `AZURE_STORAGE_ENDPOINT`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AzureConfig {
    /// The container (must exist).
    pub container: Option<String>,
    /// The account's blob endpoint URL, for emulators and private endpoints (Azurite:
    /// `http://127.0.0.1:10000/devstoreaccount1`); `None`: `https://<account>.blob.core.windows.net`.
    pub endpoint: Option<String>,
    /// Allow a plain `http://` endpoint (emulators); otherwise only HTTPS.
    pub allow_http: bool,
}

/// Where the objects live.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Backend {
    /// In this process's memory (tests; lost at exit).
    Memory,
    /// A local directory (object_store's file-system backend: each object a file, written to a
    /// temporary name and renamed, so a reader never sees a torn object).
    Local {
        /// The directory (created if missing).
        root: std::path::PathBuf,
    },
    /// An S3-compatible bucket.
    S3(S3Config),
    /// A Google Cloud Storage bucket.
    Gcs(GcsConfig),
    /// An Azure Blob Storage container.
    Azure(AzureConfig),
}

impl Backend {
    /// Builds the object store client. Makes no request.
    pub fn open(&self) -> Result<Arc<dyn ObjectStore>, ObjError> {
        match self {
            Backend::Memory => Ok(Arc::new(InMemory::new())),
            Backend::Local { root } => {
                std::fs::create_dir_all(root).map_err(|e| ObjError::Config {
                    what: format!("cannot create local object root {}: {e}", root.display()),
                })?;
                let fs = LocalFileSystem::new_with_prefix(root).map_err(|e| ObjError::Config {
                    what: format!("local object root {}: {e}", root.display()),
                })?;
                Ok(Arc::new(fs))
            }
            Backend::S3(s3) => s3_store(s3),
            Backend::Gcs(gcs) => gcs_store(gcs),
            Backend::Azure(azure) => azure_store(azure),
        }
    }
}

/// A GCS client for `config`, with the `GOOGLE_*` environment variables as defaults.
fn gcs_store(config: &GcsConfig) -> Result<Arc<dyn ObjectStore>, ObjError> {
    let mut builder = GoogleCloudStorageBuilder::from_env();
    if let Some(bucket) = &config.bucket {
        builder = builder.with_bucket_name(bucket);
    }
    let store = builder.build().map_err(|e| ObjError::Config {
        what: format!("GCS client for {}: {e}", describe("gs", &config.bucket)),
    })?;
    Ok(Arc::new(store))
}

/// An Azure Blob Storage client for `config`, with the `AZURE_*` environment variables as
/// defaults.
fn azure_store(config: &AzureConfig) -> Result<Arc<dyn ObjectStore>, ObjError> {
    let mut builder = MicrosoftAzureBuilder::from_env();
    if let Some(container) = &config.container {
        builder = builder.with_container_name(container);
    }
    if let Some(endpoint) = &config.endpoint {
        builder = builder.with_endpoint(endpoint.clone());
    }
    if config.allow_http {
        builder = builder.with_allow_http(true);
    }
    let store = builder.build().map_err(|e| ObjError::Config {
        what: format!(
            "Azure client for {}: {e}",
            describe("az", &config.container)
        ),
    })?;
    Ok(Arc::new(store))
}

/// `scheme://name` for an error message, or what stands for a name taken from the environment.
fn describe(scheme: &str, name: &Option<String>) -> String {
    match name {
        Some(name) => format!("{scheme}://{name}"),
        None => format!("{scheme}:// (name from the environment)"),
    }
}

/// An S3 client for `config`, with the `AWS_*` environment variables as defaults.
fn s3_store(config: &S3Config) -> Result<Arc<dyn ObjectStore>, ObjError> {
    let mut builder = AmazonS3Builder::from_env();
    if let Some(bucket) = &config.bucket {
        builder = builder.with_bucket_name(bucket);
    }
    if let Some(endpoint) = &config.endpoint {
        builder = builder.with_endpoint(endpoint);
    }
    if let Some(region) = &config.region {
        builder = builder.with_region(region);
    }
    if let Some(id) = &config.access_key_id {
        builder = builder.with_access_key_id(id);
    }
    if let Some(secret) = &config.secret_access_key {
        builder = builder.with_secret_access_key(secret);
    }
    if let Some(token) = &config.session_token {
        builder = builder.with_token(token);
    }
    if config.allow_http {
        builder = builder.with_allow_http(true);
    }
    // Our own deadline bounds every request; object_store's retries happen inside it.
    let store = builder.build().map_err(|e| ObjError::Config {
        what: format!("S3 client: {e}"),
    })?;
    Ok(Arc::new(store))
}

/// The object tier's configuration. Build it with [`ObjTierConfig::new`] and struct-update syntax.
#[derive(Clone, Debug)]
pub struct ObjTierConfig {
    /// The key prefix under which this tier's namespaces live (may be empty).
    pub prefix: String,
    /// The KV layout; objects live under `<prefix>/<namespace hash>/`.
    pub namespace: NamespaceId,
    /// Jobs accepted and not yet returned by `poll`; `submit` answers `Busy` beyond it.
    pub jobs_in_flight_max: usize,
    /// Object requests (puts, gets, multipart uploads) in flight at once, over all jobs.
    pub requests_in_flight_max: usize,
    /// The deadline of one request, from when it starts; waiting for a request slot has the same
    /// deadline again. A request past it fails its key.
    pub request_deadline: Duration,
    /// The deadline of the start-up listing that rebuilds the index.
    pub list_deadline: Duration,
    /// How long `Tier::drain` waits for the jobs in flight (a store that stopped answering);
    /// past it, `drain` returns with those jobs still in flight (their slots still theirs),
    /// reported by a later `poll`, and counts it (`ObjStats::drain_timeouts`).
    pub drain_deadline: Duration,
    /// Records of more bytes than this are uploaded in parts (S3 needs at least 5 MiB per part).
    pub multipart_threshold_bytes: usize,
    /// Bytes per part of a multipart upload (the last part may be shorter). S3 refuses parts
    /// under 5 MiB but the last; the memory and local backends take any size.
    pub part_bytes: usize,
    /// Threads of the tier's own async runtime.
    pub runtime_threads: usize,
}

impl ObjTierConfig {
    /// Defaults for `namespace` under `prefix`.
    pub fn new(prefix: impl Into<String>, namespace: NamespaceId) -> Self {
        Self {
            prefix: prefix.into(),
            namespace,
            jobs_in_flight_max: 64,
            requests_in_flight_max: 16,
            request_deadline: Duration::from_secs(30),
            list_deadline: Duration::from_secs(60),
            drain_deadline: Duration::from_secs(30),
            multipart_threshold_bytes: 8 << 20,
            part_bytes: 8 << 20,
            runtime_threads: 2,
        }
    }

    /// Checks the limits.
    pub fn validate(&self) -> Result<(), ObjError> {
        let bad = |what: &str| {
            Err(ObjError::Config {
                what: what.to_owned(),
            })
        };
        if self.jobs_in_flight_max == 0 {
            return bad("jobs_in_flight_max must be at least 1");
        }
        if self.requests_in_flight_max == 0 {
            return bad("requests_in_flight_max must be at least 1");
        }
        if self.part_bytes == 0 {
            return bad("part_bytes must be at least 1");
        }
        if self.runtime_threads == 0 {
            return bad("runtime_threads must be at least 1");
        }
        for (name, deadline) in [
            ("request_deadline", self.request_deadline),
            ("list_deadline", self.list_deadline),
            ("drain_deadline", self.drain_deadline),
        ] {
            if deadline.is_zero() {
                return bad(&format!("{name} must be positive"));
            }
        }
        Ok(())
    }
}
