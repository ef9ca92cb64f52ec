"""`rocmforge serve` driven by the official `openai` Python package.

Run by `cli/tests/cli.rs` (`serve_answers_the_openai_client`) as
`python serve_openai.py ROCMFORGE_BINARY MODEL_GGUF`. Every server binds 127.0.0.1 on a
free port; every loop is bounded in count and time. Prints one line per check and
exits non-zero on the first failure. The helpers are serve_common.py's; the tool-call
checks are in serve_tools.py, those of embeddings and lists of prompts in
serve_embeddings.py, each run from here on a server of its own.
"""

import json
import math
import re
import signal
import sys
import threading
import time

import openai

# The checks' own modules (below) leave no compiled copies in the checkout.
sys.dont_write_bytecode = True
from serve_common import KEY, MODEL_ID, PASSED, Server, check, error_of, generate, http

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):",
    "The three primary colors are",
    "Water boils at a temperature of",
    "My favourite recipe for a chocolate cake starts with",
    "The largest animal on Earth is",
    "In 1969, the first people to walk on the Moon",
]

# The main server: loads slowly on purpose (to watch /health), wants a key, and has a
# small body limit.
main = Server(
    "--api-key", KEY, "--ctx-size", "512", "--max-body-bytes", "65536", "--debug-load-delay-ms", "3000",
    "--alias", "my-alias", "--cors-origin", "https://app.example",
)


@check("health reports loading progress, then ok")
def _():
    deadline = time.time() + 10
    seen = None
    while time.time() < deadline and seen is None:
        try:
            status, headers, body = http("GET", main.base + "/health")
            seen = (status, json.loads(body))
        except OSError:
            time.sleep(0.01)
    status, body = seen
    assert status == 503 and body["status"] == "loading", seen
    assert 0.0 <= body["progress"] < 1.0, seen
    # The API says it is loading too.
    status, headers, body = http(
        "POST", main.base + "/v1/completions", {"prompt": "x"}, {"Authorization": f"Bearer {KEY}"}
    )
    assert "loading" in error_of(status, body, 503)
    main.wait_ready()


client = main.client()


@check("models lists the model")
def _():
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_ID, "my-alias"], models


@check("CORS: a listed origin's preflight is answered and its responses carry the header")
def _():
    url = main.base + "/v1/chat/completions"
    ask = {
        "Origin": "https://app.example",
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    status, headers, _ = http("OPTIONS", url, None, ask)
    assert status == 204, (status, headers)
    assert headers["access-control-allow-origin"] == "https://app.example", headers
    assert "POST" in headers["access-control-allow-methods"], headers
    assert "authorization" in headers["access-control-allow-headers"].lower(), headers
    auth = {"Authorization": f"Bearer {KEY}", "Origin": "https://app.example"}
    status, headers, _ = http("GET", main.base + "/v1/models", None, auth)
    assert status == 200 and headers["access-control-allow-origin"] == "https://app.example", headers
    # An error response carries it too (the page must be able to read why).
    status, headers, _ = http("GET", main.base + "/v1/models", None, {"Origin": "https://app.example"})
    assert status == 401 and headers["access-control-allow-origin"] == "https://app.example", headers
    # Another origin gets no CORS headers, and no preflight answer.
    status, headers, _ = http("OPTIONS", url, None, {**ask, "Origin": "https://evil.example"})
    assert status != 204 and "access-control-allow-origin" not in headers, (status, headers)


@check("an alias, another model's name and the routes without /v1 reach the model")
def _():
    aliased = client.chat.completions.create(
        model="my-alias", messages=[{"role": "user", "content": "Hi"}], max_tokens=2
    )
    assert aliased.model == "my-alias", aliased
    assert aliased.system_fingerprint, aliased
    other = client.completions.create(model="gpt-4o", prompt="Hi", max_tokens=2, temperature=0)
    assert other.model == MODEL_ID, other
    auth = {"Authorization": f"Bearer {KEY}"}
    status, _, body = http("GET", main.base + "/models", None, auth)
    assert status == 200 and json.loads(body)["data"][0]["id"] == MODEL_ID, (status, body)
    status, _, body = http(
        "POST", main.base + "/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}, auth
    )
    assert status == 200 and json.loads(body)["object"] == "chat.completion", (status, body)
    status, _, body = http("POST", main.base + "/completions", {"prompt": "Hi", "max_tokens": 2}, auth)
    assert status == 200 and json.loads(body)["object"] == "text_completion", (status, body)


@check("a greedy completion alone is generate's text")
def _():
    for prompt in PROMPTS[:3]:
        got = client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=24, temperature=0)
        assert got.choices[0].text == generate(prompt, "-n", "24", "--temperature", "0"), prompt
        assert got.choices[0].finish_reason in ("length", "stop")
        assert got.usage.completion_tokens <= 24 and got.usage.prompt_tokens > 0


