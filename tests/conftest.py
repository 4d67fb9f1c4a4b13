"""Shared fixtures. Tests run on 1 torch thread so results are deterministic and cores are shared."""

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def shakespeare_records():
    from dpfleet.edge.datasets import load_records

    return load_records("shakespeare")
