import os

import pytest
import torch

# Tests run on two cores next to spawned ranks; more intra-op threads only add contention.
torch.set_num_threads(int(os.environ.get("GSPO_TEST_THREADS", "1")))


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs CUDA")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
