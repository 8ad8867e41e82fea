"""The tokenizer: `tokenizer.json` (+ `tokenizer_config.json`) read with the `tokenizers` library.

    tok = load_tokenizer("checkpoints/reverse-demo")
    ids = tok.encode("abc=")            # list[int], no special tokens added
    tok.decode(ids), tok.eos_token_id, tok.pad_token_id
"""
import json
import os

from tokenizers import Tokenizer as _HFTokenizer


class Tokenizer:
    """A thin wrapper that knows the special tokens of its checkpoint."""

    def __init__(self, tokenizer: _HFTokenizer, config: dict):
        self.backend = tokenizer
        self.config = config
        self.eos_token = _token_str(config.get("eos_token"))
        self.pad_token = _token_str(config.get("pad_token")) or self.eos_token
        self.bos_token = _token_str(config.get("bos_token"))
        self.eos_token_id = self.token_to_id(self.eos_token)
        self.pad_token_id = self.token_to_id(self.pad_token)
        self.bos_token_id = self.token_to_id(self.bos_token)

    @property
    def vocab_size(self):
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token):
        return None if token is None else self.backend.token_to_id(token)

    def encode(self, text, add_special_tokens=False):
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens=True):
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def save_pretrained(self, out_dir):
        os.makedirs(out_dir, exist_ok=True)
        self.backend.save(os.path.join(out_dir, "tokenizer.json"))
        with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
            json.dump(self.config, f, indent=2, sort_keys=True)
            f.write("\n")


def _token_str(tok):
    # tokenizer_config.json stores special tokens either as strings or as AddedToken dicts
    if isinstance(tok, dict):
        return tok.get("content")
    return tok


def load_tokenizer(path) -> Tokenizer:
    tok_file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(tok_file):
        raise FileNotFoundError(f"no tokenizer.json in {path!r}")
    config = {}
    cfg_file = os.path.join(path, "tokenizer_config.json")
    if os.path.isfile(cfg_file):
        with open(cfg_file) as f:
            config = json.load(f)
    return Tokenizer(_HFTokenizer.from_file(tok_file), config)
