"""Tool calls and the code reward: parsing hand-written assistant texts, the calculator against hand-worked values
and its refusals, the error observations and their counts, the Python tool and the code reward through the real
sandbox (ppo_core/rewards/sandbox.py: real processes, no mocks), and the code reward loaded as ppo-train loads it."""
import json
import os
import time

import pytest
import torch

from ppo_core.rewards import sandbox
from ppo_core.rewards.code_tests import CodeTests, extract_code, split_tests
from ppo_core.config import build_config
from ppo_core.rewards.source import make_reward_source
from ppo_core.rewards.interface import RewardError
from ppo_core.agents.tools import (
    TOOL_CALL_END,
    Calculator,
    MalformedCall,
    PythonTool,
    ToolCall,
    ToolError,
    clip_middle,
    parse_tool_calls,
    run_tool_calls,
    tool_messages,
    tool_schemas,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the Python tool and the code reward run code in ppo_core.rewards.sandbox, which refuses to run on a machine that cannot
# isolate it (no unshare, no user namespaces): there those tests have nothing to check
ISOLATION = sandbox.isolation()
needs_sandbox = pytest.mark.skipif(ISOLATION.startswith("none"), reason=f"no sandbox on this machine: {ISOLATION}")

# ------------------------------------------------------------------------------------------------ parsing


def test_one_call_in_the_template_s_own_format():
    # what Qwen3's template renders for an assistant turn with one tool call, up to where decoding stops
    text = ('I will compute it.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "123*456"}}\n'
            + TOOL_CALL_END)
    assert parse_tool_calls(text) == [ToolCall("calculator", {"expression": "123*456"})]


def test_two_calls_in_order():
    text = ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+1"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "python", "arguments": {"code": "print(2)"}}\n</tool_call>')
    assert parse_tool_calls(text) == [ToolCall("calculator", {"expression": "1+1"}),
                                      ToolCall("python", {"code": "print(2)"})]


def test_arguments_as_a_json_string_holding_an_object():
    text = '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"2**10\\"}"}</tool_call>'
    assert parse_tool_calls(text) == [ToolCall("calculator", {"expression": "2**10"})]


def test_arguments_left_out_are_empty_and_other_keys_are_ignored():
    assert parse_tool_calls('<tool_call>{"name": "now", "id": 7}</tool_call>') == [ToolCall("now", {})]


@pytest.mark.parametrize("body, reason", [
    # positions count from the block's start: line 1 is the rest of the <tool_call> line
    ('{"name": "calculator", "arguments": {"expression": "1+1"}', "bad JSON: Expecting ',' delimiter at line 3 column 1"),
    ("calculator(1+1)", "bad JSON: Expecting value at line 2 column 1"),
    ("", "empty"),
    ('{"arguments": {"expression": "1+1"}}', 'no "name"'),
    ('{"name": 3, "arguments": {}}', '"name" must be a non-empty string, got a number'),
    ('{"name": "", "arguments": {}}', '"name" must be a non-empty string, got a string'),
    ('["calculator", {"expression": "1+1"}]', "expected a JSON object, got an array"),
    ('{"name": "calculator", "arguments": ["1+1"]}', '"arguments" must be an object, got an array'),
    ('{"name": "calculator", "arguments": "1+1"}', '"arguments" is a string of bad JSON: Extra data'),
    ('{"name": "calculator", "arguments": "[1]"}', '"arguments" must be an object, got an array'),
    # OpenAI's message form inside the block is not the template's format
    ('{"type": "function", "function": {"name": "calculator", "arguments": {}}}', 'no "name"'),
])
def test_malformed_blocks_say_why(body, reason):
    assert parse_tool_calls(f"<tool_call>\n{body}\n</tool_call>") == [MalformedCall(reason, f"\n{body}\n")]


def test_an_unclosed_block_is_malformed_and_the_next_block_still_parses():
    assert parse_tool_calls('<tool_call>\n{"name": "calculator"') == [
        MalformedCall("unclosed <tool_call>", '\n{"name": "calculator"')]
    text = '<tool_call>{"name": "a"\n<tool_call>{"name": "b"}</tool_call>'
    assert parse_tool_calls(text) == [MalformedCall("unclosed <tool_call>", '{"name": "a"\n'), ToolCall("b", {})]


def test_a_closing_tag_without_an_opening_one_is_malformed():
    # the turn stopped at TOOL_CALL_END, so the model meant a call
    assert parse_tool_calls('{"name": "calculator"}</tool_call>') == [
        MalformedCall("</tool_call> without <tool_call>", '{"name": "calculator"}')]


@pytest.mark.parametrize("text", ["The answer is 56088.", "", "tool_call", "a <tool call> in prose"])
def test_text_without_calls(text):
    assert parse_tool_calls(text) == []


# ---------------------------------------------------------------------------------------------- calculator


@pytest.mark.parametrize("expression, expected", [
    ("123*456", "56088"),
    ("1 + 2 * 3", "7"),
    ("(1 + 2) * 3", "9"),
    ("7 / 2", "3.5"),
    ("6 / 3", "2"),               # a whole-number float prints as an integer
    ("7 // 2", "3"),
    ("-7 // 2", "-4"),            # floor, as Python
    ("7 % 3", "1"),
    ("-7 % 3", "2"),
    ("2 ** 10", "1024"),
    ("2 ** -1", "0.5"),
    ("-2 ** 2", "-4"),            # ** binds tighter than unary minus
    ("(-2) ** 2", "4"),
    ("--3", "3"),
    ("+4", "4"),
    ("0.1 + 0.2", "0.30000000000000004"),  # floats as Python computes them
    ("1.5e3", "1500"),
    ("2 ** 100", "1267650600228229401496703205376"),  # integers exact
    ("  12 +\t3 ", "15"),
    ("999999999999 * 999999999999", "999999999998000000000001"),
    ("1e20", "1e+20"),            # a float past 2**53 keeps its float form
])
def test_calculator(expression, expected):
    assert Calculator()({"expression": expression}) == expected


@pytest.mark.parametrize("expression, message", [
    ("__import__('os')", "function calls are not allowed"),
    ("__import__('os').system('true')", "function calls are not allowed"),  # the outer node is refused first
    ("().__class__.__bases__[0]", "Subscript is not allowed: only numbers, + - * / // % ** and parentheses"),
    ("x + 1", "names are not allowed: 'x'"),
    ("(1).__class__", "attribute access is not allowed"),
    ("abs(-1)", "function calls are not allowed"),
    ("[1, 2][0]", "Subscript is not allowed: only numbers, + - * / // % ** and parentheses"),
    ("'a' * 3", "not a number: 'a'"),
    ("True + 1", "not a number: True"),
    ("1j * 1j", "not a number: 1j"),
    ("1 << 3", "LShift is not allowed: only numbers, + - * / // % ** and parentheses"),
    ("~1", "Invert is not allowed: only numbers, + - * / // % ** and parentheses"),
    ("1 < 2", "Compare is not allowed: only numbers, + - * / // % ** and parentheses"),
    ("lambda: 1", "Lambda is not allowed: only numbers, + - * / // % ** and parentheses"),
    ("1 +", "not an arithmetic expression: invalid syntax"),
    ("1; 2", "not an arithmetic expression: invalid syntax"),
    ("1/0", "division by zero"),
    ("1 // 0", "division by zero"),
    ("5 % 0", "division by zero"),
    ("1.0 / 0.0", "division by zero"),
    ("0 ** -1", "division by zero"),
    ("2 ** 101", "exponent 101 is larger than 100"),
    ("2 ** -101", "exponent -101 is larger than 100"),
    ("9 ** 9 ** 9", "exponent 387420489 is larger than 100"),
    ("(10 ** 50) ** 100", "result too large"),    # 167 bits * 100 > 3322: refused before computing
    ("10.0 ** 100 ** 2 ", "exponent 10000 is larger than 100"),
    ("1e300 * 1e300", "result too large"),         # inf
    ("1e999", "result too large"),
    ("10.0 ** 99 ** 1 * 1e300", "result too large"),
    ("(-8) ** 0.5", "the result is not a real number"),
    ("1" * 1001, "expression longer than 1000 characters"),
])
def test_calculator_refuses(expression, message):
    with pytest.raises(ToolError) as raised:
        Calculator()({"expression": expression})
    assert str(raised.value) == message


def test_calculator_results_stay_bounded():
    # every step is checked, so a chain of products cannot grow past the bound either
    assert Calculator()({"expression": "(10 ** 3) ** 100"}) == "1" + "0" * 300    # 10 bits * 100 <= 3322
    cube = "(10 ** 3) ** 100"
    assert Calculator()({"expression": f"{cube} * {cube} * {cube}"}) == "1" + "0" * 900  # 10**900: 2990 bits
    with pytest.raises(ToolError, match="^result too large$"):                           # 10**1200: 3987 bits
        Calculator()({"expression": f"{cube} * {cube} * {cube} * {cube}"})


@pytest.mark.parametrize("arguments, message", [
    ({}, "missing argument 'expression'"),
    ({"expression": 12}, "argument 'expression' must be a string, got a number"),
])
def test_calculator_arguments(arguments, message):
    with pytest.raises(ToolError) as raised:
        Calculator()(arguments)
    assert str(raised.value) == message


# ------------------------------------------------------------------------------------ running and messages


class Broken:
    """A tool with a bug of its own (a real class, not a mock: run_tool_calls must survive it)."""
    name, description, parameters = "broken", "always fails", {"type": "object", "properties": {}}

    def __call__(self, arguments):
        return {}["missing"]


def test_run_tool_calls_answers_each_block_and_counts():
    text = ('<tool_call>{"name": "calculator", "arguments": {"expression": "123*456"}}</tool_call>'
            '<tool_call>{"name": "search", "arguments": {"q": "weather"}}</tool_call>'
            '<tool_call>{"name": "calculator", "arguments": {"expression": "1/0"}}</tool_call>'
            '<tool_call>{"name": "calculator" "arguments": {}}</tool_call>'
            '<tool_call>{"name": "broken", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "calculator", "arguments": {"expression": "2**-2"}}')
    observations, counts = run_tool_calls(text, {"calculator": Calculator(), "broken": Broken()})
    assert observations == ["56088",
                            "error: unknown tool 'search' (the tools: broken, calculator)",
                            "error: division by zero",
                            "error: malformed tool call: bad JSON: Expecting ',' delimiter at line 1 column 23",
                            "error: KeyError: 'missing'",
                            "error: malformed tool call: unclosed <tool_call>"]
    assert counts == {"tool_calls": 6, "malformed_calls": 2, "tool_errors": 3, "calls_not_run": 0}


def test_run_tool_calls_without_calls():
    assert run_tool_calls("The product is 56088.", {"calculator": Calculator()}) == (
        [], {"tool_calls": 0, "malformed_calls": 0, "tool_errors": 0, "calls_not_run": 0})
    assert run_tool_calls('<tool_call>{"name": "x"}</tool_call>', {})[0] == ["error: unknown tool 'x' (the tools: none)"]


def test_observations_render_as_tool_responses_in_qwen3_s_template():
    from ppo_core.models.chat_template import render_chat_template

    test_tokenizer = pytest.importorskip("test_tokenizer")  # holds Qwen3's template (and needs transformers)
    assistant = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "123*456"}}\n</tool_call>'
    observations, _ = run_tool_calls(assistant, {"calculator": Calculator()})
    assert tool_messages(observations) == [{"role": "tool", "content": "56088"}]
    chat = [{"role": "user", "content": "What is 123*456?"}, {"role": "assistant", "content": assistant},
            *tool_messages(observations)]
    tools = tool_schemas([Calculator(), PythonTool()])
    assert [t["function"]["name"] for t in tools] == ["calculator", "python"]
    text = render_chat_template(test_tokenizer.QWEN3_TEMPLATE, chat, tools=tools, add_generation_prompt=True)
    assert '{"type": "function", "function": {"name": "calculator", "description": ' in text
    assert text.endswith(f"<|im_start|>assistant\n{assistant}<|im_end|>\n"
                         "<|im_start|>user\n<tool_response>\n56088\n</tool_response><|im_end|>\n"
                         "<|im_start|>assistant\n")


