"""`routeweaver serve`: a trained router behind an OpenAI-compatible endpoint (`serving`);
`routeweaver simulate-workers`: the SIMULATED workers behind real HTTP on loopback, to try it
without a paid API (`routing.simulated.http_endpoint`)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
from pathlib import Path

from jax_routeweaver.cli.common import Command


def _serve_arguments(p: argparse.ArgumentParser) -> None:
    from jax_routeweaver.serving.config import DEFAULT_TOKEN_ENV, ServeConfig

    d = ServeConfig()
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="config overrides of the run config, as for `routeweaver train`")
    p.add_argument("--checkpoint", required=True,
                   help="a training run directory (latest policy step), an orbax policy "
                        "checkpoint directory, one policy step directory, or a Hugging Face "
                        "directory (then --config)")
    p.add_argument("--channels", required=True, type=Path,
                   help="channel file of the workers (configs/channels/*.yaml; a worker's "
                        "optional `fallback` takes its failed calls)")
    p.add_argument("--config", type=Path, default=None,
                   help="training config whose model, rollout and workers sections to use "
                        "(default: the checkpoint's run config.yaml)")
    p.add_argument("--host", default=d.host,
                   help=f"address to bind (default {d.host}); a non-loopback address needs "
                        f"a bearer token in ${DEFAULT_TOKEN_ENV}")
    p.add_argument("--port", type=int, default=d.port, help=f"port (default {d.port}; 0: any)")
    p.add_argument("--model-name", default=d.model_name,
                   help=f"the model id clients send (default {d.model_name})")
    p.add_argument("--token-env", default=d.token_env,
                   help="NAME of the environment variable holding the clients' bearer token "
                        f"(default {d.token_env}; unset or empty: no token, loopback only)")
    p.add_argument("--max-inflight", type=int, default=d.max_inflight,
                   help=f"requests running at once; more get 503 (default {d.max_inflight})")
    p.add_argument("--max-batch", type=int, default=d.max_batch,
                   help=f"rows per router sampler batch (default {d.max_batch})")
    p.add_argument("--request-timeout", type=float, default=d.request_timeout_s,
                   help=f"seconds one request may run; then 504 (default "
                        f"{d.request_timeout_s:g})")
    p.add_argument("--worker-budget", type=float, default=d.worker_budget_s,
                   help="seconds one worker call may spend on retries before it fails and "
                        f"its fallback is asked (default {d.worker_budget_s:g})")
    p.add_argument("--warmup", type=int, default=d.warmup_rows, metavar="ROWS",
                   help="before listening, compile the router's shapes with episodes whose "
                        "calls get canned replies (nothing is sent), in batches of 1, 2, 4, "
                        "... up to ROWS (default: --max-batch; 0: off)")
    p.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes,
                   help=f"largest request body; larger get 413 (default {d.max_body_bytes})")
    p.add_argument("--max-question-tokens", type=int, default=d.max_question_tokens,
                   help=f"longest question in router tokens (default {d.max_question_tokens})")


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from jax_routeweaver.serving.app import create_app
    from jax_routeweaver.serving.config import ServeConfig, is_loopback
    from jax_routeweaver.serving.metrics import ServeMetrics
    from jax_routeweaver.serving.runtime import build_runtime, serve_config

    options = ServeConfig(host=args.host, port=args.port, model_name=args.model_name,
                          token_env=args.token_env, max_inflight=args.max_inflight,
                          max_batch=args.max_batch, request_timeout_s=args.request_timeout,
                          max_body_bytes=args.max_body_bytes,
                          worker_budget_s=args.worker_budget, warmup_rows=args.warmup,
                          max_question_tokens=args.max_question_tokens)
    token = os.environ.get(options.token_env, "").strip() or None
    if token is None and not is_loopback(options.host):
        raise ValueError(f"--host {options.host}: serving beyond loopback needs a bearer "
                         f"token; set ${options.token_env} (or bind 127.0.0.1)")
    cfg, ckpt = serve_config(args.checkpoint, args.channels, args.config, args.overrides)
    metrics = ServeMetrics()
    runtime = build_runtime(cfg, ckpt, options, metrics=metrics)
    app = create_app(runtime.service, options, token=token, metrics=metrics,
                     on_shutdown=runtime.aclose)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    print(f"routeweaver serve: {ckpt.path} (step {ckpt.step}), workers "
          f"{list(runtime.service.served)}, auth {'bearer token' if token else 'none'}",
          flush=True)
    server = uvicorn.Server(uvicorn.Config(
        app, host=options.host, port=options.port, log_level="info", lifespan="on",
        timeout_graceful_shutdown=int(options.shutdown_grace_s), access_log=True))
    # uvicorn finishes the accepted requests on SIGTERM, then re-sends the signal to the
    # handler it found: a drained shutdown is a normal exit (0), not a kill.
    signal.signal(signal.SIGTERM, _drained)
    server.run()
    return 0


def _drained(signum: int, frame: object) -> None:
    raise SystemExit(0)


def _simulate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="config overrides, as for `routeweaver train`")
    p.add_argument("--config", type=Path, required=True,
                   help="training config (or a run's config.yaml): the synthetic questions "
                        "the workers know (data.synthetic_*) and their seed (workers.seed)")
    p.add_argument("--channels-out", type=Path, required=True,
                   help="where to write the channel file pointing at the simulated workers "
                        "(for `serve --channels`)")
    p.add_argument("--port", type=int, default=0, help="port on 127.0.0.1 (default: any)")
    p.add_argument("--delay", type=float, default=0.0,
                   help="seconds each completion takes (default 0)")
    p.add_argument("--fallback", action="append", default=[], metavar="WORKER=FALLBACK",
                   help="a fallback entry of the channel file, e.g. worker_6=worker_1")


def _simulate(args: argparse.Namespace) -> int:
    import threading

    from jax_routeweaver.rl.run.train_config import load_train_config
    from jax_routeweaver.routing.simulated.http_endpoint import (
        SimulatedHttpWorkers,
        simulated_channel_file,
    )
    from jax_routeweaver.routing.simulated.pool import SimulatedWorkerPool
    from jax_routeweaver.routing.simulated.tasks import synthetic_tasks

    fallbacks = dict(f.split("=", 1) for f in args.fallback if "=" in f)
    if len(fallbacks) != len(args.fallback):
        raise ValueError(f"--fallback {args.fallback}: expected WORKER=FALLBACK entries")
    cfg = load_train_config(args.config, args.overrides)
    d = cfg.data
    if d.source != "synthetic":
        raise ValueError(f"{args.config}: data.source={d.source!r}; the simulated workers "
                         "know the synthetic questions only")
    tasks = synthetic_tasks(d.synthetic_queries, seed=d.synthetic_seed,
                            levels=d.synthetic_levels)
    sim = SimulatedWorkerPool(tasks, seed=cfg.workers.seed)
    with SimulatedHttpWorkers(sim, delay_s=args.delay, port=args.port) as workers:
        simulated_channel_file(args.channels_out, sim, workers.url, fallbacks=fallbacks)
        print(f"SIMULATED workers {sim.worker_ids()} at {workers.url} "
              f"({len(tasks)} known questions); channel file {args.channels_out}; "
              "Ctrl-C or SIGTERM stops them", flush=True)
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        with contextlib.suppress(KeyboardInterrupt):
            stop.wait()
    return 0


SIMULATE_WORKERS = Command(
    "simulate-workers", "serve the SIMULATED workers over HTTP on loopback and write their "
    "channel file (to try `serve` without a paid API)", _simulate_arguments, _simulate)

SERVE = Command("serve", "serve a trained router: an OpenAI-compatible endpoint that runs "
                "single, multi or agentic per request, within each request's max_cost",
                _serve_arguments, _serve)
