import os
import shutil
import sys

import pytest
from hypothesis import HealthCheck, settings

# Numba-CUDA kernels (stochattn/cuda/kmeans.py) run under Numba's CUDA simulator on machines
# without an NVIDIA GPU. The variable must be set before Numba is first imported, hence here,
# at import time; on a GPU machine (or when the caller chose) it is left alone.
if ("NUMBA_ENABLE_CUDASIM" not in os.environ and shutil.which("nvidia-smi") is None
        and not os.path.exists("/dev/nvidia0")):
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
    # The simulator runs each CUDA thread as a Python thread while the launching thread polls
    # them in a busy loop; at the default 5 ms GIL switch interval every hand-over waits out
    # that spin. 0.5 ms halves the CPU time of the simulator tests (same kernels, same checks).
    sys.setswitchinterval(5e-4)

# Two profiles: "ci" (the default) draws fresh examples with no deadline; "derandomized"
# replays the same examples every run (set HYPOTHESIS_PROFILE=derandomized).
# No example database: a statistical test fails at its stated rate by design, and a saved
# failing example would be replayed by every later run (a false failure made permanent);
# print_blob=True prints what reproduces a failure instead.
settings.register_profile(
    "ci", deadline=None, max_examples=25, print_blob=True, database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("derandomized", parent=settings.get_profile("ci"), derandomize=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def _has_gpu() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if any("gpu" in item.keywords for item in items) and not _has_gpu():
        skip = pytest.mark.skip(reason="needs a CUDA GPU with CuPy")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


# Real SmolLM2 decode instances (hamlet, 512 tokens, 40 positions) for the budget tests
# (tests/test_budgets_real.py, tests/test_budget_norms.py): dumped once per session. Only the
# modules that skip without the `eval` extra and the GGUF request them.
@pytest.fixture(scope="session")
def hamlet_traces():
    from stochattn.eval.budget_traces import dump_traces, spread_positions

    return dump_traces("hamlet", 512, spread_positions(512, 40, first=64))


@pytest.fixture(scope="session")
def hamlet_layers(hamlet_traces):
    from stochattn.eval import budget_study as bs

    return [bs.prepare(*hamlet_traces.layer_call(l)) for l in range(hamlet_traces.n_layers)]
