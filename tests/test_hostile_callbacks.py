"""User callbacks that fail (issue 49, finding 6), run through ppo-train's own command path on the shipped demo
checkpoints: a reward function or an environment that calls sys.exit, raises KeyboardInterrupt itself, returns a
`meta` tensor, a reward of 1e39 (finite in float64, inf in float32), a non-number or a non-finite reward, a
non-string observation; each is one line naming it (file:function or the environment's spec, the sample or row, what
it returned), its traceback (or what it returned) in DIR/error.log, exit 2, and nothing already written lost. A real
SIGINT still stops the run as before. A 10^7-character observation is cut to max_observation_chars before the
tokenizer reads it, and counted (env/observations_truncated)."""
import json
import os
import signal
import threading
import time

import pytest

from ppo_core.rewards.interface import CallableReward, CallbackError, clip_text
from ppo_core.train import main

TINY = ["--iterations=2", "--save_every=1", "--eval_size=4", "--rollout_batch_size=4", "--minibatch_size=4",
        "--micro_batch_size=4", "--max_new_tokens=8", "--progress=false"]
# the tool demo plays a user's environment: a turn of at most 8 tokens, so every episode's first turn is stepped
TOOL_TINY = ["--task=toolmul", "--iterations=2", "--save_every=1", "--eval_size=4", "--rollout_batch_size=4",
             "--minibatch_size=4", "--micro_batch_size=4", "--max_new_tokens=32", "--max_turn_tokens=8",
             "--progress=false"]
F32 = "(|r| <= 3.403e+38)"


def one_line(capsys) -> str:
    """The run's one error line: stderr's last, after the run's first lines (policy, precision, loss paths)."""
    err = capsys.readouterr().err
    said = [line for line in err.splitlines() if line.startswith("ppo-train")]
    assert len(said) == 1 and err.endswith(said[0] + "\n") and "Traceback" not in err, err
    return said[0]


def line_of(path, text) -> int:
    """The 1-based line of `path` that holds `text`."""
    return next(n for n, line in enumerate(path.read_text().splitlines(), 1) if text in line)


def steps(run_dir):
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# ---------------------------------------------------------------------------------------------- reward functions

REWARDS = '''\
import json, os, signal, sys
import torch

SEEN, RUN = {seen!r}, {run!r}


def seen(prompts, responses):
    with open(SEEN, "w") as f:
        json.dump({{"prompts": prompts, "responses": responses}}, f)


def exits(prompts, responses):
    seen(prompts, responses)
    sys.exit(0)


def exits_with_text(prompts, responses):
    seen(prompts, responses)
    sys.exit("done")


def interrupts(prompts, responses):
    seen(prompts, responses)
    raise KeyboardInterrupt


def closes(prompts, responses):
    seen(prompts, responses)
    raise GeneratorExit


def meta(prompts, responses):
    seen(prompts, responses)
    return torch.zeros(len(responses), device="meta")


def meta_scalars(prompts, responses):
    seen(prompts, responses)
    return [torch.zeros((), device="meta") for _ in responses]


def huge(prompts, responses):
    seen(prompts, responses)
    return [1e39] * len(responses)


def huge_float64_tensor(prompts, responses):
    seen(prompts, responses)
    return torch.full((len(responses),), 1e39, dtype=torch.float64)


def big(prompts, responses):
    seen(prompts, responses)
    return [1e38] * len(responses)


def big_too(prompts, responses):
    return [1e38] * len(responses)


def exits_in_iteration_2(prompts, responses):
    if os.path.isdir(os.path.join(RUN, "checkpoints", "step-1")):
        with open(RUN + ".metrics-before", "w") as f:
            f.write(open(os.path.join(RUN, "metrics.jsonl")).read())
        seen(prompts, responses)
        sys.exit(0)  # iteration 2
    return [0.0] * len(responses)


def signals_once(prompts, responses):
    if not os.path.exists(SEEN):
        seen(prompts, responses)
        os.kill(os.getpid(), signal.SIGINT)  # a real SIGINT, inside the reward function
    return [0.0] * len(responses)
'''


@pytest.fixture
def rewards(tmp_path):
    """-> (the reward file, the run directory, a function that reads what the last call was given)."""
    run, path = tmp_path / "run", tmp_path / "my_rewards.py"
    path.write_text(REWARDS.format(seen=str(tmp_path / "seen.json"), run=str(run)))
    return path, run, lambda: json.loads((tmp_path / "seen.json").read_text())


def sample0(seen) -> str:
    return f"(prompt {clip_text(seen['prompts'][0])}, response {clip_text(seen['responses'][0])})"


