"""Tool calls in the policy's text, the two shipped tools, and the messages that carry their answers back.

    calls = parse_tool_calls(assistant_text)             # [ToolCall(name, arguments) | MalformedCall(reason, text)]
    observations, counts = run_tool_calls(assistant_text, {"calculator": Calculator(), "python": PythonTool()})
    messages = tool_messages(observations)               # [{"role": "tool", "content": ...}], for the chat template
    tools = tool_schemas([Calculator(), PythonTool()])   # the `tools=` a chat template renders in its system turn

The format is Qwen3's (and Hermes 2 Pro's before it): the checkpoint's chat template tells the model, under "# Tools",
to answer with one block per call,

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "123*456"}}
    </tool_call>

and renders each {"role": "tool"} message as a <tool_response> block inside a user turn. A turn ends at the template's
end of turn (its EOS), as Qwen3 ends a turn of tool calls right after the last TOOL_CALL_END
(ppo_core.agents.environments); the environment then runs the calls and the policy reads their answers in its next turn.

The text is the policy's, and in RL the policy writes whatever it is rewarded for: nothing it writes raises here. A
block's JSON is decoded within MAX_CALL_BYTES and MAX_JSON_DEPTH, any failure is a MalformedCall answered with its
reason (and counted), at most max_calls blocks of a turn are run (the config's max_tool_calls_per_turn), and the
calculator evaluates with a stack of its own, not by recursion.

A tool is a plain class: `name`, `description`, `parameters` (a JSON schema of its arguments, as the template renders
it) and `__call__(arguments: dict) -> str`, the observation text. A tool refuses input it cannot answer by raising
ToolError (any exception is caught by run_tool_calls and becomes an "error: ..." observation; a tool that calls
sys.exit() ends the run with one line naming it, ppo_core.rewards.interface.UserCode).
"""
import ast
import json
import math
import operator
import re
from dataclasses import dataclass

from ..rewards.interface import UserCode, failure

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"  # closes one call
MAX_CALL_BYTES = 64 * 1024  # a block's JSON, at most: a call is a name and a few arguments (code included)
MAX_JSON_DEPTH = 32  # arrays and objects nested in one call, at most
MAX_CALLS_PER_TURN = 8  # run_tool_calls' default: blocks answered in one turn, the rest not run


class ToolError(ValueError):
    """A tool could not answer this call (bad arguments, an expression it refuses); the message is what the model
    reads after "error: "."""


@dataclass(frozen=True)
class ToolCall:
    """One well-formed call: the tool's name and its arguments (a dict, decoded from JSON)."""
    name: str
    arguments: dict


@dataclass(frozen=True)
class MalformedCall:
    """A <tool_call> block that is not a call: why (short, for the error observation) and the block's text."""
    reason: str
    text: str


# ------------------------------------------------------------------------------------------------- parsing


def parse_tool_calls(text: str) -> list:
    """Every <tool_call>...</tool_call> block of an assistant's text, in order -> list of ToolCall | MalformedCall.

    A block's body is a JSON object {"name": str, "arguments": object}; "arguments" may also be a JSON string holding
    an object (some models emit it that way, as OpenAI's API does) and may be left out for a tool without arguments.
    Keys other than these two are ignored. Malformed, each with its reason: bad JSON, not an object, no "name" or a
    name that is not a non-empty string, arguments that are not an object; a <tool_call> that is not closed before
    the text ends or the next <tool_call> starts; a </tool_call> with no <tool_call> before it (the model meant
    a call). Text outside the blocks is not read.

    The text is the policy's and may be anything: this never raises. One pass over the tags (linear in the text),
    and a block's JSON is decoded only within MAX_CALL_BYTES and MAX_JSON_DEPTH (see load_json_bounded).
    """
    calls = []
    position = 0  # end of the last tag handled
    body_start = None  # where the open block's body starts, None when no block is open
    for tag in _TAG.finditer(text):
        if tag.group() == TOOL_CALL_START:
            if body_start is not None:
                calls.append(MalformedCall(f"unclosed {TOOL_CALL_START}", text[body_start:tag.start()]))
            body_start = tag.end()
        elif body_start is None:
            calls.append(MalformedCall(f"{TOOL_CALL_END} without {TOOL_CALL_START}", text[position:tag.start()]))
        else:
            calls.append(_parse_block(text[body_start:tag.start()]))
            body_start = None
        position = tag.end()
    if body_start is not None:
        calls.append(MalformedCall(f"unclosed {TOOL_CALL_START}", text[body_start:]))
    return calls


_TAG = re.compile(re.escape(TOOL_CALL_START) + "|" + re.escape(TOOL_CALL_END))
# a JSON string (its closing quote optional, so that an unterminated one is one token, not a retry from each quote
# inside it: the scan stays linear) or a bracket
_JSON_TOKEN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"?|[\[\]{}]', re.DOTALL)


