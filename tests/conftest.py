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


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    """The train scripts' main() sets the torch thread count (utils.launch.set_cpu_threads); keep that
    inside the test that called it, so each test module's own choice holds for its other tests."""
    import torch

    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)
