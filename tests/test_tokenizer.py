"""ppo_core/models/tokenizer.py and ppo_core/models/chat_template.py against transformers' tokenizer on the same files.

    python -m pytest -q tests/test_tokenizer.py

Nothing can be downloaded, so the checkpoint files are written here: a byte-level BPE tokenizer trained with the
`tokenizers` library, and Qwen3-style (with the `enable_thinking` switch) and Llama-3-style chat templates.
Rendering must be byte-identical to transformers' apply_chat_template, and the token ids identical.
"""
import json
import os
import shutil

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from ppo_core import CheckpointError, load_tokenizer
from ppo_core.models.chat_template import render_chat_template

transformers = pytest.importorskip("transformers")

QWEN3_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>"]
LLAMA3_SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]

# The structure of Qwen3's template (tokenizer_config.json of Qwen/Qwen3-*): tools, multi-step tool detection with
# a reversed loop and a namespace, <think> splitting of assistant turns, and the enable_thinking switch.
QWEN3_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""

# Llama-3.1/3.2 style: bos_token, strftime_now for the date, trimmed contents, raise_exception, non-"-" tags that
# rely on trim_blocks / lstrip_blocks, and a {% generation %} block.
LLAMA3_TEMPLATE = """{{- bos_token }}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{% for message in messages %}
    {% if message['role'] not in ['user', 'assistant'] %}
        {{ raise_exception('Only user and assistant roles are supported after the system message, got ' + message['role']) }}
    {% endif %}
    {% if message['role'] == 'assistant' %}
{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% generation %}{{ message['content'] | trim }}{% endgeneration %}{{ '<|eot_id|>' }}
    {% else %}
{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}
    {% endif %}
    {% if loop.index > 20 %}{% break %}{% endif %}
{% endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

CORPUS = ["The quick brown fox jumps over the lazy dog. Reverse the word 'banana'!",
          "Think step by step: 2 + 2 = 4, so the answer is four.",
          "You are a helpful assistant. What is the capital of France? Paris.",
          "Hello, how are you today? I am fine, thank you; and you?",
          'def add(a, b):\n    return a + b\n\nprint({"name": "add", "arguments": {"a": 1}})']

CONVERSATIONS = [
    [{"role": "user", "content": "Reverse the word 'banana'."}],
    [{"role": "system", "content": "You are a helpful assistant.  "},
     {"role": "user", "content": "What is 2 + 2?"},
     {"role": "assistant", "content": "<think>\nsmall sum\n</think>\n\nIt is 4."},
     {"role": "user", "content": "And 3 + 3?"}],
    [{"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello!", "reasoning_content": "greet back"},
     {"role": "user", "content": "Bye", "name": None}],
]


def write_tokenizer(path, special, config, template_file=None):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer=trainer)
    os.makedirs(path, exist_ok=True)
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", **config}, f)
    if template_file is not None:
        with open(os.path.join(path, "chat_template.jinja"), "w") as f:
            f.write(template_file)
    return str(path)


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    return write_tokenizer(tmp_path_factory.mktemp("qwen3"), QWEN3_SPECIAL, {
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None, "chat_template": QWEN3_TEMPLATE})


@pytest.fixture(scope="module")
def llama3_dir(tmp_path_factory):
    # the template in chat_template.jinja (transformers 5 layout); special tokens as AddedToken dicts
    return write_tokenizer(tmp_path_factory.mktemp("llama3"), LLAMA3_SPECIAL, {
        "bos_token": {"__type": "AddedToken", "content": "<|begin_of_text|>", "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": True},
        "eos_token": "<|eot_id|>"}, template_file=LLAMA3_TEMPLATE)


def both(path):
    return load_tokenizer(path), transformers.AutoTokenizer.from_pretrained(path)


@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}, {"enable_thinking": True}])
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_qwen3_template_byte_identical(qwen3_dir, kwargs, generation_prompt):
    ours, ref = both(qwen3_dir)
    for chat in CONVERSATIONS:
        text = ours.apply_chat_template(chat, add_generation_prompt=generation_prompt, tokenize=False, **kwargs)
        expected = ref.apply_chat_template(chat, add_generation_prompt=generation_prompt, tokenize=False, **kwargs)
        assert text == expected
        assert ours.apply_chat_template(chat, add_generation_prompt=generation_prompt, **kwargs) == \
            ref.apply_chat_template(chat, add_generation_prompt=generation_prompt, return_dict=False, **kwargs)
    if kwargs.get("enable_thinking") is False and generation_prompt:
        assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_qwen3_template_with_tools_and_tool_calls(qwen3_dir):
    ours, ref = both(qwen3_dir)
    tools = [{"type": "function", "function": {"name": "add", "description": "Add <two> numbers & more",
                                               "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}]
    chat = [{"role": "user", "content": "add 1 and 2"},
            {"role": "assistant", "content": "", "tool_calls": [{"type": "function",
                                                               "function": {"name": "add", "arguments": {"a": 1, "b": "é"}}}]},
            {"role": "tool", "content": "3"}]
    text = ours.apply_chat_template(chat, tools=tools, add_generation_prompt=True, tokenize=False)
    assert text == ref.apply_chat_template(chat, tools=tools, add_generation_prompt=True, tokenize=False)
    assert "<two> numbers & more" in text and '"b": "é"' in text  # tojson: no HTML escaping, no ASCII escaping


def test_llama3_template_from_jinja_file(llama3_dir):
    ours, ref = both(llama3_dir)
    assert ours.bos_token == "<|begin_of_text|>" and ours.eos_token_id == ours.token_to_id("<|eot_id|>")
    for chat in CONVERSATIONS[:2]:
        for gen in (True, False):
            text = ours.apply_chat_template(chat, add_generation_prompt=gen, tokenize=False)
            assert text == ref.apply_chat_template(chat, add_generation_prompt=gen, tokenize=False)
            assert ours.encode(text) == ref.encode(text, add_special_tokens=False)
        assert ours.apply_chat_template(chat, tokenize=False, date_string="1 Jan 2026") == \
            ref.apply_chat_template(chat, tokenize=False, date_string="1 Jan 2026")
    bad = [{"role": "user", "content": "hi"}, {"role": "tool", "content": "x"}]
    with pytest.raises(Exception, match="Only user and assistant roles"):
        ours.apply_chat_template(bad, tokenize=False)
    with pytest.raises(Exception, match="Only user and assistant roles"):
        ref.apply_chat_template(bad, tokenize=False)


def test_continue_final_message_and_batches(qwen3_dir):
    ours, ref = both(qwen3_dir)
    chat = [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "1, 2, "}]
    assert ours.apply_chat_template(chat, continue_final_message=True, tokenize=False) == \
        ref.apply_chat_template(chat, continue_final_message=True, tokenize=False)
    assert ours.apply_chat_template(CONVERSATIONS, add_generation_prompt=True, tokenize=False) == \
        ref.apply_chat_template(CONVERSATIONS, add_generation_prompt=True, tokenize=False)


def test_special_tokens_and_template_sources(tmp_path, qwen3_dir):
    ours, ref = both(qwen3_dir)
    assert ours.special_tokens_map == ref.special_tokens_map
    assert ours.eos_token_id == ref.eos_token_id and ours.pad_token_id == ref.pad_token_id
    ids = ours.encode("Reverse the word <|im_end|> banana")
    assert ids == ref.encode("Reverse the word <|im_end|> banana", add_special_tokens=False)
    assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids, skip_special_tokens=False)
    # named templates (tokenizer_config list form): "default" unless asked, "tool_use" with tools
    path = write_tokenizer(tmp_path / "multi", QWEN3_SPECIAL, {
        "eos_token": "<|im_end|>", "chat_template": [{"name": "default", "template": "D{{ messages[0].content }}"},
                                                     {"name": "tool_use", "template": "T{{ tools | length }}"}]})
    ours, ref = both(path)
    chat = CONVERSATIONS[0]
    for kw in ({}, {"tools": [{"name": "f"}]}, {"chat_template": "tool_use", "tools": []}, {"chat_template": "X{{ eos_token }}"}):
        assert ours.apply_chat_template(chat, tokenize=False, **kw) == ref.apply_chat_template(chat, tokenize=False, **kw)
    # chat_template.jinja wins over tokenizer_config.json; the legacy special_tokens_map.json fills gaps
    path = write_tokenizer(tmp_path / "file", QWEN3_SPECIAL, {"chat_template": "config"}, template_file="file{{ eos_token }}")
    with open(os.path.join(path, "special_tokens_map.json"), "w") as f:
        json.dump({"eos_token": "<|im_end|>"}, f)
    ours, ref = both(path)
    assert ours.eos_token == ref.eos_token == "<|im_end|>"
    assert ours.apply_chat_template(chat, tokenize=False) == ref.apply_chat_template(chat, tokenize=False) == "file<|im_end|>"


def test_sandbox_rules():
    assert render_chat_template("{% set ns = namespace(a=1) %}{% set ns.a = 2 %}{{ ns.a }}", []) == "2"
    with pytest.raises(Exception, match="underscore"):
        render_chat_template("{% set ns = namespace(_a=1) %}", [])
    with pytest.raises(Exception):  # the sandbox: no attribute walk to Python internals
        render_chat_template("{{ messages.__class__.__mro__ }}", [])
    assert render_chat_template("{{ dict(a=1) | tojson }}", []) == '{"a": 1}'


def test_save_pretrained_round_trip(tmp_path, llama3_dir):
    tok = load_tokenizer(llama3_dir)
    tok.save_pretrained(str(tmp_path))
    again = load_tokenizer(str(tmp_path))
    chat = CONVERSATIONS[1]
    assert again.apply_chat_template(chat, tokenize=False) == tok.apply_chat_template(chat, tokenize=False)
    assert again.special_tokens_map == tok.special_tokens_map


# ---------------------------------------------------------------------------- stop tokens: generation_config.json

def with_generation_config(src, dst, generation_config):
    """A copy of the tokenizer directory `src` with generation_config.json (a dict is written as JSON, a str as is)."""
    shutil.copytree(src, dst)
    with open(os.path.join(dst, "generation_config.json"), "w") as f:
        f.write(generation_config if isinstance(generation_config, str) else json.dumps(generation_config))
    return str(dst)


def test_generation_config_eos_ids_join_the_tokenizers_eos(tmp_path, qwen3_dir):
    """Qwen3's layout: eos_token <|im_end|> in tokenizer_config.json, generation_config.json lists <|endoftext|> and
    <|im_end|>. eos_token_ids = the tokenizer's EOS first, then the file's ids in order, each once; as a set, what
    transformers' generate stops at (its GenerationConfig's eos_token_id, plus the tokenizer's)."""
    plain = load_tokenizer(qwen3_dir)
    im_end, endoftext = plain.token_to_id("<|im_end|>"), plain.token_to_id("<|endoftext|>")
    assert plain.eos_token_ids == [im_end] and plain.generation_config is None  # no file: the tokenizer's EOS alone
    generation_config = {"bos_token_id": endoftext, "do_sample": True, "eos_token_id": [endoftext, im_end],
                         "pad_token_id": endoftext, "temperature": 0.6, "top_k": 20, "top_p": 0.95}
    path = with_generation_config(qwen3_dir, tmp_path / "list", generation_config)
    ours = load_tokenizer(path)
    assert ours.eos_token_ids == [im_end, endoftext]
    assert ours.eos_token_id == im_end and ours.pad_token_id == endoftext  # unchanged
    reference = transformers.GenerationConfig.from_pretrained(path)
    reference_eos = transformers.AutoTokenizer.from_pretrained(path).eos_token_id
    assert set(ours.eos_token_ids) == set(reference.eos_token_id) | {reference_eos}
    # an int, and a tokenizer without an eos_token: the file's ids alone
    single = load_tokenizer(with_generation_config(qwen3_dir, tmp_path / "int", {"eos_token_id": endoftext}))
    assert single.eos_token_ids == [im_end, endoftext]
    no_eos_dir = write_tokenizer(tmp_path / "no_eos", QWEN3_SPECIAL, {})
    no_eos = load_tokenizer(with_generation_config(no_eos_dir, tmp_path / "no_eos_gc",
                                                   {"eos_token_id": [endoftext, im_end, endoftext]}))
    assert no_eos.eos_token_id is None and no_eos.eos_token_ids == [endoftext, im_end]
    null = load_tokenizer(with_generation_config(qwen3_dir, tmp_path / "null", {"eos_token_id": None}))
    assert null.eos_token_ids == [im_end]


