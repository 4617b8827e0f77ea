//! Fuzzes the transport frame decoder: any input either decodes to frames
//! whose CRC holds, asks for more bytes, or is rejected — never a panic.
#![no_main]

use ferry_transport::protocol::decode_frame;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut rest = data;
    while let Ok(Some((h, payload, used))) = decode_frame(rest) {
        // what the stream gets: the payload as sent, or its LZ4 block's raw length
        let want = if h.raw_len > 0 { h.raw_len } else { h.len };
        assert_eq!(payload.len(), want as usize);
        rest = &rest[used..];
    }
});
