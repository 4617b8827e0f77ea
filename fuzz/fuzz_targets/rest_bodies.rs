//! Fuzzes the REST request bodies: arbitrary bytes decoded as each request
//! type the control service and the agents accept (strict JSON, unknown
//! fields refused) and, when they decode, checked the way the handlers
//! check them. Decoding and checking must refuse or accept, never panic,
//! and what is accepted must encode and decode back to itself.
#![no_main]

use ferry_api::bandwidth::{BandwidthPolicy, BandwidthSetRequest};
use ferry_api::drain::{DrainRequest, HostSettings};
use ferry_api::storage::{DiskCreateRequest, Policy, PolicyUpdate, QosSettings};
use ferry_api::{IncomingRequest, MoveRequest, ValidateRequest, VmCreateRequest};
use libfuzzer_sys::fuzz_target;
use serde::{de::DeserializeOwned, Serialize};

/// Decodes `data` as `T`; if it decodes, runs `check` and the round trip.
fn body<T, F>(data: &[u8], check: F)
where
    T: DeserializeOwned + Serialize + PartialEq + std::fmt::Debug,
    F: FnOnce(&T),
{
    if let Ok(v) = serde_json::from_slice::<T>(data) {
        check(&v);
        let again: T = serde_json::from_slice(&serde_json::to_vec(&v).expect("encodes"))
            .expect("what decoded once decodes again");
        assert_eq!(v, again);
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&which, json)) = data.split_first() else {
        return;
    };
    match which % 11 {
        0 => body::<VmCreateRequest, _>(json, |r| {
            let _ = r.spec.validate();
        }),
        1 => body::<MoveRequest, _>(json, |r| {
            let _ = r.convergence.clone().resolve();
        }),
        2 => body::<DrainRequest, _>(json, |_| {}),
        3 => body::<HostSettings, _>(json, |s| {
            let _ = s.check();
        }),
        4 => body::<BandwidthSetRequest, _>(json, |r| {
            let _ = BandwidthPolicy::default().with(r).map(|p| p.check());
        }),
        5 => body::<DiskCreateRequest, _>(json, |_| {}),
        6 => body::<Policy, _>(json, |p| {
            let _ = p.validate();
        }),
        7 => body::<PolicyUpdate, _>(json, |_| {}),
        8 => body::<QosSettings, _>(json, |q| {
            let _ = q.validate();
        }),
        9 => body::<ValidateRequest, _>(json, |_| {}),
        _ => body::<IncomingRequest, _>(json, |r| {
            let _ = r.spec.validate();
        }),
    }
});
