"""Chat templates: a checkpoint's own Jinja template, rendered exactly as `transformers` renders it.

    text = render_chat_template(template, messages, add_generation_prompt=True, enable_thinking=False,
                                special_tokens={"eos_token": "<|im_end|>", ...})

The template, its reasoning switch (Qwen3's `enable_thinking`) and every other template variable must be the
same for rollout, reference log-probs and reward scoring, so the PPO config fixes them once and every stage
calls this one function. What transformers 5 does, and this file copies (transformers/utils/chat_template_utils.py):
  - a sandboxed Jinja environment (ImmutableSandboxedEnvironment) with trim_blocks and lstrip_blocks, the
    loopcontrols extension ({% break %}, {% continue %}) and `{% generation %}` blocks (rendered as their body);
  - `tojson` that does not escape HTML and accepts indent/separators/sort_keys; the globals
    `raise_exception(msg)`, `strftime_now(fmt)`, a plain `dict` and a `namespace` that rejects `_` names;
  - messages with None-valued keys dropped; a message's reasoning given under any of reasoning_content /
    thinking / reasoning is visible under `reasoning_content` and `thinking`;
  - the variables: messages, tools, documents, add_generation_prompt, the tokenizer's named special tokens
    (bos_token, eos_token, ...; a keyword argument of the same name wins), then the caller's keywords.

A template comes with a checkpoint, so it runs under bounds (issue 49): it can neither take the machine nor cost
anything while unused. Compiling evaluates nothing (Jinja folds constant expressions while compiling, sandbox or
not: `{% if false %}{{ 'a' * 5*10**9 }}{% endif %}` cost 10 GB at load): the optimizer is off, every arithmetic
operator is intercepted (never folded), outputs pass a finalize that needs the render's context (never folded), and
filters check their arguments first. A render is bounded by what each operation may build: the operators (`*`, `+`,
`%`, `**`, `~`), every filter, method and global called (`center`, `indent`, `join`, `replace`, `format`, `tojson`
...) check the size of their result BEFORE building it (MAX_TEXT characters or items), everything built adds to the
render's total (MAX_WORK, a unit per loop step too), and a render past RENDER_DEADLINE_S or an output past MAX_TEXT
stops. Any of these is a ChatTemplateError: one line naming the template's file.
"""
import functools
import json
import re
import string
import threading
import time
from datetime import datetime
from functools import lru_cache

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.compiler import CodeGenerator
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .model import CheckpointError

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")

MAX_TEMPLATE_CHARS = 1_000_000  # a template's source (real ones: under 20 k)
MAX_TEXT = 4_000_000  # the most characters (or items) any value a template builds, and its output, may hold
MAX_WORK = 64_000_000  # everything one render builds, summed, plus one per loop step
RENDER_DEADLINE_S = 5.0  # one render's wall time
MAX_FORMAT_WIDTH = 10_000  # a width or precision in `%` or str.format
MAX_INT_BITS = 100_000  # an integer a template computes (`**` and `*` on integers)


class ChatTemplateError(CheckpointError):
    """A chat template that went past its bounds (the module docstring); one line naming the template."""


class _OverBound(jinja2.exceptions.SecurityError):
    """Raised inside a render (or a fold while compiling, where Jinja takes it for "not a constant")."""


_render = threading.local()  # .work and .deadline of the render running in this thread (None outside one)


def _size(value, limit=MAX_TEXT) -> int:
    """Characters of strings and bytes + items of lists, tuples and dicts (keys and values), nested, counted as often
    as they are reached (what str() or tojson would write); stops once past limit."""
    if isinstance(value, (str, bytes)):
        return len(value)
    total, stack = 0, [value]
    while stack and total <= limit:
        value = stack.pop()
        if isinstance(value, (str, bytes)):
            total += len(value)
        elif isinstance(value, (list, tuple)):
            total += len(value)
            stack.extend(value)
        elif isinstance(value, dict):
            total += len(value)
            stack.extend(value.keys())
            stack.extend(value.values())
        elif isinstance(value, int):
            total += value.bit_length() // 8
    return total


