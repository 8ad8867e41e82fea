"""The built-in task of the default job: reverse a word, with a verifiable partial-credit reward.

    prompt   "kitten="        response "nettik<eos>"        reward 1.0
    prompt   "kitten="        response "kitten<eos>"        reward 0.0   (copied, not reversed)
    prompt   "kitten="        response "nettak<eos>"        reward 5/6

The reward is the fraction of positions that match the reversed word, over the longer of the two
strings, so a response gets credit per correct character and loses it for each missing or extra one.
It lies in [0, 1] and needs nothing but string comparison: the kind of cheap-rollout, verifiable task
that small models are used for in RL-with-verifiable-rewards work.

The shipped SFT checkpoint (`scripts/make_demo_checkpoint.py`) imitated a sloppy demonstrator that
reverses the word only 40% of the time (and copies it otherwise) and misspells 10% of characters, so
it starts with a reward near 0.4 and PPO has real headroom to climb.
"""
import random
import string

ALPHABET = string.ascii_lowercase
SEPARATOR = "="
MIN_LEN, MAX_LEN = 3, 8


def reverse_reward(prompt: str, response: str) -> float:
    """Fraction of positions where `response` matches the reversed word of `prompt`."""
    target = prompt.rstrip(SEPARATOR)[::-1]
    if not target and not response:
        return 1.0
    matches = sum(a == b for a, b in zip(response, target))
    return matches / max(len(target), len(response))


def reverse_rewards(prompts: list[str], responses: list[str]) -> list[float]:
    """The reward function in the form the trainer takes: fn(prompts, responses) -> list[float]."""
    return [reverse_reward(p, r) for p, r in zip(prompts, responses)]


def random_word(rng: random.Random) -> str:
    return "".join(rng.choice(ALPHABET) for _ in range(rng.randint(MIN_LEN, MAX_LEN)))


def eval_prompts(n: int, seed: int) -> list[str]:
    """A fixed held-out set of `n` distinct prompts (training prompts never come from it)."""
    rng = random.Random(f"eval-{seed}")
    words: list[str] = []
    seen = set()
    while len(words) < n:
        w = random_word(rng)
        if w not in seen:
            seen.add(w)
            words.append(w)
    return [w + SEPARATOR for w in words]


class PromptStream:
    """An endless, seeded stream of training prompts that skips the held-out ones.

    Its position (`state_dict`) is the number of prompts drawn, so a resumed run draws the same next
    prompts as a run that never stopped.
    """

    def __init__(self, seed: int, held_out: list[str]):
        self.seed = seed
        self.held_out = set(held_out)
        self.drawn = 0
        self._rng = random.Random(f"train-{seed}")

    def next_batch(self, n: int) -> list[str]:
        out = []
        while len(out) < n:
            p = random_word(self._rng) + SEPARATOR
            self.drawn += 1
            if p not in self.held_out:
                out.append(p)
        return out

    def state_dict(self) -> dict:
        return {"seed": self.seed, "drawn": self.drawn}

    def load_state_dict(self, state: dict):
        self.seed = state["seed"]
        self._rng = random.Random(f"train-{self.seed}")
        self.drawn = 0
        for _ in range(state["drawn"]):
            random_word(self._rng)
            self.drawn += 1
