"""After every sync: check that each engine serves exactly the trainer's weights (a mismatch stops the run).

The reference is the trainer's tensors cast to the engine dtype (what every transport sends), compared bit for bit:

- `lichen serve` (its `/weights_checker {"action": "checksum"}` answer carries `"checksum_format": "xxh3-128"`):
  the xxh3-128 of every loaded parameter's raw bytes, computed by the server from its parameters after loading,
  against the same hash of the trainer's tensors — every tensor, every sync;
- other servers (SGLang: its checksums use a GPU hash the trainer cannot recompute): `/get_weights_by_name` of a
  few tensors (first, middle and last of the trainer's names, first 100 rows), compared exactly as float lists
  (JSON carries each float32 value exactly); with `full` (--check-weight-update-equal) every tensor, every row.

A tensor the engine lacks, one it has that the trainer does not send, or different bytes raise
`WeightMismatchError` naming the engine and the tensors. Every sync failure is a `SyncError`, a `RunError`: the
CLI prints it as one line (which engine, which weight version) and exits with code 1.
"""

from __future__ import annotations

import json
import time
from typing import Any, Callable, Iterable

import torch

from lichen.errors import RunError
from lichen.weights.wire import CHECKSUM_FORMAT, parse_dtype


class SyncError(RunError, RuntimeError):  # still a RuntimeError, as these errors were before
    """A weight sync failed: an engine refused or lost the update, or serves other weights afterwards."""


class WeightMismatchError(SyncError):
    """An engine serves weights that differ from the trainer's after a sync."""


