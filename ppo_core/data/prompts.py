"""Where prompts come from: prompt files read into rows, and the seeded stream that hands rows to training.

A prompt ROW is a dict with exactly one of
  - "prompt":   str, the prompt text as the policy sees it (or, with `chat_template`, as a one-turn user chat);
  - "messages": list of {"role": "system" | "user" | "assistant", "content": str} turns, the last one a user
                turn; it is rendered with the policy's chat template, generation prompt added.
Every other key is an EXTRA COLUMN (e.g. "answer"); `columns_of` turns the extra columns of a batch into one
list per column, which reaches the reward function. The reward function receives the raw prompt text
(`prompt_text`: the "prompt", or the content of the chat's last user turn), never the chat-rendered text.

File formats (`load_rows`), chosen by the file's extension:
  .parquet   one row per table row (needs pyarrow: `pip install -e '.[parquet]'`), the format verl and the
             Hugging Face hub export;
  .jsonl     one JSON object per line;
  .json      a JSON array of objects (or of strings, each a "prompt"), or one JSON object per line;
  otherwise  plain text: one prompt per non-empty line, kept as written (only the newline is dropped).
A "prompt" or "messages" that is null counts as absent, so a table may hold both columns with one null per row;
a "prompt" that is a list of turns (verl's Parquet layout) is read as "messages".
Files are read one row at a time (a JSON array one item at a time): a row of more than MAX_ROW_BYTES (4 MiB) is
refused before it is parsed. Anything else wrong with a row is a `PromptsError`: one line naming the file, the line
(text, JSON lines) or row (JSON array, Parquet), counted from 1, and what is wrong (JSON nested too deeply included). A row found wrong later (a character the policy's tokenizer
cannot encode) is named the same way by `where_is`, which reads the file again: rows carry no position.
"""
import codecs
import itertools
import json
import os
import random
import re

ROLES = ("system", "user", "assistant")
# The most bytes one row of a prompts file may hold (a line; an item of a JSON array): ~1M tokens, beyond any model's
# context. Files are read a row at a time, so a longer row is refused after this much of it was read, not parsed whole.
MAX_ROW_BYTES = 4 << 20


class PromptsError(ValueError):
    """A prompts file that cannot be read into rows; the message is one line meant for the user."""


def load_rows(path) -> list[dict]:
    """Rows of a prompts file (the formats are in the module docstring), in file order.

    path: str or os.PathLike. Returns a list of N >= 1 row dicts, each with a non-empty "prompt" str or a
    checked "messages" list, plus its extra columns' values as read (JSON types; Parquet: `to_pylist()`).
    Raises PromptsError on a missing file, an empty one, or a bad row.
    """
    return [row for _, row in _placed_rows(path)]


def _placed_rows(path) -> list[tuple[str, dict]]:
    """load_rows' rows as (place, row) pairs, the place naming the row in messages: "FILE:LINE" (text, JSON lines;
    blank lines counted) or "FILE: row N" (JSON array, Parquet)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        raise PromptsError(f"{path}: is a directory, not a prompts file")
    if not os.path.isfile(path):
        raise PromptsError(f"{path}: no such file")
    extension = os.path.splitext(path)[1].lower()
    if extension == ".parquet":
        rows = [(f"{path}: row {n}", _checked(row, f"{path}: row {n}")) for n, row in enumerate(_parquet_rows(path), 1)]
    elif extension == ".json" and _first_character(path) == "[":
        rows = _json_array_rows(path)
    elif extension in (".json", ".jsonl"):
        rows = _json_lines_rows(path)
    else:  # a line is a prompt as written, blank lines skipped
        rows = [(f"{path}:{n}", {"prompt": line}) for n, line in _lines(path) if line.strip()]
    if not rows:
        raise PromptsError(f"{path}: holds no prompts")
    return rows


def _lines(path):
    """(line number from 1, text without its newline) of each line of a UTF-8 file, read one line at a time, so that
    memory holds one row, never the file: a line longer than MAX_ROW_BYTES is a PromptsError naming it, raised after
    reading MAX_ROW_BYTES + 2 bytes of it, before it is decoded or parsed. \\n, \\r\\n and \\r end a line."""
    n, offset = 0, 0  # offset: the file's bytes before this line, to name a byte that is not UTF-8
    with open(path, "rb") as f:
        while line := f.readline(MAX_ROW_BYTES + 2):  # + 2: room for "\r\n" after a row of the most bytes
            body = line.removesuffix(b"\n").removesuffix(b"\r")
            if len(body) > MAX_ROW_BYTES:
                raise PromptsError(f"{path}:{n + 1}: the line is longer than {MAX_ROW_BYTES >> 20} MiB, the most a "
                                   f"prompts file's row may hold; nothing after its first MiBs was read")
            try:  # the line with its newline, which shows a byte left incomplete as followed by a wrong one
                text = line.decode("utf-8").removesuffix("\n").removesuffix("\r")
            except UnicodeDecodeError as e:
                raise PromptsError(f"{path}: not UTF-8 text (byte {offset + e.start}: {e.reason})") from None
            for piece in text.split("\r"):  # a lone \r ends a line too, as in Python's text mode
                n += 1
                yield n, piece
            offset += len(line)


def _first_character(path) -> str:
    """The file's first character that is not whitespace ("" for none), read a chunk at a time."""
    with open(path, "rb") as f:
        while chunk := f.read(1 << 16):
            if chunk.strip():
                return chr(chunk.strip()[0])
    return ""


