//! The NBD wire format, as far as Ferry's server speaks it (see `doc/proto.md`
//! of NetworkBlockDevice/nbd). Pure encoding and parsing: no I/O, so every
//! function here can be fuzzed.
//!
//! All integers are big-endian.
//!
//! ```text
//! Handshake (fixed newstyle)
//!   S: u64 NBDMAGIC  u64 IHAVEOPT  u16 handshake flags (FIXED_NEWSTYLE|NO_ZEROES)
//!   C: u32 client flags            (unknown bits: the server closes)
//!   then, repeatedly:
//!   C: u64 IHAVEOPT  u32 option  u32 length  [length bytes]
//!   S: u64 REPLY_MAGIC  u32 option  u32 reply type  u32 length  [length bytes]
//!   until EXPORT_NAME (old-style answer, no reply header) or a successful GO.
//!
//! Options served
//!   EXPORT_NAME(1) name           → u64 size, u16 transmission flags [+124 zeroes]
//!   ABORT(2)                      → ACK, close
//!   LIST(3)                       → SERVER{u32 len, name}* ACK
//!   INFO(6)/GO(7) u32 len, name, u16 n, u16 info*n
//!                                 → INFO{EXPORT u16 0, u64 size, u16 flags}
//!                                   INFO{BLOCK_SIZE u16 3, u32 min, pref, max}
//!                                   [INFO{NAME}] ACK   (GO: transmission begins)
//!   STRUCTURED_REPLY(8)           → ACK
//!   STARTTLS(5)                   → ACK, then TLS (TLS-required mode only;
//!                                   before it every option but ABORT gets
//!                                   ERR_TLS_REQD and EXPORT_NAME closes)
//!   anything else                 → ERR_UNSUP (the server keeps talking)
//!
//! Transmission
//!   C: u32 0x25609513  u16 flags  u16 type  u64 cookie  u64 offset  u32 length
//!      [length bytes for WRITE]
//!   S (simple):     u32 0x67446698  u32 error  u64 cookie  [data for READ]
//!   S (structured): u32 0x668e33ef  u16 flags  u16 type  u64 cookie  u32 length
//!                   payload: OFFSET_DATA u64 offset + data | ERROR u32 err,
//!                   u16 msg len, msg
//! ```
//!
//! Ferry's server advertises `HAS_FLAGS | SEND_FLUSH | SEND_FUA | SEND_TRIM |
//! SEND_WRITE_ZEROES | CAN_MULTI_CONN` (and `READ_ONLY` for read-only
//! exports): all connections of an export share one file, so a flush on one
//! makes every completed write on every connection durable.

pub const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
pub const IHAVEOPT: u64 = 0x4948_4156_454F_5054;
pub const OPT_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
pub const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;

// handshake flags (server) and client flags
pub const FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
pub const FLAG_NO_ZEROES: u16 = 1 << 1;
pub const FLAG_C_FIXED_NEWSTYLE: u32 = 1 << 0;
pub const FLAG_C_NO_ZEROES: u32 = 1 << 1;

// options
pub const OPT_EXPORT_NAME: u32 = 1;
pub const OPT_ABORT: u32 = 2;
pub const OPT_LIST: u32 = 3;
pub const OPT_STARTTLS: u32 = 5;
pub const OPT_INFO: u32 = 6;
pub const OPT_GO: u32 = 7;
pub const OPT_STRUCTURED_REPLY: u32 = 8;

// option replies
pub const REP_ACK: u32 = 1;
pub const REP_SERVER: u32 = 2;
pub const REP_INFO: u32 = 3;
pub const REP_ERR_UNSUP: u32 = (1 << 31) + 1;
pub const REP_ERR_POLICY: u32 = (1 << 31) + 2;
pub const REP_ERR_INVALID: u32 = (1 << 31) + 3;
pub const REP_ERR_TLS_REQD: u32 = (1 << 31) + 5;
pub const REP_ERR_UNKNOWN: u32 = (1 << 31) + 6;
pub const REP_ERR_TOO_BIG: u32 = (1 << 31) + 9;

// info types
pub const INFO_EXPORT: u16 = 0;
pub const INFO_NAME: u16 = 1;
pub const INFO_BLOCK_SIZE: u16 = 3;

