"""Training and evaluation harness: the shared loss and the evaluation metrics."""
