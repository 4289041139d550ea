"""Layer 6, training: config, loop, checkpoints, value-head fitting, metrics, plots, evaluation."""
