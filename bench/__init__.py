"""GPU and kernel benchmark scripts; results in bench/RESULTS.md."""
