"""Settings at the edge: strict models, YAML files and errors that name the field.

A bad value raises `ConfigError` whose message names the field path, what was expected
and what was found::

    cache.disk.read_workers: expected an integer >= 1, found 0
"""

from __future__ import annotations

import re
import stat
from pathlib import Path
from typing import Annotated, Any, Mapping

import yaml
from pydantic import BaseModel, ConfigDict, Field, Strict, ValidationError

from .yaml_loader import CheckedLoader, YamlRefused

# YAML gives typed values: an integer field takes an integer (not true, 2.0 or "2"), a number field
# a number (not true); models reject inf and nan.
Int = Annotated[int, Strict()]
Float = Annotated[float, Strict()]

# What a run can mean: every byte size (parse_size) and every count (Count, check_count) of every settings
# model is held to these, so a mistyped exponent is refused at load instead of running out of memory or time.
MAX_BYTES = 2**60                  # 1 EiB: more than any memory, tier or storage a run meets
MAX_BYTES_TEXT = "1 EiB"
MAX_COUNT = 10**15                 # more than any count a run meets (parameters, tokens, blocks, requests)
MAX_CONTEXT_TOKENS = 10_000_000    # one prompt: the longest context models serve (10M tokens)

Count = Annotated[Int, Field(le=MAX_COUNT)]
ContextTokens = Annotated[Int, Field(le=MAX_CONTEXT_TOKENS)]

_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


class ConfigError(ValueError):
    """A configuration value is wrong; the message names field, expectation and finding."""


def parse_size(value: Any) -> int:
    """Parse a byte size: an integer, or a string such as "512MiB" or "4GB"; at most MAX_BYTES."""
    nbytes: float | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ValueError(f"expected a byte size >= 0, found {value}")
        nbytes = value
    elif isinstance(value, str):
        match = _SIZE_RE.match(value)
        if match and match.group(2).lower() in _UNITS:
            nbytes = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if nbytes is None:
        raise ValueError(f"expected a byte size (integer or string like '4GiB'), found {value!r}")
    if nbytes > MAX_BYTES:
        raise ValueError(f"expected a byte size of at most {MAX_BYTES_TEXT}, found {value!r}")
    return int(nbytes)


def check_count(value: Any, field: str, low: int = 1, high: int = MAX_COUNT) -> int:
    """`value` as a count in [low, high] (a plain int, not a bool); ConfigError naming `field` otherwise.
    The same bound as `Count` for figures read outside a settings model (a KV layout, a model's config.json)."""
    if type(value) is not int or value < low:
        raise ConfigError(f"{field}: expected an integer >= {low}, found {value!r}")
    if value > high:
        raise ConfigError(f"{field}: expected a value <= {high}, found {value}")
    return value


