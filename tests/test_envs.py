"""Multi-turn environments (envs.py) and rollouts (rollout.rollout_env): interface conformance, the safe
calculator, malformed actions, masks over observation tokens, logprob consistency, chat templates, the GEM
adapter, and the trainer on an environment (GRPO groups share an env seed).
"""

import numpy as np
import pytest
import torch

import offpolicy
import ppo_math
import tasks
import trainer
from envs import CalcError, CalculatorEnv, TaskEnv, make_env, safe_calc
from rollout import generate, rollout_env, sequence_logprobs
from tasks import tokenize_prompts

ENV_NAMES = ["calc", "guess"]
CFG = dict(max_prompt_len=64, max_new_tokens=12, temperature=1.0, top_p=1.0, top_k=0)


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    tok = tasks.make_tokenizer()
    return tasks.make_tiny_model(tok).eval(), tok


def play(env, actions):
    return [env.step(a) for a in actions]


# ----------------------------------------------------------------------------------------------
# Environments


@pytest.mark.parametrize("name", ENV_NAMES)
def test_reset_and_step_have_gem_types_and_seeding_is_deterministic(name):
    env = make_env(name)
    obs, info = env.reset(seed=7)
    assert isinstance(obs, str) and isinstance(info, dict)
    assert env.reset(seed=7)[0] == obs and env.reset(seed=8)[0] != obs
    out = env.step("nonsense")
    assert [type(x) for x in out] == [str, float, bool, bool, dict]


def test_make_env_overrides_keep_each_envs_defaults():
    guess, calc = make_env("guess", latency_s=0.2), make_env("calc", penalty=-1.0)
    assert (guess.cfg.max_turns, guess.cfg.latency_s, calc.cfg.max_turns, calc.cfg.penalty) == (6, 0.2, 3, -1.0)
    with pytest.raises(ValueError, match="unknown environment"):
        make_env("chess")


@pytest.mark.parametrize("name", ENV_NAMES)
def test_train_and_eval_episodes_are_disjoint(name):
    train = {make_env(name, "train").reset(seed=s)[0] for s in range(300)}
    held = {make_env(name, "eval").reset(seed=s)[0] for s in range(300)}
    assert not train & held
    assert all(tasks.is_eval_problem(o) for o in held) and not any(tasks.is_eval_problem(o) for o in train)


@pytest.mark.parametrize("name", ENV_NAMES)
def test_the_scripted_solver_solves_every_episode_and_the_episode_ends(name):
    for seed in range(50):
        env = make_env(name)
        env.reset(seed=seed)
        total, done = 0.0, False
        while not done:
            _, r, term, trunc, info = env.step(env.expert())
            total, done = total + r, term or trunc
        assert term and info["success"] and total == 1.0
        with pytest.raises(RuntimeError, match="after the episode ended"):
            env.step("answer 1")


def test_calculator_episode_known_answer():
    env = CalculatorEnv()
    obs, _ = env.reset(seed=3)
    truth, expr = env.state
    a, op, b = __import__("re").fullmatch(r"(\d+)([-+*])(\d+)", expr).groups()
    assert {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op] == truth
    assert (f" {a} " in obs or f" {a} bags" in obs) and f" {b} " in obs  # the numbers come from the problem
    assert play(env, [f"calc {expr}"])[0][:4] == (f"={truth}\n", 0.0, False, False)
    assert env.step(f"answer {truth + 1}")[1:4] == (0.0, True, False)  # a wrong answer ends it with 0


def test_truncated_after_max_turns_with_the_penalty_per_malformed_action():
    env = make_env("calc", max_turns=2, penalty=-0.25)
    env.reset(seed=1)
    (o1, r1, t1, u1, i1), (o2, r2, t2, u2, _) = play(env, ["hello", "calc 1+1"])
    assert o1.startswith("error:") and r1 == -0.25 and not t1 and not u1 and i1["malformed"]
    assert (o2, r2, t2, u2) == ("=2\n", 0.0, False, True)