def _parse_json(text, where):
    """json.loads(text), every way it can fail a PromptsError prefixed with `where`: a syntax error, nesting deeper
    than Python's recursion limit (RecursionError), an integer of more digits than Python converts (ValueError)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise PromptsError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    except RecursionError:
        raise PromptsError(f"{where}: not valid JSON (nested too deeply)") from None
    except ValueError as e:
        raise PromptsError(f"{where}: not valid JSON ({_first_line(e)})") from None


def _first_line(error) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


def _parquet_rows(path) -> list[dict]:
    """A Parquet file's rows as Python dicts (pyarrow imported here: it is an optional dependency)."""
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError:
        raise PromptsError(f"reading {path} needs pyarrow: pip install -e '.[parquet]'") from None
    try:
        return pyarrow.parquet.read_table(path).to_pylist()
    except (pyarrow.ArrowException, OSError) as e:
        raise PromptsError(f"{path}: cannot read as Parquet: {_first_line(e)}") from None


def _json_array_rows(path) -> list[tuple[str, dict]]:
    """Rows of a .json file holding one JSON array: of objects, or of strings (each a "prompt")."""
    rows = []
    for n, item in enumerate(_json_array_items(path), 1):
        if isinstance(item, str):
            item = {"prompt": item}
        elif not isinstance(item, dict):
            raise PromptsError(f"{path}: row {n}: expected a JSON object or a string, got {_json_type(item)}")
        rows.append((f"{path}: row {n}", _checked(item, f"{path}: row {n}")))
    return rows


def _json_array_items(path):
    """The items of a JSON array file, decoded one at a time from a window of the file that holds the item being read
    and at most MAX_ROW_BYTES after it (json.loads of the whole file would hold all of it and its objects at once).
    An item longer than the window, or a syntax error, is a PromptsError naming the item or the line and column."""
    decoder, reader = json.JSONDecoder(), codecs.getincrementaldecoder("utf-8")()
    window, pos, eof, read = "", 0, False, 0  # read: bytes of the file decoded so far
    lines_before, column_base = 0, 0  # the lines and the columns of the current line dropped from the window's front
    with open(path, "rb") as f:
        def fill():  # keep MAX_ROW_BYTES + 1 characters ahead of pos in the window, dropping what lies before pos
            nonlocal window, pos, eof, read, lines_before, column_base
            if eof or len(window) - pos > MAX_ROW_BYTES:
                return
            dropped, window, pos = window[:pos], window[pos:], 0
            if "\n" in dropped:
                lines_before, column_base = lines_before + dropped.count("\n"), len(dropped) - dropped.rfind("\n") - 1
            else:
                column_base += len(dropped)
            while not eof and len(window) <= MAX_ROW_BYTES:  # in small chunks: the window is all memory holds
                chunk = f.read(1 << 20)
                try:
                    window += reader.decode(chunk, final=not chunk)
                except UnicodeDecodeError as e:
                    raise PromptsError(f"{path}: not UTF-8 text (byte {read + e.start}: {e.reason})") from None
                read, eof = read + len(chunk), not chunk

        def at(i) -> str:  # "line L column C" of window position i
            line = window.count("\n", 0, i)
            column = i - window.rfind("\n", 0, i) + (column_base if line == 0 else 0)
            return f"line {lines_before + line + 1} column {column}"

        def skip_space():
            nonlocal pos
            while True:
                fill()
                pos = _SPACE.match(window, pos).end()
                if pos < len(window) or eof:
                    return window[pos:pos + 1]

        def syntax_error(what, i):
            return PromptsError(f"{path}: not valid JSON ({what} at {at(i)})")

        skip_space()
        pos += 1  # the "[" (_placed_rows looked)
        if skip_space() == "]":
            pos += 1
        else:
            for n in itertools.count(1):
                skip_space()
                try:
                    item, end = decoder.raw_decode(window, pos)
                except json.JSONDecodeError as e:
                    # a window that cuts an item fails at its end (a string left open: at the string's start)
                    cut = e.pos >= len(window) - len("\\u0000") or e.msg.startswith("Unterminated string")
                    if cut and not eof:
                        raise PromptsError(f"{path}: row {n} is not valid JSON within its first {MAX_ROW_BYTES >> 20} "
                                           f"MiB, the most a prompts file's row may hold") from None
                    raise syntax_error(e.msg, e.pos) from None
                except RecursionError:
                    raise PromptsError(f"{path}: row {n}: not valid JSON (nested too deeply)") from None
                except ValueError as e:
                    raise PromptsError(f"{path}: row {n}: not valid JSON ({_first_line(e)})") from None
                if end - pos > MAX_ROW_BYTES:
                    raise PromptsError(f"{path}: row {n} is longer than {MAX_ROW_BYTES >> 20} MiB, the most a "
                                       f"prompts file's row may hold")
                pos = end
                yield item
                separator = skip_space()
                if separator == "]":
                    pos += 1
                    break
                if separator != ",":
                    raise syntax_error("Expecting ',' delimiter", pos)
                pos += 1
        if skip_space():
            raise syntax_error("Extra data", pos)


