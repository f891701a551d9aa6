"""--runtime ray (lichen.cluster): what each actor sees on 8 declared GPUs, the flags, and a 3-step run with 2
trainer ranks + 2 engines against the same run's local structure.

The test process's shared Ray instance (tests/helpers/ray_local.py: 8 declared CPUs and GPUs, no dashboard, a
small object store); tests that need Ray skip only when it cannot be imported.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'lichen[ray]')")

from helpers.ray_local import shared_ray  # noqa: E402
from helpers.runs import base_args, read_dump, run  # noqa: E402
from helpers.sync_guard import assert_served_what_was_sent, record_checksums, record_ray_gets  # noqa: E402

from lichen.cli import main  # noqa: E402
from lichen.cluster.actor_group import RayTrainGroup  # noqa: E402
from lichen.cluster.engine_actors import RayEngineSet  # noqa: E402
from lichen.cluster.runtime import RayCluster  # noqa: E402
from lichen.config.cluster_config import ClusterConfig  # noqa: E402
from lichen.observe.sample_log import read_samples  # noqa: E402

pytestmark = pytest.mark.e2e  # see the marker in pyproject.toml: make test leaves it to make test-e2e


@pytest.fixture(scope="module")
def ray_local():
    shared_ray()
    yield


def _cfg(**kw) -> ClusterConfig:
    base = dict(
        ray_address=None,
        actor_num_nodes=1,
        actor_num_gpus_per_node=4,
        rollout_num_gpus=4,
        rollout_num_gpus_per_engine=1,
        colocate=False,
        debug_rollout_only=False,
        debug_train_only=False,
        external_engines=False,
        device="cpu",
        train_env_vars={"LICHEN_TEST_TRAIN": "1"},
    )
    return ClusterConfig(**{**base, **kw})


def _seen(cluster: RayCluster) -> tuple[list[dict], list[dict]]:
    trainers = RayTrainGroup(cluster, None, None, setup=False)
    engines = RayEngineSet(cluster, None)
    try:
        return trainers.where, engines.call_each("where")
    finally:
        for a in trainers.actors + engines.actors:
            ray.kill(a)


@pytest.mark.slow
def test_eight_declared_gpus_disaggregated_each_actor_sees_its_own(ray_local):
    cluster = RayCluster(_cfg())
    try:
        ranks, engines = _seen(cluster)
    finally:
        cluster.close()
    rank_gpus = [r["cuda_visible_devices"] for r in ranks]
    engine_gpus = [e["cuda_visible_devices"] for e in engines]
    assert sorted(rank_gpus + engine_gpus) == [str(i) for i in range(8)]  # one GPU each, none shared
    assert rank_gpus == [str(g) for g in cluster.gpu_ids((0, 1, 2, 3))]  # rank r on logical bundle r
    assert all(r["env"] == {"LICHEN_TEST_TRAIN": "1"} for r in ranks)  # --train-env-vars: trainer actors only
    assert all(e["env"] == {} for e in engines)


@pytest.mark.slow
def test_eight_declared_gpus_colocated_rank_and_engine_share_a_gpu(ray_local):
    cluster = RayCluster(
        _cfg(actor_num_gpus_per_node=8, rollout_num_gpus=8, rollout_num_gpus_per_engine=2, colocate=True)
    )
    try:
        ranks, engines = _seen(cluster)
    finally:
        cluster.close()
    assert sorted(r["cuda_visible_devices"] for r in ranks) == sorted(str(i) for i in range(8))
    assert cluster.placement.engines == ((0, 1), (2, 3), (4, 5), (6, 7))
    for i, e in enumerate(engines):  # the engine's actor sits on its first bundle, next to that bundle's rank
        assert e["cuda_visible_devices"] == ranks[2 * i]["cuda_visible_devices"]


@pytest.mark.slow
def test_offload_train_on_cuda_preloads_the_memory_saver_in_trainer_actors_only(ray_local, monkeypatch, tmp_path):
    """The hook's library is a stand-in (an empty file: the dynamic loader warns and ignores it); what is checked is
    the environment each actor starts with (lichen.cluster.train_env)."""
    lib = tmp_path / "torch_memory_saver_hook_mode_preload_cu12.abi3.so"
    lib.write_bytes(b"")
    monkeypatch.setattr("lichen.cluster.actor_group.memory_saver_hook", lambda: str(lib))
    cluster = RayCluster(
        _cfg(actor_num_gpus_per_node=2, rollout_num_gpus=2, colocate=True, device="cuda", offload_train=True)
    )
    try:
        ranks, engines = _seen(cluster)
    finally:
        cluster.close()
    for r in ranks:
        assert r["env"] == {
            "LICHEN_TEST_TRAIN": "1",
            "LD_PRELOAD": str(lib),
            "TMS_INIT_ENABLE": "1",
            "TMS_INIT_ENABLE_CPU_BACKUP": "1",
            "NCCL_CUMEM_ENABLE": "0",
        }
    assert all(e["env"] == {} for e in engines)  # engines: SGLang's own memory saver, through its flag


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--ray-address", "127.0.0.1:6379"], "--ray-address places Ray actors; add --runtime ray"),
        (["--runtime", "ray"], "--runtime ray: give --rollout-num-gpus R"),
        (["--runtime", "ray", "--rollout-num-gpus", "3", "--rollout-num-engines", "2"], "disagrees with"),
    ],
)
def test_ray_flags_are_checked(tiny_ckpt, addition_data, tmp_path, capsys, argv, message):
    assert main(base_args(tiny_ckpt, addition_data, tmp_path, "--dry-run", "--num-rollout", "1", *argv)) == 2
    assert message in capsys.readouterr().err


def test_ray_layout_resolves_engine_count(tiny_ckpt, addition_data, tmp_path, capsys):
    assert (
        main(
            base_args(
                tiny_ckpt,
                addition_data,
                tmp_path,
                "--dry-run",
                "--num-rollout",
                "1",
                "--runtime",
                "ray",
                "--actor-num-gpus-per-node",
                "2",
                "--rollout-num-gpus",
                "2",
            )
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "rollout_num_engines: 2" in out and "actor_num_gpus_per_node: 2" in out


BUCKET = 16 * 1024  # --update-weight-buffer-size of the run below: the tiny model is many buckets


@pytest.mark.slow
def test_three_step_ray_run_two_ranks_two_engines(ray_local, tiny_ckpt, addition_data, tmp_path, monkeypatch):
    """Also the driver-side guard of the weight sync (issue 27): every object the driver receives from Ray holds
    at most one bucket of tensors (the ranks send to the engines themselves), and every engine serves, after each
    sync, exactly the per-tensor checksums rank 0 sent; version 0 is the same list as the local run's."""
    served = {"local": record_checksums(monkeypatch)}
    common = ["--num-rollout", "3", "--device", "cpu", "--num-threads", "1", "--update-weight-buffer-size", str(BUCKET)]
    local = run(
        base_args(
            tiny_ckpt,
            addition_data,
            tmp_path / "local",
            *common,
            "--rollout-num-engines",
            "2",
            "--save",
            str(tmp_path / "local_ckpt"),
        )
    )
    monkeypatch.undo()
    served["ray"] = record_checksums(monkeypatch)
    received = record_ray_gets(monkeypatch, ray)
    rayrun = run(
        base_args(
            tiny_ckpt,
            addition_data,
            tmp_path / "ray",
            *common,
            "--runtime",
            "ray",
            "--actor-num-gpus-per-node",
            "2",
            "--rollout-num-gpus",
            "2",
            "--save",
            str(tmp_path / "ray_ckpt"),
        )
    )
    monkeypatch.undo()
    assert received and max(received) <= BUCKET, f"the driver received {max(received)} bytes of tensors at once"
    for name in ("local", "ray"):  # 4 syncs (versions 0..3), 2 engines each
        assert_served_what_was_sent(served[name], 4)
    first = {name: [got for v, _, _, got in served[name] if v == 0] for name in served}
    assert first["ray"] == first["local"] and first["ray"][0] == first["ray"][1]
    steps = [m for m in rayrun if "train/loss" in m]
    assert [m["step"] for m in steps] == [1, 2, 3]
    # the same metrics as the local run, plus each trainer rank's own memory (the local trainer is the driver)
    ray_keys = {k for m in steps for k in m}
    assert {k for m in local if "train/loss" in m for k in m} == {
        k for k in ray_keys if not k.startswith("memory/rank")
    }
    assert {"memory/rank0/train_peak_rss_gb", "memory/rank1/train_peak_rss_gb"} <= ray_keys
    assert [m["sync/weight_version"] for m in steps] == [1, 2, 3]
    mean_diff = sum(m["train/train_rollout_logprob_abs_diff"] for m in steps) / len(steps)
    assert mean_diff <= 1e-5
    assert os.path.isdir(tmp_path / "ray_ckpt" / "iter_0000002" / "hf")
    with open(tmp_path / "ray_ckpt" / "latest_checkpointed_iteration.txt") as f:
        assert f.read().strip() == "2"
    assert json.load(open(tmp_path / "ray" / "config.json"))["runtime"] == "ray"


