"""Credentials in a reward URL (issue 38, item 6): a run directory, its command line and a tracker's config keep every
URL with its credentials replaced by ***; a resume asks for the URL again instead of reading a secret from the run
directory (one line, exit 2), and with the URL given again it continues."""
import json
import os

from test_remote_reward import SMALL, ScriptedServer, ppo_train

from ppo_core.rewards.redact import redact as redact_secrets
from ppo_core.run.tracking import public_config


def test_redact_secrets_hand_worked():
    url = "http://alice:hunter2@rm.example:8000/score?api_key=K1&batch=4&token=T2#frag"
    assert redact_secrets(url) == "http://***:***@rm.example:8000/score?api_key=***&batch=4&token=***#frag"
    assert redact_secrets(f"--reward_url={url}") == "--reward_url=" + redact_secrets(url)
    assert redact_secrets(["http://h:1/s", "plain text", 3, None]) == ["http://h:1/s", "plain text", 3, None]
    assert redact_secrets({"reward_url": ["https://h/s?Secret=x&password=y&n=1"]}) == {
        "reward_url": ["https://h/s?Secret=***&password=***&n=1"]}


def test_public_config_drops_secret_keys_and_redacts_urls():
    config = {"lr": 1e-5, "wandb_api_key": "abc", "reward_url": ["http://u:p@h:1/s?key=zzz"], "task": "reverse"}
    assert public_config(config) == {"lr": 1e-5, "reward_url": ["http://***:***@h:1/s?key=***"], "task": "reverse"}


def test_no_secret_in_the_run_directory_and_resume_asks_for_the_url_again(tmp_path):
    server = ScriptedServer(["ok", "ok", "ok", "sleep"])  # the 4th request (iteration 2's) times out: exit 3
    try:
        port = server.url.rsplit(":", 1)[1]
        url = f"http://trainer:PASS-7f3a@127.0.0.1:{port}/score?api_key=KEY-91bc&batch=1"
        run = tmp_path / "run"
        proc = ppo_train(*SMALL, "--iterations=2", "--save_every=1", "--reward_timeout_s=0.5", "--reward_retries=0",
                         f"--out={run}", f"--reward_url={url}", cwd=tmp_path)
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 3, err
        for secret in ("PASS-7f3a", "KEY-91bc"):  # the credential reached no file of the run, nor the output
            assert secret not in out + err
            for root, _, files in os.walk(run):
                for name in files:
                    with open(os.path.join(root, name), "rb") as f:
                        assert secret.encode() not in f.read(), os.path.join(root, name)
        saved = json.loads((run / "config.json").read_text())
        redacted = f"http://***:***@127.0.0.1:{port}/score?api_key=***&batch=1"
        assert saved["config"]["reward_url"] == [redacted] and saved["command"][-1] == f"--reward_url={redacted}"
        assert f"reward server {redacted} unreachable" in err

        # without the URL, one line and exit 2; with it, the run goes on from its checkpoint of iteration 1
        server.script = ["ok"]
        proc = ppo_train("--resume", str(run), cwd=tmp_path)
        err = proc.communicate(timeout=300)[1]
        assert proc.returncode == 2 and err == (
            f"ppo-train: error: --resume: {run}/config.json keeps reward_url without its credential ({redacted}); "
            f"give the URL again: --resume {run} --reward_url URL\n"), err
        proc = ppo_train("--resume", str(run), f"--reward_url={url}", cwd=tmp_path)
        err = proc.communicate(timeout=300)[1]
        assert proc.returncode == 0, err
        assert (run / "checkpoints" / "latest").read_text().strip() == "step-2"
        assert all(headers.get("authorization") == "Basic dHJhaW5lcjpQQVNTLTdmM2E=" for headers in server.headers)
    finally:
        server.close()
