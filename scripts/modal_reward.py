"""Serve a reward source on its own Modal GPU: `ppo-serve-reward` as a deployed Modal web server. Nothing else.

    pip install -e ".[modal]" && modal setup                                     # once: the client and a token
    modal volume put ppo-core ./Skywork-Reward-V2-Qwen3-8B /models/Skywork-Reward-V2-Qwen3-8B   # weights (once)
    PPO_MODAL_REWARD_ARGS="--reward_model /vol/models/Skywork-Reward-V2-Qwen3-8B" \\
        modal deploy scripts/modal_reward.py                                     # A100-80GB, 0 to 4 containers
    PPO_MODAL_REWARD_GPU=L4 PPO_MODAL_REWARD_APP=ppo-core-judge \\
        PPO_MODAL_REWARD_ARGS="--judge /vol/models/CE-RM-4B" modal deploy scripts/modal_reward.py   # a 4B judge
    modal app stop ppo-core-reward                                               # when the runs are done

The URL: `modal deploy` prints it (https://<workspace>--ppo-core-reward-serve.modal.run, with the app's name in
the middle), and so does
    python -c "import modal; print(modal.Function.from_name('ppo-core-reward', 'serve').get_web_url())"
Hand it to the trainer as any reward server's URL, e.g. from scripts/modal_train.py:
    URL=https://<workspace>--ppo-core-reward-serve.modal.run
    curl -H "Authorization: Bearer $PPO_REWARD_API_KEY" $URL/health             # up? (a cold start first)
    modal run scripts/modal_train.py --policy /vol/models/Qwen3-4B --reward_url $URL
The trainer splits each batch into one request per URL it is given; the same URL listed N times
(`--reward_url URL,URL,URL,URL`) sends N requests at once, which Modal spreads over up to
PPO_MODAL_REWARD_MAX_CONTAINERS containers. Modal answers a request that takes over 150 s with a redirect to wait
on, which the trainer does not follow (a redirect could carry its credentials elsewhere: it stops with one line naming
it), so keep one request (batch / N samples) well under that, and under the trainer's per-request timeout.

The key: the URL is public, and anyone who has it could score on your GPU. Put PPO_REWARD_API_KEY (any long random
string, e.g. `python -c "import secrets; print(secrets.token_urlsafe(32))"`) in the Modal Secret named by
PPO_MODAL_SECRET: the server in each container reads it from its environment and answers 401 to a request without it,
and ppo-train (scripts/modal_train.py, with the same Secret, or your shell's environment) sends it. Without one, the
server's log says so on every start. A Modal proxy auth token (PPO_MODAL_REWARD_PROXY_AUTH) can stand in front of it.

Every container runs `python -m ppo_core.rewards.server --host 0.0.0.0 --port 8000 <PPO_MODAL_REWARD_ARGS>`: the
options are ppo-serve-reward's, the same keys as ppo-train's reward options (--reward_model, --reward_fn, --task,
--judge, ...), with paths inside the container (the Volume at /vol, read-only; this repository's configs/ at
/root/src/configs). A server that rejects its arguments stops the container at once with its one-line error in
the log (`modal app logs ppo-core-reward`), rather than after the startup timeout.

Why environment variables and not flags: Modal reads `@app.function(gpu=..., min_containers=...)` when this file
is imported, locally at `modal deploy` and again in each container, before any argument could be parsed. So:
    PPO_MODAL_REWARD_GPU             one GPU per container, default A100-80GB (an 8B reward model or judge in bf16
                                     with room for batches); L4 (24 GB) fits a 4B judge, L40S, H100 more
    PPO_MODAL_REWARD_ARGS            ppo-serve-reward's options, one string (split as a shell would), default
                                     none (the server's defaults); --host and --port are set here
    PPO_MODAL_REWARD_MIN_CONTAINERS  containers kept warm even when idle (default 0: scale to zero, and the first
                                     request after a pause waits for a cold start, weights included)
    PPO_MODAL_REWARD_MAX_CONTAINERS  at most this many containers (default 4)
    PPO_MODAL_REWARD_CONCURRENCY     requests one container takes at a time before Modal starts another (default
                                     8; the server batches what arrives together)
    PPO_MODAL_REWARD_SCALEDOWN_S     seconds an idle container stays up (default 600: longer than a PPO
                                     iteration's training phase usually is, so it stays warm between rollouts)
    PPO_MODAL_REWARD_APP             the Modal app's name (default ppo-core-reward); one name per deployed server
    PPO_MODAL_REWARD_PROXY_AUTH      1: the URL requires Modal-Key / Modal-Secret headers (a Modal proxy auth
                                     token); default 0, an open URL: anyone who has it can score on your GPU.
                                     The trainer sends them when PPO_REWARD_PROXY_KEY and PPO_REWARD_PROXY_SECRET
                                     are set (on Modal: put both in the Secret named by PPO_MODAL_SECRET)
    PPO_MODAL_VOLUME, PPO_MODAL_SECRET   as in scripts/modal_train.py: the Volume with the weights (default
                                     ppo-core) and an optional Modal Secret exposed as environment variables
                                     (PPO_REWARD_API_KEY in it: the server's key, see above)
The image sets them in the container too, so that both sides build the same function.

`modal` is an optional extra: the library never imports it, and the pure functions here (`gpu_spec`,
`reward_args`, `server_command`, `start_server`) import and run without it.
"""
import os
import re
import shlex
import socket
import subprocess
import sys
import time