def test_clip_middle_keeps_head_and_tail():
    assert clip_middle("abcdef", 6) == "abcdef"
    assert clip_middle("abcdefghij", 4) == "ab\n... [6 characters cut] ...\nij"


# ------------------------------------------------------------------------------------ the Python tool (sandbox)


@needs_sandbox
def test_python_tool_prints():
    assert PythonTool()({"code": "print(123 * 456)\nprint('done')"}) == "56088\ndone"
    assert PythonTool()({"code": "x = 1"}) == "(no output)"


@needs_sandbox
def test_python_tool_reports_an_exception_with_its_traceback_and_exit_status():
    out = PythonTool()({"code": "print('before')\n1/0"})
    lines = out.splitlines()
    assert lines[0] == "before" and lines[1] == "Traceback (most recent call last):"
    assert lines[-2:] == ["ZeroDivisionError: division by zero", "exit status 1"]


@needs_sandbox
def test_python_tool_times_out_plainly():
    start = time.monotonic()
    out = PythonTool(timeout_s=0.5)({"code": "print('started', flush=True)\nwhile True: pass"})
    assert time.monotonic() - start < 5
    assert out == "started\ntimed out after 0.5 s"


@needs_sandbox
def test_python_tool_bounds_its_observation_and_runs_through_a_pool():
    from ppo_core.rewards.sandbox import SandboxPool

    tool = PythonTool(SandboxPool(2), max_chars=100)
    out = tool({"code": "print('x' * 1000)"})
    assert out == "x" * 50 + "\n... [900 characters cut] ...\n" + "x" * 50


