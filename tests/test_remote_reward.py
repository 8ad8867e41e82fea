"""The trainer's side of a remote reward (issue 13): RemoteReward against real HTTP servers on 127.0.0.1 - a scripted
one in this process, answering each request as a test says (right, malformed, short, not a number, slow, down), and
ppo-serve-reward processes. A wrong answer is a RewardError of one line naming the URL (ppo-train: exit 2, the run
directory as it was); a server that stays down or silent is RewardUnavailable after the retries (ppo-train: a
checkpoint, one line, exit 3); a server killed mid-run, restarted, and `ppo-train --resume` end with the weights and
metrics of a run that never stopped."""
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from ppo_core.rewards.remote import RemoteReward, RewardUnavailable
from ppo_core.rewards.interface import RewardError
from ppo_core.data.tasks import reverse_rewards

SMALL = ["--eval_size=8", "--rollout_batch_size=8", "--minibatch_size=8", "--micro_batch_size=8", "--ppo_epochs=1",
         "--progress=false", "--max_new_tokens=10"]
WALL_CLOCK = ("time/", "tokens_per_s")


class ScriptedServer:
    """An HTTP server on 127.0.0.1 in this process whose n-th POST is answered as script[n] says (the last entry
    repeats): "ok" (the reverse task's reward, as ppo-serve-reward answers), "malformed", "short" (one score too
    few), "text" (a score that is a string), "nan", "503", "sleep" (answers after 3 s), "close" (hangs up)."""

    def __init__(self, script):
        self.script, self.requests, self.headers = list(script), [], []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests.append(request)
                server.headers.append({k.lower(): v for k, v in self.headers.items()})  # names are case-blind
                what = server.script[min(len(server.requests), len(server.script)) - 1]
                rewards = reverse_rewards(request["prompts"], request["responses"])
                body = {"ok": json.dumps({"rewards": rewards, "extra_logs": {"reward/reverse": rewards}}),
                        "malformed": '{"rewards": [1.0,',
                        "short": json.dumps({"rewards": rewards[:-1]}),
                        "text": json.dumps({"rewards": rewards[:-1] + ["0.5"]}),
                        "nan": json.dumps({"rewards": rewards[:-1] + [float("nan")]}),
                        "rationale": json.dumps({"rewards": rewards, "extra_logs": {
                            "judge/rationale": [f"because {r}" for r in request["responses"]], "len": [len(r) for r in request["responses"]]}}),
                        "503": json.dumps({"error": "overloaded"}), "sleep": "{}", "close": ""}[what]
                if what == "close":
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if what == "sleep":
                    time.sleep(3)
                self.send_response(503 if what == "503" else 200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body.encode())

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def scripted():
    made = []

    def make(*script):
        made.append(ScriptedServer(script))
        return made[-1]

    yield make
    for server in made:
        server.close()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PROMPTS, RESPONSES = ["ab=", "cd=", "efg="], ["ba", "dc", "gfx"]


def test_right_answers_and_text_entries(scripted):
    server = scripted("ok", "rationale")
    remote = RemoteReward([server.url], timeout_s=10, retries=0)
    scores, metrics = remote(PROMPTS, RESPONSES)
    want = torch.tensor(reverse_rewards(PROMPTS, RESPONSES), dtype=torch.float32)
    assert torch.equal(scores, want) and torch.equal(metrics["reward/reverse"], want)
    assert server.requests[0] == {"query": ["ab=ba", "cd=dc", "efg=gfx"], "prompts": PROMPTS, "responses": RESPONSES}
    scores, metrics = remote(PROMPTS, RESPONSES, {"answer": ["ba", "dc", "gfe"], "level": [1, 2, 3]})
    assert server.requests[1]["labels"] == server.requests[1]["answer"] == ["ba", "dc", "gfe"]  # labels for OpenRLHF
    assert server.requests[1]["level"] == [1, 2, 3]
    assert metrics["judge/rationale"] == ["because ba", "because dc", "because gfx"]  # text passes through
    assert torch.equal(metrics["len"], torch.tensor([2.0, 2.0, 3.0]))


def test_modal_proxy_auth_headers_come_from_the_environment(scripted, monkeypatch):
    server = scripted("ok")
    RemoteReward([server.url], timeout_s=10, retries=0)(PROMPTS, RESPONSES)
    assert "modal-key" not in server.headers[0] and "modal-secret" not in server.headers[0]
    monkeypatch.setenv("PPO_REWARD_PROXY_KEY", "wk-1234abcd")
    monkeypatch.setenv("PPO_REWARD_PROXY_SECRET", "ws-5678efgh")
    RemoteReward([server.url], timeout_s=10, retries=0)(PROMPTS, RESPONSES)
    assert server.headers[1]["modal-key"] == "wk-1234abcd" and server.headers[1]["modal-secret"] == "ws-5678efgh"
    monkeypatch.delenv("PPO_REWARD_PROXY_SECRET")
    with pytest.raises(RewardError) as e:
        RemoteReward([server.url])
    assert str(e.value) == ("set both PPO_REWARD_PROXY_KEY and PPO_REWARD_PROXY_SECRET (a Modal proxy auth token's ID "
                            "and secret), or neither")


