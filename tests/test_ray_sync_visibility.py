"""The disk transports' start check (lichen.sync.visibility): every engine reads back, by content, a probe file the
driver wrote in --update-weight-disk-dir. Engines on "other nodes" are simulated by launchers whose reads resolve
the same path somewhere else; the real Ray actors' read is covered by tests/test_ray_two_nodes.py."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from lichen import sync
from lichen.errors import ConfigError
from lichen.sync.visibility import PROBE_PREFIX, check_dir_visible

pytestmark = pytest.mark.e2e  # see the marker in pyproject.toml: make test leaves it to make test-e2e


class NodeViews:
    """A launcher whose engine i reads paths as its node sees them: `roots[i]` replaces the shared directory (None:
    the same file system as the driver)."""

    def __init__(self, shared: str, roots: list[str | None]):
        self.shared, self.roots, self.paths = shared, roots, []

    def read_each(self, path: str) -> list[dict]:
        self.paths.append(path)
        out = []
        for i, root in enumerate(self.roots):
            local = path if root is None else os.path.join(root, os.path.relpath(path, self.shared))
            try:
                with open(local) as f:
                    out.append({"content": f.read(), "where": f"node-{i}"})
            except OSError as e:
                out.append({"error": f"{type(e).__name__}: {e}", "where": f"node-{i}"})
        return out


def _engines(launcher) -> SimpleNamespace:
    return SimpleNamespace(launcher=launcher)


def test_every_engine_reads_the_probe_and_it_is_removed(tmp_path):
    shared = str(tmp_path / "versions")
    views = NodeViews(shared, [None, None])
    assert check_dir_visible(_engines(views), shared) == 2
    assert os.path.dirname(views.paths[0]) == shared and os.path.basename(views.paths[0]).startswith(PROBE_PREFIX)
    assert os.listdir(shared) == []  # the probe does not stay behind


def test_an_engine_whose_node_has_its_own_directory_fails_at_start_naming_it(tmp_path):
    shared, elsewhere = str(tmp_path / "versions"), tmp_path / "node1_disk"
    elsewhere.mkdir()
    with pytest.raises(ConfigError) as e:
        check_dir_visible(_engines(NodeViews(shared, [None, str(elsewhere)])), shared)
    msg = str(e.value)
    assert msg.startswith(f"--update-weight-disk-dir {shared}: engine 1 (node-1) cannot read the probe file")
    assert "FileNotFoundError" in msg and "\n" not in msg


def test_other_content_at_the_path_is_not_visibility(tmp_path):
    """A file that exists but holds something else (a same-named directory on the engine's own disk, an old probe)
    does not count: the check compares content."""
    shared = str(tmp_path / "versions")

    class Stale(NodeViews):
        def read_each(self, path):
            return [*super().read_each(path)[:1], {"content": "0" * 32, "where": "node-1"}]

    with pytest.raises(ConfigError, match=r"engine 1 \(node-1\) .*it read other content"):
        check_dir_visible(_engines(Stale(shared, [None, None])), shared)


@pytest.mark.parametrize("mode", ["full", "delta"])
def test_the_disk_transports_check_before_their_first_version(tmp_path, mode):
    shared = str(tmp_path / "versions")
    cfg = SimpleNamespace(
        transport="disk",
        mode=mode,
        disk_dir=shared,
        local_dir=str(tmp_path / "local"),
        hf_checkpoint=None,
        delta_encoding="xor",
        delta_checksum="xxh3-128",
        full_interval=0,
        keep_files=False,
        post_write_path=None,
    )
    with pytest.raises(ConfigError, match="engine 0 .*cannot read the probe file"):
        sync._make_transport(_engines(NodeViews(shared, [str(tmp_path)])), cfg)


def test_engines_that_cannot_be_asked_are_not_checked(tmp_path):
    """Servers launched by this process (same file system) or external ones (no actor to ask): nothing to do."""
    assert check_dir_visible(_engines(object()), str(tmp_path / "versions")) == 0
    assert not (tmp_path / "versions").exists()