@pytest.mark.parametrize("function, statement, did, last_line", [
    ("exits", "sys.exit(0)", "called sys.exit(0)", "SystemExit: 0"),
    ("exits_with_text", "sys.exit(\"done\")", "called sys.exit('done')", "SystemExit: done"),
    ("interrupts", "raise KeyboardInterrupt", "raised KeyboardInterrupt (no SIGINT was received)", "KeyboardInterrupt"),
    ("closes", "raise GeneratorExit", "raised GeneratorExit", "GeneratorExit"),
])
def test_a_reward_function_that_exits_is_one_line_exit_2_and_error_log(rewards, capsys, function, statement, did,
                                                                       last_line):
    """Before: sys.exit(0) ended ppo-train with exit 0 and no word (a scheduler records success); a KeyboardInterrupt
    of its own, a traceback."""
    path, run, seen = rewards
    assert main([*TINY, f"--reward_fn={path}:{function}", f"--out={run}"]) == 2
    line = (f"ppo-train: error: reward function {path}:{function} {did} on sample 0 {sample0(seen())}; raised at "
            f"{path}:{line_of(path, statement)} in {function}")
    assert one_line(capsys) == f"{line}; full traceback in {run / 'error.log'}"
    log = (run / "error.log").read_text()
    assert f"\n{line}\n\nTraceback (most recent call last):\n" in log and log.endswith(f"\n{last_line}\n\n"), log
    assert not (run / "checkpoints").exists() and (run / "metrics.jsonl").read_text() == ""


def test_a_reward_function_that_exits_in_iteration_2_keeps_iteration_1(rewards, capsys):
    """The failure in iteration 2's rollout: iteration 1's metrics line and checkpoint are as they were, and a resume
    with the function mended finishes the run."""
    path, run, seen = rewards
    args = [*TINY, f"--reward_fn={path}:exits_in_iteration_2", "--eval_reward_fn=ppo_core.data.tasks:reverse_rewards",
            f"--out={run}"]
    assert main(args) == 2
    assert one_line(capsys) == (
        f"ppo-train: error: reward function {path}:exits_in_iteration_2 called sys.exit(0) on sample 0 "
        f"{sample0(seen())}; raised at {path}:{line_of(path, '# iteration 2')} in exits_in_iteration_2; "
        f"full traceback in {run / 'error.log'}")
    before = (run.parent / "run.metrics-before").read_text()
    assert (run / "metrics.jsonl").read_text() == before and steps(run) == [1]
    assert (run / "checkpoints" / "step-1" / "manifest.json").is_file()
    path.write_text(path.read_text().replace("sys.exit(0)  # iteration 2", "pass"))  # mended
    assert main(["--resume", str(run)]) == 0
    assert steps(run) == [1, 2] and (run / "metrics.jsonl").read_text().startswith(before)


@pytest.mark.parametrize("function, returned", [
    ("meta", "Tensor of shape (4,) and dtype torch.float32 on device 'meta': a meta tensor holds no values; return "
             "numbers (a list, or a tensor on the CPU)"),
    ("meta_scalars", "Tensor of shape () and dtype torch.float32 on device 'meta' for sample 0 {sample}: a meta "
                     "tensor holds no value; expected an int or float"),
    ("huge", "1e+39 for sample 0 {sample}: beyond float32's range, where it is inf " + F32),
    ("huge_float64_tensor", "1e+39 for sample 0 {sample}: beyond float32's range, where it is inf " + F32),
])
def test_a_reward_that_is_not_a_float32_number_on_the_cpu_is_one_line(rewards, capsys, function, returned):
    """Before: a meta tensor gave a NotImplementedError traceback; 1e39 passed the check, became inf in float32, and
    the run ended in "3 consecutive updates had a non-finite loss" without naming the reward."""
    path, run, seen = rewards
    assert main([*TINY, f"--reward_fn={path}:{function}", f"--out={run}"]) == 2
    line = f"ppo-train: error: reward function {path}:{function} returned {returned.format(sample=sample0(seen()))}"
    assert one_line(capsys) == f"{line}; full traceback in {run / 'error.log'}"
    log = (run / "error.log").read_text()
    assert f"\n{line}\n\nwhat it returned, " in log and "checked at (most recent call last):" in log, log


def test_weights_that_carry_the_sum_past_float32_are_one_line(rewards, capsys):
    """Each score is within float32's range; 3 * 1e38 + 1e38 is not."""
    path, run, seen = rewards
    assert main([*TINY, f"--reward_fn={path}:big,{path}:big_too", "--reward_weights=3,1", f"--out={run}"]) == 2
    assert one_line(capsys) == (
        f"ppo-train: error: reward_weights: the weighted reward of sample 0 {sample0(seen())} is 3 * 1e+38 + 1 * "
        f"1e+38 = 4e+38, beyond float32's range {F32}; full traceback in {run / 'error.log'}")


