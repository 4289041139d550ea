"""Layer 2, the model: Cauchy math, heads, the fused loss, families, decoding, intervals."""
