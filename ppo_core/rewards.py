"""Reward sources, and the checks on what a reward function returns.

Every reward source is called the same way:

    scores, metrics = source(prompts, responses, columns=None)
        prompts, responses: list[str], B of each. A prompt is the RAW prompt text (for a chat row, the content of its
                            last user turn), never the chat-rendered text.
        columns:            {column name: list of B values}, the prompt rows' extra columns (e.g. "answer"), or None
        scores:             [B] float32 on the CPU
        metrics:            {name: [B] float32}, per-sample values the loop logs as batch means

It is one of
  - WeightedReward: one or more Python reward functions (config `reward_fn`, or the built-in task's reward), each
    wrapped in a CallableReward, added up with the weights `reward_weights`: score = sum_k w_k * r_k. Its metrics
    are "reward/<name>", each function's own (unweighted) scores, and "reward/<name>/<metric>" for the extra
    entries of a function's dict, with one function as with several, so a run's keys do not depend on how many
    there are. <name> is the function's name ('my_rewards.py:score' -> "score"; the task's reward: the task's
    name), prefixed by its module where two functions share a name ("a.score", "b.score").
  - RewardModelReward: a reward model checkpoint (config `reward_model`): each prompt + response is rendered (with
    the reward model's own chat template when `chat_template` is on, with the run's `enable_thinking`), tokenized
    with the reward model's tokenizer, right-padded, and scored at its last real token. No metrics.

A reward function takes the prompts and responses as its first two parameters, and any extra column as a keyword
argument, one list per column, when its signature names it (or every column, with **kwargs):

    def score(prompts, responses, answer):           # answer: list of B values, from the rows' "answer" column
        return [1.0 if r.strip() == a else 0.0 for r, a in zip(responses, answer)]

It returns one number per response (a list or tuple of ints or floats - NumPy and 0-dim torch scalars too - or a
1-D NumPy array or torch tensor), or a dict {"rewards": [B numbers], "<metric>": [B numbers], ...} whose other
entries are logged. Each element is checked: a number (not a bool, a str, a dict, None or a list), finite, one per
response. Anything else is a RewardError of one line naming the function, the sample, its prompt and response and
what was returned; so is a function that raises, naming the first sample it raises on alone. That error also carries
where the function raised, `error.raised_at` ("FILE:LINE in FUNCTION", the innermost frame in the function's own file),
and the full traceback, `error.traceback`: ppo-train adds the first to its error line and appends the second to the
run directory's error.log (ppo_core.runlog.log_error).
"""
import importlib
import importlib.util
import inspect
import math
import os
import reprlib
import traceback
from collections.abc import Mapping

import numpy as np
import torch

from .tasks import arith_rewards, reverse_rewards

TASK_REWARDS = {"reverse": reverse_rewards, "arith": arith_rewards}


class RewardError(RuntimeError):
    """The reward function failed or returned something that is not one finite score per response. When the function
    raised: `raised_at`, "FILE:LINE in FUNCTION" in the function's own file (None when no frame is there), and
    `traceback`, the full traceback (a str); both None otherwise."""

    raised_at = traceback = None


def import_callable(spec: str):
    """'package.module:function' -> the function (the module may also be a path to a .py file)."""
    module_name, _, attr = spec.rpartition(":")
    try:
        if module_name.endswith(".py"):
            loader_spec = importlib.util.spec_from_file_location(os.path.basename(module_name)[:-3], module_name)
            if loader_spec is None or not os.path.isfile(module_name):
                raise ModuleNotFoundError(f"no file {module_name}")
            module = importlib.util.module_from_spec(loader_spec)
            loader_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
        fn = getattr(module, attr)
    except (ImportError, AttributeError) as e:
        raise RewardError(f"cannot load reward_fn '{spec}': {e}") from None
    if not callable(fn):
        raise RewardError(f"reward_fn '{spec}' is not callable")
    return fn


def metric_names(specs: list[str]) -> list[str]:
    """The name each reward function is logged under: 'my_rewards.py:score' -> 'score', 'pkg.mod:score' -> 'score';
    where two share a name (or one is 'mean' or 'std', which the loop's own reward/mean and reward/std hold), the
    module's is put in front ('my_rewards.score', 'pkg.mod.score'); where that still clashes, the whole spec."""
    short = [spec.rpartition(":")[2] for spec in specs]
    names = []
    for spec, name in zip(specs, short):
        if short.count(name) > 1 or name in ("mean", "std"):
            module, _, function = spec.rpartition(":")
            module = os.path.basename(module)[:-3] if module.endswith(".py") else module
            name = f"{module}.{function}"
        names.append(name)
    return [spec if names.count(name) > 1 else name for spec, name in zip(specs, names)]


