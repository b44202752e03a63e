"""Generic typed configs: YAML files -> (frozen) dataclass trees, and back.

Schemas are plain dataclasses defined elsewhere; this module only knows how to validate a
mapping against their field annotations. It sits at the bottom of the import layering: stdlib
and yaml only, nothing from `jax_routeweaver`.

Every `ConfigError` message is one line that starts with the source and the dotted key, e.g.
``configs/a.yaml:7: optim.lr: expected a number, got 'abc' (str)``. The source is the file and
line that set the key, ``override 'optim.lr=abc'`` for a ``key=value`` override, "<defaults>"
or "<dict>".

Numeric fields declare their valid range where they are declared, with :func:`bounded`
(``lr: float = bounded(1e-6, "(0, inf)")``); the loader checks every value it reads against it
(``optim.lr: must be in (0, inf), got -1.0 (float)``).

YAML notes: PyYAML follows YAML 1.1, which reads ``1e-6`` as a string, so numeric strings are
accepted for int and float fields. A top-level ``extends: <path>`` names a base file (relative
to the including file); mappings merge recursively, anything else (lists too) replaces.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import enum
import functools
import os
import re
import tempfile
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar, Union

import yaml

T = TypeVar("T")

_SECRET_KEY = re.compile(
    r"api_key|apikey|secret|password|passwd|token$|_token(?!s)|authorization|bearer", re.IGNORECASE)
# Tokenizer special tokens ("<|endoftext|>") are vocabulary, not credentials.
_SPECIAL_TOKEN_KEY = re.compile(r"(pad|bos|eos|unk|sep|cls|mask|stop)_token", re.IGNORECASE)
REDACTED = "<redacted>"


class ConfigError(ValueError):
    """An invalid config; the message starts with the source and the dotted key."""


def _error(source: str, key: str, message: str) -> ConfigError:
    return ConfigError(f"{source}: {key}: {message}" if key else f"{source}: {message}")


RANGE = "range"  # the `dataclasses.Field.metadata` key of a field's `Range`


@dataclasses.dataclass(frozen=True)
class Range:
    """A set of valid numbers: intervals joined by "or", each ``[lo, hi]`` (closed), ``(lo, hi)``
    (open), mixed, or a single number; ``inf`` / ``-inf`` are unbounded, e.g. ``"(0, 1]"``,
    ``"[1, inf)"``, ``"-1 or [1, inf)"``. NaN is never in a range. `str()` gives `spec`."""

    spec: str
    intervals: tuple[tuple[float, float, bool, bool], ...]  # (lo, hi, lo_open, hi_open)

    @classmethod
    def parse(cls, spec: str) -> Range:
        """Parse `spec` (ValueError if malformed or empty, e.g. ``"[2, 1]"``)."""
        intervals = []
        for part in (p.strip() for p in spec.split(" or ")):
            match = re.fullmatch(r"([\[(])\s*(\S+)\s*,\s*(\S+)\s*([\])])", part)
            try:
                if match:
                    lo, hi = float(match[2]), float(match[3])
                    intervals.append((lo, hi, match[1] == "(", match[4] == ")"))
                else:
                    intervals.append((float(part), float(part), False, False))
            except ValueError:
                raise ValueError(f"range {spec!r}: cannot parse {part!r}") from None
            lo, hi, lo_open, hi_open = intervals[-1]
            if not (lo < hi or (lo == hi and not lo_open and not hi_open)):
                raise ValueError(f"range {spec!r}: {part!r} is empty")
        return cls(spec, tuple(intervals))

    def __contains__(self, value: object) -> bool:
        if isinstance(value, bool) or not isinstance(value, int | float):
            return False
        return any((lo < value if lo_open else lo <= value)
                   and (value < hi if hi_open else value <= hi)
                   for lo, hi, lo_open, hi_open in self.intervals)

    def __str__(self) -> str:
        return self.spec


def bounded(default: Any, valid: str) -> Any:
    """A dataclass field defaulting to `default` whose numbers must lie in `valid` (a `Range`
    spec, checked here for `default`); the loader checks each value it reads (the items of a
    list, the values of a mapping; None and non-numbers pass). A dict default is copied per
    instance."""
    valid_range = Range.parse(valid)
    _check_range(valid_range, default, lambda _key: "bounded", "default")
    metadata = {RANGE: valid_range}
    if isinstance(default, dict | list):
        return dataclasses.field(default_factory=functools.partial(copy.deepcopy, default),
                                 metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def field_range(f: dataclasses.Field) -> Range | None:
    """The `Range` declared with `bounded` for field `f`, or None."""
    return f.metadata.get(RANGE)


def _check_range(valid: Range, value: Any, src: Callable[[str], str], key: str) -> None:
    if isinstance(value, Mapping):
        for k, v in value.items():
            _check_range(valid, v, src, _join(key, str(k)))
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            _check_range(valid, v, src, f"{key}[{i}]")
    elif isinstance(value, int | float) and not isinstance(value, bool) and value not in valid:
        raise _error(src(key), key, f"must be in {valid}, {_got(value, key)}")


def decode_utf8(raw: bytes, path: object) -> str:
    """`raw` (the bytes of file `path`) as text; ValueError naming the file, line, column and
    byte if it is not UTF-8."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line, line_start = raw.count(b"\n", 0, err.start) + 1, raw.rfind(b"\n", 0, err.start) + 1
        raise ValueError(f"{path}:{line}: not valid UTF-8 (byte 0x{raw[err.start]:02x} at "
                         f"column {err.start - line_start + 1})") from None


