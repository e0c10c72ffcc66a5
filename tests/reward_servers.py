"""Small reward servers on loopback for the tests: an HTTP reward server and an OpenAI-compatible judge.

Both are the standard library's ThreadingHTTPServer in a daemon thread, started by a test (or a
fixture) and stopped at its end; ``fault`` switches what they answer, so one server plays every
failure a real one shows: HTTP 500, an answer slower than the client's timeout, malformed JSON, the
wrong number of rewards, a judge answer with no number. ``stop()`` and ``start()`` again on the same
port play a server killed mid-run and brought back.

The reward server scores with recipes/rewards/short_positive.py, the tiny function-reward recipe's
own function, so a run rewarded over HTTP can be compared with the same reward computed in-process.
"""

from __future__ import annotations

import importlib.util
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _short_positive():
    spec = importlib.util.spec_from_file_location("short_positive_for_server", ROOT / "recipes/rewards/short_positive.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.reward


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Server:
    """A ThreadingHTTPServer in a thread, on a fixed port so it can be stopped and started again."""

    def __init__(self, port: int | None = None):
        self.port = port or free_port()
        self.fault: str | None = None  # None answers properly; see each server's _answer
        self.slow_s = 2.0  # how long a "slow" answer takes
        self.delay_s = 0.0  # every answer waits this long first (a server that takes its time)
        self.fail_every = 0  # with fault "flaky": every n-th request answers HTTP 500
        self.probe_ok = False  # answer an empty batch (the preflight's request) properly whatever the fault
        self.requests: list[dict] = []  # {"path", "headers", "body", "at" (time.monotonic)} of each request, in order
        self.in_flight = self.max_in_flight = 0
        self._lock = threading.Lock()
        self._httpd = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "_Server":
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def _handle(self, method: str):
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                body = json.loads(raw) if raw else None
                with server._lock:
                    server.requests.append({"path": self.path, "headers": dict(self.headers), "body": body,
                                            "method": method, "at": time.monotonic()})
                    server.in_flight += 1
                    server.max_in_flight = max(server.max_in_flight, server.in_flight)
                    number = len(server.requests)
                try:
                    if server.delay_s:
                        time.sleep(server.delay_s)
                    status, payload = server._answer(method, self.path, dict(self.headers), body, number)
                finally:
                    with server._lock:
                        server.in_flight -= 1
                data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                try:
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up (timeout)
                    pass

            def do_POST(self):
                self._handle("POST")

            def do_GET(self):
                self._handle("GET")

        ThreadingHTTPServer.allow_reuse_address = True
        self._httpd = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self._httpd.daemon_threads = True
        threading.Thread(target=self._httpd.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    def _common_fault(self, number: int):
        if self.fault == "500" or (self.fault == "flaky" and self.fail_every and number % self.fail_every == 0):
            return 500, {"error": "internal error"}
        if self.fault == "slow":
            time.sleep(self.slow_s)
        if self.fault == "malformed":
            return 200, b"{'rewards': [1.0,"
        return None


class RewardServer(_Server):
    """POST /score {"prompts", "responses", "columns"} -> {"rewards": [...]}, scored by short_positive."""

    def __init__(self, port: int | None = None):
        super().__init__(port)
        self.reward = _short_positive()

    @property
    def score_url(self) -> str:
        return self.url + "/score"

    def _answer(self, method, path, headers, body, number):
        if method != "POST" or path != "/score":
            return 404, {"error": "not found"}
        if self.probe_ok and not body["responses"]:  # ppo's "does it answer" request: the fault shows later
            return 200, {"rewards": []}
        if self.fault == "echo_auth":  # a careless server that quotes the request's credentials back
            return 500, {"error": f"bad token {headers.get('Authorization')}"}
        fault = self._common_fault(number)
        if fault is not None:
            return fault
        rewards = self.reward(body["prompts"], body["responses"]) if body["responses"] else []
        if self.fault == "wrong_length":
            rewards = rewards[:-1]
        if self.fault == "null_first":
            rewards = [None] + rewards[1:]
        return 200, {"rewards": rewards}


class JudgeServer(_Server):
    """An OpenAI-compatible /v1/chat/completions whose answer is 'Score: N' (N from short_positive:
    10 for a positive response, else 1), and /v1/models; ``api_key``: the Bearer token it wants."""

    def __init__(self, port: int | None = None, api_key: str | None = None):
        super().__init__(port)
        self.api_key = api_key
        self.reward = _short_positive()

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def _answer(self, method, path, headers, body, number):
        if self.api_key is not None and headers.get("Authorization") != f"Bearer {self.api_key}":
            return 401, {"error": "unauthorized"}
        if method == "GET" and path == "/v1/models":
            return 200, {"object": "list", "data": [{"id": "judge", "object": "model"}]}
        if method != "POST" or path != "/v1/chat/completions":
            return 404, {"error": "not found"}
        fault = self._common_fault(number)
        if fault is not None:
            return fault
        text = body["messages"][-1]["content"]
        response = text.rpartition("Response:")[2]
        score = 10 if self.reward([""], [response])[0] == 10.0 else 1
        content = "I cannot rate this." if self.fault == "unparseable" else f"Score: {score}"
        return 200, {"id": "x", "object": "chat.completion", "model": body["model"],
                     "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}]}
