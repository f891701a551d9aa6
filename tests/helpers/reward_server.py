"""A remote reward model for tests: a real HTTP server on a loopback port (`with RewardServer() as rm: rm.url`)."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class RewardServer:
    """Answers POSTs with {"score": response == label}; the first `fail_first` requests per prompt get HTTP 500."""

    def __init__(self, fail_first: int = 0, status: int = 200, delay_s: float = 0.0, body: str | None = None):
        self.fail_first, self.status, self.delay_s, self.body = fail_first, status, delay_s, body
        self.requests: list[dict] = []
        self.attempts: dict[str, int] = {}
        self.in_flight = self.max_in_flight = 0
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server.lock:
                    server.requests.append(body)
                    seen = server.attempts.get(str(body["prompt"]), 0)
                    server.attempts[str(body["prompt"])] = seen + 1
                    server.in_flight += 1
                    server.max_in_flight = max(server.max_in_flight, server.in_flight)
                time.sleep(server.delay_s)
                if seen < server.fail_first:
                    code, text = 500, "try again"
                elif server.body is not None:
                    code, text = server.status, server.body
                else:
                    code, text = server.status, json.dumps(float(body["response"] == body["label"]))
                with server.lock:
                    server.in_flight -= 1
                payload = text.encode()
                self.send_response(code)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args):  # keep test output quiet
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/reward"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()
