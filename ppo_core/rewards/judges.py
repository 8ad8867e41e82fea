"""Generative reward models (judges): a causal LM that writes a rationale and then a verdict, read as a reward.

    judge = JudgeReward("ppo_core/demo/judge-demo", "pointwise")
    scores, metrics = judge(["kitten="], ["nettak"])       # scores [1]: the parsed score, 5/6 here
    judge = JudgeReward("RM-R1-DeepSeek-Distilled-Qwen-7B", "pairwise", max_new_tokens=4096)
    scores, metrics = judge(prompts, responses, columns={"reference": reference_responses})

Two kinds of judge, as the open generative reward models come:
  - pointwise (CE-RM style, Hu et al. 2026): the judge reads the prompt and ONE response and ends with a score;
    `parse_pointwise` reads it ("Score: 7", "Score: 5/6", "\\boxed{7}", "Rating: [[7]]", "<score>7</score>") and the
    reward is that number, optionally mapped from the judge's scale [lo, hi] onto [0, 1] (`score_range`).
  - pairwise (GRAM, Wang et al. 2025; RM-R1, Chen et al. 2025): the judge reads the prompt and two responses, A and
    B, and names the better one; `parse_pairwise` reads the verdict ("[[A]]", "<answer>[[B]]</answer>",
    "<answer>\\nA\\n</answer>", a bare "A"). The second response is the reference, from the prompt column
    `reference_column`. Judges favour a position (Zheng et al. 2023, "Judging LLM-as-a-Judge", sec. 3.3), so each
    pair is judged in both orders, the policy's response first as A and then as B, and the reward is the mean
    preference for the policy's response over the two (`pairwise_reward`): 1 when both verdicts pick it, 0 when
    neither does, 0.5 for a judge that always names the same position.

Each judge prompt is a Jinja template (sandboxed, as chat templates are) that reads `prompt` and `response`
(pointwise) or `prompt`, `response_a`, `response_b` (pairwise), and may read any other prompt column by name (a
rubric, a reference answer). The rendered text is the user turn of the judge's own chat template when it has one
(with `enable_thinking`), else the raw prompt. Decoding is ppo-core's batched KV-cache `generate`, greedy by
default, stopping at every EOS id of the judge's tokenizer. A reasoning judge's <think>...</think> is skipped by the
parsers; an unfinished one (cut by max_new_tokens) has no verdict.

An output with no verdict gets `unparsed_score` and counts in the metric "judge/unparsed". The judge's full output
goes to the metric "judge/rationale" (a list of B str, not a tensor), for samples.jsonl.

Templates: `template` is a path to a .jinja file or a shipped name ('pointwise', 'pairwise': ppo_core/rewards/judge_templates/);
None = the judge checkpoint's own <mode>.jinja when it has one (the tiny demo judge does), else the shipped one.
"""
import math
import os
import re
from dataclasses import dataclass
from functools import lru_cache

import jinja2
import jinja2.meta
import torch

from ..models.chat_template import ChatTemplateError, bounded_environment, render_bounded
from .interface import RewardError
from .verifiers import extract_boxed, parse_number

MODES = ("pointwise", "pairwise")
TEMPLATE_DIR = os.path.join(os.path.dirname(__file__), "judge_templates")
TEMPLATE_VARIABLES = {"pointwise": ("prompt", "response"), "pairwise": ("prompt", "response_a", "response_b")}
"""What each mode gives a template; any other variable it reads must be a prompt column of that name."""
RATIONALE_HEADERS = ("--- policy response as A ---\n", "\n--- policy response as B ---\n")
"""Before each order's output in a pairwise "judge/rationale"."""


class JudgeError(RewardError):
    """A judge that cannot be used: no checkpoint, not a causal LM, a template that is missing or does not render."""


# ---------------------------------------------------------------------------------------------------- templates

@lru_cache
def _environment() -> jinja2.Environment:
    # StrictUndefined: a misspelt variable is an error, not an empty string in the judge's prompt. A judge checkpoint's
    # template is bounded as a chat template is (ppo_core/models/chat_template.py): it cannot take the machine
    return bounded_environment(undefined=jinja2.StrictUndefined)


@lru_cache
def compile_judge_template(template: str) -> jinja2.Template:
    try:
        return _environment().from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise JudgeError(f"judge template does not parse: {e.message} (line {e.lineno})") from None


