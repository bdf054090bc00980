"""User entry points: the offline ``LLM`` and the command line."""
