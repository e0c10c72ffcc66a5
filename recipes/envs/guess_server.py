"""GuessNumber (guess.py) served over the http environment contract (`environment.type: http`):

    POST /reset {"episode_id", "row", "seed"} -> {"observation"}
    POST /step  {"episode_id", "message"}     -> {"observation", "reward", "done"}
    POST /close {"episode_id"}                -> {}

Run: python recipes/envs/guess_server.py --port 8080  (listens on 127.0.0.1 only). Standard library only.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from guess import GuessNumber  # noqa: E402


def make_server(port: int, low: int = 1, high: int = 10) -> ThreadingHTTPServer:
    """A server (not yet serving) on 127.0.0.1:port; one GuessNumber per episode_id."""
    episodes: dict[str, GuessNumber] = {}
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # quiet
            pass

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
            episode = body.get("episode_id")
            status, answer = 200, {}
            if self.path == "/reset":
                with lock:
                    episodes[episode] = GuessNumber(low, high)
                answer = {"observation": episodes[episode].reset(body.get("row", {}), body["seed"])}
            elif self.path == "/step" and episode in episodes:
                answer = episodes[episode].step(body["message"])
            elif self.path == "/close":
                with lock:
                    episodes.pop(episode, None)
            else:
                status, answer = 404, {"error": f"unknown path or episode: {self.path}"}
            data = json.dumps(answer).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    server.daemon_threads = True
    server.episodes = episodes  # the open episodes, for a look from outside
    return server


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8080)
    make_server(parser.parse_args().port).serve_forever()
