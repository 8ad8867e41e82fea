"""A reward source in another process: the scores come from reward servers over HTTP (config `reward_url`).

    PPO_REWARD_API_KEY=... ppo-serve-reward --port 8000 --reward_model ~/models/skywork-rm   # the reward model host
    PPO_REWARD_API_KEY=... ppo-train --reward_url http://rm-host:8000 ...                    # the trainer

RemoteReward is called as every reward source is (ppo_core.rewards): scores, metrics = source(prompts, responses,
columns). It POSTs OpenRLHF's remote reward request (the exact protocol: ppo_core.rewards.server) and reads the
answer back with the checks a local reward function gets.

Credentials: the server's shared key from the environment variable PPO_REWARD_API_KEY, sent as
`Authorization: Bearer KEY` (never from the config, which the run directory records); a URL's own user:password@
goes as HTTP Basic instead; a Modal proxy auth token as Modal-Key / Modal-Secret (proxy_auth_headers). Every URL
this module prints is redact_url's (ppo_core.rewards.redact): credentials replaced by ***.

Several URLs: the batch is split into len(urls) contiguous chunks, chunk k posted to urls[(k + start) % n] at the
same time (the servers score in parallel, as OpenRLHF spreads a batch over its remote_rm_url list); `start` moves on
by one each call, so a batch smaller than the list still spreads its load. A chunk that gets no answer is tried again
on the next URL (the same one when there is one), at most `retries` times, retry k after backoff_s * 2**(k-1) seconds.

Each try has ONE deadline, timeout_s after it starts, for the connection, the request and the whole answer: every
wait for bytes is bounded by the time left, so a server that trickles its answer cannot hold the trainer past it.
A redirect is not followed (it would carry the credentials to another host): it is an error naming the new location.
An answer longer than max_answer_bytes is refused unread.

What a call can raise:
  - RewardError (exit 2 in ppo-train, bad input): the server answered, and the answer is wrong - malformed JSON
    (nested too deeply or a number too long to read included), no "rewards", a wrong number of them, a value that is
    not a finite number (one line naming the URL, the sample and what came back), an answer over max_answer_bytes, a
    redirect, a request the server refused (HTTP 4xx: 401 a missing or wrong key, 413 a request over its caps), the
    reward source failing on the server (HTTP 500). Retrying would not change it.
  - RewardUnavailable (exit 3 in ppo-train, which saves a checkpoint): no answer after 1 + retries tries - the
    connection refused or reset, no whole answer within timeout_s, HTTP 502, 503, 504 or another 5xx but 500.
With several processes every process calls the source at the same point (the loop does); a failure on one process,
whatever it is, is raised on all of them, so that they stop together instead of waiting for each other in a
collective.
"""
import base64
import concurrent.futures
import functools
import http.client
import io
import json
import os
import socket
import time
import urllib.parse

import torch

from ..rewards.redact import redact_url
from .interface import CallableReward, RewardError

# The request's own fields (ppo_core.rewards.server); a prompt column of one of these names cannot be sent.
PROTOCOL_FIELDS = ("query", "prompts", "responses", "labels")
API_KEY_ENV = "PPO_REWARD_API_KEY"  # the reward server's shared key, on both sides (ppo_core.rewards.server)
MAX_ANSWER_BYTES = 64 << 20
"""The longest answer read (64 MiB: a score is ~20 bytes, a judge's rationale a few KB a sample)."""


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
    """One try that got no usable answer (connection, timeout, HTTP 502/503/504): worth another try."""


class DeadlineReader(io.RawIOBase):
    """A socket's bytes, each wait for them bounded by the time left until `deadline` (a time.monotonic() value the
    owner may move on): a read through it ends by the deadline however slowly the peer sends, with TimeoutError.
    A socket's own timeout bounds each wait alone, so a byte every timeout_s / 2 would hold a reader forever."""

    def __init__(self, sock, deadline):
        self.sock, self.deadline = sock, deadline

    def readable(self):
        return True

    def readinto(self, buffer):
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the deadline passed")
        self.sock.settimeout(left)
        return self.sock.recv_into(buffer)