@pytest.mark.parametrize("what, message", [
    ("malformed", "reward server {url} returned malformed JSON (Expecting value at character 17): '{{\"rewards\": [1.0,'"),
    ("short", "reward function at {url} returned 2 scores in \"rewards\" for 3 responses: none for sample 2 "
              "(prompt 'efg=', response 'gfx')"),
    ("text", "reward function at {url} returned str '0.5' in \"rewards\" for sample 2 (prompt 'efg=', response "
             "'gfx'): expected an int or float"),
    ("nan", "reward function at {url} returned nan in \"rewards\" for sample 2 (prompt 'efg=', response 'gfx'): "
            "expected a finite number"),
], ids=["malformed", "short", "text", "nan"])
def test_a_wrong_answer_is_a_reward_error_of_one_line_and_not_retried(scripted, what, message):
    server = scripted(what)
    with pytest.raises(RewardError) as caught:
        RemoteReward([server.url], timeout_s=10, retries=3, backoff_s=0.01)(PROMPTS, RESPONSES)
    text = str(caught.value)
    assert "\n" not in text and message.format(url=server.url) in text and server.url in text
    assert len(server.requests) == 1


def test_retries_back_off_and_move_to_the_next_url(scripted):
    # a 503 and a hang-up are retried, on the same URL when there is one, after 0.1 s then 0.2 s
    server = scripted("503", "close", "ok")
    t0 = time.perf_counter()
    scores, _ = RemoteReward([server.url], timeout_s=10, retries=2, backoff_s=0.1)(PROMPTS, RESPONSES)
    assert time.perf_counter() - t0 >= 0.3 and len(server.requests) == 3
    assert torch.equal(scores, torch.tensor(reverse_rewards(PROMPTS, RESPONSES), dtype=torch.float32))
    # two URLs, the first down: its chunk is retried on the second, which scores every row
    dead = f"http://127.0.0.1:{free_port()}"
    server = scripted("ok")
    remote = RemoteReward([dead, server.url], timeout_s=10, retries=1, backoff_s=0.01)
    prompts, responses = PROMPTS + ["hi="], RESPONSES + ["ih"]
    scores, metrics = remote(prompts, responses)
    assert torch.equal(scores, torch.tensor(reverse_rewards(prompts, responses), dtype=torch.float32))
    assert sorted(r["prompts"] for r in server.requests) == [["ab=", "cd="], ["efg=", "hi="]]
    # the next call starts on the other URL: round-robin
    server.requests.clear()
    remote(PROMPTS[:1], RESPONSES[:1])
    assert len(server.requests) == 1


def test_a_server_down_or_silent_is_reward_unavailable(scripted):
    dead = f"http://127.0.0.1:{free_port()}"
    t0 = time.perf_counter()
    with pytest.raises(RewardUnavailable) as caught:
        RemoteReward([dead], timeout_s=5, retries=2, backoff_s=0.05)(PROMPTS, RESPONSES)
    assert str(caught.value) == f"reward server {dead} unreachable after 3 tries (connection refused)"
    assert time.perf_counter() - t0 >= 0.15  # 0.05 + 0.1 of backoff
    assert not isinstance(caught.value, RewardError)  # ppo-train must not treat it as bad input
    server = scripted("sleep")
    with pytest.raises(RewardUnavailable, match=r"unreachable after 1 try \(no answer within 0.5 s\)$"):
        RemoteReward([server.url], timeout_s=0.5, retries=0)(PROMPTS, RESPONSES)
    server = scripted("503")
    with pytest.raises(RewardUnavailable, match=r"unreachable after 2 tries \(HTTP 503: overloaded\)$"):
        RemoteReward([server.url], timeout_s=5, retries=1, backoff_s=0.01)(PROMPTS, RESPONSES)


