"""What the serving tests share: a quickstart run holding a random-init router, and a
server running in a thread (`Served`)."""

from __future__ import annotations

import io
import threading
import time
from pathlib import Path

from rich.console import Console

from jax_routeweaver.config import dump_config
from jax_routeweaver.models.sharding import make_mesh
from jax_routeweaver.rl.run.builders import build_policy, build_pool, build_records, build_tokenizer
from jax_routeweaver.rl.run.checkpoint import save_policy
from jax_routeweaver.rl.run.train_config import load_train_config
from jax_routeweaver.serving.app import create_app
from jax_routeweaver.serving.config import ServeConfig
from jax_routeweaver.serving.metrics import ServeMetrics
from jax_routeweaver.serving.runtime import build_runtime, serve_config

QUICKSTART = Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"
PROXY_VARS = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy",
              "all_proxy")


def tiny_run(root: Path, *overrides: str) -> tuple[Path, list]:
    """(a quickstart run directory holding a random-init router as policy step 1, its
    questions); `overrides` change the quickstart config."""
    out = root / "run"
    cfg = load_train_config(QUICKSTART, [f"out_dir={out}", "model.init=random",
                                         "data.synthetic_queries=40", "logging.progress=false",
                                         *overrides])
    records = build_records(cfg, Console(file=io.StringIO()))
    tokenizer = build_tokenizer(cfg, records, build_pool(cfg, records, check=False))
    tokenizer.save_pretrained(str(root / "tokenizer"))
    save_policy(build_policy(cfg, make_mesh((1, -1, 1)), tokenizer),
                out / "checkpoints" / "policy", 1, tokenizer_dir=root / "tokenizer")
    dump_config(cfg, out / "config.yaml")
    return out, records


class Served:
    """A server running in a thread (its own event loop), its runtime and metrics."""

    def __init__(self, checkpoint: Path, channels: Path, options: ServeConfig,
                 token: str | None, overrides: tuple[str, ...] = (),
                 work_dir: Path | None = None):
        cfg, ckpt = serve_config(checkpoint, channels, overrides=overrides)
        self.metrics = ServeMetrics()
        self.runtime = build_runtime(cfg, ckpt, options, metrics=self.metrics,
                                     work_dir=work_dir)
        self.app = create_app(self.runtime.service, options, token=token, metrics=self.metrics,
                              on_shutdown=self.runtime.aclose)
        import uvicorn

        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=0,
                                                    log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 120
        while not self.server.started:
            assert time.time() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.05)
        # What the warm-up (`ServeConfig.warmup_rows`) sampled before the first request.
        self.warm_batches, self.warm_rows = self.runtime.sampler.batches, \
            self.runtime.sampler.rows
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.base = f"http://127.0.0.1:{port}"
        self.url = self.base + "/v1"

    @property
    def state(self):
        return self.app.state.routeweaver

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(60)
