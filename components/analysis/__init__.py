"""Turning measured curves into decisions: LR bounds, the step window, their plots and reports.

numpy and matplotlib only (no torch), so every piece is fast to test on curves built from formulas.
"""
