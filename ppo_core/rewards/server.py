"""ppo-serve-reward: any reward source of ppo-core served over HTTP, so a reward model can live on its own machine.

    export PPO_REWARD_API_KEY=$(python -c "import secrets; print(secrets.token_urlsafe(32))")   # both sides
    ppo-serve-reward --host 0.0.0.0 --port 8000 --reward_model ~/models/skywork-rm --dtype bfloat16
    ppo-serve-reward --port 8000 --reward_fn my_rewards.py:score --max_batch 512
    ppo-train --reward_url http://rm-host:8000 ...           # the trainer's side: ppo_core.rewards.remote

The reward source is chosen with ppo-train's own options and config file (--config FILE.toml, --task, --reward_fn,
--reward_weights, --reward_model, --chat_template, --enable_thinking, --device, --dtype, --threads; every other key
of the config is accepted and unused, so a run's TOML file serves as it is). The server's own options: --host
(default 127.0.0.1), --port (default 8000; 0 = a free port), --max_batch (default 256), and the limits below. When
it is ready it prints one line on stdout, `serving <source> on http://HOST:PORT` (the port it got, with --port 0). An
error at start-up (an unknown key, a checkpoint that does not load, a port taken) is one line on stderr and exit
status 2.

Who may score, and how much (anyone who reaches the port could otherwise score on your GPU, or hold it):
    --api_key KEY        (default: the environment variable PPO_REWARD_API_KEY, which keeps it out of `ps`) every
                         request must carry `Authorization: Bearer KEY` (or HTTP Basic with KEY as the password: a
                         http://user:KEY@host URL), else 401; compared in constant time. ppo-train sends
                         $PPO_REWARD_API_KEY. Empty = no key; listening on anything but loopback without one prints a
                         warning line.
    --max_body_mb 128    a request whose Content-Length is larger is 413, its body never read; a missing Content-Length
                         is 411, a negative or non-integer one (ASCII digits only) 400.
    --max_values 1048576 a request whose JSON holds more values (strings, numbers, lists, ...) is 413, counted on its
                         bytes before it is decoded: decoded JSON costs up to ~20x its text (`[],` is 3 bytes, a list
                         64), so the byte cap alone let 114 MB of `[],` become 3.4 GB.
    --max_pending_mb 512 the requests being read, decoded, queued or scored together hold at most this much, each
                         counted as its Content-Length + 96 bytes for every value it may hold (at most one per 2
                         bytes, at most --max_values); a request waits for room up to --timeout_s, then is 503.
    --max_rows 16384     a request of more rows is 413 (it would hold the scorer, and every request behind it).
    --score_timeout_s 60 a call of the reward source running longer is abandoned: its requests are answered 504
                         (a reward error for the trainer), and a fresh scoring thread serves the queue. A Python
                         thread cannot be killed, so the hung call keeps its thread (and whatever it holds) until it
                         returns; with 4 such calls still running, every request is 503 (restart the server).
    --timeout_s 60       a connection must deliver each request, line, headers and body, within this many seconds of
                         the request's start (or of the previous answer on a kept-alive connection), else it is closed
                         (408 when the body was late).
    --max_connections 32 connections handled at once, one thread each; one more is answered 503 and closed (the client
                         tries again), so no number of connections can pile up threads.

The protocol: OpenRLHF's remote reward protocol (`--remote_rm_url`, openrlhf/utils/remote_rm_utils.py: JSON POSTed,
{"query", "prompts", "labels"} in, {"rewards", "scores", "extra_logs"} out), JSON over HTTP and nothing else.

POST, to any path (so OpenRLHF's `--remote_rm_url http://HOST:PORT/get_reward` works), a JSON object of B rows:
    "prompts":   [B str]   required. Handed to the reward as they are: ppo-core's client sends the raw prompt text
                           (the last user turn's content), OpenRLHF sends its rendered prompt.
    "responses": [B str]   the responses. ppo-core's client sends them; when absent (an OpenRLHF client), each
                           response is query[i][len(prompts[i]):], and every query[i] must start with prompts[i].
    "query":     [B str]   prompt + response (OpenRLHF's); read only when "responses" is absent.
    "labels":    [B]       OpenRLHF's labels: the "answer" column, unless the request also has an "answer" list
                           (ppo-core's client sends both, labels = answer, for OpenRLHF servers).
    any other field: a list of B JSON values, the prompt column of that name (e.g. "answer", "level"), passed to the
                     reward functions whose signature names it (ppo_core.rewards). A field that is not such a list
                     is a bad request.
The answer, HTTP 200:
    {"rewards": [B numbers], "scores": [B numbers] (the same: OpenRLHF's filtering reads "scores"),
     "extra_logs": {name: [B numbers] or [B str]}}
    extra_logs holds the source's per-sample metrics, the keys ppo-train logs for an in-process source
    ("reward/<fn>", "reward/<fn>/<metric>") and text entries (a judge's "judge/rationale") as lists of strings.
    Numbers are the float32 scores written as JSON doubles: the trainer reads back exactly the in-process values.
Errors, each a JSON object {"error": "<one line>"}; the server keeps serving:
    400  not JSON (nested too deeply or a number too long to read included), not an object, a missing or malformed
         field, lists of different lengths, a column the reward needs and the request lacks, a bad Content-Length;
    401  no key, or the wrong one; 408  the body came too slowly; 411  no Content-Length;
    413  over --max_body_mb, --max_values or --max_rows; 503  over --max_connections or --max_pending_mb;
    500  the reward source failed on the request, or returned a score that is not finite:
         {"error": "<the RewardError line>", "reward_error": true};
    504  the reward source's call took longer than --score_timeout_s ("reward_error": true: retrying would hang again);
    503  with "reward_error": true: 4 abandoned calls of the source are still running.
GET /health (+ key) -> 200 {"status": "ok", "source": "<what scores>", "requests": n, "batches": m, "rows": r,
"hung": h}: requests answered, calls of the source, rows scored since start, abandoned calls still running.

Batching: request threads queue their rows; one scoring thread (a reward model is not thread-safe, and one call
over many rows uses the accelerator better) takes the queued requests in arrival order, as many as fit in
max_batch rows and share the same column names, and scores them in ONE call of the source; each request gets its
own rows back. A request larger than max_batch is scored alone. When a merged call fails, each of its requests is
scored alone, so a bad request cannot fail the others. A scoring thread whose call passes --score_timeout_s is
abandoned (the watch is kept by the requests waiting on it) and a new one takes the queue.
"""
import base64
import collections
import contextlib
import dataclasses
import hmac
import io
import ipaddress
import json
import math
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

