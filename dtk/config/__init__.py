"""compose: the configuration from conf/ and the command line, as the schema dataclasses.
Imports no other dtk stage (only dtk.errors, dtk.resources); the only place besides the CLIs that touches Hydra."""
