"""ppo-serve-reward (issue 13): real server processes on 127.0.0.1 give the scores and metrics of the in-process reward
source, bit for bit, to ppo-core's RemoteReward and to a plain OpenRLHF request (query / prompts / labels); requests
that arrive together are scored in one call and each gets its own rows; a bad request is a 400 and a reward function
that raises a 500, one line each, and the server keeps serving; a bad start is one line and exit status 2. And the
trainer's stops when a server fails in an evaluation (mid-run, and the final one), resumed to the end of a run that
never stopped."""
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

from ppo_core.config import build_config
from ppo_core.models.model import load_score_model
from ppo_core.models.precision import resolve_precision
from ppo_core.rewards.remote import RemoteReward
from ppo_core.rewards.source import make_reward_source
from ppo_core.rewards.interface import RewardError
from ppo_core.data.tasks import eval_prompts
from ppo_core.train import DEMO_CHECKPOINT
from random_weights import randomize

ANSWERS = '''
import time

def exact(prompts, responses, answer, delay=None):
    """1 for the answer column exactly, + half the share of right characters (also a metric); `delay` (a column of
    seconds) makes the call slow, an answer 'boom' makes it raise."""
    if "boom" in answer:
        raise ValueError("boom")
    if delay:
        time.sleep(max(delay))
    right = [sum(a == b for a, b in zip(r, t)) / max(len(r), len(t), 1) for r, t in zip(responses, answer)]
    return {"rewards": [float(r == t) + 0.5 * c for r, t, c in zip(responses, answer, right)], "chars": right}
'''


def start_server(*args, cwd):
    """A ppo-serve-reward process on a free port; -> (process, its URL) once it says it serves."""
    proc = subprocess.Popen([sys.executable, "-m", "ppo_core.rewards.server", "--port=0", *args], cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return proc


def ready(proc):
    line = proc.stdout.readline()  # blocks until the ready line (or EOF if it died)
    assert line.startswith("serving "), proc.stderr.read()[-2000:]
    return line.split(" on ")[-1].strip()


def post(url, obj, raw=None):
    """-> (HTTP status, decoded JSON answer)."""
    body = raw if raw is not None else json.dumps(obj).encode()
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def health(url):
    with urllib.request.urlopen(url + "/health", timeout=30) as reply:
        return json.loads(reply.read())


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """Three servers started together: the reverse task's reward, a reward function reading the answer column, and a
    reward model checkpoint."""
    d = tmp_path_factory.mktemp("servers")
    (d / "answers.py").write_text(ANSWERS)
    reward_model = load_score_model(DEMO_CHECKPOINT, init_head="normal")  # a random reward model on the demo tokenizer
    randomize(reward_model, seed=3).save_pretrained(d / "rm")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(DEMO_CHECKPOINT, name), d / "rm" / name)
    procs = {"reverse": start_server("--task=reverse", cwd=d),
             "answers": start_server(f"--reward_fn={d / 'answers.py'}:exact", "--max_batch=64", cwd=d),
             "model": start_server(f"--reward_model={d / 'rm'}", cwd=d)}
    try:
        yield {name: ready(p) for name, p in procs.items()}, d
    finally:
        for p in procs.values():
            p.kill()
            p.wait()