@check("a greedy chat alone is generate --chat's text")
def _():
    got = client.chat.completions.create(
        model=MODEL_ID, messages=[{"role": "user", "content": "What is 2+2?"}], max_tokens=24, temperature=0
    )
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == generate("What is 2+2?", "--chat", "-n", "24", "--temperature", "0")


@check("seeded sampling repeats itself and is generate's with the same seed")
def _():
    ask = dict(model=MODEL_ID, prompt=PROMPTS[1], max_tokens=32, temperature=0.9, seed=42)
    a = client.completions.create(**ask).choices[0].text
    b = client.completions.create(**ask).choices[0].text
    assert a == b
    assert a == generate(PROMPTS[1], "-n", "32", "--temperature", "0.9", "--seed", "42")
    c = client.completions.create(**{**ask, "seed": 7}).choices[0].text
    assert c != a, "another seed draws other tokens"


@check("streamed chat is the whole text, with usage in the last chunk")
def _():
    messages = [{"role": "user", "content": "Name three fruits."}]
    whole = client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=30, temperature=0)
    stream = client.chat.completions.create(
        model=MODEL_ID,
        messages=messages,
        max_tokens=30,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                pieces.append(choice.delta.content)
            if choice.finish_reason:
                finish = choice.finish_reason
    assert "".join(pieces) == whole.choices[0].message.content
    assert finish == whole.choices[0].finish_reason
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens


@check("streamed completions and stop strings never split")
def _():
    full = client.completions.create(model=MODEL_ID, prompt=PROMPTS[7], max_tokens=40, temperature=0).choices[0].text
    cut = len(full) // 2
    stop = full[cut : cut + 4]
    assert len(stop) == 4 and full.find(stop) == cut, (full, stop)
    got = client.completions.create(model=MODEL_ID, prompt=PROMPTS[7], max_tokens=40, temperature=0, stop=[stop])
    assert got.choices[0].text == full[:cut] and got.choices[0].finish_reason == "stop", got
    pieces = []
    for chunk in client.completions.create(
        model=MODEL_ID, prompt=PROMPTS[7], max_tokens=40, temperature=0, stop=stop, stream=True
    ):
        pieces.append(chunk.choices[0].text)
        assert stop not in "".join(pieces)
    assert "".join(pieces) == full[:cut]
    assert chunk.choices[0].finish_reason == "stop"


@check("8 clients at once all complete with their greedy text alone")
def _():
    alone = [
        client.completions.create(model=MODEL_ID, prompt=p, max_tokens=32, temperature=0).choices[0].text
        for p in PROMPTS
    ]
    results = [None] * len(PROMPTS)
    steps_before = main.metric("steps_total")

    def one(i):
        c = main.client()
        results[i] = c.completions.create(model=MODEL_ID, prompt=PROMPTS[i], max_tokens=32, temperature=0)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    for i, r in enumerate(results):
        assert r is not None, f"client {i} did not finish"
        # SmolLM2's Q4_1 products and the attention are computed row by row, so a batch
        # changes no bit: no near-tie can flip.
        assert r.choices[0].text == alone[i], (PROMPTS[i], r.choices[0].text, alone[i])
    steps = main.metric("steps_total") - steps_before
    assert steps < 8 * 32, f"{steps} steps for 8 x 32 tokens: the requests were batched"


@check("a stream closed mid-way stops its work")
def _():
    cancelled = main.metric("requests_cancelled_total")
    stream = client.completions.create(model=MODEL_ID, prompt=PROMPTS[1], max_tokens=400, temperature=0, stream=True)
    for i, _chunk in enumerate(stream):
        if i == 3:
            break
    stream.close()
    deadline = time.time() + 10
    while main.metric("requests_cancelled_total") == cancelled:
        assert time.time() < deadline, "the request was not cancelled"
        time.sleep(0.02)
    generated = main.metric("generation_tokens_total")
    time.sleep(0.3)
    assert main.metric("generation_tokens_total") == generated, "tokens still being generated"
    assert main.metric("running_sequences") == 0
    assert main.metric("kv_blocks_used") == 0


@check("a repeated prefix is reused")
def _():
    system = "You are a very helpful assistant. You answer in one short sentence, politely and precisely."
    usage = []
    for q in ["What is the capital of Spain?", "What colour is the sky?"]:
        r = client.chat.completions.create(
            model=MODEL_ID,
            messages=[{"role": "system", "content": system}, {"role": "user", "content": q}],
            max_tokens=8,
            temperature=0,
        )
        usage.append(r.usage)
    assert usage[1].prompt_tokens_details.cached_tokens >= 16, usage[1]


def unknown_field_counts():
    text = http("GET", main.base + "/metrics", headers={"Authorization": f"Bearer {KEY}"})[2].decode()
    pattern = r'^rocmforge_unknown_request_fields_total\{field="([^"]*)"\} (\S+)$'
    return {k: float(v) for k, v in re.findall(pattern, text, re.M)}


@check("unknown fields are ignored, and counted by name in the metrics")
def _():
    before = unknown_field_counts()
    for _ in range(2):
        r = client.chat.completions.create(
            model=MODEL_ID, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
            extra_body={"made_up_option": {"a": 1}, "user": "someone"},
        )
        assert r.choices[0].message.content is not None
    status, _, body = http(
        "POST", main.base + "/v1/completions",
        {"model": MODEL_ID, "prompt": "Hi", "max_tokens": 1, "made_up_option": True},
        headers={"Authorization": f"Bearer {KEY}"},
    )
    assert status == 200, body
    after = unknown_field_counts()
    grown = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
    # Fields the server takes, or refuses by name, are never counted as unknown.
    assert grown == {"made_up_option": 3, "user": 2}, (before, after)


@check("bad input gets OpenAI-shaped errors")
def _():
    auth = {"Authorization": f"Bearer {KEY}"}
    url = main.base + "/v1/completions"
    error_of(*http("POST", url, b"{not json", auth)[::2], 400)
    error_of(*http("POST", url, {"prompt": "x", "max_tokens": "many"}, auth)[::2], 400)
    error_of(*http("POST", main.base + "/v1/chat/completions", {"messages": "hi"}, auth)[::2], 400)
    status, _, body = http("POST", url, {"prompt": "x", "n": 2}, auth)
    assert "n must be 1" in error_of(status, body, 400)
    status, _, body = http("POST", url, {"prompt": "x", "temperature": -1}, auth)
    error_of(status, body, 400)
    # What the server cannot do yet is refused naming the field, never ignored.
    chat_url = main.base + "/v1/chat/completions"
    hi = [{"role": "user", "content": "hi"}]
    for extra, field in [
        ({"response_format": {"type": "sound"}}, "response_format"),
        ({"top_logprobs": 3}, "top_logprobs"),
    ]:
        status, _, body = http("POST", chat_url, {"messages": hi, **extra}, auth)
        assert field in error_of(status, body, 400), (extra, body)
    status, _, body = http(
        "POST", chat_url, {"messages": hi, "response_format": {"type": "text"}, "max_tokens": 1}, auth
    )
    assert status == 200, (status, body)
    # SmolLM2's own template does not render tools: they are refused, saying how to
    # give a template that does.
    tool = {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}
    try:
        client.chat.completions.create(
            model=MODEL_ID, messages=hi, tools=[tool], tool_choice="required", max_tokens=8
        )
        raise AssertionError("tools were accepted")
    except openai.BadRequestError as e:
        assert "tools" in str(e) and "--chat-template-file" in str(e), e
    try:
        client.completions.create(model=MODEL_ID, prompt="hello " * 600, max_tokens=1)
        raise AssertionError("an over-long prompt was accepted")
    except openai.BadRequestError as e:
        assert re.search(r"has \d+ tokens but the context holds 512", str(e)), str(e)
    status, _, body = http("POST", url, {"prompt": "x" * 100_000}, auth)
    error_of(status, body, 413)
    try:
        main.client(key="wrong").completions.create(model=MODEL_ID, prompt="x", max_tokens=1)
        raise AssertionError("a wrong key was accepted")
    except openai.AuthenticationError:
        pass
    error_of(*http("GET", main.base + "/v1/models")[::2], 401)
    error_of(*http("GET", main.base + "/metrics")[::2], 401)
    assert http("GET", main.base + "/health")[0] == 200
    # Still serving.
    assert client.completions.create(model=MODEL_ID, prompt="Hi", max_tokens=2).usage.completion_tokens <= 2


def chat_logprobs(**ask):
    """A greedy, seeded chat's choice with log-probabilities, and the same streamed: its
    text and the `logprobs.content` entries of its chunks, in order."""
    ask = dict(
        model=MODEL_ID, messages=[{"role": "user", "content": "Name three fruits."}], max_tokens=20,
        temperature=0, seed=11, logprobs=True, **ask,
    )
    whole = client.chat.completions.create(**ask)
    text, entries = [], []
    for chunk in client.chat.completions.create(stream=True, **ask):
        for choice in chunk.choices:
            text.append(choice.delta.content or "")
            if choice.logprobs is not None and choice.logprobs.content:
                entries.extend(choice.logprobs.content)
    return whole, "".join(text), entries


@check("chat logprobs: the greedy token is the most likely, top ones descend, streamed as whole")
def _():
    response, streamed_text, streamed = chat_logprobs(top_logprobs=5)
    whole = response.choices[0]
    content = whole.logprobs.content
    assert whole.message.content == streamed_text
    # One entry per generated token (the end of generation has none).
    assert content and len(content) == response.usage.completion_tokens, response
    # The tokens' bytes make the text.
    assert b"".join(bytes(e.bytes) for e in content).decode() == whole.message.content
    for e in content:
        assert e.logprob <= 0.0 and len(e.top_logprobs) == 5, e
        top = [t.logprob for t in e.top_logprobs]
        assert top == sorted(top, reverse=True), top
        # Greedy: the token taken is the most likely one, and first of the top ones.
        assert all(e.logprob >= t for t in top), e
        assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == e.logprob, e
        assert sum(math.exp(t) for t in top) <= 1.0 + 1e-5, top
        assert bytes(e.bytes).decode("utf-8", "replace") == e.token
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    assert [[(t.token, t.logprob) for t in e.top_logprobs] for e in streamed] == [
        [(t.token, t.logprob) for t in e.top_logprobs] for e in content
    ]
    # Asking for log-probabilities changes nothing of the text.
    plain = client.chat.completions.create(
        model=MODEL_ID, messages=[{"role": "user", "content": "Name three fruits."}], max_tokens=20,
        temperature=0, seed=11,
    ).choices[0]
    assert plain.message.content == whole.message.content and plain.logprobs is None
    # Without top_logprobs: the tokens alone.
    bare = client.chat.completions.create(
        model=MODEL_ID, messages=[{"role": "user", "content": "Name three fruits."}], max_tokens=20,
        temperature=0, seed=11, logprobs=True,
    ).choices[0]
    assert [e.top_logprobs for e in bare.logprobs.content] == [[] for _ in content]
    assert [(e.token, e.logprob) for e in bare.logprobs.content] == [(e.token, e.logprob) for e in content]


@check("completions logprobs: the legacy lists, streamed as whole, greedy text unchanged")
def _():
    ask = dict(model=MODEL_ID, prompt=PROMPTS[0], max_tokens=12, temperature=0)
    plain = client.completions.create(**ask).choices[0]
    got = client.completions.create(logprobs=3, **ask).choices[0]
    assert got.text == plain.text and plain.logprobs is None
    lp = got.logprobs
    n = len(lp.tokens)
    assert n > 0 and len(lp.token_logprobs) == n and len(lp.top_logprobs) == n and len(lp.text_offset) == n
    assert "".join(lp.tokens) == got.text
    offset = 0
    for token, logprob, top, at in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset):
        assert at == offset, (at, offset)
        offset += len(token)
        assert 1 <= len(top) <= 3 and top.get(token) == logprob, (token, top)
        assert all(logprob >= v for v in top.values()) and sum(math.exp(v) for v in top.values()) <= 1.0 + 1e-5
    tokens, logprobs, offsets = [], [], []
    for chunk in client.completions.create(stream=True, logprobs=3, **ask):
        if chunk.choices[0].logprobs is not None:
            tokens += chunk.choices[0].logprobs.tokens
            logprobs += chunk.choices[0].logprobs.token_logprobs
            offsets += chunk.choices[0].logprobs.text_offset
    assert (tokens, logprobs, offsets) == (lp.tokens, lp.token_logprobs, lp.text_offset)
    # No alternatives: the tokens and their log-probabilities alone.
    zero = client.completions.create(logprobs=0, **ask).choices[0].logprobs
    assert zero.token_logprobs == lp.token_logprobs and all(t == {} for t in zero.top_logprobs)
    # The distribution is the one the biases made: a token biased by +100 is all but
    # certain, and one biased by -100 is left out of the top ones.
    _, _, raw = http("POST", main.base + "/tokenize", {"content": " fish"}, {"Authorization": f"Bearer {KEY}"})
    fish = json.loads(raw)["tokens"][0]
    forced = client.completions.create(logprobs=2, logit_bias={str(fish): 100}, **{**ask, "max_tokens": 2})
    forced = forced.choices[0].logprobs
    assert forced.tokens == [" fish", " fish"] and all(v > -1e-3 for v in forced.token_logprobs), forced
    first = lp.tokens[0]
    first_id = json.loads(
        http("POST", main.base + "/tokenize", {"content": first}, {"Authorization": f"Bearer {KEY}"})[2]
    )["tokens"]
    banned = client.completions.create(logprobs=3, logit_bias={str(first_id[0]): -100}, **{**ask, "max_tokens": 1})
    banned = banned.choices[0].logprobs
    assert len(first_id) == 1 and first not in banned.top_logprobs[0] and banned.tokens[0] != first, banned
    # A format's mask is part of it too: only the tokens it allows (digits, or the end)
    # are among the top ones, and they hold all the probability.
    digits = client.completions.create(
        logprobs=5, extra_body={"regex": "[0-9]{1,6}"}, **{**ask, "prompt": "The year is", "max_tokens": 3}
    ).choices[0]
    assert re.fullmatch("[0-9]{1,6}", digits.text), digits.text
    for top in digits.logprobs.top_logprobs:
        assert top and all(re.fullmatch("[0-9]+", t) or t.startswith("<|") for t in top), top
        assert sum(math.exp(v) for v in top.values()) <= 1.0 + 1e-5


