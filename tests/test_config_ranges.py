"""Every numeric field of the training config declares its valid range where it is declared
(`config.bounded`), and the loader checks it: an out-of-range value is one ConfigError line
naming its source (``<file>:<line>`` or ``override 'key=value'``), the key, the value and the
range. Also: the shipped train configs still load, and a config file that is not UTF-8, not a
mapping or not YAML is named with its line."""

from __future__ import annotations

import dataclasses
import re
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from jax_routeweaver import config
from jax_routeweaver.config import ConfigError, from_dict, load_config
from jax_routeweaver.rl.learner.learner_config import OptimConfig
from jax_routeweaver.rl.run.train_config import (
    TrainConfig,
    TrainRewardConfig,
    check_train_config,
    load_train_config,
)
from jax_routeweaver.routing.protocol.grammar import ProtocolConfig
from jax_routeweaver.sampling.sidecar import VllmConfig
from jax_routeweaver.sampling.vllm_server import ServerBaseConfig, ServerConfig

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
QUICKSTART = CONFIGS / "quickstart.yaml"


def _numeric(tp: Any) -> bool:
    """Whether annotation `tp` can hold a number (bool is not one), in a union or container."""
    if tp in (int, float):
        return True
    if tp is bool or dataclasses.is_dataclass(tp) or typing.get_origin(tp) is typing.Literal:
        return False
    return any(_numeric(arg) for arg in typing.get_args(tp) if arg is not Ellipsis)


def _leaves(cls: type, prefix: str = "") -> Iterator[tuple[str, dataclasses.Field, Any]]:
    """(dotted key, field, annotation) of every non-dataclass field under `cls`."""
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        key, tp = prefix + field.name, hints[field.name]
        nested = [a for a in (tp, *typing.get_args(tp)) if dataclasses.is_dataclass(a)]
        if nested:
            yield from _leaves(nested[0], key + ".")
        else:
            yield key, field, tp


NUMERIC = [(key, field) for key, field, tp in _leaves(TrainConfig) if _numeric(tp)]


def _default(field: dataclasses.Field) -> Any:
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


# ---------------------------------------------------------------------------------------------
# Every numeric field has a declared range


def test_the_walk_covers_the_whole_config_tree():
    keys = {key for key, _ in NUMERIC}
    assert {"seed", "steps", "model.remat_groups", "mesh.fsdp", "data.quotas", "data.seed",
            "rollout.temperature", "rollout.prompt_buckets", "rollout.protocol.max_action_turns",
            "rollout.protocol.obs_tail_fraction", "rollout.router_r1.max_turns",
            "rollout.vllm.port", "workers.failure_rate", "reward.c_ref",
            "reward.router_r1.cost_coe", "algo.loss.clip_c", "algo.exploration.support_floor",
            "algo.support_max_prompt", "optim.eps", "checkpoint.keep_full",
            "logging.summary_window"} <= keys
    assert len(keys) >= 80
    assert "model.random" not in keys  # ModelConfig fields (dict[str, Any]): ModelConfig checks


@pytest.mark.parametrize(("key", "field"), NUMERIC, ids=[key for key, _ in NUMERIC])
def test_every_numeric_field_declares_a_range_that_its_default_meets(key, field):
    valid = config.field_range(field)
    assert valid is not None, f"{key}: declare its range, e.g. bounded(default, '[0, inf)')"
    default = _default(field)
    values = (default.values() if isinstance(default, dict)
              else default if isinstance(default, tuple) else [default])
    assert all(v is None or isinstance(v, str) or v in valid for v in values), (key, default)


