//! Fuzzes the carrier handshake: Hello and Welcome decoding of arbitrary bytes.
#![no_main]

use ferry_transport::protocol::{decode_welcome, Hello, HELLO_LEN, WELCOME_LEN};
use libfuzzer_sys::fuzz_target;

const SECRET: &[u8] = b"fuzzing-credential-fuzzing-credential";

fuzz_target!(|data: &[u8]| {
    if data.len() >= HELLO_LEN {
        let mut b = [0u8; HELLO_LEN];
        b.copy_from_slice(&data[..HELLO_LEN]);
        // without the secret no input may pass
        assert!(
            Hello::decode(&b, SECRET).is_err()
                || b == Hello::decode(&b, SECRET)
                    .map(|h| h.encode(SECRET))
                    .unwrap_or([0; HELLO_LEN])
        );
    }
    if data.len() >= WELCOME_LEN + 16 {
        let mut w = [0u8; WELCOME_LEN];
        w.copy_from_slice(&data[..WELCOME_LEN]);
        let mut nonce = [0u8; 16];
        nonce.copy_from_slice(&data[WELCOME_LEN..WELCOME_LEN + 16]);
        let _ = decode_welcome(&w, &nonce, SECRET);
    }
});
