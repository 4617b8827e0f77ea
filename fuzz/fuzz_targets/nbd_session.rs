//! Fuzzes a whole NBD session: arbitrary client bytes into the server's
//! handshake and transmission phases, over an in-memory pipe, against one
//! 1 MiB export. The server must answer or hang up — never panic, never
//! write past the export.
#![no_main]

use std::sync::{Arc, OnceLock};

use ferry_storage::export::Export;
use ferry_storage::nbd::server::{
    serve_connection, Attachment, Catalog, NbdLimits, Peer, Refusal,
};
use ferry_storage::qos::{Config, Scheduler, Ticket};
use libfuzzer_sys::fuzz_target;
use tokio::io::AsyncWriteExt;

struct One {
    export: Arc<Export>,
    sched: Arc<Scheduler>,
    /// The export's file, its name unlinked as soon as it was opened: the
    /// size is checked through it, and nothing is left in /tmp when the
    /// fuzzer exits (libFuzzer runs no destructors)
    file: std::fs::File,
}

struct Att(Arc<Export>, Arc<Scheduler>);

impl Attachment for Att {
    fn export(&self) -> &Arc<Export> {
        &self.0
    }
    fn request(&self, bytes: u64) -> Ticket {
        self.1.request(1, bytes)
    }
}

impl Catalog for One {
    fn list(&self, _peer: &Peer) -> Vec<String> {
        vec!["d".into()]
    }
    fn describe(&self, name: &str, _peer: &Peer) -> Result<(u64, bool), Refusal> {
        (name == "d")
            .then(|| (self.export.size(), false))
            .ok_or_else(|| Refusal::Unknown(format!("no export '{name}'")))
    }
    fn attach(&self, name: &str, _peer: &Peer) -> Result<Box<dyn Attachment>, Refusal> {
        (name == "d")
            .then(|| Box::new(Att(self.export.clone(), self.sched.clone())) as Box<dyn Attachment>)
            .ok_or_else(|| Refusal::Unknown(format!("no export '{name}'")))
    }
}

fn catalog() -> Arc<One> {
    static C: OnceLock<Arc<One>> = OnceLock::new();
    C.get_or_init(|| {
        let p = std::env::temp_dir().join(format!("ferry-fuzz-{}.img", std::process::id()));
        let _ = std::fs::remove_file(&p);
        let export = Arc::new(Export::create("d", &p, 1 << 20, false).expect("export file"));
        let file = std::fs::File::open(&p).expect("the export's file");
        std::fs::remove_file(&p).expect("unlinking the export's file");
        Arc::new(One {
            export,
            sched: Scheduler::new(Config::default()),
            file,
        })
    })
    .clone()
}

fuzz_target!(|data: &[u8]| {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let one = catalog();
        let (mut client, server) = tokio::io::duplex(1 << 16);
        let peer = "127.0.0.1:1".parse().expect("addr");
        // structured replies on: their error chunks are fuzzed too
        let limits = NbdLimits {
            structured_replies: true,
            ..Default::default()
        };
        let task = tokio::spawn(serve_connection(server, peer, one.clone(), limits));
        // an odd first byte fuzzes the handshake from its first byte; an even
        // one sends a valid handshake (structured replies, GO to "d") first,
        // so the rest reaches the transmission phase
        if let Some((&mode, rest)) = data.split_first() {
            if mode % 2 == 0 {
                let _ = client.write_all(&valid_handshake()).await;
            }
            let _ = client.write_all(rest).await;
        }
        drop(client);
        let _ = tokio::time::timeout(std::time::Duration::from_secs(5), task).await;
        let len = one.file.metadata().expect("the export's size").len();
        assert_eq!(len, 1 << 20, "a session changed the export's size");
    });
});

fn option(opt: u32, data: &[u8]) -> Vec<u8> {
    let mut v = b"IHAVEOPT".to_vec();
    v.extend_from_slice(&opt.to_be_bytes());
    v.extend_from_slice(&(data.len() as u32).to_be_bytes());
    v.extend_from_slice(data);
    v
}

fn valid_handshake() -> Vec<u8> {
    let mut v = 3u32.to_be_bytes().to_vec();
    v.extend(option(8, &[]));
    v.extend(option(7, &[0, 0, 0, 1, b'd', 0, 0]));
    v
}
