"""A reward source in another process: the scores come from reward servers over HTTP (config `reward_url`).

    ppo-serve-reward --port 8000 --reward_model ~/models/skywork-rm        # on the reward model's machine
    ppo-train --reward_url http://rm-host:8000 ...                          # the trainer

RemoteReward is called as every reward source is (ppo_core.rewards): scores, metrics = source(prompts, responses,
columns). It POSTs OpenRLHF's remote reward request (the exact protocol: ppo_core.reward_server) and reads the
answer back with the checks a local reward function gets.

Several URLs: the batch is split into len(urls) contiguous chunks, chunk k posted to urls[(k + start) % n] at the
same time (the servers score in parallel, as OpenRLHF spreads a batch over its remote_rm_url list); `start` moves on
by one each call, so a batch smaller than the list still spreads its load. A chunk that gets no answer is tried again
on the next URL (the same one when there is one), at most `retries` times, retry k after backoff_s * 2**(k-1) seconds.

What a call can raise:
  - RewardError (exit 2 in ppo-train, bad input): the server answered, and the answer is wrong - malformed JSON, no
    "rewards", a wrong number of them, a value that is not a finite number (one line naming the URL, the sample and
    what came back), a request the server refused (HTTP 4xx), a reward function that raised on the server (HTTP 500
    whose JSON says "reward_error": true). Retrying would not change it.
  - RewardUnavailable (exit 3 in ppo-train, which saves a checkpoint): no answer after 1 + retries tries - the
    connection refused or reset, no answer within timeout_s, any other HTTP 5xx.
With several processes every process calls the source at the same point (the loop does); a failure on one process
is raised on all of them, so that they stop together instead of waiting for each other in a collective.
"""
import concurrent.futures
import http.client
import json
import os
import socket
import time
import urllib.error
import urllib.request

import torch

from .rewards import CallableReward, RewardError

# The request's own fields (ppo_core.reward_server); a prompt column of one of these names cannot be sent.
PROTOCOL_FIELDS = ("query", "prompts", "responses", "labels")


class RewardUnavailable(RuntimeError):
    """No reward server answered after the retries; one line: 'reward server URL unreachable after N tries (reason)'."""


def unreachable(urls, tries, reason) -> RewardUnavailable:
    return RewardUnavailable(f"reward server {', '.join(urls)} unreachable after {tries} tr{'y' if tries == 1 else 'ies'} ({reason})")


PROXY_AUTH_ENV = ("PPO_REWARD_PROXY_KEY", "PPO_REWARD_PROXY_SECRET")


def proxy_auth_headers(environ) -> dict:
    """The Modal-Key / Modal-Secret headers of a Modal Proxy Auth Token, which a reward server deployed with
    PPO_MODAL_REWARD_PROXY_AUTH=1 (scripts/modal_reward.py) requires: the token's ID and secret from the environment
    variables PPO_REWARD_PROXY_KEY and PPO_REWARD_PROXY_SECRET (never from the config, which the run directory
    records). Neither set: no headers. One of them alone is a RewardError."""
    key, secret = (environ.get(name, "") for name in PROXY_AUTH_ENV)
    if bool(key) != bool(secret):
        raise RewardError(f"set both {PROXY_AUTH_ENV[0]} and {PROXY_AUTH_ENV[1]} (a Modal proxy auth token's ID and "
                          f"secret), or neither")
    return {"Modal-Key": key, "Modal-Secret": secret} if key else {}


class _Down(Exception):
    """One try that got no usable answer (connection, timeout, HTTP 5xx): worth another try."""


