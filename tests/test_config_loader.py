"""jax_routeweaver.config: YAML -> typed dataclasses, overrides, extends, redacted dumps."""

from __future__ import annotations

import enum
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jax_routeweaver.config import (
    ConfigError,
    apply_overrides,
    dump_config,
    from_dict,
    load_config,
    redact_secrets,
    to_dict,
)


class Color(enum.Enum):
    RED = "red"
    GREEN = "green"


@dataclass(frozen=True)
class Optim:
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    schedule: Literal["constant", "cosine"] = "constant"
    warmup_steps: int = 0

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"lr must be positive, got {self.lr}")


@dataclass(frozen=True)
class Worker:
    model: str
    api_key_env: str | None = None
    api_key: str | None = None


@dataclass(frozen=True)
class Train:
    name: str
    steps: int = 10
    seed: int | None = None
    debug: bool = False
    color: Color = Color.RED
    batch: int | Literal["auto"] = "auto"
    optim: Optim = field(default_factory=Optim)
    maybe_optim: Optional[Optim] = None  # noqa: UP045 -- the typing spelling must work too
    tags: tuple[str, ...] = ()
    layers: list[int] = field(default_factory=list)
    workers: dict[str, Worker] = field(default_factory=dict)
    weights: Mapping[str, float] = field(default_factory=dict)
    extra: Any = None


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


# ---------------------------------------------------------------------------------------------
# Types accepted


def test_every_supported_type_is_accepted(tmp_path):
    path = write(tmp_path / "full.yaml", """\
name: run-1
steps: 20
seed: null
debug: true
color: green
batch: 64
optim: {lr: 1e-6, betas: [0.8, 0.9], schedule: cosine, warmup_steps: "100"}
maybe_optim: {lr: 2}
tags: [a, b]
layers: [1, 2, 3]
workers:
  w1: {model: m1, api_key_env: OPENAI_API_KEY}
weights: {math: 1, code: 0.5}
extra: {anything: [1, x]}
""")
    cfg = load_config(Train, path)
    assert cfg == Train(
        name="run-1", steps=20, seed=None, debug=True, color=Color.GREEN, batch=64,
        optim=Optim(lr=1e-6, betas=(0.8, 0.9), schedule="cosine", warmup_steps=100),
        maybe_optim=Optim(lr=2.0), tags=("a", "b"), layers=[1, 2, 3],
        workers={"w1": Worker(model="m1", api_key_env="OPENAI_API_KEY")},
        weights={"math": 1.0, "code": 0.5}, extra={"anything": [1, "x"]})
    # YAML 1.1 reads 1e-6 as a string; it must come out a float, and ints become floats too.
    assert type(cfg.optim.lr) is float and type(cfg.maybe_optim.lr) is float
    assert type(cfg.weights["math"]) is float
    assert isinstance(cfg.tags, tuple) and isinstance(cfg.optim.betas, tuple)
    assert isinstance(cfg.layers, list)


def test_defaults_and_default_factories_fill_missing_fields(tmp_path):
    cfg = load_config(Train, write(tmp_path / "min.yaml", "name: x\n"))
    assert cfg == Train(name="x")
    assert cfg.optim == Optim() and cfg.layers == [] and cfg.workers == {}


@pytest.mark.parametrize(("yaml_value", "expected"), [
    ('"1e3"', 1000), ('"12"', 12), ("1_000", 1000), ("3.0", 3), ("-4", -4)])
def test_int_accepts_integral_numbers_and_numeric_strings(yaml_value, expected):
    cfg = from_dict(Train, yaml.safe_load(f"{{name: x, steps: {yaml_value}}}"))
    assert cfg.steps == expected and type(cfg.steps) is int


@pytest.mark.parametrize(("yaml_value", "expected"), [
    ("1e-6", 1e-6), ('"2.5"', 2.5), ("3", 3.0), ("1.0e-4", 1e-4), (".5", 0.5)])
