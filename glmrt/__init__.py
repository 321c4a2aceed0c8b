"""glmrt: a serving runtime for the GLM-5.3-Flash model family."""

__version__ = "0.1.0"
