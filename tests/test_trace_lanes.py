"""--trace over every process of a run (issue 20): a Ray run with 2 trainer ranks, 2 `lichen serve` engines and a
remote reward model gives one process lane each, with the slices each did; the sample log names the engine of
every sample and the report's sample browser filters by it. One run, since a Ray run is slow on this machine."""

from __future__ import annotations

import asyncio
import json
import os
import re

import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'lichen[ray]')")

from helpers import chromium  # noqa: E402
from helpers.ray_local import shared_ray  # noqa: E402
from helpers.reward_server import RewardServer  # noqa: E402
from helpers.runs import base_args, ray_args, run  # noqa: E402

pytestmark = pytest.mark.e2e  # see the marker in pyproject.toml: make test leaves it to make test-e2e

STEPS = 2
SAMPLES = 16  # --rollout-batch-size 4 x --n-samples-per-prompt 4 (helpers.runs.base_args)


@pytest.fixture(scope="module")
def run_dir(tiny_ckpt, addition_data, tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("lanes")
    shared_ray()
    with RewardServer() as rm:
        argv = base_args(
            tiny_ckpt,
            addition_data,
            out,
            "--num-rollout",
            str(STEPS),
            *ray_args(2, 2),
            "--rm-type",
            "remote_rm",
            "--rm-url",
            rm.url,
            "--trace",
            "--log-samples",
            str(SAMPLES),
        )
        k = argv.index("--custom-rm-path")  # the remote reward model instead
        run(argv[:k] + argv[k + 2 :])
        assert len(rm.requests) == STEPS * SAMPLES
    return str(out)


def check_perfetto_fields(events: list[dict]) -> None:
    """The fields Perfetto's JSON importer reads, with their types: complete events ("X") and metadata ("M")."""
    for e in events:
        assert e["ph"] in ("X", "M") and isinstance(e["name"], str)
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int) and isinstance(e["args"], dict)
        if e["ph"] == "X":
            assert isinstance(e["ts"], (int, float)) and isinstance(e["dur"], (int, float))
            assert e["ts"] >= 0 and e["dur"] > 0  # microseconds since the run started; every phase took time
        else:
            assert e["name"] in ("process_name", "thread_name") and isinstance(e["args"]["name"], str)


def _inside(inner: dict, outer: dict, slack_us: float = 1e5) -> bool:
    return outer["ts"] - slack_us <= inner["ts"] and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"] + slack_us


@pytest.mark.slow
def test_one_lane_per_process_with_its_slices(run_dir):
    with open(os.path.join(run_dir, "trace.json")) as f:
        events = json.load(f)["traceEvents"]
    check_perfetto_fields(events)
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert len(names) == len(set(names.values())) == 6, names  # one pid per process, each named once
    lanes = {pid: [e for e in events if e["pid"] == pid and e["ph"] == "X"] for pid in names}
    by_name = {n: pid for pid, n in names.items()}
    driver = by_name.pop("lichen train (driver)")
    ranks = [by_name.pop(f"trainer rank {r} (Ray actor)") for r in range(2)]
    engines = sorted(n for n in by_name if n.startswith("lichen serve "))
    (rm,) = [n for n in by_name if n.startswith("reward server http://127.0.0.1:")]
    assert len(engines) == 2 and len({driver, *ranks, *(by_name[n] for n in engines)}) == 5
    for pid in names:  # every thread a slice is on is named
        threads = {e["tid"] for e in events if e["pid"] == pid and e["name"] == "thread_name"}
        assert {e["tid"] for e in lanes[pid]} <= threads
    driver_phase = {(e["name"], e["args"]["rollout_id"]): e for e in lanes[driver] if e["name"] != "reward"}
    for rid in range(STEPS):
        for name in ("generate", "train", "sync"):
            assert (name, rid) in driver_phase
    # each rank trains every step, inside the driver's train phase, and sends the weights (its part of the gathers) at each sync
    for pid in ranks:
        train = [e for e in lanes[pid] if e["name"] == "train"]
        assert sorted(e["args"]["rollout_id"] for e in train) == list(range(STEPS))
        assert all(_inside(e, driver_phase[("train", e["args"]["rollout_id"])]) for e in train)
        gathers = [e for e in lanes[pid] if e["name"] == "sync_weights"]
        assert len(gathers) >= STEPS
        assert all(_inside(e, driver_phase[("sync", e["args"]["rollout_id"])]) for e in gathers)
    # each engine served in every step's generate and took every weight update
    for n in engines:
        served = [e for e in lanes[by_name[n]] if e["name"] == "generate"]
        assert {e["args"]["rollout_id"] for e in served} == set(range(STEPS))
        assert all(_inside(e, driver_phase[("generate", e["args"]["rollout_id"])]) for e in served)
        assert sum(e["name"] == "update weights" for e in lanes[by_name[n]]) >= STEPS
    # the reward server's lane: one slice per request, inside the driver's reward phase of its rollout; requests
    # that overlap in time are on different threads (slices on one thread must nest)
    reqs = lanes[by_name[rm]]
    assert len(reqs) == STEPS * SAMPLES and {e["name"] for e in reqs} == {"reward request"}
    reward = {e["args"]["rollout_id"]: e for e in lanes[driver] if e["name"] == "reward"}
    assert all(_inside(e, reward[e["args"]["rollout_id"]], slack_us=0) for e in reqs)
    for tid in {e["tid"] for e in reqs}:
        mine = sorted((e for e in reqs if e["tid"] == tid), key=lambda e: e["ts"])
        assert all(a["ts"] + a["dur"] <= b["ts"] for a, b in zip(mine, mine[1:]))