def test_float_accepts_numbers_and_numeric_strings(yaml_value, expected):
    cfg = from_dict(Optim, yaml.safe_load(f"{{lr: {yaml_value}}}"))
    assert cfg.lr == expected and type(cfg.lr) is float


def test_union_tries_members_in_order():
    assert from_dict(Train, {"name": "x", "batch": "auto"}).batch == "auto"
    assert from_dict(Train, {"name": "x", "batch": 8}).batch == 8
    assert from_dict(Train, {"name": "x", "seed": 3}).seed == 3


def test_enum_accepts_a_member_and_nested_dataclass_accepts_an_instance():
    cfg = from_dict(Train, {"name": "x", "color": Color.GREEN, "optim": Optim(lr=0.5)})
    assert cfg.color is Color.GREEN and cfg.optim == Optim(lr=0.5)


# ---------------------------------------------------------------------------------------------
# Types rejected: the message names the file and the dotted key


@pytest.mark.parametrize(("body", "key", "fragment"), [
    ("steps: abc", "steps", "expected an integer, got 'abc' (str)"),
    ("steps: true", "steps", "expected an integer, got True (bool)"),
    ("steps: 1.5", "steps", "expected an integer, got 1.5 (float)"),
    ('steps: "1.5"', "steps", "expected an integer"),
    ("optim: {lr: abc}", "optim.lr", "expected a number, got 'abc' (str)"),
    ("optim: {lr: false}", "optim.lr", "expected a number, got False (bool)"),
    ("optim: {lr: [1]}", "optim.lr", "expected a number"),
    ("name: 123", "name", "expected a string, got 123 (int)"),
    ("name: null", "name", "expected str, got null"),
    ('debug: "yes"', "debug", "expected a boolean (true/false), got 'yes' (str)"),
    ("debug: 1", "debug", "expected a boolean"),
    ("seed: abc", "seed", "expected an integer"),
    ("seed: 2.5", "seed", "expected an integer"),
    ("batch: [1]", "batch", "expected one of int | Literal['auto']"),
    ("optim: {schedule: linear}", "optim.schedule",
     "expected one of ['constant', 'cosine'], got 'linear'"),
    ("color: blue", "color", "expected one of ['red', 'green'], got 'blue'"),
    ("color: RED", "color", "expected one of ['red', 'green']"),  # by value, case-sensitive
    ("tags: abc", "tags", "expected a list, got 'abc' (str)"),
    ("tags: [a, 1]", "tags[1]", "expected a string, got 1 (int)"),
    ("optim: {betas: [0.9]}", "optim.betas", "expected a list of 2 items"),
    ("optim: {betas: [0.9, x]}", "optim.betas[1]", "expected a number"),
    ("layers: [1, x]", "layers[1]", "expected an integer"),
    ("layers: {a: 1}", "layers", "expected a list"),
    ("workers: [1]", "workers", "expected a mapping"),
    ("workers: {w1: {model: 3}}", "workers.w1.model", "expected a string"),
    ("workers: {w1: {}}", "workers.w1.model", "missing required field"),
    ("workers: {3: {model: m}}", "workers.3", "expected a string, got 3 (int)"),
    ("weights: {a: x}", "weights.a", "expected a number"),
    ("optim: 3", "optim", "expected a mapping (Optim), got 3 (int)"),
    ("optim: null", "optim", "expected Optim, got null"),
    ("maybe_optim: {lr: x}", "maybe_optim.lr", "expected a number"),
])
def test_wrong_types_are_rejected_naming_file_line_and_key(tmp_path, body, key, fragment):
    path = write(tmp_path / "bad.yaml", f"name: x\n{body}\n" if "name" not in body else body)
    with pytest.raises(ConfigError) as info:
        load_config(Train, path)
    message = str(info.value)
    line = 1 if body.startswith("name") else 2
    assert message.startswith(f"{path}:{line}: {key}: "), message
    assert fragment in message


