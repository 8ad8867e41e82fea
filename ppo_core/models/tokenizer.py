"""The tokenizer: `tokenizer.json` + `tokenizer_config.json` (+ the chat template) read with the `tokenizers`
library, behaving as transformers' tokenizer on the same files.

    tok = load_tokenizer("checkpoints/reverse-demo")
    ids = tok.encode("abc=")            # list[int], no special tokens added
    ids = tok.encode_prompt("abc=")     # = transformers' tok("abc=")["input_ids"]: BOS where the template adds one
    tok.decode(ids), tok.eos_token_id, tok.pad_token_id, tok.eos_token_ids
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, enable_thinking=False)

Text a tokenizer without an unknown token cannot encode (a character its vocabulary lacks) raises UnknownTextError,
one line naming the character, where the tokenizers library raises "WordLevel error: Missing [UNK] token".

Special tokens come from tokenizer_config.json (strings or AddedToken dicts), else from the legacy
special_tokens_map.json. The chat template comes from chat_template.jinja (+ additional_chat_templates/*.jinja),
which wins over the "chat_template" entry of tokenizer_config.json, as in transformers 5.

Stop tokens: a chat model often ends a turn with a token other than the tokenizer's eos_token (Llama 3:
<|eot_id|> beside <|end_of_text|>; Qwen: <|im_end|> and <|endoftext|>). transformers' generate stops at every id
of generation_config.json's "eos_token_id" (an int or a list); `eos_token_ids` holds the tokenizer's eos_token_id
and those, and save_pretrained writes generation_config.json back so that a saved policy keeps them.
"""
import contextlib
import json
import os
import sys
import tempfile

import jinja2
from tokenizers import Tokenizer as _HFTokenizer

from .chat_template import ChatTemplateError, compile_chat_template, render_chat_template
from .model import CheckpointError, checkpoint_dir, read_json_object

# the named special tokens transformers passes to a chat template (`special_tokens_map`)
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class UnknownTextError(ValueError):
    """Text holding a piece (for a character vocabulary, a character) that the vocabulary lacks, in a tokenizer
    without an unknown token to stand for it (a WordLevel model whose unk_token is not in its vocabulary, as the
    demo checkpoints' character tokenizers). Byte-level and byte-fallback tokenizers encode any text and never
    raise it. The message is one line naming the piece."""


