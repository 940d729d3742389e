"""The reference engine's model: a deterministic function of the token ids, the same as baton-sim's
(sim/src/kv.rs), so a decoder can check every byte of KV it received and any pairing of Python and
simulated engines produces the same text.

- Token ids are the prompt's UTF-8 bytes; a chat is rendered as ``<|role|>\\ncontent\\n`` per
  message, then ``<|assistant|>\\n``.
- The KV of token ``t`` on layer ``l``, K or V, head ``h`` of rank ``r`` is derived from a hash of the
  token ids up to and including ``t`` (the same prefix gives the same KV, as in a real model), ``l``,
  K/V, ``r`` and ``h``.
- Output token ``i`` is one of 32 words, chosen by a hash of the whole sequence before it.

A model is pluggable: anything with ``kv(hashes, layer, kv, rank, heads, head_bytes)`` and
``generate(ids, n)`` will do (see ``engine.py``).
"""

import numpy as np

WORDS = [
    " the", " baton", " passes", " between", " prefill", " and", " decode", " ranks", " without",
    " losing", " a", " single", " page", " of", " cache", " while", " queues", " stay", " fair",
    " under", " load", " so", " every", " request", " finishes", " on", " time", " with", " its",
    " tokens", " intact", ".",
]

MASK = (1 << 64) - 1
PREFIX_BASIS = 0xCBF29CE484222325
FNV_PRIME = 0x100000001B3


def tokenize(text):
    """Byte-level token ids."""
    return list(text.encode("utf-8"))


def content_text(content):
    """A message's text: a string, or the text parts of a content list."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def render_chat(messages):
    out = []
    for m in messages:
        out.append(f"<|{m.get('role', '')}|>\n{content_text(m.get('content'))}\n")
    out.append("<|assistant|>\n")
    return "".join(out)


def extend(h, token_id):
    for b in (token_id & 0xFFFFFFFF).to_bytes(4, "little"):
        h ^= b
        h = (h * FNV_PRIME) & MASK
    return h


def prefix_hashes(ids):
    """``h[t]`` = hash of token ids ``0..=t``."""
    out = np.empty(len(ids), dtype=np.uint64)
    h = PREFIX_BASIS
    for i, t in enumerate(ids):
        h = extend(h, t)
        out[i] = h
    return out


def mix_int(z):
    z = (z + 0x9E3779B97F4A7C15) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


_C1, _C2, _C3 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)


def mix(z):
    """splitmix64's finalizer over a uint64 array (wrapping arithmetic)."""
    z = z + _C1
    z = (z ^ (z >> _S30)) * _C2
    z = (z ^ (z >> _S27)) * _C3
    return z ^ (z >> _S31)


class DeterministicModel:
    """baton-sim's model."""

    name = "deterministic"

    def kv(self, hashes, layer, kv, rank, heads, head_bytes):
        """The KV bytes of every token for one layer and K or V on one rank: ``[tokens, heads,
        head_bytes]`` uint8."""
        words = -(-head_bytes // 8)
        out = np.empty((len(hashes), heads, words), dtype=np.uint64)
        with np.errstate(over="ignore"):
            for head in range(heads):
                salt = mix_int((layer << 40) | (kv << 32) | (rank << 16) | head)
                s = mix(hashes ^ np.uint64(salt))
                for w in range(words):
                    s = mix(s)
                    out[:, head, w] = s
        return out.astype("<u8").view(np.uint8).reshape(len(hashes), heads, words * 8)[:, :, :head_bytes]

    def generate(self, ids, n, choice=0):
        """The first ``n`` output tokens ``[(id, text)]``, each depending on the whole sequence before
        it (so a decoder continues exactly where one engine would)."""
        h = PREFIX_BASIS
        for t in ids:
            h = extend(h, t)
        if choice > 0:
            h = extend(h, 0xFFFFFFFF - choice)
        out = []
        for _ in range(n):
            w = mix_int(h) % len(WORDS)
            out.append((w, WORDS[w]))
            h = extend(h, w)
        return out