from ..config import ConfigError, build_config, load_toml, parse_cli
from ..models.model import CheckpointError
from ..models.precision import precision_line, resolve_precision  # ppo-train's own choice of device, dtype and autocast
from .remote import API_KEY_ENV, DeadlineReader
from .source import make_reward_source
from .interface import RewardError

USAGE = """usage: ppo-serve-reward [--host H] [--port P] [--max_batch N] [--api_key KEY] [--max_body_mb M]
                        [--max_values V] [--max_pending_mb P] [--max_rows R] [--timeout_s S] [--score_timeout_s S]
                        [--max_connections C] [--config FILE.toml] [--KEY=VALUE ...]

Serves the reward source that ppo-train would build from the same options (--task, --reward_fn, --reward_model, ...)
over HTTP, with OpenRLHF's remote reward protocol (see ppo_core/rewards/server.py). Point ppo-train at it with
--reward_url http://H:P."""
# the server's own options, as text (the defaults: the module docstring); api_key defaults to $PPO_REWARD_API_KEY
SERVER_OPTIONS = {"host": "127.0.0.1", "port": "8000", "max_batch": "256", "api_key": None, "max_body_mb": "128",
                  "max_values": "1048576", "max_pending_mb": "512", "max_rows": "16384", "timeout_s": "60",
                  "score_timeout_s": "60", "max_connections": "32"}
