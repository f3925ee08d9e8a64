"""Training: step accounting, bucket sampling and the accelerate training loop."""
