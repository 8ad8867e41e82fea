"""A code reward: the response's code run against the prompt row's tests in the sandbox, scored as the fraction passed.

    ppo-train --prompts_file coding.jsonl --reward_fn ppo_core.rewards.code_tests:code_tests
    # coding.jsonl: {"prompt": "Write add(a, b).", "tests": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"]}

The response's code is its last ```python (or ```py, or bare ```) fenced block, else the whole response. The row's
`tests` column is a string of test code (one test) or a list of such strings (one test each; a string holding a JSON
array of strings counts as that list). Each test is one sandbox run (ppo_core.rewards.sandbox.run_code: no network, none of
the trainer's environment variables, rlimits, a wall-clock timeout): the code is written to `solution.py`, and the
program run is

    import sys
    sys.path.insert(0, '.')
    from solution import *
    <the test>
    print("<a random token>")

so the solution's `if __name__ == "__main__":` block (often a demo reading input()) does not run, and the test sees
the solution's names as MBPP-style asserts expect. A test passes when the run exits 0, did not time out, and its
output ends with the token: without that last condition a solution that calls `sys.exit(0)` or `os._exit(0)` when
imported would pass every test, a shortcut RL finds. (This closes the shortcut a policy stumbles on, not a determined
attack: a solution may still read main.py to learn the token, or rebind builtins the test uses.) A solution that
prints more than the sandbox keeps (64 KiB) loses the token with the rest, and fails.

The reward is passed / tests, in [0, 1]. Metrics, per response (logged as reward/code_tests/<metric> means):
tests_passed, tests_timed_out, no_code_block (1 when the whole response was run), sandbox_s (wall seconds of its runs).
Other limits: CodeTests(timeout_s=..., memory_mb=..., max_workers=...) in a reward file of your own,

    from ppo_core.rewards.code_tests import CodeTests
    code_tests_strict = CodeTests(timeout_s=1.0)       # --reward_fn my_rewards.py:code_tests_strict
"""
import json
import os
import re
import secrets

# Imported by the package's absolute name, so that this file also loads by its path
# (--reward_fn=ppo_core/rewards/code_tests.py:code_tests), where a relative import has no package to be relative to.
from ppo_core.rewards.sandbox import SETUP_FAILED, SandboxPool

# ``` then an optional python / python3 / py tag, the rest of the fence line blank, the code, the closing ```
_FENCED = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def extract_code(response: str) -> tuple[str, bool]:
    """-> (the code, whether it came from a fenced block): the last ```python / ```py / bare ``` block's contents,
    or the whole response when it has none (a fence left open by a response cut at its length limit is not a block)."""
    blocks = _FENCED.findall(response)
    return (blocks[-1], True) if blocks else (response, False)


def split_tests(tests) -> list[str]:
    """A row's `tests` value -> the list of test strings. ValueError for anything else, and for no tests at all: a
    fraction of zero tests is not a score, and a row without tests is a mistake in the data."""
    if isinstance(tests, str):
        try:
            decoded = json.loads(tests)
        except json.JSONDecodeError:
            decoded = None
        # '["assert f(1) == 1"]' would otherwise run as a Python list literal, which passes
        tests = decoded if isinstance(decoded, list) else [tests]
    if not isinstance(tests, (list, tuple)) or not all(isinstance(test, str) for test in tests):
        raise ValueError(f"column 'tests' must be a string of test code or a list of them, got {tests!r:.100}")
    if not tests:
        raise ValueError("column 'tests' holds no tests")
    return list(tests)


class CodeTests:
    """The reward function: __call__(prompts, responses, tests) -> {"rewards": fractions passed, <metrics>}.

    timeout_s, memory_mb: each run's sandbox limits. max_workers: how many sandboxes run at once (default: the
    CPU count); the pool is made at the first call, so importing this module starts nothing.
    """

    def __init__(self, timeout_s: float = 5.0, memory_mb: int = 512, max_workers: int | None = None):
        self.timeout_s, self.memory_mb = timeout_s, memory_mb
        self.max_workers = max_workers or os.cpu_count() or 1
        self.pool = None

    def __call__(self, prompts, responses, tests):
        if self.pool is None:
            self.pool = SandboxPool(self.max_workers)
        tests = [split_tests(row_tests) for row_tests in tests]  # every row checked before anything runs
        # Every (response, test) run is submitted before any is waited for: they run max_workers at a time.
        runs, no_code_block = [], []
        for response, row_tests in zip(responses, tests):
            code, fenced = extract_code(response)
            no_code_block.append(float(not fenced))
            runs.append([self._submit(code, test) for test in row_tests])
        rewards, passed, timed_out, sandbox_s = [], [], [], []
        for row_runs in runs:
            results = [(future.result(), token) for future, token in row_runs]
            for result, _ in results:
                if result.error and result.error.startswith(SETUP_FAILED):  # a broken sandbox is not a score of 0
                    raise RuntimeError(f"the sandbox could not start: {result.error}")
            row_passed = sum(result.exit_code == 0 and not result.timed_out and result.stdout.rstrip().endswith(token)
                             for result, token in results)
            rewards.append(row_passed / len(results))
            passed.append(float(row_passed))
            timed_out.append(float(sum(result.timed_out for result, _ in results)))
            sandbox_s.append(sum(result.wall_s for result, _ in results))
        return {"rewards": rewards, "tests_passed": passed, "tests_timed_out": timed_out,
                "no_code_block": no_code_block, "sandbox_s": sandbox_s}

    def _submit(self, code: str, test: str):
        """Start one test's run -> (its future, the token its output must end with)."""
        token = f"tests-done-{secrets.token_hex(8)}"  # fresh each run: the solution cannot know it in advance
        # `python -I` (the sandbox's) leaves the script's directory off sys.path, so it is put back for the import
        program = f"import sys\nsys.path.insert(0, '.')\nfrom solution import *\n{test}\nprint({token!r})\n"
        future = self.pool.submit(program, files={"solution.py": code}, timeout_s=self.timeout_s,
                                  memory_mb=self.memory_mb)
        return future, token


code_tests = CodeTests()
