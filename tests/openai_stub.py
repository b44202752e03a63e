"""An OpenAI-compatible chat endpoint on loopback that answers as the SIMULATED workers
(`SimServer`), and a channel file pointing the six workers at it: real HTTP through
`HttpWorkerPool` without a paid API."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import yaml

from jax_routeweaver.routing.simulated import SimulatedWorkerPool

KEY_ENV, SECRET = "RW_STUB_TEST_KEY", "sk-stub-test-9f8e7d6c5b4a"
PROXY_VARS = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy",
              "all_proxy")


class SimServer:
    """An OpenAI-compatible endpoint on loopback whose model ``sim-K`` answers as simulated
    worker_K; it keeps every request body."""

    def __init__(self, sim: SimulatedWorkerPool):
        self.bodies: list[dict] = []
        lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

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


def channel_file(path: Path, sim: SimulatedWorkerPool, url: str) -> Path:
    """Channels for every simulated worker at `url`; worker_1's key is read from KEY_ENV."""
    workers = {w: {"description": sim.description(w), "base_url": url, "model": f"sim-{w[7:]}",
                   "timeout_s": 30} for w in sim.worker_ids()}
    workers["worker_1"]["api_key_env"] = KEY_ENV
    path.write_text(yaml.safe_dump({"workers": workers}))
    return path
