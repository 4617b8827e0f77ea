//! What a sealed DATA frame of the largest size costs each end, per GiB of
//! payload, on this machine: the source's way before (payload copied into
//! its own buffer, sealed, then copied again behind the header, and the
//! CRC computed over it), [`Sealer::frame`] now (copied once, into the
//! carrier's buffer, sealed there) with and without the CRC, and the
//! target's CRC check and opening; and on the same noise, what the source
//! spends deciding not to compress it: the noise screen
//! ([`looks_like_noise`]) against each codec a probe tries. Contenders
//! alternate in rounds; the medians are printed with every round.
//!
//!     cargo run --release -p ferry-transport --example frame_cost

use std::time::Instant;

use bytes::BytesMut;
use ferry_transport::compress::{looks_like_noise, Codec};
use ferry_transport::protocol::{
    check_crc, decode_header, encode_frame, header_bytes, sealed_aad, Header, Hello, Kind,
    HEADER_LEN, MAX_PAYLOAD, ROLE_CARRIER,
};
use ferry_transport::seal::{Direction, Opener, Sealer};
use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM};

const FRAMES: usize = 2048;
const ROUNDS: usize = 7;
const SECRET: &[u8] = b"0123456789abcdef0123456789abcdef";
const ANSWER: [u8; 16] = [4; 16];

fn hello() -> Hello {
    Hello {
        role: ROLE_CARRIER,
        carrier: 0,
        session: [7; 16],
        nonce: [1; 16],
        sealed: true,
    }
}

/// CPU seconds per GiB of payload that `each` takes over `FRAMES` frames.
fn per_gib(mut each: impl FnMut(usize)) -> f64 {
    let t = Instant::now();
    for i in 0..FRAMES {
        each(i);
    }
    t.elapsed().as_secs_f64() / ((FRAMES * MAX_PAYLOAD) as f64 / f64::from(1u32 << 30))
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    // a payload that does not compress, as a frame sent as it is
    let mut payload = vec![0u8; MAX_PAYLOAD];
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    for b in payload.iter_mut() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8;
    }
    let dir = Direction::SourceToTarget;
    let key = LessSafeKey::new(UnboundKey::new(&AES_256_GCM, &[1u8; 32]).expect("32 bytes"));
    let mut out = BytesMut::with_capacity(2 * MAX_PAYLOAD);
    let h = |i: usize| Header::new(Kind::Data, 1, i as u64 + 1, (i * MAX_PAYLOAD) as u64);
    let names = [
        "seal, the way before (two copies, CRC)",
        "seal, Sealer::frame with CRC",
        "seal, Sealer::frame without CRC",
        "open, CRC checked first",
        "open, no CRC check",
        "noise screen",
        "LZ4 on noise",
        "zstd:-1 on noise",
        "zstd:1 on noise",
        "zstd:3 on noise",
    ];
    let mut runs: Vec<Vec<f64>> = vec![Vec::new(); names.len()];
    // the frames the receivers open: sealed once, with their CRC
    let mut sealed = Vec::with_capacity(FRAMES);
    let mut s = Sealer::new(SECRET, &hello(), &ANSWER, dir);
    for i in 0..FRAMES.min(64) {
        let mut f = BytesMut::new();
        s.frame(&h(i), &payload, &mut f);
        sealed.push(f);
    }
    for round in 0..ROUNDS {
        for c in (0..names.len()).map(|k| (k + round) % names.len()) {
            let t = match c {
                0 => per_gib(|i| {
                    let mut hd = h(i);
                    hd.sealed = true;
                    let len = payload.len() + 16;
                    let aad = sealed_aad(&header_bytes(&hd, len));
                    let mut body = Vec::with_capacity(len);
                    body.extend_from_slice(&payload);
                    let mut n = [0u8; 12];
                    n[4..].copy_from_slice(&(i as u64).to_le_bytes());
                    let tag = key
                        .seal_in_place_separate_tag(
                            Nonce::assume_unique_for_key(n),
                            Aad::from(aad),
                            &mut body,
                        )
                        .expect("below GCM's limit");
                    body.extend_from_slice(tag.as_ref());
                    out.clear();
                    encode_frame(&hd, &body, &mut out);
                    std::hint::black_box(&out);
                }),
                1 | 2 => {
                    let s = Sealer::new(SECRET, &hello(), &ANSWER, dir);
                    let mut s = if c == 2 { s.without_crc() } else { s };
                    per_gib(|i| {
                        out.clear();
                        s.frame(&h(i), &payload, &mut out);
                        std::hint::black_box(&out);
                    })
                }
                5 => per_gib(|_| {
                    assert!(looks_like_noise(std::hint::black_box(&payload)));
                }),
                6..=9 => {
                    let codec =
                        [Codec::Lz4, Codec::Zstd(-1), Codec::Zstd(1), Codec::Zstd(3)][c - 6];
                    per_gib(|_| {
                        std::hint::black_box(codec.compress(&payload));
                    })
                }
                _ => {
                    let mut o = Opener::new(SECRET, &hello(), &ANSWER, dir);
                    // the frames opened in turn, as many as were sealed, again
                    // under a fresh opener each pass (its count is the nonce)
                    per_gib(|i| {
                        let k = i % sealed.len();
                        if k == 0 {
                            o = Opener::new(SECRET, &hello(), &ANSWER, dir);
                        }
                        let f = &sealed[k];
                        let mut head = [0u8; HEADER_LEN];
                        head.copy_from_slice(&f[..HEADER_LEN]);
                        let hd = decode_header(&head).expect("a frame just sealed");
                        if c == 3 {
                            check_crc(&head, &f[HEADER_LEN..]).expect("its CRC");
                        }
                        // the receiver reads each payload into a buffer of its own
                        let body = BytesMut::from(&f[HEADER_LEN..]);
                        std::hint::black_box(o.open(&hd, &head, body).expect("opens"));
                    })
                }
            };
            runs[c].push(t);
        }
    }
    println!(
        "{FRAMES} frames of {} KiB, {ROUNDS} rounds, CPU-s per GiB of payload (median; every round):",
        MAX_PAYLOAD >> 10
    );
    for (name, r) in names.iter().zip(runs.iter_mut()) {
        let every: Vec<String> = r.iter().map(|t| format!("{t:.3}")).collect();
        println!("  {name:40} {:.3}  ({})", median(r), every.join(", "));
    }
}
