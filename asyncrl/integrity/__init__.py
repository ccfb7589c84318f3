"""The integrity guard (docs/integrity.md): the promises a run checks about what it trains."""

from asyncrl.integrity.guard import IntegrityGuard

__all__ = ["IntegrityGuard"]
