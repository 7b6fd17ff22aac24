"""A complete ppo_minimal.Batch from the tensors a test cares about (imported by the test modules).

The trainer always builds every field (train() stanza 4); a test that exercises one piece of the update gives
the tensors that piece reads and gets the neutral value of the others: the clip anchored at old_logprobs, token
weights and importance weights 1, the pg / entropy masks equal to the response mask, returns equal to the
advantages, no critic.
"""

import torch

import ppo_minimal as pm


def full_batch(**fields) -> pm.Batch:
    """A Batch of `fields` (input_ids, attention_mask, response_mask, old_logprobs, ref_logprobs, advantages at
    least) with the neutral values above for the fields left out (or given as None)."""
    fields = {k: v for k, v in fields.items() if v is not None}
    ones = torch.ones_like(fields["old_logprobs"])  # [B, R]
    neutral = {
        "clip_anchor": fields["old_logprobs"],
        "returns": fields["advantages"],
        "token_weights": ones,
        "pg_mask": fields["response_mask"],
        "ent_mask": fields["response_mask"],
        "is_weights": ones,
        "old_values": None,
        "critic_returns": None,
        "shares": None,
    }
    return pm.Batch(**{**neutral, **{k: v for k, v in fields.items() if k in neutral or k in pm.Batch.__annotations__}})
