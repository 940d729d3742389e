"""The demo's whole native handoff on one device: N requests at concurrency C, each answer's text
recorded, so that a cuda run and a cpu run of the same prompts can be compared."""
import json, sys, time, urllib.request
from concurrent.futures import ThreadPoolExecutor

base, n, c, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]

def one(i):
    words = " ".join(f"w{(i * 7 + k) % 97}" for k in range(16 + (i * 37) % 900))
    body = {"model": "baton-sim", "prompt": words, "max_tokens": 8 + i % 24, "temperature": 0}
    req = urllib.request.Request(base + "/v1/completions", json.dumps(body).encode(),
                                 {"content-type": "application/json"})
    t = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            ans = json.load(r)
        return i, ans["choices"][0]["text"], ans["usage"], time.monotonic() - t, None
    except Exception as e:  # noqa: BLE001
        return i, None, None, time.monotonic() - t, repr(e)

t0 = time.monotonic()
with ThreadPoolExecutor(c) as ex:
    rows = list(ex.map(one, range(n)))
wall = time.monotonic() - t0
errors = [r for r in rows if r[4]]
lat = sorted(r[3] for r in rows)
json.dump({"n": n, "c": c, "wall_s": wall, "errors": len(errors), "first_errors": [r[4] for r in errors[:5]],
           "p50_s": lat[len(lat) // 2], "p99_s": lat[int(len(lat) * 0.99)],
           "answers": {str(r[0]): [r[1], r[2]] for r in rows}}, open(out, "w"))
print(f"{out}: {n} requests, c={c}, {len(errors)} errors, wall {wall:.2f}s, p50 {lat[len(lat)//2]*1e3:.1f} ms")
