"""The hang watchdog (--watchdog-timeout): a reward that hangs gets a stack dump naming the reward phase; the run
exits with code 3 after a second timeout unless --watchdog-wait."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from helpers.runs import base_args, run

DEADLINE_S = 120  # generous: the machine's cores are shared; the hang ends as soon as the dump exists


def wait_for_dump(args, sample) -> float:
    """A reward that hangs (sample 0 of the first step only) until the watchdog has dumped it. Not "until any
    dump": a generation slower than the timeout is dumped first, naming generate."""
    folder = os.path.join(args.output_dir, "watchdog")
    if sample.index == 0 and not _reward_dumps(folder):
        deadline = time.monotonic() + DEADLINE_S
        while not _reward_dumps(folder) and time.monotonic() < deadline:
            time.sleep(0.05)
    return 0.5


def _reward_dumps(folder) -> list[str]:
    return sorted(n for n in os.listdir(folder) if n.endswith("_reward.txt")) if os.path.isdir(folder) else []


def hang_forever(args, sample) -> float:
    while True:
        time.sleep(1)


def test_a_hanging_reward_is_dumped_naming_the_reward_phase(tiny_ckpt, addition_data, tmp_path):
    out = tmp_path / "run"
    argv = base_args(
        tiny_ckpt, addition_data, out, "--num-rollout", "2", "--watchdog-timeout", "0.5", "--watchdog-wait"
    )
    argv[argv.index("loop_plugins.digit_fraction")] = "test_watchdog.wait_for_dump"
    assert len(run(argv)) == 2  # --watchdog-wait: the run goes on once the reward returns
    dumps = _reward_dumps(out / "watchdog")
    assert dumps
    text = (out / "watchdog" / dumps[0]).read_text()
    first = text.splitlines()[0]
    assert first.startswith("lichen watchdog: phase generate > reward has run longer than --watchdog-timeout 0.5 s"), (
        first
    )
    assert "rank 0" in first
    assert "  generate (rollout 0): rank 0, thread 'MainThread'" in text
    assert "  reward (rollout 0): rank 0" in text
    assert "stacks of every thread of this process (faulthandler)" in text
    assert "in wait_for_dump" in text  # the hanging verifier's frame is in the dump


@pytest.mark.slow
def test_without_wait_a_hang_exits_with_code_3(tiny_ckpt, addition_data, tmp_path):
    out = tmp_path / "run"
    argv = base_args(tiny_ckpt, addition_data, out, "--num-rollout", "2", "--watchdog-timeout", "2")
    argv[argv.index("loop_plugins.digit_fraction")] = "test_watchdog.hang_forever"
    tests = os.path.dirname(__file__)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-m", "lichen.cli", *argv], env=env, capture_output=True, text=True, timeout=DEADLINE_S
    )
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert "watchdog: phase generate > reward still running" in proc.stderr
    dumps = sorted(os.listdir(out / "watchdog"))
    assert len(dumps) == 2 and dumps[-1].endswith("_2_reward.txt")  # one dump per timeout passed


def test_check_dumps_once_per_timeout_and_exits_after_the_second():
    from lichen.observe.phases import PhaseTracker
    from lichen.observe.watchdog import EXIT_CODE, Watchdog

    def fresh(tmp, wait):
        exits = []
        return Watchdog(tmp, 10, wait=wait, phases=phases, exit_fn=exits.append), exits

    import tempfile

    phases = PhaseTracker()
    with tempfile.TemporaryDirectory() as tmp, phases.phase("train", 4) as rec:
        wd, exits = fresh(tmp, wait=False)
        assert wd.check(now=rec.start + 9) is None
        first = wd.check(now=rec.start + 11)
        assert first and "train" in os.path.basename(first) and wd.check(now=rec.start + 15) is None
        assert exits == []
        wd.check(now=rec.start + 21)
        assert exits == [EXIT_CODE] and len(wd.dumps) == 2
        wd, exits = fresh(tmp, wait=True)
        for t in (11, 21, 31):
            wd.check(now=rec.start + t)
        assert exits == [] and len(wd.dumps) == 3  # waiting: one dump per further timeout


@pytest.mark.slow
def test_the_dump_holds_the_engine_servers_stacks(pair, tmp_path):
    """`lichen serve` answers GET /debug/stacks (admin key) with its threads' stacks; the dump carries them."""
    import urllib.error
    import urllib.request

    from lichen.observe.phases import PhaseTracker
    from lichen.observe.run_observer import engine_stacks_of
    from lichen.observe.watchdog import Watchdog

    try:
        urllib.request.urlopen(pair.urls[0] + "/debug/stacks", timeout=30)
        status = 200
    except urllib.error.HTTPError as e:
        status = e.code
    assert status == 401  # the stacks show the server's code paths: admin key only
    phases = PhaseTracker()
    wd = Watchdog(str(tmp_path), 5, phases=phases, engine_stacks=engine_stacks_of([pair]), exit_fn=lambda c: None)
    with phases.phase("generate", 0) as rec:
        path = wd.check(now=rec.start + 6)
    text = open(path).read()
    assert "engines: " + ", ".join(pair.urls) in text
    for url in pair.urls:
        section = text.split(f"---- engine {url}: stacks ----\n")[1]
        assert section.startswith("Thread ") and "debug_stacks" in section.split("---- engine")[0]


