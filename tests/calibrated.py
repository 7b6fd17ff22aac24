"""The trainer configuration that the calibrated tests were measured in (imported by the test modules).

The injection bounds (test_inject.py), the learning test's margins (test_learning.py) and the AsyPPO runs
(test_asyppo.py) were calibrated on the `reverse` task's SFT warm start (the `sft_path` fixture) at
temperature 1, a constant lr of 1e-4 after the warm-up, one epoch of one minibatch and 16 prompts x 16:
the trainer's defaults before the `sort` recipe became the embedded default (RESULTS.md, the sort recipe). These
tests pin that configuration, so a change of the defaults cannot silently move what they measure.
"""

REVERSE_T1 = dict(
    task="reverse",
    temperature=1.0,
    lr=1e-4,
    lr_schedule="constant",
    ppo_epochs=1,
    minibatches=1,
    prompts_per_step=16,
    group_size=16,
)
