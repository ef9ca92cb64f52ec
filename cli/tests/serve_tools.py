"""Tool calls, checked through the official `openai` client against a server given a
Hermes-style template that renders tools (SmolLM2's own does not). Run from
serve_openai.py, whose helpers it shares (serve_common.py).
"""

import json
import os
import re
import subprocess

import openai

from serve_common import BINARY, MODEL, MODEL_ID, Server, check, error_of, http

# A server with a Hermes-style template that renders tools (SmolLM2's own does not).
TEMPLATE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "templates", "hermes-tools.jinja")
tooled = Server("--ctx-size", "4096", "--chat-template-file", TEMPLATE)
tooled.wait_ready()
tc = tooled.client()

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time in a time zone, as an offset from UTC in hours.",
        "parameters": {
            "type": "object",
            "properties": {"offset": {"type": "integer", "minimum": -12, "maximum": 14}},
            "required": ["offset"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, CLOCK]
ASK = [{"role": "user", "content": "What is the weather in Paris and in London, and what time is it in Tokyo?"}]


def valid_arguments(name, arguments):
    """The checks each tool's schema asks for, written out (no schema validator needed)."""
    value = json.loads(arguments)
    if name == "get_weather":
        assert isinstance(value, dict) and set(value) == {"city", "unit"}, value
        assert isinstance(value["city"], str) and len(value["city"]) <= 30, value
        assert value["unit"] in ("celsius", "fahrenheit"), value
    else:
        assert name == "get_time", name
        assert isinstance(value, dict) and set(value) == {"offset"}, value
        assert isinstance(value["offset"], int) and -12 <= value["offset"] <= 14, value


def valid_calls(message, names=("get_weather", "get_time")):
    assert message.tool_calls, message
    for call in message.tool_calls:
        assert call.type == "function" and re.fullmatch(r"call_[A-Za-z0-9]{24}", call.id), call
        assert call.function.name in names, call
        valid_arguments(call.function.name, call.function.arguments)
    assert len({c.id for c in message.tool_calls}) == len(message.tool_calls)


def streamed_calls(**ask):
    """The calls of a streamed answer, put together from their deltas (checking that
    each call's first delta has its id, type and name, and the indexes run 0, 1, ...),
    the streamed content, and the finish reason."""
    calls, content, finish = [], "", None
    for chunk in tc.chat.completions.create(model=MODEL_ID, stream=True, **ask):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
            for d in choice.delta.tool_calls or []:
                if d.index == len(calls):
                    assert d.id and d.type == "function" and d.function.name, d
                    calls.append({"id": d.id, "name": d.function.name, "arguments": d.function.arguments or ""})
                else:
                    assert d.index == len(calls) - 1 and not d.id, (d, calls)
                    calls[d.index]["arguments"] += d.function.arguments or ""
    return calls, content, finish


@check("tool_choice required gives a valid call of the tools, streamed or not")
def _():
    for temperature, seed in [(0, 0), (1.0, 1)]:
        r = tc.chat.completions.create(
            model=MODEL_ID, messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
            max_tokens=200, temperature=temperature, seed=seed,
        )
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content is None and len(choice.message.tool_calls) == 1, choice.message
        valid_calls(choice.message)
    calls, content, finish = streamed_calls(
        messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=200, temperature=0
    )
    assert finish == "tool_calls" and content == "" and len(calls) == 1, (calls, content, finish)
    assert calls[0]["name"] in ("get_weather", "get_time") and calls[0]["id"].startswith("call_"), calls
    valid_arguments(calls[0]["name"], calls[0]["arguments"])
    # Greedy: the streamed call is the one answered whole.
    whole = tc.chat.completions.create(
        model=MODEL_ID, messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
        max_tokens=200, temperature=0,
    ).choices[0].message.tool_calls[0]
    assert (whole.function.name, whole.function.arguments) == (calls[0]["name"], calls[0]["arguments"])


@check("a named tool_choice calls that tool")
def _():
    for seed in range(1):
        r = tc.chat.completions.create(
            model=MODEL_ID, messages=ASK, tools=TOOLS, max_tokens=200, temperature=1.0, seed=seed,
            tool_choice={"type": "function", "function": {"name": "get_time"}},
        )
        assert r.choices[0].finish_reason == "tool_calls", r
        valid_calls(r.choices[0].message, names=("get_time",))


@check("parallel tool calls: every call valid, indexed 0, 1, ... as streamed")
def _():
    counts = []
    for seed in range(2):
        ask = dict(messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=True,
                   max_tokens=1000, temperature=1.0, seed=seed)
        r = tc.chat.completions.create(model=MODEL_ID, **ask)
        assert r.choices[0].finish_reason == "tool_calls", r
        valid_calls(r.choices[0].message)
        calls, content, finish = streamed_calls(**ask)
        assert finish == "tool_calls" and content == "", (calls, content, finish)
        # The same seed: the same calls (ids aside), in the same order.
        assert [(c["name"], c["arguments"]) for c in calls] == [
            (c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls
        ], (calls, r.choices[0].message.tool_calls)
        counts.append(len(calls))
    # The seeds are fixed and the CPU's sampling repeats itself: these answers hold
    # several calls.
    assert max(counts) >= 2, counts


@check("tool_choice auto and none answer, and a call in the history with its result is rendered")
def _():
    r = tc.chat.completions.create(model=MODEL_ID, messages=ASK, tools=TOOLS, max_tokens=100, temperature=0)
    choice = r.choices[0]
    if choice.finish_reason == "tool_calls":
        assert all(c.function.name in ("get_weather", "get_time") for c in choice.message.tool_calls), choice
    else:
        assert isinstance(choice.message.content, str) and not choice.message.tool_calls, choice
    r = tc.chat.completions.create(
        model=MODEL_ID, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=20, temperature=0
    )
    assert r.choices[0].finish_reason in ("stop", "length") and not r.choices[0].message.tool_calls, r
    assert isinstance(r.choices[0].message.content, str), r
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_abc", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "celsius"})},
        }]},
        {"role": "tool", "tool_call_id": "call_abc", "content": "18 degrees and sunny"},
    ]
    without = tc.chat.completions.create(
        model=MODEL_ID, messages=history[:2], tools=TOOLS, max_tokens=1, temperature=0
    )
    with_result = tc.chat.completions.create(
        model=MODEL_ID, messages=history, tools=TOOLS, max_tokens=30, temperature=0
    )
    assert with_result.usage.prompt_tokens > without.usage.prompt_tokens + 8, (with_result.usage, without.usage)
    streamed = tc.chat.completions.create(
        model=MODEL_ID, messages=history, tools=TOOLS, max_tokens=30, temperature=0, stream=True
    )
    text, calls = "", 0
    for chunk in streamed:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            calls += len(choice.delta.tool_calls or [])
    whole = with_result.choices[0].message
    if not whole.tool_calls:
        assert text == whole.content, (text, whole.content)


