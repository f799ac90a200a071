"""Datasets: the folder contract, image loading, the validation pass, synthetic data and the deterministic split."""
