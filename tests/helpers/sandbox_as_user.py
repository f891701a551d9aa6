"""Run trainer-side sandbox code as an unprivileged user (nobody) from a root test process."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile

NOBODY = 65534
CAN_DROP = os.geteuid() == 0 and os.path.exists("/usr/bin/setpriv") and os.path.exists("/usr/bin/python3")


def readable_package() -> str:
    """A world-readable copy of the lichen package (a checkout, e.g. a `mktemp -d` clone, may be 0700). Its
    lichen/rewards/__init__.py is emptied: the sandbox modules need nothing else, and the system python3 that
    nobody runs has none of the venv's packages."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    readable = tempfile.mkdtemp(prefix="lichen-sandbox-pkg-")
    shutil.copytree(
        os.path.join(root, "lichen"), os.path.join(readable, "lichen"), ignore=shutil.ignore_patterns("__pycache__")
    )
    with open(os.path.join(readable, "lichen", "rewards", "__init__.py"), "w"):
        pass
    for d, _dirs, files in os.walk(readable):
        os.chmod(d, 0o755)
        for name in files:
            os.chmod(os.path.join(d, name), 0o644)
    return readable


def run_as_nobody(script: str, *args: str, timeout: float = 120) -> tuple[dict, str]:
    """Run `script` (python source) as nobody with the package on sys.path; it prints one JSON line last.
    Returns that JSON and the process's stderr."""
    package = readable_package()
    try:
        proc = subprocess.run(
            [
                "/usr/bin/setpriv",
                f"--reuid={NOBODY}",
                f"--regid={NOBODY}",
                "--clear-groups",
                "/usr/bin/python3",
                "-c",
                script,
                package,
                *args,
            ],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd="/",
        )
    finally:
        shutil.rmtree(package, ignore_errors=True)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr
