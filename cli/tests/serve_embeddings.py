"""Embeddings and text completions of a list of prompts, checked through the official
`openai` client on a server of their own with a small context. Run from
serve_openai.py, whose helpers it shares (serve_common.py).
"""

import base64
import json
import math
import os
import struct
import threading

import openai

from serve_common import MODEL_ID, Server, check, error_of, http

emb = Server("--ctx-size", "128", "--max-sequences", "4")
emb.wait_ready()
ec = emb.client()

FOX = "The quick brown fox jumps over the lazy dog."
WATER = "Water boils at a temperature of"
N_EMBD = 576  # SmolLM2-135M

# llama.cpp's embedding of FOX (testdata/embedding, its README says how it was made).
REFERENCE = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "..", "testdata", "embedding", "SmolLM2-135M-Instruct.Q4_1.json"
)


def embed(**ask):
    return ec.embeddings.create(model=MODEL_ID, encoding_format="float", **ask)


def norm(v):
    return math.sqrt(sum(x * x for x in v))


def tokens_of(text):
    status, _, body = http("POST", emb.base + "/tokenize", {"content": text, "add_special": True})
    assert status == 200, body
    return json.loads(body)["tokens"]


def as_f32(values):
    return struct.pack(f"<{len(values)}f", *values)


@check("embeddings: one text is one unit vector of the model's width, llama.cpp's to 1e-6")
def _():
    got = embed(input=FOX)
    assert got.object == "list" and got.model == MODEL_ID, got
    assert len(got.data) == 1 and got.data[0].index == 0 and got.data[0].object == "embedding", got
    v = got.data[0].embedding
    assert len(v) == N_EMBD, len(v)
    assert abs(norm(v) - 1) <= 1e-4, norm(v)
    n = len(tokens_of(FOX))
    assert got.usage.prompt_tokens == n and got.usage.total_tokens == n, got.usage
    with open(REFERENCE) as f:
        reference = json.load(f)
    assert tokens_of(FOX) == reference["tokens"]
    worst = max(abs(a - b) for a, b in zip(v, reference["flash_attention_on"]))
    assert worst <= 1e-6, worst


@check("embeddings: a list gives one vector per input in order; the same text the same vector")
def _():
    one = embed(input=FOX).data[0].embedding
    got = embed(input=[FOX, WATER, FOX])
    assert [d.index for d in got.data] == [0, 1, 2], got
    vs = [d.embedding for d in got.data]
    assert all(len(v) == N_EMBD and abs(norm(v) - 1) <= 1e-4 for v in vs)
    # Batching changes no bit of SmolLM2's rows.
    assert vs[0] == one and vs[2] == one
    assert max(abs(a - b) for a, b in zip(vs[0], vs[1])) > 1e-3, "different texts differ"
    assert got.usage.prompt_tokens == 2 * len(tokens_of(FOX)) + len(tokens_of(WATER)), got.usage


@check("embeddings: token ids, one list or several, are the text's vector")
def _():
    one = embed(input=FOX).data[0].embedding
    ids = tokens_of(FOX)
    assert embed(input=ids).data[0].embedding == one
    got = embed(input=[ids, tokens_of(WATER)])
    assert len(got.data) == 2 and got.data[0].embedding == one, got
    assert got.usage.prompt_tokens == len(ids) + len(tokens_of(WATER))


@check("embeddings: base64 is the little-endian f32 bytes of the float vector")
def _():
    floats = embed(input=[FOX, WATER]).data
    status, _, body = http(
        "POST", emb.base + "/v1/embeddings", {"input": [FOX, WATER], "encoding_format": "base64"}
    )
    assert status == 200, body
    data = json.loads(body)["data"]
    for d, f in zip(data, floats):
        raw = base64.b64decode(d["embedding"])
        assert len(raw) == 4 * N_EMBD and raw == as_f32(f.embedding)
    # The client asks for base64 unless told otherwise, and decodes it.
    default = ec.embeddings.create(model=MODEL_ID, input=FOX).data[0].embedding
    assert as_f32(default) == as_f32(floats[0].embedding)
    # Also without /v1.
    status, _, body = http("POST", emb.base + "/embeddings", {"input": FOX})
    assert status == 200 and json.loads(body)["data"][0]["embedding"] == floats[0].embedding, body