// transmission flags
pub const TF_HAS_FLAGS: u16 = 1 << 0;
pub const TF_READ_ONLY: u16 = 1 << 1;
pub const TF_SEND_FLUSH: u16 = 1 << 2;
pub const TF_SEND_FUA: u16 = 1 << 3;
pub const TF_SEND_TRIM: u16 = 1 << 5;
pub const TF_SEND_WRITE_ZEROES: u16 = 1 << 6;
pub const TF_CAN_MULTI_CONN: u16 = 1 << 8;

// command flags
pub const CMD_FLAG_FUA: u16 = 1 << 0;
pub const CMD_FLAG_NO_HOLE: u16 = 1 << 1;
pub const CMD_FLAG_DF: u16 = 1 << 2;

// commands
pub const CMD_READ: u16 = 0;
pub const CMD_WRITE: u16 = 1;
pub const CMD_DISC: u16 = 2;
pub const CMD_FLUSH: u16 = 3;
pub const CMD_TRIM: u16 = 4;
pub const CMD_WRITE_ZEROES: u16 = 6;

// structured reply
pub const REPLY_FLAG_DONE: u16 = 1 << 0;
pub const REPLY_TYPE_NONE: u16 = 0;
pub const REPLY_TYPE_OFFSET_DATA: u16 = 1;
pub const REPLY_TYPE_ERROR: u16 = (1 << 15) + 1;

// errors
pub const EPERM: u32 = 1;
pub const EIO: u32 = 5;
pub const EINVAL: u32 = 22;
pub const ENOSPC: u32 = 28;
pub const EOVERFLOW: u32 = 75;

/// Largest option payload accepted; larger ones are answered `ERR_TOO_BIG`
/// after being skipped (up to [`MAX_OPTION_SKIP`]) or the client is dropped.
pub const MAX_OPTION: u32 = 8 << 10;
pub const MAX_OPTION_SKIP: u32 = 1 << 20;
/// Largest READ/WRITE payload the server advertises and accepts.
pub const MAX_PAYLOAD: u32 = 32 << 20;
pub const PREFERRED_BLOCK: u32 = 4096;
/// Longest export name (the spec's limit for strings).
pub const MAX_NAME: usize = 4096;

pub const REQUEST_LEN: usize = 28;

/// A request header, parsed but not yet checked against an export.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    pub flags: u16,
    pub kind: u16,
    pub cookie: u64,
    pub offset: u64,
    pub length: u32,
}

/// What went wrong in a request, and what the server must do about it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    /// The stream is out of step (bad magic, or a write payload too large to
    /// skip): the server must hard-disconnect.
    #[error("{0}: disconnecting")]
    Fatal(String),
    /// Answer with this NBD error; the connection stays usable. For a WRITE
    /// the payload has to be read and dropped first.
    #[error("{msg} (NBD error {code})")]
    Reply { code: u32, msg: String },
}

fn be16(b: &[u8]) -> u16 {
    u16::from_be_bytes([b[0], b[1]])
}
fn be32(b: &[u8]) -> u32 {
    u32::from_be_bytes([b[0], b[1], b[2], b[3]])
}
fn be64(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    u64::from_be_bytes(a)
}

pub fn parse_request(b: &[u8; REQUEST_LEN]) -> Result<Request, RequestError> {
    let magic = be32(&b[0..4]);
    if magic != REQUEST_MAGIC {
        return Err(RequestError::Fatal(format!(
            "request magic {magic:#010x} is not {REQUEST_MAGIC:#010x}"
        )));
    }
    Ok(Request {
        flags: be16(&b[4..6]),
        kind: be16(&b[6..8]),
        cookie: be64(&b[8..16]),
        offset: be64(&b[16..24]),
        length: be32(&b[24..28]),
    })
}

/// Which command a checked request is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Command {
    Read,
    Write { fua: bool },
    Disconnect,
    Flush,
    Trim { fua: bool },
    WriteZeroes { fua: bool, no_hole: bool },
}

