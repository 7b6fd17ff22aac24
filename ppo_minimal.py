"""PPO and GRPO for causal LMs: `python ppo_minimal.py` runs the full trainer (trainer.py) until the textbook lands."""

import sys

import trainer


def main(argv=None):
    """The full trainer's main, with the same flags."""
    return trainer.main(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