@check("embeddings: dimensions, empty and too long inputs, and bad shapes are 400s naming the field")
def _():
    cases = [
        (dict(input=FOX, dimensions=64), "dimensions"),
        (dict(input=""), "input"),
        (dict(input=[]), "input"),
        (dict(input=[FOX, ""]), "input"),
        (dict(input=[[]]), "input"),
        (dict(input=" ".join(["word"] * 300)), "128"),
    ]
    for ask, needle in cases:
        try:
            embed(**ask)
        except openai.BadRequestError as e:
            assert needle in e.message, (ask, e.message)
        else:
            raise AssertionError(f"{ask} was accepted")
    for body, needle in [
        ({"input": FOX, "encoding_format": "hex"}, "encoding_format"),
        ({"input": [FOX, 3]}, "input"),
        ({"input": {"text": FOX}}, "input"),
        ({"input": [-1]}, "input"),
        ({"input": [10**9]}, "vocabulary"),
    ]:
        status, _, reply = http("POST", emb.base + "/v1/embeddings", body)
        assert needle in error_of(status, reply, 400), (body, reply)


@check("embeddings run beside a stream and are counted in the metrics")
def _():
    requests = emb.metric("embedding_requests_total")
    tokens = emb.metric("embedding_tokens_total")
    one = embed(input=FOX).data[0].embedding
    stream = ec.completions.create(model=MODEL_ID, prompt=WATER, max_tokens=40, temperature=0, stream=True)
    it = iter(stream)
    next(it)  # running now
    got = {}

    def side():
        got["v"] = embed(input=[FOX] * 5).data

    t = threading.Thread(target=side)
    t.start()
    rest = list(it)
    t.join(timeout=120)
    assert rest and rest[-1].choices[0].finish_reason in ("length", "stop")
    assert [d.embedding for d in got["v"]] == [one] * 5
    assert emb.metric("embedding_requests_total") == requests + 2
    assert emb.metric("embedding_tokens_total") == tokens + 6 * len(tokens_of(FOX))
    assert emb.metric("kv_blocks_used") == 0


PROMPTS = ["The capital of France is", "def fibonacci(n):", "The three primary colors are"]


@check("a list of prompts gives one choice per prompt, in order, each its text alone")
def _():
    alone = [
        ec.completions.create(model=MODEL_ID, prompt=p, max_tokens=8, temperature=0) for p in PROMPTS
    ]
    got = ec.completions.create(model=MODEL_ID, prompt=PROMPTS, max_tokens=8, temperature=0)
    assert [c.index for c in got.choices] == [0, 1, 2], got
    assert [c.text for c in got.choices] == [a.choices[0].text for a in alone], got
    for field in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert getattr(got.usage, field) == sum(getattr(a.usage, field) for a in alone), (field, got.usage)
    # Token-id lists, several and one.
    ids = [tokens_of(p) for p in PROMPTS]
    by_ids = ec.completions.create(model=MODEL_ID, prompt=ids, max_tokens=8, temperature=0)
    assert [c.text for c in by_ids.choices] == [c.text for c in got.choices]
    single = ec.completions.create(model=MODEL_ID, prompt=ids[1], max_tokens=8, temperature=0)
    assert len(single.choices) == 1 and single.choices[0].text == got.choices[1].text


@check("a streamed list of prompts tags each chunk with its choice and ends once all have")
def _():
    want = ec.completions.create(model=MODEL_ID, prompt=PROMPTS, max_tokens=8, temperature=0)
    stream = ec.completions.create(
        model=MODEL_ID, prompt=PROMPTS, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )
    texts, reasons, usage = ["", "", ""], [None] * 3, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
            assert chunk.choices == []
            continue
        assert len(chunk.choices) == 1, chunk
        c = chunk.choices[0]
        assert reasons[c.index] is None, "no chunk after a choice's finish"
        texts[c.index] += c.text
        reasons[c.index] = c.finish_reason
    assert texts == [c.text for c in want.choices], texts
    assert reasons == [c.finish_reason for c in want.choices], reasons
    assert usage is not None and usage.total_tokens == want.usage.total_tokens, usage


@check("prompt lists: empty, too long, n > 1 and a prompt past the context are 400s")
def _():
    for ask, needle in [
        (dict(prompt=[]), "prompt"),
        (dict(prompt=["x"] * 65), "64"),
        (dict(prompt=PROMPTS, n=2), "n"),
        (dict(prompt=["Hi", " ".join(["word"] * 300)]), "128"),
    ]:
        try:
            ec.completions.create(model=MODEL_ID, max_tokens=2, **ask)
        except openai.BadRequestError as e:
            assert needle in e.message, (ask, e.message)
        else:
            raise AssertionError(f"{ask} was accepted")
    assert emb.metric("running_sequences") == 0


assert emb.stop() == 0