class _DeadlineResponse(http.client.HTTPResponse):
    """http.client's answer, read through a DeadlineReader: its status line, headers and body within one deadline."""

    def __init__(self, sock, *args, deadline, **kwargs):
        super().__init__(sock, *args, **kwargs)
        self.socket_file = self.fp  # open until the answer is closed: it keeps the socket open, as http.client expects
        self.fp = io.BufferedReader(DeadlineReader(sock, deadline))

    def _close_conn(self):
        super()._close_conn()
        self.socket_file.close()


class Target:
    """Where one URL's requests go: host, port, the path with its query, TLS or not, the headers (its credentials),
    and `name`, the URL as printed (redact_url). A URL that does not parse is a RewardError."""

    def __init__(self, url, headers, environ):
        self.name = redact_url(url)
        try:
            parts = urllib.parse.urlsplit(url)
            self.host, self.port = parts.hostname, parts.port
        except ValueError:  # not its message: it quotes the port as read, which may be part of a password
            raise RewardError(f"reward_url {self.name}: its host or port cannot be read (percent-encode a # / ? "
                              f"in its user:password@)") from None
        if parts.scheme not in ("http", "https") or not self.host:
            raise RewardError(f"reward_url {self.name}: expected http://host[:port][/path] or https://...")
        self.https = parts.scheme == "https"
        self.path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        self.headers = dict(headers)
        if parts.username is not None:  # user:password@ in the URL: HTTP Basic, which urllib never sent
            userinfo = f"{urllib.parse.unquote(parts.username)}:{urllib.parse.unquote(parts.password or '')}"
            self.headers["Authorization"] = "Basic " + base64.b64encode(userinfo.encode()).decode()
        elif environ.get(API_KEY_ENV):
            self.headers["Authorization"] = f"Bearer {environ[API_KEY_ENV]}"


