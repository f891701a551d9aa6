"""Shared by the `lichen serve` protocol tests (lichen's own model and the generic HF path): a server process with
the same checkpoint loaded in process as the reference, and small request helpers."""

from __future__ import annotations

import threading
import time

import torch

from helpers.serve_process import call, launch
from lichen.models import load_model


def server_and_reference(ckpt: str, tmp_path_factory, *server_args: str):
    """Yield (the server process, the checkpoint loaded here); they load concurrently. Stops the server after."""
    log = str(tmp_path_factory.mktemp("serve_log") / "serve.log")
    proc = launch(
        ckpt,
        "--num-threads",
        "1",
        "--health-check-timeout",
        "3",
        "--weight-version",
        "0",
        "--weight-dir",
        str(tmp_path_factory.getbasetemp()),
        *server_args,
        log_path=log,
        wait=False,
    )
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = load_model(ckpt)
        yield proc.wait_ready(), model
    finally:
        proc.stop()
        torch.set_num_threads(before)


def full_forward(model, ids, temperature):
    """log p(ids[k] | ids[:k]) for k >= 1: log_softmax(logits / T) of one uncached forward (float64 softmax)."""
    with torch.no_grad():
        logits = model.logits(model(torch.tensor([ids]), torch.arange(len(ids))[None]))[0].double()
    lp = torch.log_softmax(logits / temperature, -1)
    return [lp[k - 1, t].item() for k, t in enumerate(ids) if k > 0]


def gen(server, body, **kw):
    return call(server.url + "/generate", body, **kw)


def in_thread(fn, *args):
    out = {}
    th = threading.Thread(target=lambda: out.setdefault("r", fn(*args)), daemon=True)
    th.start()
    return th, out


def wait_running(server, n=1, timeout=10.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        load = call(server.url + "/v1/loads?include=core")[1]["loads"][0]
        if load["num_running_reqs"] >= n:
            return load
        time.sleep(0.005)
    raise AssertionError("request never started running")