def _shallow(value) -> int:
    """What building value cost: characters of a string, items of a list, tuple or dict (not what they refer to)."""
    return len(value) if isinstance(value, (str, bytes, list, tuple, dict)) else 0


def _json_size(value, indent) -> int:
    """At most how many characters json.dumps(value, indent=indent) writes (a character escaped takes 6; each item
    a line indented by its depth); stops once past MAX_TEXT."""
    total, stack = 0, [(value, 1)]
    while stack and total <= MAX_TEXT:
        value, depth = stack.pop()
        if isinstance(value, str):
            total += 6 * len(value) + 2
        elif isinstance(value, (list, tuple, dict)):
            total += 2 + len(value) * (indent * depth + 4)
            children = [*value.keys(), *value.values()] if isinstance(value, dict) else value
            stack.extend((child, depth + 1) for child in children)
        else:
            total += 32  # a number's digits, true, null
    return total


def _text_size(value) -> int:
    """At most how many characters str(value) writes (a container's repr adds quotes, commas, escapes)."""
    return len(value) if isinstance(value, str) else 10 * _size(value, MAX_TEXT // 10)


def _allow(size, what):
    """Refuse to build `what` of `size` characters or items over MAX_TEXT; else count it against the render."""
    if size > MAX_TEXT:
        raise _OverBound(f"{what} would hold {size} characters or items, over the limit of {MAX_TEXT} (MAX_TEXT)")
    _spend(size)


def _spend(units):
    render = getattr(_render, "state", None)
    if render is None:  # compiling (a fold), or a template object used directly
        return
    render[0] += units
    if render[0] > MAX_WORK:
        raise _OverBound(f"built more than {MAX_WORK} characters and items in one render (MAX_WORK)")
    if time.monotonic() > render[1]:
        raise _OverBound(f"took more than {RENDER_DEADLINE_S:g} s to render (RENDER_DEADLINE_S)")


_PRINTF = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d*)(?:\.(\*|\d*))?[hlL]?([a-zA-Z%])")


def _check_widths(widths, what):
    for width in widths:
        if width == "*" or (width and int(width) > MAX_FORMAT_WIDTH) or "{" in width:
            raise _OverBound(f"{what}: a width or precision of {width!r} (the limit: {MAX_FORMAT_WIDTH}, written out)")


def _check_printf(fmt, args, what="the % operator"):
    """`fmt % args` (and the format filter): widths written out and bounded, the result's size bounded."""
    if not isinstance(fmt, str):
        return
    conversions = _PRINTF.findall(fmt)
    _check_widths([w for c in conversions for w in c[:2]], what)
    per = max([int(w) for c in conversions for w in c[:2] if w] + [0]) + 400  # 400: a float's digits
    _allow(len(fmt) + len(conversions) * (per + _text_size(args)), f"the result of {what}")


def _check_format(fmt, args, kwargs):
    """str.format / format_map: the same bounds, nested fields ('{:{w}}') refused."""
    fields = [f for f in string.Formatter().parse(fmt) if f[1] is not None]
    _check_widths([w for f in fields for w in re.findall(r"\d+|\{", f[2] or "")], "str.format")
    _allow(len(fmt) + len(fields) * (MAX_FORMAT_WIDTH + 400 + _text_size(args) + _text_size(kwargs)),
           "the result of str.format")


