"""Placeholder: filled in by its op family."""
__all__: list[str] = []