BYTES_PER_VALUE = 96  # a decoded JSON value's worst cost: a list 56 bytes + its slot 8, a str 49 + its slot, ...
MAX_HUNG = 4  # abandoned calls of the source still running, beyond which the server refuses to score


class BadRequest(ValueError):
    """A request the protocol does not accept: HTTP `status` (400 unless said)."""

    def __init__(self, message, status=400):
        super().__init__(message)
        self.status = status


def count_values(body: bytes, limit: int) -> int:
    """How many JSON values (strings, numbers, lists, objects, ...) `body` holds at most, counted with bytes methods (C
    speed) before anything is decoded: 1 + one per '[', '{', ',' and ':' outside strings. When the count over the
    whole text is within `limit` it is the answer; else the strings are cut out first (escaped backslashes and
    quotes removed, then the text split at quotes), and more than `limit` strings is the answer already."""
    def structural(text):
        return 1 + sum(text.count(c) for c in (b"[", b"{", b",", b":"))

    n = structural(body)
    if n <= limit:
        return n
    bare = body.replace(b"\\\\", b"").replace(b'\\"', b"")  # every quote left opens or closes a string
    strings = bare.count(b'"') // 2
    if strings > limit:
        return strings
    return structural(b"".join(bare.split(b'"')[::2]))  # the even pieces lie outside strings


def parse_request(body: bytes, max_rows=None, max_values=None):
    """A request body -> (prompts [B str], responses [B str], columns {name: [B values]}). Raises BadRequest (413
    for more than max_rows rows, or more than max_values JSON values, counted before decoding)."""
    if max_values is not None:
        values = count_values(body, max_values)
        if values > max_values:
            raise BadRequest(f"the request holds more JSON values (strings, numbers, lists, ...) than this server's "
                             f"--max_values {max_values}: send smaller requests (more URLs, or a smaller batch)", 413)
    try:
        request = json.loads(body)
    except (ValueError, RecursionError) as e:  # not UTF-8, not JSON, a number over 4300 digits, nested too deeply
        reason = "nested too deeply" if isinstance(e, RecursionError) else " ".join(str(e).split())[:200]
        raise BadRequest(f"the request body is not JSON: {reason}") from None
    if not isinstance(request, dict):
        raise BadRequest(f"the request must be a JSON object with \"prompts\" and \"responses\" (or \"query\"), "
                         f"got {type(request).__name__}")
    prompts = _strings(request, "prompts", None)
    B = len(prompts)
    if max_rows is not None and B > max_rows:
        raise BadRequest(f"the request holds {B} rows, more than this server's --max_rows {max_rows}: send smaller "
                         f"requests (more URLs, or a smaller batch)", 413)
    if "responses" in request:
        responses = _strings(request, "responses", B)
    elif "query" in request:  # OpenRLHF: the query is the prompt followed by the response
        queries = _strings(request, "query", B)
        for i, (query, prompt) in enumerate(zip(queries, prompts)):
            if not query.startswith(prompt):
                raise BadRequest(f"query {i} does not start with its prompt, so the response cannot be cut from it "
                                 f"(prompt {prompt[:40]!r}, query {query[:40]!r}); send \"responses\"")
        responses = [query[len(prompt):] for query, prompt in zip(queries, prompts)]
    else:
        raise BadRequest('the request has no "responses" (nor an OpenRLHF "query")')
    columns = {}
    for key, values in request.items():
        if key in ("prompts", "responses", "query"):
            continue
        if not isinstance(values, list) or len(values) != B:
            got = f"a list of {len(values)}" if isinstance(values, list) else type(values).__name__
            raise BadRequest(f"field \"{key}\" must be a list of {B} values, one per prompt, got {got}")
        if key == "labels":  # OpenRLHF's labels are the answer column; an explicit "answer" wins
            if "answer" not in request:
                columns["answer"] = values
        else:
            columns[key] = values
    return prompts, responses, columns


