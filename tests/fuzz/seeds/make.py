#!/usr/bin/env python3
"""Writes the fuzz targets' starting inputs into tests/fuzz/corpus/TARGET/seed-*: one or a few
valid inputs per format, from the formats' definitions and the captured vLLM frames in
gateway/tests/fixtures. `scripts/fuzz --grow` then adds what the fuzzer finds. Standard library
only; run from anywhere."""

import json
import os
import struct
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent.parent
CORPUS = HERE.parent / "corpus"


def put(target, name, data):
    d = CORPUS / target
    d.mkdir(parents=True, exist_ok=True)
    (d / f"seed-{name}").write_bytes(data if isinstance(data, bytes) else data.encode())


# The data plane's frames (dataplane/src/wire/codec.rs): len:u32le version:u8 kind:u8 flags:u16le body.
def frame(kind, body):
    return struct.pack("<IBBH", 4 + len(body), 1, kind, 0) + body


key = (7).to_bytes(16, "little") + struct.pack("<I", 0)
put("dataplane_wire", "info", frame(3, b""))
put("dataplane_wire", "hello", frame(1, struct.pack("<BQI", 1, 0x1234, 0)))
put("dataplane_wire", "cancel", frame(8, key))
put("dataplane_wire", "reserve", frame(5, key + struct.pack("<IQI", 3, 30000, 0)))
put("dataplane_wire", "grant", frame(17, key + struct.pack("<III", 0, 4, 1)))
payload = bytes(range(32))
put("dataplane_wire", "chunk", frame(11, key + struct.pack("<IIIQI", 0, 4, 1, 0, len(payload)) + payload))

# ZMTP 3: a PUSH peer's greeting, READY and one message (dataplane/src/compat/zmtp.rs).
greeting = b"\xff" + b"\x00" * 8 + b"\x7f" + bytes([3, 0]) + b"NULL".ljust(20, b"\x00") + b"\x00" + b"\x00" * 31
ready = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", 4) + b"PUSH"
msg = b'\x82\xa4type\xaaProxyNotif\xa6req_id\xa2r1'
put("zmtp", "push", greeting + bytes([0x04, len(ready)]) + ready + bytes([0x00, len(msg)]) + msg)
put("zmtp", "two-frames", greeting + bytes([0x04, len(ready)]) + ready + b"\x01\x00" + bytes([0x00, len(msg)]) + msg)

# KV events: captured vLLM frames, joined by the target's 0xFF 0x00 frame separator.
SEP = b"\xff\x00"
for version in ("0.32.0", "0.9.2"):
    fixture = json.loads((ROOT / "gateway/tests/fixtures" / f"vllm-publisher-{version}.json").read_text())
    for i, m in enumerate(fixture["live"][:3]):
        put("kv_events", f"vllm-{version}-{i}", SEP.join(bytes.fromhex(f) for f in m["frames"]))

# LMCache's PD messages, as msgspec writes them (a map, the `type` tag first).
def mp_str(s):
    b = s.encode()
    return bytes([0xA0 | len(b)]) + b


put("lmcache_msg", "proxy-notif", b"\x82" + mp_str("type") + mp_str("ProxyNotif") + mp_str("req_id") + mp_str("r1"))
put(
    "lmcache_msg",
    "alloc-response",
    b"\x83" + mp_str("type") + mp_str("AllocResponse") + mp_str("already_sent_indexes") + b"\x91\x00"
    + mp_str("remote_indexes") + b"\x92\x01\x02",
)

# SSE: the first byte is where the stream is cut.
put("sse", "stream", b"\x10" + b'data: {"choices":[{"text":"a"}]}\n\ndata: [DONE]\n\n')
put("sse", "crlf", b"\x03" + b"event: x\r\ndata: y\r\n\r\ndata:z\n\n")

# Requests: the first byte picks the endpoint (even: completions, odd: chat).
put("request", "completion", b"\x00" + json.dumps({"model": "m", "prompt": "hi", "max_tokens": 4, "stream": True,
    "stream_options": {"include_usage": True}, "stop": ["\n"], "logprobs": 2, "n": 2}).encode())
put("request", "chat", b"\x01" + json.dumps({"model": "m", "messages": [{"role": "system", "content": "s"},
    {"role": "user", "content": [{"type": "text", "text": "hi"}]}], "tools": [{"type": "function",
    "function": {"name": "f", "parameters": {"type": "object"}}}], "max_completion_tokens": 3}).encode())

# Configuration files: the shipped examples.
for f in sorted((ROOT / "configs").glob("*.toml")):
    put("config", f.stem, f.read_bytes())

# Text for the tokenizers: whitespace runs, contractions, digits, Unicode that normalizes, added
# tokens whole and cut (gateway/src/tokenize/fast.rs).
put("tokenize", "english", "It's the gateway's 1st run:  12345 tokens, 'LL do.\n\n\tNext   line  \r\n")
put("tokenize", "unicode", "e\u0301te\u0301 \u212bngstr\u00f6m \u65e5\u672c\u8a9e \U0001f389\u200d \u00a0x\u3000y \u017fs")
put("tokenize", "added", "<|im_start|>user\nhi<|im_end|>\n<|begin_of_text|><|eot_id|><|im_st")