/// Checks a request against an export of `size` bytes, as the spec's error
/// section asks: unknown command or flag → EINVAL; read or trim past the end
/// → EINVAL; write past the end → ENOSPC; write or trim of a read-only export
/// → EPERM. A WRITE payload above [`MAX_PAYLOAD`] cannot be skipped safely and
/// is fatal; a READ above it is refused with EINVAL.
pub fn check_request(r: &Request, size: u64, read_only: bool) -> Result<Command, RequestError> {
    let reply = |code: u32, msg: String| Err(RequestError::Reply { code, msg });
    if r.kind == CMD_WRITE && r.length > MAX_PAYLOAD {
        return Err(RequestError::Fatal(format!(
            "write of {} bytes is above the {MAX_PAYLOAD}-byte maximum payload",
            r.length
        )));
    }
    let allowed: u16 = match r.kind {
        CMD_READ => CMD_FLAG_DF,
        CMD_WRITE | CMD_TRIM => CMD_FLAG_FUA,
        CMD_WRITE_ZEROES => CMD_FLAG_FUA | CMD_FLAG_NO_HOLE,
        CMD_DISC | CMD_FLUSH => 0,
        k => return reply(EINVAL, format!("unknown command {k}")),
    };
    if r.flags & !allowed != 0 {
        return reply(
            EINVAL,
            format!(
                "flags {:#06x} are not valid for command {}",
                r.flags, r.kind
            ),
        );
    }
    let fua = r.flags & CMD_FLAG_FUA != 0;
    let end = r.offset.checked_add(r.length as u64);
    let past_end = end.is_none_or(|e| e > size);
    let range = || {
        format!(
            "offset {} + length {} is past the end ({size})",
            r.offset, r.length
        )
    };
    match r.kind {
        CMD_READ => {
            if r.length > MAX_PAYLOAD {
                return reply(
                    EINVAL,
                    format!("read of {} bytes is above the maximum payload", r.length),
                );
            }
            if past_end {
                return reply(EINVAL, range());
            }
            Ok(Command::Read)
        }
        CMD_WRITE | CMD_TRIM | CMD_WRITE_ZEROES => {
            if read_only {
                return reply(EPERM, "the export is read-only".into());
            }
            if past_end {
                let code = if r.kind == CMD_TRIM { EINVAL } else { ENOSPC };
                return reply(code, range());
            }
            Ok(match r.kind {
                CMD_WRITE => Command::Write { fua },
                CMD_TRIM => Command::Trim { fua },
                _ => Command::WriteZeroes {
                    fua,
                    no_hole: r.flags & CMD_FLAG_NO_HOLE != 0,
                },
            })
        }
        CMD_FLUSH => Ok(Command::Flush),
        _ => Ok(Command::Disconnect),
    }
}

/// Option header after IHAVEOPT: (option, length).
pub fn parse_option_header(b: &[u8; 16]) -> Result<(u32, u32), String> {
    let magic = be64(&b[0..8]);
    if magic != IHAVEOPT {
        return Err(format!("option magic {magic:#018x} is not IHAVEOPT"));
    }
    Ok((be32(&b[8..12]), be32(&b[12..16])))
}

/// The data of `NBD_OPT_INFO`/`NBD_OPT_GO`: (export name, info requests).
pub fn parse_info_request(d: &[u8]) -> Result<(String, Vec<u16>), String> {
    if d.len() < 6 {
        return Err(format!(
            "{} bytes are too short for a name and count",
            d.len()
        ));
    }
    let n = be32(&d[0..4]) as usize;
    if n > d.len() - 6 {
        return Err(format!(
            "name length {n} overruns the {}-byte option",
            d.len()
        ));
    }
    let name = parse_name(&d[4..4 + n])?;
    let rest = &d[4 + n..];
    let count = be16(&rest[0..2]) as usize;
    if rest.len() != 2 + 2 * count {
        return Err(format!(
            "{count} information requests do not fill the {} bytes left",
            rest.len() - 2
        ));
    }
    let infos = rest[2..].chunks(2).map(be16).collect();
    Ok((name, infos))
}

/// An export name: UTF-8, no NUL, at most [`MAX_NAME`] bytes.
pub fn parse_name(b: &[u8]) -> Result<String, String> {
    if b.len() > MAX_NAME {
        return Err(format!("export name of {} bytes is too long", b.len()));
    }
    let s = std::str::from_utf8(b).map_err(|_| "export name is not UTF-8".to_string())?;
    if s.contains('\0') {
        return Err("export name contains NUL".into());
    }
    Ok(s.to_string())
}

