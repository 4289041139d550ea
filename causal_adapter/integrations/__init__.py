"""Layer 8, other tools run on a causal adapter: lm-evaluation-harness's model ``causal_adapter``
(`lm_eval_harness`, the ``[eval]`` extra; docs/evaluate.md)."""
