import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; run on the GPU host (README: GPU tests)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
