"""Capture KV event frames from vLLM's own publisher code, in both encodings vLLM has shipped.

Writes `gateway/tests/fixtures/vllm-publisher-{0.32,0.9.2}.json`, which the gateway's unit tests
(`kv_events::tests::vllm_publisher_code_decodes_exactly`) decode and compare field by field with
what the publisher was given.

- vLLM 0.32 (the venv `scripts/fetch-vllm` makes): events are msgpack maps tagged by `type`.
- vLLM 0.9.2 (its `vllm/distributed/kv_events.py`, from the PyPI sdist, loaded into the same
  venv; it imports only `vllm.config.KVEventsConfig` and `vllm.logger`, which 0.32 still has):
  events are arrays whose first element is the tag.

Each publisher is the real `ZmqEventPublisher`, bound on loopback with a replay socket: the frames
are what a SUB socket received, and what its ROUTER answered a DEALER asking to replay from
sequence 1 (0.32 adds a topic frame to each reply; 0.9.2 does not).

Run: scripts/capture-kv-events (downloads the 0.9.2 sdist once into .cache/).
"""

import importlib.util
import json
import socket
import sys
import tempfile
import time

import msgspec
import zmq


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def plain(v):
    """What the publisher was given, as JSON: bytes as {"hex": ...}, structs as maps with their tag."""
    if isinstance(v, msgspec.Struct):
        out = {"type": type(v).__name__}
        for f in v.__struct_fields__:
            out[f] = plain(getattr(v, f))
        return out
    if isinstance(v, (bytes, bytearray)):
        return {"hex": bytes(v).hex()}
    if isinstance(v, (list, tuple)):
        return [plain(x) for x in v]
    return v


def capture(mod, batches, topic: str):
    replay_port = free_port()
    # The publisher binds wildcard and ipc endpoints and connects to any other: an ipc socket
    # keeps it off the network (the frames are the same on any transport).
    pub_endpoint = f"ipc://{tempfile.mkdtemp()}/kv-events"
    publisher = mod.ZmqEventPublisher(
        data_parallel_rank=0,
        endpoint=pub_endpoint,
        replay_endpoint=f"tcp://127.0.0.1:{replay_port}",
        topic=topic,
    )
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub_endpoint)
    time.sleep(0.5)  # the subscription reaches the publisher before anything is published
    for b in batches:
        publisher.publish(b)
    live = []
    for b in batches:
        if not sub.poll(5000):
            sys.exit("no frame from the publisher within 5 s")
        live.append({"frames": [f.hex() for f in sub.recv_multipart()], "batch": plain(b)})
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{replay_port}")
    dealer.send_multipart([b"", (1).to_bytes(8, "big")])
    replies = []
    while True:
        if not dealer.poll(5000):
            sys.exit("the replay socket stopped answering")
        frames = dealer.recv_multipart()
        replies.append([f.hex() for f in frames])
        if frames[-2] == b"\xff" * 8:
            break
    for s in (sub, dealer):
        s.close(linger=0)
    publisher.shutdown()
    return {"live": live, "replay_from": 1, "replay": replies}


def main() -> None:
    old_file, out_dir = sys.argv[1], sys.argv[2]
    import vllm
    import vllm.distributed.kv_events as new

    spec = importlib.util.spec_from_file_location("kv_events_0_9_2", old_file)
    old = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old)

    sha = bytes(range(32))
    new_batches = [
        new.KVEventBatch(
            ts=1760000000.25,
            events=[
                new.BlockStored(
                    block_hashes=[-2, 2**63 + 5],
                    parent_block_hash=None,
                    token_ids=list(range(8)),
                    block_size=4,
                    lora_id=None,
                    medium="GPU",
                    lora_name=None,
                ),
                new.BlockRemoved(block_hashes=[2**63 + 5], medium="GPU"),
            ],
        ),
        new.KVEventBatch(
            ts=1760000001.5,
            events=[
                new.BlockStored(
                    block_hashes=[sha],
                    parent_block_hash=bytes(reversed(sha)),
                    token_ids=[100, 4000, 65000, 7],
                    block_size=4,
                    lora_id=3,
                    medium="CPU",
                    lora_name="adapter-a",
                    extra_keys=[("adapter-a",)],
                    group_idx=0,
                    kv_cache_spec_kind="full_attention",
                ),
                new.AllBlocksCleared(),
            ],
            data_parallel_rank=1,
        ),
    ]
    old_batches = [
        old.KVEventBatch(
            ts=1750000000.75,
            events=[
                old.BlockStored(
                    block_hashes=[-7, 11],
                    parent_block_hash=5,
                    token_ids=list(range(10, 18)),
                    block_size=4,
                    lora_id=None,
                ),
                old.BlockRemoved(block_hashes=[11]),
            ],
        ),
        old.KVEventBatch(
            ts=1750000001.0,
            events=[
                old.BlockStored(
                    block_hashes=[12], parent_block_hash=None, token_ids=[1, 2, 3, 4], block_size=4, lora_id=9
                ),
                old.AllBlocksCleared(),
            ],
        ),
    ]
    version = vllm.__version__.split("+")[0]
    for v, mod, batches, topic in [(version, new, new_batches, ""), ("0.9.2", old, old_batches, "kv")]:
        got = capture(mod, batches, topic)
        got["source"] = f"vLLM {v} vllm/distributed/kv_events.py: ZmqEventPublisher, topic {topic!r}"
        name = f"vllm-publisher-{v}"
        with open(f"{out_dir}/{name}.json", "w") as f:
            json.dump(got, f, indent=1)
            f.write("\n")
        print(f"wrote {out_dir}/{name}.json: {len(got['live'])} batches, {len(got['replay'])} replay replies")


if __name__ == "__main__":
    main()