try:
    import modal
except ModuleNotFoundError:  # the pure functions below stay importable and testable without Modal
    modal = None

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import modal_common  # noqa: E402  (scripts/modal_common.py: the same image as scripts/modal_train.py, built once)
from modal_common import VOLUME_PATH  # noqa: E402

PORT = 8000
STARTUP_TIMEOUT_S = 15 * 60  # a cold start: CUDA, then the weights from the Volume (16 GB for an 8B model in bf16)


# ---------------------------------------------------------------------------- pure functions

def env_int(name, default, minimum) -> int:
    """The integer environment variable `name` (default if unset), at least `minimum`; ValueError naming it."""
    text = os.environ.get(name, str(default))
    if not re.fullmatch(r"\d+", text.strip()) or int(text) < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {text!r}")
    return int(text)


def gpu_spec(spec: str) -> str:
    """A Modal GPU type for one GPU: "A100-80GB", "L4", "H100:1" -> the spec; else ValueError. One GPU, because
    the server scores on one device: more containers, not more GPUs per container, scale it."""
    match = re.fullmatch(r"([A-Za-z0-9-]+!?)(?::(\d+))?", spec)
    if not match or match.group(2) not in (None, "1"):
        raise ValueError(f"PPO_MODAL_REWARD_GPU must be one GPU type such as A100-80GB, L4 or H100, got {spec!r}")
    return spec


def reward_args(text: str) -> list[str]:
    """PPO_MODAL_REWARD_ARGS split as a shell would; --host and --port are this script's to set, and the key comes
    from the Secret, never from here."""
    try:
        args = shlex.split(text)
    except ValueError as e:
        raise ValueError(f"PPO_MODAL_REWARD_ARGS: {e} in {text!r}") from None
    for arg in args:
        if re.fullmatch(r"--api[_-]key(=.*)?", arg):  # the image's environment, and so Modal's dashboard, would show it
            raise ValueError("PPO_MODAL_REWARD_ARGS: --api_key would be written into the image; put "
                             "PPO_REWARD_API_KEY in the Modal Secret named by PPO_MODAL_SECRET instead")
        if re.fullmatch(r"--(host|port)(=.*)?", arg):
            raise ValueError(f"PPO_MODAL_REWARD_ARGS: {arg.split('=')[0]} is set by scripts/modal_reward.py "
                             f"(0.0.0.0:{PORT}); leave it out")
    return args


def server_command(args, port=PORT) -> list[str]:
    """The reward server's command line in a container: the normal entry point, listening on every interface
    (Modal connects to the container's external address, not to 127.0.0.1)."""
    return ["python", "-m", "ppo_core.rewards.server", "--host", "0.0.0.0", "--port", str(port), *args]


