//! A misbehaving admission policy for the gateway's sandbox tests: the request's tenant picks the
//! fault. `loop` spins forever, `grow` allocates until memory runs out, `trap` hits `unreachable`,
//! `bad-status` rejects with HTTP status 42, `print` writes to stderr (blocking I/O); anyone else is admitted in class 3. A config with
//! `"refuse"` in it is refused.

//!
//! Built for the frozen `baton:policy@0.1.0` on purpose: the sandbox tests run it, so they also show
//! that plugins built before 0.2.0 still load and run.

wit_bindgen::generate!({ world: "admission", path: "../../../wit/0.1.0" });

use baton::policy::types::Request;
use exports::baton::policy::admission_policy::{Decision, Guest, QueueState, Rejection, Usage};

struct Policy;

impl Guest for Policy {
    fn validate_config(config: String) -> Result<(), String> {
        if config.contains("refuse") { Err("refused as asked".into()) } else { Ok(()) }
    }

    fn admit(req: Request, _queue: QueueState) -> Decision {
        match req.tenant.as_str() {
            "loop" => {
                let mut n: u64 = 0;
                loop {
                    n = std::hint::black_box(n.wrapping_add(1));
                }
            }
            "grow" => {
                let mut hoard: Vec<Vec<u8>> = Vec::new();
                loop {
                    hoard.push(vec![1u8; 1 << 20]);
                    std::hint::black_box(&hoard);
                }
            }
            "trap" => std::process::abort(),
            "print" => {
                eprintln!("policy plugins have no stderr");
                Decision::Admit(3)
            }
            "bad-status" => {
                Decision::Reject(Rejection { status: 42, message: "bad".into(), retry_after_s: None })
            }
            _ => Decision::Admit(3),
        }
    }

    fn on_complete(_req: Request, _usage: Usage) {}
}

export!(Policy);
