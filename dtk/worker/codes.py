"""Worker exit codes the drivers act on (no torch here: drivers import it)."""

EXIT_STOPPED = 3
"""The worker saved a committed checkpoint and stopped on a signal; the driver decides what follows."""
