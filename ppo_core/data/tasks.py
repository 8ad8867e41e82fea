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
never negative. The answer is read as GSM8K writes it (the text after "####", see ppo_core/rewards/verifiers.py)
and must equal the true result as a number: all or nothing. Its shipped SFT checkpoint
(`scripts/make_arith_checkpoint.py`) imitated a demonstrator that often forgets to carry (or to borrow),
so it starts well below perfect.
"""
import random
import re
import string

from .numbers import extract_gsm8k, numbers_equal

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


# ---------------------------------------------------------------------------------------- toolmul
# Multiply two 3-digit numbers: too hard for the demo's 0.2M-parameter model, easy with the calculator tool
# (ppo_core.agents.tools.Calculator) played by ppo_core.agents.environments.ToolEnvironment, which scores the final answer against
# the row's "answer" column by exact match. Its rows are {"prompt": "123*456", "answer": "56088"}: a task of rows,
# not of prompt strings, so it has its own held-out set and stream beside eval_prompts and PromptStream.
# Its shipped SFT checkpoint (`scripts/make_tool_checkpoint.py`) calls the tool only some of the time.

TOOLMUL_MIN, TOOLMUL_MAX = 100, 999
_TOOLMUL_PROMPT = re.compile(r"(\d+)\*(\d+)")


def toolmul_row(prompt: str) -> dict:
    """The row of a toolmul prompt: toolmul_row("123*456") == {"prompt": "123*456", "answer": "56088"}. ValueError
    for any other text."""
    m = _TOOLMUL_PROMPT.fullmatch(prompt.strip())
    if m is None:
        raise ValueError(f"not a toolmul prompt (digits, '*', digits): {prompt!r}")
    return {"prompt": prompt, "answer": str(int(m.group(1)) * int(m.group(2)))}


def random_toolmul_row(rng: random.Random) -> dict:
    """A row of two operands drawn uniformly from TOOLMUL_MIN..TOOLMUL_MAX: {"prompt": "123*456", "answer": "56088"}."""
    return toolmul_row(f"{rng.randint(TOOLMUL_MIN, TOOLMUL_MAX)}*{rng.randint(TOOLMUL_MIN, TOOLMUL_MAX)}")


def toolmul_rows(n: int, seed: int) -> list[dict]:
    """A fixed held-out set of `n` rows with distinct prompts, as eval_prompts is for the prompt tasks (its own
    random stream, so a seed's toolmul rows share nothing with its reverse or arith prompts)."""
    rng = random.Random(f"eval-toolmul-{seed}")
    rows, seen = [], set()
    while len(rows) < n:
        row = random_toolmul_row(rng)
        if row["prompt"] not in seen:
            seen.add(row["prompt"])
            rows.append(row)
    return rows


class ToolmulStream:
    """An endless, seeded stream of training rows of toolmul that skips the held-out prompts: PromptStream for a task
    of rows (next_batch returns dicts), with the same state_dict, so a resumed run draws the same next rows."""

    def __init__(self, seed: int, held_out: list[str]):
        self.seed = seed
        self.held_out = set(held_out)
        self.drawn = 0
        self._rng = random.Random(f"train-toolmul-{seed}")

    def next_batch(self, n: int) -> list[dict]:
        out = []
        while len(out) < n:
            row = random_toolmul_row(self._rng)
            self.drawn += 1
            if row["prompt"] not in self.held_out:
                out.append(row)
        return out

    def state_dict(self) -> dict:
        return {"seed": self.seed, "drawn": self.drawn}

    def load_state_dict(self, state: dict):
        self.seed = state["seed"]
        self._rng = random.Random(f"train-toolmul-{self.seed}")
        self.drawn = 0
        for _ in range(state["drawn"]):
            random_toolmul_row(self._rng)
            self.drawn += 1
