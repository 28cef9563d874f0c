"""``alignlit serve``: one rollout engine, vLLM's own OpenAI-compatible server, for ``rollout.engine: vllm_server``.

Examples::

    alignlit serve out/quickstart/sft --port 8001                  # CPU: gloo weight transfer
    alignlit serve out/quickstart/sft --port 8001 -- --max-model-len 512
    alignlit serve /models/policy --port 8001 -- --tensor-parallel-size 2   # GPUs (not run here)
    alignlit serve out/quickstart/sft --print                      # only print the vllm serve command

It runs ``vllm serve MODEL_DIR`` (the process is replaced by it) with the flags
:func:`~alignlit.rollout.server.vllm_serve_command` adds: float32 (``--dtype``), ``--generation-config vllm``
(no sampling defaults from the export), ``--enable-scale-out`` (token ids in and out, with log-probs and
the weight version of every token), alignlit's gloo weight-transfer backend and worker extension, and
``VLLM_SERVER_DEV_MODE=1`` (the weight-transfer routes; keep the port off public networks). Everything after
``--`` goes to ``vllm serve`` as it is. The OpenAI API (``/v1/completions``, ``/v1/chat/completions``)
is served too.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Sequence


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="alignlit serve", description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="the policy's exported Hugging Face directory (weights + tokenizer)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="port (default: %(default)s)")
    p.add_argument("--dtype", default="float32", help="engine dtype (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="engine seed (default: %(default)s)")
    p.add_argument(
        "--logprobs-mode", default="processed_logprobs", choices=("processed_logprobs", "raw_logprobs"),
        help="which log-probs the engine reports (default: %(default)s)",
    )  # fmt: skip
    p.add_argument("--print", action="store_true", help="print the command and exit")
    p.epilog = "Arguments after -- are passed on to `vllm serve`."
    return p


def main(argv: Sequence[str] | None = None) -> int | None:
    from pathlib import Path

    from alignlit.rollout.endpoint import vllm_serve_command

    argv = list(argv) if argv is not None else sys.argv[2:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args, extra = build_parser().parse_args(argv[:cut]), argv[cut + 1 :]
    if not (Path(args.model) / "config.json").exists():
        raise SystemExit(f"alignlit serve: {args.model} is not an exported model directory (no config.json)")
    command, env = vllm_serve_command(
        args.model, host=args.host, port=args.port, dtype=args.dtype,
        seed=args.seed, logprobs_mode=args.logprobs_mode, extra=extra,
    )  # fmt: skip
    line = " ".join(f"{k}={v}" for k, v in env.items()) + " " + shlex.join(command)
    print(f"alignlit serve: {line}", flush=True)
    if args.print:
        return 0
    os.execvpe(command[0], command, {**os.environ, **env})
    return None  # not reached
