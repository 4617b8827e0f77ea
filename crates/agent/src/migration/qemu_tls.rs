//! QEMU's own TLS on the paths where QEMU's bytes leave the host as QEMU
//! wrote them: `tcp` (one stream or QEMU's multifd channels), `mptcp`
//! (the authenticated MPTCP socket handed to QEMU) and `mptcp-relay`.
//! Ferry's own carriers seal their frames instead (`ferry_transport::seal`).
//!
//! Both QEMUs get `tls-creds-psk` credentials whose pre-shared key is
//! derived from the move's session key (HKDF-SHA256, info
//! [`PSK_INFO`]): a key no other move shares, that crossed the network only
//! inside the agents' mutual TLS (`POST /incoming`). TLS 1.3's handshake
//! brings a fresh random from each side, so no recorded connection replays,
//! and a peer without the key gets no channel. Post-copy's recovery stream
//! uses the same credentials while they are in place.
//!
//! The key file lives in the VM's own directory, readable only by the VM's
//! QEMU user: on the source QEMU reads it once, at `object-add`, and it is
//! removed at once; on the target QEMU reads it at each handshake, so it
//! stays until the move ends ([`disarm`]).

use std::path::{Path, PathBuf};

use ferry_api::util::hex;
use hkdf::Hkdf;
use sha2::Sha256;

use crate::qmp::{MigrationParameters, Qmp, QmpError};

/// The id of the migration TLS credentials in each QEMU.
pub const TLS_ID: &str = "ferry-migration-tls";
/// The PSK identity both QEMUs use.
pub const PSK_USER: &str = "ferry";
/// HKDF info of the PSK (distinct from the carriers' seal keys).
pub const PSK_INFO: &[u8] = b"ferry qemu-tls psk v1";
/// The directory, in a VM's directory, of its `keys.psk`.
const PSK_DIR: &str = "migration-tls";

/// Which end of the TLS connection a QEMU is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum End {
    /// The source QEMU, which dials.
    Client,
    /// The target QEMU, which listens.
    Server,
}

/// The PSK of a move with session key `key`.
pub fn psk(key: &[u8; 32]) -> [u8; 32] {
    let mut k = [0u8; 32];
    Hkdf::<Sha256>::new(None, key)
        .expand(PSK_INFO, &mut k)
        .unwrap_or_else(|_| unreachable!("32 bytes is a valid HKDF-SHA256 length"));
    k
}

/// The line of QEMU's `keys.psk` (`identity:hex`).
pub fn psk_line(key: &[u8; 32]) -> String {
    format!("{PSK_USER}:{}\n", hex(&psk(key)))
}

fn psk_dir(vm_dir: &Path) -> PathBuf {
    vm_dir.join(PSK_DIR)
}

/// Writes the key file, mode 0600 in a 0700 directory, owned by `owner`
/// (the VM's QEMU user) when QEMU runs confined.
fn write_key(vm_dir: &Path, key: &[u8; 32], owner: Option<(u32, u32)>) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
    let dir = psk_dir(vm_dir);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::DirBuilder::new().mode(0o700).create(&dir)?;
    let path = dir.join("keys.psk");
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)?;
    f.write_all(psk_line(key).as_bytes())?;
    if let Some((uid, gid)) = owner {
        std::os::unix::fs::chown(&dir, Some(uid), Some(gid))?;
        std::os::unix::fs::chown(&path, Some(uid), Some(gid))?;
    }
    Ok(())
}

/// Gives `qmp`'s QEMU the move's TLS credentials and makes every migration
/// channel use them.
pub async fn arm(
    qmp: &Qmp,
    vm_dir: &Path,
    key: &[u8; 32],
    end: End,
    owner: Option<(u32, u32)>,
) -> Result<(), String> {
    write_key(vm_dir, key, owner).map_err(|e| format!("writing the move's TLS key: {e}"))?;
    // a previous move's credentials, if one ended without its cleanup
    let _ = qmp.object_del(TLS_ID).await;
    let mut creds = serde_json::json!({
        "qom-type": "tls-creds-psk",
        "id": TLS_ID,
        "endpoint": match end { End::Client => "client", End::Server => "server" },
        "dir": psk_dir(vm_dir).display().to_string(),
    });
    if end == End::Client {
        creds["username"] = PSK_USER.into();
    }
    let armed = async {
        qmp.object_add(creds).await?;
        qmp.set_parameters(MigrationParameters {
            tls_creds: Some(TLS_ID.into()),
            ..Default::default()
        })
        .await
    };
    let r = armed.await.map_err(|e: QmpError| {
        format!(
            "QEMU refused the move's TLS credentials: {}",
            ferry_api::util::error_chain(&e)
        )
    });
    if end == End::Client || r.is_err() {
        // the client read its key at object-add; nothing reads it again
        let _ = std::fs::remove_dir_all(psk_dir(vm_dir));
    }
    r
}

/// No TLS on `qmp`'s next migration channels (a move over sealed carriers,
/// or one the cluster lets go in clear): QEMU keeps the last parameters set.
pub async fn clear(qmp: &Qmp) -> Result<(), QmpError> {
    qmp.set_parameters(MigrationParameters {
        tls_creds: Some(String::new()),
        ..Default::default()
    })
    .await
}

/// The move is over: its credentials leave QEMU and its key file the disk.
pub async fn disarm(qmp: &Qmp, vm_dir: &Path) {
    let _ = clear(qmp).await;
    let _ = qmp.object_del(TLS_ID).await;
    let _ = std::fs::remove_dir_all(psk_dir(vm_dir));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_move_key_gives_its_own_psk_never_the_key_itself() {
        let (a, b) = ([1u8; 32], [2u8; 32]);
        assert_ne!(psk(&a), psk(&b));
        assert_ne!(psk(&a), a);
        assert_eq!(psk(&a), psk(&a));
        let line = psk_line(&a);
        assert!(line.starts_with("ferry:") && line.ends_with('\n'));
        assert_eq!(line.trim().len(), "ferry:".len() + 64);
    }

    #[test]
    fn the_key_file_is_private_to_its_owner() {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        let dir = tempfile::tempdir().unwrap();
        write_key(dir.path(), &[7; 32], Some((4242, 4343))).unwrap();
        let d = std::fs::metadata(psk_dir(dir.path())).unwrap();
        let f = std::fs::metadata(psk_dir(dir.path()).join("keys.psk")).unwrap();
        assert_eq!(d.permissions().mode() & 0o777, 0o700);
        assert_eq!(f.permissions().mode() & 0o777, 0o600);
        assert_eq!((f.uid(), f.gid()), (4242, 4343));
        // a second move replaces it
        write_key(dir.path(), &[8; 32], None).unwrap();
        let text = std::fs::read_to_string(psk_dir(dir.path()).join("keys.psk")).unwrap();
        assert_eq!(text, psk_line(&[8; 32]));
    }
}
