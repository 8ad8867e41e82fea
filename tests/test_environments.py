"""Multi-turn episodes (ppo_core/agents/environments.py) on the rollout engine: a scripted environment played by a tiny
random policy over a real BPE tokenizer with a chat template. The conversation the sequence holds must be exactly the
template's rendering of the messages (checked here against a rendering of the final conversation in one go), the
observations masked 0, rewards summed, the turn and token limits kept; a template that rewrites history is refused."""
import json
import os
import subprocess
import sys
import time

import pytest
import torch

from ppo_core.engine import RolloutEngine
from ppo_core.agents.environments import IncrementalRenderError, run_episodes
from ppo_core.models.model import CausalLM, ModelArgs
from ppo_core.models.tokenizer import load_tokenizer
from ppo_core.run.start import Models, Step

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from test_generate import BASE  # noqa: E402
from test_tokenizer import write_tokenizer  # noqa: E402

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# renders every message verbatim: a conversation can grow turn by turn
VERBATIM = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# drops every assistant turn but the last: what the sequence holds is rewritten once a turn is added
FORGETFUL = ("{% for m in messages %}{% if m.role != 'assistant' or loop.last %}<|im_start|>{{ m.role }}\n"
             "{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
             "{% endif %}")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = write_tokenizer(tmp_path_factory.mktemp("tok"), SPECIAL, {
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None, "chat_template": VERBATIM})
    return load_tokenizer(path)


def policy(vocab_size, seed=0):
    torch.manual_seed(seed)
    model = CausalLM(ModelArgs.from_hf_config({**BASE, "architectures": ["Qwen3ForCausalLM"], "head_dim": 14,
                                               "vocab_size": vocab_size})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.3 * torch.randn_like(p) if "norm" in name else torch.randn_like(p) / p.shape[-1] ** 0.5)
    return model


class Counter:
    """Answers each turn with a tool message naming the turn; reward 1 per turn, +10 on the third; done then."""

    max_turns = 5

    def __init__(self, delay=0.0):
        self.delay, self.seen = delay, []

    def reset(self, row):
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, text):
        time.sleep(self.delay)
        self.seen.append(text)
        if len(self.seen) == 3:
            return None, 11.0, True
        return [{"role": "tool", "content": f"turn {len(self.seen)} of {self.reset_marker}"}], 1.0, False

    reset_marker = "the counter"


ROWS = [{"prompt": "add the numbers"}, {"prompt": "reverse it"}, {"prompt": "go"}]


def test_episodes_hold_the_conversation_as_the_template_renders_it(tokenizer):
    model = policy(tokenizer.vocab_size)
    envs = [Counter(), Counter(delay=0.05), Counter()]
    engine = RolloutEngine(model, block_size=4)
    episodes = run_episodes(engine, tokenizer, envs, ROWS, max_new_tokens=200, max_turn_tokens=6, greedy=True)
    for episode, env in zip(episodes, envs):
        # the whole sequence decodes to the template's one-go rendering of the final conversation, up to its last turn
        held = tokenizer.decode(episode.prompt_ids + episode.tokens, skip_special_tokens=False)
        whole = tokenizer.apply_chat_template(episode.messages, tokenize=False)
        assert whole.startswith(held) and whole[len(held):] in ("", "<|im_end|>\n")
        assert episode.turns == len(env.seen) == 3 and episode.done
        assert episode.reward == 1.0 + 1.0 + 11.0
        # the observations, masked 0: each the tool turn and the next generation prompt, as the template renders them
        spans, current = [], []
        for token, keep in zip(episode.tokens, episode.mask):
            if not keep:
                current.append(token)
            elif current:
                spans.append(tokenizer.decode(current, skip_special_tokens=False))
                current = []
        assert len(spans) == 2 and episode.observation_tokens == len(episode.mask) - sum(episode.mask)
        for k, span in enumerate(spans, start=1):
            tool_turn = f"<|im_start|>tool\nturn {k} of the counter<|im_end|>\n<|im_start|>assistant\n"
            assert span in (tool_turn, "<|im_end|>\n" + tool_turn)  # the turn's own EOS, or one the template closes
    assert engine.stats["turns"] == 9  # three turn ends per episode: two answered with a tool turn, the third ends it


