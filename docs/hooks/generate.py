"""MkDocs hook: the pages made from the code and the repository at every build, so they cannot drift.

- ``reference/config/*.md``: every config key of every stage and DataModule, read with the same
  jsonargparse calls ``alignlit fit`` makes (the ``__init__`` signatures and the docstrings' ``Args:``);
- ``reference/cli.md``: the ``--help`` of every ``alignlit`` tool, from its argparse parser;
- ``reference/api/*.md``: one mkdocstrings page per package of ``alignlit``;
- ``recipes/*.md`` from ``recipes/*/README.md`` and ``changelog.md`` from ``CHANGELOG.md`` (their one place);
- ``assets/results/*.png``: the committed plots of ``benchmarks/results/``.

Nothing is written into ``docs/``: the files exist only in the build.
"""

from __future__ import annotations

import argparse
import inspect
import io
import re
import textwrap
import typing
from contextlib import redirect_stdout
from pathlib import Path

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[2]

# packages whose API page is generated, in the order of the layers (pyproject's import contract)
API_PACKAGES = [
    ("modules", "Stages (LightningModules) and their bases"),
    ("data", "DataModules, record formats, truncation"),
    ("losses", "Losses: pure tensor functions and their registries"),
    ("ops", "RL math: advantages, KL, GAE, statistics, rollout corrections"),
    ("rollout", "Rollout engines, the rollout loop, environments, tools"),
    ("rewards", "Rewards a stage can take: verifiers, the LLM judge, a preference model"),
    ("models", "Loading, exporting, the teacher-forced forward, LoRA"),
    ("eval", "Evaluation: gold reward, verifiable accuracy, plots"),
    ("sim", "The simulated-human-feedback task"),
    ("callbacks", "Callbacks every stage installs, and opt-in ones"),
    ("strategies", "FSDP2 and tensor parallel"),
    ("checkpoint_io", "Crash-safe checkpoints"),
    ("hub", "Models by Hugging Face hub id"),
]


def _rst_to_md(text: str) -> str:
    """The docstrings' reStructuredText roles and literals as Markdown code spans."""
    text = re.sub(r":(?:class|func|meth|data|mod|attr|obj|exc):`~?([^`]+)`", r"`\1`", text)
    text = text.replace("``", "`")
    return text


def _cell(text: str) -> str:
    text = " ".join(_rst_to_md(str(text)).split())
    return text.replace("|", "\\|")


def _type_name(hint) -> str:
    text = str(hint) if not inspect.isclass(hint) else hint.__qualname__
    text = re.sub(r"<class '([^']+)'>", r"\1", text)
    text = re.sub(r"\b(?:typing|collections\.abc|builtins)\.", "", text)
    text = re.sub(r"\balignlit\.[\w.]*\.(\w+)", r"\1", text)
    text = re.sub(r"\blightning\.[\w.]*\.(\w+)", r"\1", text)
    text = text.replace("NoneType", "None")
    return text


def _expandable(hint) -> list[type]:
    """The alignlit classes a key's type names (a nested group of keys), not protocols or callables."""
    found = []
    for arg in [hint, *typing.get_args(hint)]:
        if (
            inspect.isclass(arg)
            and arg.__module__.startswith("alignlit.")
            and not getattr(arg, "_is_protocol", False)
            and arg not in found
        ):
            found.append(arg)
    return found


def _class_keys(cls: type) -> list[tuple[str, object, object, str]]:
    """(key, type, default, help) of every argument jsonargparse reads from ``cls`` (as the CLI does)."""
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(cls, "x", fail_untyped=False, sub_configs=True)
    rows = []
    for action in parser._actions:
        dest = action.dest
        if (
            not dest.startswith("x.")
            or dest.endswith(".help")
            or type(action).__name__ == "_ActionConfigLoad"
        ):
            continue
        hint = getattr(action, "_typehint", None)
        default = action.default
        if type(default).__name__ == "_RequiredDefault" or (default is None and action.required):
            default_text = "required"
        elif isinstance(default, str) and default == argparse.SUPPRESS:
            continue
        else:
            default_text = repr(default)
        rows.append((dest[2:], hint, default_text, action.help or ""))
    return rows


def _key_table(cls: type, prefix: str) -> tuple[str, list[tuple[str, type]]]:
    lines = [
        f"| key (under `{prefix}`{'' if prefix.count('.') == 1 else ', or its `init_args`'}) | type | default | what it is |",
        "|---|---|---|---|",
    ]
    nested = []
    for key, hint, default, help_text in _class_keys(cls):
        lines.append(f"| `{key}` | `{_cell(_type_name(hint))}` | `{_cell(default)}` | {_cell(help_text)} |")
        for sub in _expandable(hint):
            nested.append((f"{prefix}.{key}", sub))
    return "\n".join(lines) + "\n", nested


