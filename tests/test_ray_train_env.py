"""torch_memory_saver's preload hook in the trainer actors' runtime_env (lichen.cluster.train_env) and the ranks'
offload through it (lichen.train.memory_saver): what is built and called, checked on CPU with stand-ins for the
package. What the hook does on a GPU is untested here (docs/runtimes.md)."""

from __future__ import annotations

import sys
import types

import pytest

from lichen.cluster.actor_group import _memory_saver_lib
from lichen.cluster.train_env import memory_saver_hook, train_runtime_env
from lichen.config.cluster_config import ClusterConfig
from lichen.errors import ConfigError
from lichen.train import memory_saver
from lichen.train.dist_trainer import DistTrainer
from lichen.train.memory_saver import memory_saver_active

pytestmark = pytest.mark.e2e  # see the marker in pyproject.toml: make test leaves it to make test-e2e

LIB = "/site-packages/torch_memory_saver_hook_mode_preload_cu12.abi3.so"


def test_without_the_hook_only_the_users_variables():
    assert train_runtime_env({}) == {}
    assert train_runtime_env({"A": "1"}) == {"env_vars": {"A": "1"}}


def test_the_hook_is_preloaded_with_slimes_variables():
    assert train_runtime_env({"A": "1"}, LIB) == {
        "env_vars": {
            "A": "1",
            "LD_PRELOAD": LIB,
            "TMS_INIT_ENABLE": "1",
            "TMS_INIT_ENABLE_CPU_BACKUP": "1",
            "NCCL_CUMEM_ENABLE": "0",
        }
    }


def test_the_users_preload_and_choices_are_kept():
    env = train_runtime_env({"LD_PRELOAD": "/opt/mine.so", "TMS_INIT_ENABLE_CPU_BACKUP": "0"}, LIB)["env_vars"]
    assert env["LD_PRELOAD"] == f"{LIB}:/opt/mine.so"  # the hook first; torch_memory_saver splits on ':'
    assert env["TMS_INIT_ENABLE_CPU_BACKUP"] == "0"


def test_a_rank_knows_it_was_started_with_the_hook():
    assert memory_saver_active(train_runtime_env({}, LIB)["env_vars"])
    assert not memory_saver_active({})
    assert not memory_saver_active({"LD_PRELOAD": LIB})  # the hook without TMS_INIT_ENABLE saves nothing
    assert not memory_saver_active({"LD_PRELOAD": "/opt/other.so", "TMS_INIT_ENABLE": "1"})


def _fake_package(monkeypatch, find) -> None:
    pkg, utils = types.ModuleType("torch_memory_saver"), types.ModuleType("torch_memory_saver.utils")
    utils.get_binary_path_from_package = find
    pkg.utils = utils
    monkeypatch.setitem(sys.modules, "torch_memory_saver", pkg)
    monkeypatch.setitem(sys.modules, "torch_memory_saver.utils", utils)


def test_the_library_is_found_through_the_package(monkeypatch):
    _fake_package(monkeypatch, lambda stem: f"/site-packages/{stem}_cu12.abi3.so")
    assert memory_saver_hook() == LIB


def test_a_missing_package_or_library_is_one_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_memory_saver.utils", None)  # import fails
    with pytest.raises(ConfigError, match=r"torch_memory_saver, which is not installed: pip install 'lichen\[gpu\]'"):
        memory_saver_hook()

    def no_cuda(stem):
        raise RuntimeError("torch_memory_saver: could not detect CUDA runtime")

    _fake_package(monkeypatch, no_cuda)
    with pytest.raises(ConfigError, match="no torch_memory_saver_hook_mode_preload library .*could not detect CUDA"):
        memory_saver_hook()


def _ccfg(**kw) -> ClusterConfig:
    base = dict(
        ray_address=None,
        actor_num_nodes=1,
        actor_num_gpus_per_node=2,
        rollout_num_gpus=2,
        rollout_num_gpus_per_engine=1,
        colocate=True,
        debug_rollout_only=False,
        debug_train_only=False,
        external_engines=False,
        device="cuda",
        offload_train=True,
    )
    return ClusterConfig(**{**base, **kw})


def test_the_hook_goes_in_only_with_offload_train_on_cuda(monkeypatch):
    _fake_package(monkeypatch, lambda stem: f"/site-packages/{stem}_cu12.abi3.so")
    assert _memory_saver_lib(_ccfg()) == LIB
    assert _memory_saver_lib(_ccfg(offload_train=False)) is None
    assert _memory_saver_lib(_ccfg(device="cpu")) is None


class _Actor:
    def __init__(self):
        self.calls = []

    def offload(self):
        self.calls.append("actor.offload")

    def onload(self):
        self.calls.append("actor.onload")


def _rank(monkeypatch, environ: dict) -> tuple[DistTrainer, list]:
    """A DistTrainer without a process group: only its offload/onload are called."""
    rank = object.__new__(DistTrainer)
    rank.actor = _Actor()
    # the library's calls recorded (tests/test_memory_saver.py checks their order against the loop's)
    monkeypatch.setattr(memory_saver, "LibraryBackend", lambda: memory_saver.RecordingBackend(rank.actor.calls))
    for k in ("LD_PRELOAD", "TMS_INIT_ENABLE"):
        monkeypatch.delenv(k, raising=False)
    for k, v in environ.items():
        monkeypatch.setenv(k, v)
    rank.memory = memory_saver.for_this_process()  # as DistTrainer.__init__ makes it
    return rank, rank.actor.calls


def test_a_rank_with_the_hook_pauses_and_resumes_through_it(monkeypatch):
    rank, calls = _rank(monkeypatch, train_runtime_env({}, LIB)["env_vars"])
    rank.offload()
    rank.onload()
    assert calls == [
        "synchronize",
        "pause(default)",
        "pause(optimizer)",
        "pause(weights)",
        "resume(weights)",
        "resume(optimizer)",
        "resume(default)",
    ]


def test_a_rank_without_the_hook_offloads_its_shards_as_before(monkeypatch):
    rank, calls = _rank(monkeypatch, {})
    rank.offload()
    rank.onload()
    assert calls == ["actor.offload", "actor.onload"]