def test_episode_limits_turns_and_tokens(tokenizer):
    model = policy(tokenizer.vocab_size)
    capped = Counter()
    capped.max_turns = 2
    (episode,) = run_episodes(RolloutEngine(model), tokenizer, [capped], ROWS[:1], max_new_tokens=100,
                              max_turn_tokens=6, greedy=True)
    assert episode.turns == 2 and episode.reward == 2.0 and episode.done
    # a 6-token turn, then an observation longer than the 14 tokens left: the episode ends there, nothing appended
    (episode,) = run_episodes(RolloutEngine(model), tokenizer, [Counter()], ROWS[:1], max_new_tokens=20,
                              max_turn_tokens=6, greedy=True)
    assert episode.turns == 1 and len(episode.tokens) == 6 and all(episode.mask)
    # the budget ends the first turn (4 of its 6 tokens): that turn is stepped all the same
    (episode,) = run_episodes(RolloutEngine(model), tokenizer, [Counter()], ROWS[:1], max_new_tokens=4,
                              max_turn_tokens=6, greedy=True)
    assert len(episode.tokens) == 4 and episode.turns == 1 and episode.reward == 1.0 and episode.done


def test_a_template_that_rewrites_history_is_refused(tmp_path):
    path = write_tokenizer(tmp_path / "tok", SPECIAL, {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                                                       "bos_token": None, "chat_template": FORGETFUL})
    tokenizer = load_tokenizer(path)
    model = policy(tokenizer.vocab_size)
    with pytest.raises(IncrementalRenderError, match="cannot be rendered turn by turn"):
        run_episodes(RolloutEngine(model), tokenizer, [Counter()], ROWS[:1], max_new_tokens=60, max_turn_tokens=6,
                     greedy=True)


def test_tool_environment_answers_calls_then_scores_the_answer():
    """The shipped ToolEnvironment with the real calculator: a call is answered with its result as a tool message, a
    malformed call with an error (counted), and a turn without a call is the answer, scored against the row."""
    from ppo_core.agents.environments import ToolEnvironment
    from ppo_core.agents.tools import Calculator

    env = ToolEnvironment({"calculator": Calculator()})
    assert env.reset({"prompt": "what is 123*456?", "answer": 56088}) == [{"role": "user", "content": "what is 123*456?"}]
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "123*456"}}\n</tool_call>'
    assert env.step(call) == ([{"role": "tool", "content": "56088"}], 0.0, False)
    observation, reward, done = env.step("<tool_call>\n{not json}\n</tool_call>")
    assert observation[0]["content"].startswith("error: malformed tool call") and (reward, done) == (0.0, False)
    assert env.step(" 56088\n") == (None, 1.0, True)
    assert env.counts.pop("tool_s") > 0
    assert env.counts == {"tool_calls": 2, "malformed_calls": 1, "tool_errors": 0, "calls_not_run": 0}
    env.reset({"prompt": "again", "answer": "56088"})
    assert env.step("56089") == (None, 0.0, True)