def _configs_using(class_path: str) -> list[str]:
    found = []
    for path in sorted((ROOT / "configs").rglob("*.yaml")) + sorted((ROOT / "recipes").rglob("*.yaml")):
        if re.search(rf"class_path:\s*{re.escape(class_path)}\s*$", path.read_text(), flags=re.M):
            found.append(str(path.relative_to(ROOT)))
    return found


def _first_paragraph(cls: type) -> str:
    doc = inspect.getdoc(cls) or ""
    return _rst_to_md(" ".join(doc.split("\n\n")[0].split()))


def config_page(cls: type, group: str) -> str:
    """One stage's or DataModule's keys, with the nested groups its types name (each class once)."""
    class_path = f"alignlit.{cls.__module__.split('.')[1]}.{cls.__name__}"
    out = [
        f"# `{cls.__name__}`\n",
        f"`{group}: {{class_path: {class_path}}}`\n",
        _first_paragraph(cls) + "\n",
    ]
    users = _configs_using(class_path)
    if users:
        out.append("Shipped configs that use it: " + ", ".join(f"`{u}`" for u in users) + ".\n")
    out.append(
        f"Generated from the signature `alignlit fit` reads (`alignlit fit --{group}.help {class_path}` "
        "prints the same keys). Any key is set in the YAML or on the command line, "
        f"`--{group}.init_args.KEY VALUE`.\n"
    )
    table, nested = _key_table(cls, f"{group}.init_args")
    out.append(table)
    seen = {cls}
    while nested:
        prefix, sub = nested.pop(0)
        if sub in seen:
            continue
        seen.add(sub)
        try:
            table, more = _key_table(sub, prefix)
        except Exception as err:  # a type jsonargparse cannot expand: say so, never skip silently
            out.append(f"## `{prefix}`: `{sub.__name__}`\n\n(keys not expanded: {_cell(err)})\n")
            continue
        out.append(f"## `{prefix}`: `{sub.__name__}`\n")
        if _first_paragraph(sub):
            out.append(_first_paragraph(sub) + "\n")
        out.append(table)
        nested += more
    return "\n".join(out)


def stage_classes() -> tuple[list[type], list[type]]:
    """Every concrete stage of ``alignlit.modules`` and DataModule of ``alignlit.data`` (by their bases)."""
    import alignlit.data as data
    import alignlit.modules as modules
    from alignlit.data.base import AlignDataModule
    from alignlit.modules import AlignModule, OnlineModule

    stages = [
        getattr(modules, n)
        for n in modules.__all__
        if inspect.isclass(getattr(modules, n))
        and issubclass(getattr(modules, n), AlignModule)
        and getattr(modules, n) not in (AlignModule, OnlineModule)
    ]
    datamodules = [
        getattr(data, n)
        for n in data.__all__
        if inspect.isclass(getattr(data, n))
        and issubclass(getattr(data, n), AlignDataModule)
        and getattr(data, n) is not AlignDataModule
    ]
    return stages, datamodules


def cli_page() -> str:
    """``alignlit --help`` and every tool's ``--help``, from the parsers the commands use."""
    from alignlit.cli import USAGE, eval_data, sample, score, serve, sim
    from alignlit.cli import eval as eval_cli

    def help_of(parser: argparse.ArgumentParser, prog: str) -> str:
        parser.prog = prog
        return parser.format_help()

    out = [
        "# CLI commands\n",
        "Generated from the parsers of `alignlit` (`alignlit.cli`) at every build of this site.\n",
        "## `alignlit`\n",
        f"```text\n{USAGE}\n```\n",
        "## `alignlit fit | validate | test | predict`\n",
        "LightningCLI over the stages: `alignlit fit --config STAGE.yaml [--key value ...]`. "
        "`alignlit fit --help` lists every trainer field; the model and data keys of every stage are in "
        "[Config keys](config/index.md); `--ckpt_path` resumes (see [Guarantees](../guarantees.md)).\n",
    ]
    tools = [
        ("alignlit sim", sim.build_parser()),
        ("alignlit eval --sim", eval_cli.build_parser()),
        ("alignlit eval (real prompts)", eval_data.build_parser()),
        ("alignlit sample", sample.build_parser()),
        ("alignlit score", score.build_parser()),
        ("alignlit serve", serve.build_parser()),
    ]
    for title, parser in tools:
        prog = title.split(" (")[0].replace(" --sim", "")
        out.append(f"## `{title}`\n")
        out.append(f"```text\n{help_of(parser, prog)}```\n")
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    out.append(f"### `{prog} {name}`\n")
                    out.append(f"```text\n{help_of(sub, f'{prog} {name}')}```\n")
    return "\n".join(out)