def test_memory_phase_reads_cuda_peaks_when_cuda_is_in_use(monkeypatch):
    """No GPU here: torch.cuda's counters stubbed, the phase resets the peak at its start and reports it at the end."""
    import torch

    from lichen.observe.phases import PhaseTracker

    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: calls.append("reset"))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: calls.append("read") or 3 * 1024**3)
    phases = PhaseTracker()
    with phases.phase("train", 0, memory=True):
        assert calls == ["reset"]
    with phases.phase("reward", 0):  # not a memory phase: no counters touched
        pass
    got = phases.take_memory()
    assert calls == ["reset", "read"] and got["memory/train_cuda_max_allocated_gb"] == 3.0
    assert got["memory/train_peak_rss_gb"] > 0.01 and "memory/reward_peak_rss_gb" not in got
    assert phases.take_memory() == {}  # taken once


def test_a_memory_phase_starts_by_giving_freed_heap_back(tmp_path):
    """200 MB of 4 KB heap blocks, every 16th kept: freeing the rest leaves glibc holding the pages (they are
    not at the top of the heap); the next memory phase returns them, so its peak does not carry them."""
    script = tmp_path / "heap.py"
    script.write_text(
        "import json, sys\n"
        "from lichen.observe.phases import PhaseTracker\n"
        "def rss():\n"
        "    return int(next(l for l in open('/proc/self/status') if l.startswith('VmRSS:')).split()[1]) * 1024\n"
        "blocks = [bytearray(4000) for _ in range(50_000)]\n"
        "kept = blocks[::16]\n"
        "del blocks\n"
        "freed = rss()\n"
        "phases = PhaseTracker()\n"
        "with phases.phase('train', 0, memory=True):\n"
        "    inside = rss()\n"
        "json.dump({'freed': freed, 'inside': inside, 'mem': phases.take_memory()}, sys.stdout)\n"
    )
    got = json.loads(subprocess.run([sys.executable, str(script)], capture_output=True, check=True).stdout)
    mib = 2**20
    assert got["freed"] - got["inside"] >= 120 * mib, got
    assert got["mem"]["memory/train_peak_rss_gb"] * 1024**3 <= got["freed"] - 120 * mib, got


def test_a_process_keeps_its_lifetime_peak_across_phase_resets(tmp_path):
    """A phase's reset of VmHWM also lowers the kernel's lifetime peak (the ru_maxrss a parent's wait4 gets) to the
    last phase's: a 400 MB buffer in the first of two phases is gone from ru_maxrss, and lifetime_peak_rss_bytes
    (what `lichen bench rl` reports) keeps it."""
    script = tmp_path / "peaks.py"
    script.write_text(
        "import json, sys\n"
        "from lichen.observe.phases import PhaseTracker, lifetime_peak_rss_bytes, peak_rss_bytes\n"
        "phases = PhaseTracker()\n"
        "before = peak_rss_bytes()\n"
        "with phases.phase('generate', 0, memory=True):\n"
        "    buf = bytearray(400 * 2**20)\n"
        "    buf[:: 4096] = b'x' * len(buf[:: 4096])\n"  # touch every page
        "    del buf\n"
        "with phases.phase('train', 0, memory=True):\n"
        "    pass\n"
        "json.dump({'before': before, 'lifetime': lifetime_peak_rss_bytes(), 'mem': phases.take_memory()}, sys.stdout)\n"
    )
    # a launcher forks the script: a child forked straight from this (large) test process would start its
    # ru_maxrss at this process' size
    launcher = (
        "import os, subprocess, sys\n"
        "proc = subprocess.Popen([sys.executable, sys.argv[1]], stdout=subprocess.PIPE)\n"
        "out = proc.stdout.read()\n"
        "_, status, usage = os.wait4(proc.pid, 0)\n"
        "assert os.waitstatus_to_exitcode(status) == 0\n"
        "sys.stdout.write(out.decode()[:-1] + ', \"ru_maxrss_kib\": %d}' % usage.ru_maxrss)\n"
    )
    got = json.loads(
        subprocess.run([sys.executable, "-c", launcher, str(script)], capture_output=True, check=True).stdout
    )
    mib = 2**20
    assert got["lifetime"] >= got["before"] + 390 * mib
    assert got["mem"]["memory/generate_peak_rss_gb"] * 1024**3 >= got["before"] + 390 * mib
    assert got["ru_maxrss_kib"] * 1024 < got["before"] + 200 * mib  # the kernel's counter lost the first phase
