"""Two `rocmforge serve` replicas behind SGLang's router (`sglang-router`, a
prefix-aware router installed from the package registry), driven through the router by
the official `openai` client, on loopback:

- the router registers both replicas and lists their model;
- each conversation's second turn goes to the replica that computed its first, which
  takes the first turn's tokens from its KV pool (`/metrics`' cached prompt tokens);
- one replica is killed while clients are running: what the clients saw is printed,
  the router stops sending to the dead replica, and the run finishes on the other.

Usage: serve_router.py ROCMFORGE MODEL.gguf (a Python with `openai` and
`sglang_router`, as `cargo xtask test` installs them).
"""

import json
import signal
import subprocess
import sys
import threading
import time

import openai

from serve_common import MODEL_ID, PASSED, Server, check, free_port, http

replicas = [Server("--device", "cpu", "--threads", "1") for _ in range(2)]
for r in replicas:
    r.wait_ready()


class Router:
    def __init__(self, workers):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        args = [
            sys.executable, "-m", "sglang_router.launch_router",
            "--host", "127.0.0.1", "--port", str(self.port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
            "--worker-urls", *[w.base for w in workers],
            "--policy", "cache_aware",
            # Probe each replica every second; one failure takes it out.
            "--health-check-interval-secs", "1",
            "--health-failure-threshold", "1",
            "--log-level", "warn",
        ]
        self.log = []
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        threading.Thread(target=lambda: self.log.extend(self.proc.stdout), daemon=True).start()

    def workers(self):
        status, _, body = http("GET", self.base + "/workers")
        assert status == 200, (status, body)
        return {w["url"]: w for w in json.loads(body)["workers"]}

    def wait_registered(self, n, timeout=60):
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                ws = self.workers()
                if len(ws) == n and all(w["is_healthy"] and w["model_id"] == MODEL_ID for w in ws.values()):
                    return ws
            except (OSError, AssertionError):
                pass
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        raise AssertionError("router did not register the replicas:\n" + "".join(self.log[-40:]))

    def client(self):
        return openai.OpenAI(base_url=self.base + "/v1", api_key="unused", max_retries=0, timeout=120)

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


router = Router(replicas)
router.wait_registered(2)
client = router.client()


def served():
    """Requests each replica has received so far."""
    return [r.metric("requests_received_total") for r in replicas]


@check("the router lists the replicas' model")
def _():
    ids = [m.id for m in client.models.list().data]
    assert ids == [MODEL_ID], ids


@check("a replica's load is what it computes")
def _():
    r = replicas[0]
    load = lambda: json.loads(http("GET", r.base + "/get_load")[2])
    assert load() == [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}], load()
    c = r.client()
    done = threading.Event()
    threading.Thread(
        target=lambda: (c.completions.create(model=MODEL_ID, prompt="Once upon a time", max_tokens=200, temperature=0), done.set()),
        daemon=True,
    ).start()
    seen = None
    while not done.is_set():
        (entry,) = load()
        if entry["num_reqs"] == 1:
            seen = entry
            break
        time.sleep(0.01)
    assert seen and seen["num_tokens"] > 0 and seen["num_tokens"] % 16 == 0, seen
    assert done.wait(120)


TOPICS = [
    "Describe how a lighthouse keeper spent a long stormy night on a small rocky island far in the north, and what he saw.",
    "Explain to a curious child why bread rises when it bakes, with an example from an old farm kitchen in the hills.",
    "Tell a short story about a patient clockmaker who repairs the great tower clock of a quiet mountain village.",
    "List what a careful traveller should pack for a whole week of walking through cold, wet and windy hills.",
]


