"""mixprec.parallel (see its issue)."""

__all__ = []
