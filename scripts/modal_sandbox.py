"""The sandbox's modal backend: `ppo_core.rewards.sandbox.run_code(code, backend="modal")` runs the program here, in a Modal
Sandbox with outbound network blocked (`block_network=True`, gVisor), a memory limit and a lifetime, with the program
and its files written in and both output streams read back with the local backend's bounds.

    pip install modal && modal token new        # once
    python -c "from ppo_core.rewards.sandbox import run_code; print(run_code('print(1)', backend='modal'))"

The library never imports modal (tests/test_modal_reward.py checks it); ppo_core.rewards.sandbox loads this file from the
repository when the modal backend is asked for. The pure parts it uses (the arguments of Sandbox.create and exec, the
command, the result) are ppo_core.rewards.sandbox's and are tested offline (tests/test_sandbox.py).
"""
import concurrent.futures
import functools
import os
import sys
import time

import modal

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from ppo_core.rewards.sandbox import (MAIN, MODAL_APP_NAME, MODAL_PYTHON_VERSION, MODAL_WORKDIR,  # noqa: E402
                              BoundedOutput, SandboxResult, drain_into, modal_command, modal_exec_args, modal_result,
                              modal_sandbox_args)


@functools.lru_cache(maxsize=None)
def _modal_app_and_image():
    app = modal.App.lookup(MODAL_APP_NAME, create_if_missing=True)
    return app, modal.Image.debian_slim(python_version=MODAL_PYTHON_VERSION)


def run(code: str, stdin: bytes, timeout_s: float, memory_mb: int, files: dict) -> SandboxResult:
    """ppo_core.rewards.sandbox.run_code(backend='modal'): the program in a Modal Sandbox, bounded as locally."""
    app, image = _modal_app_and_image()
    start = time.monotonic()
    sandbox = modal.Sandbox.create(app=app, image=image, **modal_sandbox_args(timeout_s, memory_mb))
    try:
        for name, content in {MAIN: code.encode(), **files}.items():
            sandbox.filesystem.write_bytes(content, f"{MODAL_WORKDIR}/{name}")
        process = sandbox.exec(*modal_command(), **modal_exec_args(timeout_s))
        process.stdin.write(stdin)
        process.stdin.write_eof()
        process.stdin.drain()
        stdout, stderr = BoundedOutput(), BoundedOutput()
        # both streams at once, as _communicate does locally: a program blocked on one unread stream never ends
        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as reader:
            stderr_capped = reader.submit(drain_into, process.stderr, stderr)
            capped = drain_into(process.stdout, stdout)
            if capped:
                sandbox.terminate()  # ends the program and with it the stderr stream
            capped = stderr_capped.result() or capped
        returncode = None if capped else process.wait()
    finally:
        sandbox.terminate()  # a no-op where it already ended
    return modal_result(returncode, stdout, stderr, time.monotonic() - start, capped)
