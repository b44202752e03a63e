"""A scripted `Sampler` for episode tests: the policy's text comes from a function of the
context, so tests know exactly which tokens the policy 'sampled'."""

from collections.abc import Callable, Sequence

from jax_routeweaver.sampling.base import Completion, SamplingParams, apply_stop_strings


class ScriptedSampler:
    """`script(context_text, params) -> str` gives the next turn's text; it is encoded with the
    tokenizer, cut at the params' stop strings in token space (as a real sampler would), and
    returned with logprob -0.25 per token. Records every call in `calls`."""

    def __init__(self, tokenizer, script: Callable[[str, SamplingParams], str], version: int = 7):
        self.tok = tokenizer
        self.script = script
        self.version = version
        self.calls: list[tuple[int, SamplingParams, Sequence | None]] = []

    @property
    def policy_version(self) -> int:
        return self.version

    def generate(self, prompts, params, grammars=None):
        self.calls.append((len(prompts), params, grammars))
        out = []
        for p in prompts:
            text = self.script(self.tok.decode(p), params)
            ids = self.tok.encode(text, add_special_tokens=False)[:params.max_new_tokens]
            stop = ids and ids[-1] in params.stop_token_ids
            c = Completion(ids, [-0.25] * len(ids), "stop_token" if stop else "length",
                           ids[-1] if stop else None, self.version)
            if params.stop_strings:
                c = apply_stop_strings(c, self.tok.decode, params.stop_strings)
            out.append(c)
        return out

    def update_weights(self, weights, version):
        self.version = version
