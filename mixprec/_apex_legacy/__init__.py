"""Modules that only the Apex alias serves: Apex's ``apex.fp16_utils`` (removed from Apex with
``apex.amp``), ``apex.multi_tensor_apply``, and ``apex.optimizers`` (mixprec's ``FusedAdam``,
``FusedSGD`` as PyTorch's SGD, stand-ins for Apex's other optimizers), so the import blocks
of Apex-era scripts (Apex's own ImageNet example among them) still import. See
:func:`mixprec.install_apex_alias`."""


class NotProvided:
    """A stand-in for an Apex class mixprec does not provide: it imports (so that a script's
    import block runs), and constructing it raises ``NotImplementedError`` saying what to use
    instead. Subclasses set ``_module`` (Apex's module), ``_what`` (a note after the name)
    and ``_use`` (the replacement)."""

    _module = ""
    _what = ""
    _use = ""

    def __init__(self, *args, **kwargs):
        raise NotImplementedError(
            f"apex.{self._module}.{type(self).__name__}{self._what} is not provided by "
            f"mixprec's Apex alias. {self._use}"
        )