def test_a_real_sigint_in_a_reward_function_still_stops_the_run_with_a_checkpoint(rewards, capsys):
    """SIGINT arriving while the reward function runs (iteration 1's rollout) reaches runlog.StopSignals as before:
    the iteration finishes, a checkpoint is saved, exit 143."""
    path, run, _ = rewards
    args = [*TINY, f"--reward_fn={path}:signals_once", "--eval_reward_fn=ppo_core.data.tasks:reverse_rewards",
            f"--out={run}"]
    assert main(args) == 143
    err = capsys.readouterr().err
    assert err.endswith(f"ppo-train: received SIGINT; saved checkpoint at iteration 1 of 2 in {run}; continue with: "
                        f"ppo-train --resume {run}\n"), err
    assert steps(run) == [1] and not (run / "error.log").exists()


def test_a_real_sigint_passes_a_raised_keyboardinterrupt_does_not():
    """Outside the loop's StopSignals (the evaluation before training), Python's own handler turns a real SIGINT
    into KeyboardInterrupt: it leaves the reward function as it is. One the function raises itself is its failure,
    on the main thread and on another (where no KeyboardInterrupt is a signal's)."""
    def signalled(prompts, responses):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)  # the handler runs at the next bytecode; never reached
        return [0.0] * len(responses)

    def raised(prompts, responses):
        raise KeyboardInterrupt

    # Python's handler, as in a terminal (a process started in the background may begin with SIGINT ignored)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        t0 = time.perf_counter()
        with pytest.raises(KeyboardInterrupt):
            CallableReward(signalled, "signalled").score(["p"], ["r"])
        assert time.perf_counter() - t0 < 1 and signal.getsignal(signal.SIGINT) is signal.default_int_handler
        with pytest.raises(CallbackError, match=r"^reward function own raised KeyboardInterrupt \(no SIGINT was "):
            CallableReward(raised, "own").score(["p"], ["r"])
        failed = []
        thread = threading.Thread(target=lambda: failed.append(
            pytest.raises(CallbackError, CallableReward(raised, "t").score, ["p"], ["r"])))
        thread.start(), thread.join()
        assert str(failed[0].value).startswith("reward function t raised KeyboardInterrupt (no SIGINT was received)")
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)

# ---------------------------------------------------------------------------------------------------- environments

ENVIRONMENTS = '''\
import os, sys

from ppo_core.agents.tools import run_tool_calls

SEEN, RUN = {seen!r}, {run!r}


class Env:
    max_turns = 2

    def reset(self, row):
        self.row = row
        return [{{"role": "user", "content": row["prompt"]}}]

    def step(self, text):
        with open(SEEN, "a") as f:
            f.write(self.row["prompt"] + "\\n")
        return self.answer(text)


class StepRaises(Env):
    def answer(self, text):
        raise ValueError("boom")


class StepExits(Env):
    def answer(self, text):
        sys.exit(0)


class RewardText(Env):
    def answer(self, text):
        return None, "1.0", True


class RewardNaN(Env):
    def answer(self, text):
        return None, float("nan"), True


class RewardInf(Env):
    def answer(self, text):
        return None, float("-inf"), True


class RewardHuge(Env):
    def answer(self, text):
        return None, 1e39, True


class ContentInt(Env):
    def answer(self, text):
        return [{{"role": "tool", "content": 42}}], 0.0, False


class ObservationText(Env):
    def answer(self, text):
        return "the result is 42", 0.0, False


class Pair(Env):
    def answer(self, text):
        return None, 1.0


class Quit:
    name, description, parameters = "quit", "ends everything", {{"type": "object", "properties": {{}}}}

    def __call__(self, arguments):
        sys.exit(3)


class ToolExits(Env):
    def answer(self, text):
        observations, _ = run_tool_calls('<tool_call>{{"name": "quit", "arguments": {{}}}}</tool_call>',
                                         {{"quit": Quit()}})
        return [{{"role": "tool", "content": o}} for o in observations], 0.0, False


class ResetRaises(Env):
    def reset(self, row):
        with open(SEEN, "a") as f:
            f.write(row["prompt"] + "\\n")
        raise KeyError("prompt")


class Echo(Env):
    """An observation of 10^7 characters, then done."""

    def answer(self, text):
        if getattr(self, "echoed", False):
            return None, 1.0, True
        self.echoed = True
        return [{{"role": "tool", "content": "x" * 10**7}}], 0.0, False


class RaisesInIteration2(Env):
    def answer(self, text):
        if os.path.isdir(os.path.join(RUN, "checkpoints", "step-1")):
            with open(RUN + ".metrics-before", "w") as f:
                f.write(open(os.path.join(RUN, "metrics.jsonl")).read())
            raise RuntimeError("late")
        return None, 0.5, True
'''


