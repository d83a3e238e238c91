//! Where files live: `<root>/<namespace hash>/` holds the namespace config file
//! (`namespace.json`, the layout identity, checked at start) and the segment files
//! `<instance>-<sequence>.seg`, each appended by one worker of one tier instance (the instance id
//! is fresh at every start, so two instances sharing a directory never append to the same file).
//! Temporary files (`*.tmp`: the namespace file being written, the O_DIRECT probe) live beside them.

use std::fs;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::config::NamespaceId;
use crate::error::FsError;
use crate::format::FORMAT_VERSION;

/// The namespace config file's name, inside the namespace directory.
pub const NAMESPACE_FILE: &str = "namespace.json";
/// The suffix of every temporary file.
pub const TMP_SUFFIX: &str = ".tmp";
/// The suffix of every segment file.
pub const SEGMENT_SUFFIX: &str = ".seg";
/// The lock file of a namespace directory: held exclusively by a tier in a private directory,
/// shared by the tiers of a shared one, so a private tier never runs beside another tier there.
pub const LOCK_FILE: &str = "lock";

/// Process-wide counter that makes temporary names and instance ids unique (with the process id).
static TMP_COUNTER: AtomicU64 = AtomicU64::new(0);

/// The hash that names a namespace directory (stable across builds and machines).
pub fn namespace_hash(ns: &NamespaceId) -> u64 {
    ns.hash_with("kvtier-fs", FORMAT_VERSION)
}

/// A fresh tier-instance id: a hash of the process id, the wall clock and a process-wide
/// counter, so that instances on one host or on several hosts sharing a directory differ.
pub fn new_instance_id() -> u64 {
    let n = TMP_COUNTER.fetch_add(1, Ordering::Relaxed);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let text = format!("{}-{nanos}-{n}", std::process::id());
    crate::format::xxh3_64(text.as_bytes())
}

/// The paths of one namespace.
#[derive(Clone, Debug)]
pub struct Layout {
    dir: PathBuf,
}

impl Layout {
    /// The layout of namespace `ns` under `root`.
    pub fn new(root: &Path, ns: &NamespaceId) -> Self {
        Self {
            dir: root.join(format!("{:016x}", namespace_hash(ns))),
        }
    }

    /// The namespace directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The path of segment `sequence` of instance `instance`.
    pub fn segment_path(&self, instance: u64, sequence: u32) -> PathBuf {
        self.dir.join(segment_file_name(instance, sequence))
    }

    /// A fresh temporary path in the namespace directory itself (probes, the namespace file).
    pub fn temp_path_in_dir(&self, stem: &str) -> PathBuf {
        let n = TMP_COUNTER.fetch_add(1, Ordering::Relaxed);
        self.dir
            .join(format!("{stem}.{}-{n}{TMP_SUFFIX}", std::process::id()))
    }

    /// The namespace config file.
    pub fn namespace_file(&self) -> PathBuf {
        self.dir.join(NAMESPACE_FILE)
    }
}

/// `<instance as 16 hex digits>-<sequence as 8 hex digits>.seg`.
pub fn segment_file_name(instance: u64, sequence: u32) -> String {
    format!("{instance:016x}-{sequence:08x}{SEGMENT_SUFFIX}")
}

/// The instance and sequence a segment file name encodes, or `None` for any other name.
pub fn parse_segment_file_name(name: &str) -> Option<(u64, u32)> {
    let stem = name.strip_suffix(SEGMENT_SUFFIX)?;
    let (instance, sequence) = stem.split_once('-')?;
    let hex = |s: &str, len: usize| s.len() == len && s.bytes().all(|b| b.is_ascii_hexdigit());
    if !hex(instance, 16) || !hex(sequence, 8) {
        return None;
    }
    let parsed = (
        u64::from_str_radix(instance, 16).ok()?,
        u32::from_str_radix(sequence, 16).ok()?,
    );
    // Only the canonical (lower-case) spelling is ours.
    (segment_file_name(parsed.0, parsed.1) == name).then_some(parsed)
}

/// Whether `name` is a temporary file's name.
pub fn is_temp_name(name: &str) -> bool {
    name.ends_with(TMP_SUFFIX)
}

/// The namespace file's text for `ns`.
fn namespace_text(ns: &NamespaceId) -> String {
    let fields = serde_json::json!({
        "format_version": FORMAT_VERSION,
        "model": ns.model,
        "dtype": ns.dtype,
        "tokens_per_chunk": ns.tokens_per_chunk,
        "parallel_layout": ns.parallel_layout,
    });
    format!("{fields:#}\n")
}

/// Writes the namespace file if it is missing, or checks it against `ns` if present. A mismatch
/// (or an unreadable file) is an error naming the field.
pub fn write_or_check_namespace_file(layout: &Layout, ns: &NamespaceId) -> Result<(), FsError> {
    let path = layout.namespace_file();
    match fs::read_to_string(&path) {
        Ok(text) => check_namespace_text(&path, &text, ns),
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
            write_namespace_file(layout, ns)
        }
        Err(error) => Err(FsError::io("read", &path, 0, error)),
    }
}

