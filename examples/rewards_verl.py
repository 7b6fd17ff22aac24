"""A reward file as veRL users write them (custom_reward_function.path): `--reward examples/rewards_verl.py`.

veRL calls compute_score(data_source, solution_str, ground_truth, extra_info) once per response; a float or a
dict whose "score" is the reward (its other numbers are logged as reward/rewards_verl/<key>).
"""

import re


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """1.0 if the last number of the response is the ground truth, 0.1 for a number that is not, else 0."""
    numbers = re.findall(r"-?\d+", solution_str)
    if not numbers:
        return {"score": 0.0, "has_number": 0.0}
    return {"score": 1.0 if numbers[-1] == str(ground_truth).strip() else 0.1, "has_number": 1.0}