class Tokenizer:
    """A thin wrapper that knows the special tokens and the chat template of its checkpoint."""

    def __init__(self, tokenizer: _HFTokenizer, config: dict, chat_template=None, generation_config=None,
                 template_origins=None, source=None):
        self.backend = tokenizer
        self.source = source or "tokenizer.json"  # the file read, which an error names
        self.config = config
        self.special_tokens_map = _special_tokens_map(config)
        """name -> token string, only the tokens the config sets (what chat templates see)."""
        self.eos_token = self.special_tokens_map.get("eos_token")
        # Without a pad token, pad with EOS (the usual choice; transformers would leave pad_token None).
        self.pad_token = self.special_tokens_map.get("pad_token") or self.eos_token
        self.bos_token = self.special_tokens_map.get("bos_token")
        self.eos_token_id = self.token_to_id(self.eos_token)
        self.pad_token_id = self.token_to_id(self.pad_token)
        self.bos_token_id = self.token_to_id(self.bos_token)
        self.generation_config = generation_config
        """generation_config.json as read (a dict, kept whole for save_pretrained), or None without one."""
        self.eos_token_ids = _stop_token_ids(self.eos_token_id, generation_config)
        """Every id that ends a response: eos_token_id first (when set), then generation_config.json's
        "eos_token_id" entries in their order, each once. What generate(eos_token_id=...) should stop at."""
        self.chat_template = chat_template if chat_template is not None else config.get("chat_template")
        if isinstance(self.chat_template, (list, tuple)):  # [{"name", "template"}] -> {name: template}
            self.chat_template = {t["name"]: t["template"] for t in self.chat_template}
        self.template_origins = template_origins or {}
        """template text -> where it was read (a file, and its key), named when a render goes past its bounds."""

    @property
    def vocab_size(self):
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token):
        return None if token is None else self.backend.token_to_id(token)

    def encode(self, text, add_special_tokens=False):
        try:
            return self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        except Exception:  # the tokenizers library raises a bare Exception ("WordLevel error: Missing [UNK] token ...")
            unknown = _unknown_text_error(self.backend, text)
            if unknown is None:
                raise
            raise unknown from None
        except BaseException as e:  # the library's Rust code panicked: pyo3's PanicException is no Exception
            if type(e).__name__ != "PanicException":
                raise
            reason = " ".join(str(e).split())[:200]
            hint = "; its pre-tokenizer's regex backtracks past the regex engine's limit" if "Regex" in reason else ""
            raise CheckpointError(f"{self.source}: the tokenizers library failed encoding a text of {len(text)} "
                                  f"characters ({reason}){hint}") from None

    def encode_prompt(self, text) -> list:
        """The ids of transformers' `tokenizer(text)["input_ids"]`: `text` encoded, then tokenizer.json's
        post_processor applied (add_special_tokens=True). A TemplateProcessing "<s> $A" (Llama-family checkpoints)
        puts the BOS in front; a template "$A </s>" appends an EOS as well, exactly as transformers does; no
        post_processor, or one that adds no token (ByteLevel, Qwen's), gives encode(text).

        For a prompt that does not go through a chat template (a template writes its own BOS, and its text is
        encoded with encode). transformers 5 ignores tokenizer_config.json's add_bos_token / add_eos_token when
        a tokenizer.json exists: the post_processor alone decides, here as there."""
        return self.encode(text, add_special_tokens=True)

    def decode(self, ids, skip_special_tokens=True):
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def get_chat_template(self, chat_template=None, tools=None) -> str:
        """The template string: `chat_template` itself, or the name of one of the checkpoint's templates, or
        the checkpoint's ("tool_use" when tools are given and it exists, else "default")."""
        templates = self.chat_template
        if isinstance(templates, dict):
            if chat_template in templates:
                return templates[chat_template]
            if chat_template is None:
                if tools is not None and "tool_use" in templates:
                    return templates["tool_use"]
                if "default" in templates:
                    return templates["default"]
                raise ValueError(f"this tokenizer has several chat templates and no default: pass one of "
                                 f"{sorted(templates)} as chat_template")
        if chat_template is not None:
            return chat_template
        if templates is None:
            raise ValueError("this tokenizer has no chat template (tokenizer_config.json 'chat_template' or "
                             "chat_template.jinja); pass one as chat_template")
        return templates

    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=True, *, tools=None,
                            documents=None, chat_template=None, continue_final_message=False, **template_kwargs):
        """Render `messages` with the checkpoint's chat template exactly as transformers' apply_chat_template
        (see ppo_core/models/chat_template.py) -> the text (tokenize=False) or its token ids, encoded without adding
        special tokens (transformers 5 returns a BatchEncoding by default; this returns list[int]). A list of
        conversations gives a list of results. template_kwargs reach the template (enable_thinking=False, ...)."""
        template = self.get_chat_template(chat_template, tools)
        batched = bool(messages) and isinstance(messages[0], (list, tuple))
        texts = [render_chat_template(template, chat, add_generation_prompt=add_generation_prompt, tools=tools,
                                      documents=documents, continue_final_message=continue_final_message,
                                      special_tokens=self.special_tokens_map,
                                      where=self.template_origins.get(template), **template_kwargs)
                 for chat in (messages if batched else [messages])]
        out = [self.encode(t) for t in texts] if tokenize else texts
        return out if batched else out[0]

    def save_pretrained(self, out_dir):
        os.makedirs(out_dir, exist_ok=True)
        self.backend.save(os.path.join(out_dir, "tokenizer.json"))
        config = dict(self.config)
        if isinstance(self.chat_template, str):
            config["chat_template"] = self.chat_template
        elif isinstance(self.chat_template, dict):
            config["chat_template"] = [{"name": k, "template": v} for k, v in self.chat_template.items()]
        with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)
            f.write("\n")
        if self.generation_config is not None:  # the stop tokens travel with the saved policy
            with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
                json.dump(self.generation_config, f, indent=2)
                f.write("\n")