def template_variables(template: str) -> set:
    """The variables a template reads (that it does not set itself)."""
    try:
        return jinja2.meta.find_undeclared_variables(_environment().parse(template))
    except jinja2.TemplateSyntaxError as e:
        raise JudgeError(f"judge template does not parse: {e.message} (line {e.lineno})") from None


def render_judge_prompt(template: str, **variables) -> str:
    """The judge's prompt: `template` (Jinja text) rendered with `variables` (prompt=..., response=... or
    response_a=..., response_b=..., and any prompt column). JudgeError when it fails (a variable it reads is not
    given, a filter or `raise_exception` fails), naming the error."""
    try:
        return render_bounded(compile_judge_template(template), variables, what="the judge template")
    except ChatTemplateError as e:
        raise JudgeError(str(e)) from None
    except jinja2.TemplateError as e:
        raise JudgeError(f"judge template does not render: {type(e).__name__}: {e}") from None


def resolve_template(template, mode: str, judge_path: str = "") -> tuple[str, str]:
    """-> (template text, where it came from). `template`: a path to a file, or a shipped name ('pointwise',
    'pairwise'); None or "" = judge_path/<mode>.jinja when that exists, else the shipped template of `mode`."""
    if not template:
        own = os.path.join(judge_path, f"{mode}.jinja") if judge_path else ""
        path = own if own and os.path.isfile(own) else os.path.join(TEMPLATE_DIR, f"{mode}.jinja")
    else:
        path = os.path.expanduser(str(template))
        shipped = os.path.join(TEMPLATE_DIR, f"{template}.jinja")
        if not os.path.isfile(path) and os.path.isfile(shipped):
            path = shipped
    if not os.path.isfile(path):
        names = ", ".join(sorted(f[: -len(".jinja")] for f in os.listdir(TEMPLATE_DIR) if f.endswith(".jinja")))
        raise JudgeError(f"judge template {template!r}: no such file, and not a shipped template ({names})")
    try:
        with open(path, encoding="utf-8") as f:
            return f.read(), path
    except (OSError, UnicodeDecodeError) as e:
        raise JudgeError(f"judge template {path}: cannot be read ({e})") from None


# ---------------------------------------------------------------------------------------------------- parsers

_NUMBER = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)"
_SCORE_AFTER_WORD = re.compile(
    rf"(?i:\b(?:score|rating|grade)\b)[\s*_]*(?:(?i:is|of)\b|[:=])?[\s*_]*"
    rf"({_NUMBER}(?:\s*(?:/|(?i:out of))\s*{_NUMBER})?)")
_DOUBLE_BRACKETS = re.compile(r"\[\[\s*([^\[\]]*?)\s*\]\]")
_SCORE_TAG = re.compile(r"<(score|answer)>\s*(.*?)\s*</\1>", re.DOTALL)
_VERDICT_AFTER_WORD = re.compile(
    r"(?i:\b(?:final verdict|verdict|preferred|preference|better response|better answer|winner|choice|answer))"
    r"(?:\s+(?i:is))?\s*[:=]?[\s*\"'(\[]*(?:(?i:response|assistant|output)\s*)?([AB])\b")


def final_part(text: str) -> str | None:
    """The text after a reasoning judge's last </think>; None when a <think> never closes (the judge was cut off
    while thinking: whatever it wrote there is not a verdict); the whole text when it does not think."""
    if "</think>" in text:
        return text.rsplit("</think>", 1)[1]
    if "<think>" in text:
        return None
    return text


def _number(text: str) -> float | None:
    """A finite float from '7', '7.5', '5/6', '7 out of 10', '\\frac{5}{6}', else None."""
    text = re.sub(r"(?i)\s*out of\s*", "/", text.strip())
    value = parse_number(text)
    if value is None:
        return None
    try:
        value = float(value)
    except OverflowError:
        return None
    return value if math.isfinite(value) else None


