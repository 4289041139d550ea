"""Where `CausalModel` lived before 0.2 (now `causal_adapter.model`): this path keeps working (CHANGELOG)."""
from ..model.causal_model import CausalModel, CausalOutput, get_causal_model  # noqa: F401
from ..model.checks import check_supported, check_unquantized_heads, resolve_num_token_id  # noqa: F401
