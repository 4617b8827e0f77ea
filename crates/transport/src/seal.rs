//! Sealed carriers: AES-256-GCM per frame, one key per connection and
//! direction (the wire format is in [`crate::protocol`], "Sealed
//! connections"). Used when the cluster asks for carriers to be encrypted,
//! for fabrics the hosts do not trust; the credential never crosses the wire.
//!
//! The cipher is `ring`'s (the one rustls uses here): with AES-NI and
//! carry-less multiply it seals ~6× faster than a portable AES-GCM, and
//! both ends of a move seal or open every byte of it
//! (BENCHMARKS.md, "Sealing"; `examples/seal_speed.rs` measures it).

use bytes::{Bytes, BytesMut};
use hkdf::Hkdf;
use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM};
use sha2::Sha256;

use crate::protocol::*;

/// Which way a key seals.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    SourceToTarget = 1,
    TargetToSource = 2,
}

/// The AES-256 key of one connection and direction (HKDF-SHA256).
fn key_bytes(secret: &[u8], hello: &Hello, answer: &[u8; 16], dir: Direction) -> [u8; 32] {
    let mut salt = [0u8; 48];
    salt[..16].copy_from_slice(&hello.session);
    salt[16..32].copy_from_slice(&hello.nonce);
    salt[32..].copy_from_slice(answer);
    let mut info = b"ferry-transport seal v2".to_vec();
    info.extend([dir as u8, hello.carrier]);
    let mut k = [0u8; 32];
    Hkdf::<Sha256>::new(Some(&salt), secret)
        .expand(&info, &mut k)
        .unwrap_or_else(|_| unreachable!("32 bytes is a valid HKDF-SHA256 length"));
    k
}

fn key(secret: &[u8], hello: &Hello, answer: &[u8; 16], dir: Direction) -> LessSafeKey {
    let k = UnboundKey::new(&AES_256_GCM, &key_bytes(secret, hello, answer, dir))
        .unwrap_or_else(|_| unreachable!("32 bytes is an AES-256 key"));
    LessSafeKey::new(k)
}

/// The nonce of a connection's `count`th frame: each is used once per key.
fn nonce(count: u64) -> Nonce {
    let mut n = [0u8; 12];
    n[4..].copy_from_slice(&count.to_le_bytes());
    Nonce::assume_unique_for_key(n)
}

/// Seals the frames one side sends on one connection.
pub struct Sealer {
    key: LessSafeKey,
    count: u64,
    /// Whether the header's CRC is computed ([`Sealer::without_crc`]).
    crc: bool,
}

impl Sealer {
    /// The sealer of one connection: its Hello and the Welcome's `answer`
    /// nonce.
    pub fn new(secret: &[u8], hello: &Hello, answer: &[u8; 16], dir: Direction) -> Sealer {
        Sealer {
            key: key(secret, hello, answer, dir),
            count: 0,
            crc: true,
        }
    }

    /// A sealer whose frames leave the CRC 0: for a receiver whose Welcome
    /// said it does not check the CRC of sealed frames
    /// ([`FEATURE_SEALED_UNCHECKED`]).
    pub fn without_crc(mut self) -> Sealer {
        self.crc = false;
        self
    }

    /// Appends a sealed frame to `out`: header, then `payload` encrypted,
    /// then the tag. The payload is copied once, into `out`, and encrypted
    /// there.
    pub fn frame(&mut self, h: &Header, payload: &[u8], out: &mut BytesMut) {
        let mut h = *h;
        h.sealed = true;
        let sealed_len = payload.len() + TAG_LEN;
        let head = header_bytes(&h, sealed_len);
        let start = out.len();
        out.reserve(HEADER_LEN + sealed_len);
        out.extend_from_slice(&head);
        out.extend_from_slice(payload);
        let tag = self
            .key
            .seal_in_place_separate_tag(
                nonce(self.count),
                Aad::from(sealed_aad(&head)),
                &mut out[start + HEADER_LEN..],
            )
            .unwrap_or_else(|_| unreachable!("payloads are far below GCM's limit"));
        self.count += 1;
        out.extend_from_slice(tag.as_ref());
        if self.crc {
            let crc = frame_crc(&head, &out[start + HEADER_LEN..]);
            out[start + 24..start + 28].copy_from_slice(&crc.to_le_bytes());
        }
    }
}

/// Opens the frames one side receives on one connection, in order.
pub struct Opener {
    key: LessSafeKey,
    count: u64,
}

impl Opener {
    pub fn new(secret: &[u8], hello: &Hello, answer: &[u8; 16], dir: Direction) -> Opener {
        Opener {
            key: key(secret, hello, answer, dir),
            count: 0,
        }
    }

