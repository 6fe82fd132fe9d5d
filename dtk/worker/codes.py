"""Worker exit codes the drivers act on (no torch here: drivers import it)."""

EXIT_CONFIG = 2
"""The worker found a configuration error (a UserError: its `error:` line is in its log).
Starting it again cannot help: the driver fails the job at once."""

EXIT_STOPPED = 3
"""The worker saved a committed checkpoint and stopped on a signal; the driver decides what follows."""
