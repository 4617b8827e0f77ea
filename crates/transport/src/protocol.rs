//! Ferry transport protocol, version 1 — the wire format, written as a spec.
//!
//! ## Connections
//! A *session* carries one migration between a source agent and a target
//! agent. The source opens one *carrier* (a TCP connection) per NIC, bound
//! to that NIC's address, to the target's per-session listener on the same
//! fabric. Every carrier starts with a handshake; then both directions carry
//! frames. A carrier that dies is re-opened with the same session id and
//! carrier index when its link returns.
//!
//! ## Handshake (all integers little endian)
//! ```text
//! Hello (source → target), 80 bytes
//!   0  [8]  magic "FERRYTP1"
//!   8  u16  version = 1
//!  10  u8   role: 1 = carrier, 2 = spliced stream (0 is reserved as invalid)
//!  11  u8   carrier: the carrier index (< MAX_CARRIERS); spliced stream:
//!           the stream index (< MAX_STREAMS)
//!  12  u32  flags: bit 0 SEALED (every frame of this connection is
//!           sealed, see below; carriers only); other bits 0
//!  16  [16] session id
//!  32  [16] nonce (random per connection)
//!  48  [32] HMAC-SHA256(cluster credential, "ferry-transport hello" ‖ bytes 0..48)
//! Welcome (target → source), 80 bytes
//!   0  [8]  magic "FERRYTP1"
//!   8  u16  version = 2
//!  10  u8   status: 0 ok, 1 bad version, 2 bad credential, 3 unknown session, 4 too many carriers
//!           (or streams),
//!           5 sealing differs (the Hello's SEALED flag is not the session's),
//!           6 replayed (this Hello's nonce was already used in this session)
//!  11  u8   features the target accepts (status 0 only; bits unknown to
//!           the source are ignored): bit 0 ZSTD (DATA frames may be zstd
//!           frames); bit 1 SEALED_UNCHECKED (the target does not check the
//!           CRC of sealed frames, so the source may leave it 0); other bits 0
//!  12  [4]  reserved, 0
//!  16  [16] the Hello's nonce
//!  32  [16] the target's nonce (status 0 only: random per connection)
//!  48  [32] HMAC-SHA256(session key, "ferry-transport welcome" ‖ bytes 0..48)
//! Confirm (source → target, after a status-0 Welcome), 32 bytes
//!   0  [32] HMAC-SHA256(session key, "ferry-transport confirm" ‖ the Hello's
//!           80 bytes ‖ the Welcome's bytes 0..48)
//! ```
//! The *session key* is the move's own: 32 random bytes the source agent
//! makes for each migration and hands the target in its authenticated
//! `/incoming` call (mutual TLS between the agents), never a cluster-wide
//! secret. Both sides add a fresh nonce, so a recorded Hello replayed to the
//! target gets a Welcome with a new target nonce that the replayer cannot
//! Confirm; the target also refuses, with status 6, any Hello whose nonce
//! the session has already seen, and logs it. The target starts nothing
//! (no carrier attached, no stream handed to QEMU) before the Confirm checks.
//! A *spliced stream* (the MPTCP carrier kind, see `mptcp.rs`) is one
//! MPTCP connection per QEMU connection: after the Welcome it carries that
//! connection's bytes as they are, both ways, and ends with it. No frames
//! follow on it; the kernel's subflows carry it over every NIC. Relayed
//! (`mptcp-relay`), each end is an agent copying to and from QEMU; handed
//! off (`mptcp`), there is one stream, index 0, and after the Welcome each
//! agent gives the socket to its QEMU. Status 4 also refuses a second
//! stream into a handed-off session.
//!
//! The target answers a Hello whose HMAC is wrong with status 2 and closes,
//! without a MAC of its own; the source checks the Welcome's MAC and the
//! target the Confirm, so both ends prove they hold the session key, on this
//! connection.
//!
//! ## Frames, 32-byte header then `len` payload bytes
//! ```text
//!   0  u8   kind: 1 DATA, 2 ACK, 3 OPEN, 4 FIN, 5 PING, 6 WINDOW (0 is reserved as invalid)
//!   1  u8   flags: bit 0 LZ4 (DATA only: the payload is an LZ4 block);
//!           bit 1 SEALED (every frame of a sealed connection, none of another);
//!           bit 2 ZSTD (DATA only: the payload is one zstd frame; only to a
//!           target whose Welcome set feature ZSTD); LZ4 and ZSTD never
//!           both; other bits 0
//!   2  u16  stream (< MAX_STREAMS)
//!   4  u32  len: payload bytes; ≤ MAX_PAYLOAD for DATA, 0 for every other kind
//!           (sealed: TAG_LEN more, the tag ending the payload)
//!   8  u64  id: DATA/OPEN/FIN: frame id (per direction, from 1, for diagnostics);
//!           ACK: how many DATA/OPEN/FIN frames this carrier connection has received;
//!           PING: sender's counter; WINDOW: 0
//!  16  u64  offset: DATA: the payload's offset in its stream; FIN: the stream's length;
//!           ACK and PING: the sender's spare CPU (below), 0 if not reported;
//!           WINDOW: how many bytes of `stream` the target's local reader has taken
//!  24  u32  CRC-32C of bytes 0..24 and the payload (sealed: see below)
//!  28  u32  raw_len: with LZ4 or ZSTD, the payload's length once decompressed
//!           (1..=MAX_PAYLOAD; the receiver refuses a payload that does not
//!           decompress to exactly this); without, 0
//! ```
//! Compression is the sender's choice per frame (see `compress.rs`); `offset`
//! and stream lengths always count uncompressed bytes. The CRC covers the
//! payload as sent. An ACK's or PING's spare CPU tells the sender what the
//! receiver could spend on decompressing: bits 0..16 are 1 + the share of
//! all its CPUs idle over the last quarter second, in thousandths (1..=1001),
//! bits 16..32 its number of CPUs; higher bits 0. A receiver that does not
//! understand it ignores it.
//!
//! ## Stream windows
//! A session's agents may agree, outside this protocol (the migration
//! request's `stream_windows`), that the target reports what its local
//! reader takes: then, on every carrier, the target sends a WINDOW frame for
//! each stream whose count grew since that carrier last reported it (and
//! every count again on a new carrier). The count is what the local reader
//! has read: the bytes written to it less those still unread in its
//! connection. Counts are cumulative and never go
//! down; a lost or late WINDOW is superseded by the next. The source reads
//! no more of a stream from its local end while what it has read and the
//! target has not taken, counted expanded (each byte × what it stands for
//! once loaded: QEMU compressed its pages), is [`STREAM_WINDOW`] or more
//! (a source may narrow it, down to [`MIN_STREAM_WINDOW`], for the end of
//! a migration; the target sees no difference).
//! Each stream has its own window, so one stream its reader is not reading
//! (QEMU's multifd channels wait for each other at sync points) never holds
//! back another. Without the agreement no WINDOW is sent; a WINDOW from the
//! source is a protocol error. This bounds what is still to load on the
//! target when the source QEMU pauses: the switch-over does not wait for a
//! backlog of compressed pages.
//!
//! ## Sealed connections (the default: the cluster's `encryption`)
//! Every frame's payload (compressed first, if it is) is encrypted with
//! AES-256-GCM and followed by its 16-byte tag; the tag also authenticates
//! header bytes 0..24 and 28..32 (all but the CRC). One key per connection
//! and direction: HKDF-SHA256 of the session key, salt = session id ‖ the
//! Hello's nonce ‖ the Welcome's target nonce (both random per connection),
//! info = "ferry-transport seal v2" ‖ direction (1 source → target, 2 target
//! → source) ‖ carrier index.
//! The tag is the check of a sealed frame: a receiver does not check its
//! CRC (a frame corrupted in transit fails to open, and the carrier is
//! closed as on a bad CRC). A target says so in its Welcome
//! (SEALED_UNCHECKED), and a source then leaves the CRC of its frames 0
//! rather than compute a second pass over every byte; a target still
//! fills in the CRC of its own frames, for sources that check it.
//! The 96-bit nonce is 4 zero bytes ‖ the u64 count of frames sealed in that
//! direction of the connection, so no nonce repeats under a key and a frame
//! dropped, replayed or moved inside a connection does not open. ACK and PING
//! are sealed too: a forged ACK could otherwise release frames never
//! received. See `seal.rs`.
//! DATA, OPEN and FIN are *reliable*: each is sent on one carrier and kept in
//! the sender's replay buffer until that carrier's ACK count covers it (TCP
//! keeps a carrier's frames in order, so a count suffices; a receiver may
//! let one ACK cover several frames, and acknowledges within 20 ms of a
//! frame's arrival, an OPEN or FIN at once); if the carrier
//! dies first it is sent again on another. The receiver puts each stream back in order by offset and
//! drops what it already has, so a stream's bytes arrive once, in order.
//! OPEN announces a stream (the target connects it to QEMU); FIN ends one.
//! Every side sends something on every carrier at least every
//! [`HEARTBEAT`]; a carrier silent for [`DEAD_AFTER`] is dead.
//!
//! Anything that breaks these rules — bad magic, version, kind, flags, size,
//! CRC — is a [`ProtocolError`]; the carrier is closed and its frames resent
//! elsewhere, so a corrupted frame never reaches QEMU.

