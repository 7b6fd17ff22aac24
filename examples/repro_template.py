"""One whole GRPO iteration for any Hugging Face causal LM, torch + transformers only: copy this file and edit it
into the smallest reproduction of a bug seen in a large framework.

    python examples/repro_template.py                     # a random-init tiny Qwen2, built from a config
    python examples/repro_template.py --model NAME_OR_DIR  # any causal LM folder or hub name

The iteration: sample G responses per prompt at temperature T (HF generate), score them (`reward`: edit it),
GRPO advantages A = (r - mean_g) / (std_g + 1e-6) (unbiased std, Shao et al. 2024 eq. 3 as veRL computes it), the
anchor logprobs recomputed by the trainer, the clipped PPO loss with veRL's dual clip, token-mean over every
valid response token, one AdamW step after clipping the gradient norm. The constants are trainer.py's
defaults; the same iteration there is `--adv-estimator grpo --ppo-epochs 1 --minibatches 1 --lr-schedule constant
--warmup-steps 0`, and tests/test_repro_template.py checks that one update here and one of trainer.py on the
same batch give the same loss and gradient, so the copy cannot drift from the reference unseen.
veRL's conventions: left-padded prompts; response_mask 1 up to and including the first EOS; logits at P + t - 1,
over T, score response token t; position ids count a row's real tokens. Nothing here imports the project.
"""

import argparse

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

TEMPERATURE, CLIP_LOW, CLIP_HIGH, DUAL_CLIP, GRAD_CLIP, LR = 0.6, 0.2, 0.2, 3.0, 1.0, 2e-4  # trainer's defaults


