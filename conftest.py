"""Shared pytest setup: CPU-only, deterministic, quiet."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

try:
    from hypothesis import settings

    settings.register_profile("ci", max_examples=100, deadline=None, derandomize=True)
    settings.register_profile("long", max_examples=2000, deadline=None)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
except ImportError:  # hypothesis is a test extra
    pass
