"""A reference prefill/decode engine in Python that embeds baton's data plane (``baton_dataplane``)
and speaks the native handoff exactly as ``baton-sim`` does, so the gateway cannot tell them apart.

    python engine.py --role decode  --listen 127.0.0.1:8200 --tp 2 --pages 64 --dp-port 9000
    python engine.py --role prefill --listen 127.0.0.1:8100 --tp 2

On start it prints one JSON line: its HTTP address (``listen``), role, geometry and, for a decoder,
each rank's data-plane address (what goes in the gateway's ``dataplane = [...]``).

- prefill: computes the prompt's KV into its own paged cache (one NHD numpy array per layer and
  rank), gathers each chunk out of it and writes it into the decoder ranks' reserved pages named in
  the request's ``baton.decoders`` (over TCP, all of a rank's chunks and its fence in one round
  trip, or the rank's shared-memory export with ``--shared-memory``), fences every rank it was
  told about, and answers with one token. When the gateway leaves the reservation to it
  (``reserve = "prefiller"``: ``baton.reserve`` and no chunk addresses) it reserves on each rank
  with its first chunks, in the same round trip, and answers 507 ``kv_busy`` when a rank has no
  room;
- decode: one data-plane server per rank (``RankServer``); for a request it takes each rank's
  reservation, consumes it (scattering every chunk into its HND paged cache), checks every byte
  against the model, and generates. Its ranks tell the gateway it waits for the KV itself
  (``--no-decode-waits`` to not): a decode request then comes with the prefill, carrying
  ``baton.kv_wait_ms``, and waits on ``RankServer.take_ready``.

The HTTP side is the standard library's threaded server: one thread per connection, the data-plane
calls release the GIL. ``GET /engine/stats`` shows the buffers and the cache blocks held.
"""

import argparse
import base64
import binascii
import json
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np

import baton_dataplane as bd
from model import DeterministicModel, prefix_hashes, render_chat, tokenize

MAX_BODY = 32 << 20
DEFAULT_MAX_TOKENS = 16
# Chunks per ``Producer.write_chunks`` call: the rank's pipeline window, so a call is one round
# trip and holds at most this many gathered pages.
WRITE_BATCH = 16
DTYPES = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


class EngineError(Exception):
    """An error with the HTTP status and code it maps to (the same as baton-sim's)."""

    def __init__(self, status, code, message):
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


def bad(m):
    return EngineError(400, "invalid_request", m)


def prompt_ids(value):
    """``baton.prompt_token_ids``: a list of ids, or (a pool with ``token_ids = "base64"``) their
    little-endian uint32s in standard base64; ``None`` when absent."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            raw = base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError) as e:
            raise bad(f"prompt_token_ids is a string but not standard padded base64: {e}") from None
        if base64.b64encode(raw).decode("ascii") != value:
            # As the Rust contract reads it: the unused bits of the last character must be zero.
            raise bad("prompt_token_ids is a string but not standard padded base64: trailing bits set")
        if len(raw) % 4:
            raise bad(f"prompt_token_ids decodes to {len(raw)} bytes, not a whole number of 4-byte ids")
        return np.frombuffer(raw, dtype="<u4").tolist()
    if isinstance(value, list) and all(type(i) is int and 0 <= i < 1 << 32 for i in value):
        return value
    raise bad("prompt_token_ids must be a list of token ids or their base64 string")


class BlockPool:
    """A rank's free cache blocks; ``alloc`` is all or nothing."""

    def __init__(self, total):
        self.total = total
        self.free = list(range(total - 1, -1, -1))
        self.lock = threading.Lock()

    def alloc(self, n):
        with self.lock:
            if n > len(self.free):
                return None
            return [self.free.pop() for _ in range(n)]

    def release(self, blocks):
        with self.lock:
            self.free.extend(blocks)

    def held(self):
        with self.lock:
            return self.total - len(self.free)


