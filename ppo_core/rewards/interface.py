"""The reward-source interface, and the checks on what a reward function returns.

Every reward source is called the same way:

    scores, metrics = source(prompts, responses, columns=None)
        prompts, responses: list[str], B of each. A prompt is the RAW prompt text (for a chat row, the content of its
                            last user turn), never the chat-rendered text.
        columns:            {column name: list of B values}, the prompt rows' extra columns (e.g. "answer"), or None
        scores:             [B] float32 on the CPU
        metrics:            {name: [B] float32}, per-sample values the loop logs as batch means

and has check_columns(names), a RewardError when it needs a prompt column that `names` lacks. The sources, each in
its own file: reward functions (ppo_core.rewards.functions), a reward model checkpoint (ppo_core.rewards.reward_model), a
generative judge (ppo_core.rewards.judges), reward servers over HTTP (ppo_core.rewards.remote). Which one a run uses is
chosen from its config by ppo_core.rewards.source.make_reward_source, above them all.

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
run directory's error.log (ppo_core.run.runlog.log_error).
"""
import inspect
import math
import os
import reprlib
import traceback
from collections.abc import Mapping

import numpy as np
import torch


class RewardError(RuntimeError):
    """The reward function failed or returned something that is not one finite score per response. When the function
    raised: `raised_at`, "FILE:LINE in FUNCTION" in the function's own file (None when no frame is there), and
    `traceback`, the full traceback (a str); both None otherwise."""

    raised_at = traceback = None


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


def clip_text(text: str, n: int = 80) -> str:
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
    return f"(prompt {clip_text(prompts[i])}, response {clip_text(responses[i])})"