_SPACE = re.compile(r"[ \t\n\r]*")  # JSON's whitespace


def _json_lines_rows(path) -> list[tuple[str, dict]]:
    """Rows of a JSON-lines file: one object per non-blank line; errors name the line, counted from 1."""
    rows = []
    for n, line in _lines(path):
        if not line.strip():
            continue
        try:
            item = _parse_json(line, f"{path}:{n}")
        except PromptsError:
            if not rows and _is_one_json_object(path):  # a pretty-printed object, not one object per line
                raise PromptsError(f"{path}: holds one JSON object; expected one object per line "
                                   f"or a JSON array of objects") from None
            raise
        if not isinstance(item, dict):
            raise PromptsError(f"{path}:{n}: expected a JSON object with a \"prompt\" or \"messages\" field, "
                               f"got {_json_type(item)}")
        rows.append((f"{path}:{n}", _checked(item, f"{path}:{n}")))
    return rows


def _is_one_json_object(path) -> bool:
    """Whether the file, no longer than one row may be, is one JSON object (read whole: it is that small)."""
    if os.path.getsize(path) > MAX_ROW_BYTES:
        return False
    try:
        with open(path, encoding="utf-8") as f:
            return isinstance(json.loads(f.read()), dict)
    except (ValueError, RecursionError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        return False


LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _lone_surrogate(value, name):
    """(where, character) of the first lone surrogate in a JSON value (a str, or the strs in its lists and dicts),
    `where` being `name` with the list indices and keys that lead to it; None when there is none."""
    if isinstance(value, str):
        found = LONE_SURROGATE.search(value)
        return (name, found.group()) if found else None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found = _lone_surrogate(item, f"{name}[{key!r}]" if isinstance(key, str) else f"{name}[{key}]")
        if found:
            return found
    return None


def _checked(row: dict, where: str) -> dict:
    """`row` after checking its "prompt" / "messages" (a null one is dropped as absent); `where` prefixes errors."""
    for key, value in row.items():  # JSON's "\ud800" alone: a str Python holds, which no UTF-8 tokenizer can take
        found = _lone_surrogate(value, f'"{key}"')
        if found:
            raise PromptsError(f"{where}: {found[0]} holds a lone surrogate escape ({ascii(found[1])[1:-1]}), half of "
                               f"a UTF-16 pair and not a character: write the character itself, or both halves")
    row = {key: value for key, value in row.items() if not (key in ("prompt", "messages") and value is None)}
    chat_under_prompt = isinstance(row.get("prompt"), list) and all(isinstance(t, dict) for t in row["prompt"])
    if chat_under_prompt and row["prompt"] and "messages" not in row:  # verl's layout: the chat under "prompt"
        row["messages"] = row.pop("prompt")
    if "prompt" in row and "messages" in row:
        raise PromptsError(f"{where}: has both \"prompt\" and \"messages\"; give one")
    if "prompt" in row:
        if not isinstance(row["prompt"], str):
            raise PromptsError(f"{where}: \"prompt\" must be a string, got {_json_type(row['prompt'])}")
        if not row["prompt"].strip():
            raise PromptsError(f"{where}: \"prompt\" is empty")
        return row
    if "messages" not in row:
        keys = ", ".join(map(str, row)) or "none"
        raise PromptsError(f"{where}: needs a \"prompt\" string or a \"messages\" list (its keys: {keys})")
    messages = row["messages"]
    if not isinstance(messages, list):
        raise PromptsError(f"{where}: \"messages\" must be a list of {{\"role\", \"content\"}} turns, "
                           f"got {_json_type(messages)}")
    if not messages:
        raise PromptsError(f"{where}: \"messages\" is empty")
    for i, turn in enumerate(messages):
        if not isinstance(turn, dict):
            raise PromptsError(f"{where}: messages[{i}] must be an object with \"role\" and \"content\", "
                               f"got {_json_type(turn)}")
        for key in ("role", "content"):
            if key not in turn:
                raise PromptsError(f"{where}: messages[{i}] has no \"{key}\"")
            if not isinstance(turn[key], str):
                raise PromptsError(f"{where}: messages[{i}] \"{key}\" must be a string, got {_json_type(turn[key])}")
        if turn["role"] not in ROLES:
            raise PromptsError(f"{where}: messages[{i}] has role {turn['role']!r}; expected system, user or assistant")
    if messages[-1]["role"] != "user":
        raise PromptsError(f"{where}: the last turn of \"messages\" must be a user turn, got {messages[-1]['role']}")
    if not messages[-1]["content"].strip():
        raise PromptsError(f"{where}: the last user turn of \"messages\" is empty")
    return row


def _json_type(value) -> str:
    """The JSON name of a value's type, for error messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def where_is(row: dict, files: dict) -> str:
    """Where `row` was read, for a message about it: "config key 'KEY': FILE:LINE" (or "FILE: row N"), the first
    place in `files` ({config key: path}, an empty path skipped) holding a row equal to it; a row found nowhere (a
    built-in task's) is named by its prompt. Reads the files again: meant for error paths only."""
    for key, path in files.items():
        if path:
            for place, candidate in _placed_rows(path):
                if candidate == row:
                    return f"config key '{key}': {place}"
    return f"prompt {prompt_text(row)[:40]!r}"


def prompt_text(row: dict) -> str:
    """The raw prompt a reward function receives: row["prompt"], or the content of the last user turn of
    row["messages"] (never the chat-rendered text)."""
    if "prompt" in row:
        return row["prompt"]
    for turn in reversed(row.get("messages") or []):
        if turn["role"] == "user":
            return turn["content"]
    raise PromptsError(f"row with keys {', '.join(map(str, row))} has neither a \"prompt\" nor a user turn")


def columns_of(rows: list[dict]) -> dict[str, list]:
    """The extra columns of B rows (every key but "prompt" / "messages"): {name: list of B values}, in row
    order, names in order of first appearance; a row lacking a column another row has gives None there."""
    names = {}  # a dict keeps first-appearance order
    for row in rows:
        names.update((key, None) for key in row if key not in ("prompt", "messages"))
    return {name: [row.get(name) for row in rows] for name in names}


def split_held_out(rows: list, eval_size: int) -> tuple[list, list]:
    """(train_rows, held_out_rows): the last min(eval_size, N // 2) of N rows are held out for evaluation, so
    at least half of a small file still trains. Raises PromptsError when N < 2 (nothing could be held out)."""
    if eval_size < 1:
        raise ValueError(f"eval_size must be >= 1, got {eval_size}")
    n_eval = min(eval_size, len(rows) // 2)
    if n_eval < 1:
        raise PromptsError(f"holding prompts out for evaluation needs at least 2 prompts, got {len(rows)}; "
                           f"add prompts or give eval_prompts_file")
    return list(rows[:-n_eval]), list(rows[-n_eval:])


class RowStream:
    """Training rows from a list: passes (epochs) over the list, each in a fresh permutation seeded by
    (seed, epoch); the position is the number of rows drawn, so a resumed run draws the same next rows.

    next_batch returns the row dicts themselves, not copies.
    """

    def __init__(self, rows: list[dict], seed: int):
        if not rows:
            raise ValueError("RowStream needs at least one row")
        self.rows, self.seed, self.drawn = list(rows), seed, 0
        self._order_epoch, self._order = None, None

    def _epoch_order(self, epoch: int) -> list[int]:
        if epoch != self._order_epoch:  # one shuffle per pass over the list, not per row drawn
            self._order = list(range(len(self.rows)))
            random.Random(f"{self.seed}-{epoch}").shuffle(self._order)
            self._order_epoch = epoch
        return self._order

    def next_batch(self, n: int) -> list[dict]:
        """The next n rows (a batch may span the end of one pass and the start of the next)."""
        out = []
        while len(out) < n:
            epoch, i = divmod(self.drawn, len(self.rows))
            out.append(self.rows[self._epoch_order(epoch)[i]])
            self.drawn += 1
        return out

    def state_dict(self) -> dict:
        return {"seed": self.seed, "drawn": self.drawn}

    def load_state_dict(self, state: dict):
        self.seed, self.drawn = state["seed"], state["drawn"]
        self._order_epoch = None
