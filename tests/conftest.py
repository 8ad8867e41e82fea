"""Without a GPU, run the Triton kernels through Triton's CPU interpreter (must be set before triton is imported)."""
import os

# Before torch initialises CUDA: tests turn on deterministic algorithms (`poisoned_empty`), under which every
# cuBLAS call raises unless this is set; cuBLAS reads it once, at its first call in the process.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import pytest  # noqa: E402
import torch  # noqa: E402

import background  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Every test runs single-threaded: its models and kernels are tiny, and on 2 shared cores a second
    thread only adds OpenMP synchronisation (the default job runs with threads=1 as well)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def poisoned_empty():
    """Make every torch.empty NaN-filled (ints: max value), so an output element never written shows up.

    This is where the tests turn torch's deterministic mode on (its fill_uninitialized_memory is the poison), and
    only here: for the kernel tests that take this fixture (test_kernels_logprobs / _linear / _loss and test_cispo).
    Neither ppo_core's trainer nor any other test turns it on. While it is on, those tests dispatch (recorded on
    the CPU, 2026-12-04) elementwise ops, reductions, softmax / log_softmax and their backward, mm / addmm / bmm,
    gather, index_select, index_copy_, index_put_, scatter_add (gather's backward), nonzero, randn / randint /
    rand, and on CUDA the Triton kernels and the backward's `addmm` / `mm` with out_dtype=float32. None of them is
    among the ops torch.use_deterministic_algorithms documents as raising on CUDA; scatter_add, index_copy_ and
    index_put_ are among those it switches to a deterministic implementation there. ppo_core.generate's sampling
    uses a CUDA float cumsum, which that docstring (torch 2.11 and 2.13) lists as raising; torch 2.11's CUDA
    library has no such alert left and scans deterministically (the docstring was corrected upstream later).
    bench/gpu_first_checks.py runs the sampling and a whole generate call under deterministic mode on the GPU."""
    deterministic = torch.are_deterministic_algorithms_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    assert torch.empty(8).isnan().all()
    yield
    torch.use_deterministic_algorithms(deterministic)
    torch.utils.deterministic.fill_uninitialized_memory = fill


def pytest_collection_modifyitems(session, config, items):
    """Start the long runs that the selected tests' fixtures read, on the background lane (tests/background.py)."""
    starters = {}
    for item in items:
        for fixture, starter in getattr(getattr(item, "module", None), "BACKGROUND", {}).items():
            if fixture in getattr(item, "fixturenames", ()):
                starters[starter] = None
    for starter in starters:
        starter()


def pytest_sessionfinish(session, exitstatus):
    background.stop()