    /// Checks and decrypts the payload of the next frame (its header already
    /// decoded and its CRC checked); returns the payload without the tag.
    pub fn open(
        &mut self,
        h: &Header,
        head: &[u8; HEADER_LEN],
        mut payload: BytesMut,
    ) -> Result<Bytes, ProtocolError> {
        if !h.sealed {
            return Err(ProtocolError::SealingDiffers("not sealed", "sealed"));
        }
        let at = payload
            .len()
            .checked_sub(TAG_LEN)
            .ok_or(ProtocolError::BadSeal)?;
        // ciphertext then tag, opened in place
        self.key
            .open_in_place(nonce(self.count), Aad::from(sealed_aad(head)), &mut payload)
            .map_err(|_| ProtocolError::BadSeal)?;
        payload.truncate(at);
        self.count += 1;
        Ok(payload.freeze())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECRET: &[u8] = b"0123456789abcdef0123456789abcdef";
    /// The Welcome's target nonce of the connection the tests seal.
    const ANSWER: [u8; 16] = [4; 16];

    fn hello(nonce: u8) -> Hello {
        Hello {
            role: ROLE_CARRIER,
            carrier: 1,
            session: [7; 16],
            nonce: [nonce; 16],
            sealed: true,
        }
    }

    /// Splits one encoded frame back into what the reader has.
    fn read(buf: &[u8]) -> (Header, [u8; HEADER_LEN], BytesMut) {
        let mut head = [0u8; HEADER_LEN];
        head.copy_from_slice(&buf[..HEADER_LEN]);
        let h = decode_header(&head).unwrap();
        let payload = &buf[HEADER_LEN..HEADER_LEN + h.len as usize];
        check_crc(&head, payload).unwrap();
        (h, head, BytesMut::from(payload))
    }

    #[test]
    fn sealed_frames_round_trip_in_order_and_hide_the_payload() {
        let mut s = Sealer::new(SECRET, &hello(1), &ANSWER, Direction::SourceToTarget);
        let mut o = Opener::new(SECRET, &hello(1), &ANSWER, Direction::SourceToTarget);
        let plain = b"guest memory page guest memory page";
        for i in 0..3u64 {
            let mut out = BytesMut::new();
            s.frame(&Header::new(Kind::Data, 2, i + 1, i * 100), plain, &mut out);
            assert!(
                !out.windows(8).any(|w| w == b"guest me"),
                "plaintext on the wire"
            );
            let (h, head, p) = read(&out);
            assert_eq!((h.len as usize, h.offset), (plain.len() + TAG_LEN, i * 100));
            assert_eq!(&o.open(&h, &head, p).unwrap()[..], plain);
        }
        // an ACK is sealed too: just its tag
        let mut out = BytesMut::new();
        s.frame(&Header::new(Kind::Ack, 0, 9, 0), &[], &mut out);
        let (h, head, p) = read(&out);
        assert!(o.open(&h, &head, p).unwrap().is_empty());
    }

    /// A sealer without CRC differs only in the header's CRC, left 0: the
    /// same ciphertext and tag, opened the same way, and a byte flipped
    /// anywhere in the payload or the header's authenticated bytes does not
    /// open.
    #[test]
    fn frames_without_crc_differ_only_in_the_crc_and_still_refuse_a_flipped_byte() {
        let dir = Direction::SourceToTarget;
        let plain: Vec<u8> = (0..5000u32).map(|i| (i % 253) as u8).collect();
        let h = Header::new(Kind::Data, 3, 1, 4096);
        let (mut with, mut without) = (BytesMut::new(), BytesMut::new());
        Sealer::new(SECRET, &hello(1), &ANSWER, dir).frame(&h, &plain, &mut with);
        Sealer::new(SECRET, &hello(1), &ANSWER, dir)
            .without_crc()
            .frame(&h, &plain, &mut without);
        assert_eq!(&without[24..28], &[0; 4]);
        assert_ne!(&with[24..28], &[0; 4]);
        assert_eq!(&with[..24], &without[..24]);
        assert_eq!(&with[28..], &without[28..]);
        let open = |frame: &[u8]| {
            let mut head = [0u8; HEADER_LEN];
            head.copy_from_slice(&frame[..HEADER_LEN]);
            let hd = decode_header(&head)?;
            Opener::new(SECRET, &hello(1), &ANSWER, dir).open(
                &hd,
                &head,
                BytesMut::from(&frame[HEADER_LEN..]),
            )
        };
        assert_eq!(&open(&without).unwrap()[..], &plain[..]);
        // the stream and offset bytes of the header, the payload, the tag
        for at in [2, 16, HEADER_LEN + 7, HEADER_LEN + 4000, without.len() - 1] {
            let mut bad = without.to_vec();
            bad[at] ^= 0x01;
            assert_eq!(open(&bad), Err(ProtocolError::BadSeal), "byte {at}");
        }
    }

    /// The wire is plain AES-256-GCM: this seals what another
    /// implementation seals with the same key and nonce, byte for byte, and
    /// opens it, so agents built with either talk to each other.
    #[test]
    fn frames_are_aes_256_gcm_as_another_implementation_computes_it() {
        use aes_gcm::aead::{AeadInPlace, KeyInit};
        let h = hello(3);
        let dir = Direction::SourceToTarget;
        let other = aes_gcm::Aes256Gcm::new(&key_bytes(SECRET, &h, &ANSWER, dir).into());
        let plain: Vec<u8> = (0..70_000u32).map(|i| (i * 7 % 251) as u8).collect();
        let mut s = Sealer::new(SECRET, &h, &ANSWER, dir);
        let mut o = Opener::new(SECRET, &h, &ANSWER, dir);
        for count in 0..3u64 {
            let mut out = BytesMut::new();
            s.frame(&Header::new(Kind::Data, 1, count + 1, 0), &plain, &mut out);
            let (hd, head, p) = read(&out);
            // the other implementation's sealing of the same frame
            let mut n = [0u8; 12];
            n[4..].copy_from_slice(&count.to_le_bytes());
            let mut body = plain.clone();
            let tag = other
                .encrypt_in_place_detached(&n.into(), &sealed_aad(&head), &mut body)
                .unwrap();
            body.extend_from_slice(&tag);
            assert_eq!(&p[..], &body[..], "frame {count} differs");
            assert_eq!(&o.open(&hd, &head, p).unwrap()[..], &plain[..]);
        }
    }

    #[test]
    fn forged_replayed_reordered_or_foreign_frames_do_not_open() {
        let mk = || Sealer::new(SECRET, &hello(1), &ANSWER, Direction::SourceToTarget);
        let mut s = mk();
        let mut frames = Vec::new();
        for i in 0..2u64 {
            let mut out = BytesMut::new();
            s.frame(&Header::new(Kind::Data, 1, i + 1, 0), b"abcdef", &mut out);
            frames.push(out);
        }
        // out of order: the second first
        let mut o = Opener::new(SECRET, &hello(1), &ANSWER, Direction::SourceToTarget);
        let (h, head, p) = read(&frames[1]);
        assert_eq!(o.open(&h, &head, p), Err(ProtocolError::BadSeal));
        // replayed: the first twice
        let mut o = Opener::new(SECRET, &hello(1), &ANSWER, Direction::SourceToTarget);
        let (h, head, p) = read(&frames[0]);
        o.open(&h, &head, p.clone()).unwrap();
        assert_eq!(o.open(&h, &head, p), Err(ProtocolError::BadSeal));
        // another direction, connection (either nonce) or session key
        for mut o in [
            Opener::new(SECRET, &hello(1), &ANSWER, Direction::TargetToSource),
            Opener::new(SECRET, &hello(2), &ANSWER, Direction::SourceToTarget),
            Opener::new(
                b"another credential",
                &hello(1),
                &ANSWER,
                Direction::SourceToTarget,
            ),
            // the same Hello answered by another Welcome: a replayed Hello's keys
            Opener::new(SECRET, &hello(1), &[5; 16], Direction::SourceToTarget),
        ] {
            let (h, head, p) = read(&frames[0]);
            assert_eq!(o.open(&h, &head, p), Err(ProtocolError::BadSeal));
        }
        // a header field changed and its CRC recomputed: the tag still catches it
        let (mut h, _, p) = read(&frames[0]);
        h.offset = 4096;
        let mut forged = BytesMut::new();
        encode_frame(&h, &p, &mut forged);
        let (h, head, p) = read(&forged);
        let mut o = Opener::new(SECRET, &hello(1), &ANSWER, Direction::SourceToTarget);
        assert_eq!(o.open(&h, &head, p), Err(ProtocolError::BadSeal));
        // an unsealed frame on a sealed connection
        let mut plain = BytesMut::new();
        encode_frame(&Header::new(Kind::Data, 1, 1, 0), b"abcdef", &mut plain);
        let (h, head, p) = read(&plain);
        assert!(matches!(
            o.open(&h, &head, p),
            Err(ProtocolError::SealingDiffers(..))
        ));
    }
}
