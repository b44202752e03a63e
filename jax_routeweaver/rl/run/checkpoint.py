"""Policy checkpoints: the parameters of a `Qwen3` per training step, managed by orbax.

Layout of a checkpoint directory::

    CKPT_DIR/
      <step>/                  one per saved step (orbax `CheckpointManager`, plain step names)
        params/                item `params`: the nnx.Param state as a pure nested dict
        model_config/metadata  item `model_config` (JSON): {"format": 1,
                               "model_config": dataclasses.asdict(ModelConfig),
                               "hf_config": the HF config.json dict (`ModelConfig.to_hf()`)}
      tokenizer/               tokenizer files, copied once by the first save given them

Every step is self-describing: restoring needs nothing outside CKPT_DIR. `model_config` is
authoritative for restoring; `hf_config` is there for exporters and inference sidecars.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding

from jax_routeweaver.models.config import ModelConfig
from jax_routeweaver.models.hf import CheckpointError, tokenizer_files
from jax_routeweaver.models.policy_step import (
    CONFIG_ITEM,
    PARAMS_ITEM,
    config_from_json,
    config_to_json,
    first_line,
    flatten,
)
from jax_routeweaver.models.qwen3 import Qwen3
from jax_routeweaver.models.sharding import TRAIN_RULES, Rules, param_specs

TOKENIZER_DIR = "tokenizer"
# Runtime options a restore may change; architecture fields come from the checkpoint only.
RUNTIME_OPTIONS = ("compute_dtype", "scan_layers", "remat", "remat_groups", "logprob_chunk",
                   "attention_block", "causal_parts")
# Spelled out (it is orbax's default) because `step_dir` builds the same names.
STEP_FORMAT = ocp.step.standard_name_format()


# ------------------------------------------------------------------------------ tokenizer
def has_tokenizer(src: str | Path) -> bool:
    """Whether `src` holds HF tokenizer files (see `tokenizer_files`)."""
    try:
        tokenizer_files(src)
    except FileNotFoundError:
        return False
    return True


# ------------------------------------------------------------------------------ checkpointer
def _handler_registry() -> ocp.handlers.CheckpointHandlerRegistry:
    """Our items and their handlers, declared up front so metadata reads know them."""
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    for item, arg_types in ((PARAMS_ITEM, (ocp.args.StandardSave, ocp.args.StandardRestore)),
                            (CONFIG_ITEM, (ocp.args.JsonSave, ocp.args.JsonRestore))):
        for arg_type in arg_types:
            registry.add(item, arg_type)
    return registry


class PolicyCheckpointer:
    """Saves and restores policy steps under one CKPT_DIR (one orbax CheckpointManager).

    Use it as a context manager, or call `close()`. `keep`: keep only the `keep` most recently
    saved steps (None keeps all). `read_only=True` creates and deletes nothing (restoring,
    sidecars) and needs the directory to exist. Orbax saves asynchronously;
    `save(block=False)` returns once the arrays are copied off the devices, and `wait()` returns
    once every pending step is committed on disk.
    """

    def __init__(self, ckpt_dir: str | Path, *, keep: int | None = None,
                 read_only: bool = False):
        # Orbax's tensorstore layer insists on absolute paths.
        self.dir = Path(ckpt_dir).absolute()
        self.read_only = read_only
        if self.dir.exists() and not self.dir.is_dir():
            raise CheckpointError(f"{self.dir}: not a directory")
        if read_only and not self.dir.is_dir():
            raise FileNotFoundError(f"{self.dir}: no such checkpoint directory")
        if keep is not None and keep < 1:
            raise ValueError(f"keep={keep}: must be a positive number of steps or None")
        policy = None if keep is None else ocp.checkpoint_managers.LatestN(n=keep)
        options = ocp.CheckpointManagerOptions(create=not read_only, read_only=read_only,
                                               step_name_format=STEP_FORMAT,
                                               preservation_policy=policy)
        self._manager = ocp.CheckpointManager(self.dir, options=options,
                                              handler_registry=_handler_registry())

    def __enter__(self) -> PolicyCheckpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Wait for pending saves, then release orbax's threads (even if a save failed)."""
        try:
            self._manager.wait_until_finished()
        finally:
            self._manager.close()

    def wait(self) -> None:
        """Block until every pending save is committed."""
        self._manager.wait_until_finished()

    # ---------------------------------------------------------------------------- steps
    def steps(self) -> list[int]:
        """Saved steps, ascending. A writer's list includes steps still being written (it is
        the only writer); a reader re-reads the disk, where another process may be writing."""
        if self.read_only:
            self._manager.reload()
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def delete_after(self, step: int) -> list[int]:
        """Delete the steps newer than `step` (a run resumed from `step` redoes them);
        returns the deleted steps."""
        if self.read_only:
            raise CheckpointError(f"{self.dir}: opened read-only, cannot delete steps")
        newer = [s for s in self.steps() if s > step]
        for s in newer:
            self._manager.delete(s)
        return newer

    def step_dir(self, step: int) -> Path:
        return self.dir / STEP_FORMAT.build_name(step)

    def _resolve(self, step: int | None) -> int:
        steps = self.steps()
        if not steps:
            raise FileNotFoundError(f"{self.dir}: no checkpoint steps found")
        if step is None:
            return steps[-1]
        if step not in steps:
            raise FileNotFoundError(f"{self.dir}: no step {step} (available steps: {steps})")
        return step

    # ---------------------------------------------------------------------------- save
    def save(self, model: Qwen3, step: int, *, tokenizer_dir: str | Path | None = None,
             block: bool = True) -> Path:
        """Save `model`'s parameters and config as `step`; returns the step directory.

        CheckpointError if the step exists already. `tokenizer_dir`: copy its tokenizer files
        to CKPT_DIR/tokenizer unless that exists (a run has one tokenizer). `block=False` returns
        while orbax writes in the background (single-process only; `wait` joins it).
        """
        if self.read_only:
            raise CheckpointError(f"{self.dir}: opened read-only, cannot save step {step}")
        step = int(step)
        if step < 0:
            raise ValueError(f"step={step}: must be >= 0")
        existing = self.steps()
        if step in existing:
            raise CheckpointError(f"{self.dir}: step {step} already exists "
                                  f"(steps: {existing})")
        # Checked before writing, so a bad path does not leave a step without its tokenizer;
        # by process 0 only, which copies it (the others need not see it yet).
        files = tokenizer_files(tokenizer_dir) \
            if tokenizer_dir is not None and jax.process_index() == 0 else []
        params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        args = ocp.args.Composite(**{
            PARAMS_ITEM: ocp.args.StandardSave(params),
            CONFIG_ITEM: ocp.args.JsonSave(config_to_json(model.config)),
        })
        # force: orbax otherwise skips, silently, a step that is not newer than the latest.
        self._manager.save(step, args=args, force=True)
        # Always blocks on multi-host: two managers finalizing at once there share orbax's
        # barrier names ("Barrier ThreadSaveMultiHostValueHolder:set_value_start is already
        # ongoing") and the run hangs.
        if block or jax.process_count() > 1:
            self.wait()
        if files:
            self._copy_tokenizer(files)
        return self.step_dir(step)

    def _copy_tokenizer(self, files: list[Path]) -> None:
        dest = self.dir / TOKENIZER_DIR
        if dest.exists() or jax.process_index() != 0:
            return
        # Copy to a side directory and rename, so readers see all the files or none.
        partial = self.dir / f".{TOKENIZER_DIR}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir()
        for f in files:
            shutil.copyfile(f, partial / f.name)
        partial.rename(dest)

    @property
    def tokenizer_dir(self) -> Path | None:
        """CKPT_DIR/tokenizer if a save stored one, else None."""
        dest = self.dir / TOKENIZER_DIR
        return dest if dest.is_dir() else None

    # ---------------------------------------------------------------------------- restore
    def read_config(self, step: int | None = None) -> ModelConfig:
        """The `ModelConfig` stored with `step` (default: latest)."""
        step = self._resolve(step)
        where = f"{self.step_dir(step)}/{CONFIG_ITEM}"
        args = ocp.args.Composite(**{CONFIG_ITEM: ocp.args.JsonRestore()})
        try:
            meta = self._manager.restore(step, args=args)[CONFIG_ITEM]
        except (KeyError, FileNotFoundError) as e:
            raise CheckpointError(f"{where}: missing ({first_line(e)})") from e
        except ValueError as e:  # includes json.JSONDecodeError
            raise CheckpointError(f"{where}: corrupt ({first_line(e)})") from e
        return config_from_json(meta, where)

    def restore(self, step: int | None = None, *, mesh: Mesh | None = None,
                rules: Rules = TRAIN_RULES, dtype: str | None = None,
                **runtime: Any) -> tuple[Qwen3, int]:
        """Rebuild the model of `step` (default: latest); returns (model, step).

        With `mesh`, each array is read straight into its sharding from `param_specs(rules)`;
        without, onto one local device. `dtype` sets the parameter (and, unless
        `compute_dtype` is given, compute) dtype, cast while reading. `runtime`: any of
        RUNTIME_OPTIONS. Raises FileNotFoundError for a missing step (naming the available
        ones) and CheckpointError for a missing or corrupt item, or for stored arrays that
        cannot be read (a truncated or corrupt data file: `unreadable`).
        """
        step = self._resolve(step)
        cfg = _with_runtime(self.read_config(step), dtype, runtime)
        abstract = nnx.eval_shape(lambda: Qwen3(cfg, rngs=nnx.Rngs(0)))
        graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
        target = abstract_params(abstract, mesh, rules)
        where = f"{self.step_dir(step)}/{PARAMS_ITEM}"
        # Compared first: orbax's own mismatch errors are pages long and leave threads behind.
        _check_shapes(self._stored_params(step, where), flatten(target), where)
        args = ocp.args.Composite(**{PARAMS_ITEM: ocp.args.StandardRestore(target)})
        try:
            restored = self._manager.restore(step, args=args)[PARAMS_ITEM]
        except (KeyError, FileNotFoundError) as e:
            raise CheckpointError(f"{where}: missing ({first_line(e)})") from e
        except Exception as e:  # orbax wraps tensorstore's read errors in a bare Exception
            if not is_read_error(e):
                raise
            raise unreadable(self.step_dir(step), e) from e
        nnx.replace_by_pure_dict(params, restored)
        return nnx.merge(graphdef, params, rest), step


    def _stored_params(self, step: int, where: str) -> dict[tuple[str, ...], Any]:
        """path -> stored array metadata (shape, dtype) of `step`'s params, read cheaply."""
        try:
            stored = self._manager.item_metadata(step)[PARAMS_ITEM]
        except (KeyError, FileNotFoundError, ValueError) as e:
            raise CheckpointError(f"{where}: missing or unreadable ({first_line(e)})") from e
        if stored is None:
            raise CheckpointError(f"{where}: missing")
        return flatten(getattr(stored, "tree", stored))


