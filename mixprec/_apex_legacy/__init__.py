"""Modules that only the Apex alias serves: Apex's ``apex.fp16_utils`` (removed from Apex with
``apex.amp``), ``apex.multi_tensor_apply``, and ``apex.optimizers`` (mixprec's ``FusedAdam``,
``FusedSGD`` as PyTorch's SGD, stand-ins for Apex's other optimizers), so the import blocks of Apex-era scripts (Apex's
own ImageNet example among them) still import. See :func:`mixprec.install_apex_alias`."""