def engine_view(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The trainer tensor as an engine of `dtype` holds it: floating point cast, on CPU, contiguous."""
    t = t.detach()
    if t.is_floating_point() and t.dtype != dtype:
        t = t.to(dtype)
    return t.to("cpu").contiguous()


def expected_checksums(named: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype) -> dict[str, str]:
    """name -> xxh3-128 of the tensor's bytes in the engine dtype (cast chunk by chunk, tensors in parallel)."""
    from lichen.weights.delta_codec import cast_checksum
    from lichen.weights.parallel import parallel_map

    items = list(named)
    sums = parallel_map(lambda item: cast_checksum(CHECKSUM_FORMAT, item[1], dtype), items)
    return {name: digest for (name, _), digest in zip(items, sums)}


def _describe(url: str, version: Any, missing: list[str], extra: list[str], differ: list[str]) -> str:
    parts = []
    if differ:
        parts.append(f"{len(differ)} tensor(s) differ from the trainer's: {', '.join(differ[:10])}")
    if missing:
        parts.append(f"{len(missing)} trainer tensor(s) the engine does not serve: {', '.join(missing[:10])}")
    if extra:
        parts.append(f"{len(extra)} served tensor(s) the trainer does not have: {', '.join(extra[:10])}")
    return (
        f"engine {url} does not serve the trainer's weights after the sync to version {version}: "
        + "; ".join(parts)
        + ". The run stops: the engines would generate with other weights than trained."
    )


def compare_checksums(url: str, expected: dict[str, str], body: dict, version: Any) -> int:
    """Check one engine's `/weights_checker` checksum answer; returns the number of tensors checked."""
    got: dict[str, str] = {}
    for rank in body.get("ranks") or []:
        got.update(rank.get("checksums") or {})
    missing = sorted(expected.keys() - got.keys())
    extra = sorted(got.keys() - expected.keys())
    differ = [n for n in expected if n in got and got[n] != expected[n]]
    if missing or extra or differ:
        raise WeightMismatchError(_describe(url, version, missing, extra, differ))
    return len(expected)


def _sample_names(names: list[str]) -> list[str]:
    picks = {0, len(names) // 2, len(names) - 1} if names else set()
    return [names[i] for i in sorted(picks)]


def engine_dtype(infos: list[dict], fallback: torch.dtype = torch.bfloat16) -> torch.dtype:
    """The dtype the engines serve in (from /server_info); all must agree. SGLang's "auto" reads as `fallback`."""
    names = {str(i.get("dtype") or "auto") for i in infos}
    if len(names) != 1:
        raise WeightMismatchError(f"the engines serve different dtypes ({sorted(names)}); one sync cannot fit all")
    name = names.pop()
    return fallback if name == "auto" else parse_dtype(name)


def answered(urls: list[str], answers: list) -> tuple[list[str], list]:
    """The (urls, answers) of the engines that answered a call to every engine in rotation. With failover an
    engine that could not be reached answers None (`RemoteEngines._each`): it has left rotation and re-joins at
    a later sync, so the engines still serving are the ones to check."""
    pairs = [(u, a) for u, a in zip(urls, answers) if a is not None]
    return [u for u, _ in pairs], [a for _, a in pairs]


def _same_across_engines(urls: list[str], bodies: list, version: Any) -> None:
    """SGLang's own checksums cannot be recomputed by the trainer, but engines with the same layout (ranks) that
    hold the same weights report the same per_engine_checksum."""
    seen: dict[tuple, tuple[str, str]] = {}
    for url, b in zip(urls, bodies):
        if not isinstance(b, dict) or not b.get("per_engine_checksum"):
            continue
        layout = tuple(sorted(json.dumps(r.get("parallelism_info"), sort_keys=True) for r in b.get("ranks") or []))
        if layout in seen and seen[layout][1] != b["per_engine_checksum"]:
            raise WeightMismatchError(
                f"engines {seen[layout][0]} and {url} serve different weights after the sync to "
                f"version {version} (their /weights_checker checksums differ)"
            )
        seen.setdefault(layout, (url, b["per_engine_checksum"]))


def verify_engines(
    engines: Any,
    named_weights: Callable[[], Iterable[tuple[str, torch.Tensor]]],
    dtype: torch.dtype,
    *,
    version: Any = None,
    full: bool = False,
    method: str = "auto",
    expected: dict[str, str] | None = None,
    fetch: Callable[[list[str], int | None], dict[str, torch.Tensor]] | None = None,
) -> dict:
    """Check every engine of `engines` (a RemoteEngines) against the trainer's weights; returns metrics.

    expected: {name: xxh3-128} of what the sender sent (lichen.weights.rank_send), compared with the engines'
    checksums without reading the trainer's weights again; else they are hashed from `named_weights()`.
    fetch(names, rows): the first `rows` rows (all with None) of those tensors, for the sampled check of engines
    without lichen's checksums (under --runtime ray gathered by the ranks, only those tensors); else read from
    `named_weights()`.
    method "auto": checksums where the engine answers them in lichen's format, else sampled rows;
    "checksum" / "sampled" force one (tests)."""
    t0 = time.perf_counter()
    urls = engines.active_urls()
    bodies = None
    if method in ("auto", "checksum"):
        try:
            bodies = engines.post_each("/weights_checker", {"action": "checksum"})
        except Exception:
            if method == "checksum":
                raise
        if bodies is not None:  # an engine lost during the call answered None: it left rotation, skip it
            urls, bodies = answered(urls, bodies)
        if bodies is not None and not all(
            isinstance(b, dict) and b.get("checksum_format") == CHECKSUM_FORMAT for b in bodies
        ):
            if method == "checksum":
                raise WeightMismatchError(f"the engines {urls} do not report {CHECKSUM_FORMAT} weight checksums")
            _same_across_engines(urls, bodies, version)
            bodies = None
    if bodies is not None:
        if expected is None:
            expected = expected_checksums(named_weights(), dtype)
        checked = sum(compare_checksums(url, expected, body, version) for url, body in zip(urls, bodies))
        return {"time/sync_verify": time.perf_counter() - t0, "sync/verified_tensors": checked}
    if expected is None or fetch is None:
        state = dict(named_weights())
        all_names = list(state)

        def fetch(names: list[str], rows: int | None) -> dict[str, torch.Tensor]:
            return {n: state[n] for n in names}

    else:
        all_names = list(expected)
    names = all_names if full else _sample_names(all_names)
    refs = fetch(names, None if full else 100)
    checked = 0
    for name in names:
        ref = engine_view(refs[name], dtype)
        rows = ref.shape[0] if (full and ref.dim()) else 100
        want = ref[:rows].float() if ref.dim() else ref.float()
        try:
            answers = engines.get_weights_by_name(name, rows)
        except Exception as e:
            raise WeightMismatchError(
                f"cannot read tensor {name!r} back from the engines ({e}); "
                f"engines {urls} after the sync to version {version}"
            ) from None
        for url, rows_got in zip(urls, answers):
            if rows_got is None:  # lost during the check: out of rotation, it re-joins at a later sync
                continue
            got = torch.tensor(rows_got, dtype=torch.float32)
            if got.shape != want.shape or not torch.equal(got, want):
                raise WeightMismatchError(_describe(url, version, [], [], [name]))
            checked += 1
    return {"time/sync_verify": time.perf_counter() - t0, "sync/verified_tensors": checked}


def verify_in_process(engine: Any, named: Iterable[tuple[str, torch.Tensor]], version: Any = None) -> int:
    """The in-process engine: its parameters must equal the trainer's tensors (cast to its dtype) exactly. A
    parameter that is the trainer's tensor (the same memory, shape, strides and dtype: Engine.share_weights) is
    equal by construction and not compared element by element."""
    params = dict(engine.model.named_parameters())
    checked, missing, differ = 0, [], []
    for name, t in named:
        p = params.get(name)
        if p is None:
            missing.append(name)
            continue
        if _same_memory(p, t):
            checked += 1
            continue
        ref = t.detach().to(device=p.device, dtype=p.dtype)
        if not torch.equal(p.detach(), ref):
            differ.append(name)
        checked += 1
    if missing or differ:
        raise WeightMismatchError(_describe("in-process", version, missing, [], differ))
    return checked


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.data_ptr() == b.data_ptr()
        and a.device == b.device
        and a.dtype == b.dtype
        and a.shape == b.shape
        and a.stride() == b.stride()
    )
