"""An OpenAI-compatible chat endpoint on loopback that answers as the SIMULATED workers
(`SimServer`; its model list at GET .../models), and a channel file pointing the six workers at
it, priced: real HTTP through `HttpWorkerPool` without a paid API."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import yaml

from jax_routeweaver.routing.pricing import REFERENCE_PRICES
from jax_routeweaver.routing.simulated import SimulatedWorkerPool

KEY_ENV, SECRET = "RW_STUB_TEST_KEY", "sk-stub-test-9f8e7d6c5b4a"
PROXY_VARS = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy",
              "all_proxy")


class SimServer:
    """An OpenAI-compatible endpoint on loopback whose model ``sim-K`` answers as simulated
    worker_K; it keeps every request body. ``GET .../models`` answers `models_status` with
    the OpenAI model list of `models` (default: ``sim-K`` for every simulated worker) and
    keeps each request's Authorization header in `models_auth`."""

    def __init__(self, sim: SimulatedWorkerPool, models: list[str] | None = None):
        self.bodies: list[dict] = []
        self.models = [f"sim-{w[7:]}" for w in sim.worker_ids()] if models is None \
            else list(models)
        self.models_status = 200
        self.models_auth: list[str | None] = []
        lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_GET(self):
                outer.models_auth.append(self.headers.get("Authorization"))
                found = self.path.rstrip("/").endswith("/models")
                status = outer.models_status if found else 404
                payload = json.dumps({"object": "list", "data": [
                    {"id": m, "object": "model"} for m in outer.models]}).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with lock:
                    outer.bodies.append(body)
                worker = "worker_" + body["model"].split("-")[1]
                call = sim.respond(worker, body["messages"][0]["content"],
                                   max_tokens=body["max_tokens"])
                usage = {"prompt_tokens": call.usage.prompt_tokens,
                         "completion_tokens": call.usage.completion_tokens}
                payload = json.dumps({"choices": [{"message": {"content": call.text}}],
                                      "usage": usage}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def channel_file(path: Path, sim: SimulatedWorkerPool, url: str,
                 prices: dict | None = None) -> Path:
    """Channels for every simulated worker at `url`; worker_1's key is read from KEY_ENV.
    Each is priced at the reference table (as the simulated pool bills), or at `prices`
    (worker -> (input, output) USD per 1M tokens, or None: no price entry)."""
    workers = {w: {"description": sim.description(w), "base_url": url, "model": f"sim-{w[7:]}",
                   "timeout_s": 30} for w in sim.worker_ids()}
    workers["worker_1"]["api_key_env"] = KEY_ENV
    for w, entry in workers.items():
        price = (REFERENCE_PRICES[w].input_usd_per_m, REFERENCE_PRICES[w].output_usd_per_m) \
            if prices is None else prices.get(w)
        if price is not None:
            entry["price"] = {"input": price[0], "output": price[1]}
    path.write_text(yaml.safe_dump({"workers": workers}))
    return path