def _strings(request, key, B):
    values = request.get(key)
    if values is None:
        raise BadRequest(f'the request has no "{key}"')
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise BadRequest(f'"{key}" must be a list of strings')
    if B is not None and len(values) != B:
        raise BadRequest(f'"{key}" holds {len(values)} strings for {B} prompts')
    return values


def as_lists(scores, metrics, B):
    """A source's (scores [B] tensor, {name: [B] tensor or B str}) -> (list of B floats, {name: list of B})."""
    if len(scores) != B:
        raise RewardError(f"the reward source gave {len(scores)} scores for {B} responses")
    out = {}
    for name, values in metrics.items():
        values = values.tolist() if isinstance(values, torch.Tensor) else list(values)
        if len(values) != B:
            raise RewardError(f"the reward source's metric '{name}' holds {len(values)} values for {B} responses")
        if not all(isinstance(v, str) or math.isfinite(v) for v in values):  # JSON has no NaN
            raise RewardError(f"the reward source's metric '{name}' holds a value that is not finite")
        out[name] = values
    scores = [float(s) for s in scores.tolist()]
    for i, score in enumerate(scores):
        if not math.isfinite(score):  # JSON has no NaN: the trainer would refuse it anyway, so name it here
            raise RewardError(f"the reward source returned {score} for sample {i}: expected a finite number")
    return scores, out


class ScoringTimeout(RewardError):
    """A call of the reward source that passed --score_timeout_s, or the server refusing to score after MAX_HUNG of
    them: HTTP `status` (504, or 503)."""

    def __init__(self, message, status=504):
        super().__init__(message)
        self.status = status


class Job:
    """One request's rows waiting to be scored; `done` is set when `result` or `error` is."""

    def __init__(self, prompts, responses, columns):
        self.prompts, self.responses, self.columns = prompts, responses, columns
        self.result, self.error, self.done = None, None, threading.Event()