def format_size(nbytes: float) -> str:
    """A byte count as people read it: "512 B", "64.0 MiB", "8.0 GiB" (powers of 1024)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(nbytes) < 1024 or unit == "TiB":
            return f"{nbytes:.1f} {unit}" if unit != "B" else f"{int(nbytes)} B"
        nbytes /= 1024
    raise AssertionError("unreachable")


_EXPECTATIONS = {
    "int_type": "an integer", "int_parsing": "an integer", "int_from_float": "an integer",
    "float_type": "a number", "float_parsing": "a number",
    "bool_type": "true or false", "bool_parsing": "true or false",
    "string_type": "a string", "path_type": "a path",
    "model_type": "a mapping", "dict_type": "a mapping", "model_attributes_type": "a mapping",
    "list_type": "a list", "finite_number": "a finite number",
}


def _expected(item: Mapping[str, Any]) -> str:
    kind, ctx = item["type"], item.get("ctx", {})
    if kind in _EXPECTATIONS:
        return _EXPECTATIONS[kind]
    if kind == "greater_than_equal":
        return f"a value >= {ctx['ge']}"
    if kind == "greater_than":
        return f"a value > {ctx['gt']}"
    if kind == "less_than_equal":
        return f"a value <= {ctx['le']}"
    if kind == "less_than":
        return f"a value < {ctx['lt']}"
    if kind == "literal_error":
        return f"one of {ctx['expected']}"
    return item["msg"].removeprefix("Value error, ").removeprefix("expected ")


def field_path(root: str, loc: tuple) -> str:
    """("g3", "thresholds", 1, "metric") under root "" → "g3.thresholds[1].metric"."""
    path = root
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path


# A validator's message may name a field inside the value it checked: "[1].metric: expected …".
_INNER_FIELD = re.compile(
    r"^((?:\[\d+\]\.?)?[A-Za-z_]\w*(?:\[\d+\])?(?:\.[A-Za-z_]\w*)*|\[\d+\]): ((?:expected|unknown field) .*)$",
    re.S
)


def format_validation_error(error: ValidationError, root: str) -> str:
    """Turn a pydantic error into lines of `path: expected ..., found ...`."""
    lines = []
    for item in error.errors():
        path = field_path(root, item["loc"])
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] == "value_error" and "\n" in message:   # a section checked whole: each line its own field
            lines += [_under(path, line) for line in message.splitlines()]
            continue
        inner = _INNER_FIELD.match(message) if item["type"] == "value_error" else None
        if item["type"] == "extra_forbidden":
            lines.append(_at(path, f"unknown field (no such setting here), found {item.get('input')!r}"))
        elif item["type"] == "missing":
            lines.append(_at(path, "expected a value (required), found nothing"))
        elif inner:
            lines.append(_under(path, message, _INNER_FIELD))
        elif item["type"] == "value_error" and "found" in message:
            lines.append(_at(path, message))
        else:
            lines.append(_at(path, f"expected {_expected(item)}, found {item.get('input')!r}"))
    return "\n".join(lines)


def _at(path: str, text: str) -> str:
    """`text` said of the field at `path` (a model's own check, at no path, is said as it is)."""
    return f"{path}: {text}" if path else text


# One line of a section's own error list: "users: …", "turns[2].text: …".
_FIELD_LINE = re.compile(r"^((?:\[\d+\]\.?)?[A-Za-z_]\w*(?:\[\d+\])?(?:\.[A-Za-z_]\w*(?:\[\d+\])?)*|\[\d+\]): (.*)$")


def _under(path: str, line: str, field: re.Pattern = _FIELD_LINE) -> str:
    """One line of a validator's message under the field it checked: "users: expected …" → "PATH.users: …"."""
    inner = field.match(line)
    if inner is None:
        return _at(path, line)
    return f"{path}{'' if inner.group(1).startswith('[') or not path else '.'}{inner.group(1)}: {inner.group(2)}"


MAX_YAML_BYTES = 16 << 20     # a settings file of more is no settings file (/dev/zero, a log named by mistake)


class _NotARegularFile(Exception):
    pass


def _check_readable_file(path: Path) -> None:
    """A regular file of at most MAX_YAML_BYTES: a device, a FIFO or a huge file is refused before it is read (a
    FIFO would block, /dev/zero read without end)."""
    if not path.exists():
        return                      # reading it says so, as an OSError
    found = path.stat()
    kind = found.st_mode
    if not stat.S_ISREG(kind):
        raise _NotARegularFile("a directory" if stat.S_ISDIR(kind) else "a FIFO" if stat.S_ISFIFO(kind) else
                               "a device" if stat.S_ISCHR(kind) or stat.S_ISBLK(kind) else "no regular file")
    if found.st_size > MAX_YAML_BYTES:
        raise _NotARegularFile(f"a file of {found.st_size:,} bytes (at most {MAX_YAML_BYTES:,})")


def load_yaml_file(path: Any, root: str) -> Any:
    """Parsed YAML of a file (None when it holds no document); unreadable or malformed files, a key given
    twice and aliases that expand without bound (kvcore.yaml_loader) raise ConfigError under `root`.
    Every YAML file kvgate reads is read here."""
    try:
        _check_readable_file(Path(path))
        return yaml.load(Path(path).read_text(encoding="utf-8"), Loader=CheckedLoader)
    except _NotARegularFile as refused:
        raise ConfigError(f"{root}: expected a YAML file, found {refused} ({path})") from None
    except OSError as error:
        raise ConfigError(f"{root}: expected a readable YAML file, found {error.strerror or error} ({path})") from None
    except UnicodeDecodeError as error:
        raise ConfigError(f"{root}: expected a UTF-8 text file, found byte 0x{error.object[error.start]:02x} "
                          f"at offset {error.start} ({path})") from None
    except yaml.YAMLError as error:
        raise ConfigError(f"{root}: expected valid YAML, found {error}") from None
    except YamlRefused as refused:
        where = f"{root}: {field_path('', refused.loc)}" if refused.loc else root
        raise ConfigError(f"{where}: {refused.message}") from None
    except RecursionError:
        raise ConfigError(f"{root}: expected YAML nested a few hundred levels deep at most, found deeper ({path})") \
            from None


def load_yaml_mapping(path: Any, root: str) -> dict:
    """A settings file's top-level mapping; an empty file (or one of comments only) and any other
    top-level value raise ConfigError: an empty file is as likely a truncated or wrong one as a wish for
    the defaults, and leaving out the file says that wish plainly."""
    data = load_yaml_file(path, root)
    if data is None:
        raise ConfigError(f"{root}: expected a mapping at the top level, found an empty file (no settings: "
                          "leave out --config to run on the defaults)")
    if not isinstance(data, dict):
        raise ConfigError(f"{root}: expected a mapping at the top level, found {type(data).__name__}")
    return data


class StrictModel(BaseModel):
    """Settings models: unknown keys are errors, values are frozen once validated."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, allow_inf_nan=False)


# Field checks the settings models of every room share.

def size_text(value: Any) -> str:
    """A byte size (parse_size) kept as the text the user wrote it in."""
    parse_size(value)
    return value if isinstance(value, str) else str(value)


def repeated(values: list) -> list:
    """The values that appear more than once, sorted (an "each once" check says them)."""
    return sorted({v for v in values if values.count(v) > 1})


def absolute_path(value: Any) -> Any:
    """A directory path made absolute now (the suites run elsewhere and must read the same place)."""
    if isinstance(value, str) and not value.strip():
        raise ValueError("expected a directory path, found an empty string")
    return Path(value).absolute() if isinstance(value, (str, Path)) else value


Positive = Annotated[Count, Field(ge=1)]


def positive_size(value: Any) -> Any:
    """A byte size > 0, kept as given."""
    if parse_size(value) <= 0:
        raise ValueError(f"expected a byte size > 0, found {value!r}")
    return value


def each_once(values: list, noun: str = "value") -> list:
    twice = repeated(values)
    if twice:
        raise ValueError(f"expected each {noun} once, found {twice} repeated")
    return values
