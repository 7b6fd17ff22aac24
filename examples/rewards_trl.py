"""Reward functions as TRL users write them (GRPOTrainer(reward_funcs=[...])): `--reward examples/rewards_trl.py:FN`.

TRL calls fn(prompts, completions, completion_ids, **columns) once per batch: completions are strings for plain
prompts and [{"role": "assistant", "content": ...}] for chat prompts; every other dataset column arrives as a
keyword list. Return one float per completion, or None where the function does not apply.
"""


def _text(completion):
    return completion[0]["content"] if isinstance(completion, list) else completion


def correct(prompts, completions, ground_truth, **kwargs):
    """1.0 where the completion, stripped, is the row's ground_truth column."""
    return [float(_text(c).strip() == str(t).strip()) for c, t in zip(completions, ground_truth)]


def length_penalty(prompts, completions, completion_ids, **kwargs):
    """-0.01 per token past 4 (a shaping term to weigh against correctness; list it after the correctness one)."""
    return [-0.01 * max(0, len(ids) - 4) for ids in completion_ids]
