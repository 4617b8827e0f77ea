//! Fuzzes the transport frame decoder: any input either decodes to frames
//! whose CRC holds, asks for more bytes, or is rejected — never a panic.
//! A second pass wraps the input in a DATA frame with a valid CRC, packed
//! as LZ4 or zstd with a claimed raw length, so the decompressors see
//! hostile payloads too: they yield exactly the claimed length or an error.
#![no_main]

use bytes::BytesMut;
use ferry_transport::protocol::{decode_frame, encode_frame, Header, Kind, Packing, MAX_PAYLOAD};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut rest = data;
    while let Ok(Some((h, payload, used))) = decode_frame(rest) {
        // what the stream gets: the payload as sent, or its raw length once unpacked
        let want = if h.raw_len > 0 { h.raw_len } else { h.len };
        assert_eq!(payload.len(), want as usize);
        rest = &rest[used..];
    }
    if data.len() < 5 {
        return;
    }
    let packing = if data[0] & 1 == 0 { Packing::Lz4 } else { Packing::Zstd };
    let claim = u32::from_le_bytes([data[1], data[2], data[3], data[4]]) % (MAX_PAYLOAD as u32) + 1;
    let payload = &data[5..data.len().min(5 + MAX_PAYLOAD)];
    if payload.is_empty() {
        return;
    }
    let mut h = Header::new(Kind::Data, 1, 1, 0);
    h.packing = packing;
    h.raw_len = claim;
    let mut frame = BytesMut::new();
    encode_frame(&h, payload, &mut frame);
    if let Ok(Some((_, raw, _))) = decode_frame(&frame) {
        assert_eq!(raw.len(), claim as usize);
    }
});
