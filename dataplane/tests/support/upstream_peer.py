"""The upstream side, in Python: LMCache's PD side channels with the real libraries (pyzmq =
libzmq, msgspec), so baton's own ZMTP and msgpack code is checked against them, not against itself;
and the request flows of LMCache's and vLLM's example proxies, replayed against the simulated
engines.

The message classes are declared exactly as LMCache declares them in
lmcache/v1/storage_backend/pd_backend.py (msgspec.Struct, tag=True); LMCache itself is not imported
(it needs torch and a GPU).

  push ADDR REQ_ID [COUNT]   PUSH COUNT ProxyNotif(req_id) messages to tcp://ADDR
  pull HOST COUNT            bind PULL on a free port of HOST, print `bound PORT`, then each
                             decoded message as a JSON line
  pub HOST                   bind PUB on a free port of HOST, print `bound PORT`, then publish
  req ADDR                   send one AllocRequest over REQ, print the decoded AllocResponse
  proxy HOST DECODE INIT_PORTS ALLOC_PORTS PROMPT MAX_TOKENS
                             bind the proxy's PULL on a free port of HOST and print `bound PORT`;
                             read the prefiller's URL from stdin (it is launched to push to that
                             port), then make one completion the way LMCache's
                             disagg_proxy_server.py makes it (tokenize, prefill with disagg_spec
                             and ret_first_tok, wait for one ProxyNotif per decoder rank, decode
                             from prompt + first token); prints the text as JSON
  nixl-proxy PREFILL DECODE PROMPT MAX_TOKENS
                             one completion the way vLLM's NIXL toy_proxy_server.py makes it
                             (prefill with do_remote_decode, decode with the kv_transfer_params the
                             prefiller returned); prints the text as JSON

A bound socket takes its port from the OS (`bind_to_random_port`) rather than from the caller: a port
the caller found free can be taken by another test before the peer binds it.
"""

import json
import sys
import time
import urllib.request
from typing import Union

import msgspec
import zmq


class PDMsgBase(msgspec.Struct, tag=True):
    pass


class AllocRequest(PDMsgBase):
    keys: list[str]
    fmt: int
    shape: list[int]
    dtype: str
    last_chunk_toks: int


class AllocResponse(PDMsgBase):
    already_sent_indexes: list[int]
    remote_indexes: list[int]


class ProxyNotif(PDMsgBase):
    req_id: str


PDMsg = Union[AllocRequest, AllocResponse, ProxyNotif]
TIMEOUT_MS = 10_000


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=TIMEOUT_MS / 1000) as r:
        return json.loads(r.read())


def bind(s, host: str) -> None:
    """Bind S on a port of HOST the OS picks, and print `bound PORT`."""
    port = s.bind_to_random_port(f"tcp://{host}")
    print(f"bound {port}", flush=True)


def proxy(ctx, host, decode, init_ports, alloc_ports, prompt, max_tokens) -> None:
    """The request flow of LMCache's examples/disagg_prefill/disagg_proxy_server.py, with the same
    request fields, against engines at PREFILL (read from stdin once bound) and DECODE
    (http://IP:PORT)."""
    s = ctx.socket(zmq.PULL)
    s.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
    bind(s, host)
    prefill = sys.stdin.readline().strip()
    init = [int(p) for p in init_ports.split(",")]
    alloc = [int(p) for p in alloc_ports.split(",")]
    tokens = post(f"{prefill}/tokenize", {"prompt": prompt})["tokens"]
    req_id = "1"
    req = {
        "model": "baton-sim",
        "prompt": tokens,
        "max_tokens": 1,
        "stream": False,
        "kv_transfer_params": {
            "ret_first_tok": True,
            "disagg_spec": {
                "req_id": req_id,
                "receiver_host": host,
                "receiver_init_port": init,
                "receiver_alloc_port": alloc,
            },
        },
    }
    out = post(f"{prefill}/v1/completions", req)
    got = 0
    while got < len(init):
        msg = msgspec.msgpack.decode(s.recv(), type=PDMsg)
        if msg.req_id == req_id:
            got += 1
    req["max_tokens"] = int(max_tokens) - 1
    req["prompt"].append(out["kv_transfer_params"]["first_tok"])
    req.pop("kv_transfer_params")
    dec = post(f"{decode}/v1/completions", req)
    print(json.dumps({"text": out["choices"][0]["text"] + dec["choices"][0]["text"]}), flush=True)
    s.close()


def nixl_proxy(prefill, decode, prompt, max_tokens) -> None:
    """The request flow of vLLM's tests/v1/kv_connector/nixl_integration/toy_proxy_server.py."""
    req = {"model": "baton-sim", "prompt": prompt, "max_tokens": int(max_tokens)}
    p = dict(req)
    p["kv_transfer_params"] = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    p["stream"] = False
    p["max_tokens"] = 1
    out = post(f"{prefill}/v1/completions", p)
    params = out.get("kv_transfer_params", {})
    if params:
        req["kv_transfer_params"] = params
    dec = post(f"{decode}/v1/completions", req)
    print(json.dumps({"text": dec["choices"][0]["text"], "params": params}), flush=True)


def main() -> None:
    mode, addr = sys.argv[1], sys.argv[2]
    ctx = zmq.Context()
    if mode == "push":
        count = int(sys.argv[4]) if len(sys.argv) > 4 else 1
        s = ctx.socket(zmq.PUSH)
        s.setsockopt(zmq.LINGER, TIMEOUT_MS)
        s.connect(f"tcp://{addr}")
        for _ in range(count):
            s.send(msgspec.msgpack.encode(ProxyNotif(req_id=sys.argv[3])))
        s.close()
    elif mode == "pull":
        s = ctx.socket(zmq.PULL)
        s.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
        bind(s, addr)
        for _ in range(int(sys.argv[3])):
            msg = msgspec.msgpack.decode(s.recv(), type=PDMsg)
            print(json.dumps({"type": type(msg).__name__, **msgspec.structs.asdict(msg)}), flush=True)
        s.close()
    elif mode == "req":
        s = ctx.socket(zmq.REQ)
        s.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(f"tcp://{addr}")
        req = AllocRequest(keys=["k0", "k1"], fmt=1, shape=[2, 2, 16, 32], dtype="bfloat16", last_chunk_toks=5)
        s.send(msgspec.msgpack.encode(req))
        msg = msgspec.msgpack.decode(s.recv(), type=PDMsg)
        print(json.dumps({"type": type(msg).__name__, **msgspec.structs.asdict(msg)}), flush=True)
        s.close()
    elif mode == "pub":
        # A KV event publisher as vLLM's: binds, then sends [topic, seq (8 bytes big-endian),
        # msgpack batch] on three topics every 20 ms, 200 times (a subscriber needs a moment
        # before libzmq applies its subscription; messages before that are dropped, as in vLLM).
        s = ctx.socket(zmq.PUB)
        s.setsockopt(zmq.LINGER, 0)
        bind(s, addr)
        for seq in range(200):
            batch = msgspec.msgpack.encode([1.5, [], None])
            for topic in (b"kv", b"kvx", b"other"):
                s.send_multipart([topic, seq.to_bytes(8, "big"), batch])
            time.sleep(0.02)
        s.close()
    elif mode == "proxy":
        proxy(ctx, *sys.argv[2:])
    elif mode == "nixl-proxy":
        nixl_proxy(*sys.argv[2:])
    else:
        raise SystemExit(f"unknown mode {mode}")
    ctx.term()


if __name__ == "__main__":
    main()