COUNTER_FILE = '''
class Counter:
    max_turns = 3
    def reset(self, row):
        return [{"role": "user", "content": row["prompt"]}]
    def step(self, text):
        self.n = getattr(self, "n", 0) + 1
        if self.n == 3:
            return None, float(len(text) % 3), True
        return [{"role": "tool", "content": f"turn {self.n}"}], 0.5, False
'''


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny random policy over the VERBATIM-template tokenizer, in the HF layout; prompt rows; an environment file."""
    path = tmp_path_factory.mktemp("env-run")
    write_tokenizer(path / "ckpt", SPECIAL, {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None,
                                             "chat_template": VERBATIM})
    policy(load_tokenizer(str(path / "ckpt")).vocab_size).save_pretrained(str(path / "ckpt"))
    with open(path / "rows.jsonl", "w") as f:
        for i in range(24):
            f.write(json.dumps({"prompt": f"{100 + i}*{200 + i}", "answer": str((100 + i) * (200 + i))}) + "\n")
    (path / "counter_env.py").write_text(COUNTER_FILE)
    return path


def test_rollout_forward_attends_to_observations_and_scores_only_the_policy_tokens(checkpoint):
    """The scoring pass over episodes: the old log-probs of the policy's tokens are those of the model run over the
    whole sequence (observations included, as context), 0 on the observations; padded and packed alike."""
    from ppo_core.config import build_config
    from ppo_core.models.model import load_model
    from ppo_core.rollout import play_episodes, rollout_forward

    tokenizer = load_tokenizer(str(checkpoint / "ckpt"))
    model = load_model(str(checkpoint / "ckpt")).double().eval()
    rows = [{"prompt": "12*34"}, {"prompt": "5*6"}]
    for packed in (False, True):
        batching = {"micro_batch_tokens": "64"} if packed else {"micro_batch_size": "2"}
        cfg = build_config({}, {**batching, "environment": f"{checkpoint}/counter_env.py:Counter", "max_new_tokens": "48",
                                "max_turn_tokens": "5", "rollout_batch_size": "2", "minibatch_size": "2",
                                "adv_estimator": "grpo", "n_samples_per_prompt": "2", "fused_kernels": "false"})
        sampled = play_episodes(model, tokenizer, rows, Step(cfg, torch.Generator().manual_seed(0)), 0, (0, 2))
        assert (sampled.response_mask.bool() != sampled.attended).any()  # observations: attended, not trained on
        rollout = rollout_forward(Models(model, model), sampled, torch.tensor([0, 0]), Step(cfg))
        for i in range(2):
            n, P = int(sampled.attended[i].sum()), sampled.prompt_ids.shape[1]
            real = sampled.prompt_mask[i].sum().item()
            ids = torch.cat([sampled.prompt_ids[i, P - real:], sampled.tokens[i, :n]])[None]
            with torch.no_grad():
                logp = torch.log_softmax(model(ids)[0].double(), -1)  # [T, V], alone, unpadded
            want = logp[real - 1 : real - 1 + n].gather(-1, sampled.tokens[i, :n, None])[:, 0]  # [n]
            want = want * sampled.response_mask[i, :n]
            torch.testing.assert_close(rollout.old_logprobs[i, :n].double(), want, rtol=0, atol=2e-6)  # float32 values
            assert (rollout.old_logprobs[i, n:] == 0).all()


def test_ppo_train_plays_a_users_environment_file(checkpoint):
    """ppo-train with environment=FILE:Class, packed passes, GRPO: it trains, logs the episodes' metrics, and writes
    each conversation turn by turn to samples.jsonl."""
    out = checkpoint / "run"
    proc = subprocess.run([sys.executable, "-m", "ppo_core.train", "--policy", str(checkpoint / "ckpt"),
                           "--prompts_file", str(checkpoint / "rows.jsonl"),
                           "--environment", f"{checkpoint / 'counter_env.py'}:Counter", "--iterations=2",
                           "--rollout_batch_size=4", "--n_samples_per_prompt=2", "--adv_estimator=grpo",
                           "--minibatch_size=8", "--micro_batch_tokens=96", "--max_new_tokens=40",
                           "--max_turn_tokens=6", "--eval_size=4", "--log_samples_every=1", "--progress=false",
                           f"--out={out}"], capture_output=True, text=True, timeout=300, cwd=checkpoint)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2 and all(m["env/turns"] >= 1 and m["env/observation_tokens"] > 0 for m in metrics)
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    for step, m in zip((1, 2), metrics):  # eos_frac counts episodes whose last token is the EOS, not finished ones
        stops = [s["stop"] for s in samples if s["step"] == step]
        assert m["response/eos_frac"] == pytest.approx(stops.count("eos") / len(stops))
    for s in samples:
        assert s["policy_prompt"].startswith("<|im_start|>user\n")  # the rendered first turn, as the policy saw it
        # "eos" exactly where the policy's last token is its EOS (an episode the budget cut is done, not ended)
        assert (s["stop"] == "eos") == s["response"].endswith("<|im_end|>"), s
    sample = samples[0]
    conversation = json.loads(sample["conversation"])
    assert conversation[0]["role"] == "user" and conversation[1]["role"] == "assistant"
    assert conversation[2] == {"role": "tool", "content": "turn 1"}


@pytest.mark.parametrize("thinking", [True, False])
def test_qwen3_template_plays_tool_turns_incrementally_with_thinking_on(tmp_path, thinking):
    """Qwen3's own template (tests/test_tokenizer.py's copy): a turn that thinks, calls the calculator and ends; the
    tool's answer is appended as the template renders it (a <tool_response> in a user turn, then the generation prompt).
    With enable_thinking=False the generation prompt's empty <think></think> is dropped from the re-rendered history:
    refused, loudly."""
    from ppo_core.agents.environments import Episode, observation_ids, render
    from test_tokenizer import QWEN3_SPECIAL, QWEN3_TEMPLATE

    tokenizer = load_tokenizer(write_tokenizer(tmp_path / "qwen3", QWEN3_SPECIAL, {
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None, "chat_template": QWEN3_TEMPLATE}))
    kwargs = {"enable_thinking": thinking}
    messages = [{"role": "user", "content": "what is 12*34?"}]
    prompt_ids = tokenizer.encode(render(tokenizer, messages, None, **kwargs))
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*34"}}\n</tool_call>'
    turn = ("<think>\nI should use the tool.\n</think>\n\n" if thinking else "") + call
    turn_ids = tokenizer.encode(turn + "<|im_end|>")
    episode = Episode({}, None, messages + [{"role": "assistant", "content": turn}, {"role": "tool", "content": "408"}],
                      prompt_ids, turns=1)
    if not thinking:
        with pytest.raises(IncrementalRenderError, match="cannot be rendered turn by turn"):
            observation_ids(tokenizer, episode, prompt_ids + turn_ids, None, **kwargs)
        return
    added = observation_ids(tokenizer, episode, prompt_ids + turn_ids, None, **kwargs)
    assert tokenizer.decode(added, skip_special_tokens=False) == (
        "\n<|im_start|>user\n<tool_response>\n408\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    whole = tokenizer.encode(render(tokenizer, episode.messages, None, **kwargs))
    assert prompt_ids + turn_ids + added == whole


def test_the_readme_environment_example_runs():
    """docs/agents.md's my_env.py, as printed there: a calculator call is answered, the right answer scores 1."""
    page = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "agents.md")).read()
    code = page.split("```python\n# my_env.py\n", 1)[1].split("```", 1)[0]
    namespace = {}
    exec(compile(code, "docs/agents.md:my_env.py", "exec"), namespace)
    env = namespace["Multiply"]()
    assert env.reset({"prompt": "12*34", "answer": "408"})[0]["content"] == "What is 12*34? Use the calculator."
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>'
    assert env.step(call) == ([{"role": "tool", "content": "408"}], 0.0, False)
    assert env.step("408") == (None, 1.0, True) and env.step("407") == (None, 0.0, True)