def test_unknown_key_suggests_the_nearest_valid_key(tmp_path):
    path = write(tmp_path / "a.yaml", "name: x\noptim: {lrr: 0.1}\n")
    with pytest.raises(ConfigError) as info:
        load_config(Train, path)
    assert str(info.value) == (f"{path}:2: optim.lrr: unknown key; did you mean 'lr'? "
                               "valid keys: lr, betas, schedule, warmup_steps")


def test_unknown_key_without_a_close_match_lists_valid_keys():
    with pytest.raises(ConfigError) as info:
        from_dict(Optim, {"zzzzzz": 1})
    message = str(info.value)
    assert message.startswith("<dict>: zzzzzz: unknown key; valid keys: lr, betas")
    assert "did you mean" not in message


def test_missing_required_field_is_named(tmp_path):
    path = write(tmp_path / "a.yaml", "steps: 3\n")
    with pytest.raises(ConfigError, match=r"a\.yaml: name: missing required field$"):
        load_config(Train, path)


def test_post_init_errors_are_wrapped_with_source_and_prefix(tmp_path):
    path = write(tmp_path / "a.yaml", "name: x\noptim: {lr: -1}\n")
    with pytest.raises(ConfigError) as info:
        load_config(Train, path)
    assert str(info.value) == f"{path}:2: optim: lr must be positive, got -1.0"
    assert isinstance(info.value.__cause__, ValueError)


def test_from_dict_uses_source_and_prefix_in_messages():
    with pytest.raises(ConfigError) as info:
        from_dict(Optim, {"lr": "abc"}, source="run.yaml", prefix="train.optim")
    assert str(info.value).startswith("run.yaml: train.optim.lr: expected a number")
    with pytest.raises(ConfigError, match=r"^<dict>: expected a mapping \(Optim\)"):
        from_dict(Optim, [1, 2])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="dataclass"):
        from_dict(dict, {})


def test_errors_never_echo_a_value_under_a_secret_key():
    with pytest.raises(ConfigError) as info:
        from_dict(Worker, {"model": "m", "api_key": 123456789})
    assert "123456789" not in str(info.value)
    assert "api_key: expected a string, got <redacted> (int)" in str(info.value)


# ---------------------------------------------------------------------------------------------
# Overrides


def test_overrides_parse_values_as_yaml_and_create_nested_mappings():
    data = {"a": {"keep": 1}, "n": None}
    out = apply_overrides(data, ["a.b.c=3", "x=[1, 2]", "y=null", "z=", "s=hello", "f=1e-6",
                                 "t=true", "n.k=v", "a.keep=2", "m={p: 1}"])
    assert out == {"a": {"keep": 2, "b": {"c": 3}}, "n": {"k": "v"}, "x": [1, 2], "y": None,
                   "z": "", "s": "hello", "f": "1e-6", "t": True, "m": {"p": 1}}
    assert data == {"a": {"keep": 1}, "n": None}  # the input is not modified


@pytest.mark.parametrize(("override", "fragment"), [
    ("noequals", "override 'noequals': expected key.path=value"),
    ("=3", "override '=3': expected key.path=value"),
    ("a..b=1", "override 'a..b=1': expected key.path=value"),
    ("x=[1, 2", "override 'x=[1, 2': x: cannot parse '[1, 2' as YAML"),
    ("a.keep.deeper=1", "override 'a.keep.deeper=1': a.keep.deeper: a.keep is not a mapping"),
])
def test_bad_override_syntax(override, fragment):
    with pytest.raises(ConfigError) as info:
        apply_overrides({"a": {"keep": 1}}, [override])
    assert str(info.value).startswith(fragment), str(info.value)