def is_read_error(e: BaseException) -> bool:
    """Whether `e` is how orbax reports stored data it cannot read: tensorstore's ValueError
    (OUT_OF_RANGE, DATA_LOSS, ...: a truncated or corrupt data file), json's (a ValueError),
    an OSError, or the bare `Exception` orbax raises around them while reading an array."""
    return isinstance(e, ValueError | OSError) or type(e) is Exception


def unreadable(step_dir: str | Path, e: BaseException) -> CheckpointError:
    """The one-line error for a checkpoint step whose stored data cannot be read: names the
    step directory and the innermost cause (orbax's own message is a pointer to it)."""
    while e.__cause__ is not None:
        e = e.__cause__
    return CheckpointError(f"checkpoint {step_dir}: unreadable (truncated or corrupt: "
                           f"{first_line(e)})")


def _check_shapes(stored: dict[tuple[str, ...], Any], want: dict[tuple[str, ...], Any],
                  where: str) -> None:
    """CheckpointError naming the parameter if the stored arrays do not fit the model."""
    name = ".".join
    missing = sorted(name(p) for p in set(want) - set(stored))
    extra = sorted(name(p) for p in set(stored) - set(want))
    if missing or extra:
        raise CheckpointError(f"{where}: does not match its model_config (missing {missing}, "
                              f"unexpected {extra})")
    for path, target in want.items():
        shape = tuple(stored[path].shape)
        if shape != tuple(target.shape):
            raise CheckpointError(f"{where}: does not match its model_config ({name(path)} "
                                  f"has shape {list(shape)}, expected {list(target.shape)})")