def parse_pointwise(text: str) -> float | None:
    """The score a pointwise judge ends with, or None. A fraction is read as its value ('Score: 5/6' -> 0.8333,
    'Score: 7/10' -> 0.7, '7 out of 10' -> 0.7); a bare number as itself ('Score: 7' -> 7.0).

    Looked for in this order, the LAST occurrence of the first kind found (a judge's final word wins over the
    numbers it quotes on the way): \\boxed{...} (nested braces kept, as verifiers.extract_boxed), [[...]] (MT-Bench's
    "Rating: [[7]]"), <score>...</score> or <answer>...</answer>, then a number after the word score / rating /
    grade ("Score: 7", "**Overall score**: 8/10", "final score is 6.5"). Only the text after </think> is read."""
    text = final_part(text)
    if text is None:
        return None
    boxed = extract_boxed(text)
    if boxed is not None and _number(boxed) is not None:
        return _number(boxed)
    for content in reversed(_DOUBLE_BRACKETS.findall(text)):
        if _number(content) is not None:
            return _number(content)
    for _, content in reversed(_SCORE_TAG.findall(text)):
        if _number(content) is not None:
            return _number(content)
    found = _SCORE_AFTER_WORD.findall(text)
    return _number(found[-1]) if found else None


def _letter(content: str) -> str | None:
    """'A', 'B' or 'tie' from a verdict's content ('A', '[[B]]', 'Response A', '"A"', 'C' (MT-Bench's tie))."""
    content = re.sub(r"^(?i:response|assistant|output)\s*", "", content.strip(" \t\n*\"'()[]."))
    content = content.strip(" \t\n*\"'()[].")
    if content in ("A", "B"):
        return content
    if content.upper() in ("C", "TIE"):
        return "tie"
    return None


def parse_pairwise(text: str) -> str | None:
    """The response a pairwise judge prefers: "A", "B", "tie" (an explicit [[C]] or [[tie]], as MT-Bench's judge
    writes one), or None when there is no verdict.

    Looked for in this order, the LAST occurrence of the first kind found: [[A]] / [[B]] (RM-R1 writes
    "<answer>[[A]]</answer>"), <answer>...</answer> holding A or B (GRAM-R^2 writes "<answer>\\nA\\n</answer>"), a
    letter after verdict / preferred / better response / winner / choice / answer ("#Preferred: B", "Final
    verdict: A"), and an output that is nothing but the letter (GRAM writes "A"). The letter must be a capital.
    Only the text after </think> is read."""
    text = final_part(text)
    if text is None:
        return None
    for content in reversed(_DOUBLE_BRACKETS.findall(text)):
        if _letter(content) is not None:
            return _letter(content)
    for tag, content in reversed(_SCORE_TAG.findall(text)):
        if tag == "answer" and _letter(content) is not None:
            return _letter(content)
    found = _VERDICT_AFTER_WORD.findall(text)
    if found:
        return found[-1]
    return _letter(text) if _letter(text) in ("A", "B") else None


def preference(verdict, policy_is: str, unparsed_score: float, tie_score: float = 0.5) -> float:
    """One order's preference for the policy's response, which sat at position `policy_is` ("A" or "B"):
    1 if the verdict names it, 0 if it names the other, tie_score for a tie, unparsed_score without a verdict."""
    if verdict is None:
        return float(unparsed_score)
    if verdict == "tie":
        return float(tie_score)
    return 1.0 if verdict == policy_is else 0.0


def pairwise_reward(verdict_ab, verdict_ba, unparsed_score: float = 0.0, tie_score: float = 0.5) -> float:
    """The both-orders reward of one pair. verdict_ab: the judge's verdict with the policy's response as A and the
    reference as B; verdict_ba: with the two swapped. Each is "A", "B", "tie" or None (unparseable).

        r = ( pref(policy as A) + pref(policy as B) ) / 2

    so a judge that names the same position both times (pure position bias) gives 0.5, not 0 or 1."""
    return 0.5 * (preference(verdict_ab, "A", unparsed_score, tie_score)
                  + preference(verdict_ba, "B", unparsed_score, tie_score))


# ---------------------------------------------------------------------------------------------------- the source

@dataclass(frozen=True)
class JudgeSettings:
    """How a JudgeReward judges (JudgeReward(path, mode, **settings) takes these by name; JudgeReward's docstring
    says what each does). The config's judge_* keys (ppo_core.rewards.source) map onto them."""
    template: str = None
    max_new_tokens: int = 1024
    unparsed_score: float = 0.0
    reference_column: str = "reference"
    chat_template: bool = None
    enable_thinking: bool = False
    greedy: bool = True
    temperature: float = 1.0
    batch_size: int = 32
    seed: int = 0
    score_range: tuple = None
    tie_score: float = 0.5
    engine: str = "paged"


