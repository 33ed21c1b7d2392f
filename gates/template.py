"""The commented gates.yaml that `kvgate init` writes, generated from the configuration's own models.

One source: every key, its order and its comment come from the settings models (`Field(description=…)`, a
section's docstring, `examples` for a key left unset), each value from the quick profile (gates/profiles/
quick.yaml) or, for a key the profile leaves out, the validated default. A threshold's comment is its check's
meaning (kvcore/checks.py). A key without a description is an error here, so the template never goes silent.
"""

from __future__ import annotations

import inspect
import json
import re
import textwrap
from typing import Any, Optional, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from kvcore.checks import CHECKS
from workloads.storage.settings import StorageConfig

from .config import GatesConfig, load_config, profile_defaults

HEADER = """\
# kvgate gates.yaml: what to test, against what, and what counts as passing.
# Every key is optional: a missing key takes the profile's default. A typo is an
# error (exit 2), never a silent default. Run: kvgate run --config gates.yaml
# A commented-out key is unset; its line shows an example value.
"""
WIDTH = 118             # a line's most characters; a comment that does not fit beside its key goes above it
_PLAIN = re.compile(r"^[A-Za-z0-9_./][A-Za-z0-9_./ -]*$")
_LONG_FLOW = 60         # a mapping whose flow form is longer is written as a block (a workload)


def render_template() -> str:
    """The template's text: the configuration's keys in order, each with its comment and the quick profile's value."""
    validated = load_config(profile="quick").model_dump(mode="json", by_alias=True)
    # the storage path is made absolute when validated; the template keeps the default as written
    validated["storage"]["path"] = str(StorageConfig.model_fields["path"].default)
    lines = HEADER.splitlines()
    _section(GatesConfig, profile_defaults("quick"), validated, "", lines)
    return "\n".join(lines) + "\n"


def description_of(name: str, field: FieldInfo, path: str) -> str:
    """A key's comment: its description, else (a section) its model's docstring's first paragraph."""
    model = section_model(field.annotation)
    text = field.description or (_first_paragraph(model.__doc__) if model is not None else "")
    if not text:
        raise KeyError(f"{path}{name}: no description to write in the template (give the field a description)")
    return " ".join(text.split())


def section_model(annotation: Any) -> Optional[type[BaseModel]]:
    """The settings model a field holds (itself or Optional of it), None for anything else."""
    if get_origin(annotation) is Union:
        models = [a for a in get_args(annotation) if inspect.isclass(a) and issubclass(a, BaseModel)]
        others = [a for a in get_args(annotation) if a is not type(None) and a not in models]
        return models[0] if len(models) == 1 and not others else None
    return annotation if inspect.isclass(annotation) and issubclass(annotation, BaseModel) else None


def _section(model: type[BaseModel], profile: Any, validated: dict, path: str, out: list[str],
             written: Optional[dict] = None) -> None:
    """The keys of `model` under `path`; `written`: the unset sections already written out, by model."""
    written = {} if written is None else written
    indent = "  " * path.count(".")
    for name, field in model.model_fields.items():
        key = field.alias or name
        comment = description_of(key, field, path)
        value = profile[key] if isinstance(profile, dict) and key in profile else validated.get(key)
        sub = section_model(field.annotation)
        if sub is not None and isinstance(value, dict):
            _comment_above(indent, comment, out)
            out.append(f"{indent}{key}:")
            _section(sub, profile.get(key, {}) if isinstance(profile, dict) else {}, validated.get(key) or {},
                     f"{path}{key}.", out, written)
        elif value is None and sub is not None:
            _comment_above(indent, comment, out)
            if sub in written:       # one example of a kind of section is enough: the next ones point to it
                out.append(f"{indent}# {key}: {{…}}                       # the keys of {written[sub]}")
            else:
                written[sub] = f"{path}{key}"
                out.append(f"{indent}# {key}:")
                _unset_section(sub, f"{path}{key}.", out)
        elif value is None:
            example = field.examples[0] if field.examples else None
            _keyed(f"{indent}{'# ' if example is not None else ''}{key}: {_flow(example)}", comment, indent, out)
        elif isinstance(value, list) and value and all(isinstance(item, dict) for item in value):
            _comment_above(indent, comment, out)
            out.append(f"{indent}{key}:")
            for item in value:
                _item(f"{indent}  - {_flow(item)}", path, key, item, out)
        elif isinstance(value, dict) and len(_flow(value)) > _LONG_FLOW:
            _comment_above(indent, comment, out)
            out.append(f"{indent}{key}:")
            out += [f"{indent}  {name_}: {_flow(item)}" for name_, item in value.items() if item is not None]
        else:
            _keyed(f"{indent}{key}: {_flow(value)}", comment, indent, out)
        if not path:
            out.append("")


def _unset_section(model: type[BaseModel], path: str, out: list[str]) -> None:
    """A section left unset, commented out: each key with an example (or its default) and its comment."""
    indent = "  " * (path.count(".") - 1) + "#   "
    for name, field in model.model_fields.items():
        key = field.alias or name
        example = field.examples[0] if field.examples else (None if field.is_required() else field.get_default(
            call_default_factory=True))
        if isinstance(example, BaseModel):
            example = example.model_dump(mode="json", exclude_defaults=True) or None
        if example is None or example == {} or example == []:
            continue
        _keyed(f"{indent}{key}: {_flow(example)}", description_of(key, field, path), indent, out)


def _item(line: str, path: str, key: str, item: dict, out: list[str]) -> None:
    """A list item; a threshold says what its check means (beside it where it fits, else above it)."""
    gate = path.rstrip(".")
    meaning = next((c.meaning for c in CHECKS.get(gate, ()) if c.metric == item.get("metric")), None) \
        if key == "thresholds" else None
    if len(line) > WIDTH:           # too long for one line: a block mapping
        indent = " " * (len(line) - len(line.lstrip()))
        out += [f"{indent}{'- ' if i == 0 else '  '}{name}: {_flow(value)}"
                for i, (name, value) in enumerate((n, v) for n, v in item.items() if v not in (None, ""))]
    elif meaning is None:
        out.append(line)
    else:
        _keyed(line, meaning, line[: len(line) - len(line.lstrip())], out, column=0)


def _keyed(text: str, comment: str, indent: str, out: list[str], column: int = 32) -> None:
    """`text` with `comment` beside it (from `column` past the indent) where it fits, else above it."""
    padded = text.ljust(len(indent) + column) if column else text
    if len(padded) + 4 + len(comment) <= WIDTH:
        out.append(f"{padded}  # {comment}")
        return
    _comment_above(indent, comment, out)
    out.append(text)


def _comment_above(indent: str, comment: str, out: list[str]) -> None:
    out += textwrap.wrap(comment, WIDTH, initial_indent=f"{indent}# ", subsequent_indent=f"{indent}# ")


def _first_paragraph(doc: Optional[str]) -> str:
    return inspect.cleandoc(doc).split("\n\n")[0] if doc else ""


def _flow(value: Any) -> str:
    """YAML's flow form as a person writes it: [1M, 16M], {min: 3, max: 12}, \">=\", null."""
    if isinstance(value, dict):
        # a key at null or "" is one left unset (its default): left out
        return "{" + ", ".join(f"{key}: {_flow(item)}" for key, item in value.items() if item not in (None, "")) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_flow(item) for item in value) + "]"
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, str) and not _PLAIN.match(value):
        return json.dumps(value, ensure_ascii=False)
    return str(value)