def _is_secret_key(key: object) -> bool:
    return (isinstance(key, str) and not key.lower().endswith("_env")
            and _SECRET_KEY.search(key) is not None and not _SPECIAL_TOKEN_KEY.fullmatch(key))


def _got(value: Any, key: str) -> str:
    if value is None:
        return "got null"
    # Never echo what may be a credential into an error (errors end up in logs).
    name = re.sub(r"\[\d+\]", "", key).rsplit(".", 1)[-1]
    shown = REDACTED if _is_secret_key(name) else repr(value)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    return f"got {shown} ({type(value).__name__})"


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _init_fields(cls: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if f.init]


def _unknown_key(source: str, key: str, name: object, valid: Sequence[str]) -> ConfigError:
    close = difflib.get_close_matches(str(name), valid, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return _error(source, key, f"unknown key; {hint}valid keys: {', '.join(valid)}")


def _build(cls: type[T], data: Any, src: Callable[[str], str], prefix: str) -> T:
    if not isinstance(data, Mapping):
        raise _error(src(prefix), prefix, f"expected a mapping ({cls.__name__}), "
                                          f"{_got(data, prefix)}")
    fields, hints = _init_fields(cls), _hints(cls)
    names = [f.name for f in fields]
    for name in data:
        if name not in names:
            key = _join(prefix, str(name))
            raise _unknown_key(src(key), key, name, names)
    kwargs = {}
    for f in fields:
        key = _join(prefix, f.name)
        if f.name in data:
            kwargs[f.name] = _convert(hints[f.name], data[f.name], src, key)
            if (valid := field_range(f)) is not None:
                _check_range(valid, kwargs[f.name], src, key)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise _error(src(key), key, "missing required field")
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as err:
        raise _error(src(prefix), prefix, str(err)) from err


def _type_name(tp: Any) -> str:
    return tp.__name__ if isinstance(tp, type) else repr(tp).replace("typing.", "")


def _as_number(value: Any) -> int | float | None:
    if isinstance(value, str):  # YAML 1.1 reads 1e-6 as a string
        for parse in (int, float):
            try:
                return parse(value)
            except ValueError:
                pass
        return None
    return value if isinstance(value, int | float) and not isinstance(value, bool) else None


def _convert(tp: Any, value: Any, src: Callable[[str], str], key: str) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)

    def bad(expected: str) -> ConfigError:
        return _error(src(key), key, f"expected {expected}, {_got(value, key)}")

    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        errors = []
        for option in options:
            try:
                return _convert(option, value, src, key)
            except ConfigError as err:
                errors.append(err)
        if len(options) == 1:
            raise errors[0]
        raise bad(f"one of {' | '.join(map(_type_name, options))}")
    if value is None or tp is type(None):
        if value is None and tp is type(None):
            return None
        raise bad("null" if tp is type(None) else _type_name(tp))
    if dataclasses.is_dataclass(tp):
        return value if isinstance(value, tp) else _build(tp, value, src, key)
    if tp is bool:
        if not isinstance(value, bool):
            raise bad("a boolean (true/false)")
        return value
    if tp is float:
        if (number := _as_number(value)) is None:
            raise bad("a number")
        return float(number)
    if tp is int:
        number = _as_number(value)
        if number is None or (isinstance(number, float) and not number.is_integer()):
            raise bad("an integer")
        return int(number)
    if tp is str:
        if not isinstance(value, str):
            raise bad("a string")
        return value
    if origin is Literal:
        for allowed in args:
            if type(value) is type(allowed) and value == allowed:
                return allowed
        raise bad(f"one of {list(args)}")
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        for member in tp:
            if value is member or (type(value) is type(member.value) and value == member.value):
                return member
        raise bad(f"one of {[m.value for m in tp]}")
    if tp in (list, tuple) or origin in (list, tuple):
        if not isinstance(value, list | tuple):
            raise bad("a list")
        item_types = (args[0] if args else Any,) * len(value)
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise bad(f"a list of {len(args)} items")
            item_types = args
        items = [_convert(t, v, src, f"{key}[{i}]")
                 for i, (t, v) in enumerate(zip(item_types, value, strict=True))]
        return tuple(items) if tuple in (tp, origin) else items
    if tp in (dict, Mapping) or origin in (dict, Mapping):
        if not isinstance(value, Mapping):
            raise bad("a mapping")
        key_type, item_type = args or (Any, Any)
        return {_convert(key_type, k, src, _join(key, str(k))):
                _convert(item_type, v, src, _join(key, str(k))) for k, v in value.items()}
    raise TypeError(f"{key}: unsupported annotation {tp!r}")


