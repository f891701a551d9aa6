"""The import directions of docs/architecture.md#import-directions, checked on every module under lichen/.

Every `import`/`from ... import` of lichen, at the top of a module or inside a function (and under
`if TYPE_CHECKING:`), is mapped to the package it reaches and compared with ALLOWED, which mirrors the table in
docs/architecture.md section 4: change both together. A failure names the file:line of each offending import.
Also checked here: the repository cites only its own documents, and test modules do not import each other
(shared test code lives in tests/helpers/).
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LICHEN = REPO / "lichen"

# Shared helpers: any part may import them; they import only `errors` (`observe` also `types` and `safe_files`).
SHARED = {
    "errors",
    "plugins",
    "aio",
    "torch_files",
    "observe",
    "devices",
    "key_files",
    "safe_files",
    "excerpt",
    "lifetime",
    "lichen",
}
ANYTHING = None
# package -> the lichen packages it may import besides itself and SHARED (docs/architecture.md section 4)
ALLOWED: dict[str, set[str] | None] = {
    "cli": ANYTHING,
    "train_cli": ANYTHING,
    "eval_cli": ANYTHING,
    "port_slime": ANYTHING,
    "loop": {"rollout", "train", "sync", "cluster"},
    "cluster": {"engines", "train"},
    "loop_async": {"loop", "rollout", "sync", "types"},
    "rollout": {"engines", "rewards", "data", "models", "types"},
    "train": {"algo", "models", "weights", "types"},
    "sync": {"engines", "weights"},
    "engines": {"models", "weights"},
    "rewards": {"types", "engines"},
    "config": {"models"},
    "models": {"weights"},
    "data": set(),
    "algo": set(),
    "weights": set(),
    "types": set(),
    # the shared helpers themselves
    "errors": set(),
    "plugins": set(),
    "aio": set(),
    "torch_files": set(),
    "devices": set(),
    "key_files": set(),
    "safe_files": set(),
    "excerpt": set(),
    "lifetime": set(),
    "observe": {"types", "safe_files"},
    "lichen": set(),
}
SHARED_IMPORTS = {"errors"}  # what a shared helper may import of the other shared helpers
# config may reach these only inside its checking functions (their lookup tables and messages)
CONFIG_IN_FUNCTIONS = {"rewards", "engines", "rollout"}
# lichen/engines/ is four sub-packages (docs/architecture.md#engines-layout): the in-process engine (`core`), what
# servers and their clients agree on (`api`), `lichen serve` (`server`) and the clients of engine servers
# (`clients`). Sub-package -> the sub-packages it may import besides itself.
ENGINE_LAYERS: dict[str, set[str]] = {
    "core": set(),
    "api": {"core"},
    "server": {"core", "api"},
    "clients": {"core", "api"},
}
# the server side of `lichen serve`: imported only inside `engines` (and by `cli`, which runs it)
SERVER = re.compile(r"^lichen\.engines\.server\b")
# the typed configs: every part may import its own; they import nothing of lichen but `errors`
TYPED_CONFIGS = (
    "rollout_config",
    "train_config",
    "engine_config",
    "cluster_config",
    "tool_config",
    "lora_config",
    "model_code",
)
CONFIG_TYPES = re.compile(r"^lichen\.config\.(" + "|".join(TYPED_CONFIGS) + ")$")


def _package_of_file(path: Path) -> str:
    rel = path.relative_to(LICHEN)
    if len(rel.parts) == 1:
        return "lichen" if rel.stem == "__init__" else rel.stem
    return rel.parts[0]


def _module_of_file(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _package_of_module(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "lichen"


def lichen_imports(path: Path) -> list[tuple[int, str, bool]]:
    """(line, imported lichen module, inside a function) for every import of lichen in `path`."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    module = _module_of_file(path)
    found: list[tuple[int, str, bool]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            targets: list[str] = []
            if isinstance(child, ast.Import):
                targets = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:  # relative: resolve against this module's package
                    pkg = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                    pkg = pkg[: len(pkg) - (child.level - 1)]
                    base = ".".join(pkg + ([base] if base else []))
                if base == "lichen":  # `from lichen import algo` reaches lichen.algo; `__version__` the root
                    targets = [
                        f"lichen.{a.name}"
                        if (LICHEN / a.name).exists() or (LICHEN / f"{a.name}.py").exists()
                        else "lichen"
                        for a in child.names
                    ]
                else:
                    targets = [base]
            found.extend((child.lineno, t, in_function) for t in targets if t == "lichen" or t.startswith("lichen."))
            visit(child, inner)

    visit(tree, False)
    return found


def _engine_layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["lichen", "engines"] else None


def _allowed(src: str, src_module: str, target: str, in_function: bool) -> bool:
    dst = _package_of_module(target)
    if src == "engines" and dst == "engines":
        src_layer, dst_layer = _engine_layer(src_module), _engine_layer(target)
        return src_layer == dst_layer or dst_layer in ENGINE_LAYERS.get(src_layer or "", set())
    if CONFIG_TYPES.match(src_module):  # a typed config is a leaf
        return dst == "errors" or CONFIG_TYPES.match(target) is not None
    if dst == src or CONFIG_TYPES.match(target):
        return True
    if SERVER.match(target):
        return src == "cli"
    allowed = ALLOWED[src]
    if allowed is ANYTHING:
        return True
    if src in SHARED:
        return dst in allowed | SHARED_IMPORTS
    return dst in SHARED or dst in allowed or (src == "config" and in_function and dst in CONFIG_IN_FUNCTIONS)


def violations() -> list[str]:
    bad = []
    for path in sorted(LICHEN.rglob("*.py")):
        src, src_module = _package_of_file(path), _module_of_file(path)
        if src not in ALLOWED:
            bad.append(f"{path.relative_to(REPO)}: the package {src} has no row in ALLOWED (and in the docs)")
            continue
        for line, target, in_function in lichen_imports(path):
            if not _allowed(src, src_module, target, in_function):
                bad.append(
                    f"{path.relative_to(REPO)}:{line}: {src} imports {target}, which is not in its row of "
                    "docs/architecture.md#import-directions"
                )
    return bad


def test_imports_follow_the_documented_directions():
    assert violations() == []


def test_the_table_here_is_the_table_in_the_docs():
    """Each row of docs/architecture.md section 4 names the packages ALLOWED gives it (and the shared helpers)."""
    doc = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = doc[doc.index("## 4. Import directions") : doc.index("## 5.")]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[0].startswith("`"):
            for name in re.findall(r"`(\w+)`", cells[0]):
                rows[name] = set(re.findall(r"`(\w+)`", cells[1])) if cells[1] != "anything" else ANYTHING
    for package, allowed in ALLOWED.items():
        if package in SHARED:
            continue
        assert package in rows, f"docs/architecture.md section 4 has no row for {package}"
        if allowed is ANYTHING:
            assert rows[package] is ANYTHING, package
        else:
            # a row may also name shared helpers, and config's what it reaches only inside functions
            named = rows[package] - SHARED - (CONFIG_IN_FUNCTIONS if package == "config" else set())
            assert named == allowed, f"{package}: docs say {sorted(named)}, the test says {sorted(allowed)}"
    named_files = {f"config/{c}.py" for c in TYPED_CONFIGS} | {f"engines/{layer}" for layer in ENGINE_LAYERS}
    for name in (SHARED - {"lichen"}) | named_files:
        assert f"`{name}`" in section, f"{name} is not named in docs/architecture.md section 4"


def test_the_checker_catches_a_backward_import(tmp_path, monkeypatch):
    """The walk sees imports inside functions and `from lichen import x`, and names the file and line."""
    fake = tmp_path / "lichen"
    (fake / "engines").mkdir(parents=True)
    (fake / "engines" / "x.py").write_text(
        "import os\n\ndef f():\n    from lichen import train\n    import lichen.rollout.manager\n"
    )
    (fake / "sync").mkdir()
    (fake / "sync" / "y.py").write_text(
        "from lichen.engines.clients.client import EngineError\nfrom lichen.engines.server.weight_endpoints import parse_dtype\n"
    )
    (fake / "engines" / "clients").mkdir()  # inside engines: a client reaching the server, not the shared api
    (fake / "engines" / "clients" / "c.py").write_text(
        "from lichen.engines.api.auth import key_for_path\nfrom lichen.engines.server.limits import Limits\n"
    )
    (fake / "train").mkdir()
    (fake / "rollout").mkdir()
    monkeypatch.setattr(sys.modules[__name__], "LICHEN", fake)
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    assert violations() == [
        "lichen/engines/clients/c.py:2: engines imports lichen.engines.server.limits, which is not in its row of "
        "docs/architecture.md#import-directions",
        "lichen/engines/x.py:4: engines imports lichen.train, which is not in its row of "
        "docs/architecture.md#import-directions",
        "lichen/engines/x.py:5: engines imports lichen.rollout.manager, which is not in its row of "
        "docs/architecture.md#import-directions",
        "lichen/sync/y.py:2: sync imports lichen.engines.server.weight_endpoints, which is not in its row of "
        "docs/architecture.md#import-directions",
    ]


def _repo_files() -> list[Path]:
    """Tracked and untracked (not ignored) files of the repository."""
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [REPO / p for p in out.splitlines() if (REPO / p).is_file()]


TEXT_SUFFIXES = {".py", ".md", ".toml", ".yaml", ".yml", ".txt", ".cfg", ".ini", ".sh", ""}


def test_sources_and_docs_cite_only_the_repository():
    """Documents outside the repository (the design notes and protocol notes it was written from) are not cited."""
    forbidden = re.compile(r"\.\./" + "shared|" + r"\bDES" + r"IGN\b|" + "sglang-" + r"api\.md")
    hits = []
    for path in _repo_files():
        if path.suffix not in TEXT_SUFFIXES or path.stat().st_size > 2_000_000:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for n, line in enumerate(text.splitlines(), 1):
            if forbidden.search(line):
                hits.append(f"{path.relative_to(REPO)}:{n}: {line.strip()[:100]}")
    assert hits == []


def test_test_modules_do_not_import_each_other():
    tests = REPO / "tests"
    modules = {p.stem for p in tests.glob("*.py") if p.stem.startswith("test_") or p.stem == "conftest"}
    bad = []
    for path in sorted(tests.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            for name in names:
                parts = name.split(".")
                stem = parts[1] if parts[0] == "tests" and len(parts) > 1 else parts[0]
                if stem in modules and (parts[0] == "tests" or len(parts) == 1):
                    bad.append(f"tests/{path.name}:{node.lineno}: imports {name}; move shared code to tests/helpers/")
    assert bad == []


def getattr_args_calls(root: Path, packages: tuple[str, ...]) -> list[str]:
    """file:line of each `getattr(args, ...)` under the given packages of `root`/lichen."""
    hits = []
    for package in packages:
        for path in sorted((root / "lichen" / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Name)
                    and node.func.id == "getattr"
                    and node.args
                    and isinstance(node.args[0], ast.Name)
                    and node.args[0].id == "args"
                ):
                    hits.append(f"{path.relative_to(root)}:{node.lineno}")
    return hits


def test_engines_sync_and_observe_take_their_configs():
    """Flag defaults live in argparse and the typed configs of lichen/config/ are resolved from them once; the
    engines, weight sync and the metrics sinks read their config, never the flag namespace."""
    assert getattr_args_calls(REPO, ("engines", "sync", "observe", "weights", "models")) == []
