"""Kernel sets per hardware plus the reference torch ops. Imports nothing of ours.

`backends.registry.get_backend(name)` returns a `Backend` whose `ops` object provides every
operation the model needs (`backends.reference.ReferenceOps` defines them). The `reference` backend is pure torch and
is the oracle every fast kernel is tested against.
"""
