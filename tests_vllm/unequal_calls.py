"""Run by test_vllm_engine.py under torchrun: each rank's engine (vLLM's external_launcher, data parallel over the
ranks) makes a different number of generate calls, as ranks whose multi-turn episodes end at different turns do,
then drains (vllm_engine detail 5). Without the agreement before each call, rank 0 would wait forever in its second
call's first step. Prints each rank's call count and whether its greedy answers were the same at every call.

    torchrun --nproc_per_node=2 tests_vllm/unequal_calls.py MODEL_FOLDER
"""

import sys

import torch
import torch.distributed as dist

import tasks
import vllm_engine
from rollout import left_pad


def main(folder: str) -> None:
    dist.init_process_group("gloo")
    rank, tok = dist.get_rank(), tasks.make_tokenizer()
    engine = vllm_engine.Engine(folder, vllm_engine.EngineArgs(max_model_len=64))
    prompts = [tok(tok.bos_token + f"{i}+{i + rank}=", add_special_tokens=False).input_ids for i in range(3)]
    ids, mask = left_pad(prompts, tok.pad_token_id)
    stops = {"max_new_tokens": 6, "eos_token_ids": [tok.eos_token_id], "pad_token_id": tok.pad_token_id}
    outs = [engine.generate(None, ids, mask, **stops).response_ids for _ in range(3 - 2 * rank)]  # 3 calls, 1 call
    engine.drain()
    same = all(torch.equal(o, outs[0]) for o in outs)
    print(f"rank {rank}: {len(outs)} calls, the same greedy answers each time: {same}", flush=True)
    engine.close()  # vLLM destroys the default process group with its own


if __name__ == "__main__":
    main(sys.argv[1])
