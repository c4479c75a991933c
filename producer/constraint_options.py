"""The submit keywords and ``mlxq submit`` flags that ask for a constraint.

:class:`ConstraintOptions` declares them as a group of the request's ``constraint`` field
(:mod:`mlxq.producer.fields`): each is a way to give it, none is a payload key, and
:func:`~mlxq.producer.constraints.from_options` turns the one given into the
:class:`~mlxq.producer.constraints.Constraint` the payload carries.
"""

from __future__ import annotations

from argparse import ArgumentTypeError
from dataclasses import dataclass, field
from typing import Any

from mlxq.producer.fields import option


def _text_or_file(arg: str) -> str:
    """A flag's text, or with ``@path`` the file's."""
    if not arg.startswith("@"):
        return arg
    try:
        with open(arg[1:], encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise ArgumentTypeError(f"cannot read {arg[1:]!r}: {e.strerror}") from None


@dataclass(frozen=True, slots=True)
class ConstraintOptions:
    """The submit keywords and ``mlxq submit`` flags that ask for a :class:`Constraint`
    (at most one per job); none is a payload key: the request's ``constraint`` is."""

    response_format: Any = field(
        default=None,
        metadata=option(
            payload=False,
            cli=dict(
                type=_text_or_file,
                metavar="JSON",
                help="OpenAI response_format: JSON text, @file, 'text' or 'json_object' "
                "(default: none)",
            ),
        ),
    )
    json_schema: Any = field(
        default=None,
        metadata=option(
            payload=False,
            cli=dict(
                type=_text_or_file,
                metavar="JSON",
                help="the answer is JSON valid against this schema: JSON text or @file "
                "(default: none)",
            ),
        ),
    )
    regex: Any = field(
        default=None,
        metadata=option(
            payload=False, cli=dict(help="the answer matches this regex whole (default: none)")
        ),
    )
    choice: Any = field(
        default=None,
        metadata=option(
            payload=False,
            cli=dict(
                action="append", help="the answer is one of these, repeatable (default: none)"
            ),
        ),
    )
    grammar: Any = field(
        default=None,
        metadata=option(
            payload=False,
            cli=dict(
                type=_text_or_file,
                help="the answer derives from this Lark or GBNF grammar: text or @file "
                "(default: none)",
            ),
        ),
    )
