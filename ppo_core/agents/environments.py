"""Multi-turn episodes: an environment a user writes in plain Python, played by the policy on the rollout engine.

    class MyEnv:                                   # in a file of the user's, like a reward function
        max_turns = 4
        def reset(self, row):                      # the prompt row (its columns: row["answer"], ...)
            return [{"role": "user", "content": row["prompt"]}]
        def step(self, assistant_text):            # the policy's turn, as text
            return observation_messages_or_None, reward, done

    episodes = run_episodes(engine, tokenizer, [MyEnv() for _ in rows], rows, max_new_tokens=512, max_turn_tokens=128)
    episodes[i].tokens, episodes[i].mask, episodes[i].reward    # after the prompt: 1 = the policy's token, 0 = observation

One episode: reset(row) gives the first messages, rendered with the checkpoint's own chat template (generation prompt
on) -> the prompt. The policy decodes a turn until its EOS (the template's end of turn) or max_turn_tokens; step(text)
answers with observation messages (a tool's result: {"role": "tool", "content": ...}), a reward and whether the
episode is over. The observation is rendered by the same template and appended to the sequence with mask 0, and
decoding goes on from the sequence's own KV cache (ppo_core.engine's on_turn_end); steps run in a thread pool, so a
slow tool never stops the other episodes from decoding. An episode ends when step says done, returns no observation,
reaches max_turns, or runs out of max_new_tokens (which counts observation tokens too); its last turn is then stepped
too (its reward counts). The episode's reward is the sum of its steps' rewards.

Incremental rendering is checked at every turn, on the text: the template's rendering of the whole conversation (with
the new observation and the generation prompt) must begin with the text of everything the sequence holds (prompt,
turns, earlier observations), and the tokens of the text added must be what encoding the whole conversation gives
after that point. A template that rewrites earlier turns (e.g. one that drops the reasoning of past assistant turns)
cannot be played incrementally: IncrementalRenderError, with the two texts where they part. Qwen3's template plays
incrementally with thinking on (the policy writes its <think> block and the template re-renders the turns after the
last user query with it); with enable_thinking=False its generation prompt holds an empty <think></think> that the
re-rendered history drops, and the episode is refused (tests/test_environments.py shows both).

Shipped: ToolEnvironment, which answers the policy's tool calls (ppo_core.agents.tools: a calculator, a Python runner in the
sandbox) until it answers without one, and scores that answer against a column of the row.
"""
import functools
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ..models.tokenizer import UnknownTextError
from ..rewards.functions import import_callable
from ..rewards.interface import FLOAT32_MAX, UserCode, as_number, clip_text, failure, returned_wrong, shown
from .tools import (MAX_CALLS_PER_TURN, TOOL_CALL_END, TOOL_CALL_START, Calculator, PythonTool, run_tool_calls,
                    tool_messages, tool_schemas)


class IncrementalRenderError(ValueError):
    """The chat template renders an earlier part of the conversation differently once more is appended."""


@dataclass
class Episode:
    row: dict
    env: object
    messages: list  # the conversation so far, as the template renders it
    prompt_ids: list  # the first messages rendered, with the generation prompt
    tokens: list = field(default_factory=list)  # after the prompt (filled at the end)
    mask: list = field(default_factory=list)  # 1: the policy's token, 0: an observation's
    reward: float = 0.0  # the sum of its steps' rewards
    turns: int = 0  # turns the policy took (stepped)
    stepped: int = 0  # tokens after the prompt that step() has seen (turns and observations)
    done: bool = False
    observation_tokens: int = 0
    observation_chars_replaced: int = 0  # observation characters the tokenizer cannot encode (encodable_observation)
    observations_truncated: int = 0  # observation messages cut to max_observation_chars


def render(tokenizer, messages, tools, **template_kwargs):
    """The conversation as the policy sees it next: the chat template, with the generation prompt."""
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, tools=tools,
                                         **template_kwargs)