@check("malformed tools and tool_choice are 400s naming the field")
def _():
    url = tooled.base + "/v1/chat/completions"
    bad_schema = {"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}
    named = {"type": "function", "function": {"name": "get_date"}}
    for extra, field in [
        ({"tools": TOOLS, "tool_choice": named}, "tool_choice"),
        ({"tools": [bad_schema], "tool_choice": "required"}, "tools"),
        ({"tools": [bad_schema]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": {"get_weather": WEATHER}}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"messages": ASK + [{"role": "assistant", "tool_calls": {"a": 1}}]}, "messages"),
    ]:
        status, _, body = http("POST", url, {"messages": ASK, "max_tokens": 4, **extra})
        message = error_of(status, body, 400)
        assert json.loads(body)["error"]["param"] == field and field in message, (extra, body)
    status, _, body = http("POST", tooled.base + "/v1/completions", {"prompt": "x", "tools": TOOLS})
    assert json.loads(body)["error"]["param"] == "tools" and status == 400, body
    try:
        tc.chat.completions.create(model=MODEL_ID, messages=ASK, tools=TOOLS, tool_choice=named, max_tokens=4)
        raise AssertionError("an unknown tool was accepted")
    except openai.BadRequestError as e:
        assert "get_date" in str(e), e


@check("a --chat-template-file that cannot be read stops the server before it listens")
def _():
    out = subprocess.run(
        [BINARY, "serve", "--gguf", MODEL, "--port", "0", "--chat-template-file", TEMPLATE + ".missing"],
        capture_output=True, text=True, timeout=60,
    )
    assert out.returncode != 0 and "chat template" in out.stderr and "listening" not in out.stderr, out


assert tooled.stop() == 0