def ppo_train(*args, cwd):
    return subprocess.Popen([sys.executable, "-m", "ppo_core.train", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=cwd)


def metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [{k: v for k, v in json.loads(line).items() if not k.startswith(WALL_CLOCK)} for line in f]


def test_ppo_train_wrong_answer_exit_2_silent_server_exit_3_down_before_training_exit_3(scripted, tmp_path):
    """Three runs at once: the 4th reward request (iteration 2's rollout, after the 2 evaluations before training)
    gets malformed JSON, or no answer in time; or no server at all. A checkpoint is saved every iteration."""
    malformed = scripted("ok", "ok", "ok", "malformed")
    silent = scripted("ok", "ok", "ok", "sleep")
    dead = f"http://127.0.0.1:{free_port()}"
    common = SMALL + ["--iterations=2", "--save_every=1"]
    runs = {name: tmp_path / name for name in ("malformed", "silent", "dead")}
    procs = {"malformed": ppo_train(*common, f"--reward_url={malformed.url}", f"--out={runs['malformed']}", cwd=tmp_path),
             "silent": ppo_train(*common, f"--reward_url={silent.url}", "--reward_timeout_s=0.5", "--reward_retries=0",
                                 f"--out={runs['silent']}", cwd=tmp_path),
             "dead": ppo_train(*common, f"--reward_url={dead}", "--reward_retries=0", f"--out={runs['dead']}", cwd=tmp_path)}
    errs = {name: p.communicate(timeout=300)[1] for name, p in procs.items()}
    codes = {name: p.returncode for name, p in procs.items()}
    assert codes == {"malformed": 2, "silent": 3, "dead": 3}, errs
    for name, err in errs.items():  # after the run's start line(s): one line
        assert err.count("ppo-train:") == 1 and err.splitlines()[-1].startswith("ppo-train:"), err
    run = runs["malformed"]
    assert errs["malformed"].splitlines()[-1] == (f"ppo-train: error: reward server {malformed.url} returned malformed "
                                                  "JSON (Expecting value at character 17): '{\"rewards\": [1.0,'")
    assert len(metrics(run)) == 1 and (run / "checkpoints" / "latest").read_text().strip() == "step-1"
    run = runs["silent"]
    assert errs["silent"].splitlines()[-1] == (
        f"ppo-train: reward server {silent.url} unreachable after 1 try (no answer within 0.5 s); saved checkpoint at "
        f"iteration 1 of 2 in {run}; continue with: ppo-train --resume {run}")
    assert len(metrics(run)) == 1 and (run / "checkpoints" / "latest").read_text().strip() == "step-1"
    run = runs["dead"]
    assert errs["dead"].splitlines()[-1] == (
        f"ppo-train: reward server {dead} unreachable after 1 try (connection refused) during the evaluation before "
        f"training; nothing saved yet; start again with: ppo-train --resume {run}")
    assert (run / "config.json").exists() and not (run / "checkpoints").exists()


KILLER = '''
import os, signal
from ppo_core.data.tasks import reverse_rewards

def reverse(prompts, responses):
    """The reverse task's reward; call number KILL_AT (counted in COUNT_FILE) kills the server process it runs in."""
    path = os.environ["COUNT_FILE"]
    n = int(open(path).read()) + 1 if os.path.exists(path) else 1
    open(path, "w").write(str(n))
    if n == int(os.environ.get("KILL_AT", "0")):
        os.kill(os.getpid(), signal.SIGKILL)
    return reverse_rewards(prompts, responses)
'''


def serve(tmp_path, port, count_file, kill_at=0):
    """ppo-serve-reward of killer.py:reverse on `port`; -> the process, once it says it serves."""
    env = {**os.environ, "COUNT_FILE": str(count_file), "KILL_AT": str(kill_at)}
    return subprocess.Popen([sys.executable, "-m", "ppo_core.rewards.server", f"--port={port}", "--reward_fn=killer.py:reverse"],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_ready(server):
    line = server.stdout.readline()
    # the file as the config holds it, made absolute: .../killer.py
    assert line.startswith("serving reward function /") and "/killer.py:reverse on http://127.0.0.1:" in line, \
        server.stderr.read()
    return line.split(" on ")[-1].strip()


def test_server_killed_mid_run_then_resume_equals_a_run_that_never_stopped(tmp_path):
    (tmp_path / "killer.py").write_text(KILLER)
    args = SMALL + ["--iterations=4", "--save_every=0", "--reward_retries=1"]
    steady = serve(tmp_path, 0, tmp_path / "steady.count")
    port = free_port()
    killed = serve(tmp_path, port, tmp_path / "killed.count", kill_at=5)  # iteration 3's rollout
    servers = [steady, killed]
    try:
        steady_url, killed_url = wait_ready(steady), wait_ready(killed)
        assert killed_url == f"http://127.0.0.1:{port}"
        reference, run = tmp_path / "reference", tmp_path / "run"
        ref_proc = ppo_train(*args, f"--reward_url={steady_url}", f"--out={reference}", cwd=tmp_path)
        proc = ppo_train(*args, f"--reward_url={killed_url}", f"--out={run}", cwd=tmp_path)
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 3, err
        assert killed.wait(timeout=60) == -signal.SIGKILL
        # one line: the first try lost its answer when the server died, the retry found nobody listening
        assert err.count("ppo-train:") == 1 and err.splitlines()[-1] == (
            f"ppo-train: reward server {killed_url} unreachable after 2 tries (connection refused); saved checkpoint "
            f"at iteration 2 of 4 in {run}; continue with: ppo-train --resume {run}")
        assert (run / "checkpoints" / "latest").read_text().strip() == "step-2" and len(metrics(run)) == 2
        restarted = serve(tmp_path, 0, tmp_path / "killed.count")  # back elsewhere: --resume may say where
        servers.append(restarted)
        restarted_url = wait_ready(restarted)
        resumed = ppo_train("--resume", str(run), f"--reward_url={restarted_url}", cwd=tmp_path)
        _, err = resumed.communicate(timeout=300)
        assert resumed.returncode == 0, err
        assert f"resuming {run} from {run / 'checkpoints' / 'step-2'} (iteration 2 of 4)" in err
        _, ref_err = ref_proc.communicate(timeout=300)
        assert ref_proc.returncode == 0, ref_err
    finally:
        for server in servers:
            server.kill()
            server.wait()
    assert metrics(run) == metrics(reference) and len(metrics(run)) == 4
    final = os.path.join("checkpoints", "step-4")
    assert (run / final / "model.safetensors").read_bytes() == (reference / final / "model.safetensors").read_bytes()
    assert (run / final / "critic" / "model.safetensors").read_bytes() == \
        (reference / final / "critic" / "model.safetensors").read_bytes()
    summary, ref_summary = (json.loads((d / "summary.json").read_text()) for d in (run, reference))
    assert {k: v for k, v in summary.items() if k not in ("time/total_s", "checkpoint")} == \
        {k: v for k, v in ref_summary.items() if k not in ("time/total_s", "checkpoint")}
    # the server answered every request of both runs: 2 evaluations before, 4 iterations, 2 after (+ the lost one)
    assert (tmp_path / "steady.count").read_text() == "8" and (tmp_path / "killed.count").read_text() == "9"


def test_two_processes_stop_together_when_one_gets_no_answer(scripted, tmp_path):
    """torchrun, 2 processes: the 4 evaluation requests and one process's iteration-1 rollout are answered, the other
    process's gets a 503. Both stop at once (no process left waiting in a collective), with one line and step-0."""
    server = scripted("ok", "ok", "ok", "ok", "ok", "503")
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           "-m", "ppo_core.train", *SMALL, "--iterations=2", f"--reward_url={server.url}",
                           "--reward_retries=0", f"--out={run}"], capture_output=True, text=True, cwd=tmp_path,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode != 0 and len(server.requests) == 6
    lines = [line for line in proc.stderr.splitlines() if "ppo-train:" in line]
    assert len(lines) == 1 and lines[0].endswith(
        f"ppo-train: reward server {server.url} unreachable after 1 try (HTTP 503: overloaded); saved checkpoint at "
        f"iteration 0 of 2 in {run}; continue with: ppo-train --resume {run}"), proc.stderr[-3000:]
    assert (run / "checkpoints" / "latest").read_text().strip() == "step-0"


def test_config_keys_of_a_remote_reward():
    from ppo_core.config import ConfigError, build_config
    from ppo_core.rewards.source import make_reward_source

    cfg = build_config(overrides={"reward_url": "http://a:1,https://b:2/get_reward", "reward_timeout_s": "2.5",
                                  "reward_retries": "0"})
    source = make_reward_source(cfg)
    assert isinstance(source, RemoteReward) and source.urls == ["http://a:1", "https://b:2/get_reward"]
    assert (source.timeout_s, source.retries, source.backoff_s) == (2.5, 0, 1.0)
    assert build_config({"reward_url": ["http://a:1"]}).reward_url == ["http://a:1"]  # a TOML list
    for overrides, message in [
        ({"reward_url": "http://a:1", "reward_fn": "m.py:f"}, "config key 'reward_url' conflicts with reward_fn and reward_model"),
        ({"reward_url": "http://a:1", "reward_model": "rm"}, "config key 'reward_url' conflicts with reward_fn and reward_model"),
        ({"reward_url": "a:1"}, "config key 'reward_url' must hold http:// or https:// URLs, not 'a:1'"),
        ({"reward_timeout_s": "0"}, "config key 'reward_timeout_s' must be > 0"),
        ({"reward_retries": "-1"}, "config key 'reward_retries' must be >= 0"),
    ]:
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):  # one of its problems
            build_config(overrides=overrides)
