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
entries are logged. Each element is checked: a number (not a bool, a str, a dict, None or a list), finite and within
float32's range (|r| <= 3.4e38: the loop holds rewards in float32, where 1e39 is inf), one per response; a tensor's
values are read on the CPU (a `meta` tensor, which holds none, is named). Anything else is a RewardError of one line
naming the function, the sample, its prompt and response and what was returned; so is a function that raises (or calls
sys.exit: UserCode), naming the first sample it raises on alone. That error also carries where the function raised,
`error.raised_at` ("FILE:LINE in FUNCTION", the innermost frame in the function's own file), and the full traceback,
`error.traceback`: ppo-train adds the first to its error line and appends the second to the run directory's error.log
(ppo_core.run.runlog.log_error).

UserCode is the one wrapper around every call into a user's code (reward functions here; environments and tools,
ppo_core.agents): whatever the code raises, SystemExit included, is a CallbackError of one line naming it.
"""
import inspect
import math
import os
import reprlib
import signal
import threading
import traceback
from collections.abc import Mapping

import numpy as np
import torch


class RewardError(RuntimeError):
    """The reward function failed or returned something that is not one finite score per response. When the function
    raised: `raised_at`, "FILE:LINE in FUNCTION" in the function's own file (None when no frame is there), and
    `traceback`, the full traceback (a str); both None otherwise."""

    raised_at = traceback = None


class CallbackError(RewardError):
    """A user's callback (a reward function, an environment, a tool) raised, exited, or returned what it must not:
    one line naming it ('module:function' or the environment's spec) and what it was given."""


# ------------------------------------------------------------------------------------------------ a user's code

FLOAT32_MAX = float(np.finfo(np.float32).max)  # 3.4028235e38: a reward beyond it is inf once the loop holds it


class UserCode:
    """`with UserCode(describe, code):` around a call into a user's code (`code`: the function, class or object, whose
    file `raised_at` looks for). What the call raises as its own failure leaves the block as one CallbackError,
    describe(exception) its line (failure(exception) says what happened), with raised_at and the traceback: any
    Exception, and what `except Exception` lets by: SystemExit (a sys.exit() would end ppo-train with the code's
    status, 0 being success to a scheduler, and no line), GeneratorExit, and a KeyboardInterrupt no SIGINT sent.

    Passed on as they are: a CallbackError (a tool's, inside an environment's step), the KeyboardInterrupt of a real
    SIGINT, and every other BaseException, which the program raises to stop the work in flight
    (ppo_core.run.runlog.IterationAbandoned). A real SIGINT is told from `raise KeyboardInterrupt` by a handler put in
    front of the current one for the block, on the main thread (the only one Python runs handlers on; elsewhere no
    KeyboardInterrupt is a signal's): it notes the signal, then calls the handler it stands in front of (Python's,
    which raises KeyboardInterrupt; runlog.StopSignals', which asks the loop to stop)."""

    def __init__(self, describe, code=None):
        self.describe, self.code = describe, code
        self.signalled, self.previous = False, None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            previous = signal.getsignal(signal.SIGINT)
            if callable(previous):  # SIG_IGN / SIG_DFL: no SIGINT becomes a KeyboardInterrupt
                self.previous = previous
                signal.signal(signal.SIGINT, self._noted)
        return self

    def _noted(self, signum, frame):
        self.signalled = True
        self.previous(signum, frame)

    def __exit__(self, kind, exception, tb):
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)
        if exception is None or isinstance(exception, CallbackError):
            return False
        if isinstance(exception, KeyboardInterrupt) and self.signalled:
            return False
        if not isinstance(exception, (Exception, SystemExit, GeneratorExit, KeyboardInterrupt)):
            return False
        error = CallbackError(self.describe(exception))
        error.raised_at = raised_at(self.code, exception)
        error.traceback = "".join(traceback.format_exception(exception))
        raise error from None


def returned_wrong(line, value) -> CallbackError:
    """A CallbackError for a user's code that returned `value`, wrong as `line` says; its `traceback`, for
    DIR/error.log: the value (its repr, cut at 10,000 characters) and where the loop called the code."""
    error = CallbackError(line)
    error.traceback = (f"what it returned, {type(value).__name__}:\n{_long_repr.repr(value)}\n\n"
                       f"checked at (most recent call last):\n{''.join(traceback.format_stack()[:-2])}")
    return error


def failure(exception: BaseException) -> str:
    """What a user's code did, for a line: 'raised ValueError: boom', 'called sys.exit(0)', 'raised KeyboardInterrupt
    (no SIGINT was received)'."""
    if isinstance(exception, SystemExit):
        return f"called sys.exit({exception.code!r})"
    message = " ".join(str(exception).split())[:200]
    if isinstance(exception, KeyboardInterrupt):
        return f"raised KeyboardInterrupt{': ' + message if message else ''} (no SIGINT was received)"
    return f"raised {type(exception).__name__}: {message}" if message else f"raised {type(exception).__name__}"


