"""A stand-in `sglang.launch_server` module for tests (no GPU, no SGLang needed).

FAKE_LAUNCH_SERVER is a stdlib HTTP server that speaks the part of SGLang's protocol lichen drives, with a
deterministic /generate (tokens are a function of the request's sampling_seed and input, so a re-sent request is
recognisable) that holds each request FAKE_SGLANG_DELAY seconds; GET /server_info counts the /generate and
/abort_request calls it received. POST /test_hold {"after": N} makes it answer the next N /generate requests and
hold every later one until an /abort_request arrives (then they, and any sent after it, answer "abort"), so tests
of aborting do not depend on how fast the client decides; {"after": null} turns holding off. POST /test_freeze {"on":
true} holds every /generate until {"on": false} (unlike /pause_generation, which lichen itself ends). Used by the SGLang launcher, fault-tolerance, abort and custom-generate tests.
"""

from __future__ import annotations

import os
import sys

FAKE_LAUNCH_SERVER = r"""
import json, os, sys, threading, time
from http.server import ThreadingHTTPServer, BaseHTTPRequestHandler

argv = sys.argv[1:]
opt = lambda name: argv[argv.index(name) + 1]
print("ARGV " + json.dumps(argv), flush=True)
with open(os.path.join(os.environ["FAKE_SGLANG_DIR"], "pid_%d" % os.getpid()), "w") as f:
    json.dump(argv, f)
state = {"version": "default", "paused": False, "model": opt("--model-path"), "generate_requests": 0, "aborts": 0,
         "hold_after": None, "aborted": False, "frozen": False}
cond = threading.Condition()
DELAY = float(os.environ.get("FAKE_SGLANG_DELAY", "0"))
PATHS = {"/generate", "/health", "/health_generate", "/model_info", "/pause_generation", "/continue_generation",
         "/flush_cache", "/update_weights_from_disk", "/abort_request", "/release_memory_occupation",
         "/resume_memory_occupation"}

def tokens(seed, ids, n):
    return [(seed * 31 + sum(ids) + 7 * k) % 50 + 5 for k in range(n)]

class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *a): pass
    def reply(self, status, obj=None):
        raw = b"" if obj is None else json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)
    def body(self):
        n = int(self.headers.get("Content-Length") or 0)
        return json.loads(self.rfile.read(n) or b"{}") if n else {}
    def gate(self):
        with cond:
            cond.wait_for(lambda: not state["paused"])
    def held(self):
        # True: this request was held until an abort; None: no abort came within the bound (a broken test: the
        # request fails rather than being answered late, which would let the test pass slowly)
        with cond:
            if state["hold_after"] is None:
                return False
            if state["hold_after"] > 0 and not state["aborted"]:
                state["hold_after"] -= 1
                return False
            return cond.wait_for(lambda: state["aborted"], timeout=120) or None
    def do_OPTIONS(self):
        self.reply(200 if self.path in PATHS else 404)
    def do_GET(self):
        if self.path == "/health":
            return self.reply(200)
        if self.path == "/health_generate":
            self.gate()
            return self.reply(200)
        if self.path == "/model_info":
            return self.reply(200, {"model_path": state["model"], "weight_version": state["version"]})
        if self.path == "/flush_cache":
            return self.reply(200)
        if self.path == "/server_info":
            return self.reply(200, {k: state[k] for k in ("generate_requests", "aborts")})
        self.reply(404, {"error": "no such path"})
    def do_POST(self):
        body = self.body()
        if self.path == "/generate":
            state["generate_requests"] += 1
            self.gate()
            with cond:  # /test_freeze: held until thawed (lichen's own /continue_generation does not release it)
                cond.wait_for(lambda: not state["frozen"], timeout=120)
            aborted = self.held()
            if aborted is None:
                return self.reply(500, {"error": "held 120 s and no /abort_request came"})
            time.sleep(0 if aborted else DELAY)
            sp = body.get("sampling_params", {})
            out = tokens(int(sp.get("sampling_seed", 0)), body["input_ids"], int(sp.get("max_new_tokens", 4)))
            out = [] if aborted else out
            finish = {"type": "abort", "message": "aborted"} if aborted else {"type": "length", "length": len(out)}
            meta = {"id": body.get("rid"), "finish_reason": finish,
                    "prompt_tokens": len(body["input_ids"]), "completion_tokens": len(out),
                    "weight_version": state["version"], "output_token_logprobs": [[-0.5, t, None] for t in out]}
            return self.reply(200, {"output_ids": out, "meta_info": meta})
        if self.path == "/pause_generation":
            state["paused"] = True
            return self.reply(200, {"message": "paused"})
        if self.path == "/continue_generation":
            with cond:
                state["paused"] = False
                cond.notify_all()
            return self.reply(200, {"message": "continued"})
        if self.path == "/update_weights_from_disk":
            if not os.path.isdir(body["model_path"]):
                return self.reply(400, {"success": False, "message": "no such path"})
            state["version"], state["model"] = body["weight_version"], body["model_path"]
            return self.reply(200, {"success": True, "message": "ok"})
        if self.path == "/abort_request":
            with cond:
                state["aborts"] += 1
                state["aborted"] = state["hold_after"] is not None
                cond.notify_all()
            return self.reply(200)
        if self.path == "/test_hold":
            with cond:
                state["hold_after"], state["aborted"] = body.get("after"), False
                cond.notify_all()
            return self.reply(200)
        if self.path == "/test_freeze":
            with cond:
                state["frozen"] = bool(body.get("on"))
                cond.notify_all()
            return self.reply(200)
        if self.path in ("/release_memory_occupation", "/resume_memory_occupation"):
            return self.reply(200)
        self.reply(404, {"error": "no such path"})

server = ThreadingHTTPServer((opt("--host"), int(opt("--port"))), H)
server.daemon_threads = True
server.serve_forever()
"""


def fake_sglang_command(i: int, port: int) -> list[str]:
    """The launch command of fake SGLang server `i` (a `command_for` for SGLangLauncher)."""
    return [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        "/m",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]


def write_fake_sglang(root) -> dict:
    """A stand-in `sglang` package under `root`; returns the environment that makes `python -m
    sglang.launch_server` run it (FAKE_SGLANG_DIR: where each server records its argv, by pid)."""
    pkg = root / "sglang"
    pkg.mkdir(exist_ok=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "launch_server.py").write_text(FAKE_LAUNCH_SERVER)
    return {"PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]), "FAKE_SGLANG_DIR": str(root)}