class Rank:
    """One tensor-parallel rank's paged KV cache: a numpy array per layer, ``order`` "nhd" or "hnd"."""

    def __init__(self, geometry, blocks, block_size, order):
        heads, hd = geometry.heads_per_rank, geometry.head_dim
        dtype = DTYPES[geometry.dtype_bytes]
        shape = (2, blocks, block_size, heads, hd) if order == "nhd" else (2, blocks, heads, block_size, hd)
        self.layers = [np.zeros(shape, dtype=dtype) for _ in range(geometry.layers)]
        self.cache = bd.PagedCache(self.layers, order=order)
        self.order = order
        self.block_size = block_size
        self.pool = BlockPool(blocks)

    def slots(self, blocks, tokens):
        t = np.arange(tokens)
        return np.asarray(blocks, dtype=np.int64)[t // self.block_size], t % self.block_size

    def view(self, layer, kv, blocks, tokens):
        """The cache's elements of the request's tokens as ``[tokens, heads, head_dim]`` (a copy)."""
        b, s = self.slots(blocks, tokens)
        a = self.layers[layer]
        return a[kv, b, s] if self.order == "nhd" else a[kv, b, :, s]


class Engine:
    def __init__(self, args, geometry):
        self.args = args
        self.g = geometry
        self.model = DeterministicModel()
        self.role = args.role
        self.next_id = 0
        self.lock = threading.Lock()
        self.running = 0
        # Requests whose ``baton.prompt_token_ids`` came as a list, and as base64.
        self.ids_forms = {"json": 0, "base64": 0}
        order = "nhd" if self.role == "prefill" else "hnd"
        # The prefiller's cache is NHD, the decoder's HND, so every transfer crosses layouts.
        self.ranks = [Rank(geometry, args.cache_blocks, args.block_size, order) for _ in range(geometry.tp_size)]
        self.servers = []
        if self.role == "decode":
            for r in range(geometry.tp_size):
                port = args.dp_port + r if args.dp_port else 0
                self.servers.append(
                    bd.RankServer(
                        geometry, pages=args.pages, rank=r, host=args.dp_host, port=port,
                        quarantine_ms=args.quarantine_ms, tls_cert=args.dp_tls_cert,
                        tls_key=args.dp_tls_key, tls_client_ca=args.dp_tls_ca,
                        decode_waits=args.decode_waits,
                    )
                )
        self.producers = {}
        self.producers_lock = threading.Lock()
        # Prefill: chunks written, by path. Decode: requests taken once every rank was ready, and
        # those that came with the prefill and waited for the KV (``kv_wait_ms``).
        self.written = {"shared_memory": 0, "socket": 0}
        self.decodes = {"ready": 0, "waited": 0}

    # ---- the model's KV in a rank's cache ----

    def kv_rows(self, hashes, layer, kv, rank):
        rows = self.model.kv(hashes, layer, kv, rank, self.g.heads_per_rank, self.g.head_dim * self.g.dtype_bytes)
        return rows.view(DTYPES[self.g.dtype_bytes]).reshape(len(hashes), self.g.heads_per_rank, self.g.head_dim)

    def compute_kv(self, rank, blocks, hashes):
        """Prefill: the prompt's KV into rank ``rank``'s cache blocks."""
        r = self.ranks[rank]
        b, s = r.slots(blocks, len(hashes))
        for layer, a in enumerate(r.layers):
            for kv in (0, 1):
                a[kv, b, s] = self.kv_rows(hashes, layer, kv, rank)

    def verify_kv(self, rank, blocks, hashes):
        """Decode: every byte scattered into the cache is what the prompt's prefix must produce."""
        r = self.ranks[rank]
        for layer in range(self.g.layers):
            for kv in (0, 1):
                got = r.view(layer, kv, blocks, len(hashes))
                want = self.kv_rows(hashes, layer, kv, rank)
                if not np.array_equal(got, want):
                    bad_t = int(np.nonzero((got != want).any(axis=(1, 2)))[0][0])
                    raise EngineError(
                        500, "internal_error",
                        f"kv mismatch on rank {rank}, layer {layer}, {'KV'[kv]}, token {bad_t}",
                    )

    # ---- prefill ----

    def producer_tls(self):
        """Prefill: mTLS to the decoder ranks when --dp-tls-ca is given (with this engine's
        certificate, and the name the ranks' certificates carry)."""
        a = self.args
        if not a.dp_tls_ca:
            return {}
        return {"tls_ca": a.dp_tls_ca, "tls_cert": a.dp_tls_cert, "tls_key": a.dp_tls_key,
                "server_name": a.dp_tls_name}

    def producer(self, addr, rank):
        with self.producers_lock:
            pool = self.producers.get((addr, rank))
            if pool:
                return pool.pop()
        tls = self.producer_tls()
        if self.args.shared_memory:
            try:
                return bd.Producer(addr, self.g, rank=rank, shared_memory=True, **tls)
            except bd.DataPlaneError:
                pass  # Another host or user, or a rank without an export: the socket carries the chunks.
        try:
            return bd.Producer(addr, self.g, rank=rank, **tls)
        except bd.DataPlaneError as e:
            raise EngineError(502, "kv_transfer_failed", f"decoder rank {rank} at {addr}: {e}") from e

    def give_back(self, addr, rank, p):
        if p.closed:
            return
        with self.producers_lock:
            self.producers.setdefault((addr, rank), []).append(p)

    def fence(self, addr, rank, rid, epoch):
        # A failed fence is harmless: the decoder's quarantine deadline covers it.
        try:
            p = self.producer(addr, rank)
            p.fence(rid, epoch=epoch)
            self.give_back(addr, rank, p)
        except (EngineError, bd.DataPlaneError):
            pass

    def prefill(self, rid, epoch, ids, targets, reserve=None):
        ct = self.g.chunk_tokens
        chunks_needed = -(-len(ids) // ct)
        if reserve is not None:
            # The gateway left the reservation to this prefiller (``reserve = "prefiller"``).
            if (not isinstance(reserve, dict) or reserve.get("chunks") != chunks_needed
                    or not isinstance(reserve.get("lease_ms"), int) or reserve["lease_ms"] <= 0):
                raise bad(f"baton.reserve must be {{chunks: {chunks_needed}, lease_ms: > 0}} for this prompt")
            if any(t.get("chunks") for t in targets if isinstance(t, dict)):
                raise bad("baton.decoders with chunk addresses and baton.reserve: one or the other")
        for t in targets:
            if not isinstance(t, dict) or not isinstance(t.get("rank"), int) or not isinstance(t.get("addr"), str):
                raise bad("baton.decoders: each needs rank and addr")
            if not 0 <= t["rank"] < self.g.tp_size:
                raise bad(f"decoder rank {t['rank']} but this prefiller has {self.g.tp_size} ranks")
            if len(t.get("chunks", [])) > chunks_needed:
                raise bad(f"{len(t['chunks'])} chunk addresses for a prompt of {chunks_needed} chunks")
        hashes = prefix_hashes(ids)
        need = -(-len(ids) // self.args.block_size)
        held = []
        # Targets written to whole (and fenced with their chunks), in order.
        fenced = 0
        try:
            for r, rank in enumerate(self.ranks):
                blocks = rank.pool.alloc(need)
                if blocks is None:
                    raise EngineError(503, "engine_busy", f"prefill rank {r} has no room for {need} cache blocks")
                held.append(blocks)
                self.compute_kv(r, blocks, hashes)
            for t in targets:
                self.send_rank(rid, epoch, t, held[t["rank"]], len(ids), reserve)
                fenced += 1
        finally:
            # Whatever happened, the decoders learn that nothing more will come for this request
            # (a rank written to whole was fenced with its chunks).
            for t in targets[fenced:]:
                self.fence(t["addr"], t["rank"], rid, epoch)
            for r, blocks in enumerate(held):
                self.ranks[r].pool.release(blocks)

    def send_rank(self, rid, epoch, t, blocks, tokens, reserve=None):
        """Writes the request's chunks to one decoder rank and fences it with the last of them
        (``Producer.write_chunks``: one round trip per ``WRITE_BATCH`` chunks, not one each). At
        most a batch of gathered pages is held at once, whatever the prompt's length. With
        ``reserve`` this prefiller reserves the pages itself, the Reserve leaving with the first
        batch and every chunk written to the page the reservation holds for it."""
        rank, addr = t["rank"], t["addr"]
        ct = self.g.chunk_tokens
        if reserve is None:
            addrs = t.get("chunks", [])
        else:
            addrs = [(chunk, None, None) for chunk in range(reserve["chunks"])]
        p = self.producer(addr, rank)
        try:
            for at in range(0, max(len(addrs), 1), WRITE_BATCH):
                batch = []
                for chunk, page, generation in addrs[at:at + WRITE_BATCH]:
                    first = chunk * ct
                    count = max(0, min(ct, tokens - first))
                    batch.append((chunk, page, generation, self.ranks[rank].cache.gather(self.g, blocks, first, count)))
                order = (reserve["chunks"], reserve["lease_ms"]) if reserve is not None and at == 0 else None
                p.write_chunks(rid, batch, epoch=epoch, fence=at + WRITE_BATCH >= len(addrs), reserve=order)
        except bd.ReserveError as e:
            # The contract's answer for a rank without room: the gateway retries later.
            raise EngineError(507, "kv_busy", f"reserving on decoder rank {rank}: {e}") from e
        except bd.DataPlaneError as e:
            raise EngineError(502, "kv_transfer_failed", f"writing to decoder rank {rank}: {e}") from e
        with self.lock:
            self.written["shared_memory" if p.shared_memory else "socket"] += len(addrs)
        self.give_back(addr, rank, p)

    # ---- decode ----

    def take_ready(self, r, server, rid, epoch, chunks, deadline):
        """Rank ``r``'s ready KV of the request. With a ``deadline`` (the decode came with the
        prefill, ``baton.kv_wait_ms``) it waits for the last chunk; without one the KV must be in."""
        if deadline is not None:
            left = max(1, int((deadline - time.monotonic()) * 1000))
            try:
                ready = server.take_ready(rid, epoch=epoch, timeout_ms=left)
            except bd.LeaseError as e:
                raise EngineError(410, "kv_gone", f"kv of {rid:032x} on rank {r}: {e}") from e
            except bd.WaitTimeout as e:
                raise EngineError(504, "kv_transfer_timeout", f"rank {r}: {e}") from e
            if ready is None:
                raise EngineError(409, "kv_not_ready", f"no reservation for {rid:032x} on rank {r}")
            if ready.chunks != chunks:
                ready.close()
                raise bad(f"reservation has {ready.chunks} chunks, the prompt needs {chunks}")
            return ready
        res = server.take(rid, epoch=epoch)
        if res is None:
            raise EngineError(409, "kv_not_ready", f"no reservation for {rid:032x} on rank {r}")
        # Leaving this block in any way other than consuming cancels the reservation.
        with res:
            if res.chunks != chunks:
                raise bad(f"reservation has {res.chunks} chunks, the prompt needs {chunks}")
            try:
                ready = res.try_ready()
            except bd.LeaseError as e:
                raise EngineError(410, "kv_gone", f"kv of {rid:032x} on rank {r}: {e}") from e
            if ready is None:
                raise EngineError(409, "kv_not_ready", f"kv of {rid:032x} is not ready on rank {r}")
        return ready

    def consume(self, rid, epoch, ids, wait_ms=None):
        """Takes the request's KV from every rank into the cache; returns ``[(rank, blocks)]`` held.
        ``wait_ms``: the gateway sent the decode with the prefill; wait that long for the KV."""
        ct = self.g.chunk_tokens
        chunks = -(-len(ids) // ct)
        hashes = prefix_hashes(ids)
        deadline = None if wait_ms is None else time.monotonic() + wait_ms / 1000
        held = []
        try:
            for r, server in enumerate(self.servers):
                ready = self.take_ready(r, server, rid, epoch, chunks, deadline)
                rank = self.ranks[r]
                need = -(-len(ids) // self.args.block_size)
                with ready:
                    blocks = rank.pool.alloc(need)
                    if blocks is None:
                        raise EngineError(503, "engine_busy", f"decode rank {r} has no room for the request's cache blocks")
                    held.append((r, blocks))
                    try:
                        consuming = ready.consume()
                    except bd.LeaseError as e:
                        raise EngineError(410, "kv_gone", f"kv of {rid:032x} on rank {r}: {e}") from e
                with consuming:
                    for chunk in range(chunks):
                        first = chunk * ct
                        consuming.scatter_chunk(chunk, rank.cache, blocks, first, min(ct, len(ids) - first))
                self.verify_kv(r, blocks, hashes)
            return held
        except BaseException:
            self.release(held)
            raise

    def release(self, held):
        for r, blocks in held:
            self.ranks[r].pool.release(blocks)

    # ---- the request ----

    def generate(self, chat, req):
        """``(response dict | token iterator, release)``: what to answer, and what to call once sent."""
        baton = req.get("baton")
        if baton is not None and not isinstance(baton, dict):
            raise bad("baton must be an object")
        given = (baton or {}).get("prompt_token_ids")
        ids = prompt_ids(given)
        if ids is not None:
            with self.lock:
                self.ids_forms["base64" if isinstance(given, str) else "json"] += 1
        if ids is None:
            if chat:
                msgs = req.get("messages")
                if not isinstance(msgs, list):
                    raise bad("messages is required")
                ids = tokenize(render_chat(msgs))
            else:
                prompt = req.get("prompt")
                if isinstance(prompt, str):
                    ids = tokenize(prompt)
                elif isinstance(prompt, list) and all(isinstance(i, int) for i in prompt):
                    ids = prompt
                else:
                    raise bad("prompt is required (a string or token ids)")
        if req.get("n", 1) not in (1, None) or req.get("logprobs") not in (None, False):
            raise bad("the reference engine generates one choice without logprobs")
        n = req.get("max_completion_tokens") or req.get("max_tokens") or DEFAULT_MAX_TOKENS
        if not isinstance(n, int) or n < 1:
            raise bad("max_tokens must be a positive integer")
        held = []
        if baton is not None:
            try:
                rid = int(str(baton.get("request_id", "")), 16)
            except ValueError:
                raise bad("baton.request_id must be up to 32 hex digits") from None
            epoch = int(baton.get("epoch", 0))
            if self.role == "prefill" and baton.get("decoders"):
                self.prefill(rid, epoch, ids, baton["decoders"], baton.get("reserve"))
                # Like a vLLM prefiller in a PD pair: the prompt is processed, one token comes back.
                n = 1
            elif self.role == "decode" and baton.get("local_prefill"):
                # No KV comes (nothing was reserved): the prompt is computed here, as a plain
                # request; the gateway sends this only to a decoder that holds nearly all of it.
                pass
            elif self.role == "decode":
                wait_ms = baton.get("kv_wait_ms")
                if wait_ms is not None and (not isinstance(wait_ms, int) or wait_ms < 1):
                    raise bad("baton.kv_wait_ms must be a positive integer")
                held = self.consume(rid, epoch, ids, wait_ms)
                with self.lock:
                    self.decodes["ready" if wait_ms is None else "waited"] += 1
        else:
            rid = None
        with self.lock:
            self.next_id += 1
            local = self.next_id
        rid_text = baton["request_id"] if baton else f"{local:032x}"
        return ids, self.model.generate(ids, n), rid_text, (lambda: self.release(held))

    def stats(self):
        out = {
            "role": self.role, "model": self.args.model, "tp": self.g.tp_size,
            "geometry_fingerprint": self.g.fingerprint, "chunk_tokens": self.g.chunk_tokens,
            "page_bytes": self.g.page_bytes, "engine_blocks_held": sum(r.pool.held() for r in self.ranks),
            "running": self.running, "prompt_ids": dict(self.ids_forms),
        }
        if self.role == "prefill":
            out["chunks_written"] = dict(self.written)
        if self.servers:
            out["decodes"] = dict(self.decodes)
            out["ranks"] = []
            for server in self.servers:
                s = server.stats()
                out["ranks"].append(dict(s, addr=server.address, pages_total=s["total"], pages_free=s["free"]))
        return out


def chunk_json(chat, rid, model, text, first, finish):
    now = int(time.time())
    if chat:
        delta = {} if text is None else ({"role": "assistant", "content": text} if first else {"content": text})
        return {"id": f"chatcmpl-{rid}", "object": "chat.completion.chunk", "created": now, "model": model,
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
    return {"id": f"cmpl-{rid}", "object": "text_completion", "created": now, "model": model,
            "choices": [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}]}


def usage(prompt, completion):
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    engine = None  # set by main
    # TCP_NODELAY: an answer's headers and body are written apart, and with Nagle's algorithm the
    # body waits for the peer's delayed ACK of the headers: 40 ms on every request on Linux.
    disable_nagle_algorithm = True

    def log_message(self, *a):
        pass

    def send_json(self, status, body):
        data = json.dumps(body).encode()
        try:
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            # The client (the gateway, for a client that left) closed the connection first; the
            # caller still releases what the request held.
            self.close_connection = True

    def send_error_json(self, e):
        kind = "invalid_request_error" if e.status < 500 else "server_error"
        self.send_json(e.status, {"error": {"message": e.message, "type": kind, "param": None, "code": e.code}})

    def do_GET(self):
        if self.path == "/health":
            self.send_json(200, {"status": "ok"})
        elif self.path == "/v1/models":
            self.send_json(200, {"object": "list", "data": [{"id": self.engine.args.model, "object": "model"}]})
        elif self.path == "/engine/stats":
            self.send_json(200, self.engine.stats())
        else:
            self.send_error_json(EngineError(404, "not_found", f"no route GET {self.path}"))

    def do_POST(self):
        chat = {"/v1/chat/completions": True, "/v1/completions": False}.get(self.path)
        length = int(self.headers.get("content-length") or 0)
        if length > MAX_BODY:
            self.close_connection = True
            return self.send_error_json(EngineError(413, "body_too_large", "request body too large"))
        body = self.rfile.read(length)
        if chat is None:
            return self.send_error_json(EngineError(404, "not_found", f"no route POST {self.path}"))
        try:
            req = json.loads(body)
            if not isinstance(req, dict):
                raise bad("the body must be a JSON object")
        except ValueError as e:
            return self.send_error_json(bad(f"invalid request body: {e}"))
        e = self.engine
        with e.lock:
            e.running += 1
        try:
            try:
                ids, tokens, rid, release = e.generate(chat, req)
            except EngineError as err:
                return self.send_error_json(err)
            try:
                self.answer(chat, req, ids, tokens, rid)
            finally:
                release()
        finally:
            with e.lock:
                e.running -= 1

    def answer(self, chat, req, ids, tokens, rid):
        model = req.get("model") or self.engine.args.model
        delay = self.engine.args.token_delay_ms / 1000
        if not req.get("stream"):
            if delay:
                time.sleep(delay * len(tokens))
            text = "".join(t for _, t in tokens)
            choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                       "finish_reason": "length"} if chat else
                      {"index": 0, "text": text, "logprobs": None, "finish_reason": "length"})
            return self.send_json(200, {
                "id": f"{'chatcmpl' if chat else 'cmpl'}-{rid}",
                "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": model, "choices": [choice], "usage": usage(len(ids), len(tokens)),
            })
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("cache-control", "no-cache")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()

        def event(v):
            data = f"data: {v if isinstance(v, str) else json.dumps(v)}\n\n".encode()
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()

        try:
            for i, (_, text) in enumerate(tokens):
                if delay:
                    time.sleep(delay)
                event(chunk_json(chat, rid, model, text, i == 0, None))
            event(chunk_json(chat, rid, model, None, False, "length"))
            if (req.get("stream_options") or {}).get("include_usage"):
                u = chunk_json(chat, rid, model, None, False, None)
                u["choices"], u["usage"] = [], usage(len(ids), len(tokens))
                event(u)
            event("[DONE]")
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            # The client left: the caller releases the cache blocks.
            self.close_connection = True


def parse(argv):
    a = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    a.add_argument("--role", choices=["prefill", "decode"], required=True)
    a.add_argument("--listen", default="127.0.0.1:0")
    a.add_argument("--model", default="baton-python")
    a.add_argument("--tp", type=int, default=1)
    a.add_argument("--geometry", default="tiny", help="tiny, or a Hugging Face config.json")
    a.add_argument("--chunk-tokens", type=int, default=16)
    a.add_argument("--pages", type=int, default=64, help="decode: PD buffer pages per rank")
    a.add_argument("--cache-blocks", type=int, default=4096, help="engine cache blocks per rank")
    a.add_argument("--block-size", type=int, default=16, help="tokens per engine cache block")
    a.add_argument("--token-delay-ms", type=float, default=0.0)
    a.add_argument("--dp-host", default="127.0.0.1", help="decode: where the ranks' data plane listens")
    a.add_argument("--dp-port", type=int, default=0, help="decode: rank r listens on BASE + r (0: ephemeral)")
    a.add_argument("--quarantine-ms", type=int, default=None)
    a.add_argument("--decode-waits", action=argparse.BooleanOptionalAction, default=True,
                   help="decode: wait for a request's KV itself, so the gateway sends the decode with the "
                        "prefill (--no-decode-waits: only once every rank is ready)")
    a.add_argument("--shared-memory", action="store_true",
                   help="prefill: write chunks into a same-host rank's shared-memory export")
    a.add_argument("--dp-tls-cert", help="data-plane TLS: this engine's certificate chain (PEM)")
    a.add_argument("--dp-tls-key", help="data-plane TLS: its private key (PEM)")
    a.add_argument("--dp-tls-ca", help="data-plane TLS: the CA of the peers' certificates; a decoder's ranks "
                                       "then refuse peers without one (mTLS)")
    a.add_argument("--dp-tls-name", default="localhost", help="prefill: the name in the ranks' certificates")
    return a.parse_args(argv)


def geometry_of(args):
    if args.geometry == "tiny":
        return bd.KvGeometry(layers=2, kv_heads=2, head_dim=16, dtype_bytes=2,
                             chunk_tokens=args.chunk_tokens, tp_size=args.tp)
    with open(args.geometry) as f:
        return bd.KvGeometry.from_hf_config(f.read(), chunk_tokens=args.chunk_tokens, tp_size=args.tp)


def main(argv=None):
    args = parse(argv)
    try:
        g = geometry_of(args)
    except (OSError, ValueError) as e:
        print(f"engine: --geometry: {e}", file=sys.stderr)
        return 2
    engine = Engine(args, g)
    host, _, port = args.listen.rpartition(":")
    Handler.engine = engine
    server = ThreadingHTTPServer((host.strip("[]"), int(port)), Handler)
    server.daemon_threads = True
    hello = engine.stats()
    hello["listen"] = f"{host}:{server.server_address[1]}"
    print(json.dumps(hello), flush=True)
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown).start())
    try:
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    server.server_close()
    # Stopping the ranks and dropping them removes their shared-memory files now (a killed
    # process's files are reclaimed by the next buffer made on the host).
    for s in engine.servers:
        s.close()
    engine.servers.clear()
    return 0


if __name__ == "__main__":
    sys.exit(main())
