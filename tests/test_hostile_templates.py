"""Chat templates that try to take the machine (issue 49, finding 5): each is stopped by its bound in a fraction of a
second and a few MB, with one line naming the template's file (ppo_core/models/chat_template.py's module docstring).
An unused `{% if false %}{{ 'a' * 5*10**9 }}{% endif %}` cost 73 s and 10 GB at load (Jinja folds constants while
compiling); now nothing in a template is evaluated while it compiles. The real templates render as transformers does.
Allocations are measured with tracemalloc (the Python heap's peak), the deadline cut to 0.3 s for the suite's time."""
import json
import os
import shutil
import time
import tracemalloc

import pytest

from ppo_core.models import chat_template
from ppo_core.models.chat_template import ChatTemplateError, compile_chat_template, render_chat_template
from ppo_core.models.model import CheckpointError
from ppo_core.models.tokenizer import load_tokenizer
from ppo_core.train import DEMO_CHECKPOINT, main

HOSTILE_BUT_UNUSED = "{% if false %}{{ 'a' * 5*10**9 }}{% endif %}{{ messages[0]['content'] }}"
CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(autouse=True)
def short_deadline(monkeypatch):
    monkeypatch.setattr(chat_template, "RENDER_DEADLINE_S", 0.3)


def measured(fn):
    """fn() -> (its result or the exception it raised, seconds, peak MB of Python allocations meanwhile)."""
    tracemalloc.start()
    t0 = time.monotonic()
    try:
        result = fn()
    except Exception as e:  # the caller asserts which
        result = e
    seconds = time.monotonic() - t0
    peak = tracemalloc.get_traced_memory()[1] / 2**20
    tracemalloc.stop()
    return result, seconds, peak


def test_an_unused_template_costs_nothing_when_it_compiles():
    for template in (HOSTILE_BUT_UNUSED, "{% autoescape 'a'|center(1000000000) %}{% endautoescape %}",
                     "{% autoescape " + " ~ ".join(["'x'|center(3999999)"] * 200) + " %}{% endautoescape %}",
                     "{% if false %}{{ 10**10**10**10 }}{{ {'a': 1}|tojson(indent=1000000000) }}{% endif %}"):
        result, seconds, peak = measured(lambda: compile_chat_template(template))
        assert not isinstance(result, Exception) and seconds < 1.0 and peak < 20, (template[:60], seconds, peak)
    assert render_chat_template(HOSTILE_BUT_UNUSED, CHAT) == "hi"


