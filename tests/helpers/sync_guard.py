"""Recorders for the weight-sync guard tests (issue 27): what the driver process receives from Ray, and what each
engine serves against what the sender sent, per weight version."""

from __future__ import annotations

from typing import Any


def tensor_bytes(obj: Any) -> int:
    """Bytes of all the tensors in `obj` (nested dicts, lists, tuples)."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def record_ray_gets(monkeypatch: Any, ray: Any) -> list[int]:
    """Wrap `ray.get` in the driver: the returned list gets the tensor bytes of every answer it returns."""
    received: list[int] = []
    real_get = ray.get

    def recording_get(refs: Any, *args: Any, **kwargs: Any) -> Any:
        out = real_get(refs, *args, **kwargs)
        received.append(tensor_bytes(out))
        return out

    monkeypatch.setattr(ray, "get", recording_get)
    return received


def record_checksums(monkeypatch: Any) -> list[tuple[int, str, dict, dict]]:
    """Wrap lichen.sync.verify.compare_checksums: (version, engine url, sent checksums, served checksums) per
    engine per sync."""
    import lichen.sync.verify as verify

    seen: list[tuple[int, str, dict, dict]] = []
    real = verify.compare_checksums

    def recording(url: str, expected: dict, body: dict, version: Any) -> int:
        got = {k: v for r in body.get("ranks") or [] for k, v in (r.get("checksums") or {}).items()}
        seen.append((int(version), url, dict(expected), got))
        return real(url, expected, body, version)

    monkeypatch.setattr(verify, "compare_checksums", recording)
    return seen


def assert_served_what_was_sent(seen: list[tuple[int, str, dict, dict]], versions: int) -> None:
    """Every engine was checked at every version 0..versions-1 and served exactly the sent checksums."""
    urls = {u for _, u, _, _ in seen}
    assert urls and {(v, u) for v, u, _, _ in seen} == {(v, u) for v in range(versions) for u in urls}
    assert all(sent == got and len(sent) > 10 for _, _, sent, got in seen)