def _with_runtime(cfg: ModelConfig, dtype: str | None, runtime: dict[str, Any]) -> ModelConfig:
    """Apply restore-time options the way `load_hf` does (`dtype` also sets compute dtype)."""
    unknown = sorted(set(runtime) - set(RUNTIME_OPTIONS))
    if unknown:
        raise ValueError(f"{unknown}: not runtime options (allowed: {list(RUNTIME_OPTIONS)})")
    changes = dict(runtime)
    compute = changes.pop("compute_dtype", None)
    if dtype is not None:
        changes["param_dtype"] = dtype
    if compute or dtype:
        changes["dtype"] = compute or dtype
    return cfg.replace(**changes) if changes else cfg


def abstract_params(abstract: Qwen3, mesh: Mesh | None = None,
                    rules: Rules = TRAIN_RULES) -> dict[str, Any]:
    """The pure-dict restore target: a `jax.ShapeDtypeStruct` with its sharding per param."""
    if mesh is None:
        one_device = SingleDeviceSharding(jax.local_devices()[0])
        sharding = lambda path: one_device
    else:
        specs = param_specs(abstract, rules, mesh)
        sharding = lambda path: NamedSharding(mesh, specs[path])

    def leaf(keys: tuple, x: Any) -> jax.ShapeDtypeStruct:
        path = tuple(k.key for k in keys)
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding(path))

    pure = nnx.to_pure_dict(nnx.state(abstract, nnx.Param))
    return jax.tree_util.tree_map_with_path(leaf, pure)


