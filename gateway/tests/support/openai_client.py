"""Drives the gateway with the official OpenAI Python SDK and prints what it parsed, as one JSON
object, for gateway/tests/e2e.rs to check (texts against the simulated model, usage against the
tokenizer). Any parse error in the SDK fails the script and so the test.

usage: openai_client.py BASE_URL MODEL
"""

import json
import sys

from openai import OpenAI


def main() -> None:
    base, model = sys.argv[1], sys.argv[2]
    client = OpenAI(base_url=base, api_key="test", max_retries=0, timeout=30)
    out = {}
    prompt = "The baton passes between prefill and decode ranks. " * 8
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hello, how are you? " * 4},
    ]

    r = client.completions.create(model=model, prompt=prompt, max_tokens=7)
    out["completion"] = {"text": r.choices[0].text, "usage": r.usage.model_dump(), "object": r.object}

    text, usage = "", None
    for chunk in client.completions.create(
        model=model, prompt=prompt, max_tokens=7, stream=True, stream_options={"include_usage": True}
    ):
        if chunk.choices:
            text += chunk.choices[0].text
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
    out["completion_stream"] = {"text": text, "usage": usage}

    r = client.chat.completions.create(model=model, messages=messages, max_tokens=5)
    out["chat"] = {
        "text": r.choices[0].message.content,
        "role": r.choices[0].message.role,
        "usage": r.usage.model_dump(),
        "finish_reason": r.choices[0].finish_reason,
    }

    text, usage, roles = "", None, []
    for chunk in client.chat.completions.create(
        model=model, messages=messages, max_tokens=5, stream=True, stream_options={"include_usage": True}
    ):
        if chunk.choices:
            d = chunk.choices[0].delta
            text += d.content or ""
            if d.role:
                roles.append(d.role)
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
    out["chat_stream"] = {"text": text, "usage": usage, "roles": roles}

    models = client.models.list()
    out["models"] = [m.id for m in models.data]

    try:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
        out["error"] = None
    except Exception as e:  # the SDK's typed error for a 404
        out["error"] = {"type": type(e).__name__, "status": getattr(e, "status_code", None)}

    print(json.dumps(out))


if __name__ == "__main__":
    main()
