"""Command-line entry points: glmrt make-checkpoint, up, bench, ..."""
