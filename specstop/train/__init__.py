"""train: PyTorch Lightning training of stopping predictors (Lightning is imported only here)."""