@needs_sandbox
def test_python_tool_says_how_a_run_ended_badly():
    tool = PythonTool(memory_mb=256)
    assert tool({"code": "import ctypes\nctypes.string_at(0)"}) == "killed by SIGSEGV"  # a crash of its own
    hog = tool({"code": "x = bytearray(10**10)"}).splitlines()                           # 10 GB past 256 MB
    assert hog[-2:] == ["MemoryError", "exit status 1"]
    flood = tool({"code": "import sys\nsys.stdout.write('x' * (20 << 20))"})             # 20 MiB of output
    assert flood.endswith("xxx\n[output truncated]\noutput passed 16 MiB: the run was killed") and len(flood) < 2100


@needs_sandbox
def test_python_tool_arguments_are_checked_through_run_tool_calls():
    text = ('<tool_call>{"name": "python", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "python", "arguments": {"code": ["print(1)"]}}</tool_call>'
            '<tool_call>{"name": "python", "arguments": {"code": "print(6 * 7)"}}</tool_call>')
    assert run_tool_calls(text, {"python": PythonTool()}) == (
        ["error: missing argument 'code'", "error: argument 'code' must be a string, got an array", "42"],
        {"tool_calls": 3, "malformed_calls": 0, "tool_errors": 2, "calls_not_run": 0})


