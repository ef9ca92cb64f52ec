"""The client side of `cargo xtask bench-serve`: for each concurrency level, a fixed
number of streamed completions (a prompt of exactly P token ids, exactly G generated
tokens) sent by C client threads with the official `openai` client to a server on
loopback. Prints one JSON object per level on stdout.

usage: bench_serve.py BASE_URL MODEL_ID LEVELS REQUESTS PROMPT_TOKENS GEN_TOKENS
"""

import json
import sys
import threading
import time

import openai

base, model_id, levels, requests, prompt_tokens, gen_tokens = sys.argv[1:7]
levels = [int(x) for x in levels.split(",")]
requests, prompt_tokens, gen_tokens = int(requests), int(prompt_tokens), int(gen_tokens)


def percentile(values, p):
    values = sorted(values)
    if not values:
        return None
    k = min(len(values) - 1, max(0, round(p / 100 * (len(values) - 1))))
    return values[k]


def prompt(i):
    # Distinct token ids per request, so that no prompt reuses another's blocks.
    return [1000 + (i * 7919 + j * 104729) % 40000 for j in range(prompt_tokens)]


serial = [0]


def wait_ready(timeout=300):
    import urllib.request

    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(base + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise SystemExit("the server did not get ready")


def run_level(clients, count):
    lock = threading.Lock()
    next_request = [0]
    results, failures = [], []

    def worker():
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=600)
        while True:
            with lock:
                if next_request[0] >= count:
                    return
                next_request[0] += 1
                serial[0] += 1
                i = serial[0]
            start = time.perf_counter()
            first = last = None
            usage = None
            try:
                stream = client.completions.create(
                    model=model_id,
                    prompt=prompt(i),
                    max_tokens=gen_tokens,
                    temperature=0,
                    stream=True,
                    stream_options={"include_usage": True},
                    extra_body={"ignore_eos": True},
                )
                for chunk in stream:
                    now = time.perf_counter()
                    if chunk.usage is not None:
                        usage = chunk.usage
                    if chunk.choices and chunk.choices[0].text:
                        first = first or now
                        last = now
            except Exception as e:  # noqa: BLE001 - every failure is counted and shown
                failures.append(repr(e))
                continue
            n = usage.completion_tokens if usage else 0
            results.append(
                {
                    "ttft": (first or last or start) - start,
                    "tpot": (last - first) / (n - 1) if first and n > 1 else None,
                    "tokens": n,
                }
            )

    start = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=3600)
    wall = time.perf_counter() - start
    ttft = [r["ttft"] for r in results]
    tpot = [r["tpot"] for r in results if r["tpot"] is not None]
    out_tokens = sum(r["tokens"] for r in results)
    return {
        "clients": clients,
        "requests": count,
        "completed": len(results),
        "failures": failures[:5],
        "n_failures": len(failures),
        "wall_s": wall,
        "ttft_p50_ms": percentile(ttft, 50) * 1e3 if ttft else None,
        "ttft_p99_ms": percentile(ttft, 99) * 1e3 if ttft else None,
        "tpot_p50_ms": percentile(tpot, 50) * 1e3 if tpot else None,
        "tpot_mean_ms": sum(tpot) / len(tpot) * 1e3 if tpot else None,
        "output_tokens_per_s": out_tokens / wall,
        "total_tokens_per_s": (out_tokens + len(results) * prompt_tokens) / wall,
    }


wait_ready()
for level in levels:
    print(json.dumps(run_level(level, max(requests, level))), flush=True)