def test_ppo_train_task_toolmul_runs_the_shipped_tool_demo(tmp_path):
    """`ppo-train --task=toolmul`: the shipped tool-demo checkpoint plays calculator episodes (environment='tools' by
    default for the task) and trains; two small iterations, the episodes' metrics logged."""
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "ppo_core.train", "--task=toolmul", "--max_new_tokens=96",
                           "--max_turn_tokens=64", "--iterations=2", "--rollout_batch_size=8", "--minibatch_size=8",
                           "--micro_batch_size=8", "--eval_size=8", "--progress=false", f"--out={out}"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(0 <= m["env/tool_calls"] <= 3 and m["env/turns"] >= 1 for m in metrics)
    assert sum(m["env/tool_calls"] for m in metrics) > 0  # the SFT policy calls the calculator some of the time


def test_a_chat_row_is_rendered_by_its_environment_like_any_row(checkpoint, tmp_path):
    """With an environment, a row's prompt is what the environment's reset renders, for a "messages" row too (the
    lengths the run checks and pads to are those of the prompts the episodes play)."""
    from ppo_core.config import build_config
    from ppo_core.agents.environments import render
    from ppo_core.rollout import prompt_token_ids

    (tmp_path / "chat_env.py").write_text(
        "class Chat:\n"
        "    def reset(self, row):\n"
        "        return [{'role': 'system', 'content': 'be brief'}] + row['messages']\n"
        "    def step(self, text):\n"
        "        return None, 0.0, True\n")
    cfg = build_config({}, {"environment": f"{tmp_path / 'chat_env.py'}:Chat"})
    tokenizer = load_tokenizer(str(checkpoint / "ckpt"))
    row = {"messages": [{"role": "user", "content": "12*34"}]}
    want = tokenizer.encode(render(tokenizer, [{"role": "system", "content": "be brief"}, *row["messages"]], None,
                                   enable_thinking=True))
    assert prompt_token_ids(tokenizer, row, cfg) == want