class Batcher:
    """The scoring thread: requests queued together are scored in one call of the source (see the module docstring).
    A call running past score_timeout_s is abandoned: its requests get a ScoringTimeout, the thread is left to finish
    (a Python thread cannot be stopped) and its answer dropped, and a new scoring thread takes the queue."""

    def __init__(self, source, max_batch, autocast=contextlib.nullcontext, score_timeout_s=60.0):
        self.source, self.max_batch, self.autocast = source, max_batch, autocast
        self.score_timeout_s = score_timeout_s
        self.queue, self.ready = collections.deque(), threading.Condition()
        self.counts = {"requests": 0, "batches": 0, "rows": 0, "hung": 0}
        self.calls = {}  # scoring thread's generation -> (its jobs, when its current call began), while it scores
        self.batches = {}  # scoring thread's generation -> the jobs it took from the queue, until it is done with them
        self.generation = 0  # the scoring thread that takes the queue; older ones are abandoned
        self._start_scorer()

    def _start_scorer(self):
        threading.Thread(target=self._serve, args=(self.generation,), name=f"scorer-{self.generation}",
                         daemon=True).start()

    def score(self, prompts, responses, columns):
        """Block until the rows are scored -> (list of B floats, {name: list of B}). Raises RewardError
        (ScoringTimeout when the call scoring them ran past score_timeout_s)."""
        if self.counts["hung"] >= MAX_HUNG:
            raise ScoringTimeout(f"the reward source has hung in {self.counts['hung']} calls (each over "
                                 f"--score_timeout_s {self.score_timeout_s:g}) that are still running; this server "
                                 f"scores no more: fix the reward and restart it", 503)
        job = Job(prompts, responses, columns)
        with self.ready:
            self.queue.append(job)
            self.ready.notify()
        while not job.done.wait(min(0.25, self.score_timeout_s / 4)):
            self._abandon_if_hung()
        if job.error is not None:
            raise job.error
        return job.result

    def _abandon_if_hung(self):
        """Run by every waiting request: the current call past its deadline fails its jobs, and a new thread scores."""
        with self.ready:
            current = self.calls.get(self.generation)
            if current is None or time.monotonic() - current[1] <= self.score_timeout_s:
                return
            del self.calls[self.generation]
            # the rest of its batch (a failed merged call's requests, scored one by one) goes back to the queue
            rest = [job for job in self.batches.pop(self.generation, []) if job not in current[0]
                    and not job.done.is_set()]
            self.queue.extendleft(reversed(rest))
            self.generation += 1
            self.counts["hung"] += 1
            for job in current[0]:
                job.error = ScoringTimeout(f"the reward source did not answer within --score_timeout_s "
                                           f"{self.score_timeout_s:g} (scoring {len(job.prompts)} rows); the call was "
                                           f"abandoned and the server scores the requests behind it")
                self.counts["requests"] += 1
                job.done.set()
            self._start_scorer()

    def _serve(self, generation):
        while True:
            with self.ready:
                while not self.queue and generation == self.generation:
                    self.ready.wait(1.0)
                if generation != self.generation:  # abandoned while its call hung; the call has returned now
                    return
                jobs = [self.queue.popleft()]
                rows, names = len(jobs[0].prompts), set(jobs[0].columns)
                while self.queue and set(self.queue[0].columns) == names and \
                        rows + len(self.queue[0].prompts) <= self.max_batch:
                    jobs.append(self.queue.popleft())
                    rows += len(jobs[-1].prompts)
                self.batches[generation] = jobs
            self._score(jobs, generation)
            with self.ready:
                if self.batches.get(generation) is jobs:
                    del self.batches[generation]

    def _call(self, jobs, generation):
        """One call of the source over the jobs' rows -> (scores, metrics); _Abandoned when it was abandoned meanwhile
        (its jobs are answered already)."""
        prompts = [p for job in jobs for p in job.prompts]
        responses = [r for job in jobs for r in job.responses]
        columns = {name: [v for job in jobs for v in job.columns[name]] for name in jobs[0].columns}
        with self.ready:
            self.calls[generation] = jobs, time.monotonic()
        try:
            with torch.no_grad(), self.autocast():  # the trainer's autocast: the scores ppo-train would compute
                return as_lists(*self.source(prompts, responses, columns or None), len(prompts))
        finally:
            with self.ready:
                if self.calls.pop(generation, None) is None:  # abandoned: its jobs are answered already
                    self.counts["hung"] -= 1
                    raise _Abandoned

    def _score(self, jobs, generation):
        try:
            scores, metrics = self._call(jobs, generation)
        except _Abandoned:
            return
        except Exception as e:
            if len(jobs) > 1:  # find whose rows failed: each request alone
                for job in jobs:
                    if generation != self.generation:  # abandoned on one of them: the rest went back to the queue
                        return
                    self._score([job], generation)
                return
            error = e if isinstance(e, RewardError) else \
                RewardError(f"the reward source raised {type(e).__name__}: {' '.join(str(e).split())[:200]}")
            jobs[0].error = error
            self.counts["requests"] += 1
            jobs[0].done.set()
            return
        self.counts["batches"] += 1
        self.counts["rows"] += len(scores)
        lo = 0
        for job in jobs:
            hi = lo + len(job.prompts)
            job.result = scores[lo:hi], {name: values[lo:hi] for name, values in metrics.items()}
            lo = hi
            self.counts["requests"] += 1
            job.done.set()


class _Abandoned(Exception):
    """Raised out of a call of the source that returned after it was abandoned (its answer is dropped)."""


class Budget:
    """Bytes that the requests in flight (read, decoded, queued, scored) may hold together (--max_pending_mb)."""

    def __init__(self, total):
        self.total, self.left, self.changed = total, total, threading.Condition()

    def take(self, n, deadline) -> int:
        """Wait until n bytes (at most the whole budget) are free and take them -> the bytes taken (0: the deadline
        passed first)."""
        n = min(n, self.total)
        with self.changed:
            while self.left < n:
                if not self.changed.wait(deadline - time.monotonic()) and time.monotonic() >= deadline:
                    return 0
            self.left -= n
        return n

    def give(self, n):
        with self.changed:
            self.left += n
            self.changed.notify_all()


