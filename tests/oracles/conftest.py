"""Oracle fixtures: one thread, as in the engine tests (a busy neighbour stalls two)."""

import torch

torch.set_num_threads(1)
