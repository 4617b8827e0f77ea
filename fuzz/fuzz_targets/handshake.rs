//! Fuzzes the carrier handshake: Hello, Welcome and Confirm checks of arbitrary bytes.
#![no_main]

use ferry_transport::protocol::{
    check_confirm, decode_welcome, Hello, CONFIRM_LEN, HELLO_LEN, WELCOME_LEN,
};
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
    if data.len() >= HELLO_LEN + WELCOME_LEN + CONFIRM_LEN {
        let (h, rest) = data.split_at(HELLO_LEN);
        let (w, c) = rest.split_at(WELCOME_LEN);
        let (h, w, c) = (
            h.try_into().unwrap(),
            w.try_into().unwrap(),
            c[..CONFIRM_LEN].try_into().unwrap(),
        );
        // a Confirm is a MAC under the key: no input forges one
        assert!(check_confirm(SECRET, h, w, c).is_err());
    }
});
