"""Without a GPU, run the Triton kernels through Triton's CPU interpreter (must be set before triton is imported)."""
import os

# Before torch initialises CUDA: tests turn on deterministic algorithms (`poisoned_empty`), under which every
# cuBLAS call raises unless this is set; cuBLAS reads it once, at its first call in the process.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import pytest  # noqa: E402
import torch  # noqa: E402

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
    """Make every torch.empty NaN-filled (ints: max value), so an output element never written shows up."""
    deterministic = torch.are_deterministic_algorithms_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    assert torch.empty(8).isnan().all()
    yield
    torch.use_deterministic_algorithms(deterministic)
    torch.utils.deterministic.fill_uninitialized_memory = fill