def load_json_bounded(text: str, max_bytes: int, max_depth: int):
    """json.loads(text) for text the policy wrote; raises only ValueError (json.JSONDecodeError for bad JSON, with its
    position), whose message is the reason.

    Bounded before decoding: at most max_bytes of UTF-8, and arrays/objects nested at most max_depth deep (counted
    outside strings), since json.loads recurses once per level (1,000 levels: RecursionError) and its cost grows with
    the text. What json.loads raises besides bad JSON becomes a ValueError too: an integer past Python's 4,300-digit
    limit, a recursion the bracket count did not foresee."""
    size = len(text.encode("utf-8", errors="surrogatepass"))
    if size > max_bytes:
        raise ValueError(f"longer than {max_bytes} bytes ({size})")
    depth = deepest = 0
    for token in _JSON_TOKEN.findall(text):
        if token == "[" or token == "{":
            depth += 1
            deepest = max(deepest, depth)
        elif token == "]" or token == "}":
            depth -= 1
    if deepest > max_depth:
        raise ValueError(f"nested deeper than {max_depth} levels")
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise
    except (ValueError, RecursionError) as e:
        raise ValueError(f"bad JSON: {str(e)[:200]}") from None


def _parse_block(body: str):
    """The JSON between <tool_call> and </tool_call> -> ToolCall, or MalformedCall saying what is wrong with it."""
    if not body.strip():
        return MalformedCall("empty", body)
    try:
        call = load_json_bounded(body, MAX_CALL_BYTES, MAX_JSON_DEPTH)
    except json.JSONDecodeError as e:
        return MalformedCall(f"bad JSON: {e.msg} at line {e.lineno} column {e.colno}", body)
    except ValueError as e:
        return MalformedCall(str(e), body)
    if not isinstance(call, dict):
        return MalformedCall(f"expected a JSON object, got {_json_type(call)}", body)
    name = call.get("name")
    if name is None:
        return MalformedCall('no "name"', body)
    if not isinstance(name, str) or not name:
        return MalformedCall(f'"name" must be a non-empty string, got {_json_type(name)}', body)
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # '{"expression": "1+1"}' as a string: decode it once
        try:
            arguments = load_json_bounded(arguments, MAX_CALL_BYTES, MAX_JSON_DEPTH)
        except json.JSONDecodeError as e:
            return MalformedCall(f'"arguments" is a string of bad JSON: {e.msg}', body)
        except ValueError as e:
            return MalformedCall(f'"arguments" is a string: {e}', body)
    if not isinstance(arguments, dict):
        return MalformedCall(f'"arguments" must be an object, got {_json_type(arguments)}', body)
    return ToolCall(name, arguments)


def _json_type(value) -> str:
    """The JSON name of a decoded value's type, for a reason the model can read."""
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    names = {str: "a string", list: "an array", dict: "an object", type(None): "null"}
    return names.get(type(value), type(value).__name__)


# ------------------------------------------------------------------------------------------------- running


def run_tool_calls(text: str, tools: dict, max_calls: int = MAX_CALLS_PER_TURN) -> tuple[list[str], dict]:
    """Answer the tool calls in an assistant's text, at most max_calls of them -> (observations, counts).

    observations: one str per <tool_call> block, in order, up to max_calls: the tool's output; or "error: unknown
                  tool 'x'", "error: malformed tool call: <reason>", "error: <message>" when the tool raised
                  ToolError, and "error: <ExceptionType>: <message>" when it raised anything else (a bug, not the
                  model's input). Blocks past max_calls are not run: one more
                  observation says how many, so a turn of 5,000 calls costs max_calls calls and one line.
    counts:       {"tool_calls": blocks, well-formed or not, run or not; "malformed_calls": those that are not calls;
                   "tool_errors": well-formed calls answered with an error (an unknown tool, a tool that raised);
                   "calls_not_run": blocks past max_calls}.
    A Python run that fails is an observation, not a tool error: the tool did run the code (see PythonTool).
    """
    observations = []
    calls = parse_tool_calls(text)
    counts = {"tool_calls": len(calls), "malformed_calls": 0, "tool_errors": 0,
              "calls_not_run": max(len(calls) - max_calls, 0)}
    for call in calls[:max_calls]:
        if isinstance(call, MalformedCall):
            counts["malformed_calls"] += 1
            observations.append(f"error: malformed tool call: {call.reason}")
            continue
        tool = tools.get(call.name)
        if tool is None:
            counts["tool_errors"] += 1
            observations.append(f"error: unknown tool {clip_middle(repr(call.name), 200)} "
                                f"(the tools: {', '.join(sorted(tools)) or 'none'})")
            continue
        # what `except Exception` lets by (a tool's sys.exit()) ends the run in one line naming the tool (UserCode)
        with UserCode(lambda e: f"tool {call.name!r} ({type(tool).__module__}:{type(tool).__qualname__}) {failure(e)} "
                                f"on arguments {clip_middle(repr(call.arguments), 200)}", tool):
            try:
                observations.append(str(tool(call.arguments)))
            except ToolError as e:
                counts["tool_errors"] += 1
                observations.append(f"error: {e}")
            except Exception as e:  # a tool's own failure must not end the rollout; the model reads what went wrong
                counts["tool_errors"] += 1
                observations.append(f"error: {type(e).__name__}: {e}")
    if counts["calls_not_run"]:
        observations.append(f"error: {counts['calls_not_run']} more tool calls not run: at most {max_calls} "
                            f"per turn")
    return observations, counts


