"""The benchmarks' shared harness.

Configs: a run of the simulated task is named like its export directory (``grpo``, ``grpo-verifiable``)
and is one stack of config files: a quickstart stage base (``configs/quickstart/grpo.yaml``), the
overlays of its variant (``configs/verifiable/grpo.yaml``) and, at paper scale, its size overlay
(``configs/paper/grpo-verifiable.yaml``). Every paper overlay names the whole stack in its header (the
``#   alignlit fit --config ...`` line, parsed by tests/test_configs.py), so :func:`config_stack` reads it
there: one source for the tests, the README and the benchmarks.
"""

from __future__ import annotations

import hashlib
import itertools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
SCALES = ("quickstart", "paper")
COMMAND = "#   alignlit fit --config "


def scale_dir(scale: str | Path) -> Path:
    """``quickstart`` / ``paper``, or a ``configs/<scale>`` directory, as the directory."""
    path = Path(scale)
    return path.resolve() if len(path.parts) > 1 else CONFIGS / str(scale)


def header_stack(overlay: Path) -> list[Path]:
    """The config files the ``#   alignlit fit --config a --config b ...`` line of ``overlay``'s header
    stacks (paths relative to the checkout holding ``overlay``)."""
    checkout = overlay.resolve().parents[2]
    for line in overlay.read_text().splitlines():
        if not line.startswith("#"):
            break
        if line.startswith(COMMAND):
            words = line[len("#   alignlit fit ") :].split()
            return [checkout / w for k, w in itertools.pairwise(words) if k == "--config"]
    raise ValueError(f"{overlay}: no `{COMMAND.strip()} ...` line in its header")


def config_stack(name: str, scale: str | Path = "quickstart") -> list[Path]:
    """The config files of run ``name`` (``grpo-verifiable``, ``sft.yaml``) at ``scale``, in stacking order."""
    name = name.removesuffix(".yaml")
    directory = scale_dir(scale)
    own, paper = directory / f"{name}.yaml", directory.parent / "paper" / f"{name}.yaml"
    if directory.name == "paper" and own.exists():
        return header_stack(own)
    if directory.name != "paper" and own.exists():
        return [own]
    if directory.name != "paper" and paper.exists():
        return header_stack(paper)[:-1]
    raise FileNotFoundError(f"no config for run {name!r} at {directory}")


def config_args(name: str, scale: str | Path = "quickstart") -> list[str]:
    """``--config a --config b ...`` of run ``name`` at ``scale``."""
    return [arg for path in config_stack(name, scale) for arg in ("--config", str(path))]


def merge(base, over):
    """YAML overlay ``over`` on ``base`` as the stage parser merges them: mappings key by key (a new
    ``class_path`` replaces the whole value), anything else replaced."""
    if isinstance(base, dict) and isinstance(over, dict):
        if "class_path" in over and over["class_path"] != base.get("class_path"):
            return over
        return {**base, **{k: merge(base[k], v) if k in base else v for k, v in over.items()}}
    return over


def read_files(paths) -> dict:
    """Config files stacked in order, merged as YAML (not parsed: unset keys keep the stage's defaults)."""
    import yaml

    config: dict = {}
    for path in paths:
        config = merge(config, yaml.safe_load(Path(path).read_text()) or {})
    return config


def read_config(name: str, scale: str | Path = "quickstart") -> dict:
    """Run ``name``'s stacked YAML (:func:`read_files` of its :func:`config_stack`)."""
    return read_files(config_stack(name, scale))


def config_sha256(name: str, scale: str | Path = "quickstart") -> str:
    """One hash of the run's config files, in stacking order."""
    digest = hashlib.sha256()
    for path in config_stack(name, scale):
        digest.update(path.read_bytes())
    return digest.hexdigest()


def get_key(config: dict, dotted: str):
    node = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def runs() -> list[str]:
    """Every run of the simulated task, by name: each has a paper overlay ``configs/paper/<name>.yaml``."""
    return sorted(p.stem for p in (CONFIGS / "paper").glob("*.yaml"))
