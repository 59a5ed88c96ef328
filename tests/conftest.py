import os
import sys

# Nothing is downloaded in tests: every model is built locally from a config.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "disabled")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)


import pytest  # noqa: E402


def pytest_configure(config):
    """Under pytest-xdist (`make test-full`: `-n 2`), each worker runs on its own share of the cores, so the torch
    threads of one worker's tests and launches never contend with the other's: the scripts size their thread
    pools from the cores a process may run on (utils.core.launch.set_cpu_threads), and OpenMP's spinning threads
    slow down several times when two pools share a core."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if worker and count > 1 and hasattr(os, "sched_setaffinity"):
        cores = sorted(os.sched_getaffinity(0))
        if len(cores) >= count:
            os.sched_setaffinity(0, cores[int(worker.removeprefix("gw")) % count::count])


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    """The train scripts' main() sets the torch thread count (utils.core.launch.set_cpu_threads); keep that
    inside the test that called it, so each test module's own choice holds for its other tests."""
    import torch

    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


DISTRIBUTED_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def _keep_distributed_env():
    """The vLLM colocate path sets torch.distributed's variables for vLLM in its process, as a launcher would
    (utils.core.vllm_rollout); a test that runs it in this process must not leave the next test's Accelerator
    believing it was launched on several processes."""
    before = {k: os.environ.get(k) for k in DISTRIBUTED_ENV}
    yield
    for k, v in before.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="module")
def two_torch_threads():
    """Two torch threads for a whole module of model tests (`pytestmark = pytest.mark.usefixtures(...)`)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def distill_world(tmp_path_factory):
    """(questions.jsonl, its rows, a tiny reasoner that knows their chains by heart): tests/distill_helpers.py. The
    reasoner is trained once per version of the code that makes it, into the tiny cache (tiny/cache.py's `cached`),
    so the fast tier, the full tier and each pytest worker share it."""
    import train_sft
    from tests import distill_helpers
    from tests.distill_helpers import train_memorized_reasoner, write_questions
    from tests.launch_helpers import failing_fixture
    from tiny import cycle, models, shapes
    from tiny.cache import _source, cached
    from utils.core.checkpoint import latest_checkpoint

    folder = tmp_path_factory.mktemp("distill-world")
    with failing_fixture("the distill world (16 shapes questions, the tiny reasoner trained on their chains)"):
        path, rows = write_questions(str(folder))
        spec = {"code": _source(distill_helpers, train_sft, models, shapes, cycle),
                "rows": [[r["id"], r["question"], r["answer"]] for r in rows]}
        built = cached("test-distill-reasoner", spec, lambda out: train_memorized_reasoner(rows, out))
        return path, rows, latest_checkpoint(os.path.join(built, "train"))


@pytest.fixture(scope="session")
def reasoner_server(distill_world, tmp_path_factory):
    """`transformers serve` of that reasoner on 127.0.0.1, for the whole session."""
    from tests.launch_helpers import failing_fixture
    from utils.core.serving import LocalServer

    log = str(tmp_path_factory.mktemp("reasoner-server") / "server.log")
    with failing_fixture(f"`transformers serve` of the tiny reasoner (its log: {log})"):
        server = LocalServer(distill_world[2], device="cpu", log_path=log).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def family_models(tmp_path_factory):
    """family -> (model, processor) of a tiny family (tests/family_helpers.py), each built once per session."""
    from tests.family_helpers import build_family

    root = tmp_path_factory.mktemp("families")
    built = {}

    def get(family):
        if family not in built:
            built[family] = build_family(str(root / family), family)
        return built[family]

    return get
