"""mixprec.bench: the ``mixprec bench`` command and the measurements behind it.

* :mod:`mixprec.bench.models` -- the small CNN with BatchNorm, the GPT-style model, ResNet-50
  (torchvision) and their synthetic workloads.
* :mod:`mixprec.bench.runner` -- runs one recipe (fp32, amp O0-O3, torch autocast, pure half)
  and measures step time, peak memory, losses and skipped steps.
* :mod:`mixprec.bench.report` -- the table, JSON, CSV and PNG plot.
* :mod:`mixprec.bench.cli` -- the command line (``mixprec bench``).

tqdm and matplotlib (the ``bench`` extra) are imported only when the progress bar or the plot
is used.
"""

from mixprec.bench.models import GPT, GPTConfig, SmallCNN, Workload, build_workload, gpt_config
from mixprec.bench.runner import MODES, ModeResult, run_mode, run_modes

__all__ = [
    "GPT",
    "GPTConfig",
    "MODES",
    "ModeResult",
    "SmallCNN",
    "Workload",
    "build_workload",
    "gpt_config",
    "run_mode",
    "run_modes",
]
