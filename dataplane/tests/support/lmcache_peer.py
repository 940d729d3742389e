"""A peer that speaks LMCache's PD side channels with the real libraries (pyzmq = libzmq, msgspec),
so baton's own ZMTP and msgpack code is checked against them, not against itself.

The message classes are declared exactly as LMCache declares them in
lmcache/v1/storage_backend/pd_backend.py (msgspec.Struct, tag=True); LMCache itself is not imported
(it needs torch and a GPU).

  push ADDR REQ_ID [COUNT]   PUSH COUNT ProxyNotif(req_id) messages to tcp://ADDR
  pull ADDR COUNT            bind PULL on tcp://ADDR, print each decoded message as a JSON line
  req ADDR                   send one AllocRequest over REQ, print the decoded AllocResponse
"""

import json
import sys
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
        s.bind(f"tcp://{addr}")
        print("bound", flush=True)
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
    else:
        raise SystemExit(f"unknown mode {mode}")
    ctx.term()


if __name__ == "__main__":
    main()