@pytest.fixture
def environments(tmp_path):
    """-> (the environment file, the run directory, a function: the prompts of the rows whose step (or reset) ran)."""
    run, path = tmp_path / "run", tmp_path / "my_env.py"
    path.write_text(ENVIRONMENTS.format(seen=str(tmp_path / "seen.txt"), run=str(run)))
    return path, run, lambda: set((tmp_path / "seen.txt").read_text().splitlines())


FORM = 'expected a list of messages {"role": str, "content": str}'


@pytest.mark.parametrize("env, what, at", [
    ("StepRaises", "step raised ValueError: boom in turn 1 of row {row}", 'raise ValueError("boom")'),
    ("StepExits", "step called sys.exit(0) in turn 1 of row {row}", "sys.exit(0)"),
    ("ResetRaises", "reset raised KeyError: 'prompt' for row {row}", 'raise KeyError("prompt")'),
    ("ToolExits", None, "sys.exit(3)"),
    ("RewardText", "step returned reward str '1.0' in turn 1 of row {row}: expected an int or float", None),
    ("RewardNaN", "step returned reward nan in turn 1 of row {row}: expected a finite number", None),
    ("RewardInf", "step returned reward -inf in turn 1 of row {row}: expected a finite number", None),
    ("RewardHuge", "step returned reward 1e+39 in turn 1 of row {row}: beyond float32's range, where it is inf " + F32,
     None),
    ("ContentInt", "step returned observation message 0 with content int 42 in turn 1 of row {row}: " + FORM, None),
    ("ObservationText", "step returned observation str 'the result is 42' in turn 1 of row {row}: " + FORM, None),
    ("Pair", "step returned tuple (None, 1.0) in turn 1 of row {row}: expected (observation messages or None, reward, "
             "done)", None),
])
def test_an_environment_that_fails_is_one_line_exit_2_and_error_log(environments, capsys, env, what, at):
    """Before: a traceback (from the rollout's thread pool), no error.log; a NaN or inf reward was not checked."""
    path, run, seen = environments
    spec = f"{path}:{env}"
    assert main([*TOOL_TINY, f"--environment={spec}", f"--out={run}"]) == 2
    got = one_line(capsys)
    assert got.endswith(f"; full traceback in {run / 'error.log'}"), got
    line = got.removesuffix(f"; full traceback in {run / 'error.log'}")
    if env == "ToolExits":  # the tool is named, not the environment that ran it
        lines = {f"ppo-train: error: tool 'quit' (my_env:Quit) called sys.exit(3) on arguments {{}}; raised at "
                 f"{path}:{line_of(path, at)} in __call__"}
    else:
        function = "reset" if env == "ResetRaises" else "answer"
        raised = f"; raised at {path}:{line_of(path, at)} in {function}" if at else ""
        # the episodes are stepped in a thread pool: the first to fail is one of the rows played
        lines = {f"ppo-train: error: environment {spec}: {what.replace('{row}', f'(prompt {clip_text(p)})')}{raised}"
                 for p in seen()}
    assert line in lines, (got, lines)
    log = (run / "error.log").read_text()
    assert f"\n{line}\n\n" in log
    assert ("Traceback (most recent call last):" if at else "checked at (most recent call last):") in log, log
    assert not (run / "checkpoints").exists()


def test_an_environment_that_raises_in_iteration_2_keeps_iteration_1(environments, capsys):
    path, run, seen = environments
    spec = f"{path}:RaisesInIteration2"
    assert main([*TOOL_TINY, f"--environment={spec}", f"--out={run}"]) == 2
    got = one_line(capsys)
    assert got.startswith(f"ppo-train: error: environment {spec}: step raised RuntimeError: late in turn 1 of row "
                          f"(prompt "), got
    assert got.endswith(f"; raised at {path}:{line_of(path, 'late')} in answer; full traceback in {run}/error.log")
    before = (run.parent / "run.metrics-before").read_text()
    assert (run / "metrics.jsonl").read_text() == before and steps(run) == [1]
    assert (run / "checkpoints" / "step-1" / "manifest.json").is_file()


@pytest.mark.parametrize("cap", [None, 16])
def test_a_10_million_character_observation_is_cut_before_the_tokenizer_and_counted(environments, cap):
    """Before: the 10^7 characters were rendered and tokenized (11 GB, still running after 300 s). Now the default
    max_observation_chars (65536) or a smaller one cuts the content first; each episode's one observation counts."""
    path, run, _ = environments
    t0 = time.perf_counter()
    args = [*TOOL_TINY, f"--environment={path}:Echo", "--log_samples_every=1", f"--out={run}"]
    assert main(args + ([f"--max_observation_chars={cap}"] if cap else [])) == 0
    assert time.perf_counter() - t0 < 120
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["env/observations_truncated"] for m in metrics] == [1.0, 1.0]
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    for sample in samples:
        conversation = json.loads(sample["conversation"])
        assert conversation[2] == {"role": "tool", "content": "x" * (cap or 65536)}, conversation[2]["content"][:40]
