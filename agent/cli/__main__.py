"""``python -m agent.cli``."""

from agent.cli import main

main()
