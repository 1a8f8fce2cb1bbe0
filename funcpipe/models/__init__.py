"""Models written as pure stage functions (the demo's GPT)."""

from funcpipe.models import gpt

__all__ = ["gpt"]
