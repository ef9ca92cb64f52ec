"""What the `rocmforge serve` checks share: the binary and model from the command line,
the check decorator (each check runs as it is defined and is counted in PASSED), a
server on a free port with its stderr kept, plain HTTP, and OpenAI-shaped errors.
Imported by serve_openai.py and the check files it runs.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import atexit

import openai

BINARY, MODEL = sys.argv[1], sys.argv[2]
KEY = "test-key-123"
MODEL_ID = os.path.basename(MODEL)[: -len(".gguf")]
PASSED = []


def check(name):
    def wrap(fn):
        start = time.time()
        fn()
        PASSED.append(name)
        print(f"ok {name} ({time.time() - start:.1f} s)", flush=True)

    return wrap


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, *args):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [BINARY, "serve", "--gguf", MODEL, "--host", "127.0.0.1", "--port", str(self.port), *args],
            stderr=subprocess.PIPE,
            text=True,
        )
        self.stderr = []
        threading.Thread(target=self._drain, daemon=True).start()
        # A failed check must not leave a server behind.
        atexit.register(lambda: self.proc.poll() is None and self.proc.kill())

    def _drain(self):
        for line in self.proc.stderr:
            self.stderr.append(line)

    def wait_ready(self, timeout=60):
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                status, _, _ = http("GET", self.base + "/health")
                if status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.05)
        raise AssertionError(f"server not ready: {''.join(self.stderr)}")

    def client(self, key=KEY, **kw):
        return openai.OpenAI(base_url=self.base + "/v1", api_key=key, max_retries=0, timeout=120, **kw)

    def metric(self, name):
        _, _, body = http("GET", self.base + "/metrics", headers={"Authorization": f"Bearer {KEY}"})
        m = re.search(rf"^rocmforge_{name} (\S+)$", body.decode(), re.M)
        assert m, f"metric {name} missing"
        return float(m.group(1))

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout=60)
        assert "panicked" not in "".join(self.stderr), "".join(self.stderr)
        return code


def http(method, url, body=None, headers=None):
    data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, r.read()
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}, e.read()


def generate(prompt, *args):
    out = subprocess.run(
        [BINARY, "generate", "--gguf", MODEL, "--prompt", prompt, "--json", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(out.stdout)["text"]


def error_of(status, body, expected_status):
    assert status == expected_status, (status, body)
    err = json.loads(body)["error"]
    assert isinstance(err["message"], str) and err["type"], err
    return err["message"]