@pytest.mark.parametrize(
    "action",
    [
        "calc __import__('os').system('echo pwned')",
        "calc 1+1; import os",
        "calc " + "9" * 30,
        "calc ((((((((((1))))))))))",
        "calc 99999*99999*99999",
        "calc 7/0",
        "calc 7/2",
        "calc 1+",
        "answer twelve",
        "answer " + "1" * 40,
        "x" * 500,
        "\x00\x01 calc 1",
        "",
    ],
)
def test_malformed_actions_get_the_penalty_and_never_raise_or_execute(action, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    env = CalculatorEnv()
    env.reset(seed=0)
    obs, reward, terminated, truncated, info = env.step(action)
    assert obs.startswith("error:") and reward == env.cfg.penalty and not terminated and info["malformed"]
    assert not list(tmp_path.iterdir())  # nothing ran


def test_safe_calc_known_answers_and_refusals():
    assert [safe_calc(e) for e in ["1+2*3", "(1+2)*3", "-3--4", "12/4", " 7 - 10 "]] == [7, 9, 1, 3, -3]
    for bad in ["2**3", "1e3", "abs(1)", "1 2", "(1", "1)", "", "9" * 25, "8/3"]:
        with pytest.raises(CalcError):
            safe_calc(bad)
    for bad in ["9" * 5000, "1+" + "7" * 20000, "-" * 50 + "1"]:  # at any max_len: a CalcError, never a bare ValueError
        with pytest.raises(CalcError, match="beyond|too deep"):
            safe_calc(bad, max_len=10**6)
    assert safe_calc("0" * 5000 + "12", max_len=10**6) == 12


def test_latency_is_applied_and_seeded(monkeypatch):
    slept = []
    monkeypatch.setattr("envs.time.sleep", slept.append)
    for _ in range(2):
        env = make_env("calc", latency_s=0.5, latency_sigma=0.5)
        env.reset(seed=4)
        env.step("calc 1+1")
    assert slept[0] == slept[1] > 0  # the same seed gives the same delay


# ----------------------------------------------------------------------------------------------
# Rollouts


def test_single_turn_is_the_one_turn_case_of_the_same_code_path(tiny):
    model, tok = tiny
    task = tasks.make_task("reverse")
    problems = task.sample(8, "train", np.random.default_rng(0))
    ids, attention_mask = tokenize_prompts(tok, [tasks.format_prompt(tok, p["prompt"]) for p in problems], 64)
    kw = {"eos_token_ids": [tok.eos_token_id], "pad_token_id": tok.pad_token_id}
    plain = generate(model, ids, attention_mask, max_new_tokens=12, generator=torch.Generator().manual_seed(1), **kw)
    envs = [TaskEnv(task, p) for p in problems]
    rollout, info = rollout_env(
        model, tok, envs, [None] * 8, [tok.eos_token_id], generator=torch.Generator().manual_seed(1), **CFG
    )
    for field in ("prompt_ids", "response_ids", "attention_mask", "response_mask", "rollout_logprobs", "truncated"):
        assert torch.equal(getattr(plain, field), getattr(rollout, field)), field
    scores = [task.compute_score(tok.decode(r[m.bool()], skip_special_tokens=True), p["ground_truth"])
              for r, m, p in zip(plain.response_ids, plain.response_mask, problems)]  # fmt: skip
    assert rollout.token_scores.sum(-1).tolist() == pytest.approx(scores)


@pytest.fixture(scope="module")
def multi(tiny):
    """A batch of calc episodes from the random tiny model: malformed actions, observations, several turns."""
    model, tok = tiny
    envs = [make_env("calc") for _ in range(6)]
    rollout, info = rollout_env(
        model,
        tok,
        envs,
        [1, 1, 1, 2, 2, 2],
        [tok.eos_token_id],
        generator=seeded(0),
        max_turns=3,
        **CFG,
    )
    return rollout, info


def test_masks_cover_exactly_the_action_tokens_and_rewards_sit_at_their_ends(multi, tiny):
    rollout, info = multi
    _, tok = tiny
    assert all(e["turns"] == 3 for e in info)  # random text is malformed: every episode runs to max_turns
    for i, e in enumerate(info):
        expected = torch.zeros_like(rollout.response_mask[i])
        ends = torch.zeros_like(rollout.token_scores[i])
        for start, end in e["action_spans"]:
            expected[start:end] = 1
            ends[end - 1] = 1
        assert torch.equal(rollout.response_mask[i], expected)
        assert torch.equal(rollout.token_scores[i] != 0, (ends != 0) & (rollout.token_scores[i] != 0))
        assert rollout.token_scores[i].sum().item() == pytest.approx(e["return"])
        assert len(e["env_s"]) == len(e["gen_s"]) == e["turns"] and min(e["gen_s"]) > 0  # per-turn timing
        n = int(
            rollout.attention_mask[i, rollout.prompt_ids.shape[1] :].sum()
        )  # actions and observations are real tokens
        text = tok.decode(rollout.response_ids[i, :n])
        assert text.count("error:") == 2  # the two observations between three malformed actions


def test_recomputed_logprobs_match_the_sampler_on_every_action_token(multi, tiny):
    model, _ = tiny
    rollout, _ = multi
    lp, _ = sequence_logprobs(model, rollout.input_ids, rollout.attention_mask, rollout.response_ids.shape[1])
    diff = ((lp - rollout.rollout_logprobs).abs() * rollout.response_mask).max().item()
    assert diff < 1e-5  # ratio 1 before the first update, also across observation tokens


def test_the_loss_gradient_is_exactly_zero_on_observation_tokens(multi, tiny):
    model, _ = tiny
    rollout, _ = multi
    R = rollout.response_ids.shape[1]
    logp, _ = sequence_logprobs(model, rollout.input_ids, rollout.attention_mask, R)
    logp.retain_grad()
    adv = torch.randn(logp.shape)
    loss, _ = offpolicy.policy_loss(
        logp, rollout.rollout_logprobs, adv, rollout.response_mask.float(), clip_low=0.2, clip_high=0.2
    )
    loss.backward()
    obs = (rollout.response_mask == 0) & (rollout.attention_mask[:, -R:] == 1)
    assert obs.sum() > 20 and (logp.grad[obs] == 0).all() and (logp.grad[rollout.response_mask.bool()] != 0).any()


def test_gae_passes_values_through_observation_tokens():
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0]])  # action, observation (2 tokens), action
    rewards = torch.tensor([[0.0, 0.0, 0.0, 0.0, 1.0]])
    values = torch.tensor([[0.1, 0.2, 9.0, 9.0, 0.5]])
    adv, ret = ppo_math.gae(rewards, values, mask, gamma=1.0, lam=1.0)
    assert adv[0, [0, 1, 4]].tolist() == pytest.approx([0.9, 0.8, 0.5])  # R - V_t, the 9s never enter
    assert adv[0, 2:4].tolist() == [0.0, 0.0]