def api_page(package: str, title: str) -> str:
    return textwrap.dedent(
        f"""\
        # `alignlit.{package}`

        {title}. Generated from the docstrings by mkdocstrings.

        ::: alignlit.{package}
            options:
              show_root_heading: false
              show_submodules: false
        """
    )


def _recipe_text(path: Path) -> str:
    # the recipes' own pages link each other as folders/README.md; on the site they are pages
    return re.sub(r"\((?:\.\./)?([\w-]+)/README\.md\)", r"(\1.md)", path.read_text())


GENERATED: dict[str, str] = {}


def _generate() -> dict[str, str]:
    if GENERATED:
        return GENERATED
    stages, datamodules = stage_classes()
    index = [
        "# Config keys\n",
        "Every key of every stage (`model:`) and DataModule (`data:`), generated at each build from the "
        "signatures `alignlit fit` reads. The trainer's keys are Lightning's: `alignlit fit --help`.\n",
        "| `model:` stage | what it is |",
        "|---|---|",
    ]
    for cls in stages:
        GENERATED[f"reference/config/{cls.__name__}.md"] = config_page(cls, "model")
        index.append(f"| [`{cls.__name__}`]({cls.__name__}.md) | {_cell(_first_paragraph(cls))} |")
    index += ["", "| `data:` DataModule | what it is |", "|---|---|"]
    for cls in datamodules:
        GENERATED[f"reference/config/{cls.__name__}.md"] = config_page(cls, "data")
        index.append(f"| [`{cls.__name__}`]({cls.__name__}.md) | {_cell(_first_paragraph(cls))} |")
    GENERATED["reference/config/index.md"] = "\n".join(index) + "\n"
    GENERATED["reference/cli.md"] = cli_page()
    api_index = ["# API\n", "Generated from the docstrings (mkdocstrings), one page per package.\n"]
    for package, title in API_PACKAGES:
        GENERATED[f"reference/api/{package}.md"] = api_page(package, title)
        api_index.append(f"- [`alignlit.{package}`]({package}.md): {title}")
    GENERATED["reference/api/index.md"] = "\n".join(api_index) + "\n"
    GENERATED["recipes/index.md"] = _recipe_text(ROOT / "recipes" / "README.md")
    for readme in sorted((ROOT / "recipes").glob("*/README.md")):
        GENERATED[f"recipes/{readme.parent.name}.md"] = _recipe_text(readme)
    GENERATED["changelog.md"] = (ROOT / "CHANGELOG.md").read_text()
    return GENERATED


def _nav_pages(prefix: str) -> list:
    pages = sorted(p for p in _generate() if p.startswith(prefix) and not p.endswith("index.md"))
    return [f"{prefix}index.md", *[{Path(p).stem: p} for p in pages]]


def on_config(config, **kwargs):
    """Replace the nav's placeholders by the generated pages."""

    def expand(items):
        out = []
        for item in items:
            if isinstance(item, dict):
                (title, value), *_ = item.items()
                if value == "GENERATED_CONFIG":
                    value = _nav_pages("reference/config/")
                elif value == "GENERATED_API":
                    value = _nav_pages("reference/api/")
                elif value == "GENERATED_RECIPES":  # recipes/README.md's order
                    order = re.findall(
                        r"\(([\w-]+)/README\.md\)", (ROOT / "recipes" / "README.md").read_text()
                    )
                    value = ["recipes/index.md", *[f"recipes/{name}.md" for name in dict.fromkeys(order)]]
                elif isinstance(value, list):
                    value = expand(value)
                out.append({title: value})
            else:
                out.append(item)
        return out

    config["nav"] = expand(config["nav"])
    return config


def on_files(files: Files, config, **kwargs) -> Files:
    for path, text in _generate().items():
        files.append(File.generated(config, path, content=text))
    for png in sorted((ROOT / "benchmarks" / "results").glob("*.png")):
        files.append(File.generated(config, f"assets/results/{png.name}", abs_src_path=str(png)))
    return files


if __name__ == "__main__":  # print one generated page: python docs/hooks/generate.py reference/cli.md
    import sys

    buffer = io.StringIO()
    with redirect_stdout(buffer):
        pages = _generate()
    print(pages[sys.argv[1]] if len(sys.argv) > 1 else "\n".join(pages))
