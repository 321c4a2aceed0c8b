"""Training the tiny-trained model: the synthetic corpus (arithmetic.py, corpus.py), its
tokenizer and batches (data.py), the differentiable batched ops that run glmrt's own model
modules (ops.py), the training loop (trainer.py) and what a run writes (output.py)."""