@check("bad logprobs values are 400s naming the field")
def _():
    auth = {"Authorization": f"Bearer {KEY}"}
    hi = [{"role": "user", "content": "hi"}]
    for url, body, field in [
        ("/v1/chat/completions", {"messages": hi, "top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {"messages": hi, "logprobs": False, "top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {"messages": hi, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/chat/completions", {"messages": hi, "logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        ("/v1/chat/completions", {"messages": hi, "logprobs": 3}, "logprobs"),
        ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
        ("/v1/completions", {"prompt": "x", "logprobs": True}, "logprobs"),
        ("/v1/completions", {"prompt": "x", "logprobs": 2, "echo": True}, "echo"),
    ]:
        status, _, raw = http("POST", main.base + url, {"max_tokens": 1, **body}, auth)
        assert field in error_of(status, raw, 400), (body, raw)
        assert json.loads(raw)["error"]["param"] == field, raw
    try:
        client.chat.completions.create(model=MODEL_ID, messages=hi, logprobs=True, top_logprobs=30, max_tokens=1)
        raise AssertionError("top_logprobs 30 was accepted")
    except openai.BadRequestError as e:
        assert "top_logprobs" in str(e), e


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "colour": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "colour"],
    "additionalProperties": False,
}


def valid_person(value):
    """The checks `PERSON` asks for, written out (no schema validator needed)."""
    assert isinstance(value, dict) and set(value) == {"name", "age", "colour"}, value
    assert isinstance(value["name"], str) and len(value["name"]) <= 24, value
    assert isinstance(value["age"], int) and not isinstance(value["age"], bool), value
    assert 0 <= value["age"] <= 150, value
    assert value["colour"] in ("red", "green", "blue"), value


@check("response_format json_object and json_schema hold the output to JSON")
def _():
    story = [{"role": "user", "content": "Tell me a short story about a cat."}]
    plain = client.chat.completions.create(
        model=MODEL_ID, messages=story, max_tokens=24, temperature=0
    ).choices[0].message.content
    try:
        json.loads(plain)
        raise AssertionError(f"the unconstrained story is JSON already: {plain!r}")
    except ValueError:
        pass
    ask = [{"role": "user", "content": "Describe a cat as a JSON object with its name and age."}]
    for temperature, seed in [(0, 0), (0.5, 1), (0.5, 2)]:
        r = client.chat.completions.create(
            model=MODEL_ID, messages=ask, max_tokens=200, temperature=temperature, seed=seed,
            response_format={"type": "json_object"},
        )
        text = r.choices[0].message.content
        assert r.choices[0].finish_reason == "stop", (text, r.choices[0].finish_reason)
        assert isinstance(json.loads(text), dict), text
    person = [{"role": "user", "content": "Describe a person as JSON."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for seed in range(3):
        r = client.chat.completions.create(
            model=MODEL_ID, messages=person, max_tokens=120, temperature=1.0, seed=seed, response_format=fmt
        )
        assert r.choices[0].finish_reason == "stop", r
        valid_person(json.loads(r.choices[0].message.content))
    # Greedy too (the scheduler's argmax), and streamed.
    chunks = client.chat.completions.create(
        model=MODEL_ID, messages=story, max_tokens=120, temperature=0, response_format=fmt, stream=True
    )
    text, finish = "", None
    for chunk in chunks:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "stop", (text, finish)
    valid_person(json.loads(text))
    # max_tokens still ends it, with "length".
    r = client.completions.create(
        model=MODEL_ID, prompt="Once upon a time", max_tokens=3, extra_body={"response_format": fmt}
    )
    assert r.choices[0].finish_reason == "length" and r.choices[0].text.startswith("{"), r
    # "text" asks for nothing: the same greedy text as without it.
    same = client.chat.completions.create(
        model=MODEL_ID, messages=story, max_tokens=24, temperature=0, response_format={"type": "text"}
    ).choices[0].message.content
    assert same == plain, (same, plain)


@check("regex and grammar hold the output, streamed or not")
def _():
    rx = r"[A-Z][a-z]{2,8} (is|was) [0-9]{1,3}"
    for seed in range(3):
        r = client.completions.create(
            model=MODEL_ID, prompt="Once upon a time", max_tokens=40, temperature=1.0, seed=seed,
            extra_body={"regex": rx},
        )
        assert r.choices[0].finish_reason == "stop", r
        assert re.fullmatch(rx, r.choices[0].text), r.choices[0].text
    stream = client.completions.create(
        model=MODEL_ID, prompt="The answer is", max_tokens=40, temperature=0, stream=True,
        extra_body={"regex": rx},
    )
    text, finish = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "stop" and re.fullmatch(rx, text), (text, finish)
    lark = 'start: answer " because " reason\nanswer: "yes" | "no"\nreason: /[a-z]{3,12}/\n'
    for seed in range(3):
        r = client.chat.completions.create(
            model=MODEL_ID, messages=[{"role": "user", "content": "Is the sky green?"}], max_tokens=40,
            temperature=1.0, seed=seed, extra_body={"grammar": lark},
        )
        assert r.choices[0].finish_reason == "stop", r
        assert re.fullmatch(r"(yes|no) because [a-z]{3,12}", r.choices[0].message.content), r


@check("constraints that do not compile, or several at once, are 400s naming the field")
def _():
    auth = {"Authorization": f"Bearer {KEY}"}
    url = main.base + "/v1/chat/completions"
    hi = [{"role": "user", "content": "hi"}]
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}
    for extra, field in [
        ({"response_format": bad_schema}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
        ({"regex": "(unclosed"}, "regex"),
        ({"grammar": 'root ::= "a"'}, "grammar"),
        ({"grammar": "start: missing_rule"}, "grammar"),
        ({"regex": "a+", "grammar": 'start: "a"'}, "regex"),
        ({"response_format": {"type": "json_object"}, "regex": "a+"}, "regex"),
    ]:
        status, _, body = http("POST", url, {"messages": hi, "max_tokens": 4, **extra}, auth)
        error_of(status, body, 400)
        assert json.loads(body)["error"]["param"] == field, (extra, body)
    try:
        client.chat.completions.create(model=MODEL_ID, messages=hi, max_tokens=4, response_format=bad_schema)
        raise AssertionError("a schema that does not compile was accepted")
    except openai.BadRequestError as e:
        assert "response_format" in str(e), e


@check("tokenize and detokenize round-trip")
def _():
    auth = {"Authorization": f"Bearer {KEY}"}
    status, _, body = http("POST", main.base + "/tokenize", {"content": "Hello world"}, auth)
    tokens = json.loads(body)["tokens"]
    assert status == 200 and len(tokens) >= 2
    status, _, body = http("POST", main.base + "/detokenize", {"tokens": tokens}, auth)
    assert status == 200 and json.loads(body)["content"] == "Hello world"
    error_of(*http("POST", main.base + "/detokenize", {"tokens": [10**9]}, auth)[::2], 400)


@check("metrics carry the device cache's counters, 0 while the CPU computes")
def _():
    _, _, body = http("GET", main.base + "/metrics", headers={"Authorization": f"Bearer {KEY}"})
    text = body.decode()
    assert main.metric("device_cache_enabled") == 0
    # vLLM's names for the load gauges, which routers and autoscalers read.
    for name in ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"]:
        assert f"# TYPE vllm:{name} gauge" in text, text
        assert re.search(rf'^vllm:{name}{{model_name="{re.escape(MODEL_ID)}"}} [0-9.e+-]+$', text, re.M), name
    for name in ["hits", "misses", "evictions", "uploaded_bytes"]:
        full = f"device_cache_{name}_total"
        assert f"# TYPE rocmforge_{full} counter" in text, text
        assert main.metric(full) == 0, full


@check("a bounded load test: 4 clients x 6 requests, no failure")
def _():
    failures, done = [], []

    def worker(w):
        c = main.client()
        for j in range(6):
            try:
                stream = j % 2 == 0
                r = c.completions.create(
                    model=MODEL_ID, prompt=PROMPTS[(w + j) % 8], max_tokens=16, temperature=0.7, seed=j, stream=stream
                )
                if stream:
                    list(r)
                done.append(1)
            except Exception as e:  # noqa: BLE001 - every failure is reported
                failures.append(repr(e))

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not failures, failures
    assert len(done) == 24


@check("metrics time the scheduler's steps and the forward passes within them")
def _():
    text = http("GET", main.base + "/metrics", headers={"Authorization": f"Bearer {KEY}"})[2].decode()
    for name in ["step_seconds", "forward_seconds"]:
        assert f"# TYPE rocmforge_{name} histogram" in text, text
        assert f'rocmforge_{name}_bucket{{le="+Inf"}}' in text, text
    steps = main.metric("steps_total")
    assert steps > 0
    # A step is timed once its text is handed out, a moment after the client has it.
    deadline = time.time() + 10
    while main.metric("step_seconds_count") != steps and time.time() < deadline:
        time.sleep(0.01)
    assert main.metric("step_seconds_count") == steps
    assert main.metric("forward_seconds_count") == steps
    assert 0 < main.metric("forward_seconds_sum") <= main.metric("step_seconds_sum")
    # The parts outside the forward passes add up to the rest of the steps (the
    # histograms' sums count whole microseconds, the parts nanoseconds).
    assert "# TYPE rocmforge_step_phase_seconds_total counter" in text, text
    phases = {p: main.metric(f'step_phase_seconds_total{{phase="{p}"}}') for p in ["admit", "schedule", "sample", "deliver"]}
    assert all(v >= 0 for v in phases.values()), phases
    # Requests above sampled at temperature 0.7 on the scheduler thread.
    assert phases["sample"] > 0 and phases["deliver"] > 0, phases
    rest = main.metric("step_seconds_sum") - main.metric("forward_seconds_sum")
    assert abs(sum(phases.values()) - rest) <= steps * 2e-6 + 1e-4, (phases, rest)


# Tool calls, on a server of their own (serve_tools.py).
import serve_tools  # noqa: E402,F401  (its checks run as it is imported)

# Embeddings and lists of prompts, on a server of their own (serve_embeddings.py).
import serve_embeddings  # noqa: E402,F401  (its checks run as it is imported)


# A second server with a queue of one, to fill it, then stopped with SIGTERM mid-stream.
small = Server(
    "--max-sequences", "1", "--max-queue", "1", "--ctx-size", "512", "--shutdown-grace", "30",
    "--strict-model-names",
)
small.wait_ready()


@check("with --strict-model-names another model's name is a 400 naming it")
def _():
    status, _, body = http("POST", small.base + "/v1/completions", {"model": "gpt-4o", "prompt": "x", "max_tokens": 1})
    assert "gpt-4o" in error_of(status, body, 400), body


@check("a full queue answers 503 with Retry-After; SIGTERM finishes in-flight streams and exits 0")
def _():
    c = small.client()
    stream = c.completions.create(model=MODEL_ID, prompt=PROMPTS[1], max_tokens=60, temperature=0, stream=True)
    it = iter(stream)
    next(it)  # running now
    waiting = {}

    def queued():
        try:
            waiting["r"] = small.client().completions.create(model=MODEL_ID, prompt="Hi", max_tokens=2)
        except openai.APIStatusError as e:
            waiting["status"] = e.status_code

    t = threading.Thread(target=queued)
    t.start()
    deadline = time.time() + 10
    while small.metric("queue_depth") < 1:
        assert time.time() < deadline
        time.sleep(0.01)
    status, headers, body = http("POST", small.base + "/v1/completions", {"prompt": "x", "max_tokens": 1})
    error_of(status, body, 503)
    assert headers.get("retry-after") == "1", headers
    small.proc.send_signal(signal.SIGTERM)
    rest = list(it)
    assert rest and rest[-1].choices[0].finish_reason == "length", "the running stream finished"
    t.join(timeout=60)
    # The waiting request was never started: it is refused, not left hanging.
    assert waiting.get("status") == 503, waiting
    assert small.proc.wait(timeout=60) == 0
    assert "panicked" not in "".join(small.stderr)


assert main.stop() == 0
print(f"{len(PASSED)} passed, 0 failed")