use std::time::Duration;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use hmac::{Hmac, Mac};
use sha2::Sha256;

pub const MAGIC: &[u8; 8] = b"FERRYTP1";
pub const VERSION: u16 = 2;
pub const HELLO_LEN: usize = 80;
pub const WELCOME_LEN: usize = 80;
pub const CONFIRM_LEN: usize = 32;
pub const HEADER_LEN: usize = 32;
/// Largest DATA payload.
pub const MAX_PAYLOAD: usize = 256 << 10;
/// Bytes of one stream, counted expanded, the source may have read and the
/// target not yet taken when the session has stream windows (see "Stream
/// windows"): with QEMU's pages loading at ~500 MB/s, ~8 ms of loading.
pub const STREAM_WINDOW: u64 = 4 << 20;
/// The narrowest a source may make a stream's window for the end of a
/// migration (`Session::set_stream_window`).
pub const MIN_STREAM_WINDOW: u64 = 256 << 10;
pub const MAX_CARRIERS: u8 = 16;
pub const MAX_STREAMS: u16 = 64;
pub const HEARTBEAT: Duration = Duration::from_millis(100);
pub const DEAD_AFTER: Duration = Duration::from_millis(500);
/// Frame flag: the DATA payload is an LZ4 block of `raw_len` bytes.
pub const FLAG_LZ4: u8 = 1;
/// Frame flag: the payload is sealed (ciphertext ‖ tag).
pub const FLAG_SEALED: u8 = 2;
/// Frame flag: the DATA payload is one zstd frame of `raw_len` bytes.
pub const FLAG_ZSTD: u8 = 4;
/// Welcome feature: the target decompresses zstd frames.
pub const FEATURE_ZSTD: u8 = 1;
/// Welcome feature: the target does not check the CRC of sealed frames
/// (their tag authenticates everything the CRC covers), so the source may
/// leave it 0.
pub const FEATURE_SEALED_UNCHECKED: u8 = 2;
/// Hello roles: a carrier of frames; one spliced stream.
pub const ROLE_CARRIER: u8 = 1;
pub const ROLE_SPLICED: u8 = 2;
/// Hello flag: the connection's frames are sealed.
pub const HELLO_SEALED: u32 = 1;
/// Bytes of a sealed frame's tag.
pub const TAG_LEN: usize = 16;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtocolError {
    #[error("Bad magic: not a Ferry transport peer")]
    BadMagic,
    #[error("Unsupported protocol version {0} (this side speaks {VERSION})")]
    BadVersion(u16),
    #[error("Invalid role {0}")]
    BadRole(u8),
    #[error("Carrier index {0} is not below {MAX_CARRIERS}")]
    BadCarrier(u8),
    #[error("Peer refused the handshake: {0}")]
    Refused(&'static str),
    #[error("Peer failed authentication with the session key")]
    BadCredential,
    #[error("Replayed Hello: its nonce was already used in this session")]
    Replayed,
    #[error("Source did not confirm the handshake with the session key")]
    BadConfirm,
    #[error("Unknown frame kind {0}")]
    BadKind(u8),
    #[error("Reserved field {0} is not zero")]
    Reserved(&'static str),
    #[error("Stream {0} is not below {MAX_STREAMS}")]
    BadStream(u16),
    #[error("Frame length {len} is over {max} for {kind:?}")]
    BadLength { kind: Kind, len: u32, max: u32 },
    #[error("Frame checksum mismatch: corrupted in transit")]
    BadChecksum,
    #[error("Unknown frame flags {0:#04x}")]
    BadFlags(u8),
    #[error("Compressed frame: raw length {0} is not 1..=MAX_PAYLOAD")]
    BadRawLength(u32),
    #[error("Compressed frame does not decompress to its raw length: {0}")]
    BadCompression(String),
    #[error("Frame {0} on a connection that is {1}")]
    SealingDiffers(&'static str, &'static str),
    #[error("Sealed frame does not open: forged, corrupted, replayed or out of order")]
    BadSeal,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Data = 1,
    Ack = 2,
    Open = 3,
    Fin = 4,
    Ping = 5,
    Window = 6,
}

impl Kind {
    fn from_u8(v: u8) -> Result<Kind, ProtocolError> {
        Ok(match v {
            1 => Kind::Data,
            2 => Kind::Ack,
            3 => Kind::Open,
            4 => Kind::Fin,
            5 => Kind::Ping,
            6 => Kind::Window,
            v => return Err(ProtocolError::BadKind(v)),
        })
    }
}

/// Handshake statuses.
pub const STATUS_OK: u8 = 0;
pub const STATUS_BAD_VERSION: u8 = 1;
pub const STATUS_BAD_CREDENTIAL: u8 = 2;
pub const STATUS_UNKNOWN_SESSION: u8 = 3;
pub const STATUS_TOO_MANY: u8 = 4;
pub const STATUS_SEALING: u8 = 5;
pub const STATUS_REPLAYED: u8 = 6;

fn status_text(s: u8) -> &'static str {
    match s {
        STATUS_BAD_VERSION => "unsupported version",
        STATUS_BAD_CREDENTIAL => "wrong session key",
        STATUS_UNKNOWN_SESSION => "unknown session",
        STATUS_TOO_MANY => "too many carriers",
        STATUS_SEALING => "carrier encryption differs between the two agents",
        STATUS_REPLAYED => "replayed hello",
        _ => "unknown status",
    }
}

fn mac(secret: &[u8], label: &[u8], data: &[u8]) -> [u8; 32] {
    // HMAC accepts keys of any length
    let mut m = <Hmac<Sha256> as Mac>::new_from_slice(secret).unwrap_or_else(|_| unreachable!());
    m.update(label);
    m.update(data);
    m.finalize().into_bytes().into()
}

fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    /// [`ROLE_CARRIER`] or [`ROLE_SPLICED`].
    pub role: u8,
    /// The carrier index, or a spliced stream's index.
    pub carrier: u8,
    pub session: [u8; 16],
    pub nonce: [u8; 16],
    /// The connection's frames are sealed.
    pub sealed: bool,
}