def _require_dataclass(cls: Any) -> None:
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"expected a dataclass type, got {cls!r}")


def from_dict(cls: type[T], data: Mapping, *, source: str = "<dict>", prefix: str = "") -> T:
    """Build dataclass `cls` from `data`, validating against its field annotations.

    Missing fields take their defaults; unknown keys, missing required fields, values of the
    wrong type or outside their field's `bounded` range and `ValueError`/`TypeError` from
    `__post_init__` raise ConfigError naming `source` and the dotted key (under `prefix`).
    `cls` must be a module-level dataclass (string annotations are resolved with
    `typing.get_type_hints`).
    """
    _require_dataclass(cls)
    return _build(cls, data, lambda _key: source, prefix)


def _unwrap_optional(tp: Any) -> Any:
    if typing.get_origin(tp) in (Union, types.UnionType):
        options = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(options) == 1:
            return options[0]
    return tp


def _check_path(schema: type, segments: list[str], source: str) -> None:
    tp: Any = schema
    for depth, segment in enumerate(segments):
        key = ".".join(segments[: depth + 1])
        tp = _unwrap_optional(tp)
        if tp is Any:
            return
        if dataclasses.is_dataclass(tp):
            names = [f.name for f in _init_fields(tp)]
            if segment not in names:
                raise _unknown_key(source, key, segment, names)
            tp = _hints(tp)[segment]
        elif tp in (dict, Mapping) or typing.get_origin(tp) in (dict, Mapping):
            tp = (typing.get_args(tp) or (Any, Any))[1]
        else:
            raise _error(source, key, f"cannot set a sub-key of {segments[depth - 1]!r}, "
                                      f"which is not a mapping")


def override_source(override: str) -> str:
    """How errors name a ``key=value`` override: ``override 'optim.lr=-1'`` (a value under a
    secret-like key redacted, a long one cut)."""
    dotted, eq, _raw = override.partition("=")
    if eq and _is_secret_key(dotted.strip().rsplit(".", 1)[-1]):
        override = f"{dotted}={REDACTED}"
    shown = repr(override)
    return f"override {shown if len(shown) <= 80 else shown[:76] + '...' + shown[0]}"


