"""The resume contract of ``alignlit fit --ckpt_path``: what a resume may change, what it refuses.

A checkpoint written by ``alignlit fit`` records the run's full parsed config (``checkpoint["alignlit"]
["config"]``, by :class:`alignlit.callbacks.CheckpointStageStamp`). A resume compares the config it is
given, field by field, with that record:

- settings of *where and how long*, which the checkpoint does not hold, take the command line's value
  and each change is logged: every ``trainer.*`` field (run length, validation and logging cadence,
  callbacks, devices) except those below, ``model.init_args.export_dir`` and ``curves_file`` (where
  results go), ``data.init_args.num_workers``;
- everything that shapes the optimisation is refused, naming each field with the checkpoint's value and
  the given one: the model and its architecture, loss and rollout hyperparameters, the reward, optimizer
  settings (their state is in the checkpoint), the data, ``seed_everything``, and the trainer's
  ``gradient_clip_val``, ``gradient_clip_algorithm``, ``accumulate_grad_batches`` and ``precision``.

Lightning's own LightningCLI instead replaced the config's model arguments by the checkpoint's saved
hyperparameters, silently: overrides were dropped and the *old* ``export_dir`` was written to, while
settings it does not save (rollout, reward) took effect — a mix of two runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

APPLIED_PREFIXES = ("trainer.",)
APPLIED = frozenset(
    {
        "model.init_args.export_dir",
        "model.init_args.curves_file",
        "data.init_args.num_workers",
    }
)
"""Fields a resume takes from the command line (each change logged)."""

REFUSED = frozenset(
    {
        "trainer.gradient_clip_val",
        "trainer.gradient_clip_algorithm",
        "trainer.accumulate_grad_batches",
        "trainer.precision",
    }
)
"""``trainer.*`` fields that change the optimisation, refused like the model's and the data's."""

IGNORED = frozenset({"config", "ckpt_path", "weights_only", "__path__"})
"""Top-level entries that are not settings of the run."""

MISSING = "<not set>"


@dataclass(frozen=True)
class Change:
    """One field whose value differs between the checkpoint's run and the resume."""

    field: str
    saved: Any
    given: Any

    @property
    def applied(self) -> bool:
        return self.field in APPLIED or (self.field.startswith(APPLIED_PREFIXES) and not _refused(self.field))

    def __str__(self) -> str:
        return f"{self.field}: {_show(self.saved)} -> {_show(self.given)}"


def _refused(field: str) -> bool:
    return any(field == r or field.startswith(r + ".") for r in REFUSED)


def _show(value: Any) -> str:
    text = repr(value) if value is not MISSING else MISSING
    return text if len(text) <= 80 else text[:77] + "..."


def _diff(saved: Any, given: Any, path: str, out: list[Change]) -> None:
    if isinstance(saved, dict) and isinstance(given, dict):
        for key in list(saved) + [k for k in given if k not in saved]:
            _diff(saved.get(key, MISSING), given.get(key, MISSING), f"{path}.{key}" if path else key, out)
    elif isinstance(saved, list) and isinstance(given, list) and len(saved) == len(given):
        for i, (a, b) in enumerate(zip(saved, given)):
            _diff(a, b, f"{path}.{i}", out)
    elif not _same(saved, given):
        out.append(Change(path, saved, given))


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool | type(None)):
        return float(a) == float(b)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def config_changes(saved: dict[str, Any], given: dict[str, Any]) -> list[Change]:
    """Every field of the run config ``given`` (plain dicts, as ``AlignCLI`` records them) whose value
    differs from ``saved``, the config recorded in the checkpoint; entries that are not settings of the
    run (``config``, ``ckpt_path``) are left out."""
    out: list[Change] = []
    keys = [k for k in list(saved) + [k for k in given if k not in saved] if k not in IGNORED]
    for key in keys:
        _diff(saved.get(key, MISSING), given.get(key, MISSING), key, out)
    return out


def hparams_changes(hparams: dict[str, Any], given_model: dict[str, Any]) -> list[Change]:
    """For a checkpoint that records no config (written outside ``alignlit fit`` or by an older
    alignlit): the model arguments among its saved hyperparameters that differ from the given ones."""
    init_args = given_model.get("init_args", {}) if isinstance(given_model, dict) else {}
    out: list[Change] = []
    for key, value in hparams.items():
        if key.startswith("_") or key not in init_args:
            continue
        before = _plain(value)
        if isinstance(before, str) and isinstance(init_args[key], dict):
            continue  # an object the checkpoint keeps only as text: not comparable
        _diff(before, init_args[key], f"model.init_args.{key}", out)
    return out


def _plain(value: Any) -> Any:
    import dataclasses

    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def refusal(ckpt_path: str, refused: list[Change]) -> str:
    """The error message of a resume that changes refused fields."""
    fields = "; ".join(f"{c.field} (checkpoint {_show(c.saved)}, given {_show(c.given)})" for c in refused)
    return (
        f"--ckpt_path {ckpt_path}: a resume continues the run as it was configured, and these settings differ "
        f"from the checkpoint's: {fields}. A resume may change only where and how long the run goes "
        "(trainer length, validation and logging, callbacks, export_dir, curves_file); give the checkpoint's "
        "values, or start a new run without --ckpt_path to train with the new ones"
    )