impl Hello {
    pub fn encode(&self, secret: &[u8]) -> [u8; HELLO_LEN] {
        let mut b = [0u8; HELLO_LEN];
        b[0..8].copy_from_slice(MAGIC);
        b[8..10].copy_from_slice(&VERSION.to_le_bytes());
        b[10] = self.role;
        b[11] = self.carrier;
        if self.sealed {
            b[12..16].copy_from_slice(&HELLO_SEALED.to_le_bytes());
        }
        b[16..32].copy_from_slice(&self.session);
        b[32..48].copy_from_slice(&self.nonce);
        let m = mac(secret, b"ferry-transport hello", &b[0..48]);
        b[48..80].copy_from_slice(&m);
        b
    }

    /// Checks a Hello; on error also returns the status to answer with.
    pub fn decode(b: &[u8; HELLO_LEN], secret: &[u8]) -> Result<Hello, (ProtocolError, u8)> {
        if &b[0..8] != MAGIC {
            return Err((ProtocolError::BadMagic, STATUS_BAD_VERSION));
        }
        let version = u16::from_le_bytes([b[8], b[9]]);
        if version != VERSION {
            return Err((ProtocolError::BadVersion(version), STATUS_BAD_VERSION));
        }
        if !ct_eq(
            &mac(secret, b"ferry-transport hello", &b[0..48]),
            &b[48..80],
        ) {
            return Err((ProtocolError::BadCredential, STATUS_BAD_CREDENTIAL));
        }
        let role = b[10];
        let limit = match role {
            ROLE_CARRIER => MAX_CARRIERS as u16,
            ROLE_SPLICED => MAX_STREAMS,
            r => return Err((ProtocolError::BadRole(r), STATUS_BAD_VERSION)),
        };
        if b[11] as u16 >= limit {
            return Err((ProtocolError::BadCarrier(b[11]), STATUS_TOO_MANY));
        }
        let flags = u32::from_le_bytes([b[12], b[13], b[14], b[15]]);
        let allowed = if role == ROLE_CARRIER {
            HELLO_SEALED
        } else {
            0
        };
        if flags & !allowed != 0 {
            return Err((ProtocolError::Reserved("hello"), STATUS_BAD_VERSION));
        }
        let mut session = [0u8; 16];
        session.copy_from_slice(&b[16..32]);
        let mut nonce = [0u8; 16];
        nonce.copy_from_slice(&b[32..48]);
        Ok(Hello {
            role,
            carrier: b[11],
            session,
            nonce,
            sealed: flags & HELLO_SEALED != 0,
        })
    }
}

