"""Each request field declared once: how it is given, carried and offered on the command line.

Every field of :class:`~mlxq.producer.params.GenerationRequest`, and of the parameter
groups it holds (:class:`~mlxq.producer.params.SamplingParams`,
:class:`~mlxq.producer.logits_params.LogitsParams`), carries an :class:`Option` in its
dataclass metadata. :meth:`Client.submit`'s keywords, the payload's keys (both ways) and
``mlxq submit``'s flags are read from those, so a new option is one field plus its docs and
its type in :class:`~mlxq.producer.params.SubmitOptions` (for type checkers; a test holds the
two lists equal).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from functools import cache
from typing import Any

_OPTION = "mlxq.option"
_GROUP = "mlxq.group"

Convert = Callable[[Any], Any]


@dataclass(frozen=True, slots=True)
class Option:
    """How one field travels (see :func:`option`)."""

    submit: bool = True
    given: Convert | None = None
    encode: Convert | None = None
    decode: Convert | None = None
    sparse: bool = False
    rides_with: str | None = None
    cli: Mapping[str, Any] | None = None
    payload: bool = True


@dataclass(frozen=True, slots=True)
class _Group:
    of: type
    build: Callable[..., Any]


@dataclass(frozen=True, slots=True)
class Spec:
    """One request option: its name, its :class:`Option`, the group field holding it
    (None: the request's own) and its default."""

    name: str
    option: Option
    group: str | None
    default: Any


def option(**kw: Any) -> dict[str, Option]:
    """A field's metadata declaring it a request option.

    Args:
        submit: A keyword of :meth:`Client.submit` (default); False: a payload key only.
        given: Turns a submit argument into the field's value, before the field's checks.
        encode: The field's value -> its payload value.
        decode: A payload value -> the field's value, before the field's checks.
        sparse: Written to the payload only when not at its default, so a job that asks
            for none of these reads as it did before they existed.
        rides_with: Written to the payload exactly when this other (earlier) field is.
        cli: ``argparse`` keywords of its ``mlxq submit`` flag (the default is the
            field's unless given); None: no flag.
        payload: False: a way to give the field's group (a submit keyword, a flag), never
            a payload key; the group's field carries the value.
    """
    return {_OPTION: Option(**kw)}


def flag(help: str, **argparse: Any) -> dict[str, Option]:
    """A field's metadata declaring it a submit option with an ``mlxq submit`` flag."""
    return option(cli={"help": help, **argparse})


def group(of: type, build: Callable[..., Any] | None = None) -> dict[str, Any]:
    """A field's metadata declaring it a group of options: the fields of ``of``, whose
    values ``build`` (default: ``of`` itself) turns into the field's value. Merged with
    :func:`option`'s, the field is an option too (its own payload key), and ``build``
    is also given its own value, when that is given."""
    return {_GROUP: _Group(of, build or of)}


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


@cache
def specs(cls: type) -> tuple[Spec, ...]:
    """Every option of ``cls``, its groups' in their place, in declaration order."""
    out: list[Spec] = []
    for f in dataclasses.fields(cls):
        if _GROUP in f.metadata:
            inner = dataclasses.fields(f.metadata[_GROUP].of)
            out += [
                Spec(g.name, g.metadata[_OPTION], f.name, _default(g))
                for g in inner
                if _OPTION in g.metadata
            ]
        if _OPTION in f.metadata:
            out.append(Spec(f.name, f.metadata[_OPTION], None, _default(f)))
    return tuple(out)


def given(cls: type, values: Mapping[str, Any]) -> dict[str, Any]:
    """Submit arguments (all options of ``cls``) as field values, through each ``given``."""
    return {
        s.name: _through(s.option.given, values[s.name]) for s in specs(cls) if s.name in values
    }


def decoded(cls: type, payload: Mapping[str, Any]) -> dict[str, Any]:
    """A payload's option values as field values, through each ``decode``."""
    return {
        s.name: _through(s.option.decode, payload[s.name])
        for s in specs(cls)
        if s.name in payload and s.option.payload
    }


def _through(convert: Convert | None, value: Any) -> Any:
    return value if convert is None else convert(value)


@cache
def _layout(cls: type) -> tuple[tuple[str, _Group | None, tuple[str, ...], bool], ...]:
    """``cls``'s fields as :func:`assemble` walks them: each field's name, its group (or
    None), the group's field names, and whether the field is an option of its own."""
    out = []
    for f in dataclasses.fields(cls):
        g = f.metadata.get(_GROUP)
        inner = tuple(x.name for x in dataclasses.fields(g.of)) if g is not None else ()
        out.append((f.name, g, inner, _OPTION in f.metadata))
    return tuple(out)


def assemble(cls: type, values: Mapping[str, Any], **fixed: Any) -> Any:
    """A ``cls`` from option values (absent ones take their defaults) and ``fixed``
    fields; each group is built before the request's own checks run."""
    kw = dict(fixed)
    for name, g, inner, option in _layout(cls):
        if g is not None:
            names = [*inner, name] if option and name in values else inner
            kw[name] = g.build(**{n: values[n] for n in names if n in values})
        elif option and name in values:
            kw[name] = values[name]
    return cls(**kw)


def encode(obj: Any) -> dict[str, Any]:
    """The payload values of ``obj``'s options, in declaration order (sparse ones only
    when set). A group set to None reads as its defaults."""
    out: dict[str, Any] = {}
    cls: type = type(obj)
    for s in specs(cls):
        if not s.option.payload:
            continue
        owner = obj if s.group is None else getattr(obj, s.group)
        value = s.default if owner is None else getattr(owner, s.name)
        if s.option.rides_with is not None:
            if s.option.rides_with not in out:
                continue
        elif s.option.sparse and value == s.default:
            continue
        out[s.name] = _through(s.option.encode, value)
    return out


def flags(cls: type) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """``(field, --flag, argparse keywords)`` of each option offered on the command line."""
    for s in specs(cls):
        if s.option.cli is not None:
            yield s.name, "--" + s.name.replace("_", "-"), {"default": s.default, **s.option.cli}
