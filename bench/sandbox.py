"""What the sandbox costs a tool call: the wall time of a local run_code("print(1)") against the same interpreter run
bare, medians of 20 calls after 2 warm-up calls (the goal: under 100 ms of overhead).

    python bench/sandbox.py              # 20 calls each
    python bench/sandbox.py --calls 100

"bare" is `python3 -I -S -u -c "print(1)"` through subprocess.run, with the interpreter the sandbox uses: the cost
of starting Python, which no sandbox can avoid. "run_code" adds the namespaces (unshare), the setup interpreter
that makes the mounts read-only and drops privileges (ppo_core.rewards.sandbox._sandbox_init), and the bounded reading of
the output. Calls run one after the other; a SandboxPool runs them side by side.
"""
import argparse
import datetime
import statistics
import subprocess
import time

from ppo_core.rewards import sandbox


def cpu_name() -> str:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown CPU"


def median_ms(call, calls: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        call()
    walls = []
    for _ in range(calls):
        start = time.perf_counter()
        call()
        walls.append(time.perf_counter() - start)
    return 1000 * statistics.median(walls)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20, help="timed calls of each kind (after 2 warm-up calls)")
    args = parser.parse_args()

    print(f"isolation: {sandbox.NETWORK_ISOLATION}")
    python = sandbox.interpreter()
    assert python is not None, "no sandbox on this machine"

    def sandboxed():
        result = sandbox.run_code("print(1)")
        assert result.ok and result.stdout == "1\n", result

    def bare():
        completed = subprocess.run([python, "-I", "-S", "-u", "-c", "print(1)"], capture_output=True)
        assert completed.returncode == 0 and completed.stdout == b"1\n"

    run_code_ms = median_ms(sandboxed, args.calls)
    bare_ms = median_ms(bare, args.calls)
    overhead_ms = run_code_ms - bare_ms
    print("| date       | CPU                  | run_code('print(1)') | bare python | overhead | goal: < 100 ms |")
    print(f"| {datetime.date.today()} | {cpu_name()[:20]:<20} | {run_code_ms:17.1f} ms | {bare_ms:8.1f} ms "
          f"| {overhead_ms:5.1f} ms | {'met' if overhead_ms < 100 else 'MISSED':<14} |")

if __name__ == "__main__":
    main()