def test_the_vllm_section_and_the_server_share_one_default_and_range_per_option(tmp_path):
    """``rollout.vllm``'s server options are the `ServerBaseConfig` fields themselves: a default
    or range declared a second time (the section once ran 8192 tokens, a bare server 4096)
    fails here, and so does a `ServerConfig` check that enforces another range."""
    options = dataclasses.fields(ServerBaseConfig)
    section = {f.name: f for f in dataclasses.fields(VllmConfig)}
    server_only = {f.name for f in dataclasses.fields(ServerConfig)} - {f.name for f in options}
    assert not server_only & set(section), server_only & set(section)
    for option in options:
        assert section[option.name] is option or (
            _default(section[option.name]), config.field_range(section[option.name])) == (
            _default(option), config.field_range(option)), option.name
    (tmp_path / "config.json").write_text("{}")
    server = ServerConfig(model=str(tmp_path), work_dir=str(tmp_path / "w"))
    trained = TrainConfig().rollout.vllm
    assert {f.name: getattr(server, f.name) for f in options} == \
        {f.name: getattr(trained, f.name) for f in options}
    assert server.max_model_len == trained.max_model_len == 8192
    for option in options:
        valid = config.field_range(option)
        if valid is None:
            continue
        for lo, hi, lo_open, hi_open in valid.intervals:
            for outside in (lo - 1e-9 if lo_open else lo - 1, hi + 1e-9 if hi_open else hi + 1):
                if abs(outside) == float("inf"):
                    continue
                value = int(outside) if isinstance(_default(option), int) else outside
                assert value not in valid, (option.name, value)
                with pytest.raises(ValueError, match=rf"{option.name}={value}\b"):
                    ServerConfig(model=str(tmp_path), work_dir=str(tmp_path / "w"),
                                 **{option.name: value})
            for edge, edge_open in ((lo, lo_open), (hi, hi_open)):
                if not edge_open and abs(edge) != float("inf"):  # a closed edge is accepted
                    ServerConfig(model=str(tmp_path), work_dir=str(tmp_path / "w"),
                                 **{option.name: type(_default(option))(edge)})


# ---------------------------------------------------------------------------------------------
# Out-of-range values are rejected at load, naming the source


BAD = [  # (key, value, the range the error must state)
    ("rollout.temperature", -1, "[0, inf)"),
    ("rollout.top_p", 5, "(0, 1]"),
    ("rollout.top_p", 0, "(0, 1]"),
    ("rollout.max_new_tokens", 0, "[1, inf)"),
    ("data.synthetic_queries", -5, "[1, inf)"),
    ("workers.failure_rate", 2.0, "[0, 1]"),
    ("workers.concurrency", 0, "[1, inf)"),
    ("reward.score_workers", 0, "[1, inf)"),
    ("reward.c_ref", -1, "(0, inf)"),
    ("logging.summary_window", -1, "[1, inf)"),
    ("data.seed", -1, "[0, 4294967295]"),
    ("checkpoint.keep_full", 0, "[1, inf)"),
    ("optim.lr", -1, "(0, inf)"),
    ("optim.b2", 1, "[0, 1)"),
    ("mesh.fsdp", 0, "-1 or [1, inf)"),
    ("rollout.vllm.port", 70000, "[0, 65535]"),
    ("rollout.vllm.sleep_level", 3, "[0, 2]"),
    ("rollout.protocol.obs_tail_fraction", 1.5, "[0, 1]"),
    ("rollout.protocol.max_action_turns", 0, "[1, inf)"),
    ("algo.loss.clip_c", 1, "(1, inf)"),
    ("algo.exploration.forced_anneal_steps", 0, "[1, inf)"),
    ("reward.router_r1.window_size", 0, "[1, inf)"),
    ("rollout.temperature", ".nan", "[0, inf)"),
]


def _got(value: Any) -> str:
    return r"got (nan|-?\d+(\.0)?) \((int|float)\)$" if value == ".nan" else \
        rf"got {re.escape(str(value))}(\.0)? \((int|float)\)$"


@pytest.mark.parametrize(("key", "value", "valid"), BAD)
def test_an_out_of_range_override_names_the_override_key_value_and_range(key, value, valid):
    override = f"{key}={value}"
    with pytest.raises(ConfigError) as info:
        load_train_config(QUICKSTART, [override])
    message = str(info.value)
    prefix = f"override {override!r}: {key}: must be in {valid}, "
    assert message.startswith(prefix), message
    assert re.fullmatch(_got(value), message[len(prefix):]), message


