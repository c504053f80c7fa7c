"""Placeholder, filled in below."""
def apply() -> bool:
    return False
