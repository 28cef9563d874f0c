"""``alignlit serve``: one rollout engine, vLLM's own OpenAI-compatible server, for ``rollout.engine: vllm_server``.

Examples::

    alignlit serve out/quickstart/sft --port 8001                  # CPU: gloo weight transfer
    alignlit serve out/quickstart/sft --port 8001 -- --max-model-len 512
    alignlit serve /models/policy --port 8001 -- --tensor-parallel-size 2   # GPUs (not run here)
    alignlit serve out/quickstart/sft --print                      # only print the vllm serve command

It runs ``vllm serve MODEL_DIR`` (the process is replaced by it) with the flags
:func:`~alignlit.rollout.endpoint.vllm_serve_command` adds: float32 (``--dtype``), ``--generation-config vllm``
(no sampling defaults from the export), ``--enable-scale-out`` (token ids in and out, with log-probs and
the weight version of every token), alignlit's gloo weight-transfer backend and worker extension, and
``VLLM_SERVER_DEV_MODE=1`` (the weight-transfer routes). Everything after ``--`` goes to ``vllm serve`` as
it is. The OpenAI API (``/v1/completions``, ``/v1/chat/completions``) is served too.

Every route but ``GET /health`` needs ``Authorization: Bearer KEY`` (:mod:`alignlit.rollout.engine_auth`):
KEY is ``--api-key`` or ``--api-key-file``'s contents, else ``$ALIGNLIT_API_KEY``, else a fresh random key,
printed once. Give the trainer the same key (``ALIGNLIT_API_KEY`` or ``rollout.vllm_args.api_key_file``).
``--insecure-no-auth`` serves without a key, on a loopback address only.
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
    p.add_argument(
        "--api-key", default=None,
        help="the shared secret (visible in `ps`: prefer --api-key-file or $ALIGNLIT_API_KEY; default: generated)",
    )  # fmt: skip
    p.add_argument("--api-key-file", default=None, help="a file holding the shared secret")
    p.add_argument(
        "--insecure-no-auth", action="store_true",
        help="serve without a key: anyone who reaches the port can load weights (loopback hosts only)",
    )  # fmt: skip
    p.add_argument("--print", action="store_true", help="print the command and exit")
    p.epilog = "Arguments after -- are passed on to `vllm serve`."
    return p


def main(argv: Sequence[str] | None = None) -> int | None:
    from pathlib import Path

    from alignlit.rollout.endpoint import vllm_serve_command
    from alignlit.rollout.engine_auth import API_KEY_ENV, is_loopback, new_api_key, resolve_api_key

    argv = list(argv) if argv is not None else sys.argv[2:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args, extra = build_parser().parse_args(argv[:cut]), argv[cut + 1 :]
    if not (Path(args.model) / "config.json").exists():
        raise SystemExit(f"alignlit serve: {args.model} is not an exported model directory (no config.json)")
    given = [f for f, v in (("--api-key", args.api_key), ("--api-key-file", args.api_key_file)) if v]
    if args.insecure_no_auth:
        if given or os.environ.get(API_KEY_ENV):
            raise SystemExit(
                f"alignlit serve: --insecure-no-auth with {' and '.join(given) or '$' + API_KEY_ENV}: choose one"
            )
        if not is_loopback(args.host):
            raise SystemExit(
                f"alignlit serve: --insecure-no-auth is only allowed on a loopback address, not --host {args.host}: "
                "anyone who reaches the port could load weights into the engine"
            )
        key, source = None, None
    else:
        if len(given) == 2:
            raise SystemExit("alignlit serve: give --api-key or --api-key-file, not both")
        try:
            key = resolve_api_key(args.api_key, args.api_key_file)
        except ValueError as err:
            raise SystemExit(f"alignlit serve: {err}") from None
        source = given[0] if given else (f"${API_KEY_ENV}" if key else None)
        key = key or new_api_key()
    try:
        command, env = vllm_serve_command(
            args.model, host=args.host, port=args.port, dtype=args.dtype,
            seed=args.seed, logprobs_mode=args.logprobs_mode, extra=extra, api_key=key,
        )  # fmt: skip
    except ValueError as err:
        raise SystemExit(f"alignlit serve: {err}") from None
    shown = {k: ("<the API key>" if k == API_KEY_ENV else v) for k, v in env.items()}
    line = " ".join(f"{k}={v}" for k, v in shown.items()) + " " + shlex.join(command)
    print(f"alignlit serve: {line}", flush=True)
    if key is None:
        print(
            "alignlit serve: WARNING: no API key (--insecure-no-auth): anyone on this machine can load weights"
        )
    elif source is None:
        print(
            f"alignlit serve: API key (give the trainer the same: {API_KEY_ENV}=KEY or "
            f"rollout.vllm_args.api_key_file): {key}",
            flush=True,
        )
    else:
        print(f"alignlit serve: API key from {source}", flush=True)
    if args.print:
        return 0
    os.execvpe(command[0], command, {**os.environ, **env})
    return None  # not reached