def _unknown_text_error(backend: _HFTokenizer, text):
    """The UnknownTextError for `text` when backend.encode(text) failed on a piece its model has no token for, else
    None. Only called after a failure, so a tokenizer that encodes everything pays nothing: the text is split as
    encode splits it (added tokens, then the normalizer and the pre-tokenizer) and the pieces are tried one by one."""
    if not isinstance(text, str):
        return None
    special = sorted((t.content for t in backend.get_added_tokens_decoder().values()), key=len, reverse=True)
    segments = [text]
    for token in special:  # added tokens ("<eos>", "<|im_start|>") are matched before the model sees the text
        segments = [part for segment in segments for part in segment.split(token)]
    for segment in segments:
        if backend.normalizer is not None:
            segment = backend.normalizer.normalize_str(segment)
        pieces = backend.pre_tokenizer.pre_tokenize_str(segment) if backend.pre_tokenizer is not None else [(segment, None)]
        for piece, _ in pieces:
            try:
                backend.model.tokenize(piece)
            except Exception:
                shown = f"{piece!r} (U+{ord(piece):04X})" if len(piece) == 1 else repr(piece)
                return UnknownTextError(f"no token for {shown} in the tokenizer's vocabulary, and no unknown token "
                                        f"to stand for it")
    return None