def describe(cfg) -> str:
    """What scores, in words, for the ready line and /health."""
    if getattr(cfg, "judge", ""):  # a generative judge (ppo_core.rewards.judges), once the config has the key
        return f"judge {cfg.judge}"
    if cfg.reward_model:
        return f"reward model {cfg.reward_model}"
    if cfg.reward_fn:
        return f"reward function{'s' if len(cfg.reward_fn) > 1 else ''} {', '.join(cfg.reward_fn)}"
    return f"the reward of task '{cfg.task}'"


BUSY_BODY = b'{"error": "the reward server is at its --max_connections; try again"}'
BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(BUSY_BODY), BUSY_BODY))


class Server(ThreadingHTTPServer):
    """One thread per connection, at most max_connections of them: one more is answered 503 at once and closed."""
    daemon_threads = True  # a request thread never holds the process up at exit
    request_queue_size = 128  # the listen backlog: many trainer processes may post at the same moment

    def __init__(self, address, handler, max_connections=32):
        super().__init__(address, handler)
        self.slots = threading.BoundedSemaphore(max_connections)

    def process_request(self, request, client_address):
        if not self.slots.acquire(blocking=False):
            try:
                request.setblocking(False)  # the accepting thread never waits on a client: a short answer or none
                request.send(BUSY)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:  # no thread started: give its slot back
            self.slots.release()
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()

    def handle_error(self, request, client_address):  # one line, not a traceback: a client hung up or misbehaved
        error = sys.exc_info()[1]
        if not isinstance(error, (ConnectionError, TimeoutError)):
            print(f"ppo-serve-reward: a request from {client_address[0]} failed: {type(error).__name__}: {error}",
                  file=sys.stderr)


