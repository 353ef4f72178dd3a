"""certckpt.integrations: Lightning, the Hugging Face Trainer, Accelerate, DeepSpeed."""
