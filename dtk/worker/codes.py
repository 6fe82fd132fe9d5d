"""Worker exit codes the drivers act on (no torch here: drivers import it)."""

EXIT_CONFIG = 2
"""The worker found a configuration error (a UserError), or ran out of memory (a
configuration the device cannot hold: the line names the planned numbers and the overrides
that would fit); its `error:` line is in its log. Starting it again cannot help: the driver
fails the job at once."""

EXIT_STOPPED = 3
"""The worker saved a committed checkpoint and stopped on a signal; the driver decides what follows."""