/// The target's answer: `features` ([`FEATURE_ZSTD`]) and the target's
/// own `answer` nonce only with status 0, whose answer alone carries a MAC.
pub fn encode_welcome(
    status: u8,
    features: u8,
    nonce: &[u8; 16],
    answer: &[u8; 16],
    secret: &[u8],
) -> [u8; WELCOME_LEN] {
    let mut b = [0u8; WELCOME_LEN];
    b[0..8].copy_from_slice(MAGIC);
    b[8..10].copy_from_slice(&VERSION.to_le_bytes());
    b[10] = status;
    b[16..32].copy_from_slice(nonce);
    if status == STATUS_OK {
        b[11] = features;
        b[32..48].copy_from_slice(answer);
        let m = mac(secret, b"ferry-transport welcome", &b[0..48]);
        b[48..80].copy_from_slice(&m);
    }
    b
}

/// Checks the target's answer to our Hello with `nonce`; returns the
/// features it accepts and the target's nonce.
pub fn decode_welcome(
    b: &[u8; WELCOME_LEN],
    nonce: &[u8; 16],
    secret: &[u8],
) -> Result<(u8, [u8; 16]), ProtocolError> {
    if &b[0..8] != MAGIC {
        return Err(ProtocolError::BadMagic);
    }
    let version = u16::from_le_bytes([b[8], b[9]]);
    if version != VERSION {
        return Err(ProtocolError::BadVersion(version));
    }
    if b[10] != STATUS_OK {
        return Err(ProtocolError::Refused(status_text(b[10])));
    }
    if &b[16..32] != nonce
        || !ct_eq(
            &mac(secret, b"ferry-transport welcome", &b[0..48]),
            &b[48..80],
        )
    {
        return Err(ProtocolError::BadCredential);
    }
    let mut answer = [0u8; 16];
    answer.copy_from_slice(&b[32..48]);
    Ok((b[11], answer))
}

/// The source's Confirm of one handshake: proof, bound to both nonces, that
/// it holds the session key on this connection (see "Handshake").
pub fn confirm(
    secret: &[u8],
    hello: &[u8; HELLO_LEN],
    welcome: &[u8; WELCOME_LEN],
) -> [u8; CONFIRM_LEN] {
    let mut data = [0u8; HELLO_LEN + 48];
    data[..HELLO_LEN].copy_from_slice(hello);
    data[HELLO_LEN..].copy_from_slice(&welcome[..48]);
    mac(secret, b"ferry-transport confirm", &data)
}

/// Target: checks the source's Confirm.
pub fn check_confirm(
    secret: &[u8],
    hello: &[u8; HELLO_LEN],
    welcome: &[u8; WELCOME_LEN],
    got: &[u8; CONFIRM_LEN],
) -> Result<(), ProtocolError> {
    if ct_eq(&confirm(secret, hello, welcome), got) {
        Ok(())
    } else {
        Err(ProtocolError::BadConfirm)
    }
}

/// The Hello nonces a session has accepted: a nonce seen once is a replay
/// the second time. Sessions are short and take a handful of connections;
/// past [`Nonces::LIMIT`] nonces every Hello is refused as a replay (a peer
/// dialling that often is not a migration).
#[derive(Debug, Default)]
pub struct Nonces(std::sync::Mutex<std::collections::HashSet<[u8; 16]>>);

impl Nonces {
    pub const LIMIT: usize = 4096;

    /// True the first time `nonce` is seen (and it is remembered).
    pub fn first_use(&self, nonce: &[u8; 16]) -> bool {
        let mut seen = self.0.lock().unwrap_or_else(|p| p.into_inner());
        seen.len() < Self::LIMIT && seen.insert(*nonce)
    }
}

/// How a DATA payload is packed on the wire (the level a sender compressed
/// at is its own business: the receiver needs only the format).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Packing {
    #[default]
    Plain,
    Lz4,
    Zstd,
}

impl Packing {
    fn flag(self) -> u8 {
        match self {
            Packing::Plain => 0,
            Packing::Lz4 => FLAG_LZ4,
            Packing::Zstd => FLAG_ZSTD,
        }
    }
}

/// A sender's spare CPU as an ACK or PING carries it in `offset`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SpareCpu {
    /// Share of all CPUs idle, 0..=1.
    pub idle: f64,
    pub cpus: u16,
}

impl SpareCpu {
    pub fn encode(&self) -> u64 {
        let permille = (self.idle.clamp(0.0, 1.0) * 1000.0).round() as u64;
        (permille + 1) | (u64::from(self.cpus) << 16)
    }

    /// `None` for 0 (not reported) or anything out of range.
    pub fn decode(v: u64) -> Option<SpareCpu> {
        let permille = v & 0xffff;
        let cpus = (v >> 16) & 0xffff;
        if permille == 0 || permille > 1001 || cpus == 0 || v >> 32 != 0 {
            return None;
        }
        Some(SpareCpu {
            idle: (permille - 1) as f64 / 1000.0,
            cpus: cpus as u16,
        })
    }

    /// Idle CPUs (cores' worth).
    pub fn cores(&self) -> f64 {
        self.idle * f64::from(self.cpus)
    }
}

/// A decoded frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub kind: Kind,
    pub stream: u16,
    pub len: u32,
    pub id: u64,
    pub offset: u64,
    pub crc: u32,
    /// How a DATA payload is packed.
    pub packing: Packing,
    /// Compressed DATA: the length once decompressed; else 0.
    pub raw_len: u32,
    /// The payload is sealed (ciphertext ‖ tag).
    pub sealed: bool,
}

impl Header {
    pub fn new(kind: Kind, stream: u16, id: u64, offset: u64) -> Header {
        Header {
            kind,
            stream,
            len: 0,
            id,
            offset,
            crc: 0,
            packing: Packing::Plain,
            raw_len: 0,
            sealed: false,
        }
    }
}

/// Encodes a frame (header with its CRC, then the payload).
pub fn encode_frame(h: &Header, payload: &[u8], out: &mut BytesMut) {
    encode_header(h, payload, out);
    out.put_slice(payload);
}

/// Encodes only the header (its CRC covers `payload`), so the payload can be
/// written from where it already is.
pub fn encode_header(h: &Header, payload: &[u8], out: &mut BytesMut) {
    let mut head = header_bytes(h, payload.len());
    let crc = frame_crc(&head, payload);
    head[24..28].copy_from_slice(&crc.to_le_bytes());
    out.reserve(HEADER_LEN + payload.len());
    out.put_slice(&head);
}

