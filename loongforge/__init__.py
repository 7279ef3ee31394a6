"""LoongForge: fast training of multimodal embodied-AI models."""

__version__ = "0.1.0"