def tool_messages(observations: list[str]) -> list[dict]:
    """The observations as chat messages: {"role": "tool", "content": text} each. Qwen3's template renders
    consecutive tool messages as <tool_response> blocks in one user turn."""
    return [{"role": "tool", "content": text} for text in observations]


def tool_schemas(tools) -> list[dict]:
    """The tools as a chat template's `tools=` argument: {"type": "function", "function": {name, description,
    parameters}} each, the OpenAI form Qwen3's template renders (as JSON) in its system turn."""
    return [{"type": "function", "function": {"name": tool.name, "description": tool.description,
                                              "parameters": tool.parameters}} for tool in tools]


def _required_string(arguments: dict, key: str) -> str:
    value = arguments.get(key)
    if value is None:
        raise ToolError(f"missing argument {key!r}")
    if not isinstance(value, str):
        raise ToolError(f"argument {key!r} must be a string, got {_json_type(value)}")
    return value


# ---------------------------------------------------------------------------------------------- calculator

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}


class Calculator:
    """Arithmetic on numbers: + - * / // % **, unary minus and plus, parentheses, as Python computes them (integers
    exact, `/` a float). The expression is parsed with `ast` and only those nodes are evaluated: never `eval`, so a
    name, a call, an attribute or a subscript is refused before anything runs. Bounds keep one call cheap: at most
    MAX_CHARS characters, |exponent| <= MAX_EXPONENT, every integer on the way within MAX_BITS bits (about 1,000
    digits), floats finite. A result that is a whole number prints as an integer ("6/3" -> "2"), else Python's repr.
    """

    name = "calculator"
    description = "Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses."
    parameters = {"type": "object",
                  "properties": {"expression": {"type": "string", "description": "for example (12 + 7) * 3 / 4"}},
                  "required": ["expression"]}
    MAX_CHARS = 1000
    MAX_EXPONENT = 100
    MAX_BITS = 3322  # 10**1000 < 2**3322

    def __call__(self, arguments: dict) -> str:
        expression = _required_string(arguments, "expression")
        if len(expression) > self.MAX_CHARS:
            raise ToolError(f"expression longer than {self.MAX_CHARS} characters")
        try:
            tree = ast.parse(expression.strip(), mode="eval")
        except SyntaxError as e:
            raise ToolError(f"not an arithmetic expression: {e.msg}") from None
        except (RecursionError, MemoryError, ValueError):  # the parser's own bounds on nesting
            raise ToolError("expression nested too deeply") from None
        value = self._evaluate(tree.body)
        if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:  # exact as an int below 2**53
            return str(int(value))
        return repr(value)

    def _evaluate(self, root):
        """The expression tree's value, computed with a stack of its own rather than by recursion: '-' * 999 + '1'
        is 999 nested nodes, past Python's recursion limit."""
        values = []  # operands computed so far, in post-order
        pending = [(root, False)]  # (node, its operands are already on `values`)
        while pending:
            node, operands_done = pending.pop()
            if isinstance(node, ast.Constant):
                if type(node.value) not in (int, float):  # bool is an int subclass, hence type(), not isinstance
                    raise ToolError(f"not a number: {node.value!r}")
                values.append(self._checked(node.value))  # 1e999 is a float literal of inf
            elif isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
                if not operands_done:
                    pending += [(node, True), (node.operand, False)]
                else:
                    values.append(_UNARY[type(node.op)](values.pop()))
            elif isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
                if not operands_done:  # the left operand is computed first, as Python does
                    pending += [(node, True), (node.right, False), (node.left, False)]
                    continue
                right = values.pop()
                left = values.pop()
                if isinstance(node.op, ast.Pow):
                    self._check_power(left, right)
                try:
                    value = _BINARY[type(node.op)](left, right)
                except ZeroDivisionError:
                    raise ToolError("division by zero") from None
                except OverflowError:  # float ** float past 1.8e308
                    raise ToolError("result too large") from None
                values.append(self._checked(value))
            else:
                self._refuse(node)
        return values.pop()

    def _refuse(self, node):
        if isinstance(node, ast.Name):
            raise ToolError(f"names are not allowed: {node.id!r}")
        if isinstance(node, ast.Call):
            raise ToolError("function calls are not allowed")
        if isinstance(node, ast.Attribute):
            raise ToolError("attribute access is not allowed")
        symbol = type(node.op).__name__ if isinstance(node, (ast.BinOp, ast.UnaryOp)) else type(node).__name__
        raise ToolError(f"{symbol} is not allowed: only numbers, + - * / // % ** and parentheses")

    def _check_power(self, base, exponent):
        """Refuse before computing: the cost of int ** int grows with the result's size, which can be astronomical."""
        if abs(exponent) > self.MAX_EXPONENT:
            raise ToolError(f"exponent {exponent} is larger than {self.MAX_EXPONENT}")
        if isinstance(base, int) and isinstance(exponent, int) and base.bit_length() * exponent > self.MAX_BITS:
            raise ToolError("result too large")

    def _checked(self, value):
        if isinstance(value, complex):  # (-8) ** (1/3)
            raise ToolError("the result is not a real number")
        if isinstance(value, int) and value.bit_length() > self.MAX_BITS:
            raise ToolError("result too large")
        if isinstance(value, float) and not math.isfinite(value):
            raise ToolError("result too large")
        return value


