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
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
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


# --- where and what a result was measured on --------------------------------------------------------

RESULTS = ROOT / "benchmarks" / "results"


def commit() -> dict:
    """The checkout's commit and whether it has uncommitted changes (``None`` outside git)."""
    import subprocess

    def git(*args: str) -> str | None:
        res = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False)
        return res.stdout.strip() if res.returncode == 0 else None

    head = git("rev-parse", "HEAD")
    return {
        "commit": head,
        "dirty": bool(git("status", "--porcelain", "--untracked-files=no")) if head else None,
    }


def machine() -> dict:
    """CPU model, cores this process may use, memory, Python, torch and its threads, the GPU if any."""
    import os
    import platform

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {
        "cpu": cpu,
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    try:
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        info["memory_gb"] = round(pages * size / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        pass
    try:
        import torch

        info.update(torch=torch.__version__, torch_threads=torch.get_num_threads())
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return info


def command_line(argv: list[str] | None = None, script: str | None = None) -> str:
    """The command that reproduces this run, as typed in a checkout: ``python benchmarks/<script> ...``."""
    import shlex
    import sys

    argv = sys.argv if argv is None else argv
    path = Path(script or argv[0]).resolve()
    shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    return shlex.join(["python", str(shown), *argv[1:]])


# --- cells: cached, resumable -----------------------------------------------------------------------


class Cells:
    """Cells of a benchmark cached under ``work/cells/<key>.json``: a cell whose ``spec`` (what it
    computes: its command line, settings, the stamp of what it reads) is unchanged is read back instead
    of run again, so a stopped benchmark resumes where it stopped. Each record keeps the cell's seconds."""

    def __init__(self, work: str | Path):
        self.dir = Path(work) / "cells"

    def path(self, key: str) -> Path:
        safe = "".join(c if c.isalnum() or c in "-_.=," else "_" for c in key)
        return self.dir / f"{safe}.json"

    def get(self, key: str, spec=None):
        """The cached result of ``key`` if it was computed with ``spec``, else ``None``."""
        import json

        path = self.path(key)
        if not path.exists():
            return None
        record = json.loads(path.read_text())
        return record["result"] if record.get("spec") == _jsonable(spec) else None

    def latest(self, key: str):
        """The stored result of ``key`` whatever ``spec`` it was computed with (``None`` if there is none): what
        a report of finished cells reads."""
        import json

        path = self.path(key)
        return json.loads(path.read_text())["result"] if path.exists() else None

    def run(self, key: str, compute, spec=None, valid=None):
        """``compute()``'s result for ``key``, computed once per ``spec`` (JSON-serialisable); with ``valid``,
        a cached result is used only if ``valid(result)`` (e.g. the files it names still exist)."""
        import json
        import os
        import time

        cached = self.get(key, spec)
        if cached is not None and (valid is None or valid(cached)):
            return cached
        start = time.perf_counter()
        result = compute()
        record = {
            "key": key,
            "spec": _jsonable(spec),
            "result": result,
            "seconds": time.perf_counter() - start,
        }
        record["finished"] = time.time()
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.path(key).with_suffix(".tmp")
        tmp.write_text(json.dumps(record, indent=1, default=str) + "\n")
        os.replace(tmp, self.path(key))  # a killed run leaves the old record or the new one, never half
        return result


def code_stamp() -> str:
    """The checkout's commit plus a hash of its uncommitted changes to tracked files: a measurement cell
    (``Cells.run(key, measure, spec={..., "code": code_stamp()})``) is read back only for the same code."""
    import subprocess

    def git(*args: str) -> str:
        res = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False)
        return res.stdout if res.returncode == 0 else ""

    diff = git("diff", "HEAD")
    head = git("rev-parse", "HEAD").strip() or "no-git"
    return head + (f"+{hashlib.sha256(diff.encode()).hexdigest()[:12]}" if diff else "")


def measurement_cells(name: str, work: str | Path | None = None) -> Cells:
    """The cells of measuring benchmark ``name`` (default ``out/bench/<name>``): a cut run resumes."""
    return Cells(Path(work) if work else ROOT / "out" / "bench" / name)


def _jsonable(value):
    import json

    return json.loads(json.dumps(value, default=str))


# --- results: table + JSON + plot, with the command, machine and commit ----------------------------


def markdown_table(rows: list[dict], columns: list[str] | None = None) -> str:
    columns = columns or list(dict.fromkeys(k for row in rows for k in row))

    def fmt(value) -> str:
        if isinstance(value, float):
            return f"{value:.4g}"
        return "" if value is None else str(value)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def write_results(
    name: str,
    data: dict | None,
    *,
    command: str | None = None,
    table: str | None = None,
    title: str | None = None,
    plot=None,
    results_dir: str | Path = RESULTS,
) -> dict[str, Path]:
    """``<results_dir>/<name>.json`` (``data`` with ``command``, ``machine`` (its own keys kept), ``commit``, ``date``), and with
    ``table`` (markdown) ``<name>.md`` ending in the command, and with ``plot(path)`` ``<name>.png`` (``plot`` a
    dict ``{file name: plot}``: those files, keyed by stem in the returned paths).
    ``nox -s bench -- <name>`` runs ``command`` again."""
    import json
    import time

    results_dir = Path(results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    command = command or command_line()
    record = {"name": name, "command": command, **(data or {})}
    own = record.get("machine")  # a script's own machine keys are kept, besides machine()'s
    record["machine"] = {**machine(), **own} if isinstance(own, dict) else own or machine()
    record.setdefault("commit", commit())
    record.setdefault("date", time.strftime("%Y-%m-%d"))
    out = {}
    if data is not None:  # None: a table (and plot) only, its command in the table's last lines
        out["json"] = results_dir / f"{name}.json"
        out["json"].write_text(json.dumps(record, indent=1, default=str) + "\n")
    if table is not None:
        head = f"# {title}\n\n" if title else ""
        where = record["commit"].get("commit") if isinstance(record["commit"], dict) else record["commit"]
        foot = f"\n\nCommand: `{command}`\n\nMachine: {_machine_line(record['machine'])}; commit {where}; {record['date']}\n"
        out["md"] = results_dir / f"{name}.md"
        out["md"].write_text(head + table.rstrip() + foot)
    plots = plot if isinstance(plot, dict) else {f"{name}.png": plot} if plot is not None else {}
    for file, draw in plots.items():  # a dict names its files: {"quality_frontier.png": draw, ...}
        out[Path(file).stem if isinstance(plot, dict) else "png"] = results_dir / file
        draw(results_dir / file)
    return out


def _machine_line(info) -> str:
    if not isinstance(info, dict):
        return str(info)
    parts = [info.get("cpu"), f"{info['cores']} cores" if info.get("cores") else None]
    parts += [f"torch {info['torch']}" if info.get("torch") else None, info.get("gpu")]
    return ", ".join(p for p in parts if p)


# --- one command per committed result --------------------------------------------------------------


def script_source(script: str | Path) -> str:
    """The text of benchmark ``script`` and of the harness modules it imports (where its parser may be):
    what a check of a documented command's options reads."""
    script = Path(script)
    source = script.read_text()
    for module in re.findall(r"^from harness(?:\.(\w+)| import (\w+) as)", source, re.M):
        path = Path(__file__).resolve().parent / f"{module[0] or module[1]}.py"
        source += path.read_text() if path.exists() else ""
    return source


def result_names(results_dir: str | Path = RESULTS) -> list[str]:
    """The committed results, by name (``<name>.json`` or ``<name>.md`` under benchmarks/results/)."""
    results_dir = Path(results_dir)
    return sorted({p.stem for p in results_dir.iterdir() if p.suffix in (".json", ".md")})


def result_command(name: str, results_dir: str | Path = RESULTS) -> str:
    """The command that reproduces committed result ``name``: its JSON's ``command``, else its markdown's
    ``Command: `...``` line."""
    import json
    import re

    results_dir = Path(results_dir)
    path = results_dir / f"{name}.json"
    if path.exists():
        data = json.loads(path.read_text())
        if isinstance(data, dict) and data.get("command"):
            return data["command"]
    path = results_dir / f"{name}.md"
    if path.exists():
        match = re.search(r"^Command: `([^`]+)`", path.read_text(), re.M)
        if match:
            return match.group(1)
    raise KeyError(f"benchmarks/results/{name}: no result of that name names its command")


# --- shared stages, made once -----------------------------------------------------------------------


def paper_stages(sim: Path, sft: Path, reward: Path, logs: Path, steps: int | None = None) -> list[tuple]:
    """``(done marker, alignlit argv)`` of the paper-scale shared stages: the simulated data, SFT and the
    reward model on it, written to ``sim``, ``sft``, ``reward`` (logs under ``logs``, no checkpoints;
    ``steps`` caps SFT and reward-model training, a smoke test)."""
    log = f"--trainer.logger.init_args.save_dir={logs}"
    return [
        (sim / "manifest.json", ["sim", "make-data", "--out", str(sim)]),
        (
            sft / "config.json",
            ["fit", *config_args("sft", "paper"), log, "--trainer.enable_checkpointing=false",
             "--trainer.callbacks=[]", f"--model.init_args.policy.init_args.tokenizer={sim / 'tokenizer'}",
             f"--model.init_args.export_dir={sft}", f"--data.init_args.train_file={sim / 'sft_train.jsonl'}",
             f"--data.init_args.val_file={sim / 'sft_val.jsonl'}",
             *([f"--trainer.max_steps={steps}", f"--trainer.val_check_interval={steps}"] if steps else [])],
        ),
        (
            reward / "config.json",
            ["fit", *config_args("reward", "paper"), log, f"--model.init_args.model={sft}",
             f"--model.init_args.export_dir={reward}", f"--data.init_args.train_file={sim / 'pairs_train.jsonl'}",
             f"--data.init_args.val_file={sim / 'pairs_gold_val.jsonl'}",
             *([f"--trainer.limit_train_batches={steps}", "--trainer.limit_val_batches=2"] if steps else [])],
        ),
    ]  # fmt: skip


def prepare(stages: list[tuple], run=None, *, make: bool = True, hint: str = "") -> None:
    """Run each stage of ``stages`` (``(done marker, alignlit argv)``) whose marker is missing, in order,
    with ``run(argv)`` (default: ``alignlit`` in this process); with ``make=False`` a missing one is an
    error naming the markers and ``hint``."""
    missing = [str(done) for done, _ in stages if not Path(done).exists()]
    if missing and not make:
        raise SystemExit(f"missing {missing}: {hint}")
    if run is None:
        from alignlit.cli import main as run
    for done, argv in stages:
        if not Path(done).exists():
            run(argv)


def stamp(payload: dict, command: str | None = None) -> dict:
    """``payload`` as a committed result: its ``command`` first (``nox -s bench -- NAME`` runs it), then
    its own keys, and ``commit``, ``date`` and ``machine`` (the script's own machine keys kept)."""
    import time

    own = payload.get("machine")
    record = {"command": command or command_line(), **payload}
    record["machine"] = {**machine(), **own} if isinstance(own, dict) else own or machine()
    record.setdefault("commit", commit())
    record.setdefault("date", time.strftime("%Y-%m-%d"))
    return record


def fit_once(work: Path, argv: list[str], record: dict | None = None, extra_s: float = 0.0, run=None) -> dict:
    """A training cell (``Cells(work)``, key ``fit``, spec: ``argv``): ``alignlit <argv>`` (in this process by
    default), unless the same ``argv`` finished and its export ``work/policy`` is complete; returns the run's
    record (``record``'s keys, ``argv``, ``policy``, ``fit_s``: its wall time plus ``extra_s``)."""
    import time

    policy = Path(work) / "policy"
    if run is None:
        from alignlit.cli import main as run

    def train() -> dict:
        start = time.perf_counter()
        run(argv)
        return {
            **(record or {}),
            "argv": argv,
            "policy": str(policy),
            "fit_s": time.perf_counter() - start + extra_s,
        }

    return Cells(work).run(
        "fit", train, spec={"argv": argv}, valid=lambda _: (policy / "config.json").exists()
    )


# --- running alignlit, JSON records ------------------------------------------------------------------


def run_alignlit(name: str, argv: list[str], cwd: Path, log: Path, env: dict | None = None) -> float:
    """``alignlit <argv>`` in ``cwd`` as a subprocess, output to ``log``; returns its wall time. A failure
    raises RuntimeError naming ``name``, the exit status and the log's last lines."""
    import os
    import subprocess
    import sys
    import time

    log.parent.mkdir(parents=True, exist_ok=True)
    env = env or {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    start = time.perf_counter()
    with log.open("w") as f:
        proc = subprocess.run(
            [sys.executable, "-m", "alignlit.cli", *argv],
            cwd=cwd,
            stdout=f,
            stderr=subprocess.STDOUT,
            env=env,
        )
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        tail = log.read_text().splitlines()[-15:]
        raise RuntimeError(f"{name} failed (exit {proc.returncode}; log {log}):\n" + "\n".join(tail))
    return elapsed


def quickstart_stages(root: Path) -> list[tuple]:
    """``(done marker, alignlit argv)`` of the quickstart's shared stages as a checkout at ``root`` runs
    them (relative paths, run with ``cwd=root``): the simulated data, SFT, the reward model."""
    return [
        (root / "data/sim/manifest.json", ["sim", "make-data", "--out", "data/sim"]),
        (root / "out/quickstart/sft/config.json", ["fit", *config_args("sft")]),
        (root / "out/quickstart/reward/config.json", ["fit", *config_args("reward")]),
    ]


# --- helpers several benchmarks share ----------------------------------------------------------------

QWEN = dict(
    vocab_size=151936, hidden_size=896, intermediate_size=4864, num_attention_heads=14,
    num_key_value_heads=2, head_dim=64, max_position_embeddings=32768, rope_theta=1000000.0,
    rms_norm_eps=1e-6, tie_word_embeddings=True, hidden_act="silu",
)  # fmt: skip  # Qwen2.5-0.5B's architecture (a Qwen2Config's keys); the benchmarks give it random weights


def mean_std(values: list[float | None]) -> tuple[float | None, float | None]:
    """Mean and sample std of the values that are not None (std None for fewer than two)."""
    import statistics

    values = [v for v in values if v is not None]
    if not values:
        return None, None
    return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else None)


def pm(mean, std, digits=3) -> str:
    """``mean ± std`` (``mean`` alone without a std, empty without a mean)."""
    if mean is None:
        return ""
    return f"{mean:.{digits}f}" + ("" if std is None else f" ± {std:.{digits}f}")


def fmt_s(seconds: float) -> str:
    """``1h02m`` / ``3m05s``."""
    seconds = int(seconds)
    return (
        f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
        if seconds >= 3600
        else f"{seconds // 60}m{seconds % 60:02d}s"
    )


def allocation_peak(prof) -> int:
    """Most bytes the CPU allocator held at once above its level at the start of a finished
    ``torch.profiler.profile(profile_memory=True)`` run (its allocation events, in time order)."""
    from torch._C._profiler import _EventType

    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            events.append((node.start_time_ns, node.extra_fields.alloc_size))
    current = peak = 0
    for _, size in sorted(events):
        current += size
        peak = max(peak, current)
    return peak


GSM8K = Path(
    "/work/shared/data/gsm8k/train.jsonl.gz"
)  # GSM8K's train split, where this checkout's machines keep it
if not GSM8K.is_file():
    GSM8K = ROOT.parent / "shared" / "data" / "gsm8k" / "train.jsonl.gz"


def hash_reward(prompts, responses, answer):
    """1.0 when the number after the response's last '####' equals the gold's (GSM8K's answer format)."""

    def final(text: str) -> str:
        return text.rsplit("####", 1)[-1].strip().replace(",", "") if "####" in text else ""

    return [float(final(r) != "" and final(r) == final(a)) for r, a in zip(responses, answer)]