def test_an_unused_template_in_a_checkpoint_loads_as_fast_as_a_plain_one(tmp_path):
    policy = tmp_path / "policy"
    shutil.copytree(DEMO_CHECKPOINT, policy)
    config = json.loads((policy / "tokenizer_config.json").read_text())
    (policy / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": HOSTILE_BUT_UNUSED}))
    tokenizer, seconds, peak = measured(lambda: load_tokenizer(policy))
    assert seconds < 1.0 and peak < 20, (seconds, peak)
    assert tokenizer.apply_chat_template(CHAT, tokenize=False) == "hi"


# template -> the reason in its error (after "the chat template ")
HOSTILE = {
    "repeat": ("{{ 'a' * 5*10**9 }}",
               "str * 1000000000 would hold 5000000000 characters or items, over the limit of 4000000 (MAX_TEXT)"),
    "nested-loops": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                     "took more than 0.3 s to render (RENDER_DEADLINE_S)"),
    "tojson-indent": ("{{ {'a': 1}|tojson(indent=10**9) }}", "tojson: an indent of 1000000000 (the limit: 10000)"),
    "doubling": ("{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
                 "a concatenation (~) would hold 4194304 characters or items, over the limit of 4000000 (MAX_TEXT)"),
    "doubling-plus": ("{% set ns = namespace(l=[1]) %}{% for i in range(40) %}{% set ns.l = ns.l + ns.l %}{% endfor %}",
                      "a concatenation (+) would hold 4194304 characters or items, over the limit of 4000000 "
                      "(MAX_TEXT)"),
    "center-method": ("{{ 'a'.center(10**9) }}", "the result of str.center would hold 1000000000 characters or items, "
                                                 "over the limit of 4000000 (MAX_TEXT)"),
    "center-filter": ("{{ 'a'|center(1000000000) }}", "the result of |center would hold 1000000000 characters or "
                                                      "items, over the limit of 4000000 (MAX_TEXT)"),
    "replace": ("{% set s = 'a' * 4000 %}{{ s.replace('a', s) }}", "the result of str.replace would hold 16000000 "
                                                                  "characters or items, over the limit of 4000000 "
                                                                  "(MAX_TEXT)"),
    "percent-width": ("{{ '%0999999999d' % 1 }}",
                      "the % operator: a width or precision of '999999999' (the limit: 10000, written out)"),
    "format-width": ("{{ '{:>999999999}'.format(1) }}",
                     "str.format: a width or precision of '999999999' (the limit: 10000, written out)"),
    "join": ("{% set l = ['ab'] * 100000 %}{{ l|join('a' * 1000000) }}",  # 2 * 100000 + 99999 * 10^6
             "the result of |join would hold 99999200000 characters or items, over the limit of 4000000 (MAX_TEXT)"),
    "power": ("{{ 2**1000000 }}", "an integer power over 100000 bits (2 ** 1000000)"),
    "lipsum": ("{{ lipsum(10**6, max=10**6) }}",
               "lipsum() would hold 12000000000000 characters or items, over the limit of 4000000 (MAX_TEXT)"),
    "to-bytes": ("{{ (1).to_bytes(10**9, 'big') }}",
                 "int.to_bytes would hold 1000000000 characters or items, over the limit of 4000000 (MAX_TEXT)"),
    "aliases": ("{% set s = 'a' * 3000000 %}{{ [s, s, s, s, s, s, s, s, s, s] }}",
                "an output would hold 30000100 characters or items, over the limit of 4000000 (MAX_TEXT)"),
    "many-builds": ("{% set s = 'a' * 3000000 %}{% for i in range(100000) %}{% set t = s.upper() %}{% endfor %}",
                    "built more than 64000000 characters and items in one render (MAX_WORK)"),
    "long-output": ("{% for i in range(1000) %}{{ 'x' * 10000 }}{% endfor %}",
                    "wrote over 4000000 characters (MAX_TEXT)"),
    "buffered": ("{% set x %}{% for i in range(100000) %}{% for j in range(100000) %}" + "y" * 10000 +
                 "{% endfor %}{% endfor %}{% endset %}{{ x|length }}",  # kept in a buffer, never streamed
                 "built more than 64000000 characters and items in one render (MAX_WORK)"),
    "macro-body": ("{% macro m() %}{% for i in range(100000) %}{{ 'y' * 10000 }}{% endfor %}{% endmacro %}"
                   "{{ m()|length }}", "built more than 64000000 characters and items in one render (MAX_WORK)"),
    "recursion": ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "recursed too deeply"),
}


@pytest.mark.parametrize("name", HOSTILE)
def test_a_hostile_template_is_one_error_within_its_bounds(name):
    template, reason = HOSTILE[name]
    error, seconds, peak = measured(lambda: render_chat_template(template, CHAT, where="checkpoint/x.jinja"))
    assert isinstance(error, ChatTemplateError), error
    assert str(error) == f"checkpoint/x.jinja: the chat template {reason}; it is not rendered"
    assert seconds < 1.5 and peak < 80, (seconds, peak)