# ---------------------------------------------------------------------------------------------------- the checks

_repr = reprlib.Repr()
_repr.maxstring, _repr.maxother, _repr.maxlist, _repr.maxtuple, _repr.maxdict = 40, 60, 6, 6, 4


def _show(value) -> str:
    """What was returned, for a message: its type and a short repr on one line ('str '0.5'', 'None')."""
    if value is None:
        return "None"
    if isinstance(value, (np.ndarray, torch.Tensor)):
        return f"{type(value).__name__} of shape {tuple(value.shape)} and dtype {value.dtype}"
    text = _repr.repr(value).replace("\n", " ")  # an object's repr may span lines
    return f"{type(value).__name__} {text[:100]}"


def _clip(text: str, n: int = 80) -> str:
    """repr(text) of at most n characters of it, '...' marking a cut."""
    shown = repr(text[:n])
    return shown[:-1] + "..." + shown[-1] if len(text) > n else shown


def as_number(x):
    """x as a Python float if it is one number - an int or float, a NumPy integer or floating scalar, a 0-dim NumPy
    array or torch tensor of an integer or floating dtype - else None (a bool, str, dict, None, list, complex...)."""
    if isinstance(x, (bool, np.bool_)):
        return None
    if isinstance(x, (int, float, np.integer, np.floating)):
        try:
            return float(x)
        except OverflowError:  # an int beyond float's range
            return math.inf
    if isinstance(x, np.ndarray) and x.ndim == 0 and x.dtype.kind in "iuf":
        return float(x)
    if isinstance(x, torch.Tensor) and x.ndim == 0 and x.dtype != torch.bool and not x.dtype.is_complex:
        return float(x.item())
    return None


DICT_FORM = '{"rewards": [one number per response], "<metric>": [one number per response], ...}'


