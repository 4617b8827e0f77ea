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
//!
//! The target's directory also holds `dh-params.pem`, RFC 7919's `ffdhe2048`
//! group ([`DH_PARAMS`]). A `tls-creds-psk` server without that file has QEMU
//! generate 2048-bit Diffie-Hellman parameters at `object-add`: a prime search
//! of 0.06–0.65 s on the target's CPU at the start of every move, for a file
//! TLS 1.3's PSK exchange (named groups) never uses. Where the CPU has AES,
//! both QEMUs' credentials put AES-GCM before ChaCha20-Poly1305 ([`priority`]).

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
/// RFC 7919's `ffdhe2048` group in PKCS#3 PEM: public, fixed parameters that
/// spare the target QEMU generating its own (see the module text).
pub const DH_PARAMS: &str = "-----BEGIN DH PARAMETERS-----
MIIBCAKCAQEA//////////+t+FRYortKmq/cViAnPTzx2LnFg84tNpWp4TZBFGQz
+8yTnc4kmz75fS/jY2MMddj2gbICrsRhetPfHtXV/WVhJDP1H18GbtCFY2VVPe0a
87VXE15/V8k1mE8McODmi3fipona8+/och3xWKE2rec1MKzKT0g6eXq8CrGCsyT7
YdEIqUuyyOP7uWrat2DX9GgdT0Kj3jlN9K5W7edjcrsZCwenyO4KbXCeAvzhzffi
7MA0BM0oNC9hkXL+nOmFg/+OTxIy7vKBg8P+OxtMb61zO7X8vC7CIAXFjvGDfRaD
ssbzSibBsu/6iGtCOGEoXJf//////////wIBAg==
-----END DH PARAMETERS-----
";

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

/// AES-GCM first, ChaCha20-Poly1305 moved to the end (GnuTLS priority syntax).
pub const AES_FIRST: &str = "NORMAL:-CHACHA20-POLY1305:+CHACHA20-POLY1305";

/// The GnuTLS priority of both QEMUs' credentials on this host: [`AES_FIRST`]
/// where the CPU has AES and carry-less multiply instructions, else `None`
/// (QEMU's default). On a virtual CPU with AES-NI, QEMU's default (GnuTLS
/// 3.7) negotiated ChaCha20-Poly1305 for a migration and took 2.1 × the time
/// and 2.2 × the target's CPU of AES-GCM (BENCHMARKS, "QEMU's TLS: DH
/// parameters and AES-GCM"). ChaCha20 stays offered, last.
pub fn priority() -> Option<&'static str> {
    cpu_has_fast_aes().then_some(AES_FIRST)
}

fn cpu_has_fast_aes() -> bool {
    #[cfg(target_arch = "x86_64")]
    return std::arch::is_x86_feature_detected!("aes")
        && std::arch::is_x86_feature_detected!("pclmulqdq");
    #[cfg(target_arch = "aarch64")]
    return std::arch::is_aarch64_feature_detected!("aes")
        && std::arch::is_aarch64_feature_detected!("pmull");
    #[allow(unreachable_code)]
    false
}

/// Writes the key file (and, for the server, the DH parameters), mode 0600
/// in a 0700 directory, owned by `owner` (the VM's QEMU user) when QEMU runs
/// confined.
fn write_key(
    vm_dir: &Path,
    key: &[u8; 32],
    end: End,
    owner: Option<(u32, u32)>,
) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
    let dir = psk_dir(vm_dir);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::DirBuilder::new().mode(0o700).create(&dir)?;
    if let Some((uid, gid)) = owner {
        std::os::unix::fs::chown(&dir, Some(uid), Some(gid))?;
    }
    let line = psk_line(key);
    let mut files = vec![("keys.psk", line.as_str())];
    if end == End::Server {
        files.push(("dh-params.pem", DH_PARAMS));
    }
    for (name, text) in files {
        let path = dir.join(name);
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)?;
        f.write_all(text.as_bytes())?;
        if let Some((uid, gid)) = owner {
            std::os::unix::fs::chown(&path, Some(uid), Some(gid))?;
        }
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
    write_key(vm_dir, key, end, owner).map_err(|e| format!("writing the move's TLS key: {e}"))?;
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
    if let Some(p) = priority() {
        creds["priority"] = p.into();
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
        write_key(dir.path(), &[7; 32], End::Client, Some((4242, 4343))).unwrap();
        let d = std::fs::metadata(psk_dir(dir.path())).unwrap();
        let f = std::fs::metadata(psk_dir(dir.path()).join("keys.psk")).unwrap();
        assert_eq!(d.permissions().mode() & 0o777, 0o700);
        assert_eq!(f.permissions().mode() & 0o777, 0o600);
        assert_eq!((f.uid(), f.gid()), (4242, 4343));
        // a second move replaces it
        write_key(dir.path(), &[8; 32], End::Client, None).unwrap();
        let text = std::fs::read_to_string(psk_dir(dir.path()).join("keys.psk")).unwrap();
        assert_eq!(text, psk_line(&[8; 32]));
        // only the server end has DH parameters
        assert!(!psk_dir(dir.path()).join("dh-params.pem").exists());
    }

    #[test]
    fn aes_gcm_comes_first_exactly_where_the_cpu_has_aes() {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let flags: Vec<&str> = cpuinfo
            .lines()
            .find(|l| l.starts_with("flags") || l.starts_with("Features"))
            .map(|l| l.split_whitespace().collect())
            .unwrap_or_default();
        let has = |f: &str| flags.contains(&f);
        let fast = has("aes") && (has("pclmulqdq") || has("pmull"));
        assert_eq!(priority(), fast.then_some(AES_FIRST), "flags: {flags:?}");
    }

    #[test]
    fn the_server_gets_rfc_7919_ffdhe2048_not_a_prime_to_search_for() {
        use base64::Engine;
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        write_key(dir.path(), &[7; 32], End::Server, None).unwrap();
        let pem = psk_dir(dir.path()).join("dh-params.pem");
        assert_eq!(std::fs::read_to_string(&pem).unwrap(), DH_PARAMS);
        assert_eq!(
            std::fs::metadata(&pem).unwrap().permissions().mode() & 0o777,
            0o600
        );
        // PKCS#3: SEQUENCE { INTEGER p, INTEGER g }
        let b64: String = DH_PARAMS
            .lines()
            .filter(|l| !l.starts_with("-----"))
            .collect();
        let der = base64::engine::general_purpose::STANDARD
            .decode(b64)
            .unwrap();
        assert_eq!(&der[..4], &[0x30, 0x82, 0x01, 0x08]);
        assert_eq!(&der[4..8], &[0x02, 0x82, 0x01, 0x01]);
        let p = &der[9..9 + 256];
        assert_eq!(der[8], 0, "p is positive");
        // RFC 7919 A.1: p = 2^2048 - 2^1984 + {[2^1918 * e] + 560316} * 2^64 + 2^64 - 1
        assert_eq!(&p[..8], &[0xff; 8]);
        assert_eq!(&p[8..16], &[0xad, 0xf8, 0x54, 0x58, 0xa2, 0xbb, 0x4a, 0x9a]);
        assert_eq!(&p[248..], &[0xff; 8]);
        assert_eq!(
            &p[240..248],
            &[0x88, 0x6b, 0x42, 0x38, 0x61, 0x28, 0x5c, 0x97]
        );
        assert_eq!(&der[9 + 256..], &[0x02, 0x01, 0x02], "g = 2");
    }
}