# ------------------------------------------------------------------------------------------- the code reward

IS_EVEN_TESTS = ["assert is_even(2)", "assert not is_even(3)", "assert is_even(0)", "assert is_even(-4)"]
CORRECT = "Here it is:\n```python\ndef is_even(n):\n    return n % 2 == 0\n```\nIt uses the remainder."
WRONG = "```python\ndef is_even(n):\n    return n % 2 == 1\n```"          # fails all 4 (-4 % 2 == 0 in Python)
PARTIAL = "```python\ndef is_even(n):\n    return n % 2 == 0 and n != 0\n```"  # fails is_even(0) alone: 3 of 4


@pytest.mark.parametrize("response, code, fenced", [
    ("```python\nprint(1)\n```", "print(1)\n", True),
    ("first\n```python\nx = 1\n```\nthen\n```py\nx = 2\n```\ndone", "x = 2\n", True),   # the last block
    ("```Python3\nx = 3\n```", "x = 3\n", True),
    ("```\nx = 4\n```", "x = 4\n", True),                                                  # a bare fence
    ("```python\nx = 5\n```\n```bash\nls\n```", "x = 5\n", True),                         # not another language
    ("def f():\n    return 1", "def f():\n    return 1", False),                           # no block: all of it
    ("```python\nx = 1\n```\n```python\nx = 2", "x = 1\n", True),                          # cut-off last fence
])
def test_extract_code(response, code, fenced):
    assert extract_code(response) == (code, fenced)


def test_split_tests():
    assert split_tests("assert f(1) == 1\nassert f(2) == 2") == ["assert f(1) == 1\nassert f(2) == 2"]  # one test
    assert split_tests(["assert f(1) == 1", "assert f(2) == 2"]) == ["assert f(1) == 1", "assert f(2) == 2"]
    assert split_tests('["assert f(1) == 1", "assert f(2) == 2"]') == ["assert f(1) == 1", "assert f(2) == 2"]
    for bad, message in [([], "holds no tests"), ("[]", "holds no tests"), (None, "must be a string"),
                         ([1], "must be a string")]:
        with pytest.raises(ValueError, match=message):
            split_tests(bad)