pub fn greeting() -> Vec<u8> {
    let mut v = Vec::with_capacity(18);
    v.extend_from_slice(&NBDMAGIC.to_be_bytes());
    v.extend_from_slice(&IHAVEOPT.to_be_bytes());
    v.extend_from_slice(&(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes());
    v
}

pub fn option_reply(opt: u32, kind: u32, data: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(20 + data.len());
    v.extend_from_slice(&OPT_REPLY_MAGIC.to_be_bytes());
    v.extend_from_slice(&opt.to_be_bytes());
    v.extend_from_slice(&kind.to_be_bytes());
    v.extend_from_slice(&(data.len() as u32).to_be_bytes());
    v.extend_from_slice(data);
    v
}

pub fn info_export(size: u64, flags: u16) -> Vec<u8> {
    let mut v = Vec::with_capacity(12);
    v.extend_from_slice(&INFO_EXPORT.to_be_bytes());
    v.extend_from_slice(&size.to_be_bytes());
    v.extend_from_slice(&flags.to_be_bytes());
    v
}

pub fn info_block_size() -> Vec<u8> {
    let mut v = Vec::with_capacity(14);
    v.extend_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
    v.extend_from_slice(&1u32.to_be_bytes());
    v.extend_from_slice(&PREFERRED_BLOCK.to_be_bytes());
    v.extend_from_slice(&MAX_PAYLOAD.to_be_bytes());
    v
}

pub fn info_name(name: &str) -> Vec<u8> {
    let mut v = INFO_NAME.to_be_bytes().to_vec();
    v.extend_from_slice(name.as_bytes());
    v
}

pub fn server_entry(name: &str) -> Vec<u8> {
    let mut v = (name.len() as u32).to_be_bytes().to_vec();
    v.extend_from_slice(name.as_bytes());
    v
}

/// The answer to `NBD_OPT_EXPORT_NAME`.
pub fn export_name_reply(size: u64, flags: u16, no_zeroes: bool) -> Vec<u8> {
    let mut v = Vec::with_capacity(134);
    v.extend_from_slice(&size.to_be_bytes());
    v.extend_from_slice(&flags.to_be_bytes());
    if !no_zeroes {
        v.extend_from_slice(&[0u8; 124]);
    }
    v
}

pub fn simple_reply(error: u32, cookie: u64) -> [u8; 16] {
    let mut v = [0u8; 16];
    v[0..4].copy_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
    v[4..8].copy_from_slice(&error.to_be_bytes());
    v[8..16].copy_from_slice(&cookie.to_be_bytes());
    v
}

/// A structured reply chunk header for `payload_len` bytes of payload.
pub fn chunk_header(flags: u16, kind: u16, cookie: u64, payload_len: u32) -> [u8; 20] {
    let mut v = [0u8; 20];
    v[0..4].copy_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
    v[4..6].copy_from_slice(&flags.to_be_bytes());
    v[6..8].copy_from_slice(&kind.to_be_bytes());
    v[8..16].copy_from_slice(&cookie.to_be_bytes());
    v[16..20].copy_from_slice(&payload_len.to_be_bytes());
    v
}

/// A final `NBD_REPLY_TYPE_ERROR` chunk carrying `msg`.
pub fn error_chunk(cookie: u64, error: u32, msg: &str) -> Vec<u8> {
    let msg = &msg.as_bytes()[..msg.len().min(1024)];
    let mut v = chunk_header(
        REPLY_FLAG_DONE,
        REPLY_TYPE_ERROR,
        cookie,
        6 + msg.len() as u32,
    )
    .to_vec();
    v.extend_from_slice(&error.to_be_bytes());
    v.extend_from_slice(&(msg.len() as u16).to_be_bytes());
    v.extend_from_slice(msg);
    v
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn req(kind: u16, flags: u16, offset: u64, length: u32) -> Request {
        Request {
            flags,
            kind,
            cookie: 7,
            offset,
            length,
        }
    }

    fn encode(r: &Request) -> [u8; REQUEST_LEN] {
        let mut b = [0u8; REQUEST_LEN];
        b[0..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
        b[4..6].copy_from_slice(&r.flags.to_be_bytes());
        b[6..8].copy_from_slice(&r.kind.to_be_bytes());
        b[8..16].copy_from_slice(&r.cookie.to_be_bytes());
        b[16..24].copy_from_slice(&r.offset.to_be_bytes());
        b[24..28].copy_from_slice(&r.length.to_be_bytes());
        b
    }

    #[test]
    fn requests_round_trip() {
        let r = req(CMD_WRITE, CMD_FLAG_FUA, 4096, 512);
        assert_eq!(parse_request(&encode(&r)).unwrap(), r);
        let mut b = encode(&r);
        b[0] = 0;
        assert!(matches!(parse_request(&b), Err(RequestError::Fatal(_))));
    }

    fn code(r: Result<Command, RequestError>) -> u32 {
        match r {
            Err(RequestError::Reply { code, .. }) => code,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn the_spec_errors_are_returned() {
        let size = 1 << 20;
        assert_eq!(
            check_request(&req(CMD_READ, 0, 0, 4096), size, false),
            Ok(Command::Read)
        );
        assert_eq!(
            code(check_request(&req(CMD_READ, 0, size, 1), size, false)),
            EINVAL
        );
        assert_eq!(
            code(check_request(&req(CMD_WRITE, 0, size - 1, 2), size, false)),
            ENOSPC
        );
        assert_eq!(
            code(check_request(&req(CMD_TRIM, 0, size, 1), size, false)),
            EINVAL
        );
        assert_eq!(
            code(check_request(&req(CMD_WRITE, 0, 0, 1), size, true)),
            EPERM
        );
        assert_eq!(code(check_request(&req(99, 0, 0, 1), size, false)), EINVAL);
        assert_eq!(
            code(check_request(
                &req(CMD_FLUSH, CMD_FLAG_FUA, 0, 0),
                size,
                false
            )),
            EINVAL
        );
        assert_eq!(
            code(check_request(&req(CMD_READ, 0, u64::MAX, 10), size, false)),
            EINVAL
        );
        assert_eq!(
            code(check_request(
                &req(CMD_READ, 0, 0, MAX_PAYLOAD + 1),
                u64::MAX,
                false
            )),
            EINVAL
        );
        assert!(matches!(
            check_request(&req(CMD_WRITE, 0, 0, MAX_PAYLOAD + 1), u64::MAX, false),
            Err(RequestError::Fatal(_))
        ));
        assert_eq!(
            check_request(
                &req(CMD_WRITE_ZEROES, CMD_FLAG_FUA | CMD_FLAG_NO_HOLE, 0, 10),
                size,
                false
            ),
            Ok(Command::WriteZeroes {
                fua: true,
                no_hole: true
            })
        );
    }

    #[test]
    fn info_requests_are_parsed_and_bounded() {
        let mut d = 4u32.to_be_bytes().to_vec();
        d.extend_from_slice(b"disk");
        d.extend_from_slice(&2u16.to_be_bytes());
        d.extend_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
        d.extend_from_slice(&INFO_NAME.to_be_bytes());
        assert_eq!(
            parse_info_request(&d).unwrap(),
            ("disk".to_string(), vec![INFO_BLOCK_SIZE, INFO_NAME])
        );
        // name length overrunning the option
        let mut bad = 400u32.to_be_bytes().to_vec();
        bad.extend_from_slice(b"disk\0\0");
        assert!(parse_info_request(&bad).unwrap_err().contains("overruns"));
        // count not matching the bytes left
        let mut bad = d.clone();
        bad.pop();
        assert!(parse_info_request(&bad).is_err());
        assert!(parse_info_request(&[0, 0]).is_err());
        assert!(parse_name(b"a\0b").is_err());
        assert!(parse_name(&[0xff, 0xfe]).is_err());
    }

    #[test]
    fn replies_have_the_documented_layout() {
        let g = greeting();
        assert_eq!(&g[0..8], b"NBDMAGIC");
        assert_eq!(&g[8..16], b"IHAVEOPT");
        assert_eq!(export_name_reply(1, 3, false).len(), 134);
        assert_eq!(export_name_reply(1, 3, true).len(), 10);
        let e = error_chunk(9, EINVAL, "bad");
        assert_eq!(e.len(), 20 + 6 + 3);
        assert_eq!(be16(&e[6..8]), REPLY_TYPE_ERROR);
        assert_eq!(be32(&e[16..20]), 9);
    }
}
