//! Fuzzes what a target reads of a move ticket before any signature is
//! checked (see `ferry_net::ticket`): the JSON object, each part's bounds
//! and hex, and the claims. Nothing panics; what is accepted is within the
//! bounds the spec gives; a ticket for another move never passes `check`.
#![no_main]

use ferry_net::ticket::{Claims, Expect, Ticket, MAX_CLAIMS, MAX_ISSUER, MAX_SIGNATURE};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(t) = serde_json::from_slice::<Ticket>(data) {
        if let Ok(p) = ferry_net::ticket::parts(&t) {
            assert!(p.claims.len() <= MAX_CLAIMS);
            assert!(!p.signature.is_empty() && p.signature.len() * 2 <= MAX_SIGNATURE);
            assert!(!p.issuer.is_empty() && p.issuer.len() * 2 <= MAX_ISSUER);
        }
    }
    if let Ok(c) = Claims::parse(data) {
        assert_eq!(c.v, 1);
        let want = Expect {
            vm: "vm1",
            spec: "00",
            source: "host2",
            target: "host1",
        };
        if c.check(&want, 1_800_000_000_000).is_ok() {
            assert!(c.vm == "vm1" && c.spec == "00" && c.source == "host2" && c.target == "host1");
            assert!(c.expires_ms >= 1_800_000_000_000);
        }
    }
});
