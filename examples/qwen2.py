"""Train a Qwen2-shaped language model: ``examples/lm.py`` (every decoder family and preset) under
the name of its first family; ``--help`` for every flag.

    python examples/qwen2.py --steps 40
    torchrun --nproc-per-node 2 examples/qwen2.py --schedule braided_v --pp 2
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lm  # noqa: E402
from train_loop import main  # noqa: E402

TASK = replace(lm.TASK, prog="qwen2.py")

if __name__ == "__main__":
    sys.exit(main(TASK))