def test_schema_checked_overrides():
    out = apply_overrides({}, ["optim.lr=0.5", "workers.w9.model=m", "weights.any=1"],
                          schema=Train)
    assert out == {"optim": {"lr": 0.5}, "workers": {"w9": {"model": "m"}},
                   "weights": {"any": 1}}
    with pytest.raises(ConfigError) as info:
        apply_overrides({}, ["optim.lrr=1"], schema=Train)
    assert str(info.value).startswith(
        "override 'optim.lrr=1': optim.lrr: unknown key; did you mean 'lr'?")
    with pytest.raises(ConfigError,
                       match=r"^override 'workers\.w9\.modle=m': workers\.w9\.modle: .*'model'"):
        apply_overrides({}, ["workers.w9.modle=m"], schema=Train)
    with pytest.raises(ConfigError, match=r"^override 'steps\.x=1': steps\.x: cannot set a sub"):
        apply_overrides({}, ["steps.x=1"], schema=Train)
    # Any-typed fields take arbitrary sub-keys.
    assert apply_overrides({}, ["extra.p.q=1"], schema=Train) == {"extra": {"p": {"q": 1}}}


def test_load_config_applies_overrides_with_types(tmp_path):
    path = write(tmp_path / "a.yaml", "name: x\noptim: {lr: 0.1, warmup_steps: 3}\n")
    cfg = load_config(Train, path, ["steps=7", "debug=true", "tags=[a, b]", "optim.lr=1e-5",
                                    "maybe_optim.schedule=cosine", "color=green"])
    assert cfg.steps == 7 and cfg.debug is True and cfg.tags == ("a", "b")
    assert cfg.optim == Optim(lr=1e-5, warmup_steps=3)  # the rest of optim is kept
    assert cfg.maybe_optim == Optim(schedule="cosine") and cfg.color is Color.GREEN


def test_a_bad_override_value_is_blamed_on_the_overrides(tmp_path):
    path = write(tmp_path / "a.yaml", "name: x\noptim: {lr: 0.1}\n")
    with pytest.raises(ConfigError, match=r"^override 'optim\.lr=abc': optim\.lr: expected a "):
        load_config(Train, path, ["optim.lr=abc"])
    with pytest.raises(ConfigError, match=r"^override 'optim\.lr_=2': optim\.lr_: .*did you mea"):
        load_config(Train, path, ["optim.lr_=2"])
    # A whole mapping set by an override: its sub-keys are blamed on that override too.
    with pytest.raises(ConfigError, match=r"^override 'optim=\{lr: x\}': optim\.lr: expected"):
        load_config(Train, path, ["optim={lr: x}"])


def test_load_config_without_a_file_uses_defaults_and_overrides():
    assert load_config(Train, None, ["name=n", "steps=3"]) == Train(name="n", steps=3)
    with pytest.raises(ConfigError, match=r"^<defaults>: name: missing required field"):
        load_config(Train, None)
    assert load_config(Optim, None) == Optim()


# ---------------------------------------------------------------------------------------------
# Files and `extends`


