"""The directories a `lichen serve` engine may read weights from and write its local copy to, fixed at start.

A request names paths (`/pull_weights` `source_dir` and `local_checkpoint_dir`, `/update_weights_from_disk`
`model_path`); each is resolved (symlinks and `..`) and must be one of these, else the request is answered 403
and nothing is read or written:

- read: the served `--model` directory, each `--weight-dir DIR` and anything below one (published versions
  `DIR/weight_vNNNNNN`), and the `--local-checkpoint-dir` and anything below it;
- write: only the `--local-checkpoint-dir` or a directory below it (the `local_checkpoint_dir` of
  `/pull_weights`), and there only files the pull itself wrote (lichen.weights.pull); the `source_dir` of a pull
  must be a `--weight-dir` or below one.

`lichen train` passes its own `--update-weight-disk-dir` and `--update-weight-local-checkpoint-dir` to the engines
it launches.
"""

from __future__ import annotations

import os
from typing import Iterable

from lichen.engines.api.protocol import RequestError


class Forbidden(RequestError):
    """A path outside the directories this server was started with: 403, nothing touched."""

    def __init__(self, message: str):
        super().__init__(message, status=403)


def _real(path: str) -> str:
    return os.path.realpath(os.path.abspath(path))


def _within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


class WeightDirs:
    def __init__(self, model_dir: str, weight_dirs: Iterable[str] = (), local_dir: str | None = None):
        self.model_dir = _real(model_dir)
        self.weight_dirs = [_real(d) for d in weight_dirs]
        self.local_dir = None if local_dir is None else _real(local_dir)

    def _refuse(self, field: str, path: str, allowed: str) -> Forbidden:
        return Forbidden(
            f"{field} {path!r} is not a directory this server may use ({allowed}); start lichen serve "
            "with --weight-dir / --local-checkpoint-dir naming it"
        )

    def source(self, path: str) -> str:
        """A pull's `source_dir`: a --weight-dir or below one. Returns the resolved path."""
        real = _real(path)
        if not any(_within(real, d) for d in self.weight_dirs):
            raise self._refuse("source_dir", path, f"--weight-dir: {self.weight_dirs or 'none given'}")
        return real

    def local(self, path: str) -> str:
        """A pull's `local_checkpoint_dir`: the --local-checkpoint-dir or below it. Returns the resolved path."""
        real = _real(path)
        if self.local_dir is None or not _within(real, self.local_dir):
            raise self._refuse(
                "local_checkpoint_dir", path, f"--local-checkpoint-dir: {self.local_dir or 'none given'}"
            )
        return real

    def model(self, path: str) -> str:
        """An `/update_weights_from_disk` `model_path`: the served model, the local copy, or within a --weight-dir."""
        real = _real(path)
        roots = self.weight_dirs + ([self.local_dir] if self.local_dir else [])
        if real == self.model_dir or any(_within(real, d) for d in roots):
            return real
        allowed = [self.model_dir, *([self.local_dir] if self.local_dir else []), *self.weight_dirs]
        raise self._refuse("model_path", path, f"allowed: {allowed}")
