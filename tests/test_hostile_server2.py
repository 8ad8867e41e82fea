"""The reward server under attack, round 2 (issue 49, finding 8), on 127.0.0.1: a body that is small in bytes but huge
once decoded (`[],` repeated: 413 from a count of its values made before decoding), requests that together would hold
more than --max_pending_mb (the later one waits, then 503), a reward that hangs (504 at --score_timeout_s, and the
server keeps scoring the requests behind it with a fresh scoring thread; 503 once 4 hung calls still run), and a
Content-Length written in digits that are not ASCII (400 with a message, not a closed connection)."""
import json
import socket
import threading
import time

import pytest
import torch

from ppo_core.rewards import server as reward_server
from ppo_core.rewards.interface import RewardError
from ppo_core.rewards.remote import RemoteReward, RewardUnavailable

KEY = "k-49b"


class Length:
    """Each response's length as its score; a response "hang" blocks until `release` is set."""

    def __init__(self):
        self.release = threading.Event()

    def check_columns(self, names):
        pass

    def __call__(self, prompts, responses, columns=None):
        if "hang" in responses:
            self.release.wait()
        return torch.tensor([float(len(r)) for r in responses]), {}


@pytest.fixture
def serve():
    """start(source, **limits) -> the port of a real reward server in a thread."""
    started = []

    def start(source, **limits):
        options = {"host": "127.0.0.1", "port": 0, "max_batch": 256, "api_key": KEY, "max_body_mb": 8.0,
                   "max_rows": 1000, "timeout_s": 2.0, "max_connections": 8, **limits}
        server = reward_server.make_server(source, "length", options)
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        started.append(server)
        return server.server_address[1]

    yield start
    for server in started:
        server.shutdown()
        server.server_close()


def head(length, path="/"):
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


def exchange(port, raw, timeout=10.0):
    """Send raw bytes; -> (HTTP status, the JSON answer, seconds until the answer came)."""
    import http.client
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(raw)
        reply = http.client.HTTPResponse(sock)
        reply.begin()
        return reply.status, json.loads(reply.read()), time.monotonic() - t0


def post(port, prompts, responses, **fields):
    body = json.dumps({"prompts": prompts, "responses": responses, **fields}).encode()
    return exchange(port, head(len(body)) + body)


def health(port):
    return exchange(port, f"GET /health HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n\r\n".encode())[1]


# ---------------------------------------------------------------------------- the decoded size


def values_in(obj) -> int:
    """The reference count: every value once (a dict's keys too), + 1 for each empty list or dict (whose '[' or '{'
    count_values counts without a value after it)."""
    if isinstance(obj, list):
        return 1 + (not obj) + sum(values_in(v) for v in obj)
    if isinstance(obj, dict):
        return 1 + (not obj) + sum(1 + values_in(v) for v in obj.values())
    return 1


@pytest.mark.parametrize("obj", [
    {"prompts": ["a, b: [c] {d}"] * 7, "responses": ['he said "x, y", \\ then: [1, 2]'] * 7},
    {"tests": [[{"in": "1,2", "out": "3"}, {}], [], ["\\\\", "\\\"", ",:[{"]], "n": [1, 2.5, None, True]},
    [[], [[]], {"": ""}],
], ids=["commas-in-strings", "nested-and-escapes", "empties"])
def test_count_values_is_exact_at_any_limit(obj):
    body = json.dumps(obj).encode()
    n = values_in(obj)
    quick = reward_server.count_values(body, 10**9)  # over the whole text, strings included: never fewer
    assert quick == n if b'"' not in body.replace(b'""', b"") else quick > n
    for limit in (n - 1, n):  # the text has more '[', ',' and ':' than n: the strings are cut out
        assert (reward_server.count_values(body, limit) > limit) == (n > limit), limit


def test_a_body_huge_once_decoded_is_413_before_decoding(serve):
    port = serve(Length(), max_values=1000)
    body = b"[" + b"[]," * 2_000_000 + b"[]]"  # 6 MB, under --max_body_mb 8; decoded it would be ~130 MB
    status, answer, seconds = exchange(port, head(len(body)) + body)
    assert status == 413 and answer["error"].startswith("the request holds more JSON values (strings, numbers, lists, "
                                                        "...) than this server's --max_values 1000")
    assert seconds < 2.0, seconds
    # commas, colons and brackets inside strings are not values: 2 lists of 300 strings is 603 values
    text = "x, y: [z] " * 100
    assert post(port, ["p"] * 300, [text] * 300)[:2] == (200, {"rewards": [float(len(text))] * 300,
                                                              "scores": [float(len(text))] * 300, "extra_logs": {}})
    assert post(port, ["p"] * 500, [text] * 500)[0] == 413  # 1003 values


def test_requests_beyond_max_pending_wait_then_are_503(serve):
    # a request of 5000 bytes holds 5000 + 96 * 2500 = 245000 bytes of the 0.3 MB budget until it is answered
    source = Length()
    port = serve(source, max_pending_mb=0.3, timeout_s=0.6)
    held = json.dumps({"prompts": ["p" * (5000 - 40)], "responses": ["hang"]}).encode()
    body = json.dumps({"prompts": ["p" * (5000 - 37)], "responses": ["r"]}).encode()
    assert len(held) == len(body) == 5000
    holder = socket.create_connection(("127.0.0.1", port))
    holder.sendall(head(len(held)) + held)  # scored by a reward that waits: the request holds its share meanwhile
    time.sleep(0.2)
    status, answer, seconds = exchange(port, head(len(body)) + body)
    assert status == 503 and "--max_pending_mb 0.3" in answer["error"] and 0.5 < seconds < 2.0, (status, seconds)
    source.release.set()  # the first request is answered and gives its share back
    assert holder.recv(12) == b"HTTP/1.1 200"
    holder.close()
    assert exchange(port, head(len(body)) + body)[0] == 200