class JudgeReward:
    """A generative judge as a reward source: scores, metrics = judge(prompts, responses, columns).

    JudgeReward(path, mode, device="cpu", dtype=None, **settings), settings the fields of JudgeSettings:
    path: the judge checkpoint (any *ForCausalLM ppo-core loads, with its tokenizer); mode: "pointwise" or "pairwise";
    template: see resolve_template; max_new_tokens: the longest judgement (a rationale cut short has no verdict);
    unparsed_score: the reward of a judgement without a verdict (pairwise: of that order); tie_score: of one
    order's explicit tie (pairwise); score_range: (lo, hi) of the judge's scale, mapped onto [0, 1] (pointwise;
    None = the parsed number itself); reference_column: the prompt column holding the reference response
    (pairwise); chat_template: None = use the judge's chat template when it has one, True = require it, False =
    the raw prompt; enable_thinking: passed to that chat template; greedy, temperature, seed: decoding (a sampled
    judge draws from its own seeded noise); batch_size: judge prompts decoded at once; engine: "paged" (the rollout
    engine, ppo_core.engine: every prompt of a call in one continuous batch, a shared template prefix prefilled
    once) or "padded" (ppo_core.generate on length-sorted batches, the reference).

    Metrics, each [B] float32 unless noted: "judge/unparsed" 1.0 for a sample with a judgement without a verdict
    (pairwise: in either order); "judge/truncated" 1.0 where a judgement hit max_new_tokens; pairwise also
    "judge/pref_policy_as_a" and "judge/pref_policy_as_b" (each order's preference, whose means differ by the
    judge's position bias) and "judge/consistent" (1.0 where both orders name the same response);
    "judge/rationale": list of B str, the full output (pairwise: both orders, each after its RATIONALE_HEADERS line).
    """

    def __init__(self, path, mode, device="cpu", dtype=None, **settings):
        s = JudgeSettings(**settings)  # an unknown setting: a TypeError that names it
        template, max_new_tokens, unparsed_score, tie_score = (s.template, s.max_new_tokens, s.unparsed_score,
                                                               s.tie_score)
        reference_column, chat_template, enable_thinking = s.reference_column, s.chat_template, s.enable_thinking
        greedy, temperature, batch_size, seed = s.greedy, s.temperature, s.batch_size, s.seed
        score_range, engine = s.score_range, s.engine
        from ..engine import RolloutEngine
        from ..engine.generate import generate
        from ..models.model import CheckpointError, load_model
        from ..models.tokenizer import load_tokenizer

        if mode not in MODES:
            raise JudgeError(f"judge mode {mode!r}: expected 'pointwise' or 'pairwise'")
        if max_new_tokens < 1 or batch_size < 1:
            raise JudgeError(f"judge max_new_tokens ({max_new_tokens}) and batch_size ({batch_size}) must be >= 1")
        if not greedy and not temperature > 0:
            raise JudgeError(f"judge temperature must be > 0 when sampling, got {temperature}")
        if score_range is not None:
            if len(score_range) != 2 or not float(score_range[0]) < float(score_range[1]):
                raise JudgeError(f"judge score_range must be [lo, hi] with lo < hi, got {list(score_range)}")
            score_range = (float(score_range[0]), float(score_range[1]))
        path = os.path.expanduser(str(path))
        if not os.path.isdir(path):
            raise JudgeError(f"judge checkpoint {path!r}: no such directory")
        try:
            self.model = load_model(path, dtype=dtype, device=device).eval().requires_grad_(False)
            self.tokenizer = load_tokenizer(path)
        except (CheckpointError, FileNotFoundError) as e:
            raise JudgeError(f"judge checkpoint {path!r}: {e}") from None
        has_chat_template = self.tokenizer.chat_template is not None
        if chat_template and not has_chat_template:
            raise JudgeError(f"judge checkpoint {path!r} has no chat template (chat_template.jinja or "
                             "tokenizer_config.json's 'chat_template'), and the judge's chat_template is on")
        self.template, self.template_path = resolve_template(template, mode, path)
        compile_judge_template(self.template)  # a syntax error now, not at the first batch
        given = TEMPLATE_VARIABLES[mode]
        for needed in given[1:]:
            if needed not in template_variables(self.template):
                raise JudgeError(f"judge template {self.template_path} never reads '{needed}': a {mode} template "
                                 f"reads {', '.join(given)}")
        self.column_variables = sorted(template_variables(self.template) - set(given))
        """Prompt columns the template reads by name (a rubric, a reference answer)."""
        self.path, self.mode = path, mode
        self.max_new_tokens, self.batch_size = int(max_new_tokens), int(batch_size)
        self.unparsed_score, self.tie_score, self.score_range = float(unparsed_score), float(tie_score), score_range
        self.reference_column = reference_column
        self.use_chat_template = has_chat_template if chat_template is None else bool(chat_template)
        self.enable_thinking, self.greedy, self.temperature = enable_thinking, greedy, temperature
        self.device = torch.device(device)
        if engine not in ("paged", "padded"):
            raise JudgeError(f"judge engine {engine!r}: expected 'paged' or 'padded'")
        self.engine = RolloutEngine(self.model, max_num_seqs=self.batch_size) if engine == "paged" else None
        self.seed, self.n_calls = seed, 0  # the paged engine's noise: (seed, call) for each call
        self.generator = torch.Generator(self.device).manual_seed(seed)
        self._generate = generate

    # -- columns

    def needed_columns(self) -> list[str]:
        """The prompt columns every call needs: the reference (pairwise) and those the template reads."""
        needed = [self.reference_column] if self.mode == "pairwise" else []
        return needed + [c for c in self.column_variables if c not in needed]

    def check_columns(self, names):
        """RewardError naming the first needed column (needed_columns) that `names` lacks."""
        names = list(names)
        for column in self.needed_columns():
            if column not in names:
                have = f"its columns: {', '.join(names)}" if names else "it has no extra columns"
                why = ("holds the reference response the pairwise judge compares with"
                       if column == self.reference_column and self.mode == "pairwise"
                       else f"is read by the judge template {self.template_path}")
                raise RewardError(f"judge: column '{column}' {why}, and the prompts do not have it ({have})")

    # -- judging

    def encode(self, judge_prompt: str) -> list[int]:
        """The token ids of one rendered judge prompt: as the user turn of the judge's chat template (which writes
        its own BOS) when it is used, else the raw text with what the tokenizer's post-processor adds."""
        if not self.use_chat_template:
            return self.tokenizer.encode_prompt(judge_prompt)
        try:
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": judge_prompt}], tokenize=False,
                                                      add_generation_prompt=True, enable_thinking=self.enable_thinking)
        except (jinja2.TemplateError, ValueError, TypeError) as e:
            raise JudgeError(f"judge checkpoint {self.path!r}: its chat template fails: {e}") from None
        return self.tokenizer.encode(text)

    @torch.no_grad()
    def complete(self, judge_prompts: list[str]) -> tuple[list[str], list[bool]]:
        """Judge prompts (rendered text) -> (the judge's outputs, whether each hit max_new_tokens before an EOS).

        The paged engine decodes them all in one call (batch_size at once); the padded path in batches of
        batch_size, rows sorted by length first (less padding; left padding leaves each row's tokens exactly as
        alone). Each output is decoded up to its first EOS id."""
        tok = self.tokenizer
        eos_ids = list(tok.eos_token_ids)
        pad = tok.pad_token_id if tok.pad_token_id is not None else (eos_ids[0] if eos_ids else 0)
        encoded = [self.encode(p) for p in judge_prompts]
        if self.engine is not None:
            self.n_calls += 1
            new = self.engine.generate(encoded, self.max_new_tokens, greedy=self.greedy, temperature=self.temperature,
                                       eos_token_id=eos_ids, seed=self.seed * 1_000_003 + self.n_calls)
            ended = [bool(row) and row[-1] in eos_ids for row in new]
            outputs = [tok.decode(row[:-1] if end else row, skip_special_tokens=True) for row, end in zip(new, ended)]
            return outputs, [not end for end in ended]
        order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))
        outputs, truncated = [""] * len(encoded), [False] * len(encoded)
        for start in range(0, len(order), self.batch_size):
            rows = order[start : start + self.batch_size]
            P = max(len(encoded[i]) for i in rows)
            ids = torch.tensor([[pad] * (P - len(encoded[i])) + encoded[i] for i in rows], device=self.device)  # [b, P]
            mask = torch.tensor([[0] * (P - len(encoded[i])) + [1] * len(encoded[i]) for i in rows],
                                device=self.device)  # [b, P], left-padded
            tokens = self._generate(self.model, ids, self.max_new_tokens, attention_mask=mask, greedy=self.greedy,
                                    temperature=self.temperature, eos_token_id=eos_ids, pad_token_id=pad,
                                    generator=self.generator)  # [b, max_new_tokens]
            for i, row in zip(rows, tokens.tolist()):
                ends = [t for t, token in enumerate(row) if token in eos_ids]
                truncated[i] = not ends
                outputs[i] = tok.decode(row[: ends[0]] if ends else row, skip_special_tokens=True)
        return outputs, truncated

    def _render(self, prompt, i, columns, **responses) -> str:
        extra = {name: columns[name][i] for name in self.column_variables}
        return render_judge_prompt(self.template, prompt=prompt, **responses, **extra)

    def __call__(self, prompts, responses, columns=None):
        """-> (scores [B] float32 on the CPU, metrics: see the class docstring)."""
        prompts, responses = list(prompts), list(responses)
        B = len(responses)
        if len(prompts) != B:
            raise RewardError(f"judge: {len(prompts)} prompts for {B} responses")
        columns = columns or {}
        self.check_columns(columns)
        for name in self.needed_columns():
            if len(columns[name]) != B:
                raise RewardError(f"judge: column '{name}' holds {len(columns[name])} values for {B} prompts")
        if self.mode == "pointwise":
            return self._pointwise(prompts, responses, columns)
        return self._pairwise(prompts, responses, columns)

    def _pointwise(self, prompts, responses, columns):
        judge_prompts = [self._render(p, i, columns, response=r) for i, (p, r) in enumerate(zip(prompts, responses))]
        outputs, truncated = self.complete(judge_prompts)
        scores, unparsed = [], []
        for text in outputs:
            value = parse_pointwise(text)
            unparsed.append(value is None)
            if value is None:
                scores.append(self.unparsed_score)
            elif self.score_range is not None:
                lo, hi = self.score_range
                scores.append((value - lo) / (hi - lo))  # the judge's scale [lo, hi] -> [0, 1]
            else:
                scores.append(value)
        metrics = {"judge/unparsed": torch.tensor(unparsed, dtype=torch.float32),  # [B]
                   "judge/truncated": torch.tensor(truncated, dtype=torch.float32),  # [B]
                   "judge/rationale": outputs}
        return torch.tensor(scores, dtype=torch.float32), metrics

    def _pairwise(self, prompts, responses, columns):
        references = [str(r) for r in columns[self.reference_column]]
        # rows 0..B-1: the policy's response as A; rows B..2B-1: as B
        judge_prompts = ([self._render(p, i, columns, response_a=r, response_b=ref)
                          for i, (p, r, ref) in enumerate(zip(prompts, responses, references))]
                         + [self._render(p, i, columns, response_a=ref, response_b=r)
                            for i, (p, r, ref) in enumerate(zip(prompts, responses, references))])
        outputs, truncated = self.complete(judge_prompts)
        B = len(responses)
        verdicts = [parse_pairwise(text) for text in outputs]
        as_a, as_b = verdicts[:B], verdicts[B:]
        rewards = [pairwise_reward(ab, ba, self.unparsed_score, self.tie_score) for ab, ba in zip(as_a, as_b)]
        unparsed, tie = self.unparsed_score, self.tie_score
        metrics = {  # each [B] float32 but the rationales
            "judge/unparsed": torch.tensor([ab is None or ba is None for ab, ba in zip(as_a, as_b)],
                                           dtype=torch.float32),
            "judge/truncated": torch.tensor([t1 or t2 for t1, t2 in zip(truncated[:B], truncated[B:])],
                                            dtype=torch.float32),
            "judge/pref_policy_as_a": torch.tensor([preference(v, "A", unparsed, tie) for v in as_a]),
            "judge/pref_policy_as_b": torch.tensor([preference(v, "B", unparsed, tie) for v in as_b]),
            # the same response named in both orders: the verdict followed the content, not the position
            "judge/consistent": torch.tensor([(ab, ba) in (("A", "B"), ("B", "A")) for ab, ba in zip(as_a, as_b)],
                                             dtype=torch.float32),
            "judge/rationale": [RATIONALE_HEADERS[0] + ab + RATIONALE_HEADERS[1] + ba
                                for ab, ba in zip(outputs[:B], outputs[B:])],
        }
        return torch.tensor(rewards, dtype=torch.float32), metrics