# ---- an engine actor killed mid-rollout ------------------------------------------------------------------------
SEEN: dict = {}


def killing_actor_rollout(args, rollout_id, data_source, evaluation=False):
    """Step 0: kill engine 0's Ray actor (its server dies with it) while it has a request in flight. Step 1: record
    the engines' state."""
    import threading
    import time

    from lichen.rollout.context import current
    from lichen.rollout.generate import generate_rollout

    engines = current().engine
    if rollout_id == 0:

        def kill() -> None:
            end = time.monotonic() + 60
            while engines.clients[0].in_flight == 0 and time.monotonic() < end:
                time.sleep(0.0005)
            SEEN["in_flight_at_kill"] = engines.clients[0].in_flight
            ray.kill(engines.launcher.actors[0], no_restart=True)

        killer = threading.Thread(target=kill)
        killer.start()
        groups = generate_rollout(args, rollout_id, data_source)
        killer.join()
        SEEN["reissued_from"] = list(engines.router.reissued_from)
    else:
        SEEN["step1"] = {
            "in_rotation": engines.router.in_rotation(),
            "versions": engines.weight_versions(),
            "restarts": list(engines.monitor.restarts),
        }
        groups = generate_rollout(args, rollout_id, data_source)
    return groups


@pytest.mark.slow
def test_engine_actor_killed_mid_rollout_is_replaced_and_no_sample_is_lost(
    ray_local, tiny_ckpt, addition_data, tmp_path
):

    SEEN.clear()
    dump = str(tmp_path / "r_{rollout_id}.pt")
    run(
        base_args(
            tiny_ckpt,
            addition_data,
            tmp_path / "o",
            "--num-rollout",
            "2",
            "--device",
            "cpu",
            "--num-threads",
            "1",
            "--runtime",
            "ray",
            "--rollout-num-gpus",
            "2",
            "--update-weight-transport",
            "disk",
            "--update-weight-disk-dir",
            str(tmp_path / "w"),
            "--sglang-server-concurrency",
            "1",
            "--use-fault-tolerance",
            "--rollout-health-check-interval",
            "0.5",
            "--rollout-health-check-timeout",
            "5",
            "--rollout-health-check-first-wait",
            "0",
            "--rollout-function-path",
            "test_ray_runtime.killing_actor_rollout",
            "--save-debug-rollout-data",
            dump,
        )
    )
    assert SEEN["in_flight_at_kill"] >= 1 and SEEN["reissued_from"][0] >= 1  # engine 0's requests were re-sent
    for k in range(2):  # every group whole, no index twice
        groups = read_dump(dump.format(rollout_id=k))["samples"]
        assert [len(g) for g in groups] == [4, 4, 4, 4]
        assert sorted(s["index"] for g in groups for s in g) == list(range(16))
    step1 = SEEN["step1"]  # a new actor on the same bundle, back in rotation at the current version
    assert step1["in_rotation"] == [0, 1] and step1["versions"] == ["1", "1"] and step1["restarts"] == [1, 0]