/// The CRC-32C a frame's header carries: of its bytes 0..24, then the payload.
pub fn frame_crc(head: &[u8; HEADER_LEN], payload: &[u8]) -> u32 {
    crc32c::crc32c_append(crc32c::crc32c(&head[0..24]), payload)
}

/// A header's bytes for a payload of `len` bytes, CRC left 0.
pub fn header_bytes(h: &Header, len: usize) -> [u8; HEADER_LEN] {
    let mut head = [0u8; HEADER_LEN];
    head[0] = h.kind as u8;
    if h.packing != Packing::Plain {
        head[1] = h.packing.flag();
        head[28..32].copy_from_slice(&h.raw_len.to_le_bytes());
    }
    if h.sealed {
        head[1] |= FLAG_SEALED;
    }
    head[2..4].copy_from_slice(&h.stream.to_le_bytes());
    head[4..8].copy_from_slice(&(len as u32).to_le_bytes());
    head[8..16].copy_from_slice(&h.id.to_le_bytes());
    head[16..24].copy_from_slice(&h.offset.to_le_bytes());
    head
}

/// What a sealed frame's tag authenticates of its header: all but the CRC.
pub fn sealed_aad(head: &[u8; HEADER_LEN]) -> [u8; 28] {
    let mut a = [0u8; 28];
    a[..24].copy_from_slice(&head[..24]);
    a[24..].copy_from_slice(&head[28..32]);
    a
}

/// Decodes and validates a header (everything but the CRC, which needs the payload).
pub fn decode_header(b: &[u8; HEADER_LEN]) -> Result<Header, ProtocolError> {
    let mut r = &b[..];
    let kind = Kind::from_u8(r.get_u8())?;
    let flags = r.get_u8();
    let packing = match flags & (FLAG_LZ4 | FLAG_ZSTD) {
        0 => Packing::Plain,
        FLAG_LZ4 => Packing::Lz4,
        FLAG_ZSTD => Packing::Zstd,
        _ => return Err(ProtocolError::BadFlags(flags)),
    };
    if flags & !(FLAG_LZ4 | FLAG_ZSTD | FLAG_SEALED) != 0
        || (packing != Packing::Plain && kind != Kind::Data)
    {
        return Err(ProtocolError::BadFlags(flags));
    }
    let sealed = flags & FLAG_SEALED != 0;
    let stream = r.get_u16_le();
    let len = r.get_u32_le();
    let id = r.get_u64_le();
    let offset = r.get_u64_le();
    let crc = r.get_u32_le();
    let raw_len = r.get_u32_le();
    if packing == Packing::Plain && raw_len != 0 {
        return Err(ProtocolError::Reserved("header"));
    }
    if packing != Packing::Plain && (raw_len == 0 || raw_len as usize > MAX_PAYLOAD) {
        return Err(ProtocolError::BadRawLength(raw_len));
    }
    if stream >= MAX_STREAMS {
        return Err(ProtocolError::BadStream(stream));
    }
    let tag = if sealed { TAG_LEN as u32 } else { 0 };
    let max = if kind == Kind::Data {
        MAX_PAYLOAD as u32
    } else {
        0
    } + tag;
    // DATA carries bytes; OPEN, FIN, ACK and PING never do (but a tag)
    if len > max || (kind == Kind::Data && len <= tag) || (kind != Kind::Data && len != tag) {
        return Err(ProtocolError::BadLength { kind, len, max });
    }
    Ok(Header {
        kind,
        stream,
        len,
        id,
        offset,
        crc,
        packing,
        raw_len,
        sealed,
    })
}

/// The payload as the stream carries it: decompressed if the frame was
/// compressed, checked to be exactly `raw_len` bytes (never more is
/// allocated or written, whatever a hostile payload claims).
pub fn unpack_payload(h: &Header, payload: Bytes) -> Result<Bytes, ProtocolError> {
    let raw = match h.packing {
        Packing::Plain => return Ok(payload),
        Packing::Lz4 => lz4_flex::block::decompress(&payload, h.raw_len as usize)
            .map_err(|e| ProtocolError::BadCompression(e.to_string()))?,
        Packing::Zstd => zstd_decompress(&payload, h.raw_len as usize)
            .map_err(|e| ProtocolError::BadCompression(format!("zstd: {e}")))?,
    };
    if raw.len() != h.raw_len as usize {
        return Err(ProtocolError::BadCompression(format!(
            "{} bytes, not {}",
            raw.len(),
            h.raw_len
        )));
    }
    Ok(Bytes::from(raw))
}

/// One zstd frame into at most `cap` bytes, with a context kept per thread.
fn zstd_decompress(payload: &[u8], cap: usize) -> std::io::Result<Vec<u8>> {
    thread_local! {
        static CTX: std::cell::RefCell<Option<zstd::bulk::Decompressor<'static>>> =
            const { std::cell::RefCell::new(None) };
    }
    CTX.with(|c| {
        let mut c = c.borrow_mut();
        if c.is_none() {
            *c = Some(zstd::bulk::Decompressor::new()?);
        }
        match c.as_mut() {
            Some(d) => d.decompress(payload, cap),
            None => Err(std::io::Error::other("no zstd context")),
        }
    })
}

/// Checks a frame's CRC against its header bytes and payload.
pub fn check_crc(head: &[u8; HEADER_LEN], payload: &[u8]) -> Result<(), ProtocolError> {
    let want = u32::from_le_bytes([head[24], head[25], head[26], head[27]]);
    if frame_crc(head, payload) != want {
        return Err(ProtocolError::BadChecksum);
    }
    Ok(())
}

