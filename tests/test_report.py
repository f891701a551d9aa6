"""`lichen report` on a real 5-step run, opened in headless Chromium; the run's sample log, trace and memory
metrics (issue 20)."""

from __future__ import annotations

import asyncio
import gzip
import json
import os

import pytest
from helpers import chromium
from helpers.runs import base_args, run

STEPS = 5


@pytest.fixture(scope="module")
def run_dir(tiny_ckpt, addition_data, tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("report_run")
    run(
        base_args(
            tiny_ckpt,
            addition_data,
            out,
            "--num-rollout",
            str(STEPS),
            "--log-samples",
            "6",
            "--trace",
            "--save",
            str(out / "ckpt"),
            "--save-interval",
            "2",
            "--eval-prompt-data",
            "held",
            f"{addition_data}@[0:4]",
            "--eval-interval",
            "2",
            "--eval-max-response-len",
            "4",
        )
    )
    return str(out)


@pytest.fixture(scope="module")
def report(run_dir) -> str:
    from lichen.cli import main

    page = os.path.join(run_dir, "page", "report.html")  # -o into a directory that does not exist yet
    assert main(["report", run_dir, "-o", page]) == 0
    return page


def test_sample_log_holds_n_samples_per_step_with_their_tokens(run_dir):
    from lichen.observe.sample_log import read_samples

    rows = read_samples(run_dir)
    assert sorted({r["step"] for r in rows}) == list(range(1, STEPS + 1))  # the step numbers of metrics.jsonl
    for step in range(1, STEPS + 1):
        mine = [r for r in rows if r["step"] == step]
        assert len(mine) == 6
        assert [r["group_index"] for r in mine] == [0, 0, 0, 0, 1, 1]  # whole groups first
    for r in rows:
        n = r["response_length"]
        assert len(r["tokens"]) == len(r["token_texts"]) == len(r["rollout_log_probs"]) == n > 0
        assert len(r["trainer_log_probs"]) == len(r["advantages"]) == n
        # the engine and the trainer run the same model code: their log-probs agree closely
        assert max(abs(a - b) for a, b in zip(r["rollout_log_probs"], r["trainer_log_probs"])) < 1e-3
        assert r["status"] in ("completed", "truncated") and r["weight_versions"] == [str(r["step"] - 1)]
        assert isinstance(r["reward"], float) and r["prompt"] and all(isinstance(t, str) for t in r["token_texts"])
    # group-normalised advantages: a group whose rewards differ has advantages of both signs
    assert any(min(r["advantages"]) < 0 for r in rows) and any(max(r["advantages"]) > 0 for r in rows)


def test_sample_log_is_bounded_and_zero_turns_it_off(tmp_path):
    from lichen.observe.sample_log import MAX_TEXT, SampleLog, read_samples
    from lichen.types import Sample

    groups = [
        [
            Sample(
                prompt="p" * 10_000,
                tokens=[1, 2, 3],
                response="r",
                response_length=2,
                reward=1.0,
                group_index=g,
                index=g * 3 + j,
            )
            for j in range(3)
        ]
        for g in range(4)
    ]
    assert SampleLog(str(tmp_path), 0).write(1, groups) is None
    assert read_samples(str(tmp_path)) == []
    SampleLog(str(tmp_path), 5).write(1, groups)
    rows = read_samples(str(tmp_path))
    assert [(r["group_index"], r["index"]) for r in rows] == [(0, 0), (0, 1), (0, 2), (1, 3), (1, 4)]
    assert len(rows[0]["prompt"]) < MAX_TEXT + 100 and rows[0]["tokens"] == [2, 3]


def test_memory_per_phase_is_in_the_metrics(run_dir):
    from lichen.observe import read_metrics

    rows = [m for m in read_metrics(run_dir) if m["step"] > 0]
    assert len(rows) == STEPS
    for m in rows:
        for ph in ("generate", "train", "sync"):
            assert 0.05 < m[f"memory/{ph}_peak_rss_gb"] < 64, (ph, m)
    assert sum("memory/save_peak_rss_gb" in m for m in rows) == 3  # steps 2, 4 and the last one saved
    assert "time/save" in rows[1]


def test_trace_has_one_slice_per_phase_per_step(run_dir):
    with open(os.path.join(run_dir, "trace.json")) as f:
        trace = json.load(f)
    events = trace["traceEvents"]
    slices = [e for e in events if e["ph"] == "X"]
    # the fields Perfetto's JSON importer reads for complete events, with their types
    for e in slices:
        assert isinstance(e["name"], str) and isinstance(e["pid"], int) and isinstance(e["tid"], int)
        assert isinstance(e["ts"], (int, float)) and isinstance(e["dur"], (int, float)) and e["dur"] > 0
        assert e["ts"] >= 0 and isinstance(e["args"], dict)  # microseconds since the run started
    assert {e["name"] for e in events if e["ph"] == "M"} == {"process_name", "thread_name"}
    per = {}
    for e in slices:
        per.setdefault((e["name"], e["args"].get("rollout_id")), []).append(e)
    from lichen.observe import read_metrics

    step_s = {m["step"]: m["time/step"] for m in read_metrics(run_dir) if m["step"] > 0}
    for rid in range(STEPS):
        for name in ("generate", "train", "sync"):
            assert len(per[(name, rid)]) == 1, (name, rid)
            # each phase of a step takes time, and less than the step's wall time (metrics' step rid + 1)
            assert 0 < per[(name, rid)][0]["dur"] < step_s[rid + 1] * 1e6, (name, rid)
        # the reward phase nests in generate (and, at eval steps, once more in eval)
        for outer in ("generate", "eval"):
            if (outer, rid) in per:
                o = per[(outer, rid)][0]
                inside = [
                    r for r in per[("reward", rid)] if o["ts"] <= r["ts"] <= r["ts"] + r["dur"] <= o["ts"] + o["dur"]
                ]
                assert len(inside) == 1, (outer, rid)
    assert sorted(rid for (name, rid) in per if name == "save") == [1, 3, 4]
    assert sorted(rid for (name, rid) in per if name == "eval") == [-1, 1, 3, 4]  # before training, then due steps


def test_report_errors_are_one_line(tmp_path, capsys):
    from lichen.cli import main

    assert main(["report", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("lichen report: error: ") and "is not a directory" in err and "\n" not in err
    assert main(["report", str(tmp_path)]) == 2
    assert "holds no metrics.jsonl" in capsys.readouterr().err


def test_negative_observe_flags_are_one_line_errors(tiny_ckpt, addition_data, tmp_path, capsys):
    from lichen.cli import main

    for flag, value, says in (
        ("--log-samples", "-1", "--log-samples: must be 0 (off) or a positive number"),
        ("--watchdog-timeout", "-5", "--watchdog-timeout: must be 0 (off) or a positive"),
    ):
        assert main(base_args(tiny_ckpt, addition_data, tmp_path / "r", "--num-rollout", "1", flag, value)) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("lichen train: error: " + says) and "\n" not in err, err


def test_report_is_self_contained(report, run_dir):
    html = open(report, encoding="utf-8").read()
    assert "http://" not in html.replace("http://www.w3.org/2000/svg", "") and "https://" not in html
    assert "<script src" not in html and "<link" not in html
    # a sample text cannot end the data element early
    assert html.count("</script>") == 2


@pytest.mark.skipif(
    not chromium.available(),
    reason="Debian's chromium is not installed (scripts/setup.sh test "
    "installs it when run as root with apt-get); the browser test of the report cannot run",
)
def test_report_opens_in_headless_chromium(report, run_dir):
    asyncio.run(_check_page(report, run_dir))


async def _check_page(report: str, run_dir: str) -> None:
    from lichen.observe.sample_log import read_samples

    samples = read_samples(run_dir)
    async with chromium.Browser() as page:
        await page.goto("file://" + report)
        assert page.errors == []
        # every curve has as many points as steps logged
        counts = await page.js("""Object.fromEntries([...document.querySelectorAll('g.series')].map(
            g => [g.dataset.metric, g.querySelectorAll('circle.pt').length]))""")
        for key in (
            "rollout/reward_mean",
            "rollout/response_length_mean",
            "train/loss",
            "train/ppo_kl",
            "train/pg_clipfrac",
            "train/train_rollout_logprob_abs_diff",
            "train/grad_norm",
            "train/lr",
            "memory/train_peak_rss_gb",
        ):
            assert counts[key] == STEPS, (key, counts)
        assert counts["eval/held/reward_mean"] == 4  # before training and at steps 2, 4, 5
        assert await page.js("document.querySelectorAll('svg.phases rect.bar.generate').length") == STEPS
        # the timeline (from trace.json): one generate slice per step, plus the eval before training
        assert await page.js("document.querySelectorAll('svg.timeline rect.slice.generate').length") == STEPS
        assert await page.js("document.querySelectorAll('svg.timeline rect.slice.eval').length") == 4
        # the sample browser's filters change the visible rows
        visible = "[...document.querySelectorAll('tr.sample-row')].filter(r => !r.hidden).length"
        assert await page.js(visible) == len(samples)
        await page.js("""(() => { const s = document.getElementById('f-step'); s.value = '3';
            s.dispatchEvent(new Event('input')); })()""")
        assert await page.js(visible) == sum(s["step"] == 3 for s in samples) == 6
        needle = samples[-1]["prompt"]
        await page.js(f"""(() => {{ document.getElementById('f-step').value = '';
            const q = document.getElementById('f-text'); q.value = {json.dumps(needle)};
            q.dispatchEvent(new Event('input')); }})()""")
        want = sum(needle.lower() in (s["prompt"] + s["response"] + str(s["label"])).lower() for s in samples)
        assert 0 < await page.js(visible) == want < len(samples)
        # a row's tokens, coloured
        await page.js("document.querySelector('tr.sample-row:not([hidden])').click()")
        assert (
            await page.js("document.querySelectorAll('#sample-detail .tok').length")
            == next(s for s in samples if needle in s["prompt"])["response_length"]
        )
        assert page.errors == []
        png = await page.screenshot()
        assert png[:8] == b"\x89PNG\r\n\x1a\n"
        # non-blank: decoded in the browser itself, the screenshot holds many colours
        colours = await page.js(f"""new Promise(done => {{ const img = new Image();
            img.onload = () => {{ const c = document.createElement('canvas'); c.width = img.width;
              c.height = img.height; const g = c.getContext('2d'); g.drawImage(img, 0, 0);
              const px = g.getImageData(0, 0, c.width, c.height).data; const seen = new Set();
              for (let i = 0; i < px.length; i += 4) seen.add((px[i] << 16) | (px[i + 1] << 8) | px[i + 2]);
              done(seen.size); }};
            img.src = 'data:image/png;base64,{__import__("base64").b64encode(png).decode()}'; }})""")
        assert colours > 20, colours


def test_report_of_a_run_still_writing(run_dir, tmp_path):
    """A torn last metrics line and a sample file half written are what a run leaves mid-step: the page is made
    from what is complete."""
    import shutil

    from lichen.cli import main
    from lichen.observe.report.data import collect

    live = tmp_path / "live"
    shutil.copytree(run_dir, live)
    with open(live / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "rollout/rew')
    (live / "samples" / "step_000006.jsonl.gz").write_bytes(gzip.compress(b'{"step": 6}\n')[:12])
    data = collect(str(live))
    assert [m["step"] for m in data["metrics"]][-1] == STEPS
    assert max(s["step"] for s in data["samples"]) == STEPS
    assert main(["report", str(live)]) == 0 and (live / "report.html").stat().st_size > 10_000


@pytest.mark.slow
def test_trace_holds_the_engine_servers_phases(tiny_ckpt, addition_data, tmp_path):
    """With launched `lichen serve` engines the trace has a process per server: its busy periods (labelled with
    the rollout they served) and its weight updates. The metrics hold the server's own peak memory per phase."""
    out = tmp_path / "r"
    rows = run(base_args(tiny_ckpt, addition_data, out, "--num-rollout", "2", "--trace", "--rollout-num-engines", "1"))
    for m in [m for m in rows if m["step"] > 0]:
        for ph in ("generate", "train", "sync"):
            assert 0.05 < m[f"memory/engine0/{ph}_peak_rss_gb"] < 64, (ph, m)
        # the server is another process: its peak differs from the driver's (which holds the trainer too)
        assert m["memory/engine0/train_peak_rss_gb"] != m["memory/train_peak_rss_gb"]
    with open(out / "trace.json") as f:
        events = json.load(f)["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    (driver,) = [p for p, n in names.items() if n.startswith("lichen train")]
    (engine,) = [p for p, n in names.items() if n.startswith("lichen serve http://127.0.0.1:")]
    assert engine != driver == os.getpid()
    served = [e for e in events if e["pid"] == engine and e["ph"] == "X"]
    assert {e["args"].get("rollout_id") for e in served if e["name"] == "generate"} >= {0, 1}
    assert sum(e["name"] == "update weights" for e in served) >= 2  # the syncs after steps 0 and 1
    gen = {e["args"]["rollout_id"]: e for e in events if e["pid"] == driver and e["name"] == "generate"}
    for e in served:  # the engine's busy periods lie inside the driver's generate of the same rollout
        if e["name"] == "generate":
            g = gen[e["args"]["rollout_id"]]
            assert g["ts"] <= e["ts"] and e["ts"] + e["dur"] <= g["ts"] + g["dur"] + 1e5  # 0.1 s for the answer


def test_timeline_keeps_the_last_rollouts_and_unlabelled_slices_among_them(tmp_path):
    from lichen.observe.report.data import _timeline
    from lichen.observe.trace import write_trace

    def x(name, rid, ts, dur, pid=1):
        return {
            "name": name,
            "ph": "X",
            "pid": pid,
            "tid": 7,
            "ts": ts,
            "dur": dur,
            "args": {} if rid is None else {"rollout_id": rid},
        }

    events = [x("generate", r, r * 100, 40) for r in range(30)] + [
        x("generate", None, 2920, 30, pid=2),  # an engine busy within the window, no rollout label
        x("generate", None, 50, 30, pid=2),  # one long before the window
        {"name": "thread_name", "ph": "M", "pid": 1, "tid": 7, "args": {"name": "MainThread"}},
    ]
    write_trace(str(tmp_path / "trace.json"), events)
    tl = _timeline(str(tmp_path), last_steps=20)
    assert sorted({s["rollout_id"] for s in tl["slices"]} - {None}) == list(range(10, 30))
    assert [s["ts"] for s in tl["slices"] if s["rollout_id"] is None] == [2920]
    assert tl["lanes"] == ["MainThread", "thread 7"]
