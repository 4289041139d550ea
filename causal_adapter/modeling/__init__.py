"""Layer 2, the model's math: Cauchy math, heads, the fused loss, families, decoding, intervals."""
