"""alignlit: composable PyTorch Lightning modules for aligning language models with human feedback."""

__version__ = "0.1.0"