@check("each conversation's second turn goes to the replica holding its prefix")
def _():
    # Conversations at once, as clients come: the router spreads their first turns by
    # load (no replica holds any of them yet) and sends each second turn after its
    # first, to the replica whose KV pool has it.
    turns = {}
    served_before = served()
    cached_before = sum(r.metric("prompt_tokens_cached_total") for r in replicas)

    def conversation(topic):
        messages = [{"role": "user", "content": topic}]
        first = client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=24, temperature=0)
        messages += [
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "Now say that again in one sentence."},
        ]
        second = client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=16, temperature=0)
        turns[topic] = (first.usage, second.usage)

    threads = [threading.Thread(target=conversation, args=(t,)) for t in TOPICS]
    for t in threads:
        t.start()
        time.sleep(0.05)
    for t in threads:
        t.join(timeout=120)
    assert len(turns) == len(TOPICS), "a conversation failed"
    for topic, (first, second) in turns.items():
        cached = second.prompt_tokens_details.cached_tokens
        # The whole first turn's prompt but its last, partly filled block of 16: only
        # the replica that computed it has that (the other could share the template's
        # opening at most, which is shorter).
        print(f"  turn 2 took {cached} of {second.prompt_tokens} prompt tokens from the pool (turn 1: {first.prompt_tokens})")
        assert cached >= first.prompt_tokens - 16, (first, second)
    per_replica = [n - b for n, b in zip(served(), served_before)]
    assert all(n > 0 for n in per_replica), f"the conversations all went to one replica: {per_replica}"
    reused = sum(r.metric("prompt_tokens_cached_total") for r in replicas) - cached_before
    reported = sum(f.prompt_tokens_details.cached_tokens + s.prompt_tokens_details.cached_tokens for f, s in turns.values())
    assert reused == reported, (reused, reported)
    print(f"  requests per replica: {per_replica}")


@check("a replica killed mid-run: the router stops sending to it and the run finishes on the other")
def _():
    # Six clients, half of them streaming, send requests in a loop; one replica is
    # killed while it computes some of them.
    outcomes = []  # (start, end, streamed, "ok" or what the client raised)
    lock = threading.Lock()
    stop_at = [None]

    def client_loop(k):
        c = router.client()
        stream = k % 2 == 1
        n = 0
        while stop_at[0] is None or time.time() < stop_at[0]:
            n += 1
            start = time.time()
            request = dict(
                model=MODEL_ID,
                messages=[{"role": "user", "content": f"Client {k}, request {n}: name a colour and a fruit."}],
                max_tokens=24,
                temperature=0.7,
                seed=n,
            )
            try:
                if stream:
                    text = "".join(
                        chunk.choices[0].delta.content or ""
                        for chunk in c.chat.completions.create(stream=True, **request)
                        if chunk.choices
                    )
                else:
                    text = c.chat.completions.create(**request).choices[0].message.content
                outcome = "ok" if text else "empty"
            except openai.APIStatusError as e:
                outcome = f"{type(e).__name__} {e.status_code}"
            except openai.APIError as e:
                outcome = type(e).__name__
            with lock:
                outcomes.append((start, time.time(), stream, outcome))

    threads = [threading.Thread(target=client_loop, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    victim, survivor = replicas
    while len(outcomes) < 12 or victim.metric("running_sequences") == 0:
        time.sleep(0.02)
    in_flight = victim.metric("running_sequences") + victim.metric("queue_depth")
    victim.proc.kill()
    kill = time.time()
    victim.proc.wait()
    # Until the router notices (a second's health check, or a failed forward), a
    # request may still be sent to the dead replica; after that, none may.
    deadline = time.time() + 20
    while router.workers()[victim.base]["is_healthy"]:
        assert time.time() < deadline, "the router still calls the dead replica healthy"
        time.sleep(0.05)
    noticed = time.time()
    survivor_before = survivor.metric("requests_received_total")
    stop_at[0] = time.time() + 6
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a client hung"
    survivor_after = survivor.metric("requests_received_total")

    def summary(start, end):
        picked = [(s, o) for t, _, s, o in outcomes if start <= t < end]
        counts = {}
        for streamed, outcome in picked:
            key = ("streamed " if streamed else "whole ") + outcome
            counts[key] = counts.get(key, 0) + 1
        return counts, [o for _, o in picked]

    (before, _), (during, _), (after, after_all) = (
        summary(0, kill), summary(kill, noticed), summary(noticed, float("inf"))
    )
    print(f"  killed with {in_flight:.0f} requests in flight on it")
    print(f"  requests started before the kill: {before}")
    print(f"  started until the router marked it unhealthy ({noticed - kill:.2f} s): {during}")
    print(f"  started after: {after}")
    # The kill may fail what the dead replica was computing; nothing that had ended
    # before it.
    assert all(o == "ok" for t, e, _, o in outcomes if e < kill), before
    assert after_all and all(o == "ok" for o in after_all), after
    # Every request sent after the router noticed reached the survivor.
    assert survivor_after - survivor_before >= len(after_all), (survivor_before, survivor_after, len(after_all))
    assert not router.workers()[victim.base]["is_healthy"]


router.stop()
assert replicas[1].stop() == 0
print(f"{len(PASSED)} passed, 0 failed")