def _check_binop(operator, left, right):
    if operator == "*":
        for seq, n in ((left, right), (right, left)):
            if isinstance(seq, (str, bytes, list, tuple)) and isinstance(n, int):
                _allow(len(seq) * max(n, 0), f"{type(seq).__name__} * {n}")
        if isinstance(left, int) and isinstance(right, int) and left.bit_length() + right.bit_length() > MAX_INT_BITS:
            raise _OverBound(f"an integer product over {MAX_INT_BITS} bits")
    elif operator == "**":
        if isinstance(left, int) and isinstance(right, int) and right > 0 and \
                max(left.bit_length(), 1) * right > MAX_INT_BITS:
            raise _OverBound(f"an integer power over {MAX_INT_BITS} bits ({left} ** {right})")
    elif operator == "+":
        if isinstance(left, (str, bytes, list, tuple)) and isinstance(right, (str, bytes, list, tuple)):
            _allow(len(left) + len(right), "a concatenation (+)")
    elif operator == "%":
        _check_printf(left, right)


# str (and bytes) methods whose result can be far larger than the string and the arguments: each one's size
def _method_size(s, name, args, kwargs):
    if name in ("center", "ljust", "rjust", "zfill"):
        width = args[0] if args else kwargs.get("width", 0)
        return max(len(s), width) if isinstance(width, int) else len(s)
    if name == "expandtabs":
        tabsize = args[0] if args else kwargs.get("tabsize", 8)
        return len(s) + s.count("\t" if isinstance(s, str) else b"\t") * max(tabsize, 0)
    if name == "replace" and len(args) >= 2:
        old, new = args[0], args[1]
        count = args[2] if len(args) > 2 else kwargs.get("count", -1)
        n = s.count(old) if old else len(s) + 1
        n = n if count is None or count < 0 else min(n, count)
        return len(s) + n * max(len(new) - len(old), 0)
    if name == "translate" and args and isinstance(args[0], dict):
        longest = max([len(v) for v in args[0].values() if isinstance(v, (str, bytes))] + [1])
        return len(s) * longest
    if name == "join" and args:
        return sum(_text_size(item) for item in args[0]) + max(len(args[0]) - 1, 0) * len(s)
    return None


def _bounded_call(obj, args, kwargs):
    """The checks before a template calls obj(*args, **kwargs) -> the args to call it with (a join's iterable as
    a list, so that it is measured and then used)."""
    owner, name = getattr(obj, "__self__", None), getattr(obj, "__name__", "")
    if isinstance(owner, (str, bytes)):
        if name == "join" and args:
            args = (list(args[0]), *args[1:])
        size = _method_size(owner, name, args, kwargs)
        if size is not None:
            _allow(size, f"the result of {type(owner).__name__}.{name}")
    elif isinstance(owner, int) and name == "to_bytes":
        _allow(args[0] if args and isinstance(args[0], int) else 1, "int.to_bytes")
    elif name == "generate_lorem_ipsum":  # the lipsum() global: n paragraphs of up to max words
        n, most = (list(args) + [5, True, 20, 100])[0], kwargs.get("max", args[3] if len(args) > 3 else 100)
        _allow(n * most * 12 if isinstance(n, int) and isinstance(most, int) else 0, "lipsum()")
    elif obj is _strftime_now and args and isinstance(args[0], str) and re.search(r"%[-_0^#]*\d{4,}", args[0]):
        raise _OverBound(f"strftime_now: a width in {args[0][:40]!r} (the limit: 999)")
    return args


