"""compose: the configuration from conf/ and the command line, as the schema dataclasses.
May import no other stage (only the shared modules: dtk.common.errors, dtk.common.resources); the only place besides
the CLIs that touches Hydra."""
