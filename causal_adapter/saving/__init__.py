"""Layer 3, files and glue: adapter files, base checkpoints, peft / accelerate / Trainer glue (the public CausalModel is layer 4, `model`)."""
