"""Evaluation: validation during training, a trained policy for inference, open-loop `loongforge eval`."""
