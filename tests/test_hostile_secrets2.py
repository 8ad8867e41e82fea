"""Credentials in hostile URLs, round 2 (issue 49, finding 4): one redaction (ppo_core.rewards.redact) for everything
ppo-train prints or writes. Each URL below hides the password Alpha7<c>Bravo9 (or a credential parameter) in a form
that broke the first redaction: a quote, # / ? @ %40 or a space in the password, an upper-case scheme, a query
parameter, the URL quoted inside a list's repr. Through the real command paths (a config conflict, an address that
cannot be read, a server that does not answer, a run and its resume with both trackers, a reward function's error)
neither half of the secret may appear in what was printed nor in any file under the run directory."""
import base64
import io
import json
import os
import sys
import urllib.parse

import pytest

from test_remote_reward import SMALL, ScriptedServer, ppo_train
from test_tracking import wandb_home  # noqa: F401 (a fixture)

from ppo_core.rewards.redact import forget_secrets, redact, redact_url, remember_secrets
from ppo_core.train import main, redacted_excepthook

HALVES = ("Alpha7", "Bravo9")  # a password's two halves: neither may be seen, whatever split the URL
PASSWORDS = {"quote": "Alpha7'Bravo9", "double quote": 'Alpha7"Bravo9', "both quotes": "Alpha7'\"Bravo9",
             "hash": "Alpha7#Bravo9", "slash": "Alpha7/Bravo9", "question mark": "Alpha7?Bravo9",
             "at": "Alpha7@Bravo9", "percent-encoded at": "Alpha7%40Bravo9", "space": "Alpha7 Bravo9"}
HOSTILE = {**{name: f"http://trainer:{password}@127.0.0.1:{{port}}/score" for name, password in PASSWORDS.items()},
           "upper-case scheme": "HTTPS://trainer:Alpha7Bravo9@127.0.0.1:{port}/score",
           **{f"query {key}": f"http://127.0.0.1:{{port}}/score?n=1&{key}=Alpha7Bravo9"
              for key in ("api_key", "token", "key", "secret", "password")}}
ENDS_THE_HOST = ("hash", "slash", "question mark")  # a parser reads the host part only up to them: refused, exit 2
TINY = ["--iterations=1", "--eval_size=8", "--rollout_batch_size=4", "--n_samples_per_prompt=2", "--minibatch_size=8",
        "--micro_batch_size=8", "--max_new_tokens=8", "--progress=false", "--reward_retries=0",
        "--reward_timeout_s=0.5"]  # the last two: for a reward server


def assert_no_secret(text, run_dir=None):
    """Neither half of the secret in `text`, nor in any file under run_dir (bytes, so a binary log counts too)."""
    for half in HALVES:
        assert half not in text, text
    if run_dir is not None and os.path.exists(run_dir):
        for root, _, files in os.walk(run_dir):
            for name in files:
                with open(os.path.join(root, name), "rb") as f:
                    data = f.read()
                assert not any(half.encode() in data for half in HALVES), os.path.join(root, name)


@pytest.fixture(autouse=True)
def no_secret_left_remembered():
    yield
    forget_secrets()


def test_redact_hand_worked():
    assert redact_url("HTTPS://u:p@h:1/s?Api_Key=K&n=4#access_token=T&x=1") == \
        "HTTPS://***:***@h:1/s?Api_Key=***&n=4#access_token=***&x=1"
    # the userinfo ends at the last @: a / ? # inside a password is still the password
    assert redact_url("http://u:a/b?c#d@h:1/s") == "http://***:***@h:1/s"
    assert redact_url("http://tok3n@h/") == "http://***@h/"
    assert redact("got ['http://u:TOPSECRET@127.0.0.1:1/']") == "got ['http://***:***@127.0.0.1:1/']"
    # a URL cut by a space or a quote in its password: what the URL pattern cannot see, the remembered secret hides
    url = "http://u:Alpha7 Bravo9@h:1/"
    assert redact(f"got [{url!r}]") == f"got [{url!r}]"  # the pattern alone ends the URL at the space: no @ in it
    remember_secrets([f"--reward_url={url},http://h:2/?token=Charlie3&n=1"])
    assert redact(f"got [{url!r}]") == "got ['http://***:***@h:1/']"
    assert redact("tried Charlie3 twice") == "tried *** twice"
    remember_secrets(["--reward_url=http://u:Alpha7'\"Bravo9@h/"])
    assert redact(f"got {['Alpha7' + chr(39) + chr(34) + 'Bravo9']}") == "got ['***']"  # as repr() escapes it
    assert redact(json.dumps({"pw": "Alpha7'\"Bravo9"})) == '{"pw": "***"}'  # as JSON does
    remember_secrets(["http://u:Alpha7%40Bravo9@h/"])  # the password as written and percent-decoded
    assert redact("Alpha7%40Bravo9 Alpha7@Bravo9") == "*** ***"
    remember_secrets(["abc"], whole=True)  # too short to replace everywhere
    assert redact("abc") == "abc"
    forget_secrets()
    assert redact("tried Charlie3") == "tried Charlie3"