def apply_overrides(data: dict, overrides: Sequence[str], *, schema: type | None = None
                    ) -> dict:
    """Return a copy of `data` with each ``a.b.c=value`` applied (value parsed as YAML).

    Missing intermediate mappings (or nulls) are created. With `schema` (a dataclass type) each
    dotted path must name a field; keys under a ``dict[str, T]`` field are free. Errors name
    the override (``override 'a.b=[1': a.b: cannot parse ...``).
    """
    data = copy.deepcopy(dict(data))
    for override in overrides:
        source = override_source(override)
        dotted, eq, raw = override.partition("=")
        dotted = dotted.strip()
        segments = dotted.split(".")
        if not eq or not all(segments):
            raise _error(source, "", "expected key.path=value")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as err:
            problem = getattr(err, "problem", None) or str(err).splitlines()[0]
            raise _error(source, dotted, f"cannot parse {raw!r} as YAML ({problem})") from None
        if schema is not None:
            _check_path(schema, segments, source)
        node = data
        for depth, segment in enumerate(segments[:-1]):
            child = node.get(segment)
            if child is None:
                child = node[segment] = {}
            elif not isinstance(child, dict):
                key = ".".join(segments[: depth + 1])
                raise _error(source, dotted, f"{key} is not a mapping")
            node = child
        node[segments[-1]] = value
    return data


def _where(err: yaml.YAMLError, text: str) -> str:
    """The "line L, column C: problem" of a YAML error, on one line."""
    mark = getattr(err, "problem_mark", None)
    position = getattr(err, "position", None)  # a ReaderError (a control character) has no mark
    if mark is not None:
        where = f"line {mark.line + 1}, column {mark.column + 1}: "
    elif isinstance(position, int):
        line, line_start = text.count("\n", 0, position) + 1, text.rfind("\n", 0, position) + 1
        where = f"line {line}, column {position - line_start + 1}: "
    else:
        where = ""
    return where + (getattr(err, "problem", None) or str(err).splitlines()[0])


def _key_lines(node: yaml.Node, prefix: str, lines: dict[str, int], seen: set[int]) -> None:
    """Record the 1-based line of every dotted key of mapping `node` (aliases: first path)."""
    if not isinstance(node, yaml.MappingNode) or id(node) in seen:
        return
    seen.add(id(node))
    for key_node, value_node in node.value:
        if isinstance(key_node, yaml.ScalarNode):
            key = _join(prefix, key_node.value)
            lines.setdefault(key, key_node.start_mark.line + 1)
            _key_lines(value_node, key, lines, seen)


def _read_yaml(path: Path) -> tuple[dict, dict[str, int]]:
    """The top-level mapping of YAML file `path` and the line of each dotted key in it.

    ConfigError (one line, naming the file and the line where known) if the file is missing,
    unreadable, not UTF-8, not YAML or not a mapping.
    """
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except OSError as err:
        raise ConfigError(f"{path}: cannot read config file ({err.strerror})") from None
    try:
        text = decode_utf8(raw, path)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    try:
        loader = yaml.SafeLoader(text)
        try:
            node = loader.get_single_node()
            data = None if node is None else loader.construct_document(node)
        finally:
            loader.dispose()
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: invalid YAML: {_where(err, text)}") from None
    if data is None:
        return {}, {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}:{node.start_mark.line + 1}: top level must be a mapping, got "
                          f"{type(data).__name__}")
    lines: dict[str, int] = {}
    _key_lines(node, "", lines, set())
    return data, lines


def _merge(base: dict, top: Mapping, origin: dict[str, str], where: Callable[[str], str],
           prefix: str) -> dict:
    merged = dict(base)
    for k, v in top.items():
        key = _join(prefix, str(k))
        origin[key] = where(key)
        if isinstance(v, Mapping):
            below = merged.get(k)
            v = _merge(below if isinstance(below, Mapping) else {}, v, origin, where, key)
        merged[k] = v
    return merged


