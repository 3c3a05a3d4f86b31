"""The papers' prompt templates, as a registry users can extend.

A template turns one dataset record (a dict) into prompt text. It is named by one of:

* a built-in or registered name (``mbpp``, ``humaneval``, ``cnn_dm``, ``alpaca``, ``gsm8k``);
* ``field:<name>``: the raw value of one field;
* a Python format string with ``{field}`` placeholders (anything containing ``{``), e.g.
  ``"Question: {question}\\nAnswer:"`` or ``"{text}\\n{test_list[0]}"``.

The built-ins reproduce DISCO App. B (Figs. 7-10). The paper prints every prompt between
triple quotes. For MBPP the quotes are part of the prompt (a docstring holding the task and one
test, following Ben Allal et al. and Fried et al., so the model sees the function signature); for
CNN-DM and Alpaca they only delimit the figure, and Alpaca is the Stanford template verbatim
(Taori et al.), which ends at ``### Response:`` without a newline.
"""

from __future__ import annotations

import string
from collections.abc import Callable

from specstop.errors import UserError

Template = Callable[[dict], str]

ALPACA_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:"
)
ALPACA_NO_INPUT = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:"
)
MBPP_FORMAT = '"""{text}\n{test_list[0]}\n"""'
CNN_DM_FORMAT = "Summarize:\n{article}\nSummary:\n"


def _kind(value) -> str:
    return "null" if value is None else {list: "a list", dict: "an object", bool: "a boolean"}.get(
        type(value), f"a number ({value!r})" if isinstance(value, (int, float)) else type(value).__name__
    )


def _field(record: dict, name: str):
    try:
        return record[name]
    except KeyError:
        raise UserError(
            f"prompt record has no field {name!r} (fields: {sorted(record)}); "
            "pick a template that matches the data set, or use `field:<name>` / a format string"
        ) from None


def _text_field(record: dict, name: str) -> str:
    """A field that is the whole prompt: it must be a string (``null`` must not become "None")."""
    value = _field(record, name)
    if not isinstance(value, str):
        raise UserError(f"field {name!r} is {_kind(value)}, not text; every prompt must be a string")
    return value


class _TextFormatter(string.Formatter):
    """``str.format_map`` that refuses null, list and object values (they would render as "None", "[...]")."""

    def format_field(self, value, format_spec):
        if value is None or isinstance(value, (list, dict)):
            raise UserError(f"a template placeholder is {_kind(value)}, not text; fix the record or the template")
        return super().format_field(value, format_spec)


def _format(fmt: str, record: dict) -> str:
    try:
        return _TextFormatter().vformat(fmt, (), record)
    except KeyError as err:
        raise UserError(
            f"template {fmt!r} needs field {err.args[0]!r}, but the record has only {sorted(record)}; "
            "fix the template's placeholders or the data set's field names"
        ) from None
    except (IndexError, AttributeError, ValueError, TypeError) as err:
        if isinstance(err, UserError):
            raise
        raise UserError(f"template {fmt!r} cannot be filled from this record: {err}") from None


def _mbpp(record: dict) -> str:
    tests = _field(record, "test_list")
    if not tests:
        raise UserError("MBPP record has an empty test_list; the mbpp template needs its first test")
    return _format(MBPP_FORMAT, record)


def _alpaca(record: dict) -> str:
    # Stanford Alpaca picks the template by whether the optional input is non-empty.
    has_input = bool(str(record.get("input") or "").strip())
    return _format(ALPACA_WITH_INPUT if has_input else ALPACA_NO_INPUT, record)


TEMPLATES: dict[str, Template] = {
    "mbpp": _mbpp,
    "humaneval": lambda r: _text_field(r, "prompt"),
    "cnn_dm": lambda r: _format(CNN_DM_FORMAT, r),
    "alpaca": _alpaca,
    "gsm8k": lambda r: _text_field(r, "question"),
}


def register_template(name: str, template: str | Template) -> None:
    """Add a named template: a callable ``record -> str`` or a format string with ``{field}``s."""
    if name.startswith("field:") or "{" in name:
        raise ValueError(f"template name {name!r} is reserved syntax; pick a plain name")
    TEMPLATES[name] = (lambda r, _fmt=template: _format(_fmt, r)) if isinstance(template, str) else template


def render_template(name_or_format: str, record: dict) -> str:
    """Render one record with a named template, ``field:<name>``, or a format string."""
    if name_or_format in TEMPLATES:
        return TEMPLATES[name_or_format](record)
    if name_or_format.startswith("field:"):
        return _text_field(record, name_or_format[len("field:") :])
    if "{" in name_or_format:
        return _format(name_or_format, record)
    raise UserError(
        f"unknown prompt template {name_or_format!r}: use one of {sorted(TEMPLATES)}, `field:<name>`, "
        "or a format string with {field} placeholders"
    )
