"""mixprec.normalization (see its issue)."""

__all__ = []
