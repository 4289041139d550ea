"""`python -m causal_adapter <command>`: the console entry point `causal-adapter`."""
from causal_adapter.commands.main import run_and_exit

run_and_exit()
