"""Serving a trained router: an OpenAI-compatible endpoint (`app`) over one `RouterService`
(`router`) that runs each request's episode on a shared batching sampler (`batcher`) within
the request's cost budget (`budget`); `runtime` builds it from a checkpoint and a channel
file, `openai_api` is the wire format, `metrics` the Prometheus counters, `config` the
settings. The command is `routeweaver serve` (`cli.serve_cmd`).
"""
