"""The reward server and its client under attack (issue 38, items 2, 3 and 6's client side), all on 127.0.0.1.

The server: the real ppo-serve-reward server (reward_server.make_server) in a thread, over a tiny reward source, hit by
raw sockets: its key (401), its caps on a request's bytes (413, decided from Content-Length before any body) and rows,
a bad Content-Length (400), a connection that trickles (closed at the deadline), more connections than it handles at
once (503), JSON it cannot read (400), and a source that returns NaN (500, which the client takes for a RewardError).
The client: RemoteReward against tiny hostile servers (socketserver in a thread) that trickle their answer (one deadline
per request), redirect (not followed: the new host gets nothing), answer too much, or answer JSON that cannot be read.
And redact_url, hand-worked. Deadlines are 0.5 s, so the file runs in a few seconds."""
import base64
import http.client
import json
import socket
import socketserver
import threading
import time

import pytest
import torch

from ppo_core.rewards import remote as remote_reward, server as reward_server
from ppo_core.rewards.remote import RemoteReward, RewardUnavailable
from ppo_core.rewards.interface import RewardError

KEY = "k-3f9a1c"
TIMEOUT_S = 0.5
SLACK_S = 0.4  # a loaded 2-core machine: thread start-up and scheduling on top of a deadline


class Length:
    """A reward source (the protocol every source follows): each response's length as its score, NaN for 'nan'."""

    def check_columns(self, names):
        pass

    def __call__(self, prompts, responses, columns=None):
        return torch.tensor([float("nan") if r == "nan" else float(len(r)) for r in responses]), {}


@pytest.fixture
def serve():
    """start(**limits) -> the port of a real reward server in a thread, with the key KEY and small limits."""
    started = []

    def start(**limits):
        options = {"host": "127.0.0.1", "port": 0, "max_batch": 256, "api_key": KEY, "max_body_mb": 1.0,
                   "max_rows": 100, "timeout_s": TIMEOUT_S, "max_connections": 4, **limits}
        server = reward_server.make_server(Length(), "length", options)
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        started.append(server)
        return server.server_address[1]

    yield start
    for server in started:
        server.shutdown()
        server.server_close()


def exchange(port, head, body=b"", timeout=5.0):
    """Send raw bytes; -> (HTTP status, the JSON answer, seconds until the answer came)."""
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(head + body)
        reply = http.client.HTTPResponse(sock)
        reply.begin()
        return reply.status, json.loads(reply.read()), time.monotonic() - t0


