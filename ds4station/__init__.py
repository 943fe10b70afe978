"""ds4station: run DeepSeek-V4-Flash on your own multi-GPU workstation."""

__version__ = "0.1.0"
