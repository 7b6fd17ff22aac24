"""Run by test_vllm_engine.py under torchrun (2 ranks): each rank's engine (vLLM's external_launcher, data parallel
over the ranks) makes a different number of generate calls inside `vllm_engine.sampling`, as ranks whose multi-turn
episodes end at different turns do: two rollouts, calls per rank (2, 0) then (1, 3). `sampling` syncs the policy's
weights and drains at the end (vllm_engine detail 5). Prints, per rank and rollout, its calls and whether every
call's greedy answers equal rollout.generate's on the policy.

    torchrun --nproc_per_node=2 tests_vllm/unequal_calls.py MODEL_FOLDER
"""

import sys

import torch
import torch.distributed as dist

import tasks
import vllm_engine
from rollout import generate, left_pad

CALLS = [(2, 0), (1, 3)]  # per rollout: rank 0's calls, rank 1's


def main(folder: str) -> None:
    dist.init_process_group("gloo")
    rank, tok = dist.get_rank(), tasks.make_tokenizer()
    engine = vllm_engine.Engine(folder, vllm_engine.EngineArgs(max_model_len=64))
    torch.manual_seed(0)
    policy = tasks.make_tiny_model(tok).eval()
    stops = {"max_new_tokens": 6, "eos_token_ids": [tok.eos_token_id], "pad_token_id": tok.pad_token_id}
    for k, calls in enumerate(CALLS):
        # weights the engine has not seen (the same on both ranks): this rollout's sync must bring them
        with torch.no_grad():
            for p in policy.parameters():
                p += 0.05 * torch.randn_like(p)
        agree = []
        with vllm_engine.sampling(engine, policy) as (model, sample, _):
            for c in range(calls[rank]):
                text = [f"{i + c}+{i + rank + k}=" for i in range(3)]
                ids, mask = left_pad(
                    [tok(tok.bos_token + t, add_special_tokens=False).input_ids for t in text], tok.pad_token_id
                )
                ours = generate(policy, ids, mask, temperature=0.0, **stops).response_ids
                agree.append(torch.equal(sample(model, ids, mask, **stops).response_ids, ours))
        print(f"rank {rank} rollout {k}: {len(agree)} calls, rollout.generate's greedy answers: {all(agree)}")
    sys.stdout.flush()
    engine.close()  # vLLM destroys the default process group with its own


if __name__ == "__main__":
    main(sys.argv[1])
