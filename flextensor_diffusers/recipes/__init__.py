"""Runnable recipes: load CPU-first, enable offload, profile once, generate, write an mp4, report."""