# ------------------------------------------------------------------------------ functions
def save_policy(model: Qwen3, ckpt_dir: str | Path, step: int, *,
                tokenizer_dir: str | Path | None = None, keep: int | None = None) -> Path:
    """Save `model` as `step` of `ckpt_dir` (created if needed) and wait until it is on disk.

    Returns the step directory. See `PolicyCheckpointer.save`.
    """
    with PolicyCheckpointer(ckpt_dir, keep=keep) as ckpt:
        return ckpt.save(model, step, tokenizer_dir=tokenizer_dir)


def restore_policy(ckpt_dir: str | Path, step: int | None = None, *, mesh: Mesh | None = None,
                   rules: Rules = TRAIN_RULES, dtype: str | None = None,
                   **runtime: Any) -> tuple[Qwen3, int]:
    """(model, step) from `ckpt_dir` (latest step by default). See `PolicyCheckpointer.restore`.

    FileNotFoundError names the directory (and the available steps for a missing step).
    """
    with PolicyCheckpointer(ckpt_dir, read_only=True) as ckpt:
        return ckpt.restore(step, mesh=mesh, rules=rules, dtype=dtype, **runtime)


def list_steps(ckpt_dir: str | Path) -> list[int]:
    """The committed steps of `ckpt_dir`, ascending; [] if it does not exist."""
    if not Path(ckpt_dir).is_dir():
        return []
    with PolicyCheckpointer(ckpt_dir, read_only=True) as ckpt:
        return ckpt.steps()


def latest_step(ckpt_dir: str | Path) -> int | None:
    """The newest committed step of `ckpt_dir`; None if it has none or does not exist."""
    steps = list_steps(ckpt_dir)
    return steps[-1] if steps else None


# ------------------------------------------------------------------------------ train state
STATE_ITEM = "train_state"
LOOP_ITEM = "loop"