def test_sample_log_names_each_samples_engine(run_dir):
    from lichen.observe.sample_log import read_samples

    with open(os.path.join(run_dir, "trace.json")) as f:
        names = [e["args"]["name"] for e in json.load(f)["traceEvents"] if e["name"] == "process_name"]
    urls = {n.removeprefix("lichen serve ") for n in names if n.startswith("lichen serve ")}
    rows = read_samples(run_dir)
    assert len(rows) == STEPS * SAMPLES
    assert {r["engine"] for r in rows} == urls and all(re.fullmatch(r"http://127\.0\.0\.1:\d+", u) for u in urls)


@pytest.mark.skipif(
    not chromium.available(),
    reason="Debian's chromium is not installed (scripts/setup.sh test "
    "installs it when run as root with apt-get); the browser test of the report cannot run",
)
def test_sample_browser_shows_and_filters_by_engine(run_dir):
    from lichen.cli import main
    from lichen.observe.sample_log import read_samples

    assert main(["report", run_dir]) == 0
    rows = read_samples(run_dir)
    url = sorted({r["engine"] for r in rows})[0]

    async def check() -> None:
        async with chromium.Browser() as page:
            await page.goto("file://" + os.path.join(run_dir, "report.html"))
            visible = "[...document.querySelectorAll('tr.sample-row')].filter(r => !r.hidden)"
            cells = await page.js(f"{visible}.map(r => r.querySelector('td.engine').textContent)")
            assert sorted(cells) == sorted(r["engine"].removeprefix("http://") for r in rows)
            await page.js(f"""(() => {{ const s = document.getElementById('f-engine'); s.value = {json.dumps(url)};
                s.dispatchEvent(new Event('input')); }})()""")
            assert await page.js(f"{visible}.length") == sum(r["engine"] == url for r in rows) < len(rows)
            await page.js(f"{visible}[0].click()")
            assert f"engine {url}" in await page.js("document.querySelector('#sample-detail .meta').textContent")
            assert page.errors == []

    asyncio.run(check())


def test_overlapping_requests_to_a_service_get_their_own_threads():
    """Slices on one thread must nest; requests to a service overlap without nesting, so each goes on the first
    request slot free at its start."""
    from lichen.observe.phases import PhaseRecord
    from lichen.observe.trace import REMOTE_ARG, remote_lanes

    def rec(start: float, end: float, **args) -> PhaseRecord:
        return PhaseRecord("reward request", 3, start, 99, "MainThread", args, end)

    svc = {REMOTE_ARG: "reward server http://h/r"}
    own, remote = remote_lanes([rec(0, 10), rec(1, 4, **svc), rec(2, 6, **svc), rec(5, 7, **svc), rec(6, 9, **svc)])
    assert [(r.start, r.end) for r in own] == [(0, 10)]
    placed = remote["reward server http://h/r"]
    assert [(r.start, r.thread_id) for r in placed] == [(1, 1), (2, 2), (5, 1), (6, 2)]
    assert all(REMOTE_ARG not in r.args and r.step == 3 for r in placed)
