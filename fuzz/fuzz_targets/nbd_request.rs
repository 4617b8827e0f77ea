//! Fuzzes the NBD parsers: request headers and their checks against an
//! export, option headers, and INFO/GO option data. Any input is parsed or
//! refused with an error — never a panic, and a checked request never
//! reaches past the export's end.
#![no_main]

use ferry_storage::nbd::proto::{
    check_request, parse_info_request, parse_option_header, parse_request, Command, REQUEST_LEN,
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if data.len() >= REQUEST_LEN {
        let mut h = [0u8; REQUEST_LEN];
        h.copy_from_slice(&data[..REQUEST_LEN]);
        if let Ok(r) = parse_request(&h) {
            let size = 1u64 << 30;
            if let Ok(c) = check_request(&r, size, false) {
                if matches!(c, Command::Read | Command::Write { .. } | Command::Trim { .. }) {
                    assert!(r.offset + r.length as u64 <= size);
                }
            }
        }
    }
    if data.len() >= 16 {
        let mut h = [0u8; 16];
        h.copy_from_slice(&data[..16]);
        let _ = parse_option_header(&h);
    }
    if let Ok((name, infos)) = parse_info_request(data) {
        assert!(name.len() + 6 + 2 * infos.len() <= data.len());
    }
});
