"""`lichen serve` against a hostile local user (issue 12 items 1-3) and SGLang's behaviour on disconnects.

The server runs as this test's user (root here, as engines often do); the attacker is a real unprivileged process
(uid 65534) on loopback without a key. Each attack is checked by its effect on disk or on the server, and each
test fails when the fix it covers is reverted.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.serve_process import call, launch

from lichen.models.tiny import make_tiny_model

NOBODY = 65534
GEN = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}}
LONG = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 400, "ignore_eos": True, "sampling_seed": 9}}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("security")
    os.chmod(root, 0o755)  # the attacker may traverse it (it holds the attacker's own directory too)
    d = {name: root / name for name in ("weights", "local", "victim", "attacker", "other")}
    for name in ("weights", "local", "victim"):
        d[name].mkdir()
    os.chmod(d["victim"], 0o700)  # root-only, like ~root/.ssh
    (d["victim"] / "precious.txt").write_text("keep me")
    d["attacker"].mkdir(mode=0o755)
    (d["attacker"] / "authorized_keys").write_text("ssh-ed25519 AAAA attacker")
    (d["attacker"] / "config.json").write_text("{}")
    os.chown(d["attacker"], NOBODY, NOBODY)
    return d


@pytest.fixture(scope="module")
def server(tiny_ckpt, dirs, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("serve_sec") / "serve.log")
    proc = launch(
        tiny_ckpt,
        "--num-threads",
        "1",
        "--weight-dir",
        str(dirs["weights"]),
        "--local-checkpoint-dir",
        str(dirs["local"]),
        "--max-sequences-per-request",
        "16",
        "--max-queued-sequences",
        "4",
        "--header-timeout",
        "1",
        "--max-batch-size",
        "100000000",
        log_path=log,
    )
    yield proc
    proc.stop()


def as_nobody(url: str, requests: list[tuple[str, dict]]) -> list[int]:
    """POST each (path, body) from a process running as uid/gid 65534; returns the statuses."""
    code = (
        "import json, sys, urllib.error, urllib.request\n"
        "def post(url, body):\n"
        "    req = urllib.request.Request(url, data=json.dumps(body).encode(), method='POST',\n"
        "                                 headers={'Content-Type': 'application/json'})\n"
        "    try:\n"
        "        with urllib.request.urlopen(req, timeout=60) as r:\n"
        "            return r.status\n"
        "    except urllib.error.HTTPError as e:\n"
        "        return e.code\n"
        "url, reqs = sys.argv[1], json.loads(sys.argv[2])\n"
        "print(json.dumps([post(url + p, b) for p, b in reqs]))\n"
    )

    def drop() -> None:
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)

    # the system interpreter: this checkout's may sit where the attacker cannot read (e.g. under /root)
    python = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin") or sys.executable
    out = subprocess.run(
        [python, "-I", "-c", code, url, json.dumps(requests)],
        preexec_fn=drop,
        capture_output=True,
        text=True,
        timeout=120,
        cwd="/",
        env={"PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.slow
@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run the attacker as another user")
def test_unprivileged_user_cannot_make_the_engine_write_or_delete_elsewhere(server, dirs, tiny_ckpt, tmp_path):
    os.symlink(dirs["victim"], dirs["local"] / "planted")  # a link inside the allowed dir leads out of it
    other = make_tiny_model(
        str(dirs["other"]), hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128, seed=1, init_std=0.1
    )
    weights, victim = str(dirs["weights"]), str(dirs["victim"])
    attacks = [
        ("/pull_weights", {"local_checkpoint_dir": victim, "source_dir": weights, "target_version": 0}),
        ("/pull_weights", {"local_checkpoint_dir": victim, "source_dir": str(dirs["attacker"]), "target_version": 0}),
        (
            "/pull_weights",
            {"local_checkpoint_dir": str(dirs["local"] / ".." / "victim"), "source_dir": weights, "target_version": 0},
        ),
        (
            "/pull_weights",
            {"local_checkpoint_dir": str(dirs["local"] / "planted"), "source_dir": weights, "target_version": 0},
        ),
        (
            "/pull_weights",
            {
                "local_checkpoint_dir": str(dirs["local"] / "x"),
                "source_dir": str(dirs["attacker"]),
                "target_version": 0,
            },
        ),
        ("/update_weights_from_disk", {"model_path": other, "weight_version": "evil"}),
        ("/update_weights_from_disk", {"model_path": str(dirs["weights"] / ".." / "other")}),
    ]
    assert as_nobody(server.url, attacks) == [403] * len(attacks)
    assert sorted(os.listdir(victim)) == ["precious.txt"]
    assert (dirs["victim"] / "precious.txt").read_text() == "keep me"
    assert not (dirs["local"] / "x").exists()
    info = call(server.url + "/model_info")[1]
    assert info["weight_version"] == "default" and info["model_path"] == tiny_ckpt


def test_pull_into_the_allowed_dir_keeps_files_it_did_not_write(server, dirs, tiny_ckpt):
    local = dirs["local"] / "copy"
    local.mkdir()
    (local / "notes.txt").write_text("mine")
    body = {"local_checkpoint_dir": str(local), "source_dir": str(dirs["weights"]), "target_version": 0}
    st, out = call(server.url + "/pull_weights", body)
    assert st == 200 and out["success"], out
    assert (local / "notes.txt").read_text() == "mine"  # a seed used to prune every file the source lacks
    assert (local / "model.safetensors").exists()


def test_seed_neither_deletes_nor_replaces_foreign_files(tiny_ckpt, tmp_path):
    from lichen.weights import DeltaError
    from lichen.weights.pull import pull_weights, written_files

    local = tmp_path / "local"
    local.mkdir()
    (local / "notes.txt").write_text("mine")
    pull_weights(str(local), str(tmp_path / "w"), 0, base_dir=tiny_ckpt)
    assert (local / "notes.txt").read_text() == "mine"
    assert "model.safetensors" in written_files(str(local)) and "notes.txt" not in written_files(str(local))
    clash = tmp_path / "clash"
    clash.mkdir()
    (clash / "config.json").write_text("not lichen's")
    with pytest.raises(DeltaError, match="no pull wrote"):
        pull_weights(str(clash), str(tmp_path / "w"), 0, base_dir=tiny_ckpt)
    assert (clash / "config.json").read_text() == "not lichen's"


def test_update_from_an_allowed_dir_renames_the_served_model(server, dirs, tiny_ckpt):
    new = dirs["weights"] / "weight_v000001"
    shutil.copytree(tiny_ckpt, new)
    st, body = call(server.url + "/update_weights_from_disk", {"model_path": str(new), "weight_version": "1"})
    assert st == 200 and body["success"], body
    try:
        assert call(server.url + "/model_info")[1]["served_model_name"] == str(new)
        assert call(server.url + "/get_server_info")[1]["served_model_name"] == str(new)
        assert [m["id"] for m in call(server.url + "/v1/models")[1]["data"]] == [str(new)]
    finally:
        call(server.url + "/update_weights_from_disk", {"model_path": tiny_ckpt, "weight_version": "default"})
    assert call(server.url + "/model_info")[1]["served_model_name"] == tiny_ckpt


# ---- bounded work ---------------------------------------------------------------------------------------------
def rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def test_a_huge_n_is_refused_at_once_and_memory_stays_flat(server):
    before = rss_kb(server.proc.pid)
    body = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 1, "n": 703_490}}
    st, out = call(server.url + "/generate", body, timeout=60)
    assert st == 400 and "16 sequences" in out["error"]["message"]
    st, out = call(
        server.url + "/v1/completions", {"model": "x", "prompt": [5, 6], "max_tokens": 1, "n": 703_490}, timeout=60
    )
    assert st == 400 and "16 sequences" in out["message"]
    assert rss_kb(server.proc.pid) - before < 50_000  # kB
    assert call(server.url + "/generate", GEN)[0] == 200


@pytest.mark.slow
def test_a_full_queue_answers_503_and_the_client_backs_off(server):
    import asyncio

    from lichen.engines.clients.client import EngineClient

    assert call(server.url + "/pause_generation", {"mode": "abort"})[0] == 200
    outs: dict[int, list[str]] = {}
    code = (
        f"import sys, json\nsys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from helpers.serve_process import call\n"
        "st, out = call(sys.argv[1] + '/generate', json.loads(sys.argv[2]))\nprint(st, json.dumps(out))"
    )
    # 6 requests while generation is paused: 4 wait at the gate (--max-queued-sequences 4), 2 are turned away
    held = [
        subprocess.Popen([sys.executable, "-c", code, server.url, json.dumps(GEN)], stdout=subprocess.PIPE, text=True)
        for _ in range(6)
    ]
    try:
        deadline = time.monotonic() + 60
        while sum(p.poll() is not None for p in held) < 2:
            assert time.monotonic() < deadline, "no request was turned away"
            time.sleep(0.05)
        outs = {i: p.communicate()[0].split(" ", 1) for i, p in enumerate(held) if p.poll() is not None}
        refused = list(outs.values())
        assert [st for st, _ in refused] == ["503", "503"]
        assert all("server busy" in json.loads(body)["error"]["message"] for _, body in refused)
        st, out = call(server.url + "/generate", GEN)
        assert st == 503 and "server busy" in out["error"]["message"]

        async def both():
            c = EngineClient(server.url, retry_delay=0.1)

            async def client_generate() -> tuple[dict, int]:
                # ignore_eos: unseeded sampling over the tiny model's 102 tokens stops at its first token ~2% of runs
                res = await c.generate({**GEN, "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}})
                return res, c.attempts

            async def resume_later() -> None:
                # resume only after the client was turned away 4 times (the old client gave up after 3 retries):
                # a condition, so a slow machine cannot let the request through early
                end = time.monotonic() + 60
                while c.attempts < 4 and time.monotonic() < end:
                    await asyncio.sleep(0.05)
                await asyncio.to_thread(call, server.url + "/continue_generation", {})

            try:
                return await asyncio.gather(client_generate(), resume_later())
            finally:
                await c.close()

        (res, attempts), _ = asyncio.run(both())
        assert res["meta_info"]["completion_tokens"] == 2 and attempts > 4
    finally:
        call(server.url + "/continue_generation", {})
        sts = [outs[i][0] if i in outs else p.communicate(timeout=60)[0].split(" ", 1)[0] for i, p in enumerate(held)]
        assert sorted(sts) == ["200"] * 4 + ["503"] * 2


def test_slow_headers_are_cut_off(server):
    port = server.port
    socks = []
    for _ in range(20):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\n")  # and never the rest
        socks.append(s)
    try:
        for s in socks:
            s.settimeout(30)
            assert s.recv(100) == b""  # closed by the server (--header-timeout 1)
    finally:
        for s in socks:
            s.close()
    assert call(server.url + "/generate", GEN)[0] == 200


def test_a_client_that_disconnects_aborts_its_request_and_frees_its_rid(server):
    body = json.dumps({**LONG, "rid": "dropped"}).encode()
    s = socket.create_connection(("127.0.0.1", server.port))
    s.sendall(
        b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )
    deadline = time.monotonic() + 30
    while call(server.url + "/v1/loads?include=core")[1]["loads"][0]["num_running_reqs"] < 1:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.01)
    assert call(server.url + "/pause_generation", {"mode": "in_place"})[0] == 200  # it would wait here forever
    try:
        s.close()
        while call(server.url + "/v1/loads?include=core")[1]["loads"][0]["num_running_reqs"] != 0:
            assert time.monotonic() < deadline + 30, "the disconnected request kept running"
            time.sleep(0.05)
    finally:
        call(server.url + "/continue_generation", {})
    st, out = call(server.url + "/generate", {**GEN, "rid": "dropped"})
    assert st == 200, out


def test_server_info_tells_the_truth(server):
    info = call(server.url + "/get_server_info")[1]
    assert info["enable_memory_saver"] is False  # CPU: releasing memory frees nothing
    ctx = info["context_length"]
    # --max-batch-size 1e8: that many full-context sequences cannot fit in this machine's memory
    assert 0 < info["max_total_num_tokens"] < info["max_running_requests"] * ctx
    assert info["max_queued_sequences"] == 4 and info["max_sequences_per_request"] == 16


def test_scheduler_state_read_elsewhere_never_touches_the_live_batch(tiny_ckpt):
    """/v1/loads and /get_server_info read the scheduler's counts from the event loop thread while the scheduler
    thread mutates the batch; len() of a batch mid-update once raised (a 500 under load). The counts are published
    by the scheduler thread after each pass, so reading them never looks at the batch."""
    from lichen.engines.core.engine import Engine
    from lichen.engines.server.scheduler import Scheduler
    from lichen.models import load_model

    class Mutating:  # a batch caught between `rows` and `n_dead` being updated
        cache_tokens = 0

        def __len__(self):
            raise ValueError("__len__() should return >= 0")

    sch = Scheduler(Engine(load_model(tiny_ckpt), eos_token_ids=[0]), max_running=4, on_events=lambda p, d: None)
    sch.batch = Mutating()
    assert (sch.num_running, sch.num_waiting, sch.cache_tokens, sch.waiting_tokens) == (0, 0, 0, 0)


def test_launched_engines_get_the_runs_dirs_and_bounds(tmp_path):
    from types import SimpleNamespace

    from lichen.engines.clients.launch_args import launch_server_args

    cfg = SimpleNamespace(
        device="cpu",
        max_batch_size=None,
        num_threads=1,
        num_engines=2,
        weight_dir=str(tmp_path / "w"),
        local_checkpoint_dir=str(tmp_path / "local"),
        concurrency=3000,
        max_prompt_len=100,
        max_response_len=200,
    )
    flags = launch_server_args(cfg)
    opt = {flags[i]: flags[i + 1] for i in range(len(flags) - 1) if flags[i].startswith("--")}
    assert opt["--weight-dir"] == str(tmp_path / "w") and opt["--local-checkpoint-dir"] == str(tmp_path / "local")
    assert opt["--max-queued-sequences"] == "6000"  # twice what the client keeps in flight per engine
    assert opt["--max-queued-tokens"] == str(6000 * (100 + 200))  # the longest prompt + response of the run
