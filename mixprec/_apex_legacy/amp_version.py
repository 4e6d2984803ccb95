"""``apex.amp.__version__`` under the Apex alias: Apex's amp kept its version in a submodule of
that name, which Apex-era import blocks import (``from apex.amp import __version__``, inside a
``try`` whose ``except ImportError`` says to install Apex)."""

VERSION = (0, 1, 0)
__version__ = ".".join(map(str, VERSION))