def start_server(argv, port, timeout_s) -> subprocess.Popen:
    """Start the server and return its process once it accepts connections on `port`. Raises RuntimeError at
    once if it exits first (bad arguments: exit status 2, its one-line error in the log above), TimeoutError
    (after stopping it) if it is not listening within timeout_s."""
    process = subprocess.Popen(argv)
    deadline = time.monotonic() + timeout_s
    while True:
        status = process.poll()
        if status is not None:
            raise RuntimeError(f"the reward server exited with status {status} before listening on port {port}: "
                               f"{shlex.join(argv)}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1.0).close()
            return process
        except OSError:
            if time.monotonic() > deadline:
                process.kill()
                process.wait()
                raise TimeoutError(f"the reward server was not listening on port {port} after {timeout_s} s: "
                                   f"{shlex.join(argv)}") from None
            time.sleep(0.2)


# ---------------------------------------------------------------------------- the settings (read at import)

GPU = gpu_spec(os.environ.get("PPO_MODAL_REWARD_GPU", "A100-80GB"))
REWARD_ARGS = reward_args(os.environ.get("PPO_MODAL_REWARD_ARGS", ""))
MIN_CONTAINERS = env_int("PPO_MODAL_REWARD_MIN_CONTAINERS", 0, minimum=0)
MAX_CONTAINERS = env_int("PPO_MODAL_REWARD_MAX_CONTAINERS", 4, minimum=1)
CONCURRENCY = env_int("PPO_MODAL_REWARD_CONCURRENCY", 8, minimum=1)
SCALEDOWN_S = env_int("PPO_MODAL_REWARD_SCALEDOWN_S", 600, minimum=2)  # Modal's least scaledown_window is 2 s
PROXY_AUTH = env_int("PPO_MODAL_REWARD_PROXY_AUTH", 0, minimum=0) > 0
APP_NAME = os.environ.get("PPO_MODAL_REWARD_APP", "ppo-core-reward")
VOLUME_NAME = os.environ.get("PPO_MODAL_VOLUME", "ppo-core")
SECRET_NAME = os.environ.get("PPO_MODAL_SECRET", "")
if MIN_CONTAINERS > MAX_CONTAINERS:
    raise ValueError(f"PPO_MODAL_REWARD_MIN_CONTAINERS={MIN_CONTAINERS} is more than "
                     f"PPO_MODAL_REWARD_MAX_CONTAINERS={MAX_CONTAINERS}")


# ---------------------------------------------------------------------------- the Modal App (needs modal)

if modal is not None:
    app = modal.App(APP_NAME)
    # the same settings in the container, so that its import builds the same function
    image = modal_common.image({
        "PPO_MODAL_REWARD_GPU": GPU, "PPO_MODAL_REWARD_ARGS": shlex.join(REWARD_ARGS),
        "PPO_MODAL_REWARD_MIN_CONTAINERS": str(MIN_CONTAINERS), "PPO_MODAL_REWARD_MAX_CONTAINERS": str(MAX_CONTAINERS),
        "PPO_MODAL_REWARD_CONCURRENCY": str(CONCURRENCY), "PPO_MODAL_REWARD_SCALEDOWN_S": str(SCALEDOWN_S),
        "PPO_MODAL_REWARD_PROXY_AUTH": str(int(PROXY_AUTH)), "PPO_MODAL_REWARD_APP": APP_NAME,
        "PPO_MODAL_VOLUME": VOLUME_NAME, "PPO_MODAL_SECRET": SECRET_NAME})
    # Read-only: the server only reads weights, and the same Volume holds the training runs and their checkpoints.
    # Not created here: a missing Volume would have no weights on it either.
    volume = modal_common.read_only(modal.Volume.from_name(VOLUME_NAME))

    def serve():
        """Runs once as each container starts: the server in the background; Modal then proxies the URL to it."""
        start_server(server_command(REWARD_ARGS), PORT, STARTUP_TIMEOUT_S)

    serve = app.function(
        image=image,
        gpu=GPU,
        volumes={VOLUME_PATH: volume},
        secrets=[modal.Secret.from_name(SECRET_NAME)] if SECRET_NAME else [],
        min_containers=MIN_CONTAINERS,
        max_containers=MAX_CONTAINERS,
        scaledown_window=SCALEDOWN_S,
        timeout=STARTUP_TIMEOUT_S,  # bounds the container's start (weights) and each request
    )(modal.concurrent(max_inputs=CONCURRENCY)(
        modal.web_server(PORT, startup_timeout=STARTUP_TIMEOUT_S, requires_proxy_auth=PROXY_AUTH)(serve)))