def turn_text(tokenizer, turn_tokens, stop_ids):
    """The assistant's text of one turn: its tokens decoded, without the end-of-turn token that closed it."""
    if turn_tokens and turn_tokens[-1] in stop_ids:
        turn_tokens = turn_tokens[:-1]
    return tokenizer.decode(turn_tokens, skip_special_tokens=False)  # as the template will render it back


OBSERVATION_REPLACEMENT = "?"  # what stands for a character of an observation the tokenizer cannot encode


def encodable_observation(tokenizer, messages) -> int:
    """Replace, in place, each character of the messages' "content" that the tokenizer cannot encode (a vocabulary
    without it and no unknown token, as the demo checkpoints' character tokenizers) by OBSERVATION_REPLACEMENT, or
    drop it where that is not encodable either; -> how many characters were replaced. An observation is data (a
    tool's error quoting the policy's '\u00d7' as '×'): it never ends the run."""
    def encodes(text):
        try:
            tokenizer.encode(text)
            return True
        except UnknownTextError:
            return False

    replacement = OBSERVATION_REPLACEMENT if encodes(OBSERVATION_REPLACEMENT) else ""
    replaced = 0
    for message in messages:
        content = message.get("content")
        if not isinstance(content, str) or encodes(content):
            continue
        unknown = {char for char in set(content) if not encodes(char)}
        message["content"] = "".join(replacement if char in unknown else char for char in content)
        replaced += sum(content.count(char) for char in unknown)
    return replaced


def observation_ids(tokenizer, episode: Episode, held_ids, tools, **template_kwargs):
    """The token ids of what the template adds after the sequence's `held_ids` (prompt + everything after it) once
    the conversation holds the new observation: checked to be an incremental rendering (see the module docstring).
    Characters of the observation the tokenizer cannot encode are replaced first (encodable_observation)."""
    held_text = tokenizer.decode(held_ids, skip_special_tokens=False)
    full_text = render(tokenizer, episode.messages, tools, **template_kwargs)
    try:
        whole = tokenizer.encode(full_text)
    except UnknownTextError:  # the observation is what follows the policy's last turn
        last_turn = max(i for i, m in enumerate(episode.messages) if m.get("role") == "assistant")
        episode.observation_chars_replaced += encodable_observation(tokenizer, episode.messages[last_turn + 1:])
        full_text = render(tokenizer, episode.messages, tools, **template_kwargs)
        whole = tokenizer.encode(full_text)
    if not full_text.startswith(held_text):
        at = next((i for i, (a, b) in enumerate(zip(held_text, full_text)) if a != b), min(len(held_text), len(full_text)))
        raise IncrementalRenderError(
            f"the chat template cannot be rendered turn by turn: after turn {episode.turns} the conversation renders as "
            f"...{full_text[max(0, at - 40):at + 40]!r} where the sequence holds ...{held_text[max(0, at - 40):at + 40]!r}")
    added = tokenizer.encode(full_text[len(held_text):])
    if whole[len(whole) - len(added):] != added:
        raise IncrementalRenderError(f"the observation after turn {episode.turns} tokenizes differently alone than "
                                     f"in the whole conversation (tokens merge across {full_text[len(held_text):][:40]!r})")
    return added


@dataclass
class EpisodeSettings:
    """What shapes a batch of episodes (run_episodes takes these by name, beside the engine's sampling settings).

    max_new_tokens: each episode's budget of tokens after its prompt (turns and observations); max_turn_tokens: one
    turn's at most (None: until an EOS); tools: the tool schemas the chat template renders (None: none); max_workers:
    threads stepping the environments; template_kwargs: the template's own switches (Qwen3's enable_thinking); name:
    the environment's, for a message (config `environment`; None: 'module:Class'); max_observation_chars: an
    observation message's content is cut to that many characters before the template renders it (0: no cap;
    counted in Episode.observations_truncated)."""
    max_new_tokens: int
    max_turn_tokens: int = None
    tools: list = None
    max_workers: int = 8
    template_kwargs: dict = None
    name: str = None
    max_observation_chars: int = 0