def tiny_model_and_tokenizer():
    """A character-level tokenizer over digits and a 2-layer Qwen2 from a config (random init: nothing to fetch)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    vocab = {t: i for i, t in enumerate(["<pad>", "<bos>", "<eos>", "<unk>", ">", *"0123456789"])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))  # other characters: <unk>, never <pad>
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.Split(Regex("."), "isolated"), decoders.Fuse()  # 1 char 1 token
    tok = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>")
    cfg = Qwen2Config(vocab_size=len(vocab), hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2)  # fmt: skip
    return Qwen2ForCausalLM(cfg), tok


def reward(prompt: str, response: str) -> float:
    """Share of the digits before '>' that the response holds (dense enough for a random model). Edit this."""
    want = prompt.removeprefix("<bos>").split(">")[0]
    return sum(c in response for c in want) / len(want)


def logprobs(model, input_ids, attention_mask, R: int, temperature: float = TEMPERATURE):
    """Log-probs [B, R] of the last R tokens under logits / temperature (position P + t - 1 predicts token t)."""
    pos = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # [B, T] positions count the real tokens (left padding)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=pos, use_cache=False).logits
    logits = logits[:, -R - 1 : -1].float() / temperature  # [B, R, V]
    return F.log_softmax(logits, -1).gather(-1, input_ids[:, -R:, None]).squeeze(-1)  # [B, R]


def stop_ids(model, tok) -> list[int]:
    """The tokenizer's EOS and every EOS of the model's generation config (chat models have several)."""
    ids = model.generation_config.eos_token_id  # None, an int or a list
    return sorted({i for i in [tok.eos_token_id, *(ids if isinstance(ids, list) else [ids])] if i is not None})


@torch.no_grad()
def sample(model, tok, prompts: list[str], G: int, max_new_tokens: int, generator=None):
    """G responses per prompt: input_ids and attention_mask [B, P+R], response_mask [B, R], the texts."""
    enc = tok([p for p in prompts for _ in range(G)], return_tensors="pt", padding=True, padding_side="left")
    if generator is not None:
        torch.manual_seed(int(torch.randint(2**31, (1,), generator=generator)))  # generate draws from the global RNG
    stops = stop_ids(model, tok)
    gc = GenerationConfig(
        do_sample=True,
        temperature=TEMPERATURE,
        top_p=1.0,
        top_k=0,
        max_new_tokens=max_new_tokens,
        pad_token_id=tok.pad_token_id,
        eos_token_id=stops,
    )  # fresh: no repetition penalty etc.
    out = model.generate(**enc, generation_config=gc)  # samples softmax(logits / T), what logprobs() scores
    resp = out[:, enc.input_ids.shape[1] :]  # [B, R]
    is_eos = torch.isin(resp, torch.tensor(stops)).long()  # [B, R]
    response_mask = ((is_eos.cumsum(-1) - is_eos) == 0).long()  # [B, R] up to and including the first EOS
    attention_mask = torch.cat([enc.attention_mask, response_mask], 1)  # [B, P+R]
    texts = [tok.decode(r[:n], skip_special_tokens=True) for r, n in zip(resp, response_mask.sum(-1).tolist())]
    return out, attention_mask, response_mask, texts


def grpo_advantages(rewards, G: int, eps: float = 1e-6):
    """[B] rewards of consecutive groups of G -> [B] advantages (r - mean_g) / (std_g + eps), unbiased std."""
    if G < 2:
        raise ValueError(f"GRPO needs groups of G >= 2 responses (got {G}): one has no baseline")
    r = rewards.view(-1, G)  # [N, G]
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + eps)).view(-1)  # [B]


def policy_loss(logp, old_logp, advantages, response_mask):
    """Clipped surrogate (PPO eq. 7 as a loss) with the dual clip on A < 0, token-mean over valid tokens."""
    ratio = torch.exp((logp - old_logp).clamp(-20, 20))  # [B, R]
    l1, l2 = -advantages * ratio, -advantages * ratio.clamp(1 - CLIP_LOW, 1 + CLIP_HIGH)
    loss = torch.maximum(l1, l2)
    loss = torch.where(advantages < 0, torch.minimum(loss, -advantages * DUAL_CLIP), loss)  # [B, R]
    mask = response_mask.float()
    return (loss * mask).sum() / mask.sum().clamp(min=1)


def update(model, opt, input_ids, attention_mask, response_mask, old_logp, advantages):
    """One optimizer step on the batch; returns (loss, gradient norm before clipping)."""
    logp = logprobs(model, input_ids, attention_mask, response_mask.shape[1])
    loss = policy_loss(logp, old_logp, advantages, response_mask)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
    if not torch.isfinite(grad_norm):
        raise FloatingPointError(f"gradient norm {grad_norm.item()}: nothing stepped")
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach(), grad_norm


def iteration(model, tok, opt, prompts: list[str], G: int = 4, max_new_tokens: int = 8, generator=None) -> dict:
    """Sample, score, advantages, anchor, one update: the iteration's numbers."""
    model.eval()  # dropout off in sampling and in the update (as trainer)
    ids, attn, resp_mask, texts = sample(model, tok, prompts, G, max_new_tokens, generator)
    rewards = torch.tensor([reward(p, t) for p, t in zip([p for p in prompts for _ in range(G)], texts)])  # [B]
    adv = grpo_advantages(rewards, G)[:, None] * resp_mask  # [B, R] the sequence's advantage on its tokens
    with torch.no_grad():
        old_logp = logprobs(model, ids, attn, resp_mask.shape[1])  # the anchor: the trainer's own recompute
    loss, grad_norm = update(model, opt, ids, attn, resp_mask, old_logp, adv)
    return dict(reward=rewards.mean().item(), loss=loss.item(), grad_norm=grad_norm.item(), sample=texts[0])


def main():
    """A few iterations on the tiny model (or --model), printed one line each."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="", help="causal LM folder or hub name (default: the tiny random model)")
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    torch.manual_seed(0)
    if args.model:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)  # fp32 weights and AdamW
        tok = AutoTokenizer.from_pretrained(args.model)
        tok.pad_token = tok.pad_token or tok.eos_token
    else:
        model, tok = tiny_model_and_tokenizer()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    prompts, gen = ["<bos>1234>", "<bos>5678>", "<bos>9021>"], torch.Generator().manual_seed(0)
    for step in range(1, args.steps + 1):
        print(step, iteration(model, tok, opt, prompts, generator=gen), flush=True)


if __name__ == "__main__":
    main()
