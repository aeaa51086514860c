import pytest
import torch

torch.set_num_threads(1)  # small models: a second thread costs more than it gives on CI's 2 cores


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