EPISODE_SETTINGS = frozenset(EpisodeSettings.__dataclass_fields__)


def run_episodes(engine, tokenizer, envs, prompt_rows, **options):
    """Play one episode per (env, prompt row) on `engine` (a ppo_core.engine.RolloutEngine). options: the fields of
    EpisodeSettings (max_new_tokens is required) and of RolloutEngine.generate's sampling (temperature, top_p, top_k,
    greedy, seed, rows (the noise rows), return_logprobs, return_entropy), by name.
    -> the Episodes, with (tokens, mask[, logprobs]) filled in, in order. Every call into an environment is checked
    (reset_messages, step_answer): what it raises or returns wrong is a CallbackError of one line naming it."""
    settings = EpisodeSettings(**{key: options.pop(key) for key in list(options) if key in EPISODE_SETTINGS})
    sampling = options  # what is left: the engine's sampling settings
    stop_ids = list(tokenizer.eos_token_ids)
    template_kwargs = settings.template_kwargs or {}
    name = settings.name
    episodes = []
    for env, row in zip(envs, prompt_rows):
        name = name or f"{type(env).__module__}:{type(env).__qualname__}"
        messages = reset_messages(env, row, name)
        prompt_ids = tokenizer.encode(render(tokenizer, messages, settings.tools, **template_kwargs))
        episodes.append(Episode(row, env, messages, prompt_ids))

    def step(episode, held_ids, turn_ids, last=False):
        """The environment's answer to one turn -> observation ids, or None when the episode is over (last: the
        budget has ended it, whatever step says)."""
        text = turn_text(tokenizer, turn_ids, stop_ids)
        episode.messages.append({"role": "assistant", "content": text})
        observation, reward, done = step_answer(episode, text, name)
        episode.turns += 1
        episode.stepped = len(held_ids) - len(episode.prompt_ids)
        max_turns = getattr(episode.env, "max_turns", None)
        if last or done or not observation or (max_turns is not None and episode.turns >= max_turns):
            episode.done = True
            return None
        observation, cut = capped(observation, settings.max_observation_chars)  # before the tokenizer reads it
        episode.observations_truncated += cut
        episode.messages.extend(observation)
        ids = observation_ids(tokenizer, episode, held_ids, settings.tools, **template_kwargs)
        episode.stepped += len(ids)
        episode.observation_tokens += len(ids)
        return ids

    with ThreadPoolExecutor(settings.max_workers) as pool:
        def on_turn_end(index, tokens):
            episode = episodes[index]
            return pool.submit(step, episode, episode.prompt_ids + tokens, tokens[episode.stepped :])

        out = engine.generate([e.prompt_ids for e in episodes], settings.max_new_tokens, eos_token_id=stop_ids,
                              on_turn_end=on_turn_end, max_turn_tokens=settings.max_turn_tokens, return_mask=True,
                              **sampling)
    tokens, masks = out[0], out[1]
    for i, episode in enumerate(episodes):
        episode.tokens, episode.mask = tokens[i], masks[i]
        if not episode.done and len(episode.tokens) > episode.stepped:  # the budget ended its last turn: step it too
            step(episode, episode.prompt_ids + episode.tokens, episode.tokens[episode.stepped :], last=True)
    if sampling.get("return_logprobs"):
        for k, episode in enumerate(episodes):
            episode.logprobs = out[2][k]
            episode.entropy = out[3][k] if sampling.get("return_entropy") else None
    return episodes