_DRIVER_WRITES: list[str] | None = None  # while a list: paths the driver process opened for writing or renamed to


def _record_driver_writes(event: str, args: tuple) -> None:
    """An audit hook (sys.addaudithook; it cannot be removed, so it records only while _DRIVER_WRITES is a list).
    Ray's actors are other processes: this sees the driver's own file writes only."""
    if _DRIVER_WRITES is None:
        return
    if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        mode, flags = args[1], args[2]
        writes = any(c in mode for c in "wax+") if isinstance(mode, str) else bool(flags & (os.O_WRONLY | os.O_RDWR))
        if writes:
            _DRIVER_WRITES.append(os.fsdecode(args[0]))
    elif event == "os.rename":
        _DRIVER_WRITES.append(os.fsdecode(args[1]))


@pytest.mark.slow
def test_ray_run_saved_on_two_ranks_resumes_on_one(ray_local, tiny_ckpt, addition_data, tmp_path):
    """Also (issue 27 item 4) one checkpoint writer: the driver writes no file under iter_*/dist/ or hf/, and its
    own files in the order rollout_state.json, meta.json (world_size kept), checksums.json, `latest`; the sample
    log has the ranks' per-token values; (item 6) each rank's and the engine's peak memory per phase."""
    global _DRIVER_WRITES
    common = [
        "--device",
        "cpu",
        "--num-threads",
        "1",
        "--runtime",
        "ray",
        "--rollout-num-gpus",
        "1",
        "--save",
        str(tmp_path / "ckpt"),
    ]
    sys.addaudithook(_record_driver_writes)
    _DRIVER_WRITES = []
    try:
        first = run(
            base_args(
                tiny_ckpt,
                addition_data,
                tmp_path / "a",
                "--num-rollout",
                "2",
                "--actor-num-gpus-per-node",
                "2",
                *common,
            )
        )
        written = [os.path.relpath(p, tmp_path / "ckpt") for p in _DRIVER_WRITES]
    finally:
        _DRIVER_WRITES = None
    mine = [p for p in written if not p.startswith("..")]
    assert not [p for p in mine if p.split("/")[1:2] in (["dist"], ["hf"])], mine  # the ranks' files only
    names = [
        p.split("/")[-1] for p in mine if p.startswith("iter_0000001/") or p == "latest_checkpointed_iteration.txt"
    ]
    assert [n for n in names if ".tmp-" not in n] == [
        "rollout_state.json",
        "meta.json",
        "checksums.json",
        "latest_checkpointed_iteration.txt",
    ], names
    with open(tmp_path / "ckpt" / "iter_0000001" / "meta.json") as f:
        assert json.load(f) == {"rollout_id": 1, "weight_version": "2", "world_size": 2}
    logged = read_samples(str(tmp_path / "a"))
    assert logged and all(r["advantages"] is not None and r["trainer_log_probs"] is not None for r in logged)
    assert all(len(r["advantages"]) == len(r["trainer_log_probs"]) == r["response_length"] for r in logged)
    steps = [m for m in first if "train/loss" in m]
    for phase in ("generate", "train", "sync"):  # every rank's own peak, beside the driver's
        for who in ("rank0", "rank1", "engine0"):
            assert 0.05 < steps[-1][f"memory/{who}/{phase}_peak_rss_gb"] < 64, (who, phase)
    assert 0.05 < steps[-1]["memory/rank0/save_peak_rss_gb"] < 64
    resumed = run(
        base_args(
            tiny_ckpt, addition_data, tmp_path / "b", "--num-rollout", "3", *common, "--load", str(tmp_path / "ckpt")
        )
    )
    steps = [m for m in resumed if "train/loss" in m]
    assert [m["step"] for m in steps] == [3]  # only the step after the checkpoint of step 2
    assert steps[0]["sync/weight_version"] == 3
    with open(tmp_path / "ckpt" / "latest_checkpointed_iteration.txt") as f:
        assert f.read().strip() == "2"
