"""The client side of `cargo xtask bench-serve`: for each concurrency level, a number
of streamed completions (a prompt of exactly P token ids, exactly G generated tokens)
sent by C client threads with the official `openai` client to a server on loopback.
Prints one JSON object per level on stdout.

REQUESTS is the number per level; 0 means 4 per client, so that every client sends
several in a row and the server spends most of the run with C streams at once instead
of in the ramp-up and the ramp-down.

The clients are threads of several processes, at most CLIENTS_PER_PROCESS threads each:
the `openai` client spends a few hundred microseconds of CPU on every streamed chunk, and
the threads of one process share an interpreter lock, so one process of many streams
would measure the client instead of the server. The clock starts once every thread has
its client and waits at a barrier, so the clients' set-up is not in the wall time. Besides the end-to-end figures, a level
reports the steady state, while all C clients are streaming (from the moment every
one of them has had its first token to the moment the first runs out of requests),
and the server's own account from `/metrics`: how much of the wall time its scheduler
spent in steps, and in the model's forward passes within them, and where the rest of a
step (its host work) went.

With CONSTRAINED (`json_schema` or `grammar`), each level runs twice with the same
clients and requests: unconstrained first, then with every request held to a nested JSON
schema (`response_format`) or a Lark grammar (`grammar`), without `ignore_eos` (the
output ends where the format does, or at GEN_TOKENS). The constrained run's line also
carries the bucket deltas of the server's `rocmforge_constraint_mask_seconds` histogram
(the grammar's mask, once per token), from which `bench-serve` computes its quantiles.

usage: bench_serve.py BASE_URL MODEL_ID LEVELS REQUESTS PROMPT_TOKENS GEN_TOKENS CLIENTS_PER_PROCESS [CONSTRAINED]
"""

import json
import multiprocessing
import sys
import threading
import time

import openai

base, model_id, levels, requests, prompt_tokens, gen_tokens, per_process = sys.argv[1:8]
levels = [int(x) for x in levels.split(",")]
requests, prompt_tokens, gen_tokens = int(requests), int(prompt_tokens), int(gen_tokens)
per_process = int(per_process)
constrained = sys.argv[8] if len(sys.argv) > 8 else "none"

# An order as a shop's back end would ask a model for it: nested objects, an array of
# objects, enums, a pattern, numbers with bounds. The items array is unbounded, so the
# output runs until the model closes it or GEN_TOKENS.
ORDER_SCHEMA = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{6}$"},
        "customer": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 64},
                "email": {"type": "string", "maxLength": 64},
                "address": {
                    "type": "object",
                    "properties": {
                        "street": {"type": "string", "maxLength": 64},
                        "city": {"type": "string", "maxLength": 32},
                        "country": {"type": "string", "enum": ["DE", "FR", "US", "JP"]},
                    },
                    "required": ["street", "city", "country"],
                    "additionalProperties": False,
                },
            },
            "required": ["name", "address"],
            "additionalProperties": False,
        },
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "maxLength": 16},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 100},
                    "unit_price": {"type": "number", "minimum": 0},
                    "gift": {"type": "boolean"},
                },
                "required": ["sku", "quantity", "unit_price"],
                "additionalProperties": False,
            },
        },
        "priority": {"type": "string", "enum": ["low", "normal", "high"]},
        "notes": {"type": ["string", "null"], "maxLength": 200},
    },
    "required": ["order_id", "customer", "items", "priority"],
    "additionalProperties": False,
}

# Lines of `key = value` pairs, as a small configuration language (Lark, as llguidance
# reads it).
CONFIG_GRAMMAR = r"""
start: line+
line: KEY " = " value "\n"
value: NUMBER | STRING | "true" | "false" | "[" value (", " value)* "]"
KEY: /[a-z_][a-z0-9_]{0,15}/
NUMBER: /-?[0-9]{1,6}(\.[0-9]{1,3})?/
STRING: /"[a-zA-Z0-9 ]{0,24}"/
"""