def raised_at(code, exception):
    """"FILE:LINE in FUNCTION" of the innermost frame of the exception's traceback in the file `code` (a function, a
    class, or an instance of one) is defined in: the line that raised, in the code or a helper of that file, or the
    line of that file that called the library that raised. None when no frame is in that file (a builtin, say)."""
    code = code if inspect.isroutine(code) or inspect.isclass(code) else type(code)
    if inspect.isclass(code):  # where its methods are written: a class from a file.py has no module in sys.modules
        own_file = next((v.__code__.co_filename for v in vars(code).values() if inspect.isfunction(v)), None)
    else:
        try:
            own_file = inspect.getsourcefile(code)
        except TypeError:  # a builtin
            return None
    frames = [f for f in traceback.extract_tb(exception.__traceback__)
              if own_file and os.path.abspath(f.filename) == os.path.abspath(own_file)]
    return f"{frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}" if frames else None


# ---------------------------------------------------------------------------------------------------- the checks

_repr = reprlib.Repr()
_repr.maxstring, _repr.maxother, _repr.maxlist, _repr.maxtuple, _repr.maxdict = 40, 60, 6, 6, 4
_long_repr = reprlib.Repr()  # for error.log: a value whole, up to about 10,000 characters
_long_repr.maxstring, _long_repr.maxother, _long_repr.maxlist, _long_repr.maxtuple, _long_repr.maxdict = (
    10_000, 10_000, 1000, 1000, 1000)


def shown(value) -> str:
    """What was returned, for a message: its type and a short repr on one line ('str '0.5'', 'None')."""
    if value is None:
        return "None"
    if isinstance(value, (np.ndarray, torch.Tensor)):
        on_cpu = not isinstance(value, torch.Tensor) or value.device.type == "cpu"
        device = "" if on_cpu else f" on device '{value.device}'"
        return f"{type(value).__name__} of shape {tuple(value.shape)} and dtype {value.dtype}{device}"
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
        return None if x.is_meta else float(x.item())  # .item(): from any device to the CPU; a meta tensor holds none
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
        with UserCode(lambda e: f"reward function {self.name} {failure(e)} {self._locate(prompts, responses, kwargs)}",
                      self.fn):
            result = self.fn(prompts, responses, **kwargs)
        if isinstance(result, Mapping):
            if "rewards" not in result or not all(isinstance(key, str) for key in result):
                raise self._wrong(f"reward function {self.name} returned a dict with keys {_repr.repr(list(result))}: "
                                  f"a dict must be {DICT_FORM}", result)
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
        if isinstance(values, torch.Tensor) and values.is_meta:
            raise self._wrong(f"reward function {self.name} returned {shown(values)}{where}: a meta tensor holds no "
                              f"values; return numbers (a list, or a tensor on the CPU)", values)
        if isinstance(values, (np.ndarray, torch.Tensor)) and values.ndim == 1:
            values = values.detach().cpu().tolist() if isinstance(values, torch.Tensor) else values.tolist()
        elif not isinstance(values, (list, tuple)):
            if entry is None:
                raise self._wrong(f"reward function {self.name} must return a list of numbers, one for each of the "
                                  f"{B} responses, or a dict {DICT_FORM}; got {shown(values)}", values)
            raise self._wrong(f"reward function {self.name} returned {shown(values)}{where}: expected a list of "
                              f"numbers, one for each of the {B} responses", values)
        if len(values) != B:
            missing = f": none for sample {len(values)} {_sample(len(values), prompts, responses)}" if len(values) < B else ""
            what = "scores" if entry in (None, "rewards") else "values"
            raise self._wrong(f"reward function {self.name} returned {len(values)} {what}{where} for {B} responses"
                              f"{missing}", values)
        checked = []
        for i, value in enumerate(values):
            number = as_number(value)
            if number is None:
                meta = isinstance(value, torch.Tensor) and value.is_meta
                raise self._wrong(f"reward function {self.name} returned {shown(value)}{where} for sample {i} "
                                  f"{_sample(i, prompts, responses)}: "
                                  f"{'a meta tensor holds no value; expected' if meta else 'expected'} an int or float",
                                  values)
            if not math.isfinite(number):
                raise self._wrong(f"reward function {self.name} returned {_repr.repr(value)}{where} for sample {i} "
                                  f"{_sample(i, prompts, responses)}: expected a finite number", values)
            if abs(number) > FLOAT32_MAX:  # finite in float64, inf in the float32 the loop holds rewards in
                raise self._wrong(f"reward function {self.name} returned {_repr.repr(value)}{where} for sample {i} "
                                  f"{_sample(i, prompts, responses)}: beyond float32's range, where it is inf "
                                  f"(|r| <= {FLOAT32_MAX:.4g})", values)
            checked.append(number)
        return checked

    def _wrong(self, line, value) -> RewardError:
        """The error for a function that returned `value`, wrong as `line` says: a CallbackError whose traceback (for
        DIR/error.log) is what it returned and where it was called (returned_wrong); a RewardError of the line alone
        for an answer no function of the user's returned (ppo_core.rewards.remote checks a server's with fn None)."""
        return returned_wrong(line, value) if self.fn is not None else RewardError(line)

    def _locate(self, prompts, responses, kwargs):
        """Find the first sample on which the function raises by itself, to name it in the error."""
        for i in range(len(prompts)):
            try:
                with UserCode(lambda e: "", self.fn):
                    self.fn([prompts[i]], [responses[i]], **{key: [values[i]] for key, values in kwargs.items()})
            except CallbackError:
                return f"on sample {i} {_sample(i, prompts, responses)}"
        return f"on a batch of {len(prompts)} samples"


def _sample(i, prompts, responses) -> str:
    return f"(prompt {clip_text(prompts[i])}, response {clip_text(responses[i])})"
