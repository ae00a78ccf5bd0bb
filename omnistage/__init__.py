"""omnistage: serve multi-stage, multi-modal model pipelines across hosts."""

__version__ = "0.1.0"