class CallableReward:
    """A reward function, called with the prompt columns its signature names, its answer checked.

    fn(prompts, responses, <column>=[B values], ...) -> B numbers, or {"rewards": [B numbers], "<metric>": [B numbers]}
    name: how messages name it (the reward_fn spec, or "of task 'reverse'").
    The signature is read once, here: the parameters after the first two that can be passed by keyword are the
    columns it takes (all of them with **kwargs); those without a default are columns it needs.
    """

    def __init__(self, fn, name):
        self.fn, self.name = fn, name
        self.column_params, self.needed, self.takes_all, self.own_params = [], [], False, set()
        try:
            signature = inspect.signature(fn)
        except (TypeError, ValueError):  # a builtin without a signature: called with (prompts, responses) only
            return
        P = inspect.Parameter
        params = list(signature.parameters.values())
        positional = [p for p in params if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
        if len(positional) < 2 and not any(p.kind == P.VAR_POSITIONAL for p in params):
            raise RewardError(f"reward function {name} must take (prompts, responses) as its first two parameters, "
                              f"its signature is {signature}")
        for p in positional[2:]:
            if p.kind == P.POSITIONAL_ONLY and p.default is P.empty:
                raise RewardError(f"reward function {name}: a column cannot reach its positional-only parameter '{p.name}'")
        by_keyword = [p for p in params
                      if p.kind in (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY) and p not in positional[:2]]
        self.column_params = [p.name for p in by_keyword]
        self.needed = [p.name for p in by_keyword if p.default is P.empty]
        self.takes_all = any(p.kind == P.VAR_KEYWORD for p in params)
        self.own_params = {p.name for p in positional[:2]}  # a column of that name would collide with them

    def check_columns(self, names):
        """RewardError if the function needs a column (a parameter without a default) that `names` lacks."""
        names = list(names)
        for param in self.needed:
            if param not in names:
                have = f"its columns: {', '.join(names)}" if names else "it has no extra columns"
                raise RewardError(f"reward function {self.name} needs column '{param}', which the prompts file "
                                  f"does not have ({have})")

    def column_kwargs(self, columns, B):
        """{parameter: list of B values} for the columns the function takes."""
        columns = columns or {}
        self.check_columns(columns)
        kwargs = {}
        for key, values in columns.items():
            if (self.takes_all or key in self.column_params) and key not in self.own_params:
                if len(values) != B:
                    raise RewardError(f"column '{key}' holds {len(values)} values for {B} prompts")
                kwargs[key] = list(values)
        return kwargs

    def score(self, prompts, responses, columns=None):
        """-> (scores: list of B floats, metrics: {metric: list of B floats}), every value checked."""
        prompts, responses = list(prompts), list(responses)
        kwargs = self.column_kwargs(columns, len(responses))
        try:
            result = self.fn(prompts, responses, **kwargs)
        except Exception as e:
            message = " ".join(str(e).split())[:200]
            error = RewardError(f"reward function {self.name} raised {type(e).__name__}: {message} "
                                f"{self._locate(prompts, responses, kwargs)}")
            error.raised_at, error.traceback = self._raised_at(e), "".join(traceback.format_exception(e))
            raise error from None
        if isinstance(result, Mapping):
            if "rewards" not in result or not all(isinstance(key, str) for key in result):
                raise RewardError(f"reward function {self.name} returned a dict with keys {_repr.repr(list(result))}: "
                                  f"a dict must be {DICT_FORM}")
            scores = self._check(result["rewards"], "rewards", prompts, responses)
            return scores, {key: self._check(v, key, prompts, responses) for key, v in result.items() if key != "rewards"}
        return self._check(result, None, prompts, responses), {}

    def __call__(self, prompts, responses, columns=None):
        """-> (scores [B] float32, {metric: [B] float32}), the function's own metrics under their own names."""
        scores, metrics = self.score(prompts, responses, columns)
        return (torch.tensor(scores, dtype=torch.float32),
                {key: torch.tensor(values, dtype=torch.float32) for key, values in metrics.items()})

    def _check(self, values, entry, prompts, responses):
        """One returned list (the whole answer, entry None, or the dict's entry `entry`) -> list of B floats."""
        B = len(responses)
        where = f' in "{entry}"' if entry is not None else ""
        if isinstance(values, (np.ndarray, torch.Tensor)) and values.ndim == 1:
            values = values.detach().cpu().tolist() if isinstance(values, torch.Tensor) else values.tolist()
        elif not isinstance(values, (list, tuple)):
            if entry is None:
                raise RewardError(f"reward function {self.name} must return a list of numbers, one for each of the "
                                  f"{B} responses, or a dict {DICT_FORM}; got {_show(values)}")
            raise RewardError(f"reward function {self.name} returned {_show(values)}{where}: expected a list of "
                              f"numbers, one for each of the {B} responses")
        if len(values) != B:
            missing = f": none for sample {len(values)} {_sample(len(values), prompts, responses)}" if len(values) < B else ""
            what = "scores" if entry in (None, "rewards") else "values"
            raise RewardError(f"reward function {self.name} returned {len(values)} {what}{where} for {B} responses{missing}")
        checked = []
        for i, value in enumerate(values):
            number = as_number(value)
            if number is None:
                raise RewardError(f"reward function {self.name} returned {_show(value)}{where} for sample {i} "
                                  f"{_sample(i, prompts, responses)}: expected an int or float")
            if not math.isfinite(number):
                raise RewardError(f"reward function {self.name} returned {_repr.repr(value)}{where} for sample {i} "
                                  f"{_sample(i, prompts, responses)}: expected a finite number")
            checked.append(number)
        return checked

    def _raised_at(self, exception):
        """"FILE:LINE in FUNCTION" of the innermost frame of the exception's traceback in the file the reward function
        is defined in: the line that raised, in the function or a helper of that file, or the line of that file that
        called the library that raised. None when no frame is in that file (a builtin, say)."""
        try:
            own_file = inspect.getsourcefile(self.fn if inspect.isroutine(self.fn) else type(self.fn))
        except TypeError:  # a builtin
            return None
        frames = [f for f in traceback.extract_tb(exception.__traceback__)
                  if own_file and os.path.abspath(f.filename) == os.path.abspath(own_file)]
        return f"{frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}" if frames else None

    def _locate(self, prompts, responses, kwargs):
        """Find the first sample on which the function raises by itself, to name it in the error."""
        for i in range(len(prompts)):
            try:
                self.fn([prompts[i]], [responses[i]], **{key: [values[i]] for key, values in kwargs.items()})
            except Exception:
                return f"on sample {i} {_sample(i, prompts, responses)}"
        return f"on a batch of {len(prompts)} samples"


def _sample(i, prompts, responses) -> str:
    return f"(prompt {_clip(prompts[i])}, response {_clip(responses[i])})"


class WeightedReward:
    """Several reward functions added up: score = sum_k w_k * r_k (config reward_fn, reward_weights).

    functions: CallableReward each; weights: float each; names: each one's name in the metrics.
    Called as every reward source is, it returns (scores [B] float32, metrics): "reward/<name>" [B] each function's
    own (unweighted) scores, and "reward/<name>/<metric>" [B] for each extra entry of a function's dict.
    """

    def __init__(self, functions, weights, names):
        if not len(functions) == len(weights) == len(names):
            raise ValueError(f"{len(functions)} reward functions, {len(weights)} weights, {len(names)} names")
        self.functions, self.weights, self.names = list(functions), [float(w) for w in weights], list(names)

    def check_columns(self, names):
        """RewardError naming the first function that needs a column `names` lacks."""
        for function in self.functions:
            function.check_columns(names)

    def __call__(self, prompts, responses, columns=None):
        total = torch.zeros(len(responses), dtype=torch.float64)  # [B], summed in float64, rounded once
        metrics = {}
        for function, weight, name in zip(self.functions, self.weights, self.names):
            scores, extra = function.score(prompts, responses, columns)
            # r = sum_k w_k * r_k
            total += weight * torch.tensor(scores, dtype=torch.float64)
            metrics[f"reward/{name}"] = torch.tensor(scores, dtype=torch.float32)  # [B]
            for metric, values in extra.items():
                metrics[f"reward/{name}/{metric}"] = torch.tensor(values, dtype=torch.float32)  # [B]
        return total.float(), metrics


class RewardModelReward:
    """Scores from a *ForSequenceClassification checkpoint, as transformers computes them. It reads no columns."""

    def __init__(self, path, cfg, device, dtype, batch_size=16):
        from .model import load_reward_model
        from .tokenizer import load_tokenizer

        self.model = load_reward_model(path, dtype=dtype, device=device).eval().requires_grad_(False)
        self.tokenizer = load_tokenizer(path)
        self.cfg, self.device, self.batch_size = cfg, device, batch_size

    def render(self, prompt, response):
        if self.cfg.chat_template:
            chat = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
            return self.tokenizer.apply_chat_template(chat, tokenize=False, enable_thinking=self.cfg.enable_thinking)
        return prompt + response

    def check_columns(self, names):
        """Nothing to check: the reward model scores prompt + response only."""

    @torch.no_grad()
    def __call__(self, prompts, responses, columns=None):
        """-> (scores [B] float32 on the CPU, {}); `columns` is ignored."""
        encoded = [self.tokenizer.encode(self.render(p, r)) for p, r in zip(prompts, responses)]
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        scores = []
        for i in range(0, len(encoded), self.batch_size):
            chunk = encoded[i : i + self.batch_size]
            T = max(len(e) for e in chunk)
            ids = torch.tensor([e + [pad] * (T - len(e)) for e in chunk], device=self.device)  # [b, T] right-padded
            mask = torch.tensor([[1] * len(e) + [0] * (T - len(e)) for e in chunk], device=self.device)
            scores.append(self.model.score(ids, mask).float().cpu())  # [b]
        scores = torch.cat(scores)
        if not torch.isfinite(scores).all():
            i = int((~torch.isfinite(scores)).nonzero()[0])
            raise RewardError(f"reward model gave {scores[i].item()} for sample {i} (prompt {_clip(prompts[i])})")
        return scores, {}


def make_reward_source(cfg, device="cpu", dtype=None):
    """The run's reward source: the reward model (cfg.reward_model), else the reward functions (cfg.reward_fn, a list)
    weighted by cfg.reward_weights (empty = 1.0 each), else the built-in task's reward, as a WeightedReward of one;
    with cfg.reward_url, the reward servers at those URLs (ppo_core.remote_reward); with cfg.judge, a generative judge
    (ppo_core.judges)."""
    if cfg.reward_url:
        from .remote_reward import RemoteReward

        return RemoteReward(cfg.reward_url, cfg.reward_timeout_s, cfg.reward_retries)
    if cfg.judge:
        from .judges import JudgeReward

        return JudgeReward(cfg.judge, cfg.judge_mode, template=cfg.judge_template or None,
                           max_new_tokens=cfg.judge_max_new_tokens, unparsed_score=cfg.judge_unparsed_score,
                           reference_column=cfg.judge_reference_column, enable_thinking=cfg.judge_enable_thinking,
                           greedy=cfg.judge_temperature == 0, temperature=cfg.judge_temperature or 1.0,
                           batch_size=cfg.judge_batch_size, device=device, dtype=dtype, seed=cfg.seed,
                           score_range=cfg.judge_score_range or None)
    if cfg.reward_model:
        return RewardModelReward(cfg.reward_model, cfg, device, dtype)
    if isinstance(cfg.reward_fn, str):
        raise TypeError("cfg.reward_fn must be a list of 'module:function' specs (config.build_config makes one)")
    if cfg.reward_fn:
        functions = [CallableReward(import_callable(spec), spec) for spec in cfg.reward_fn]
        return WeightedReward(functions, list(cfg.reward_weights) or [1.0] * len(functions), metric_names(cfg.reward_fn))
    return WeightedReward([CallableReward(TASK_REWARDS[cfg.task], f"of task '{cfg.task}'")], [1.0], [cfg.task])