/// Decodes one whole frame of an unsealed connection from a buffer: the form
/// the fuzz target drives (sealed frames: [`crate::seal::Opener`]).
pub fn decode_frame(buf: &[u8]) -> Result<Option<(Header, Bytes, usize)>, ProtocolError> {
    if buf.len() < HEADER_LEN {
        return Ok(None);
    }
    let mut head = [0u8; HEADER_LEN];
    head.copy_from_slice(&buf[..HEADER_LEN]);
    let h = decode_header(&head)?;
    if h.sealed {
        return Err(ProtocolError::SealingDiffers("sealed", "not sealed"));
    }
    let total = HEADER_LEN + h.len as usize;
    if buf.len() < total {
        return Ok(None);
    }
    let payload = &buf[HEADER_LEN..total];
    check_crc(&head, payload)?;
    let payload = unpack_payload(&h, Bytes::copy_from_slice(payload))?;
    Ok(Some((h, payload, total)))
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECRET: &[u8] = b"0123456789abcdef0123456789abcdef";

    #[test]
    fn spliced_hellos_take_stream_indexes_and_are_never_sealed() {
        let h = Hello {
            role: ROLE_SPLICED,
            carrier: (MAX_STREAMS - 1) as u8,
            session: [7; 16],
            nonce: [9; 16],
            sealed: false,
        };
        assert_eq!(Hello::decode(&h.encode(SECRET), SECRET).unwrap(), h);
        let sealed = Hello {
            sealed: true,
            ..h.clone()
        };
        assert_eq!(
            Hello::decode(&sealed.encode(SECRET), SECRET).unwrap_err().0,
            ProtocolError::Reserved("hello")
        );
        let over = Hello {
            carrier: MAX_STREAMS as u8,
            ..h.clone()
        };
        assert_eq!(
            Hello::decode(&over.encode(SECRET), SECRET).unwrap_err().0,
            ProtocolError::BadCarrier(MAX_STREAMS as u8)
        );
        let carrier_over = Hello {
            role: ROLE_CARRIER,
            carrier: MAX_CARRIERS,
            ..h.clone()
        };
        assert_eq!(
            Hello::decode(&carrier_over.encode(SECRET), SECRET)
                .unwrap_err()
                .0,
            ProtocolError::BadCarrier(MAX_CARRIERS)
        );
        let unknown = Hello { role: 3, ..h };
        assert_eq!(
            Hello::decode(&unknown.encode(SECRET), SECRET)
                .unwrap_err()
                .0,
            ProtocolError::BadRole(3)
        );
    }

    #[test]
    fn hello_round_trips_and_authenticates() {
        let h = Hello {
            role: ROLE_CARRIER,
            carrier: 2,
            session: [7; 16],
            nonce: [9; 16],
            sealed: false,
        };
        let b = h.encode(SECRET);
        assert_eq!(Hello::decode(&b, SECRET).unwrap(), h);
        let err = Hello::decode(&b, b"another-secret-another-secret-xx").unwrap_err();
        assert_eq!(err, (ProtocolError::BadCredential, STATUS_BAD_CREDENTIAL));
        let mut bad = b;
        bad[11] = 3; // tampered after signing
        assert_eq!(
            Hello::decode(&bad, SECRET).unwrap_err().0,
            ProtocolError::BadCredential
        );
        let mut old = b;
        old[8] = 9;
        assert_eq!(
            Hello::decode(&old, SECRET).unwrap_err().0,
            ProtocolError::BadVersion(9)
        );
    }

    #[test]
    fn welcome_proves_the_target_holds_the_key_and_brings_its_own_nonce() {
        let (nonce, answer) = ([5; 16], [8; 16]);
        let w = encode_welcome(STATUS_OK, FEATURE_ZSTD, &nonce, &answer, SECRET);
        assert_eq!(
            decode_welcome(&w, &nonce, SECRET),
            Ok((FEATURE_ZSTD, answer))
        );
        for (i, what) in [(11, "features"), (40, "the target's nonce")] {
            let mut forged = w;
            forged[i] ^= 1; // under the MAC
            assert_eq!(
                decode_welcome(&forged, &nonce, SECRET),
                Err(ProtocolError::BadCredential),
                "{what}"
            );
        }
        assert_eq!(
            decode_welcome(&w, &[6; 16], SECRET),
            Err(ProtocolError::BadCredential)
        );
        assert_eq!(
            decode_welcome(&w, &nonce, b"x"),
            Err(ProtocolError::BadCredential)
        );
        let refused = encode_welcome(STATUS_BAD_CREDENTIAL, FEATURE_ZSTD, &nonce, &answer, SECRET);
        assert_eq!(refused[11], 0, "features only with status 0");
        assert_eq!(&refused[32..48], &[0; 16], "a nonce only with status 0");
        assert_eq!(
            decode_welcome(&refused, &nonce, SECRET),
            Err(ProtocolError::Refused("wrong session key"))
        );
        let replayed = encode_welcome(STATUS_REPLAYED, 0, &nonce, &answer, SECRET);
        assert_eq!(
            decode_welcome(&replayed, &nonce, SECRET),
            Err(ProtocolError::Refused("replayed hello"))
        );
    }

    /// A recorded Hello and Confirm do not pass again: the target's new
    /// nonce changes the Confirm it expects.
    #[test]
    fn a_confirm_binds_both_nonces_and_the_key() {
        let h = Hello {
            role: ROLE_CARRIER,
            carrier: 1,
            session: [7; 16],
            nonce: [9; 16],
            sealed: true,
        }
        .encode(SECRET);
        let w1 = encode_welcome(STATUS_OK, 0, &[9; 16], &[1; 16], SECRET);
        let w2 = encode_welcome(STATUS_OK, 0, &[9; 16], &[2; 16], SECRET);
        let c1 = confirm(SECRET, &h, &w1);
        assert_eq!(check_confirm(SECRET, &h, &w1, &c1), Ok(()));
        assert_eq!(
            check_confirm(SECRET, &h, &w2, &c1),
            Err(ProtocolError::BadConfirm),
            "replayed into a new handshake"
        );
        assert_eq!(
            check_confirm(SECRET, &h, &w1, &confirm(b"another key", &h, &w1)),
            Err(ProtocolError::BadConfirm)
        );
    }

    #[test]
    fn a_session_accepts_each_hello_nonce_once() {
        let seen = Nonces::default();
        assert!(seen.first_use(&[1; 16]));
        assert!(seen.first_use(&[2; 16]));
        assert!(!seen.first_use(&[1; 16]), "a replay");
        for i in 0..Nonces::LIMIT as u32 {
            let mut n = [0xee; 16];
            n[..4].copy_from_slice(&i.to_le_bytes());
            seen.first_use(&n);
        }
        assert!(!seen.first_use(&[3; 16]), "past the limit nothing is new");
    }

    #[test]
    fn frames_round_trip() {
        let mut out = BytesMut::new();
        encode_frame(&Header::new(Kind::Data, 3, 42, 4096), b"payload", &mut out);
        encode_frame(&Header::new(Kind::Ack, 0, 42, 0), b"", &mut out);
        let (h, p, used) = decode_frame(&out).unwrap().unwrap();
        assert_eq!(
            (h.kind, h.stream, h.id, h.offset, &p[..]),
            (Kind::Data, 3, 42, 4096, &b"payload"[..])
        );
        let (h2, _, used2) = decode_frame(&out[used..]).unwrap().unwrap();
        assert_eq!((h2.kind, h2.id), (Kind::Ack, 42));
        assert_eq!(used + used2, out.len());
        assert_eq!(decode_frame(&out[..10]).unwrap(), None);
    }

    #[test]
    fn a_window_frame_names_its_stream_and_count_and_carries_nothing() {
        let mut out = BytesMut::new();
        encode_frame(&Header::new(Kind::Window, 5, 0, 123_456), &[], &mut out);
        let (h, payload, used) = decode_frame(&out).unwrap().unwrap();
        assert_eq!((h.kind, h.stream, h.offset), (Kind::Window, 5, 123_456));
        assert!(payload.is_empty());
        assert_eq!(used, out.len());
        // a WINDOW with a payload is refused, as every control frame's
        let mut bad = BytesMut::new();
        encode_frame(&Header::new(Kind::Window, 5, 0, 1), b"xx", &mut bad);
        assert!(decode_frame(&bad).is_err());
        // kinds past WINDOW are not frames
        let mut head = [0u8; HEADER_LEN];
        head.copy_from_slice(&out[..HEADER_LEN]);
        head[0] = 7;
        assert_eq!(decode_header(&head), Err(ProtocolError::BadKind(7)));
    }

    #[test]
    fn any_flipped_bit_is_caught() {
        let mut out = BytesMut::new();
        encode_frame(&Header::new(Kind::Data, 1, 1, 0), &[0xAB; 100], &mut out);
        for i in 0..out.len() {
            for bit in 0..8 {
                let mut b = out.to_vec();
                b[i] ^= 1 << bit;
                assert!(
                    decode_frame(&b).is_err() || decode_frame(&b).unwrap().is_none(),
                    "byte {i} bit {bit}"
                );
            }
        }
    }

    #[test]
    fn compressed_frames_round_trip_and_lying_sizes_are_refused() {
        let raw: Vec<u8> = (0..100_000u32).map(|i| (i % 7) as u8).collect();
        let packed = lz4_flex::block::compress(&raw);
        assert!(packed.len() < raw.len() / 10);
        let mut h = Header::new(Kind::Data, 1, 5, 8192);
        h.packing = Packing::Lz4;
        h.raw_len = raw.len() as u32;
        let mut out = BytesMut::new();
        encode_frame(&h, &packed, &mut out);
        let (d, p, used) = decode_frame(&out).unwrap().unwrap();
        assert_eq!(
            (d.raw_len, d.offset, used),
            (raw.len() as u32, 8192, out.len())
        );
        assert_eq!(&p[..], &raw[..]);
        // a raw length that is not the truth (re-signed, so only the size lies)
        for lie in [raw.len() as u32 - 1, raw.len() as u32 + 1] {
            let mut h2 = h;
            h2.raw_len = lie;
            let mut out = BytesMut::new();
            encode_frame(&h2, &packed, &mut out);
            assert!(
                matches!(decode_frame(&out), Err(ProtocolError::BadCompression(_))),
                "raw_len {lie}"
            );
        }
        // a compression bomb claim past the cap
        let mut head = [0u8; HEADER_LEN];
        head[0] = Kind::Data as u8;
        head[1] = FLAG_LZ4;
        head[4..8].copy_from_slice(&16u32.to_le_bytes());
        head[28..32].copy_from_slice(&(MAX_PAYLOAD as u32 + 1).to_le_bytes());
        assert_eq!(
            decode_header(&head),
            Err(ProtocolError::BadRawLength(MAX_PAYLOAD as u32 + 1))
        );
        // garbage that claims to be LZ4
        let mut h3 = Header::new(Kind::Data, 1, 6, 0);
        h3.packing = Packing::Lz4;
        h3.raw_len = 4096;
        let mut out = BytesMut::new();
        encode_frame(&h3, &[0xff; 64], &mut out);
        assert!(matches!(
            decode_frame(&out),
            Err(ProtocolError::BadCompression(_))
        ));
    }

    #[test]
    fn zstd_frames_round_trip_and_hostile_ones_fail_cleanly() {
        let raw: Vec<u8> = (0..200_000u32).map(|i| (i % 11) as u8).collect();
        let packed = zstd::bulk::compress(&raw, 1).unwrap();
        let frame = |packing, raw_len: u32, payload: &[u8]| {
            let mut h = Header::new(Kind::Data, 2, 7, 0);
            h.packing = packing;
            h.raw_len = raw_len;
            let mut out = BytesMut::new();
            encode_frame(&h, payload, &mut out);
            out
        };
        let out = frame(Packing::Zstd, raw.len() as u32, &packed);
        let (d, p, _) = decode_frame(&out).unwrap().unwrap();
        assert_eq!(d.packing, Packing::Zstd);
        assert_eq!(&p[..], &raw[..]);
        // a frame that holds more than it claims is cut at the claim, refused
        let short = frame(Packing::Zstd, raw.len() as u32 - 1, &packed);
        assert!(matches!(
            decode_frame(&short),
            Err(ProtocolError::BadCompression(_))
        ));
        // one that holds less, garbage, and an LZ4 block labelled zstd
        let long = frame(Packing::Zstd, raw.len() as u32 + 1, &packed);
        assert!(matches!(
            decode_frame(&long),
            Err(ProtocolError::BadCompression(_))
        ));
        let junk = frame(
            Packing::Zstd,
            4096,
            &[0x28, 0xb5, 0x2f, 0xfd, 0xff, 0xff, 0, 1],
        );
        assert!(matches!(
            decode_frame(&junk),
            Err(ProtocolError::BadCompression(_))
        ));
        let lz4 = frame(
            Packing::Zstd,
            raw.len() as u32,
            &lz4_flex::block::compress(&raw),
        );
        assert!(matches!(
            decode_frame(&lz4),
            Err(ProtocolError::BadCompression(_))
        ));
        // a zstd frame claiming a content size past the cap: the header refuses it
        let mut head = [0u8; HEADER_LEN];
        head[0] = Kind::Data as u8;
        head[1] = FLAG_ZSTD | FLAG_LZ4;
        head[4..8].copy_from_slice(&16u32.to_le_bytes());
        head[28..32].copy_from_slice(&4096u32.to_le_bytes());
        assert_eq!(
            decode_header(&head),
            Err(ProtocolError::BadFlags(FLAG_ZSTD | FLAG_LZ4))
        );
        head[1] = FLAG_ZSTD;
        head[0] = Kind::Ack as u8;
        head[4..8].copy_from_slice(&[0; 4]);
        assert_eq!(
            decode_header(&head),
            Err(ProtocolError::BadFlags(FLAG_ZSTD))
        );
    }

    #[test]
    fn spare_cpu_round_trips_and_nonsense_is_unreported() {
        let s = SpareCpu {
            idle: 0.731,
            cpus: 2,
        };
        let d = SpareCpu::decode(s.encode()).unwrap();
        assert_eq!(d.cpus, 2);
        assert!((d.idle - 0.731).abs() < 1e-9 && (d.cores() - 1.462).abs() < 1e-9);
        assert_eq!(SpareCpu::decode(0), None, "old peers send 0");
        assert_eq!(SpareCpu::decode(1002 | (2 << 16)), None);
        assert_eq!(SpareCpu::decode(500), None, "no CPU count");
        assert_eq!(SpareCpu::decode(500 | (2 << 16) | (1 << 40)), None);
    }

    #[test]
    fn sizes_and_reserved_fields_are_enforced() {
        let mut head = [0u8; HEADER_LEN];
        head[0] = Kind::Data as u8;
        head[4..8].copy_from_slice(&(MAX_PAYLOAD as u32 + 1).to_le_bytes());
        assert!(matches!(
            decode_header(&head),
            Err(ProtocolError::BadLength { .. })
        ));
        head[0] = Kind::Ack as u8;
        head[4..8].copy_from_slice(&1u32.to_le_bytes());
        assert!(matches!(
            decode_header(&head),
            Err(ProtocolError::BadLength { .. })
        ));
        let mut head = [0u8; HEADER_LEN];
        assert_eq!(decode_header(&head), Err(ProtocolError::BadKind(0)));
        head[0] = Kind::Ping as u8;
        head[1] = FLAG_LZ4; // compression only on DATA
        assert_eq!(decode_header(&head), Err(ProtocolError::BadFlags(FLAG_LZ4)));
        head[1] = 0x80;
        assert_eq!(decode_header(&head), Err(ProtocolError::BadFlags(0x80)));
        // a sealed ACK is exactly its tag
        head[1] = FLAG_SEALED;
        head[0] = Kind::Ack as u8;
        assert!(matches!(
            decode_header(&head),
            Err(ProtocolError::BadLength { .. })
        ));
        head[4..8].copy_from_slice(&(TAG_LEN as u32).to_le_bytes());
        assert!(decode_header(&head).unwrap().sealed);
        head[4..8].copy_from_slice(&[0; 4]);
        head[0] = Kind::Ping as u8;
        head[1] = 0;
        head[28] = 1; // raw_len without the flag
        assert_eq!(decode_header(&head), Err(ProtocolError::Reserved("header")));
        head[28] = 0;
        head[2..4].copy_from_slice(&MAX_STREAMS.to_le_bytes());
        assert_eq!(
            decode_header(&head),
            Err(ProtocolError::BadStream(MAX_STREAMS))
        );
    }
}

