"""Multi-turn episodes (ppo_core/environments.py) on the rollout engine: a scripted environment played by a tiny
random policy over a real BPE tokenizer with a chat template. The conversation the sequence holds must be exactly the
template's rendering of the messages (checked here against a rendering of the final conversation in one go), the
observations masked 0, rewards summed, the turn and token limits kept; a template that rewrites history is refused."""
import sys
import time

import pytest
import torch

from ppo_core.engine import RolloutEngine
from ppo_core.environments import IncrementalRenderError, run_episodes
from ppo_core.model import CausalLM, ModelArgs
from ppo_core.tokenizer import load_tokenizer

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