# --------------------------------------------------------------------------------------------- python tool


class PythonTool:
    """Runs the model's Python code in the sandbox (ppo_core.rewards.sandbox.run_code: its own process, no network, no
    trainer environment, rlimits, a wall-clock timeout) and answers with what it printed.

    pool: a ppo_core.rewards.sandbox.SandboxPool, or None to call run_code directly; a pool bounds how many sandboxes run at
    once when many episodes call the tool from their own threads. timeout_s, memory_mb: the sandbox's limits.
    max_chars: the observation's length bound; a longer one keeps its head and tail (a traceback's last line is the
    one that says what went wrong) with the number of characters cut in between.

    The observation: stdout, then stderr if any; "(no output)" when both are empty. Then how a run that did not end
    well ended: "timed out after S s" (after what it printed until then), the sandbox's reason when it stopped the
    run (more than 16 MiB of output), "killed by SIGSEGV" (a signal), or "exit status N" (after the traceback).
    These are observations, not tool errors: the model's code ran and this is what happened. A sandbox that could
    not start is a tool error (ToolError): the model's code never ran.
    """

    name = "python"
    description = ("Run a Python 3 program and return what it prints (stdout and stderr). "
                   "Each call is a fresh process with no network and no files from earlier calls.")
    parameters = {"type": "object",
                  "properties": {"code": {"type": "string", "description": "a complete program; use print()"}},
                  "required": ["code"]}

    def __init__(self, pool=None, timeout_s: float = 5.0, memory_mb: int = 512, max_chars: int = 2000):
        self.pool, self.timeout_s, self.memory_mb, self.max_chars = pool, timeout_s, memory_mb, max_chars

    def __call__(self, arguments: dict) -> str:
        from ..rewards.sandbox import SETUP_FAILED, run_code  # imported by the tool that runs code, not by every user of tools

        code = _required_string(arguments, "code")
        if self.pool is not None:
            result = self.pool.submit(code, timeout_s=self.timeout_s, memory_mb=self.memory_mb).result()
        else:
            result = run_code(code, timeout_s=self.timeout_s, memory_mb=self.memory_mb)
        if result.error and result.error.startswith(SETUP_FAILED):
            raise ToolError(f"the sandbox could not start: {result.error}")
        return self.format(result)

    def format(self, result) -> str:
        """A SandboxResult -> the observation text (see the class docstring), at most about max_chars long."""
        parts = [text.rstrip("\n") for text in (result.stdout, result.stderr) if text.strip()]
        if result.truncated:
            parts.append("[output truncated]")
        if result.timed_out:
            parts.append(f"timed out after {self.timeout_s:g} s")
        elif result.error:
            parts.append(result.error)
        elif result.killed_by:
            parts.append(f"killed by {result.killed_by}")
        elif result.exit_code != 0:
            parts.append(f"exit status {result.exit_code}")
        text = "\n".join(parts) if parts else "(no output)"
        return clip_middle(text, self.max_chars)


def clip_middle(text: str, max_chars: int) -> str:
    """text if it fits in max_chars, else its first and last max_chars // 2 characters around a note of how many
    were cut."""
    if len(text) <= max_chars:
        return text
    keep = max_chars // 2
    return f"{text[:keep]}\n... [{len(text) - 2 * keep} characters cut] ...\n{text[len(text) - keep:]}"