def test_save_pretrained_keeps_generation_config(tmp_path, qwen3_dir):
    """The saved directory has the same generation_config.json (every key, in its order) and the same stop ids."""
    generation_config = {"top_p": 0.95, "eos_token_id": [7, 3], "do_sample": True, "transformers_version": "4.51.0"}
    tok = load_tokenizer(with_generation_config(qwen3_dir, tmp_path / "src", generation_config))
    tok.save_pretrained(str(tmp_path / "out"))
    with open(tmp_path / "out" / "generation_config.json") as f:
        saved = json.load(f)
    assert saved == generation_config and list(saved) == list(generation_config)
    again = load_tokenizer(str(tmp_path / "out"))
    assert again.eos_token_ids == tok.eos_token_ids == [tok.token_to_id("<|im_end|>"), 7, 3]
    # a tokenizer read without one writes none
    load_tokenizer(qwen3_dir).save_pretrained(str(tmp_path / "bare"))
    assert not os.path.exists(tmp_path / "bare" / "generation_config.json")


@pytest.mark.parametrize("content, message", [
    ("{not json", "generation_config.json: not valid JSON"),
    ("[1, 2]", "generation_config.json: expected a JSON object, got list"),
    ({"eos_token_id": "<|im_end|>"}, "generation_config.json: eos_token_id must be a token id or a list of token ids"),
    ({"eos_token_id": [1, "2"]}, "eos_token_id must be a token id"),
    ({"eos_token_id": [1, -1]}, "eos_token_id must be a token id"),
    ({"eos_token_id": True}, "eos_token_id must be a token id"),
])
def test_malformed_generation_config_is_a_checkpoint_error(tmp_path, qwen3_dir, content, message):
    with pytest.raises(CheckpointError, match=message):
        load_tokenizer(with_generation_config(qwen3_dir, tmp_path / "bad", content))


