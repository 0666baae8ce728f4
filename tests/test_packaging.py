"""The plain install is enough to run: every module of the installed packages imports in a virtualenv
made from ``pip install <checkout>`` (no extras), and the console script's subcommands start. Catches
a runtime import of a package that is only a test or optional dependency (httpx was one: ``kv-router
bridge`` died with ModuleNotFoundError on a plain install). pip's cache is reused; only the C
accelerators are compiled."""

from __future__ import annotations

import os
import shutil
import subprocess
import venv
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("indexer", "router", "api", "mocker")
# Optional by design: imports matplotlib itself, by name, only when it is installed.
OPTIONAL = {"mocker.plots"}
SKIPPED = (".git", ".venv*", "build", "dist", "*.egg-info", "*.so", "__pycache__", ".*_cache", ".hypothesis", "bench")

IMPORT_ALL = """
import importlib, pkgutil, sys
packages, optional = sys.argv[1].split(","), set(sys.argv[2].split(","))
failed, imported = [], 0
for package in packages:
    module = importlib.import_module(package)
    assert module.__file__ and "site-packages" in module.__file__, module.__file__  # the installed copy
    for info in pkgutil.walk_packages(module.__path__, package + "."):
        if info.name in optional:
            continue
        try:
            importlib.import_module(info.name)
            imported += 1
        except Exception as exc:
            failed.append(f"{info.name}: {exc!r}")
print(imported)
print("\\n".join(failed), file=sys.stderr)
sys.exit(1 if failed else 0)
"""


def test_every_module_imports_and_the_commands_start_from_the_plain_install(tmp_path: Path) -> None:
    env_dir = tmp_path / "plain"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    env = {key: value for key, value in os.environ.items() if key not in ("VIRTUAL_ENV", "PYTHONPATH")}
    # A copy of the sources: a build in the checkout would leave its build/ directory there.
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(*SKIPPED))
    install = subprocess.run(
        [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", str(source)],
        env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert install.returncode == 0, install.stderr[-3000:]
    imported = subprocess.run(
        [python, "-c", IMPORT_ALL, ",".join(PACKAGES), ",".join(OPTIONAL)],
        env=env, capture_output=True, text=True, timeout=300, check=False, cwd=tmp_path,
    )  # fmt: skip
    assert imported.returncode == 0, "modules that do not import on the plain install:\n" + imported.stderr
    assert int(imported.stdout) > 50
    for command in (["bridge", "--help"], ["serve", "--help"], ["mock-worker", "--help"]):
        started = subprocess.run(
            [env_dir / "bin" / "kv-router", *command],
            env=env, capture_output=True, text=True, timeout=120, check=False, cwd=tmp_path,
        )  # fmt: skip
        assert started.returncode == 0, started.stderr[-3000:]
        assert "usage: kv-router" in started.stdout