def _filter_size(name, value, args, kwargs):
    """The largest result a builtin filter may build from these arguments (None: no larger than its input)."""
    def arg(i, key, default):
        return args[i] if len(args) > i else kwargs.get(key, default)

    if name == "center":
        width = arg(0, "width", 80)
        return max(_text_size(value), width if isinstance(width, int) else 0)
    if name == "indent":
        width = arg(0, "width", 4)
        width = width if isinstance(width, int) else _text_size(width)
        return _text_size(value) * (1 + max(width, 0))
    if name in ("batch", "slice"):
        n = arg(0, "linecount" if name == "batch" else "slices", 1)
        return _shallow(value) + (n if isinstance(n, int) else 0)
    if name == "join":
        sep = arg(0, "d", "")
        return sum(_text_size(item) for item in value) + max(len(value) - 1, 0) * _text_size(sep)
    if name == "replace":
        text = str(value)
        return _method_size(text, "replace", tuple(str(a) for a in args[:2]) + tuple(args[2:3]), kwargs)
    if name == "wordwrap":
        wrapstring = arg(2, "wrapstring", None) or "\n"
        return _text_size(value) * (1 + len(str(wrapstring)))
    if name == "urlize":
        extra = sum(_text_size(v) for v in (*args, *kwargs.values()))
        return _text_size(value) * (1 + extra)
    if name == "tojson":  # Jinja's own (the judges' environment); the chat templates' _tojson bounds itself
        indent = arg(0, "indent", None)
        indent = len(indent) if isinstance(indent, str) else indent or 0
        if indent > MAX_FORMAT_WIDTH:
            raise _OverBound(f"tojson: an indent of {indent} (the limit: {MAX_FORMAT_WIDTH})")
        return _json_size(value, indent)
    if name == "sum":  # sum of lists: each step copies what is summed so far
        items = list(value)
        return len(items) * sum(_shallow(item) for item in items)
    return None


_STRINGIFYING = {"string", "e", "escape", "forceescape", "upper", "lower", "title", "capitalize", "trim",
                 "striptags", "wordcount", "urlencode", "safe", "pprint", "center", "indent", "replace", "wordwrap",
                 "truncate", "format", "urlize", "join"}


def _bounded_filter(name, f):
    """A builtin filter that first checks what it may build (the filter itself is Jinja's, unchanged)."""
    pass_arg = jinja2.utils._PassArg.from_obj(f)

    @functools.wraps(f)
    def bounded(*args, **kwargs):
        if getattr(_render, "state", None) is None:  # Jinja folding a constant while compiling: never
            raise _OverBound(f"|{name} outside a render")
        lead, (value, *rest) = (args[:1], args[1:]) if pass_arg is not None else ((), args)
        if name in ("join", "sum") and not isinstance(value, (str, list, tuple, dict)):
            value = list(value)  # a generator: measured once, then filtered
        if name in _STRINGIFYING:
            _allow(_text_size(value), f"the text of |{name}'s input")
        if name == "format":
            _check_printf(value, (tuple(rest), kwargs), "the format filter")
        size = _filter_size(name, value, rest, kwargs)
        if size is not None:
            _allow(size, f"the result of |{name}")
        result = f(*lead, value, *rest, **kwargs)
        _spend(_shallow(result))
        return result

    return bounded


