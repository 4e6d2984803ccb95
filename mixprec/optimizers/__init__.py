"""mixprec.optimizers: Apex's ``FusedAdam``, one Triton pass per step that also writes amp
O2's half model.

Example::

    >>> from mixprec.optimizers import FusedAdam
    >>> optimizer = FusedAdam(model.parameters(), lr=3e-4, weight_decay=0.1)  # AdamW
"""

from mixprec.optimizers.fused_adam import FusedAdam

__all__ = ["FusedAdam"]