def test_the_error_names_the_file_the_template_came_from(tmp_path):
    policy = tmp_path / "policy"
    shutil.copytree(DEMO_CHECKPOINT, policy)
    (policy / "chat_template.jinja").write_text("{{ 'a' * 5*10**9 }}")
    with pytest.raises(ChatTemplateError) as caught:
        load_tokenizer(policy).apply_chat_template(CHAT, tokenize=False)
    assert str(caught.value).startswith(f"{policy / 'chat_template.jinja'}: the chat template str * 1000000000 ")
    (policy / "chat_template.jinja").unlink()
    config = json.loads((policy / "tokenizer_config.json").read_text())
    (policy / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": [
        {"name": "default", "template": "ok"}, {"name": "tool_use", "template": "{{ 'a'|center(10**9) }}"}]}))
    tokenizer = load_tokenizer(policy)
    assert tokenizer.apply_chat_template(CHAT, tokenize=False) == "ok"
    with pytest.raises(ChatTemplateError, match=f"^{policy / 'tokenizer_config.json'}: chat_template 'tool_use': the "
                                                f"chat template the result of |center would hold 1000000000 "):
        tokenizer.apply_chat_template(CHAT, tools=[{"type": "function"}], tokenize=False)
    (policy / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": "x" * 1_000_001}))
    with pytest.raises(CheckpointError, match=f"^{policy / 'tokenizer_config.json'}: 'chat_template': a chat template "
                                              f"of 1000001 characters, over the limit of 1000000"):
        load_tokenizer(policy)


def test_ppo_train_stops_at_the_first_render_with_one_line(tmp_path, capsys):
    policy = tmp_path / "policy"
    shutil.copytree(DEMO_CHECKPOINT, policy)
    (policy / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content * 10**9 }}{% endfor %}")
    run_dir = tmp_path / "run"
    assert main([f"--policy={policy}", "--chat_template=true", "--iterations=1", "--rollout_batch_size=4",
                 "--n_samples_per_prompt=2", "--eval_size=4", "--max_new_tokens=4", "--progress=false",
                 f"--out={run_dir}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"ppo-train: error: {policy / 'chat_template.jinja'}: the chat template str * 1000000000 "
                          f"would hold "), err


# ---------------------------------------------------------------------------- the real templates, as before


def test_the_shipped_and_tested_templates_render_as_transformers_does(tmp_path):
    transformers = pytest.importorskip("transformers")
    import test_tokenizer  # its Qwen3 and Llama 3 templates, on their own tokenizers

    tools = [{"type": "function", "function": {"name": "add", "description": "a + b", "parameters": {
        "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}}]
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 2}}}]},
            {"role": "tool", "content": "4"}, {"role": "assistant", "content": "4"}, {"role": "user", "content": "ok"}]
    plain = [chat[0], chat[1], chat[4], chat[5]]
    qwen3 = test_tokenizer.write_tokenizer(tmp_path / "qwen3", test_tokenizer.QWEN3_SPECIAL, {
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None,
        "chat_template": test_tokenizer.QWEN3_TEMPLATE})
    llama3 = test_tokenizer.write_tokenizer(tmp_path / "llama3", test_tokenizer.LLAMA3_SPECIAL, {
        "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}, template_file=test_tokenizer.LLAMA3_TEMPLATE)
    demos = [os.path.join(os.path.dirname(DEMO_CHECKPOINT), name) for name in sorted(os.listdir(
        os.path.dirname(DEMO_CHECKPOINT)))]
    with_template = [d for d in demos if load_tokenizer(d).chat_template is not None]
    assert with_template, "a demo checkpoint ships a chat template"
    for path in [*with_template, qwen3, llama3]:
        ours, ref = load_tokenizer(path), transformers.AutoTokenizer.from_pretrained(path)
        for kwargs in ({"tools": tools}, {"enable_thinking": False}, {}):
            for messages in ([chat] if path == qwen3 else []) + [plain, plain[:2]]:
                assert ours.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs) == \
                    ref.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs), path


def test_a_judge_checkpoints_template_is_bounded_too():
    from ppo_core.rewards.judges import JudgeError, compile_judge_template, render_judge_prompt

    template = "{% if false %}{{ 'a' * 5*10**9 }}{{ {'a': 1}|tojson(indent=1000000000) }}{% endif %}{{ prompt }}"
    result, seconds, peak = measured(lambda: compile_judge_template(template))
    assert not isinstance(result, Exception) and seconds < 1.0 and peak < 20, (seconds, peak)
    assert render_judge_prompt(template, prompt="p") == "p"
    for template, reason in [("{{ prompt * 10**9 }}", "str * 1000000000 would hold 1000000000 characters or items"),
                             ("{{ [prompt]|tojson(indent=1000000000) }}", "tojson: an indent of 1000000000 (the "
                                                                           "limit: 10000)")]:
        with pytest.raises(JudgeError) as caught:
            render_judge_prompt(template, prompt="p")
        assert str(caught.value).startswith(f"the judge template {reason}"), caught.value