def post_head(length, auth=f"Bearer {KEY}"):
    return (f"POST / HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nAuthorization: {auth}\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


def request(prompts, responses):
    return json.dumps({"prompts": prompts, "responses": responses}).encode()


# ---------------------------------------------------------------------------- the server


def test_the_key_is_required_and_compared(serve, monkeypatch):
    port = serve()
    body = request(["a=", "b="], ["xyz", "q"])
    for auth in ("", "Bearer wrong", f"Bearer {KEY}x", f"Basic {base64.b64encode(b'u:wrong').decode()}", "Basic !!"):
        status, answer, _ = exchange(port, post_head(len(body), auth), body)
        assert status == 401 and "PPO_REWARD_API_KEY" in answer["error"], (auth, answer)
    status, answer, _ = exchange(port, post_head(len(body)), body)
    assert status == 200 and answer["rewards"] == [3.0, 1.0]
    status, answer, _ = exchange(port, post_head(len(body), f"Basic {base64.b64encode(f'me:{KEY}'.encode()).decode()}"),
                                 body)
    assert status == 200 and answer["rewards"] == [3.0, 1.0]  # a http://user:KEY@host URL
    assert exchange(port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")[0] == 401
    # the client: the key from the environment as a Bearer token; without it one line naming the 401, exit 2's kind
    url = f"http://127.0.0.1:{port}"
    monkeypatch.delenv("PPO_REWARD_API_KEY", raising=False)
    with pytest.raises(RewardError, match=r"refused the request \(HTTP 401\): this reward server needs its API key"):
        RemoteReward([url], timeout_s=5, retries=0)(["a="], ["xyz"])
    monkeypatch.setenv("PPO_REWARD_API_KEY", KEY)
    assert RemoteReward([url], timeout_s=5, retries=0)(["a=", "b="], ["xyz", "q"])[0].tolist() == [3.0, 1.0]
    # a key in the URL's userinfo goes as HTTP Basic; a message never shows it
    monkeypatch.delenv("PPO_REWARD_API_KEY")
    assert RemoteReward([f"http://me:{KEY}@127.0.0.1:{port}"], timeout_s=5, retries=0)(["a="], ["xy"])[0].tolist() == [2.0]
    with pytest.raises(RewardError) as caught:
        RemoteReward([f"http://me:not-{KEY}@127.0.0.1:{port}/?token=t0k"], timeout_s=5, retries=0)(["a="], ["xy"])
    assert f"reward server http://***:***@127.0.0.1:{port}/?token=*** refused the request (HTTP 401)" in str(caught.value)
    assert KEY not in str(caught.value) and "t0k" not in str(caught.value)


def test_a_body_over_the_cap_is_413_before_it_is_read_and_a_bad_length_400(serve):
    port = serve()
    # no body is sent at all: the answer comes from the headers alone, long before the read deadline
    status, answer, seconds = exchange(port, post_head(10**12))
    assert status == 413 and "--max_body_mb 1" in answer["error"] and seconds < TIMEOUT_S / 2
    assert exchange(port, post_head(2**20 + 1))[0] == 413
    for length in ("-1", "abc", "1e3", ""):
        status, answer, seconds = exchange(port, post_head(length))
        assert status == 400 and "Content-Length must be a non-negative integer" in answer["error"], length
        assert seconds < TIMEOUT_S / 2
    status, answer, _ = exchange(port, b"POST / HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() + b"\r\n\r\n")
    assert status == 411


def test_too_many_rows_are_413_naming_the_option(serve):
    port = serve(max_rows=3)
    body = request(["p="] * 4, ["r"] * 4)
    status, answer, _ = exchange(port, post_head(len(body)), body)
    assert status == 413 and answer["error"].startswith("the request holds 4 rows, more than this server's --max_rows 3")
    body = request(["p="] * 3, ["r"] * 3)
    assert exchange(port, post_head(len(body)), body)[:2] == (200, {"rewards": [1.0] * 3, "scores": [1.0] * 3,
                                                                     "extra_logs": {}})


@pytest.mark.parametrize("body, reason", [
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    (b'{"prompts": ["a="], "responses": ["b"], "n": [' + b"9" * 5000 + b"]}", "Exceeds the limit (4300 digits)"),
    (b'{"prompts": ["\xff"], "responses": ["b"]}', "utf-8"),
], ids=["nesting-bomb", "5000-digits", "not-utf8"])
def test_json_the_server_cannot_read_is_400(serve, body, reason):
    port = serve()
    status, answer, _ = exchange(port, post_head(len(body)), body)
    assert status == 400 and answer["error"].startswith("the request body is not JSON") and reason in answer["error"]
    assert exchange(port, post_head(len(request(["a="], ["b"]))), request(["a="], ["b"]))[0] == 200  # still serving


def test_a_trickling_connection_is_closed_at_the_deadline(serve):
    port = serve()
    for head in (b"POST / HTTP/1.1\r\n", post_head(100)):  # in the headers, then in the body (after them: a 408)
        with socket.create_connection(("127.0.0.1", port), timeout=0.05) as sock:
            sock.sendall(head)
            t0, received = time.monotonic(), b""
            while time.monotonic() - t0 < 5:
                try:
                    sock.sendall(b"x")  # a byte every 0.05 s: a per-read timeout would never fire
                    chunk = sock.recv(4096)
                except socket.timeout:
                    continue
                except OSError:  # reset: closed
                    break
                received += chunk
                if not chunk:
                    break
            seconds = time.monotonic() - t0
        assert seconds < TIMEOUT_S + SLACK_S, seconds
        if head.endswith(b"\r\n\r\n"):
            assert received.startswith(b"HTTP/1.1 408 "), received


def test_connections_beyond_the_pool_are_503_not_threads(serve):
    port = serve(max_connections=2, timeout_s=2.0)
    before = threading.active_count()
    holders = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]
    for sock in holders:
        sock.sendall(b"POST / HT")  # a request begun and never finished: each holds a handler thread
    time.sleep(0.2)
    for _ in range(20):
        status, answer, seconds = exchange(port, post_head(2), b"{}")
        assert status == 503 and "--max_connections" in answer["error"] and seconds < 0.5
    assert threading.active_count() <= before + 2
    for sock in holders:
        sock.close()
    time.sleep(0.2)
    body = request(["a="], ["b"])
    assert exchange(port, post_head(len(body)), body)[0] == 200


def test_a_source_returning_nan_is_500_and_a_reward_error_for_the_client(serve, monkeypatch):
    port = serve()
    body = request(["a=", "b="], ["ok", "nan"])
    status, answer, _ = exchange(port, post_head(len(body)), body)
    assert (status, answer) == (500, {"error": "the reward source returned nan for sample 1: expected a finite number",
                                      "reward_error": True})
    monkeypatch.setenv("PPO_REWARD_API_KEY", KEY)
    with pytest.raises(RewardError) as caught:
        RemoteReward([f"http://127.0.0.1:{port}"], timeout_s=5, retries=2, backoff_s=0.01)(["a=", "b="], ["ok", "nan"])
    assert not isinstance(caught.value, RewardUnavailable)
    assert str(caught.value) == f"reward server http://127.0.0.1:{port}: the reward source returned nan for sample 1: " \
                                "expected a finite number"


def test_a_non_loopback_host_is_told_apart():
    assert [reward_server.is_loopback(h) for h in ("127.0.0.1", "127.8.0.1", "::1", "localhost")] == [True] * 4
    assert [reward_server.is_loopback(h) for h in ("0.0.0.0", "", "::", "10.0.0.5", "rm-host")] == [False] * 5


# ---------------------------------------------------------------------------- the client against hostile servers


class Hostile:
    """A TCP server in a thread: each connection's request is read whole, then `answer(sock, request_bytes)` writes
    whatever it likes. `requests` holds every request received."""

    def __init__(self, answer):
        self.requests = []
        hostile = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self):
                data = b""
                while b"\r\n\r\n" not in data:
                    chunk = self.request.recv(65536)
                    if not chunk:
                        return
                    data += chunk
                head, _, body = data.partition(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                while len(body) < length:
                    body += self.request.recv(65536)
                hostile.requests.append(head + b"\r\n\r\n" + body)
                try:
                    answer(self.request, json.loads(body or b"{}"))
                except OSError:  # the client hung up: what a hostile server expects
                    pass

        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def hostile():
    made = []

    def make(answer):
        made.append(Hostile(answer))
        return made[-1]

    yield make
    for server in made:
        server.close()


def trickle_status(sock, request):
    for byte in b"HTTP/1.1 200 OK\r\n":
        sock.sendall(bytes([byte]))
        time.sleep(0.05)


def trickle_body(sock, request):
    sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n")
    for _ in range(200):
        sock.sendall(b" ")
        time.sleep(0.05)


@pytest.mark.parametrize("answer", [trickle_status, trickle_body], ids=["status-line", "body"])
def test_a_trickled_answer_ends_at_the_deadline(hostile, answer):
    server = hostile(answer)
    t0 = time.monotonic()
    with pytest.raises(RewardUnavailable, match=r"unreachable after 1 try \(no answer within 0.5 s\)$"):
        RemoteReward([server.url], timeout_s=TIMEOUT_S, retries=0)(["a="], ["b"])
    assert time.monotonic() - t0 < TIMEOUT_S + SLACK_S


def test_a_redirect_is_not_followed_and_carries_no_credentials(hostile, monkeypatch):
    target = hostile(lambda sock, request: sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 16\r\n\r\n{\"rewards\": [1]}"))
    location = f"{target.url}/steal?token=s3cret&n=1"
    redirect = hostile(lambda sock, request: sock.sendall(
        f"HTTP/1.1 302 Found\r\nLocation: {location}\r\nContent-Length: 0\r\n\r\n".encode()))
    monkeypatch.setenv("PPO_REWARD_PROXY_KEY", "wk-1")
    monkeypatch.setenv("PPO_REWARD_PROXY_SECRET", "ws-2")
    monkeypatch.setenv("PPO_REWARD_API_KEY", KEY)
    with pytest.raises(RewardError) as caught:
        RemoteReward([redirect.url], timeout_s=5, retries=2, backoff_s=0.01)(["a="], ["b"])
    assert str(caught.value).startswith(f"reward server {redirect.url} answered HTTP 302, a redirect to "
                                        f"{target.url}/steal?token=***&n=1, which is not followed")
    assert len(redirect.requests) == 1 and target.requests == []  # not retried, and the new host got nothing
    assert f"Authorization: Bearer {KEY}".encode() in redirect.requests[0]  # what the redirect would have carried


def test_an_answer_too_long_is_refused(hostile):
    said = hostile(lambda sock, request: sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000000000\r\n\r\n"))
    with pytest.raises(RewardError, match=f"^reward server {said.url} answered 1000000000 bytes, more than the "
                                          f"1048576 read$"):
        RemoteReward([said.url], timeout_s=5, retries=0, max_answer_bytes=2**20)(["a="], ["b"])

    def endless(sock, request):  # no Content-Length: the answer runs until the connection closes
        sock.sendall(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n")
        for _ in range(64):
            sock.sendall(b" " * 65536)

    unsaid = hostile(endless)
    with pytest.raises(RewardError, match=f"^reward server {unsaid.url} answered more than the 1048576 bytes read$"):
        RemoteReward([unsaid.url], timeout_s=5, retries=0, max_answer_bytes=2**20)(["a="], ["b"])


def answering(body: bytes, status=b"200 OK"):
    return lambda sock, request: sock.sendall(b"HTTP/1.1 " + status + b"\r\nContent-Length: "
                                              + str(len(body)).encode() + b"\r\n\r\n" + body)


@pytest.mark.parametrize("body, reason", [
    (b"[" * 100_000 + b"]" * 100_000, "returned JSON that cannot be read (nested too deeply)"),
    (b'{"rewards": [' + b"9" * 5000 + b"]}", "returned JSON that cannot be read (Exceeds the limit (4300 digits)"),
    (b'{"rewards": [1], "extra_logs": {"m": [' + b"[" * 500 + b"]" * 500 + b"]}}", "expected an int or float"),
], ids=["nesting-bomb", "5000-digits", "nested-metric"])
def test_an_answer_that_cannot_be_read_is_a_reward_error(hostile, body, reason):
    server = hostile(answering(body))
    with pytest.raises(RewardError) as caught:
        RemoteReward([server.url], timeout_s=5, retries=0)(["a="], ["b"])
    assert str(caught.value).startswith(f"reward server {server.url} returned") or \
        str(caught.value).startswith(f"reward function at {server.url} returned")
    assert reason in str(caught.value) and "\n" not in str(caught.value)


def test_http_500_is_a_reward_error_and_503_unavailable(hostile):
    server = hostile(answering(b"Internal Server Error", b"500 Internal Server Error"))
    with pytest.raises(RewardError) as caught:
        RemoteReward([server.url], timeout_s=5, retries=2, backoff_s=0.01)(["a="], ["b"])
    assert str(caught.value) == f"reward server {server.url}: Internal Server Error" and len(server.requests) == 1
    server = hostile(answering(b'{"error": "busy"}', b"503 Service Unavailable"))
    with pytest.raises(RewardUnavailable, match=r"unreachable after 2 tries \(HTTP 503: busy\)$"):
        RemoteReward([server.url], timeout_s=5, retries=1, backoff_s=0.01)(["a="], ["b"])


def test_an_unreachable_line_shows_no_password():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    with pytest.raises(RewardUnavailable) as caught:
        RemoteReward([f"http://trainer:hunter2@127.0.0.1:{port}/score?api_key=K9"], timeout_s=1, retries=0)(["a="], ["b"])
    assert str(caught.value) == (f"reward server http://***:***@127.0.0.1:{port}/score?api_key=*** unreachable after "
                                 f"1 try (connection refused)")


def test_redact_url_hand_worked():
    redact = remote_reward.redact_url
    assert redact("http://alice:hunter2@rm:8000/score?api_key=K1&batch=4&token=T2#frag") == \
        "http://***:***@rm:8000/score?api_key=***&batch=4&token=***#frag"
    assert redact("https://bob@rm/s?Secret=x&PASSWORD=y&access_token=z&key=k&n=1&monkey") == \
        "https://***@rm/s?Secret=***&PASSWORD=***&access_token=***&key=***&n=1&monkey"
    assert redact("http://rm:8000/get_reward") == "http://rm:8000/get_reward"
    assert redact("http://[::1:80/") == "<unparsable URL>"
    for url in ("http://a:b@h/?key=1", "http://h/?x=1&auth=2"):
        assert redact(redact(url)) == redact(url)


def test_the_modal_app_takes_its_key_from_the_secret_only(monkeypatch):
    from test_modal_reward import SCRIPT, load_script

    module = load_script(monkeypatch)
    for args in ("--api_key=abc", "--api-key abc"):
        with pytest.raises(ValueError, match="PPO_MODAL_REWARD_ARGS: --api_key would be written into the image; put "
                                             "PPO_REWARD_API_KEY in the Modal Secret"):
            module.reward_args(args)
    assert "PPO_REWARD_API_KEY" in open(SCRIPT).read().split('"""')[1]  # the docstring tells where the key goes
