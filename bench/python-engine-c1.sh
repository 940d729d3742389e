#!/usr/bin/env bash
# c=1 latency of `baton serve` in front of the reference Python engines (examples/python-engine,
# TP 2, the data plane over TCP on loopback): 400 sequential completions of an 800-token prompt
# (50 chunks of 16 tokens a rank), one token each; the first 50 are not counted.
#
#   bench/python-engine-c1.sh [ENGINE.py] [decode engine flags, e.g. --no-decode-waits]
#
# Needs the test venv with the wheel (scripts/test builds both) and target/release/baton
# (cargo build --release -p baton-gateway). BATON_BENCH_PORT: the gateway's port (18999).
set -euo pipefail
cd "$(dirname "$0")/.."
py=.cache/venv/bin/python
engine=${1:-examples/python-engine/engine.py}
shift || true
port=${BATON_BENCH_PORT:-18999}
dir=$(mktemp -d)
pids=()
trap 'kill "${pids[@]}" 2>/dev/null; wait 2>/dev/null; rm -rf "$dir"' EXIT
"$py" "$engine" --role decode --tp 2 --model baton-sim --pages 64 "$@" >"$dir/decode" &
pids+=($!)
"$py" "$engine" --role prefill --tp 2 --model baton-sim >"$dir/prefill" &
pids+=($!)
hello() { # waits for an engine's first line, then prints one field of it
  for _ in $(seq 100); do [[ -s $1 ]] && break; sleep 0.1; done
  head -1 "$1" | "$py" -c "import json, sys; h = json.load(sys.stdin); print($2)"
}
decode=$(hello "$dir/decode" 'h["listen"]')
prefill=$(hello "$dir/prefill" 'h["listen"]')
ranks=$(hello "$dir/decode" '", ".join(json.dumps(r["addr"]) for r in h["ranks"])')
cat >"$dir/baton.toml" <<TOML
[[listeners]]
address = "127.0.0.1:$port"
plain_http = true

[model]
name = "baton-sim"
context_length = 32768
chunk_tokens = 16
geometry = { layers = 2, kv_heads = 2, head_dim = 16, dtype_bytes = 2 }

[[prefill]]
name = "p"
url = "http://$prefill"

[[decode]]
name = "d"
url = "http://$decode"
dataplane = [$ranks]
TOML
target/release/baton serve --config "$dir/baton.toml" >"$dir/baton.log" 2>&1 &
pids+=($!)
"$py" - "$port" <<'PY'
import http.client, json, sys, time
port = int(sys.argv[1])
for _ in range(100):
    try:
        c = http.client.HTTPConnection("127.0.0.1", port)
        c.connect()
        break
    except OSError:
        time.sleep(0.1)
body = json.dumps({"model": "baton-sim", "prompt": "the quick brown fox " * 40, "max_tokens": 1})
lat = []
for i in range(400):
    t = time.perf_counter()
    c.request("POST", "/v1/completions", body, {"content-type": "application/json"})
    r = c.getresponse()
    r.read()
    assert r.status == 200, (r.status, r.read())
    if i >= 50:
        lat.append(time.perf_counter() - t)
lat.sort()
print(f"n={len(lat)} p50={lat[len(lat) // 2] * 1000:.2f} ms p90={lat[int(len(lat) * 0.9)] * 1000:.2f} ms")
PY