def _keyed_leaves(tree: Any) -> dict[str, Any]:
    """{keypath string: leaf}: any pytree (nnx.State, optax NamedTuples) as a flat dict orbax
    stores without knowing the node types; the caller's own tree rebuilds the structure."""
    return {jax.tree_util.keystr(path): leaf
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


class StateCheckpointer:
    """Full train state every N steps, for exact resume: the state pytree (params, optimizer
    state, step, RNG: arrays, restored into the shardings of a live template) and a JSON
    `loop` item (data-iterator position, reward-window state, anything JSON-able).

    `keep`: after each save, keep only the `keep` newest steps (None keeps all); it must be at
    least 1 (ValueError otherwise), and pruning never deletes the newest step whatever `keep`
    says. Restoring a step whose data cannot be read, or that another model or optimizer
    saved, is a one-line CheckpointError naming the step directory; nothing is deleted.
    """

    def __init__(self, ckpt_dir: str | Path, *, keep: int | None = 2):
        if keep is not None and keep < 1:
            raise ValueError(f"keep={keep}: must keep at least 1 full train state (or None "
                             "to keep all)")
        self.dir = Path(ckpt_dir).absolute()
        self.keep = keep
        registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
        for item, arg_types in ((STATE_ITEM, (ocp.args.StandardSave, ocp.args.StandardRestore)),
                                (LOOP_ITEM, (ocp.args.JsonSave, ocp.args.JsonRestore))):
            for arg_type in arg_types:
                registry.add(item, arg_type)
        # Pruned by `_prune`, not by an orbax preservation policy: the newest step's survival
        # is then this class's guarantee.
        options = ocp.CheckpointManagerOptions(step_name_format=STEP_FORMAT)
        self._manager = ocp.CheckpointManager(self.dir, options=options,
                                              handler_registry=registry)

    def __enter__(self) -> StateCheckpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def step_dir(self, step: int) -> Path:
        return self.dir / STEP_FORMAT.build_name(step)

    def save(self, step: int, state: Any, loop: dict[str, Any]) -> None:
        """Save and wait until committed (a resume must never see half a step), then prune."""
        args = ocp.args.Composite(**{STATE_ITEM: ocp.args.StandardSave(_keyed_leaves(state)),
                                     LOOP_ITEM: ocp.args.JsonSave(loop)})
        self._manager.save(int(step), args=args, force=True)
        self._manager.wait_until_finished()
        self._prune()

    def _prune(self) -> list[int]:
        """Delete all but the `keep` newest steps, never the newest; returns the deleted."""
        if self.keep is None:
            return []
        steps = sorted(self._manager.all_steps())
        old = steps[:max(len(steps) - max(self.keep, 1), 0)]
        for s in old:
            self._manager.delete(s)
        return old

    def _step(self, step: int | None) -> int:
        step = self._manager.latest_step() if step is None else int(step)
        if step is None:
            raise FileNotFoundError(f"{self.dir}: no train-state checkpoint")
        return step

    def read_loop(self, step: int | None = None) -> dict[str, Any]:
        """The JSON `loop` item of a saved step (latest by default), without the arrays."""
        step = self._step(step)
        try:
            got = self._manager.restore(step, args=ocp.args.Composite(
                **{LOOP_ITEM: ocp.args.JsonRestore()}))
        except KeyError as e:
            raise CheckpointError(f"{self.step_dir(step)}: missing ({first_line(e)})") from e
        except Exception as e:
            if not is_read_error(e):
                raise
            raise unreadable(self.step_dir(step), e) from e
        return dict(got[LOOP_ITEM])

    def restore(self, template: Any, step: int | None = None) -> tuple[Any, dict[str, Any], int]:
        """(state shaped and sharded like `template`, loop dict, step); latest by default.
        A leaf the template holds uncommitted (a fresh optimizer state, which the first
        jitted update places) comes back uncommitted on the default device, as at a fresh
        start: committed to one device it would clash with mesh-sharded params in the next
        update. A state saved from a different model or optimizer, or one whose stored data
        cannot be read (`unreadable`), is a CheckpointError."""
        step = self._step(step)
        treedef = jax.tree_util.tree_structure(template)
        keyed = _keyed_leaves(template)
        where = self.step_dir(step)
        # Compared first, from the metadata: a read error of the arrays then means bad data.
        self._check_leaves(step, keyed, where)
        loose = {k for k, v in keyed.items() if not getattr(v, "committed", True)}
        target = {k: np.empty(v.shape, v.dtype) if k in loose
                  else jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding)
                  for k, v in keyed.items()}
        args = ocp.args.Composite(**{STATE_ITEM: ocp.args.StandardRestore(target),
                                     LOOP_ITEM: ocp.args.JsonRestore()})
        try:
            got = self._manager.restore(step, args=args)
        except KeyError as e:
            raise CheckpointError(f"{where}: missing ({first_line(e)})") from e
        except Exception as e:  # orbax wraps tensorstore's read errors in a bare Exception
            if not is_read_error(e):
                raise
            raise unreadable(where, e) from e
        restored = got[STATE_ITEM]
        state = jax.tree_util.tree_unflatten(
            treedef, [jnp.asarray(restored[k]) if k in loose else restored[k] for k in keyed])
        return state, dict(got[LOOP_ITEM]), step

    def _check_leaves(self, step: int, keyed: dict[str, Any], where: Path) -> None:
        """CheckpointError unless `step` stores exactly `keyed`'s leaves with their shapes."""
        try:
            stored = self._manager.item_metadata(step)[STATE_ITEM]
        except KeyError as e:
            raise CheckpointError(f"{where}: missing ({first_line(e)})") from e
        except Exception as e:
            if not is_read_error(e):
                raise
            raise unreadable(where, e) from e
        if stored is None:
            raise CheckpointError(f"{where}: no {STATE_ITEM} item")
        stored = dict(getattr(stored, "tree", stored))
        if set(stored) != set(keyed):
            raise CheckpointError(f"{where}: train-state leaves differ from this run's")
        for k, v in keyed.items():
            if tuple(stored[k].shape) != tuple(v.shape):
                raise CheckpointError(f"{where}: cannot restore the train state into this "
                                      f"model/optimizer (leaf {k} has shape "
                                      f"{tuple(stored[k].shape)}, this run's {tuple(v.shape)})")