@pytest.mark.parametrize("name", HOSTILE)
def test_a_config_conflict_prints_no_secret(name, tmp_path, capsys):
    url = HOSTILE[name].format(port=1)
    assert main([f"--reward_url={url}", "--reward_fn=m.py:f", f"--out={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("ppo-train: error: ") and "conflicts with reward_fn" in err, err
    assert_no_secret(err, tmp_path)


def test_a_config_file_s_url_is_redacted_too(tmp_path, capsys):
    config = tmp_path / "run.toml"
    config.write_text(f'reward_url = ["{HOSTILE["quote"].format(port=1)}"]\nreward_fn = ["m.py:f"]\n')
    assert main([f"--config={config}"]) == 2
    err = capsys.readouterr().err
    assert "conflicts with reward_fn" in err and "http://***:***@127.0.0.1:1/score" in err, err
    assert_no_secret(err)


@pytest.mark.parametrize("name", HOSTILE)
def test_a_server_that_cannot_be_reached_prints_and_writes_no_secret(name, tmp_path, capsys):
    url, run_dir = HOSTILE[name].format(port=1), tmp_path / "run"  # nothing listens on port 1
    code = main([*TINY, f"--reward_url={url}", f"--out={run_dir}"])
    err = capsys.readouterr().err
    assert_no_secret(err, tmp_path)
    last = err.splitlines()[-1]
    if name in ENDS_THE_HOST:
        assert code == 2 and err.count("\n") == 1 and "host or port cannot be read" in err, err
        return
    assert code == 3 and " unreachable after 1 try (connection refused)" in last, err
    saved = json.loads((run_dir / "config.json").read_text())
    (printed,) = saved["config"]["reward_url"]
    assert f"reward server {printed} unreachable" in last and "***" in printed


def test_the_command_s_stderr_config_json_and_w_b_metadata_hold_no_secret(tmp_path, monkeypatch,
                                                                          wandb_home):  # noqa: F811
    """The real process, for the password with both quotes (which ended the first redaction's URL pattern): its
    stderr, config.json's config and command line, and W&B's offline log, whose metadata records sys.argv (neither
    shows in main() called in this process)."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    url, run_dir = HOSTILE["both quotes"].format(port=1), tmp_path / "run"
    proc = ppo_train(*TINY, "--report_to=wandb", f"--reward_url={url}", f"--out={run_dir}", cwd=tmp_path)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 3 and " unreachable after 1 try (connection refused)" in err, err
    (log,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    assert b"--reward_url=http://***:***@127.0.0.1:1/score" in log.read_bytes()  # the metadata's command line
    assert_no_secret(out + err, tmp_path)
    saved = json.loads((run_dir / "config.json").read_text())
    assert saved["config"]["reward_url"] == ["http://***:***@127.0.0.1:1/score"]
    assert saved["command"] == ["train.py", *TINY, "--report_to=wandb", "--reward_url=http://***:***@127.0.0.1:1/score",
                                f"--out={run_dir}"]


@pytest.mark.parametrize("name", ["both quotes", "space", "percent-encoded at", "query token"])
def test_a_run_its_resume_and_its_trackers_keep_no_secret(name, tmp_path, monkeypatch, capsys,
                                                          wandb_home):  # noqa: F811
    monkeypatch.setenv("WANDB_MODE", "offline")
    server = ScriptedServer(["ok", "ok", "ok", "sleep"])  # the 4th request (iteration 2's) times out: exit 3
    try:
        url, run_dir = HOSTILE[name].format(port=server.url.rsplit(":", 1)[1]), tmp_path / "run"
        args = [*SMALL, "--iterations=2", "--save_every=1", "--reward_timeout_s=0.5", "--reward_retries=0",
                "--report_to=tensorboard,wandb", f"--out={run_dir}"]
        assert main([*args, f"--reward_url={url}"]) == 3
        server.script = ["ok"]
        assert main(["--resume", str(run_dir), f"--reward_url={url}"]) == 0  # config.json read back, sent to W&B
        wandb_home.teardown()  # W&B's service process writes the offline log: wait for it
        assert_no_secret(capsys.readouterr().err, tmp_path)
        assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step-2"
        assert len(list((run_dir / "wandb").rglob("*.wandb"))) == 2 and list((run_dir / "tensorboard").iterdir())
        if name in PASSWORDS:  # the server got the credential (percent-decoded): the run used it, never wrote it
            basic = base64.b64encode(f"trainer:{urllib.parse.unquote(PASSWORDS[name])}".encode()).decode()
            assert {h["authorization"] for h in server.headers} == {f"Basic {basic}"}
    finally:
        server.close()


def test_a_reward_function_s_error_and_error_log_hold_no_secret(tmp_path, capsys):
    reward = tmp_path / "reward.py"
    reward.write_text("def score(prompts, responses):\n"
                      "    raise ConnectionError('no answer from http://svc:Alpha7Bravo9@10.0.0.9/v1?token=Bravo9x')\n")
    run_dir = tmp_path / "run"
    assert main([*TINY[:-2], f"--reward_fn={reward}:score", f"--out={run_dir}"]) == 2
    err = capsys.readouterr().err
    assert "http://***:***@10.0.0.9/v1?token=***" in err and (run_dir / "error.log").exists(), err
    assert_no_secret(err, run_dir)


def test_an_unforeseen_traceback_is_redacted(monkeypatch):
    remember_secrets(["--reward_url=http://u:Alpha7 Bravo9@h/"])
    stderr = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stderr)
    try:
        raise RuntimeError("bug while posting to http://u:Alpha7 Bravo9@h/")
    except RuntimeError:
        redacted_excepthook(*sys.exc_info())
    assert stderr.getvalue().startswith("Traceback (most recent call last):\n")
    assert stderr.getvalue().endswith("RuntimeError: bug while posting to http://***:***@h/\n")
    assert_no_secret(stderr.getvalue())