def row_text(row) -> str:
    """A prompt row, for a message: its prompt (or last message), clipped."""
    if isinstance(row, dict) and isinstance(row.get("prompt"), str):
        return f"(prompt {clip_text(row['prompt'])})"
    if isinstance(row, dict) and isinstance(row.get("messages"), list) and row["messages"]:
        return f"(last message {clip_text(str(row['messages'][-1].get('content', '')))})"
    return f"({shown(row)})"


def checked_messages(messages, name, what, where) -> list:
    """An environment's messages -> a list of {"role": str, "content": str, ...} dicts; anything else is a
    CallbackError: "environment NAME: WHAT <what it was> WHERE: expected ..." (what: "reset returned", say)."""
    form = 'a list of messages {"role": str, "content": str}'
    if not isinstance(messages, (list, tuple)):
        raise returned_wrong(f"environment {name}: {what} {shown(messages)} {where}: expected {form}", messages)
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise returned_wrong(f"environment {name}: {what} message {i} {shown(message)} {where}: expected {form}",
                                 messages)
        if not isinstance(message.get("content"), str):
            raise returned_wrong(f"environment {name}: {what} message {i} with content "
                                 f"{shown(message.get('content'))} {where}: expected {form}", messages)
    return list(messages)


def reset_messages(env, row, name) -> list:
    """env.reset(row), checked: the episode's first messages."""
    where = f"for row {row_text(row)}"
    with UserCode(lambda e: f"environment {name}: reset {failure(e)} {where}", env):
        messages = env.reset(row)
    return checked_messages(messages, name, "reset returned", where)


def step_answer(episode: Episode, text, name):
    """episode.env.step(text), checked -> (observation messages or None, reward as a float, done); the reward is
    added to episode.reward. What it raises, an answer that is not a triple, a reward that is not a number, finite
    and within float32's range (nor the episode's sum), an observation that is not None or a list of messages with
    str contents: a CallbackError of one line naming the environment, the turn and the row."""
    where = f"in turn {episode.turns + 1} of row {row_text(episode.row)}"
    with UserCode(lambda e: f"environment {name}: step {failure(e)} {where}", episode.env):
        answer = episode.env.step(text)
    if not (isinstance(answer, (tuple, list)) and len(answer) == 3):
        raise returned_wrong(f"environment {name}: step returned {shown(answer)} {where}: expected "
                             f"(observation messages or None, reward, done)", answer)
    observation, reward, done = answer
    number = as_number(reward)
    if number is None:
        raise returned_wrong(f"environment {name}: step returned reward {shown(reward)} {where}: expected an int "
                             f"or float", answer)
    if not math.isfinite(number):
        raise returned_wrong(f"environment {name}: step returned reward {number!r} {where}: expected a finite "
                             f"number", answer)
    if abs(number) > FLOAT32_MAX:
        raise returned_wrong(f"environment {name}: step returned reward {number!r} {where}: beyond float32's range, "
                             f"where it is inf (|r| <= {FLOAT32_MAX:.4g})", answer)
    episode.reward += number
    if abs(episode.reward) > FLOAT32_MAX:
        raise returned_wrong(f"environment {name}: the episode's rewards add up to {episode.reward:g} by turn "
                             f"{episode.turns + 1} of row {row_text(episode.row)}, beyond float32's range", answer)
    if observation is not None and not (isinstance(observation, (str, list, tuple)) and not observation):
        observation = checked_messages(observation, name, "step returned observation", where)  # "" or []: none
    return observation or None, number, done


def capped(messages, max_chars):
    """-> (messages with each content cut to its first max_chars characters (copies; 0: as they are), how many were
    cut). Applied before the template renders them: tokenizing 10^7 characters takes minutes and gigabytes."""
    if not max_chars:
        return messages, 0
    cut = [m for m in messages if len(m["content"]) > max_chars]
    if not cut:
        return messages, 0
    kept = [{**m, "content": m["content"][:max_chars]} if len(m["content"]) > max_chars else m for m in messages]
    return kept, len(cut)


