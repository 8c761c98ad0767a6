"""Suite-wide settings.

The suite runs on two pytest-xdist workers (``-n 2`` in pyproject.toml), test by test, except
that each file of :data:`WHOLE_FILES` goes to one worker as a unit, before the rest; then the
tests marked ``slow``, so that the last ones are short and the workers finish together.
(``--dist loadgroup`` would say the same with marks, but pytest >= 9.2 drops the group that
pytest-xdist 3.8 appends to the node ids, silently.) Each worker takes an equal share of the
cores as torch intra-op threads (one on 2 cores): the tensors here are tiny, and on a loaded
machine a descheduled OpenMP thread stalls every op (two files took 98 s on two threads, 26 s
on one, the machine shared). Without xdist (``-n 0``) torch keeps its default.
"""

import gc
import os

import pytest
from hypothesis import settings

# torch is imported where it is used: the xdist controller, which runs no test, then starts
# its workers ~2 s sooner.

settings.register_profile("ci", max_examples=25, deadline=None, derandomize=True)
settings.register_profile("dev", max_examples=10, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


#: Files whose tests share a costly module fixture (computed once per worker that runs any of
#: them): the distributed runs (dense: eight processes; expert stacks: 2, 4 and 2 processes)
#: and the ahead-of-time compilation of every kernel.
WHOLE_FILES = ("tests/test_distributed.py", "tests/test_distributed_experts.py",
               "tests/test_ops_aot.py")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "load":
        return None  # another --dist: pytest-xdist's own
    from xdist.scheduler import LoadScopeScheduling

    class WholeFilesFirst(LoadScopeScheduling):
        """A unit per test, or per file of WHOLE_FILES; units of more tests go first."""

        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return path if path in WHOLE_FILES else nodeid

    return WholeFilesFirst(config, log)


def pytest_collection_modifyitems(config, items):
    if _worker_threads() is not None:  # every worker collects the same order
        items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def _worker_threads() -> int | None:
    """Intra-op threads for an xdist worker, ``None`` outside one."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers is None:
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // int(workers))


def pytest_configure(config):
    # Python's full (oldest-generation) collections: at most one per 100 middle-generation
    # passes instead of 10. A worker's heap is large (torch, transformers, compiled graphs):
    # each full pass took 0.2 to 0.35 s, dozens a run; young cycles go as often as before.
    gc.set_threshold(*gc.get_threshold()[:2], 100)
    capability = os.environ.get("ATEN_CPU_CAPABILITY")
    if capability and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        # torch 2.13's inductor cache does not key its entries on the capability: code built
        # for the machine's own vector width, run under another, computes garbage. A cache of
        # its own per capability (inherited by the processes the tests start).
        import getpass
        import tempfile

        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(
            tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}_{capability}")
    threads = _worker_threads()
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
        # processes a test starts (examples, benchmarks) inherit the share
        os.environ["OMP_NUM_THREADS"] = str(threads)


def pytest_collection_finish(session):
    # What collecting made (the imported packages and test modules: most of a worker's
    # objects) lives to the end: frozen, full collections no longer visit it.
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True)
def _seed_everything():
    import torch

    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _threads_restored():
    """In a worker, a test that changes torch's thread count gives the share back: the next
    test there must not inherit it."""
    yield
    threads = _worker_threads()
    if threads is not None:
        import torch

        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
