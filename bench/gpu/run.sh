#!/bin/bash
# One call on a GPU machine (no Rust toolchain there): GPU facts, the CUDA device tests, the CUDA
# bench, and the demo's native handoff on cuda against cpu. Results go to $OUT.
#
# Built beforehand on a machine with the toolchain, into .gpu/ (ignored by git), then carried:
#   cargo build --release -p baton-dataplane --bench cuda --tests
#   cargo build --release -p baton-gateway --bin baton --features demo
#   strip -o .gpu/core target/release/deps/core-<hash>
#   strip -o .gpu/cuda-bench target/release/deps/cuda-<hash>
#   strip -o .gpu/baton target/release/baton
set -o pipefail
cd "$(dirname "$0")/../.."
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nvidia-smi | sed -n 1,4p; } | tee $OUT/gpu.txt
echo "== tests"; BATON_REQUIRE_GPU=1 .gpu/core --test-threads 1 2>&1 | tee $OUT/tests.log | grep -E "cuda|gpu|test result|FAIL|panick" | head -40
echo "== bench"; BATON_REQUIRE_GPU=1 .gpu/cuda-bench --out $OUT/cuda-bench.json 2>&1 | tee $OUT/bench.log
for dev in cuda cpu; do
  echo "== demo $dev"
  .gpu/baton demo --device $dev --listen 127.0.0.1:18080 --admin-listen 127.0.0.1:19090 > $OUT/demo-$dev.log 2>&1 &
  pid=$!
  for i in $(seq 50); do curl -sf 127.0.0.1:18080/health >/dev/null 2>&1 && break; sleep 0.2; done
  python3 bench/gpu/demo-e2e.py http://127.0.0.1:18080 2000 32 $OUT/e2e-$dev.json
  curl -s 127.0.0.1:19090/metrics | grep -E "^baton_(requests_total|kv_transfer|pd_buffer)" | head -20 > $OUT/metrics-$dev.txt
  kill -TERM $pid; wait $pid
done
python3 - <<'PY'
import json, os
a = json.load(open(os.environ["OUT"] + "/e2e-cuda.json")); b = json.load(open(os.environ["OUT"] + "/e2e-cpu.json"))
same = sum(a["answers"][k] == b["answers"][k] for k in a["answers"])
print(f"cuda vs cpu: {same}/{len(a['answers'])} answers equal; errors cuda {a['errors']} cpu {b['errors']}")
PY