def request_body(constrain):
    """The fields besides the prompt a request carries."""
    if not constrain:
        return {"ignore_eos": True}
    if constrained == "json_schema":
        return {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "order", "strict": True, "schema": ORDER_SCHEMA},
            }
        }
    return {"grammar": CONFIG_GRAMMAR}


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


MASK_BUCKET = 'rocmforge_constraint_mask_seconds_bucket{le="'


def metrics():
    """The server's counters and histogram sums, by name (without `rocmforge_`); the
    mask histogram's cumulative buckets as `mask_le_<bound>`."""
    import urllib.request

    with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
        text = r.read().decode()
    values = {}
    phase = 'rocmforge_step_phase_seconds_total{phase="'
    for line in text.splitlines():
        if line.startswith("rocmforge_") and "{" not in line:
            name, value = line.split()
            values[name[len("rocmforge_") :]] = float(value)
        elif line.startswith(phase):
            name, value = line[len(phase) :].split('"} ')
            values["phase_" + name] = float(value)
        elif line.startswith(MASK_BUCKET):
            bound, value = line[len(MASK_BUCKET) :].split('"} ')
            values["mask_le_" + bound] = float(value)
    return values


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


def client_process(threads, count, serial_base, counter, barrier, out, constrain):
    """C threads of one client process; puts what they saw on `out`."""
    results, failures = [], []
    # Per client: the time of each text chunk, of its first, and when it ran out of work.
    chunk_times = [[] for _ in range(threads)]
    first_token = [None] * threads
    out_of_work = [None] * threads

    def worker(w):
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=600)
        barrier.wait()
        while True:
            with counter.get_lock():
                if counter.value >= count:
                    out_of_work[w] = time.perf_counter()
                    return
                counter.value += 1
                i = serial_base + counter.value
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
                    extra_body=request_body(constrain),
                )
                for chunk in stream:
                    now = time.perf_counter()
                    if chunk.usage is not None:
                        usage = chunk.usage
                    if chunk.choices and chunk.choices[0].text:
                        first = first or now
                        last = now
                        chunk_times[w].append(now)
                        if first_token[w] is None:
                            first_token[w] = now
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

    pool = [threading.Thread(target=worker, args=(w,)) for w in range(threads)]
    for t in pool:
        t.start()
    # Once every thread has its client: their set-up is not counted.
    barrier.wait()
    cpu_before = time.process_time()
    for t in pool:
        t.join(timeout=3600)
    out.put(
        {
            "results": results,
            "failures": failures,
            "chunk_times": chunk_times,
            "first_token": first_token,
            "out_of_work": out_of_work,
            "cpu_s": time.process_time() - cpu_before,
        }
    )