class RemoteReward:
    """Scores from reward servers speaking OpenRLHF's remote reward protocol (see the module docstring).

    urls: one or more 'http://host:port[/path]'; timeout_s: seconds to wait for each try's connection and answer;
    retries: further tries of a chunk after its first fails; backoff_s: the wait before retry k (1, 2, ...) is
    backoff_s * 2**(k-1).
    Called -> (scores [B] float32 on the CPU, metrics {name: [B] float32, or a list of B str for a text entry}).
    """

    def __init__(self, urls, timeout_s=60.0, retries=3, backoff_s=1.0):
        self.urls = [urls] if isinstance(urls, str) else list(urls)
        if not self.urls:
            raise ValueError("RemoteReward needs at least one URL")
        self.headers = {"Content-Type": "application/json", **proxy_auth_headers(os.environ)}
        self.timeout_s, self.retries, self.backoff_s = float(timeout_s), int(retries), float(backoff_s)
        self.start = 0  # the URL of the next call's first chunk: round-robin across calls
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=len(self.urls)) if len(self.urls) > 1 else None

    def check_columns(self, names):
        """Nothing to check here: the server checks the columns its reward needs on each request (HTTP 400)."""

    def __call__(self, prompts, responses, columns=None):
        prompts, responses = list(prompts), list(responses)
        failure = None
        try:
            scores, metrics = self._score(prompts, responses, columns or {})
        except (RewardError, RewardUnavailable) as e:
            failure = e
        _raise_everywhere(failure)
        return scores, metrics

    def _score(self, prompts, responses, columns):
        B, n = len(responses), len(self.urls)
        if B == 0:
            return torch.zeros(0), {}
        for name in columns:
            if name in PROTOCOL_FIELDS:
                raise RewardError(f"prompt column '{name}' has the name of a field of the reward server's request "
                                  f"({', '.join(PROTOCOL_FIELDS)}); rename the column")
        size = -(-B // n)  # ceil(B / n) rows a chunk, as OpenRLHF splits a batch over its servers
        chunks = [(lo, min(lo + size, B)) for lo in range(0, B, size)]
        first = [(self.start + k) % n for k in range(len(chunks))]
        self.start = (self.start + 1) % n
        jobs = [(prompts[lo:hi], responses[lo:hi], {k: list(v[lo:hi]) for k, v in columns.items()}, url_index)
                for (lo, hi), url_index in zip(chunks, first)]
        if self.pool is None or len(jobs) == 1:
            results = [self._post_with_retries(*job) for job in jobs]
        else:
            results = list(self.pool.map(lambda job: self._post_with_retries(*job), jobs))  # re-raises a chunk's error
        scores = [s for chunk_scores, _ in results for s in chunk_scores]
        names = list(results[0][1])
        for _, chunk_metrics in results[1:]:
            if list(chunk_metrics) != names:
                raise RewardError(f"reward servers {', '.join(self.urls)} returned different extra_logs entries for "
                                  f"the chunks of one batch ({names} and {list(chunk_metrics)})")
        metrics = {}
        for name in names:
            values = [v for _, chunk_metrics in results for v in chunk_metrics[name]]
            is_text = all(isinstance(v, str) for v in values)
            metrics[name] = values if is_text else torch.tensor(values, dtype=torch.float32)  # [B]
        return torch.tensor(scores, dtype=torch.float32), metrics

    def _post_with_retries(self, prompts, responses, columns, url_index):
        """One chunk, tried on urls[url_index], then the next URLs in turn. -> (scores, {name: values})."""
        body = request_body(prompts, responses, columns)
        tried, reason = [], ""
        for attempt in range(1 + self.retries):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            url = self.urls[(url_index + attempt) % len(self.urls)]
            if url not in tried:
                tried.append(url)
            try:
                answer = self._post(url, body)
            except _Down as e:
                reason = str(e)
                continue
            return check_answer(answer, url, prompts, responses)
        raise unreachable(tried, 1 + self.retries, reason)

    def _post(self, url, body: bytes):
        """One try: the server's answer as text; RewardError for a refusal or a reward error, _Down otherwise."""
        request = urllib.request.Request(url, data=body, headers=self.headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as reply:
                return reply.read().decode("utf-8", errors="replace")
        except urllib.error.HTTPError as e:
            text = e.read().decode("utf-8", errors="replace")
            error = _error_of(text)
            if e.code >= 500 and not (isinstance(error, dict) and error.get("reward_error")):
                raise _Down(f"HTTP {e.code}: {_one_line(error.get('error', text) if isinstance(error, dict) else text)}") from None
            message = error.get("error") if isinstance(error, dict) and "error" in error else _one_line(text)
            if e.code >= 500:
                raise RewardError(f"reward server {url}: {message}") from None
            raise RewardError(f"reward server {url} refused the request (HTTP {e.code}): {message}") from None
        except urllib.error.URLError as e:
            reason = e.reason
            if isinstance(reason, (socket.timeout, TimeoutError)):
                raise _Down(f"no answer within {self.timeout_s:g} s") from None
            if isinstance(reason, ConnectionRefusedError):
                raise _Down("connection refused") from None
            raise _Down(_one_line(str(reason))) from None
        except (socket.timeout, TimeoutError):
            raise _Down(f"no answer within {self.timeout_s:g} s") from None
        except (ConnectionError, http.client.HTTPException, OSError) as e:  # reset, closed mid-answer
            raise _Down(_one_line(f"{type(e).__name__}: {e}")) from None


def request_body(prompts, responses, columns) -> bytes:
    """The JSON request of ppo-core's client: OpenRLHF's query / prompts / labels, and responses and every column, so
    that an OpenRLHF server (which reads query) and ppo-serve-reward (which reads responses) both understand it."""
    request = {"query": [p + r for p, r in zip(prompts, responses)], "prompts": prompts, "responses": responses}
    if "answer" in columns:
        request["labels"] = columns["answer"]  # OpenRLHF's reward_func(queries, prompts, labels)
    request.update(columns)
    try:
        return json.dumps(request, allow_nan=False).encode()
    except (TypeError, ValueError) as e:
        raise RewardError(f"the prompt columns cannot be sent to a reward server as JSON: {e}") from None


def check_answer(text, url, prompts, responses):
    """The server's JSON answer -> (scores: list of B floats, {name: list of B floats or of B str}), checked as a local
    reward function's answer is (ppo_core.rewards): one finite number per response, named by the URL on failure."""
    try:
        answer = json.loads(text)
    except json.JSONDecodeError as e:
        raise RewardError(f"reward server {url} returned malformed JSON ({e.msg} at character {e.pos}): "
                          f"{_one_line(text)[:80]!r}") from None
    if not isinstance(answer, dict) or "rewards" not in answer:
        raise RewardError(f"reward server {url} returned {_one_line(text)[:80]!r}: expected a JSON object "
                          '{"rewards": [one number per response], ...}')
    check = CallableReward(None, f"at {url}")  # a reward function's checks, under this name (fn is never called)
    scores = check._check(answer["rewards"], "rewards", prompts, responses)
    extra = answer.get("extra_logs") or {}
    if not isinstance(extra, dict):
        raise RewardError(f"reward server {url} returned extra_logs {_one_line(json.dumps(extra))[:80]}: expected an "
                          "object {name: [one value per response]}")
    metrics = {}
    for name, values in extra.items():
        if isinstance(values, list) and values and all(isinstance(v, str) for v in values):
            if len(values) != len(responses):
                raise RewardError(f'reward function at {url} returned {len(values)} values in "{name}" for '
                                  f"{len(responses)} responses")
            metrics[name] = values  # a text entry (a judge's rationale): passed through
        else:
            metrics[name] = check._check(values, name, prompts, responses)
    return scores, metrics


def _error_of(text):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def _one_line(text) -> str:
    return " ".join(str(text).split())[:200]


def _raise_everywhere(failure):
    """Raise `failure` (or None: nothing failed here) on every process, as soon as one process has one: the processes
    agree on a flag (0 ok, 1 RewardError, 2 RewardUnavailable) and the message of the lowest rank that failed."""
    if not torch.distributed.is_initialized():
        if failure is not None:
            raise failure
        return
    from . import distributed as dist

    flag = 0 if failure is None else (2 if isinstance(failure, RewardUnavailable) else 1)
    worst = dist.all_reduce_max_int(flag)
    if worst == 0:
        return
    # each process's message as bytes in a CPU tensor (gloo moves CPU tensors on every backend; nothing is pickled)
    text = (str(failure) if failure is not None else "").encode()[:1023]
    mine = torch.zeros(1, 1024, dtype=torch.uint8)
    mine[0, : len(text)] = torch.tensor(list(text), dtype=torch.uint8)
    mine[0, 1023] = flag
    everyone = dist.all_gather_rows(mine)  # [world, 1024]
    row = next(r for r in everyone if int(r[1023]) == worst)
    message = bytes(row[:1023].tolist()).rstrip(b"\0").decode(errors="replace")
    if failure is not None and flag == worst:
        raise failure
    raise RewardUnavailable(message) if worst == 2 else RewardError(message)
