//! How fast this machine seals with AES-256-GCM: `ring` (the carriers'
//! cipher) against the portable `aes-gcm` crate, on 64 KiB frames.
//!
//!     cargo run --release -p ferry-transport --example seal_speed

use std::time::Instant;

const FRAME: usize = 64 * 1024;
const FRAMES: u64 = 4000;
const ROUNDS: usize = 5;

fn nonce(i: u64) -> [u8; 12] {
    let mut n = [0u8; 12];
    n[4..].copy_from_slice(&i.to_le_bytes());
    n
}

/// MB/s sealing `FRAMES` frames in place with `seal`.
fn rate(mut seal: impl FnMut(u64, &mut [u8])) -> f64 {
    let mut buf = vec![0x5au8; FRAME];
    let t = Instant::now();
    for i in 0..FRAMES {
        seal(i, &mut buf);
    }
    (FRAME as u64 * FRAMES) as f64 / t.elapsed().as_secs_f64() / 1e6
}

fn main() {
    use aes_gcm::aead::{AeadInPlace, KeyInit};
    use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM};
    let portable = aes_gcm::Aes256Gcm::new(&[1u8; 32].into());
    let ring_key =
        LessSafeKey::new(UnboundKey::new(&AES_256_GCM, &[1u8; 32]).expect("a 32-byte key"));
    let (mut r, mut p) = (Vec::new(), Vec::new());
    // alternating, so that both see the same machine
    for _ in 0..ROUNDS {
        r.push(rate(|i, b| {
            let tag = ring_key
                .seal_in_place_separate_tag(
                    Nonce::assume_unique_for_key(nonce(i)),
                    Aad::from(b"h"),
                    b,
                )
                .expect("a frame far below GCM's limit");
            let _ = std::hint::black_box(tag);
        }));
        p.push(rate(|i, b| {
            let tag = portable
                .encrypt_in_place_detached(&nonce(i).into(), b"h", b)
                .expect("a frame far below GCM's limit");
            let _ = std::hint::black_box(tag);
        }));
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (mr, mp) = (median(&mut r), median(&mut p));
    println!("ring     {mr:.0} MB/s (every round {r:.0?})");
    println!("aes-gcm  {mp:.0} MB/s (every round {p:.0?})");
    println!("ring ÷ aes-gcm: {:.1} ×", mr / mp);
}