def test_max_context_cuts_an_episode(tiny):
    model, tok = tiny
    envs = [make_env("guess") for _ in range(3)]
    rollout, info = rollout_env(
        model, tok, envs, [0, 1, 2], [tok.eos_token_id], generator=seeded(0), **CFG, max_turns=6, max_context=60
    )
    assert all(e["cut"] and e["turns"] < 6 for e in info) and int(rollout.attention_mask.sum(-1).max()) <= 60


class Exploding:
    name = "boom-env"

    def __init__(self, reward=0.0):
        self.reward, self.closed = reward, False

    def close(self):
        self.closed = True

    def reset(self, seed=None):
        return "12>", {}

    def step(self, action):
        if self.reward is None:
            raise KeyError("env exploded")
        return "", self.reward, True, False, {}


@pytest.mark.parametrize("reward, err, what", [(None, RuntimeError, "env exploded"), (float("nan"), ValueError, "nan")])
def test_an_env_that_raises_or_returns_nan_is_named_with_its_turn(tiny, reward, err, what):
    model, tok = tiny
    envs = [Exploding(0.0), Exploding(reward)]
    with pytest.raises(err) as e:
        rollout_env(model, tok, envs, [0, 0], [tok.eos_token_id], generator=seeded(0), **CFG)
    msg = str(e.value)
    assert "'boom-env'" in msg and "turn 1 of episode 1" in msg and what in msg, msg
    assert all(env.closed for env in envs)  # what the episodes hold is freed on the way out too


def test_every_env_is_closed_even_when_one_fails_to_close_and_that_failure_is_raised(tiny):
    model, tok = tiny

    class Sticky(Exploding):
        def close(self):
            super().close()
            raise OSError("workspace busy")

    envs = [Sticky(1.0), Exploding(1.0), Exploding(1.0)]
    with pytest.raises(OSError, match="workspace busy"):
        rollout_env(model, tok, envs, [0, 0, 0], [tok.eos_token_id], generator=seeded(0), **CFG)
    assert all(env.closed for env in envs)


