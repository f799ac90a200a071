"""Engine tests run torch on one thread: on a shared 2-core machine a second intra-op thread mostly spins waiting
for the other processes' cores (a tiny-model update measured 0.75 s on one thread, 12 s on two under load)."""

import pytest
import torch


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