class ToolEnvironment:
    """Tools until an answer: each turn's <tool_call> blocks are run (ppo_core.agents.tools.run_tool_calls) and their outputs
    come back as `tool` messages (reward 0); a turn without a tool call is the answer, scored 1.0 when, stripped, it
    equals str(row[answer_column]) stripped, else 0.0, and the episode ends. tools: {name: tool}; pass
    ppo_core.agents.tools.tool_schemas(tools.values()) to run_episodes' `tools` so the template shows them to the policy.
    `counts` sums run_tool_calls' counts over the episode (tool calls, malformed calls, tool errors, calls not run)
    and the seconds its tools ran (tool_s: the sandbox's, for the Python tool). max_tool_calls_per_turn: the calls run
    in one turn; the rest are answered with one line saying they were not run. Whatever the turn's text, step
    returns: its tool calls are data (ppo_core.agents.tools never raises on them)."""

    def __init__(self, tools: dict, max_turns=4, answer_column="answer", system_prompt=None,
                 max_tool_calls_per_turn=MAX_CALLS_PER_TURN):
        self.tools, self.max_turns, self.max_tool_calls_per_turn = tools, max_turns, max_tool_calls_per_turn
        self.answer_column, self.system_prompt = answer_column, system_prompt
        self.counts = {"tool_calls": 0, "malformed_calls": 0, "tool_errors": 0, "calls_not_run": 0, "tool_s": 0.0}

    def reset(self, row):
        self.row = row
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return system + [{"role": "user", "content": row["prompt"]}]

    def step(self, assistant_text):
        if TOOL_CALL_START in assistant_text or TOOL_CALL_END in assistant_text:  # a block, well-formed or not
            start = time.perf_counter()
            observations, counts = run_tool_calls(assistant_text, self.tools, self.max_tool_calls_per_turn)
            self.counts["tool_s"] += time.perf_counter() - start
            for key, n in counts.items():
                self.counts[key] += n
            return tool_messages(observations), 0.0, False
        answer = assistant_text.strip()
        return None, float(answer == str(self.row[self.answer_column]).strip()), True


def make_tools(names: str) -> dict:
    """'calculator,python' -> {name: tool} (ppo_core.agents.tools)."""
    known = {"calculator": Calculator, "python": PythonTool}
    tools = {}
    for name in filter(None, (n.strip() for n in names.split(","))):
        if name not in known:
            raise ValueError(f"unknown tool {name!r} (the tools: {', '.join(known)})")
        tools[name] = known[name]()
    return tools


@functools.lru_cache(maxsize=8)
def make_environment(spec: str, tools: str = "calculator,python", max_turns: int = 4,
                     max_tool_calls_per_turn: int = MAX_CALLS_PER_TURN):
    """-> (a function that builds one environment, the tool schemas its chat template shows, or None). spec: 'tools',
    the shipped ToolEnvironment over `tools`, running at most max_tool_calls_per_turn calls a turn; 'file.py:Class'
    or 'module:Class', a user's class built with no arguments, given max_turns where it sets none. Cached: a user's
    file is loaded once, not for every row."""
    if spec == "tools":
        offered = make_tools(tools)
        return (functools.partial(ToolEnvironment, offered, max_turns=max_turns,
                                  max_tool_calls_per_turn=max_tool_calls_per_turn), tool_schemas(offered.values()))
    cls = import_callable(spec, "environment")

    def build():
        with UserCode(lambda e: f"environment {spec}: building one ({cls.__name__}()) {failure(e)}", cls):
            env = cls()
        if getattr(env, "max_turns", None) is None:
            env.max_turns = max_turns
        if isinstance(env.max_turns, bool) or not isinstance(env.max_turns, int) or env.max_turns < 1:
            raise returned_wrong(f"environment {spec}: max_turns is {shown(env.max_turns)}: expected an int >= 1",
                                 env.max_turns)
        return env
    return build, getattr(cls, "tools", None)