/// Randomized robustness: arbitrary and mutated bytes never panic the
/// decoders and never decode a frame whose CRC does not hold. (The same
/// functions are what `fuzz/` drives with libFuzzer.)
#[cfg(test)]
mod robustness {
    use super::*;
    use rand::{Rng, SeedableRng};

    #[test]
    fn random_and_mutated_input_never_panics_or_passes_corrupt_frames() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(0x5eed);
        let secret = b"0123456789abcdef0123456789abcdef";
        let mut good = BytesMut::new();
        encode_frame(&Header::new(Kind::Data, 2, 9, 4096), &[7u8; 300], &mut good);
        let hello = Hello {
            role: ROLE_CARRIER,
            carrier: 1,
            session: [3; 16],
            nonce: [4; 16],
            sealed: true,
        }
        .encode(secret);
        for i in 0..20_000 {
            // random bytes
            let n = rng.gen_range(0..200);
            let buf: Vec<u8> = (0..n).map(|_| rng.gen()).collect();
            let _ = decode_frame(&buf);
            // a valid frame with a few bytes changed: either rejected or the same frame
            let mut m = good.to_vec();
            for _ in 0..rng.gen_range(1..4) {
                let at = rng.gen_range(0..m.len());
                m[at] = rng.gen();
            }
            if let Ok(Some((h, p, _))) = decode_frame(&m) {
                assert_eq!(
                    m,
                    good.to_vec(),
                    "a changed frame decoded at iteration {i}: {h:?} {}",
                    p.len()
                );
            }
            let mut hb = hello;
            let at = rng.gen_range(0..HELLO_LEN);
            hb[at] ^= rng.gen_range(1..=255u8);
            assert!(
                Hello::decode(&hb, secret).is_err(),
                "a changed hello passed at byte {at}"
            );
        }
    }
}
