//! What a move ticket costs: the control service signing one, and a target
//! admitting one (chain, role, signature, claims, nonce), in µs. Five
//! rounds of 2000 each, every round printed, and the medians.
//!
//!     cargo bench -p ferry-api --bench ticket

use std::time::Instant;

use ferry_api::VmSpec;
use ferry_net::ticket::{now_ms, spec_digest, Expect, TicketVerifier};
use ferry_net::tls::{Authority, CertRequest, Pki, Role};

const N: u32 = 2000;

fn main() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let ca = Authority::create(&dir.path().join("ca"), "bench").expect("a CA");
    let req = CertRequest {
        role: Role::Control,
        name: "control".into(),
        san: vec![],
        days: 1,
    };
    ca.issue(&req, &dir.path().join("control"))
        .expect("a certificate");
    let pki = Pki::load(&dir.path().join("control")).expect("the certificate");
    let signer = pki.ticket_signer().expect("a signer");
    let verifier = TicketVerifier::new(pki.roots()).expect("a verifier");
    let spec = VmSpec::workload("vm1", 1 << 30, 512 << 20, 0);
    let (mut signs, mut admits) = (Vec::new(), Vec::new());
    for round in 1..=5 {
        let now = now_ms();
        let t0 = Instant::now();
        let tickets: Vec<_> = (0..N)
            .map(|_| signer.sign(&spec, "host1", "host2", now))
            .collect();
        let sign = t0.elapsed().as_secs_f64() * 1e6 / f64::from(N);
        let t0 = Instant::now();
        for t in &tickets {
            // the digest is part of what a target does per request
            let d = spec_digest(&spec);
            let want = Expect {
                vm: "vm1",
                spec: &d,
                source: "host1",
                target: "host2",
            };
            verifier.admit(Some(t), &want, now).expect("a good ticket");
        }
        let admit = t0.elapsed().as_secs_f64() * 1e6 / f64::from(N);
        println!("round {round}: sign {sign:.1} µs, admit {admit:.1} µs");
        signs.push(sign);
        admits.push(admit);
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    println!(
        "median: sign {:.1} µs, admit {:.1} µs",
        median(&mut signs),
        median(&mut admits)
    );
}
