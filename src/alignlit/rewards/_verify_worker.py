"""The math answer check itself, and the worker process that runs it (:mod:`alignlit.rewards.verify_pool`).

This module imports only the standard library at import time (``math_verify`` inside the functions that
need it), so that a worker starts as ``python -P _verify_worker.py READ_FD WRITE_FD`` without importing
``alignlit`` (torch) and the parent can import the same text functions for its fast exact path.

- :func:`normalize_digits`: Unicode decimal digits (``٧٢``, ``७२``, full-width ``７２``) and full-width ASCII
  forms as ASCII; nothing else changes (superscripts such as ``x²`` keep their meaning);
- :func:`final_answer`: a response's final answer, the last ``\\boxed{...}``, else the last ``#### N``;
- :func:`check`: 1.0/0.0 for a gold answer against a response, with ``math_verify``.

The worker reads ``[task_id, gold, response]`` JSON frames and answers ``[task_id, status, score, detail]``
(``status``: ``ok``, ``bad_gold`` when math-verify reads no expression from the gold, ``error`` when
parsing/verifying raised).
"""

from __future__ import annotations

import json
import re
import sys
import unicodedata

_FULLWIDTH = range(0xFF01, 0xFF5F)
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_HASHES = re.compile(r"####[ \t]*([^\n]*)")
_LETTER = re.compile(r"[A-Za-z]")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")


def normalize_digits(text: str) -> str:
    """``text`` with every Unicode decimal digit (category Nd: Arabic-Indic ``٧``, Devanagari ``७``,
    full-width ``７`` ...) as its ASCII digit and full-width ASCII forms (``（``, ``＋``) as ASCII."""
    if text.isascii():
        return text
    out = []
    for c in text:
        if unicodedata.category(c) == "Nd":
            out.append(str(unicodedata.digit(c)))
        elif ord(c) in _FULLWIDTH:
            out.append(unicodedata.normalize("NFKC", c))
        else:
            out.append(c)
    return "".join(out)


def boxed_span(text: str) -> tuple[int, int] | None:
    """``(start, end)`` of the content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) whose braces
    balance (``text[end]`` is its closing brace), else None. Linear in ``len(text)``: a brace that an
    unclosed later box never closes cannot close an earlier one either, so each stretch is scanned once."""
    limit = len(text)
    for match in reversed(list(_BOXED.finditer(text))):
        depth, start = 1, match.end()
        for i in range(start, limit):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    return start, i
        limit = match.start()
    return None


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) with balanced braces, else None."""
    span = boxed_span(text)
    return None if span is None else text[span[0] : span[1]]


def clean_answer(answer: str) -> str:
    """An answer's text for comparison: without outer spaces and ``$``, a final ``.`` and thousands commas."""
    answer = answer.strip().strip("$").strip()
    answer = answer.removesuffix(".").strip()
    return _THOUSANDS.sub("", answer)


def final_answer(response: str) -> tuple[str, str] | None:
    """The response's final answer and how it was found: ``("boxed", content)`` for the last ``\\boxed{}``,
    else ``("hashes", N)`` for the last ``#### N`` line, else None (then math-verify's own extraction of the
    whole text decides, see :func:`check`)."""
    boxed = last_boxed(response)
    if boxed is not None:
        return "boxed", boxed
    hashes = _HASHES.findall(response)
    if hashes and hashes[-1].strip():
        return "hashes", hashes[-1]
    return None


def _expression(parsed: list) -> bool:
    """Whether math-verify read an expression (it hands back only the unparsed text when it did not)."""
    return any(not isinstance(x, str) for x in parsed)


def _parse(mv, text: str) -> list:
    return mv.parse(text, parsing_timeout=None)


def parse_gold(mv, gold: str) -> list:
    """The gold answer (already reduced, e.g. ``72`` or ``\\frac{1}{2}``) parsed by math-verify."""
    return _parse(mv, gold if "$" in gold or "\\boxed" in gold else f"${gold}$")


def parse_response(mv, response: str) -> list:
    """What math-verify compares: the last ``\\boxed{}``, else the last ``#### N``, else math-verify's
    extraction from the whole text (``the answer is 18``, the last number or expression); a short text
    without letters is first read as one expression (a bare ``(1, 2)`` is the interval, not ``2``)."""
    found = final_answer(response)
    if found is not None:
        kind, answer = found
        return _parse(mv, f"\\boxed{{{answer}}}" if kind == "boxed" else f"${clean_answer(answer)}$")
    text = response.strip()
    if 0 < len(text) <= 200 and "$" not in text and not _LETTER.search(text):
        parsed = _parse(mv, f"${text}$")  # a bare expression: "(1, 2)", "3/4", "-5"
        if _expression(parsed):
            return parsed
    return _parse(mv, response)


def check(mv, gold: str, response: str, golds: dict | None = None) -> tuple[str, float]:
    """``("ok", 1.0 or 0.0)``, or ``("bad_gold", 0.0)`` when math-verify reads no expression from the gold.
    Unbounded: run it in a worker (:class:`~alignlit.rewards.verify_pool.VerifierPool`), never in the
    training process."""
    parsed_gold = golds.get(gold) if golds is not None else None
    if parsed_gold is None:
        parsed_gold = parse_gold(mv, gold)
        if golds is not None:
            if len(golds) > 4096:
                golds.clear()
            golds[gold] = parsed_gold
    if not _expression(parsed_gold):
        return "bad_gold", 0.0
    parsed = parse_response(mv, response)
    if not parsed:
        return "ok", 0.0
    return "ok", float(mv.verify(parsed_gold, parsed, timeout_seconds=None))


def _serve(read_fd: int, write_fd: int, memory_mb: int) -> None:
    from multiprocessing.connection import Connection

    tasks, results = Connection(read_fd, writable=False), Connection(write_fd, readable=False)
    sys.set_int_max_str_digits(0)  # a 10,000-digit gold is a number, not an unreadable gold
    if memory_mb > 0:
        import resource

        limit = memory_mb * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    try:
        import logging

        import math_verify as mv

        logging.getLogger("math_verify").setLevel(logging.ERROR)
    except Exception as e:
        results.send_bytes(json.dumps(["import_error", f"{type(e).__name__}: {e}"]).encode())
        return
    results.send_bytes(json.dumps(["ready", ""]).encode())
    golds: dict = {}
    while True:
        try:
            task_id, gold, response = json.loads(tasks.recv_bytes())
        except EOFError:  # the parent is gone or closed the pool
            return
        try:
            status, score = check(mv, gold, response, golds)
            detail = ""
        except BaseException as e:
            status, score, detail = "error", 0.0, f"{type(e).__name__}: {str(e)[:300]}"
        results.send_bytes(json.dumps([task_id, status, score, detail]).encode())


if __name__ == "__main__":
    _serve(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
