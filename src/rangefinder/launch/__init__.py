"""Launchers: how a training step's run starts on its node's accelerators (processes.py: one process, or PyTorch's
torchrun on one node) or on several nodes (trainjob.py: a Kubeflow Trainer v2 TrainJob).

A layer of its own between the steps, which call `run_training`, and the engine it launches (training/); the
pipelines read its thread setting.
"""
