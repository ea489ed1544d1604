"""Public name of the torch client: ``import kvfs.torch`` is kvfs/client/torch.py itself."""
import sys

from kvfs.client import torch as _client

sys.modules[__name__] = _client