# ---------------------------------------------------------------------------- a reward that hangs


def test_a_hung_reward_is_504_and_the_server_keeps_scoring(serve, monkeypatch):
    source = Length()
    port = serve(source, score_timeout_s=0.3)
    try:
        status, answer, seconds = post(port, ["p"], ["hang"])
        assert status == 504 and answer["reward_error"] is True and 0.3 <= seconds < 2.0, (status, seconds)
        assert answer["error"] == ("the reward source did not answer within --score_timeout_s 0.3 (scoring 1 rows); "
                                   "the call was abandoned and the server scores the requests behind it")
        assert post(port, ["p", "q"], ["ab", "abc"])[:2] == (200, {"rewards": [2.0, 3.0], "scores": [2.0, 3.0],
                                                                   "extra_logs": {}})
        assert health(port)["hung"] == 1
        monkeypatch.setenv("PPO_REWARD_API_KEY", KEY)  # the trainer's side: a reward error, not "server down"
        with pytest.raises(RewardError) as caught:
            RemoteReward([f"http://127.0.0.1:{port}"], timeout_s=5, retries=2, backoff_s=0.01)(["p"], ["hang"])
        assert not isinstance(caught.value, RewardUnavailable) and "--score_timeout_s 0.3" in str(caught.value)
        for _ in range(2):
            assert post(port, ["p"], ["hang"])[0] == 504
        assert health(port)["hung"] == 4
        status, answer, seconds = post(port, ["p"], ["ok"])
        assert status == 503 and answer["reward_error"] is True and seconds < 0.5
        assert answer["error"].startswith("the reward source has hung in 4 calls (each over --score_timeout_s 0.3) "
                                          "that are still running; this server scores no more")
    finally:
        source.release.set()  # the hung calls return; their answers are dropped
    deadline = time.monotonic() + 5
    while health(port)["hung"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert health(port)["hung"] == 0
    assert post(port, ["p"], ["abcd"])[:2] == (200, {"rewards": [4.0], "scores": [4.0], "extra_logs": {}})


# ---------------------------------------------------------------------------- Content-Length


@pytest.mark.parametrize("length", ["٣".encode(), "３".encode(), "²".encode("latin-1"), "1²".encode("latin-1")],
                         ids=["arabic-indic", "fullwidth", "superscript", "digit-superscript"])
def test_a_content_length_in_other_digits_is_400(serve, length):
    port = serve(Length())
    raw = head("LEN").replace(b"LEN", length) + b"{}"
    status, answer, _ = exchange(port, raw)
    assert status == 400 and answer["error"].startswith("Content-Length must be a non-negative integer, got ")
    assert post(port, ["p"], ["ab"])[0] == 200


@pytest.mark.parametrize("argv, message", [
    (["--max_values=0"], "--max_values must be >= 1, got 0"),
    (["--max_pending_mb=0"], "--max_pending_mb must be > 0, got 0"),
    (["--score_timeout_s=inf"], "--score_timeout_s must be > 0, got inf"),
    (["--score_timeout_s=soon"], "--score_timeout_s takes a number, got 'soon'"),
])
def test_the_new_limits_are_checked_as_options(argv, message):
    with pytest.raises(reward_server.ConfigError) as caught:
        reward_server.split_server_options(argv, environ={})
    assert str(caught.value) == message
    options, rest = reward_server.split_server_options(["--max_values=7", "--score_timeout_s", "2.5", "--task=x"], {})
    assert (options["max_values"], options["score_timeout_s"], options["max_pending_mb"], rest) == \
        (7, 2.5, 512.0, ["--task=x"])


def test_a_hang_while_a_failed_batch_is_scored_request_by_request_loses_no_request():
    """Three requests merged into one call that fails; scored alone, the second hangs: it is abandoned (504) and the
    third, still unscored, is scored by the new thread."""
    source = Length()
    calls = []

    def scores(prompts, responses, columns=None):
        calls.append(list(responses))
        if len(responses) > 1:
            raise ValueError("a merged call fails")
        return source(prompts, responses, columns)

    source_fn = type("Source", (), {"check_columns": lambda self, names: None,
                                    "__call__": lambda self, *a: scores(*a)})()
    batcher = reward_server.Batcher(source_fn, max_batch=8, score_timeout_s=0.3)
    jobs = [reward_server.Job(["p"], [r], {}) for r in ("ab", "hang", "abcd")]
    with batcher.ready:  # queued together, so that one call takes all three
        batcher.queue.extend(jobs)
        batcher.ready.notify()
    try:
        deadline = time.monotonic() + 5
        while not all(job.done.is_set() for job in jobs) and time.monotonic() < deadline:
            batcher._abandon_if_hung()  # what a waiting request thread does
            time.sleep(0.05)
        assert [job.result[0] if job.result else type(job.error).__name__ for job in jobs] == \
            [[2.0], "ScoringTimeout", [4.0]]
        assert calls == [["ab", "hang", "abcd"], ["ab"], ["hang"], ["abcd"]]
    finally:
        source.release.set()
