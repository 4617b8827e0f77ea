//! Fuzzes what a host admits from a caller before anything starts: the
//! names that reach QEMU's command line (machine type, CPU model), the ids
//! and hook names peers and users send, and the qcow2 header an image's
//! writer controls. Nothing panics, and whatever is accepted is what the
//! format allows: no option separator, no path, no more than was read.
#![no_main]

use ferry_api::hardware::{qcow2_backing, validate_cpu_model, validate_machine};
use ferry_api::rolling::validate_hook_name;
use ferry_api::validate_migration_id;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(s) = std::str::from_utf8(data) {
        if validate_machine(s).is_ok() {
            assert!(s == "q35" || s.starts_with("pc-q35-"));
            assert!(!s.contains([',', '=', ' ', '\n']), "{s:?}");
        }
        if validate_cpu_model(s).is_ok() {
            assert!(!s.contains([',', '=', ' ', '\n']), "{s:?}");
        }
        if validate_migration_id(s).is_ok() {
            assert!(s.len() == 16 && s.bytes().all(|b| b.is_ascii_hexdigit()));
        }
        if validate_hook_name(s).is_ok() {
            assert!(!s.contains('/') && !s.starts_with('.') && !s.contains(' '), "{s:?}");
        }
    }
    if let Some(name) = qcow2_backing(data) {
        // a name shown is one read from the header, at most 1023 bytes
        assert!(name.len() <= 1023 * 3 + 64);
    }
});