@pytest.mark.parametrize(("key", "value", "valid"), BAD)
def test_an_out_of_range_value_in_a_file_names_the_file_line_key_value_and_range(
        tmp_path, key, value, valid):
    *parents, leaf = key.split(".")
    lines = [f"extends: {QUICKSTART}", "# a comment line"]
    lines += [f"{'  ' * depth}{name}:" for depth, name in enumerate(parents)]
    lines.append(f"{'  ' * len(parents)}{leaf}: {value}")
    path = tmp_path / "run.yaml"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_train_config(path)
    message = str(info.value)
    prefix = f"{path}:{len(lines)}: {key}: must be in {valid}, "
    assert message.startswith(prefix), message
    assert re.fullmatch(_got(value), message[len(prefix):]), message


def test_list_items_and_mapping_values_are_checked_one_by_one(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_train_config(QUICKSTART, ["rollout.prompt_buckets=[64, 0]"])
    assert str(info.value) == ("override 'rollout.prompt_buckets=[64, 0]': "
                               "rollout.prompt_buckets[1]: must be in [1, inf), got 0 (int)")
    path = tmp_path / "q.yaml"
    path.write_text(f"extends: {QUICKSTART}\ndata:\n  quotas: {{MATH: 12, CODE: -2}}\n",
                    encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_train_config(path)
    assert str(info.value) == f"{path}:3: data.quotas.CODE: must be in [0, inf), got -2 (int)"
    # Edges are in range; a c_ref path (a string) is not a number to check.
    cfg = load_train_config(QUICKSTART, ["rollout.top_p=1", "rollout.temperature=0",
                                         "workers.failure_rate=1", "mesh.data=-1",
                                         "reward.c_ref=configs/cost_ref.json"])
    assert (cfg.rollout.top_p, cfg.workers.failure_rate, cfg.reward.c_ref) == \
        (1.0, 1.0, "configs/cost_ref.json")


def test_from_dict_checks_ranges_too():
    with pytest.raises(ConfigError) as info:
        from_dict(OptimConfig, {"lr": 0}, source="run.yaml", prefix="optim")
    assert str(info.value) == "run.yaml: optim.lr: must be in (0, inf), got 0.0 (float)"
    assert from_dict(ProtocolConfig, {"observation_cap": None}).observation_cap is None


# ---------------------------------------------------------------------------------------------
# Cross-field rules name the source too


def test_a_cross_field_error_from_an_override_names_the_override():
    with pytest.raises(ConfigError) as info:
        load_train_config(QUICKSTART, ["reward.alpha=0.5"])
    assert str(info.value).startswith("override 'reward.alpha=0.5': reward.alpha: "), \
        str(info.value)


def test_a_section_error_names_the_file_line_and_the_override_inside_it(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(f"extends: {QUICKSTART}\nrollout:\n  protocol:\n    multi_max_routes: 3\n",
                    encoding="utf-8")
    override = "rollout.protocol.multi_min_routes=4"
    with pytest.raises(ConfigError) as info:
        load_train_config(path, [override])
    assert str(info.value).startswith(f"{path}:3 + override {override!r}: rollout.protocol: "
                                      "ProtocolConfig: need 1 <= multi_min_routes (4)"), \
        str(info.value)


def test_check_train_config_still_takes_a_plain_source():
    cfg = dataclasses.replace(TrainConfig(), reward=TrainRewardConfig(alpha=0.5))
    with pytest.raises(ConfigError, match=r"^x\.yaml: reward\.alpha: alpha=0\.5 > 0 needs"):
        check_train_config(cfg, "x.yaml")


def test_load_config_passes_the_key_sources_to_check(tmp_path):
    path = tmp_path / "o.yaml"
    path.write_text("lr: 0.5\n\nb1: 0.8\n", encoding="utf-8")
    seen = {}

    def check(cfg: OptimConfig, src) -> None:
        seen.update(lr=src("lr"), b1=src("b1"), eps=src("eps"), cfg=cfg)

    load_config(OptimConfig, path, ["lr=0.25"], check=check)
    assert seen == {"lr": "override 'lr=0.25'", "b1": f"{path}:3", "eps": str(path),
                    "cfg": OptimConfig(lr=0.25, b1=0.8)}


# ---------------------------------------------------------------------------------------------
# The declaration helpers


def test_range_specs():
    valid = config.Range.parse("-1 or [1, inf)")
    assert str(valid) == "-1 or [1, inf)"
    assert [v in valid for v in (-1, 0, 0.5, 1, 10**30, float("inf"), float("nan"), True)] == \
        [True, False, False, True, True, False, False, False]
    half_open = config.Range.parse("(0, 1]")
    assert [v in half_open for v in (0, 1e-9, 1, 1.0000001)] == [False, True, True, False]
    for bad in ("[2, 1]", "(1, 1]", "[0 1]", "[a, 1]", ""):
        with pytest.raises(ValueError, match="range"):
            config.Range.parse(bad)


def test_bounded_checks_its_default_and_copies_a_dict_default():
    with pytest.raises(ValueError, match=r"default: must be in \[1, inf\), got 0"):
        config.bounded(0, "[1, inf)")
    first, second = TrainConfig(), TrainConfig()
    assert first.data.quotas == second.data.quotas and first.data.quotas is not second.data.quotas


# ---------------------------------------------------------------------------------------------
# Shipped configs


TRAIN_CONFIGS = sorted([*CONFIGS.glob("*.yaml"), *CONFIGS.glob("paper/*.yaml"),
                        *CONFIGS.glob("ablations/*.yaml"), *CONFIGS.glob("tpu/*.yaml")])


def test_every_yaml_outside_channels_is_a_train_config():
    channels = set(CONFIGS.glob("channels/*.yaml"))  # worker channel files, not train configs
    assert set(TRAIN_CONFIGS) == set(CONFIGS.rglob("*.yaml")) - channels
    assert len(TRAIN_CONFIGS) >= 14


@pytest.mark.parametrize("path", TRAIN_CONFIGS, ids=[str(p.relative_to(CONFIGS))
                                                     for p in TRAIN_CONFIGS])
def test_every_shipped_train_config_loads(path):
    assert isinstance(load_train_config(path), TrainConfig)


# ---------------------------------------------------------------------------------------------
# Unreadable config files: one line naming the file and the line


def test_a_non_utf8_config_names_the_file_line_byte_and_column(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("name: run\n# café\nsteps: 3\n".encode("latin-1"))
    with pytest.raises(ConfigError) as info:
        load_train_config(path)
    assert str(info.value) == f"{path}:2: not valid UTF-8 (byte 0xe9 at column 6)"


def test_a_non_utf8_base_file_is_named(tmp_path):
    base = tmp_path / "base.yaml"
    base.write_bytes(b"\xfename: run\n")
    leaf = tmp_path / "leaf.yaml"
    leaf.write_text("extends: base.yaml\n", encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_train_config(leaf)
    assert str(info.value) == f"{base}:1: not valid UTF-8 (byte 0xfe at column 1)"


def test_a_config_that_is_not_a_mapping_names_the_file_and_line(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("# steps, as a list\n- 1\n- 2\n", encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_train_config(path)
    assert str(info.value) == f"{path}:2: top level must be a mapping, got list"


@pytest.mark.parametrize(("text", "where"), [
    ("name: x\nrollout: {top_p: 0.5\nsteps: 3\n", "line 3, column 6"),
    ('name: x\nout_dir: "a\x01b"\n', "line 2, column 12"),  # a control character
])
def test_a_yaml_error_is_one_line_naming_the_file_and_line(tmp_path, text, where):
    path = tmp_path / "broken.yaml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_train_config(path)
    message = str(info.value)
    assert message.startswith(f"{path}: invalid YAML: {where}: "), message
    assert "\n" not in message


def test_offered_workers_reach_the_episodes_and_must_be_distinct():
    from jax_routeweaver.rl.run.routeweaver_run import env_config
    from jax_routeweaver.rl.run.train_config import load_train_config

    cfg = load_train_config(QUICKSTART, ["workers.offered=[worker_1, worker_4]"])
    assert env_config(cfg, 0).offered == ("worker_1", "worker_4")
    assert env_config(load_train_config(QUICKSTART), 0).offered == ()  # the whole pool
    with pytest.raises(ConfigError, match=r"workers\.offered"):
        load_train_config(QUICKSTART, ["workers.offered=[worker_1, worker_1]"])