def authorized(header, api_key) -> bool:
    """Whether an Authorization header carries api_key: 'Bearer KEY', or HTTP Basic with KEY as the password (a
    http://user:KEY@host URL). Compared in constant time (hmac.compare_digest), so its bytes cannot be timed out."""
    if not api_key:
        return True
    scheme, _, value = (header or "").strip().partition(" ")
    if scheme.lower() == "basic":
        try:
            value = base64.b64decode(value.strip(), validate=True).decode().partition(":")[2]
        except ValueError:  # not base64 (binascii.Error), not UTF-8
            value = ""
    elif scheme.lower() != "bearer":
        value = ""
    return hmac.compare_digest(value.strip().encode(), api_key.encode())


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one request may ask of the server (the module docstring's limits; make_server fills them from the
    options): the API key it must present ("" none), its body's bytes, rows and decoded values at most, the seconds
    it may take to arrive, and the Budget of bytes all requests in flight share (None: 4 bodies' worth)."""
    api_key: str = ""
    max_body_bytes: int = 128 << 20
    max_rows: int = 16384
    timeout_s: float = 60.0
    max_values: int = 1 << 20
    budget: object = None


def make_handler(source, batcher, name, limits: Limits = Limits()):
    """The request handler: the limits of the module docstring, checked from the headers before a body is read."""
    api_key, max_body_bytes, max_rows = limits.api_key, limits.max_body_bytes, limits.max_rows
    timeout_s, max_values = limits.timeout_s, limits.max_values
    budget = limits.budget or Budget(4 * max_body_bytes)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: a client may send many requests on one connection

        def setup(self):
            super().setup()
            # every read of a request (its line, headers and body) against one deadline, set per request below
            self.reader = DeadlineReader(self.connection, time.monotonic() + timeout_s)
            self.socket_file, self.rfile = self.rfile, io.BufferedReader(self.reader)

        def finish(self):
            super().finish()
            self.socket_file.close()

        def handle_one_request(self):
            self.reader.deadline = time.monotonic() + timeout_s
            super().handle_one_request()

        def handle_expect_100(self):  # refuse from the headers before the client sends a body ("Expect: 100-continue")
            refusal = self._refusal()
            if refusal:
                self._reply(*refusal)
                return False
            return super().handle_expect_100()

        def _refusal(self):
            """(status, {"error": ...}) when the headers alone refuse the request (its key, its length), else None."""
            if not authorized(self.headers.get("Authorization"), api_key):
                return 401, {"error": f"this reward server needs its API key: send Authorization: Bearer KEY "
                                      f"(ppo-train sends ${API_KEY_ENV})"}
            if self.command != "POST":
                return None
            text = self.headers.get("Content-Length")
            if text is None:
                return 411, {"error": "a request needs a Content-Length"}
            if not (text.strip().isascii() and text.strip().isdigit()):  # int() would read '٣' or '３' too
                return 400, {"error": f"Content-Length must be a non-negative integer, got {text[:40]!r}"}
            if int(text) > max_body_bytes:
                return 413, {"error": f"the request holds {int(text)} bytes, more than this server's --max_body_mb "
                                      f"{max_body_bytes / 2**20:g}: send smaller requests (more URLs, or a smaller "
                                      f"batch)"}
            return None

        def do_GET(self):
            refusal = self._refusal()
            if refusal:
                self._reply(*refusal)
            elif self.path.rstrip("/") == "/health":
                self._reply(200, {"status": "ok", "source": name, **batcher.counts})
            else:
                self._reply(404, {"error": f"GET {self.path}: not found (POST a request to score, GET /health)"})

        def do_POST(self):
            refusal = self._refusal()
            if refusal:  # the body is left unread, so the connection cannot carry another request
                self._reply(*refusal)
                return
            length = int(self.headers["Content-Length"])
            # what this request may hold once decoded: its bytes, and a value's worth for every 2 of them at most
            held = budget.take(length + BYTES_PER_VALUE * min(max_values, length // 2), self.reader.deadline)
            if not held:
                self._reply(503, {"error": f"the reward server holds --max_pending_mb "
                                           f"{round(budget.total / 2**20, 3):g} of requests; try again"})
                return
            try:
                self._score(length)
            finally:
                budget.give(held)

        def _score(self, length):
            try:
                body = self.rfile.read(length)
            except TimeoutError:
                self._reply(408, {"error": f"the request's body did not arrive within --timeout_s {timeout_s:g}"})
                return
            try:
                prompts, responses, columns = parse_request(body, max_rows, max_values)
                del body
                source.check_columns(list(columns))
            except BadRequest as e:
                self._reply(e.status, {"error": " ".join(str(e).split())})
                return
            except (RewardError, ValueError) as e:
                self._reply(400, {"error": " ".join(str(e).split())})
                return
            try:
                scores, metrics = batcher.score(prompts, responses, columns)
            except ScoringTimeout as e:
                self._reply(e.status, {"error": " ".join(str(e).split()), "reward_error": True})
                return
            except RewardError as e:
                self._reply(500, {"error": " ".join(str(e).split()), "reward_error": True})
                return
            self._reply(200, {"rewards": scores, "scores": scores, "extra_logs": metrics})

        def _reply(self, status, obj):
            try:
                body = json.dumps(obj, allow_nan=False).encode()
            except (TypeError, ValueError) as e:  # what the source gave cannot be JSON: that is the answer
                status, body = 500, json.dumps({"error": f"the reward source's answer cannot be written as JSON: {e}",
                                                "reward_error": True}).encode()
            if status in (401, 408, 411, 413) or status == 400 and self.command == "POST":
                self.close_connection = True  # a body may be left unread: this connection cannot carry another request
            self.connection.settimeout(timeout_s)  # the whole answer's send (Python >= 3.5: a total, not per send)
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            if status == 401:
                self.send_header("WWW-Authenticate", "Bearer")
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format, *args):  # no line per request
            pass

    return Handler


def split_server_options(argv, environ=os.environ):
    """(the server's own options {host, port, max_batch, api_key, max_body_mb, max_values, max_pending_mb, max_rows,
    timeout_s, score_timeout_s, max_connections}, the rest of argv for config.parse_cli)."""
    own, rest, i = dict(SERVER_OPTIONS), [], 0
    while i < len(argv):
        key, eq, value = argv[i][2:].partition("=") if argv[i].startswith("--") else ("", "", "")
        key = key.replace("-", "_")
        if key in SERVER_OPTIONS:
            if not eq:
                if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                    raise ConfigError(f"option --{key} needs a value")
                value, i = argv[i + 1], i + 1
            own[key] = value
        else:
            rest.append(argv[i])
        i += 1
    api_key = own["api_key"] if own["api_key"] is not None else environ.get(API_KEY_ENV, "")
    options = {"host": own["host"], "api_key": api_key}
    for key, kind, ok, rule in [("port", int, lambda v: 0 <= v <= 65535, "in [0, 65535]"),
                                ("max_batch", int, lambda v: v >= 1, ">= 1"),
                                ("max_body_mb", float, lambda v: 0 < v < math.inf, "> 0"),
                                ("max_values", int, lambda v: v >= 1, ">= 1"),
                                ("max_pending_mb", float, lambda v: 0 < v < math.inf, "> 0"),
                                ("max_rows", int, lambda v: v >= 1, ">= 1"),
                                ("timeout_s", float, lambda v: 0 < v < math.inf, "> 0"),
                                ("score_timeout_s", float, lambda v: 0 < v < math.inf, "> 0"),
                                ("max_connections", int, lambda v: v >= 1, ">= 1")]:
        try:
            options[key] = kind(own[key])
        except ValueError:
            kind_name = "an integer" if kind is int else "a number"
            raise ConfigError(f"--{key} takes {kind_name}, got {own[key]!r}") from None
        if not ok(options[key]):
            raise ConfigError(f"--{key} must be {rule}, got {own[key]}")
    return options, rest


def is_loopback(host) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name, or "" (every interface)
        return False


def make_server(source, name, options, autocast=contextlib.nullcontext):
    """The server (not yet serving) of a reward source under the options of split_server_options."""
    defaults = {key: float(value) for key, value in SERVER_OPTIONS.items() if key in ("max_values", "max_pending_mb",
                                                                                    "score_timeout_s")}
    options = {**defaults, **options}
    batcher = Batcher(source, options["max_batch"], autocast, options["score_timeout_s"])
    limits = Limits(options["api_key"], int(options["max_body_mb"] * 2**20), options["max_rows"],
                    options["timeout_s"], int(options["max_values"]), Budget(int(options["max_pending_mb"] * 2**20)))
    handler = make_handler(source, batcher, name, limits)
    return Server((options["host"], options["port"]), handler, options["max_connections"])


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    try:
        server_options, rest = split_server_options(argv)
        own, overrides = parse_cli(rest)
        if "resume" in own:
            raise ConfigError("--resume is ppo-train's; a reward server takes --config and --KEY=VALUE")
        cfg = build_config(load_toml(own["config"]) if "config" in own else {}, overrides, own.get("config", ""))
        if cfg.reward_url:
            raise ConfigError("config key 'reward_url' names another reward server; a reward server scores with "
                              "its own reward source (reward_fn, reward_model or the task's reward)")
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        precision = resolve_precision(cfg)
        source = make_reward_source(cfg, torch.device(precision.device), precision.param_dtype)
        name = describe(cfg)
        try:
            server = make_server(source, name, server_options, precision.autocast)
        except OSError as e:
            raise ConfigError(f"cannot listen on {server_options['host']}:{server_options['port']}: {e.strerror or e}") from None
    except (ConfigError, CheckpointError, RewardError, FileNotFoundError) as e:
        print(f"ppo-serve-reward: error: {e}", file=sys.stderr)
        return 2
    host, port = server.server_address[:2]
    print(f"precision: {precision_line(precision)}", file=sys.stderr, flush=True)
    if not server_options["api_key"] and not is_loopback(server_options["host"]):
        where = server_options["host"] or "every interface"
        print(f"ppo-serve-reward: warning: listening on {where} without an API key: anyone who reaches port {port} "
              f"can score; set {API_KEY_ENV} (or --api_key)", file=sys.stderr, flush=True)
    print(f"serving {name} on http://{host}:{port}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
