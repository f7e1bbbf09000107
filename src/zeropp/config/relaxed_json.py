"""Config text that is not strict JSON: Hjson (DeepSpeed reads every config file with ``hjson``), or without the
``hjson`` package the relaxed JSON that hand-written configs use.

DeepSpeed parses config files with ``hjson.load``, so a DeepSpeed config may carry comments, unquoted keys,
trailing commas, or be written in Hjson proper (quoteless strings, no commas: what ``hjson.dump`` writes). zeropp
reads strict JSON first. A file that is not strict JSON is read:

* with ``hjson`` (``pip install hjson``) when it is installed: every Hjson file DeepSpeed reads;
* else as relaxed JSON: JSON with ``//``, ``#`` and ``/* */`` comments, unquoted keys (``train_batch_size: 1``)
  and trailing commas (``[1, 2,]``). Other Hjson (quoteless string values, objects without commas) is an error
  that says to install ``hjson``.

:func:`relaxed_to_json` rewrites the relaxed forms into JSON text, keeping every line break where it was, so that
a parse error's line number is the file's.
"""
from __future__ import annotations

import importlib
import json
from typing import Any, Callable, Optional

_BARE = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_$-.")


class RelaxedJSONError(ValueError):
    """Config text that neither JSON, Hjson (when installed) nor the relaxed forms can read."""

    def __init__(self, message: str, line: int, column: int) -> None:
        super().__init__(message)
        self.message, self.line, self.column = message, line, column


def hjson_module() -> Optional[Any]:
    """The ``hjson`` package when it is installed, else None."""
    try:
        return importlib.import_module("hjson")
    except ImportError:
        return None


def loads_config(text: str, object_pairs_hook: Callable[[list[tuple[str, Any]]], Any]) -> Any:
    """Parse config text that strict JSON refused: with ``hjson`` when installed, else as relaxed JSON.

    Raises :class:`RelaxedJSONError` with the line and column of the first problem.
    """
    hjson = hjson_module()
    if hjson is not None:
        try:
            return hjson.loads(text, object_pairs_hook=object_pairs_hook)
        except hjson.HjsonDecodeError as err:
            raise RelaxedJSONError(f"invalid Hjson: {err.msg}", err.lineno, err.colno) from None
    try:
        return json.loads(relaxed_to_json(text), object_pairs_hook=object_pairs_hook)
    except json.JSONDecodeError as err:
        raise RelaxedJSONError(
            f"{err.msg} (JSON with comments, unquoted keys and trailing commas is read; other Hjson forms, such as "
            "quoteless strings or objects without commas, need the hjson package: pip install hjson)",
            err.lineno, err.colno) from None


def relaxed_to_json(text: str) -> str:
    """``text`` with comments blanked out (line breaks kept), unquoted keys quoted and trailing commas dropped."""
    out: list[str] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == '"':
            j = _string_end(text, i)
            out.append(text[i:j])
            i = j
        elif c == "#" or text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append("".join(ch if ch == "\n" else " " for ch in text[i:j]))
            i = j
        elif c in "}]":
            _drop_trailing_comma(out)
            out.append(c)
            i += 1
        elif c in _BARE and _starts_key(out):
            j = i
            while j < n and text[j] in _BARE:
                j += 1
            word = text[i:j]
            out.append(json.dumps(word) if _is_key(text, j) else word)
            i = j
        else:
            out.append(c)
            i += 1
    return "".join(out)


def _string_end(text: str, start: int) -> int:
    """The index just past the JSON string that opens at ``start`` (the end of the text if unterminated)."""
    i = start + 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
            continue
        if text[i] == '"':
            return i + 1
        i += 1
    return len(text)


def _last_token(out: list[str]) -> str:
    """The last non-blank character written so far ("" at the start)."""
    for piece in reversed(out):
        stripped = piece.rstrip()
        if stripped:
            return stripped[-1]
    return ""


def _starts_key(out: list[str]) -> bool:
    """Whether a word here stands where an object key may (after ``{`` or ``,``)."""
    return _last_token(out) in ("{", ",")


def _is_key(text: str, end: int) -> bool:
    """Whether the word ending at ``end`` is followed by ``:`` (blanks and comments between are not read)."""
    j = end
    while j < len(text) and text[j] in " \t\r\n":
        j += 1
    return j < len(text) and text[j] == ":"


def _drop_trailing_comma(out: list[str]) -> None:
    """Remove a comma that is the last token written (a trailing comma before ``}`` or ``]``)."""
    for k in range(len(out) - 1, -1, -1):
        stripped = out[k].rstrip()
        if not stripped:
            continue
        if stripped[-1] == ",":
            out[k] = stripped[:-1] + out[k][len(stripped):]
        return
