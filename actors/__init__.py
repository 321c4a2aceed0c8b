"""glmrt actors package (see docs/ARCHITECTURE.md)."""