def run_level(clients, count, processes, constrain=False):
    # The clients are threads of `processes` processes (forked, so that they share no
    # interpreter lock), as evenly spread as they go.
    ctx = multiprocessing.get_context("fork")
    counter = ctx.Value("l", 0)
    processes = max(1, min(processes, clients))
    # Every client thread, the main thread of every process, and this one.
    barrier = ctx.Barrier(clients + processes + 1, timeout=600)
    out = ctx.Queue()
    spread = [clients // processes + (p < clients % processes) for p in range(processes)]
    children = []
    for threads in spread:
        child = ctx.Process(
            target=client_process,
            args=(threads, count, serial[0], counter, barrier, out, constrain),
        )
        child.start()
        children.append(child)
    before = metrics()
    barrier.wait()
    start = time.perf_counter()
    parts = [out.get(timeout=3600) for _ in children]
    wall = time.perf_counter() - start
    for child in children:
        child.join()
    serial[0] += count
    after = metrics()
    results = [r for part in parts for r in part["results"]]
    failures = [f for part in parts for f in part["failures"]]
    chunk_times = [c for part in parts for c in part["chunk_times"]]
    first_token = [t for part in parts for t in part["first_token"]]
    out_of_work = [t for part in parts for t in part["out_of_work"]]
    client_cpu = sum(part["cpu_s"] for part in parts)
    ttft = [r["ttft"] for r in results]
    tpot = [r["tpot"] for r in results if r["tpot"] is not None]
    out_tokens = sum(r["tokens"] for r in results)

    # The steady state: every client streaming. Chunks count tokens in the ratio of the
    # whole level (a chunk holds more than one token only where a character spans them).
    chunks = sum(len(c) for c in chunk_times)
    steady = None
    if None not in first_token and None not in out_of_work and chunks:
        begin, end = max(first_token), min(out_of_work)
        if end > begin:
            inside = sum(1 for c in chunk_times for t in c if begin <= t <= end)
            steady = {
                "steady_s": end - begin,
                "steady_output_tokens_per_s": inside * (out_tokens / chunks) / (end - begin),
            }

    def delta(name):
        return after.get(name, 0.0) - before.get(name, 0.0)

    steps = delta("step_seconds_count")
    server = {
        "steps": int(steps),
        "tokens_per_step": delta("computed_tokens_total") / steps if steps else None,
        "step_ms_mean": delta("step_seconds_sum") / steps * 1e3 if steps else None,
        "forward_ms_mean": delta("forward_seconds_sum") / steps * 1e3 if steps else None,
        # The step outside its forward pass (the scheduler's host work), whole and by part.
        "host_ms_mean": (delta("step_seconds_sum") - delta("forward_seconds_sum")) / steps * 1e3 if steps else None,
        **{
            f"{p}_ms_mean": delta("phase_" + p) / steps * 1e3 if steps else None
            for p in ["admit", "schedule", "sample", "deliver"]
        },
        # Shares of the client's wall time: the rest is the scheduler waiting for work.
        "step_share": delta("step_seconds_sum") / wall,
        "forward_share": delta("forward_seconds_sum") / wall,
    }
    # The mask histogram's buckets over the run: (upper bound, observations at or below).
    mask_buckets = sorted(
        (float(name[len("mask_le_") :]), int(delta(name)))
        for name in after
        if name.startswith("mask_le_") and name != "mask_le_+Inf"
    )
    return {
        "clients": clients,
        "phase": "constrained" if constrain else "plain",
        "constraint": constrained if constrain else None,
        "mask_buckets": mask_buckets,
        "mask_count": int(delta("constraint_mask_seconds_count")),
        "mask_sum_s": delta("constraint_mask_seconds_sum"),
        "requests": count,
        "completed": len(results),
        "failures": failures[:5],
        "n_failures": len(failures),
        "wall_s": wall,
        "ttft_p50_ms": percentile(ttft, 50) * 1e3 if ttft else None,
        "ttft_p99_ms": percentile(ttft, 99) * 1e3 if ttft else None,
        "tpot_p50_ms": percentile(tpot, 50) * 1e3 if tpot else None,
        "tpot_mean_ms": sum(tpot) / len(tpot) * 1e3 if tpot else None,
        "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / wall,
        "total_tokens_per_s": (out_tokens + len(results) * prompt_tokens) / wall,
        "steady_s": steady and steady["steady_s"],
        "steady_output_tokens_per_s": steady and steady["steady_output_tokens_per_s"],
        "client_processes": processes,
        "client_cpu_s": client_cpu,
        # The client's own CPU time per streamed chunk: one process, whose threads share
        # an interpreter lock, takes at most 1 / this many chunks a second.
        "client_cpu_us_per_chunk": client_cpu / chunks * 1e6 if chunks else None,
        **server,
    }


wait_ready()
for level in levels:
    count = requests if requests > 0 else 4 * level
    processes = -(-level // per_process)
    print(json.dumps(run_level(level, max(count, level), processes)), flush=True)
    if constrained != "none":
        print(json.dumps(run_level(level, max(count, level), processes, True)), flush=True)
