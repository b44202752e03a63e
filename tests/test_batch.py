"""Packing trajectories for the update: layout, padding buckets, policy-token gather."""

import numpy as np
import pytest

from jax_routeweaver.data.records import Record
from jax_routeweaver.rewards.reward import Rewards
from jax_routeweaver.rl.learner.batch import POLICY_WIDTH_MIN, length_bucket, pack_rollouts
from jax_routeweaver.routing.episodes.episode import Trajectory


@pytest.mark.parametrize(("n", "bucket"), [(1, 64), (64, 64), (65, 96), (96, 96), (97, 128),
                                           (1100, 1536), (1537, 2048), (3000, 3072)])
def test_length_buckets_are_powers_of_two_and_their_halves(n, bucket):
    assert length_bucket(n, 64) == bucket


def traj(sample_id: str, repeat: int, prompt: int, response: list[int], mode: str
         ) -> Trajectory:
    record = Record(sample_id=sample_id, domain="MATH", dataset="d", scorer_dataset="math",
                    question="q", gold=["1"])
    return Trajectory(record=record, repeat=repeat, prompt_ids=list(range(1, prompt + 1)),
                      response_ids=[7] * len(response), policy_mask=response,
                      logprobs=[-0.5] * len(response), mode=mode, mode_span_end=2)


def rewards(r: float) -> Rewards:
    return Rewards(r_task=r, r_eff=r, infra=False, s_cost=1.0, cost_usd=0.0,
                   cost_complete=True, failure_kind="")


def test_pack_lays_out_rows_and_gathers_the_policy_tokens():
    trajs = [traj("a", 0, 3, [1, 1, 0, 0, 1], "single"), traj("a", 1, 4, [1, 1, 1], "multi"),
             traj("b", 0, 2, [1] * 70, "agentic"), traj("b", 1, 5, [1, 0, 1], "single")]
    batch = pack_rollouts(trajs, [rewards(x) for x in (1, 0, 1, 0)], group_size=2, pad_id=0,
                          row_multiple=8)
    assert batch.shape == (8, 96)  # 8 rows (4 padding); 72 tokens -> bucket 96 of 64
    # The 70-token row needs more than the minimum width: the next bucket.
    assert batch.policy_index.shape == (8, 96) and POLICY_WIDTH_MIN == 64
    np.testing.assert_array_equal(batch.policy_index[0, :3], [3, 4, 7])
    assert batch.policy_valid[0].sum() == 3 and batch.policy_valid[2].sum() == 70
    assert batch.policy_valid[4:].sum() == 0 and not batch.real[4:].any()
    np.testing.assert_array_equal(batch.group_ids, [0, 0, 1, 1, 2, 3, 4, 5])
    np.testing.assert_array_equal(batch.mode_span_end[:4], [5, 6, 4, 7])
    gathered = batch.gather(batch.sampler_logp)
    assert gathered.shape == (8, 96)
    np.testing.assert_allclose(gathered[1, :3], -0.5)
    np.testing.assert_allclose(gathered[1, 3:], 0.0)
