"""The import-linter contracts of pyproject.toml hold, and each catches what it forbids.

``nox -s lint`` runs ``lint-imports`` on the tree; here the contracts are also run on a copy of the
package with one change that breaks them: an upward import (layers), a new top-level module no layer
names (the layers contract is exhaustive), a stage importing another stage (independence).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
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
    assert "2 kept, 0 broken" in res.stdout


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


def copy_package(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    shutil.copytree(ROOT / "src" / "alignlit", src / "alignlit", ignore=shutil.ignore_patterns("__pycache__"))
    return src


def test_a_new_top_level_module_must_be_placed_in_a_layer(lint_imports_available, tmp_path):
    src = copy_package(tmp_path)
    (src / "alignlit" / "helpers.py").write_text('"""A module no layer names."""\n')
    res = _lint_imports(src, tmp_path)
    assert res.returncode != 0
    assert "alignlit.helpers" in res.stdout


def test_a_stage_importing_another_stage_breaks_independence(lint_imports_available, tmp_path):
    src = copy_package(tmp_path)
    target = src / "alignlit" / "modules" / "online_rrhf.py"
    target.write_text(
        target.read_text() + "\n\ndef _sibling():\n    import alignlit.modules.online_dpo  # noqa: F401\n"
    )
    res = _lint_imports(src, tmp_path)
    assert res.returncode != 0
    assert "stages are independent" in res.stdout and "BROKEN" in res.stdout