@needs_sandbox
def test_correct_wrong_and_partial_solutions_score_the_fraction_of_tests_passed():
    reward = CodeTests(timeout_s=5.0, max_workers=4)
    out = reward(["Write is_even(n)."] * 3, [CORRECT, WRONG, PARTIAL], [IS_EVEN_TESTS] * 3)
    assert out["rewards"] == [1.0, 0.0, 0.75]
    assert out["tests_passed"] == [4.0, 0.0, 3.0]
    assert out["tests_timed_out"] == [0.0, 0.0, 0.0]
    assert out["no_code_block"] == [0.0, 0.0, 0.0]
    assert all(0 < seconds < 20 for seconds in out["sandbox_s"])


@needs_sandbox
def test_a_response_without_a_block_runs_whole_and_a_main_block_does_not_run():
    # the demo under __main__ reads input(), which would fail the test if the solution were run as a script
    response = "def is_even(n):\n    return n % 2 == 0\n\nif __name__ == '__main__':\n    print(is_even(int(input())))\n"
    out = CodeTests()(["p"], [response], ["assert is_even(10)"])
    assert out["rewards"] == [1.0] and out["no_code_block"] == [1.0]
    assert CodeTests()(["p"], ["This is prose, not code."], ["assert is_even(10)"])["rewards"] == [0.0]


@needs_sandbox
def test_an_infinite_loop_scores_zero_promptly():
    reward = CodeTests(timeout_s=1.0, max_workers=4)
    looping = "```python\ndef is_even(n):\n    while True:\n        pass\n```"
    at_import = "```python\nwhile True:\n    pass\n```"
    start = time.monotonic()
    out = reward(["p", "p"], [looping, at_import], [IS_EVEN_TESTS[:2], IS_EVEN_TESTS[:2]])
    elapsed = time.monotonic() - start
    assert out["rewards"] == [0.0, 0.0] and out["tests_timed_out"] == [2.0, 2.0]
    assert elapsed < 6.0, elapsed  # four 1 s runs, four at a time, with room for a loaded machine


@needs_sandbox
@pytest.mark.parametrize("exit_call", ["import sys\nsys.exit(0)", "import os\nos._exit(0)"])
def test_exiting_early_with_status_zero_does_not_pass(exit_call):
    # the shortcut: leave before the asserts run, with the status of success
    response = f"```python\ndef is_even(n):\n    return False\n{exit_call}\n```"
    assert CodeTests()(["p"], [response], [IS_EVEN_TESTS])["rewards"] == [0.0]


@needs_sandbox
def test_the_solution_does_not_see_the_trainer_s_secrets(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_trainer_secret")
    monkeypatch.setenv("PPO_CORE_TEST_SECRET", "hunter2")
    response = ("```python\nimport os\n\ndef secrets():\n"
                "    return [os.environ.get('HF_TOKEN'), os.environ.get('PPO_CORE_TEST_SECRET')]\n```")
    tests = ["assert secrets() == [None, None]",
             "assert 'hf_trainer_secret' in secrets()",
             "assert 'hunter2' in secrets()",
             "assert not any('hunter2' in value or 'hf_trainer' in value for value in __import__('os').environ.values())"]
    out = CodeTests()(["p"], [response], [tests])
    assert out["rewards"] == [0.5] and out["tests_passed"] == [2.0]  # the first and the last: nothing leaks


@needs_sandbox
@pytest.mark.parametrize("spec", ["ppo_core.rewards.code_tests:code_tests", f"{ROOT}/ppo_core/rewards/code_tests.py:code_tests"])
def test_loads_as_ppo_train_loads_a_reward_function(spec):
    source = make_reward_source(build_config(overrides={"reward_fn": spec}))
    with pytest.raises(RewardError, match="needs column 'tests'"):
        source.check_columns(["answer"])
    source.check_columns(["tests"])
    columns = {"tests": [IS_EVEN_TESTS, json.dumps(IS_EVEN_TESTS)]}  # a list, and a JSON array in a string
    scores, metrics = source(["Write is_even(n).", "Write is_even(n)."], [CORRECT, PARTIAL], columns)
    assert torch.equal(scores, torch.tensor([1.0, 0.75]))
    assert sorted(metrics) == ["reward/code_tests", "reward/code_tests/no_code_block", "reward/code_tests/sandbox_s",
                               "reward/code_tests/tests_passed", "reward/code_tests/tests_timed_out"]
    assert metrics["reward/code_tests/tests_passed"].tolist() == [4.0, 3.0]
    with pytest.raises(RewardError, match=r"raised ValueError: column 'tests' holds no tests on sample 1"):
        source(["a", "b"], [CORRECT, CORRECT], {"tests": [IS_EVEN_TESTS, []]})
