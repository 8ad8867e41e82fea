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
"""
import json
from datetime import datetime
from functools import lru_cache

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


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
    # unlike Jinja's own tojson: no HTML escaping, and the json.dumps options
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


@lru_cache
def compile_chat_template(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
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
                         tools=None, documents=None, special_tokens=None, **template_kwargs) -> str:
    """One conversation (a list of {"role", "content", ...} dicts) -> the prompt text.

    special_tokens: {"bos_token": ..., "eos_token": ...} as the tokenizer names them; template_kwargs: any
    other template variable (enable_thinking=False, ...). continue_final_message: leave the last message
    open (True, or the name of the field to continue), as transformers does."""
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
    variables = {**(special_tokens or {}), **_plain(template_kwargs)}
    text = compile_chat_template(template).render(messages=chat, tools=_plain(tools), documents=_plain(documents),
                                                  add_generation_prompt=add_generation_prompt, **variables)
    if continue_final_message:
        if final.strip() not in text or tag.strip() not in text:
            raise ValueError("continue_final_message: the final message does not appear in the rendered chat")
        at = text.rindex(tag.strip())
        text = text[:at] if text[at : at + len(tag)] == tag else text[:at].rstrip()
    return text
