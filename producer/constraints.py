"""Structured outputs: what a job's answer must match, checked at submit without a model.

A :class:`Constraint` is one of a JSON schema, any JSON object, a regular expression, a
choice among strings, or a grammar (Lark, or GBNF, as llguidance reads them), held as a
canonical string so equal constraints compare and hash equal (the worker compiles each
once per model and keys its cache on it). The producer compiles a constraint's grammar
with llguidance (no tokenizer, no MLX) before anything reaches Redis, so a schema or
regex that cannot compile is refused at submit naming the field it came in; the worker
compiles it again against its tokenizer and fails only that job if that fails.

The request shapes map here, once, for every entry: :meth:`Client.submit`'s keywords
(:func:`from_options`), OpenAI's ``response_format`` (:func:`from_response_format`) and
vLLM's ``structured_outputs`` (:func:`from_structured_outputs`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from mlxq.producer.validate import bad, text

#: The kinds of constraint.
KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
#: Longest constraint (its canonical text, in characters): a schema or grammar past it is
#: refused; compiling one costs the worker's decode thread time and memory.
MAX_CONSTRAINT_CHARS = 64 * 1024
#: Most strings a ``choice`` may list.
MAX_CHOICES = 1024
#: How llguidance lays out JSON unless the schema's own ``x-guidance`` says otherwise:
#: compact (no free whitespace), so a weak model cannot spend its tokens on blanks.
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False}
_ANY_OBJECT = '{"type":"object"}'


@dataclass(frozen=True, slots=True)
class Constraint:
    """What a job's answer must match: ``kind`` (one of :data:`KINDS`) and ``value``, its
    canonical text (a schema as compact JSON in its own key order, which is the order an
    answer writes its properties in, as OpenAI's do; a choice as a JSON list,
    a regex or grammar as given, ``""`` for ``json_object``).

    Build one with :meth:`of_json_schema`, :meth:`of_regex`, :meth:`of_choice`,
    :meth:`of_grammar` or :meth:`of_json_object`, which also compile it.

    Raises:
        PayloadError: (a ``ValueError``) a kind not in :data:`KINDS`, a value that is no
            string or longer than :data:`MAX_CONSTRAINT_CHARS`.
    """

    kind: str
    value: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise bad("constraint.kind", self.kind, f"must be one of {', '.join(KINDS)}")
        text("constraint.value", self.value)
        if len(self.value) > MAX_CONSTRAINT_CHARS:
            raise bad(
                f"constraint ({self.kind})",
                f"<{len(self.value)} characters>",
                f"at most {MAX_CONSTRAINT_CHARS} characters",
            )

    @classmethod
    def of_json_schema(cls, schema: Any, field: str = "json_schema") -> Constraint:
        """Answers that are JSON documents valid against ``schema`` (a map, or its JSON
        text), laid out compactly unless its ``x-guidance`` asks otherwise.

        Raises:
            PayloadError: naming ``field``: not a JSON object, too large, or does not compile.
        """
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise bad(field, schema, f"is not JSON ({e})") from None
        if not isinstance(schema, Mapping):
            raise bad(field, schema, "must be a JSON schema (an object)")
        try:
            # Not sorted: llguidance writes properties in the schema's order, and an answer
            # whose keys came alphabetically would write ``arguments`` before ``name``.
            canonical = json.dumps(schema, separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError) as e:
            raise bad(field, schema, f"must be JSON data ({e})") from None
        except RecursionError:
            raise bad(field, "<a deep object>", "nested too deeply") from None
        return _checked(cls, "json_schema", canonical, field)

    @classmethod
    def of_json_object(cls) -> Constraint:
        """Answers that are any JSON object (OpenAI's ``json_object`` mode)."""
        return cls("json_object", "")

    @classmethod
    def of_regex(cls, pattern: Any, field: str = "regex") -> Constraint:
        """Answers that match ``pattern`` whole (Rust ``regex`` syntax, as llguidance reads it).

        Raises:
            PayloadError: naming ``field``: not a string, empty, or does not compile.
        """
        if not isinstance(pattern, str) or not pattern:
            raise bad(field, pattern, "must be a non-empty regular expression")
        return _checked(cls, "regex", pattern, field)

    @classmethod
    def of_choice(cls, options: Any, field: str = "choice") -> Constraint:
        """Answers that are exactly one of ``options`` (strings).

        Raises:
            PayloadError: naming ``field``: not a non-empty list of non-empty strings.
        """
        if isinstance(options, (str, bytes)) or not isinstance(options, Sequence) or not options:
            raise bad(field, options, "must be a non-empty list of strings")
        if len(options) > MAX_CHOICES:
            raise bad(field, f"<{len(options)} strings>", f"at most {MAX_CHOICES}")
        for i, o in enumerate(options):
            if not isinstance(o, str) or not text(f"{field}[{i}]", o):
                raise bad(f"{field}[{i}]", o, "must be a non-empty string")
        return _checked(cls, "choice", json.dumps(list(options), ensure_ascii=False), field)

    @classmethod
    def of_grammar(cls, grammar: Any, field: str = "grammar") -> Constraint:
        """Answers the grammar's ``start`` rule derives: Lark (llguidance's dialect) or
        GBNF (llama.cpp's), told apart as llguidance does.

        Raises:
            PayloadError: naming ``field``: not a string, empty, or does not compile.
        """
        if not isinstance(grammar, str) or not grammar.strip():
            raise bad(field, grammar, "must be a non-empty grammar (Lark or GBNF)")
        return _checked(cls, "grammar", grammar, field)

    def llguidance_grammar(self) -> str:
        """The grammar llguidance's ``LLMatcher`` compiles for this constraint.

        Raises:
            ValueError: the grammar cannot be converted (a GBNF grammar llguidance
                cannot read).
        """
        return _grammar(self.kind, self.value)

    def to_payload(self) -> dict[str, str]:
        """The constraint as a job payload carries it."""
        return {"kind": self.kind, "value": self.value}

    @classmethod
    def from_payload(cls, value: Any) -> Constraint:
        """Check a payload's ``constraint`` (see :meth:`to_payload`) and compile it.

        Raises:
            PayloadError: naming ``constraint``.
        """
        if isinstance(value, Constraint):
            return check(value, "constraint")
        if not isinstance(value, Mapping) or set(value) != {"kind", "value"}:
            raise bad("constraint", value, "must be a map of 'kind' and 'value'")
        return _checked(cls, value["kind"], value["value"], "constraint")


def _checked(cls: type[Constraint], kind: Any, value: Any, field: str) -> Constraint:
    if isinstance(value, str) and len(value) > MAX_CONSTRAINT_CHARS:
        raise bad(field, f"<{len(value)} characters>", f"at most {MAX_CONSTRAINT_CHARS}")
    return check(cls(kind, value), field)


def check(constraint: Constraint, field: str) -> Constraint:
    """``constraint`` once it compiles (a cached check: a sweep of one schema compiles it
    once per process).

    Raises:
        PayloadError: naming ``field`` and why it does not compile.
    """
    error = compile_error(constraint.kind, constraint.value)
    if error:
        shown = constraint.value or constraint.kind
        raise bad(field, shown, f"does not compile: {error}")
    return constraint


@lru_cache(maxsize=256)
def compile_error(kind: str, value: str) -> str:
    """Why llguidance cannot compile this constraint (no tokenizer), or ``""``."""
    from llguidance import LLMatcher

    try:
        grammar = _grammar(kind, value)
    except ValueError as e:
        return _first_lines(str(e))
    failed, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    return _first_lines(messages[0]) if failed and messages else ""


def _first_lines(message: str, lines: int = 4, chars: int = 300) -> str:
    short = " | ".join(x.strip() for x in message.strip().splitlines()[:lines] if x.strip())
    return short if len(short) <= chars else f"{short[:chars]}..."


def _grammar(kind: str, value: str) -> str:
    from llguidance import LLMatcher, grammar_from

    if kind == "json_schema":
        return LLMatcher.grammar_from_json_schema(value, defaults=JSON_OPTIONS)  # type: ignore[arg-type]
    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema(_ANY_OBJECT, defaults=JSON_OPTIONS)  # type: ignore[arg-type]
    if kind == "regex":
        return LLMatcher.grammar_from_regex(value)
    if kind == "choice":
        return grammar_from("choice", value)
    return grammar_from("grammar", value)


def from_options(
    *,
    constraint: Any = None,
    response_format: Any = None,
    json_schema: Any = None,
    regex: Any = None,
    choice: Any = None,
    grammar: Any = None,
) -> Constraint | None:
    """The constraint :meth:`Client.submit`'s keywords ask for (at most one given).

    Raises:
        PayloadError: two given, or the one given is bad (naming it).
    """
    given = {
        k: v
        for k, v in (
            ("constraint", constraint),
            ("response_format", response_format),
            ("json_schema", json_schema),
            ("regex", regex),
            ("choice", choice),
            ("grammar", grammar),
        )
        if v is not None
    }
    if len(given) > 1:
        names = sorted(given)
        raise bad(names[1], given[names[1]], f"give at most one of {', '.join(names)}")
    if not given:
        return None
    ((name, value),) = given.items()
    if name == "constraint":
        return Constraint.from_payload(value)
    if name == "response_format":
        return from_response_format(value)
    if name == "json_schema":
        return Constraint.of_json_schema(value)
    if name == "regex":
        return Constraint.of_regex(value)
    if name == "choice":
        return Constraint.of_choice(value)
    return Constraint.of_grammar(value)


def from_response_format(value: Any, field: str = "response_format") -> Constraint | None:
    """OpenAI's ``response_format``: ``{"type": "text"}`` (None: no constraint),
    ``{"type": "json_object"}`` or ``{"type": "json_schema", "json_schema": {"name",
    "schema", "strict"}}``. A JSON string of one of these is read too (``mlxq submit``).

    Raises:
        PayloadError: naming the field (``response_format.json_schema.schema``, ...).
    """
    if isinstance(value, str):
        value = _json_or_word(value, field)
    if not isinstance(value, Mapping):
        raise bad(field, value, "must be an object with a 'type'")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint.of_json_object()
    if kind != "json_schema":
        raise bad(f"{field}.type", kind, "must be one of text, json_object, json_schema")
    spec = value.get("json_schema")
    if not isinstance(spec, Mapping):
        raise bad(f"{field}.json_schema", spec, "must be an object with a 'schema'")
    name = spec.get("name")
    if name is not None and not isinstance(name, str):
        raise bad(f"{field}.json_schema.name", name, "must be a string")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad(f"{field}.json_schema.strict", strict, "must be true or false")
    if "schema" not in spec:
        raise bad(f"{field}.json_schema.schema", None, "required")
    return Constraint.of_json_schema(spec["schema"], f"{field}.json_schema.schema")


def _json_or_word(value: str, field: str) -> Any:
    if value in ("text", "json_object"):
        return {"type": value}
    try:
        return json.loads(value)
    except ValueError:
        raise bad(field, value, "must be a JSON object, 'text' or 'json_object'") from None


#: vLLM's ``structured_outputs`` keys mlxq reads, and how each becomes a constraint.
STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")


def from_structured_outputs(value: Any, field: str = "structured_outputs") -> Constraint | None:
    """vLLM's ``structured_outputs``: exactly one of ``json`` (a schema, or its JSON
    text), ``regex``, ``choice``, ``grammar`` or ``json_object: true``. Other keys
    vLLM defines (backend options) are refused by name, as mlxq does not honour them.

    Raises:
        PayloadError: naming the field (``structured_outputs.regex``, ...).
    """
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise bad(field, value, "must be an object")
    # vLLM's backend options (whitespace, fallback) are honoured only when off.
    unknown = sorted(str(k) for k, v in value.items() if k not in STRUCTURED_KEYS and v)
    if unknown:
        raise bad(f"{field}.{unknown[0]}", value[unknown[0]], "not supported by mlxq")
    given = {
        k: v for k, v in value.items() if k in STRUCTURED_KEYS and v is not None and v is not False
    }
    if len(given) != 1:
        raise bad(field, sorted(given), f"give exactly one of {', '.join(STRUCTURED_KEYS)}")
    ((key, v),) = given.items()
    return from_structured_key(key, v, f"{field}.{key}")


def from_structured_key(key: str, value: Any, field: str) -> Constraint:
    """One of vLLM's ``structured_outputs`` keys (:data:`STRUCTURED_KEYS`) and its value,
    errors naming ``field`` (``structured_outputs.regex``, or vLLM's older ``guided_regex``).

    Raises:
        PayloadError: naming ``field``.
    """
    if key == "json":
        return Constraint.of_json_schema(value, field)
    if key == "regex":
        return Constraint.of_regex(value, field)
    if key == "choice":
        return Constraint.of_choice(value, field)
    if key == "grammar":
        return Constraint.of_grammar(value, field)
    if value is not True:
        raise bad(field, value, "must be true")
    return Constraint.of_json_object()


#: vLLM's older names for ``structured_outputs``' keys, which many clients still send.
GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def from_body(body: Mapping[str, Any]) -> Constraint | None:
    """An OpenAI request body's constraint: its ``response_format``, vLLM's
    ``structured_outputs`` or one of vLLM's older ``guided_*`` fields (at most one of
    them); None when none asks for one.

    Raises:
        PayloadError: naming the field (``response_format.json_schema.schema``, ...).
    """
    asked = [
        k for k in ("response_format", "structured_outputs", *GUIDED) if body.get(k) is not None
    ]
    if len(asked) > 1:
        raise bad(asked[1], body[asked[1]], f"give one of {', '.join(asked)}, not both")
    if not asked:
        return None
    name = asked[0]
    if name == "response_format":
        return from_response_format(body[name])
    if name == "structured_outputs":
        return from_structured_outputs(body[name])
    return from_structured_key(GUIDED[name], body[name], name)
