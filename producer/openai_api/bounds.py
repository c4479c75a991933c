"""Bounds on an OpenAI request body before its fields are read: unknown fields (warned of
once per name, refused past :data:`MAX_UNKNOWN_FIELDS` in one object or a name longer than
:data:`MAX_FIELD_NAME_CHARS`), nesting past :data:`MAX_DEPTH`, and strings UTF-8 cannot carry
(a lone surrogate). Each refusal names where, so one hostile body costs one 400 and never
grows the process or its log.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Container, Mapping
from typing import Any

from mlxq.producer.errors import InvalidRequest

log = logging.getLogger("mlxq.openai")

#: Field names remembered as warned about; past this many, new ones are not told by name.
MAX_WARNED_NAMES = 256
#: Most fields mlxq does not know that one object of a body may carry, and the longest
#: name of one: a body past either is refused (remembering and logging such names would
#: let one request grow the process and its log without bound).
MAX_UNKNOWN_FIELDS = 64
MAX_FIELD_NAME_CHARS = 256
#: Deepest nesting of objects and arrays a body may have (OpenAI's own shapes use 4).
MAX_DEPTH = 32
_warned: set[str] = set()
_SURROGATE = re.compile("[\ud800-\udfff]")


def _ignore(name: str) -> None:
    """Warn of an unknown field once per name, while fewer than :data:`MAX_WARNED_NAMES`
    names were told (then once, that names are no longer told)."""
    if name in _warned:
        return
    if len(_warned) < MAX_WARNED_NAMES:
        _warned.add(name)
        log.warning("ignoring request field %r: mlxq does not support it", name)
    elif len(_warned) == MAX_WARNED_NAMES:
        _warned.add("")  # never a field name: marks that this was told
        log.warning(
            "ignoring request fields mlxq does not support: %d names told, no more are",
            MAX_WARNED_NAMES,
        )


def unknown_fields(obj: Mapping[str, Any], known: Container[str], where: str) -> None:
    """Warn of the fields of ``obj`` not in ``known`` (each as ``where + name``).

    Raises:
        InvalidRequest: more than :data:`MAX_UNKNOWN_FIELDS` of them, or one whose name
            is longer than :data:`MAX_FIELD_NAME_CHARS`.
    """
    unknown = [k for k in obj if k not in known]
    if len(unknown) > MAX_UNKNOWN_FIELDS:
        raise InvalidRequest(
            f"{where or 'the body'}: {len(unknown)} fields mlxq does not know "
            f"(at most {MAX_UNKNOWN_FIELDS}), e.g. {cut(unknown[0])!r}",
            where.rstrip(".") or None,
        )
    for k in unknown:
        if len(k) > MAX_FIELD_NAME_CHARS:
            raise InvalidRequest(
                f"{where}{cut(k)!r}...: a field name of {len(k)} characters "
                f"(at most {MAX_FIELD_NAME_CHARS})",
                where.rstrip(".") or None,
            )
    for k in unknown:
        _ignore(f"{where}{k}")


def cut(name: str, limit: int = 40) -> str:
    return name[:limit]


def _child(path: str, key: str | int) -> str:
    """The path of ``key`` (an object's field or an array's index) under ``path``."""
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def problem_in(value: Any) -> tuple[str, str] | None:
    """Where ``value`` (a decoded JSON body) nests deeper than :data:`MAX_DEPTH` or holds
    a string UTF-8 cannot carry (a lone surrogate, from an escape like ``\\ud800``), and
    what; None if nowhere. Iterative: a deep body cannot exhaust the stack."""
    stack: list[tuple[Any, str, int]] = [(value, "", 0)]
    while stack:
        v, path, depth = stack.pop()
        if depth > MAX_DEPTH:
            return path, f"nested deeper than {MAX_DEPTH} levels"
        items = v.items() if isinstance(v, dict) else enumerate(v) if isinstance(v, list) else ()
        for k, item in items:
            here = _child(path, k)
            if isinstance(k, str) and not k.isascii() and _SURROGATE.search(k):
                return here, "a field name that is not valid Unicode (a lone surrogate)"
            if isinstance(item, str):
                if not item.isascii() and _SURROGATE.search(item):
                    return here, "not valid Unicode text (a lone surrogate)"
            elif isinstance(item, (dict, list)):
                stack.append((item, here, depth + 1))
    return None
