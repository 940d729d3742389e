"""Admission by token budget, the Python version of plugins/rust/token-budget: the same config, the
same decisions (the gateway's tests compare all three languages on one table of requests)."""

import json

from componentize_py_types import Err
from wit_world import exports
from wit_world.exports.admission_policy import (
    Decision_Admit,
    Decision_Queue,
    Decision_Reject,
    Queued,
    Rejection,
)
from wit_world.imports import host

DEFAULTS = {"tokens_per_minute": 60000, "default_max_tokens": 256, "low_priority_max_wait_ms": 2000}
U32 = 0xFFFFFFFF


def is_u32(v):
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= U32


def parse(text):
    try:
        raw = json.loads(text)
    except ValueError as e:
        raise Err(f"token-budget config: {e}")
    if not isinstance(raw, dict):
        raise Err("token-budget config: not a table")
    c = dict(DEFAULTS, tenants={}, unmetered_bands=[])
    for k, v in raw.items():
        if k == "unmetered_bands":
            if not isinstance(v, list) or not all(isinstance(b, str) for b in v):
                raise Err("token-budget config: unmetered_bands is not a list of strings")
            c[k] = v
        elif k == "tenants":
            if not isinstance(v, dict):
                raise Err("token-budget config: tenants is not a table")
            for name, t in v.items():
                if not isinstance(t, dict):
                    raise Err(f"token-budget config: tenant {name} is not a table")
                tenant = {}
                for tk, tv in t.items():
                    if tk == "tokens_per_minute":
                        if not is_u32(tv):
                            raise Err(f"token-budget config: tenant {name}: tokens_per_minute is not a u32")
                        if tv == 0:
                            raise Err(f"token-budget config: tenant {name}: tokens_per_minute must be above 0")
                        tenant[tk] = tv
                    elif tk == "priority":
                        if not is_u32(tv) or tv > 255:
                            raise Err(f"token-budget config: tenant {name}: priority is not a u8")
                        if tv > 7:
                            raise Err(f"token-budget config: tenant {name}: priority must be 0-7")
                        tenant[tk] = tv
                    else:
                        raise Err(f"token-budget config: tenant {name}: unknown field {tk}")
                c["tenants"][name] = tenant
        elif k in DEFAULTS:
            if not is_u32(v):
                raise Err(f"token-budget config: {k} is not a u32")
            c[k] = v
        else:
            raise Err(f"token-budget config: unknown field {k}")
    if c["tokens_per_minute"] == 0:
        raise Err("token-budget config: tokens_per_minute must be above 0")
    return c


_config = None


def config():
    global _config
    if _config is None:
        try:
            _config = parse(host.config())
        except Err as e:
            host.log(host.Level.ERROR, str(e.value))
            _config = dict(DEFAULTS, tenants={}, unmetered_bands=[])
    return _config


def tenant_of(req):
    return "anonymous" if req.tenant == "" else req.tenant


def max_tokens(req, c):
    return req.max_tokens if req.max_tokens > 0 else c["default_max_tokens"]


def unmetered(req, c):
    """Whether flow control put the request in a band the budget does not count."""
    return req.band is not None and req.band in c["unmetered_bands"]

class AdmissionPolicy(exports.AdmissionPolicy):
    def validate_config(self, config_json):
        parse(config_json)

    def admit(self, req, queue):
        c = config()
        if unmetered(req, c):
            return Decision_Admit(0)
        name = tenant_of(req)
        t = c["tenants"].get(name, {})
        tpm = t.get("tokens_per_minute", c["tokens_per_minute"])
        cls = t.get("priority", 0)
        if req.priority == "low":
            cls = 0
        cost = min(req.prompt_tokens + max_tokens(req, c), U32)
        if cost > tpm:
            return Decision_Reject(
                Rejection(
                    status=400,
                    message=f"request needs {cost} tokens, more than tenant {name}'s budget of {tpm} tokens per minute",
                    retry_after_s=None,
                )
            )
        s = host.bucket_take(f"tpm/{name}", tpm, tpm, cost)
        if not s.taken:
            return Decision_Reject(
                Rejection(
                    status=429,
                    message=f"tenant {name} is over its budget of {tpm} tokens per minute",
                    retry_after_s=max(1, -(-s.retry_after_ms // 1000)),
                )
            )
        if cls == 0 and queue.free_slots < req.slots:
            return Decision_Queue(Queued(priority=0, max_wait_ms=c["low_priority_max_wait_ms"]))
        return Decision_Admit(cls)

    def on_complete(self, req, usage):
        c = config()
        if unmetered(req, c):
            return
        unused = max(0, max_tokens(req, c) - usage.completion_tokens)
        if unused > 0:
            host.bucket_give(f"tpm/{tenant_of(req)}", unused)
