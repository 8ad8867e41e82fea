"""Python reward functions as a reward source (config `reward_fn`, or the built-in task's reward).

WeightedReward: one or more Python reward functions, each wrapped in a CallableReward (ppo_core.rewards: the columns
it takes, the checks on what it returns), added up with the weights `reward_weights`: score = sum_k w_k * r_k. Its
metrics are "reward/<name>", each function's own (unweighted) scores, and "reward/<name>/<metric>" for the extra
entries of a function's dict, with one function as with several, so a run's keys do not depend on how many there
are. <name> is the function's name ('my_rewards.py:score' -> "score"; the task's reward: the task's name), prefixed by
its module where two functions share a name ("a.score", "b.score").
"""
import importlib
import importlib.util
import os
import traceback

import torch

from .interface import FLOAT32_MAX, RewardError, clip_text, returned_wrong
from ..data.tasks import arith_rewards, reverse_rewards

TASK_REWARDS = {"reverse": reverse_rewards, "arith": arith_rewards}


# Modules that moved into subpackages (issue 39): a spec naming the old module, 'ppo_core.<old>:function' in a config
# written before the move, still loads, from the module's new place. No module is left at the old path.
MOVED_MODULES = {
    "model": "models.model", "tokenizer": "models.tokenizer", "chat_template": "models.chat_template",
    "lora": "models.lora", "engine": "engine.rollout_engine", "scheduler": "engine.scheduler",
    "kv_blocks": "engine.kv_blocks", "static_decode": "engine.static_decode", "generate": "engine.generate",
    "rewards": "rewards.interface", "reward_source": "rewards.source", "reward_functions": "rewards.functions",
    "reward_model": "rewards.reward_model", "judges": "rewards.judges", "remote_reward": "rewards.remote",
    "reward_server": "rewards.server", "verifiers": "rewards.verifiers", "code_reward": "rewards.code_tests",
    "environments": "agents.environments", "tools": "agents.tools", "sandbox": "rewards.sandbox",
    "prompts": "data.prompts", "tasks": "data.tasks", "packing": "data.packing", "distributed": "models.distributed",
    "rollout_worker": "run.rollout_worker", "checkpoint": "run.checkpoint", "runlog": "run.runlog",
    "tracking": "run.tracking", "plan": "run.plan", "precision": "models.precision",
    # and out of run/ and agents/ so that subpackages import one way (issue 52)
    "run.distributed": "models.distributed", "run.precision": "models.precision", "run.redact": "rewards.redact",
    "agents.sandbox": "rewards.sandbox",
}


def current_module(module_name: str) -> str:
    """A module's name today: 'ppo_core.verifiers' -> 'ppo_core.rewards.verifiers' (MOVED_MODULES); any other name
    as it is."""
    moved = MOVED_MODULES.get(module_name.removeprefix("ppo_core.")) if module_name.startswith("ppo_core.") else None
    return f"ppo_core.{moved}" if moved else module_name


def current_spec(spec: str) -> str:
    """'ppo_core.verifiers:f' -> 'ppo_core.rewards.verifiers:f' (current_module); any other spec as it is."""
    module, sep, attr = spec.rpartition(":")
    return f"{current_module(module)}{sep}{attr}" if module else spec


SPEC_KEYS = ("reward_fn", "eval_reward_fn", "environment")  # the config keys that may name 'module:callable'


def specs_as_today(config: dict) -> dict:
    """A saved config (a dict) with every 'module:callable' spec (SPEC_KEYS) naming its module where it is now, so
    that a config written before the subpackages move equals today's (a resume, compare.py's --from_runs)."""
    out = dict(config)
    for key in SPEC_KEYS:
        if isinstance(out.get(key), list):
            out[key] = [current_spec(spec) for spec in out[key]]
        elif isinstance(out.get(key), str):
            out[key] = current_spec(out[key])
    return out


def import_callable(spec: str, key: str = "reward_fn"):
    """'package.module:function' -> the function (the module may also be a path to a .py file); `key` is the config
    key the spec came from, for the message. A spec naming a ppo_core module by its place before the move into
    subpackages (a config written before it) loads the module from its new place (MOVED_MODULES).

    A user's file that does not import (a SyntaxError, an ImportError, any exception its top level raises) or lacks
    the name is a RewardError of one line naming the spec and the error, with `raised_at` ("FILE:LINE", where the file
    failed) and `traceback` (the full one), which ppo-train adds to its line and writes to DIR/error.log
    (ppo_core.run.runlog.log_error), as for a reward function that raises while scoring."""
    module_name, _, attr = spec.rpartition(":")
    try:
        if module_name.endswith(".py"):
            loader_spec = importlib.util.spec_from_file_location(os.path.basename(module_name)[:-3], module_name)
            if loader_spec is None or not os.path.isfile(module_name):
                raise RewardError(f"cannot load {key} '{spec}': no file {module_name}")
            module = importlib.util.module_from_spec(loader_spec)
            loader_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(current_module(module_name))
    except RewardError:
        raise
    except (Exception, SystemExit) as e:  # whatever the file's top level raises (SystemExit: a script's sys.exit())
        what = f"{type(e).__name__}: {e.msg if isinstance(e, SyntaxError) else e}"
        error = RewardError(f"cannot load {key} '{spec}': {what}")
        error.raised_at, error.traceback = _import_failed_at(e), "".join(traceback.format_exception(e))
        raise error from None
    fn = getattr(module, attr, None)
    if fn is None:
        defined = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise RewardError(f"cannot load {key} '{spec}': {getattr(module, '__file__', module_name)} has no '{attr}' "
                          f"(it defines: {', '.join(defined) or 'nothing callable'})")
    if not callable(fn):
        raise RewardError(f"{key} '{spec}' is not callable")
    return fn


def _import_failed_at(error: BaseException):
    """"FILE:LINE" where an import failed: a SyntaxError's own position, else the innermost frame outside Python's
    import machinery (the user's file, or a library it imported); None when there is none."""
    if isinstance(error, SyntaxError) and error.filename:
        return f"{error.filename}:{error.lineno}"
    frames = [f for f in traceback.extract_tb(error.__traceback__)
              if not f.filename.startswith(("<frozen", os.path.dirname(importlib.__file__))) and f.filename != __file__]
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else None


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
        outside = (~torch.isfinite(total) | (total.abs() > FLOAT32_MAX)).nonzero()
        if len(outside):  # each score is within float32's range, but large weights can carry their sum past it
            i = int(outside[0])
            scores = {name: float(metrics[f"reward/{name}"][i]) for name in self.names}
            terms = " + ".join(f"{w:g} * {scores[n]:g}" for w, n in zip(self.weights, self.names))
            raise returned_wrong(f"reward_weights: the weighted reward of sample {i} (prompt {clip_text(prompts[i])}, "
                                 f"response {clip_text(responses[i])}) is {terms} = {float(total[i]):g}, beyond "
                                 f"float32's range (|r| <= {FLOAT32_MAX:.4g})", scores)
        return total.float(), metrics
