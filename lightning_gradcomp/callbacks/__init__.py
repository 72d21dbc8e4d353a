"""Diagnostics that read the hook's per-step statistics (compression monitor, histograms, bound checks)."""
