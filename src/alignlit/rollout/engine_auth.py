"""The shared secret of served rollout engines (``alignlit serve``, ``rollout.engine: vllm_server``).

A served engine runs vLLM's server with weight routes open (``/collective_rpc``, ``/update_weights``,
``/update_weight_version``): whoever can call them decides which weights the trainer's rollouts come from. So
every route but ``GET /health`` needs ``Authorization: Bearer <key>`` (:class:`BearerAuthMiddleware`, loaded into
vLLM's server with ``--middleware``), the engine proves to the trainer that it holds the same key
(:func:`key_proof`, checked when the client connects), and the weight group's rendezvous keys are derived from it
(:func:`group_prefix`): a process without the key can neither call the engine nor join the weight push.

The key reaches the engine in the environment variable ``ALIGNLIT_API_KEY`` (never on its command line, where
``ps`` shows it) and the trainer through ``ALIGNLIT_API_KEY`` or a key file (:func:`resolve_api_key`).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import os
import re
import secrets
import stat
import warnings
from collections.abc import Mapping
from pathlib import Path

API_KEY_ENV = "ALIGNLIT_API_KEY"
"""The environment variable holding the shared secret (the engine's and the trainer's)."""
PUBLIC_PATHS = ("/health",)
"""Routes answered without the key (``GET``/``HEAD`` only): liveness probes; they reveal nothing."""
MIDDLEWARE = "alignlit.rollout.engine_auth.BearerAuthMiddleware"
MIN_KEY_CHARS = 16
_KEY = re.compile(r"[!-~]+")  # visible ASCII: it travels in an HTTP header


class Secret(str):
    """A key that does not show itself in ``repr`` (tracebacks, ``vars()``, logged objects)."""

    def __repr__(self) -> str:
        return "<secret>"


def new_api_key() -> str:
    """A fresh random key (256 bits, URL-safe)."""
    return secrets.token_urlsafe(32)


def check_api_key(key: str, source: str) -> str:
    """``key`` if it can serve as the shared secret, else ValueError naming ``source`` (never the key)."""
    if not isinstance(key, str) or not _KEY.fullmatch(key):
        raise ValueError(
            f"the API key from {source} must be visible ASCII characters without spaces (it travels in an "
            "HTTP header)"
        )
    if len(key) < MIN_KEY_CHARS:
        raise ValueError(
            f"the API key from {source} has {len(key)} characters, fewer than {MIN_KEY_CHARS}: use a random one, "
            "e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))'"
        )
    return Secret(key)


def read_api_key_file(path: str | Path) -> str:
    """The key in ``path`` (surrounding whitespace removed); a file others can read gets a warning."""
    path = Path(path).expanduser()
    try:
        text = path.read_text()
        mode = path.stat().st_mode
    except OSError as err:
        raise ValueError(f"cannot read the API key file {path}: {err.strerror or err}") from None
    if mode & (stat.S_IRGRP | stat.S_IROTH):
        warnings.warn(f"the API key file {path} is readable by other users: chmod 600 {path}", stacklevel=2)
    return check_api_key(text.strip(), f"the file {path}")


def resolve_api_key(
    api_key: str | None = None,
    api_key_file: str | Path | None = None,
    *,
    environ: Mapping[str, str] | None = None,
) -> str | None:
    """The shared secret: ``api_key``, else the contents of ``api_key_file``, else ``$ALIGNLIT_API_KEY``; None
    when none is set (an engine started with ``--insecure-no-auth`` on a loopback address)."""
    if api_key is not None and api_key_file is not None:
        raise ValueError("give the API key or an API key file, not both")
    if api_key is not None:
        return check_api_key(api_key, "the api_key argument")
    if api_key_file is not None:
        return read_api_key_file(api_key_file)
    value = (os.environ if environ is None else environ).get(API_KEY_ENV)
    return check_api_key(value, f"${API_KEY_ENV}") if value else None


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (``localhost``, ``127.0.0.0/8``, ``::1``)."""
    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _mac(key: str | None, what: bytes, nonce: str) -> str:
    return hmac.new((key or "").encode(), what + b":" + nonce.encode(), hashlib.sha256).hexdigest()


def key_proof(key: str | None, nonce: str) -> str | None:
    """What an engine holding ``key`` answers to the client's ``nonce`` (None without a key): the client checks
    it, so an engine that does not hold the trainer's key is refused."""
    return None if not key else _mac(key, b"alignlit-engine-proof", nonce)


def group_prefix(key: str | None, nonce: str) -> str:
    """The weight group's rendezvous keys live under this prefix: only a process holding ``key`` (and this
    push's ``nonce``) can find them."""
    return "alignlit-weights/" + _mac(key, b"alignlit-weight-group", nonce)[:32]


class BearerAuthMiddleware:
    """ASGI middleware refusing (HTTP 401) every request without ``Authorization: Bearer <key>``, except
    ``GET``/``HEAD`` of :data:`PUBLIC_PATHS`; websockets without it are closed. The key comes from
    ``$ALIGNLIT_API_KEY`` (``alignlit serve`` sets it); without one the middleware refuses to start.
    Keys are compared with :func:`hmac.compare_digest`."""

    def __init__(self, app, api_key: str | None = None):
        key = api_key if api_key is not None else os.environ.get(API_KEY_ENV, "")
        if not key:
            raise RuntimeError(
                f"{MIDDLEWARE}: ${API_KEY_ENV} is not set, so every request would be refused; start the engine "
                "with alignlit serve (it generates and prints a key)"
            )
        self.app = app
        self._key = check_api_key(key, f"${API_KEY_ENV}").encode()

    def authorized(self, headers) -> bool:
        values = [v for k, v in headers if k.lower() == b"authorization"]
        if len(values) != 1:
            return False
        scheme, _, token = values[0].strip().partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._key)

    async def __call__(self, scope, receive, send) -> None:
        kind = scope.get("type")
        if kind not in ("http", "websocket"):  # lifespan
            return await self.app(scope, receive, send)
        path, root = scope.get("path", ""), scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root) :]
        public = kind == "http" and path in PUBLIC_PATHS and scope.get("method") in ("GET", "HEAD")
        if public or self.authorized(scope.get("headers") or []):
            return await self.app(scope, receive, send)
        if kind == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return None
        body = json.dumps(
            {"error": "unauthorized: send Authorization: Bearer <the key alignlit serve printed>"}
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"www-authenticate", b"Bearer"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
        return None
