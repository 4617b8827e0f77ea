//! Fuzzes the transport frame decoder: any input either decodes to frames
//! whose CRC holds, asks for more bytes, or is rejected — never a panic.
#![no_main]

use ferry_transport::protocol::decode_frame;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut rest = data;
    while let Ok(Some((h, payload, used))) = decode_frame(rest) {
        assert_eq!(payload.len(), h.len as usize);
        rest = &rest[used..];
    }
});