# ---------------------------------------------------------------------------- encode_prompt: the post-processor

WORDS = {"<unk>": 0, "<s>": 1, "</s>": 2, "reverse": 3, "the": 4, "word": 5, "banana": 6, "=": 7}


def write_word_level(path, post_processor, config=None):
    """A WordLevel tokenizer over WORDS with an optional post_processor, and its tokenizer_config.json."""
    tok = Tokenizer(models.WordLevel(WORDS, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    if post_processor is not None:
        tok.post_processor = post_processor
    os.makedirs(path, exist_ok=True)
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
                   "unk_token": "<unk>", **(config or {})}, f)
    return str(path)


BOS_TEMPLATE = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])


@pytest.mark.parametrize("post_processor, config, added", [
    (BOS_TEMPLATE, None, ([1], [])),  # Llama-family: BOS in front
    (processors.TemplateProcessing(single="<s> $A </s>", special_tokens=[("<s>", 1), ("</s>", 2)]), None, ([1], [2])),
    (None, None, ([], [])),  # no post_processor: the plain encoding
    # transformers 5 drops add_bos_token when a tokenizer.json exists: the post_processor alone decides
    (None, {"add_bos_token": True}, ([], [])),
    (BOS_TEMPLATE, {"add_bos_token": False}, ([1], [])),
], ids=["bos", "bos_and_eos", "none", "add_bos_token_without_template", "template_despite_add_bos_token_false"])
def test_encode_prompt_is_transformers_tokenizer_call(tmp_path, post_processor, config, added):
    path = write_word_level(tmp_path / "tok", post_processor, config)
    ours = load_tokenizer(path)
    for ref in (transformers.AutoTokenizer.from_pretrained(path),
                transformers.PreTrainedTokenizerFast.from_pretrained(path)):
        for text in ("reverse the word banana =", "banana", "the <s> word"):
            assert ours.encode_prompt(text) == ref(text)["input_ids"], (text, type(ref).__name__)
    before, after = added
    assert ours.encode_prompt("reverse the word banana =") == before + [3, 4, 5, 6, 7] + after
    assert ours.encode("reverse the word banana =") == [3, 4, 5, 6, 7]  # encode adds nothing, whatever the template


def test_encode_prompt_of_a_byte_level_tokenizer(tmp_path):
    """Qwen-style: a ByteLevel post_processor adds no token, so encode_prompt is encode, as in transformers."""
    path = write_tokenizer(tmp_path / "qwen", QWEN3_SPECIAL, {"eos_token": "<|im_end|>"})
    with open(os.path.join(path, "tokenizer.json")) as f:
        spec = json.load(f)
    spec["post_processor"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    with open(os.path.join(path, "tokenizer.json"), "w") as f:
        json.dump(spec, f)
    ours, ref = both(path)
    text = "Reverse the word 'banana'!"
    assert ours.encode_prompt(text) == ref(text)["input_ids"] == ours.encode(text)