class RemoteReward:
    """Scores from reward servers speaking OpenRLHF's remote reward protocol (see the module docstring).

    urls: one or more 'http://host:port[/path]'; timeout_s: seconds for each try, from connecting to the last byte
    of the answer; retries: further tries of a chunk after its first fails; backoff_s: the wait before retry k
    (1, 2, ...) is backoff_s * 2**(k-1); max_answer_bytes: the longest answer read.
    Called -> (scores [B] float32 on the CPU, metrics {name: [B] float32, or a list of B str for a text entry}).
    """

    def __init__(self, urls, timeout_s=60.0, retries=3, backoff_s=1.0, max_answer_bytes=MAX_ANSWER_BYTES):
        self.urls = [urls] if isinstance(urls, str) else list(urls)
        if not self.urls:
            raise ValueError("RemoteReward needs at least one URL")
        headers = {"Content-Type": "application/json", "Connection": "close", **proxy_auth_headers(os.environ)}
        self.targets = [Target(url, headers, os.environ) for url in self.urls]
        self.timeout_s, self.retries, self.backoff_s = float(timeout_s), int(retries), float(backoff_s)
        self.max_answer_bytes = int(max_answer_bytes)
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
        except Exception as e:  # whatever else: still raised on every process, so that none waits in a collective
            failure = RewardError(f"reward servers {', '.join(t.name for t in self.targets)}: the answer could not "
                                  f"be read ({type(e).__name__}: {_one_line(e)})")
            failure.__cause__ = e
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
                raise RewardError(f"reward servers {', '.join(t.name for t in self.targets)} returned different "
                                  f"extra_logs entries for the chunks of one batch ({names} and {list(chunk_metrics)})")
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
            target = self.targets[(url_index + attempt) % len(self.targets)]
            if target.name not in tried:
                tried.append(target.name)
            try:
                answer = self._post(target, body)
            except _Down as e:
                reason = str(e)
                continue
            return check_answer(answer, target.name, prompts, responses)
        raise unreachable(tried, 1 + self.retries, reason)

    def _post(self, target, body: bytes):
        """One try, within one deadline: the server's answer as text; RewardError for a refusal, a redirect, an
        answer too long or a reward error, _Down otherwise."""
        deadline = time.monotonic() + self.timeout_s
        kind = http.client.HTTPSConnection if target.https else http.client.HTTPConnection
        connection = kind(target.host, target.port, timeout=self.timeout_s)
        connection.response_class = functools.partial(_DeadlineResponse, deadline=deadline)
        reply = None
        try:
            connection.connect()
            connection.sock.settimeout(max(deadline - time.monotonic(), 1e-3))  # the send's total (Python >= 3.5)
            connection.request("POST", target.path, body, target.headers)
            reply = connection.getresponse()
            status, location = reply.status, reply.getheader("Location", "")
            text = _read_capped(reply, self.max_answer_bytes, target.name)
        except TimeoutError:
            raise _Down(f"no answer within {self.timeout_s:g} s") from None
        except ConnectionRefusedError:
            raise _Down("connection refused") from None
        except (http.client.HTTPException, OSError) as e:  # reset, closed mid-answer, a name that does not resolve
            if time.monotonic() >= deadline:
                raise _Down(f"no answer within {self.timeout_s:g} s") from None
            raise _Down(_one_line(f"{type(e).__name__}: {e}")) from None
        finally:
            if reply is not None:
                reply.close()
            connection.close()
        if 200 <= status < 300:
            return text
        if 300 <= status < 400:
            raise RewardError(f"reward server {target.name} answered HTTP {status}, a redirect to "
                              f"{redact_url(location) or '(no Location)'}, which is not followed: give that URL "
                              f"itself (on Modal: a request over 150 s is redirected; send smaller requests)")
        error = _error_of(text)
        message = _one_line(error["error"] if isinstance(error, dict) and "error" in error else text)
        if status >= 500 and status != 500 and not (isinstance(error, dict) and error.get("reward_error")):
            raise _Down(f"HTTP {status}: {message}")
        if status >= 500:
            raise RewardError(f"reward server {target.name}: {message}")
        raise RewardError(f"reward server {target.name} refused the request (HTTP {status}): {message}")


def _read_capped(reply, cap, name) -> str:
    """The answer's body, refused (RewardError) once it is over `cap` bytes, before it is read when it says so."""
    length = reply.getheader("Content-Length", "")
    if length.strip().isdigit() and int(length) > cap:
        raise RewardError(f"reward server {name} answered {int(length)} bytes, more than the {cap} read")
    chunks, size = [], 0
    while chunk := reply.read(1 << 16):
        size += len(chunk)
        if size > cap:
            raise RewardError(f"reward server {name} answered more than the {cap} bytes read")
        chunks.append(chunk)
    return b"".join(chunks).decode("utf-8", errors="replace")


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
    except (ValueError, RecursionError) as e:  # a number over Python's 4300 digits, lists nested past the stack
        reason = "nested too deeply" if isinstance(e, RecursionError) else _one_line(e)[:80]
        raise RewardError(f"reward server {url} returned JSON that cannot be read ({reason}): "
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
    except (ValueError, RecursionError):  # not JSON, a number too long, nested too deeply
        return None


def _one_line(text) -> str:
    return " ".join(str(text)[:1000].split())[:200]


def _raise_everywhere(failure):
    """Raise `failure` (or None: nothing failed here) on every process, as soon as one process has one: the processes
    agree on a flag (0 ok, 1 RewardError, 2 RewardUnavailable) and the message of the lowest rank that failed."""
    if not torch.distributed.is_initialized():
        if failure is not None:
            raise failure
        return
    from ..models import distributed as dist

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