def _load_tree(path: Path, chain: list[Path], origin: dict[str, str]) -> dict:
    if path.resolve() in [p.resolve() for p in chain]:
        raise ConfigError(f"{path}: extends cycle: {' -> '.join(map(str, [*chain, path]))}")
    data, lines = _read_yaml(path)

    def where(key: str) -> str:
        return f"{path}:{lines[key]}" if key in lines else str(path)

    parent = data.pop("extends", None)
    base: dict = {}
    if parent is not None:
        if not isinstance(parent, str) or not parent:
            raise _error(where("extends"), "extends", f"expected a file path, {_got(parent, '')}")
        base = _load_tree(path.parent / parent, [*chain, path], origin)
    return _merge(base, data, origin, where, "")


def load_config(cls: type[T], path: str | os.PathLike | None, overrides: Sequence[str] = (),
                *, check: Callable[[T, Callable[[str], str]], None] | None = None) -> T:
    """Load `cls` from a YAML file (following `extends`), then apply `overrides`.

    `path=None` means all defaults plus overrides. Errors name the source of the offending
    key: ``<file>:<line>`` that set it, the override (``override 'optim.lr=-1'``) or
    "<defaults>"; an error about a whole section (its `__post_init__`) also names the
    overrides that set keys inside it. `check(cfg, src)`, if given, runs further (cross-field)
    rules on the loaded config; `src(dotted_key)` is that key's source, for their errors.
    """
    _require_dataclass(cls)
    origin: dict[str, str] = {}
    data = _load_tree(Path(path), [], origin) if path is not None else {}
    data = apply_overrides(data, overrides, schema=cls)
    overridden: dict[str, str] = {}
    for override in overrides:
        dotted, source = override.partition("=")[0].strip(), override_source(override)
        origin.update({k: source for k in origin if k.startswith(dotted + ".")})
        origin[dotted] = overridden[dotted] = source
    default = str(path) if path is not None else "<defaults>"

    def src(key: str) -> str:
        bare = re.sub(r"\[\d+\]", "", key)
        parts = bare.split(".")
        found = next((origin[k] for n in range(len(parts), 0, -1)
                      if (k := ".".join(parts[:n])) in origin), None)
        below = [s for k, s in overridden.items() if not bare or k.startswith(bare + ".")]
        head = [found] if found is not None else [] if below else [default]
        return " + ".join(dict.fromkeys(head + below))

    cfg = _build(cls, data, src, "")
    if check is not None:
        check(cfg, src)
    return cfg


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return to_dict(value)
    if isinstance(value, enum.Enum):
        return _plain(value.value)
    if isinstance(value, Mapping):
        return {k.value if isinstance(k, enum.Enum) else k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return value


def fields_of(source: Any, base: type) -> dict[str, Any]:
    """The values of dataclass `base`'s fields in `source` (an instance of a dataclass that
    extends `base`), to build another config from them."""
    return {f.name: getattr(source, f.name) for f in dataclasses.fields(base)}


def to_dict(obj: Any) -> dict:
    """Dataclass tree -> plain YAML/JSON-safe data (enums -> values, tuples -> lists).

    Only `init=True` fields are emitted, so `from_dict(type(x), to_dict(x)) == x`.
    """
    if not dataclasses.is_dataclass(obj) or isinstance(obj, type):
        raise TypeError(f"to_dict needs a dataclass instance, got {type(obj).__name__}")
    return {f.name: _plain(getattr(obj, f.name)) for f in _init_fields(type(obj))}


def redact_secrets(d: Mapping) -> dict:
    """Copy of `d` with every non-empty string under a secret-like key replaced by "<redacted>".

    Keys ending in ``_env`` hold environment-variable NAMES and are kept. Under a secret-like
    key, strings nested in mappings/lists are redacted too.
    """
    def walk(value: Any, secret: bool) -> Any:
        if isinstance(value, Mapping):
            return {k: walk(v, (secret and not str(k).lower().endswith("_env"))
                            or _is_secret_key(k)) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [walk(v, secret) for v in value]
        return REDACTED if secret and isinstance(value, str) and value else value

    return walk(d, False)


def dump_config(obj: Any, path: str | os.PathLike) -> None:
    """Write `to_dict(obj)` as YAML with secrets redacted, atomically (temp file + rename)."""
    path = Path(path)
    text = yaml.safe_dump(redact_secrets(to_dict(obj)), sort_keys=False, allow_unicode=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; a run's config should be readable like any file
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
