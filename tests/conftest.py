"""One Ray cluster for the whole suite; `gpu` tests skip without CUDA."""

import pytest
import torch

import troupe


def pytest_collection_modifyitems(config, items):
    # Tests that start a Ray cluster of their own run first, before the shared one exists:
    # with two clusters on one machine, a job submitted to the second never finished.
    items.sort(key=lambda item: "own_cluster" not in item.keywords)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def cluster():
    """The embedded cluster, with more logical CPUs than cores so 4-rank groups fit."""
    info = troupe.init(num_cpus=16)
    yield info
    troupe.shutdown()
