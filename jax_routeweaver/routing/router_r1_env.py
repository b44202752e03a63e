"""Router-R1 as an `episode.Env`: its dialect (`router_r1.py`) driven turn by turn.

The router names LLMs by their Router-R1 names; the worker pool only knows anonymous ids, so
`model_workers` maps each `RouterR1Model.name` the policy may call to a pool worker id.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from jax_routeweaver.data.records import Record
from jax_routeweaver.routing import router_r1 as r1
from jax_routeweaver.routing.calls import WorkerCall
from jax_routeweaver.routing.episode import CallRequest, EnvFactory, Step, Trajectory, Turn
from jax_routeweaver.sampling.base import Completion, SamplingParams


class RouterR1Env:
    """One Router-R1 episode. `tokenizer`: HF tokenizer (chat template, encode, decode)."""

    def __init__(self, tokenizer: Any, model_workers: Mapping[str, str],
                 config: r1.RouterR1Config, sampling: SamplingParams):
        self.tok = tokenizer
        self.model_workers = model_workers
        self.config = config
        self.sampling = sampling
        self.state = r1.EpisodeState()
        self.eos_ids = tuple(sampling.stop_token_ids) or tuple(
            i for i in (tokenizer.eos_token_id,) if i is not None)

    def _encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)

    def start(self, traj: Trajectory) -> Sequence[int]:
        return ()

    def next_turn(self, traj: Trajectory) -> Turn | None:
        if traj.done:
            return None
        if len(traj.response_ids) >= self.config.trajectory_max_tokens:
            traj.finish = "length_limit"
            return None
        return Turn(self.sampling)

    def context(self, traj: Trajectory) -> list[int]:
        return traj.context_ids[-self.config.context_max_tokens:]

    def step(self, traj: Trajectory, completion: Completion) -> Step:
        keep = r1.cut_turn_ids(completion.token_ids, self._decode,
                               drop_trailing_ids=self.eos_ids)
        action = r1.parse_action(self._decode(completion.token_ids[:keep]))
        decision = r1.decide_turn(self.state, action, self.config)
        if isinstance(decision, r1.EndEpisode):
            traj.finish = decision.reason
            if isinstance(action, r1.AnswerAction):
                traj.answer = action.answer
                traj.final_turn = self._decode(completion.token_ids[:keep])
            return Step(keep)
        self.state = r1.advance(self.state, decision)
        if isinstance(decision, r1.AppendObservation):
            traj.notices.append(decision.reason)
            return Step(keep, self._cap(decision.text))
        worker = self.model_workers.get(decision.model.name)
        if worker is None:  # a real model the pool does not serve: Router-R1 shows "None"
            traj.notices.append("model_not_served")
            return Step(keep, self._cap(r1.render_observation(None)))
        return Step(keep, calls=[CallRequest(worker, decision.prompt,
                                             max_tokens=self.config.worker_max_tokens)])

    async def inspect(self, traj: Trajectory, calls: Sequence[WorkerCall]) -> None:
        return None

    def observe(self, traj: Trajectory, calls: Sequence[WorkerCall]) -> Sequence[int]:
        return self._cap(r1.observation_for_call(calls[0]))

    def _cap(self, text: str) -> list[int]:
        return r1.cap_observation(text, self._encode, self._decode,
                                  self.config.obs_max_tokens).ids


def router_r1_envs(tokenizer: Any, model_workers: Mapping[str, str], *,
                   config: r1.RouterR1Config | None = None, validation: bool = False,
                   sampling: SamplingParams | None = None) -> EnvFactory:
    """An `EnvFactory` for `run_episodes`: Router-R1 prompt ids and a fresh env per episode.

    `sampling` overrides the reference's rollout sampling (e.g. to set a seed); its
    `max_new_tokens` is the per-turn cap.
    """
    config = config or r1.RouterR1Config()
    unknown = sorted(set(model_workers) - {m.name for m in r1.ALL_MODELS})
    if unknown:
        raise ValueError(f"model_workers names unknown Router-R1 models {unknown}")
    params = sampling or r1.rollout_sampling_params(config, validation=validation)
    if params.stop_token_ids == () and tokenizer.eos_token_id is not None:
        params = dataclasses.replace(params, stop_token_ids=(tokenizer.eos_token_id,))

    def make(record: Record, repeat: int) -> tuple[list[int], RouterR1Env]:
        prompt = r1.render_prompt_ids(record.question, tokenizer, config)
        return prompt, RouterR1Env(tokenizer, model_workers, config, params)

    return make
