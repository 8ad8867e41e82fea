"""The built-in tasks: *reverse* a word (the default job), with a verifiable partial-credit reward, and *arith*.

    prompt   "kitten="        response "nettik<eos>"        reward 1.0
    prompt   "kitten="        response "kitten<eos>"        reward 2/6   (copied: only the middle "tt" is in place)
    prompt   "kitten="        response "nettak<eos>"        reward 5/6

The reward is the fraction of positions that match the reversed word, over the longer of the two
strings, so a response gets credit per correct character and loses it for each missing or extra one.
It lies in [0, 1] and needs nothing but string comparison: the kind of cheap-rollout, verifiable task
that small models are used for in RL-with-verifiable-rewards work.

The shipped SFT checkpoint (`scripts/make_demo_checkpoint.py`) imitated a sloppy demonstrator that
reverses the word only 40% of the time (and copies it otherwise) and misspells 10% of characters, so
it starts with a reward near 0.4 and PPO has real headroom to climb.

The second built-in task, *arith*, is multi-digit addition and subtraction with an exact-match reward:

    prompt   "347+85="            response "#### 432<eos>"      reward 1.0
    prompt   "347+85="            response "#### 322<eos>"      reward 0.0   (forgot both carries)
    prompt   "904-388="           response "#### 684<eos>"      reward 0.0   (forgot the borrows; the answer is 516)
    prompt   "347+85="            response "432<eos>"           reward 0.0   (no "####": GSM8K's answer format)

Operands have 2 or 3 digits (what the demo's 0.19M-parameter model learns in a few CPU minutes; longer
operands are a change of ARITH_MAX_DIGITS); a subtraction puts the larger operand first, so answers are
never negative. The answer is read as GSM8K writes it (the text after "####", see ppo_core/verifiers.py)
and must equal the true result as a number: all or nothing. Its shipped SFT checkpoint
(`scripts/make_arith_checkpoint.py`) imitated a demonstrator that often forgets to carry (or to borrow),
so it starts well below perfect.
"""
import random
import re
import string

from .verifiers import extract_gsm8k, numbers_equal

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


# ---------------------------------------------------------------------------------------- arith

ARITH_MIN_DIGITS, ARITH_MAX_DIGITS = 2, 3
_ARITH_PROMPT = re.compile(r"(\d+)([+-])(\d+)=")


def random_operand(rng: random.Random) -> int:
    """A number of ARITH_MIN_DIGITS..ARITH_MAX_DIGITS digits (the length drawn first, uniformly)."""
    digits = rng.randint(ARITH_MIN_DIGITS, ARITH_MAX_DIGITS)
    return rng.randint(10 ** (digits - 1), 10**digits - 1)


def random_arith_prompt(rng: random.Random) -> str:
    """"a+b=" or "a-b=", the larger operand first (a >= b), e.g. "347+85=" or "904-388="."""
    a, b = random_operand(rng), random_operand(rng)
    op = rng.choice("+-")
    a, b = max(a, b), min(a, b)
    return f"{a}{op}{b}{SEPARATOR}"


def arith_answer(prompt: str) -> int:
    """The true result of an arith prompt: arith_answer("347+85=") == 432. ValueError for any other text."""
    m = _ARITH_PROMPT.fullmatch(prompt.strip())
    if m is None:
        raise ValueError(f"not an arith prompt (digits, + or -, digits, '='): {prompt!r}")
    a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
    return a + b if op == "+" else a - b


def arith_reward(response: str, answer) -> float:
    """1.0 if the number after the response's last "####" equals `answer` (an int or a numeric string), else 0.0."""
    return 1.0 if numbers_equal(extract_gsm8k(response), answer) else 0.0


def arith_rewards(prompts: list[str], responses: list[str]) -> list[float]:
    """The arith task's reward function, fn(prompts, responses) -> list[float]: the answer from the prompt."""
    return [arith_reward(r, arith_answer(p)) for p, r in zip(prompts, responses)]


def arith_answer_reward(prompts: list[str], responses: list[str], answer: list) -> list[float]:
    """The same check with the answer from the dataset's "answer" column (one entry per response), for prompt
    files whose rows carry it: fn(prompts, responses, answer) -> list[float]. The prompts are not read."""
    return [arith_reward(r, a) for r, a in zip(responses, answer)]


# ---------------------------------------------------------------------------------------- prompts of a task

def random_prompt(rng: random.Random, task: str = "reverse") -> str:
    """One prompt of a built-in task: 'reverse' ("kitten=") or 'arith' ("347+85=")."""
    if task == "reverse":
        return random_word(rng) + SEPARATOR
    if task == "arith":
        return random_arith_prompt(rng)
    raise ValueError(f"unknown task {task!r}: 'reverse' or 'arith'")


def eval_prompts(n: int, seed: int, task: str = "reverse") -> list[str]:
    """A fixed held-out set of `n` distinct prompts of `task` (training prompts never come from it)."""
    rng = random.Random(f"eval-{seed}")
    prompts: list[str] = []
    seen = set()
    while len(prompts) < n:
        p = random_prompt(rng, task)
        if p not in seen:
            seen.add(p)
            prompts.append(p)
    return prompts


class PromptStream:
    """An endless, seeded stream of training prompts of `task` that skips the held-out ones.

    Its position (`state_dict`) is the number of prompts drawn, so a resumed run draws the same next
    prompts as a run that never stopped.
    """

    def __init__(self, seed: int, held_out: list[str], task: str = "reverse"):
        self.seed = seed
        self.held_out = set(held_out)
        self.task = task
        self.drawn = 0
        self._rng = random.Random(f"train-{seed}")

    def next_batch(self, n: int) -> list[str]:
        out = []
        while len(out) < n:
            p = random_prompt(self._rng, self.task)
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
            random_prompt(self._rng, self.task)
            self.drawn += 1
