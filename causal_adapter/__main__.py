"""`python -m causal_adapter <command>`: the console entry point `causal-adapter`."""
import sys

from causal_adapter.commands.main import main

sys.exit(main())
