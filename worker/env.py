"""``mlxq worker``'s options from the environment: each has an ``MLXQ_*`` variable.

A service manager starts the worker with no command line of its own to speak of: systemd
reads an ``EnvironmentFile``, launchd's shell sources one. So every option can come from
the environment (``--max-batch`` from ``MLXQ_MAX_BATCH``, ``--model`` from ``MLXQ_MODEL``),
the command line winning. An option is registered here as it is added to the parser
(argparse's own default stays :data:`UNSET`, so a given option is told from an absent one),
and :meth:`EnvOptions.resolve` fills what the command line left out: from the variable
when it is set and not empty, else the built-in default. A variable's value is checked as
the option's would be, and an error names the variable and the value.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any


class _Unset:
    def __repr__(self) -> str:
        return "UNSET"

    def __bool__(self) -> bool:  # reads as "not given" to ``arg or fallback`` code too
        return False


#: argparse's default for a registered option: not given on the command line.
UNSET: Any = _Unset()

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def env_switch(name: str, default: bool) -> bool:
    """An ``MLXQ_*`` switch of the worker's own (not an option): on where the variable is
    ``1``, off where ``0``, ``default`` where it is unset or anything else."""
    given = os.environ.get(name, "").strip()
    return given == "1" if given in ("0", "1") else default


def env_name(flag: str) -> str:
    """The variable of ``--some-option``: ``MLXQ_SOME_OPTION``."""
    return "MLXQ_" + flag.lstrip("-").replace("-", "_").upper()


def switch(text: str) -> bool:
    """A flag's variable: 1/true/yes/on or 0/false/no/off (any case)."""
    word = text.strip().lower()
    if word in _TRUE:
        return True
    if word in _FALSE:
        return False
    raise ValueError(f"give one of {'/'.join(_TRUE)} or {'/'.join(_FALSE)}")


@dataclass(frozen=True, slots=True)
class EnvOption:
    """One option: its flag, where argparse puts it, its variable, how the variable's text
    reads (the option's own ``type``), its default, and whether one of the two is needed."""

    flag: str
    dest: str
    env: str
    parse: Callable[[str], Any]
    default: Any
    required: bool = False
    absent: Any = UNSET  # what argparse leaves when the flag is not given


def _why(e: Exception) -> str:
    text = str(e)
    if isinstance(e, ValueError) and text.startswith(("invalid literal", "could not convert")):
        return "not a number"
    return text


class EnvOptions:
    """The options of one command that read the environment, by ``dest``."""

    def __init__(self) -> None:
        self.options: dict[str, EnvOption] = {}

    def add(
        self,
        p: argparse.ArgumentParser,
        flag: str,
        *,
        help: str,
        default: Any = None,
        type: Callable[[str], Any] = str,
        env: str | None = None,
        shown: str | None = None,
        required: bool = False,
        **kw: Any,
    ) -> None:
        """``p.add_argument(flag, ...)`` that also reads ``env`` (by default the flag's
        :func:`env_name`); ``shown`` is how ``--help`` states the default (by default
        the default itself)."""
        env = env or env_name(flag)
        dest = kw.pop("dest", None) or flag.lstrip("-").replace("-", "_")
        parse = _with_choices(type, kw.get("choices"))
        # argparse's append starts from its default, so that one must be None; the
        # values given one per flag each stay one string (``type`` reads the variable).
        absent = None if kw.get("action") == "append" else UNSET
        if absent is UNSET:
            kw["type"] = type
        self.options[dest] = EnvOption(flag, dest, env, parse, default, required, absent)
        said = f"${env}" + ("" if required else f", else {default if shown is None else shown}")
        p.add_argument(flag, dest=dest, default=absent, help=f"{help} (default: {said})", **kw)

    def add_switch(
        self, p: argparse.ArgumentParser, flag: str, *, dest: str, help: str, env: str | None = None
    ) -> None:
        """A flag that turns ``dest`` off (``--no-routing``); its variable set to a true
        word (``MLXQ_NO_ROUTING=1``) does the same."""
        env = env or env_name(flag)
        self.options[dest] = EnvOption(flag, dest, env, lambda t: not switch(t), True)
        p.add_argument(
            flag,
            dest=dest,
            action="store_const",
            const=False,
            default=UNSET,
            help=f"{help} (default: off; ${env}=1 turns it on)",
        )

    def add_flag(
        self, p: argparse.ArgumentParser, flag: str, *, help: str, env: str | None = None
    ) -> None:
        """A flag that turns its option on (``--allow-mixed-models``); its variable set to a
        true word (``MLXQ_ALLOW_MIXED_MODELS=1``) does the same."""
        env = env or env_name(flag)
        dest = flag.lstrip("-").replace("-", "_")
        self.options[dest] = EnvOption(flag, dest, env, switch, False)
        p.add_argument(
            flag,
            dest=dest,
            action="store_const",
            const=True,
            default=UNSET,
            help=f"{help} (default: off; ${env}=1 turns it on)",
        )

    def resolve(self, args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> None:
        """Fill each option the command line left out, in place: from its variable when
        set and not empty, else its default. Every option is filled before an error is
        raised, so ``args`` is whole either way.

        Raises:
            ValueError: a variable that does not read as its option's value (naming the
                variable and its text), or a required option given neither way.
        """
        environ = os.environ if environ is None else environ
        errors = []
        for o in self.options.values():
            if getattr(args, o.dest, o.absent) is not o.absent:
                continue
            setattr(args, o.dest, o.default)
            raw = environ.get(o.env, "")
            if not raw.strip():
                if o.required:
                    errors.append(f"{o.flag} is needed: give it, or set ${o.env}")
                continue
            try:
                setattr(args, o.dest, o.parse(raw))
            except (ValueError, TypeError, argparse.ArgumentTypeError) as e:
                errors.append(f"{o.env}={raw!r} (for {o.flag}): {_why(e)}")
        if errors:
            raise ValueError("; ".join(errors))


def _with_choices(
    parse: Callable[[str], Any], choices: Sequence[Any] | None
) -> Callable[[str], Any]:
    if not choices:
        return parse

    def check(text: str) -> Any:
        value = parse(text.strip())
        if value not in choices:
            raise ValueError(f"give one of {', '.join(map(str, choices))}")
        return value

    return check