fn write_namespace_file(layout: &Layout, ns: &NamespaceId) -> Result<(), FsError> {
    let path = layout.namespace_file();
    let temp = layout.temp_path_in_dir(NAMESPACE_FILE);
    let result = (|| {
        let mut file = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(crate::direct::FILE_MODE)
            .open(&temp)
            .map_err(|e| FsError::io("create", &temp, 0, e))?;
        file.write_all(namespace_text(ns).as_bytes())
            .map_err(|e| FsError::io("write", &temp, 0, e))?;
        file.sync_all()
            .map_err(|e| FsError::io("fsync", &temp, 0, e))?;
        fs::rename(&temp, &path).map_err(|e| FsError::io("rename", &path, 0, e))
    })();
    if result.is_err() {
        let _ = fs::remove_file(&temp);
    }
    result
}

fn check_namespace_text(path: &Path, text: &str, ns: &NamespaceId) -> Result<(), FsError> {
    let value: serde_json::Value = serde_json::from_str(text).map_err(|e| FsError::Corrupt {
        path: path.to_owned(),
        offset: 0,
        reason: format!("namespace file is not JSON: {e}"),
    })?;
    let expected = [
        ("format_version", serde_json::json!(FORMAT_VERSION)),
        ("model", serde_json::json!(ns.model)),
        ("dtype", serde_json::json!(ns.dtype)),
        ("tokens_per_chunk", serde_json::json!(ns.tokens_per_chunk)),
        ("parallel_layout", serde_json::json!(ns.parallel_layout)),
    ];
    for (field, want) in expected {
        let found = value.get(field).cloned().unwrap_or(serde_json::Value::Null);
        if found != want {
            return Err(FsError::NamespaceMismatch {
                path: path.to_owned(),
                field,
                expected: want.to_string(),
                found: found.to_string(),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ns() -> NamespaceId {
        NamespaceId {
            model: "llama".into(),
            dtype: "bf16".into(),
            tokens_per_chunk: 256,
            parallel_layout: "tp1".into(),
        }
    }

    #[test]
    fn segment_names_round_trip_and_reject_strangers() {
        let name = segment_file_name(0xAB00_0000_0000_0012, 3);
        assert_eq!(name, "ab00000000000012-00000003.seg");
        assert_eq!(
            parse_segment_file_name(&name),
            Some((0xAB00_0000_0000_0012, 3))
        );
        for bad in [
            "ab00000000000012-00000003.seg.tmp",
            "AB00000000000012-00000003.seg",
            "ab0000000000012-00000003.seg",
            "ab00000000000012-0000003.seg",
            "ab00000000000012.seg",
            "namespace.json",
        ] {
            assert_eq!(parse_segment_file_name(bad), None, "{bad}");
        }
        let layout = Layout::new(Path::new("/r"), &ns());
        assert_eq!(layout.segment_path(1, 2).parent(), Some(layout.dir()));
        assert_ne!(new_instance_id(), new_instance_id());
        let a = layout.temp_path_in_dir("x");
        assert_ne!(a, layout.temp_path_in_dir("x"));
        assert!(is_temp_name(&a.file_name().unwrap().to_string_lossy()));
    }

    #[test]
    fn namespace_hash_depends_on_every_field() {
        let base = namespace_hash(&ns());
        let mut other = ns();
        other.model.push('x');
        assert_ne!(namespace_hash(&other), base);
        let mut other = ns();
        other.tokens_per_chunk += 1;
        assert_ne!(namespace_hash(&other), base);
        let mut other = ns();
        other.parallel_layout = "tp2".into();
        assert_ne!(namespace_hash(&other), base);
        assert_eq!(namespace_hash(&ns()), base);
    }

    #[test]
    fn namespace_file_is_written_then_checked() {
        let dir = tempfile::tempdir().unwrap();
        let layout = Layout::new(dir.path(), &ns());
        fs::create_dir_all(layout.dir()).unwrap();
        write_or_check_namespace_file(&layout, &ns()).unwrap();
        write_or_check_namespace_file(&layout, &ns()).unwrap();
        let mut other = ns();
        other.dtype = "fp8".into();
        match write_or_check_namespace_file(&layout, &other) {
            Err(FsError::NamespaceMismatch { field, .. }) => assert_eq!(field, "dtype"),
            result => panic!("expected a mismatch naming dtype, got {result:?}"),
        }
        fs::write(layout.namespace_file(), "not json").unwrap();
        assert!(write_or_check_namespace_file(&layout, &ns()).is_err());
        let leftovers: Vec<_> = fs::read_dir(layout.dir())
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| is_temp_name(&e.file_name().to_string_lossy()))
            .collect();
        assert!(leftovers.is_empty());
    }
}
