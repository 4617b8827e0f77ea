//! Local drives: disk files of the host's own, `STATE_DIR/disks/VM/NAME`
//! (raw or qcow2), named by a drive's `local` field. `vm create` makes a
//! missing one when the drive gives a `size`; a shared-nothing migration
//! copies them to the target (see `migration::disks`), and the source's
//! copies go once the guest runs there.

use std::path::{Path, PathBuf};

use ferry_api::hardware::DriveFormat;
use ferry_api::{ApiError, VmSpec};

use crate::qemu::QemuConfig;

/// Every local drive of `spec`: (drive index, its file, its format).
pub fn files(cfg: &QemuConfig, spec: &VmSpec) -> Vec<(usize, PathBuf, DriveFormat)> {
    spec.local_drives()
        .filter_map(|(i, d)| Some((i, cfg.local_disk(&spec.name, d.local.as_deref()?), d.format)))
        .collect()
}

/// The files of every local drive of `spec`.
pub fn paths(cfg: &QemuConfig, spec: &VmSpec) -> Vec<PathBuf> {
    files(cfg, spec).into_iter().map(|(_, f, _)| f).collect()
}

/// Creates an empty image of `size` bytes at `path` (its directory too).
pub async fn create(path: &Path, format: DriveFormat, size: u64) -> Result<(), ApiError> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)
            .map_err(|e| ApiError::internal(format!("creating {}: {e}", dir.display())))?;
    }
    let out = tokio::process::Command::new("qemu-img")
        .args(["create", "-q", "-f", format.as_str()])
        .arg(path)
        .arg(size.to_string())
        .output()
        .await
        .map_err(|e| ApiError::internal(format!("running qemu-img (package qemu-utils): {e}")))?;
    if !out.status.success() {
        let _ = std::fs::remove_file(path);
        return Err(ApiError::internal(format!(
            "qemu-img create {}: {}",
            path.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(())
}

/// Before `vm create`: every local drive's file exists, made now when the
/// drive gives a size. Returns the files made (removed again if the VM
/// does not start).
pub async fn ensure(cfg: &QemuConfig, spec: &VmSpec) -> Result<Vec<PathBuf>, ApiError> {
    let mut made = Vec::new();
    for (i, path, format) in files(cfg, spec) {
        if path.exists() {
            continue;
        }
        let Some(size) = spec.drives[i].size else {
            remove(&made);
            return Err(ApiError::invalid(
                &format!("drives[{i}].local"),
                format!(
                    "{} does not exist; give a size to create it",
                    path.display()
                ),
            ));
        };
        if let Err(e) = create(&path, format, size).await {
            remove(&made);
            return Err(e);
        }
        made.push(path);
    }
    Ok(made)
}

/// Removes `paths` and, when empty, their VM's directory (best effort).
pub fn remove(paths: &[PathBuf]) {
    for p in paths {
        match std::fs::remove_file(p) {
            Ok(()) => tracing::info!(file = %p.display(), "local disk removed"),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => tracing::warn!(file = %p.display(), error = %e, "removing a local disk"),
        }
        if let Some(dir) = p.parent() {
            let _ = std::fs::remove_dir(dir);
        }
    }
}

/// Beside a VM's local drives, `.incoming-ID.json` lists the files an
/// incoming shared-nothing migration `ID` made empty: they are removed with
/// the skeleton if it never runs (also by an agent restarted meanwhile, see
/// `recover`), and kept, as the VM's drives, once it runs.
pub fn partial_marker(cfg: &QemuConfig, vm: &str, id: &str) -> PathBuf {
    cfg.local_disks
        .join(vm)
        .join(format!(".incoming-{id}.json"))
}

/// Records `files` as partial copies (before any of them exists).
pub fn record_partial(marker: &Path, files: &[PathBuf]) -> std::io::Result<()> {
    if let Some(dir) = marker.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let text = serde_json::to_vec(files).map_err(std::io::Error::other)?;
    let tmp = marker.with_extension("tmp");
    std::fs::write(&tmp, text)?;
    std::fs::rename(tmp, marker)
}

/// The skeleton ran: its copies are the VM's drives now.
pub fn keep_partial(marker: &Path) {
    let _ = std::fs::remove_file(marker);
}

/// The skeleton never ran: removes the partial copies it recorded, then
/// the record.
pub fn remove_partial(marker: &Path) {
    let Ok(text) = std::fs::read(marker) else {
        return;
    };
    match serde_json::from_slice::<Vec<PathBuf>>(&text) {
        Ok(files) => remove(&files),
        Err(e) => {
            tracing::error!(file = %marker.display(), error = %e, "unreadable list of partial disks")
        }
    }
    keep_partial(marker);
    if let Some(dir) = marker.parent() {
        let _ = std::fs::remove_dir(dir);
    }
}

/// Skeleton `id` of VM `vm` never ran: removes the partial copies its
/// migration recorded (see [`partial_marker`]).
pub fn discard_partial(cfg: &QemuConfig, vm: &str, id: &str) {
    remove_partial(&partial_marker(cfg, vm, id));
}

/// The virtual size of the image at `path` (`qemu-img info`, read shared
/// with the QEMU that has it open).
pub async fn virtual_size(path: &Path) -> Result<u64, String> {
    let out = tokio::process::Command::new("qemu-img")
        .args(["info", "-U", "--output=json"])
        .arg(path)
        .output()
        .await
        .map_err(|e| format!("running qemu-img: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "qemu-img info {}: {}",
            path.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)
        .map_err(|e| format!("qemu-img info {}: {e}", path.display()))?;
    v["virtual-size"]
        .as_u64()
        .ok_or_else(|| format!("qemu-img info {}: no virtual-size", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partial_copies_are_removed_only_until_kept() {
        let root = std::env::temp_dir().join(format!("ferry-partial-{}", std::process::id()));
        let dir = root.join("vm1");
        std::fs::create_dir_all(&dir).unwrap();
        let (a, b) = (dir.join("a.qcow2"), dir.join("b.raw"));
        let marker = dir.join(".incoming-1.json");
        record_partial(&marker, std::slice::from_ref(&a)).unwrap();
        for f in [&a, &b] {
            std::fs::write(f, b"x").unwrap();
        }
        remove_partial(&marker);
        assert!(!a.exists() && b.exists() && !marker.exists());
        record_partial(&marker, std::slice::from_ref(&b)).unwrap();
        keep_partial(&marker);
        remove_partial(&marker);
        assert!(b.exists(), "a kept copy is the VM's drive");
        std::fs::remove_file(&b).unwrap();
        record_partial(&marker, std::slice::from_ref(&b)).unwrap();
        remove_partial(&marker);
        assert!(!dir.exists(), "an emptied directory goes too");
        std::fs::remove_dir_all(&root).unwrap();
    }
}
