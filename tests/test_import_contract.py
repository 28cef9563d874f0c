"""The import-linter layers contract of pyproject.toml holds, and it catches an upward import.

``nox -s lint`` runs ``lint-imports`` on the tree; here the contract is also run on a copy of the
package with one import that breaks the layering added, to show that such an import fails it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def _lint_imports(src: Path, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(src)}
    return subprocess.run(
        [str(LINT_IMPORTS), "--config", str(ROOT / "pyproject.toml"), "--no-cache"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def lint_imports_available():
    if not LINT_IMPORTS.exists():
        raise FileNotFoundError(f"{LINT_IMPORTS} not found: install the dev extra (import-linter)")


def test_layers_contract_is_kept(lint_imports_available, tmp_path):
    res = _lint_imports(ROOT / "src", tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "1 kept, 0 broken" in res.stdout


@pytest.mark.parametrize(
    ("module", "upward"),
    [
        ("ops/__init__.py", "alignlit.losses"),  # the bottom layer reaching one up
        ("models/export.py", "alignlit.eval"),
        ("eval/gold.py", "alignlit.cli"),
    ],
)
def test_an_upward_import_breaks_the_contract(lint_imports_available, tmp_path, module, upward):
    """Even a lazy import inside a function counts (import-linter reads every import statement)."""
    src = tmp_path / "src"
    shutil.copytree(ROOT / "src" / "alignlit", src / "alignlit", ignore=shutil.ignore_patterns("__pycache__"))
    target = src / "alignlit" / module
    target.write_text(target.read_text() + f"\n\ndef _upward():\n    import {upward}  # noqa: F401\n")
    res = _lint_imports(src, tmp_path)
    assert res.returncode != 0
    assert "BROKEN" in res.stdout and upward in res.stdout