class _BoundedCodeGenerator(CodeGenerator):
    """Jinja's code generator with every `for` loop's iterable passed through environment.bounded_iter (the
    deadline and MAX_WORK, one unit a step), `~` through environment.bounded_concat (a size checked first), and
    every piece of output, streamed or kept in a block's buffer (`{% set %}`, `{% filter %}`, a macro's body),
    through environment.counted: its characters count against MAX_WORK, so no buffer outgrows it."""

    def _output_const_repr(self, group):
        return f"environment.counted({super()._output_const_repr(group)})"

    def _output_child_pre(self, node, frame, finalize):
        self.write("environment.counted(")
        super()._output_child_pre(node, frame, finalize)

    def _output_child_post(self, node, frame, finalize):
        super()._output_child_post(node, frame, finalize)
        self.write(")")

    def visit_For(self, node, frame):
        node.iter = jinja2.nodes.Call(jinja2.nodes.EnvironmentAttribute("bounded_iter"), [node.iter], [], None, None,
                                      lineno=node.lineno)
        super().visit_For(node, frame)

    def visit_Concat(self, node, frame):
        self.write("environment.bounded_concat((")
        for part in node.nodes:
            self.visit(part, frame)
            self.write(", ")
        self.write("))")


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    """transformers' sandbox (ImmutableSandboxedEnvironment) with the bounds of the module docstring."""

    code_generator_class = _BoundedCodeGenerator
    intercepted_binops = frozenset(["+", "-", "*", "/", "//", "%", "**"])  # intercepted: never folded at compile

    def call_binop(self, context, operator, left, right):
        if operator in ("*", "**", "+", "%"):  # the others cannot build more than their operands
            _check_binop(operator, left, right)
        result = self.binop_table[operator](left, right)
        if isinstance(result, (str, bytes, list, tuple)):
            _spend(len(result))
        return result

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (Jinja's own signature)
        args = _bounded_call(__obj, args, kwargs)
        result = super().call(__context, __obj, *args, **kwargs)
        _spend(_shallow(result))
        return result

    def wrap_str_format(self, value):
        wrapper = super().wrap_str_format(value)
        if wrapper is None:
            return None

        def bounded(*args, **kwargs):
            _check_format(value.__self__, args, kwargs)
            return wrapper(*args, **kwargs)

        return bounded

    @staticmethod
    def bounded_iter(iterable):
        for item in iterable:
            _spend(1)
            yield item

    @staticmethod
    def counted(text):
        _spend(len(text))
        return text

    @staticmethod
    def bounded_concat(parts):
        _allow(sum(_text_size(part) for part in parts), "a concatenation (~)")
        return "".join(map(str, parts))


@jinja2.pass_context
def _finalize(context, value):
    """Every {{ output }}: its text checked before it is written. Needing the context, it is never run while
    compiling, so no output is folded into a constant."""
    if not isinstance(value, str):
        _allow(_text_size(value), "an output")
    return value


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for transformers' assistant-token masks;
    here it renders its body unchanged (the mask is not computed)."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """Jinja's namespace(), refusing underscore-prefixed attributes (no way to CPython internals)."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore-prefixed attributes ({name!r})")


class _Dict:
    """`dict(...)` in templates, without exposing the dict type itself."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # unlike Jinja's own tojson: no HTML escaping, and the json.dumps options; written piece by piece, so that a value
    # reached many times over (a list of 10^4 references to one long string) stops at MAX_TEXT, never built whole
    width = len(indent) if isinstance(indent, str) else indent or 0
    if width > MAX_FORMAT_WIDTH:
        raise _OverBound(f"tojson: an indent of {width} (the limit: {MAX_FORMAT_WIDTH})")
    encoder = json.JSONEncoder(ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    pieces, size = [], 0
    for piece in encoder.iterencode(x):
        size += len(piece)
        if size > MAX_TEXT:
            raise _OverBound(f"tojson would write over {MAX_TEXT} characters (MAX_TEXT)")
        pieces.append(piece)
    _spend(size)
    return "".join(pieces)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


def bounded_environment(**options) -> jinja2.Environment:
    """A sandboxed Jinja environment (ImmutableSandboxedEnvironment) that evaluates nothing while compiling and
    renders under the bounds of the module docstring, through render_bounded. The judges' templates use it too."""
    env = _BoundedEnvironment(optimized=False, finalize=_finalize, **options)
    for name, f in list(env.filters.items()):
        env.filters[name] = _bounded_filter(name, f)
    return env


@lru_cache
def compile_chat_template(template: str) -> jinja2.Template:
    """The template compiled, nothing in it evaluated (see the module docstring)."""
    if len(template) > MAX_TEMPLATE_CHARS:
        raise ChatTemplateError(f"a chat template of {len(template)} characters, over the limit of "
                                f"{MAX_TEMPLATE_CHARS} (MAX_TEMPLATE_CHARS)")
    env = bounded_environment(trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _Dict()
    env.globals["namespace"] = _Namespace
    return env.from_string(template)


def _plain(value):
    """A copy made of JSON types only (what transformers lets a template see); anything else -> "<TypeName>"."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if hasattr(value, "item") and callable(value.item):  # numpy / torch scalars
        return _plain(value.item())
    return f"<{type(value).__name__}>"


def _prepare(messages):
    chat = []
    for message in messages:
        if not isinstance(message, dict):
            raise TypeError(f"chat messages must be dicts, got {message!r}")
        message = _plain({k: v for k, v in message.items() if v is not None})
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        chat.append(message)
    return chat


def render_chat_template(template: str, messages, *, add_generation_prompt=False, continue_final_message=False,
                         tools=None, special_tokens=None, where=None, **template_kwargs) -> str:
    """One conversation (a list of {"role", "content", ...} dicts) -> the prompt text.

    special_tokens: {"bos_token": ..., "eos_token": ...} as the tokenizer names them; template_kwargs: any
    other template variable (documents=[...], enable_thinking=False, ...; documents is None when not given, as in
    transformers, the others undefined). continue_final_message: leave the last message
    open (True, or the name of the field to continue), as transformers does. where: the template's file (and
    key), named by a ChatTemplateError when the render goes past its bounds."""
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be set")
    if tools is not None and not all(isinstance(t, dict) for t in tools):
        raise TypeError("tools must be JSON-schema dicts (transformers' conversion of Python functions is not copied)")
    chat = _prepare(messages)
    tag = "CONTINUE_FINAL_MESSAGE_TAG "
    if continue_final_message:
        if not chat:
            raise ValueError("continue_final_message is set but the conversation is empty")
        field = continue_final_message if isinstance(continue_final_message, str) else "content"
        final = chat[-1].get(field)
        if final is None:
            raise ValueError(f'continue_final_message: the final message has no "{field}"')
        fields = [field]
        if field in _REASONING_FIELDS:
            fields = [f for f in _REASONING_FIELDS if chat[-1].get(f) == final]
        if not any(f in template for f in fields):
            raise ValueError(f'continue_final_message is set to "{field}", which the chat template never reads')
        if isinstance(final, (list, tuple)):
            for block in reversed(final):
                if "text" in block:
                    final = block["text"]
                    block["text"] = block["text"] + tag
                    break
            else:
                raise ValueError("continue_final_message: no text to continue in the final message")
        else:
            for f in fields:
                chat[-1][f] = chat[-1][f] + tag
    documents = template_kwargs.pop("documents", None)
    variables = {**(special_tokens or {}), **_plain(template_kwargs)}
    text = render_bounded(compile_chat_template(template), dict(
        messages=chat, tools=_plain(tools), documents=_plain(documents), add_generation_prompt=add_generation_prompt,
        **variables), where)
    if continue_final_message:
        if final.strip() not in text or tag.strip() not in text:
            raise ValueError("continue_final_message: the final message does not appear in the rendered chat")
        at = text.rindex(tag.strip())
        text = text[:at] if text[at : at + len(tag)] == tag else text[:at].rstrip()
    return text


def render_bounded(compiled, variables: dict, where=None, what="the chat template") -> str:
    """compiled.render(**variables) under the render's bounds (MAX_WORK, RENDER_DEADLINE_S, an output of MAX_TEXT);
    compiled: from bounded_environment. Past a bound: ChatTemplateError "<where>: <what> <the bound>"."""
    _render.state = [0, time.monotonic() + RENDER_DEADLINE_S]
    try:
        pieces, size = [], 0
        for piece in compiled.generate(variables):
            size += len(piece)
            if size > MAX_TEXT:
                raise _OverBound(f"wrote over {MAX_TEXT} characters (MAX_TEXT)")
            _spend(0)
            pieces.append(piece)
        return "".join(pieces)
    except (_OverBound, RecursionError) as e:
        reason = e if isinstance(e, _OverBound) else "recursed too deeply"
        raise ChatTemplateError(f"{where + ': ' if where else ''}{what} {reason}; it is not rendered") from None
    finally:
        _render.state = None