@contextlib.contextmanager
def native_stderr_held():
    """File descriptor 2 held in a temporary file while the block runs, and written back after it, unless the block
    raised a CheckpointError: the message a panic of the tokenizers library's Rust code prints there (a backtrace
    with RUST_BACKTRACE=1), which the error's one line replaces. Python's own sys.stderr writes are kept too."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        replaced = False
        try:
            yield
        except CheckpointError:
            replaced = True
            raise
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            if not replaced:
                held.seek(0)
                while chunk := held.read(1 << 16):
                    os.write(2, chunk)


def _token_str(tok):
    # tokenizer_config.json stores special tokens either as strings or as AddedToken dicts
    if isinstance(tok, dict):
        return tok.get("content")
    return tok


def _special_tokens_map(config: dict) -> dict:
    """The standard named tokens, plus model-specific `*_token` entries (e.g. image_token), as transformers 5
    collects them into `special_tokens_map`."""
    out = {}
    for key, value in config.items():
        if key in SPECIAL_TOKEN_NAMES or (key.endswith("_token") and isinstance(value, (str, dict))):
            if _token_str(value) is not None:
                out[key] = _token_str(value)
    for extra in (config.get("model_specific_special_tokens"), config.get("extra_special_tokens")):
        if isinstance(extra, dict):
            out.update({k: _token_str(v) for k, v in extra.items() if _token_str(v) is not None})
    return out


def _stop_token_ids(eos_token_id, generation_config) -> list:
    """[eos_token_id] (when not None) + generation_config["eos_token_id"] (an int or a list), duplicates dropped."""
    ids = [] if eos_token_id is None else [eos_token_id]
    extra = (generation_config or {}).get("eos_token_id")
    if extra is None:
        extra = []
    elif isinstance(extra, int):
        extra = [extra]
    for token_id in extra:
        if token_id not in ids:
            ids.append(token_id)
    return ids


def read_generation_config(path):
    """generation_config.json of a checkpoint directory as a dict, or None when there is none. Its
    "eos_token_id" must be null, a token id or a list of token ids; anything else is a CheckpointError."""
    file = os.path.join(path, "generation_config.json")
    if not os.path.isfile(file):
        return None
    config = read_json_object(file)
    eos = config.get("eos_token_id")
    ids = [eos] if not isinstance(eos, list) else eos
    if eos is not None and not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise CheckpointError(f"{file}: eos_token_id must be a token id or a list of token ids, got {eos!r}")
    return config


def _read_template(file, origins) -> str:
    """A chat template file's text, compiled once here so that a file that is not UTF-8 or not a Jinja template is
    a CheckpointError naming it (and its line) when the tokenizer loads, not a traceback at the first render."""
    try:
        with open(file, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"cannot read {file} as UTF-8 text ({e})") from None
    return _check_template(text, file, origins)


def _check_template(text, where, origins) -> str:
    """The template compiled (which evaluates nothing in it: ppo_core/models/chat_template.py); origins[text] = where,
    for the error of a render that goes past its bounds."""
    try:
        compile_chat_template(text)
    except jinja2.TemplateSyntaxError as e:
        raise CheckpointError(f"{where}: not a valid Jinja chat template (line {e.lineno}: {e.message})") from None
    except ChatTemplateError as e:
        raise CheckpointError(f"{where}: {e}") from None
    except RecursionError:
        raise CheckpointError(f"{where}: a chat template nested too deeply to compile") from None
    origins[text] = where
    return text


def _check_tokenizer_config(config: dict, file, origins=None):
    """The entries of tokenizer_config.json (or special_tokens_map.json) that the Tokenizer reads: named special
    tokens as strings or {"content": string} dicts, the chat template a string or a list of {"name", "template"}."""
    for key in SPECIAL_TOKEN_NAMES:
        value = config.get(key)
        if value is not None and not isinstance(value if not isinstance(value, dict) else value.get("content"), str):
            raise CheckpointError(f"{file}: '{key}' must be a token string or {{\"content\": string}}, got {value!r}")
    templates = config.get("chat_template")
    if isinstance(templates, str):
        _check_template(templates, f"{file}: 'chat_template'", origins if origins is not None else {})
    elif templates is not None:
        if not (isinstance(templates, list) and all(isinstance(t, dict) and isinstance(t.get("name"), str)
                                                    and isinstance(t.get("template"), str) for t in templates)):
            raise CheckpointError(f"{file}: 'chat_template' must be a string or a list of "
                                  f"{{\"name\", \"template\"}} strings")
        for t in templates:
            _check_template(t["template"], f"{file}: chat_template {t['name']!r}",
                            origins if origins is not None else {})


def load_tokenizer(path) -> Tokenizer:
    """The Tokenizer of a checkpoint directory: tokenizer.json (required), and when present tokenizer_config.json,
    special_tokens_map.json, chat_template.jinja, additional_chat_templates/*.jinja and generation_config.json.
    `~` in `path` is expanded; a path that is not a directory is a CheckpointError ("no such directory: ...")."""
    path = checkpoint_dir(path)
    tok_file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(tok_file):
        raise FileNotFoundError(f"no tokenizer.json in {path!r}")
    config, origins = {}, {}
    cfg_file = os.path.join(path, "tokenizer_config.json")
    if os.path.isfile(cfg_file):
        config = read_json_object(cfg_file)
        _check_tokenizer_config(config, cfg_file, origins)
    # legacy layout: special tokens in special_tokens_map.json (transformers reads it when the config has no
    # added_tokens_decoder; the config's own entries win)
    legacy = os.path.join(path, "special_tokens_map.json")
    if os.path.isfile(legacy) and "added_tokens_decoder" not in config:
        legacy_tokens = read_json_object(legacy)
        _check_tokenizer_config({k: v for k, v in legacy_tokens.items() if k != "chat_template"}, legacy)
        for key, value in legacy_tokens.items():
            if not config.get(key):
                config[key] = value
    # chat_template.jinja and additional_chat_templates/NAME.jinja win over tokenizer_config.json
    templates = {}
    if os.path.isfile(os.path.join(path, "chat_template.jinja")):
        templates["default"] = _read_template(os.path.join(path, "chat_template.jinja"), origins)
    extra_dir = os.path.join(path, "additional_chat_templates")
    if os.path.isdir(extra_dir):
        for name in sorted(os.listdir(extra_dir)):
            if name.endswith(".jinja"):
                templates[name[: -len(".jinja")]] = _read_template(os.path.join(extra_dir, name), origins)
    chat_template = None
    if templates:
        chat_template = templates["default"] if list(templates) == ["default"] else templates
    try:
        backend = _HFTokenizer.from_file(tok_file)
    except Exception as e:  # the tokenizers library raises a bare Exception for a file it cannot parse
        reason = " ".join(str(e).split())[:200]
        raise CheckpointError(f"{tok_file}: not a tokenizer the tokenizers library can read ({reason})") from None
    return Tokenizer(backend, config, chat_template, read_generation_config(path), origins, source=tok_file)