def test_chat_template_observations_continue_the_conversation():
    tok = tasks.make_tokenizer()
    tok.chat_template = (
        "{% for m in messages %}{{ m['role'][0] }}: {{ m['content'] }}{% if m['role'] == 'assistant' %}"
        "{{ eos_token }}{% endif %}\n{% endfor %}{% if add_generation_prompt %}a: {% endif %}"
    )
    from tasks import observation_ids

    first = observation_ids(tok, "12+3=", first=True)
    later = observation_ids(tok, "=15", first=False)
    action = tok("calc 12+3", add_special_tokens=False).input_ids + [tok.eos_token_id]
    convo = [{"role": "user", "content": "12+3="}, {"role": "assistant", "content": "calc 12+3"}]
    convo.append({"role": "user", "content": "=15"})
    expected = tok.apply_chat_template(convo, tokenize=False, add_generation_prompt=True)
    assert tok.decode(first + action + later) == expected


# ----------------------------------------------------------------------------------------------
# The GEM adapter (gem-llm is an optional extra for users; CI installs it)


def test_gem_adapter_runs_a_gem_game(tiny):
    """gem-llm (in requirements.txt) is optional for users; the install command brings it, so this test never skips."""
    model, tok = tiny
    name = "gem:game:GuessTheNumber-v0-easy"  # a number in 1..10

    def trajectory(seed, split="train", guesses=(5, 3, 8)):
        env = make_env(name, split)
        obs, info = env.reset(seed=seed)
        assert isinstance(obs, str) and isinstance(info, dict)
        return [env.step(f"\\boxed{{{g}}}") for g in guesses]

    assert trajectory(3) == trajectory(3)  # seeded: the same hidden number, the same answers
    assert len({str(trajectory(s)) for s in range(6)}) > 1 and trajectory(3) != trajectory(3, "eval")
    assert [type(x) for x in trajectory(3)[0]] == [str, float, bool, bool, dict]
    finals = [trajectory(3, guesses=(g,))[0] for g in range(1, 11)]
    won = [f for f in finals if f[4]["success"]]  # exactly one guess solves it: reward 1, terminated
    assert len(won) == 1 and won[0][1] == 1.0 and won[0][2] and not won[0][3]
    envs = [make_env("gem:game:GuessTheNumber-v0-easy") for _ in range(2)]
    cfg = {**CFG, "max_prompt_len": 1000}
    rollout, info = rollout_env(
        model, tok, envs, [0, 1], [tok.eos_token_id], generator=seeded(0), **cfg, max_turns=4, max_context=2000
    )
    assert all(1 <= e["turns"] <= 4 for e in info) and rollout.response_mask.sum() > 0


# ----------------------------------------------------------------------------------------------
# The trainer on an environment


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.manual_seed(0)
    tok, path = tasks.make_tokenizer(), tmp_path_factory.mktemp("tiny")
    tasks.make_tiny_model(tok).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_ppo_with_a_critic_runs_on_an_environment(model_dir, tmp_path):
    """GAE over multi-turn sequences: values pass through observation tokens; the critic trains."""
    cfg = trainer.Config(model=str(model_dir), task="guess", steps=2, prompts_per_step=2, group_size=2, eval_every=0,
                    max_new_tokens=8, out_dir=str(tmp_path))  # fmt: skip
    out = trainer.train(cfg)
    assert out["rollout/turns"] > 1 and out["critic/grad_norm_0"] > 0 and np.isfinite(out["loss/value"])


def test_gem_task_without_a_model_is_refused():
    with pytest.raises(ValueError, match="needs --model"):
        trainer.Config(task="gem:game:GuessTheNumber-v0-easy")


def test_trainer_runs_on_an_environment_with_groups_sharing_a_seed(model_dir, tmp_path):
    cfg = trainer.Config(model=str(model_dir), task="calc", adv_estimator="grpo", steps=1, prompts_per_step=3,
                    group_size=4, eval_every=1, eval_n=6, dump_batch=1, out_dir=str(tmp_path / "run"))  # fmt: skip
    out = trainer.train(cfg)
    assert 0.0 <= out["eval/acc"] <= 1.0 and out["rollout/turns"] > 1
    prompts = torch.load(tmp_path / "run" / "batch-1.pt", weights_only=True)["prompts"]
    groups = [prompts[i : i + 4] for i in range(0, 12, 4)]
    assert all(len(set(g)) == 1 for g in groups) and len({g[0] for g in groups}) == 3
