"""Uses `baton demo`, started with its default flags, as a new user would with the official OpenAI
Python SDK, and prints what it saw as one JSON object for gateway/tests/e2e.rs to check: a ten-turn
chat, 64 concurrent requests of 20 to 2,500 tokens (half streamed), a prompt list of 3 (whole and
streamed), n=2, logprobs on both endpoints, and the error for max_tokens=-5. Any error the SDK
raises where none is expected fails the script and so the test.

usage: openai_demo.py BASE_URL
"""

import asyncio
import json
import random
import sys

import openai
from openai import AsyncOpenAI, OpenAI

MODEL = "baton-sim"
WORDS = "the baton passes between prefill and decode ranks while pages wait in the buffer".split()


def text(rng, tokens):
    """About `tokens` tokens of the demo's byte-level tokenizer (one token a byte)."""
    out = ""
    while len(out) < tokens:
        out += rng.choice(WORDS) + " "
    return out[:tokens]


def chat_turns(client, rng):
    messages = [{"role": "system", "content": "You are a patient assistant."}]
    prompt_tokens = []
    for turn in range(10):
        messages.append({"role": "user", "content": f"Turn {turn}: " + text(rng, 240)})
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16)
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
        prompt_tokens.append(r.usage.prompt_tokens)
    return {"prompt_tokens": prompt_tokens, "messages": len(messages)}


async def concurrent(base, rng):
    client = AsyncOpenAI(base_url=base, api_key="demo", max_retries=0, timeout=120)
    sizes = [20 + (2480 * i) // 63 for i in range(64)]
    rng.shuffle(sizes)

    async def one(i, size):
        prompt = text(rng, size)
        if i % 2:
            got, usage = "", None
            stream = await client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=8, stream=True, stream_options={"include_usage": True}
            )
            async for chunk in stream:
                if chunk.choices:
                    got += chunk.choices[0].text
                if chunk.usage is not None:
                    usage = chunk.usage
            return {"size": size, "prompt_tokens": usage.prompt_tokens, "text": len(got) > 0, "stream": True}
        r = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=8)
        return {"size": size, "prompt_tokens": r.usage.prompt_tokens, "text": len(r.choices[0].text) > 0, "stream": False}

    results = await asyncio.gather(*(one(i, s) for i, s in enumerate(sizes)))
    await client.close()
    return results


def main():
    base = sys.argv[1]
    rng = random.Random(7)
    client = OpenAI(base_url=base, api_key="demo", max_retries=0, timeout=120)
    out = {"chat": chat_turns(client, rng), "concurrent": asyncio.run(concurrent(base, rng))}

    prompts = [text(rng, 40), text(rng, 60), text(rng, 80)]
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=6)
    whole = {c.index: c.text for c in r.choices}
    streamed, usage = {}, None
    for chunk in client.completions.create(
        model=MODEL, prompt=prompts, max_tokens=6, stream=True, stream_options={"include_usage": True}
    ):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
        if chunk.usage is not None:
            usage = chunk.usage
    out["prompt_list"] = {
        "whole": [whole[i] for i in sorted(whole)],
        "streamed": [streamed[i] for i in sorted(streamed)],
        "prompt_tokens": r.usage.prompt_tokens,
        "streamed_prompt_tokens": usage.prompt_tokens,
    }

    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Two takes, please."}], n=2, max_tokens=6
    )
    out["n2"] = {"texts": [c.message.content for c in r.choices], "completion_tokens": r.usage.completion_tokens}

    r = client.completions.create(model=MODEL, prompt="Score me.", max_tokens=4, logprobs=2)
    lp = r.choices[0].logprobs
    out["logprobs_completion"] = {"tokens": len(lp.tokens), "top": [len(t) for t in lp.top_logprobs]}
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Score me."}], max_tokens=4, logprobs=True, top_logprobs=2
    )
    content = r.choices[0].logprobs.content
    out["logprobs_chat"] = {"tokens": len(content), "top": [len(t.top_logprobs) for t in content]}

    try:
        client.completions.create(model=MODEL, prompt="x", max_tokens=-5)
        out["bad_max_tokens"] = None
    except openai.BadRequestError as e:
        out["bad_max_tokens"] = {"status": e.status_code, "param": e.param, "code": e.code, "message": e.message}

    print(json.dumps(out))


if __name__ == "__main__":
    main()