def rows(n=12, seed=7):
    """Reverse-task prompts, responses that are right, half right or wrong, and the answer column."""
    prompts = eval_prompts(n, seed=seed)
    answers = [p.rstrip("=")[::-1] for p in prompts]
    responses = [a if i % 3 == 0 else a[: len(a) // 2] + "x" if i % 3 == 1 else "" for i, a in enumerate(answers)]
    return prompts, responses, answers


def test_scores_over_http_equal_the_in_process_source(servers):
    (urls, d) = servers
    prompts, responses, answers = rows()
    # the reverse task's reward: scores and its metric, float32 for float32
    local = make_reward_source(build_config(overrides={"task": "reverse"}))
    remote = RemoteReward([urls["reverse"]], timeout_s=30, retries=0)
    (want, want_metrics), (got, got_metrics) = local(prompts, responses), remote(prompts, responses)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    assert list(got_metrics) == list(want_metrics) == ["reward/reverse"]
    assert torch.equal(got_metrics["reward/reverse"], want_metrics["reward/reverse"])
    # a reward function with an answer column and a metric of its own
    local = make_reward_source(build_config(overrides={"reward_fn": f"{d / 'answers.py'}:exact"}))
    remote = RemoteReward([urls["answers"]], timeout_s=30, retries=0)
    columns = {"answer": answers}
    (want, want_metrics), (got, got_metrics) = local(prompts, responses, columns), remote(prompts, responses, columns)
    assert torch.equal(got, want) and list(got_metrics) == list(want_metrics) == ["reward/exact", "reward/exact/chars"]
    assert all(torch.equal(got_metrics[k], want_metrics[k]) for k in want_metrics)
    # the values themselves, by hand: right = 1 + 0.5, empty = 0
    assert got[0].item() == 1.5 and got[2].item() == 0.0
    # a reward model: no metrics, the scores of the model in this process under the precision ppo-train would choose
    # (dtype='auto': bf16 autocast on a CPU with AMX or AVX512-BF16), the server's own
    cfg = build_config(overrides={"reward_model": str(d / "rm")})
    local = make_reward_source(cfg)
    with resolve_precision(cfg).autocast():
        want, _ = local(prompts, responses)
    got, got_metrics = RemoteReward([urls["model"]], 30, 0)(prompts, responses)
    assert torch.equal(got, want) and got_metrics == {} and got.std() > 0.1


def test_an_openrlhf_request_query_prompts_labels(servers):
    """What OpenRLHF's remote_rm_fn sends (query = prompt + response, labels = the answers), to its usual path."""
    (urls, d) = servers
    prompts, responses, answers = rows()
    status, answer = post(urls["answers"] + "/get_reward", {"query": [p + r for p, r in zip(prompts, responses)],
                                                           "prompts": prompts, "labels": answers})
    assert status == 200 and set(answer) == {"rewards", "scores", "extra_logs"}
    want, want_metrics = make_reward_source(build_config(overrides={"reward_fn": f"{d / 'answers.py'}:exact"}))(
        prompts, responses, {"answer": answers})
    assert answer["rewards"] == answer["scores"] == want.tolist()  # float32 values, exactly, as JSON doubles
    assert answer["extra_logs"] == {k: v.tolist() for k, v in want_metrics.items()}
    # a query that does not start with its prompt cannot be split: 400, one line
    status, answer = post(urls["answers"], {"query": ["zzz"], "prompts": ["abc="], "labels": ["cba"]})
    assert status == 400 and answer["error"].startswith("query 0 does not start with its prompt")


def test_requests_arriving_together_are_scored_in_one_call(servers):
    (urls, _) = servers
    url = urls["answers"]
    prompts, responses, answers = rows(16, seed=3)
    before = health(url)
    # a first slow request keeps the scoring thread busy while 7 more arrive; each gets its own rows back
    results = {}

    def request(k, delay):
        sl = slice(2 * k, 2 * k + 2)
        results[k] = post(url, {"prompts": prompts[sl], "responses": responses[sl], "answer": answers[sl],
                                "delay": [delay, delay]})

    first = threading.Thread(target=request, args=(0, 1.0))
    first.start()
    time.sleep(0.2)  # it is being scored (or at least queued first)
    others = [threading.Thread(target=request, args=(k, 0.0)) for k in range(1, 8)]
    for t in others:
        t.start()
    for t in [first] + others:
        t.join()
    for k in range(8):
        status, answer = results[k]
        sl = slice(2 * k, 2 * k + 2)
        right = [sum(a == b for a, b in zip(r, t)) / max(len(r), len(t), 1) for r, t in zip(responses[sl], answers[sl])]
        assert status == 200
        assert answer["rewards"] == [float(torch.tensor(float(r == t) + 0.5 * c, dtype=torch.float32))
                                     for r, t, c in zip(responses[sl], answers[sl], right)]
    after = health(url)
    assert after["requests"] - before["requests"] == 8 and after["rows"] - before["rows"] == 16
    assert after["batches"] - before["batches"] <= 2  # the slow one, then the 7 that queued meanwhile (or all 8 at once)


def test_bad_requests_are_400_a_raising_reward_500_and_the_server_keeps_serving(servers):
    (urls, _) = servers
    url = urls["answers"]
    cases = [
        (b"not json", "the request body is not JSON: Expecting value"),
        (b"[1, 2]", 'the request must be a JSON object with "prompts" and "responses" (or "query"), got list'),
        (json.dumps({"responses": ["a"]}).encode(), 'the request has no "prompts"'),
        (json.dumps({"prompts": ["a=", "b="], "responses": ["a"], "answer": ["a", "b"]}).encode(),
         '"responses" holds 1 strings for 2 prompts'),
        (json.dumps({"prompts": ["a="], "responses": ["a"], "answer": ["a", "b"]}).encode(),
         'field "answer" must be a list of 1 values, one per prompt, got a list of 2'),
    ]
    for body, message in cases:
        status, answer = post(url, None, raw=body)
        assert status == 400 and answer["error"].startswith(message), answer
        assert "\n" not in answer["error"]
    status, answer = post(url, {"prompts": ["a="], "responses": ["a"]})  # the function needs the answer column
    assert status == 400 and "needs column 'answer', which the prompts file does not have" in answer["error"]
    status, answer = post(url, {"prompts": ["ab=", "cd="], "responses": ["ba", "dc"], "answer": ["ba", "boom"]})
    assert status == 500 and answer["reward_error"] is True
    assert "exact raised ValueError: boom on sample 1 (prompt 'cd=', response 'dc')" in answer["error"]
    # RemoteReward turns that into a RewardError of one line naming the URL
    with pytest.raises(RewardError, match=f"^reward server {url}: reward function .*exact raised ValueError: boom"):
        RemoteReward([url], timeout_s=30, retries=0)(["ab="], ["ba"], {"answer": ["boom"]})
    # a raising request batched with good ones fails alone
    results = {}

    def request(k, answer):
        results[k] = post(url, {"prompts": ["ab="], "responses": ["ba"], "answer": [answer], "delay": [0.3]})

    threads = [threading.Thread(target=request, args=(k, "boom" if k == 2 else "ba")) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [results[k][0] for k in range(4)] == [200, 200, 500, 200]
    assert all(results[k][1]["rewards"] == [1.5] for k in (0, 1, 3))
    assert health(url)["status"] == "ok"


def test_a_bad_start_is_one_line_and_exit_2(tmp_path, capsys):
    """ppo-serve-reward's main, in this process: each bad start is one line on stderr and exit status 2."""
    from ppo_core.rewards.server import main

    cases = [(["--port=0", "--reward_modle=x"], "unknown config key 'reward_modle' (did you mean 'reward_model'"),
             (["--port=0", f"--reward_model={tmp_path / 'none'}"], str(tmp_path / "none")),
             (["--port=0", "--reward_url=http://127.0.0.1:1"], "config key 'reward_url' names another reward server"),
             (["--port=http"], "--port takes an integer, got 'http'"),
             (["--port", "0", "--max_batch=0"], "--max_batch must be >= 1, got 0"),
             (["--port=0", "--max_body_mb=-1"], "--max_body_mb must be > 0, got -1"),
             (["--port=0", "--timeout_s", "nan"], "--timeout_s must be > 0, got nan")]
    for argv, message in cases:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("ppo-serve-reward: error: ") and message in err, err
    # a port already taken
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        assert main([f"--port={taken.getsockname()[1]}"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"ppo-serve-reward: error: cannot listen on 127.0.0.1:{taken.getsockname()[1]}: ") and \
            err.count("\n") == 1


def test_server_down_in_an_evaluation_then_resume_equals_a_run_that_never_stopped(tmp_path):
    """eval_every=1, 3 iterations: requests 1-2 evaluate before training, then per iteration a rollout and (but for the
    last) an evaluation, then 2 final evaluations. The 6th request (iteration 2's evaluation, after its update) and,
    once resumed, the final evaluation's first get a 503: each stop saves a checkpoint (the first with the iteration's
    metrics for the resume to complete), and the twice-resumed run ends as a run that never stopped."""
    from test_remote_reward import SMALL, ScriptedServer, metrics

    steady, flaky = ScriptedServer(["ok"]), ScriptedServer(["ok"] * 5 + ["503"] + ["ok"] * 2 + ["503", "ok"])
    args = SMALL + ["--iterations=3", "--eval_every=1", "--log_samples_every=1", "--save_every=0", "--reward_retries=0"]
    reference, run = tmp_path / "reference", tmp_path / "run"
    try:
        procs = [subprocess.Popen([sys.executable, "-m", "ppo_core.train", *args, f"--reward_url={server.url}",
                                   f"--out={out}"], stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=tmp_path)
                 for server, out in ((steady, reference), (flaky, run))]
        errs = [p.communicate(timeout=300)[1] for p in procs]
        assert [p.returncode for p in procs] == [0, 3], errs
        assert errs[1].splitlines()[-1] == (
            f"ppo-train: reward server {flaky.url} unreachable after 1 try (HTTP 503: overloaded) in the evaluation of "
            f"iteration 2; saved checkpoint at iteration 2 of 3 in {run}; continue with: ppo-train --resume {run}")
        assert len(metrics(run)) == 1 and (run / "checkpoints" / "latest").read_text().strip() == "step-2"
        resume = [sys.executable, "-m", "ppo_core.train", "--resume", str(run)]
        again = subprocess.run(resume, capture_output=True, text=True, cwd=tmp_path, timeout=300)
        assert again.returncode == 3 and again.stderr.splitlines()[-1] == (
            f"ppo-train: reward server {flaky.url} unreachable after 1 try (HTTP 503: overloaded) during the final "
            f"evaluation; the final checkpoint (iteration 3) is in {run}; finish with: ppo-train --resume {run}")
        assert not (run / "summary.json").exists()
        last = subprocess.run(resume, capture_output=True, text=True, cwd=tmp_path, timeout=300)
        assert last.returncode == 0, last.stderr
    finally:
        steady.close(), flaky.close()
    assert metrics(run) == metrics(reference) and "eval/reward" in metrics(run)[1]
    assert (run / "samples.jsonl").read_text() == (reference / "samples.jsonl").read_text()
    final = os.path.join("checkpoints", "step-3", "model.safetensors")
    assert (run / final).read_bytes() == (reference / final).read_bytes()
    summary, ref_summary = (json.loads((d / "summary.json").read_text()) for d in (run, reference))
    assert {k: v for k, v in summary.items() if k not in ("time/total_s", "checkpoint")} == \
        {k: v for k, v in ref_summary.items() if k not in ("time/total_s", "checkpoint")}
    assert len(flaky.requests) == 6 + 3 + 2 and len(steady.requests) == 2 + 3 + 2 + 2  # (the runs of the flaky one)
