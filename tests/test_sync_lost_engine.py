"""A sync that loses an engine mid-call checks the engines still serving and does not crash on the lost one.

With failover, `RemoteEngines._each` answers None for an engine it could not reach and takes it out of rotation
(it re-joins at a later sync; tests/test_fault_tolerance.py drives that with real servers). Every reader of those
answers in the sync must skip the None: the checksum verify, the delta pull's byte count and vLLM's dtype and
checksum reads. Here a stub engine set answers None for the first engine and real answers for the second; the
second's answers are right, then wrong, so the check is seen to run on it."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lichen.sync.verify import WeightMismatchError, answered, expected_checksums, verify_engines
from lichen.weights.wire import CHECKSUM_FORMAT

URLS = ["http://127.0.0.1:1", "http://127.0.0.1:2"]


class LostFirst:
    """Two engines in rotation; the first was lost during every call (None), the second answers `answer(path)`."""

    def __init__(self, answer):
        self.answer = answer
        self.calls: list[str] = []

    def active_urls(self) -> list[str]:
        return list(URLS)

    def post_each(self, path: str, body: Any, **_: Any) -> list[Any]:
        self.calls.append(path)
        return [None, self.answer(path, body)]


def weights() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [("a.weight", torch.randn(4, 3, generator=g)), ("b.weight", torch.randn(5, generator=g))]


def checker_body(sums: dict[str, str]) -> dict:
    return {"checksum_format": CHECKSUM_FORMAT, "ranks": [{"checksums": sums}]}


def test_answered_keeps_the_engines_that_answered_in_order():
    assert answered(["u0", "u1", "u2"], [None, {"x": 1}, {"y": 2}]) == (["u1", "u2"], [{"x": 1}, {"y": 2}])
    assert answered(["u0"], [{"x": 1}]) == (["u0"], [{"x": 1}])


@pytest.mark.parametrize("method", ["auto", "checksum"])
def test_the_checksum_verify_checks_the_engine_still_serving(method):
    want = expected_checksums(weights(), torch.float32)
    engines = LostFirst(lambda path, body: checker_body(want))
    out = verify_engines(engines, weights, torch.float32, version=3, method=method)
    assert out["sync/verified_tensors"] == len(want)  # one engine checked: the lost one has no entry
    wrong = dict(want, **{"b.weight": "0" * 32})
    engines = LostFirst(lambda path, body: checker_body(wrong))
    with pytest.raises(WeightMismatchError, match=r"127\.0\.0\.1:2.*b\.weight|b\.weight.*127\.0\.0\.1:2"):
        verify_engines(engines, weights, torch.float32, version=3, method=method)


def test_the_delta_sync_counts_the_bytes_the_answering_engines_read(tmp_path):
    from lichen.sync.disk_delta import DeltaSync

    class Engines(LostFirst):
        def update_weights_from_disk(self, path: str, version: str) -> None:
            self.calls.append("/update_weights_from_disk")

    engines = Engines(lambda path, body: {"success": True, "bytes_read": 1234})
    sync = DeltaSync(engines, disk_dir=str(tmp_path / "pub"), local_dir=str(tmp_path / "local"))
    metrics = sync._deliver(1, {}, 0.0)
    assert metrics["sync/bytes_read"] == 1234
    assert engines.calls == ["/pull_weights", "/update_weights_from_disk"]


def test_vllm_reads_the_dtype_and_the_checksums_of_the_engine_still_serving():
    from lichen.sync import vllm_sync

    want = expected_checksums(weights(), torch.float32)

    def answer(path, body):
        method = body["method"]
        if method == "lichen_info":
            return {"results": [{"dtype": "torch.float32"}]}
        assert method == "lichen_checksums"
        return {"results": [{"checksum_format": CHECKSUM_FORMAT, "checksums": want}]}

    engines = LostFirst(answer)
    assert vllm_sync.served_dtype(engines) == torch.float32

    side = vllm_sync._VLLMSide()
    side.timeout_s, side.sent_checksums = 5.0, want
    assert side.verify(engines, 2)["sync/verified_tensors"] == len(want)
    side.sent_checksums = dict(want, **{"a.weight": "f" * 32})
    with pytest.raises(WeightMismatchError, match="a.weight"):
        side.verify(engines, 2)
