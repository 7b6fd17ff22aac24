"""A complete trainer.Batch from the tensors a test cares about (imported by the test modules).

The trainer always builds every field (train() stanza 4); a test that exercises one piece of the update gives
the tensors that piece reads and gets the neutral value of the others (replay.batch_fields, which also spells out
old dumps): the clip anchored at old_logprobs, token weights 1, no importance weights (None), the pg / entropy /
loss masks equal to the response mask, no critic.
"""

import dataclasses

import replay
import trainer

NAMES = [f.name for f in dataclasses.fields(trainer.Batch)]


def full_batch(**fields) -> trainer.Batch:
    """A Batch of `fields` (input_ids, attention_mask, response_mask, old_logprobs, ref_logprobs, advantages at
    least) with the neutral values above for the fields left out (or given as None); a misspelt field is an error."""
    if unknown := fields.keys() - set(NAMES):
        raise TypeError(f"full_batch: Batch has no field(s) {sorted(unknown)}; its fields: {NAMES}")
    return trainer.Batch(**replay.batch_fields(fields, NAMES, "full_batch"))