def test_extends_chain_deep_merges_and_replaces_lists(tmp_path, monkeypatch):
    write(tmp_path / "configs" / "base.yaml", """\
name: base
steps: 5
optim: {lr: 0.1, warmup_steps: 3, betas: [0.1, 0.2]}
tags: [a, b]
layers: [1, 2, 3]
workers: {w1: {model: m1}, w2: {model: m2}}
""")
    write(tmp_path / "configs" / "exp" / "mid.yaml",
          "extends: ../base.yaml\nsteps: 50\nworkers: {w2: {model: m2b}}\n")
    leaf = write(tmp_path / "configs" / "exp" / "leaf.yaml",
                 "extends: mid.yaml\noptim: {lr: 0.2, betas: [0.3, 0.4]}\nlayers: [9]\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # `extends` is relative to the file, not the cwd
    cfg = load_config(Train, leaf)
    assert cfg.name == "base" and cfg.steps == 50 and cfg.tags == ("a", "b")
    assert cfg.optim == Optim(lr=0.2, warmup_steps=3, betas=(0.3, 0.4))
    assert cfg.layers == [9]  # lists replace, they do not concatenate
    assert cfg.workers == {"w1": Worker("m1"), "w2": Worker("m2b")}


def test_an_error_in_a_base_file_names_the_base_file(tmp_path):
    base = write(tmp_path / "base.yaml", "name: x\noptim: {lr: abc}\n")
    leaf = write(tmp_path / "leaf.yaml", "extends: base.yaml\nsteps: 3\n")
    with pytest.raises(ConfigError) as info:
        load_config(Train, leaf)
    assert str(info.value).startswith(f"{base}:2: optim.lr: expected a number")
    write(leaf, "extends: base.yaml\noptim: {lr: 0.5}\nstepz: 1\n")
    with pytest.raises(ConfigError, match=r"leaf\.yaml:3: stepz: unknown key; did you mean"):
        load_config(Train, leaf)
    write(leaf, "extends: base.yaml\noptim: {lr: 0.5}\n")
    assert load_config(Train, leaf).optim.lr == 0.5  # the leaf fixes the base's bad value


def test_extends_cycles_are_errors_naming_the_files(tmp_path):
    a = write(tmp_path / "a.yaml", "extends: b.yaml\nname: a\n")
    b = write(tmp_path / "b.yaml", "extends: a.yaml\nsteps: 1\n")
    with pytest.raises(ConfigError) as info:
        load_config(Train, a)
    message = str(info.value)
    assert "extends cycle" in message and str(a) in message and str(b) in message
    me = write(tmp_path / "me.yaml", "extends: me.yaml\n")
    with pytest.raises(ConfigError, match="extends cycle"):
        load_config(Train, me)


def test_bad_extends_values(tmp_path):
    missing = write(tmp_path / "m.yaml", "extends: nope/base.yaml\nname: x\n")
    with pytest.raises(ConfigError) as info:
        load_config(Train, missing)
    assert str(tmp_path / "nope" / "base.yaml") in str(info.value)
    assert "not found" in str(info.value)
    path = write(tmp_path / "n.yaml", "extends: 3\nname: x\n")
    with pytest.raises(ConfigError, match=r"n\.yaml:1: extends: expected a file path"):
        load_config(Train, path)


def test_yaml_syntax_error_names_the_file(tmp_path):
    path = write(tmp_path / "broken.yaml", "name: x\noptim: {lr: 0.1\nsteps: 3\n")
    with pytest.raises(ConfigError) as info:
        load_config(Train, path)
    assert str(info.value).startswith(f"{path}: invalid YAML: line ")


def test_missing_file_and_non_mapping_top_level(tmp_path):
    with pytest.raises(ConfigError, match=r"absent\.yaml: config file not found"):
        load_config(Train, tmp_path / "absent.yaml")
    path = write(tmp_path / "list.yaml", "- 1\n- 2\n")
    with pytest.raises(ConfigError, match=r"list\.yaml:1: top level must be a mapping, got list"):
        load_config(Train, path)
    assert load_config(Optim, write(tmp_path / "empty.yaml", "")) == Optim()


# ---------------------------------------------------------------------------------------------
# to_dict, redaction, dumps


def test_to_dict_is_plain_data():
    cfg = Train(name="x", color=Color.GREEN, tags=("a",), optim=Optim(betas=(0.5, 0.6)),
                workers={"w1": Worker("m")})
    data = to_dict(cfg)
    assert data["color"] == "green" and data["tags"] == ["a"]
    assert data["optim"] == {"lr": 1e-3, "betas": [0.5, 0.6], "schedule": "constant",
                             "warmup_steps": 0}
    assert data["workers"] == {"w1": {"model": "m", "api_key_env": None, "api_key": None}}
    assert json.loads(json.dumps(data)) == data
    assert from_dict(Train, data) == cfg
    with pytest.raises(TypeError):
        to_dict(Train)


def test_redact_secrets():
    data = {
        "api_key": "sk-1", "api_key_env": "OPENAI_API_KEY", "OPENAI_APIKEY": "k",
        "hf_token": "hf_x", "token": "t", "Authorization": "Bearer x", "db_password": "p",
        "passwd": "p", "bearer": "b", "max_tokens": 512, "tokenizer": "Qwen/Qwen3-4B",
        "pad_token": "<|endoftext|>", "empty_secret": "", "secret_none": None,
        "nested": {"client_secret": "s", "items": [{"apikey": "k", "model": "m"}]},
        "secrets": {"openai": "sk-2", "openai_env": "OPENAI_API_KEY"},
    }
    out = redact_secrets(data)
    assert out == {
        "api_key": "<redacted>", "api_key_env": "OPENAI_API_KEY", "OPENAI_APIKEY": "<redacted>",
        "hf_token": "<redacted>", "token": "<redacted>", "Authorization": "<redacted>",
        "db_password": "<redacted>", "passwd": "<redacted>", "bearer": "<redacted>",
        "max_tokens": 512, "tokenizer": "Qwen/Qwen3-4B", "pad_token": "<|endoftext|>",
        "empty_secret": "", "secret_none": None,
        "nested": {"client_secret": "<redacted>", "items": [{"apikey": "<redacted>",
                                                             "model": "m"}]},
        "secrets": {"openai": "<redacted>", "openai_env": "OPENAI_API_KEY"},
    }
    assert data["api_key"] == "sk-1" and data["nested"]["client_secret"] == "s"


def test_dump_redacts_and_is_atomic(tmp_path):
    cfg = Train(name="x", workers={"w1": Worker("m", api_key_env="OPENAI_API_KEY",
                                                api_key="sk-live-123")})
    out = tmp_path / "run" / "config.yaml"
    write(out, "old: content\n")
    dump_config(cfg, out)
    text = out.read_text()
    assert "sk-live-123" not in text and "api_key: <redacted>" in text
    assert "api_key_env: OPENAI_API_KEY" in text
    assert text.index("name:") < text.index("steps:") < text.index("optim:")  # field order
    assert os.listdir(out.parent) == ["config.yaml"]  # no temp file left behind
    assert load_config(Train, out).workers["w1"].api_key == "<redacted>"


def test_dump_then_load_round_trips(tmp_path):
    cfg = Train(name="run", steps=3, seed=7, debug=True, color=Color.GREEN, batch=16,
                optim=Optim(lr=1e-6, betas=(0.8, 0.95), schedule="cosine"),
                maybe_optim=Optim(lr=3.0), tags=("x", "1e-6", "true"), layers=[4, 5],
                workers={"w1": Worker("m", api_key_env="K")}, weights={"a": 0.25},
                extra={"k": [1, "v"]})
    dump_config(cfg, tmp_path / "c.yaml")
    assert load_config(Train, tmp_path / "c.yaml") == cfg


_text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")), max_size=12)
_finite = st.floats(allow_nan=False, allow_infinity=False)
_optims = st.builds(Optim, lr=st.floats(min_value=1e-12, max_value=1e6),
                    betas=st.tuples(_finite, _finite),
                    schedule=st.sampled_from(["constant", "cosine"]), warmup_steps=st.integers())
_trains = st.builds(
    Train, name=_text, steps=st.integers(), seed=st.none() | st.integers(),
    debug=st.booleans(), color=st.sampled_from(Color),
    batch=st.just("auto") | st.integers(), optim=_optims, maybe_optim=st.none() | _optims,
    tags=st.lists(_text, max_size=3).map(tuple), layers=st.lists(st.integers(), max_size=3),
    workers=st.dictionaries(st.from_regex(r"w[0-9]{1,2}", fullmatch=True),
                            st.builds(Worker, model=_text, api_key_env=st.none() | _text),
                            max_size=2),
    weights=st.dictionaries(_text, _finite, max_size=3),
    extra=st.none() | st.lists(st.integers(), max_size=2))


@given(_trains)
def test_to_dict_from_dict_round_trip(cfg):
    assert from_dict(Train, to_dict(cfg)) == cfg


@settings(max_examples=50, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cfg=_trains)
def test_dump_load_round_trip_property(tmp_path, cfg):
    dump_config(cfg, tmp_path / "c.yaml")
    assert load_config(Train, tmp_path / "c.yaml") == cfg
