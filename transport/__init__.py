"""glmrt transport package (see docs/ARCHITECTURE.md)."""
