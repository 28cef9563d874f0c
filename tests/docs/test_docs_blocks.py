"""Every Python and shell block of the documentation (``docs/**/*.md`` and ``README.md``) is executed here,
or is marked with the reason it is not, so the docs cannot rot silently.

A block is classified by an HTML comment on the line(s) just before its fence (invisible on the site):

- no comment, or ``<!-- docs: run -->``: **executed**, in order, in one working directory per page (links to
  ``configs/``, ``recipes/``, ``examples/``, ``benchmarks/``; a copy of a tiny ``data/sim`` and of tiny
  ``out/quickstart/{sft,reward,pairpref,samples}``; an offline hub cache holding a tiny random
  ``Qwen/Qwen2.5-0.5B-Instruct``, ``tests/hubcache.py``). Every ``alignlit`` command is made tiny (:func:`tiny_argv`: one step
  or rollout per ``fit``, no validation, small ``sim make-data``, 16 prompts for ``sample``, 8 for
  ``eval``); a shell block of ``alignlit`` commands only runs them in this process, any other under
  ``bash -e`` with that tiny ``alignlit`` first on ``PATH``. Python blocks run in one namespace per page;
  a block whose first line is ``# some/file.py`` is also written to that file (importable from the page's
  directory). ``run replace="A -> B; C -> D"`` runs the block with those substitutions (a cheap variant).
- ``<!-- docs: parse REASON: why -->``: every command line in it is **parsed, not run**: ``alignlit fit``
  lines through the real CLI parser (``--print_config``: configs, overrides, keys and types), tool lines
  through their argparse parsers, ``python benchmarks/X.py`` lines against the script's options, ``nox -s``
  against the noxfile's sessions. REASON is one of :data:`REASONS`.
- ``<!-- docs: excerpt PATH -->``: an excerpt of a tested file: every line of it (``...`` aside) is in PATH.
- ``<!-- docs: skip REASON: why -->``: neither (a line no parser can check).

The parse and excerpt checks and the classification run in the ``tests`` session; executing the blocks
is ``nox -s docs`` (``ALIGNLIT_DOCS_RUN=1``).
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import harness  # noqa: E402  (benchmarks/harness: which options a benchmark script has)

LANGS = {"python": "python", "py": "python", "bash": "bash", "sh": "bash", "shell": "bash", "console": "bash"}
REASONS = {
    "gpu": "needs GPUs",
    "network": "downloads a model or data set from the hub",
    "minutes": "trains or benchmarks for minutes to hours",
    "vllm": "needs vLLM (nox -s vllm)",
    "nodes": "needs several machines or a scheduler",
}
RUN = os.environ.get("ALIGNLIT_DOCS_RUN") == "1"
FENCE = re.compile(
    r"^(?P<indent> *)```(?P<lang>[\w-]*)[^\n]*\n(?P<code>.*?)^(?P=indent)```[ \t]*$", re.S | re.M
)
MARKER = re.compile(r"<!--\s*docs:\s*(?P<body>.*?)\s*-->\s*\Z", re.S)


@dataclass
class Block:
    path: Path
    line: int
    lang: str
    code: str
    kind: str  # run | parse | excerpt | skip
    arg: str  # the reason, the excerpt's file or run's options

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def collect(path: Path) -> list[Block]:
    text = path.read_text()
    blocks = []
    for m in FENCE.finditer(text):
        lang = LANGS.get(m["lang"])
        if lang is None:
            continue
        before = text[: m.start()].rstrip()
        marker = MARKER.search(before[-600:])
        kind, arg = "run", ""
        if marker:
            body = marker["body"]
            kind, _, arg = body.partition(" ")
        code = textwrap.dedent(m["code"])
        blocks.append(Block(path, text[: m.start()].count("\n") + 1, lang, code, kind, arg.strip()))
    return blocks


BLOCKS = [b for p in doc_files() for b in collect(p)]


def test_the_docs_have_blocks_and_every_marker_is_valid():
    assert len(BLOCKS) > 30, [b.id for b in BLOCKS]
    bad = []
    for b in BLOCKS:
        if b.kind in ("parse", "skip"):
            reason, _, why = b.arg.partition(":")
            if reason not in REASONS or not why.strip():
                bad.append(
                    f"{b.id}: `docs: {b.kind} {b.arg}`: want `{b.kind} REASON: why`, REASON in {sorted(REASONS)}"
                )
            if b.kind == "parse" and b.lang != "bash":
                bad.append(f"{b.id}: only shell blocks can be parsed")
        elif b.kind == "excerpt":
            if not (ROOT / b.arg).is_file():
                bad.append(f"{b.id}: excerpt of {b.arg!r}, which does not exist")
        elif b.kind == "run":
            if b.arg and not b.arg.startswith("replace="):
                bad.append(f'{b.id}: `docs: run {b.arg}`: only replace="A -> B; ..."')
        else:
            bad.append(f"{b.id}: unknown marker `docs: {b.kind}`")
    assert not bad, "\n".join(bad)


@pytest.mark.docs
def test_summary(capsys):
    """Prints how many blocks are run, parsed, excerpts or skipped (the docs session shows it)."""
    counts: dict[str, int] = {}
    for b in BLOCKS:
        key = b.kind if b.kind in ("run", "excerpt") else f"{b.kind} ({b.arg.partition(':')[0]})"
        counts[key] = counts.get(key, 0) + 1
    with capsys.disabled():
        print(
            f"\ndocs code blocks: {len(BLOCKS)}: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
        )


# --- excerpts ---


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.kind == "excerpt"], ids=lambda b: b.id)
def test_excerpt_lines_are_in_their_file(block):
    source = (ROOT / block.arg).read_text()
    missing = [
        line
        for line in block.code.splitlines()
        if line.strip() and line.strip() != "..." and line.strip() not in source
    ]
    assert not missing, f"{block.id}: lines not in {block.arg}: {missing}"


# --- command lines: split, then parsed by the parsers that run them ---


def command_lines(code: str) -> list[list[str]]:
    """The commands of a shell block: continuation lines joined, comments dropped, `&&` split, simple
    `NAME="..."` variables substituted."""
    joined = re.sub(r"\\\n", " ", code)
    variables: dict[str, str] = {}
    out = []
    for line in joined.splitlines():
        words = shlex.split(line, comments=True)
        if not words:
            continue
        if len(words) == 1 and re.fullmatch(r"[A-Z_]+=.*", words[0]):
            name, _, value = words[0].partition("=")
            variables[name] = value
            continue
        words = [w for v in words for w in (shlex.split(variables[v[1:]]) if v[1:] in variables else [v])]
        command: list[str] = []
        for w in [*words, "&&"]:
            if w in ("&&", "&", ";", "||"):
                if command:
                    out.append(command)
                command = []
            else:
                command.append(w)
    return out


def _quiet_exit(fn, *args) -> tuple[int, str]:
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
            fn(*args)
    except SystemExit as err:
        return (err.code if isinstance(err.code, int) else 1), buf.getvalue()
    return 0, buf.getvalue()


def check_alignlit(argv: list[str]) -> str | None:
    """None when ``alignlit ARGV`` parses (nothing is run), else the error."""
    from alignlit.cli import LIGHTNING_SUBCOMMANDS

    sub, rest = argv[0], argv[1:]
    if sub in LIGHTNING_SUBCOMMANDS:
        from alignlit.cli import main

        code, out = _quiet_exit(main, [sub, *rest, "--print_config"])
        return None if code == 0 else out.strip()[-600:]
    if sub == "eval":
        from alignlit.cli import eval as eval_sim
        from alignlit.cli import eval_data

        parser = (eval_sim if "--sim" in rest else eval_data).build_parser()
    elif sub in ("sim", "sample", "score", "serve"):
        import importlib

        parser = importlib.import_module(f"alignlit.cli.{sub}").build_parser()
        if sub == "serve" and "--" in rest:
            rest = rest[: rest.index("--")]
    else:
        return f"unknown alignlit command {sub!r}"
    code, out = _quiet_exit(parser.parse_args, rest)
    return None if code == 0 else out.strip()[-600:]


def check_command(words: list[str]) -> str | None:
    """None when the command parses (or is one nothing needs to check), else why not."""
    head = words[0]
    if head in ("export", "cd", "mkdir", "(umask", "echo"):
        return None
    if head == "srun":
        return check_command(words[1:])
    if head == "alignlit":
        return check_alignlit(words[1:])
    if head == "torchrun":
        if "-m" not in words or words[words.index("-m") + 1] != "alignlit.cli":
            return "torchrun without -m alignlit.cli"
        return check_alignlit(words[words.index("-m") + 2 :])
    if head == "bash":
        return None if (ROOT / words[1]).exists() else f"no file {words[1]}"
    if head in ("python", "python3"):
        if words[1:3] == ["-m", "pip"] or words[1] == "-c":
            return None
        if words[1:3] == ["-m", "nox"]:
            return check_command(["nox", *words[3:]])
        if words[1:3] == ["-m", "pytest"]:
            return None
        script = ROOT / words[1]
        if not script.is_file():
            return f"no script {words[1]}"
        text = harness.script_source(script)  # the script and the harness module its parser is in
        unknown = [
            w.split("=")[0] for w in words[2:] if w.startswith("--") and f'"{w.split("=")[0]}"' not in text
        ]
        return f"{words[1]} has no option {unknown}" if unknown else None
    if head == "nox":
        sessions = re.findall(r"^def (\w+)\(session", (ROOT / "noxfile.py").read_text(), flags=re.M)
        asked = []
        for w in words[words.index("-s") + 1 :] if "-s" in words else []:
            if w.startswith("-"):
                break
            asked.append(w)
        unknown = [s for s in asked if s not in sessions]
        return f"nox sessions {unknown} are not in noxfile.py ({sessions})" if unknown else None
    if head == "pytest":
        return None
    return f"no checker for `{head}`: mark the block or teach tests/docs/test_docs_blocks.py"


FILE_LINE = re.compile(r"# ((?:\w+/)+\w+\.py)")


def file_blocks() -> dict[str, str]:
    """The Python blocks that are files (first line ``# mypkg/file.py``): path -> code."""
    found: dict[str, str] = {}
    for b in BLOCKS:
        if b.lang == "python" and (m := FILE_LINE.fullmatch(b.code.splitlines()[0].strip())):
            assert found.setdefault(m[1], b.code) == b.code, f"{b.id}: two different blocks are {m[1]}"
    return found


def write_files(root: Path) -> None:
    for rel, code in file_blocks().items():
        target = root / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        for parent in Path(rel).parents:
            if str(parent) != "." and not (root / parent / "__init__.py").exists():
                (root / parent / "__init__.py").write_text("")
        target.write_text(code)


def _registries() -> list[dict]:
    import alignlit.losses as losses
    import alignlit.ops as ops

    return [
        losses.POLICY_LOSSES,
        losses.PREFERENCE_LOSSES,
        losses.LOSS_AGGREGATIONS,
        ops.ADVANTAGE_ESTIMATORS,
        ops.TOKEN_ADVANTAGE_ESTIMATORS,
        ops.ROLLOUT_CORRECTIONS,
    ]


@pytest.fixture(scope="module")
def doc_modules(tmp_path_factory):
    """Every file block of the docs written under one folder on ``sys.path`` (for this module: a module
    registers its names once, whichever page imports it first). Afterwards the folder, its modules and
    the names they registered are gone, so no other test sees them."""
    root = tmp_path_factory.mktemp("doc-modules")
    write_files(root)
    before = [dict(r) for r in _registries()]
    sys.path.insert(0, str(root))
    yield root
    sys.path.remove(str(root))
    packages = {rel.split("/")[0] for rel in file_blocks()}
    for name in [m for m in sys.modules if m.split(".")[0] in packages]:
        del sys.modules[name]
    for registry, saved in zip(_registries(), before):
        for name in [n for n in registry if n not in saved]:
            del registry[name]


@pytest.mark.parametrize(
    "block", [b for b in BLOCKS if b.lang == "bash" and b.kind != "skip"], ids=lambda b: b.id
)
def test_shell_block_commands_parse(block, monkeypatch, doc_modules):
    """Every command of every shell block (run or parse) parses against today's configs and parsers."""
    monkeypatch.chdir(ROOT)
    errors = [
        f"{' '.join(words)}\n  -> {err}"
        for words in command_lines(block.code)
        if (err := check_command(words))
    ]
    assert not errors, f"{block.id}:\n" + "\n".join(errors)


# --- executing the blocks (nox -s docs) ---

TINY_SIM = ["--n-sft", "2000", "--n-pairs", "400", "--n-prompts", "200", "--n-val", "40", "--n-test", "40"]


def _set(argv: list[str], flag: str, value: str, *, at_most: int | None = None) -> list[str]:
    if flag in argv:
        i = argv.index(flag)
        if at_most is None or int(argv[i + 1]) > at_most:
            argv[i + 1] = value
        return argv
    return [*argv, flag, value]


def tiny_argv(argv: list[str]) -> list[str]:
    """``alignlit ARGV`` made tiny: what the docs tests run for each command of a page."""
    argv = list(argv)
    if argv[:2] == ["sim", "make-data"]:
        for flag, value in zip(TINY_SIM[::2], TINY_SIM[1::2]):
            if flag not in argv:
                argv += [flag, value]
        return argv
    if argv[:1] == ["sample"]:
        return _set(argv, "--max-prompts", "16", at_most=16)
    if argv[:1] == ["eval"]:
        return _set(argv, "--n-prompts", "8", at_most=8)
    if argv[:1] != ["fit"]:
        return argv
    trainer: dict = {}
    for i, w in enumerate(argv):
        if w == "--config":
            trainer.update((yaml.safe_load(Path(argv[i + 1]).read_text()) or {}).get("trainer") or {})
    if "max_steps" in trainer:
        tiny = ["--trainer.max_steps=1", "--trainer.val_check_interval=1"]
    else:
        tiny = ["--trainer.limit_train_batches=1", "--trainer.val_check_interval=1.0"]
    return [
        *argv,
        *tiny,
        "--trainer.limit_val_batches=0",
        "--trainer.num_sanity_val_steps=0",
        "--trainer.enable_progress_bar=false",
    ]


SHIM = """#!{python}
# alignlit for the docs tests: every command made tiny (tests/docs/test_docs_blocks.py: tiny_argv)
import sys
sys.path.insert(0, {root!r})
from tests.docs.test_docs_blocks import tiny_argv
from alignlit.cli import main
result = main(tiny_argv(sys.argv[1:]))
sys.exit(result if isinstance(result, int) else 0)
"""


@pytest.fixture(scope="session")
def workspace(tmp_path_factory):
    """A tiny data/sim and the quickstart's first exports (SFT, reward model, samples, pairwise preference
    model), made once through the CLI in this process."""
    from alignlit.cli import main

    work = tmp_path_factory.mktemp("docs-workspace")
    for name in ("configs",):
        (work / name).symlink_to(ROOT / name)
    commands = [
        ["sim", "make-data", "--out", "data/sim"],
        ["fit", "--config", "configs/quickstart/sft.yaml"],
        ["fit", "--config", "configs/quickstart/reward.yaml"],
        ["fit", "--config", "configs/quickstart/pairpref.yaml"],
        [
            *(
                "sample",
                "--policy",
                "out/quickstart/sft",
                "--prompts",
                "data/sim/prompts_train.jsonl",
                "--n",
                "4",
            ),
            *("--scorer", "out/quickstart/reward", "--out", "out/quickstart/samples/ranked.jsonl"),
            *("--pairs", "out/quickstart/samples/pairs.jsonl", "--rft", "out/quickstart/samples/rft.jsonl"),
        ],
    ]
    cwd = os.getcwd()
    os.chdir(work)
    try:
        for argv in commands:
            main(tiny_argv(argv))
    finally:
        os.chdir(cwd)
    from tests.hubcache import make_hub_cache

    make_hub_cache(work / "hf-hub")  # a tiny random Qwen/Qwen2.5-0.5B-Instruct, offline (tests/hubcache.py)
    shim = work / "bin" / "alignlit"
    shim.parent.mkdir()
    shim.write_text(SHIM.format(python=sys.executable, root=str(ROOT)))
    shim.chmod(0o755)
    return work


def page_dir(workspace: Path, tmp_path: Path) -> Path:
    d = tmp_path / "page"
    d.mkdir()
    for name in ("configs", "recipes", "examples", "benchmarks", "noxfile.py"):
        (d / name).symlink_to(ROOT / name)
    shutil.copytree(workspace / "data", d / "data")
    keep = ("sft", "reward", "pairpref", "samples")
    for name in keep:
        shutil.copytree(workspace / "out" / "quickstart" / name, d / "out" / "quickstart" / name)
    return d


def _replaced(block: Block) -> str:
    code = block.code
    if block.arg.startswith("replace="):
        for pair in block.arg[len("replace=") :].strip("\"'").split(";"):
            old, _, new = pair.partition(" -> ")
            assert old.strip() in code, f"{block.id}: replace {old.strip()!r}: not in the block"
            code = code.replace(old.strip(), new.strip())
    return code


PAGES = sorted({b.path for b in BLOCKS if b.kind == "run"})


@pytest.mark.docs
@pytest.mark.skipif(not RUN, reason="executing the docs' blocks is `nox -s docs` (ALIGNLIT_DOCS_RUN=1)")
@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_page_blocks_run(page, workspace, doc_modules, tmp_path, monkeypatch):
    from huggingface_hub import constants

    d = page_dir(workspace, tmp_path)
    monkeypatch.chdir(d)
    for name, value in (("HF_HUB_CACHE", str(workspace / "hf-hub")), ("HF_HUB_OFFLINE", "1")):
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(workspace / "hf-hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    write_files(d)  # for the page's commands (subprocesses); this process imports them from doc_modules
    env = {
        **os.environ,
        "PATH": f"{workspace / 'bin'}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": os.pathsep.join([str(d), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    namespace: dict = {"__name__": "__docs__"}
    for block in [b for b in BLOCKS if b.path == page and b.kind == "run"]:
        code = _replaced(block)
        if block.lang == "python":
            if m := FILE_LINE.fullmatch(code.splitlines()[0].strip()):
                import importlib

                module = importlib.import_module(m[1][: -len(".py")].replace("/", "."))
                namespace.update({k: v for k, v in vars(module).items() if not k.startswith("__")})
            else:
                exec(compile(code, block.id, "exec"), namespace)
        elif all(words[0] == "alignlit" for words in command_lines(code)):
            # only alignlit commands: run in this process (one import of torch and Lightning for all)
            from alignlit.cli import main

            for words in command_lines(code):
                main(tiny_argv(words[1:]))
        else:
            proc = subprocess.run(
                ["bash", "-e", "-c", code], cwd=d, env=env, capture_output=True, text=True, timeout=900
            )
            assert proc.returncode == 0, (
                f"{block.id} failed ({proc.returncode}):\n{code}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
            )


def test_readme_links_resolve():
    """The README's relative links (into docs/, recipes/, ...) name files that exist; anchors of pages in
    docs/ are checked by `mkdocs build --strict`."""
    text = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    assert links
    missing = [link for link in links if "://" not in link and not (ROOT / link).exists()]
    assert not missing, missing
